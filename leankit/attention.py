"""Paged mixed-precision attention: the plain-PyTorch reference (and CPU backend).

Queries attend to the tokens stored in a layer's unified pages: first the high-tier pages
(walked from the left of the bidirectional row), then the low-tier pages (from the right), the
order LeanKV's kernel uses for load balance (§6.2). Pages are gathered and dequantized a chunk
at a time and combined with an online softmax, so no more than one tile of pages per head is
ever dequantized at once: the full-precision cache is never materialized.

Masking is by stored position, not by physical slot: key ``j`` is visible to query ``i`` iff it
is a live slot of its tier and ``pos[j] <= pos[i]``. That handles causality, left padding (pad
tokens are never stored) and pruning (a pruned token is simply gone) with one rule.

A forward step's own new tokens are not read back from the pages: the step attends to them at
their exact values (:func:`step_attention`), as HF's ``QuantizedCache`` and the LeanKV paper's
prompt phase do, and the two partial softmaxes are merged by their log-sum-exp
(:func:`merge_attention`). The pages therefore only ever serve tokens of *earlier* steps, which
is also what makes prefill cost what plain attention costs: the prompt never waits for its own
quantized copy.

GQA: the ``G = Hq / Hkv`` query heads of a group are stacked into one ``[G * Q, F]`` operand, so
each dequantized K/V tile is shared by the whole group (as the Triton kernel does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import decode_attention, native
from .page_table import BidirectionalPageTable
from .pages import SEGMENTS, PageLayout, PagePool
from .quant import META_DTYPE, codes_per_byte

# Floor of an exponent before ``exp_``: PyTorch's vectorized CPU exp leaves its fast path for
# inputs below about -87.3 (where the fp32 result underflows), -inf included, and runs 10-20x
# slower on such vectors; masked scores and long-tail logits hit it all the time. exp(-87) =
# 1.6e-38, so a floored term adds at most (queries x 1.6e-38) to a sum of probabilities: far
# below fp32 resolution of any real significance and below the fp16 range the scores are stored in.
EXP_FLOOR = -87.0


class Workspace:
    """Reusable scratch buffers for the reference attention's large per-tile temporaries.

    On a CPU a fresh multi-megabyte tensor is mapped from the OS and page-faulted on first touch,
    which costs several times the pass that fills it (converting a gathered tile of codes to
    fp32 into a fresh tensor measured ~10x slower than into a reused one). A cache keeps one
    workspace: each named buffer grows to the largest tile seen and is reused by every layer
    and step. A buffer is only valid until the next :meth:`get` of the same name.
    """

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # the last view handed out per buffer
        # Small per-layer objects a caller derives from the cache and keys itself, reused while
        # what they were derived from stays (e.g. the decode step's kernel arguments,
        # leankit.decode_attention._decode_tiers).
        self.memo: dict = {}

    def __deepcopy__(self, memo) -> Workspace:
        """A fresh workspace: scratch holds nothing a copy needs, and the memo's kernel arguments
        (ctypes arrays of the native passes) point at the original's tensors."""
        return Workspace()

    def __reduce__(self):
        """Pickled as a fresh workspace, for the same reason as :meth:`__deepcopy__`: the memo's
        ctypes kernel arguments cannot be pickled and would point into this process's tensors."""
        return (Workspace, ())

    def get(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialized) backed by the buffer ``name``.

        The same request as the last one for ``name`` returns the same view: a decode step asks
        for its small per-layer buffers with one shape in every layer, and slicing a fresh view
        cost more than the rest of the lookup.
        """
        key = (name, dtype, device if isinstance(device, torch.device) else torch.device(device))
        view = self._views.get(key)
        if view is not None and view.shape == shape:
            return view
        n = math.prod(map(int, shape))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(max(n, 1), dtype=dtype, device=device)
        view = self._views[key] = buf[:n].view(shape)
        return view


@dataclass
class PagedKV:
    """Everything attention needs to read one layer's pages."""

    pool: PagePool
    layouts: tuple[PageLayout, ...]  # per tier: high, then low (if any)
    table: BidirectionalPageTable
    layer: int
    workspace: Workspace | None = None  # reused scratch (None: fresh tensors)


