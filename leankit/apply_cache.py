"""``leankit.apply(model, kv)``: make plain ``model.generate`` use a fresh LeanCache per call.

A LeanCache holds one batch of requests, so one object cannot serve several ``generate`` calls
(``pipeline("text-generation")`` over a list makes one call per prompt or batch). ``apply``
therefore wraps the generate method of this one model instance: each call that brings no
cache gets a new ``LeanCache(model, kv, **overrides)``, built with the end-of-sequence
ids that call stops on, so finished rows free their pages at once.

Why an instance wrapper and not a transformers hook: ``generate``'s keyword arguments are its
public, documented interface, while the place where it builds its default cache
(``_prepare_cache_for_generation``) and the ``cache_implementation`` registry are private and
have changed across 5.x releases. Pipelines call ``self.model.generate``, which finds the
instance attribute first, so they are covered too. Nothing of transformers is patched: other
model instances are untouched, and ``apply(model, None)`` (or :func:`remove`) restores the
original method and attention implementation.
"""

from __future__ import annotations

import copy

from .config import KVConfig
from .hf import CACHE_KWARGS, cache_kwargs

_STATE = "_leankit_apply"


def apply(model, kv: str | KVConfig | None, **overrides):
    """Make ``model.generate`` (and pipelines over ``model``) use a fresh LeanCache per call.

    Args:
        model: a causal LM that :class:`~leankit.LeanCache` serves.
        kv: KV config string or :class:`KVConfig` (``"K8V4"``, ``"K8V4-K4V2:th=0.25,tl=0"``), or
            ``None`` to undo a previous ``apply``.
        **overrides: :class:`KVConfig` overrides, and ``num_pages`` / ``max_seq_len`` for the cache.

    Returns the model. Calling ``apply`` again replaces the config. A call that passes its own
    cache (``cache=`` or ``past_key_values=``), ``use_cache=False`` or a ``cache_implementation``
    of its own is left alone; a ``cache_implementation`` the model's generation config sets by
    default is overridden. ``copy.deepcopy(model)`` gives a copy whose ``generate`` serves the copy. Raises
    ``ValueError`` for a bad config or an architecture LeanCache cannot serve, leaving the model
    unchanged.
    """
    if kv is None:
        if overrides:
            raise ValueError(f"apply(model, None) undoes apply and takes no overrides, got {sorted(overrides)}")
        remove(model)
        return model
    from .cache import check_model_supported
    from .hf import enable

    cache_kw = {k: overrides.pop(k) for k in ("num_pages", "max_seq_len") if k in overrides}
    cfg = KVConfig.parse(kv, **overrides)  # validate before touching the model
    check_model_supported(model.config)
    state = getattr(model, _STATE, None)
    if state is None:
        state = {"attn": _attn_implementations(model.config),
                 "generate": model.__dict__.get("generate")}
    enable(model)
    state["cfg"], state["cache_kw"] = cfg, cache_kw
    setattr(model, _STATE, state)
    model.generate = _ApplyGenerate(model)
    return model


class _ApplyGenerate:
    """``model.generate`` after :func:`apply`: the original generate, handed a fresh LeanCache.

    An object bound to its model rather than a closure over it, so that ``copy.deepcopy(model)``
    gives a copy whose ``generate`` runs the copy (a closure, copied by reference, kept running the
    original model, its weights and its cache, from the copy's ``generate``).
    """

    def __init__(self, model):
        self.model = model
        original = self._original()
        for name in ("__module__", "__name__", "__qualname__", "__doc__"):  # as functools.wraps, but
            setattr(self, name, getattr(original, name, None))  # __wrapped__ follows the model (below)

    @property
    def __wrapped__(self):  # what inspect.signature and help() read
        return self._original()

    @property
    def leankit_config(self) -> KVConfig:
        return getattr(self.model, _STATE)["cfg"]

    def _original(self):
        own = getattr(self.model, _STATE)["generate"]
        return own or type(self.model).generate.__get__(self.model)

    def __deepcopy__(self, memo):
        # the model's copy from memo (deepcopy(model) is copying it now, its state may not be there yet)
        new = copy.copy(self)
        new.model = copy.deepcopy(self.model, memo)
        return new

    def __call__(self, *args, **kwargs):
        model, state = self.model, getattr(self.model, _STATE)
        given = any(kwargs.get(name) is not None for name in CACHE_KWARGS)  # either name a transformers takes
        passed = _passed_generation_config(args, kwargs)
        if not given and _setting("use_cache", model, passed, kwargs, default=True) is not False \
                and not _asks_for_own_cache(model, passed, kwargs):
            if _setting("cache_implementation", model, passed, kwargs) is not None:
                # the model's default cache_implementation (a generation_config.json's "static", say):
                # transformers refuses it next to a cache object, and this model serves a LeanCache
                kwargs["cache_implementation"] = None
            kwargs.update(cache_kwargs(model, _fresh_cache(model, state["cfg"], state["cache_kw"], kwargs, passed)))
        return self._original()(*args, **kwargs)


def _asks_for_own_cache(model, passed, kwargs) -> bool:
    """Whether this call names a transformers cache of its own: ``cache_implementation=`` on the
    call, or in a passed GenerationConfig where it differs from the model's default (a pipeline
    passes a copy of the model's generation config, which asks for nothing new)."""
    if kwargs.get("cache_implementation") is not None:
        return True
    asked = getattr(passed, "cache_implementation", None) if passed is not None else None
    default = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    return asked is not None and asked != default


def remove(model):
    """Undo :func:`apply`: the model's own ``generate`` and attention implementation come back.

    A model ``apply`` never touched is returned as it is. Returns the model.
    """
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    if state["generate"] is None:
        model.__dict__.pop("generate", None)
    else:
        model.generate = state["generate"]
    if state["attn"] is not None and _attn_implementations(model.config) != state["attn"]:
        model.set_attn_implementation(state["attn"])
    delattr(model, _STATE)
    return model


def _attn_implementations(config):
    """The attention implementation of ``config``, in the form ``set_attn_implementation`` takes back:
    its name, or for a composite model ``{"": name, sub_config: ...}`` (its vision or audio tower may
    run another implementation than its text model, and ``enable`` switches them all)."""
    own = getattr(config, "_attn_implementation", None)
    subs = {key: getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}}
    subs = {key: _attn_implementations(sub) for key, sub in subs.items() if sub is not None}
    return {"": own, **subs} if subs else own


def _passed_generation_config(args: tuple, kwargs: dict):
    """The GenerationConfig a ``generate(inputs, generation_config, ...)`` call passes, by keyword
    or as the second positional argument (None: none)."""
    given = kwargs.get("generation_config")
    return args[1] if given is None and len(args) > 1 else given


def _setting(name: str, model, passed, kwargs: dict, default=None):
    """One generation setting as ``generate`` resolves it: the call's keyword, else the passed
    GenerationConfig's value where it sets one (not None), else the model's generation config."""
    if name in kwargs:
        return kwargs[name]
    for source in (passed, getattr(model, "generation_config", None)):
        value = getattr(source, name, None) if source is not None else None
        if value is not None:
            return value
    return default


def _fresh_cache(model, cfg: KVConfig, cache_kw: dict, kwargs: dict, passed):
    """A new LeanCache for one ``generate`` call, freeing rows on the ids that call stops on and
    the padding it feeds a finished row."""
    from .cache import LeanCache

    eos = _setting("eos_token_id", model, passed, kwargs)
    pad = _setting("pad_token_id", model, passed, kwargs)
    return LeanCache(model, cfg, eos_token_id=eos, pad_token_id=pad, **cache_kw)
