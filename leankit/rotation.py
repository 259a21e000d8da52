"""Orthonormal Hadamard rotation of the head dimension before quantization (``rotate=1``).

This is not part of LeanKV. It is the incoherence processing of rotation-based quantizers
(QuaRot, QuIP#): keys and values are multiplied by an orthonormal Walsh-Hadamard matrix ``H``
(``H Hᵀ = I``) along head_dim before they are quantized, so that a few outlier channels no longer
set the min-max range of a whole group. Attention is unchanged in exact arithmetic:

* scores: ``(q H) · (k H)ᵀ = q kᵀ``, so the cache rotates each query the same way;
* output: ``softmax(·) (V H) = (softmax(·) V) H``, so the cache multiplies the output by ``Hᵀ``.

Everything the pages hold (codes, scale and minimum, Eq. 2) stays in the rotated basis, so the
page layout, byte model and kernels are untouched; only the three matmuls by ``H`` are added
(``[n, F] x [F, F]`` per stored token and per query).

On SmolLM2-135M (a 1k-token Wikipedia article, all 30 layers) the relative MSE of a per-token
4-bit key with one group of 64 falls from 0.0169 to 0.0074, of a 4-bit value from 0.0094 to
0.0079, and of a 2-bit value from 0.235 to 0.200 (``python -m eval.quant_error``). Keys gain most:
RoPE'd keys carry a few large channels, values are closer to isotropic.
"""

from __future__ import annotations

import functools
import math

import torch


