"""Shared Triton building blocks: reading tokens of a unified page as register tiles.

Every attention kernel of leankit reads the same thing: ``BLOCK_N`` consecutive *slots* of one
precision tier of one (sequence, KV head), turned into fp32 ``[BLOCK_N, F]`` key/value tiles.

Slot -> byte address (LeanKV §5.2, unified paging + bidirectional page table)::

    column  = slot // T            (high tier)      or  R - 1 - slot // T   (low tier)
    page    = tables[b, h, column]                  (int32, one row of R entries per head)
    row     = slot % T                              (token row inside the page)
    K data  = pool[page, K_OFF  + row * Kb : + Kb]   uint8 packed codes (or raw dense bytes)
    K meta  = pool[page, KM_OFF + row * 4G : + 4G]   G x (fp16 scale, fp16 min)
    V data / V meta likewise, position = int32 at POS_OFF + 4 * row, score = fp16 at SC_OFF + 2 * row

``T`` need not be a power of two (a K8V4 page of head_dim 64 holds 18 tokens), so a tile is a run
of *slots*, not of pages: it may straddle a page boundary, and ``page``/``row`` are computed per
token (``// T`` and ``% T`` by a constexpr compile to a multiply-shift). Inside a page a segment is
token-major and contiguous, so the ``[BLOCK_N, Kb]`` byte tile of one page is one contiguous run
of ``T * Kb`` bytes: whole-tile loads coalesce into 128-bit transactions (every segment starts on
a 16-byte boundary, see :mod:`leankit.pages`).

Packed codes are unpacked in registers: the ``[BLOCK_N, Kb]`` uint8 tile is split into its
``P = 8 / bits`` bit fields, which ``tl.interleave`` puts back in element order (element ``e`` =
byte ``e // P``, bit ``(e % P) * bits``: the little-endian packing of :mod:`leankit.quant`).
Dequantization is LeanKV Eq. (2) with ``z = -min``: ``x = s * Q + min`` per group.

Masking: only live slots are ever loaded (``mask=valid``, ``other=0``). Dead slots of a page
hold stale bytes (possibly NaN patterns); they never enter a register, so ``0 * NaN`` can never
reach an accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Positions loaded for dead slots: larger than any query position, so they are never visible.
POS_DEAD = 2**31 - 1

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch floating dtype (fp16, bf16, fp32)."""
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"leankit kernels support fp16, bf16 and fp32 tensors, got {dtype}") from None


def check_head_dim(f: int) -> None:
    """The kernels tile head_dim as one power-of-two block (Llama-family 64/128 heads)."""
    if f < 16 or f & (f - 1):
        raise ValueError(f"leankit Triton kernels need a power-of-two head_dim >= 16, got {f}; "
                         "use LEANKIT_BACKEND=torch for this model")


def tier_constexprs(layout, prefix: str) -> dict:
    """Compile-time description of one tier's page layout, keys prefixed by ``prefix``.

    ``T`` tokens per page, key/value bits, and the byte offset of each of the six segments.
    """
    p = layout.precision
    return {
        f"{prefix}T": layout.tokens,
        f"{prefix}KBITS": p.k_bits,
        f"{prefix}VBITS": p.v_bits,
        f"{prefix}KOFF": layout.offset("k_data"),
        f"{prefix}KMOFF": layout.offset("k_meta"),
        f"{prefix}VOFF": layout.offset("v_data"),
        f"{prefix}VMOFF": layout.offset("v_meta"),
        f"{prefix}SCOFF": layout.offset("score"),
        f"{prefix}POSOFF": layout.offset("position"),
    }


def dummy_tier_constexprs(prefix: str) -> dict:
    """Constexprs for an absent low tier (never executed: ``HAS_LOW=False``)."""
    return {f"{prefix}{k}": v for k, v in
            {"T": 1, "KBITS": 8, "VBITS": 8, "KOFF": 0, "KMOFF": 0, "VOFF": 0, "VMOFF": 0, "SCOFF": 0, "POSOFF": 0}.items()}


