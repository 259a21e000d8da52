"""LeanCache: a unified-paged, hetero-quantized ``transformers`` Cache.

Data flows one way: the HF attention layer hands its new K/V to :meth:`LeanCache.update`, the
cache places them (policy), quantizes them into unified pages (pages), and the registered
``"leankit"`` attention function reads them back from the pages (attention/kernels).

Per forward step (one call of the decoder):

1. ``begin_step`` (a forward pre-hook installed by :func:`leankit.enable`) reads the 2-D padding
   mask and positions, decides how many pages every (layer, sequence, head) needs this step and
   allocates them all in **one** batched prefix-sum call;
2. ``update`` (per layer) quantizes the real (non-pad) new tokens straight into their slots;
3. ``attend`` (per layer) runs paged attention over the pages;
4. ``end_step`` (a forward hook) advances the logical length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.configuration_utils import PretrainedConfig

from . import decode_attention, native
from .allocator import FreePageList, PoolExhausted
from .attention import (
    PagedKV,
    Workspace,
    long_step_attention,
    merge_attention,
    paged_attention_ref,
    received_attention_ref,
    received_from_logits,
    serves_merged_step,
    step_attention,
    step_attention_merged,
)
from .backend import use_triton
from .config import FULL_ATTENTION, SLIDING_ATTENTION, KVConfig, attention_layer_types, fp16_token_bytes
from .hf import SUPPORTED_MODEL_TYPES
from .page_table import HIGH, LOW, BidirectionalPageTable
from .pages import PageLayout, PagePool, format_bytes
from .prompt_attention import prompt_attention
from .quant import NonFiniteKVError, codes_per_byte, pad_repeating
from .rotation import hadamard, rotate, rotate_stored, unrotate

# Layer types LeanCache serves: full attention is compressed into pages; sliding-window layers keep
# transformers' own plain sliding-window cache layer (their window already bounds their memory).
COMPRESSED, PLAIN = FULL_ATTENTION, SLIDING_ATTENTION
# Steps of at most this many queries keep their attention logits for the significance update
# (decode and eval chunks). Longer steps keep them on the compiled kernels, in query chunks whose
# live-slot logits fit their score budget (decode_attention.step_logits_queries); elsewhere they use
# the chunked second pass, which never holds Q x N.
LOGITS_QUERY_LIMIT = 64


def inference_only(method):
    """Run a cache entry point as inference: no autograd, and normal tensors, whatever mode the
    caller's step runs under.

    * ``torch.inference_mode``: switched off inside. A tensor created under it can never be written
      in place outside it, and the cache writes its pages, tables and scores in place: a cache
      filled under ``inference_mode`` and continued under ``no_grad`` (or built under one and
      stepped under the other) would fail there, where ``DynamicCache`` (which concatenates) does
      not. The step's inference-mode K/V and queries are only read, which normal mode allows;
      ``inference_mode(False)`` keeps the grad mode it finds, which inference mode had disabled.
    * Grad mode (a plain ``model(**inputs)``): the cache's work runs under ``no_grad``. Quantized
      pages carry no gradient (rounding has none), and the prompt path writes into preallocated
      buffers (``out=``), which autograd refuses. Where a query or K/V the cache receives requires
      grad, one warning per cache says that no gradient flows through its layers' attention.
    """
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return method(*args, **kwargs)
        if torch.is_grad_enabled():
            cache = args[0]
            if not getattr(cache, "_warned_no_grad", False) and any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:]):
                cache._warned_no_grad = True
                warnings.warn("LeanCache is inference-only: its layers' attention reads quantized pages, through "
                              "which no gradient flows, so it runs without autograd; call the model under "
                              "torch.no_grad() or torch.inference_mode() (as generate does)", UserWarning,
                              stacklevel=3)
            with torch.no_grad():
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return wrapper


def _token_ids(ids, name: str) -> list[int]:
    """``ids`` (None, one token id or a sequence of them, as Python or numpy ints or a tensor) as a
    list of ints; ``ValueError`` naming ``name`` for anything else (a float, a string)."""
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor) and not (ids.is_floating_point() or ids.is_complex()):
        ids = ids.flatten().tolist()
    try:
        return [operator.index(ids)]
    except TypeError:
        pass
    try:
        return [operator.index(i) for i in ids]
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of token ids, got {ids!r}") from None


def _positive_int(value, name: str) -> int:
    """``value`` as an int, or ``ValueError`` naming ``name`` unless it is a positive integer."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if n <= 0:
        raise ValueError(f"{name} must be a positive integer, got {n}")
    return n


