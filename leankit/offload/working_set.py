"""The device working set: a small page pool holding the pages of the layers in flight.

Host page ids (the home ids the page table and free list use) map to device slots while their
layer is in flight (``slot_of``), and slots map back (``owner``). The pool never holds more
than what the windows in flight need: the layer being computed, the layers being prefetched and
the step's new pages of those layers. A fixed budget (``device_pages``) turns an overflow into a
``DeviceBudgetExceeded`` (a ``RuntimeError``) naming the pages needed.
"""

from __future__ import annotations

import torch

from ..allocator import PoolExhausted
from ..pages import PagePool


class DeviceBudgetExceeded(RuntimeError):
    """The device working set needs more pages than the fixed offload budget (``device_pages``)."""


class WorkingSet:
    """Device slots for host pages, with the peak number of slots ever in use."""

    def __init__(self, page_size: int, device, budget: int | None):
        self.fixed = budget is not None
        self.pool = PagePool(budget or 8, page_size, device, "device working set (offload device_pages)")
        self.owner = torch.full((self.pool.num_pages,), -1, dtype=torch.long, device=device)
        self.slot_of = torch.full((0,), -1, dtype=torch.long, device=device)
        self.used = 0
        self.peak = 0

    @property
    def budget(self) -> int | None:
        """The fixed device budget in pages, or ``None`` (elastic)."""
        return self.pool.num_pages if self.fixed else None

    def _cover(self, capacity: int) -> None:
        if self.slot_of.numel() < capacity:
            grown = torch.full((capacity,), -1, dtype=torch.long, device=self.slot_of.device)
            grown[: self.slot_of.numel()] = self.slot_of
            self.slot_of = grown

    def assign(self, ids: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Device slots of host pages ``ids`` (unique), giving free slots to those without one.

        ``bound``: an id bound known on the host (the host pool's size), which spares a device read.
        Returns ``(slots, fresh)``: ``fresh`` marks the pages that had no slot before.
        """
        ids = ids.long()
        if ids.numel() == 0:
            return ids, torch.zeros(0, dtype=torch.bool, device=ids.device)
        self._cover(bound if bound is not None else int(ids.max()) + 1)
        fresh = self.slot_of[ids] < 0
        new_ids = ids[fresh]  # the one read of how many pages need a slot
        need = new_ids.numel()
        if need:
            free = (self.owner < 0).nonzero().flatten()
            if free.numel() < need:
                if self.fixed:
                    raise DeviceBudgetExceeded(
                        f"the device working set needs {self.used + need} pages but the offload budget is "
                        f"{self.pool.num_pages} (device_pages): give it more pages or prefetch fewer layers")
                cap = max(2 * self.pool.num_pages, self.used + need)
                self.pool.grow(cap)
                owner = torch.full((cap,), -1, dtype=torch.long, device=self.owner.device)
                owner[: self.owner.numel()] = self.owner
                self.owner = owner
                free = (self.owner < 0).nonzero().flatten()
            slots = free[:need]
            self.owner[slots] = new_ids
            self.slot_of[new_ids] = slots
            self.used += need
            self.peak = max(self.peak, self.used)
        return self.slot_of[ids], fresh

    def drop(self, ids: torch.Tensor) -> None:
        """Free the slots of host pages ``ids`` (those without a slot are ignored)."""
        ids = ids.long()
        if ids.numel() == 0 or self.slot_of.numel() == 0:
            return
        ids = ids[ids < self.slot_of.numel()]
        slots = self.slot_of[ids]
        held = slots >= 0
        self.owner[slots[held]] = -1
        self.slot_of[ids[held]] = -1
        self.used -= int(held.sum())

    def clear(self, keep: torch.Tensor | None = None) -> None:
        """Free every slot, except those of the host pages marked in ``keep`` (bool, by host id)."""
        if keep is None or keep.numel() == 0:
            self.owner.fill_(-1)
            self.slot_of.fill_(-1)
            self.used = 0
            return
        held = (self.owner >= 0).nonzero().flatten()
        ids = self.owner[held]
        inside = ids < keep.numel()
        kept = torch.zeros_like(inside)
        kept[inside] = keep[ids[inside]]
        self.drop(ids[~kept])


class WindowFreeList:
    """The cache's free list while a layer's window is open: pages still come from (and return to)
    the host free list, but the ids handed out are device slots, since the layer's page-table row
    holds slots while it computes (LeanKV allocates a prompt's pages per layer, as it stores)."""

    def __init__(self, home, working: WorkingSet, grow_home):
        self.home, self.working, self.grow_home = home, working, grow_home

    @property
    def capacity(self) -> int:
        return self.home.capacity

    @property
    def num_free(self) -> int:
        return self.home.num_free

    # The host list's counter state, for callers that fold a stale list's counters into their own
    # device read (BidirectionalPageTable.grow).
    @property
    def stale(self) -> bool:
        return self.home.stale

    @property
    def counters(self) -> torch.Tensor | None:
        return self.home.counters

    def load(self, head: int, tail: int) -> None:
        self.home.load(head, tail)

    def allocate(self, demand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host pages for ``demand`` (as :meth:`FreePageList.allocate`), returned as device slots."""
        try:
            ids, offsets = self.home.allocate(demand)
        except PoolExhausted as e:
            if not self.grow_home(e):
                raise
            ids, offsets = self.home.allocate(demand)
        try:
            slots, _ = self.working.assign(ids)
        except BaseException:  # no device slot for them (a fixed budget): the host pages go back
            self.home.release(ids)
            raise
        return slots.to(torch.int32), offsets

    def release(self, slots: torch.Tensor) -> None:
        """Return the host pages behind device ``slots`` to the host free list."""
        slots = slots.reshape(-1).long()
        ids = self.working.owner[slots]
        self.working.drop(ids)
        self.home.release(ids)
