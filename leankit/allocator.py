"""Circular free-page list with prefix-sum coordination (LeanKV §5.2, "Circular Free Page List").

All free page ids sit in a ring buffer between two monotonically increasing counters,
``free_head`` (next id to hand out) and ``free_tail`` (next place to put a returned id); a
counter ``c`` addresses ring slot ``c % capacity``, so both pointers wrap. The free region
``[free_head, free_tail)`` and the used region stay contiguous, which is what lets a whole step's
allocation be coordinated with one exclusive prefix sum:

* planning: every (layer, sequence, head) states how many pages it needs (``demand[i]``);
* coordination: ``offset = exclusive_cumsum(demand)``; requester ``i`` takes ring slots
  ``free_head + offset[i] .. + demand[i]`` and ``free_head`` advances by ``sum(demand)``.

Recycling is the mirror image at ``free_tail``. There is no Python loop over requesters; the
Triton kernel ``leankit_kernels.page_alloc`` performs the same steps in one launch.
"""

from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    """The page pool cannot serve an allocation. The cache is left unchanged."""

    def __init__(self, needed: int, free: int, total: int, detail: str = ""):
        self.needed, self.free, self.total = needed, free, total
        super().__init__(
            f"KV page pool exhausted: this step needs {needed} pages{detail} but only {free} of {total} are free. "
            "Give LeanCache more pages (num_pages=...), use a lower-precision KV config, or shorten the batch."
        )


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum along the last dim: ``out[i] = sum(x[:i])``."""
    c = torch.cumsum(x, dim=-1)
    return c - x


class FreePageList:
    """GPU-resident circular list of free page ids.

    Attributes:
        ring: int32 ``[capacity]`` page ids.
        free_head, free_tail: Python-int counters (slot = counter % capacity).
        counters: int64 ``[2]`` device copy of ``(free_head, free_tail)``, made on first use by a
            kernel (:meth:`device_counters`). A deferred kernel allocation advances it on the
            device alone; the host counters then catch up on the next read (:meth:`sync`, or
            :meth:`load` with values the caller read itself), so a step allocates without a host sync.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.ring = torch.arange(capacity, dtype=torch.int32, device=device)
        self.counters: torch.Tensor | None = None
        self._stale = False  # the device counters moved past the host ones
        self._head, self._tail = 0, capacity
        self._floor = capacity  # while stale: a host lower bound on the free pages

    @property
    def free_head(self) -> int:
        """Ring index of the next page to hand out (syncs the host counters)."""
        self.sync()
        return self._head

    @free_head.setter
    def free_head(self, value: int) -> None:
        self.sync()
        self._head = value
        self._push()

    @property
    def free_tail(self) -> int:
        """Ring index one past the last free page (syncs the host counters)."""
        self.sync()
        return self._tail

    @free_tail.setter
    def free_tail(self, value: int) -> None:
        self.sync()
        self._tail = value
        self._push()

    def _push(self) -> None:
        if self.counters is not None:
            self.counters[0].fill_(self._head)
            self.counters[1].fill_(self._tail)

    def device_counters(self) -> torch.Tensor:
        """The int64 ``[2]`` device ``(free_head, free_tail)`` the kernels read (made on first call)."""
        if self.counters is None:
            self.counters = torch.empty(2, dtype=torch.int64, device=self.ring.device)  # filled, not copied
            self._push()
        return self.counters

    def mark_stale(self, taken: int | None = None) -> None:
        """A kernel advanced the device counters; the host ones are behind until :meth:`sync`.

        ``taken``: a host bound on the pages the kernel took from the list (0 for a release, which
        only adds free pages; None if unknown). It keeps :attr:`free_floor` a true lower bound.
        """
        self._floor = 0 if taken is None else max(0, self.free_floor - int(taken))
        self._stale = True

    @property
    def free_floor(self) -> int:
        """Free pages, or a lower bound of them while the host counters are stale; reads nothing
        from the device (an elastic pool's deferred grant checks its bound against this)."""
        return self._floor if self._stale else self._tail - self._head

    @property
    def stale(self) -> bool:
        """Whether a kernel moved the device counters since the host last read them."""
        return self._stale

    def sync(self) -> None:
        """Bring the host counters up to the device ones (a host read, only when they moved)."""
        if self._stale:
            self.load(*self.counters.tolist())

    def load(self, head: int, tail: int) -> None:
        """Set the host counters to device values the caller has read (see :meth:`sync`)."""
        self._head, self._tail, self._stale = int(head), int(tail), False

    @property
    def capacity(self) -> int:
        """Pages the ring can hold (the pool's size)."""
        return self.ring.numel()

    @property
    def num_free(self) -> int:
        """Free pages now (syncs the host counters)."""
        return self.free_tail - self.free_head

    def free_ids(self) -> torch.Tensor:
        """The free page ids in ring order (for tests and growth)."""
        idx = (torch.arange(self.num_free, device=self.ring.device) + self.free_head) % self.capacity
        return self.ring[idx]

    def grow(self, capacity: int) -> None:
        """Add ids ``[old_capacity, capacity)`` to the free list."""
        old = self.capacity
        if capacity <= old:
            return
        free = self.free_ids()
        new_ids = torch.arange(old, capacity, dtype=torch.int32, device=self.ring.device)
        ring = torch.empty(capacity, dtype=torch.int32, device=self.ring.device)
        n = free.numel() + new_ids.numel()
        ring[:n] = torch.cat([free, new_ids])
        self.ring, self.free_head, self.free_tail = ring, 0, n

    def allocate(self, demand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand out ``demand[i]`` pages to each requester ``i`` in one coordinated step.

        Returns ``(ids, offsets)``: requester ``i`` owns ``ids[offsets[i] : offsets[i] + demand[i]]``.
        Raises :class:`PoolExhausted` (changing nothing) if the ring holds too few ids.
        """
        demand = demand.reshape(-1).long()
        offsets = exclusive_cumsum(demand)
        total = int(demand.sum())
        if total > self.num_free:
            raise PoolExhausted(total, self.num_free, self.capacity)
        slots = (torch.arange(total, device=self.ring.device) + self.free_head) % self.capacity
        ids = self.ring[slots]
        self.free_head += total
        return ids, offsets

    def took(self, pages: int) -> None:
        """Advance the head past ``pages`` ids that a compiled grant read from the ring in place
        (``leankit/native/page_grants.c``), as :meth:`allocate` advances it past its own."""
        self.free_head = self.free_head + pages

    def returned(self, pages: int) -> None:
        """Advance the tail past ``pages`` ids that a compiled recycle wrote into the ring in place,
        as :meth:`release` advances it past its own."""
        self.free_tail = self.free_tail + pages

    def release(self, ids: torch.Tensor) -> None:
        """Return page ids to the ring at ``free_tail`` (already prefix-sum ordered by the caller)."""
        ids = ids.reshape(-1)
        n = ids.numel()
        if n == 0:
            return
        if n > self.capacity - self.num_free:
            raise RuntimeError("releasing more pages than are in use: double free")
        slots = (torch.arange(n, device=self.ring.device) + self.free_tail) % self.capacity
        self.ring[slots] = ids.to(torch.int32)
        self.free_tail += n
