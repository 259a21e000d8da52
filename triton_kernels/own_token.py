"""A decode step's own token, attended exactly and merged into the paged attention, in one launch.

In a decode step each query also sees its own new key, exactly as the model produced it (never
its stored codes; as HF ``QuantizedCache`` and the LeanKV paper's prefill do). With one new key
per row that attention has a closed form (:func:`leankit.attention.step_attention`): the logit
``s = q . k * scale`` is its log-sum-exp, and its output is ``v``. It then merges with the paged
attention over the earlier tokens by log-sum-exp (:func:`leankit.attention.merge_attention`, the
flash-decoding split merge):

    m = max(lse_old, s),  w_old = e^(lse_old - m),  w_new = e^(s - m)
    out = (w_old out_old + w_new v) / (w_old + w_new),  lse = m + log(w_old + w_new)

(computed in base 2, as the decode kernels' softmax, with the same logit and score helpers
:func:`own_logit` and :func:`own_received` that the decode launch uses when it takes the own token
itself: :func:`leankit_kernels.paged_attention.decode_step_attention`)

and, for policies that track significance (LeanKV §4), the new token's initial score is the
probability its own queries give it under their final softmax, averaged over the ``G`` query heads
of its KV head: ``received = real * sum_g e^(s_g - lse_g) / G``.

As torch ops that is about 20 small kernels per layer (35 with the significance); on a GPU each is
a launch of a few microseconds around a few hundred bytes of work, more than the paged decode
kernel itself takes at short contexts. ``_own_token_kernel`` does it in one: one program per
(sequence, KV head) reads the group's ``G`` query rows, the new key and value, and the paged
output and lse of those rows, and writes the merged output, lse and score.

Reads per program: ``G x F`` query and paged-output elements, ``2 F`` new K/V elements, ``G``
lse values; writes ``G x F + G + 1`` values. No host sync: every size comes from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tiles
from .tiles import LOG2E, kernel_for

LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(LOG2E)

__all__ = ["merge_own_token"]


@triton.jit
def own_logit(q_row, k_row, sm_scale, F, G: tl.constexpr, G_PAD: tl.constexpr, F_PAD: tl.constexpr,
              MASK_F: tl.constexpr):
    """Base-2 logit ``q . k * sm_scale`` ``[G_PAD]`` of each query row of a KV head's group (rows at
    ``q_row``, a ``[G_PAD, 1]`` pointer tile) for the step's own key (``F`` channels at ``k_row``,
    masked to them in a ``F_PAD`` tile when ``MASK_F``), in fp32 from the model's values; 0 on padded
    rows."""
    g = tl.arange(0, G_PAD)
    f = tl.arange(0, F_PAD)
    if MASK_F:
        fmask = f < F
        q = tl.load(q_row + f[None, :], mask=(g < G)[:, None] & fmask[None, :], other=0.0).to(tl.float32)
        k = tl.load(k_row + f, mask=fmask, other=0.0).to(tl.float32)
    else:
        q = tl.load(q_row + f[None, :], mask=(g < G)[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_row + f).to(tl.float32)
    return tl.sum(q * k[None, :], 1) * sm_scale


@triton.jit
def own_received(s, m, l, real_ptr, recv_ptr, G: tl.constexpr, G_PAD: tl.constexpr):
    """The new token's initial significance (LeanKV §4) from its base-2 logit ``s`` and its queries'
    final softmax (base-2 max ``m``, sum ``l`` relative to it): the probability they give it,
    averaged over the group, times the row's real flag: ``real * sum_g 2^(s_g - m_g) / l_g / G``."""
    g = tl.arange(0, G_PAD)
    p = tl.where(g < G, tl.exp2(s - m) / tl.maximum(l, 1e-30), 0.0)
    tl.store(recv_ptr, tl.load(real_ptr).to(tl.float32) * tl.sum(p, 0) / G)