class Tile:
    """A chunk of one tier's pages for every (sequence, head) of a layer.

    The chunk's pages are gathered once; each side is dequantized exactly once, as a whole
    ``[B, H, N, F]`` tile (one unpack, one conversion, one fused multiply-add), and meets the
    queries in one batched matmul. The factored form ``q . k_hat = s (q . Q) + m sum(q)``, which
    the Triton kernels use to keep dequantization out of their inner loop, costs one small
    matmul per group and bit plane here; on a CPU, with the few query rows of a decode step, those
    calls (each a loop over every (sequence, head)) cost far more than one pass over the tile.
    Only one tile (at most :data:`TILE_TOKENS` tokens per head by default) is converted at once.
    """

    def __init__(self, kv: PagedKV, tier: int, start: int, count: int):
        table, layer, layout, pool = kv.table, kv.layer, kv.layouts[tier], kv.pool
        self.tier, self.start, self.layout = tier, start, layout
        ids, _ = table.tier_pages(tier, layer, start, count)
        b, h, p = ids.shape
        t = layout.tokens
        # One gather of whole pages; every segment is then a typed view into them (segments are
        # 16-byte aligned, so the fp16 / int32 / dense views need no copy).
        self.ws = kv.workspace or Workspace()
        pages = self.ws.get("pages", (b * h * p, pool.page_size), torch.uint8, pool.device)
        torch.index_select(pool.storage, 0, ids.reshape(-1).long(), out=pages)
        pages = pages.view(b, h, p, pool.page_size)

        def take(name, dtype=torch.uint8):
            i = SEGMENTS.index(name)
            size = torch.empty((), dtype=dtype).element_size()
            off, nb = layout.seg_offsets[i] // size, layout.seg_bytes[i] // size
            return pages.view(dtype)[..., off: off + t * nb].unflatten(-1, (t, nb))  # [B, H, P, T, n]

        self.shape = (b, h, p * t)
        self.pos = take("position", torch.int32).reshape(b, h, p * t)
        slot = torch.arange(start * t, (start + count) * t, device=ids.device)
        self.valid = slot.view(1, 1, -1) < table.lens[tier, layer].unsqueeze(-1)
        prec = layout.precision
        self.k_data = take("k_data", layout.dense_dtype if not prec.k_quantized else torch.uint8)
        self.v_data = take("v_data", layout.dense_dtype if not prec.v_quantized else torch.uint8)
        self.k_meta = self._meta(take("k_meta", META_DTYPE)) if prec.k_quantized else None
        self.v_meta = self._meta(take("v_meta", META_DTYPE)) if prec.v_quantized else None

    def _meta(self, meta: torch.Tensor):
        # [B, H, P, T, 2G] -> scale, min [B, H, N, G]; zero dead slots (stale bytes may be NaN).
        meta = meta.float().reshape(*self.shape, -1, 2).masked_fill(~self.valid[..., None, None], 0.0)
        return meta[..., 0], meta[..., 1]

    def _codes(self, data: torch.Tensor, bits: int, name: str) -> torch.Tensor:
        """The side's codes (or dense values) as fp32 ``[B, H, N, F]`` in a reused workspace buffer.

        Bit planes are written straight to their interleaved columns, so a packed side costs one
        conversion pass like an 8-bit one.
        """
        b, h, p, t, nb = data.shape
        per_byte = 1 if bits >= 16 else codes_per_byte(bits)
        out = self.ws.get(name, (b, h, p, t, nb, per_byte), torch.float32, data.device)
        if per_byte == 1:
            out[..., 0].copy_(data)
        else:
            mask = (1 << bits) - 1
            for i in range(per_byte):
                out[..., i].copy_((data >> (i * bits)) & mask)
        return out.view(*self.shape, nb * per_byte)

    def _dequant(self, data: torch.Tensor, meta, bits: int, name: str) -> torch.Tensor:
        """One side of the tile as fp32 ``[B, H, N, F]`` (Eq. 2: ``x_hat = s * Q + m`` per group).

        Dead slots come out 0: their metadata was zeroed, and dense sides are masked.
        """
        out = self._codes(data, bits, name)
        if bits >= 16:
            return out.masked_fill_(~self.valid.unsqueeze(-1), 0.0)
        scale, mn = meta
        out.view(*self.shape, scale.shape[-1], -1).mul_(scale.unsqueeze(-1)).add_(mn.unsqueeze(-1))
        return out

    def scores(self, qg: torch.Tensor) -> torch.Tensor:
        """Raw dot products ``q . k_hat`` ``[B, H, M, N]`` for grouped queries ``[B, H, M, F]``.

        With one quantization group per token the product factors (Eq. 2) as
        ``s * (q . Q) + m * sum(q)``: one matmul on the converted codes and two ``[M, N]``
        operations, no dequantization pass. Several groups dequantize the tile first.
        """
        bits = self.layout.precision.k_bits
        if self.k_meta is not None and self.k_meta[0].shape[-1] == 1:
            scale, mn = self.k_meta
            dots = torch.matmul(qg, self._codes(self.k_data, bits, "k_hat").transpose(-1, -2))
            return torch.addcmul(qg.sum(-1, keepdim=True) * mn[..., 0].unsqueeze(2), dots, scale[..., 0].unsqueeze(2))
        return torch.matmul(qg, self._dequant(self.k_data, self.k_meta, bits, "k_hat").transpose(-1, -2))

    def weighted_values(self, p: torch.Tensor) -> torch.Tensor:
        """``p @ v_hat`` ``[B, H, M, F]`` for probabilities ``p`` ``[B, H, M, N]`` (0 on dead slots).

        One group per token: ``(p * s) @ Q + p @ m`` (Eq. 2 factored), no dequantization pass.
        """
        bits = self.layout.precision.v_bits
        if self.v_meta is not None and self.v_meta[0].shape[-1] == 1:
            scale, mn = self.v_meta
            out = torch.matmul(p * scale[..., 0].unsqueeze(2), self._codes(self.v_data, bits, "v_hat"))
            return out.add_(torch.matmul(p, mn))
        return torch.matmul(p, self._dequant(self.v_data, self.v_meta, bits, "v_hat"))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``(k, v)`` ``[B, H, N, F]`` of the tile (for oracles and tests)."""
        prec = self.layout.precision
        return (self._dequant(self.k_data, self.k_meta, prec.k_bits, "k_hat").to(dtype, copy=True),
                self._dequant(self.v_data, self.v_meta, prec.v_bits, "v_hat").to(dtype, copy=True))


# Tokens per head in one tile when no page count is given: a tile's size is set in tokens, so a
# tier with few tokens per page (an unquantized fp32 tier holds 3 at head_dim 64) is not cut
# into many small tiles, each paying the per-tile overhead.
TILE_TOKENS = 2048


def _tile_pages(layout: PageLayout, chunk_pages: int | None) -> int:
    return chunk_pages or max(1, TILE_TOKENS // layout.tokens)


def iter_page_tiles(kv: PagedKV, chunk_pages: int | None = None):
    """Yield :class:`Tile` objects: high-tier pages first, then low-tier (LeanKV §6.2 order).

    A tile covers at most ``chunk_pages`` pages per head (default: :data:`TILE_TOKENS` tokens).
    """
    table, layer = kv.table, kv.layer
    for tier in range(len(kv.layouts)):
        n_pages = table.n_pages[tier, layer]
        total = int(n_pages.max()) if n_pages.numel() else 0
        per = _tile_pages(kv.layouts[tier], chunk_pages)
        for start in range(0, total, per):
            yield Tile(kv, tier, start, min(per, total - start))


def iter_tiles(kv: PagedKV, chunk_pages: int | None = None, dtype: torch.dtype = torch.float32):
    """Yield dequantized tiles ``(tier, k, v, pos, valid, page_start)`` of a layer.

    ``k``/``v`` are ``[B, H, N, F]``, ``pos``/``valid`` ``[B, H, N]`` with ``N = pages x T``; slots
    past a tier's token count are ``valid = False``.
    """
    for tile in iter_page_tiles(kv, chunk_pages):
        k, v = tile.dequantized(dtype)
        yield tile.tier, k, v, tile.pos, tile.valid, tile.start


def _grouped_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, Q, F]`` -> ``[B, Hkv, G*Q, F]`` with query head ``h*G + g`` in group ``h``."""
    b, hq, nq, f = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, num_kv_heads, g * nq, f)


