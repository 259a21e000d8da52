"""Prefix-sum page allocation/recycling kernels vs the torch path of BidirectionalPageTable (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels.page_alloc import grow_pages, shrink_pages
from leankit_kernels.testing import fresh_generator

from leankit.allocator import FreePageList, PoolExhausted
from leankit.page_table import BidirectionalPageTable


def _pair(shape, row_len, cap, head, gen):
    """Two identical (free list, table) states; the ring is shuffled and its counters wrap."""
    perm = torch.randperm(cap, generator=gen).to(torch.int32)
    out = []
    for _ in range(2):
        fl = FreePageList(cap)
        fl.ring.copy_(perm)
        fl.free_head, fl.free_tail = head, head + cap  # everything free, counters past a wrap
        out.append((fl, BidirectionalPageTable(*shape, row_len, "cpu")))
    return out


def _same(a, b):
    (fa, ta), (fb, tb) = a, b
    assert torch.equal(ta.tables, tb.tables)
    assert torch.equal(ta.n_pages, tb.n_pages)
    assert torch.equal(fa.ring, fb.ring)
    assert (fa.free_head, fa.free_tail) == (fb.free_head, fb.free_tail)


@pytest.mark.parametrize("shape,block", [((3, 2, 5), 128), ((2, 3, 7), 16), ((1, 1, 1), 16)])
def test_grow_and_shrink_match_torch_path(shape, block):
    gen, seed = fresh_generator()
    row_len = 40
    ref, ker = _pair(shape, row_len, 700, 1234, gen)
    for step in range(4):
        extra = torch.randint(0, 3, (2, *shape), generator=gen, dtype=torch.int32)
        extra[:, :, 0] *= 4  # uneven demands: long and empty requesters side by side
        extra = torch.minimum(extra, (row_len - ref[1].n_pages.sum(0)).clamp_min(0) // 2)
        ref[1].grow(extra, ref[0])
        grow_pages(ker[1], extra, ker[0], block=block)
        _same(ref, ker)
        keep = (ref[1].n_pages - torch.randint(0, 4, ref[1].n_pages.shape, generator=gen, dtype=torch.int32))
        freed = ref[1].shrink(keep.clamp_min(0), ref[0])
        assert shrink_pages(ker[1], torch.minimum(keep.clamp_min(0), ker[1].n_pages), ker[0], block=block) == freed
        _same(ref, ker)
    # The tables hold each page id at most once, and none of them is free.
    used = ker[1].tables[ker[1].tables >= 0]
    assert used.unique().numel() == used.numel()
    assert not (set(used.tolist()) & set(ker[0].free_ids().tolist())), f"seed {seed}"


@pytest.mark.parametrize("shape,block", [((2, 3, 5), 16), ((1, 2, 3), 128)])
def test_deferred_grow_and_shrink_match_torch_path(shape, block):
    """``status=`` grants and ``defer=True`` recycles move only the device counters; once the host
    syncs, tables, page counts, ring and counters equal the eager torch path's. A grant that does not
    fit returns a false flag, records itself in ``status`` and hands out nothing."""
    gen, seed = fresh_generator()
    row_len = 30
    ref, ker = _pair(shape, row_len, 300, 77, gen)
    status = torch.zeros(3, dtype=torch.int64)
    for step in range(3):
        extra = torch.randint(0, 3, (2, *shape), generator=gen, dtype=torch.int32)
        extra = torch.minimum(extra, (row_len - ref[1].n_pages.sum(0)).clamp_min(0) // 2)
        ref[1].grow(extra, ref[0])
        assert bool(grow_pages(ker[1], extra, ker[0], block=block, status=status))
        keep = (ref[1].n_pages - torch.randint(0, 3, ref[1].n_pages.shape, generator=gen, dtype=torch.int32))
        ref[1].shrink(keep.clamp_min(0), ref[0])
        assert shrink_pages(ker[1], torch.minimum(keep.clamp_min(0), ker[1].n_pages), ker[0], block=block,
                            defer=True) is None
        assert ker[0].stale
        _same(ref, ker)  # reading the counters syncs the host ones
    assert not status.any()
    snap = (ker[1].tables.clone(), ker[1].n_pages.clone())
    free = ker[0].num_free
    too_many = torch.full((2, *shape), 1, dtype=torch.int32)
    too_many.view(-1)[0] = free  # one more page than the pool has left
    assert not bool(grow_pages(ker[1], too_many, ker[0], block=block, status=status))
    assert status.tolist() == [1, free + too_many.numel() - 1, free], f"seed {seed}"
    assert torch.equal(ker[1].tables, snap[0]) and torch.equal(ker[1].n_pages, snap[1])
    assert ker[0].num_free == free


def test_exhaustion_changes_nothing():
    gen, _ = fresh_generator()
    _ref, ker = _pair((2, 2, 3), 30, 50, 0, gen)
    grow_pages(ker[1], torch.full((2, 2, 2, 3), 2, dtype=torch.int32), ker[0])
    snap = (ker[1].tables.clone(), ker[1].n_pages.clone(), ker[0].ring.clone(), ker[0].free_head)
    with pytest.raises(PoolExhausted):
        grow_pages(ker[1], torch.full((2, 2, 2, 3), 3, dtype=torch.int32), ker[0])
    assert torch.equal(ker[1].tables, snap[0]) and torch.equal(ker[1].n_pages, snap[1])
    assert torch.equal(ker[0].ring, snap[2]) and ker[0].free_head == snap[3]


def test_page_table_dispatches_to_kernels(monkeypatch):
    """``grow``/``shrink`` take the kernel path under LEANKIT_BACKEND=triton, with identical results."""
    gen, _ = fresh_generator()
    ref, ker = _pair((2, 2, 3), 30, 200, 17, gen)
    calls = []
    import leankit_kernels.page_alloc as pa

    monkeypatch.setattr(pa, "grow_pages", lambda *a, **k: calls.append("grow") or grow_pages(*a, **k))
    monkeypatch.setattr(pa, "shrink_pages", lambda *a, **k: calls.append("shrink") or shrink_pages(*a, **k))
    extra = torch.randint(0, 5, (2, 2, 2, 3), generator=gen, dtype=torch.int32)
    keep = extra // 2
    ref[1].grow(extra, ref[0])
    ref[1].shrink(keep, ref[0])
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    ker[1].grow(extra, ker[0])
    ker[1].shrink(keep, ker[0])
    assert calls == ["grow", "shrink"]
    _same(ref, ker)
