"""Quantized codes of a page tile as exact MMA operands, with scale and min kept out of the element path.

LeanKV Eq. (2) dequantizes ``x_hat = s Q + min`` per token and group. With one group per token the
attention kernels never form ``x_hat``: ``q . k_hat = s (q . Q) + min sum(q)`` and
``p @ v_hat = (p s) @ Q + p @ min``, so the ``[N, F]`` tile is the integer codes ``Q`` only, and
``s``/``min`` are applied to ``[N]`` vectors after the matmuls.

Codes reach the fp16 MMA operand a 32-bit word at a time: the fp16 bits ``0x6400 | c`` are the
number ``1024 + c`` (exact for ``c < 1024``), so a shift, a mask and an or turn two codes of a
word into one fp16 pair, with no per-code conversion. Keys may come out in a permuted column
order inside each word (:func:`key_order`, one shift and one mask-or per pair); the caller
loads the query in the same order (``q . k`` is a sum over columns), and values in that order
fill accumulator columns the caller permutes back once per program.
"""

import triton
import triton.language as tl

from .tiles import code_ptrs, load_side, meta_index, unpack_codes


@triton.jit
def _pair(w, j: tl.constexpr, BITS: tl.constexpr):
    """Codes ``2j`` and ``2j + 1`` of each 32-bit word ``w`` as the bits of an fp16 pair ``(1024 + c)``."""
    MASK: tl.constexpr = (1 << BITS) - 1
    return ((w >> (2 * j * BITS)) & MASK) | (((w >> ((2 * j + 1) * BITS)) & MASK) << 16) | 0x64006400


@triton.jit
def _kpair(w, k: tl.constexpr, BITS: tl.constexpr):
    """Codes ``k`` and ``k + 16 / BITS`` of each 32-bit word ``w`` (one per 16-bit half) as the bits of an
    fp16 pair ``(1024 + c)``: one shift and one mask-or per pair. The key tile comes out in the
    order :func:`key_order` gives, and the query is loaded in that order to match."""
    MASK: tl.constexpr = ((1 << BITS) - 1) * 0x10001
    return ((w >> (k * BITS)) & MASK) | 0x64006400


