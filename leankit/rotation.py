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
    return torch.matmul(x, h.to(x.dtype))


def unrotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x @ Hᵀ`` along the last dim (attention output back to the model's basis)."""
    return torch.matmul(x, h.to(x.dtype).transpose(-1, -2))


__all__ = ["block_size", "hadamard", "rotate", "unrotate"]