def block_size(n: int) -> int:
    """Size of the Hadamard blocks that rotate a head of ``n`` channels: the largest power of two
    dividing ``n`` (``n`` itself when it is a power of two; 32 for 96, 16 for 80).

    Raises ``ValueError`` where that is 1 (an odd ``n``: the rotation would be the identity).
    """
    b = n & -n if n > 0 else 0
    if b < 2:
        raise ValueError(f"rotate=1 needs an even head_dim (Hadamard blocks of a power of two), got {n}")
    return b


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    b = block_size(n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    # A head_dim that is not a power of two (80, 96 ...) is rotated block by block: a block-diagonal
    # matrix of orthonormal blocks is orthonormal and symmetric too, and each block spreads an
    # outlier over its own b channels (which is what a quantization group of b channels sees).
    return torch.block_diag(*[h / b ** 0.5] * (n // b))


def hadamard(n: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal ``n x n`` Walsh-Hadamard rotation (symmetric, ``H @ H = I``).

    For a power-of-two ``n`` the Sylvester-Hadamard matrix; otherwise block-diagonal, with
    Sylvester blocks of :func:`block_size` channels. Raises ``ValueError`` for an odd ``n``.
    """
    return _hadamard_cpu(n).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last dim (keys, values and queries into the rotated basis)."""
    return torch.matmul(x, h if h.dtype == x.dtype else h.to(x.dtype))  # no conversion call per step


# Largest Sylvester block multiplied as one matmul by rotate_stored; wider blocks are split into
# halves (H_2n = [[H, H], [H, -H]]) so that no matmul sums more than this many products.
_STORED_BASE = 128


@functools.lru_cache(maxsize=32)
def _stored_matrix(n: int, factor: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One Sylvester block's ``+-1`` pattern (``n`` a power of two, at most :data:`_STORED_BASE`)
    times ``factor``, a power of two, so every entry and every product with it is exact."""
    return (_hadamard_cpu(n) * n ** 0.5).round().mul(factor).to(device=device, dtype=dtype)


def _power_of_two(f: float) -> bool:
    return math.frexp(f)[0] == 0.5


def _sylvester(x: torch.Tensor, b: int, m: torch.Tensor) -> torch.Tensor:
    """``x @ S_b`` over the last dim (``b`` a power of two): one matmul by ``m`` up to the base
    size, above it the two halves' transforms summed and differenced (fixed order, exact in shape)."""
    if b <= _STORED_BASE:
        return torch.matmul(x, m)
    z = _sylvester(x.unflatten(-1, (2, b // 2)), b // 2, m)
    return torch.cat((z[..., 0, :] + z[..., 1, :], z[..., 0, :] - z[..., 1, :]), -1)


def rotate_stored(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x @ H`` for keys and values about to be quantized: each row comes out the same however
    many rows are rotated together.

    :func:`rotate` does not give that in fp32 (16-bit tensors and head_dim 64 keep it: see below): a
    matmul's kernel changes with the number of rows (one row against a batch: whether products are fused
    into the sums, how a long sum is split), and with :func:`hadamard`'s inexact ``128 ** -0.5`` that
    moved the last bit of most outputs at head_dim 96 and 128 (and 256, 512) on a CPU. A last-bit
    difference moves a code by one step where a value sits at a rounding boundary, so a token's codes
    depended on the tokens its step brought, and differed from
    :func:`leankit.policy.stored_token_reference`, which rotates one token alone (the oracle tests then
    erred 1.5e-3 to 0.19 on some seeds). Here the matmul's products are exact (entries ``+-1``, or
    ``+-2^-k`` where the scale is a power of two, as at head_dim 64: the same bits as :func:`rotate`), the
    scale is one product after it, and no matmul sums more than 128 products (wider blocks split into
    halves, :func:`_sylvester`). The exact products still round in the sums, in the kernel's order, so
    every call is one 2-D product over at least two contiguous rows. ``h`` is :func:`hadamard`'s matrix
    (only its size is read). Queries are not quantized and keep :func:`rotate`.
    """
    n = h.shape[-1]
    # Every call is one 2-D matrix product over contiguous rows, of at least 2 rows: a strided
    # [B, H, Q, F] input became a batch of small products, and one row a matrix-vector product, and
    # both kernels sum a row's products in other orders than the matrix kernel (with MKL on an Intel
    # Xeon: the last bit of every output at head_dim 64 and 128, for one row alone). The few ops
    # around the product are what a decode step's call costs beside it, so none is spent on a no-op.
    rows = x.reshape(-1, n)
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat((rows, rows))
    elif not rows.is_contiguous():
        rows = rows.contiguous()
    b, scale, exact = _stored_plan(n)
    if x.dtype in (torch.float16, torch.bfloat16) or (exact and b == n and b <= _STORED_BASE):
        # a 16-bit result is one rounding of an fp32 sum (no row dependence seen at any width), and
        # exact entries in one matmul of one block are this very product: the same op and bits as rotate
        y = rotate(rows, h)
    else:
        # Block by block, each block halved down to the base (head_dim 96, 128, 256, 320, 384, 512 ...):
        # one matmul over a block-diagonal head (96, 320, 384) would sum n products, zeros included, and
        # at 320 or 384 the kernel's split of that sum changed with the number of rows.
        base = _stored_matrix(min(b, _STORED_BASE), scale if exact else 1.0, x.device, x.dtype)
        # one block (head_dim 128, 256 ...) goes in as the rows themselves, several as [rows, blocks, b]
        blocks = rows if b == n else rows.view(rows.shape[0], n // b, b)
        y = _sylvester(blocks, b, base)
        y = y if b == n else y.flatten(-2)
        if not exact:
            y.mul_(scale)  # the one rounding after the exact products (y is this call's own tensor)
    return (y if count > 1 else y[:1]).view_as(x)


@functools.lru_cache(maxsize=32)
def _stored_plan(n: int) -> tuple:
    """``(block, scale, exact)`` of :func:`rotate_stored` at head_dim ``n``: the Hadamard block size,
    its ``block ** -0.5`` and whether that is a power of two (then it goes into the entries)."""
    b = block_size(n)
    return b, b ** -0.5, _power_of_two(b ** -0.5)


def unrotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x @ Hᵀ`` along the last dim (attention output back to the model's basis)."""
    return torch.matmul(x, h.to(x.dtype).transpose(-1, -2))


__all__ = ["block_size", "hadamard", "rotate", "rotate_stored", "unrotate"]
