"""The device-resident share of an offloaded cache: pages that stay on the device for good.

A plan may keep part of the cache on the GPU (the planner's ``gpu_cache_tokens`` per layer, what
its memory check fits next to the weights and buffers) and only the rest on the host. Those pages
hold a host page id like every other page (the page table and the free list speak host ids), but
their bytes live in their device slot only: they are never copied in, never written back, and
their slot outlives the step.

Which pages: the share is fixed at the first step and holds one kind of page, the kind the
planner keeps on the GPU (``kind``): KV pages for plans of mode ``kv`` and ``kvpr``, ACT blocks
for ``hybrid`` (HybridServe keeps ACT blocks in GPU memory). ``device_tokens`` tokens of that
kind are spread over the rows in proportion to their filled pages of that kind after the first
step (KV: pages per head; ACT: blocks), rounded by largest remainder, so the kept tokens sum to
``device_tokens`` to within a page (or to every filled page, when the first step holds fewer
tokens: the share does not grow later). Row ``b`` keeps the first ``cap[b]`` pages of its row; under policy ``full`` a page never moves, so its column says once and for all whether it
is resident. The step's new tokens past those pages go to the host, as they must once the
device's share is full.
"""

from __future__ import annotations

import torch

from ..page_table import HIGH


class ResidentShare:
    """Which host page ids stay on the device (``flags``), from per-row column limits."""

    def __init__(self, tokens: int, kind: str, device):
        if kind not in ("kv", "act"):
            raise ValueError(f"offload resident kind must be 'kv' or 'act', got {kind!r}")
        self.tokens, self.kind = tokens, kind
        self.flags = torch.zeros(0, dtype=torch.bool, device=device)
        self.kv_cap: torch.Tensor | None = None  # long [B]: resident KV pages per head of each row
        self.act_cap: torch.Tensor | None = None  # long [B]: resident ACT blocks of each row

    @property
    def active(self) -> bool:
        """Whether any token is meant to stay on the device."""
        return self.tokens > 0

    @property
    def pages(self) -> int:
        """Resident pages right now."""
        return int(self.flags.sum())

    def _cover(self, n: int) -> None:
        if self.flags.numel() < n:
            grown = torch.zeros(n, dtype=torch.bool, device=self.flags.device)
            grown[: self.flags.numel()] = self.flags
            self.flags = grown

    def of(self, ids: torch.Tensor) -> torch.Tensor:
        """bool: which of host pages ``ids`` are resident."""
        ids = ids.long()
        out = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        inside = ids < self.flags.numel()
        out[inside] = self.flags[ids[inside]]
        return out

    def fix(self, cache, layer: int) -> None:
        """Fix the per-row limits from ``layer``'s token counts (once, at the end of the first store)."""
        if self.kv_cap is not None or self.act_cap is not None or not self.active:
            return
        store = cache.act_store
        if self.kind == "act":
            if store is None or store.table is None:
                raise ValueError("offload resident kind 'act' needs an ACT cache (act=...)")
            n, per_page = store.table.lens[layer].long(), store.layout.tokens
        else:
            n, per_page = cache.table.lens[HIGH, layer, :, 0].long(), cache.layouts[HIGH].tokens  # policy 'full'
        # Whole filled pages only: a row's partly filled last page stays on the host, where the
        # row's later tokens go once the device's share is full.
        full = n // per_page
        want = min(round(self.tokens / per_page), int(full.sum()))
        exact = full.double() * (want / int(full.sum()) if want else 0.0)
        cap = exact.floor().long()
        short = want - int(cap.sum())  # the largest remainders get the pages rounding left over
        if short > 0:
            cap[torch.argsort(exact - cap, descending=True)[:short]] += 1
        if self.kind == "act":
            self.act_cap = cap
        else:
            self.kv_cap = cap

    def mark(self, cache, layer: int) -> None:
        """Flag ``layer``'s pages that lie within the row limits (and clear the flag of the others)."""
        if self.kv_cap is None and self.act_cap is None:
            return
        table = cache.table
        row = table.tables[layer]  # [B, H, R]
        col = torch.arange(table.row_len, device=row.device).view(1, 1, -1)
        used = row >= 0
        cap = self.kv_cap if self.kv_cap is not None else torch.zeros_like(self.act_cap)
        keep = used & (col < cap.view(-1, 1, 1)) & (col < table.n_pages[HIGH, layer].unsqueeze(-1))
        ids, flags = [row[used]], [keep[used]]
        store = cache.act_store
        if self.act_cap is not None and store.table is not None:
            t = store.table
            arow = t.tables[layer]  # [B, R]: ``slices`` pages per block
            block = (torch.arange(t.row_len, device=arow.device) // t.slices).view(1, -1)
            aused = arow >= 0
            ids.append(arow[aused])
            flags.append((block < self.act_cap.view(-1, 1)).expand_as(arow)[aused])
        ids = torch.cat(ids).long()
        if ids.numel():
            self._cover(int(ids.max()) + 1)
            self.flags[ids] = torch.cat(flags)

    def prune(self, cache) -> torch.Tensor:
        """Clear the flags of pages no row holds any more (finished rows); returns their ids."""
        if self.flags.numel() == 0:
            return self.flags.new_zeros(0, dtype=torch.long)
        held = torch.zeros_like(self.flags)
        rows = [cache.table.tables] if cache.table is not None else []
        store = cache.act_store
        if store is not None and store.table is not None:
            rows.append(store.table.tables)
        for r in rows:
            ids = r[r >= 0].long()
            held[ids[ids < held.numel()]] = True
        gone = (self.flags & ~held).nonzero().flatten()
        self.flags &= held
        return gone

    def reset(self) -> None:
        """Forget the limits and flags (a new batch of requests)."""
        self.flags = torch.zeros(0, dtype=torch.bool, device=self.flags.device)
        self.kv_cap = self.act_cap = None
