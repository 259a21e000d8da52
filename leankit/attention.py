"""Paged mixed-precision attention: the plain-PyTorch reference (and CPU backend).

Queries attend to the tokens stored in a layer's unified pages: first the high-tier pages
(walked from the left of the bidirectional row), then the low-tier pages (from the right), the
order LeanKV's kernel uses for load balance (§6.2). Pages are gathered and dequantized a chunk
at a time and combined with an online softmax, so no more than ``chunk_pages`` pages per head are
ever dequantized at once: the full-precision cache is never materialized.

Masking is by stored position, not by physical slot: key ``j`` is visible to query ``i`` iff it
is a live slot of its tier and ``pos[j] <= pos[i]``. That handles causality, left padding (pad
tokens are never stored) and pruning (a pruned token is simply gone) with one rule.

GQA: the ``G = Hq / Hkv`` query heads of a group are stacked into one ``[G * Q, F]`` operand, so
each dequantized K/V tile is shared by the whole group (as the Triton kernel does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .page_table import BidirectionalPageTable
from .pages import PageLayout, PagePool


@dataclass
class PagedKV:
    """Everything attention needs to read one layer's pages."""

    pool: PagePool
    layouts: tuple[PageLayout, ...]  # per tier: high, then low (if any)
    table: BidirectionalPageTable
    layer: int


def iter_tiles(kv: PagedKV, chunk_pages: int = 64, dtype: torch.dtype = torch.float32):
    """Yield dequantized tiles ``(tier, k, v, pos, valid, page_start)`` of a layer.

    ``k``/``v`` are ``[B, H, N, F]``, ``pos``/``valid`` ``[B, H, N]`` with ``N = pages x T``; slots
    past a tier's token count are ``valid = False``.
    """
    table, layer = kv.table, kv.layer
    for tier, layout in enumerate(kv.layouts):
        n_pages = table.n_pages[tier, layer]
        total = int(n_pages.max()) if n_pages.numel() else 0
        lens = table.lens[tier, layer]
        for start in range(0, total, chunk_pages):
            count = min(chunk_pages, total - start)
            ids, _ = table.tier_pages(tier, layer, start, count)
            pages = kv.pool.gather(ids)  # [B, H, P, page_size] bytes
            k, v, _, pos = layout.decode(pages, dtype)
            t = layout.tokens
            slot = torch.arange(start * t, (start + count) * t, device=ids.device)
            valid = slot.view(1, 1, -1) < lens.unsqueeze(-1)
            yield tier, k.flatten(2, 3), v.flatten(2, 3), pos.flatten(2, 3), valid, start


def _grouped_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, Q, F]`` -> ``[B, Hkv, G*Q, F]`` with query head ``h*G + g`` in group ``h``."""
    b, hq, nq, f = q.shape
    g = hq // num_kv_heads
    return q.reshape(b, num_kv_heads, g * nq, f)


def paged_attention_ref(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float,
                        chunk_pages: int = 64, query_chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, Hq, Q, F]`` over the layer's pages.

    Args:
        q_pos: int ``[B, Q]`` absolute positions of the queries (for the causal rule).
        scale: softmax scale (``head_dim ** -0.5`` for Llama).

    Returns:
        ``(out, lse)``: ``out`` is ``[B, Q, Hq, F]`` in ``q.dtype`` (the layout HF's attention
        functions return); ``lse`` is the fp32 log-sum-exp ``[B, Hkv, G*Q]`` of the scaled scores
        (``-inf`` for a query that sees no key, whose output is 0).
    """
    b, hq, nq, f = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    outs, lses = [], []
    for q0 in range(0, nq, query_chunk):
        qc = q[:, :, q0: q0 + query_chunk]
        nqc = qc.shape[2]
        qg = _grouped_queries(qc.float(), hkv)  # [B, Hkv, G*Qc, F]
        qp = q_pos[:, q0: q0 + nqc].to(torch.int32)
        qp = qp.view(b, 1, 1, nqc).expand(b, hkv, g, nqc).reshape(b, hkv, g * nqc)
        m = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros_like(qg)
        for _, k, v, pos, valid, _ in iter_tiles(kv, chunk_pages):
            s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G*Qc, N]
            visible = valid.unsqueeze(2) & (pos.unsqueeze(2) <= qp.unsqueeze(-1))
            s = s.masked_fill(~visible, float("-inf"))
            # Dead slots hold stale bytes (possibly NaN patterns): p = 0 there, but 0 * NaN = NaN.
            v = v.masked_fill(~valid.unsqueeze(-1), 0.0)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v)
            m = m_new
        out = torch.where(l_sum.unsqueeze(-1) > 0, acc / l_sum.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(acc))
        lses.append(torch.where(l_sum > 0, m + torch.log(l_sum.clamp_min(1e-30)), torch.full_like(m, float("-inf")))
                    .view(b, hkv, g, nqc))
        outs.append(out.view(b, hkv, g, nqc, f))
    out = torch.cat(outs, dim=3).reshape(b, hq, nq, f).transpose(1, 2).to(q.dtype)
    lse = torch.cat(lses, dim=3).reshape(b, hkv, g * nq)
    return out, lse


def received_attention_ref(q: torch.Tensor, kv: PagedKV, q_pos: torch.Tensor, scale: float, lse: torch.Tensor,
                           q_valid: torch.Tensor | None = None, chunk_pages: int = 64) -> list[torch.Tensor]:
    """Attention probability each stored token received from this step's queries (LeanKV §4).

    A second pass over the pages that reuses the log-sum-exp ``lse`` ``[B, Hkv, G*Q]`` saved by
    :func:`paged_attention_ref`, so no ``Q x N`` probability matrix is kept beyond one tile.

    Args:
        q_valid: bool ``[B, Q]``; queries where it is false (padding) contribute nothing.

    Returns:
        one fp32 tensor per tier, ``[B, Hkv, P_t * T_t]`` (slot order of the tier): the sum over
        the step's queries of ``p_ij``, averaged over the ``G`` query heads of the KV group.
        Dead slots hold 0.
    """
    b, hq, nq, f = q.shape
    hkv = kv.table.shape[2]
    g = hq // hkv
    qg = _grouped_queries(q.float(), hkv)
    qp = q_pos.to(torch.int32).view(b, 1, 1, nq).expand(b, hkv, g, nq).reshape(b, hkv, g * nq)
    live = torch.isfinite(lse)
    if q_valid is not None:
        live = live & q_valid.view(b, 1, 1, nq).expand(b, hkv, g, nq).reshape(b, hkv, g * nq)
    lse_safe = torch.where(live, lse, torch.zeros_like(lse))
    per_tier: list[list[torch.Tensor]] = [[] for _ in kv.layouts]
    for tier, k, _, pos, valid, _ in iter_tiles(kv, chunk_pages):
        s = torch.matmul(qg, k.transpose(-1, -2)) * scale
        visible = valid.unsqueeze(2) & (pos.unsqueeze(2) <= qp.unsqueeze(-1)) & live.unsqueeze(-1)
        p = torch.where(visible, torch.exp(s - lse_safe.unsqueeze(-1)), torch.zeros_like(s))
        per_tier[tier].append(p.sum(2) / g)
    out = []
    for tier, chunks in enumerate(per_tier):
        if chunks:
            out.append(torch.cat(chunks, dim=-1))
        else:
            out.append(torch.zeros(b, hkv, 0, device=q.device))
    return out
