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
    is narrow: a first pass over the tier's int32 positions finds the last slot any query of the
    block can see, and the attention loop stops there (causal skipping by loop bound, by stored
    position, which also covers pruned and reordered slots), with a branch-free tile body.
    Online softmax in base 2. Tile sizes per GPU: :func:`prefill_config`.
    ``_received_kernel``: the significance pass (LeanKV §4: a token's significance is the
    attention probability it receives). One program per (sequence, KV head, tile of ``BLOCK_N``
    slots, tier): it dequantizes its K tile once and keeps it in registers, then streams the
    group's query rows in blocks (from the first block with a query at or after the tile's
    earliest key: a loop bound, no branch; ``RECEIVED_BLOCK_N`` keys per tile, so the rows are
    read once per 128 keys), recomputes ``p = exp(q k^T * scale - lse)`` with the saved ``lse`` and sums it over rows. No
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
    dot_config,
    kernel_for,
    layer_launch,
    load_side,
    online_softmax_step,
    page_counts,
    program_head,
    slot_tile,
    softmax_init,
    softmax_lse,
    softmax_output,
    tile_logits,
)

__all__ = ["prefill_attention", "received_attention"]

BLOCK_M = 64
BLOCK_N = 32
# Keys per program of the significance pass: its query rows are streamed once per key tile, so a
# wide tile reads them fewer times (the K tile itself stays in registers across the stream).
RECEIVED_BLOCK_N = 128
RECEIVED_BLOCK_M = 32  # query rows per streamed block: keeps the 128-key tile spill-free on sm_80


def prefill_warps(head_dim: int) -> int:
    """Warps per program: the ``[BLOCK_M, F]`` fp32 accumulator must fit registers without spills."""
    return 8 if head_dim >= 128 else 4


# Prefill tiles on sm_90, timed on an H200 under Triton 3.6 (python bench/prefill_kernels.py
# --tiles ...; results/gpu/prefill_tiles.md): 64 query rows and 4 warps, with 128 keys per tile
# (64 for a layer whose tiers are all dense at head_dim >= 128, where the 128-key fp16 K/V tiles
# take 146 KB of shared memory and one program per SM). Against the 64 x 32 tile of 8 warps that
# the sm_90 launch had used, at batch 4 and 2k-4k tokens: quantized d128 1.87-2.10x, FP16 d128
# 1.68-1.70x, d64 1.20-1.72x. These tiles use up to 255 registers with a few spilled bytes
# outside the loops (python -m leankit_kernels.aot); the 128-register tiles were slower.
SM90_PREFILL_ROWS = 64
SM90_PREFILL_KEYS = 128
SM90_PREFILL_KEYS_DENSE_WIDE = 64
SM90_PREFILL_WARPS = 4
# The sizes those timings cover: fp16/bf16 operands, head_dim <= 128, and tiers with one
# quantization group per token (or dense). At head_dim 256 and at 128 with several groups per
# token (dequantized through fp32 registers) the wider tiles spill inside their loop
# (python -m leankit_kernels.aot: hundreds of local operations at 256, 2-6 at 128 grouped), so
# those layers keep the 64 x 32 tile of 8 warps.
SM90_PREFILL_MAX_HEAD_DIM = 128

# fp32 operands (an fp32 model on a GPU). An ``ieee`` fp32 dot runs on the FMA units in a blocked
# layout where each thread holds whole rows of both operands along head_dim: at every tile tried
# both kernels spilled inside their loop, thousands of local operations at head_dim 128 (even
# 16 x 16 with 4 warps spilled 144-187 at 128). ``tf32x3`` runs the dot on tensor cores as three
# TF32 products (the big x big, big x small and small x big parts of each operand split into a
# TF32 head and a TF32 remainder), which keeps about fp32's accuracy (relative error near 2^-21,
# against 2^-11 for plain TF32) in the MMA register layout. With it these tiles compile with no
# local memory at all on sm_80 and sm_90a, under Triton 3.9 and 3.6 (python -m leankit_kernels.aot;
# a sweep of 16-64 rows x 16-128 keys x 4/8 warps picked the largest spill-free ones). Untimed: no
# fp32 model was run on a GPU. At head_dim 256 every fp32 tile tried still spills; those layers
# keep the default tile and precision.
FP32_PRECISION = "tf32x3"
FP32_WARPS = 8
FP32_PREFILL_TILES = {64: (32, 32), 128: (16, 32)}  # head_dim up to -> (query rows, keys)
FP32_RECEIVED_TILES = {64: (32, 128), 128: (32, 64)}


