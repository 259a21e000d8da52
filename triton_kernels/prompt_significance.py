"""Prompt-phase significance over a prompt's own exact keys (LeanKV §4, prompt phase).

A prompt (a step with nothing stored before it) is attended by transformers' SDPA, so its output
is what an uncompressed cache computes. LeanKV's policies also need each prompt token's
significance: the attention probability it receives from the prompt's live queries,
``sum_i p_ij`` with ``p_ij = exp(s_ij - lse_i)``, averaged over the ``G`` query heads of its KV
group. SDPA on a GPU returns no ``lse``, and the torch pass
(:func:`leankit.attention.step_received`) runs per chunk of queries, a loop of small launches on a
GPU. These two kernels compute it in two launches with no ``Q x Q`` matrix in memory.

Reads
    ``q`` ``[B, Hq, Q, F]`` and ``k`` ``[B, Hkv, Q, F]`` (any strides, last dim contiguous; query
    head ``h * G + g`` belongs to KV head ``h``), ``q_pos`` int32 ``[B, Q]``, ``k_real`` flags
    ``[B, Q]`` (a token is real: a key, and a query that counts).
Writes
    ``received`` fp32 ``[B, Hkv, Q]`` (0 for a padding token); scratch: the base-2 ``lse`` fp32
    ``[B, Hkv, G*Q]`` (row ``g * Q + i``).

Kernels
    ``_prompt_lse_kernel``: one program per (sequence, KV head, block of ``BLOCK_M`` query-major
    rows ``i * G + g``): the row's base-2 log-sum-exp over the keys it sees (key ``j`` is visible
    to query ``i`` iff ``j`` is real and ``pos_j <= pos_i``) by an online max and sum, with no
    value side. The loop stops after the last real key any query of the block can see (a pass over
    the int32 positions first), so a causal prompt reads about half the key tiles.
    ``_prompt_received_kernel``: one program per (sequence, KV head, tile of ``BLOCK_N`` keys): the
    K tile stays in registers while the group's query rows stream past it from the first row block
    with a query at or after the tile's earliest key, ``p = exp2(s - lse)`` is recomputed with the
    first pass's ``lse`` and summed over the live rows (the same two-pass structure as the paged
    significance pass, :mod:`leankit_kernels.prefill_attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tiles
from .prefill_attention import _first_row, _query_rows, prefill_config, received_config
from .tiles import LOG2E, dot_config, kernel_for, program_head

__all__ = ["prompt_received", "prompt_received_ref"]

# The prompt length changes from call to call: one compile serves every length. The strides stay
# specialized (model shapes; their alignment lets the q and k rows load as 16-byte vectors).
DYNAMIC = ("H", "NQ")
# Read a few values a program.
UNALIGNED = ("pos_ptr", "real_ptr", "lse_ptr")


@triton.jit
def _load_rows(ptr, stride_b, stride_h, stride_t, b, h, t, tmask, F: tl.constexpr, F_PAD: tl.constexpr,
               DOT: tl.constexpr):
    """Rows ``ptr[b, h, t, :F]`` as a ``[len(t), F_PAD]`` tile of ``DOT`` (0 in padded columns and
    masked rows); ``h`` a scalar or a per-row vector."""
    f = tl.arange(0, F_PAD)
    rows = b.to(tl.int64) * stride_b + h * stride_h + t.to(tl.int64) * stride_t
    return tl.load(ptr + rows[:, None] + f[None, :], mask=tmask[:, None] & (f < F)[None, :], other=0.0).to(DOT)


@triton.jit
def _keys_end(pos_ptr, real_ptr, b, NQ, qmax, BLOCK: tl.constexpr):
    """One past the last real key at a position ``<= qmax`` (0 if none): keys after it are in the
    future of every query of the block. Reads only the ``NQ`` positions and flags."""
    end = 0
    for j0 in range(0, NQ, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        jm = j < NQ
        kp = tl.load(pos_ptr + b * NQ + j, mask=jm, other=0)
        kr = tl.load(real_ptr + b * NQ + j, mask=jm, other=0) != 0
        end = tl.maximum(end, tl.max(tl.where(kr & (kp <= qmax), j + 1, 0), 0))
    return end


@triton.jit(**tiles.jit_options(DYNAMIC, UNALIGNED))
def _prompt_lse_kernel(q_ptr, stride_qb, stride_qh, stride_qq, k_ptr, stride_kb, stride_kh, stride_kq,
                       pos_ptr, real_ptr, lse_ptr, H, NQ, sm_scale,
                       G: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """Base-2 log-sum-exp of one block of query-major rows over the keys each row sees."""
    bh, b, h = program_head(H)
    rmask, qi, g, qp = _query_rows(tl.program_id(1) * BLOCK_M, b, pos_ptr, NQ, NQ, G, BLOCK_M)
    q = _load_rows(q_ptr, stride_qb, stride_qh, stride_qq, b, h * G + g, qi, rmask, F, F_PAD, DOT)
    end = _keys_end(pos_ptr, real_ptr, b, NQ, tl.max(qp, 0), 4 * BLOCK_N)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < end
        kp = tl.load(pos_ptr + b * NQ + j, mask=jm, other=0)
        kr = tl.load(real_ptr + b * NQ + j, mask=jm, other=0) != 0
        k = _load_rows(k_ptr, stride_kb, stride_kh, stride_kq, b, h, j, jm, F, F_PAD, DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        s = tl.where(kr[None, :] & (kp[None, :] <= qp[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m = m_new
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + bh.to(tl.int64) * G * NQ + g * NQ + qi, lse, mask=rmask)


@triton.jit(**tiles.jit_options(DYNAMIC, UNALIGNED))
def _prompt_received_kernel(q_ptr, stride_qb, stride_qh, stride_qq, k_ptr, stride_kb, stride_kh, stride_kq,
                            pos_ptr, real_ptr, lse_ptr, out_ptr, H, NQ, sm_scale,
                            G: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """Probability one tile of keys received from the live query rows, averaged over the group."""
    bh, b, h = program_head(H)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    jm = j < NQ
    kp = tl.load(pos_ptr + b * NQ + j, mask=jm, other=0)
    kr = jm & (tl.load(real_ptr + b * NQ + j, mask=jm, other=0) != 0)
    kmin = tl.min(tl.where(kr, kp, 2147483647), 0)  # a tile with no real key skips every row block
    k = _load_rows(k_ptr, stride_kb, stride_kh, stride_kq, b, h, j, jm, F, F_PAD, DOT)
    got = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(_first_row(pos_ptr, b, NQ, NQ, kmin, G, BLOCK_M), NQ * G, BLOCK_M):
        rmask, qi, g, qp = _query_rows(r0, b, pos_ptr, NQ, NQ, G, BLOCK_M)
        live = rmask & (tl.load(real_ptr + b * NQ + qi, mask=rmask, other=0) != 0)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * G * NQ + g * NQ + qi, mask=live, other=0.0)
        q = _load_rows(q_ptr, stride_qb, stride_qh, stride_qq, b, h * G + g, qi, rmask, F, F_PAD, DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        vis = live[:, None] & kr[None, :] & (kp[None, :] <= qp[:, None])
        got += tl.sum(tl.where(vis, tl.exp2(s - lse[:, None]), 0.0), 0)
    tl.store(out_ptr + bh.to(tl.int64) * NQ + j, got / G, mask=jm)


def prompt_received(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_real: torch.Tensor, scale: float, *,
                    block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention probability each prompt token received from the prompt's live queries.

    Kernel mirror of :func:`leankit.attention.step_received` (either ``ordered``): ``q``
    ``[B, Hq, Q, F]``, ``k`` ``[B, Hkv, Q, F]`` the prompt's exact keys, ``q_pos`` int ``[B, Q]``,
    ``k_real`` bool ``[B, Q]``; returns fp32 ``[B, Hkv, Q]``, the sum over live queries of each
    token's probability, averaged over the ``G`` query heads of its KV head (LeanKV §4).
    ``block_m``/``block_n`` override both passes' tiles.
    """
    b, hq, nq, f = q.shape
    if k.shape[0] != b or k.shape[2] != nq or k.shape[3] != f or hq % k.shape[1]:
        raise ValueError(f"prompt_received: keys {tuple(k.shape)} do not match queries {tuple(q.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()  # rows are loaded as contiguous vectors
    k = (k if k.stride(-1) == 1 else k.contiguous()).to(q.dtype)
    hkv = k.shape[1]
    g = hq // hkv
    dev = q.device
    out = tiles.empty((b, hkv, nq), dtype=torch.float32, device=dev)
    if nq == 0 or b * hkv == 0:
        return out
    f_pad = tiles.kernel_head_dim(f)
    pos = q_pos.to(device=dev, dtype=torch.int32).reshape(b, nq).contiguous()
    real = tiles.flag_bytes(k_real.to(dev).reshape(b, nq).contiguous())
    lse = tiles.empty((b, hkv, g * nq), dtype=torch.float32, device=dev)
    dot_t, prec = dot_config(q.dtype, dev)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    args = (q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2), pos, real, lse)
    for kernel, cfg, grid_n, extra in (
            (_prompt_lse_kernel, prefill_config(f_pad, cap, dense=True, operand_bytes=dot_t.primitive_bitwidth // 8),
             lambda c: tiles.cdiv(g * nq, c["BLOCK_M"]), ()),
            (_prompt_received_kernel, received_config(f_pad, cap, operand_bytes=dot_t.primitive_bitwidth // 8),
             lambda c: tiles.cdiv(nq, c["BLOCK_N"]), (out,))):
        cfg["BLOCK_M"] = block_m or cfg["BLOCK_M"]
        cfg["BLOCK_N"] = block_n or cfg["BLOCK_N"]
        cfg.setdefault("PREC", prec)
        cfg.setdefault("num_stages", 2)
        kernel_for(kernel, dev)[(b * hkv, grid_n(cfg))](
            *args, *extra, hkv, nq, float(scale) * LOG2E, G=g, F=f, F_PAD=f_pad, DOT=dot_t, **cfg)
    return out


def prompt_received_ref(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_real: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The torch reference: :func:`leankit.attention.step_received`, computed in fp64 with an
    explicit softmax over each query's visible keys (no chunks, no floor)."""
    b, hq, nq, f = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # (f given, not -1: an empty prompt has no size to infer it from)
    s = torch.einsum("bhgqf,bhkf->bhgqk", q.double().reshape(b, hkv, g, nq, f), k.double()) * scale
    pos = q_pos.long().reshape(b, nq)
    real = k_real.bool().reshape(b, nq)
    vis = real[:, None, :] & (pos[:, None, :] <= pos[:, :, None])  # [B, Q(query), Q(key)]
    p = torch.softmax(s.masked_fill(~vis[:, None, None], float("-inf")), -1)
    p = torch.nan_to_num(p, nan=0.0) * real[:, None, None, :, None]  # only live queries count
    return (p.sum(3).sum(2) / g).float()
