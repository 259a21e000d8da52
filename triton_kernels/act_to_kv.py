"""Fused ACT -> KV recomputation (HybridServe §3.3 Eq. 1, CAPTURE, KVPR §3): one launch per layer and step.

For ``n`` tokens of one layer, from their stored input activations ``A`` ``[n, D]`` (the hidden
state before the layer's input norm), computes the post-RoPE keys and values the HF layer would
hand to ``Cache.update``::

    X     = norm(A)                        NORM = 1: RMSNorm (Llama, Qwen, Gemma3); 2: LayerNorm (OPT); 0: none
    K, V  = X Wk^T (+ bk), X Wv^T (+ bv)   tl.dot against the stacked [Wk; Wv] rows
    K     = k_norm(K)                      per-head RMSNorm (Qwen3, Gemma3), HAS_KNORM
    K     = K cos + rotate_half(K) sin     HAS_ROPE, at each token's own position

Reads
    ``a`` ``[n, D]`` (row stride ``stride_a``), model dtype;
    ``w`` ``[2 H F, D]`` stacked ``[Wk; Wv]`` (``nn.Linear`` layout, contiguous), ``b`` ``[2 H F]``;
    ``nw``/``nb`` ``[D]`` input-norm weight/bias, ``knw`` ``[F]`` k_norm weight (Gemma3: ``1 + w``
    in fp32, ``NORM_W32``);
    ``cos``/``sin`` ``[n, F / 2]`` RoPE tables in the model dtype (HF's ``cat(freqs, freqs)`` has two
    equal halves, so one half is passed; one table serves every layer of a step).
Writes
    ``k_out``, ``v_out`` ``[n, H, F]`` in the model dtype: the dense scratch tile attention reads.

Program ``(i, h)`` handles tokens ``i * BLOCK_M ..`` and KV head ``h``, both K and V: it first
reduces the norm statistics of its token rows over ``D`` (one pass for RMSNorm; mean then
variance for LayerNorm, two passes as ``F.layer_norm`` does), then walks ``D`` in ``BLOCK_K``
steps, normalizing the activation tile in registers and feeding it to three ``tl.dot`` calls:
the low and the high half of the head's K columns (kept apart so rotate-half is a register
operation: ``K_lo' = K_lo cos - K_hi sin``, ``K_hi' = K_hi cos + K_lo sin``) and the head's V
columns. The activation tile is re-read by each of the ``H`` head programs (from L2); the
weights, which dominate the bytes for decode, are read exactly once.

Rounding follows the HF layers: norm statistics in fp32, the normalized activation rounded to
the model dtype before the norm-weight product (after it with ``NORM_W32``, as Gemma's RMSNorm
does), the projection rounded to the model dtype before ``k_norm`` and RoPE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from leankit.recompute import ActToKVParams, check_act, rope_tables

from . import tiles
from .tiles import dot_config, kernel_for

NORM_CODES = {"none": 0, "rms": 1, "layer": 2}


@triton.jit
def _row_stats(a_ptr, stride_a, tok, valid, eps, D: tl.constexpr, NORM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-token ``(mean, rstd)`` of the input norm (mean is 0 for RMSNorm and for no norm)."""
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM != 0:
        rows = a_ptr + tok.to(tl.int64)[:, None] * stride_a
        if NORM == 2:
            s1 = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, D, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(rows + kk[None, :], mask=valid[:, None] & (kk[None, :] < D), other=0.0)
                s1 += tl.sum(x.to(tl.float32), 1)
            mean = s1 / D
        s2 = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            inside = valid[:, None] & (kk[None, :] < D)
            x = tl.load(rows + kk[None, :], mask=inside, other=0.0).to(tl.float32)
            xc = tl.where(inside, x - mean[:, None], 0.0)
            s2 += tl.sum(xc * xc, 1)
        rstd = 1.0 / tl.sqrt(s2 / D + eps)
    return mean, rstd


