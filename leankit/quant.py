"""Hetero-KV quantization: the plain-PyTorch reference.

This module is the single source of truth for leankit's quantized format; the Triton kernel in
``leankit_kernels.quant`` mirrors it bit for bit and is tested against it.

Format (per token, per KV head, per group of ``group_size`` channels along head_dim):

* asymmetric min-max quantization, LeanKV Eq. (2): ``s = (max - min) / (2^b - 1)``,
  ``z = -min``, ``Q = round((x + z) / s)``, and ``x_hat = s * Q - z``. leankit stores ``s`` and
  ``min`` (= ``-z``) in fp16, and quantizes with the *stored* (fp16-rounded) values so that the
  round-trip error bound holds for what is actually kept.
* a constant group has ``s = 0``; it stores ``Q = 0`` and dequantizes exactly to ``min`` (no NaN).
* codes are bit-packed little-endian into uint8: element ``e`` of a token lives in byte
  ``e // P`` at bit offset ``(e % P) * b``, with ``P = 8 / b`` codes per byte (2x4-bit, 4x2-bit,
  8x1-bit). 8-bit codes are the bytes themselves.
"""

from __future__ import annotations

import torch

META_DTYPE = torch.float16


class NonFiniteKVError(ValueError):
    """Raised when a key or value to be cached holds NaN or Inf."""


def check_finite(x: torch.Tensor, what: str = "KV") -> None:
    """Raise :class:`NonFiniteKVError` if ``x`` holds NaN/Inf, or values beyond fp16 range."""
    if not torch.isfinite(x).all():
        raise NonFiniteKVError(f"{what} states contain NaN or Inf; refusing to store them in the cache")


def codes_per_byte(bits: int) -> int:
    """Number of ``bits``-wide codes packed into one byte."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"packable bit widths are 1, 2, 4, 8; got {bits}")
    return 8 // bits


def pad_repeating(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` ``[..., F]`` widened to ``[..., width]`` by repeating channel 0: a quantization group that
    spans the row keeps its min and max, so the real channels get the codes an unpadded row gets
    (a head whose codes do not fill whole bytes, or that the Triton kernels cannot tile)."""
    pad = width - x.shape[-1]
    if pad <= 0:
        return x
    return torch.cat([x, x[..., :1].expand(*x.shape[:-1], pad)], -1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., F]`` (values < 2**bits) into uint8 ``[..., F * bits / 8]``."""
    p = codes_per_byte(bits)
    f = codes.shape[-1]
    if f % p:
        raise ValueError(f"last dim {f} is not a multiple of {p} codes per byte")
    if p == 1:
        return codes.to(torch.uint8)
    # Horner over the codes of each byte, highest first: byte = sum_i c_i 2^(i*bits). Exact in the
    # codes' own dtype (every partial value is an integer below 256), one pass over 1/p of the data
    # per code, with no widening to int32 and no shift tensor.
    c = codes.reshape(*codes.shape[:-1], f // p, p)
    acc = c[..., p - 1] * (1 << bits)
    for i in range(p - 2, 0, -1):
        acc.add_(c[..., i]).mul_(1 << bits)
    return acc.add_(c[..., 0]).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., Fb]`` -> int32 codes ``[..., Fb * 8 / bits]``."""
    p = codes_per_byte(bits)
    if p == 1:
        return packed.to(torch.int32)
    shifts = torch.arange(p, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * p)


# Smallest normal fp16 (2^-14): below it fp16 values are spaced 2^-24 apart, not relatively.
FP16_MIN_NORMAL = 2.0 ** -14


