"""Paged mixed-precision decode attention (LeanKV §6.2) with flash-decoding split-K.

Reads
    ``q``: ``[B, Hq, 1, F]`` (any strides, last dim contiguous); query head ``h * G + g`` belongs
    to KV head ``h`` (``G = Hq / Hkv``).
    ``q_pos``: int ``[B, 1]`` absolute query positions.
    the layer's page table: ``tables[layer]`` int32 ``[B, Hkv, R]`` (high pages from the left, low
    pages from the right), ``n_pages``/``lens`` int32 ``[2, L, B, Hkv]``;
    the uint8 page pool ``[num_pages, page_size]``: per token the K/V data + meta segments and the
    int32 position (see :mod:`leankit_kernels.tiles` for the slot -> byte mapping).
Writes
    ``out`` ``[B, 1, Hq, F]`` (``q.dtype``), ``lse`` fp32 ``[B, Hkv, G]`` (natural log, ``-inf`` if
    the query sees no key); with ``update_scores=True`` also the fp16 score segment of every live
    token in place: ``s <- s + (p_bar - s) / n`` (running mean of received probability, LeanKV §4;
    ``p_bar`` = probability averaged over the group's G query heads, ``n = q_pos - pos + 1``).
Scratch
    split partials fp32 ``[B*Hkv, S, G, F]`` + ``[B*Hkv, S, G, 2]`` (running max, sum) when ``S > 1``;
    with score updates, the scaled logits fp32 ``[B*Hkv, tiers, G, N]``.

Kernels
    ``_decode_kernel``: one program per (sequence, KV head, split). Splits are contiguous ranges
    of the head's *virtual* page list ``[high pages..., low pages...]``: each program walks its
    high-tier pages first, then its low-tier pages (LeanKV's load balancing, §6.2). Every unified
    page has the same byte size, so equal page counts mean equal bytes per split, whatever the
    tiers' tokens-per-page. A tile is one or more whole pages of a tier (``decode_tile_rows``:
    32..128 rows, the rows past the last whole page masked), so each slot's page column and row
    are loop-invariant and the table is read once per page. 8- and 4-bit key codes become fp16 MMA
    operands elementwise, on the operand's own register layout (:mod:`leankit_kernels.codes`: the
    4-bit ones as two half-width MMAs, even and odd features); value codes are unpacked a 32-bit
    word at a time. One-group scale/min are applied per key after the
    matmuls (``q . k_hat = s (q . Q) + m sum(q)``, ``p @ v_hat = (p s) @ Q + p @ m``). All G query
    heads of the group share the tile, with the keys on the MMAs' M dimension: ``tl.dot`` on
    ``[N, F] x [F, G_pad]`` (``k q^T``) for the logits and ``[F, N] x [N, G_pad]`` (``v^T p``, into
    a transposed accumulator) for the output (``G_pad`` = G rounded up to a power of two;
    ``tl.dot`` pads the MMA itself), with an online softmax in base 2 whose sums stay per slot
    until the end of each tier. With one split it writes the output directly.
    ``_decode_reduce_kernel``: merges the S partials of a (sequence, KV head) (log-sum-exp merge).
    A decode step's own token (:func:`decode_step_attention`) is the first key of a one-split
    program's softmax, or one more split in the reduce (``_own_token_state``), so the step's exact
    attention to its new key needs no launch of its own.
    ``_score_update_kernel``: after the reduce, turns the saved logits and the final lse into
    ``p_bar`` and updates the score segment of live slots (one program per (head, slot tile, tier)).

Page layout: LeanKV's CUDA kernel interleaves keys as ``[F/(Kvec*Kgroup), N, Kgroup, Kvec]`` and
values token-vectorized so that each *thread group* of a warp reads contiguous vectors. A Triton
program instead loads the whole ``[BLOCK_N, Kb]`` tile of a page at once and the compiler assigns
threads to contiguous 16-byte vectors of it; a token-major segment is exactly that contiguous tile
and exactly the ``[BLOCK_N, F]`` operand ``tl.dot`` wants for both ``k q^T`` and ``v^T p``, so
leankit keeps the token-major layout of :mod:`leankit.pages` (no interleaving to undo in
registers, and quantize/pack writes whole rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from leankit.attention import PagedKV, received_attention_ref

from . import tiles
from .codes import (
    code_scale,
    code_unit,
    key_nibbles,
    key_order,
    nibble_keys,
    scale_min,
    side_tile,
    word_unpack,
)
from .own_token import merge_own_token, own_logit, own_received
from .prefill_attention import prefill_attention, received_attention
from .tiles import (
    LOG2E,
    dot_config,
    kernel_for,
    layer_launch,
    load_positions,
    page_counts,
    program_head,
    score_ptrs,
    slot_tile,
    softmax_init,
    softmax_lse,
    softmax_merge,
    softmax_output,
)

__all__ = ["DecodeLogits", "apply_score_update", "decode_step_attention", "paged_attention", "received_attention",
           "score_update_ref"]

# Warps of a decode program. The slot tile is one 2-D block with one running max / sum /
# accumulator: independent softmax lanes (a batched 3-D tl.dot per lane) issued as much per KB with
# more registers under Triton 3.9, and Triton 3.6 (the oldest leankit supports) puts the warps of a
# batched dot on its batch axis, so with one lane every warp repeated the whole tile (4x the MMAs,
# 255 registers and spills inside the loop; python -m leankit_kernels.aot under triton 3.6).
DECODE_WARPS = 4
# Software-pipelining stages of the decode inner loop's loads (Triton's ``num_stages``).
DECODE_STAGES = 2
DECODE_MAX_ROWS = 128
# A split must read at least this many times the bytes of the fp32 partial (acc, max, sum) it
# writes and the reduce reads back, so the split-K merge costs at most ~6% extra traffic.
SPLIT_BYTES_RATIO = 16


@triton.jit
def _decode_step(m, l, acc, am, qa, qb, qsum, qpos, kpos, pool, page, row, valid, sm_scale, k_scale,
                 TIER: tl.constexpr, F: tl.constexpr, DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """Base-2 logits ``[BLOCK, G_PAD]`` of one slot tile and the online-softmax step over it.

    Keys sit on the MMAs' M dimension (``k q^T``, then ``v^T p``): Triton gives the warps of a dot
    whose result feeds another dot to its M dimension, so with the G query rows there every warp
    would repeat the whole tile. ``qa``/``qb`` are the query ``[F, G_PAD]`` (its halves for 4-bit
    keys), ``m`` ``[G_PAD]`` the running max, ``acc`` ``[F, G_PAD]`` the transposed accumulator.
    Scale and min stay out of the element path: ``q . k_hat = s (q . Q) + m sum(q)`` and
    ``p @ v_hat = (p s) @ Q + (p @ m)`` (:func:`side_tile`). With one-group quantized values the
    ``p @ m`` term has its own sum ``am`` (added once per tier), so no per-tile term is broadcast
    over the accumulator's F rows; the codes' unit (:func:`code_unit`) leaves the key side in the
    key scale and the value side once per tier. ``k_scale`` is ``sm_scale`` over the power of two
    the query operand was lifted by (:func:`_tier_query`).

    The softmax sum ``l`` and ``am`` stay per slot, ``[BLOCK, G_PAD]``, rescaled with the
    running max like the accumulator and summed over the slots once per tier (:func:`_decode_tier`):
    with the slots spread over the warps, a sum over them every tile would cross lanes and warps
    (shuffles, a shared-memory round trip and a barrier each). Only the max, which every
    probability needs, is reduced per tile.
    """
    if _nibble_tier(TIER.NG, TIER.KBITS, F, DOT):
        # 4-bit keys as two half-width operands (even features, odd features): qa / qb hold the
        # query's matching halves (:func:`_query_halves`)
        k_lo, k_hi = key_nibbles(pool, page, row, valid, TIER.KOFF, F, PAGE_SIZE)
        ks, km = scale_min(pool, page, row, valid, TIER.KMOFF, PAGE_SIZE)
        raw = tl.dot(k_lo, qa, input_precision=PREC)
        raw = tl.dot(k_hi, qb, acc=raw, input_precision=PREC)
    else:
        kx, ks, km = side_tile(pool, page, row, valid, TIER.KOFF, TIER.KMOFF, TIER.KBITS, TIER, F, DENSE,
                               PAGE_SIZE, BLOCK, DOT, True)
        raw = tl.dot(kx, qa, input_precision=PREC)
    # raw = q . Q in units of the codes' (code_unit): one exact power of two, folded into the scale
    ks = ks * (k_scale / _side_unit(TIER.NG, TIER.KBITS, DOT))
    km = km * sm_scale
    s = raw * ks[:, None] + km[:, None] * qsum[None, :]
    s = tl.where(kpos[:, None] <= qpos, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[None, :])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha[None, :] + p
    VQ: tl.constexpr = TIER.VBITS < 16 and TIER.NG == 1
    vx, vs, vm = side_tile(pool, page, row, valid, TIER.VOFF, TIER.VMOFF, TIER.VBITS, TIER, F, DENSE,
                           PAGE_SIZE, BLOCK, DOT, False)
    # p <= 1 times the value scale, lifted by an exact power of two so that the products of small
    # values stay out of fp16's subnormals, where rounding is absolute (_value_lift)
    ps = (p * (vs * _value_lift(TIER.NG, TIER.VBITS, DOT))[:, None]).to(DOT)
    # Transposed (v^T p): the F output columns fill the MMA's M dimension and the few query rows
    # its N, so no padded query rows are copied into the operand registers each tile.
    pv = tl.dot(tl.trans(vx), ps, input_precision=PREC)
    if VQ:
        acc = acc * alpha[None, :] + pv
        am = am * alpha[None, :] + p * vm[:, None]
    else:  # dense or several groups per token: side_tile dequantized the values (vs = 1, vm = 0)
        acc = acc * alpha[None, :] + pv
    return s, m_new, l, acc, am


@triton.jit
def _value_units(acc, TIER: tl.constexpr, F: tl.constexpr, DOT: tl.constexpr, VPERM: tl.constexpr,
                 INTO: tl.constexpr):
    """Move the accumulator ``[F, G_PAD]`` between value units and the units a tier's one-group
    quantized values accumulate in (``INTO``): row ``f`` sums ``ps 2^e_f c`` codes' units
    (:func:`code_scale`, :func:`code_unit`; word order when ``VPERM``). An exact power-of-two
    scale per row; other tiers' values are already in value units."""
    if TIER.VBITS < 16 and TIER.NG == 1:
        unit: tl.constexpr = _side_unit(TIER.NG, TIER.VBITS, DOT) * _value_lift(TIER.NG, TIER.VBITS, DOT)
        if VPERM:
            row_unit = (code_scale(F, TIER.VBITS, DOT, False) * unit)[:, None]
        else:
            row_unit = unit
        if INTO:
            acc = acc * row_unit
        else:
            acc = acc / row_unit
    return acc


