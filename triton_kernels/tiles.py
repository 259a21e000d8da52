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

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Positions loaded for dead slots: larger than any query position, so they are never visible.
POS_DEAD = 2**31 - 1

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host integers. Launchers size grids with it: ``triton.cdiv`` is a
    constexpr function on newer Triton, and a call from Python costs microseconds of argument
    unwrapping, several per launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for host integers ``n >= 0`` (0 for 0, as Triton's), see
    :func:`cdiv`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch floating dtype (fp16, bf16, fp32)."""
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"leankit kernels support fp16, bf16 and fp32 tensors, got {dtype}") from None


MIN_HEAD_DIM = 16  # the K of one fp16 MMA: a smaller head_dim would not fill a tl.dot operand


def kernel_head_dim(f: int) -> int:
    """The head_dim the kernels tile for a model head of ``f`` channels: ``f`` itself when it is a
    power of two >= 16, else the next such power (``LeanCache`` pads such heads at its boundary)."""
    if f < 1:
        raise ValueError(f"head_dim must be positive, got {f}")
    return max(MIN_HEAD_DIM, next_power_of_2(f))


def check_head_dim(f: int) -> None:
    """The kernels tile head_dim as one power-of-two block (Llama-family 64/128 heads)."""
    if f in _TILED_HEAD_DIMS:  # every launcher checks, at every launch
        return
    if f != kernel_head_dim(f):
        raise ValueError(f"leankit Triton kernels need a power-of-two head_dim >= {MIN_HEAD_DIM}, got {f}; "
                         f"pad the heads to {kernel_head_dim(f)} (LeanCache does) or use LEANKIT_BACKEND=torch")
    _TILED_HEAD_DIMS.add(f)


_TILED_HEAD_DIMS: set = set()  # head_dims check_head_dim has passed


class Tier(NamedTuple):
    """Compile-time layout of one precision tier's pages, passed to the kernels as one ``tl.constexpr``.

    ``T`` tokens per page, key/value bits, ``NG`` quantization groups per token and side (a tier
    may use its own group size, see ``KVConfig.low_group_size``), and the byte offset of each of
    the six segments.
    """

    T: int
    NG: int
    KBITS: int
    VBITS: int
    KOFF: int
    KMOFF: int
    VOFF: int
    VMOFF: int
    SCOFF: int
    POSOFF: int


@functools.cache
def tier_constexprs(layout) -> Tier:
    """The :class:`Tier` of one page layout (memoized: launchers ask for it at every launch)."""
    p = layout.precision
    return Tier(T=layout.tokens, NG=layout.groups, KBITS=p.k_bits, VBITS=p.v_bits, KOFF=layout.offset("k_data"),
                KMOFF=layout.offset("k_meta"), VOFF=layout.offset("v_data"), VMOFF=layout.offset("v_meta"),
                SCOFF=layout.offset("score"), POSOFF=layout.offset("position"))


# Stands in for an absent low tier (never executed: ``HAS_LOW=False``).
NO_TIER = Tier(T=1, NG=1, KBITS=8, VBITS=8, KOFF=0, KMOFF=0, VOFF=0, VMOFF=0, SCOFF=0, POSOFF=0)


def page_constexprs(layout) -> dict:
    """Page geometry every tier of a cache shares: head_dim ``F``, page size, dense dtype."""
    return {"F": layout.head_dim, "PAGE_SIZE": layout.page_size,
            "DENSE": tl_dtype(layout.dense_dtype)}


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
def position_ptrs(pool, page, row, POSOFF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Pointers to the int32 position of each slot (``POS_OFF + 4 * row`` in its page)."""
    return pool.to(tl.pointer_type(tl.int32)) + page * (PAGE_SIZE // 4) + POSOFF // 4 + row


@triton.jit
def score_ptrs(pool, page, row, SCOFF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Pointers to the fp16 score of each slot (``SC_OFF + 2 * row`` in its page)."""
    return pool.to(tl.pointer_type(tl.float16)) + page * (PAGE_SIZE // 2) + SCOFF // 2 + row


@triton.jit
def load_positions(pool, page, row, valid, POSOFF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """int32 positions ``[BLOCK_N]``; dead slots read as ``POS_DEAD`` (never visible)."""
    return tl.load(position_ptrs(pool, page, row, POSOFF, PAGE_SIZE), mask=valid, other=2147483647)


@triton.jit
def slot_tile(pool, tab_row, start, n_live, R, TIER: tl.constexpr, LOW: tl.constexpr, PAGE_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Slots ``start .. start + BLOCK_N - 1`` of one tier: ``(slot, valid, page, row, position)``, where
    ``valid = slot < n_live`` and dead slots read position ``POS_DEAD``."""
    slot = start + tl.arange(0, BLOCK_N)
    valid = slot < n_live
    page, row = slot_pages(tab_row, slot, valid, R, TIER.T, LOW)
    return slot, valid, page, row, load_positions(pool, page, row, valid, TIER.POSOFF, PAGE_SIZE)


@triton.jit
def dense_ptrs(pool, page, row, OFF: tl.constexpr, F: tl.constexpr, DENSE: tl.constexpr,
               PAGE_SIZE: tl.constexpr):
    """``[N, F]`` pointers to the raw ``DENSE`` rows of an unquantized side's data segment at ``OFF``."""
    ISZ: tl.constexpr = DENSE.primitive_bitwidth // 8
    base = page * (PAGE_SIZE // ISZ) + OFF // ISZ + row * F
    return pool.to(tl.pointer_type(DENSE)) + base[:, None] + tl.arange(0, F)[None, :]


@triton.jit
def code_ptrs(pool, page, row, OFF: tl.constexpr, KB: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``[N, KB]`` pointers to the packed code bytes of a quantized side's data segment at ``OFF``."""
    base = page * PAGE_SIZE + OFF + row * KB
    return pool + base[:, None] + tl.arange(0, KB)[None, :]


@triton.jit
def meta_index(page, row, MOFF: tl.constexpr, NG: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``[N]`` fp16 index in the pool of each slot's first (scale, min) pair; group ``j`` is at ``+ 2 j``."""
    return page * (PAGE_SIZE // 2) + MOFF // 2 + row * (2 * NG)


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
        x = tl.load(dense_ptrs(pool, page, row, OFF, F, DENSE, PAGE_SIZE), mask=valid[:, None],
                    other=0.0).to(tl.float32)
    else:
        KB: tl.constexpr = F * BITS // 8
        byt = tl.load(code_ptrs(pool, page, row, OFF, KB, PAGE_SIZE), mask=valid[:, None], other=0)
        codes = unpack_codes(byt, BITS).to(tl.float32)
        p16 = pool.to(tl.pointer_type(tl.float16))
        mbase = meta_index(page, row, MOFF, NG, PAGE_SIZE)
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


# ---------------------------------------------------------------------------- attention steps
@triton.jit
def program_head(H):
    """``(bh, b, h)``: the (sequence, KV head) ``bh = b * H + h`` of a program (grid axis 0)."""
    bh = tl.program_id(0)
    return bh, bh // H, bh % H


@triton.jit
def tile_logits(q, qpos, kpos, pool, page, row, valid, sm_scale, TIER: tl.constexpr, F: tl.constexpr,
                DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT: tl.constexpr, PREC: tl.constexpr):
    """Base-2 logits ``q k^T * sm_scale`` ``[M, BLOCK_N]`` of one key tile of ``TIER``, ``-inf`` where the
    key's stored position is after the query's.

    ``qpos`` broadcasts against ``kpos[None, :]``: a scalar (decode: one query position for the
    whole group) or an ``[M, 1]`` column (prefill: one per query row).
    """
    k = load_side(pool, page, row, valid, TIER.KOFF, TIER.KMOFF, TIER.KBITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N)
    s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * sm_scale
    return tl.where(kpos[None, :] <= qpos, s, float("-inf"))


@triton.jit
def online_softmax_step(m, l, acc, s, pool, page, row, valid, TIER: tl.constexpr, F: tl.constexpr,
                        DENSE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step (FlashAttention, base 2): fold the logits tile ``s`` ``[M, BLOCK_N]``
    into the running max ``m`` and sum ``l`` ``[M]`` and the output ``acc`` ``[M, F]``, loading the
    tile's values for ``p v``. Rows that have seen no key yet keep ``m = -inf``, ``l = 0``."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    v = load_side(pool, page, row, valid, TIER.VOFF, TIER.VMOFF, TIER.VBITS, F, TIER.NG, DENSE, PAGE_SIZE, BLOCK_N)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    return m_new, l, acc


@triton.jit
def softmax_init(M: tl.constexpr, F: tl.constexpr):
    """Empty online-softmax state of ``M`` rows: ``(m = -inf, l = 0, acc = 0 [M, F])``, fp32."""
    return tl.full([M], float("-inf"), tl.float32), tl.zeros([M], tl.float32), tl.zeros([M, F], tl.float32)


@triton.jit
def softmax_merge(m, l, acc, ms, ls, a):
    """Merge the base-2 online-softmax state ``(ms, ls, a [M, F])`` of other keys into ``(m, l, acc)``
    (the flash-decoding split merge, :func:`leankit.attention.merge_attention`): both rescaled to
    the larger max; a side that saw no key (``-inf``) adds nothing."""
    m_new = tl.maximum(m, ms)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    beta = tl.exp2(ms - m_safe)
    return m_new, l * alpha + ls * beta, acc * alpha[:, None] + a * beta[:, None]


@triton.jit
def softmax_output(l, acc):
    """Normalized output rows ``acc / l``; 0 for a row that saw no key."""
    has = l > 0.0
    return tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)


@triton.jit
def softmax_lse(m, l):
    """Natural-log log-sum-exp of each row from its base-2 running max ``m`` and sum ``l``; ``-inf``
    for a row that saw no key."""
    has = l > 0.0
    return tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))


# ---------------------------------------------------------------------------- launcher helpers
LOG2E = 1.4426950408889634


def jit_options(dynamic: tuple = (), unaligned: tuple = ()) -> dict:
    """``triton.jit`` options for a kernel: ``dynamic`` integers are not specialized on (value
    classes), ``unaligned`` pointers not on their 16-byte alignment (where the Triton in use can
    leave it out; it only matters to wide vector loads, which those pointers never feed)."""
    import inspect

    opts = {"do_not_specialize": dynamic}
    if unaligned and "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        opts["do_not_specialize_on_alignment"] = unaligned
    return opts

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
    _scalar_loop_bounds()

    def __call__(self, *args, **kwargs):
        from triton.runtime.interpreter import InterpretedFunction

        fn = self.__dict__.get("_leankit_interpreted")
        if fn is None:
            fn = self.__dict__["_leankit_interpreted"] = InterpretedFunction(self.fn)
        return fn(*args, **kwargs)

    JITFunction.__call__ = __call__
    JITFunction._leankit_interpreted_calls = True


def _scalar_loop_bounds() -> None:
    """Let the interpreter use a runtime scalar (a kernel argument, a loaded count) as a loop bound
    on every supported Triton.

    The interpreter holds scalars as 1-element numpy arrays. Triton 3.6's interpreter converts a
    loop bound with ``int(array)``, which numpy >= 2.4 refuses for arrays of one element that are
    not 0-d (``only 0-dimensional arrays can be converted``); later Triton squeezes first. The
    interpreter re-installs ``tensor.__index__`` at every launch, so the hook that installs it is
    wrapped to put the squeezing conversion back. A no-op where the hook does not exist.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_leankit_scalar_index", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patch_lang_tensor._leankit_scalar_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


# When true, every output and scratch buffer a launcher allocates starts as NaN (floats) or a
# sentinel (ints), so a test sees any element a kernel forgot to write. Tests switch it on.
POISON = False


def flag_bytes(flags: torch.Tensor) -> torch.Tensor:
    """Flags as a kernel reads them (one element per flag, tested ``!= 0``): a bool tensor viewed
    as its bytes, with no conversion launch; any other dtype as it is."""
    if flags.dtype != torch.bool:
        return flags
    last = _LAST_FLAGS
    if last[0] is flags:  # the step's flags go to several launches in every layer: one view of them
        return last[1]
    view = flags.view(torch.uint8)
    _LAST_FLAGS[:] = [flags, view]
    return view


_LAST_FLAGS: list = [None, None]  # [the flags last viewed, their byte view]


def row_flags(flags: torch.Tensor, rows: int, device) -> torch.Tensor:
    """One flag per row as a kernel reads them, row ``b``'s at element ``b`` (:func:`flag_bytes`):
    the first flag of each row of ``flags`` (``[rows]`` or ``[rows, n]``) on ``device``, copied only
    when it is not already laid out that way."""
    if flags.numel() != rows or not flags.is_contiguous() or flags.device != device:
        flags = flags.reshape(rows, -1)[:, 0].to(device).contiguous()
    return flag_bytes(flags)


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; poisoned when :data:`POISON` is set: NaN for floats, True
    for bools, and for integers ``-7777``, or where that does not fit the type's most negative value
    (its largest for an unsigned type)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        elif dtype == torch.bool:
            t.fill_(True)
        else:
            info = torch.iinfo(dtype)
            t.fill_(max(-7777, info.min) if info.min < 0 else info.max)
    return t


def unused_buffer(device) -> torch.Tensor:
    """A one-element fp32 tensor on ``device`` for a pointer argument the launched variant never
    dereferences (a constexpr switches its use off); one per device, not one allocation per launch."""
    buf = _UNUSED.get(device)
    if buf is None:
        buf = _UNUSED[device] = torch.empty(1, dtype=torch.float32, device=device)
    return buf


_UNUSED: dict = {}


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
    """Per-layer views of the page table: ``(tables [B,H,R], n_pages [2,B,H], lens [2,B,H], tier_stride)``.

    The views come from the table's own memo (:meth:`leankit.page_table.BidirectionalPageTable.layer_views`),
    so a decode step does not slice the same three tensors again in every launcher of every layer."""
    views = kv.table.layer_views(kv.layer)
    tables, n_pages, lens = views.tables, views.n_pages, views.lens
    if not tables.is_contiguous() or n_pages.stride()[1:] != lens.stride()[1:] or n_pages.stride(2) != 1:
        raise ValueError("page-table tensors must be contiguous")
    assert n_pages.stride(0) == lens.stride(0)
    return tables, n_pages, lens, n_pages.stride(0)


def tier_args(layouts) -> dict:
    """Constexprs of both tiers (``HI`` high, ``LO`` low, a :class:`Tier` each) and the page geometry.

    Computed once per layouts tuple (a cache's layouts never change): every launch asks for them.
    The dict is shared; callers must not modify it.
    """
    args = _TIER_ARGS.get(layouts)
    if args is None:
        two = len(layouts) > 1
        args = _TIER_ARGS[layouts] = dict(page_constexprs(layouts[0]), HAS_LOW=two, HI=tier_constexprs(layouts[0]),
                                          LO=tier_constexprs(layouts[1]) if two else NO_TIER)
    return args


_TIER_ARGS: dict = {}


def layer_launch(q: torch.Tensor, kv):
    """The start every attention launcher shares, for ``q`` ``[B, Hq, Q, F]`` over the layer ``kv``.

    Checks the head_dim and gives ``q`` a contiguous last dim (the kernels take its other strides).
    Returns ``(q, tables, n_pages, lens, tier_stride, G, tier constexprs)``: the page-table views of
    :func:`layer_views`, the GQA group size ``G = Hq / Hkv`` and :func:`tier_args`.
    """
    check_head_dim(q.shape[-1])
    tables, n_pages, lens, stride_tier = layer_views(kv)
    # Shapes only (host ints, no device read): the kernels index the pages and the output by them,
    # so a query the layer cannot serve would read or write out of bounds instead of raising.
    batch, kv_heads = tables.shape[0], tables.shape[1]
    if q.dim() != 4 or q.shape[0] != batch or q.shape[1] < kv_heads or q.shape[1] % kv_heads \
            or q.shape[-1] != kv.layouts[0].head_dim:
        raise ValueError(f"query {list(q.shape)} does not fit this layer's pages: it needs [batch={batch}, a "
                         f"multiple of the {kv_heads} KV heads, Q, head_dim={kv.layouts[0].head_dim}]")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q, tables, n_pages, lens, stride_tier, q.shape[1] // kv_heads, tier_args(kv.layouts)


def page_counts(n_pages: torch.Tensor, has_low: bool) -> tuple[int, int, int, int]:
    """``(max high pages, max low pages, max total pages, pages of all heads)`` of a layer, with one
    host sync."""
    lo = n_pages[1] if has_low else torch.zeros_like(n_pages[0])
    if not n_pages[0].numel():
        return 0, 0, 0, 0
    tot = n_pages[0] + lo
    stats = torch.stack([n_pages[0].max(), lo.max(), tot.max(), tot.sum()])
    a, b, c, d = (int(x) for x in stats.tolist())
    return a, b, c, d