@triton.jit
def slot_pages(tab_row, slot, valid, R, T: tl.constexpr, LOW: tl.constexpr):
    """Page id (int64) and in-page row of each slot of one tier (bidirectional row, §5.2)."""
    pcol = slot // T
    if LOW:
        col = R - 1 - pcol
    else:
        col = pcol
    page = tl.load(tab_row + col, mask=valid, other=0).to(tl.int64)
    return page, slot % T


@triton.jit
def load_positions(pool, page, row, valid, POSOFF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """int32 positions ``[BLOCK_N]``; dead slots read as ``POS_DEAD`` (never visible)."""
    p32 = pool.to(tl.pointer_type(tl.int32))
    off = page * (PAGE_SIZE // 4) + POSOFF // 4 + row
    return tl.load(p32 + off, mask=valid, other=2147483647)


@triton.jit
def unpack_codes(byt, BITS: tl.constexpr):
    """uint8 ``[N, Kb]`` -> codes ``[N, Kb * 8 / BITS]`` (code ``e`` = byte ``e // P``, bits ``(e % P) * BITS``).

    Built from ``tl.interleave`` so the new minor dimension stays inside each thread's registers
    (no shared-memory shuffle): interleaving the sub-byte fields in bit-reversed order yields
    the little-endian element order of :func:`leankit.quant.pack`.
    """
    if BITS == 8:
        out = byt
    elif BITS == 4:
        out = tl.interleave(byt & 15, byt >> 4)
    elif BITS == 2:
        out = tl.interleave(tl.interleave(byt & 3, (byt >> 4) & 3), tl.interleave((byt >> 2) & 3, byt >> 6))
    else:
        e0 = tl.interleave(tl.interleave(byt & 1, (byt >> 4) & 1), tl.interleave((byt >> 2) & 1, (byt >> 6) & 1))
        e1 = tl.interleave(tl.interleave((byt >> 1) & 1, (byt >> 5) & 1), tl.interleave((byt >> 3) & 1, byt >> 7))
        out = tl.interleave(e0, e1)
    return out


@triton.jit
def load_side(pool, page, row, valid, OFF: tl.constexpr, MOFF: tl.constexpr, BITS: tl.constexpr,
              F: tl.constexpr, NG: tl.constexpr, DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Keys or values of ``BLOCK_N`` slots as fp32 ``[BLOCK_N, F]`` (0 for dead slots)."""
    f = tl.arange(0, F)
    if BITS >= 16:
        # Unquantized side: the raw model-dtype row (LeanKV keeps it lossless).
        ISZ: tl.constexpr = DENSE.primitive_bitwidth // 8
        pd = pool.to(tl.pointer_type(DENSE))
        base = page * (PAGE_SIZE // ISZ) + OFF // ISZ + row * F
        x = tl.load(pd + base[:, None] + f[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    else:
        KB: tl.constexpr = F * BITS // 8
        base = page * PAGE_SIZE + OFF + row * KB
        byt = tl.load(pool + base[:, None] + tl.arange(0, KB)[None, :], mask=valid[:, None], other=0)
        codes = unpack_codes(byt, BITS).to(tl.float32)
        p16 = pool.to(tl.pointer_type(tl.float16))
        mbase = page * (PAGE_SIZE // 2) + MOFF // 2 + row * (2 * NG)
        if NG == 1:
            scale = tl.load(p16 + mbase, mask=valid, other=0.0).to(tl.float32)[:, None]
            mn = tl.load(p16 + mbase + 1, mask=valid, other=0.0).to(tl.float32)[:, None]
        else:
            # Per-element group metadata: a broadcast gather of the token's 4G meta bytes (L1 hits).
            gidx = 2 * (f // (F // NG))
            scale = tl.load(p16 + mbase[:, None] + gidx[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            mn = tl.load(p16 + mbase[:, None] + gidx[None, :] + 1, mask=valid[:, None], other=0.0).to(tl.float32)
        # LeanKV Eq. (2): x_hat = s * Q - z, with z = -min.
        x = codes * scale + mn
    return x


# ---------------------------------------------------------------------------- launcher helpers
LOG2E = 1.4426950408889634

_INTERPRETED: dict = {}


def kernel_for(kernel, device: torch.device):
    """The kernel object to launch for tensors on ``device``.

    CUDA tensors get the compiled kernel. Anything else runs through Triton's interpreter, even
    when Triton was imported before ``TRITON_INTERPRET=1`` was set (``torch._dynamo`` imports it
    as soon as ``transformers`` loads a model, so ``LEANKIT_BACKEND=triton`` usually arrives too
    late for Triton's decoration-time switch): the kernel is re-wrapped as an interpreted
    function, and jit helpers it calls (leankit's and ``triton.language``'s) run interpreted too.
    """
    if device.type == "cuda":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    _interpret_device_calls()
    if isinstance(kernel, InterpretedFunction):
        return kernel
    if kernel not in _INTERPRETED:
        _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[kernel]


def _interpret_device_calls() -> None:
    """Make a compiled-mode ``@triton.jit`` helper callable from an interpreted kernel.

    Compiled kernels never go through ``JITFunction.__call__`` (the code generator inlines device
    calls), so routing it to the interpreter only affects interpreted launches.
    """
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction, "_leankit_interpreted_calls", False):
        return

    def __call__(self, *args, **kwargs):
        from triton.runtime.interpreter import InterpretedFunction

        fn = self.__dict__.get("_leankit_interpreted")
        if fn is None:
            fn = self.__dict__["_leankit_interpreted"] = InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    JITFunction.__call__ = __call__
    JITFunction._leankit_interpreted_calls = True


# When true, every output and scratch buffer a launcher allocates starts as NaN (floats) or a
# sentinel (ints), so a test sees any element a kernel forgot to write. Tests switch it on.
POISON = False


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; poisoned (NaN / ``-7777``) when :data:`POISON` is set."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(float("nan") if dtype.is_floating_point else -7777)
    return t


def dot_config(dtype: torch.dtype, device: torch.device | None = None):
    """``(operand dtype, input_precision)`` of the ``tl.dot`` calls for queries of ``dtype``.

    fp16/bf16 models feed tensor cores with 16-bit operands (fp32 accumulate). fp32 models keep
    fp32 operands with ``ieee`` precision, so an fp32 model's logits match the fp32 reference
    (TF32 would round keys to 10 mantissa bits). Off CUDA (Triton's interpreter, which multiplies
    bf16 tensors as their raw 16-bit integers) bf16 operands are widened to fp32 instead.
    """
    if dtype == torch.float16 or (dtype == torch.bfloat16 and device is not None and device.type == "cuda"):
        return tl_dtype(dtype), "tf32"
    return tl.float32, "ieee"


def layer_views(kv):
    """Per-layer views of the page table: ``(tables [B,H,R], n_pages [2,B,H], lens [2,B,H], tier_stride)``."""
    table, layer = kv.table, kv.layer
    tables = table.tables[layer]
    n_pages = table.n_pages[:, layer]
    lens = table.lens[:, layer]
    if not tables.is_contiguous() or n_pages.stride()[1:] != lens.stride()[1:] or n_pages.stride(2) != 1:
        raise ValueError("page-table tensors must be contiguous")
    assert n_pages.stride(0) == lens.stride(0)
    return tables, n_pages, lens, n_pages.stride(0)


def tier_args(layouts) -> dict:
    """Constexprs of both tiers (``H_*`` high, ``L_*`` low) plus the shared page geometry."""
    hi = layouts[0]
    out = {"F": hi.head_dim, "NG": hi.groups, "PAGE_SIZE": hi.page_size, "DENSE": tl_dtype(hi.dense_dtype),
               "HAS_LOW": len(layouts) > 1}
    out.update(tier_constexprs(hi, "H_"))
    out.update(tier_constexprs(layouts[1], "L_") if len(layouts) > 1 else dummy_tier_constexprs("L_"))
    return out


def page_counts(n_pages: torch.Tensor, has_low: bool) -> tuple[int, int, int]:
    """``(max high pages, max low pages, max total pages)`` over heads, with one host sync."""
    lo = n_pages[1] if has_low else torch.zeros_like(n_pages[0])
    stats = torch.stack([n_pages[0].max(), lo.max(), (n_pages[0] + lo).max()]) if n_pages[0].numel() else None
    if stats is None:
        return 0, 0, 0
    a, b, c = (int(x) for x in stats.tolist())
    return a, b, c
