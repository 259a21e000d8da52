"""Causal FlashAttention-style prefill over unified pages, and per-key significance (LeanKV §4, §6.2).

The step's new tokens are quantized into their page slots *before* attention runs, so prefill
reads one source of truth: the layer's pages (any cached prefix pages plus the prompt), high tier
first, then low tier, exactly like decode.

Reads
    ``q``: ``[B, Hq, Q, F]`` (any strides, last dim contiguous); ``q_pos`` int ``[B, Q]``;
    the page table slices ``tables[layer]`` int32 ``[B, Hkv, R]``, ``lens`` int32 ``[2, L, B, Hkv]``;
    the uint8 page pool (K/V data + meta and positions of each live slot, see
    :mod:`leankit_kernels.tiles`).
    ``received_attention`` also reads the saved ``lse`` fp32 ``[B, Hkv, G*Q]`` and ``q_valid``.
Writes
    ``out`` ``[B, Q, Hq, F]`` (``q.dtype``) and ``lse`` fp32 ``[B, Hkv, G*Q]`` (row ``g*Q + i``,
    natural log, ``-inf`` for a query that sees no key);
    ``received_attention``: one fp32 ``[B, Hkv, P_t * T_t]`` per tier (slot order, dead slots 0).

Kernels
    ``_prefill_kernel``: one program per (sequence, KV head, block of ``BLOCK_M`` query rows).
    The group's rows are ordered query-major (``row = i * G + g``), so a block holds all G heads of
    ``BLOCK_M / G`` consecutive queries: every dequantized ``[BLOCK_N, F]`` K/V tile is shared by
    the whole group (``tl.dot`` ``[BLOCK_M, F] x [F, BLOCK_N]``), and the block's position range
    is narrow, so tiles whose keys are all in the future of the block are skipped after loading
    only their positions (causal skipping, by stored position, which also covers pruned and
    reordered slots). Online softmax in base 2.
    ``_received_kernel``: the significance pass (LeanKV §4: a token's significance is the
    attention probability it receives). One program per (sequence, KV head, tile of ``BLOCK_N``
    slots, tier): it dequantizes its K tile once, then streams the group's query rows in blocks,
    recomputes ``p = exp(q k^T * scale - lse)`` with the saved ``lse`` and sums it over rows. No
    ``Q x N`` matrix ever exists beyond one ``[BLOCK_M, BLOCK_N]`` register tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from leankit.attention import PagedKV

from . import tiles
from .tiles import (
    LOG2E,
    check_head_dim,
    dot_config,
    kernel_for,
    layer_views,
    load_positions,
    load_side,
    page_counts,
    slot_pages,
    tier_args,
)

__all__ = ["prefill_attention", "received_attention"]

BLOCK_M = 64
BLOCK_N = 32


def prefill_warps(head_dim: int) -> int:
    """Warps per program: the ``[BLOCK_M, F]`` fp32 accumulator must fit registers without spills."""
    return 8 if head_dim >= 128 else 4


@triton.jit
def _prefill_tier(m, l, acc, q, qpos_r, qmax, pool, tab_row, n_slots, R, sm_scale,
                  LOW: tl.constexpr, T: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                  KOFF: tl.constexpr, KMOFF: tl.constexpr, VOFF: tl.constexpr, VMOFF: tl.constexpr,
                  POSOFF: tl.constexpr, F: tl.constexpr, NG: tl.constexpr, DENSE: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    for start in range(0, n_slots, BLOCK_N):
        slot = start + tl.arange(0, BLOCK_N)
        valid = slot < n_slots
        page, row = slot_pages(tab_row, slot, valid, R, T, LOW)
        kpos = load_positions(pool, page, row, valid, POSOFF, PAGE_SIZE)
        if tl.min(kpos, 0) <= qmax:  # causal skip: some query of the block sees a key of the tile
            k = load_side(pool, page, row, valid, KOFF, KMOFF, KBITS, F, NG, DENSE, PAGE_SIZE, BLOCK_N)
            s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * sm_scale
            s = tl.where(kpos[None, :] <= qpos_r[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            l = l * alpha + tl.sum(p, 1)
            v = load_side(pool, page, row, valid, VOFF, VMOFF, VBITS, F, NG, DENSE, PAGE_SIZE, BLOCK_N)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
            m = m_new
    return m, l, acc


@triton.jit
def _prefill_kernel(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, pool, tab_ptr, len_ptr,
                    stride_tier, out_ptr, lse_ptr, H, R, NQ, sm_scale,
                    G: tl.constexpr, F: tl.constexpr, NG: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    DENSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT: tl.constexpr, PREC: tl.constexpr, HAS_LOW: tl.constexpr,
                    H_T: tl.constexpr, H_KBITS: tl.constexpr, H_VBITS: tl.constexpr, H_KOFF: tl.constexpr,
                    H_KMOFF: tl.constexpr, H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SCOFF: tl.constexpr,
                    H_POSOFF: tl.constexpr,
                    L_T: tl.constexpr, L_KBITS: tl.constexpr, L_VBITS: tl.constexpr, L_KOFF: tl.constexpr,
                    L_KMOFF: tl.constexpr, L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SCOFF: tl.constexpr,
                    L_POSOFF: tl.constexpr):
    """One (sequence, KV head, block of query rows ``i * G + g``) over all live slots of both tiers."""
    bh = tl.program_id(0)
    mb = tl.program_id(1)
    b = bh // H
    h = bh % H
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < NQ * G
    qi = r // G
    g = r % G
    f = tl.arange(0, F)
    qpos_r = tl.load(qpos_ptr + b * stride_pb + qi, mask=rmask, other=-1)
    qmax = tl.max(qpos_r, 0)
    q_rows = b.to(tl.int64) * stride_qb + (h * G + g) * stride_qh + qi.to(tl.int64) * stride_qq
    q = tl.load(q_ptr + q_rows[:, None] + f[None, :], mask=rmask[:, None], other=0.0).to(DOT)
    tab_row = tab_ptr + bh.to(tl.int64) * R
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, F], tl.float32)
    m, l, acc = _prefill_tier(m, l, acc, q, qpos_r, qmax, pool, tab_row, tl.load(len_ptr + bh), R, sm_scale,
                              False, H_T, H_KBITS, H_VBITS, H_KOFF, H_KMOFF, H_VOFF, H_VMOFF, H_POSOFF,
                              F, NG, DENSE, PAGE_SIZE, BLOCK_N, DOT, PREC)
    if HAS_LOW:
        m, l, acc = _prefill_tier(m, l, acc, q, qpos_r, qmax, pool, tab_row, tl.load(len_ptr + stride_tier + bh),
                                  R, sm_scale,
                                  True, L_T, L_KBITS, L_VBITS, L_KOFF, L_KMOFF, L_VOFF, L_VMOFF, L_POSOFF,
                                  F, NG, DENSE, PAGE_SIZE, BLOCK_N, DOT, PREC)
    has = l > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    o_rows = ((b.to(tl.int64) * NQ + qi) * H + h) * G + g  # out is [B, Q, Hq, F]
    tl.store(out_ptr + o_rows[:, None] * F + f[None, :], out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + bh.to(tl.int64) * G * NQ + g * NQ + qi, lse, mask=rmask)


@triton.jit
def _received_tier(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool, tab_row,
                   out_row, n_out, n_live, blk, b, h, bh, R, NQ, sm_scale,
                   LOW: tl.constexpr, T: tl.constexpr, KBITS: tl.constexpr, KOFF: tl.constexpr,
                   KMOFF: tl.constexpr, POSOFF: tl.constexpr, G: tl.constexpr, F: tl.constexpr,
                   NG: tl.constexpr, DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    slot = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = slot < n_live
    page, row = slot_pages(tab_row, slot, valid, R, T, LOW)
    kpos = load_positions(pool, page, row, valid, POSOFF, PAGE_SIZE)
    kmin = tl.min(kpos, 0)
    k = load_side(pool, page, row, valid, KOFF, KMOFF, KBITS, F, NG, DENSE, PAGE_SIZE, BLOCK_N).to(DOT)
    f = tl.arange(0, F)
    got = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, NQ * G, BLOCK_M):
        r = r0 + tl.arange(0, BLOCK_M)
        rmask = r < NQ * G
        qi = r // G
        g = r % G
        qp = tl.load(qpos_ptr + b * stride_pb + qi, mask=rmask, other=-1)
        if tl.max(qp, 0) >= kmin:  # causal skip: the block sees some key of the tile
            qok = tl.load(qv_ptr + b * NQ + qi, mask=rmask, other=0) != 0
            lse = tl.load(lse_ptr + bh.to(tl.int64) * G * NQ + g * NQ + qi, mask=rmask, other=float("-inf"))
            live = qok & (lse > float("-inf"))
            lse2 = tl.where(live, lse * 1.4426950408889634, 0.0)
            q_rows = b.to(tl.int64) * stride_qb + (h * G + g) * stride_qh + qi.to(tl.int64) * stride_qq
            q = tl.load(q_ptr + q_rows[:, None] + f[None, :], mask=rmask[:, None], other=0.0).to(DOT)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
            vis = live[:, None] & (kpos[None, :] <= qp[:, None])
            p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
            got += tl.sum(p, 0)
    tl.store(out_row + slot, got / G, mask=slot < n_out)


@triton.jit
def _received_kernel(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool, tab_ptr,
                     len_ptr, stride_tier, out_h, out_l, NH_OUT, NL_OUT, H, R, NQ, sm_scale,
                     G: tl.constexpr, F: tl.constexpr, NG: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     DENSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT: tl.constexpr, PREC: tl.constexpr, HAS_LOW: tl.constexpr,
                     H_T: tl.constexpr, H_KBITS: tl.constexpr, H_VBITS: tl.constexpr, H_KOFF: tl.constexpr,
                     H_KMOFF: tl.constexpr, H_VOFF: tl.constexpr, H_VMOFF: tl.constexpr, H_SCOFF: tl.constexpr,
                     H_POSOFF: tl.constexpr,
                     L_T: tl.constexpr, L_KBITS: tl.constexpr, L_VBITS: tl.constexpr, L_KOFF: tl.constexpr,
                     L_KMOFF: tl.constexpr, L_VOFF: tl.constexpr, L_VMOFF: tl.constexpr, L_SCOFF: tl.constexpr,
                     L_POSOFF: tl.constexpr):
    """Received probability of one tile of slots of one tier (``program_id(2)``) of one (sequence, head)."""
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    tier = tl.program_id(2)
    b = bh // H
    h = bh % H
    tab_row = tab_ptr + bh.to(tl.int64) * R
    # Tiles past a tier's slot count find no live key (kmin = POS_DEAD) and skip every query block.
    if tier == 0:
        _received_tier(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool,
                       tab_row, out_h + bh.to(tl.int64) * NH_OUT, NH_OUT, tl.load(len_ptr + bh), blk, b, h, bh,
                       R, NQ, sm_scale, False, H_T, H_KBITS, H_KOFF, H_KMOFF, H_POSOFF, G, F, NG, DENSE,
                       PAGE_SIZE, BLOCK_M, BLOCK_N, DOT, PREC)
    elif HAS_LOW:
        _received_tier(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool,
                       tab_row, out_l + bh.to(tl.int64) * NL_OUT, NL_OUT, tl.load(len_ptr + stride_tier + bh),
                       blk, b, h, bh, R, NQ, sm_scale, True, L_T, L_KBITS, L_KOFF, L_KMOFF, L_POSOFF, G, F, NG,
                       DENSE, PAGE_SIZE, BLOCK_M, BLOCK_N, DOT, PREC)


def _q_strides(q: torch.Tensor) -> torch.Tensor:
    return q if q.stride(-1) == 1 else q.contiguous()


def prefill_attention(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, *,
                      q_valid: torch.Tensor | None = None, return_significance: bool = False,
                      block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """Causal attention of ``q`` ``[B, Hq, Q, F]`` over the layer's pages (prompt already written).

    Returns ``(out [B, Q, Hq, F], lse [B, Hkv, G*Q])`` like
    :func:`leankit.attention.paged_attention_ref`; with ``return_significance=True`` also the
    per-tier received probability of every slot (see :func:`received_attention`), computed by a
    second pass over the keys that reuses ``lse``.
    """
    b, hq, nq, f = q.shape
    check_head_dim(f)
    tables, _n_pages, lens, stride_tier = layer_views(kv)
    hkv, r = tables.shape[1], tables.shape[2]
    g = hq // hkv
    q = _q_strides(q)
    dev = q.device
    targs = tier_args(kv.layouts)
    out = tiles.empty((b, nq, hq, f), dtype=q.dtype, device=dev)
    lse = tiles.empty((b, hkv, g * nq), dtype=torch.float32, device=dev)
    q_pos = q_pos.to(device=dev, dtype=torch.int32).contiguous()
    dot_t, prec = dot_config(q.dtype, dev)
    grid = (b * hkv, triton.cdiv(g * nq, block_m))
    kernel_for(_prefill_kernel, dev)[grid](
        q, q.stride(0), q.stride(1), q.stride(2), q_pos, q_pos.stride(0), kv.pool.storage, tables, lens, stride_tier,
        out, lse, hkv, r, nq, float(scale) * LOG2E, G=g, BLOCK_M=block_m, BLOCK_N=block_n, DOT=dot_t, PREC=prec,
        num_warps=prefill_warps(f), num_stages=2, **targs)
    if return_significance:
        return out, lse, received_attention(q, kv, q_pos, scale, lse, q_valid)
    return out, lse


def received_attention(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, lse: torch.Tensor,
                       q_valid: torch.Tensor | None = None, *, block_m: int = BLOCK_M,
                       block_n: int = BLOCK_N) -> list[torch.Tensor]:
    """Attention probability each stored token received from this step's queries (LeanKV §4).

    Kernel mirror of :func:`leankit.attention.received_attention_ref`: one fp32
    ``[B, Hkv, P_t * T_t]`` tensor per tier (``P_t`` = the most pages any head has in tier ``t``),
    holding ``sum_i p_ij`` averaged over the group's query heads; dead slots hold 0. ``lse`` is the
    ``[B, Hkv, G*Q]`` log-sum-exp returned by the attention pass; ``q_valid`` bool ``[B, Q]``
    drops padding queries.
    """
    b, hq, nq, f = q.shape
    check_head_dim(f)
    tables, n_pages, lens, stride_tier = layer_views(kv)
    hkv, r = tables.shape[1], tables.shape[2]
    g = hq // hkv
    q = _q_strides(q)
    dev = q.device
    targs = tier_args(kv.layouts)
    max_h, max_l, _ = page_counts(n_pages, targs["HAS_LOW"])
    nh_out = max_h * targs["H_T"]
    nl_out = max_l * targs["L_T"] if targs["HAS_LOW"] else 0
    out_h = tiles.empty((b, hkv, nh_out), dtype=torch.float32, device=dev)
    out_l = tiles.empty((b, hkv, nl_out), dtype=torch.float32, device=dev)
    outs = [out_h, out_l][: len(kv.layouts)]
    n_max = max(nh_out, nl_out)
    if n_max == 0:
        return outs
    q_pos = q_pos.to(device=dev, dtype=torch.int32).contiguous()
    qv = (torch.ones((b, nq), dtype=torch.int32, device=dev) if q_valid is None
          else q_valid.to(device=dev, dtype=torch.int32).reshape(b, nq).contiguous())
    lse = lse.to(torch.float32).contiguous()
    dot_t, prec = dot_config(q.dtype, dev)
    grid = (b * hkv, triton.cdiv(n_max, block_n), len(kv.layouts))
    kernel_for(_received_kernel, dev)[grid](
        q, q.stride(0), q.stride(1), q.stride(2), q_pos, q_pos.stride(0), qv, lse, kv.pool.storage, tables, lens,
        stride_tier, out_h, out_l, nh_out, nl_out, hkv, r, nq, float(scale) * LOG2E,
        G=g, BLOCK_M=block_m, BLOCK_N=block_n, DOT=dot_t, PREC=prec, num_warps=prefill_warps(f), num_stages=2,
        **targs)
    return outs
