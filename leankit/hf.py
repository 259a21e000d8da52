"""Hugging Face glue: the ``"leankit"`` attention implementation and the step hooks.

:func:`enable` registers an attention function named ``"leankit"`` and switches the model to
it. When the K/V it receives come from a :class:`~leankit.cache.LeanCache` (tagged by
``LeanCache.update``), attention runs over the cache's pages; otherwise (no cache, or another
Cache class) it falls back to PyTorch SDPA with HF's regular causal/padding mask, so an enabled
model still works everywhere.

It also installs a forward pre-hook and a forward hook on the decoder stack. The pre-hook hands
the step's 2-D padding mask and positions to the LeanCache (``begin_step``), which is how pad
tokens are kept out of the pages; the hook closes the step (``end_step``). When the caller gives
no positions, the pre-hook supplies the model's own default: cache length + arange for
Llama-family models, the count of real tokens in the padding mask for OPT (whose learned
position table then adds its offset of 2 itself).
"""

from __future__ import annotations

import contextvars
import functools
import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

ATTN_NAME = "leankit"
_HOOKED = "_leankit_hooks"
# transformers ``model_type``s whose attention leankit serves: LeanCache pages their K/V, and
# leankit.recompute reproduces their K/V projection from a layer's input (ACT blocks).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "opt")


# Set by the decoder's pre-hook for the forward it opens: whether it is a LeanCache step after the
# prompt, whose compressed layers need no plain causal mask (they attend over pages with the step's
# own real flags and positions, LeanCache.begin_step). A mask that is built all the same (Gemma3's
# with token types: an image's tokens see each other both ways) is read by a step of several
# queries for its own keys (LeanCache._own_key_mask).
_FULL_MASK_UNUSED = contextvars.ContextVar("leankit_full_mask_unused", default=False)
# The mask the whole model was called with (2-D, or 4-D read as its padding). A composite model
# (Gemma3's image-text model) builds its per-layer-type masks itself and hands its decoder a dict
# of them, where the cache needs the rows' padding: the pre-hook on the outer model keeps it here.
_PADDING_MASK = contextvars.ContextVar("leankit_padding_mask", default=None)
# The token ids the whole model was called with. A composite model (Gemma3's or Llava's image-text
# model) embeds them itself and hands its decoder ``inputs_embeds`` alone, where the cache needs a
# decode step's fed ids to see a row end on its EOS (``eos_token_id=``): the outer pre-hook keeps them.
_INPUT_IDS = contextvars.ContextVar("leankit_input_ids", default=None)


def leankit_mask(*args, **kwargs):
    """Mask function registered for ``"leankit"`` (HF ``AttentionMaskInterface``): transformers'
    ``sdpa_mask``, except for the full-attention mask (plain causal, no ``local_size``) of a
    LeanCache step after the prompt, which no layer reads: None instead. Building it would cost a
    host read per step on a GPU (``sdpa_mask`` asks whether the padding mask is all ones before it
    can skip the mask). Sliding-window masks, which transformers' own cache layers use, are built as
    always, and so is any mask that is not the plain causal one: a composite model's encoder (an
    audio or vision tower, switched to ``"leankit"`` with the whole model) builds its bidirectional
    padding mask through this function too, in the same forward as a new turn's decoder step."""
    if _FULL_MASK_UNUSED.get() and kwargs.get("local_size") is None \
            and kwargs.get("mask_function") is causal_mask_function:
        return None
    return sdpa_mask(*args, **kwargs)


def leankit_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention function registered as ``"leankit"`` (HF ``AttentionInterface`` signature).

    Returns ``(attn_output [B, Q, Hq, F], None)``.
    """
    handle = getattr(key, "_leankit_handle", None)
    if handle is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    cache, layer = handle
    if dropout:  # HF passes the module's dropout only in training mode
        raise ValueError(f"attention dropout {dropout} (the model is in training mode): a LeanCache step applies "
                         "none, so it would silently differ from the model's own attention; call model.eval() "
                         "for inference, or pass a DynamicCache")
    if kwargs.get("output_attentions"):
        _warn_no_attention_weights()
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.attend(layer, query, scaling, module=module, attention_mask=attention_mask), None


@functools.cache
def _warn_no_attention_weights() -> None:
    """Once per process, as transformers' SDPA path does: ``output_attentions=True`` gets no weights."""
    import warnings

    warnings.warn("output_attentions=True: a LeanCache step returns no attention weights (its layers attend over "
                  "compressed pages, never forming the full probability matrix); for weights run the model with "
                  "attn_implementation='eager' and a DynamicCache", UserWarning, stacklevel=3)