@triton.jit
def _own_token_kernel(q_ptr, stride_qb, stride_qh, k_ptr, v_ptr, stride_kb, stride_kh, stride_vb, stride_vh,
                      old_ptr, stride_ob, stride_oh, lse_old_ptr, real_ptr, out_ptr, lse_ptr, recv_ptr, sm_scale,
                      HKV, F, G: tl.constexpr, G_PAD: tl.constexpr, F_PAD: tl.constexpr,
                      RECEIVED: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // HKV
    h = bh % HKV
    g = tl.arange(0, G_PAD)
    f = tl.arange(0, F_PAD)
    gmask = g < G
    fmask = f < F
    tile = gmask[:, None] & fmask[None, :]
    head = h * G + g  # query head of row g of this KV head's group
    # the new key's logit (base 2): its own attention's log-sum-exp (one key, probability 1, output v)
    s = own_logit(q_ptr + b * stride_qb + head[:, None] * stride_qh, k_ptr + b * stride_kb + h * stride_kh,
                  sm_scale, F, G, G_PAD, F_PAD, True)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + f, mask=fmask, other=0.0).to(tl.float32)
    lse_old = tl.load(lse_old_ptr + bh * G + g, mask=gmask, other=0.0) * _LOG2E
    m = tl.maximum(lse_old, s)
    m_safe = tl.where(tl.abs(m) < float("inf"), m, 0.0)  # rows that saw no key at all merge around 0
    w_old = tl.exp2(lse_old - m_safe)
    w_new = tl.exp2(s - m_safe)
    total = w_old + w_new
    norm = tl.maximum(total, 1e-30)
    old = tl.load(old_ptr + b * stride_ob + head[:, None] * stride_oh + f[None, :], mask=tile, other=0.0)
    out = old.to(tl.float32) * (w_old / norm)[:, None] + v[None, :] * (w_new / norm)[:, None]
    tl.store(out_ptr + (b * HKV * G + head[:, None]) * F + f[None, :], out.to(out_ptr.dtype.element_ty), mask=tile)
    tl.store(lse_ptr + bh * G + g, (m_safe + tl.log2(total)) * LN2, mask=gmask)
    if RECEIVED:
        own_received(s, m_safe, total, real_ptr + b, recv_ptr + bh, G, G_PAD)


def merge_own_token(query: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, out_old: torch.Tensor,
                    lse_old: torch.Tensor, real: torch.Tensor, scale: float, received: bool = False,
                    out_dtype: torch.dtype = torch.float32):
    """A decode step's exact attention to its own token, merged with the paged attention.

    Kernel mirror of ``merge_attention(out_old, lse_old, *step_attention(query, k_new, v_new, ...)[:2])``
    for one query per row (:mod:`leankit.attention`).

    Args:
        query: ``[B, Hq, 1, F]`` the step's queries (any strides, last dim contiguous).
        k_new, v_new: ``[B, Hkv, 1, F]`` the step's new keys and values as the model produced them.
        out_old: ``[B, 1, Hq, F]`` paged attention over the earlier tokens (0 where a row saw none).
        lse_old: ``[B, Hkv, G]`` its log-sum-exp (``-inf`` where a row saw no key).
        real: bool ``[B, 1]``: the row's token is real (only used for ``received``).
        scale: the softmax scale.
        received: also return each new token's initial significance.
        out_dtype: the output's dtype. The merge runs in fp32 and rounds once as it stores; the
            model's dtype here saves the caller a conversion launch.

    Returns:
        ``(out [B, 1, Hq, F] out_dtype, lse [B, Hkv, G] fp32, received [B, Hkv, 1] fp32 or None)``.
    """
    b, hq, nq, f = query.shape
    hkv = k_new.shape[1]
    if nq != 1 or k_new.shape[2] != 1 or v_new.shape[2] != 1:
        raise ValueError(f"merge_own_token serves one query and one new token per row, got query {tuple(query.shape)} "
                         f"and new keys {tuple(k_new.shape)}")
    # the kernel indexes every operand by (b, h, g, f) from the query's shape: a key, value or lse
    # of another shape would be read out of bounds instead of raising
    if hq % hkv or k_new.shape != (b, hkv, 1, f) or v_new.shape != (b, hkv, 1, f) \
            or out_old.shape != (b, 1, hq, f) or lse_old.shape[:2] != (b, hkv) or lse_old.numel() != b * hq:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, k_new {tuple(k_new.shape)}, "
                         f"v_new {tuple(v_new.shape)}, out_old {tuple(out_old.shape)}, lse_old {tuple(lse_old.shape)}")
    g = hq // hkv
    dev = query.device

    def rows(t):  # last dim contiguous, as the kernel indexes it
        return t if t.stride(-1) == 1 else t.contiguous()

    query, k_new, v_new, out_old = rows(query), rows(k_new), rows(v_new), rows(out_old)
    if lse_old.dtype != torch.float32 or lse_old.dim() != 3 or not lse_old.is_contiguous():
        lse_old = lse_old.to(torch.float32).reshape(b, hkv, g).contiguous()
    real = tiles.row_flags(real, b, dev)
    out = tiles.empty((b, 1, hq, f), dtype=out_dtype, device=dev)
    lse = tiles.empty((b, hkv, g), dtype=torch.float32, device=dev)
    recv = tiles.empty((b, hkv, 1), dtype=torch.float32, device=dev) if received else lse
    kernel_for(_own_token_kernel, dev)[(b * hkv,)](
        query, query.stride(0), query.stride(1), k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), out_old, out_old.stride(0), out_old.stride(2), lse_old, real, out, lse, recv,
        float(scale) * LOG2E, hkv, f, G=g, G_PAD=tiles.next_power_of_2(g), F_PAD=tiles.next_power_of_2(f),
        RECEIVED=received, num_warps=1)
    return out, lse, (recv if received else None)