def _join_query_chunks(outs: list[torch.Tensor], lses: list[torch.Tensor], group: int):
    """The step's ``(out [B, Q, Hq, F], lse [B, Hkv, G*Q])`` from those of its consecutive query
    chunks (``[B, Qc, Hq, F]`` and ``[B, Hkv, G*Qc]``): rows are independent, outputs join along
    the queries, and each ``lse``'s rows, ordered (query head ``g``, query ``q``), join along ``q``."""
    lse = torch.cat([x.unflatten(2, (group, -1)) for x in lses], 3).flatten(2)
    return torch.cat(outs, 1), lse


def paged_attention_ref(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float,
                        chunk_pages: int | None = None, query_chunk: int = 512, return_logits: bool = False,
                        live_slots: bool = False):
    """Attention of ``q`` ``[B, Hq, Q, F]`` over the layer's pages.

    Args:
        q_pos: int ``[B, Q]`` absolute positions of the queries (for the causal rule).
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        return_logits: also return the scaled logits, so a few queries (decode, short chunks) get
            their significance from :func:`received_from_logits` without a second pass over the
            keys. They take ``4 * B * Hq * Q * N`` bytes: not for long prompts.
        live_slots: where the live-page path serves the call, return one
            :class:`~leankit.decode_attention.LiveSlots` per tier (softmax numerators over live
            pages only) instead of the padded logits; :func:`received_from_logits` and the
            policies take either.

    Returns:
        ``(out, lse)``: ``out`` is ``[B, Q, Hq, F]`` in ``q.dtype`` (the layout HF's attention
        functions return); ``lse`` is the fp32 log-sum-exp ``[B, Hkv, G*Q]`` of the scaled scores
        (``-inf`` for a query that sees no key, whose output is 0). With ``return_logits``, a third
        item: one fp32 tensor per tier, ``[B, Hkv, G*Q, P_t * T_t]`` in the tier's slot order, with
        ``-inf`` where a key is dead or after the query.
    """
    b, hq, nq, f = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    if chunk_pages is None:
        maxima = decode_attention.tier_page_maxima(kv)
        if decode_attention.supports(kv.layouts, g * nq, [m > 0 for m in maxima],
                                     compiled=native.kernels_for(q.device) is not None):
            # Live pages only, codes never dequantized: a few query rows on the torch path, any
            # number on the compiled kernels. Logits asked for are held whole on either path (the
            # padded tiles' take at least the live scores' bytes), so such a step is one call;
            # otherwise a long step goes in query chunks whose scores fit LIVE_SCORE_BYTES.
            per_call = nq if return_logits or g * nq <= decode_attention.DECODE_ROWS else \
                decode_attention.queries_per_call(kv, maxima, g)
            if per_call >= nq:
                return decode_attention.live_page_attention(q, kv, q_pos, scale, return_logits, maxima, live_slots)
            # chunks of queries: rows are independent, so out and lse concatenate
            parts = [decode_attention.live_page_attention(q[:, :, q0: q0 + per_call], kv,
                                                          q_pos[:, q0: q0 + per_call], scale, False, maxima)
                     for q0 in range(0, nq, per_call)]
            return _join_query_chunks([p[0] for p in parts], [p[1] for p in parts], g)
    outs, lses = [], []
    logits = [] if return_logits else None  # per query chunk: one [B, Hkv, G, Qc, N_t] per tier
    for q0 in range(0, nq, query_chunk):
        qc = q[:, :, q0: q0 + query_chunk]
        nqc = qc.shape[2]
        qg = _grouped_queries(qc.float(), hkv)  # [B, Hkv, G*Qc, F]
        qp = q_pos[:, q0: q0 + nqc].to(torch.int32)
        qp = qp.view(b, 1, 1, nqc).expand(b, hkv, g, nqc).reshape(b, hkv, g * nqc)
        m = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros_like(qg)
        tier_logits = [[] for _ in kv.layouts]
        for tile in iter_page_tiles(kv, chunk_pages):
            s = tile.scores(qg) * scale  # [B, Hkv, G*Qc, N]
            visible = tile.valid.unsqueeze(2) & (tile.pos.unsqueeze(2) <= qp.unsqueeze(-1))
            s = s.masked_fill(~visible, float("-inf"))
            if logits is not None:
                tier_logits[tile.tier].append(s)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + tile.weighted_values(p)
            m = m_new
        out = torch.where(l_sum.unsqueeze(-1) > 0, acc / l_sum.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(acc))
        lses.append(torch.where(l_sum > 0, m + torch.log(l_sum.clamp_min(1e-30)), torch.full_like(m, float("-inf")))
                    .view(b, hkv, g, nqc))
        outs.append(out.view(b, hkv, g, nqc, f))
        if logits is not None:
            # A tier without tiles has no pages at all: its logits are empty ([..., 0]).
            logits.append([(torch.cat(ts, -1) if ts else m.new_empty((*m.shape, 0))).unflatten(2, (g, nqc))
                           for ts in tier_logits])
    out = torch.cat(outs, dim=3).reshape(b, hq, nq, f).transpose(1, 2).to(q.dtype)
    lse = torch.cat(lses, dim=3).reshape(b, hkv, g * nq)
    if logits is None:
        return out, lse
    # Rows in lse's order (query head g, then query q): [B, Hkv, G, Q, N] -> [B, Hkv, G*Q, N].
    per_tier = [torch.cat([c[t] for c in logits], 3).flatten(2, 3) for t in range(len(kv.layouts))]
    return out, lse, per_tier


