"""The compiled page accounting (``leankit.native``, ``page_grants.c``) against the torch path it
replaces on a CPU: :class:`BidirectionalPageTable`'s ``grow``, ``shrink``, ``move_tail``,
``tier_plan`` and ``settle`` (the policy's count update and recycle), id for id.

Two copies of a table and its free list take the same random walk of grants, recycles, hand-overs
and plans, one on each path; after every call the tables, the page counts, the rings, the
counters and the results (or the exception and its words) must be identical, and a refused call
must leave its copy as it was.
"""

import random

import pytest
import torch

from leankit import native
from leankit import page_table as page_table_module
from leankit.allocator import FreePageList, PoolExhausted
from leankit.page_table import HIGH, LOW, BidirectionalPageTable

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler for leankit.native")


class _Path:
    """One copy of a table and its free list, run on the compiled path or the torch path."""

    def __init__(self, shape, row_len, capacity, compiled: bool):
        self.table = BidirectionalPageTable(*shape, row_len, "cpu")
        self.free = FreePageList(capacity)
        self.compiled = compiled

    def call(self, monkeypatch, name, *args):
        """``table.name(*args)`` on this copy's path (``grow`` and ``shrink`` with this copy's free
        list): the result, or the exception's type and words."""
        if name in ("grow", "shrink", "settle"):
            args = (*args, self.free)
        if name == "fit":
            args = (*args[:3], self.free, *args[3:])
        with monkeypatch.context() as m:
            if not self.compiled:
                m.setattr(page_table_module.native, "kernels_for", lambda device: None)
            try:
                if name in ("settle", "fit") and not self.compiled:
                    return (_settle_torch if name == "settle" else _fit_torch)(self.table, *args)
                return getattr(self.table, name)(*args)
            except (ValueError, RuntimeError) as err:  # PoolExhausted is a RuntimeError
                return type(err), str(err)

    def state(self):
        t, f = self.table, self.free
        return t.tables.clone(), t.n_pages.clone(), t.lens.clone(), f.ring.clone(), f.free_head, f.free_tail


def _fit_torch(table, layers, lens, tokens, free, reserve):
    """What the policy does on the torch path for :meth:`BidirectionalPageTable.fit`: plan, check,
    hand over, grant."""
    need, r, extra = table.tier_plan(layers, lens, tokens, reserve)
    if int(extra.sum()) and bool(table._overflows(extra)):
        raise ValueError(table._OVERFLOW.format(table.row_len))
    if int(extra.sum()) > free.num_free:
        raise PoolExhausted(int(extra.sum()), free.num_free, free.capacity)
    table.move_tail(layers, r)
    table.grow(extra, free)
    return need


def _settle_torch(table, layers, lens, need, free):
    """What the policy does on the torch path for :meth:`BidirectionalPageTable.settle`."""
    keep = table.n_pages.clone()
    keep.index_copy_(1, layers, need.to(keep.dtype))
    freed = table.shrink(keep, free)
    table.lens.index_copy_(1, layers, lens.to(table.lens.dtype))
    return freed


def _same(a, b):
    if isinstance(a, tuple) and a and isinstance(a[0], torch.Tensor):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _draw_layers(rnd, num_layers):
    k = rnd.randint(1, num_layers)
    return torch.tensor(sorted(rnd.sample(range(num_layers), k)), dtype=torch.int64)