def decoder_stack(model):
    """The decoder stack of ``model``: the module that holds its decoder ``layers`` and whose forward
    takes ``input_ids, attention_mask, position_ids`` and the cache.

    Follows ``get_decoder`` (or ``.model``) until a module with ``layers``: a causal LM's is one
    step away, a composite model's may be two (BLIP-2's ``get_decoder`` is its whole language
    model, an ``OPTForCausalLM``). Raises ``ValueError`` where no such module is found.
    """
    base = model
    for _ in range(4):
        if isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
            return base
        inner = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
        if inner is None or inner is base:
            break
        base = inner
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def _arg(name, args, kwargs, params):
    if name in kwargs:
        return kwargs[name]
    if name in params:
        i = params.index(name)
        if i < len(args):
            return args[i]
    return None


# Names the decoder stack and its layers take the cache under: transformers 5.24 renamed
# ``past_key_values`` to ``cache`` (the old name is still accepted by the model's own forward).
CACHE_KWARGS = ("cache", "past_key_values")


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward and ``generate`` take the cache by in this transformers.

    ``"cache"`` from transformers 5.24 on (``past_key_values`` is deprecated there and leaves the
    model's forward in 5.40), ``"past_key_values"`` before (5.23 and older know no other name).
    Both renames landed in the same release, so the forward's signature answers for ``generate``.
    """
    forward = getattr(model, "forward", None)
    return _cache_keyword_of(getattr(forward, "__func__", forward))  # a bound method is new per access


@functools.lru_cache(maxsize=64)
def _cache_keyword_of(forward) -> str:
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):  # a C-level or wrapped forward with no readable signature
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` to splat into ``model(...)`` or ``model.generate(...)``.

    Example: ``model.generate(**inputs, **cache_kwargs(model, LeanCache(model, "K8V4")))``.
    """
    return {cache_keyword(model): cache}


def output_cache(out):
    """The cache a model output carries: ``out.cache`` (transformers >= 5.24) or ``out.past_key_values``."""
    for name in CACHE_KWARGS:
        if name in out:  # ModelOutput keys are its non-None fields
            return out[name]
    return None


def cache_argument(args, kwargs, params=()):
    """The cache a decoder stack or layer was called with, under either of :data:`CACHE_KWARGS`."""
    for name in CACHE_KWARGS:
        found = _arg(name, args, kwargs, params)
        if found is not None:
            return found
    return None


def _pre_hook(module, args, kwargs):
    from .cache import LeanCache

    params = module._leankit_params
    cache = cache_argument(args, kwargs, params)
    _FULL_MASK_UNUSED.set(False)  # (a forward that raised midway may have left it set)
    if not isinstance(cache, LeanCache):
        return None
    cache.check_model(module.config)  # a cache built for another model fails here, before any step work
    if cache.act_store is not None:  # ACT blocks recompute through their own model's weights: not its shape alone
        cache.act_store.check_model(module)
    impl = getattr(module.config, "_attn_implementation", None)
    if impl != ATTN_NAME:
        # Only leankit's attention reads the pages: under another implementation the layers would
        # attend to this step's K/V alone while the cache counted tokens it never stored.
        raise ValueError(f"the model's attention implementation is {impl!r}, not {ATTN_NAME!r}, so a LeanCache "
                         "cannot serve it (was set_attn_implementation called after the cache was built?); "
                         "call leankit.enable(model) again, or pass a DynamicCache")
    input_ids = _arg("input_ids", args, kwargs, params)
    embeds = _arg("inputs_embeds", args, kwargs, params)
    ref = input_ids if input_ids is not None else embeds
    if input_ids is None and embeds is not None:  # embedded by an outer model: the ids it was called with
        outer = _INPUT_IDS.get()
        if outer is not None and tuple(outer.shape) == tuple(embeds.shape[:2]):
            input_ids = outer
    position_ids = _arg("position_ids", args, kwargs, params)
    mask = _arg("attention_mask", args, kwargs, params)
    if isinstance(mask, dict):  # masks an outer model built per layer type: the mask it was called with
        outer = _PADDING_MASK.get()
        mask = outer if outer is not None and outer.shape[0] in (1, ref.shape[0]) and \
            outer.shape[-1] >= ref.shape[1] else None
    if isinstance(mask, torch.Tensor):  # a 4-D mask read as its padding (refused if it is not one)
        mask = cache.padding_mask(mask, ref.shape[0], ref.shape[1])
        # the model's own code reads the whole mask: sliding-window layers, OPT's missing positions
        derives_positions = position_ids is None and module._leankit_mask_positions
        cache.check_mask_width(mask, ref.shape[1], whole_only=cache.has_plain_layers or derives_positions)
    if position_ids is None and module._leankit_mask_positions and mask is not None and mask.dim() == 2:
        # OPT's own default: positions count the real tokens of the row (left padding starts at 0).
        # Pad tokens get 0 instead of OPT's -1; they are never stored, so real tokens are unchanged.
        position_ids = (mask.long().cumsum(1) - 1).clamp_min(0)[:, -ref.shape[1]:]
        kwargs["position_ids"] = position_ids
    try:
        q_pos = cache.begin_step(ref.shape[0], ref.shape[1], mask, position_ids, input_ids)
    except ValueError as err:  # a refused step leaves the cache as it was, its length included
        held = cache.get_seq_length()
        if held and _arg("use_cache", args, kwargs, params) is False:
            # generate without the cache feeds the whole sequence each step, tokens this cache holds
            raise ValueError(f"a LeanCache was passed with use_cache=False, under which generate feeds the whole "
                             f"sequence at every step, the {held} tokens per row this cache already holds "
                             f"included: pass use_cache=True with a LeanCache, or no cache ({err})") from err
        raise
    if position_ids is None:
        kwargs["position_ids"] = q_pos
    _FULL_MASK_UNUSED.set(cache.reads_no_full_mask())
    return args, kwargs


def _post_hook(module, args, kwargs, output):
    from .cache import LeanCache

    cache = cache_argument(args, kwargs, module._leankit_params)
    _FULL_MASK_UNUSED.set(False)
    if isinstance(cache, LeanCache):
        cache.end_step()


def _failure_hook(module, args, kwargs, output):
    """Runs after :func:`_post_hook`, and also when the forward raised (``always_call``): a step the
    forward left open (an error in any layer, or in the step's end) is dropped, so the cache stays
    as it was before the call (:meth:`LeanCache.drop_failed_step`). The mask switch is reset here
    too: a forward that raised skipped :func:`_post_hook`, and a mask built outside any leankit
    forward (a vision tower run on its own) must not see the plain causal mask skipped."""
    from .cache import LeanCache

    _FULL_MASK_UNUSED.set(False)
    cache = cache_argument(args, kwargs, module._leankit_params)
    if isinstance(cache, LeanCache):
        cache.drop_failed_step()


def _outer_pre_hook(module, args, kwargs):
    from .cache import LeanCache

    params = module._leankit_params
    mask = _arg("attention_mask", args, kwargs, params)
    _PADDING_MASK.set(mask if isinstance(mask, torch.Tensor) and mask.dim() in (2, 4) else None)
    ids = _arg("input_ids", args, kwargs, params)
    _INPUT_IDS.set(ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None)
    # A composite model builds its decoder's masks here, before the decoder's pre-hook opens the
    # step: a LeanCache step after the prompt reads no full-attention mask, so it is not built
    # (building it reads the device once per step on a GPU; see leankit_mask). Not with token
    # types: Gemma3 then builds its sliding-window mask through the full-mask builder (an and-mask,
    # no local_size), which leankit_mask could not tell from the full mask.
    cache = cache_argument(args, kwargs, params)
    _FULL_MASK_UNUSED.set(isinstance(cache, LeanCache) and cache.reads_no_full_mask(opening=True)
                          and _arg("token_type_ids", args, kwargs, params) is None)


def _outer_post_hook(module, args, kwargs, output):
    _PADDING_MASK.set(None)
    _INPUT_IDS.set(None)
    _FULL_MASK_UNUSED.set(False)


def enable(model):
    """Register the ``"leankit"`` attention and switch ``model`` to it (idempotent).

    Returns the model. Raises ``ValueError`` for architectures LeanCache cannot serve.
    """
    from .cache import _text_config, check_model_supported

    check_model_supported(model.config)
    dec = decoder_stack(model)  # before any change: a model whose layers are not found is left as it was
    AttentionInterface.register(ATTN_NAME, leankit_attention)
    AttentionMaskInterface.register(ATTN_NAME, leankit_mask)
    # the decoder's own config too: a composite model's text config can be switched on its own
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME or \
            getattr(dec.config, "_attn_implementation", ATTN_NAME) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    if not getattr(dec, _HOOKED, False):
        dec._leankit_params = list(inspect.signature(dec.forward).parameters)
        # OPT derives missing positions from the padding mask, Llama-family models from the cache length.
        # (the text model's type: a composite such as InstructBLIP wraps an OPT decoder)
        dec._leankit_mask_positions = getattr(_text_config(model.config), "model_type", None) == "opt"
        dec.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        dec.register_forward_hook(_post_hook, with_kwargs=True)
        dec.register_forward_hook(_failure_hook, with_kwargs=True, always_call=True)
        setattr(dec, _HOOKED, True)
    if dec is not model and not getattr(model, _HOOKED, False):
        # the mask the outer model was called with, for a decoder that is handed per-layer-type masks
        model._leankit_params = list(inspect.signature(model.forward).parameters)
        model.register_forward_pre_hook(_outer_pre_hook, with_kwargs=True)
        model.register_forward_hook(_outer_post_hook, with_kwargs=True, always_call=True)
        setattr(model, _HOOKED, True)
    from .act_store import install_capture  # ACT blocks: decoder-layer input capture (leankit.act_store)

    install_capture(model)
    return model
