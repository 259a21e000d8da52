"""Attention over live pages only: the CPU path of paged attention for decode steps and, compiled,
for any step after a prompt.

:func:`leankit.attention.paged_attention_ref` walks tiles shaped ``[B, H, P_max]``: every
(sequence, head) is padded to the largest page count of its tier. Under LeanKV's per-head
dynamic precision those counts differ a lot between heads (a head that keeps most tokens in the
high tier has few low-tier pages), so about half of each padded tile is dead slots that are
converted, multiplied and masked for nothing. With the one or few query rows of a decode step
the work is all in that per-key pass, so this module reads *live pages only*:

1. The live pages of a tier (page rank ``< n_pages`` of its head) are listed once and gathered
   once; each page knows its head. Scores are one batched matmul per chunk of pages, the query
   rows of each page's head against the page's codes.
2. Codes are never dequantized. A packed side is unpacked *plane-major*: plane ``i`` holds code
   ``i`` of every byte (``(b >> i*bits) & mask``; the first plane needs no shift and the last no
   mask), which is contiguous writes only; the query is permuted into the same column order once
   (a few rows) and the output permuted back. Scale and min stay out of the per-element path
   (Eq. 2 factored, as in the Triton kernels): ``q . k_hat = sum_g s_g (q_g . Q_g) + m_g sum(q_g)``;
   the groups ride in the matmul's rows as a block-diagonal query.
   On a CPU the whole step runs instead in the compiled kernels of :mod:`leankit.native` when
   they could be built: pages are listed from the page table and read in place in the pool (no
   gathered copy), with the masks, maxima, numerators and sums inside two passes (each token
   dequantized once into a small scratch row, its codes unpacked plane by plane within each
   group).
   A decode step (one query per sequence) then adds its own token and merges in one more
   compiled call (:func:`decode_step_attention`). The compiled passes also serve steps of many
   queries (a new turn's prompt, lm-eval's scored chunks), in query chunks whose scores fit
   :data:`LIVE_SCORE_BYTES` (:func:`queries_per_call`): they were faster than the padded tiles
   at every count measured, 63 to 2,049 query rows.
   The torch steps here are the fallback and their reference (a few query rows only).
3. The softmax is exact and two-pass per layer (scores of every live page are small: rows x
   tokens), with per-head maxima and sums reduced over the pages of each head by
   ``scatter_reduce`` / ``index_add``. Codes are converted a chunk of pages at a time
   (:data:`CHUNK_TOKENS`), so the fp32 temporaries stay in cache.

The result equals the padded-tile walk of :func:`leankit.attention.paged_attention_ref` up to
fp32 rounding (``tests/test_decode_attention.py`` on hand-filled, poisoned caches; the oracle
tests through the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import native
from .pages import SEGMENTS
from .quant import META_DTYPE, codes_per_byte

# Grouped query rows (query heads per KV head x queries) the torch live path serves: decode steps
# and short chunks. Longer steps amortize the padded tiles over many rows. The compiled kernels serve
# any count: they were faster than the padded tiles from 63 to 2,049 rows (chunked scoring of 1k-2k
# SmolLM2 tokens, docs/measurements.md), and as accurate.
DECODE_ROWS = 64
# Bytes of fp32 scores (query rows x live slots) one compiled call may hold when a step has more
# than DECODE_ROWS rows: a longer step is cut into query chunks that fit (every chunk reads the live
# pages again, as each query chunk of the padded tiles does). A long step under a significance
# policy keeps each chunk's logits, for the significance, within this too (step_logits_queries).
LIVE_SCORE_BYTES = 64 * 2**20
# Tokens whose codes are converted to fp32 at once: about 1 MB per side at head_dim 64, which
# stays in a core's L2 between the conversion and the matmul that reads it.
CHUNK_TOKENS = 4096


def supports(layouts, rows: int, occupied=None, compiled: bool = False) -> bool:
    """Whether this path serves ``rows`` grouped query rows over pages of ``layouts``.

    ``occupied``: per tier, whether any head holds pages of it (default: all). Only occupied
    tiers count: a two-tier config whose low tier is still empty reads like a single tier.
    ``compiled``: the call will run on the compiled CPU kernels (:func:`leankit.native.kernels_for`),
    which serve any number of rows; the torch path serves at most :data:`DECODE_ROWS`.

    On the torch path every side of every tier must be quantized (dense sides may hold stale NaN
    bytes in dead slots, which only the padded path masks) with groups that span whole bytes, and
    one tier with one group per token stays on the padded path: every head has the same page
    count there (no dead pages to skip) and that path already factors scale and min out, with one
    matmul per (sequence, head) instead of one per page (measured faster at 1k context). The
    compiled kernels read each page once with no fp32 copy of its codes, which beats the padded
    path there too; they also read dense sides (fp32, fp16, bf16) in place, and never read a dead
    slot's bytes.
    """
    live = [lay for t, lay in enumerate(layouts) if occupied is None or occupied[t]]
    if not compiled and (rows > DECODE_ROWS or (len(live) <= 1 and all(lay.groups == 1 for lay in live))):
        return False
    for lay in layouts:
        for bits in (lay.precision.k_bits, lay.precision.v_bits):
            if bits >= 16:  # dense: only the compiled kernels, and only dtypes they read
                if not compiled or native.side_format(bits, lay.dense_dtype) is None:
                    return False
            elif lay.group_size % codes_per_byte(bits):
                return False
    return True


def _plane_query(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` ``[..., F]`` in plane-major column order ``[..., P, F/P]`` (element ``j*P + i`` at ``[i, j]``)."""
    return q.view(*q.shape[:-1], -1, codes_per_byte(bits)).transpose(-1, -2).contiguous()