@triton.jit
def _act_to_kv_kernel(a_ptr, w_ptr, b_ptr, nw_ptr, nb_ptr, knw_ptr, cos_ptr, sin_ptr, k_out, v_out,
                      n, stride_a, eps, k_eps,
                      D: tl.constexpr, H: tl.constexpr, F: tl.constexpr, NORM: tl.constexpr,
                      NORM_W32: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KNORM: tl.constexpr, HAS_ROPE: tl.constexpr,
                      DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """K and V of ``BLOCK_M`` tokens for one KV head (grid: token blocks x heads)."""
    ADT = a_ptr.dtype.element_ty
    HALF: tl.constexpr = F // 2
    h = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = tok < n
    mean, rstd = _row_stats(a_ptr, stride_a, tok, valid, eps, D, NORM, BLOCK_M, BLOCK_K)

    c_lo = tl.arange(0, HALF)
    c_v = tl.arange(0, F)
    # Rows of the stacked weight: K head h at h * F, V head h at (H + h) * F.
    wk_lo = w_ptr + (h * F + c_lo).to(tl.int64)[None, :] * D
    wk_hi = wk_lo + HALF * D
    wv = w_ptr + ((H + h) * F + c_v).to(tl.int64)[None, :] * D
    rows = a_ptr + tok.to(tl.int64)[:, None] * stride_a
    k_lo = tl.zeros([BLOCK_M, HALF], tl.float32)
    k_hi = tl.zeros([BLOCK_M, HALF], tl.float32)
    v = tl.zeros([BLOCK_M, F], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kin = kk < D
        x = tl.load(rows + kk[None, :], mask=valid[:, None] & kin[None, :], other=0.0).to(tl.float32)
        if NORM == 1:
            nw = tl.load(nw_ptr + kk, mask=kin, other=0.0).to(tl.float32)
            if NORM_W32:  # Gemma: (x * rstd * (1 + w)) in fp32, then rounded (nw holds 1 + w)
                x = x * rstd[:, None] * nw[None, :]
            else:  # Llama: weight * (x * rstd) rounded to the model dtype first, as HF does
                x = (x * rstd[:, None]).to(ADT).to(tl.float32) * nw[None, :]
        elif NORM == 2:  # LayerNorm with affine weight and bias
            nw = tl.load(nw_ptr + kk, mask=kin, other=0.0).to(tl.float32)
            nb = tl.load(nb_ptr + kk, mask=kin, other=0.0).to(tl.float32)
            x = (x - mean[:, None]) * rstd[:, None] * nw[None, :] + nb[None, :]
        xd = x.to(ADT).to(DOT)
        kmask = kin[:, None]
        w_lo = tl.load(wk_lo + kk[:, None], mask=kmask, other=0.0).to(DOT)
        k_lo += tl.dot(xd, w_lo, input_precision=PREC)
        w_hi = tl.load(wk_hi + kk[:, None], mask=kmask, other=0.0).to(DOT)
        k_hi += tl.dot(xd, w_hi, input_precision=PREC)
        w_v = tl.load(wv + kk[:, None], mask=kmask, other=0.0).to(DOT)
        v += tl.dot(xd, w_v, input_precision=PREC)

    if HAS_BIAS:
        k_lo += tl.load(b_ptr + h * F + c_lo).to(tl.float32)[None, :]
        k_hi += tl.load(b_ptr + h * F + HALF + c_lo).to(tl.float32)[None, :]
        v += tl.load(b_ptr + (H + h) * F + c_v).to(tl.float32)[None, :]
    # The projection's output is a model-dtype tensor in HF.
    k_lo = k_lo.to(ADT).to(tl.float32)
    k_hi = k_hi.to(ADT).to(tl.float32)
    if HAS_KNORM:  # per-head RMSNorm over all F channels of K (Qwen3, Gemma3), before RoPE
        kr = 1.0 / tl.sqrt((tl.sum(k_lo * k_lo, 1) + tl.sum(k_hi * k_hi, 1)) / F + k_eps)
        g_lo = tl.load(knw_ptr + c_lo).to(tl.float32)
        g_hi = tl.load(knw_ptr + HALF + c_lo).to(tl.float32)
        if NORM_W32:  # Gemma's order, as for the input norm
            k_lo = (k_lo * kr[:, None] * g_lo[None, :]).to(ADT).to(tl.float32)
            k_hi = (k_hi * kr[:, None] * g_hi[None, :]).to(ADT).to(tl.float32)
        else:
            k_lo = ((k_lo * kr[:, None]).to(ADT).to(tl.float32) * g_lo[None, :]).to(ADT).to(tl.float32)
            k_hi = ((k_hi * kr[:, None]).to(ADT).to(tl.float32) * g_hi[None, :]).to(ADT).to(tl.float32)
    if HAS_ROPE:  # rotate-half RoPE at each token's own position
        t_off = tok.to(tl.int64)[:, None] * HALF + c_lo[None, :]
        cs = tl.load(cos_ptr + t_off, mask=valid[:, None], other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + t_off, mask=valid[:, None], other=0.0).to(tl.float32)
        lo = k_lo * cs - k_hi * sn
        k_hi = k_hi * cs + k_lo * sn
        k_lo = lo
    out = tok.to(tl.int64)[:, None] * (H * F) + h * F
    tl.store(k_out + out + c_lo[None, :], k_lo.to(ADT), mask=valid[:, None])
    tl.store(k_out + out + HALF + c_lo[None, :], k_hi.to(ADT), mask=valid[:, None])
    tl.store(v_out + out + c_v[None, :], v.to(ADT), mask=valid[:, None])


BLOCK_M = 16  # tl.dot's smallest M: decode steps have few tokens per layer


def act_block_k(head_dim: int) -> int:
    """``D`` step of the GEMM loop: keeps the three weight tiles at ``BLOCK_K x 2F`` elements."""
    return 64 if head_dim <= 64 else 32


def act_kernel_tiles(f: int) -> bool:
    """Whether the kernel tiles heads of ``f`` channels: each half of a head is one ``tl.dot``
    operand, so a power-of-two head_dim >= 32."""
    return f >= 32 and not f & (f - 1)


def check_act_head_dim(f: int) -> None:
    """Raise ``ValueError`` unless :func:`act_kernel_tiles` holds for ``f``."""
    if not act_kernel_tiles(f):
        raise ValueError(f"the act_to_kv kernel needs a power-of-two head_dim >= 32, got {f}; "
                         "use LEANKIT_BACKEND=torch (leankit.recompute.act_to_kv_ref) for this model")


def kernel_constexprs(params: ActToKVParams) -> dict:
    """Compile-time constants of one layer (shared with the AOT script)."""
    dot, prec = dot_config(params.dtype, params.weight.device)
    return {"D": params.hidden_size, "H": params.num_kv_heads, "F": params.head_dim,
            "NORM": NORM_CODES[params.norm], "NORM_W32": params.norm_weight_fp32, "HAS_BIAS": params.bias is not None,
            "HAS_KNORM": params.k_norm_weight is not None, "HAS_ROPE": params.has_rope,
            "DOT": dot, "PREC": prec, "BLOCK_M": BLOCK_M, "BLOCK_K": act_block_k(params.head_dim)}


def act_to_kv(act: torch.Tensor, positions: torch.Tensor | None, params: ActToKVParams,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Post-RoPE ``K, V`` ``[n, Hkv, F]`` from layer inputs ``act`` ``[n, D]`` in one launch.

    The kernel mirror of :func:`leankit.recompute.act_to_kv_ref` (same arguments). ``rope``
    may pass precomputed :func:`leankit.recompute.rope_tables` to share them across layers.

    Raises:
        ValueError: shapes, dtypes or devices that do not match the layer, or a head_dim the
            kernel does not tile.
    """
    check_act(act, positions, params)
    check_act_head_dim(params.head_dim)
    if not params.rotates_whole_head:
        raise ValueError(f"the act_to_kv kernel rotates whole heads; this layer rotates {params.rotary_dim} of "
                         f"{params.head_dim} channels (leankit.recompute.act_to_kv takes the reference for it)")
    dev = act.device
    tensors = [params.weight, params.bias, params.norm_weight, params.norm_bias, params.k_norm_weight]
    if any(t is not None and t.device != dev for t in tensors):
        raise ValueError(f"act is on {dev} but the layer parameters are not")
    n, h, f = act.shape[0], params.num_kv_heads, params.head_dim
    k = tiles.empty((n, h, f), act.dtype, dev)
    v = tiles.empty((n, h, f), act.dtype, dev)
    if n == 0:
        return k, v
    if act.stride(-1) != 1:
        act = act.contiguous()
    w = params.weight if params.weight.is_contiguous() else params.weight.contiguous()
    if params.has_rope:
        cos, sin = rope if rope is not None else rope_tables(params, positions.to(dev), act.dtype)
        if cos.shape != (n, f // 2) or sin.shape != (n, f // 2):
            raise ValueError(f"rope tables must be [n={n}, {f // 2}], got {tuple(cos.shape)}")
        cos, sin = cos.to(dev, act.dtype).contiguous(), sin.to(dev, act.dtype).contiguous()
    else:
        cos = sin = act  # never read
    # the kernel reads each vector parameter at ptr + i (a strided view is read as its storage)
    bias, norm_w, norm_b, k_norm_w = (w if t is None else t.contiguous() for t in tensors[1:])
    consts = kernel_constexprs(params)
    grid = (tiles.cdiv(n, BLOCK_M), h)
    kernel_for(_act_to_kv_kernel, dev)[grid](
        act, w, bias, norm_w, norm_b, k_norm_w,
        cos, sin, k, v, n, act.stride(0), float(params.norm_eps), float(params.k_norm_eps),
        num_warps=4, **consts)
    return k, v
