"""Hetero-KV quantize + pack straight into unified-page slots (LeanKV §4 Hetero-KV, Eq. 2, §5.2).

Reads
    ``k``, ``v``: ``[n, F]`` (fp16 / bf16 / fp32, last dim contiguous) -- the new tokens;
    ``page``, ``slot``: ``[n]`` int -- token ``i`` goes to row ``slot[i]`` of page ``page[i]``;
    ``pos`` ``[n]`` int, ``score`` ``[n]`` float.
Writes (in place, uint8 pool ``[num_pages, page_size]``), for each token, the six segments of its
page row exactly as :meth:`leankit.pages.PageLayout.encode` + :meth:`leankit.pages.PagePool.write_rows`:
    ``K data``  ``Kb = F * kbits / 8`` bytes at ``K_OFF + slot * Kb`` (packed codes, or raw dense bytes)
    ``K meta``  ``G`` x (fp16 scale, fp16 min) at ``KM_OFF + slot * 4G`` (quantized sides only)
    ``V data`` / ``V meta`` likewise, ``score`` fp16 at ``SC_OFF + 2 slot``, ``position`` int32 at
    ``POS_OFF + 4 slot``.

Quantization (bit-exact with :func:`leankit.quant.quantize`): per token, per group of
``F / G`` channels, asymmetric min-max (Eq. 2): ``min16 = fp16(min)``,
``scale16 = fp16((max - min16) / (2^b - 1))``, ``Q = round_half_even((x - min16) / scale16)``
clamped to ``[0, 2^b - 1]``; a constant group (``scale16 == 0``) stores ``Q = 0``. Divisions use
``div_rn`` (IEEE round-to-nearest, like PyTorch), never the approximate divide, and the rounding
is written out (floor + tie-to-even), so compiled code cannot drift from ``torch.round``.
Codes are packed little-endian: code ``e`` in byte ``e // P`` at bit ``(e % P) * b``.

One program handles ``BLOCK_N`` tokens and both sides: a ``[BLOCK_N, F]`` tile is loaded once,
reduced per group in registers, packed, and stored as whole ``[BLOCK_N, Kb]`` rows (each row is
contiguous inside its page, so stores coalesce).

A step's new tokens are stored by ``_store_step_kernel`` (:func:`store_step_tokens`) straight
from the model's ``[B, H, Q, F]`` K/V: each program finds its tokens' slots (the head's count plus
the token's rank among its row's real new tokens) and pages (the layer's page table) itself, so a
decode step's store is one launch with no index ops around it; it writes the same bytes.

A NaN/Inf input element, or a group whose fp16 scale or minimum would overflow, sets an error
flag. The launcher either raises :class:`leankit.quant.NonFiniteKVError` like the reference (the
rows were written, but the cache has not yet counted them), or leaves the flag on the device for
the caller to read once per step (:class:`leankit.cache.LeanCache` does, so a decode step never
waits on the host).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from leankit.pages import PageLayout
from leankit.quant import NonFiniteKVError

from . import tiles
from .tiles import (
    check_head_dim,
    code_ptrs,
    dense_ptrs,
    kernel_for,
    load_side,
    meta_index,
    page_constexprs,
    position_ptrs,
    score_ptrs,
    tier_constexprs,
)


@triton.jit
def _round_half_even(y):
    """``torch.round`` for fp32: round to nearest, ties to even (exact for |y| < 2^22)."""
    f = tl.floor(y)
    d = y - f  # exact: y and floor(y) share the exponent range here
    odd = (f.to(tl.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _quant_side(src_rows, valid, pool, page, row,
                OFF: tl.constexpr, MOFF: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr,
                NG: tl.constexpr, DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write one side of the tokens (``src_rows`` ``[BLOCK_N]``: a pointer to each token's first
    channel); returns 1 if a valid token holds NaN/Inf or a group whose fp16 scale/min overflows,
    else 0 (the caller raises the error flag)."""
    f = tl.arange(0, F)
    x = tl.load(src_rows[:, None] + f[None, :], mask=valid[:, None], other=0.0)
    # NaN/Inf in the input (|x| < inf is False for NaN): checked on the elements themselves, since a
    # GPU min/max may skip a NaN.
    bad = tl.max(tl.where(valid[:, None] & ~(tl.abs(x.to(tl.float32)) < float("inf")), 1, 0))
    if BITS >= 16:
        tl.store(dense_ptrs(pool, page, row, OFF, F, DENSE, PAGE_SIZE), x.to(DENSE), mask=valid[:, None])
    else:
        P: tl.constexpr = 8 // BITS
        KB: tl.constexpr = F // P
        GS: tl.constexpr = F // NG
        QMAX: tl.constexpr = (1 << BITS) - 1
        xg = tl.reshape(x.to(tl.float32), (BLOCK_N, NG, GS))
        lo = tl.min(xg, axis=2)
        hi = tl.max(xg, axis=2)
        mn16 = lo.to(tl.float16)
        mn16 = (mn16 + 0.0).to(tl.float16)  # a zero minimum stored as +0 (leankit.quant)
        mnf = mn16.to(tl.float32)
        # Scale from the *stored* minimum so the largest element maps inside [0, QMAX] (Eq. 2).
        step = tl.math.div_rn(hi - mnf, tl.full(hi.shape, QMAX, tl.float32))
        sc16 = step.to(tl.float16)
        # Among fp16's subnormals (< 2^-14) a scale rounded under the step goes one unit up, so a
        # small group's top codes never clamp (leankit.quant.round_scale_up_if_subnormal).
        up = (step > 0.0) & (sc16.to(tl.float32) < step) & (sc16.to(tl.float32) < 6.103515625e-05)
        sc16 = tl.where(up, (sc16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True), sc16)
        sc16 = (sc16 + 0.0).to(tl.float16)  # a zero scale stored as +0 (leankit.quant)
        scf = sc16.to(tl.float32)
        nonconst = scf > 0.0
        safe = tl.where(nonconst, scf, 1.0)
        y = tl.math.div_rn(xg - mnf[:, :, None], tl.broadcast_to(safe[:, :, None], (BLOCK_N, NG, GS)))
        q = tl.where(nonconst[:, :, None], _round_half_even(y), 0.0)
        q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0)
        codes = tl.reshape(q.to(tl.int32), (BLOCK_N, F))
        if P == 1:
            packed = codes.to(tl.uint8)
        else:
            shifts = tl.arange(0, P) * BITS
            packed = tl.sum(tl.reshape(codes, (BLOCK_N, KB, P)) << shifts[None, None, :], axis=2).to(tl.uint8)
        tl.store(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE), packed, mask=valid[:, None])
        p16 = pool.to(tl.pointer_type(tl.float16))
        mbase = meta_index(page, row, MOFF, NG, PAGE_SIZE)
        g2 = 2 * tl.arange(0, NG)
        tl.store(p16 + mbase[:, None] + g2[None, :], sc16, mask=valid[:, None])
        tl.store(p16 + mbase[:, None] + g2[None, :] + 1, mn16, mask=valid[:, None])
        ok = (tl.abs(scf) < float("inf")) & (tl.abs(mnf) < float("inf"))  # False for NaN too
        bad = tl.maximum(bad, tl.max(tl.where(valid[:, None] & (~ok), 1, 0)))
    return bad