def _fp32_config(tiles_by_dim: dict, head_dim: int, capability, operand_bytes: int) -> dict | None:
    """Launch options of the fp32-operand tile for ``head_dim`` on a GPU (8 warps, ``tf32x3`` dots),
    or None (16-bit operands, the interpreter, or a head wider than any spill-free tile)."""
    if capability is None or operand_bytes != 4:
        return None
    tile = next((tiles_by_dim[d] for d in sorted(tiles_by_dim) if head_dim <= d), None)
    if tile is None:
        return None
    return {"BLOCK_M": tile[0], "BLOCK_N": tile[1], "num_warps": FP32_WARPS, "PREC": FP32_PRECISION}


def prefill_config(head_dim: int, capability: tuple[int, int] | None, dense: bool = False,
                   grouped: bool = False, operand_bytes: int = 2) -> dict:
    """Tile and launch options of the prefill kernel on a GPU of compute ``capability`` (``None``:
    the interpreter) for a layer whose tiers are all dense (``dense``), or of which some tier holds
    several quantization groups per token (``grouped``), with ``tl.dot`` operands of
    ``operand_bytes`` bytes (2: fp16/bf16 models; 4: fp32).

    sm_90 (H100, H200), 16-bit operands, head_dim <= 128, one group per token: the measured tiles
    above. fp32 operands on a GPU, head_dim <= 128: :data:`FP32_PREFILL_TILES` with 8 warps and
    ``PREC`` = :data:`FP32_PRECISION`. Any other layer on sm_90, sm_80 (not timed here) and the
    interpreter: ``BLOCK_M`` x ``BLOCK_N`` with :func:`prefill_warps`.
    """
    fp32 = _fp32_config(FP32_PREFILL_TILES, head_dim, capability, operand_bytes)
    if fp32 is not None:
        return fp32
    if (capability is not None and capability[0] >= 9 and head_dim <= SM90_PREFILL_MAX_HEAD_DIM
            and not grouped and operand_bytes == 2):
        keys = SM90_PREFILL_KEYS_DENSE_WIDE if dense and head_dim >= 128 else SM90_PREFILL_KEYS
        return {"BLOCK_M": SM90_PREFILL_ROWS, "BLOCK_N": keys, "num_warps": SM90_PREFILL_WARPS}
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": prefill_warps(head_dim)}


def received_config(head_dim: int, capability: tuple[int, int] | None, operand_bytes: int = 2) -> dict:
    """Tile and launch options of the significance pass (``_received_kernel``): ``RECEIVED_BLOCK_M``
    query rows streamed over ``RECEIVED_BLOCK_N`` keys with :func:`prefill_warps`, or, for fp32
    operands on a GPU at head_dim <= 128, :data:`FP32_RECEIVED_TILES` with 8 warps and
    ``PREC`` = :data:`FP32_PRECISION` (the default tile spills thousands of local operations
    inside its loop with ``ieee`` fp32 dots)."""
    fp32 = _fp32_config(FP32_RECEIVED_TILES, head_dim, capability, operand_bytes)
    if fp32 is not None:
        return fp32
    return {"BLOCK_M": RECEIVED_BLOCK_M, "BLOCK_N": RECEIVED_BLOCK_N, "num_warps": prefill_warps(head_dim)}


def layer_kind(targs: dict) -> dict:
    """``dense`` / ``grouped`` of :func:`prefill_config` for the tiers in ``targs``
    (:func:`leankit_kernels.tiles.tier_args`): every tier dense, or some quantized tier with
    several groups per token."""
    tiers = (targs["HI"], targs["LO"]) if targs["HAS_LOW"] else (targs["HI"],)
    quantized = [t for t in tiers if t.KBITS < 16 or t.VBITS < 16]
    return {"dense": not quantized, "grouped": any(t.NG > 1 for t in quantized)}


