"""Quantized codes of a page tile as exact MMA operands, with scale and min kept out of the element path.

LeanKV Eq. (2) dequantizes ``x_hat = s Q + min`` per token and group. With one group per token the
attention kernels never form ``x_hat``: ``q . k_hat = s (q . Q) + min sum(q)`` and
``p @ v_hat = (p s) @ Q + p @ min``, so the ``[N, F]`` tile is the integer codes ``Q`` only, and
``s``/``min`` are applied to ``[N]`` vectors after the matmuls.

Codes reach the fp16 MMA operand a 32-bit word at a time: the fp16 bits ``x`` (exponent field 0)
are the subnormal number ``x 2^-24`` (exact for ``x < 2048``), so one mask turns two codes of a
word (one per 16-bit half) into one fp16 pair, with no per-code conversion. A code inside the 10
low bits of its half is masked where it lies and arrives as ``2^e c 2^-24`` (``e`` its bit
position, :func:`code_scale`); the codes above bit 10 get one shift per word. Tiles come out in a
permuted column order inside each word (:func:`key_order`): the caller loads the query in that
order divided by ``2^e`` (``q . k`` is a sum over columns), and values in that order fill
accumulator rows the caller divides by ``2^e`` and permutes back once per program. The unit
``2^-24`` (:func:`code_unit`) leaves after the matmuls as one exact power-of-two scale (folded
into the key scale, and into the accumulator's final scale for values).

Why subnormals and not the usual ``0x6400 | x = 1024 + x``: the offset would ride through the
MMA (``q' . (1024 + c) = 1024 sum(q') + q' . c``) and be subtracted after it, and the tensor
cores align and truncate the partial sums of the large ``1024 q'`` products, which costs the
``q' . c`` part about ten bits (1024 over a mean code of a few units). On an H200 that put the
4-bit-key and 2-bit-value decode at 3e-3 to 1e-2 of the output's scale, where the fp32
interpreter gave 1e-3. Subnormal codes carry no offset: the products are exact (fp16 x fp16
fits fp32) and the fp32 sums are of the signal alone.

The decode kernel's keys take an elementwise route instead (:func:`asm_key_bytes`,
:func:`key_nibbles`): their MMA contracts along head_dim, the direction the code bytes run, so
converting each loaded byte where it lies lets the compiler read the codes straight into the
operand's register layout, with no unpacked tile stored to shared memory and read back.
"""

import os

import triton
import triton.language as tl

from .tiles import code_ptrs, load_side, meta_index, unpack_codes

# Inline PTX runs on a GPU only: Triton's interpreter (and LEANKIT_INLINE_PTX=0) takes the
# plain-Triton path to the same fp16 values. tests/test_cuda_kernels.py (make gpu-check) checks the
# PTX path against the reference on a GPU.
# The predicates on constexprs below (nibble_keys, asm_key_bytes, word_unpack, code_unit) are
# triton.constexpr_function: Triton 3.6 (the oldest leankit supports) compiles the result of a
# @triton.jit helper to a tensor, which an `if` cannot test.
_ASM_ON = os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("LEANKIT_INLINE_PTX", "1") != "0"
_ASM = tl.constexpr(_ASM_ON)

# The PTX of the two conversions. Operands follow Triton's packing (pack=4): the four uint8 inputs
# share one 32-bit register (element i in byte i), listed after the outputs; each fp16 output
# takes two registers (elements 0-1, then 2-3, the lower element in the low half), the outputs
# one after the other. tests/test_kernel_codes_ptx.py runs both strings through an emulation of
# the PTX ISA's prmt / and, so the selectors and masks are checked on a CPU too.
BYTE_CODES_REGS = tl.constexpr("=r,=r,r")
BYTE_CODES_PTX = tl.constexpr("prmt.b32 $0, $2, 0, 0x4140;\n\tprmt.b32 $1, $2, 0, 0x4342;")
NIBBLES_REGS = tl.constexpr("=r,=r,=r,=r,r")
NIBBLES_PTX = tl.constexpr(
    "{\n\t.reg .b32 t0, t1;\n\t"
    "prmt.b32 t0, $4, 0, 0x4140;\n\tprmt.b32 t1, $4, 0, 0x4342;\n\t"
    "and.b32 $0, t0, 0x000F000F;\n\tand.b32 $1, t1, 0x000F000F;\n\t"
    "and.b32 $2, t0, 0x00F000F0;\n\tand.b32 $3, t1, 0x00F000F0;\n\t}")


