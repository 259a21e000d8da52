"""The host tier: a page pool in host memory, pinned when CUDA is present.

It is the *home* of every page of an offloaded LeanCache: the page table and the free list hold
host page ids, so everything that runs between layers (allocation, recycling, LeanKV's
cross-layer Algorithm 1 rounds, beam reordering, release of finished rows) acts on it. The
device only ever holds the working set (:mod:`leankit.offload.working_set`).
"""

from __future__ import annotations

import torch

from ..pages import PagePool, _allocate


def _pinned(num_pages: int, page_size: int, pin: bool) -> torch.Tensor:
    t = torch.empty((num_pages, page_size), dtype=torch.uint8)
    return t.pin_memory() if pin and torch.cuda.is_available() else t


class HostPool(PagePool):
    """``num_pages x page_size`` bytes in host memory (a :class:`~leankit.pages.PagePool` on the CPU)."""

    def __init__(self, num_pages: int, page_size: int, pin: bool = True):
        self.page_size = page_size
        self.pin = pin
        self.what = "host page pool (offload)"
        self.storage = _allocate(lambda: _pinned(num_pages, page_size, pin), num_pages, page_size, "cpu", self.what)

    def __getstate__(self) -> dict:
        # PagePool's state is its pages alone: a copy or a pickle must keep the pinning choice too,
        # which grow() reads (without it a copy's first grow raised AttributeError)
        return {**super().__getstate__(), "pin": self.pin}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self.pin = state.pop("pin", True)
        super().__setstate__(state)
        if self.pin and torch.cuda.is_available() and not self.storage.is_pinned():
            self.storage = self._reserve = self.storage.pin_memory()  # a copied tensor is not page-locked

    @property
    def pinned(self) -> bool:
        """Whether the pages are page-locked (copies from them can run asynchronously)."""
        return self.storage.is_pinned()

    def grow(self, num_pages: int) -> None:
        """Enlarge the pool to ``num_pages`` pages, keeping every page id and byte (and the pinning)."""
        extra = num_pages - self.num_pages
        if extra > 0:
            new = _allocate(lambda: _pinned(num_pages, self.page_size, self.pin), num_pages, self.page_size, "cpu",
                            self.what)
            new[: self.num_pages] = self.storage
            self.storage = new
