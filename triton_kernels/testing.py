"""Builders of filled unified-page caches for the kernel tests and benchmarks.

They use only leankit's own reference machinery (``BidirectionalPageTable.grow``,
``PageLayout.encode``, ``PagePool.write_rows``), so a kernel compared against
:mod:`leankit.attention` on these caches is compared against the format's source of truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from leankit.allocator import FreePageList
from leankit.attention import PagedKV
from leankit.config import KVConfig
from leankit.page_table import BidirectionalPageTable
from leankit.pages import PageLayout, PagePool


@dataclass
class FilledCache:
    """A hand-filled layer cache: the :class:`PagedKV` view plus what built it."""

    kv: PagedKV
    cfg: KVConfig
    free_list: FreePageList
    ctx: torch.Tensor  # int [B]: positions 0 .. ctx[b]-1 existed (some may be pruned)


def build_paged_kv(spec: str, batch: int, kv_heads: int, head_dim: int, ctx, *, dtype=torch.float32,
                   low_frac: float = 0.5, prune_frac: float = 0.0, layers: int = 2, layer: int = 1,
                   group_size: int | None = None, page_size: int | None = None, spare_pages: int = 3,
                   generator: torch.Generator | None = None, device="cpu", scale_k: float = 2.0) -> FilledCache:
    """Fill layer ``layer`` of a fresh cache with random tokens, per-head tier mixes and pruning.

    ``ctx`` (int or ``[B]``) is each sequence's context length; token ``j`` of head ``(b, h)`` has
    position ``j``. With two tiers, each head sends a random ``~low_frac`` of its tokens to the low
    tier (a different mix per head), ``prune_frac`` of tokens are dropped, and slot order inside a
    tier is shuffled (masking must go by stored position, not slot). The pool starts as random
    bytes, so dead slots hold garbage, NaN patterns included; the free ring is shuffled so page ids
    are scattered.
    """
    gen = generator or torch.Generator().manual_seed(0)
    overrides = {}
    if group_size is not None:
        overrides["group_size"] = group_size
    if page_size is not None:
        overrides["page_size"] = page_size
    cfg = KVConfig.parse(spec, **overrides)
    layouts = tuple(PageLayout.build(cfg, t, head_dim, dtype) for t in range(len(cfg.tiers)))
    two = len(layouts) > 1
    ctx = torch.as_tensor(ctx).reshape(-1).expand(batch).clone() if torch.as_tensor(ctx).numel() == 1 \
        else torch.as_tensor(ctx).reshape(-1)
    max_ctx = int(ctx.max())
    th = layouts[0].tokens
    row_len = math.ceil(max(max_ctx, 1) / th) + 1
    # Per head: which positions survive and in which tier.
    plan = {}
    for b in range(batch):
        for h in range(kv_heads):
            n = int(ctx[b])
            keep = torch.rand(n, generator=gen) >= prune_frac
            pos = torch.arange(n)[keep]
            if two:
                lf = low_frac * float(torch.rand(1, generator=gen)) * 2 if low_frac > 0 else 0.0
                low = torch.rand(pos.numel(), generator=gen) < min(lf, 1.0)
            else:
                low = torch.zeros(pos.numel(), dtype=torch.bool)
            tiers = []
            for t in range(len(layouts)):
                p = pos[low] if t == 1 else pos[~low]
                tiers.append(p[torch.randperm(p.numel(), generator=gen)])
            plan[b, h] = tiers
    lens = torch.zeros((2, layers, batch, kv_heads), dtype=torch.int32)
    for (b, h), tiers in plan.items():
        for t, p in enumerate(tiers):
            lens[t, layer, b, h] = p.numel()
    extra = torch.zeros_like(lens)
    for t, lay in enumerate(layouts):
        extra[t] = (lens[t] + lay.tokens - 1) // lay.tokens
    num_pages = int(extra.sum()) + spare_pages
    pool = PagePool(num_pages, cfg.page_size, device)
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=gen, dtype=torch.uint8))
    free_list = FreePageList(num_pages, device)
    free_list.ring.copy_(torch.randperm(num_pages, generator=gen).to(torch.int32))
    table = BidirectionalPageTable(layers, batch, kv_heads, row_len, device)
    table.grow(extra.to(device), free_list)
    table.lens.copy_(lens)
    for t, lay in enumerate(layouts):
        bs, hs, slots, poss = [], [], [], []
        for (b, h), tiers in plan.items():
            p = tiers[t]
            bs.append(torch.full_like(p, b))
            hs.append(torch.full_like(p, h))
            slots.append(torch.arange(p.numel()))
            poss.append(p)
        if not bs:
            continue
        bb, hh, ss, pp = (torch.cat(x).to(device) for x in (bs, hs, slots, poss))
        n = bb.numel()
        if n == 0:
            continue
        k = (torch.randn(n, head_dim, generator=gen) * scale_k).to(dtype).to(device)
        v = torch.randn(n, head_dim, generator=gen).to(dtype).to(device)
        score = torch.rand(n, generator=gen).to(device)
        page, off = table.locate(t, layer, bb, hh, ss, lay.tokens)
        pool.write_rows(lay, page, off, lay.encode(k, v, score, pp))
    return FilledCache(PagedKV(pool, layouts, table, layer), cfg, free_list, ctx)


def random_queries(batch: int, q_heads: int, q_len: int, head_dim: int, ctx: torch.Tensor, *,
                   dtype=torch.float32, generator: torch.Generator | None = None, device="cpu"):
    """``q [B, Hq, Q, F]`` (a non-contiguous view, as HF produces) and positions ``ctx - Q .. ctx - 1``."""
    gen = generator or torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_len, q_heads, head_dim, generator=gen).to(dtype).to(device).transpose(1, 2)
    q_pos = ctx.view(-1, 1).to(device) - q_len + torch.arange(q_len, device=device).view(1, -1)
    return q, q_pos.to(torch.int64)