@triton.jit
def _token_slots(page_ptr, slot_ptr, n, BLOCK_N: tl.constexpr):
    """This program's ``BLOCK_N`` tokens, their mask, and the page id (int64) and row of each token's slot."""
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = tok < n
    page = tl.load(page_ptr + tok, mask=valid, other=0).to(tl.int64)
    row = tl.load(slot_ptr + tok, mask=valid, other=0).to(tl.int64)
    # A negative page id marks a token that is not written (padding, or a slot whose page the
    # step could not get): the host never has to filter tokens (no host sync). Rows are taken as
    # inside the page (check_slots proves it on the eager path; the cache's come from its table):
    # a bound here costs the K4V2 variant a spill on sm_90a.
    valid = valid & (page >= 0)
    return tok, valid, page, row


@triton.jit
def _quantize_kernel(k_ptr, v_ptr, stride_k, stride_v, page_ptr, slot_ptr, pos_ptr, score_ptr, pool, err, n,
                     F: tl.constexpr, PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr,
                     TIER: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantize ``BLOCK_N`` tokens' K and V into their page rows (one program, both sides)."""
    tok, valid, page, row = _token_slots(page_ptr, slot_ptr, n, BLOCK_N)
    tok64 = tok.to(tl.int64)
    # each side's row pointers are formed at its own call, so the value side's hold no registers
    # while the key side is quantized
    bad = _quant_side(k_ptr + tok64 * stride_k, valid, pool, page, row, TIER.KOFF, TIER.KMOFF, TIER.KBITS, F,
                      TIER.NG, DENSE, PAGE_SIZE, BLOCK_N)
    bad = tl.maximum(bad, _quant_side(v_ptr + tok64 * stride_v, valid, pool, page, row, TIER.VOFF, TIER.VMOFF,
                                      TIER.VBITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N))
    _finish_tokens(valid, pool, page, row, err, bad, score_ptr + tok, pos_ptr + tok, True, PAGE_SIZE, TIER,
                   BLOCK_N)


@triton.jit
def _finish_tokens(valid, pool, page, row, err, bad, score_src, pos_src, HAS_SCORE: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, TIER: tl.constexpr, BLOCK_N: tl.constexpr):
    """After both sides of ``BLOCK_N`` tokens are written: raise ``err`` if ``bad``, and write each
    valid token's initial significance (from ``score_src``; 0 without ``HAS_SCORE``) and position
    (from ``pos_src``) into row ``row`` of page ``page``. Loaded only now, so they hold no
    registers across the quantization."""
    tl.store(err, bad, mask=bad > 0)  # every program that stores writes the same 1: no atomics needed
    if HAS_SCORE:
        score = tl.load(score_src, mask=valid, other=0.0).to(tl.float16)
    else:
        score = tl.zeros([BLOCK_N], tl.float16)
    tl.store(score_ptrs(pool, page, row, TIER.SCOFF, PAGE_SIZE), score, mask=valid)
    pos = tl.load(pos_src, mask=valid, other=0).to(tl.int32)
    tl.store(position_ptrs(pool, page, row, TIER.POSOFF, PAGE_SIZE), pos, mask=valid)


# Runtime integers of the step-store kernel that change from step to step or batch to batch
# (tokens, heads, queries, table width, the strides of the [B, Q] or [B, H, Q] step tensors and
# the scores): not specialized on (a variant compile each). The K/V strides are: all multiples of
# 16 for any head_dim the kernels take, so the rows load as 16-byte vectors, and their class never
# changes.
STORE_DYNAMIC = ("n", "H", "Q", "R", "ssb", "ssh", "ssq", "srb", "srh", "srq", "sxb", "sxh", "sxq", "sqb", "sqq")


@triton.jit(**tiles.jit_options(STORE_DYNAMIC))
def _store_step_kernel(k_ptr, v_ptr, skb, skh, skq, svb, svh, svq, real_ptr, srb, srh, srq, rank_ptr, sxb, sxh, sxq,
                       qpos_ptr, sqb, sqq, score_ptr, ssb, ssh, ssq, lens_ptr, tab_ptr, pool, err, n, H, Q, R,
                       F: tl.constexpr, PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr, TIER: tl.constexpr,
                       BLOCK_N: tl.constexpr, SCORE: tl.constexpr, UPDATE_LENS: tl.constexpr, LOW: tl.constexpr):
    """Store a step's new tokens of one layer straight from the model's ``[B, H, Q, F]`` K/V.

    Token ``i`` of the ``n = B * Q * H`` is (row ``b``, query ``q``, KV head ``h``), ``i = (b Q + q) H
    + h``. A token to store (``real[b, h, q]``; ``srh = 0`` when every head stores the same tokens)
    goes to slot ``lens[b, h] + rank[b, h, q]`` of its head in this tier, whose page the table
    names (§5.2 bidirectional row: high pages from the left, ``LOW`` pages from the right). ``SCORE``:
    0 stores significance 0, 1 reads ``score[b, h, q]`` (strided), 2 reads ``score[i]``.
    ``UPDATE_LENS`` (one query per row: each head's count belongs to one token): ``lens[b, h] +=
    real[b, 0]`` here, so the step's token count needs no launch of its own.
    """
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inb = i < n
    h = i % H
    bq = i // H
    q = bq % Q
    b = (bq // Q).to(tl.int64)
    keep = inb & (tl.load(real_ptr + b * srb + h * srh + q * srq, mask=inb, other=0) != 0)
    bh = b * H + h
    lens = tl.load(lens_ptr + bh, mask=inb, other=0)
    slot = lens + tl.load(rank_ptr + b * sxb + h * sxh + q * sxq, mask=keep, other=0).to(tl.int32)
    # The host proves rows fit before a step (BidirectionalPageTable.check_rows / grow); a slot past
    # the row's R pages would read a neighbouring head's column, so it is never written.
    keep = keep & (slot < R * TIER.T)
    page, row = tiles.slot_pages(tab_ptr + bh * R, slot, keep, R, TIER.T, LOW)
    # A page the step could not get is -1 in the table: the token is skipped (the step's refused
    # grant raises at its end), as in quantize_into_pages.
    valid = keep & (page >= 0)
    if SCORE == 1:
        score_src = score_ptr + b * ssb + h * ssh + q * ssq
    else:  # SCORE 2, or a pointer never read (SCORE 0)
        score_src = score_ptr + i
    row = row.to(tl.int64)
    bad = _quant_side(k_ptr + b * skb + h * skh + q * skq, valid, pool, page, row, TIER.KOFF, TIER.KMOFF, TIER.KBITS,
                      F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N)
    bad = tl.maximum(bad, _quant_side(v_ptr + b * svb + h * svh + q * svq, valid, pool, page, row, TIER.VOFF,
                                      TIER.VMOFF, TIER.VBITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N))
    _finish_tokens(valid, pool, page, row, err, bad, score_src, qpos_ptr + b * sqb + q * sqq, SCORE != 0,
                   PAGE_SIZE, TIER, BLOCK_N)
    if UPDATE_LENS:
        tl.store(lens_ptr + bh, lens + keep.to(tl.int32), mask=inb)


@triton.jit
def _dequantize_kernel(pool, page_ptr, slot_ptr, k_out, v_out, score_out, pos_out, n,
                       F: tl.constexpr, PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr,
                       TIER: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unpack + dequantize page rows back to fp32 ``[n, F]`` K/V, fp32 scores and int32 positions."""
    tok, valid, page, row = _token_slots(page_ptr, slot_ptr, n, BLOCK_N)
    f = tl.arange(0, F)
    out = tok.to(tl.int64)[:, None] * F + f[None, :]
    k = load_side(pool, page, row, valid, TIER.KOFF, TIER.KMOFF, TIER.KBITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N)
    tl.store(k_out + out, k, mask=valid[:, None])
    v = load_side(pool, page, row, valid, TIER.VOFF, TIER.VMOFF, TIER.VBITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N)
    tl.store(v_out + out, v, mask=valid[:, None])
    sc = tl.load(score_ptrs(pool, page, row, TIER.SCOFF, PAGE_SIZE), mask=valid)
    tl.store(score_out + tok, sc.to(tl.float32), mask=valid)
    ps = tl.load(position_ptrs(pool, page, row, TIER.POSOFF, PAGE_SIZE), mask=valid)
    tl.store(pos_out + tok, ps, mask=valid)


@functools.cache
def layout_constexprs(layout: PageLayout) -> dict:
    """Compile-time constants describing one tier's page layout (shared with the AOT script).

    Memoized per layout, as every store launch asks for them: the dict is shared, callers must not
    modify it."""
    return dict(page_constexprs(layout), TIER=tier_constexprs(layout))


def quant_block_n(head_dim: int) -> int:
    """Tokens per program: about 2048 elements per side (16 per thread at 4 warps)."""
    return max(8, min(32, 2048 // head_dim))


def check_slots(page: torch.Tensor, slot: torch.Tensor, tokens: int, num_pages: int) -> None:
    """Raise ``IndexError`` (as the reference's indexing does) where a written token's slot is not a
    row of a page of the pool: a page id >= ``num_pages`` or a row outside ``[0, tokens)``. One host
    read, on the eager path only (the cache's own slots come from its page table)."""
    written = page >= 0
    bad = written & ((page >= num_pages) | (slot < 0) | (slot >= tokens))
    if page.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"token {i}: slot (page {int(page[i])}, row {int(slot[i])}) is outside the pool "
                         f"({num_pages} pages of {tokens} rows)")


def quantize_into_pages(storage: torch.Tensor, layout: PageLayout, page: torch.Tensor, slot: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor,
                        *, block_n: int | None = None, err: torch.Tensor | None = None) -> None:
    """Quantize ``n`` tokens and write all six page segments of their slots, in one launch.

    Byte-for-byte identical to ``PagePool.write_rows(layout, page, slot, layout.encode(k, v, score, pos))``.

    Args:
        storage: the pool's uint8 ``[num_pages, page_size]`` tensor (written in place).
        layout: the tier's :class:`~leankit.pages.PageLayout`.
        page, slot: int ``[n]`` destination page id and row inside it; a token whose page id is
            negative is skipped (not written).
        k, v: ``[n, head_dim]`` keys and values (fp16/bf16/fp32).
        pos: int ``[n]`` positions; score: float ``[n]`` initial significance.
        err: an int32 device flag (one element). When given, a bad token sets it to 1 and
            nothing is read back to the host (no sync): the caller checks the flag when it
            chooses. When omitted, the flag is read here and the error raised.

    Raises:
        NonFiniteKVError: (without ``err``) NaN/Inf input, or a group whose fp16 scale/min would
            overflow. The rows were written, but the cache has not yet counted them.
    """
    n = k.shape[0]
    if n == 0:
        return
    f = layout.head_dim
    check_head_dim(f)
    if storage.dtype != torch.uint8 or storage.dim() != 2 or storage.shape[1] != layout.page_size:
        raise ValueError("storage must be the pool's uint8 [num_pages, page_size] tensor")
    if not storage.is_contiguous():
        raise ValueError("the page pool must be contiguous")
    if k.shape != (n, f) or v.shape != (n, f):
        raise ValueError(f"k and v must be [n, {f}], got {tuple(k.shape)} and {tuple(v.shape)}")
    # the kernel reads token i's page, slot, position and score at index i: a shorter tensor would
    # be read past its end (garbage rows, or a crash) instead of raising as the reference does
    if any(t.numel() != n for t in (page, slot, pos, score)):
        raise ValueError(f"page, slot, pos and score must hold one value per token ({n}), got "
                         f"{page.numel()}, {slot.numel()}, {pos.numel()} and {score.numel()}")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    dev = storage.device
    page = page.reshape(-1).to(device=dev, dtype=torch.int32).contiguous()
    slot = slot.reshape(-1).to(device=dev, dtype=torch.int32).contiguous()
    pos = pos.reshape(-1).to(device=dev, dtype=torch.int32).contiguous()
    score = score.reshape(-1).to(device=dev, dtype=torch.float32).contiguous()
    eager = err is None
    if eager:
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        check_slots(page, slot, layout.tokens, storage.shape[0])
    elif err.dtype != torch.int32 or err.numel() < 1 or err.device != dev:
        raise ValueError(f"err must be an int32 flag on {dev}, got {err.dtype} [{err.numel()}] on {err.device}")
    bn = block_n or quant_block_n(f)
    kernel_for(_quantize_kernel, dev)[(tiles.cdiv(n, bn),)](
        k, v, k.stride(0), v.stride(0), page, slot, pos, score, storage, err, n,
        BLOCK_N=bn, num_warps=4, enable_fp_fusion=False, **layout_constexprs(layout))
    if eager and int(err.item()):
        raise NonFiniteKVError(NON_FINITE_MESSAGE)


def store_step_tokens(storage: torch.Tensor, layout: PageLayout, k: torch.Tensor, v: torch.Tensor,
                      real: torch.Tensor, rank: torch.Tensor, q_pos: torch.Tensor, lens: torch.Tensor,
                      table: torch.Tensor, err: torch.Tensor, *, score: torch.Tensor | None = None,
                      low: bool = False, update_lens: bool | None = None, block_n: int | None = None) -> None:
    """Quantize a step's new tokens of one layer into their next slots of one tier, in one launch.

    Byte-for-byte what :func:`quantize_into_pages` writes for the same tokens, without the index
    ops that would list them, look their pages up and gather their rows first (a decode step's
    store is one launch, not a dozen). Nothing is read back to the host.

    Args:
        storage: the pool's uint8 ``[num_pages, page_size]`` tensor (written in place).
        layout: the tier's :class:`~leankit.pages.PageLayout` (the high tier's unless ``low``).
        k, v: ``[B, H, Q, F]`` the step's keys and values in the basis the pages hold (any
            strides, last dim contiguous).
        real: bool ``[B, Q]`` (every head stores the same tokens) or ``[B, H, Q]`` (per head: a
            LeanKV prompt whose tokens each head classified): the tokens to store; rank: int of
            the same shape, each stored token's index among its head's stored new tokens; q_pos:
            int ``[B, Q]`` positions.
        lens: int32 ``[B, H]`` (contiguous) tokens each head holds in the tier before the step;
            with ``update_lens`` (default: one query per row, ``Q == 1``) it is advanced in place
            by ``real``, otherwise the caller sets the counts.
        table: int32 ``[B, H, R]`` (contiguous) the layer's page table (high pages from the left,
            low pages from the right: ``low`` writes into those).
        err: the layer's int32 device error flag (raised on NaN/Inf or an fp16 overflow of the
            metadata; see :func:`quantize_into_pages`).
        score: initial significance: None (0), ``[B, H, Q]`` float, or ``[B * Q * H]`` float in
            token order ``(b Q + q) H + h``.
    """
    bsz, heads, nq, f = k.shape
    n = bsz * heads * nq
    if n == 0:
        return
    check_head_dim(f)
    if v.shape != k.shape or f != layout.head_dim:
        raise ValueError(f"k and v must be [B, H, Q, {layout.head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if real.shape not in ((bsz, nq), (bsz, heads, nq)) or rank.shape != real.shape or q_pos.shape != (bsz, nq):
        raise ValueError(f"real and rank must both be [{bsz}, {nq}] or [{bsz}, {heads}, {nq}], q_pos [{bsz}, {nq}]")
    if lens.shape != (bsz, heads) or not lens.is_contiguous() or lens.dtype != torch.int32:
        raise ValueError(f"lens must be a contiguous int32 [{bsz}, {heads}] tensor")
    if table.shape[:2] != (bsz, heads) or not table.is_contiguous() or table.dtype != torch.int32:
        raise ValueError(f"table must be a contiguous int32 [{bsz}, {heads}, R] tensor")
    if storage.dtype != torch.uint8 or storage.dim() != 2 or not storage.is_contiguous() \
            or storage.shape[1] != layout.page_size:
        raise ValueError("storage must be the pool's contiguous uint8 [num_pages, page_size] tensor")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    real = tiles.flag_bytes(real)
    # [B, Q] flags and ranks are shared by the heads: stride 0 along H
    rstr = real.stride() if real.dim() == 3 else (real.stride(0), 0, real.stride(1))
    xstr = rank.stride() if rank.dim() == 3 else (rank.stride(0), 0, rank.stride(1))
    if score is None:
        mode, score, sstr = 0, lens, (0, 0, 0)
    elif score.dim() == 3:
        if score.shape != (bsz, heads, nq):
            raise ValueError(f"score must be [{bsz}, {heads}, {nq}], got {tuple(score.shape)}")
        mode, sstr = 1, score.stride()
    else:
        if score.numel() != n:
            raise ValueError(f"a flat score must hold {n} values, got {score.numel()}")
        mode, score, sstr = 2, score.reshape(-1).contiguous(), (0, 0, 0)
    bn = block_n or quant_block_n(f)
    kernel_for(_store_step_kernel, storage.device)[(tiles.cdiv(n, bn),)](
        k, v, *k.stride()[:3], *v.stride()[:3], real, *rstr, rank, *xstr, q_pos, *q_pos.stride(),
        score, *sstr, lens, table, storage, err, n, heads, nq, table.shape[2],
        BLOCK_N=bn, SCORE=mode, UPDATE_LENS=nq == 1 if update_lens is None else update_lens, LOW=low, num_warps=4,
        enable_fp_fusion=False, **layout_constexprs(layout))


# What a raised error flag means (the kernel does not tell the two causes apart).
NON_FINITE_MESSAGE = ("KV states contain NaN or Inf, or values beyond the fp16 range of the quantization "
                      "metadata; refusing to store them in the cache")


def dequantize_from_pages(storage: torch.Tensor, layout: PageLayout, page: torch.Tensor, slot: torch.Tensor,
                          *, block_n: int = 16):
    """Read slots back: ``(k, v)`` fp32 ``[n, head_dim]``, ``score`` fp32 ``[n]``, ``pos`` int32 ``[n]``.

    The kernel mirror of :meth:`leankit.pages.PageLayout.decode` for individual slots.
    """
    dev = storage.device
    page = page.reshape(-1).to(device=dev, dtype=torch.int32).contiguous()
    slot = slot.reshape(-1).to(device=dev, dtype=torch.int32).contiguous()
    n, f = page.numel(), layout.head_dim
    check_head_dim(f)
    if slot.numel() != n:  # the kernel reads slot i for page i: a shorter slot list is read past its end
        raise ValueError(f"page and slot must hold one value per token, got {n} and {slot.numel()}")
    check_slots(page, slot, layout.tokens, storage.shape[0])
    k = tiles.empty((n, f), dtype=torch.float32, device=dev)
    v = torch.empty_like(k)
    score = tiles.empty(n, dtype=torch.float32, device=dev)
    pos = tiles.empty(n, dtype=torch.int32, device=dev)
    if n:
        kernel_for(_dequantize_kernel, dev)[(tiles.cdiv(n, block_n),)](
            storage, page, slot, k, v, score, pos, n, BLOCK_N=block_n, num_warps=4, **layout_constexprs(layout))
    return k, v, score, pos