@triton.jit
def _query_rows(r0, b, qpos_ptr, stride_pb, NQ, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows ``r0 ..`` of the group's query-major rows ``r = i * G + g``: ``(mask, i, g, position of
    query i)``; rows past the end read position -1."""
    r = r0 + tl.arange(0, BLOCK_M)
    rmask = r < NQ * G
    qi = r // G
    g = r % G
    return rmask, qi, g, tl.load(qpos_ptr + b * stride_pb + qi, mask=rmask, other=-1)


@triton.jit
def _load_queries(q_ptr, stride_qb, stride_qh, stride_qq, b, h, qi, g, rmask,
                  G: tl.constexpr, F: tl.constexpr, DOT: tl.constexpr):
    """Query rows ``q[b, h * G + g, qi, :]`` as a ``[BLOCK_M, F]`` tile of ``DOT`` (0 past the end)."""
    f = tl.arange(0, F)
    q_rows = b.to(tl.int64) * stride_qb + (h * G + g) * stride_qh + qi.to(tl.int64) * stride_qq
    return tl.load(q_ptr + q_rows[:, None] + f[None, :], mask=rmask[:, None], other=0.0).to(DOT)


@triton.jit
def _visible_end(pool, tab_row, n_slots, qmax, R, LOW: tl.constexpr, TIER: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """One past the last slot of the tier whose stored position is ``<= qmax`` (0 if none).

    Reads only the int32 positions (4 bytes a slot, against the ~100-500 bytes of its K/V), so the
    attention loop can stop there instead of testing every tile: slots after it hold only keys in
    the future of every query of the block (causal skipping by loop bound, by stored position,
    which also covers pruned and reordered slots; tiles before it that happen to be all-future
    are computed fully masked, which costs time, never correctness).
    """
    end = 0
    for start in range(0, n_slots, BLOCK):
        slot, _valid, _page, _row, kpos = slot_tile(pool, tab_row, start, n_slots, R, TIER, LOW, PAGE_SIZE, BLOCK)
        end = tl.maximum(end, tl.max(tl.where(kpos <= qmax, slot + 1, 0), 0))
    return end


@triton.jit
def _prefill_tier(m, l, acc, q, qpos_r, qmax, pool, tab_row, n_slots, R, sm_scale,
                  LOW: tl.constexpr, TIER: tl.constexpr, F: tl.constexpr,
                  DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                  PREC: tl.constexpr):
    """Online softmax over the tier's slots up to the last one any query of the block can see.

    The tile body is branch-free (masks only), so the compiler can software-pipeline the loads of
    the next tile under the math of this one.
    """
    end = _visible_end(pool, tab_row, n_slots, qmax, R, LOW, TIER, PAGE_SIZE, 4 * BLOCK_N)
    for start in range(0, end, BLOCK_N):
        _, valid, page, row, kpos = slot_tile(pool, tab_row, start, end, R, TIER, LOW, PAGE_SIZE, BLOCK_N)
        s = tile_logits(q, qpos_r[:, None], kpos, pool, page, row, valid, sm_scale, TIER, F, DENSE,
                        PAGE_SIZE, BLOCK_N, DOT, PREC)
        m, l, acc = online_softmax_step(m, l, acc, s, pool, page, row, valid, TIER, F, DENSE,
                                        PAGE_SIZE, BLOCK_N, DOT, PREC)
    return m, l, acc


# Runtime integers that change from call to call (chunk length, table width, per-layer strides):
# a specialization per value class would compile a variant per prompt length class. The query
# strides stay specialized (model shapes, and their alignment lets the query rows load as vectors).
PREFILL_DYNAMIC = ("stride_pb", "stride_tier", "H", "R", "NQ")
RECEIVED_DYNAMIC = PREFILL_DYNAMIC + ("NH_OUT", "NL_OUT")
# Pointers read a few values per program, or views whose alignment changes with the layer.
PREFILL_UNALIGNED = ("qpos_ptr", "tab_ptr", "len_ptr", "lse_ptr")
RECEIVED_UNALIGNED = ("qpos_ptr", "qv_ptr", "lse_ptr", "tab_ptr", "len_ptr")


@triton.jit(**tiles.jit_options(PREFILL_DYNAMIC, PREFILL_UNALIGNED))
def _prefill_kernel(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, pool, tab_ptr, len_ptr,
                    stride_tier, out_ptr, lse_ptr, H, R, NQ, sm_scale,
                    G: tl.constexpr, F: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    DENSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                    PREC: tl.constexpr, HAS_LOW: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr):
    """One (sequence, KV head, block of query rows ``i * G + g``) over all live slots of both tiers."""
    bh, b, h = program_head(H)
    rmask, qi, g, qpos_r = _query_rows(tl.program_id(1) * BLOCK_M, b, qpos_ptr, stride_pb, NQ, G, BLOCK_M)
    qmax = tl.max(qpos_r, 0)
    q = _load_queries(q_ptr, stride_qb, stride_qh, stride_qq, b, h, qi, g, rmask, G, F, DOT)
    tab_row = tab_ptr + bh.to(tl.int64) * R
    m, l, acc = softmax_init(BLOCK_M, F)
    m, l, acc = _prefill_tier(m, l, acc, q, qpos_r, qmax, pool, tab_row, tl.load(len_ptr + bh), R, sm_scale,
                              False, HI, F, DENSE, PAGE_SIZE, BLOCK_N, DOT, PREC)
    if HAS_LOW:
        m, l, acc = _prefill_tier(m, l, acc, q, qpos_r, qmax, pool, tab_row, tl.load(len_ptr + stride_tier + bh),
                                  R, sm_scale, True, LO, F, DENSE, PAGE_SIZE, BLOCK_N, DOT, PREC)
    out = softmax_output(l, acc)
    f = tl.arange(0, F)
    o_rows = ((b.to(tl.int64) * NQ + qi) * H + h) * G + g  # out is [B, Q, Hq, F]
    tl.store(out_ptr + o_rows[:, None] * F + f[None, :], out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(lse_ptr + bh.to(tl.int64) * G * NQ + g * NQ + qi, softmax_lse(m, l), mask=rmask)


@triton.jit
def _first_row(qpos_ptr, b, stride_pb, NQ, kmin, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query-major row block (a multiple of ``BLOCK_M``) that holds a query at position
    ``>= kmin``; ``NQ * G`` when none does. Reads only the ``NQ`` int32 query positions."""
    first = NQ
    for i0 in range(0, NQ, BLOCK_M):
        i = i0 + tl.arange(0, BLOCK_M)
        qp = tl.load(qpos_ptr + b * stride_pb + i, mask=i < NQ, other=-1)
        first = tl.minimum(first, tl.min(tl.where(qp >= kmin, i, NQ), 0))
    return (first * G) // BLOCK_M * BLOCK_M