@triton.constexpr_function
def _side_unit(NG: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """The unit a side's tile carries into the MMA (``NG`` groups per token, ``BITS`` bits):
    :func:`code_unit` for one-group quantized codes, 1 for a side dequantized in registers. Takes
    the tier's fields, not the tier: Triton 3.6's interpreter hands a constexpr function a
    :class:`~leankit_kernels.tiles.Tier` as a plain tuple."""
    if BITS < 16 and NG == 1:
        return code_unit(DOT)
    return 1.0


@triton.constexpr_function
def _value_lift(NG: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """Power of two the ``p s`` operand of one-group quantized values carries into an fp16 MMA (1
    for other operands and sides; divided out with the codes' unit, :func:`_value_units`).

    ``p s`` is below the value scale ``s`` (``p <= 1``), and a small ``s`` (values of small range,
    more so at 8 bits, whose step is the range / 255) lands it among fp16's subnormals, whose
    rounding is absolute: with values near 1e-3, K8V8 outputs erred 2.3% of their norm. The lift is
    the largest power of two at most ``(2^BITS - 1) / 2``: values within fp16's range span at most
    2 x 65504, so ``s <= 131008 / (2^BITS - 1)`` and ``p s`` times the lift stays under 65504 (64
    for 8 bits, 4 for 4, 1 for 2); the subnormal threshold falls by that much (values near 1e-4
    still err at about the fp16 tolerance: results/aot_static.md).
    """
    if DOT == tl.float16 and NG == 1 and BITS < 16:
        e = 0
        while 2 ** (e + 1) <= (2 ** BITS - 1) / 2:
            e += 1
        return float(2 ** e)
    return 1.0


@triton.jit
def _decode_tier(m, l, acc, q, qsum, qpos, pool, tab_row, pg0, pg1, n_live, R, sm_scale, k_scale, lg_ptr, LG_N,
                 LOW: tl.constexpr, TIER: tl.constexpr, F: tl.constexpr,
                 DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SAVE_LOGITS: tl.constexpr):
    """Online-softmax accumulation over the live slots of pages ``[pg0, pg1)`` of one tier.

    A tile is ``PPT = BLOCK // T`` whole pages (``BLOCK`` rows, the last ``BLOCK - PPT*T``
    rows always masked), so each slot's page column and in-page row are loop-invariant
    (``t // T``, ``t % T`` of the tile row ``t``): per tile only the ``PPT`` page ids are read
    from the table. A page larger than the tile (``T > BLOCK``) is walked in ``BLOCK``-slot runs.
    """
    t = tl.arange(0, BLOCK)
    s1 = tl.minimum(pg1 * TIER.T, n_live)
    # This tier's values fill the accumulator columns in the word order of key_order: permute the
    # accumulator into that order for the loop and back after it (once per program, not per tile).
    VPERM: tl.constexpr = TIER.VBITS < 16 and TIER.NG == 1 and word_unpack(F, TIER.VBITS, DOT)
    if VPERM:
        acc = _word_order(acc, G_PAD, F, TIER.VBITS, True)
    # value row f accumulates 2^e_f times its codes in the codes' unit: scale the rows to match
    acc = _value_units(acc, TIER, F, DOT, VPERM, True)
    am = tl.zeros([BLOCK, G_PAD], tl.float32)
    m_in = m  # the running sum l [G_PAD] enters the tier at this max; lt holds its per-slot part
    lt = tl.zeros([BLOCK, G_PAD], tl.float32)
    if _nibble_tier(TIER.NG, TIER.KBITS, F, DOT):
        qa, qb = _query_halves(q, G_PAD, F)
    else:
        qa, qb = q, q  # one operand
    if BLOCK >= TIER.T:
        PPT: tl.constexpr = BLOCK // TIER.T
        j = t // TIER.T
        row = t % TIER.T
        inside = t < PPT * TIER.T
        for pg in range(pg0, pg1, PPT):
            pcol = pg + j
            slot = pcol * TIER.T + row
            valid = inside & (slot < s1)
            if LOW:
                col = R - 1 - pcol
            else:
                col = pcol
            page = tl.load(tab_row + col, mask=valid, other=0).to(tl.int64)
            kpos = load_positions(pool, page, row, valid, TIER.POSOFF, PAGE_SIZE)
            s, m, lt, acc, am = _decode_step(m, lt, acc, am, qa, qb, qsum, qpos, kpos, pool, page, row,
                                                valid, sm_scale, k_scale, TIER, F, DENSE, PAGE_SIZE, BLOCK, DOT,
                                                PREC)
            if SAVE_LOGITS:
                _store_logits(lg_ptr, LG_N, s, slot, valid, G, G_PAD)
    else:
        for start in range(pg0 * TIER.T, s1, BLOCK):
            slot, valid, page, row, kpos = slot_tile(pool, tab_row, start, s1, R, TIER, LOW, PAGE_SIZE, BLOCK)
            s, m, lt, acc, am = _decode_step(m, lt, acc, am, qa, qb, qsum, qpos, kpos, pool, page, row,
                                                valid, sm_scale, k_scale, TIER, F, DENSE, PAGE_SIZE, BLOCK, DOT,
                                                PREC)
            if SAVE_LOGITS:
                _store_logits(lg_ptr, LG_N, s, slot, valid, G, G_PAD)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = l * tl.exp2(m_in - m_safe) + tl.sum(lt, 0)
    acc = _value_units(acc, TIER, F, DOT, VPERM, False)
    if TIER.VBITS < 16 and TIER.NG == 1:
        acc = acc + tl.sum(am, 0)[None, :]  # the p @ m term, its per-slot sums reduced once
    if VPERM:
        acc = _word_order(acc, G_PAD, F, TIER.VBITS, False)
    return m, l, acc


@triton.jit
def _word_order(acc, G_PAD: tl.constexpr, F: tl.constexpr, BITS: tl.constexpr, TO_WORD: tl.constexpr):
    """Permute the feature rows of ``acc`` ``[F, G_PAD]`` from feature order to the word order of
    :func:`key_order` (``TO_WORD``) or back: inside each block of ``32 / BITS`` rows, feature
    ``h * HALF + k`` sits at row ``2 k + h``, a transpose of ``[2, HALF]``."""
    HALF: tl.constexpr = 16 // BITS
    if TO_WORD:
        x = tl.reshape(acc, (F // (2 * HALF), 2, HALF, G_PAD))
    else:
        x = tl.reshape(acc, (F // (2 * HALF), HALF, 2, G_PAD))
    return tl.reshape(tl.permute(x, (0, 2, 1, 3)), (F, G_PAD))


@triton.constexpr_function
def _nibble_tier(NG: tl.constexpr, KBITS: tl.constexpr, F: tl.constexpr, DOT: tl.constexpr):
    """Whether a tier's keys (``NG`` groups per token, ``KBITS`` bits) are one-group 4-bit codes read
    as two half-width MMA operands (:func:`leankit_kernels.codes.nibble_keys`): the query halves and
    the key tile must agree."""
    return NG == 1 and nibble_keys(KBITS, F, DOT)


@triton.jit
def _query_halves(q, G_PAD: tl.constexpr, F: tl.constexpr):
    """The first and second halves of the query operand ``[F, G_PAD]``: ``[F/2, G_PAD]`` each (for
    4-bit keys, loaded as the even features then the odd ones: :func:`leankit_kernels.codes.key_order`)."""
    return tl.split(tl.permute(tl.reshape(q, (2, F // 2, G_PAD)), (1, 2, 0)))


@triton.jit
def _tier_query(q_row, g, TIER: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, F: tl.constexpr,
                DOT: tl.constexpr):
    """The query as ``DOT`` operand ``[F, G_PAD]`` for the key tile of ``TIER``, and its fp32 row sums.

    One-group quantized keys arrive in the column order of :func:`key_order`, column ``j`` holding
    ``2^e_j c`` units of :func:`code_unit` (:func:`code_scale`): the query is loaded in that order
    and divided by ``2^e_j`` (exact: a power of two), so ``q' . k = q . c`` in the codes' unit.
    Divided by up to ``2^8`` (2-bit codes), a small fp16 query would land among fp16's subnormals,
    whose rounding is absolute (queries near 1e-4 erred 6x the fp16 tolerance with 2-bit keys): the
    operand is first lifted by the power of two ``2^E`` that puts its largest element in
    ``[2^14, 2^15)`` (exact; built from the exponent bits), and the logits are scaled back by
    ``1 / 2^E`` with the key scale.
    Returns ``q'``, the sum of ``q`` as rounded (the ``m sum(q)`` term of ``q . k_hat``) and ``1 / 2^E``.
    """
    if TIER.KBITS < 16 and TIER.NG == 1:
        q = tl.load(q_row + key_order(F, TIER.KBITS, DOT)[None, :], mask=(g < G)[:, None], other=0.0).to(DOT)
        qf = q.to(tl.float32)
        if DOT == tl.float16:
            # floor(log2 max|q|) from the fp32 exponent bits (-127 for 0); E = 14 - that
            x = ((tl.max(tl.max(tl.abs(qf), 1), 0).to(tl.int32, bitcast=True) >> 23) & 255) - 127
            e = tl.minimum(14 - x, 126)
            lift = ((e + 127) << 23).to(tl.float32, bitcast=True)
            inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
            qf = qf * lift
        else:
            inv = 1.0
        qs = (qf / code_scale(F, TIER.KBITS, DOT, True)[None, :]).to(DOT)
    else:
        q = tl.load(q_row + tl.arange(0, F)[None, :], mask=(g < G)[:, None], other=0.0).to(DOT)
        qs = q
        inv = 1.0
    return tl.trans(qs), tl.sum(q.to(tl.float32), 1), inv


@triton.jit
def _store_logits(lg_ptr, LG_N, s, slot, valid, G: tl.constexpr, G_PAD: tl.constexpr):
    """Save the tile's logits ``s`` ``[BLOCK, G_PAD]`` at ``lg_ptr[g * LG_N + slot]`` (live slots, real heads)."""
    g = tl.arange(0, G_PAD)
    ok = valid[:, None] & (g < G)[None, :]
    tl.store(lg_ptr + slot[:, None] + g[None, :] * LG_N, s, mask=ok)


# Runtime integers the kernels must not specialize on: page counts per split, split count, logit
# row length and table width change as a generation grows, and Triton would compile a variant for
# each value class (== 1, % 16 == 0) it sees, a stall of about a second each; strides are read once
# per program, so specializing on their alignment buys nothing.
DECODE_DYNAMIC = ("stride_qb", "stride_qh", "stride_pb", "stride_tier", "H", "R", "PPS", "NSPLIT", "LG_N",
                  "stride_knb", "stride_knh", "stride_vnb", "stride_vnh")
# Pointers read or written a few scalars/rows per program (views such as one layer's slice of the
# page table change alignment from layer to layer): their alignment buys no vector access.
# The step's own token (_own_token_state): one K and one V row, one flag and one score per program.
OWN_UNALIGNED = ("kn_ptr", "vn_ptr", "real_ptr", "recv_ptr")
DECODE_UNALIGNED = ("q_ptr", "qpos_ptr", "tab_ptr", "np_ptr", "len_ptr", "lse_ptr", "lg_ptr") + OWN_UNALIGNED
REDUCE_DYNAMIC = ("H", "NSPLIT", "stride_qb", "stride_qh", "stride_knb", "stride_knh", "stride_vnb", "stride_vnh")
REDUCE_UNALIGNED = ("q_ptr", "lse_ptr") + OWN_UNALIGNED
SCORE_DYNAMIC = ("stride_pb", "stride_tier", "H", "R", "LG_N")
SCORE_UNALIGNED = ("lg_ptr", "lse_ptr", "qpos_ptr", "qvalid_ptr", "tab_ptr", "len_ptr")


@triton.jit(**tiles.jit_options(DECODE_DYNAMIC, DECODE_UNALIGNED))
def _decode_kernel(q_ptr, stride_qb, stride_qh, qpos_ptr, stride_pb, pool, tab_ptr, np_ptr, len_ptr, stride_tier,
                   part_acc, part_ml, out_ptr, lse_ptr, lg_ptr, H, R, PPS, NSPLIT, LG_N, sm_scale,
                   kn_ptr, vn_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh, real_ptr, recv_ptr,
                   G: tl.constexpr, G_PAD: tl.constexpr, F: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr, NB_HI: tl.constexpr, NB_LO: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, HAS_LOW: tl.constexpr,
                   SAVE_LOGITS: tl.constexpr, DIRECT: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr,
                   OWN: tl.constexpr = False, RECEIVED: tl.constexpr = False):
    """One (sequence, KV head, split): high-tier pages of the split, then its low-tier pages. With
    ``DIRECT`` (one split) the program writes the output itself; then ``OWN`` starts its softmax
    with the step's own token (:func:`_own_token_state`) and ``RECEIVED`` stores that token's
    score. With several splits the reduce takes the own token."""
    bh, b, h = program_head(H)
    split = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    f = tl.arange(0, F)
    qpos = tl.load(qpos_ptr + b * stride_pb)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[:, None] * stride_qh
    # Each tier's keys arrive in that tier's column order (key_order): load q in the same order.
    q_hi, qsum, q_inv = _tier_query(q_row, g, HI, G, G_PAD, F, DOT)
    tab_row = tab_ptr + bh.to(tl.int64) * R
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([F, G_PAD], tl.float32)
    if OWN:  # one split: its softmax starts with the step's own token (_own_token_state)
        s_own, m, l, acc = _own_token_state(q_row, kn_ptr + b * stride_knb + h * stride_knh,
                                            vn_ptr + b * stride_vnb + h * stride_vnh, sm_scale, G, G_PAD, F)
    v0 = split * PPS
    v1 = v0 + PPS
    nh = tl.load(np_ptr + bh)
    lg_row = lg_ptr + bh.to(tl.int64) * (2 * G) * LG_N
    m, l, acc = _decode_tier(m, l, acc, q_hi, qsum, qpos, pool, tab_row, tl.minimum(v0, nh),
                             tl.minimum(v1, nh), tl.load(len_ptr + bh), R, sm_scale, sm_scale * q_inv, lg_row, LG_N,
                             False, HI, F, DENSE, PAGE_SIZE, G, G_PAD, NB_HI, DOT, PREC, SAVE_LOGITS)
    if HAS_LOW:
        nl = tl.load(np_ptr + stride_tier + bh)
        l0 = tl.minimum(tl.maximum(v0 - nh, 0), nl)
        l1 = tl.minimum(tl.maximum(v1 - nh, 0), nl)
        q_lo, qsum, q_inv = _tier_query(q_row, g, LO, G, G_PAD, F, DOT)
        m, l, acc = _decode_tier(m, l, acc, q_lo, qsum, qpos, pool, tab_row, l0, l1,
                                 tl.load(len_ptr + stride_tier + bh),
                                 R, sm_scale, sm_scale * q_inv, lg_row + G * LG_N, LG_N,
                                 True, LO, F, DENSE, PAGE_SIZE, G, G_PAD, NB_LO, DOT, PREC, SAVE_LOGITS)
    acc = tl.trans(acc)  # [G_PAD, F]
    gmask = g < G
    if DIRECT:
        if RECEIVED:
            own_received(s_own, m, l, real_ptr + b, recv_ptr + bh, G, G_PAD)
        _finish(m, l, acc, out_ptr, lse_ptr, bh, b, h, H, G, G_PAD, F)
    else:
        base = (bh * NSPLIT + split) * G + g
        tl.store(part_acc + base.to(tl.int64)[:, None] * F + f[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml + base * 2, m, mask=gmask)
        tl.store(part_ml + base * 2 + 1, l, mask=gmask)


@triton.jit
def _finish(m, l, acc, out_ptr, lse_ptr, bh, b, h, H, G: tl.constexpr, G_PAD: tl.constexpr, F: tl.constexpr):
    """Normalize and store ``out[b, 0, h*G+g, :]`` and ``lse[b, h, g]`` (natural log)."""
    g = tl.arange(0, G_PAD)
    f = tl.arange(0, F)
    gmask = g < G
    row = (b * H + h) * G + g  # out is [B, 1, Hq, F] and Hq = H * G
    out = softmax_output(l, acc)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * F + f[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None])
    tl.store(lse_ptr + bh * G + g, softmax_lse(m, l), mask=gmask)


@triton.jit(**tiles.jit_options(REDUCE_DYNAMIC, REDUCE_UNALIGNED))
def _decode_reduce_kernel(part_acc, part_ml, out_ptr, lse_ptr, H, NSPLIT,
                          q_ptr, stride_qb, stride_qh, kn_ptr, vn_ptr, stride_knb, stride_knh, stride_vnb,
                          stride_vnh, real_ptr, recv_ptr, sm_scale,
                          G: tl.constexpr, G_PAD: tl.constexpr, F: tl.constexpr,
                          OWN: tl.constexpr = False, RECEIVED: tl.constexpr = False):
    """Merge the splits of one (sequence, KV head): ``out = sum_s w_s acc_s / sum_s w_s l_s``. With
    ``OWN`` the step's own token is merged last, as one more split (:func:`_own_token_state`),
    and with ``RECEIVED`` its score is stored."""
    bh, b, h = program_head(H)
    g = tl.arange(0, G_PAD)
    f = tl.arange(0, F)
    gmask = g < G
    m, l, acc = softmax_init(G_PAD, F)
    for s in range(NSPLIT):
        base = (bh * NSPLIT + s) * G + g
        ms = tl.load(part_ml + base * 2, mask=gmask, other=float("-inf"))
        ls = tl.load(part_ml + base * 2 + 1, mask=gmask, other=0.0)
        a = tl.load(part_acc + base.to(tl.int64)[:, None] * F + f[None, :], mask=gmask[:, None], other=0.0)
        m, l, acc = softmax_merge(m, l, acc, ms, ls, a)
    if OWN:
        q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[:, None] * stride_qh
        s_own, ms, ls, a = _own_token_state(q_row, kn_ptr + b * stride_knb + h * stride_knh,
                                            vn_ptr + b * stride_vnb + h * stride_vnh, sm_scale, G, G_PAD, F)
        m, l, acc = softmax_merge(m, l, acc, ms, ls, tl.trans(a))
        if RECEIVED:
            own_received(s_own, m, l, real_ptr + b, recv_ptr + bh, G, G_PAD)
    _finish(m, l, acc, out_ptr, lse_ptr, bh, b, h, H, G, G_PAD, F)


@triton.jit
def _own_token_state(q_row, k_row, v_row, sm_scale, G: tl.constexpr, G_PAD: tl.constexpr, F: tl.constexpr):
    """The step's own token as a softmax of its own: its base-2 logit ``s`` and the state
    ``(m, l, acc [F, G_PAD])`` of an online softmax that has seen it alone.

    A decode query attends to its new key and value exactly as the model produced them (never their
    stored codes; :func:`leankit.attention.step_attention`, as HF ``QuantizedCache`` and the LeanKV
    paper's prompt phase do). One key's softmax is ``m = s``, ``l = 1``, ``acc = v``. A one-split
    decode program starts from it and merges the pages into it as any later tile, and the split
    reduce merges it as one more split: both are the log-sum-exp merge of
    :func:`leankit.attention.merge_attention` (the flash-decoding split merge). Taken before the
    loop, the query, key and value are dead by the time the loop needs its registers (the same
    state merged after the loop held them across it: 142 -> about 180 registers for LeanKV at d64
    on sm_90a, one program fewer per SM)."""
    s = own_logit(q_row, k_row, sm_scale, F, G, G_PAD, F, False)
    v = tl.load(v_row + tl.arange(0, F)).to(tl.float32)
    l = tl.full([G_PAD], 1.0, tl.float32)
    acc = v[:, None] + tl.zeros([F, G_PAD], tl.float32)
    return s, s, l, acc


@triton.jit
def _score_tier(lg_row, lse2, qpos, pool, tab_row, n_live, blk, R, LG_N,
                LOW: tl.constexpr, TIER: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr,
                G_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    g = tl.arange(0, G_PAD)
    slot, valid, page, row, kpos = slot_tile(pool, tab_row, blk * BLOCK_N, n_live, R, TIER, LOW, PAGE_SIZE,
                                             BLOCK_N)
    s = tl.load(lg_row + g[:, None] * LG_N + slot[None, :], mask=(g < G)[:, None] & valid[None, :],
                other=float("-inf"))
    p = tl.exp2(s - lse2[:, None])  # 0 for masked logits (lse2 is finite)
    p_bar = tl.sum(p, 0) / G
    vis = valid & (kpos <= qpos)
    p16 = score_ptrs(pool, page, row, TIER.SCOFF, PAGE_SIZE)
    old = tl.load(p16, mask=vis, other=0.0).to(tl.float32)
    n = (qpos - kpos + 1).to(tl.float32)
    new = old + (p_bar - old) / tl.where(vis, n, 1.0)  # running mean of received probability (§4)
    tl.store(p16, new.to(tl.float16), mask=vis)


@triton.jit(**tiles.jit_options(SCORE_DYNAMIC, SCORE_UNALIGNED))
def _score_update_kernel(lg_ptr, lse_ptr, qpos_ptr, stride_pb, qvalid_ptr, pool, tab_ptr, len_ptr, stride_tier,
                         H, R, LG_N, G: tl.constexpr, G_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_LOW: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr):
    """Fused running-significance update of one tile of one tier's slots of one (sequence, head)."""
    bh, b, _h = program_head(H)
    blk = tl.program_id(1)
    tier = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    qpos = tl.load(qpos_ptr + b * stride_pb)
    qok = tl.load(qvalid_ptr + b) != 0
    lse2 = tl.load(lse_ptr + bh * G + g, mask=g < G, other=float("-inf")) * 1.4426950408889634
    qok = qok & (tl.max(lse2, 0) > float("-inf"))  # a query that saw no key gives nothing
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    tab_row = tab_ptr + bh.to(tl.int64) * R
    lg_row = lg_ptr + bh.to(tl.int64) * (2 * G) * LG_N
    if qok:
        if tier == 0:
            n_live = tl.load(len_ptr + bh)
            _score_tier(lg_row, lse2, qpos, pool, tab_row, n_live, blk, R, LG_N,
                        False, HI, PAGE_SIZE, G, G_PAD, BLOCK_N)
        elif HAS_LOW:
            n_live = tl.load(len_ptr + stride_tier + bh)
            _score_tier(lg_row + G * LG_N, lse2, qpos, pool, tab_row, n_live, blk, R, LG_N,
                        True, LO, PAGE_SIZE, G, G_PAD, BLOCK_N)


# Register bytes of a tile's unpacked K and V rows up to which a bigger tile of whole pages is
# preferred (it spreads the per-tile softmax, address and page-table work over more tokens at no
# extra masked rows): 128 rows of fp16 K and V at head_dim 128. Measured statically
# (python -m leankit_kernels.aot, results/aot_static.md): K8V4 d128 on 2 KB pages issues 174 -> 147
# warp instructions per KB on sm_90a with 128 rows instead of 64; registers stay in the band that
# keeps 2 programs of 4 warps per SM (169-255), and no loop spills.
DECODE_TILE_BYTES = 64 * 1024


def decode_tile_rows(tokens: int, row_bytes: int = 0) -> int:
    """Rows of the decode kernel's slot tile for a tier of ``tokens`` slots per page, whose unpacked
    K and V rows take ``row_bytes`` bytes of registers per slot.

    A tile holds ``rows // tokens`` whole pages (rows past them are masked), so the rows are the
    power of two in 32..128 that wastes the fewest rows on that remainder (a bigger tile must save
    6% of its rows), or a bigger one that wastes no more (within 1%) while its unpacked rows fit
    :data:`DECODE_TILE_BYTES`. A page larger than 128 slots is read in 128-slot runs.
    """
    if tokens >= DECODE_MAX_ROWS:
        return DECODE_MAX_ROWS
    cands = [(rows, (rows // tokens) * tokens / rows) for rows in (32, 64, DECODE_MAX_ROWS) if rows >= tokens]
    best = cands[0]
    for rows, used in cands[1:]:
        if used > best[1] + 0.06:
            best = (rows, used)
    for rows, used in cands:
        if rows > best[0] and used >= best[1] - 0.01 and rows * row_bytes <= DECODE_TILE_BYTES:
            best = (rows, best[1])
    return best[0]


def tier_rows(tier, head_dim: int, dot_bytes: int) -> int:
    """:func:`decode_tile_rows` of a :class:`leankit_kernels.tiles.Tier`: a tier whose sides reach the
    MMA as they are loaded (one-group codes unpacked, or dense rows in the model dtype) holds
    ``2 * head_dim`` values of ``dot_bytes`` per slot; a tier with several groups per token
    dequantizes through fp32 registers and keeps the smallest tile that wastes fewest rows."""
    if tier.NG == 1 or (tier.KBITS >= 16 and tier.VBITS >= 16):
        return decode_tile_rows(tier.T, 2 * head_dim * dot_bytes)
    return decode_tile_rows(tier.T, DECODE_TILE_BYTES)


def decode_loop_tokens(layout, dot_bytes: int = 2) -> int:
    """Live token slots one iteration of the decode kernel's inner loop reads for a tier of ``layout``."""
    rows = tier_rows(tiles.tier_constexprs(layout), layout.head_dim, dot_bytes)
    return (rows // layout.tokens) * layout.tokens if rows >= layout.tokens else rows


# Slot rows of a decode tile for fp32 operands on a GPU (an fp32 model). Its ``ieee`` dots run on
# the FMA units, each thread holding whole rows of the K and V tiles along head_dim, and the
# 32-128-row tiles spilled inside the loop (python -m leankit_kernels.aot: FP16 d64 129-142 local
# operations, d128 2-23; K8V4-K4V2 d128 on sm_90a 51). At 16 rows FP16 at d64, d128 and d256 and
# the quantized tiers at d64 and d128 compile with no local memory on sm_80 and sm_90a (64-242
# registers); tf32x3 dots did not clear the wide tiles (dense d128 on sm_90a still spilled 7).
# K8V4-K4V2 at d256 spills at every tile tried. Untimed: no fp32 model has run on a GPU.
FP32_DECODE_ROWS = 16


def decode_tiling(targs: dict, dot_bytes: int = 2, gpu: bool = False) -> dict:
    """Tile constexprs of :func:`_decode_kernel` for the tiers in ``targs`` (:func:`leankit_kernels.tiles.tier_args`)
    and MMA operands of ``dot_bytes`` bytes: tiles of ``NB_HI`` / ``NB_LO`` slots. ``gpu``: the
    launch is compiled for a GPU, where fp32 operands take at most :data:`FP32_DECODE_ROWS` rows
    (the interpreter keeps the wider tiles, which its tests walk)."""
    f = targs["F"]
    rows = {"NB_HI": tier_rows(targs["HI"], f, dot_bytes), "NB_LO": tier_rows(targs["LO"], f, dot_bytes)}
    if gpu and dot_bytes == 4:
        rows = {k: min(v, FP32_DECODE_ROWS) for k, v in rows.items()}
    return rows


def group_pad(g: int) -> int:
    """Rows of the query tile: the group size padded to a power of two (``tl.dot`` pads the MMA itself,
    so the softmax only ever touches these rows)."""
    return tiles.next_power_of_2(g)


# Decode programs resident per SM before the kernel's own register count is known (the first
# launch of each variant on a device): the fp16 decode variants use about 105-200 registers x 128
# threads (python -m leankit_kernels.aot), so 2-4 fit the 64K-register file of sm_80/sm_90.
CTAS_PER_SM = 2
# Register file and per-program limit of sm_80 / sm_90 SMs.
SM_REGISTERS = 65536
SM_MAX_PROGRAMS = 32
# variant key -> programs per SM that its compiled registers / shared memory allow (measured
# from the compiled kernel after its first launch; host-side metadata, no device read).
_RESIDENT: dict = {}


def resident_programs(regs: int, shared: int, warps: int, sm_shared: int = 0) -> int:
    """Programs of ``warps`` warps using ``regs`` registers per thread and ``shared`` bytes of shared
    memory that one SM holds at once (registers are allocated per warp in units of 256, i.e. the
    per-thread count rounded up to 8; ``sm_shared=0`` leaves shared memory out)."""
    if regs <= 0:
        return CTAS_PER_SM
    per_warp = -(-regs // 8) * 8 * 32
    n = min(SM_MAX_PROGRAMS, SM_REGISTERS // (per_warp * warps))
    if sm_shared and shared:
        n = min(n, sm_shared // shared)
    return max(1, n)


def choose_splits(bh: int, max_pages: int, g: int, f: int, page_size: int, sms: int | None,
                  total_pages: int | None = None, resident: int = CTAS_PER_SM) -> int:
    """Flash-decoding split factor for ``bh`` (sequence, KV head) programs of up to ``max_pages`` pages.

    The decode kernels are latency-bound, so a program's time is roughly its pages whatever else
    runs beside it, and a launch takes about ``waves x pages per split``, where a wave is one
    program in each of the ``resident * sms`` slots. A launch that spills a few programs into a
    second wave pays for much of that wave (on an H100, ``results/gpu-h100/decode_splits.md``: up
    to 1.43x slower than the count that fits one wave). So the split count is the one with the
    least modelled time, ``ceil(busy / slots) * (ceil(max_pages / splits) +``
    :data:`SPLIT_OVERHEAD_PAGES` ``)`` (:func:`split_time`), fewer splits on a tie (less partial
    traffic and fewer reduce reads), among launches of at most four waves more than one split per
    head needs (measured: one and two; many short programs pay their fixed work and the reduce
    more often than the model charges). ``busy`` counts the programs that find pages: ``bh * splits``
    for heads of equal length, at most ``total_pages / pages per split + bh`` when ``total_pages``
    (summed over the layer's heads) says that most heads are shorter than the longest, so one long
    head among short ones is split finer. Never splits so small that the partials' traffic
    (``8 G (F + 2)`` bytes per split: fp32 written, then read by the reduce) exceeds
    ``1 / SPLIT_BYTES_RATIO`` of the page bytes the split reads. Programs past their head's pages
    find an empty range and exit at once. ``sms=None`` (interpreter): 2 splits.
    """
    min_pages = max(1, tiles.cdiv(SPLIT_BYTES_RATIO * 8 * g * (f + 2), page_size))
    if not sms:
        return max(1, min(2, tiles.cdiv(max_pages, min_pages)))
    work = total_pages if total_pages is not None else bh * max_pages
    return _fewest_waves_split(bh, max(1, max_pages), max(1, work), resident * sms,
                               max(1, tiles.cdiv(max_pages, min_pages)))


# A program's fixed work (query, table row, the partials it writes), in pages of reading.
SPLIT_OVERHEAD_PAGES = 1


def split_time(bh: int, max_pages: int, work: int, slots: int, splits: int) -> tuple[int, int]:
    """``(modelled time in pages, busy programs)`` of a decode launch cut into ``splits`` per head
    (:func:`choose_splits`): ``ceil(busy / slots)`` waves of ``ceil(max_pages / splits)`` pages
    plus a program's fixed work (:data:`SPLIT_OVERHEAD_PAGES`)."""
    pps = tiles.cdiv(max_pages, splits)
    busy = min(bh * splits, tiles.cdiv(work, pps) + bh)
    return tiles.cdiv(busy, slots) * (pps + SPLIT_OVERHEAD_PAGES), busy


@functools.lru_cache(maxsize=4096)
def _fewest_waves_split(bh: int, max_pages: int, work: int, slots: int, cap: int) -> int:
    """The split count in ``1..cap`` of least :func:`split_time` (the fewest splits among equals).

    Within ``w`` waves more splits only shorten the programs, so the best count for ``w`` waves
    is the largest whose busy programs fit ``w * slots`` (busy grows with the splits): a binary
    search per wave count, from the waves one split per head needs to four more. Cached: the
    launcher asks once per layer and step, and the page bounds change every few steps."""
    best_t, busy1 = split_time(bh, max_pages, work, slots, 1)
    best, w0 = 1, tiles.cdiv(busy1, slots)
    for w in range(w0, w0 + 5):
        lo, hi = 1, cap  # largest s in [1, cap] with busy(s) <= w * slots (s = 1 always qualifies here)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if split_time(bh, max_pages, work, slots, mid)[1] <= w * slots:
                lo = mid
            else:
                hi = mid - 1
        lo = tiles.cdiv(max_pages, tiles.cdiv(max_pages, lo))  # the fewest splits of that split size
        t = split_time(bh, max_pages, work, slots, lo)[0]
        if t < best_t or (t == best_t and lo < best):
            best, best_t = lo, t
    return best


@dataclass(frozen=True)
class _DecodePlan:
    """What a decode launch derives from the cache's layouts, the query dtype and the device alone:
    worked out once per combination (:func:`_decode_plan`), not per layer and step."""

    dot_t: object
    prec: str
    tiling: dict
    variant: tuple  # the compiled variant's key for _RESIDENT
    sms: int | None
    g_pad: int
    warps: int
    stages: int


_DECODE_PLANS: dict = {}


def _decode_plan(layouts, targs: dict, dtype: torch.dtype, dev: torch.device, g: int, keep: bool) -> _DecodePlan:
    key = (layouts, dtype, dev, g, keep)
    plan = _DECODE_PLANS.get(key)
    if plan is None:
        dot_t, prec = dot_config(dtype, dev)
        tiling = decode_tiling(targs, dot_t.primitive_bitwidth // 8, gpu=dev.type == "cuda")
        variant = (dev, g, targs["F"], dtype, keep, DECODE_WARPS, DECODE_STAGES,
                   tuple(sorted((k, str(v)) for k, v in {**targs, **tiling}.items())))
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None
        plan = _DECODE_PLANS[key] = _DecodePlan(dot_t, prec, tiling, variant, sms, group_pad(g), DECODE_WARPS,
                                                DECODE_STAGES)
    return plan


@dataclass
class DecodeLogits:
    """Scaled base-2 logits a decode launch saved for a later score update (:func:`apply_score_update`).

    ``logits`` fp32 ``[B*Hkv, 2, G, n]``: row ``(bh, tier, g)`` holds the logit of each slot of
    that tier (dead or unseen slots are never read). ``q_pos`` is the query position they were
    computed for.
    """

    logits: torch.Tensor
    n: int
    group: int
    q_pos: torch.Tensor


def paged_attention(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, *,
                    update_scores: bool = False, q_valid: torch.Tensor | None = None,
                    num_splits: int | None = None,
                    page_bounds: tuple[int, ...] | None = None, save_logits: bool = False,
                    out_dtype: torch.dtype | None = None):
    """Attention of ``q`` ``[B, Hq, Q, F]`` over the layer's unified pages (kernel mirror of
    :func:`leankit.attention.paged_attention_ref`).

    ``Q == 1`` runs the split-K decode kernels; ``Q > 1`` routes to
    :func:`leankit_kernels.prefill_attention.prefill_attention`.

    Args:
        q_pos: int ``[B, Q]`` query positions (keys with ``pos <= q_pos`` are visible).
        scale: softmax scale.
        update_scores: decode only; also update every live token's running significance in
            its page's score segment (``s <- s + (p_bar - s) / (q_pos - pos + 1)``) with this
            call's own lse (:func:`apply_score_update` on the saved logits).
        q_valid: bool ``[B, Q]``; rows where it is false update no score.
        num_splits: split-K factor (default: enough programs to fill the GPU once).
        page_bounds: ``(max high pages, max low pages, max total pages[, pages of all heads])`` over
            the layer's heads when the caller already knows them (upper bounds are fine; the sum,
            which sizes the splits, defaults to every head at the maximum). With them the launcher
            reads nothing from the device (no host sync): grids come from the bounds, and programs
            of heads with less work find empty ranges and exit.
        save_logits: decode only; also return a :class:`DecodeLogits` for a later
            :func:`apply_score_update` with an lse the caller supplies (e.g. after merging more
            keys into the softmax).
        out_dtype: decode only; the output's dtype (default ``q.dtype``). fp32 spares a caller
            that goes on in fp32 (an output rotated back to the model's basis) a conversion launch
            and the rounding to 16 bits.

    Returns:
        ``(out [B, Q, Hq, F] in out_dtype, lse fp32 [B, Hkv, G*Q])``, plus the :class:`DecodeLogits`
        (``None`` when no key can be seen) with ``save_logits=True``.
    """
    nq = q.shape[2]
    if nq > 1:
        if update_scores or save_logits or out_dtype is not None:
            raise ValueError("update_scores / save_logits / out_dtype are decode (Q == 1) features; use "
                             f"received_attention for prefill (got {nq} queries)")
        return prefill_attention(q, kv, q_pos, scale)
    out, lse, saved, _ = _paged_decode(q, kv, q_pos, scale, keep=update_scores or save_logits,
                                       num_splits=num_splits, page_bounds=page_bounds, out_dtype=out_dtype)
    if update_scores:
        apply_score_update(kv, saved, lse, q_valid=q_valid)
    return (out, lse, saved) if save_logits else (out, lse)


def decode_step_attention(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, k_new: torch.Tensor,
                          v_new: torch.Tensor, real: torch.Tensor, *, significance: bool = False,
                          num_splits: int | None = None, page_bounds: tuple[int, ...] | None = None,
                          out_dtype: torch.dtype | None = None):
    """A decode step's attention: the layer's pages (the earlier tokens) and the step's own token at
    its exact K/V, merged by log-sum-exp, in the decode launch itself (the one-split decode program,
    or the split reduce): the kernel mirror of :func:`paged_attention` followed by
    :func:`leankit_kernels.own_token.merge_own_token`, one launch fewer.

    Args:
        q: ``[B, Hq, 1, F]`` the queries, in the pages' basis (any strides, last dim contiguous).
        k_new, v_new: ``[B, Hkv, 1, F]`` the step's new keys and values as the model produced them,
            in the pages' basis (last dim contiguous).
        real: bool ``[B, 1]``: the row's token is real (scales its initial significance).
        significance: also keep the logits for :func:`apply_score_update` and return each new
            token's initial significance (LeanKV §4).
        num_splits, page_bounds, out_dtype: as in :func:`paged_attention`.

    Returns:
        ``(out [B, 1, Hq, F] out_dtype, lse fp32 [B, Hkv, G], saved DecodeLogits or None,
        received fp32 [B, Hkv, 1] or None)``; ``lse`` counts the own token (the lse a score update
        of the stored tokens needs).
    """
    b, _, nq, f = q.shape
    hkv = k_new.shape[1]
    if nq != 1 or tuple(k_new.shape) != (b, hkv, 1, f) or tuple(v_new.shape) != (b, hkv, 1, f):
        raise ValueError(f"decode_step_attention serves one query and one new token per row: got query "
                         f"{tuple(q.shape)}, new keys {tuple(k_new.shape)}, new values {tuple(v_new.shape)}")
    k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
    v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
    return _paged_decode(q, kv, q_pos, scale, keep=significance, num_splits=num_splits, page_bounds=page_bounds,
                         out_dtype=out_dtype, own=(k_new, v_new, real, significance))


def _paged_decode(q, kv, q_pos, scale, *, keep: bool, num_splits, page_bounds, out_dtype, own=None):
    """The decode launches (split-K decode, then the split reduce when there are several splits):
    ``(out, lse, saved logits or None, received or None)``. ``own``: ``(k_new, v_new, real,
    received)`` folds the step's own token into the softmax before the output is written."""
    b, hq, _, f = q.shape
    q, tables, n_pages, lens, stride_tier, g, targs = layer_launch(q, kv)
    hkv, r = tables.shape[1], tables.shape[2]
    dev = q.device
    bounds = tuple(page_bounds) if page_bounds is not None else page_counts(n_pages, targs["HAS_LOW"])
    if len(bounds) not in (3, 4):
        raise ValueError(f"page_bounds must be (max high, max low, max total[, sum]) pages, got {page_bounds!r}")
    max_h, max_l, max_pages = bounds[:3]
    total_pages = bounds[3] if len(bounds) == 4 else None
    out = tiles.empty((b, 1, hq, f), dtype=out_dtype or q.dtype, device=dev)
    lse = tiles.empty((b, hkv, g), dtype=torch.float32, device=dev)
    if max_pages == 0:  # no page to read: an empty softmax
        out.zero_()
        lse.fill_(float("-inf"))
        if own is None:
            return out, lse, None, None
        k_new, v_new, real, received = own  # the own token alone: its merge with the empty softmax
        out, lse, recv = merge_own_token(q, k_new, v_new, out, lse, real, scale, received=received,
                                         out_dtype=out_dtype or q.dtype)
        return out, lse, None, recv
    q_pos = q_pos.to(device=dev, dtype=torch.int32)
    bh = b * hkv
    plan = _decode_plan(kv.layouts, targs, q.dtype, dev, g, keep)
    dot_t, prec, tiling, variant, sms = plan.dot_t, plan.prec, plan.tiling, plan.variant, plan.sms
    if not num_splits:
        resident = _RESIDENT.get(variant, CTAS_PER_SM)
        s = choose_splits(bh, max_pages, g, f, targs["PAGE_SIZE"], sms, total_pages, resident)
    else:
        s = num_splits
    pps = tiles.cdiv(max_pages, max(1, s))
    s = tiles.cdiv(max_pages, pps)
    direct = s == 1
    lg_n = max(max_h * targs["HI"].T, max_l * targs["LO"].T if targs["HAS_LOW"] else 0)
    if keep:
        logits = tiles.empty((bh, 2, g, lg_n), dtype=torch.float32, device=dev)
    else:
        logits, lg_n = tiles.unused_buffer(dev), 0
    if direct:  # the kernel writes the output itself: no partials (never read or written)
        part_acc = part_ml = tiles.unused_buffer(dev)
    else:
        part_acc = tiles.empty((bh, s, g, f), dtype=torch.float32, device=dev)
        part_ml = tiles.empty((bh, s, g, 2), dtype=torch.float32, device=dev)
    own_args, recv = _own_args(own, b, hkv, dev)
    gp = plan.g_pad
    sm_scale = float(scale) * LOG2E
    compiled = kernel_for(_decode_kernel, dev)[(bh, s)](
        q, q.stride(0), q.stride(1), q_pos, q_pos.stride(0), kv.pool.storage, tables, n_pages, lens, stride_tier,
        part_acc, part_ml, out, lse, logits, hkv, r, pps, s, lg_n, sm_scale, *own_args,
        G=g, G_PAD=gp, DOT=dot_t, PREC=prec, SAVE_LOGITS=keep, DIRECT=direct, num_warps=plan.warps,
        num_stages=plan.stages, OWN=own is not None and direct, RECEIVED=recv is not None and direct,
        **tiling, **targs)
    if dev.type == "cuda" and variant not in _RESIDENT and getattr(compiled, "n_regs", 0):
        props = torch.cuda.get_device_properties(dev)
        _RESIDENT[variant] = resident_programs(compiled.n_regs, int(compiled.metadata.shared), plan.warps,
                                               getattr(props, "shared_memory_per_multiprocessor", 0))
    if not direct:
        kernel_for(_decode_reduce_kernel, dev)[(bh,)](
            part_acc, part_ml, out, lse, hkv, s, q, q.stride(0), q.stride(1), *own_args, sm_scale, G=g, G_PAD=gp,
            F=f, OWN=own is not None, RECEIVED=recv is not None, num_warps=4)
    saved = DecodeLogits(logits, lg_n, g, q_pos) if keep else None
    return out, lse, saved, recv


def _own_args(own, b: int, hkv: int, dev: torch.device) -> tuple[tuple, torch.Tensor | None]:
    """The own-token arguments of the decode and reduce kernels (``kn_ptr`` ... ``recv_ptr``) and the
    received buffer (None unless asked for). Without an own token, one unused buffer stands for
    every pointer (never read or written) and the strides are 0."""
    if own is None:
        unused = tiles.unused_buffer(dev)
        return (unused, unused, 0, 0, 0, 0, unused, unused), None
    k_new, v_new, real, received = own
    real = tiles.row_flags(real, b, dev)
    recv = tiles.empty((b, hkv, 1), dtype=torch.float32, device=dev) if received else None
    return (k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), real,
            recv if recv is not None else tiles.unused_buffer(dev)), recv


def apply_score_update(kv: PagedKV, saved: DecodeLogits | None, lse: torch.Tensor,
                       q_pos: torch.Tensor | None = None, q_valid: torch.Tensor | None = None) -> None:
    """Fused running-significance update of the layer's score segments from saved decode logits.

    For every live slot visible to the query: ``s <- s + (p_bar - s) / (q_pos - pos + 1)``, with
    ``p_bar = mean_g exp(logit_g - lse_g)`` over the group's query heads (LeanKV §4). ``lse`` fp32
    ``[B, Hkv, G]`` (natural log) is the caller's: the decode call's own, or one that also counts
    keys the caller merged into the softmax. ``q_pos`` int ``[B, 1]`` defaults to the positions the
    logits were computed for. A row whose lse is ``-inf`` everywhere, or whose ``q_valid`` is
    false, updates nothing. Reads no value back to the host.
    """
    if saved is None:
        return
    tables, _n_pages, lens, stride_tier = tiles.layer_views(kv)
    b, hkv, r = tables.shape
    g = saved.group
    if tuple(lse.shape) != (b, hkv, g):
        raise ValueError(f"apply_score_update: lse has shape {tuple(lse.shape)}, expected {(b, hkv, g)} "
                         f"(batch, KV heads, group) of layer {kv.layer}")
    if saved.logits.shape[0] != b * hkv:
        raise ValueError(f"apply_score_update: saved logits are for {saved.logits.shape[0]} (sequence, head) rows, "
                         f"layer {kv.layer} has {b * hkv}")
    dev = saved.logits.device
    targs = tiles.tier_args(kv.layouts)
    if q_valid is None:
        qv = torch.ones(b, dtype=torch.int32, device=dev)
    else:  # the kernel reads one flag per row (!= 0)
        qv = tiles.row_flags(q_valid, b, dev)
    if lse.dtype != torch.float32 or not lse.is_contiguous() or lse.device != dev:
        lse = lse.to(device=dev, dtype=torch.float32).contiguous()
    q_pos = saved.q_pos if q_pos is None else q_pos.to(device=dev, dtype=torch.int32)
    sblk = 64
    kernel_for(_score_update_kernel, dev)[(b * hkv, tiles.cdiv(saved.n, sblk), 2 if targs["HAS_LOW"] else 1)](
        saved.logits, lse, q_pos, q_pos.stride(0), qv, kv.pool.storage, tables, lens, stride_tier, hkv, r, saved.n,
        G=g, G_PAD=group_pad(g), PAGE_SIZE=targs["PAGE_SIZE"], BLOCK_N=sblk, HAS_LOW=targs["HAS_LOW"],
        HI=targs["HI"], LO=targs["LO"], num_warps=4)


def score_update_ref(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, lse: torch.Tensor,
                     q_valid: torch.Tensor | None = None) -> None:
    """PyTorch reference of the fused decode score update (in place on the pool).

    For every live slot ``j`` visible to the (single) query: ``s_j <- s_j + (p_bar_j - s_j) / n_j``
    with ``p_bar_j`` from :func:`leankit.attention.received_attention_ref` (probability averaged
    over the group's query heads) and ``n_j = q_pos - pos_j + 1``: after the update ``s_j`` is the
    mean probability token ``j`` received over the ``n_j`` queries that could see it (LeanKV §4's
    significance). The score is stored as fp16; other bytes are untouched.
    """
    if q.shape[2] != 1:
        raise ValueError("score_update_ref is the decode (Q == 1) update")
    recv = received_attention_ref(q, kv, q_pos, scale, lse, q_valid)
    table, layer, pool = kv.table, kv.layer, kv.pool
    b = q.shape[0]
    qp = q_pos.reshape(b, -1)[:, :1].to(torch.int64).view(b, 1, 1)
    qok = torch.ones(b, dtype=torch.bool, device=q.device) if q_valid is None else q_valid.reshape(b, -1)[:, 0]
    flat16 = pool.storage.view(-1).view(torch.float16)
    for tier, layout in enumerate(kv.layouts):
        ids, _ = table.tier_pages(tier, layer)
        if ids.shape[-1] == 0:
            continue
        pages = pool.gather(ids)
        old = layout.scores(pages).flatten(2)
        pos = layout.positions(pages).flatten(2).to(torch.int64)
        slot = torch.arange(old.shape[-1], device=old.device)
        live = slot.view(1, 1, -1) < table.lens[tier, layer].unsqueeze(-1)
        upd = live & (pos <= qp) & qok.view(b, 1, 1)
        n = (qp - pos + 1).clamp_min(1).to(torch.float32)
        new = old + (recv[tier] - old) / n
        t = layout.tokens
        page = torch.gather(ids.long(), 2, (slot // t).view(1, 1, -1).expand_as(old))
        idx = (page * layout.page_size + layout.offset("score")) // 2 + (slot % t).view(1, 1, -1)
        flat16[idx[upd]] = new[upd].to(torch.float16)