def received_from_logits(logits: list[torch.Tensor], lse: torch.Tensor, group: int,
                         q_valid: torch.Tensor | None = None) -> list[torch.Tensor]:
    """:func:`received_attention_ref` from the logits :func:`paged_attention_ref` kept.

    ``p_ij = exp(s_ij - lse_i)`` summed over the step's live queries and averaged over the
    ``group`` query heads of each KV group; the same numbers as the second pass, without reading
    the keys again. Given :class:`~leankit.decode_attention.LiveSlots` (the live-page path), it
    returns them with ``row_weight`` filled in, which gives ``received`` ``[L, T]`` for live pages
    only (or lets the compiled score update fold it in per slot).
    """
    b, hkv, rows = lse.shape
    live = torch.isfinite(lse)
    if q_valid is not None:
        live = live & q_valid.view(b, 1, 1, -1).expand(b, hkv, group, rows // group).reshape(b, hkv, rows)
    if logits and isinstance(logits[0], decode_attention.LiveSlots):
        # Live pages only, [L, T] per tier, from the numerators pass 2 already took:
        # p_ij = exp(s_ij - shift_i) * exp(shift_i - lse_i), so no exp over the slots again. The
        # row factor is 0 for rows that do not count (padding queries, rows that see nothing).
        shift = logits[0].shift.view(b, hkv, rows)
        factor = torch.where(live, torch.exp(shift - lse), torch.zeros_like(lse)).div_(group).view(b * hkv, rows)
        return [replace(t, row_weight=factor) for t in logits]
    lse_safe = torch.where(live, lse, torch.zeros_like(lse)).unsqueeze(-1)
    out = []
    for s in logits:
        p = torch.exp((s - lse_safe).masked_fill(~live.unsqueeze(-1), EXP_FLOOR).clamp_min_(EXP_FLOOR))
        out.append(p.sum(2) / group)
    return out


def long_step_attention(q_pages: torch.Tensor, query: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        kv: PagedKV, q_pos: torch.Tensor, k_real: torch.Tensor, scale: float, per_call: int, *,
                        own_mask: torch.Tensor | None = None, from_page_basis=None):
    """A long step's attention under a significance policy, in query chunks whose live-slot
    logits fit the compiled kernels' score budget, with no second pass over the keys.

    Each chunk of ``per_call`` queries (:func:`~leankit.decode_attention.step_logits_queries`)
    attends to the stored pages on the live-page passes, keeping its softmax numerators; to the
    step's own tokens (:func:`step_attention`, whole keys, the chunk's queries); the two merge by
    log-sum-exp, which gives the chunk's final ``lse``, and with it the mass each stored slot and
    each new token received from the chunk (:func:`received_from_logits`). Query rows are
    independent and received mass adds over queries, so the chunks' sums are the step's, up to
    fp32 summation order (LeanKV §4 sums ``p_ij`` over the step's queries).

    Args:
        q_pages: ``[B, Hq, Q, F_pages]`` the queries in the pages' basis; ``query``: ``[B, Hq, Q, F]``
            in the model's, with ``k_new``/``v_new`` ``[B, Hkv, Q, F]`` the step's own K/V.
        q_pos, k_real: ``[B, Q]`` positions and real-token flags of the step's tokens.
        own_mask: as in :func:`step_attention`; ``from_page_basis``: maps a page-side output
            ``[B, Qc, Hq, F_pages]`` to the model's basis (None: the same basis).

    Returns:
        ``(out [B, Q, Hq, F] fp32, lse [B, Hkv, G*Q], received_old, received_new [B, Hkv, Q])``:
        ``received_old`` one :class:`~leankit.decode_attention.LiveSlots` per tier holding the
        stored slots' summed mass, for the policy's ``update_scores``.
    """
    hq, nq = query.shape[1:3]
    g = hq // kv.table.shape[2]
    maxima = decode_attention.tier_page_maxima(kv)
    outs, lses, summed, received_new = [], [], None, None
    for q0 in range(0, nq, per_call):
        q1 = min(nq, q0 + per_call)
        out_old, lse_old, live = decode_attention.live_page_attention(
            q_pages[:, :, q0:q1].float(), kv, q_pos[:, q0:q1], scale, True, maxima, live_slots=True)
        if from_page_basis is not None:
            out_old = from_page_basis(out_old)
        out_new, lse_new, got_new = step_attention(query[:, :, q0:q1], k_new, v_new, q_pos, k_real, scale,
                                                   lse_other=lse_old, received=True, own_mask=own_mask, first=q0)
        out, lse = merge_attention(out_old, lse_old, out_new, lse_new)
        # The numerators live in the workspace, overwritten by the next chunk: sum them now.
        got_old = [t.received for t in received_from_logits(live, lse, g, k_real[:, q0:q1])]
        summed = got_old if summed is None else [a.add_(c) for a, c in zip(summed, got_old, strict=True)]
        received_new = got_new if received_new is None else received_new.add_(got_new)
        outs.append(out)
        lses.append(lse)
    # Every chunk listed the same live pages (the table, not the queries, decides them), so the
    # last chunk's slots describe the sums.
    received_old = [t.holding(r) for t, r in zip(live, summed, strict=True)]
    return *_join_query_chunks(outs, lses, g), received_old, received_new


def received_attention_ref(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, lse: torch.Tensor,
                           q_valid: torch.Tensor | None = None, chunk_pages: int | None = None,
                           query_chunk: int = 256) -> list[torch.Tensor]:
    """Attention probability each stored token received from this step's queries (LeanKV §4).

    A second pass over the pages that reuses the log-sum-exp ``lse`` ``[B, Hkv, G*Q]`` saved by
    :func:`paged_attention_ref`. Keys are read a tile at a time (keys only: values are not
    needed) and queries ``query_chunk`` at a time, so no ``Q x N`` probability matrix is ever
    held (only ``query_chunk x tile``); a (query chunk, tile) pair whose keys all lie after the
    chunk's last query is skipped (causality).

    Args:
        q_valid: bool ``[B, Q]``; queries where it is false (padding) contribute nothing.

    Returns:
        one fp32 tensor per tier, ``[B, Hkv, P_t * T_t]`` (slot order of the tier): the sum over
        the step's queries of ``p_ij``, averaged over the ``G`` query heads of the KV group.
        Dead slots hold 0.
    """
    b, hq, nq, _ = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    live_all = torch.isfinite(lse).view(b, hkv, g, nq)
    if q_valid is not None:
        live_all = live_all & q_valid.view(b, 1, 1, nq)
    lse_all = lse.view(b, hkv, g, nq)
    qpos_all = q_pos.to(torch.int32)
    chunks = []
    for q0 in range(0, nq, query_chunk):
        q1 = min(nq, q0 + query_chunk)
        nqc = q1 - q0
        live = live_all[..., q0:q1].reshape(b, hkv, g * nqc)
        if not bool(live.any()):
            continue
        qg = _grouped_queries(q[:, :, q0:q1].float(), hkv)
        qp = qpos_all[:, q0:q1].view(b, 1, 1, nqc).expand(b, hkv, g, nqc).reshape(b, hkv, g * nqc)
        lse_c = lse_all[..., q0:q1].reshape(b, hkv, g * nqc)
        lse_safe = torch.where(live, lse_c, torch.zeros_like(lse_c))
        q_max = int(torch.where(live, qp, torch.full_like(qp, -(1 << 30))).max())
        chunks.append((qg, qp, live, lse_safe, q_max))
    out = []
    for tier, layout in enumerate(kv.layouts):
        n_pages = kv.table.n_pages[tier, kv.layer]
        total = int(n_pages.max()) if n_pages.numel() else 0
        acc = torch.zeros(b, hkv, total * layout.tokens, device=q.device)
        per = _tile_pages(layout, chunk_pages)
        for start in range(0, total, per):
            tile = Tile(kv, tier, start, min(per, total - start))
            k_min = int(torch.where(tile.valid, tile.pos, torch.full_like(tile.pos, 1 << 30)).min())
            lo, hi = start * layout.tokens, start * layout.tokens + tile.pos.shape[-1]
            for qg, qp, live, lse_safe, q_max in chunks:
                if k_min > q_max:
                    continue
                s = tile.scores(qg) * scale
                visible = tile.valid.unsqueeze(2) & (tile.pos.unsqueeze(2) <= qp.unsqueeze(-1)) & live.unsqueeze(-1)
                p = torch.exp((s - lse_safe.unsqueeze(-1)).masked_fill(~visible, float("-inf")))
                acc[..., lo:hi] += p.sum(2)
        out.append(acc / g)
    return out


# ============================================================================ the step's own tokens
# Elements of one query chunk's score matrix [B, Hkv, G*Qc, Q] (fp32): 2M elements = 8 MB, small
# enough to stay in the last-level cache between the passes over it (measured 1.7x faster than
# 32 MB chunks for a batch-8, 1k-token prompt) and large enough to keep the op count low.
STEP_CHUNK_ELEMS = 1 << 21
# On a GPU the same loop is launch-bound at that size: each op of a chunk is a launch of a few
# microseconds of host time for microseconds of device work. Measured on an H200
# (bench/gpu_step.py), a batch-8 prompt of SmolLM2's shape took 17x DynamicCache's prefill at 1k
# tokens and 57x at 4k with significance on (the LeanKV configs), at 586 chunks of ~10 launches a
# layer for 4k tokens. There a chunk holds 64M scores (256 MB fp32): 19 chunks a layer for that prompt.
STEP_CHUNK_ELEMS_GPU = 1 << 26


def step_chunk_rows(b: int, hq: int, nq: int, device: torch.device) -> int:
    """Query rows per chunk of :func:`step_attention` / :func:`step_received` for a step of ``nq``
    queries (``b`` rows, ``hq`` query heads): the chunk's scores ``[B, Hq, rows, nq]`` stay near
    :data:`STEP_CHUNK_ELEMS` on a CPU and :data:`STEP_CHUNK_ELEMS_GPU` elsewhere."""
    elems = STEP_CHUNK_ELEMS if torch.device(device).type == "cpu" else STEP_CHUNK_ELEMS_GPU
    return max(1, elems // max(1, b * hq * nq))


def _step_bias(q_pos: torch.Tensor, k_real: torch.Tensor, group: int, q0: int, q1: int,
               own_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask ``[B, 1, G*(q1-q0), Q]`` of query rows ``q0 .. q1-1`` over the step's new keys.

    Key ``j`` is visible to query ``i`` iff it is a real token of the step and ``pos_j <= pos_i``
    (0 where visible, ``-inf`` where not). A row that is not a live query (padding, finished
    row) sees every key instead: it never counts, and this keeps its softmax finite.
    ``own_mask``: bool ``[B or 1, Q, Q]``, the model's own mask over the step's keys (True: query
    ``i`` sees key ``j``), used instead of the positions rule (a mask that is not causal, such as
    Gemma3's bidirectional attention among one image's tokens); keys that are not real stay hidden.
    """
    b, nq = q_pos.shape
    if own_mask is not None:
        vis = k_real.view(b, 1, nq) & own_mask[:, q0:q1]
    else:
        qp = q_pos.to(torch.int64)
        vis = k_real.view(b, 1, nq) & (qp.view(b, 1, nq) <= qp[:, q0:q1].view(b, q1 - q0, 1))
    vis = vis | ~k_real[:, q0:q1].view(b, q1 - q0, 1)  # a query is live iff its token is real
    bias = torch.zeros(vis.shape, device=q_pos.device).masked_fill_(~vis, float("-inf"))
    return bias.unsqueeze(1).expand(b, group, q1 - q0, nq).reshape(b, 1, group * (q1 - q0), nq)


def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_real: torch.Tensor,
                   scale: float, *, lse_other: torch.Tensor | None = None, received: bool = False,
                   own_mask: torch.Tensor | None = None, first: int = 0):
    """Exact attention of a step's queries over the step's own new tokens (no pages involved).

    One pass of plain matmuls per chunk of queries: ``S = q kᵀ`` (mask added in the same
    ``baddbmm``), ``P = softmax(S)``, ``out = P v`` and, with ``received``, each new token's
    significance ``sum_i w_i P_ij`` in the same pass.

    Args:
        q: ``[B, Hq, Q, F]`` queries; ``k``/``v``: ``[B, Hkv, Q, F]`` the step's new keys/values as
            the model produced them (exact, never quantized).
        q_pos: int ``[B, Q]`` positions of the step's tokens (queries and keys alike).
        k_real: bool ``[B, Q]``: the token is real (pad and finished-row tokens are never keys,
            and their queries never count).
        lse_other: ``[B, Hkv, G*Q]`` log-sum-exp of the same queries over the keys of earlier
            steps (from paged attention), so that the significance uses each query's final
            softmax over *all* keys: ``p_ij = P_ij * exp(lse_new_i - lse_total_i)``.
        received: also return the probability each new token received from the step's live
            queries, averaged over the ``G`` query heads of its KV group (LeanKV §4).
        own_mask: bool ``[B or 1, Q, Q]``, the model's mask over the step's own keys, in place of
            the causal rule from ``q_pos`` (see :func:`_step_bias`); not for a one-query step.
        first: ``q`` holds the step's queries ``first .. first + Qc - 1`` only (a query chunk of a
            long step); ``k``, ``v``, ``q_pos``, ``k_real`` and ``own_mask`` still cover the whole
            step, ``lse_other`` the chunk's rows, and ``received`` counts the chunk's queries (the
            chunks' sum is the step's).

    Returns:
        ``(out [B, Q, Hq, F] fp32, lse [B, Hkv, G*Q] fp32, received [B, Hkv, Q] or None)``; rows
        are laid out as in :func:`paged_attention_ref` (query head ``h*G + g`` -> row ``g*Q + i``
        of KV head ``h``), so :func:`merge_attention` combines the two directly. A row that sees
        no key has ``lse = -inf`` and output 0. With ``first``, ``out`` and ``lse`` are the
        chunk's (``Qc`` queries) and ``received`` covers the step's ``Q`` keys.
    """
    if k.shape[2] == 1:
        return _one_token_attention(q, k, v, k_real, scale, lse_other, received)
    return _chunked_step_attention(q, k, v, q_pos, k_real, scale, lse_other, received, own_mask, first)


def softmax_sweep(scores: torch.Tensor, v: torch.Tensor):
    """Softmax attention of ``scores`` ``[..., R, K]`` (hidden keys ``-inf``) over ``v`` ``[..., K, F]``,
    log-sum-exp and softmax in one sweep over the scores.

    ``e = exp(s - max)`` is taken in place (``scores`` is overwritten), ``Z`` is its row sum,
    ``lse = max + log Z``, and ``1/Z`` is folded into ``e v`` instead of a pass over ``P``
    (``torch.logsumexp`` and ``torch.softmax`` each take their own passes, with temporaries, on a
    CPU). A row that sees no key has ``Z = 0``: output 0, ``lse`` ``-inf`` (a merge gives it no
    weight) and ``inv_z`` 0. Returns ``(out [..., R, F], lse [..., R], e, inv_z [..., R])``; the
    probabilities are ``e * inv_z``.
    """
    row_max = scores.amax(-1)
    seen = torch.isfinite(row_max)
    e = scores.sub_(torch.where(seen, row_max, 0.0).unsqueeze(-1)).exp_()  # hidden keys: exactly 0
    z = e.sum(-1)
    lse = row_max + torch.log(z)  # -inf where the row sees nothing (z = 0)
    inv_z = torch.where(seen, z.reciprocal(), 0.0)
    return torch.matmul(e, v).mul_(inv_z.unsqueeze(-1)), lse, e, inv_z


def _chunked_step_attention(q, k, v, q_pos, k_real, scale, lse_other, received, own_mask=None, first=0):
    """:func:`step_attention` of any step: masked matmul, softmax and ``P v`` per chunk of queries
    (``q``: the step's queries from ``first`` on)."""
    b, hq, nq, f = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = (q.float() * scale).view(b, hkv, g, nq, f)
    kt = k.float().transpose(-1, -2)  # [B, Hkv, F, K]
    vf = v.float()
    out = q.new_empty((b, hkv, g, nq, f), dtype=torch.float32)
    lse = q.new_empty((b, hkv, g, nq), dtype=torch.float32)
    recv = q.new_zeros((b, hkv, nk), dtype=torch.float32) if received else None
    rows = step_chunk_rows(b, hq, nk, q.device)
    for q0 in range(0, nq, rows):
        q1 = min(nq, q0 + rows)
        nqc = q1 - q0
        bias = _step_bias(q_pos, k_real, g, first + q0, first + q1, own_mask)  # [B, 1, G*Qc, K]
        qc = qg[:, :, :, q0:q1].reshape(b, hkv, g * nqc, f)
        s = torch.matmul(qc, kt).add_(bias)
        o, lse_c, e, inv_z = softmax_sweep(s, vf)  # live rows always see their own token
        out[:, :, :, q0:q1] = o.view(b, hkv, g, nqc, f)
        lse[:, :, :, q0:q1] = lse_c.view(b, hkv, g, nqc)
        if received:
            w = k_real[:, first + q0:first + q1].view(b, 1, 1, nqc).expand(b, hkv, g, nqc).reshape(b, hkv, g * nqc)
            w = w.float()
            if lse_other is not None:
                other = lse_other.view(b, hkv, g, nq)[..., q0:q1].reshape(b, hkv, g * nqc)
                total = torch.logaddexp(other, lse_c)
                w = w * torch.exp(lse_c - torch.where(torch.isfinite(total), total, lse_c))
            # P = e / Z; a row that sees nothing (inv_z = 0; else 1/Z > 0) gives nothing, even where
            # its weight above is NaN (its lse and the other part's both -inf)
            w = torch.where(inv_z > 0, w * inv_z, 0.0)
            recv += torch.matmul(w.unsqueeze(2), e).squeeze(2)
    out = out.reshape(b, hq, nq, f).transpose(1, 2)
    if recv is not None:
        recv /= g
    return out, lse.view(b, hkv, g * nq), recv


def _one_token_attention(q, k, v, k_real, scale, lse_other, received):
    """:func:`step_attention` of a decode step (one token per row), in closed form.

    Each query sees exactly one new key, its own token (a row that is not live sees it too, as in
    the general mask), so ``lse = s = q . k * scale``, ``P = 1`` and ``out = v``.
    """
    b, hq, _, f = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kf = k.float()
    s = torch.matmul(q.float().view(b, hkv, g, f), kf.view(b, hkv, f, 1)).view(b, hkv, g) * scale
    out = v.float().view(b, hkv, 1, f).expand(b, hkv, g, f).reshape(b, 1, hq, f)
    recv = None
    if received:
        w = k_real.view(b, 1, 1).expand(b, hkv, g).float()
        if lse_other is not None:
            total = torch.logaddexp(lse_other.view(b, hkv, g), s)
            w = w * torch.exp(s - torch.where(torch.isfinite(total), total, s))
        recv = w.sum(-1, keepdim=True) / g
    return out, s, recv


def serves_merged_step(b: int, hq: int, nq: int, device) -> bool:
    """Whether :func:`step_attention_merged` serves a step of ``nq`` queries (``b`` rows, ``hq``
    query heads): its scores ``[B, Hq, Q, Q]`` fit one chunk of :func:`step_attention`."""
    return step_chunk_rows(b, hq, nq, device) >= nq


def step_attention_merged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                          k_real: torch.Tensor, scale: float, out_other: torch.Tensor, lse_other: torch.Tensor,
                          own_mask: torch.Tensor | None = None):
    """:func:`step_attention` over the step's own tokens and :func:`merge_attention` with the
    older keys' partial attention, in one pass and without significance: ``(out [B, Q, Hq, F] fp32,
    lse [B, Hkv, G*Q])``, equal to the two calls' result up to fp32 rounding.

    For the short steps after a prompt (a draft's verify step in assisted or prompt-lookup
    decoding, a short second turn) the two calls are some 35 small tensor ops whose fixed cost
    exceeds their arithmetic on a CPU; here the new scores are shifted by the running maximum of
    both sides at once, ``m = max(max_j s_ij, lse_other_i)``, so the merge is a rescale of the
    older output: ``out_i = (e^(lse_other_i - m) out_other_i + sum_j e^(s_ij - m) v_j) / Z_i``
    with ``Z_i`` the sum of those weights, and ``lse_i = m + log Z_i``. Every row sees at least one
    of the step's keys (a live row its own token, any other row every key, as in
    :func:`_step_bias`), so ``m`` is finite. Check :func:`serves_merged_step` first: the scores are
    not chunked.
    ``own_mask``: as in :func:`step_attention`.
    """
    b, hq, nq, f = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s = torch.matmul(q.float().reshape(b, hkv, g * nq, f), k.float().transpose(-1, -2))  # [B, Hkv, G*Q, Q]
    s.mul_(scale).add_(_step_bias(q_pos, k_real, g, 0, nq, own_mask))
    m = torch.maximum(s.amax(-1), lse_other)
    p = s.sub_(m.unsqueeze(-1)).exp_()  # masked keys: exp(-inf) = 0 exactly
    w_other = torch.exp(lse_other - m)
    total = p.sum(-1).add_(w_other)
    acc = torch.matmul(p, v.float())  # [B, Hkv, G*Q, F]
    other = out_other.float().transpose(1, 2).reshape(b, hkv, g * nq, f)
    acc.addcmul_(other, w_other.unsqueeze(-1)).div_(total.unsqueeze(-1))
    out = acc.view(b, hq, nq, f).transpose(1, 2)
    return out, m + torch.log(total)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two partial attentions over disjoint key sets by their log-sum-exp.

    ``out_*``: ``[B, Q, Hq, F]`` (each normalized over its own keys, 0 where it saw none);
    ``lse_*``: ``[B, Hkv, G*Q]``. Returns ``(out fp32 [B, Q, Hq, F], lse [B, Hkv, G*Q])``:
    ``out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b})`` computed around the
    larger of the two (the flash-decoding split merge).
    """
    b, nq, hq, _ = out_a.shape
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    total = wa + wb
    lse = m_safe + torch.log(total)  # -inf where neither side saw a key
    norm = total.clamp_min(1e-30)

    def per_row(w):  # [B, Hkv, G*Q] -> [B, Q, Hq, 1]
        return (w / norm).reshape(b, hq, nq).transpose(1, 2).unsqueeze(-1)

    out = out_a.float() * per_row(wa) + out_b.float() * per_row(wb)
    return out, lse


def step_received(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_real: torch.Tensor,
                  scale: float, ordered: bool = False) -> torch.Tensor:
    """Significance of a prompt's tokens: the attention each received from the prompt's live queries.

    For a step with no older keys (each query's softmax runs over the step's own keys alone),
    averaged over the ``G`` query heads of each KV group: ``[B, Hkv, Q]`` fp32 (LeanKV §4,
    prompt phase). One extra pass of plain matmuls over the new keys, a chunk of queries at a
    time: ``S = q kᵀ + mask``, ``E = exp(S - rowmax)`` in place, and the weighted row sum
    ``sum_i (live_i / sum_j E_ij) E_ij`` as one more matmul, so no probability matrix is
    normalized or kept.

    ``ordered``: the real tokens' positions increase along the step (the usual case; see
    :attr:`leankit.cache.StepState.ordered`), so a chunk of queries sees no key after its last
    query and the pass stops there: about half the work of the full ``Q x Q`` product.
    """
    b, hq, nq, f = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = (q.float() * scale).view(b, hkv, g, nq, f)
    kt = k.float().transpose(-1, -2)  # [B, Hkv, F, Q]
    recv = q.new_zeros((b, hkv * g, 1, nq), dtype=torch.float32)
    rows = step_chunk_rows(b, hq, nq, q.device)
    for q0 in range(0, nq, rows):
        q1 = min(nq, q0 + rows)
        nqc = q1 - q0
        nk = q1 if ordered else nq  # keys past the chunk's last query are after every query in it
        bias = _step_bias(q_pos[:, :nk], k_real[:, :nk], 1, q0, q1).unsqueeze(1)
        qc = qg[:, :, :, q0:q1].reshape(b, hkv, g * nqc, f)
        s = torch.matmul(qc, kt[..., :nk]).view(b, hkv, g, nqc, nk).add_(bias)  # [B, Hkv, G, Qc, Nk]
        s.sub_(s.amax(-1, keepdim=True)).clamp_min_(EXP_FLOOR).exp_()
        w = k_real[:, q0:q1].float().view(b, 1, 1, nqc) / s.sum(-1).view(b, hkv * g, 1, nqc)
        recv[..., :nk] += torch.matmul(w, s.view(b, hkv * g, nqc, nk))
    return recv.view(b, hkv, g, nq).sum(2) / g