@triton.jit
def _received_tier(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool, tab_row,
                   out_row, n_out, n_live, blk, b, h, bh, R, NQ, sm_scale,
                   LOW: tl.constexpr, TIER: tl.constexpr, G: tl.constexpr, F: tl.constexpr,
                   DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    slot, valid, page, row, kpos = slot_tile(pool, tab_row, blk * BLOCK_N, n_live, R, TIER, LOW, PAGE_SIZE,
                                             BLOCK_N)
    kmin = tl.min(kpos, 0)
    k = load_side(pool, page, row, valid, TIER.KOFF, TIER.KMOFF, TIER.KBITS, F, TIER.NG, DENSE, PAGE_SIZE,
                  BLOCK_N).to(DOT)
    got = tl.zeros([BLOCK_N], tl.float32)
    # The K tile stays in registers while the query rows stream past it, starting at the first
    # block that holds a query at or after the tile's earliest key (earlier rows see none of it).
    for r0 in range(_first_row(qpos_ptr, b, stride_pb, NQ, kmin, G, BLOCK_M), NQ * G, BLOCK_M):
        rmask, qi, g, qp = _query_rows(r0, b, qpos_ptr, stride_pb, NQ, G, BLOCK_M)
        qok = tl.load(qv_ptr + b * NQ + qi, mask=rmask, other=0) != 0
        lse = tl.load(lse_ptr + bh.to(tl.int64) * G * NQ + g * NQ + qi, mask=rmask, other=float("-inf"))
        live = qok & (lse > float("-inf"))
        lse2 = tl.where(live, lse * 1.4426950408889634, 0.0)
        q = _load_queries(q_ptr, stride_qb, stride_qh, stride_qq, b, h, qi, g, rmask, G, F, DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        vis = live[:, None] & (kpos[None, :] <= qp[:, None])
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        got += tl.sum(p, 0)
    tl.store(out_row + slot, got / G, mask=slot < n_out)


@triton.jit(**tiles.jit_options(RECEIVED_DYNAMIC, RECEIVED_UNALIGNED))
def _received_kernel(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool, tab_ptr,
                     len_ptr, stride_tier, out_h, out_l, NH_OUT, NL_OUT, H, R, NQ, sm_scale,
                     G: tl.constexpr, F: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     DENSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
                     PREC: tl.constexpr, HAS_LOW: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr):
    """Received probability of one tile of slots of one tier (``program_id(2)``) of one (sequence, head)."""
    bh, b, h = program_head(H)
    blk = tl.program_id(1)
    tier = tl.program_id(2)
    tab_row = tab_ptr + bh.to(tl.int64) * R
    # Tiles past a tier's slot count find no live key (kmin = POS_DEAD) and skip every query block.
    if tier == 0:
        _received_tier(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool,
                       tab_row, out_h + bh.to(tl.int64) * NH_OUT, NH_OUT, tl.load(len_ptr + bh), blk, b, h, bh,
                       R, NQ, sm_scale, False, HI, G, F, DENSE, PAGE_SIZE, BLOCK_M, BLOCK_N, DOT, PREC)
    elif HAS_LOW:
        _received_tier(q_ptr, stride_qb, stride_qh, stride_qq, qpos_ptr, stride_pb, qv_ptr, lse_ptr, pool,
                       tab_row, out_l + bh.to(tl.int64) * NL_OUT, NL_OUT, tl.load(len_ptr + stride_tier + bh),
                       blk, b, h, bh, R, NQ, sm_scale, True, LO, G, F, DENSE, PAGE_SIZE, BLOCK_M, BLOCK_N,
                       DOT, PREC)


def prefill_attention(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, *,
                      q_valid: torch.Tensor | None = None, return_significance: bool = False,
                      block_m: int | None = None, block_n: int | None = None):
    """Causal attention of ``q`` ``[B, Hq, Q, F]`` over the layer's pages (prompt already written).

    Returns ``(out [B, Q, Hq, F], lse [B, Hkv, G*Q])`` like
    :func:`leankit.attention.paged_attention_ref`; with ``return_significance=True`` also the
    per-tier received probability of every slot (see :func:`received_attention`), computed by a
    second pass over the keys that reuses ``lse``. ``block_m``/``block_n`` override the tile of
    :func:`prefill_config`.
    """
    b, hq, nq, f = q.shape
    q, tables, _n_pages, lens, stride_tier, g, targs = layer_launch(q, kv)
    hkv, r = tables.shape[1], tables.shape[2]
    dev = q.device
    out = tiles.empty((b, nq, hq, f), dtype=q.dtype, device=dev)
    lse = tiles.empty((b, hkv, g * nq), dtype=torch.float32, device=dev)
    q_pos = q_pos.to(device=dev, dtype=torch.int32).contiguous()
    dot_t, prec = dot_config(q.dtype, dev)
    cfg = prefill_config(f, torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None, **layer_kind(targs),
                         operand_bytes=dot_t.primitive_bitwidth // 8)
    cfg["BLOCK_M"] = block_m or cfg["BLOCK_M"]
    cfg["BLOCK_N"] = block_n or cfg["BLOCK_N"]
    cfg.setdefault("num_stages", 2)
    cfg.setdefault("PREC", prec)
    grid = (b * hkv, tiles.cdiv(g * nq, cfg["BLOCK_M"]))
    kernel_for(_prefill_kernel, dev)[grid](
        q, q.stride(0), q.stride(1), q.stride(2), q_pos, q_pos.stride(0), kv.pool.storage, tables, lens, stride_tier,
        out, lse, hkv, r, nq, float(scale) * LOG2E, G=g, DOT=dot_t, **cfg, **targs)
    if return_significance:
        return out, lse, received_attention(q, kv, q_pos, scale, lse, q_valid)
    return out, lse


def received_attention(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, lse: torch.Tensor,
                       q_valid: torch.Tensor | None = None, *, block_m: int | None = None,
                       block_n: int | None = None) -> list[torch.Tensor]:
    """Attention probability each stored token received from this step's queries (LeanKV §4).

    Kernel mirror of :func:`leankit.attention.received_attention_ref`: one fp32
    ``[B, Hkv, P_t * T_t]`` tensor per tier (``P_t`` = the most pages any head has in tier ``t``),
    holding ``sum_i p_ij`` averaged over the group's query heads; dead slots hold 0. ``lse`` is the
    ``[B, Hkv, G*Q]`` log-sum-exp returned by the attention pass; ``q_valid`` bool ``[B, Q]``
    drops padding queries. ``block_m``/``block_n`` override the tile of :func:`received_config`.
    """
    b, _, nq, f = q.shape
    q, tables, n_pages, lens, stride_tier, g, targs = layer_launch(q, kv)
    hkv, r = tables.shape[1], tables.shape[2]
    dev = q.device
    max_h, max_l, *_ = page_counts(n_pages, targs["HAS_LOW"])
    nh_out = max_h * targs["HI"].T
    nl_out = max_l * targs["LO"].T if targs["HAS_LOW"] else 0
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
    cfg = received_config(f, torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
                          operand_bytes=dot_t.primitive_bitwidth // 8)
    cfg["BLOCK_M"] = block_m or cfg["BLOCK_M"]
    cfg["BLOCK_N"] = block_n or cfg["BLOCK_N"]
    cfg.setdefault("PREC", prec)
    grid = (b * hkv, tiles.cdiv(n_max, cfg["BLOCK_N"]), len(kv.layouts))
    kernel_for(_received_kernel, dev)[grid](
        q, q.stride(0), q.stride(1), q.stride(2), q_pos, q_pos.stride(0), qv, lse, kv.pool.storage, tables, lens,
        stride_tier, out_h, out_l, nh_out, nl_out, hkv, r, nq, float(scale) * LOG2E,
        G=g, DOT=dot_t, num_stages=2, **cfg, **targs)
    return outs