@triton.jit
def key_order(F: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """Feature of each column of a key tile from :func:`codes` (the word-level unpack of keys
    permutes the codes inside each 32-bit word; every other path keeps feature order)."""
    f = tl.arange(0, F)
    if word_unpack(F, BITS, DOT):
        PER: tl.constexpr = 32 // BITS  # codes per word
        r = f % PER
        f = f - r + r // 2 + (r % 2) * (PER // 2)
    return f


@triton.jit
def word_unpack(F: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """Whether :func:`codes` unpacks a side a 32-bit word at a time."""
    return DOT == tl.float16 and (F * BITS // 8) % 4 == 0 and BITS >= 2 and BITS <= 8


@triton.jit
def codes(pool, page, row, valid, OFF: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr,
           PAGE_SIZE: tl.constexpr, DOT: tl.constexpr, BIASED: tl.constexpr, PERM: tl.constexpr):
    """Integer codes ``[N, F]`` of a quantized side as exact ``DOT`` values (unpacked, not dequantized:
    codes < 256 are exact in fp16, bf16 and fp32)."""
    KB: tl.constexpr = F * BITS // 8
    if word_unpack(F, BITS, DOT):
        # Word-level unpack: each 32-bit word of codes becomes fp16 pairs of adjacent codes, a
        # shift, a mask and an or per pair with constant shifts (fp16 bits 0x6400 | c are the
        # number 1024 + c, c < 1024), so no code ever sits alone in a register. Keys keep the
        # offset (folded into their min, code_bias: q is an exact operand and the MMA accumulates
        # in fp32). Values drop it here, exactly in fp16: their other operand, p * scale, is
        # rounded to fp16, and its rounding error times 1024 would swamp the output.
        w32 = pool.to(tl.pointer_type(tl.uint32))
        base = (page * PAGE_SIZE + OFF + row * KB) // 4
        w = tl.load(w32 + base[:, None] + tl.arange(0, KB // 4)[None, :], mask=valid[:, None], other=0)
        if PERM:  # any order inside a word will do: keys meet a query permuted to match, values fill
            # output columns the store puts back in feature order (key_order gives both)
            if BITS == 8:
                pairs = tl.join(_kpair(w, 0, 8), _kpair(w, 1, 8))
            elif BITS == 4:
                pairs = tl.join(tl.join(_kpair(w, 0, 4), _kpair(w, 2, 4)), tl.join(_kpair(w, 1, 4), _kpair(w, 3, 4)))
            else:
                pairs = tl.join(tl.join(tl.join(_kpair(w, 0, 2), _kpair(w, 4, 2)),
                                        tl.join(_kpair(w, 2, 2), _kpair(w, 6, 2))),
                                tl.join(tl.join(_kpair(w, 1, 2), _kpair(w, 5, 2)),
                                        tl.join(_kpair(w, 3, 2), _kpair(w, 7, 2))))
        elif BITS == 8:
            pairs = tl.join(_pair(w, 0, 8), _pair(w, 1, 8))
        elif BITS == 4:
            pairs = tl.join(tl.join(_pair(w, 0, 4), _pair(w, 2, 4)), tl.join(_pair(w, 1, 4), _pair(w, 3, 4)))
        else:
            pairs = tl.join(tl.join(tl.join(_pair(w, 0, 2), _pair(w, 4, 2)), tl.join(_pair(w, 2, 2), _pair(w, 6, 2))),
                            tl.join(tl.join(_pair(w, 1, 2), _pair(w, 5, 2)), tl.join(_pair(w, 3, 2), _pair(w, 7, 2))))
        lo = pairs.to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (pairs >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        x = tl.reshape(tl.join(lo, hi), (valid.shape[0], F))  # (pair, half) flattens to code order
        if not BIASED:
            x = x - 1024.0
        return x
    byt = tl.load(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE), mask=valid[:, None], other=0)
    c = unpack_codes(byt, BITS)
    if DOT == tl.float16:
        x = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        if not BIASED:
            x = x - 1024.0
        return x
    return c.to(DOT)


@triton.jit
def code_bias(DOT: tl.constexpr):
    """The offset :func:`codes` leaves on key codes: 1024 for fp16 operands, 0 otherwise."""
    if DOT == tl.float16:
        return 1024.0
    return 0.0


@triton.jit
def scale_min(pool, page, row, valid, MOFF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``(scale, min)`` fp32 ``[N]`` of a one-group side: one 4-byte vector load per token."""
    p16 = pool.to(tl.pointer_type(tl.float16))
    pair = tl.load(p16 + meta_index(page, row, MOFF, 1, PAGE_SIZE)[:, None] + tl.arange(0, 2)[None, :],
                   mask=valid[:, None], other=0.0)
    return tl.split(pair.to(tl.float32))


@triton.jit
def side_tile(pool, page, row, valid, OFF: tl.constexpr, MOFF: tl.constexpr, BITS: tl.constexpr,
               TIER: tl.constexpr, F: tl.constexpr, DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK: tl.constexpr, DOT: tl.constexpr, BIASED: tl.constexpr, PERM: tl.constexpr):
    """One side (K or V) of a slot tile as ``(x [BLOCK, F] DOT, scale [BLOCK], min [BLOCK])``.

    A quantized side with one group per token keeps its scale ``s`` and min ``m`` out of the
    element path (LeanKV Eq. (2) applied after the matmul): ``x`` is the raw codes (plus the fp16
    bias of :func:`codes` when ``BIASED``) and the caller applies ``s`` and ``m`` per key. Any
    other side (dense, or several groups per token) is dequantized in registers and returned
    with ``s = 1``, ``m = 0``.
    """
    if BITS < 16 and TIER.NG == 1:
        x = codes(pool, page, row, valid, OFF, BITS, F, PAGE_SIZE, DOT, BIASED, PERM)
        sc, mn = scale_min(pool, page, row, valid, MOFF, PAGE_SIZE)
        if BIASED:
            mn = mn - code_bias(DOT) * sc  # codes arrive as c + bias
    else:
        x = load_side(pool, page, row, valid, OFF, MOFF, BITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK).to(DOT)
        sc = tl.full([BLOCK], 1.0, tl.float32)
        mn = tl.zeros([BLOCK], tl.float32)
    return x, sc, mn