def round_scale_up_if_subnormal(step: torch.Tensor) -> torch.Tensor:
    """The fp16 scale of a quantization step ``step`` (fp32, ``(max - min16) / qmax``).

    Rounded to nearest, except where that lands below ``step`` in fp16's subnormal range, where it
    is taken one unit (2^-24) up. Why: in the normal range rounding moves the scale by at most
    2^-11 of itself, so the top code ``(max - min16) / scale`` rises by at most ``qmax * 2^-11``
    (< 0.5 for 8 bits) and never clamps; below 2^-14 the spacing is absolute, so a small group's
    scale rounded down could clamp its top codes by many steps, or round to 0 and dequantize the
    whole group to its minimum (8-bit codes of K/V near 1e-6 then erred far more than 4-bit ones).
    The native and Triton store kernels round the same way, bit for bit.
    """
    sc16 = step.to(META_DTYPE)
    rounded = sc16.float()
    up = (step > 0) & (rounded < step) & (rounded < FP16_MIN_NORMAL)
    return torch.where(up, (sc16.view(torch.int16) + 1).view(META_DTYPE), sc16)


def quantize(x: torch.Tensor, bits: int, group_size: int | None = None):
    """Quantize ``x`` ``[..., F]`` per group along the last dim.

    Returns ``(packed uint8 [..., F*bits/8], scale fp16 [..., G], minimum fp16 [..., G])`` with
    ``G = F / group_size``.
    """
    f = x.shape[-1]
    gs = group_size or f
    if f % gs:
        raise ValueError(f"group_size {gs} must divide the last dim {f}")
    xg = x.float().reshape(*x.shape[:-1], f // gs, gs)
    qmax = (1 << bits) - 1
    lo, hi = torch.aminmax(xg, dim=-1)
    # + 0 makes a zero minimum or scale +0: which zero aminmax picks from a group holding both is
    # unspecified (and a constant group's min may round above its max, its step to -0), and the
    # stored bytes must not depend on it (the kernels store +0 too)
    mn16 = lo.to(META_DTYPE).add_(0.0)
    # Scale from the stored minimum so that the largest element maps inside [0, qmax].
    step = (hi - mn16.float()) / qmax
    sc16 = round_scale_up_if_subnormal(step).add_(0.0)
    # One check on the stored scale covers the input and the stored min too: a NaN/Inf element
    # makes its group's min or max non-finite, and a non-finite min (NaN, or beyond the fp16
    # range) makes hi - min NaN or infinite, so the scale is then non-finite as well.
    if not torch.isfinite(sc16).all():
        check_finite(x)
        raise NonFiniteKVError("KV values exceed the fp16 range of the quantization metadata")
    sc = sc16.float().unsqueeze(-1)
    # A constant group (s = 0) divides by +inf: its codes are 0 (x - min is finite here).
    safe = torch.where(sc > 0, sc, torch.full((), float("inf"), device=sc.device))
    codes = torch.sub(xg, mn16.float().unsqueeze(-1)).div_(safe).round_().clamp_(0, qmax)
    return pack(codes.reshape(*x.shape), bits), sc16, mn16


def dequantize(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_hat = s * Q + min`` (LeanKV Eq. 2 with ``z = -min``)."""
    codes = unpack(packed, bits).float()
    g = scale.shape[-1]
    f = codes.shape[-1]
    codes = codes.reshape(*codes.shape[:-1], g, f // g)
    out = codes * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], f).to(dtype)


def error_bound(x: torch.Tensor, bits: int, group_size: int | None = None) -> torch.Tensor:
    """Worst-case absolute round-trip error per group of :func:`quantize` (for tests).

    Half a quantization step, plus the fp16 rounding of the stored scale accumulated over up to
    ``2**bits - 1`` steps and of the stored minimum: relative ``2^-11`` for normal fp16 values;
    near zero a scale rounded up by less than 2^-24 (:func:`round_scale_up_if_subnormal`) adds
    less than 2^-25 to the half step, and the minimum's rounding at most 2^-25.
    """
    f = x.shape[-1]
    gs = group_size or f
    xg = x.float().reshape(*x.shape[:-1], f // gs, gs)
    lo, hi = xg.amin(-1), xg.amax(-1)
    step = (hi - lo) / ((1 << bits) - 1)
    eps16 = 2.0 ** -11
    return step / 2 + eps16 * (hi.abs() + lo.abs()) * 2 + 2.0 ** -24