@triton.jit
def _byte_codes_fp16(byt):
    """uint8 codes -> fp16 ``c 2^-24`` (:func:`code_unit`), elementwise (so the compiler converts on the
    MMA operand's own register layout). Four codes arrive in one 32-bit register, code ``i`` in
    byte ``i``; each ``prmt`` writes one fp16 pair: selector ``0x4140`` takes bytes (low to high)
    code 0, byte 4 (0 of the second source), code 1, byte 4 again, so the halves are ``0x00cc``,
    the subnormal ``c 2^-24``; ``0x4342`` does the same for codes 2 and 3."""
    return tl.inline_asm_elementwise(BYTE_CODES_PTX, BYTE_CODES_REGS, [byt], dtype=tl.float16, is_pure=True, pack=4)


@triton.constexpr_function
def nibble_keys(BITS: tl.constexpr, F: tl.constexpr, DOT: tl.constexpr):
    """Whether one-group 4-bit keys reach the MMA as two half-width operands, the low and the high
    nibbles of their bytes (:func:`key_nibbles`): features ``2j`` and ``2j + 1`` of a key are the
    two nibbles of its byte ``j`` (:func:`leankit.quant.pack`), so ``q . k`` is the even features'
    dot plus the odd ones', each an MMA over ``F / 2`` columns (at least the MMA's K of 16)."""
    return BITS == 4 and DOT == tl.float16 and F // 2 >= 16


@triton.jit
def _nibbles_fp16(byt):
    """uint8 ``[N, F/2]`` -> fp16 ``(lo 2^-24, 16 hi 2^-24)`` of each byte's nibbles, elementwise: one
    ``prmt`` per two bytes spreads them into the low bytes of fp16 halves (as in
    :func:`_byte_codes_fp16`), and one ``and`` per output pair keeps the low or the high nibble."""
    return tl.inline_asm_elementwise(NIBBLES_PTX, NIBBLES_REGS, [byt], dtype=(tl.float16, tl.float16), is_pure=True,
                                     pack=4)


@triton.jit
def key_nibbles(pool, page, row, valid, OFF: tl.constexpr, F: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """4-bit key codes of a slot tile as two fp16 MMA operands ``[N, F/2]``: the even features'
    codes as ``c 2^-24`` and the odd features' as ``16 c 2^-24`` (see :func:`nibble_keys`).
    Elementwise on the loaded bytes, so they convert in the operand's own register layout."""
    KB: tl.constexpr = F // 2
    byt = tl.load(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE), mask=valid[:, None], other=0)
    if _ASM:
        lo, hi = _nibbles_fp16(byt)
    else:
        lo, hi = _subnormal_fp16(byt & 15), _subnormal_fp16(byt & 240)
    return lo, hi


@triton.jit
def _subnormal_fp16(c):
    """Integer codes ``c < 2048`` as fp16 ``c 2^-24`` (:func:`code_unit`): the bits ``c`` themselves,
    a subnormal (or, from 1024, the smallest binade, whose ulp is the same), with no
    integer-to-float conversion."""
    return c.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _mpair(w, ws, k: tl.constexpr, BITS: tl.constexpr):
    """Codes ``k`` and ``k + 16 / BITS`` of each 32-bit word ``w`` (one per 16-bit half) as the bits of an
    fp16 pair ``2^e c 2^-24``, with no shift of their own: a code that lies inside the 10 low bits
    of its half is masked in place (one mask per pair), its position ``e`` scaling it by a power of
    two (:func:`code_scale`); the codes above bit 10 come from ``ws``, the word shifted once by
    ``10 // BITS`` codes, where they lie inside the low bits again (``2^e c < 1024``)."""
    DIRECT: tl.constexpr = 10 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if k < DIRECT:
        x = w & ((MASK << (k * BITS)) * 0x10001)
    else:
        x = ws & ((MASK << ((k - DIRECT) * BITS)) * 0x10001)
    return x


