"""Free list and bidirectional page table invariants, as a hypothesis state machine."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from leankit.allocator import FreePageList, PoolExhausted, exclusive_cumsum
from leankit.page_table import HIGH, LOW, BidirectionalPageTable

L, B, H, R, CAP = 2, 3, 2, 9, 40


def test_exclusive_cumsum():
    assert exclusive_cumsum(torch.tensor([3, 0, 2, 5])).tolist() == [0, 3, 3, 5]


def test_allocate_prefix_sum_order():
    fl = FreePageList(10)
    ids, off = fl.allocate(torch.tensor([2, 0, 3]))
    assert ids.tolist() == [0, 1, 2, 3, 4] and off.tolist() == [0, 2, 2]
    assert fl.free_head == 5 and fl.num_free == 5


def test_exhausted_changes_nothing():
    fl = FreePageList(4)
    fl.allocate(torch.tensor([3]))
    ring, head, tail = fl.ring.clone(), fl.free_head, fl.free_tail
    with pytest.raises(PoolExhausted) as e:
        fl.allocate(torch.tensor([1, 1]))
    assert (e.value.needed, e.value.free) == (2, 1)
    assert "2 pages" in str(e.value) and "1 of 4" in str(e.value)
    assert torch.equal(fl.ring, ring) and (fl.free_head, fl.free_tail) == (head, tail)


def test_double_free_detected():
    fl = FreePageList(4)
    with pytest.raises(RuntimeError, match="double free"):
        fl.release(torch.tensor([0]))


def test_table_sides_and_overflow():
    fl = FreePageList(20)
    t = BidirectionalPageTable(1, 1, 1, 5, "cpu")
    extra = torch.zeros(2, 1, 1, 1, dtype=torch.int32)
    extra[HIGH], extra[LOW] = 2, 2
    t.grow(extra, fl)
    row = t.tables[0, 0, 0].tolist()
    assert row[:2] == [0, 1] and row[2] == -1 and row[3:] == [3, 2]  # low ids grow from the right
    with pytest.raises(ValueError, match="max_seq_len"):
        t.grow(extra, fl)


def test_a_demand_not_shaped_like_the_table_is_refused_and_changes_nothing():
    """A demand of one layer on a two-layer table broadcast through the total (4 pages taken) and
    the page counts (8 counted): the table then claimed pages the free list still handed out."""
    fl = FreePageList(20)
    t = BidirectionalPageTable(2, 1, 1, 5, "cpu")
    with pytest.raises(ValueError, match="shaped like n_pages"):
        t.grow(torch.ones(2, 1, 1, 1, dtype=torch.int32), fl)
    assert fl.num_free == 20 and int(t.n_pages.sum()) == 0 and bool((t.tables == -1).all())


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.fl = FreePageList(CAP)
        self.table = BidirectionalPageTable(L, B, H, R, "cpu")
        self.wrapped = False

    @rule(data=st.data())
    def grow(self, data):
        extra = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=2 * L * B * H, max_size=2 * L * B * H)),
                             dtype=torch.int32).view(2, L, B, H)
        before = self.table.tables.clone(), self.table.n_pages.clone(), self.fl.num_free
        try:
            self.table.grow(extra, self.fl)
        except (PoolExhausted, ValueError):
            # the cache is left consistent: nothing changed
            assert torch.equal(self.table.tables, before[0]) and torch.equal(self.table.n_pages, before[1])
            assert self.fl.num_free == before[2]

    @rule(data=st.data())
    def shrink(self, data):
        keep = torch.tensor(data.draw(st.lists(st.integers(0, R), min_size=2 * L * B * H, max_size=2 * L * B * H)),
                            dtype=torch.int32).view(2, L, B, H)
        self.table.shrink(keep, self.fl)

    @rule(b=st.integers(0, B - 1))
    def finish_sequence(self, b):
        mask = torch.zeros(B, dtype=torch.bool)
        mask[b] = True
        self.table.release_sequences(mask, self.fl)
        assert int(self.table.n_pages[:, :, b].sum()) == 0

    @invariant()
    def conservation_and_exclusivity(self):
        owned = self.table.tables[self.table.tables >= 0]
        free = self.fl.free_ids()
        assert owned.numel() + free.numel() == CAP  # used + free = total
        assert owned.numel() == int(self.table.n_pages.sum())
        allids = torch.cat([owned, free]).sort().values
        assert torch.equal(allids, torch.arange(CAP, dtype=torch.int32))  # nobody owns a page twice
        if self.fl.free_tail > CAP:
            self.wrapped = True

    @invariant()
    def sides_are_contiguous(self):
        n = self.table.n_pages
        rows = self.table.tables.view(-1, R)
        for i, (nh, nl) in enumerate(zip(n[HIGH].reshape(-1).tolist(), n[LOW].reshape(-1).tolist())):
            row = rows[i]
            assert (row[:nh] >= 0).all() and (row[R - nl:] >= 0).all() if nl else (row[:nh] >= 0).all()
            assert (row[nh:R - nl] == -1).all()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


def test_pointers_wrap():
    fl = FreePageList(5)
    for _ in range(7):
        ids, _ = fl.allocate(torch.tensor([3]))
        fl.release(ids)
    assert fl.free_head > 5 and fl.free_tail > 10
    assert sorted(fl.free_ids().tolist()) == list(range(5))


def test_layer_views_are_memoized_and_follow_replaced_tensors():
    """``layer_views`` hands out the same views of a layer until the table's tensors are replaced
    (a beam reorder, ``select_sequences``); the views always share the table's current storage."""
    table = BidirectionalPageTable(num_layers=3, batch=4, heads=2, row_len=5, device="cpu")
    first = table.layer_views(1)
    assert table.layer_views(1) is first
    assert table.layer_views(2) is not first
    table.lens[LOW, 1, 2, 1] = 7
    table.tables[1, 3, 0, 4] = 11
    assert int(first.tier_lens[LOW][2, 1]) == 7 and int(first.lens[LOW, 2, 1]) == 7
    assert int(first.tables[3, 0, 4]) == 11 and first.n_pages.shape == (2, 4, 2)
    table.select_sequences(torch.tensor([2, 0]))
    moved = table.layer_views(1)
    assert moved is not first and moved.tables.shape == (2, 2, 5)
    assert int(moved.tier_lens[LOW][0, 1]) == 7  # row 2 is now row 0
    moved.tier_lens[HIGH][1, 0] = 3  # a write through a view lands in the table
    assert int(table.lens[HIGH, 1, 1, 0]) == 3
    table.lens = table.lens.clone()  # any one tensor replaced: fresh views
    assert table.layer_views(1).lens.data_ptr() == table.lens[:, 1].data_ptr()
