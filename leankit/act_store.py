"""The KV/ACT hybrid inside LeanCache: which tokens are stored as activations, and how they are read.

HybridServe (§3.3-4.3) and CAPTURE keep part of each request's context as *activation blocks*
(ACT): the input hidden state of every decoder layer (before its input norm), from which the
layer's K/V are recomputed when attention needs them (``K, V = norm(A) [Wk Wv]`` + k_norm + RoPE,
:mod:`leankit.recompute`). KVPR (§3) does the same for a prefix of the context. With
``KVConfig.act = f`` a LeanCache stores a fraction ``f`` of each sequence's context this way and
the rest as KV pages of its precision (``"FP16:act=1"`` is ACT-only, ``"K8V4:act=0.5"`` half
activations, half K8V4 pages).

Placement (the same for every layer of a sequence; prompt and generated tokens alike):

* **block**: ``T`` consecutive real tokens of a row, ``T`` = the tokens one ACT page holds
  (:class:`leankit.pages.ActLayout`), so an ACT block is exactly one set of ``S`` slice pages.
* ``act_order="ratio"`` (HybridServe Eq. 11, ``#ACT_req : #KV_req = #ACT_Host : #KV_Host``):
  each new block goes where it keeps the row's ``#ACT : #KV`` closest to ``f : 1 - f``
  (:func:`next_block_is_act`; ties go to ACT). The paper's example, a 3:1 ratio with five ACT and
  two KV blocks present, puts the next block in ACT. The rule is a function of the block index
  only: the first ``n`` blocks hold ``round(f * n)`` ACT blocks (:func:`act_blocks`).
* ``act_order="prefix"`` (KVPR's split): the first ``round(f * n)`` real tokens of a row are ACT
  and the rest KV, ``n`` being the row's length after its first step (its prompt). KVPR picks the
  split per step over a cache that holds both forms; a cache that stores each token once can only
  move the split over tokens it has not stored yet, so the split keeps growing with later tokens
  only while the row holds no KV token (``f = 1`` stays ACT-only).

``round`` is round-half-up, in exact integer arithmetic on ``f`` as a fraction.

Mechanics (data flows one way, as for KV pages):

* :func:`install_capture` (called by :func:`leankit.enable`) puts a forward pre-hook on every
  decoder layer: when the layer's cache is a LeanCache with ACT, the hook hands the layer's input
  hidden state to :meth:`ActStore.capture`, which keeps the step's ACT tokens (no transformers
  code is changed).
* :class:`HybridPolicy` wraps the placement policy: it decides each new token's kind at
  ``begin_step``, gives the wrapped policy a step view holding only the KV tokens (so it plans,
  allocates and stores only those), and allocates the ACT blocks in the same unified pool.
* :meth:`ActStore.attend` recomputes the K/V of the layer's ACT tokens of earlier steps (one
  layer at a time: the reference on CPU, the fused Triton kernel on CUDA), attends to them with
  the rule pages use (key visible iff stored and ``pos <= query pos``) and merges the result into
  the paged-plus-new partial by log-sum-exp (:func:`leankit.attention.merge_attention`); then it
  writes the step's ACT tokens into their pages.

On the kernel backend a decode step reads nothing back inside it (one host read per step, at its
end, as for KV pages): the ACT grant is deferred (a short fixed pool raises ``PoolExhausted`` from
``end_step`` and the step is dropped), the captured state is kept whole and written under a keep
flag instead of picked by the bool mask, and the bound on earlier ACT tokens that sizes the
recompute rides on that end-of-step read.

What does not compose: ACT needs policy ``full``. LeanKV's per-head pruning and tier moves,
H2O and StreamingLLM decide per KV head from attention significance, while an ACT block is one
vector per layer that serves every head, so a head cannot drop or downgrade its part of it; a
cache asking for both raises ``ValueError``. ``rotate=1`` composes (it changes only the basis of
the KV pages; ACT keys are recomputed in the model's own basis and attended with the unrotated
query).

Memory. Per token and layer an ACT block costs ``hidden`` values (plus an int32 position per
slice page) against ``2 * kv_heads * head_dim`` for K and V: about half for MHA models, more for
GQA models with ``hidden > 2 * kv_heads * head_dim`` (SmolLM2: 576 against 384). Asking for ACT
where its pages cost at least as much as this config's KV pages warns, and
:meth:`ActStore.token_bytes` gives both numbers so a planner can decline it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from fractions import Fraction

import torch

from .allocator import PoolExhausted
from .attention import merge_attention, softmax_sweep
from .backend import use_triton
from .config import act_kv_token_bytes
from .hf import cache_argument
from .page_table import ActPageTable
from .pages import ActLayout
from .quant import NonFiniteKVError
from .recompute import _decoder_layers, act_to_kv, layer_params, rope_tables

COMPOSES_WITH = ("full",)  # placement policies ACT blocks compose with (see the module docstring)
QUERY_CHUNK = 256  # queries per ACT attention pass (bounds the Q x N logits of long chunks)


# ============================================================================ placement
def _ratio(frac: float) -> tuple[int, int]:
    """``frac`` as an exact fraction ``p / q`` (so every rounding below is integer arithmetic)."""
    r = Fraction(frac).limit_denominator(1 << 16)
    return r.numerator, r.denominator


def act_blocks(n, frac: float):
    """ACT blocks among a row's first ``n`` blocks under ``act_order="ratio"``: ``round(frac * n)``.

    ``n`` may be an int or an integer tensor; rounding is half-up.
    """
    p, q = _ratio(frac)
    return (2 * p * n + q) // (2 * q)


def next_block_is_act(n_act: int, n_kv: int, frac: float) -> bool:
    """HybridServe Eq. 11: with ``n_act`` ACT and ``n_kv`` KV blocks present, is the next one ACT?

    The next block goes where the row's ACT count ends closest to ``frac`` times its block count
    (ACT on a tie): ``|n_act + 1 - frac (n + 1)| <= |n_act - frac (n + 1)|``, i.e.
    ``n_act + 1/2 <= frac (n + 1)``. Starting from an empty row this yields exactly
    :func:`act_blocks` ACT blocks among the first ``n``.
    """
    p, q = _ratio(frac)
    return q * (2 * n_act + 1) <= 2 * p * (n_act + n_kv + 1)


def assign_act(frac: float, order: str, rank: torch.Tensor, real: torch.Tensor, n_before: torch.Tensor,
               act_before: torch.Tensor, n_new: torch.Tensor, block: int) -> torch.Tensor:
    """bool ``[B, Q]``: which of a step's new tokens are stored as ACT.

    Args:
        rank: ``[B, Q]`` index of each token among its row's real new tokens; ``real`` ``[B, Q]``.
        n_before, act_before: ``[B]`` real tokens and ACT tokens the row stored in earlier steps.
        n_new: ``[B]`` real new tokens of the step.
        block: tokens per block (``"ratio"``).
    """
    r = n_before.view(-1, 1) + rank.long()  # the token's index among all real tokens of its row
    if order == "ratio":
        j = torch.div(r, block, rounding_mode="floor")
        act = act_blocks(j + 1, frac) > act_blocks(j, frac)
    else:  # prefix: the split moves over new tokens only while the row holds no KV token
        split = act_blocks(n_before + n_new, frac)  # round(frac * n): tokens are blocks of 1 here
        open_ = (act_before == n_before).view(-1, 1)
        act = open_ & (r < split.view(-1, 1))
    return act & real


# ============================================================================ capture
def install_capture(model) -> None:
    """Install the ACT capture pre-hook on every decoder layer of ``model`` (idempotent).

    The hook reads the layer's cache argument; it does nothing unless that is a LeanCache
    with ACT blocks, which then receives the layer's input hidden state (before the input norm).
    """
    _, layers = _decoder_layers(model)
    for i, layer in enumerate(layers):
        if not getattr(layer, "_leankit_act_hook", False):
            layer.register_forward_pre_hook(_capture_hook(i), with_kwargs=True)
            layer._leankit_act_hook = True


def _capture_hook(layer_idx: int):
    # a partial of a module-level function, not a closure: a model with the hook still pickles
    # (torch.save(model)), as a closure cannot
    return functools.partial(_capture, layer_idx)


def _capture(layer_idx: int, module, args, kwargs):
    store = getattr(cache_argument((), kwargs), "act_store", None)
    if store is not None:
        store.capture(layer_idx, args[0] if args else kwargs["hidden_states"])


# ============================================================================ attention over ACT keys
def keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
                   q_pos: torch.Tensor, scale: float, query_chunk: int = QUERY_CHUNK):
    """Exact attention of queries over explicit keys with their own positions.

    Args:
        q: ``[B, Hq, Q, F]``; ``k``/``v``: ``[B, Hkv, N, F]``; ``k_pos``/``k_valid``: ``[B, N]``.
        q_pos: ``[B, Q]``; key ``j`` is visible to query ``i`` iff ``k_valid[j]`` and
            ``k_pos[j] <= q_pos[i]`` (the rule paged attention applies).

    Returns:
        ``(out [B, Q, Hq, F] fp32, lse [B, Hkv, G*Q] fp32)`` laid out as
        :func:`leankit.attention.step_attention` returns them (query head ``h*G + g`` is row
        ``g*Q + i`` of KV head ``h``), so :func:`~leankit.attention.merge_attention` combines them.
    """
    b, hq, nq, f = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for q0 in range(0, nq, query_chunk):
        q1 = min(nq, q0 + query_chunk)
        qg = q[:, :, q0:q1].float().reshape(b, hkv, g * (q1 - q0), f)
        qp = q_pos[:, q0:q1].long().repeat(1, g)  # row g*Qc + i -> query i
        s = torch.matmul(qg, kf.transpose(-1, -2)) * scale  # [B, Hkv, G*Qc, N]
        vis = k_valid.view(b, 1, 1, -1) & (k_pos.long().view(b, 1, 1, -1) <= qp.view(b, 1, -1, 1))
        # a query that sees no key gets output 0 and lse -inf (merge gives it no weight)
        o, lse, _, _ = softmax_sweep(s.masked_fill_(~vis, float("-inf")), vf)
        outs.append(o.view(b, hkv, g, q1 - q0, f))
        lses.append(lse.view(b, hkv, g, q1 - q0))
    out = torch.cat(outs, 3).reshape(b, hq, nq, f).transpose(1, 2)
    return out, torch.cat(lses, 3).reshape(b, hkv, g * nq)


# ============================================================================ the store
def rope_groups(params: list) -> list[int]:
    """For each layer's :class:`~leankit.recompute.ActToKVParams`, the index of the first layer
    that rotates with the same table (frequencies and scaling; layers without RoPE form one group).
    Each layer's frequencies are read to the host once, when the store is built."""
    keys = [None if p.inv_freq is None else (p.rope_scaling, tuple(p.inv_freq.tolist())) for p in params]
    return [keys.index(k) for k in keys]