def ended_rows(tokens: torch.Tensor, end_ids: torch.Tensor, n_eos: int, finished: torch.Tensor,
               ending: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ended, ending')`` bool ``[B]`` of a decode step that feeds ``tokens`` ``[B]``: rows fed an
    EOS last step (``ending``) and any of ``end_ids`` (the ``n_eos`` EOS ids, then padding ids) now
    have ended; rows fed an EOS now (and not ended or finished) are ending. Why a row ends one
    token late: ``leankit_kernels.step_rows``, the kernel backend's version of this rule."""
    hit_eos = torch.isin(tokens, end_ids[:n_eos])
    hit_end = torch.isin(tokens, end_ids)
    ended = (ending & hit_end if ending is not None else torch.zeros_like(finished)) & ~finished
    return ended, hit_eos & ~(finished | ended)


def padding_mask_of(mask: torch.Tensor, past: int, q_len: int) -> torch.Tensor:
    """The 2-D padding mask ``[B, past + q_len]`` (1 = real) whose causal mask is the 4-D mask ``mask``.

    LeanCache keeps which tokens are real, not a mask: a stored token stays visible to every later
    query. A 4-D mask ``[B, 1, q_len, >= past + q_len]`` (bool, 0/1, or additive with 0 where a key
    is seen) is read as padding: a new token is real when it sees itself, an earlier one when some
    query sees it. Raises ``ValueError`` for any other 4-D mask (packed or block-diagonal sequences,
    per-head masks, a prefix-LM mask), which attention over the cache could not honour on later steps.
    """
    if mask.dim() != 4 or mask.shape[2] != q_len or mask.shape[3] < past + q_len:
        raise ValueError(f"a 4-D attention mask for this step must be [batch, 1, {q_len}, >= {past + q_len}] "
                         f"(the step's {q_len} queries over the {past} tokens before them and themselves), "
                         f"got {list(mask.shape)}")
    seen = mask == 0 if mask.is_floating_point() else mask.bool()
    row = seen[:, 0]
    i = torch.arange(q_len, device=mask.device)
    n = past + q_len
    causal = torch.arange(n, device=mask.device) <= (past + i).unsqueeze(1)  # [Q, n]
    # A query row that sees every key, later ones included, is a padding row some mask builders
    # "unmask" (so SDPA meets no all-masked row): it says nothing about which keys are real. Any
    # other row that sees a later key is not causal, and refused below.
    future = (row[..., :n] & ~causal).any(-1)  # [B, Q]
    unmasked = future & row[..., :n].all(-1)
    new = row[:, i, past + i] & ~future  # a new token is real when it sees itself
    padding = torch.cat([(row[:, :, :past] & ~future.unsqueeze(-1)).any(1), new], 1)
    expected = causal & padding.unsqueeze(1)
    # compared on the real queries only (what a padding query sees differs between mask builders)
    bad = (seen[..., :n] != expected.unsqueeze(1)) | seen[..., n:].any(-1, keepdim=True)
    if bool((bad & new[:, None, :, None]).any()) or bool((future & ~unmasked).any()):
        raise ValueError("LeanCache reads a 4-D attention mask as the causal mask of padding, and this one is "
                         "not (packed or block-diagonal sequences, per-head or prefix-LM masks): later steps would "
                         "see tokens the mask hides; pass the 2-D padding mask, or use DynamicCache for custom masks")
    return padding.long()


def attention_head_dim(config) -> int:
    """Channels per attention head of a model config (``head_dim``, else hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_kv_heads(config) -> int:
    """KV heads of a model config (``num_key_value_heads``; OPT has none and is MHA)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def padded_head_dim(cfg: KVConfig, head_dim: int, kernels: bool) -> int:
    """Channels per head the pages of ``cfg`` hold for a model head of ``head_dim`` channels.

    The head as it is, unless it must be padded (:meth:`LeanCache.to_page_basis`): to whole bytes
    of codes (a 2-bit side packs 4 channels a byte, so head_dim 30 becomes 32), and on the kernel
    backend to a power of two >= 16, the widths the Triton kernels tile (80 -> 128).
    """
    f = head_dim
    if kernels:
        from leankit_kernels.tiles import kernel_head_dim

        f = kernel_head_dim(f)
    per_byte = max((codes_per_byte(b) for p in cfg.tiers for b in (p.k_bits, p.v_bits) if b < 8), default=1)
    return -(-f // per_byte) * per_byte


def padded_group_sizes(cfg: KVConfig, head_dim: int, page_head_dim: int) -> KVConfig:
    """``cfg`` with its quantization groups restated for heads padded from ``head_dim`` to
    ``page_head_dim`` channels (:meth:`LeanCache.to_page_basis`): a group of the whole head stays
    whole (the padding repeats a channel of it), a smaller group must divide the padded width too."""
    if page_head_dim == head_dim:
        return cfg
    sizes = {}
    for name in ("group_size", "low_group_size"):
        gs = getattr(cfg, name)
        if gs == head_dim:
            gs = None if name == "group_size" else page_head_dim
        elif gs is not None and (head_dim % gs or page_head_dim % gs):
            # a group must hold real channels only, as the unpadded head's groups do
            raise ValueError(f"{name}={gs}: heads of head_dim {head_dim} are padded to {page_head_dim} channels "
                             "in the pages (whole bytes of codes; on the kernel backend a power of two >= 16), "
                             f"and {gs} does not divide both; choose a group size dividing both")
        sizes[name] = gs
    return dataclasses.replace(cfg, **sizes)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def position_limit(model) -> int | None:
    """The positions ``model`` was built for (its text config's ``max_position_embeddings``), or None."""
    return getattr(_text_config(model.config), "max_position_embeddings", None)


def layer_types(config) -> list[str]:
    """Attention type of every decoder layer of ``config`` (its text config), as the model's own
    attention sees it (:func:`leankit.config.attention_layer_types`)."""
    return attention_layer_types(_text_config(config))


def check_model_supported(config) -> None:
    """Raise ``ValueError`` unless LeanCache can serve every layer of ``config``: a supported model
    type whose layers are full attention (compressed) or sliding-window attention (kept plain)."""
    config = _text_config(config)
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"leankit's LeanCache supports model types {SUPPORTED_MODEL_TYPES}; got {mtype!r}. "
            "Other architectures are not handled."
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        # Gemma3 caps attention logits as softcap * tanh(logits / softcap) when this is set (None in
        # every released checkpoint); LeanCache's attention computes plain softmax(q k^T), so it
        # would silently differ from the model's own attention
        raise ValueError(f"this {mtype} model caps its attention logits (attn_logit_softcapping={softcap}), "
                         "which LeanCache's attention does not do: set it to None or use a DynamicCache")
    other = sorted({t for t in layer_types(config) if t not in (COMPRESSED, PLAIN)})
    if other:
        raise ValueError(f"LeanCache cannot handle layer types {other} of this {mtype} model: only "
                         f"{COMPRESSED!r} (compressed) and {PLAIN!r} (kept plain) layers are supported")


def _plain_layer(config):
    """transformers' own sliding-window cache layer for an uncompressed layer."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return DynamicSlidingWindowLayer(sliding_window=_text_config(config).sliding_window)


def _query_length(arg) -> int:
    # transformers >= 5.13 passes the query length, older 5.x the cache_position tensor
    return arg if isinstance(arg, int) else int(arg.shape[-1])


class MemoryReport(dict):
    """:meth:`LeanCache.memory_report` as a dict (every key documented there) with a readable ``str``."""

    def __str__(self) -> str:
        def size(n: float) -> str:
            return format_bytes(n, gib_digits=2)

        def times(r: float) -> str:
            return "-" if math.isnan(r) else f"{r:.3f}x"

        t, rows = self["tokens_per_tier"], self["tokens_per_row"]
        lines = [
            (f"LeanCache {self['config']} ({self['compressed_layers']} of {self['model_layers']} layers "
             f"compressed, model dtype {self['dense_dtype']})"),
            f"  tokens per row      {', '.join(str(r) for r in rows) or '-'} (real tokens, padding excluded)",
            (f"  per layer and head  high {t['high']:.1f}, low {t['low']:.1f}, pruned {t['pruned']:.1f} "
             "(tokens, summed over rows)"),
            (f"  pages               {self['pages_used']} of {self['pages_total']} in use, "
             f"{self['page_size']} B each: {size(self['pages_used'] * self['page_size'])}"),
        ]
        if "act_pages" in self:  # ACT blocks: the pages split by kind, and the tokens held as activations
            lines.append(f"    of them           KV {size(self['kv_bytes'])}, ACT {size(self['act_bytes'])} "
                         f"({self['act_pages']} pages, {self['act_tokens']} tokens summed over layers and rows)")
        lines.append(f"  page table          {size(self['table_bytes'])}")
        if self["plain_layers"]:
            lines.append(f"  plain layers        {size(self['plain_bytes'])} in {self['plain_layers']} "
                         "sliding-window layers")
        dense = "  vs " + self["dense_dtype"] + " cache"
        lines += [
            f"  total               {size(self['total_bytes'])}",
            # the ratios are NaN (0 / 0) while the cache holds no token (fresh, reset or refused)
            f"  vs fp16 cache       {times(self['ratio'])} of {size(self['fp16_bytes'])}",
            f"{dense:<22}{times(self['dense_ratio'])} of {size(self['dense_bytes'])} (the model's own dtype)",
            # peak_ratio is NaN (0 / 0) on a model with no compressed layer
            f"  peak pages          {size(self['peak_kv_bytes'])}"
            + (f", {self['peak_ratio']:.3f}x fp16" if not math.isnan(self["peak_ratio"]) else ""),
        ]
        return "\n".join(lines)


@dataclass
class StepState:
    """What ``begin_step`` learned about the tokens of the current forward call."""

    real: torch.Tensor  # bool [B, Q]: token is a real (non-pad, unfinished) token to store
    rank: torch.Tensor  # int [B, Q]: index of the token among the row's real new tokens
    n_new: torch.Tensor  # int [B]: real new tokens per row
    q_pos: torch.Tensor  # int [B, Q]: absolute positions of the queries
    q_len: int
    has_query: torch.Tensor  # bool [B]: the row has a real token this step
    q_first: torch.Tensor  # long [B]: position of the row's first real token (a large sentinel if none)
    q_last: torch.Tensor  # long [B]: position of the row's last real token (a small sentinel if none)
    lens_before: torch.Tensor  # int32 [2, L, B, H]: tokens per tier once the step's pages were planned
    ordered: bool  # every row's real tokens have increasing positions (so no key follows a later query)
    # Tensors derived from the step once and shared by all its layers, filled on first use: the
    # policy's store rows (every layer stores the same tokens) and the prompt's additive masks
    # (every layer gets the same mask). They go with the step when it ends or is dropped.
    derived: dict = field(default_factory=dict)
    # Kernel backend, a decode step (None on other steps): step_rows' int64 0/1 [B] flags of rows
    # going on after their request ended (``continued``, only with end ids) and of rows whose token
    # does not follow their stored positions (``behind``), both read at the step's one host read,
    # and the rows' highest stored positions once the step ends (``last_pos_next``). A step that
    # is dropped, or never opens, takes them with it.
    continued: torch.Tensor | None = None
    behind: torch.Tensor | None = None
    last_pos_next: torch.Tensor | None = None
    # The step's 2-D padding mask (None: no padding), right-aligned with the tokens seen once the
    # step ends: what an error message and a later crop read of which columns held real tokens.
    mask: torch.Tensor | None = None


_NO_POS = 1 << 30  # sentinel position of a row with no real token in the step
_OUTSIDE_STEP = ("LeanCache.update was called outside a forward step: call leankit.enable(model) "
                 "(LeanCache does this) and run the model through its forward/generate")
# Page dtypes that hold K/V of a narrower float dtype exactly (a host table: torch.promote_types
# would be an aten call inside every layer of a decode step)
_HOLDS_EXACTLY = {torch.float32: (torch.float16, torch.bfloat16),
                  torch.float64: (torch.float32, torch.float16, torch.bfloat16)}
_ENDED_ROWS_CONTINUE = ("rows {rows} of this LeanCache ended their request with an EOS token in an earlier step and "
                        "their pages were freed, so a new turn cannot continue them: pass a fresh LeanCache (or "
                        "build this one without eos_token_id to keep finished rows)")
_POSITIONS_GO_BACK = ("rows {rows}: this step's tokens sit at positions no later than tokens this LeanCache already "
                      "stores for the row, which a query then could not see (stored tokens are masked by position, "
                      "not by order). Positions must grow across steps: a manual forward without position_ids on "
                      "a left-padded batch counts padding that generate's mask-derived positions do not (pass "
                      "position_ids = attention_mask.cumsum(-1) - 1), and a used cache handed another request "
                      "restarts them (pass a fresh LeanCache)")
_RIGHT_PADDED = ("rows {rows} are padded on the right, after real tokens, and generate gives a step after right "
                 "padding positions that restart, at or before positions the row stores (stored tokens are "
                 "masked by position, not by order): pad a decoder-only batch on the left "
                 "(tokenizer.padding_side = 'left')")


def positions_go_back_message(rows: list[int], attention_mask, q_len: int) -> str:
    """The error for rows whose step sits at positions they already store. Rows that
    ``attention_mask`` (2-D, the whole sequence; None: unknown) shows padded on the right are named
    first, with that cause: generate counts positions from the mask, and right padding restarts them."""
    padded_rows = []
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > q_len \
            and attention_mask.shape[0] > max(rows):
        stored = attention_mask[rows, :-q_len].bool()
        right_padded = (~stored & (stored.int().cumsum(1) > 0)).any(1)  # a pad after a real token
        padded_rows = [r for r, flag in zip(rows, right_padded.tolist()) if flag]
    other_rows = [r for r in rows if r not in padded_rows]
    parts = ([_RIGHT_PADDED.format(rows=padded_rows)] if padded_rows else []) \
        + ([_POSITIONS_GO_BACK.format(rows=other_rows)] if other_rows else [])
    return "; ".join(parts)


def sequence_mask(before: torch.Tensor | None, step_mask: torch.Tensor | None, seen: int, q_len: int):
    """The padding mask of a whole sequence once a step ends: which columns held real tokens.

    ``before``: the mask of the ``seen`` columns before the step (None: no padding there);
    ``step_mask``: the step's 2-D mask, over the whole sequence (``seen + q_len`` columns) or the
    step's own tokens (``q_len``), or None (no padding in the step). Returns None while no column
    is known to be padding. A generate step brings the whole mask, which is taken as it is (no
    tensor op); only the other two kinds of step join columns."""
    if step_mask is not None and step_mask.shape[1] == seen + q_len:
        return step_mask
    if step_mask is None:
        if before is None:
            return None
        step_mask = torch.ones(before.shape[0], q_len, dtype=before.dtype, device=before.device)
    if before is None:
        before = torch.ones(step_mask.shape[0], seen, dtype=step_mask.dtype, device=step_mask.device)
    rows = max(before.shape[0], step_mask.shape[0])
    return torch.cat([before.bool().expand(rows, -1), step_mask[:, -q_len:].bool().expand(rows, -1)], 1)


def _restore_layer_states(saved: list[tuple]) -> None:
    """Put back the attributes :meth:`LeanCache._plain_layer_states` saved of each layer."""
    for layer, state in saved:
        layer.__dict__.clear()
        layer.__dict__.update(state)


def _split_row_flags(values: list, row_flags: torch.Tensor | None) -> tuple[list, list]:
    """``values`` read back with ``row_flags`` (one per row, None: not read) as their last part:
    the values before them, and the rows whose flag is raised. An explicit cut, not a negative
    slice: an empty batch's flags must not take the whole list."""
    cut = len(values) - (0 if row_flags is None else row_flags.numel())
    return values[:cut], [b for b, f in enumerate(values[cut:]) if f]


class LeanLayer(CacheLayerMixin):
    """One layer's view of a :class:`LeanCache` (all state lives in the cache's shared tables)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: LeanCache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx
        super().__init__()

    @property
    def is_initialized(self) -> bool:
        """Whether the layer holds state: once the cache's first step has built its tables (or
        transformers ran :meth:`lazy_initialization`), until :meth:`LeanCache.reset`."""
        return getattr(self, "_initialized", False) or self.cache.table is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        self._initialized = bool(value)

    def lazy_initialization(self, key_states, value_states) -> None:
        """Mark the layer initialized; its state (pages, tables) is allocated by the cache."""
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Hand the step's new K/V to the cache (stored after attention); returns them unchanged."""
        self.cache.check_kv_shape(key_states, value_states)
        return self.cache._store(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        """Positions the cache has seen per row (the same for every layer)."""
        return self.cache._seen

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask transformers builds for a step of ``query_length``."""
        return self.cache._seen + _query_length(query_length), 0

    def get_max_length(self) -> int:
        """The cache's ``max_seq_len`` (the page-table row's size, not a hard cap)."""
        return self.cache.max_seq_len

    def get_max_cache_shape(self) -> int:
        """transformers < 5.13 spelling of the size bound: -1, as for a dynamic layer (the page pool
        grows on demand, so no static mask of a fixed length may be built)."""
        return -1

    def reset(self) -> None:
        """Empty the whole cache (:meth:`LeanCache.reset`): its layers share one pool and table."""
        self.cache.reset()

    def reorder_cache(self, beam_idx) -> None:
        """Nothing per layer: :meth:`LeanCache.reorder_cache` reorders all layers at once."""


class LeanCache(Cache):
    """Unified-paged, hetero-quantized KV cache for ``model.generate``.

    Example::

        cache = LeanCache(model, "K8V4")
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
        print(cache.memory_report())

    Args:
        model: a causal LM of a type in ``SUPPORTED_MODEL_TYPES`` (Llama, SmolLM2, Mistral, Qwen2,
            Qwen3, Phi3, Gemma3, OPT). Full-attention layers are compressed into pages; sliding-window
            layers (Gemma3's local layers, Mistral with ``sliding_window``) keep transformers' own
            plain sliding-window cache layer, and ``memory_report`` counts their bytes.
        kv: a KV config string or :class:`KVConfig` (see :meth:`KVConfig.parse`).
        num_pages: fixed pool size. ``None`` starts small and grows the pool on demand; a fixed
            pool raises :class:`PoolExhausted` when it runs out.
        max_seq_len: longest sequence a row must hold (default: the model's
            ``max_position_embeddings``); sizes the page-table rows.
        eos_token_id: id(s) that end a request. When given, a row that a decode step feeds one of
            them, and then an EOS or padding id (what ``generate`` feeds a finished row), is
            finished and its pages return to the free list. The EOS itself is stored: until the
            token after it, a row fed an EOS may as well be a new ``generate`` call continuing a
            turn that stopped on it. Pass the same ids ``generate`` stops on (``generate`` keeps
            feeding a finished row, so the cache must not guess). Without it, pages return on
            :meth:`release` or :meth:`reset`.
        pad_token_id: id(s) ``generate`` feeds a finished row (default: the model's generation
            config's, else its config's). Only read with ``eos_token_id``.
        offload: keep every page (KV at any precision, or ACT) in host memory, pinned when CUDA is
            present, and only the layers in flight on the device (:mod:`leankit.offload`). Takes
            ``True``/``"host"``, a dict of :class:`~leankit.offload.OffloadConfig` fields
            (``prefetch``: layers copied in ahead, default 1; ``device_pages``: a fixed device
            budget) or an ``OffloadConfig``. ``None`` (default) or ``False``: every page on the device.
            Tokens are identical either way; ``memory_report()["offload"]`` gives the bytes moved.
        **overrides: :class:`KVConfig` overrides (``window``, ``th``, ``tl``, ``page_size`` ...).
    """

    @inference_only
    def __init__(self, model, kv: str | KVConfig = "K8V4", *, num_pages: int | None = None,
                 max_seq_len: int | None = None, eos_token_id=None, pad_token_id=None, offload=None, **overrides):
        if not isinstance(getattr(model, "config", None), PretrainedConfig):
            what = f"the string {model!r}" if isinstance(model, str) else f"a {type(model).__name__}"
            raise TypeError(f"LeanCache takes the model it serves (a transformers model), got {what}; load one "
                            "first, e.g. model, tok = leankit.load_model('smollm2-135m')")
        cfg = _text_config(model.config)
        check_model_supported(cfg)
        self.cfg = KVConfig.parse(kv, **overrides)
        types = layer_types(cfg)
        # Global layer index -> page-table layer index (None: a plain sliding-window layer). The
        # page table, the policy and ``num_layers`` cover the compressed layers only.
        table_index, n = [], 0
        for t in types:
            table_index.append(n if t == COMPRESSED else None)
            n += t == COMPRESSED
        self.table_index = tuple(table_index)
        # Page-table layer index -> the model's layer index (errors name the model's layers)
        self.compressed_layers = tuple(i for i, t in enumerate(table_index) if t is not None)
        self.model_layers = len(types)
        self.num_layers = n
        # A mask of the step's tokens alone cannot serve a model whose own layers read the whole
        # mask after the prompt: sliding-window layers keep transformers' cache and masks.
        self.has_plain_layers = n < len(types)
        if n == 0:
            warnings.warn(f"every layer of this {cfg.model_type} model is a sliding-window layer, which keeps "
                          f"transformers' own cache: LeanCache compresses nothing here ({self.cfg.label()} applies "
                          "to full-attention layers only)", UserWarning, stacklevel=3)
        self.num_kv_heads = attention_kv_heads(cfg)
        self.num_q_heads = cfg.num_attention_heads
        self.head_dim = attention_head_dim(cfg)
        self.act_hidden = cfg.hidden_size  # width of an ACT block (leankit.act_store)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._warned_dtype = False  # K/V wider than the pages were handed (check_kv_shape)
        # rotate=1: pages hold K/V in a Hadamard basis; queries are rotated to match and the
        # attention output is rotated back (leankit.rotation).
        self.rotation = hadamard(self.head_dim, self.device, self.dtype) if self.cfg.rotate else None
        # the same matrix in fp32 for rotating outputs back (in fp32): converted once, not per layer
        self._unrotation = None if self.rotation is None else self.rotation.float()
        # Channels per head in the pages (padded at this boundary where needed, :meth:`to_page_basis`)
        self.page_head_dim = padded_head_dim(self.cfg, self.head_dim, use_triton(torch.empty(0, device=self.device)))
        # the config as the pages hold it: group sizes restated for the padded heads
        self.page_cfg = padded_group_sizes(self.cfg, self.head_dim, self.page_head_dim)
        self.layouts = tuple(PageLayout.build(self.page_cfg, t, self.page_head_dim, self.dtype)
                             for t in range(len(self.cfg.tiers)))
        if max_seq_len is None:
            max_seq_len = getattr(cfg, "max_position_embeddings", None) or 8192
        self.max_seq_len = _positive_int(max_seq_len, "max_seq_len")
        # Sized by the tier with the fewest tokens a page: a low tier with a small low_group_size
        # can hold fewer tokens a page than the high one (more metadata per token), and a head
        # whose tokens all went low would then outgrow a row sized by the high tier's pages long
        # before max_seq_len (page_bounds makes the same bound, ceil(n / min T) + 1).
        self.row_len = math.ceil(self.max_seq_len / min(layout.tokens for layout in self.layouts)) + 1
        self.fixed_pool = num_pages is not None
        if self.fixed_pool:
            num_pages = _positive_int(num_pages, "num_pages")
        self.pool = PagePool(num_pages or 64, self.cfg.page_size, self.device)
        self.free_list = FreePageList(self.pool.num_pages, self.device)
        self.table: BidirectionalPageTable | None = None
        self.finished: torch.Tensor | None = None
        self._seen = 0
        self._step: StepState | None = None
        self._planning = False  # inside the policy's begin_step of a step
        self._pending: dict = {}  # layer -> the step's exact (key, value) until attention stores them
        self.workspace = Workspace()  # scratch of the reference attention, reused by every layer and step
        self._policy_saved = None
        self._plain_saved: list = []  # (plain layer, its attributes) as a step opened: what abort_step restores
        self._peak = (0, 0)  # (kv_bytes, fp16_bytes) at the step that used the most pages (fp16 may be a tensor)
        # Kernel backend: int32 error flag per layer (and one for tokens a policy moves between
        # tiers), raised by the quantize kernel on NaN/Inf K/V and read once per step in end_step.
        self._kv_err = torch.zeros(self.num_layers + 1, dtype=torch.int32, device=self.device)
        self._err_views = None  # (_kv_err, its one-element views per layer): see _layer_err
        self._prompt_geometry = None  # the tiers' rows for lk_prompt_layer, False where it cannot run: see store_prompt_layer
        self._bounds_memo = None  # ((tokens fed, row length), page_bounds()): see page_bounds
        # (refused, pages needed, pages free) of the step's first refused deferred allocation
        self._alloc_status = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._hw_tokens = 0  # most tokens any row may hold (host bound: tokens fed so far, this step's included)
        self._hw_before = 0  # _hw_tokens before the open step
        self.eos_ids = torch.tensor(_token_ids(eos_token_id, "eos_token_id"), dtype=torch.long, device=self.device)
        if pad_token_id is None:
            gen_cfg = getattr(model, "generation_config", None)
            pad_token_id = getattr(gen_cfg, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = getattr(cfg, "pad_token_id", None)
        eos = self.eos_ids.tolist()
        pads = [i for i in _token_ids(pad_token_id, "pad_token_id") if i not in eos]
        self.end_ids = torch.tensor(eos + pads, dtype=torch.long, device=self.device)  # EOS ids, then padding
        # Rows fed an EOS in the last step (stored; they end if the next token is an EOS or padding
        # id), and the same flags for the step in flight, adopted when it ends (a dropped step keeps
        # the old ones).
        self.ending: torch.Tensor | None = None
        self._ending_next: torch.Tensor | None = None
        # Highest real position stored per row (int64 [B], -1 for none), adopted when a step ends:
        # a step's queries must come after it (_POSITIONS_GO_BACK). On the kernel backend's decode
        # step step_rows makes the comparison and the update (StepState.behind, .last_pos_next).
        self._last_pos: torch.Tensor | None = None
        # The padding mask of the whole sequence so far (sequence_mask; None: no padding seen): which
        # of the newest columns held real tokens, the tokens :meth:`crop` drops.
        self._last_mask: torch.Tensor | None = None
        from .policy import make_policy  # the placement policy of this config

        self.policy = make_policy(self)
        self._text_cfg = cfg
        self.act_store = None
        if self.cfg.act > 0:  # KV/ACT hybrid: ACT blocks own their pages and wrap the policy (leankit.act_store)
            from .act_store import attach

            attach(self, model)
        self.offload = None
        if offload is not None and offload is not False:  # host tier and per-layer pipeline (leankit.offload)
            from .offload import make_runtime

            self.offload = make_runtime(self, offload)
        super().__init__(layers=self._build_layers())
        from .hf import enable

        enable(model)

    def __getstate__(self) -> dict:
        # _err_views holds views of _kv_err, which pickle would unpickle as detached copies (the
        # kernels' NaN/Inf flags would then never reach _kv_err): _layer_err cuts them again.
        state = dict(self.__dict__)
        state["_err_views"] = None
        return state

    def __copy__(self):
        # A shallow copy would share the pool, page tables and policy state with this cache while its
        # layers still pointed here: the copy's first step failed with a misleading error about
        # leankit.enable, after planning pages in the shared tables. Refused up front instead.
        raise TypeError("copy.copy of a LeanCache is not supported (the copy would share this cache's pages and "
                        "tables); use copy.deepcopy for an independent copy (transformers' prefix-cache recipe)")

    @classmethod
    def from_plan(cls, model, plan, **kwargs) -> LeanCache:
        """The cache a :func:`leankit.planner.plan` chose: its format, ACT share, KVPR split and
        placement (the host tier when the plan keeps cache on the host); see :mod:`leankit.offload.plan`.

        Raises ``ValueError`` for an infeasible plan, a plan for another model shape, or a plan
        LeanCache cannot serve (CPU attention). ``kwargs`` go to the constructor (``eos_token_id`` ...).
        """
        from .offload.plan import cache_settings, check_model

        if "offload" in kwargs:  # the plan chose the placement (a TypeError of Python's otherwise)
            raise ValueError("from_plan takes its placement from the plan: drop offload=, or build "
                             "LeanCache(model, kv, offload=...) yourself")
        check_model(plan, model)  # first: a plan for another model is wrong whatever its settings
        kv, offload = cache_settings(plan)
        return cls(model, kv, offload=offload, **kwargs)

    def _build_layers(self) -> list:
        return [LeanLayer(self, t) if t is not None else _plain_layer(self._text_cfg) for t in self.table_index]

    # ------------------------------------------------------------------ model checks
    def _shape_text(self) -> str:
        return (f"{self.model_layers} layers, {self.num_kv_heads} KV heads of head_dim {self.head_dim}")

    def check_model(self, config) -> None:
        """Raise ``ValueError`` naming both shapes when ``config`` is not the model this cache was built
        for (layer count, KV heads, head_dim), or when its layers attend otherwise: which layers slide
        (those keep transformers' sliding-window layer, the others are paged and attend to every
        stored token) and the window the plain layers keep. Python values only: no device sync."""
        config = _text_config(config)
        got = (config.num_hidden_layers, attention_kv_heads(config), attention_head_dim(config))
        if got != (self.model_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"this LeanCache was built for a model with {self._shape_text()}, but is used with a model with "
                f"{got[0]} layers, {got[1]} KV heads of head_dim {got[2]}: build a LeanCache for this model")
        if config is self._text_cfg:  # the model it was built for (the common case, every step)
            return
        paged = tuple(t == COMPRESSED for t in layer_types(config))
        window = getattr(config, "sliding_window", None) if not all(paged) else None
        if paged != tuple(t is not None for t in self.table_index) or window != self._plain_window():
            def text(flags, win):
                slides = [i for i, p in enumerate(flags) if not p]
                return f"sliding-window layers {slides} of window {win}" if slides else "no sliding-window layer"
            raise ValueError(
                f"this LeanCache was built for a model with {text([t is not None for t in self.table_index], self._plain_window())}, "
                f"but is used with a model with {text(paged, window)} (its layers would attend over the wrong "
                "tokens): build a LeanCache for this model")

    def _plain_window(self):
        """The window of this cache's plain (sliding-window) layers; None when every layer is paged."""
        return None if not self.has_plain_layers else getattr(self._text_cfg, "sliding_window", None)

    def check_kv_shape(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise ``ValueError`` when a layer hands K/V whose heads or head_dim differ from this cache's."""
        if key_states.dim() != 4 or key_states.shape[1] != self.num_kv_heads or key_states.shape[-1] != self.head_dim \
                or value_states.shape != key_states.shape:
            raise ValueError(
                f"this LeanCache was built for a model with {self._shape_text()}, but a layer handed keys of shape "
                f"{tuple(key_states.shape)} and values of shape {tuple(value_states.shape)} (expected "
                f"[batch, {self.num_kv_heads}, tokens, {self.head_dim}]): build a LeanCache for this model")
        if key_states.dtype != self.dtype and not self._warned_dtype \
                and key_states.dtype not in _HOLDS_EXACTLY.get(self.dtype, ()):
            # the pages round the K/V to a narrower dtype, as they did before (autocast can hand fp32
            # K/V to a bf16 model's cache), so FP16 is no longer lossless: said once per cache
            self._warned_dtype = True
            warnings.warn(
                f"this LeanCache was built for a {str(self.dtype).removeprefix('torch.')} model, but a layer handed "
                f"{str(key_states.dtype).removeprefix('torch.')} keys: its pages round them to "
                f"{str(self.dtype).removeprefix('torch.')} (a model moved with model.to(...) after the cache was "
                "built needs a new LeanCache)", UserWarning, stacklevel=4)

    @inference_only
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """``Cache.update`` with a clear error for a layer index this cache does not have."""
        if not 0 <= layer_idx < self.model_layers:
            raise ValueError(f"layer {layer_idx} does not exist in this LeanCache, built for a model with "
                             f"{self._shape_text()}: build a LeanCache for this model")
        if self._step is None:
            # before any layer stores: a sliding-window layer (transformers' own) would otherwise keep
            # this call's K/V, which no failure hook of an un-enabled model then drops
            raise RuntimeError(_OUTSIDE_STEP)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------------ step protocol
    def padding_mask(self, attention_mask, batch: int, q_len: int):
        """The step's mask as the cache reads it: a 2-D mask (or None) as given; a 4-D mask as the
        ``[batch, seen + q_len]`` padding mask whose causal mask it is (:func:`padding_mask_of`,
        which refuses any other), a batch-broadcast ``[1, 1, q, k]`` one repeated for every row."""
        if attention_mask is None or attention_mask.dim() != 4:
            return attention_mask
        padding = padding_mask_of(attention_mask, self._seen, q_len)
        if padding.shape[0] not in (1, batch):
            raise ValueError(f"a 4-D attention mask for a batch of {batch} rows has {padding.shape[0]}")
        return padding.expand(batch, -1).contiguous()

    @inference_only
    def begin_step(self, batch: int, q_len: int, attention_mask=None, position_ids=None,
                   input_ids=None) -> torch.Tensor:
        """Prepare a forward step of ``q_len`` tokens per row; returns the query positions ``[B, Q]``.

        Called by the pre-hook that :func:`leankit.enable` installs; call it yourself only when
        driving layers by hand. A first step that fails (a short fixed pool) leaves the cache as
        fresh as it was, not bound to that step's batch size.
        """
        if q_len < 1:
            why = (f": generate cut this step's input by the {self._seen} tokens per row this LeanCache has seen, "
                   "so the cache most likely holds another request (pass a fresh LeanCache to each generate "
                   "call; a new turn passes the whole sequence)") if self._seen else ": a step needs a token"
            raise ValueError(f"a forward step of {q_len} tokens{why}")
        if position_ids is not None and (position_ids.dim() > 2 or position_ids.shape[-1] != q_len
                                         or position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
            # a row's tokens take one position each (multimodal RoPE's [3, B, Q] sections do not)
            raise ValueError(f"position_ids of shape {tuple(position_ids.shape)} for a step of {batch} rows of "
                             f"{q_len} tokens: a LeanCache takes one position per token, [B, Q] or [Q]")
        # A step still open here was cut short by an exception that is not an ``Exception``
        # (KeyboardInterrupt, SystemExit): torch runs no ``always_call`` forward hook for those, so
        # the failure hook never dropped it, and the layers that ran before it kept their tokens.
        self.drop_failed_step()
        fresh = self.table is None
        attention_mask = self.padding_mask(attention_mask, batch, q_len)  # checked before the step opens
        self.check_mask_width(attention_mask, q_len)
        self._hw_before = self._hw_tokens  # what a dropped step restores (the kernels' grid bounds)
        try:
            return self._begin_step(batch, q_len, attention_mask, position_ids, input_ids)
        except BaseException:
            if self._step is None:
                self._hw_tokens = self._hw_before
                if fresh:
                    self.reset()
            raise

    def _begin_step(self, batch: int, q_len: int, attention_mask, position_ids, input_ids) -> torch.Tensor:
        dev = self.device
        if self.table is None:
            self.table = BidirectionalPageTable(self.num_layers, batch, self.num_kv_heads, self.row_len, dev)
            self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
            self.ending = torch.zeros(batch, dtype=torch.bool, device=dev)
            self._last_pos = torch.full((batch,), -1, dtype=torch.long, device=dev)
        elif self.table.shape[1] != batch:
            raise ValueError(f"this LeanCache holds a batch of {self.table.shape[1]} rows, got {batch}; "
                             "use a fresh LeanCache per batch")
        if q_len == 1 and use_triton(self._kv_err):
            return self._begin_decode_step(batch, attention_mask, position_ids, input_ids)
        if attention_mask is not None and attention_mask.dim() == 2:
            real = attention_mask[:, -q_len:].to(dev).bool()
        else:
            real = torch.ones(batch, q_len, dtype=torch.bool, device=dev)
        if position_ids is None:
            q_pos = (torch.arange(q_len, device=dev) + self._seen).expand(batch, q_len)
        else:
            q_pos = position_ids.to(dev).expand(batch, q_len)
        qp = q_pos.long()
        # the rows' ending flags after this step (None: unchanged); a longer step (a prompt, a new
        # turn) continues every row it feeds, so no row is left waiting on an EOS
        ending_next = torch.zeros_like(self.finished) if q_len > 1 and self.eos_ids.numel() else None
        if q_len == 1 and input_ids is not None and self._seen > 0 and self.eos_ids.numel():
            # A row fed an EOS last step and an EOS or padding id now has ended: free its pages now.
            # A row fed an EOS now stores it and waits for the next token (step_rows' docstring:
            # the first step of a new generate call continuing a turn that stopped on that EOS
            # feeds the same token).
            fed = input_ids[:, 0].to(dev)
            self._check_no_finished_row_continues(real & ~torch.isin(fed, self.end_ids).unsqueeze(1))
            ended, ending_next = ended_rows(fed, self.end_ids, self.eos_ids.numel(), self.finished, self.ending)
        else:
            ended = None
            if q_len > 1 and self._seen > 0:
                self._check_mask_keeps_stored_tokens(attention_mask, q_len)
                if self.eos_ids.numel():
                    self._check_no_finished_row_continues(real)
        # A row that ended earlier, or ends now (it stores nothing, as in step_rows), has no real token.
        real = real & ~(self.finished if ended is None else self.finished | ended).unsqueeze(1)
        q_first = torch.where(real, qp, torch.full_like(qp, _NO_POS)).amin(1)
        if self._seen > 0:  # the more specific refusals above first; a refused step changes nothing
            self._check_positions_grow(q_first, attention_mask, q_len)
        if ended is not None:
            self._release_ended(ended)
        self._hw_tokens = max(self._hw_tokens, self._seen + q_len)
        if use_triton(self._kv_err):  # a step that raised midway may have left a flag up
            self._kv_err.zero_()
            self._alloc_status.zero_()
        rank = torch.cumsum(real.int(), dim=1) - 1
        q_last = torch.where(real, qp, torch.full_like(qp, -_NO_POS)).amax(1)
        # One check per step (a host read on GPU, prompts only): causal work can stop at the diagonal.
        ordered = q_len == 1 or bool(self._positions_increase(real, qp))
        step = StepState(real, rank, real.sum(1), q_pos.to(torch.int32), q_len, real.any(1), q_first, q_last,
                         self.table.lens, ordered, mask=attention_mask if attention_mask is not None
                         and attention_mask.dim() == 2 else None)
        self._open_step(step)
        self._ending_next = ending_next
        return qp

    def _begin_decode_step(self, batch: int, attention_mask, position_ids, input_ids) -> torch.Tensor:
        """:meth:`begin_step` of a one-token step on the kernel backend: the rows' state (real
        flags, positions, ranks, ended requests) and the cleared error flags come from one launch
        (:func:`leankit_kernels.step_rows.step_rows`) instead of about twenty small tensor ops."""
        from leankit_kernels.step_rows import step_rows

        dev = self.device
        mask = attention_mask.to(dev) if attention_mask is not None and attention_mask.dim() == 2 else None
        pos = None if position_ids is None else position_ids.to(dev).expand(batch, 1)
        ends = input_ids is not None and self._seen > 0 and self.eos_ids.numel() > 0
        rows = step_rows(batch, self.finished, self._kv_err, self._alloc_status, attention_mask=mask,
                         position_ids=pos, seen=self._seen, no_pos=_NO_POS,
                         last_tokens=input_ids[:, 0].to(dev) if ends else None, end_ids=self.end_ids if ends else None,
                         n_eos=self.eos_ids.numel(), ending=self.ending, last_pos=self._last_pos)
        if rows["ended"] is not None:
            self._release_ended(rows["ended"])
        self._hw_tokens = max(self._hw_tokens, self._seen + 1)
        real = rows["real"]
        step = StepState(real, rows["rank"], rows["n_new"], rows["q_pos"], 1, real.view(-1), rows["q_first"],
                         rows["q_last"], self.table.lens, True, continued=rows["continued"], behind=rows["behind"],
                         last_pos_next=rows["last_pos"], mask=mask)
        self._open_step(step)
        self._ending_next = rows["ending"]
        return rows["q_pos64"]

    def _check_positions_grow(self, q_first: torch.Tensor, attention_mask, q_len: int) -> None:
        """Raise ``ValueError`` where a row's first real token of this step (``q_first``, a large
        sentinel for a row with none) sits at or before a position the row already stores (one host
        read; the kernel backend's decode step makes the same test on the device and reads it with
        the step's flags, :meth:`_check_step_flags`)."""
        behind = q_first <= self._last_pos
        if bool(behind.any()):
            raise ValueError(positions_go_back_message(behind.nonzero().flatten().tolist(), attention_mask, q_len))

    def check_mask_width(self, attention_mask, q_len: int, whole_only: bool = False) -> None:
        """Raise ``ValueError`` where a 2-D mask after the prompt covers neither the whole sequence
        (the ``S`` tokens this cache has seen, then the step's ``Q``) nor the step's tokens alone.

        Such a mask belongs to another sequence: most often a used cache handed to a second
        ``generate`` call with a prompt no longer than what the cache has seen, which then cuts the
        new prompt by the old length and attends to the old request's tokens (a longer prompt brings
        a mask of the right width, and only its positions could tell). Models with sliding-window
        layers or OPT's mask-derived positions need the whole mask: the decoder hook asks for it
        (``whole_only``), since it knows how the model reads the mask. A shape check, no device read."""
        if attention_mask is None or attention_mask.dim() != 2 or self._seen == 0:
            return
        width, whole = attention_mask.shape[1], self._seen + q_len
        if width == whole or (width == q_len and not whole_only):
            return
        alone = "" if whole_only else f" or the step's tokens alone ({q_len})"
        raise ValueError(
            f"the attention mask has {width} columns, but this LeanCache has seen {self._seen} tokens per row and "
            f"this step brings {q_len}: a mask after the first step covers the whole sequence ({whole}){alone}"
            + (" (this model's sliding-window layers or mask-derived positions read all of it)" if whole_only else "")
            + ". A LeanCache holds one request batch: pass a fresh LeanCache to each generate call (a new turn "
            "passes the whole sequence so far)")

    def _check_mask_keeps_stored_tokens(self, attention_mask, q_len: int) -> None:
        """Raise ``ValueError`` where a new turn's 2-D mask hides tokens this cache already stores.

        Stored tokens stay visible to every later query (a cache holds no mask of the past), so a
        mask that now hides some of them, such as the padding ``generate`` fed with mask 1 to a row
        that ended early, cannot be honoured; DynamicCache, which re-applies the whole mask each
        step, would give other tokens. Compares each live row's real tokens so far with the ones the
        mask keeps (one host read, on steps that already read the device to order their positions).
        """
        if self.table is None or attention_mask is None or attention_mask.dim() != 2 \
                or attention_mask.shape[1] != self._seen + q_len:
            return
        stored = self.policy.logical_tokens()  # real tokens per live row (0 for a finished one)
        kept = attention_mask[:, : self._seen].to(stored.device).long().sum(1)
        hidden = ~self.finished & (kept < stored)
        if bool(hidden.any()):
            rows = hidden.nonzero().flatten().tolist()
            raise ValueError(
                f"rows {rows}: the attention mask hides tokens of earlier steps that this LeanCache stored as "
                "real (padding generate fed with mask 1 to a row that ended early, for instance); stored tokens "
                "cannot be hidden afterwards: keep the earlier columns of the mask as they were, build the cache "
                "with eos_token_id so ended rows are released, or pass a fresh LeanCache")

    def _check_no_finished_row_continues(self, real: torch.Tensor) -> None:
        """Raise ``ValueError`` where a step brings real tokens to a row that ended its request in an
        earlier step: that row's pages were freed, so its context is gone. A step of several tokens
        reads the device here, as it already does to order its positions; so does a one-token step on
        the torch backend, where ``real`` leaves out the end ids ``generate`` feeds a finished row
        (the kernel backend's decode step reads nothing here: ``step_rows`` flags such rows, and
        :meth:`_check_step_flags` drops the step and raises at the step's one host read)."""
        ended = self.finished & real.any(1)
        if bool(ended.any()):
            raise ValueError(_ENDED_ROWS_CONTINUE.format(rows=ended.nonzero().flatten().tolist()))

    def _release_ended(self, ended: torch.Tensor) -> None:
        """Free the pages of the rows whose previous token ended their request (bool ``[B]``)."""
        if use_triton(self._kv_err) and self.offload is None:
            # No host read on the kernel backend: the ended rows' pages go back in a deferred
            # release (a no-op for rows that did not end), counted at the step's one read.
            self.release(ended, defer=True)
        elif bool(ended.any()):
            self.release(ended)

    def _open_step(self, step: StepState) -> None:
        """Plan ``step``'s pages through the policy and make it the open step."""
        self._planning = True  # tokens the policy moves now raise the step's flag (read in end_step)
        try:
            self.policy.begin_step(step)
        finally:
            self._planning = False
        # What a failed step rolls back to: token counts (and policy counters) once the step's pages
        # are planned. Tokens are appended past these counts, so restoring them drops the step's
        # tokens (drop_failed_step then gives back the pages the step reserved).
        step.lens_before = self.table.lens.clone()
        self._policy_saved = self.policy.save_state()
        # transformers' plain (sliding-window) layers append by concatenation, so the attributes
        # they hold now are the state a dropped step restores (references, no copy of K/V)
        self._plain_saved = self._plain_layer_states()
        self._step = step
        self._pending = {}
        if self.offload is not None:  # start copying the first layer's host pages in
            self.offload.begin_step(step)

    def reads_no_full_mask(self, opening: bool = False) -> bool:
        """Whether the open step's compressed layers ignore the model's full-attention mask: every
        step after the prompt attends over the pages with its own real flags and positions (only a
        prompt hands the model's mask to attention). ``opening``: asked for the step about to open
        (an outer model that builds its decoder's masks before the step begins)."""
        return (opening or self._step is not None) and self._seen > 0

    @staticmethod
    def _positions_increase(real: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """bool: along every row, each real token's position exceeds every earlier real token's."""
        marked = torch.where(real, q_pos, torch.full_like(q_pos, -_NO_POS))
        before = torch.cummax(marked, dim=1).values[:, :-1]
        return ~(real[:, 1:] & (q_pos[:, 1:] <= before)).any()

    @inference_only
    def end_step(self) -> None:
        """Close the forward step: advance the logical length, run end-of-step policy work.

        On the kernel backend this is where the step's device error flags are read (the step's
        one host sync): NaN/Inf K/V drop the whole step (:meth:`abort_step`) and raise
        :class:`~leankit.quant.NonFiniteKVError` naming the first bad layer.
        """
        if self._step is not None:
            self._check_step_flags()
            # Pages in use at the step's high point, before the policy's end-of-step eviction frees
            # any (the free list is current here: the read above loaded any deferred counters).
            used = self.free_list.capacity - self.free_list.num_free
            try:
                self.policy.end_step(self._step)
            except BaseException:  # e.g. a short pool for the end-of-step re-tiering: drop the whole step
                self.drop_failed_step()
                raise
            self._seen += self._step.q_len
            # rows without a real token have q_last = -_NO_POS: the maximum keeps their last position
            last_next = self._step.last_pos_next  # worked out by the kernel backend's decode step
            self._last_pos = last_next if last_next is not None else torch.maximum(self._last_pos, self._step.q_last)
            self._last_mask = sequence_mask(self._last_mask, self._step.mask, self._seen - self._step.q_len,
                                            self._step.q_len)
            self._step = None
            if self._ending_next is not None:  # the rows fed an EOS in this step (leankit_kernels.step_rows)
                self.ending = self._ending_next
            self._ending_next = None
            self._plain_saved = []  # let go of the sliding-window layers' K/V before the step
            if self.offload is not None:  # land the write-backs, count the step's bytes
                self.offload.end_step()
            if used * self.cfg.page_size >= self._peak[0]:
                # fp16 bytes as a device tensor: memory_report converts it (no sync per step)
                self._peak = (used * self.cfg.page_size, self._fp16_bytes(as_tensor=True))

    def _check_step_flags(self) -> None:
        """Read the step's device error flags and the policy's step status in one host read (the
        kernel backend's one sync per step); on a raised flag drop the step and raise."""
        if not use_triton(self._kv_err):
            return
        status = self.policy.step_status(self._step)
        free_list = self.free_list
        stale = free_list.stale  # a deferred allocation moved the device counters
        continued, behind, step_mask = self._step.continued, self._step.behind, self._step.mask
        parts = [self._kv_err.long(), self._alloc_status] + ([free_list.counters] if stale else []) \
            + ([] if status is None else [status.long().reshape(-1)]) \
            + [row_flags for row_flags in (continued, behind) if row_flags is not None]  # int64, as the rest
        values = torch.cat(parts).tolist()
        n = self._kv_err.numel()
        flags, alloc, rest = values[:n], values[n: n + 3], values[n + 3:]
        if stale:
            free_list.load(*rest[:2])
            rest = rest[2:]
        rest, went_back = _split_row_flags(rest, behind)  # the last part read
        rest, went_on = _split_row_flags(rest, continued)
        bad = [i for i, f in enumerate(flags) if f]
        if not bad and not alloc[0] and not went_on and not went_back:
            if status is not None:
                self.policy.take_status(rest)
            return
        self._kv_err.zero_()
        self._alloc_status.zero_()
        self.drop_failed_step()
        if went_on:
            raise ValueError(_ENDED_ROWS_CONTINUE.format(rows=went_on))
        if went_back:
            raise ValueError(positions_go_back_message(went_back, step_mask, 1))
        if alloc[0]:
            raise PoolExhausted(alloc[1], alloc[2], free_list.capacity)
        from leankit_kernels.quant import NON_FINITE_MESSAGE

        where = f"layer {self.compressed_layers[bad[0]]}" if bad[0] < self.num_layers else "a token moved between tiers"
        what = NON_FINITE_MESSAGE
        if self.act_store is not None:  # the flag also stands for the ACT tokens' activations (act_store.store)
            what = f"{what} (or the layer input activations stored for ACT tokens hold NaN or Inf)"
        raise NonFiniteKVError(f"{where}: {what}; the step was dropped (its tokens are not stored) "
                               "and the cache stays usable")

    def page_bounds(self) -> tuple[int, int, int]:
        """Host upper bounds ``(high pages, low pages, pages)`` any head of any layer holds.

        A head holds pages for at most the tokens its row was fed (``_hw_tokens``, this step's
        included): ``ceil(n / T)`` per tier, and ``ceil(n_h / T_h) + ceil(n_l / T_l) <=
        ceil(n / min T) + 1`` for both tiers together. The kernels size their grids from these
        bounds instead of reading the page counts (no host sync); heads with less work exit early.
        """
        r = self.row_len
        key = (self._hw_tokens, r)
        memo = self._bounds_memo
        if memo is None or memo[0] != key:  # asked by every layer of a step: worked out once
            high, low, total = self._page_bounds()
            memo = self._bounds_memo = (key, (min(r, high), min(r, low), min(r, total)))
        return memo[1]

    def _page_bounds(self) -> tuple[int, int, int]:
        n = self._hw_tokens
        t = [layout.tokens for layout in self.layouts]
        high = -(-n // t[HIGH])
        if len(t) == 1:
            return high, 0, high
        return high, -(-n // t[LOW]), -(-n // min(t)) + 1

    def _rows_fit(self) -> bool:
        """Whether no head's pages can outgrow its page-table row (host bound, no device read)."""
        return self._page_bounds()[2] <= self.row_len

    def grow_pages(self, extra: torch.Tensor, table=None, defer: bool = False,
                   bound: int | None = None) -> torch.Tensor | None:
        """Allocate ``extra[t, l, b, h]`` pages in one batched call, growing an elastic pool.

        ``table`` defaults to the KV page table; the ACT page table (leankit.act_store) passes its own
        (``extra`` then counts blocks per (layer, sequence)). A deferred grant checks only that the KV
        rows fit: a caller passing another table defers only once it has proved its own rows fit.
        ``defer``: the caller can take a refusal at the end of the step. On the kernel backend
        the grant then runs without a host read: for a fixed pool, a short pool raises
        :class:`PoolExhausted` from :meth:`end_step` (the step is dropped, nothing was handed
        out); an elastic pool defers when it has ``bound`` (a host bound on ``extra.sum()``),
        growing first (one host read, then rarely: capacity at least doubles) if its free pages
        might be fewer. A deferred grant returns its device bool ``ok`` (false: refused whole,
        nothing handed out); an eager one returns None.
        """
        table = self.table if table is None else table
        if defer and self._deferred_grant(bound):
            return table.grow(extra, self.free_list, status=self._alloc_status, taken=bound)
        self._grown_if_short(lambda: table.grow(extra, self.free_list))
        return None

    def _grown_if_short(self, grant):
        """``grant()``; where it refused for a short pool and the pool is elastic, grow the pool
        (:meth:`_ensure_free`) and call it once more. A fixed pool's refusal is raised as it is."""
        try:
            return grant()
        except PoolExhausted as e:
            if self.fixed_pool:
                raise
            self._ensure_free(e.needed)
            return grant()

    def fit_pages(self, layers: torch.Tensor, lens: torch.Tensor,
                  reserve: torch.Tensor | None = None) -> torch.Tensor | None:
        """Give every head of ``layers`` the pages for ``lens`` ``[tiers, L', B, H]`` tokens per tier
        (plus ``reserve[b]`` high slots) in one compiled call on a CPU
        (:meth:`~leankit.page_table.BidirectionalPageTable.fit`), growing an elastic pool as
        :meth:`grow_pages` does. Returns the pages each tier keeps, ``need`` ``[2, L', B, H]``, or
        None, having done nothing, where the compiled kernels do not take it."""
        tokens = tuple(lay.tokens for lay in self.layouts)
        return self._grown_if_short(lambda: self.table.fit(layers, lens, tokens, self.free_list, reserve))

    def grow_for_tokens(self, n_new: torch.Tensor, tokens_per_page: int, q_len: int) -> None:
        """Reserve high-tier room for a step's new tokens (``n_new[b] <= q_len`` per row,
        ``tokens_per_page`` to a high page) in every layer and head, in one batched grant (LeanKV §5.3).

        Deferred as :meth:`grow_pages` defers. On the kernel backend a step of at most two new pages
        per head (a decode step) is one launch that computes the demand, checks it against the free
        pages and grants it, with no host read
        (:meth:`~leankit.page_table.BidirectionalPageTable.grant_tokens`, a single program); a
        longer prompt takes the many-program grant, where each head's pages are handed out in parallel.
        """
        # Pages cover every stored token, so a head needs at most ceil((T - 1 + Q) / T) more.
        per_head = -(-(tokens_per_page - 1 + q_len) // tokens_per_page)
        bound = self.table.lens[0].numel() * per_head
        if per_head <= 2 and self._deferred_grant(bound):
            self.table.grant_tokens(n_new, tokens_per_page, self.free_list, self._alloc_status, taken=bound)
            return
        self.grow_pages(self.table.token_demand(n_new, tokens_per_page), defer=True, bound=bound)

    def _deferred_grant(self, bound: int | None) -> bool:
        """Whether a grant of at most ``bound`` pages (None: unknown) can run deferred, with no
        host read: the kernel backend, rows that cannot overflow, and a fixed pool or a bound the
        elastic pool's free pages are known to cover (grown first, one host read, if not)."""
        if not (use_triton(self._kv_err) and self._rows_fit() and (self.fixed_pool or bound is not None)):
            return False
        if not self.fixed_pool and bound > self.free_list.free_floor:
            self._ensure_free(bound)
        return True

    def _ensure_free(self, pages: int) -> None:
        """Grow an elastic pool (at least doubling it) until it has ``pages`` free pages."""
        free = self.free_list.num_free  # (syncs the host counters)
        if free < pages:
            new_cap = max(self.pool.num_pages * 2, self.pool.num_pages + pages - free)
            self.pool.grow(new_cap)
            self.free_list.grow(new_cap)

    # ------------------------------------------------------------------ layer protocol
    def _store(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Take the step's new K/V of ``layer``; they are written to the pages after attention.

        The step attends to its own tokens at their exact values, so quantizing them can wait for
        :meth:`attend`, which stores them once their significance is known. Returns the K/V
        unchanged (tagged for the ``"leankit"`` attention).
        """
        if self._step is None:
            raise RuntimeError(_OUTSIDE_STEP)
        self._pending[layer] = (key_states, value_states)
        key_states._leankit_handle = (self, layer)
        return key_states, value_states

    @inference_only
    def abort_step(self) -> None:
        """Drop the current step: every layer's tokens of it are forgotten, the cache stays usable.

        Restores the token counts and policy counters saved when the step's pages were planned
        (earlier layers of the step may already have stored their tokens); pages the step
        reserved stay owned by their heads (:meth:`drop_failed_step` then gives them back).
        """
        if self._step is None:
            return
        self.table.lens.copy_(self._step.lens_before)
        self._hw_tokens = self._hw_before  # the step's tokens are not held: same grid bounds as before it
        self.policy.load_state(self._policy_saved)
        _restore_layer_states(self._plain_saved)  # the step's K/V leave the sliding-window layers too
        self._plain_saved = []
        self._step, self._pending, self._ending_next = None, {}, None

    @inference_only
    def drop_failed_step(self) -> None:
        """Drop a step that raised before it closed (no-op when no step is open): its tokens are
        forgotten (:meth:`abort_step`), and a failed first step leaves the cache fresh (every page
        it took back in the pool, no batch size bound), so the caller may retry with other inputs."""
        if self._step is None:
            return
        self.abort_step()
        if self.offload is not None:  # pages prefetched for later layers of the dropped step are stale
            self.offload.forget_step()  # (and its link bytes are no finished step's)
        if self._seen == 0:
            self.reset()
        else:
            # The pages the step reserved for its tokens (KV pages, ACT blocks; on the kernel backend
            # also the blocks a keep-flagged ACT grant handed out before another grant was refused)
            # go back to the pool: left with their heads they are held until those heads' later
            # tokens fill them, so a fixed pool could refuse another row's step that an unfailed
            # cache serves (one device read, on the failure path)
            self.trim_pages()

    def trim_pages(self) -> int:
        """Return every page past the ones each head's tokens fill, KV and ACT: the pages a dropped
        step reserved, which :meth:`abort_step` leaves with their heads for the next step. An offloaded
        cache with a fixed device budget needs them gone, since every page of a layer, empty or not,
        takes a device slot in its window. Reads the device; returns the pages freed."""
        freed = 0
        if self.table is not None:  # the pages each head's tokens need, from the shared tier plan
            layers = torch.arange(self.num_layers, device=self.device)
            need = self.table.tier_plan(layers, self.table.lens[: len(self.layouts)],
                                        tuple(lay.tokens for lay in self.layouts))[0]
            freed += int(self.table.shrink(need, self.free_list))
        store = self.act_store
        if store is not None and store.table is not None:
            freed += store.table.shrink_to_lens(self.free_list)
        return freed

    def write_tokens(self, tier: int, layer: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor,
                     keep: torch.Tensor | None = None) -> None:
        """Quantize ``n`` tokens (``k``/``v`` ``[n, F]``) into slots ``slot`` of tier ``tier``.

        ``layer`` is one layer index, or an int tensor ``[n]`` giving each token's layer.
        ``keep`` bool ``[n]``: write only these tokens (the others may name any slot).

        The kernel backend writes inside a step without reading anything back: NaN/Inf K/V raise
        the layer's device error flag, which :meth:`end_step` reads once for the whole step.
        """
        if b.numel() == 0:
            return
        layout = self.layouts[tier]
        if isinstance(layer, torch.Tensor):  # per-token layers (a policy moving tokens of many layers)
            col = self.table.column(tier, slot.long() // layout.tokens, self.table.row_len)
            page, off = self.table.tables[layer.long(), b.long(), h.long(), col], slot % layout.tokens
        else:
            page, off = self.table.locate(tier, layer, b, h, slot, layout.tokens)
        if use_triton(k):
            from leankit_kernels.quant import quantize_into_pages

            if keep is not None:  # a negative page id: the kernel skips the token
                page = torch.where(keep, page, torch.full_like(page, -1))
            flag = self.num_layers if isinstance(layer, torch.Tensor) else layer
            in_step = self._step is not None or self._planning
            err = self._layer_err(flag) if in_step else None  # outside a step: raise now
            quantize_into_pages(self.pool.storage, layout, page, off, k, v, pos, score, err=err)
        else:
            self.pool.write_tokens(layout, page, off, k, v, score, pos, keep=keep)

    def store_classed(self, layer: int, tier: int, k: torch.Tensor, v: torch.Tensor, step, score: torch.Tensor,
                      cls: torch.Tensor, rank: torch.Tensor, want: int) -> bool:
        """A CPU prompt's tokens of class ``want`` of ``layer`` into ``tier``, in one compiled call
        (:meth:`leankit.pages.PagePool.store_ranked`): token ``(b, h, q)`` (``k``/``v``
        ``[B, H, Q, F]``, the basis the pages hold) to slot ``lens[b, h] + rank[b, h, q]`` of its
        head's tier, with position ``step.q_pos[b, q]`` and significance ``score``; ``cls``,
        ``rank`` and ``score`` ``[B, H, Q]`` as a prompt classification returns them. The counts
        are left to the caller. Returns False, having done nothing, where the compiled kernels
        cannot take the store."""
        views = self.table.layer_views(layer)
        first_col, col_step = self.table.tier_columns(tier)
        return self.pool.store_ranked(self.layouts[tier], views.tables, first_col, col_step, views.tier_lens[tier],
                                      k, v, step.q_pos, cls, rank, want, score)

    def store_prompt_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, received: torch.Tensor,
                           q_last: torch.Tensor, pruned_mass: torch.Tensor, window: int, th: float, tl: float) -> bool:
        """A CPU LeanKV prompt's ``layer`` in one compiled call
        (:meth:`leankit.native.Kernels.prompt_layer`): the prompt-phase rule on ``received``
        ``[B, H, Q]`` (:func:`leankit.policy.prompt_classes`, with ``window``, ``th``, ``tl`` and
        the rows' last positions ``q_last``), the pages for the heads' new counts (as
        :meth:`fit_pages`), the kept tokens of ``k``/``v`` ``[B, H, Q, F]`` (the basis the pages
        hold) into their tiers (as :meth:`store_classed`), ``pruned_mass`` ``[B, H]`` (fp32, the
        layer's row) raised by what the rule pruned, and the new counts with the unneeded pages
        recycled (as :meth:`~leankit.page_table.BidirectionalPageTable.settle`): the same bytes,
        page ids and counts as those calls one by one. A short elastic pool grows and the call runs
        again (nothing changed); other refusals raise as those calls do. Returns False, having done
        nothing, where the compiled kernels cannot take the layer."""
        table, free_list = self.table, self.free_list
        kernels = table._compiled(free_list)
        if kernels is None:
            return False
        geometry = self._prompt_geometry
        if geometry is None:  # once per cache: its layouts and pool do not change
            tiers = []
            for layout in self.layouts:
                store, k_fmt, v_fmt = self.pool._native_store(layout)
                if store is None:
                    tiers = None
                    break
                tiers.append((layout.tokens, k_fmt, v_fmt, layout.group_size, tuple(layout.seg_offsets)))
            geometry = False if tiers is None else kernels.prompt_geometry(tuple(tiers), self.page_head_dim)
            self._prompt_geometry = geometry
        if geometry is False:
            return False
        q_pos, real, q_last = step.q_pos.long().contiguous(), step.real.contiguous(), q_last.long().contiguous()
        k, v, received = k.float().contiguous(), v.float().contiguous(), received.float()

        def layer_call():
            code, stage, taken, freed = kernels.prompt_layer(
                received, q_pos, real, q_last, pruned_mass, window, th, tl, table.tables, table.n_pages,
                table.lens, layer, free_list.ring, free_list.free_head, free_list.free_tail, self.pool.storage,
                geometry, k, v)
            if stage == 0:  # refused (code != 0) with nothing changed: raised in the grant's words
                table._take_grant(code, taken, free_list)  # a short pool raises PoolExhausted (it may grow)
                return
            free_list.took(taken)
            if freed:
                free_list.returned(freed)
            native.Kernels._check_result(code, "prompt_layer",
                                         bad_page="a kept token's slot has no page in its page-table row")

        self._grown_if_short(layer_call)
        return True

    def write_step_tokens(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, score=None, *,
                          take: torch.Tensor | None = None, rank: torch.Tensor | None = None, tier: int = HIGH) -> None:
        """Kernel backend: the step's real new tokens of ``layer`` (``k``/``v`` ``[B, H, Q, F]``, the
        basis the pages hold) into the next high-tier slots of their heads, and the heads' token
        counts advanced by the step's, in one launch for a decode step
        (:func:`leankit_kernels.quant.store_step_tokens`). ``score``: the tokens' initial
        significance, None (0), ``[B, H, Q]`` or ``[B * Q * H]`` in token order. NaN/Inf K/V raise
        the layer's device error flag, read once at the end of the step.

        With ``take``/``rank`` (bool / int ``[B, H, Q]``: the tokens each head keeps in ``tier`` and
        their ranks among them) only those tokens are written, into ``tier``'s next slots, and the
        counts are left to the caller (a LeanKV prompt classified per head before it is stored)."""
        from leankit_kernels.quant import store_step_tokens

        views = self.table.layer_views(layer)
        lens, err = views.tier_lens[tier], self._layer_err(layer)
        if take is not None:
            store_step_tokens(self.pool.storage, self.layouts[tier], k, v, take, rank, step.q_pos, lens,
                              views.tables, err, score=score, low=tier == LOW, update_lens=False)
            return
        store_step_tokens(self.pool.storage, self.layouts[HIGH], k, v, step.real, step.rank, step.q_pos, lens,
                          views.tables, err, score=score)
        if k.shape[2] > 1:  # several queries per row: the kernel left the counts to add here
            lens += step.n_new.view(-1, 1).to(lens.dtype)

    def store_decode_tokens(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, score=None) -> bool:
        """A CPU decode step's new tokens of ``layer`` (``k``/``v`` ``[B, H, 1, F]``, the basis the
        pages hold) into the next high-tier slots of their heads, and the heads' token counts
        advanced, in one compiled call (:meth:`leankit.pages.PagePool.store_decode`): the CPU twin
        of :meth:`write_step_tokens`. ``score``: the tokens' initial significance ``[B, H, 1]``, or
        None (0). Returns False, having done nothing, where the compiled kernels cannot take the
        store (none built, or a dtype they do not read); raises as :meth:`write_tokens` does, with
        nothing written."""
        views = self.table.layer_views(layer)
        return self.pool.store_decode(self.layouts[HIGH], views.tables, *self.table.tier_columns(HIGH),
                                      views.tier_lens[HIGH], k, v, step.q_pos, step.real, score)

    def _layer_err(self, layer: int) -> torch.Tensor:
        """The device error flag of ``layer`` (index ``num_layers``: tokens moved between tiers), a
        one-element view of ``_kv_err``; the views are cut once, not at every store."""
        if self._err_views is None or self._err_views[0] is not self._kv_err:
            self._err_views = (self._kv_err, [self._kv_err[i: i + 1] for i in range(self._kv_err.numel())])
        return self._err_views[1][layer]

    def paged_kv(self, layer: int) -> PagedKV:
        """The page view attention reads for ``layer``."""
        return PagedKV(self.pool, self.layouts, self.table, layer, self.workspace)

    @inference_only
    def attend(self, layer: int, query: torch.Tensor, scaling: float, module=None, attention_mask=None) -> torch.Tensor:
        """Attention of the step's queries for ``layer``; returns ``[B, Q, Hq, F]``.

        With ``offload``, it runs inside the layer's window, on its pages copied to the device
        (:meth:`leankit.offload.OffloadRuntime.attend`).
        """
        # An error inside the layer drops the step here, after the offload runtime closed the layer's
        # window (its rows point at device slots while it is open, and dropping the step forgets the
        # layers prefetched after it, which it refuses to do while a window is open)
        try:
            if self.offload is not None:
                return self.offload.attend(
                    layer, lambda: self._attend_and_store(layer, query, scaling, module, attention_mask))
            return self._attend_and_store(layer, query, scaling, module, attention_mask)
        except NonFiniteKVError as e:  # NaN/Inf, or a value beyond the fp16 range of the metadata
            self.drop_failed_step()
            raise NonFiniteKVError(f"layer {self.compressed_layers[layer]}: {e}; the step was dropped (its tokens "
                                   "are not stored) and the cache stays usable") from e
        except BaseException:  # a short pool, a row outgrown, anything else: the cache stays as it was
            self.drop_failed_step()
            raise

    def _attend_and_store(self, layer: int, query: torch.Tensor, scaling: float, module=None,
                          attention_mask=None) -> torch.Tensor:
        """Attention of the step's queries for ``layer`` over the pages in ``self.pool``.

        Keys of earlier steps are read from the pages (paged attention over their codes); the
        step's own new keys are used at their exact values and the two parts are merged by
        log-sum-exp. A step with nothing stored before it (a prompt) is plain SDPA with the
        model's own mask (``module``/``attention_mask`` from the attention function), exactly
        what an uncompressed cache computes. The new tokens are then quantized into the pages.
        """
        st = self._step
        k_new, v_new = self._pending.pop(layer)
        policy = self.policy
        sig = policy.uses_significance
        nq = query.shape[2]
        group = query.shape[1] // self.num_kv_heads
        received_new = None
        k_store, v_store = self.to_page_basis(k_new), self.to_page_basis(v_new)
        if self._seen == 0:  # nothing stored yet: the whole step is one exact attention
            if module is not None:  # exactly what an uncompressed cache computes for a prompt
                out, received_new = prompt_attention(module, query, k_new, v_new, attention_mask, scaling,
                                                     significance=sig, q_pos=st.q_pos, k_real=st.real,
                                                     ordered=st.ordered, ws=self.workspace,
                                                     mask_memo=st.derived.setdefault("prompt_masks", {}),
                                                     exact=self.cfg.lossless)
            else:
                out, _, received_new = step_attention(query, k_new, v_new, st.q_pos, st.real, scaling,
                                                      received=sig)
        else:
            kv = self.paged_kv(layer)
            kernels = use_triton(query)
            fused = nq == 1 and not kernels and decode_attention.serves_decode_step(kv, group, query.device)
            # Attention below adds this step's attention to the stored tokens' significance before
            # the store checks the step's K/V: NaN/Inf queries or keys would leave NaN there for
            # good, past the dropped step. Checked first on the torch backend, one host read for
            # both; the compiled decode call checks them itself before it writes anything, and the
            # kernel backend's decode kernel flags the layer instead.
            if sig and not kernels and not fused and not bool(torch.isfinite(query).all()
                                                                & torch.isfinite(k_new).all()):
                raise NonFiniteKVError("query or key states contain NaN or Inf; refusing to store them in the cache")
            if fused and self.rotation is not None and query.dtype != torch.float32:
                # the step's own token stays exact: rotated in fp32, not rounded to the model dtype
                q_pages = self.to_page_basis(query.float(), query=True)
                k_att, v_att = self.to_page_basis(k_new.float()), self.to_page_basis(v_new.float())
            else:
                q_pages = self.to_page_basis(query, query=True)
                k_att, v_att = k_store, v_store
            if fused:
                # A CPU decode step: both passes over the pages, then the step's own token, the
                # log-sum-exp merge and the significance's row factors in one compiled call.
                # With significance, LeanKV's running update of the stored tokens (§4) runs in the
                # same call, from the passes' own numerators, as the GPU decode kernel's does.
                out, lse, _, received_new = decode_attention.decode_step_attention(
                    q_pages, kv, st.q_pos, scaling, k_att, v_att, st.real, significance=sig, update_significance=True)
                out = self.from_page_basis(out)
            else:
                # Several queries: their attention among themselves follows the model's mask where one is
                # handed over (a step after the prompt gets one only where it is not plain causal, such as
                # Gemma3's bidirectional attention within an image; see leankit.hf.leankit_mask)
                own = self._own_key_mask(attention_mask, nq) if nq > 1 and attention_mask is not None else None
                out, lse, received_new = self._attend_pages(layer, kv, query, q_pages, k_new, v_new, k_att, v_att,
                                                            scaling, kernels, own)
        if self.act_store is not None:  # ACT blocks: merge attention over recomputed K/V, store the step's
            out = self.act_store.attend(layer, query, scaling, st, out, None if self._seen == 0 else lse)
        policy.store(layer, k_store, v_store, st, received_new)
        policy.after_store(layer, st)
        return out.to(query.dtype)

    def to_page_basis(self, x: torch.Tensor, query: bool = False) -> torch.Tensor:
        """Keys or values ``[..., head_dim]`` (queries with ``query=True``) in the basis the pages
        hold, ``[..., page_head_dim]``.

        With ``rotate=1`` they are rotated (:mod:`leankit.rotation`). A head the kernels cannot tile
        is padded to ``page_head_dim`` channels: keys and values repeat channel 0, so a quantization
        group that spans the whole head keeps its min and max and the real channels get the codes the
        torch backend gives them (padding that fills groups of its own is quantized on its own);
        queries are padded with zeros, so the padded channels add exactly nothing to ``q . k``.
        """
        if self.rotation is not None:  # keys and values row by row, as they are quantized from it
            x = rotate(x, self.rotation) if query else rotate_stored(x, self.rotation)
        if query:
            pad = self.page_head_dim - self.head_dim
            return torch.nn.functional.pad(x, (0, pad)) if pad else x
        return pad_repeating(x, self.page_head_dim)

    def from_page_basis(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output over the pages ``[..., page_head_dim]`` back in the model's basis
        ``[..., head_dim]``: the padded channels cut off (the padded values' weighted sum), then
        rotated back (fp32) with ``rotate=1``."""
        if self.page_head_dim != self.head_dim:
            out = out[..., : self.head_dim]
        if self.rotation is not None:
            out = unrotate(out.float(), self._unrotation)
        return out

    def _own_key_mask(self, attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
        """The block of the model's 4-D mask ``attention_mask`` (``[B, 1, Q, >= seen + Q]``: bool, or
        additive with 0 where a key is seen) over the step's own keys, as bool ``[B or 1, Q, Q]``.

        A step after the prompt attends the stored tokens by their positions, and its own keys by
        this block: where the model's mask is not causal among the step's tokens (Gemma3 lets one
        image's tokens see each other both ways), the step sees what an uncompressed cache sees.
        Device ops only (no host read). A per-head mask reaches a layer only as the decoder's own
        4-D mask, which :func:`padding_mask_of` checked to be causal on every head: head 0 serves.
        """
        past = self._seen
        if attention_mask.dim() != 4 or attention_mask.shape[2] != q_len or attention_mask.shape[3] < past + q_len:
            raise ValueError(f"the attention mask of a {q_len}-token step after {past} stored tokens must be "
                             f"[batch, 1, {q_len}, >= {past + q_len}], got {list(attention_mask.shape)}")
        block = attention_mask[:, 0, :, past:past + q_len]
        return block == 0 if block.is_floating_point() else block.bool()

    def _attend_pages(self, layer: int, kv: PagedKV, query: torch.Tensor, q_pages: torch.Tensor,
                      k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      scaling: float, kernels: bool, own: torch.Tensor | None = None):
        """:meth:`_attend` of a step after a prompt, on the paged kernels (Triton) or the torch
        path: paged attention over the earlier tokens, exact attention over the step's own, merged
        by log-sum-exp; the running significance of the stored tokens is updated. Returns
        ``(out [B, Q, Hq, F], lse [B, Hkv, G*Q], received_new)``; ``out`` is fp32, or the model's
        dtype from a kernel-backend decode step without ACT blocks (the kernel that merges the own
        token rounds it as it stores). ``k_pages``/``v_pages``: the new K/V in the pages' basis
        (:meth:`to_page_basis`).
        ``kernels``: the caller's ``use_triton(query)``. ``own``: the model's mask over the step's own
        keys (:meth:`_own_key_mask`; None: causal by position), for a step of several queries."""
        st, policy = self._step, self.policy
        sig = policy.uses_significance
        nq = query.shape[2]
        group = query.shape[1] // self.num_kv_heads
        logits = saved = None
        # The merged output leaves the kernels in the model's dtype (one rounding, in the kernel's
        # store, no conversion launch) unless ACT blocks merge more attention into it. Not for bf16
        # in Triton's interpreter, which truncates fp32 to bf16 where a GPU and torch round to
        # nearest even.
        narrow = self.act_store is None and (query.is_cuda or query.dtype != torch.bfloat16)
        if kernels and nq == 1 and self.rotation is None:
            from leankit_kernels.paged_attention import apply_score_update, decode_step_attention

            # Pages and the step's own token in the decode launch (grids from host bounds, no
            # sync), its logits kept for the fused score update; both K/V and query in the pages'
            # basis (head padding: the query's padded channels are 0, the output's are cut off).
            out, lse, saved, received_new = decode_step_attention(
                q_pages, kv, st.q_pos, scaling, k_pages, v_pages, st.real, significance=sig,
                page_bounds=self.page_bounds(), out_dtype=query.dtype if narrow else torch.float32)
            out = self.from_page_basis(out)
            if sig:  # LeanKV §4 running significance from the decode kernel's own logits
                apply_score_update(kv, saved, lse, st.q_pos, st.real)
            return out, lse, received_new
        per_call = 0
        if sig and not kernels and nq > LOGITS_QUERY_LIMIT:
            per_call = decode_attention.step_logits_queries(kv, group, query.device)
            if 0 < per_call < nq:
                # A long step on the compiled passes in query chunks, each keeping its logits for
                # the significance (no second pass over the keys), merged chunk by chunk.
                out, lse, received_old, received_new = long_step_attention(
                    q_pages, query, k_new, v_new, kv, st.q_pos, st.real, scaling, per_call, own_mask=own,
                    from_page_basis=self.from_page_basis)
                policy.update_scores(layer, st, received_old)
                return out, lse, received_new
        if kernels:
            from leankit_kernels.paged_attention import paged_attention

            if nq == 1:  # rotated decode: grids from host bounds (no sync); logits kept for the score update
                # the output goes on in fp32 (rotated back), so it is written in fp32
                res = paged_attention(q_pages, kv, st.q_pos, scaling, save_logits=sig,
                                      page_bounds=self.page_bounds(), out_dtype=torch.float32)
                out_old, lse_old, saved = res if sig else (*res, None)
            else:
                out_old, lse_old = paged_attention(q_pages, kv, st.q_pos, scaling)
        elif sig and (nq <= LOGITS_QUERY_LIMIT or per_call >= nq):
            # few queries, or logits that fit one call: keep them for the significance update
            out_old, lse_old, logits = paged_attention_ref(q_pages.float(), kv, st.q_pos, scaling,
                                                           return_logits=True, live_slots=True)
        else:
            out_old, lse_old = paged_attention_ref(q_pages.float(), kv, st.q_pos, scaling)
        out_old = self.from_page_basis(out_old)
        if nq == 1 and kernels:  # the step's own token and the merge in one launch, not ~20
            from leankit_kernels.own_token import merge_own_token

            # rotated pages: the paged output was rotated back first, the own token merges in the
            # model's basis (exact, unrotated) and the merge rounds to the model's dtype
            out, lse, received_new = merge_own_token(
                query, k_new, v_new, out_old, lse_old, st.real, scaling, received=sig,
                out_dtype=query.dtype if narrow else torch.float32)
        elif not sig and not kernels and serves_merged_step(*query.shape[:3], query.device):
            # a short step (a draft's verify step, a short turn): own tokens and merge in one pass
            out, lse = step_attention_merged(query, k_new, v_new, st.q_pos, st.real, scaling, out_old, lse_old, own)
            received_new = None
        else:
            out_new, lse_new, received_new = step_attention(query, k_new, v_new, st.q_pos, st.real, scaling,
                                                            lse_other=lse_old, received=sig, own_mask=own)
            out, lse = merge_attention(out_old, lse_old, out_new, lse_new)
        if sig and saved is not None:
            from leankit_kernels.paged_attention import apply_score_update

            # LeanKV §4 running significance, updated in place from the decode kernel's own
            # logits with the merged lse: no second pass over the keys.
            apply_score_update(kv, saved, lse, st.q_pos, st.real)
        elif sig:
            if logits is not None:
                received_old = received_from_logits(logits, lse, group, st.real)
            else:
                received_attention = received_attention_ref
                if kernels:
                    from leankit_kernels.prefill_attention import received_attention
                received_old = received_attention(q_pages, kv, st.q_pos, scaling, lse, q_valid=st.real)
            policy.update_scores(layer, st, received_old)
        return out, lse, received_new

    # ------------------------------------------------------------------ lifecycle
    @inference_only
    def release(self, rows: torch.Tensor, defer: bool = False) -> int | None:
        """Finish the rows where ``rows[b]`` is true: return all their pages to the free list.

        ``rows``: a bool mask ``[B]`` of the batch's rows; anything else (row indices, whose
        ``torch.tensor([2])`` would broadcast as a mask to every row) raises ``ValueError`` and
        changes nothing. Returns the pages freed. ``defer`` (kernel backend, no offload): release
        without reading anything back to the host; the free list's host counters catch up at their
        next read, and None is returned.
        """
        if self.table is None:
            return 0
        rows = torch.as_tensor(rows, device=self.device)
        batch = self.table.shape[1]
        if rows.dtype != torch.bool or tuple(rows.shape) != (batch,):
            # an index tensor would pass as a mask: torch.tensor([2]) -> [True] broadcasts to every row
            raise ValueError(f"release takes a bool mask of the batch's {batch} rows (True: release the row), got "
                             f"a {rows.dtype} tensor of shape {tuple(rows.shape)}; for row indices idx pass "
                             f"torch.zeros({batch}, dtype=torch.bool).index_fill_(0, idx, True)")
        if defer:
            if not use_triton(self.table.tables) or self.offload is not None:
                raise ValueError("a deferred release needs the kernel backend, without offload")
            self.table.release_sequences(rows, self.free_list, defer=True)
            if self.act_store is not None:
                self.act_store.release(rows, defer=True)
            self.finished |= rows
            return None
        if self.offload is not None:  # pages prefetched for the step are re-read after the release
            self.offload.abandon_prefetch()
        freed = self.table.release_sequences(rows, self.free_list)
        if self.act_store is not None:  # ACT pages of the rows (leankit.act_store)
            freed += self.act_store.release(rows)
        self.finished |= rows
        if self.offload is not None:  # the rows' resident pages give back their device slots now
            self.offload.prune_resident()
        return freed

    @inference_only
    def reset(self) -> None:
        """Free every page and forget all sequences (the pool itself is kept)."""
        if self.table is not None:
            self.table.release_sequences(torch.ones(self.table.shape[1], dtype=torch.bool, device=self.device),
                                         self.free_list)
        self.table, self.finished, self._seen, self._step, self._pending = None, None, 0, None, {}
        self.ending = self._ending_next = self._last_pos = self._last_mask = None
        self._plain_saved = []
        self._hw_tokens = 0
        self._peak = (0, 0)  # a reused cache reports its own runs' peak
        self._kv_err.zero_()
        self.policy.reset()
        if self.offload is not None:
            self.offload.reset()
        self.layers = self._build_layers()  # fresh plain layers; LeanLayers hold no state

    @inference_only
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes a copy of row ``beam_idx[i]``.

        Rows may be duplicated, so pages are copied (never shared): every new row gets fresh
        pages in one batched allocation, the page bytes are copied, and the old pages are freed.
        Unlike a decode step, this reads the device (about five times: the allocation's and the
        release's counts, and the copy's page lists), so a beam-search step on a GPU stalls more
        than once.
        """
        if self.table is not None:  # before anything moves: a refused reorder leaves the cache as it was
            batch = self.table.shape[1]
            idx = torch.as_tensor(beam_idx)
            if idx.dim() != 1 or idx.shape[0] != batch or idx.is_floating_point() or idx.dtype == torch.bool:
                raise ValueError(f"reorder_cache: beam_idx must be an integer tensor [{batch}] (one source row per "
                                 f"row of this cache), got {idx.dtype} {tuple(idx.shape)}")
            if batch and not bool(((idx >= 0) & (idx < batch)).all()):
                raise ValueError(f"reorder_cache: beam_idx {idx.tolist()} names rows outside [0, {batch})")
        if self.offload is not None:  # a clear error where the host tier cannot reorder (leankit.offload)
            self.offload.check_reorder()
        self._reorder_pages(beam_idx)  # may raise PoolExhausted, before any plain layer moved
        for layer in self.layers:
            if not isinstance(layer, LeanLayer):
                layer.reorder_cache(beam_idx)

    def _reorder_pages(self, beam_idx: torch.LongTensor) -> None:
        if self.table is None:
            return
        beam_idx = beam_idx.to(self.device).long()
        old = self.table
        new = BidirectionalPageTable(*old.shape, self.row_len, self.device)
        src_pages = old.n_pages.index_select(2, beam_idx)
        if self.act_store is not None and self.fixed_pool:
            # The ACT blocks are reordered after the KV pages (HybridPolicy.reorder), once the old KV
            # pages are back in the pool; a short pool refusing them there would leave the KV rows
            # reordered and the ACT rows not. Count both grants now, before anything moves.
            free = self.free_list.num_free
            kv_need, kv_back, act_need = torch.stack(  # one host read for the three counts
                (src_pages.sum(), old.n_pages.sum(), self.act_store.reorder_pages(beam_idx))).tolist()
            need = kv_need - kv_back + act_need
            if kv_need <= free < need:  # (a KV grant the pool cannot serve refuses below, as it did)
                raise PoolExhausted(need, free, self.free_list.capacity, " to copy its KV pages and ACT blocks")
        saved_table, self.table = self.table, new
        try:
            self.grow_pages(src_pages)
        except PoolExhausted:
            self.table = saved_table
            raise
        src_rows = old.tables.index_select(1, beam_idx)
        used = new.tables >= 0
        dst_ids = new.tables[used].long()
        src_ids = src_rows[used].long()
        self.pool.storage[dst_ids] = self.pool.storage[src_ids]
        new.lens = old.lens.index_select(2, beam_idx).clone()
        old.release_sequences(torch.ones(old.shape[1], dtype=torch.bool, device=self.device), self.free_list)
        self.finished = self.finished.index_select(0, beam_idx)
        self.ending = self.ending.index_select(0, beam_idx)
        self._last_pos = self._last_pos.index_select(0, beam_idx)
        if self._last_mask is not None and self._last_mask.shape[0] > 1:
            self._last_mask = self._last_mask.index_select(0, beam_idx.to(self._last_mask.device))
        self.policy.reorder(beam_idx)

    # ------------------------------------------------------------------ rollback
    def _crop_blocker(self) -> str | None:
        """Why this cache cannot drop its newest tokens (None: it can). Only the ``full`` policy
        keeps every token where it was stored, in arrival order, with nothing else derived from it."""
        if self.cfg.policy != "full":
            return (f"policy {self.cfg.policy!r} moves, evicts or scores tokens as steps go, which dropping the "
                    "newest tokens would not undo")
        if self.act_store is not None:
            return "its ACT blocks hold activations of tokens on their own pages"
        if self.offload is not None:
            return "an offloaded cache streams its pages between host and device"
        return None

    def _plain_layer_states(self) -> list[tuple]:
        """``(layer, its attributes)`` of each plain (sliding-window) layer: what
        :func:`_restore_layer_states` puts back after a dropped step or a refused crop."""
        return [(layer, dict(layer.__dict__)) for layer in self.layers if not isinstance(layer, LeanLayer)]

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can drop the newest tokens (transformers asks before assisted and
        prompt-lookup decoding): a ``full``-policy cache (``FP16``, ``K8V4`` ...) without ACT
        blocks or offload, whose sliding-window layers can crop too."""
        return self._crop_blocker() is None and all(
            getattr(layer, "is_croppable", False) for layer in self.layers if not isinstance(layer, LeanLayer))

    @inference_only
    def crop(self, max_length: int) -> None:
        """Drop the newest tokens of every row: how assisted and prompt-lookup decoding roll back the
        draft tokens the model rejected.

        ``max_length < 0`` drops ``-max_length`` tokens (transformers >= 5.25 calls it so), a
        positive one keeps the first ``max_length`` (the older spelling), ``0`` drops none. The
        dropped columns must hold a real token of every row, as they do in generate (the masks the
        steps brought say so: a column of padding there, or a row that ended on an EOS, is
        refused). Pages the kept tokens no longer fill return to the pool (one device read). No
        row is left waiting on an EOS: one whose kept last token is an EOS ends at its next EOS,
        not at padding.
        Raises ``NotImplementedError`` for a cache that cannot roll back (:attr:`is_croppable`),
        ``ValueError`` for a bad length; a refused call changes nothing.
        """
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"crop takes an int, got {type(max_length).__name__}")
        why = self._crop_blocker()
        if why is not None:
            raise NotImplementedError(f"this LeanCache cannot crop: {why}. A 'full'-policy config such as "
                                      "'FP16' or 'K8V4' without ACT blocks or offload can")
        if self._step is not None:
            raise RuntimeError("crop was called inside a forward step")
        seen = self._seen
        drop = -max_length if max_length < 0 else (max(seen - max_length, 0) if max_length > 0 else 0)
        if drop > seen:
            raise ValueError(f"crop({max_length}) drops {drop} tokens of a cache that has seen {seen}")
        if drop and self.table is not None:
            self._check_dropped_columns_real(drop)
        # Sliding-window layers first (their own crop, transformers' rules): restored if one refuses
        saved = self._plain_layer_states()
        try:
            # handed the count to drop, whichever spelling came in: transformers >= 5.25 refuses a
            # positive length there; a positive length that drops nothing leaves them, as the pages
            # (crop(0) still reaches them: transformers' layers may trim to their window there)
            if max_length <= 0 or drop:
                for layer, _ in saved:
                    layer.crop(-drop)
        except BaseException:
            _restore_layer_states(saved)
            raise
        if drop == 0:
            return
        self._seen = seen - drop
        if self._last_mask is not None:
            self._last_mask = self._last_mask[:, : self._last_mask.shape[1] - drop]
        if self.table is None:
            return
        # full policy: every stored token sits in the high tier in arrival order, so the newest
        # `drop` are the last `drop` slots of each head; slots past a head's length are dead
        self.table.lens[HIGH].sub_(drop)
        self.policy.real_seen.sub_(drop)
        self.trim_pages()
        if self.ending is not None:  # the token a row was fed last is gone with the step that fed it
            self.ending.zero_()
        self._last_pos = self._stored_last_positions()

    def _check_dropped_columns_real(self, drop: int) -> None:
        """Raise ``ValueError`` unless every row stored a real token in each of the newest ``drop``
        columns (host reads; before anything changes)."""
        if self.finished is not None and bool(self.finished.any()):
            raise ValueError("crop cannot roll back a batch in which a row ended on an EOS token (its pages were "
                             "freed and it stores no more tokens)")
        mask = self._last_mask  # the whole sequence's (sequence_mask)
        if mask is not None and (mask.shape[1] < drop or not bool(mask[:, mask.shape[1] - drop:].bool().all())):
            raise ValueError(f"crop drops the newest {drop} columns, but the attention masks of the steps that fed "
                             "them do not show a real token of every row in each (padding there stores nothing "
                             "to drop)")
        lens, real = self.table.lens, self.policy.real_seen
        if bool((lens[HIGH] != real.view(1, -1, 1)).any()) or (lens.shape[0] > 1 and bool(lens[LOW].any())) \
                or bool((real < drop).any()):
            raise ValueError(f"crop drops {drop} tokens per row, more than some row's stored tokens or not all "
                             "of them the newest")

    def _stored_last_positions(self) -> torch.Tensor:
        """Highest stored position of each row (int64 ``[B]``, -1 for none), read from the pages."""
        from .policy import read_tier_meta

        if self.num_layers == 0:
            return torch.full_like(self._last_pos, -1)
        meta = read_tier_meta(self, HIGH, torch.zeros(1, dtype=torch.long, device=self.device))
        pos = torch.where(meta.valid, meta.pos.long(), torch.full((), -1, dtype=torch.long, device=self.device))
        return pos.flatten(2).amax(-1)[0] if pos.shape[-1] else torch.full_like(self._last_pos, -1)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """The ``Cache`` API's row expansion (each row repeated ``repeats`` times): a no-op on a fresh
        cache; a filled one refuses (its pages would have to be copied per row), so expand the inputs
        and start from a fresh cache instead."""
        if self.table is not None:
            raise NotImplementedError("LeanCache cannot expand a filled cache; expand the inputs instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """The ``Cache`` API's row selection: a no-op on a fresh cache, which holds no row to select
        (as ``DynamicCache``); a filled one refuses, so select the inputs instead."""
        if self.table is not None:
            raise NotImplementedError("LeanCache cannot select rows of a filled cache; select the inputs instead")

    # ------------------------------------------------------------------ reporting
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical tokens seen per row (padding included, as ``DynamicCache`` counts them)."""
        return self._seen

    def memory_report(self) -> MemoryReport:
        """Exact memory accounting of the cache: a dict (with a readable ``str``).

        Bytes (every ``*_bytes`` key is in bytes):
            ``kv_bytes``: pages in use (``pages_used`` x ``page_size``), every byte of each page;
            ``table_bytes``: page-table metadata; ``plain_bytes``: K/V held by uncompressed
            (sliding-window) layers, in the model's dtype; ``total_bytes``: the sum of the three;
            ``pool_bytes``: the whole pool, in use or free.
        Baselines, for the same real tokens (padding excluded) of the live rows:
            ``fp16_bytes``: an fp16 ``DynamicCache``; ``dense_bytes``: a ``DynamicCache`` in the
            model's own dtype ``dense_dtype`` (an fp32 model keeps fp32 K/V, twice fp16, and so
            does ``FP16`` on it: 16 bits means "unquantized", kept in the model's dtype).
            The plain layers count the same in the baselines as in the total.
        Ratios: ``ratio`` = total_bytes / fp16_bytes, ``dense_ratio`` = total_bytes / dense_bytes,
            ``pages_ratio`` = bytes of every page in use (with ACT blocks, their pages too: ``kv_bytes``
            then counts the KV pages alone) / fp16 bytes of the compressed layers.
        Tokens: ``tokens_per_row`` real tokens each row has seen (0 for a finished row);
            ``tokens_per_tier`` high/low/pruned tokens summed over rows and averaged over the
            compressed layers and KV heads (all high: equals ``sum(tokens_per_row)``; all 0 on a
            model with no compressed layer, whose every layer slides);
            ``slots_per_tier`` the same as raw (token, layer, KV head) slot counts.
        Peak: ``peak_kv_bytes``/``peak_ratio``, pages against the fp16 bytes of the compressed
            layers at the step that used the most pages (finished requests still show).
        Also ``config``, ``pages_used``, ``pages_total``, ``page_size``, ``compressed_layers``,
        ``plain_layers``, ``model_layers``. With ``offload``, ``offload`` holds the host tier
        (``host_pages``/``host_bytes``: every page in use lives there), the device working set
        (``device_pages_peak``, ``device_pages_budget``) and the bytes copied, counted where each
        copy is issued: ``h2d_bytes_step``/``d2h_bytes_step`` of the last step, ``*_total`` and
        ``bytes_per_step`` (``(h2d, d2h)`` per step).
        """
        pages_used = self.free_list.capacity - self.free_list.num_free
        kv_bytes = pages_used * self.cfg.page_size
        if self.table is None:
            rows, high, low = [], 0, 0
        else:
            high = int(self.table.lens[HIGH].sum())
            low = int(self.table.lens[LOW].sum())
            rows = [int(x) for x in self.policy.logical_tokens().tolist()]
        slots = self.num_layers * self.num_kv_heads
        logical_slots = sum(rows) * slots
        pruned = max(logical_slots - high - low, 0)
        table_bytes = self.table.nbytes() if self.table is not None else 0
        plain = [layer for layer in self.layers if not isinstance(layer, LeanLayer)]
        plain_elems = sum(t.numel() for layer in plain for t in (layer.keys, layer.values) if t is not None)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        compressed_fp16 = self._fp16_bytes()
        fp16 = compressed_fp16 + plain_elems * 2
        dense = compressed_fp16 // 2 * itemsize + plain_elems * itemsize
        total = kv_bytes + table_bytes + plain_elems * itemsize

        def div(a, b):
            return a / b if b else float("nan")

        report = MemoryReport(
            config=self.cfg.label(), pages_used=pages_used, pages_total=self.pool.num_pages,
            page_size=self.cfg.page_size, kv_bytes=kv_bytes, table_bytes=table_bytes,
            plain_bytes=plain_elems * itemsize, total_bytes=total, pool_bytes=self.pool.num_pages * self.cfg.page_size,
            fp16_bytes=fp16, dense_bytes=dense, dense_dtype=str(self.dtype).removeprefix("torch."),
            ratio=div(total, fp16), dense_ratio=div(total, dense), pages_ratio=div(kv_bytes, compressed_fp16),
            tokens_per_row=rows,
            tokens_per_tier={tier: n / slots if slots else 0.0
                             for tier, n in (("high", high), ("low", low), ("pruned", pruned))},
            slots_per_tier={"high": high, "low": low, "pruned": pruned},
            compressed_layers=self.num_layers, plain_layers=len(plain), model_layers=self.model_layers,
            peak_kv_bytes=self._peak[0], peak_ratio=div(self._peak[0], int(self._peak[1])),
        )
        if self.act_store is not None:  # KV and ACT bytes apart (leankit.act_store)
            report = self.act_store.report(report)
        if self.offload is not None:  # host tier, device peak, bytes moved per step (leankit.offload)
            report = self.offload.report(report)
        return report

    def token_bytes(self) -> dict:
        """Page bytes per token and layer as KV pages of this config and as an ACT block (for planners)."""
        from .act_store import token_bytes

        return token_bytes(self, self.act_hidden)

    def _fp16_bytes(self, as_tensor: bool = False):
        """Bytes an fp16 DynamicCache would hold for the live rows' real tokens (an int, or with
        ``as_tensor`` a device scalar that is not read back)."""
        if self.table is None:
            return 0
        logical = self.policy.logical_tokens().sum() * (self.num_layers * self.num_kv_heads
                                                         * fp16_token_bytes(self.head_dim))
        return logical if as_tensor else int(logical)