def _plane_values(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_plane_query` on an output: ``[..., P, nb]`` -> ``[..., F]``."""
    return y.transpose(-1, -2).flatten(-2)


_GROUP_MASKS: dict = {}


def _group_mask(layout, bits: int, device) -> torch.Tensor:
    """fp32 ``[G, 1, P * nb]``: 1 where plane-major column ``(i, j)`` belongs to quantization group ``g``."""
    key = (layout.head_dim, layout.group_size, bits, str(device))
    mask = _GROUP_MASKS.get(key)
    if mask is None:
        p = codes_per_byte(bits)
        nb = layout.head_dim // p
        g = torch.arange(layout.groups, device=device).view(-1, 1, 1)
        j = torch.arange(nb, device=device).view(1, 1, -1)
        mask = _GROUP_MASKS[key] = (j // (layout.group_size // p) == g).expand(-1, p, -1).reshape(
            layout.groups, 1, p * nb).float()
    return mask


class _LiveTier:
    """The live pages of one tier of one layer, gathered once, with the head each belongs to."""

    def __init__(self, kv, tier: int, pmax: int, ws):
        table, layer = kv.table, kv.layer
        self.layout = layout = kv.layouts[tier]
        self.pmax = pmax  # most pages any head holds in this tier
        # Live page i is rank ``rank[i]`` of head ``head[i]``: heads in order, ranks 0 .. n_pages-1.
        counts = table.n_pages[tier, layer].reshape(-1).long()  # [B*H]
        self.n = n = int(counts.sum())
        heads = torch.arange(counts.numel(), device=counts.device)
        self.head = head = torch.repeat_interleave(heads, counts, output_size=n)  # in [0, B*H)
        rank = torch.arange(n, device=counts.device) - (torch.cumsum(counts, 0) - counts).index_select(0, head)
        self.flat = head * self.pmax + rank  # index into [B*H*P_max] (the padded layout)
        rows = table.tables[layer].reshape(counts.numel(), -1)
        self.page_ids = rows[head, table.column(tier, rank, table.row_len)].long()  # pool id of each live page
        t = self.tokens = layout.tokens
        pages = ws.get(f"live_pages{tier}", (n, kv.pool.page_size), torch.uint8, kv.pool.device)
        torch.index_select(kv.pool.storage, 0, self.page_ids, out=pages)
        self.pages = pages
        self._views = {}
        # Tokens left in each page: the tier's length minus the slots of the pages before it.
        left = table.lens[tier, layer].reshape(-1).index_select(0, head) - rank * t
        self.valid = torch.arange(t, device=head.device) < left.unsqueeze(1)  # [L, T]
        # A tier's tokens fill slots 0 .. lens-1, so only a head's last pages hold dead slots (stale
        # bytes, NaN patterns included). They are cleaned in this gathered copy, a few pages only:
        # a position after every query (one comparison then masks dead slots and causality), and
        # V scale and min 0 (their probability is 0, and 0 * NaN would not be).
        pos = self._seg("position", torch.int32).squeeze(-1)  # [L, T]
        part = (left < t).nonzero().squeeze(1)
        if part.numel():
            dead = ~self.valid.index_select(0, part)
            pos[part] = pos.index_select(0, part).masked_fill_(dead, torch.iinfo(torch.int32).max)
            v_meta = self._seg("v_meta", META_DTYPE)
            v_meta[part] = v_meta.index_select(0, part).masked_fill_(dead.unsqueeze(-1), 0.0)
        self.pos = pos

    def _seg(self, name: str, dtype=torch.uint8) -> torch.Tensor:
        """Segment ``name`` of every live page as ``[L, T, n]`` (a typed view, no copy)."""
        key = (name, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._seg_view(name, dtype)
        return view

    def _seg_view(self, name: str, dtype) -> torch.Tensor:
        lay = self.layout
        i = SEGMENTS.index(name)
        off, nb = lay.seg_offsets[i] // dtype.itemsize, lay.seg_bytes[i] // dtype.itemsize
        return self.pages.view(dtype)[:, off: off + self.tokens * nb].view(self.n, self.tokens, nb)

    def meta(self, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and min of every live slot, fp32 ``[L, G, T]`` each (strided views).

        The segment converts as one contiguous copy (a transposing copy measured several times
        slower); the group and slot dims are then swapped in the views. V sides hold 0 on dead
        slots (cleaned at gather time); K sides may hold anything there.
        """
        m = self.meta32(side).view(self.n, self.tokens, self.layout.groups, 2).transpose(1, 2)  # [L, G, T, 2]
        return m[..., 0], m[..., 1]

    def meta32(self, side: str) -> torch.Tensor:
        """Scale and min of every live slot as one contiguous fp32 ``[L, T, 2G]`` (pairs per group)."""
        return self._seg(f"{side}_meta", META_DTYPE).float()

    def planes(self, side: str, bits: int, ws):
        """Yield ``(c0, c1, codes)`` per chunk of :data:`CHUNK_TOKENS`: the codes of pages
        ``c0 .. c1-1`` as fp32 ``[Lc, T, P * nb]`` in plane-major column order (one reused buffer)."""
        data_all = self._seg(f"{side}_data")
        p, t = codes_per_byte(bits), self.tokens
        per = max(1, CHUNK_TOKENS // t)
        buf = ws.get(f"live_{side}", (min(per, self.n), t, p, data_all.shape[-1]), torch.float32, data_all.device)
        mask = (1 << bits) - 1
        for c0 in range(0, self.n, per):
            c1 = min(self.n, c0 + per)
            data, out = data_all[c0:c1], buf[: c1 - c0]
            if p == 1:
                out[:, :, 0].copy_(data)
            else:
                out[:, :, 0].copy_(data & mask)
                for i in range(1, p - 1):
                    out[:, :, i].copy_((data >> (i * bits)) & mask)
                out[:, :, p - 1].copy_(data >> ((p - 1) * bits))
            yield c0, c1, out.view(c1 - c0, t, -1)


# Query rows per page from which LiveSlots.received sums the numerators by a batched matmul
# instead of a broadcast multiply and a row sum. Measured on one core (fp32, 1,400 pages of 17-64
# slots): the matmul is 1.4-2x slower at 3-12 rows on pages of 17-28 slots, mixed at 16, and 2.8-5.7x
# faster from 24 rows (12x at a 97-query chunk's 291 rows, where the product leaves the caches;
# docs/measurements.md, "Outside the passes").
RECEIVED_MATMUL_ROWS = 24


@dataclass
class LiveSlots:
    """One tier's live pages after a step's attention: its softmax numerators over their slots,
    and what the significance update needs of them.

    Returned by :func:`live_page_attention` with ``live_slots=True``, so the running-significance
    update (LeanKV §4) touches live slots only and never re-reads the pages' positions.
    ``probs``, ``valid``, ``pos`` and ``score`` live in the cache's workspace: valid until the
    next layer's attention.
    """

    page_ids: torch.Tensor  # [L] int64 pool id of each live page
    head: torch.Tensor  # [L] flat (sequence, KV head) index of each page, in [0, B*Hkv)
    # [L, R, T] fp32 exp(s - shift): the softmax numerators of pass 2 (0 where dead or after the query)
    probs: torch.Tensor
    shift: torch.Tensor  # [B*Hkv, R] the per-row maximum they are taken against
    valid: torch.Tensor  # [L, T] bool: slot holds a stored token
    pos: torch.Tensor  # [L, T] int32 token positions (dead slots: int32 max)
    score: torch.Tensor  # [L, T] fp32 stored significance as read (dead slots: stale bytes)
    # [B*Hkv, R] fp32 what each row's numerator counts for in the received mass (exp(shift - lse)
    # averaged over the group, 0 for rows that do not count), once the step's lse is known
    row_weight: torch.Tensor | None = None
    pages: native.PoolPages | None = None  # the pages as the compiled kernels read them, on that path

    @property
    def received(self) -> torch.Tensor:
        """``[L, T]``: the probability mass each slot received this step (``row_weight`` set)."""
        if self.row_weight is None:
            raise ValueError("LiveSlots.received needs row_weight: pass the slots through received_from_logits")
        weight = self.row_weight.index_select(0, self.head)  # [L, R]
        if self.probs.shape[1] < RECEIVED_MATMUL_ROWS:
            # Few rows per page (a decode step): a broadcast multiply and a row sum beat a batched
            # matmul of [1, R] x [R, T].
            return (self.probs * weight.unsqueeze(-1)).sum(1)
        # Many rows (a long step's query chunk): the broadcast product [L, R, T] is tens of MB and
        # leaves the caches; the batched matmul reads the numerators once.
        return torch.bmm(weight.unsqueeze(1), self.probs).squeeze(1)

    def holding(self, received: torch.Tensor) -> LiveSlots:
        """These slots with a received mass ``[L, T]`` already summed (over a long step's query
        chunks, each of which had its own numerators): one row of weight 1, which ``received`` and
        the compiled score update read as they read any other."""
        bh = self.shift.shape[0]
        return replace(self, probs=received.unsqueeze(1), shift=received.new_zeros((bh, 1)),
                       row_weight=received.new_ones((bh, 1)))


def tier_page_maxima(kv) -> list[int]:
    """Most pages any (sequence, head) of the layer holds, per tier (one host read)."""
    n_pages = kv.table.n_pages[: len(kv.layouts), kv.layer]  # [tiers, B, H]
    return n_pages.flatten(1).amax(1).tolist() if n_pages[0].numel() else [0] * len(kv.layouts)


def queries_per_call(kv, page_maxima: list[int], group: int) -> int:
    """Queries per sequence one compiled :func:`live_page_attention` call takes so that its fp32
    scores (each query's ``group`` rows over every live slot: at most each (sequence, head) at its
    tier's page maximum) stay within :data:`LIVE_SCORE_BYTES`; at least 1."""
    b, hkv = kv.table.shape[1], kv.table.shape[2]
    slots = b * hkv * sum(p * lay.tokens for p, lay in zip(page_maxima, kv.layouts, strict=True))
    return max(1, LIVE_SCORE_BYTES // max(1, 4 * group * slots))


def _key_scores_torch(qs: torch.Tensor, lt: _LiveTier, bits: int, ws) -> torch.Tensor:
    """Scaled scores ``[L, R, T]`` of every live slot of ``lt`` (torch path: plane-major codes,
    one batched matmul per chunk of pages, Eq. 2 factored)."""
    lay, (bh, rows, f) = lt.layout, qs.shape
    ng, n = lay.groups, lt.n
    qq = _plane_query(qs, bits).flatten(-2)  # [BH, R, F], plane-major columns
    qbd = (qq.unsqueeze(1) * _group_mask(lay, bits, qs.device)).view(bh, ng * rows, f)  # block-diagonal by group
    q_pages = qbd.index_select(0, lt.head)  # [L, G*R, F]: each page meets its own head's rows
    dots = qs.new_empty((n, ng, rows, lt.tokens))
    for c0, c1, codes in lt.planes("k", bits, ws):
        torch.bmm(q_pages[c0:c1], codes.transpose(1, 2), out=dots[c0:c1].view(c1 - c0, ng * rows, -1))
    sc, mn = lt.meta("k")  # [L, G, T] each
    qsum = qs.view(bh, rows, ng, -1).sum(-1).index_select(0, lt.head)  # [L, R, G]
    # sum_g s_g (q_g . Q_g) + m_g sum(q_g), elementwise: a matmul with G inner terms is far
    # slower on a CPU than these few fused multiply-adds.
    s_tier = torch.mul(dots[:, 0], sc[:, :1])
    for gi in range(ng):
        if gi:
            s_tier.addcmul_(dots[:, gi], sc[:, gi: gi + 1])
        s_tier.addcmul_(qsum[..., gi: gi + 1], mn[:, gi: gi + 1])
    return s_tier


def _values_torch(p: torch.Tensor, lt: _LiveTier, ws, bh: int, rows: int, f: int) -> torch.Tensor:
    """``[BH, R, F]``: ``sum_n p_n v_hat_n`` over the live slots of ``lt``, per head (torch path,
    plane-major and factored: ``sum_n (p_n s_n) codes_n + sum_n p_n m_n`` per group)."""
    lay, bits = lt.layout, lt.layout.precision.v_bits
    ng, n = lay.groups, lt.n
    sc, mn = lt.meta("v")  # [L, G, T] each; 0 on dead slots
    weights = torch.mul(p.unsqueeze(1), sc.unsqueeze(2), out=p.new_empty((n, ng, rows, lt.tokens)))
    weights = weights.view(n, ng * rows, -1)  # p * s_g, rows by group
    y = p.new_empty((n, ng * rows, f))  # per page: sum p s codes
    for c0, c1, codes in lt.planes("v", bits, ws):
        torch.bmm(weights[c0:c1], codes, out=y[c0:c1])
    acc_codes = torch.zeros((bh, ng * rows, f), device=p.device).index_add_(0, lt.head, y)
    p_min = torch.bmm(p, mn.contiguous().transpose(1, 2))  # [L, R, G]: sum_n p_n m_n
    acc_min = torch.zeros((bh, rows, ng), device=p.device).index_add_(0, lt.head, p_min)
    picked = (acc_codes.view(bh, ng, rows, f) * _group_mask(lay, bits, p.device)).sum(1)
    out = _plane_values(picked.view(bh, rows, codes_per_byte(bits), -1))  # each column from its own group
    return out + acc_min.repeat_interleave(lay.group_size, dim=-1)


def live_page_attention(q: torch.Tensor, kv, q_pos: torch.Tensor, scale: float, return_logits: bool = False,
                        page_maxima: list[int] | None = None, live_slots: bool = False,
                        use_native: bool = True):
    """Attention of ``q`` ``[B, Hq, Q, F]`` over the layer's live pages (same contract as
    :func:`leankit.attention.paged_attention_ref`; see the module docstring for the method).

    ``page_maxima``: :func:`tier_page_maxima` of ``kv`` if the caller already has it.
    ``live_slots``: with ``return_logits``, the third item is one :class:`LiveSlots` per tier
    (softmax numerators over live pages) instead of the padded ``[B, Hkv, R, P_t * T_t]`` logits.
    ``use_native``: on a CPU, run the per-page loops in the compiled kernels of
    :mod:`leankit.native` when they are available (``False``: always the torch path).
    """
    from .attention import Workspace

    b, hq, nq, f = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    bh, rows = b * hkv, g * nq
    ws = kv.workspace or Workspace()
    qs, qp = _query_rows(q, q_pos, scale, hkv)
    compiled = native.kernels_for(q.device) if use_native else None
    if compiled is not None:
        return _live_attention_native(compiled, q, qs, qp, kv, ws, return_logits, live_slots)
    maxima = tier_page_maxima(kv) if page_maxima is None else page_maxima
    tiers = [_LiveTier(kv, t, pmax, ws) for t, pmax in enumerate(maxima)]

    # Pass 1: scaled scores of every live slot [L, R, T], and the per-head maximum. A chunk only
    # converts codes and multiplies; metadata, masks and the query gather are tier-wide ops.
    scores, m = [], torch.full((bh, rows), float("-inf"), device=q.device)
    for lt in tiers:
        s_tier = _key_scores_torch(qs, lt, lt.layout.precision.k_bits, ws)
        visible = lt.pos.unsqueeze(1) <= qp.index_select(0, lt.head).unsqueeze(-1)  # live and not after the query
        s_tier = s_tier.masked_fill_(~visible, float("-inf"))
        if lt.n:
            m.scatter_reduce_(0, lt.head.view(-1, 1).expand(-1, rows), s_tier.amax(-1), "amax")
        scores.append(s_tier)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))

    # Pass 2: probabilities, their per-head sums, and the values (plane-major, factored):
    # sum_n p_n v_hat_n = sum_n (p_n s_n) codes_n + sum_n p_n m_n per group.
    l_sum = torch.zeros_like(m)
    acc = torch.zeros((bh, rows, f), device=q.device)
    for lt, s_tier in zip(tiers, scores):
        if not lt.n:
            continue
        shift = m_safe.index_select(0, lt.head).unsqueeze(-1)
        keep_logits = return_logits and not live_slots  # the padded logits are s itself, not its exp
        p = torch.exp(s_tier - shift) if keep_logits else s_tier.sub_(shift).exp_()  # [L, R, T]; 0 on dead slots
        l_sum.index_add_(0, lt.head, p.sum(-1))
        acc += _values_torch(p, lt, ws, bh, rows, f)

    out, lse = _normalize(q, acc, l_sum, m_safe, b, hkv, g, nq)
    if not return_logits:
        return out, lse
    if live_slots:
        return out, lse, [LiveSlots(lt.page_ids, lt.head, probs, m_safe, lt.valid, lt.pos,
                                     lt._seg("score", torch.float16).squeeze(-1).float())
                          for lt, probs in zip(tiers, scores)]  # exp'd in place by pass 2
    return out, lse, [_padded_logits(s_tier, lt.flat, lt.pmax, b, hkv) for lt, s_tier in zip(tiers, scores)]


def _query_rows(q: torch.Tensor, q_pos: torch.Tensor, scale: float, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled query rows ``[BH, R, F]`` fp32 and their positions ``[BH, R]`` int32 that both
    passes take: row ``g*Q + i`` of KV head ``h`` is query head ``h*G + g``, query ``i``."""
    b, hq, nq, f = q.shape
    g = hq // hkv
    qs = (q.float().reshape(b * hkv, g * nq, f) * scale).contiguous()
    qp = q_pos.to(torch.int32).view(b, 1, 1, nq).expand(b, hkv, g, nq).reshape(b * hkv, g * nq).contiguous()
    return qs, qp


def _padded_logits(s_tier: torch.Tensor, flat: torch.Tensor, pmax: int, b: int, hkv: int) -> torch.Tensor:
    """Live-page scores ``[L, R, T]`` in the padded slot order ``[B, Hkv, R, P_max * T]`` of
    :func:`leankit.attention.paged_attention_ref`, -inf where dead; ``flat`` is each page's index
    ``head * P_max + rank`` into the padded pages."""
    _, rows, tokens = s_tier.shape
    full = torch.full((b * hkv * pmax, rows, tokens), float("-inf"), device=s_tier.device)
    full.index_copy_(0, flat, s_tier)
    return full.view(b * hkv, pmax, rows, tokens).transpose(1, 2).reshape(b, hkv, rows, -1)


def _normalize(q, acc, l_sum, m_safe, b: int, hkv: int, g: int, nq: int):
    """The attention output ``[B, Q, Hq, F]`` (in ``q``'s dtype) and log-sum-exp ``[B, Hkv, R]``
    from the unnormalized value sums ``acc`` ``[BH, R, F]``, the numerators' sums ``l_sum`` and
    the shift ``m_safe`` ``[BH, R]`` they were taken against; 0 and -inf for rows that see nothing."""
    f, rows = acc.shape[-1], g * nq
    # A row that sees nothing has l_sum = 0 and acc = 0 (nothing was added), so the clamped
    # division gives its 0 output and log(0) its -inf lse, with no masks: a row that sees anything
    # has l_sum >= 1 (its maximum slot contributes exp(0)), far above the clamp. Fewer small ops
    # per layer matter here: a decode step calls this once per layer.
    out = acc / l_sum.clamp_min(1e-30).unsqueeze(-1)
    lse = torch.log(l_sum).add_(m_safe)
    out = out.view(b, hkv, g, nq, f).reshape(b, hkv * g, nq, f).transpose(1, 2).to(q.dtype)
    return out, lse.view(b, hkv, rows)


def tier_pages(k: native.Kernels, kv, tier: int, out: tuple | None = None) -> native.PoolPages:
    """The live pages of ``tier`` in ``kv``'s layer, listed from its page table by the compiled
    kernels (head order, then rank order); ``out``: three int64 buffers to list into
    (:meth:`leankit.native.Kernels.list_pages`)."""
    table, layer, lay = kv.table, kv.layer, kv.layouts[tier]
    bh = table.shape[1] * table.shape[2]
    first, step = table.tier_columns(tier)
    rows_of_table = table.tables[layer].view(bh, table.row_len)
    return k.list_pages(kv.pool.storage, table.n_pages[tier, layer].view(bh), rows_of_table, first, step,
                        lay.tokens, dict(zip(SEGMENTS, lay.seg_offsets)), out=out)


def _native_scores(k: native.Kernels, qs: torch.Tensor, qp: torch.Tensor, kv, ws, keep_slots: bool):
    """Pass 1 of the compiled kernels over every tier's live pages: ``(pages, scores, slots, m)``,
    per tier the listed pages, their masked scaled scores ``[L, R, T]`` and (``keep_slots``) the
    slots' positions, validity and stored significance; ``m`` ``[BH, R]`` each row's maximum."""
    table, layer = kv.table, kv.layer
    bh, rows = qp.shape
    m = torch.full((bh, rows), float("-inf"))
    tiers, scores, slots = [], [], []
    for tier, lay in enumerate(kv.layouts):
        listing = tuple(ws.get(f"live_list{tier}_{i}", (bh * table.row_len,), torch.int64, "cpu") for i in range(3))
        pages = tier_pages(k, kv, tier, out=listing)
        n, t = pages.page_id.numel(), lay.tokens
        s_tier = ws.get(f"live_scores{tier}", (n, rows, t), torch.float32, "cpu")
        extra = {}
        if keep_slots:
            extra = {"pos_out": ws.get(f"live_pos{tier}", (n, t), torch.int32, "cpu"),
                     "valid_out": ws.get(f"live_valid{tier}", (n, t), torch.bool, "cpu"),
                     "score_out": ws.get(f"live_score{tier}", (n, t), torch.float32, "cpu")}
        k.live_scores(pages, qs, qp, table.lens[tier, layer].view(bh),
                      native.side_format(lay.precision.k_bits, lay.dense_dtype), lay.group_size, s_tier, m, **extra)
        tiers.append(pages)
        scores.append(s_tier)
        slots.append(extra)
    return tiers, scores, slots, m


def _native_values(k: native.Kernels, kv, tiers, scores, m: torch.Tensor, dim: int):
    """Pass 2 of the compiled kernels: ``(shift, l_sum, acc)``; pass 1's scores become the softmax
    numerators in place."""
    shift = m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a row that sees nothing: numerators 0 either way
    l_sum = torch.zeros(m.shape)
    acc = torch.zeros((*m.shape, dim))
    for lay, pages, s_tier in zip(kv.layouts, tiers, scores):
        k.live_values(pages, s_tier, shift, native.side_format(lay.precision.v_bits, lay.dense_dtype),
                      lay.group_size, l_sum, acc)
    return shift, l_sum, acc


def _live_slots(tiers, scores, slots, shift, row_weight=None) -> list[LiveSlots]:
    """One :class:`LiveSlots` per tier from the passes' results (``slots`` kept by pass 1)."""
    return [LiveSlots(pages.page_id, pages.head, probs, shift, extra["valid_out"], extra["pos_out"],
                      extra["score_out"], row_weight=row_weight, pages=pages)
            for pages, probs, extra in zip(tiers, scores, slots)]


def _live_attention_native(k: native.Kernels, q: torch.Tensor, qs: torch.Tensor, qp: torch.Tensor, kv, ws,
                           return_logits: bool, live_slots: bool):
    """:func:`live_page_attention` on the compiled CPU kernels: each tier's live pages are listed
    from the page table and read in place in the pool (no gathered copy, no fp32 copy of the
    metadata); masks, maxima, numerators and their sums are computed inside the two passes.
    ``qs`` ``[BH, R, F]`` and ``qp`` ``[BH, R]`` are the scaled query rows and their positions."""
    b, hq, nq, f = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    tiers, scores, slots, m = _native_scores(k, qs, qp, kv, ws, keep_slots=return_logits and live_slots)
    padded = None
    if return_logits and not live_slots:  # the padded logits are the scores themselves, kept before pass 2
        maxima = tier_page_maxima(kv)
        padded = [_padded_logits(s_tier, pages.head * pmax + pages.rank, pmax, b, hkv)
                  for s_tier, pages, pmax in zip(scores, tiers, maxima)]
    shift, l_sum, acc = _native_values(k, kv, tiers, scores, m, f)
    out, lse = _normalize(q, acc, l_sum, shift, b, hkv, g, nq)
    if not return_logits:
        return out, lse
    if padded is not None:
        return out, lse, padded
    return out, lse, _live_slots(tiers, scores, slots, shift)


def step_logits_queries(kv, group: int, device) -> int:
    """Queries per sequence a compiled :func:`live_page_attention` call of a long step may take
    with its live-slot logits kept (:func:`queries_per_call`: they fit :data:`LIVE_SCORE_BYTES`),
    so that the stored tokens' significance comes from them
    (:func:`leankit.attention.received_from_logits`) with no second pass over the keys; a step of
    more queries goes in chunks of this many. 0 where the compiled kernels do not serve the
    layer's pages. One host read of the page counts."""
    if native.kernels_for(device) is None:
        return 0
    maxima = tier_page_maxima(kv)
    per_call = queries_per_call(kv, maxima, group)
    return per_call if supports(kv.layouts, group * per_call, [m > 0 for m in maxima], compiled=True) else 0


def serves_decode_step(kv, rows: int, device) -> bool:
    """Whether :func:`decode_step_attention` serves a decode step of ``rows`` query rows per KV
    head (the group size) over ``kv``'s pages on ``device``: the compiled CPU kernels are there and
    read every side of every tier."""
    return native.kernels_for(device) is not None and supports(kv.layouts, rows, compiled=True)


def decode_step_attention(q: torch.Tensor, kv, q_pos: torch.Tensor, scale: float, k_new: torch.Tensor,
                          v_new: torch.Tensor, real: torch.Tensor, significance: bool = False,
                          update_significance: bool = False):
    """A decode step's whole attention on the compiled CPU kernels: one query per sequence over
    the layer's live pages and the step's own token, at its exact key and value.

    One compiled call (:meth:`leankit.native.Kernels.decode_attention`) lists each tier's live
    pages, runs both passes over them (what :func:`live_page_attention` runs on the compiled
    kernels), then adds the new token, merges the two softmaxes by log-sum-exp and normalizes: what
    :func:`leankit.attention.step_attention` and :func:`leankit.attention.merge_attention` compute
    after :func:`live_page_attention`, without the small tensor ops around each kernel (a few
    hundred microseconds a layer at short contexts). Check :func:`serves_decode_step` first.

    Args:
        q: ``[B, Hq, 1, F]`` queries in the basis the pages hold (rotated if the cache rotates).
        q_pos: int ``[B, 1]`` the step's positions; ``real`` bool ``[B, 1]``: the row's token is real.
        k_new, v_new: ``[B, Hkv, 1, F]`` the step's keys and values, in the pages' basis.
        significance: also return what LeanKV's running significance needs (§4).
        update_significance: with ``significance``, update the stored tokens' running
            significance in place in the same call (what :meth:`leankit.policy._Base.update_scores`
            does with the live slots, as the GPU decode kernel's fused score update does), and
            return no live slots.

    Returns:
        ``(out [B, 1, Hq, F] fp32 in the pages' basis, lse [B, Hkv, G], live, received)``: with
        ``significance``, ``received`` ``[B, Hkv, 1]`` is the mass the new token received and
        ``live`` one :class:`LiveSlots` per tier with ``row_weight`` set (None with
        ``update_significance``); else both ``None``.
    """
    from .attention import Workspace

    b, hq, nq, f = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    bh = b * hkv
    if nq != 1:
        raise ValueError(f"decode_step_attention: one query per sequence, got {nq}")
    k = native.kernels_for(q.device)
    if k is None:
        raise RuntimeError(f"decode_step_attention runs on the compiled CPU kernels, which {q.device} tensors "
                           "cannot use here (see serves_decode_step)")
    ws = kv.workspace or Workspace()
    tiers, buffers = _decode_tiers(kv, ws, g, keep_slots=significance)
    scratch = (ws.get("decode_q_rows", (bh, g, f), torch.float32, "cpu"),
               ws.get("decode_row_pos", (bh, g), torch.int32, "cpu"),
               ws.get("decode_l_sum", (bh, g), torch.float32, "cpu"))
    shift = torch.empty((bh, g))  # kept by the live slots of a significance step: not a workspace buffer
    out, lse = torch.empty((b, 1, hq, f)), torch.empty((bh, g))  # row g of KV head h is query head h*G + g
    row_weight = torch.empty((bh, g)) if significance else None
    received = torch.empty(bh) if significance else None
    k.decode_attention(kv.pool.storage, tiers, _contiguous_f32(q), scale, _flat_positions(q_pos, b),
                       _contiguous_f32(k_new), _contiguous_f32(v_new), real.reshape(b).contiguous(),
                       (scratch[0], scratch[1], shift, scratch[2]), out, lse, row_weight, received,
                       update_significance=significance and update_significance)
    if not significance:
        return out, lse.view(b, hkv, g), None, None
    if update_significance:
        return out, lse.view(b, hkv, g), None, received.view(b, hkv, 1)
    pages, probs, slots = zip(*_listed_tiers(kv, tiers, buffers))
    live = _live_slots(pages, probs, slots, shift, row_weight)
    return out, lse.view(b, hkv, g), live, received.view(b, hkv, 1)


def _contiguous_f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous fp32 tensor (itself when it already is one)."""
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


def _flat_positions(q_pos: torch.Tensor, b: int) -> torch.Tensor:
    """A decode step's positions ``[B, 1]`` as the contiguous int64 ``[B]`` the kernels read."""
    q_pos = q_pos.reshape(b)
    if q_pos.dtype != torch.int64:
        q_pos = q_pos.long()
    return q_pos if q_pos.is_contiguous() else q_pos.contiguous()


def _decode_tiers(kv, ws, rows: int, keep_slots: bool):
    """``(tiers, buffers)`` for :meth:`leankit.native.Kernels.decode_attention` on ``kv``'s layer:
    the ctypes :class:`leankit.native.DecodeTier` array (per tier, its page-table rows and counts,
    its page geometry and the buffers its pages are listed into) and, per tier, those buffers by
    name (``head``, ``rank``, ``page_id`` ``[C]``, ``scores`` ``[C, rows, T]`` and, with
    ``keep_slots``, the slots' ``pos_out``/``valid_out``/``score_out`` ``[C, T]``), each holding
    every page a row of the table can list (``C`` pages).

    Memoized per layer in the workspace: a decode step builds the same arguments in every layer
    of every step, which cost about as much as the rest of the call's Python. An entry serves as
    long as the layer's table views (:meth:`leankit.page_table.BidirectionalPageTable.layer_views`,
    cut afresh whenever the table's tensors are replaced) and the layouts are the ones it was built
    from; it holds its own buffers (tensors kept alive by the entry), so its pointers stay valid
    whatever else the workspace hands out."""
    table, layer = kv.table, kv.layer
    views = table.layer_views(layer)
    key = ("decode_tiers", layer, rows, keep_slots)
    memo = ws.memo.get(key)
    if memo is not None and memo[0] is views and memo[1] is kv.layouts:
        return memo[2], memo[3]
    if not (table.tables.is_contiguous() and table.n_pages.is_contiguous() and table.lens.is_contiguous()):
        raise ValueError("decode_step_attention: the page table's tensors must be contiguous")
    _, batch, heads = table.shape
    row_len = table.row_len
    capacity = batch * heads * row_len
    tiers = (native.DecodeTier * len(kv.layouts))()
    buffers = []
    for tier, (lay, desc) in enumerate(zip(kv.layouts, tiers)):
        desc.n_pages, desc.table, desc.lens = (views.n_pages[tier].data_ptr(), views.tables.data_ptr(),
                                               views.tier_lens[tier].data_ptr())
        desc.first_col, desc.col_step = table.tier_columns(tier)
        desc.row_len, desc.capacity = row_len, capacity
        desc.tokens, desc.group_size = lay.tokens, lay.group_size
        desc.k_bits = native.side_format(lay.precision.k_bits, lay.dense_dtype)
        desc.v_bits = native.side_format(lay.precision.v_bits, lay.dense_dtype)
        (desc.k_data, desc.k_meta, desc.v_data, desc.v_meta, desc.score_off, desc.pos_off) = lay.seg_offsets
        t = lay.tokens
        named = {name: ws.get(f"decode_{name}{tier}", (capacity,), torch.int64, "cpu")
                 for name in ("head", "rank", "page_id")}
        named["scores"] = ws.get(f"decode_scores{tier}", (capacity, rows, t), torch.float32, "cpu")
        if keep_slots:
            named.update({name: ws.get(f"decode_{name}{tier}", (capacity, t), dtype, "cpu")
                          for name, dtype in (("pos_out", torch.int32), ("valid_out", torch.bool),
                                              ("score_out", torch.float32))})
        for name, buf in named.items():
            setattr(desc, name, buf.data_ptr())
        buffers.append(named)
    ws.memo[key] = (views, kv.layouts, tiers, buffers)
    return tiers, buffers


def _listed_tiers(kv, tiers, buffers):
    """Per tier, what :func:`_decode_tiers`' buffers hold after the call: ``(pages, probs, slots)``,
    the listed pages (:class:`leankit.native.PoolPages`), their numerators ``[L, R, T]`` and the
    slots' ``pos_out``/``valid_out``/``score_out`` ``[L, T]``, cut to the ``L`` pages listed."""
    for lay, desc, named in zip(kv.layouts, tiers, buffers):
        n = desc.n_listed
        pages = native.PoolPages(kv.pool.storage, named["page_id"][:n], named["head"][:n], named["rank"][:n],
                                 lay.tokens, dict(zip(SEGMENTS, lay.seg_offsets)))
        slots = {name: named[name][:n] for name in ("pos_out", "valid_out", "score_out")}
        yield pages, named["scores"][:n], slots