def token_bytes(cache, hidden: int) -> dict:
    """Page bytes per token and layer of a KV token of ``cache``'s config and of an ACT token.

    ``{"kv", "act", "act_over_kv", "act_saves"}`` (:func:`leankit.config.act_kv_token_bytes` at the
    cache's dtype and page size); what a planner reads to decline ACT.
    """
    itemsize = torch.empty((), dtype=cache.dtype).element_size()
    # KV pages hold heads at the width the cache pads them to (LeanCache.page_head_dim)
    return act_kv_token_bytes(cache.page_cfg, hidden, cache.num_kv_heads, cache.page_head_dim, itemsize)


class ActStore:
    """The ACT blocks of one LeanCache: pages, per-row counters, capture, recompute-attention.

    Built by :func:`attach`; reached through ``cache.act_store``.
    """

    def __init__(self, cache, model):
        cfg = cache.cfg
        self.cache = cache
        self.frac, self.order = float(cfg.act), cfg.act_order
        # The store, like the page table, indexes the compressed layers only: a model with sliding
        # layers (Gemma3, Qwen2 with max_window_layers) keeps their own cache, so page-table layer t
        # is decoder layer compressed[t]. Captures arrive under the decoder index (see capture).
        self.compressed = cache.compressed_layers
        # stacked [Wk Wv] (+ biases, norms, RoPE) per compressed layer: copies, so they are read again
        # when the model's weights change under the cache (_refresh_params)
        self._model = model
        self.params = [layer_params(model, g) for g in self.compressed]
        self._weights_seen = self._weights_key()
        self.layout = ActLayout.build(cache.act_hidden, cache.dtype, cfg.page_size)
        self.block = self.layout.tokens
        self.bytes = token_bytes(cache, cache.act_hidden)
        self.table: ActPageTable | None = None
        self.n_real: torch.Tensor | None = None  # long [B]: real tokens stored per row (KV + ACT)
        self.n_act: torch.Tensor | None = None  # long [B]: ACT tokens stored per row
        self._mask = self._rank = self._n_new = None  # this step's placement
        self._n_max = 0  # most ACT tokens of any row before this step (a host bound)
        # Kernel backend: the most ACT tokens of any row once the last step stored its tokens,
        # read in the cache's one host read per step (HybridPolicy.step_status), not by a sync here.
        self._n_max_read = 0
        self._dense = False  # this step lists every (row, query) with a keep flag (no host read)
        # layer -> the step's captured input: its ACT rows [n, D], or the whole [B, Q, D] when _dense
        self._stash: dict[int, torch.Tensor] = {}
        # RoPE tables of this step's earlier ACT keys, one per distinct rotary table (every cached
        # layer of the supported models shares one; Gemma3's sliding layers, which differ, are not cached)
        self._rope: dict[int, tuple] = {}
        self._rope_group = rope_groups(self.params)
        self._ahead: dict[int, tuple] = {}  # layer -> K/V recomputed before its attention (offload)

    def __deepcopy__(self, memo):
        """A copy of the store's state that shares the model and the stacked weights with the
        original: they are read only (replaced, never edited, when the weights change), and a
        prefix cache copied per continuation would otherwise copy the whole model each time."""
        memo[id(self._model)] = self._model
        memo[id(self.params)] = self.params
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for name, value in self.__dict__.items():
            setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    def __getstate__(self):
        # Pickling would carry the whole model (the store recomputes K/V through it), hooks included,
        # which fails deep inside pickle with a message about a local function; say so here instead.
        raise TypeError("a LeanCache with ACT blocks (act > 0) cannot be pickled: it recomputes K/V through "
                        "the model, which does not travel with it; copy.deepcopy works (it shares the "
                        "model), or pickle a cache without act")

    def check_model(self, decoder) -> None:
        """Raise ``ValueError`` unless ``decoder`` is the decoder stack of the model this store was
        built for. A KV page holds the K/V the running model computed, so any model of the cache's
        shape serves; an ACT block is recomputed with the stacked weights of the cache's own model,
        and another model of the same shape would attend to keys it never computed."""
        if decoder is not _decoder_layers(self._model)[0]:
            raise ValueError("this LeanCache has ACT blocks, whose K/V it recomputes with the weights of the model it "
                             "was built for, but it is used with another model (of the same shape): build a "
                             "LeanCache for this model")

    # -------------------------------------------------------------- bytes
    def token_bytes(self) -> dict:
        """Page bytes per token and layer of each kind, ``{"kv", "act", "act_over_kv", "act_saves"}``."""
        return dict(self.bytes)

    # -------------------------------------------------------------- step
    def _weights_key(self) -> tuple:
        """Which tensors the compressed layers and the rotary tables hold now, and their in-place
        versions: a ``load_state_dict``, ``model.to(dtype)`` or in-place edit changes it. An edit
        through ``.data`` does not: autograd gives ``.data`` its own version counter, and comparing
        the weights' values at every prompt would cost a read of every K/V projection (README)."""
        base, layers = _decoder_layers(self._model)
        tensors = [t for g in self.compressed for t in layers[g].parameters()]
        tensors += [t for name, child in base.named_children() if "rotary" in name for t in child.buffers()]
        return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)

    def _refresh_params(self) -> None:
        """Read ``[Wk Wv]``, norms and RoPE again where the model's weights changed since they were
        stacked (checked at a prompt or a new turn, not at every decode step: host work per tensor)."""
        key = self._weights_key()
        if key != self._weights_seen:
            self.params = [layer_params(self._model, g) for g in self.compressed]
            self._rope_group = rope_groups(self.params)
            self._weights_seen = key

    def plan(self, step):
        """Decide the kinds of the step's tokens, allocate ACT blocks; return the KV-only step view."""
        cache = self.cache
        if step.q_len > 1 or cache._seen == 0:  # a generate call starts: the weights may have changed
            self._refresh_params()
        dev = cache.device
        batch = step.real.shape[0]
        if self.table is None:
            self.table = ActPageTable(cache.num_layers, batch, cache.max_seq_len, self.layout.slices,
                                      self.layout.tokens, dev)
            self.n_real = torch.zeros(batch, dtype=torch.long, device=dev)
            self.n_act = torch.zeros(batch, dtype=torch.long, device=dev)
        mask = assign_act(self.frac, self.order, step.rank, step.real, self.n_real, self.n_act, step.n_new.long(),
                          self.block)
        n_act_new = mask.sum(1)
        extra = self.table.blocks_needed(n_act_new.view(1, -1).expand(cache.num_layers, -1))
        # The kernel backend reads nothing back inside a step (leankit.cache: one host read per step,
        # at its end). The grant is deferred like the KV pages' (a short pool raises from end_step,
        # the step dropped), and the ACT tokens of earlier steps are bounded by the count that read
        # carried. Deferring needs a host proof that no row outgrows its ACT row: a row holds at most
        # the tokens it was fed, ``ceil(n / T)`` blocks.
        self._dense = use_triton(cache._kv_err)
        blocks_bound = -(-cache._hw_tokens // self.block)
        defer = self._dense and blocks_bound * self.layout.slices <= self.table.row_len
        # A row's new ACT tokens (at most Q) fill what its last block has left, then ceil(Q / T) blocks.
        pages_bound = extra.numel() * -(-step.q_len // self.block) * self.layout.slices
        deferred_ok = cache.grow_pages(extra, table=self.table, defer=defer, bound=pages_bound)
        self._extra, self.deferred_grant = extra, deferred_ok is not None
        self._mask, self._rank, self._n_new = mask, torch.cumsum(mask.int(), 1) - 1, n_act_new
        if self._dense:
            self._n_max = self._n_max_read
        else:
            self._n_max = int(self.n_act.max()) if self.n_act.numel() else 0
        self._stash, self._rope, self._ahead = {}, {}, {}
        kv = step.real & ~mask
        # Its own derived indices: the step's would list the ACT tokens too.
        return dataclasses.replace(step, real=kv, rank=torch.cumsum(kv.int(), 1) - 1, n_new=kv.sum(1), derived={})

    def granted_pages(self) -> int:
        """Pages of the ACT blocks this step's plan asked for (a host read: failure paths only)."""
        return int(self._extra.sum()) * self.layout.slices

    def end_step(self, step) -> None:
        """Advance the per-row counters once every layer stored the step."""
        self.n_real += step.n_new.long()
        self.n_act += self._n_new
        self._stash, self._rope, self._ahead = {}, {}, {}

    def step_status(self) -> torch.Tensor:
        """The most ACT tokens of any row once this step is stored (device ``[1]``), for the
        cache's one host read at the end of a kernel-backend step; :meth:`take_status` receives it."""
        after = self.n_act + self._n_new
        return after.max().reshape(1) if after.numel() else torch.zeros(1, dtype=torch.long, device=after.device)

    def take_status(self, n_max: int) -> None:
        """Receive :meth:`step_status` as read on the host: the next step's bound on earlier ACT tokens."""
        self._n_max_read = int(n_max)

    def recompute_ahead(self, layer: int) -> None:
        """Recompute ``layer``'s earlier ACT tokens' K/V now, as soon as their pages are on the device
        (the offload pipeline calls it before the layer's KV pages have landed, KVPR §3.3); its
        attention then uses them. Nothing to do when the step attends over no ACT token."""
        if self._n_max > 0 and self.cache._seen > 0:  # the condition under which attend() reads them
            self._ahead[layer] = self._keys(layer)

    def capture(self, decoder_layer: int, hidden: torch.Tensor) -> None:
        """Keep decoder layer ``decoder_layer``'s input hidden state ``[B, Q, D]`` of the step's ACT
        tokens (pre-hook), under its page-table index; a sliding layer kept plain has no ACT tokens.

        The kernel backend keeps the whole ``[B, Q, D]`` state (a reference, no copy: the layer
        computes its residual out of place): picking the ACT rows with the bool mask would read the
        mask back to the host. :meth:`_store` gathers them with the step's dense index instead.
        """
        layer = self.cache.table_index[decoder_layer]
        if layer is not None and self._mask is not None and self.cache._step is not None:
            self._stash[layer] = hidden.detach() if self._dense else hidden.detach()[self._mask]

    # -------------------------------------------------------------- attention
    def _keys(self, layer: int):
        """Recomputed K/V ``[B, Hkv, N, F]`` of ``layer``'s ACT tokens of earlier steps, with positions/validity.

        ``N`` covers the whole blocks of the longest row (the step's bound on earlier ACT tokens
        rounded up to a block): a row's tokens past its length are invalid, and attention skips them.
        Projecting those few rows costs less than copying the activations to cut them off.
        """
        lay = self.layout
        blocks = -(-self._n_max // lay.tokens)
        n = blocks * lay.tokens
        ids = self.table.tables[layer, :, : blocks * lay.slices].clamp_min(0)  # rows with fewer blocks: masked
        b = ids.shape[0]
        valid = torch.arange(n, device=ids.device).view(1, -1) < self.table.lens[layer].view(-1, 1)
        # Dead rows hold stale bytes (any pattern, NaN included): they read as zeros, projected at position 0.
        act, pos = lay.read_blocks(self.cache.pool, ids.view(b, blocks, lay.slices),
                                   live=valid.view(b, blocks, lay.tokens))
        act, pos = act.view(b, n, -1), pos.view(b, n)
        params = self.params[layer]
        # pages keep the dtype the cache was built with, the weights follow model.to(dtype): exact for a
        # downcast, and a 16-bit model's activations were stored exactly in wider pages
        act = act.to(params.dtype)
        flat_pos = pos.reshape(-1)
        rope = None
        if params.has_rope:
            # One table per step and rotary table: every layer holds the same earlier ACT tokens at the same positions
            # (each layer reads them before it stores the step's own). Comparing the positions
            # instead (torch.equal) would read the device back once per layer.
            group = self._rope_group[layer]
            if group not in self._rope:
                self._rope[group] = rope_tables(params, flat_pos, act.dtype)
            rope = self._rope[group]
        k, v = act_to_kv(act.reshape(b * n, -1), flat_pos, params, rope=rope)
        k = k.view(b, n, params.num_kv_heads, -1).transpose(1, 2)
        v = v.view(b, n, params.num_kv_heads, -1).transpose(1, 2)
        return k, v, pos, valid

    def attend(self, layer: int, query: torch.Tensor, scaling: float, step, out: torch.Tensor,
               lse: torch.Tensor | None) -> torch.Tensor:
        """Merge attention over ``layer``'s earlier ACT tokens into ``(out, lse)``, then store the step's.

        ``out``/``lse``: the partial over the pages and the step's new tokens (``lse`` may be
        ``None`` when nothing was stored before the step, in which case no ACT token exists).
        Returns the merged ``out`` ``[B, Q, Hq, F]``.
        """
        if lse is not None and self._n_max > 0:
            k, v, pos, valid = self._ahead.pop(layer, None) or self._keys(layer)
            out_act, lse_act = keys_attention(query, k, v, pos, valid, step.q_pos, scaling)
            out, _ = merge_attention(out, lse, out_act, lse_act)
        self._store(layer, step)
        return out

    def _store(self, layer: int, step) -> None:
        """Write the step's captured ACT tokens of ``layer`` into their slots.

        The torch backend lists the ACT tokens (``nonzero``); the kernel backend lists every
        (row, query) of the step with a keep flag, since listing would read the mask back to the host.
        """
        if self._dense:
            b, q = self._mask.shape
            b_idx = torch.arange(b, device=self._mask.device).repeat_interleave(q)
            q_idx = torch.arange(q, device=self._mask.device).repeat(b)
            keep = self._mask.reshape(-1)
        else:
            b_idx, q_idx = self._mask.nonzero(as_tuple=True)
            if b_idx.numel() == 0:
                return
            keep = None
        act = self._stash.pop(layer, None)
        if act is None:
            raise RuntimeError(f"layer {layer}'s input activations were not captured: ACT blocks need the "
                               "decoder-layer hooks of leankit.enable(model) (run the model's own forward)")
        if self._dense:
            act = act.reshape(b * q, -1)
            # NaN/Inf activations raise the layer's device error flag, read once at the end of the
            # step (the step is dropped there), as the KV store's kernel does for K/V
            bad = (~torch.isfinite(act).all(-1) & keep).any()
            err = self.cache._layer_err(layer)
            err.copy_(err | bad.to(err.dtype))
        elif not bool(torch.isfinite(act).all()):
            raise NonFiniteKVError("layer input activations of ACT tokens contain NaN or Inf; refusing to store "
                                   "them in the cache")
        lens = self.table.lens[layer]
        slot = lens[b_idx].long() + self._rank[b_idx, q_idx].clamp_min(0)
        if self._dense:  # a token not kept may name any slot, but one inside the row
            slot = slot.clamp_max(self.table.row_len // self.layout.slices * self.layout.tokens - 1)
        ids, rows = self.table.locate(layer, b_idx, slot)
        self.layout.write(self.cache.pool, ids, rows, act, step.q_pos[b_idx, q_idx], keep=keep)
        lens += self._n_new.to(lens.dtype)

    # -------------------------------------------------------------- lifecycle
    def save_state(self):
        return None if self.table is None else self.table.lens.clone()

    def load_state(self, saved) -> None:
        if saved is not None:
            self.table.lens.copy_(saved)
        self._stash = {}

    def release(self, rows: torch.Tensor, defer: bool = False) -> int | None:
        """Return the ACT pages of finished rows; returns the page count (None with ``defer``: a
        release that reads nothing back, kernel backend only)."""
        if self.table is None:
            return 0
        return self.table.release_sequences(rows.to(self.cache.device).bool(), self.cache.free_list, defer=defer)

    def reset(self) -> None:
        """Free every ACT page and forget all rows."""
        if self.table is not None:
            self.release(torch.ones(self.table.lens.shape[1], dtype=torch.bool, device=self.cache.device))
        self.table = self.n_real = self.n_act = self._mask = self._rank = self._n_new = None
        self._stash, self._rope, self._n_max, self._n_max_read, self._ahead = {}, {}, 0, 0, {}

    def reorder_pages(self, beam_idx: torch.Tensor) -> torch.Tensor:
        """Pages :meth:`reorder` takes from the pool for ``beam_idx``, before it frees the old ones
        (a 0-d int64 tensor on the cache's device: the caller reads it with its own counts)."""
        if self.table is None:
            return torch.zeros((), dtype=torch.int64, device=self.cache.device)
        return self.table.n_pages.index_select(1, beam_idx.to(self.table.n_pages.device)).sum().to(torch.int64)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` becomes a copy of row ``beam_idx[i]`` (fresh pages, bytes copied)."""
        if self.table is None:
            return
        old, lay = self.table, self.layout
        new = ActPageTable(*old.lens.shape, self.cache.max_seq_len, lay.slices, lay.tokens, self.cache.device)
        self.cache.grow_pages(old.n_blocks.index_select(1, beam_idx), table=new)
        used = new.tables >= 0
        src = old.tables.index_select(1, beam_idx)[used].long()
        self.cache.pool.storage[new.tables[used].long()] = self.cache.pool.storage[src]
        new.lens = old.lens.index_select(1, beam_idx).clone()
        old.release_sequences(torch.ones(old.lens.shape[1], dtype=torch.bool, device=self.cache.device),
                              self.cache.free_list)
        self.table = new
        self.n_real, self.n_act = self.n_real.index_select(0, beam_idx), self.n_act.index_select(0, beam_idx)

    # -------------------------------------------------------------- reporting
    def report(self, rep: dict) -> dict:
        """Split a LeanCache memory report into KV and ACT parts (see :meth:`LeanCache.memory_report`).

        ``kv_bytes`` becomes the KV pages only, ``config`` names the ACT settings; adds
        ``act_pages``, ``act_bytes``, ``act_tokens`` (ACT tokens summed over layers and
        sequences), ``total_bytes`` (both kinds; ``ratio`` is ``total_bytes / fp16_bytes``) and
        ``token_bytes``. ``fp16_bytes`` already counts every real token, ACT ones included.
        """
        cache, page = self.cache, self.cache.cfg.page_size
        act_pages = 0 if self.table is None else int(self.table.n_blocks.sum()) * self.layout.slices
        act_tokens = 0 if self.table is None else int(self.table.lens.sum())
        act_table = self.table.nbytes() if self.table is not None else 0
        slots = dict(rep["slots_per_tier"])
        slots["pruned"] = max(slots["pruned"] - act_tokens * cache.num_kv_heads, 0)
        tiers = dict(rep["tokens_per_tier"])
        # a model whose layers all slide has no cached layer, and then no ACT token either
        per_layer = act_tokens / cache.num_layers if cache.num_layers else 0.0
        tiers["pruned"] = max(tiers["pruned"] - per_layer, 0.0)
        total = rep["total_bytes"] + act_table  # the pool pages already count the ACT pages
        out = dict(rep)
        out.update(kv_bytes=(rep["pages_used"] - act_pages) * page, act_pages=act_pages, act_bytes=act_pages * page,
                   act_tokens=act_tokens, total_bytes=total, table_bytes=rep["table_bytes"] + act_table,
                   ratio=total / rep["fp16_bytes"] if rep["fp16_bytes"] else float("nan"),
                   dense_ratio=total / rep["dense_bytes"] if rep["dense_bytes"] else float("nan"),
                   tokens_per_tier=tiers, slots_per_tier=slots, token_bytes=self.token_bytes())
        return type(rep)(out)


# ============================================================================ the policy view
class HybridPolicy:
    """Wraps a placement policy so that it only ever sees the KV tokens of a step.

    Everything not overridden here is the wrapped policy's own (attribute access is delegated).
    """

    def __init__(self, inner, store: ActStore):
        self.inner, self.act = inner, store
        self._full = self._kv = None  # the cache's step and its KV-only view
        self._inner_values = 0  # how many values of the step's status are the inner policy's

    def __getattr__(self, name):
        # Only for attributes this wrapper lacks. ``inner`` itself and dunder lookups (copy and
        # pickle probe ``__setstate__`` and friends on an instance built without __init__) must not
        # recurse through a missing ``inner``.
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _view(self, step):
        if step is not self._full:
            raise RuntimeError("policy called with a step its begin_step did not plan")
        return self._kv

    def begin_step(self, step) -> None:
        try:
            kv = self.act.plan(step)
        except PoolExhausted as e:  # the ACT grant comes first: its KV pages would come on top
            raise PoolExhausted(e.needed, e.free, e.total, " for its ACT blocks alone (its KV pages on top)") from None
        self._full, self._kv = step, kv
        try:
            self.inner.begin_step(kv)
        except PoolExhausted as e:
            # The step's ACT blocks were granted first: the step needs both, out of the pages free
            # before it. The step never opened, so no drop_failed_step gives the blocks back: do it here.
            act = self.act.granted_pages()
            taken = 0 if self.act.deferred_grant else act
            self._give_back_act_grant()
            raise PoolExhausted(e.needed + act, e.free + taken, e.total,
                                f" ({act} for ACT blocks, {e.needed} for KV)") from None
        except BaseException:
            self._give_back_act_grant()
            raise

    def _give_back_act_grant(self) -> None:
        """Return the ACT blocks :meth:`ActStore.plan` granted to a step that failed before it opened
        (the KV plan refused it): the cache must stay as it was (a failure path: reads the device)."""
        if self.act.table is not None:
            self.act.table.shrink_to_lens(self.act.cache.free_list)

    def store(self, layer, k, v, step, received=None) -> None:
        self.inner.store(layer, k, v, self._view(step), received)

    def after_store(self, layer, step) -> None:
        self.inner.after_store(layer, self._view(step))

    def step_status(self, step):
        # The kernel backend's one host read per step carries the inner policy's status (planned
        # over the step it was given, the KV-only view), then the ACT store's own count.
        inner = self.inner.step_status(self._view(step))
        self._inner_values = 0 if inner is None else inner.numel()
        act = self.act.step_status()
        return act if inner is None else torch.cat([inner.long().reshape(-1), act.long()])

    def take_status(self, values: list[int]) -> None:
        if self._inner_values:
            self.inner.take_status(values[: self._inner_values])
        self.act.take_status(values[self._inner_values])

    def end_step(self, step) -> None:
        self.inner.end_step(self._view(step))
        self.act.end_step(step)
        self._full = self._kv = None

    def save_state(self):
        return self.inner.save_state(), self.act.save_state()

    def load_state(self, saved) -> None:
        self.inner.load_state(saved[0])
        self.act.load_state(saved[1])

    def reset(self) -> None:
        self.inner.reset()
        self.act.reset()
        self._full = self._kv = None

    def reorder(self, beam_idx) -> None:
        self.inner.reorder(beam_idx)
        self.act.reorder(beam_idx)

    def logical_tokens(self) -> torch.Tensor:
        """Real tokens per live row, KV and ACT alike (what an uncompressed cache would hold)."""
        kv = self.inner.logical_tokens()
        if self.act.n_act is None or kv.numel() == 0:
            return kv
        return kv + torch.where(self.act.cache.finished, torch.zeros_like(self.act.n_act), self.act.n_act)


def attach(cache, model) -> None:
    """Give ``cache`` ACT blocks for ``cache.cfg.act > 0``: sets ``cache.act_store`` and wraps ``cache.policy``.

    Raises ``ValueError`` for a policy ACT does not compose with; warns where an ACT block costs
    at least as many page bytes per token as this config's KV pages (GQA models with
    ``hidden > 2 * kv_heads * head_dim``, or quantized KV).
    """
    cfg = cache.cfg
    if cfg.policy not in COMPOSES_WITH:
        raise ValueError(
            f"act={cfg.act} does not compose with policy {cfg.policy!r}: an ACT block is one activation per "
            f"layer serving every KV head, so per-head pruning/tier moves (leankv, h2o, streaming) cannot act "
            f"on it; use policy 'full' (a single-tier config such as 'K8V4:act={cfg.act}')")
    store = ActStore(cache, model)
    b = store.bytes
    if not b["act_saves"]:
        hidden = store.layout.hidden
        warnings.warn(
            f"act={cfg.act}: an ACT block costs {b['act']:.0f} page bytes per token and layer, more than the "
            f"{b['kv']:.0f} of a {cfg} KV token (hidden {hidden} vs 2 x {cache.num_kv_heads} KV heads x "
            f"{cache.head_dim} = {2 * cache.num_kv_heads * cache.head_dim}); ACT saves memory only where "
            "hidden < 2 * kv_heads * head_dim at the same precision; cache.token_bytes() gives both.",
            stacklevel=4)  # the caller of LeanCache(...): attach <- __init__ <- its inference_only wrapper
    cache.act_store = store
    cache.policy = HybridPolicy(cache.policy, store)


__all__ = ["ActStore", "HybridPolicy", "act_blocks", "assign_act", "attach", "install_capture", "keys_attention",
           "next_block_is_act"]