@pytest.mark.parametrize("shape,row_len,capacity", [((1, 1, 3), 7, 40), ((3, 2, 5), 9, 97), ((2, 3, 1), 5, 23),
                                                    ((4, 1, 2), 13, 11)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_page_accounting_matches_the_torch_path(monkeypatch, shape, row_len, capacity, seed):
    rnd = random.Random(seed * 1009 + row_len)
    gen = torch.Generator().manual_seed(seed)
    paths = [_Path(shape, row_len, capacity, compiled=c) for c in (True, False)]
    num_layers = shape[0]
    for step in range(120):
        op = rnd.choice(["grow", "grow", "shrink", "move_tail", "tier_plan", "settle", "fit", "fit"])
        n_pages = paths[0].table.n_pages
        if op == "grow":
            hi = rnd.choice([1, 2, 3])
            extra = torch.randint(0, hi + 1, n_pages.shape, generator=gen, dtype=torch.int32)
            extra *= torch.rand(n_pages.shape, generator=gen) < 0.5
            if rnd.random() < 0.05:
                extra.view(-1)[rnd.randrange(extra.numel())] = -1  # a negative demand: refused
            args = (extra,)
        elif op == "shrink":
            keep = (n_pages.float() * torch.rand(n_pages.shape, generator=gen)).round().int()
            keep += torch.randint(0, 2, keep.shape, generator=gen, dtype=torch.int32)  # past n_pages: kept as is
            args = (keep,)
        elif op == "move_tail":
            layers = _draw_layers(rnd, num_layers)
            cur_h = n_pages[HIGH].index_select(0, layers).long()
            args = (layers, (cur_h.float() * torch.rand(cur_h.shape, generator=gen)).floor().long())
        elif op == "settle":
            layers = _draw_layers(rnd, num_layers)
            have = n_pages.index_select(1, layers).long()
            need = (have.float() * torch.rand(have.shape, generator=gen)).round().long()
            need += torch.randint(0, 2, need.shape, generator=gen)  # past n_pages: kept as is
            args = (layers, torch.randint(0, 50, need.shape, generator=gen), need)
        else:  # a plan, alone or granted
            layers = _draw_layers(rnd, num_layers)
            tokens = rnd.choice([(4,), (4, 8), (3, 5)])
            lens = torch.randint(0, (3 if op == "tier_plan" else 1) * row_len, (len(tokens), len(layers), *shape[1:]),
                                 generator=gen)
            reserve = torch.randint(0, 5, (shape[1],), generator=gen) if rnd.random() < 0.5 else None
            args = (layers, lens.int() if rnd.random() < 0.5 else lens, tokens, reserve)
        before = [p.state() for p in paths]
        results = [p.call(monkeypatch, op, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
                   for p in paths]
        if op == "grow" and results[0] is None and (args[0] < 0).any():
            pytest.fail("a negative demand was granted")
        assert _same(results[0], results[1]), (step, op, results)
        assert _same(paths[0].state(), paths[1].state()), (step, op)
        if isinstance(results[0], tuple) and isinstance(results[0][0], type):  # refused: nothing changed
            assert _same(paths[0].state(), before[0]), (step, op)
        if op == "shrink" and rnd.random() < 0.1:  # hand everything back now and then, to reach a full ring
            for p in paths:
                p.call(monkeypatch, "shrink", torch.zeros_like(n_pages))
            assert _same(paths[0].state(), paths[1].state())


def test_refused_grants_change_nothing_and_say_why():
    table, free = BidirectionalPageTable(1, 1, 2, 4, "cpu"), FreePageList(5)
    extra = torch.zeros(2, 1, 1, 2, dtype=torch.int32)
    extra[HIGH, 0, 0, 0], extra[LOW, 0, 0, 0] = 2, 3  # 5 pages in a 4-column row
    before = table.tables.clone(), table.n_pages.clone(), free.free_head
    with pytest.raises(ValueError, match="max_seq_len"):
        table.grow(extra, free)
    extra[LOW, 0, 0, 0], extra[HIGH, 0, 0, 1] = 1, 3  # 6 pages from a ring of 5
    with pytest.raises(PoolExhausted) as err:
        table.grow(extra, free)
    assert (err.value.needed, err.value.free, err.value.total) == (6, 5, 5)
    extra[HIGH, 0, 0, 1] = -1
    with pytest.raises(ValueError, match="negative"):
        table.grow(extra, free)
    assert torch.equal(table.tables, before[0]) and torch.equal(table.n_pages, before[1])
    assert free.free_head == before[2] and free.num_free == 5


def test_a_double_free_and_a_bad_hand_over_are_refused():
    table, free = BidirectionalPageTable(2, 1, 1, 6, "cpu"), FreePageList(8)
    extra = torch.zeros(2, 2, 1, 1, dtype=torch.int32)
    extra[HIGH, 0], extra[LOW, 1] = 3, 2
    table.grow(extra, free)
    assert table.tables[0, 0, 0].tolist() == [0, 1, 2, -1, -1, -1]
    assert table.tables[1, 0, 0].tolist() == [-1, -1, -1, -1, 4, 3]  # low pages from the right
    with pytest.raises(ValueError, match="outside the page table"):  # more than the row's high pages
        table.move_tail(torch.tensor([1]), torch.tensor([[[1]]]))
    with pytest.raises(ValueError, match="outside the page table"):
        table.move_tail(torch.tensor([2]), torch.tensor([[[0]]]))
    table.move_tail(torch.tensor([0]), torch.tensor([[[2]]]))  # the newest high pages become low, newest first
    assert table.tables[0, 0, 0].tolist() == [0, -1, -1, -1, 1, 2]
    assert table.n_pages[:, 0, 0, 0].tolist() == [1, 2]
    with pytest.raises(ValueError, match="outside the page table"):  # a negative need
        table.settle(torch.tensor([0]), torch.zeros(2, 1, 1, 1), torch.full((2, 1, 1, 1), -1), free)
    table.n_pages[LOW, 1] += 4  # counts that claim pages the ring still holds
    state = table.tables.clone(), table.n_pages.clone(), free.free_tail
    with pytest.raises(RuntimeError, match="double free"):
        table.shrink(torch.zeros_like(table.n_pages), free)
    assert torch.equal(table.tables, state[0]) and torch.equal(table.n_pages, state[1])
    assert free.free_tail == state[2]


def test_the_plan_of_a_retiering_follows_the_paper_accounting():
    """need = ceil(tokens / T), r = min((cur_h - need_h)+, (need_l - cur_l)+), extra the rest."""
    table, free = BidirectionalPageTable(2, 1, 2, 10, "cpu"), FreePageList(30)
    extra = torch.zeros(2, 2, 1, 2, dtype=torch.int32)
    extra[HIGH, 1, 0, 0], extra[HIGH, 1, 0, 1], extra[LOW, 1, 0, 1] = 4, 1, 1
    table.grow(extra, free)
    lens = torch.tensor([[[[5, 9]]], [[[20, 3]]]])  # [tiers, L'=1, B, H]: high, low tokens of layer 1
    need, r, grant = table.tier_plan(torch.tensor([1]), lens, (4, 8), torch.tensor([2]))
    assert need[:, 0, 0].tolist() == [[2, 3], [3, 1]]  # ceil((5 + 2) / 4), ceil((9 + 2) / 4); ceil(20 / 8), 1
    assert r[0, 0].tolist() == [2, 0]  # head 0: 2 spare high pages, 3 low pages lacking
    assert grant[:, 1, 0].tolist() == [[0, 2], [1, 0]] and not grant[:, 0].any()