@triton.constexpr_function
def asm_key_bytes(BITS: tl.constexpr, DOT: tl.constexpr, KEYS: tl.constexpr):
    """Whether :func:`codes` turns a side's codes into fp16 with inline PTX, one byte per code
    (:func:`_byte_codes_fp16`): 8-bit keys on a GPU. The conversion is elementwise on ``[N, F]``,
    so the compiler converts the codes in the MMA operand's own register layout instead of
    storing the unpacked tile to shared memory and reading it back (K8V4 d128 on sm_90a: 920 ->
    798 SASS instructions per 126-token iteration). Values (the ``p @ v`` MMA's other operand)
    keep the word-level unpack, where this measured worse."""
    return bool(KEYS and BITS == 8 and DOT == tl.float16 and _ASM_ON)


@triton.jit
def code_scale(F: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr, KEYS: tl.constexpr):
    """Power of two ``2^e`` each column of a tile from :func:`codes` carries on its codes (fp32 ``[F]``, in
    the column order of :func:`key_order`): the word-level unpack leaves code
    ``c`` as ``2^e c`` units of :func:`code_unit` (:func:`_mpair`); every other path leaves 1. Key columns meet a query divided by it, value
    columns fill accumulator rows divided by it once per program (exact: powers of two)."""
    f = tl.arange(0, F)
    if KEYS and nibble_keys(BITS, F, DOT):
        return tl.where(f >= F // 2, 16.0, 1.0)
    if word_unpack(F, BITS, DOT) and not asm_key_bytes(BITS, DOT, KEYS):
        PER: tl.constexpr = 32 // BITS  # codes per word
        DIRECT: tl.constexpr = 10 // BITS
        k = (f % PER) // 2  # the column's code inside its 16-bit half
        e = tl.where(k < DIRECT, k, k - DIRECT) * BITS
        return (1 << e).to(tl.float32)
    return tl.full([F], 1.0, tl.float32)


@triton.jit
def key_order(F: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """Feature of each column of a key tile from :func:`codes` (the word-level unpack of keys
    permutes the codes inside each 32-bit word; every other path keeps feature order)."""
    f = tl.arange(0, F)
    if nibble_keys(BITS, F, DOT):  # the even features, then the odd ones (key_nibbles)
        return tl.where(f < F // 2, 2 * f, 2 * (f - F // 2) + 1)
    if word_unpack(F, BITS, DOT) and not asm_key_bytes(BITS, DOT, True):
        PER: tl.constexpr = 32 // BITS  # codes per word
        r = f % PER
        f = f - r + r // 2 + (r % 2) * (PER // 2)
    return f


@triton.constexpr_function
def word_unpack(F: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    """Whether :func:`codes` unpacks a side a 32-bit word at a time."""
    return DOT == tl.float16 and (F * BITS // 8) % 4 == 0 and BITS >= 2 and BITS <= 8


@triton.jit
def codes(pool, page, row, valid, OFF: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr,
          PAGE_SIZE: tl.constexpr, DOT: tl.constexpr, KEYS: tl.constexpr):
    """Integer codes ``[N, F]`` of a quantized side as exact ``DOT`` values (unpacked, not dequantized),
    in units of :func:`code_unit`: fp16 holds code ``c`` as the subnormal ``c 2^-24``, bf16 and fp32
    as ``c``. Where :func:`word_unpack` holds, the columns come in the order of :func:`key_order`,
    each scaled by :func:`code_scale`; elsewhere in feature order."""
    KB: tl.constexpr = F * BITS // 8
    if DOT != tl.float16:  # bf16 / fp32 operands hold the codes as they are (unit 1)
        x = unpack_codes(tl.load(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE), mask=valid[:, None], other=0),
                         BITS).to(DOT)
    elif word_unpack(F, BITS, DOT) and not asm_key_bytes(BITS, DOT, KEYS):
        # Word-level unpack: each 32-bit word of codes becomes fp16 pairs, one mask per pair
        # (plus one shift per word), so no code ever sits alone in a register.
        w32 = pool.to(tl.pointer_type(tl.uint32))
        base = (page * PAGE_SIZE + OFF + row * KB) // 4
        w = tl.load(w32 + base[:, None] + tl.arange(0, KB // 4)[None, :], mask=valid[:, None], other=0)
        # Any order inside a word will do: keys meet a query permuted to match, values fill output
        # columns the store puts back in feature order (key_order, code_scale give both).
        ws = w >> ((10 // BITS) * BITS)
        if BITS == 8:
            pairs = tl.join(_mpair(w, ws, 0, 8), _mpair(w, ws, 1, 8))
        elif BITS == 4:
            pairs = tl.join(tl.join(_mpair(w, ws, 0, 4), _mpair(w, ws, 2, 4)),
                            tl.join(_mpair(w, ws, 1, 4), _mpair(w, ws, 3, 4)))
        else:
            pairs = tl.join(tl.join(tl.join(_mpair(w, ws, 0, 2), _mpair(w, ws, 4, 2)),
                                    tl.join(_mpair(w, ws, 2, 2), _mpair(w, ws, 6, 2))),
                            tl.join(tl.join(_mpair(w, ws, 1, 2), _mpair(w, ws, 5, 2)),
                                    tl.join(_mpair(w, ws, 3, 2), _mpair(w, ws, 7, 2))))
        lo = pairs.to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (pairs >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        x = tl.reshape(tl.join(lo, hi), (valid.shape[0], F))  # (pair, half) flattens to code order
    elif asm_key_bytes(BITS, DOT, KEYS):
        x = _byte_codes_fp16(tl.load(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE), mask=valid[:, None], other=0))
    else:
        x = _subnormal_fp16(unpack_codes(tl.load(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE),
                                                 mask=valid[:, None], other=0), BITS))
    return x


@triton.constexpr_function
def code_unit(DOT: tl.constexpr):
    """The value of code 1 in a tile from :func:`codes`: ``2^-24`` for fp16 operands (subnormal codes),
    1 otherwise. Exact powers of two, so the matmul's result times ``1 / code_unit`` is exact."""
    if DOT == tl.float16:
        return 2.0 ** -24
    return 1.0


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
               BLOCK: tl.constexpr, DOT: tl.constexpr, KEYS: tl.constexpr):
    """One side (K or V) of a slot tile as ``(x [BLOCK, F] DOT, scale [BLOCK], min [BLOCK])``.

    A quantized side with one group per token keeps its scale ``s`` and min ``m`` out of the
    element path (LeanKV Eq. (2) applied after the matmul): ``x`` is the raw codes in units of
    :func:`code_unit`, with the power-of-two column scale of :func:`code_scale`, and the caller
    applies ``s`` and ``m`` per key and removes unit and scale. Any
    other side (dense, or several groups per token) is dequantized in registers and returned
    with ``s = 1``, ``m = 0``.
    """
    if BITS < 16 and TIER.NG == 1:
        x = codes(pool, page, row, valid, OFF, BITS, F, PAGE_SIZE, DOT, KEYS)
        sc, mn = scale_min(pool, page, row, valid, MOFF, PAGE_SIZE)
    else:
        x = load_side(pool, page, row, valid, OFF, MOFF, BITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK).to(DOT)
        sc = tl.full([BLOCK], 1.0, tl.float32)
        mn = tl.zeros([BLOCK], tl.float32)
    return x, sc, mn
