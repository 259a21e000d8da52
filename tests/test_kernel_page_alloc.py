"""Prefix-sum page allocation/recycling kernels vs the torch path of BidirectionalPageTable (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels.page_alloc import (
    grant_token_pages,
    grow_pages,
    move_tail_pages,
    plan_tier_pages,
    release_rows,
    shrink_pages,
)
from leankit_kernels.testing import fresh_generator

from leankit.allocator import FreePageList, PoolExhausted
from leankit.page_table import ActPageTable, BidirectionalPageTable


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
@pytest.mark.parametrize("single", [True, False], ids=["one-program", "many-program"])
def test_deferred_grow_and_shrink_match_torch_path(shape, block, single, monkeypatch):
    """``status=`` grants and ``defer=True`` recycles move only the device counters; once the host
    syncs, tables, page counts, ring and counters equal the eager torch path's. A grant that does not
    fit returns a false flag, records itself in ``status`` and hands out nothing. Both grants: the
    one-program kernel (up to ``SINGLE_GRANT_MAX`` requesters; ``SINGLE_GRANT_BLOCK`` below the
    requester count makes it loop) and the many-program grow with its torch check."""
    from leankit_kernels import page_alloc

    monkeypatch.setattr(page_alloc, "SINGLE_GRANT_MAX", 1 << 16 if single else 0)
    monkeypatch.setattr(page_alloc, "SINGLE_GRANT_BLOCK", 16)
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


@pytest.mark.parametrize("shape,tokens,block", [((2, 3, 5), 7, 16), ((3, 1, 2), 1, 1024), ((1, 4, 3), 18, 8)])
def test_token_grant_matches_the_eager_grow_of_its_demand(shape, tokens, block):
    """``grant_token_pages`` (one single-program launch: demand, total, check, grant, counters)
    leaves tables, page counts, ring and counters as the eager torch ``grow`` of
    ``table.token_demand`` does, over steps with uneven stored lengths, rows with no new token and
    prompts of several tokens; a grant the pool cannot hold records itself in ``status`` once and
    moves nothing."""
    gen, seed = fresh_generator()
    layers, batch, heads = shape
    row_len = 64
    ref, ker = _pair(shape, row_len, 20 * layers * batch * heads, 4321, gen)
    status = torch.zeros(3, dtype=torch.int64)
    for step in range(5):
        n_new = torch.randint(0, 2 if step else 4 * tokens, (batch,), generator=gen)  # int64, as a step counts
        if step == 2:
            n_new[0] = 0  # a row without a token this step (padding, a finished request)
        ref[1].grow(ref[1].token_demand(n_new, tokens), ref[0])
        grant_token_pages(ker[1], n_new, tokens, ker[0], status, block=block)
        assert ker[0].stale
        _same(ref, ker)
        # The stored tokens grow by the step's new ones, then some heads lose a few (pruning moves
        # tokens between tiers), so demands differ from head to head.
        for t in (ref[1], ker[1]):
            t.lens[0] += n_new.view(1, -1, 1).to(torch.int32)
        drop = torch.randint(0, 3, (layers, batch, heads), generator=gen, dtype=torch.int32)
        for t in (ref[1], ker[1]):
            t.lens[0] = (t.lens[0] - drop).clamp_min(0)
    assert not status.any(), f"seed {seed}"
    # The pool runs short of the next demand: the grant is refused whole and recorded once.
    n_new = torch.full((batch,), tokens * (2 + int(ker[1].n_pages[0].max())), dtype=torch.int64)  # >= 2 pages a head
    need, free = int(ker[1].token_demand(n_new, tokens).sum()), ker[0].num_free
    if need <= free:  # pages held elsewhere (another table, say) until the demand no longer fits
        ker[0].allocate(torch.tensor([free - need + 1]))
        free = ker[0].num_free
    assert need > free, f"seed {seed}: the refusal case does not refuse ({need} <= {free})"
    snap = (ker[1].tables.clone(), ker[1].n_pages.clone(), ker[0].ring.clone())
    grant_token_pages(ker[1], n_new, tokens, ker[0], status, block=block)
    assert status.tolist() == [1, need, free], f"seed {seed}"
    grant_token_pages(ker[1], n_new, tokens, ker[0], status, block=block)
    assert status.tolist() == [1, need, free], "a second refusal overwrote the first record"
    assert torch.equal(ker[1].tables, snap[0]) and torch.equal(ker[1].n_pages, snap[1])
    assert torch.equal(ker[0].ring, snap[2]) and ker[0].num_free == free


def test_token_grant_checks_its_inputs():
    gen, _ = fresh_generator()
    _ref, (fl, table) = _pair((2, 3, 2), 20, 100, 0, gen)
    status = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="n_new must be"):
        grant_token_pages(table, torch.ones(2, dtype=torch.int64), 4, fl, status)
    with pytest.raises(ValueError, match="tokens_per_page"):
        grant_token_pages(table, torch.ones(3, dtype=torch.int64), 0, fl, status)
    assert not fl.stale and table.n_pages.sum() == 0


@pytest.mark.parametrize("shape,block", [((2, 3, 5), 16), ((1, 4, 2), 1024), ((3, 1, 1), 8)])
def test_release_rows_matches_the_deferred_shrink(shape, block):
    """``release_rows`` (one single-program launch) leaves tables, page and token counts, ring and
    counters as the deferred ``shrink_pages`` to zero pages for the released rows, plus zeroed
    token counts, does; the other rows keep everything; releasing nothing moves nothing."""
    gen, seed = fresh_generator()
    batch = shape[1]
    ref, ker = _pair(shape, 40, 600, 999, gen)
    extra = torch.randint(0, 4, (2, *shape), generator=gen, dtype=torch.int32)
    for fl, t in (ref, ker):
        grow_pages(t, extra, fl)
        t.lens.copy_(extra * 3)
    for rows in (torch.rand(batch, generator=gen) < 0.5, torch.zeros(batch, dtype=torch.bool),
                 torch.ones(batch, dtype=torch.bool)):
        keep = torch.where(rows.view(1, 1, -1, 1), torch.zeros_like(ref[1].n_pages), ref[1].n_pages)
        shrink_pages(ref[1], keep, ref[0], defer=True)
        ref[1].lens.masked_fill_(rows.view(1, 1, -1, 1), 0)
        release_rows(ker[1], rows, ker[0], block=block)
        assert ker[0].stale
        _same(ref, ker)
        assert torch.equal(ref[1].lens, ker[1].lens), f"seed {seed}"
    assert ker[1].n_pages.sum() == 0 and (ker[1].tables == -1).all()


def test_release_rows_of_act_tables():
    """The single-sided ACT table (one row per (layer, sequence), ``tiers=1``)."""
    gen, seed = fresh_generator()
    fls, tables = [], []
    perm = torch.randperm(300, generator=gen).to(torch.int32)
    for _ in range(2):
        fl = FreePageList(300)
        fl.ring.copy_(perm)
        table = ActPageTable(3, 5, 64, 2, 8, "cpu")
        grow_pages(table, torch.tensor([[1, 0, 2, 1, 3], [0, 2, 1, 1, 1], [2, 2, 0, 0, 1]], dtype=torch.int32) * 2,
                   fl, tiers=1)
        table.lens.copy_(table.n_pages * 3)
        fls.append(fl)
        tables.append(table)
    rows = torch.tensor([True, False, True, False, False])
    keep = torch.where(rows.view(1, -1), torch.zeros_like(tables[0].n_pages), tables[0].n_pages)
    shrink_pages(tables[0], keep, fls[0], defer=True, tiers=1)
    tables[0].lens.masked_fill_(rows.view(1, -1), 0)
    release_rows(tables[1], rows, fls[1], tiers=1)
    for name in ("tables", "n_pages", "lens"):
        assert torch.equal(getattr(tables[0], name), getattr(tables[1], name)), f"{name} (seed {seed})"
    assert torch.equal(fls[0].ring, fls[1].ring) and fls[0].num_free == fls[1].num_free
    with pytest.raises(ValueError, match="rows must be"):
        release_rows(tables[1], torch.ones(4, dtype=torch.bool), fls[1], tiers=1)


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


@pytest.mark.parametrize("shape,row_len,block", [((3, 4, 3), 20, 256), ((2, 2, 5), 33, 4), ((1, 1, 1), 6, 2)])
@pytest.mark.parametrize("full_rows", [False, True])
def test_move_tail_pages_matches_the_torch_path(shape, row_len, block, full_rows):
    """The one-launch hand-over of emptied high pages to the low side equals the torch path of
    ``BidirectionalPageTable.move_tail``, for any page counts, rows with no free column between the
    sides (a moved page lands in a column a high page leaves), several tiles per row (``block``
    below ``r``) and a subset of the layers in any order."""
    gen, seed = fresh_generator()
    n_layers, batch, heads = shape
    tables = []
    for _ in range(2):
        t = BidirectionalPageTable(n_layers, batch, heads, row_len, "cpu")
        tables.append(t)
    cur_h = torch.randint(0, row_len + 1, shape, generator=gen)
    room = row_len - cur_h
    cur_l = room if full_rows else (torch.rand(shape, generator=gen) * (room + 1)).long().clamp_max(room)
    ids = torch.randperm(n_layers * batch * heads * row_len, generator=gen).view(*shape, row_len).to(torch.int32)
    col = torch.arange(row_len)
    used = (col < cur_h.unsqueeze(-1)) | (col >= row_len - cur_l.unsqueeze(-1))
    for t in tables:
        t.tables.copy_(torch.where(used, ids, torch.full_like(ids, -1)))
        t.n_pages[0].copy_(cur_h)
        t.n_pages[1].copy_(cur_l)
    layers = torch.randperm(n_layers, generator=gen)[: max(1, n_layers - 1)]
    r = (torch.rand(layers.numel(), batch, heads, generator=gen) * (cur_h[layers] + 1)).long()
    r = torch.minimum(r, cur_h[layers])
    tables[0].move_tail(layers, r)  # CPU tables: the torch path
    move_tail_pages(tables[1], layers, r.to(torch.int32), block=block)
    assert torch.equal(tables[0].n_pages, tables[1].n_pages), f"seed {seed}"
    assert torch.equal(tables[0].tables, tables[1].tables), f"seed {seed}"
    assert int(r.sum()) > 0 or r.numel() < 4, f"seed {seed}: nothing moved"
    with pytest.raises(ValueError, match="r must be"):
        move_tail_pages(tables[1], layers, r[:, :1, :1].expand(-1, 1, 1) if batch > 1 else r[:0])


@pytest.mark.parametrize("shape,tokens", [((3, 4, 3), (5, 9)), ((2, 2, 5), (1, 3)), ((1, 1, 1), (7, 7)),
                                          ((2, 3, 2), (4,))])
@pytest.mark.parametrize("with_reserve", [False, True])
def test_plan_tier_pages_matches_torch(shape, tokens, with_reserve):
    """Pages needed, surplus high pages for the low side and the grant of a re-tiering, one
    launch against the torch accounting, for one or two tiers, with and without reserved high
    slots, on a subset of the layers (the others get no grant)."""
    gen, seed = fresh_generator()
    n_layers, batch, heads = shape
    table = BidirectionalPageTable(n_layers, batch, heads, 64, "cpu")
    table.n_pages.copy_(torch.randint(0, 12, table.n_pages.shape, generator=gen, dtype=torch.int32))
    if len(tokens) == 1:
        table.n_pages[1].zero_()
    layers = torch.randperm(n_layers, generator=gen)[: max(1, n_layers - 1)]
    lens = torch.randint(0, 60, (len(tokens), layers.numel(), batch, heads), generator=gen)
    reserve = torch.randint(0, 3, (batch,), generator=gen) if with_reserve else None
    if len(tokens) > 1:  # one head at least downgrades: high pages emptied, the low side short
        lens[:, 0, 0, 0] = torch.tensor([0, 60])
        table.n_pages[:, layers[0], 0, 0] = torch.tensor([5, 0], dtype=torch.int32)
    got = plan_tier_pages(table, layers, lens, tokens, reserve, block=4)
    want = table.tier_plan(layers, lens, tokens, reserve)  # CPU table: the torch path
    for name, g, w in zip(("need", "r", "extra"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name} (seed {seed})"
    assert int(got[1].sum()) > 0 or len(tokens) == 1, f"seed {seed}: no page moves"
    with pytest.raises(ValueError, match="lens must be"):
        plan_tier_pages(table, layers, lens[..., :0], tokens)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_negative_demand_is_refused_and_changes_nothing(monkeypatch, backend):
    """A prefix sum over a negative demand would hand the same pages to two heads."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    free, table = FreePageList(20), BidirectionalPageTable(1, 1, 2, 8, "cpu")
    table.grow(torch.tensor([[[[3, 2]]], [[[0, 0]]]], dtype=torch.int32), free)
    before = table.tables.clone(), table.n_pages.clone(), free.num_free
    with pytest.raises(ValueError, match="negative"):
        table.grow(torch.tensor([[[[-2, 3]]], [[[0, 0]]]], dtype=torch.int32), free)
    assert torch.equal(table.tables, before[0]) and torch.equal(table.n_pages, before[1]) and free.num_free == before[2]


def test_a_deferred_grant_reads_a_negative_demand_as_none():
    """The deferred kernel grant reads nothing back, so it cannot raise: it grants 0 there, and every
    page it hands out has one owner."""
    free, table = FreePageList(20), BidirectionalPageTable(1, 1, 2, 8, "cpu")
    grow_pages(table, torch.tensor([[[[3, 2]]], [[[0, 0]]]], dtype=torch.int32), free)
    status = torch.zeros(3, dtype=torch.int64)
    grow_pages(table, torch.tensor([[[[-2, 3]]], [[[0, 0]]]], dtype=torch.int32), free, status=status, taken=3)
    assert table.n_pages[0].view(-1).tolist() == [3, 5] and status.tolist() == [0, 0, 0]
    held = table.tables[table.tables >= 0]
    assert held.numel() == 8 and held.unique().numel() == 8  # no page twice


def test_a_multi_program_deferred_grant_reads_a_negative_demand_as_none(monkeypatch):
    """Past SINGLE_GRANT_MAX requesters the deferred grant runs the many-program grow: its head
    counter advances by the pages the kernel hands out (a negative demand is none), so the next
    grant never hands a held page out again."""
    from leankit_kernels import page_alloc

    monkeypatch.setattr(page_alloc, "SINGLE_GRANT_MAX", 0)
    free, table = FreePageList(20), BidirectionalPageTable(1, 1, 2, 8, "cpu")
    grow_pages(table, torch.tensor([[[[3, 2]]], [[[0, 0]]]], dtype=torch.int32), free)
    status = torch.zeros(3, dtype=torch.int64)
    grow_pages(table, torch.tensor([[[[-2, 3]]], [[[0, 0]]]], dtype=torch.int32), free, status=status, taken=3)
    assert table.n_pages[0].view(-1).tolist() == [3, 5] and status.tolist() == [0, 0, 0]
    assert free.num_free == 12
    rest = BidirectionalPageTable(1, 1, 1, 20, "cpu")
    grow_pages(rest, torch.tensor([[[[12]]], [[[0]]]], dtype=torch.int32), free)
    held = torch.cat([table.tables[table.tables >= 0], rest.tables[rest.tables >= 0]])
    assert held.numel() == 20 and held.unique().numel() == 20  # no page twice


def test_an_eager_grow_refuses_a_negative_demand_and_changes_nothing():
    """grow_pages called directly (no ``total`` read by the page table): the prefix sum would hand
    the same pages out twice, so it raises as BidirectionalPageTable.grow does."""
    free, table = FreePageList(20), BidirectionalPageTable(1, 1, 2, 8, "cpu")
    grow_pages(table, torch.tensor([[[[3, 2]]], [[[0, 0]]]], dtype=torch.int32), free)
    before = table.tables.clone(), table.n_pages.clone(), free.num_free
    with pytest.raises(ValueError, match="negative"):
        grow_pages(table, torch.tensor([[[[-2, 3]]], [[[0, 0]]]], dtype=torch.int32), free)
    assert torch.equal(table.tables, before[0]) and torch.equal(table.n_pages, before[1]) and free.num_free == before[2]


@pytest.mark.parametrize("status", [False, True])
def test_a_demand_not_shaped_like_the_table_is_refused(status):
    """The kernels read ``extra`` flat, one demand per ``n_pages`` entry: a demand of one layer for
    a two-layer table would land on the wrong heads and tiers, a longer one past ``n_pages``."""
    for shape in ((2, 1, 1, 2), (2, 3, 1, 2)):
        free, table = FreePageList(40), BidirectionalPageTable(2, 1, 2, 8, "cpu")
        kw = {"status": torch.zeros(3, dtype=torch.int64)} if status else {}
        with pytest.raises(ValueError, match="shaped like n_pages"):
            grow_pages(table, torch.ones(shape, dtype=torch.int32), free, **kw)
        assert not table.n_pages.any() and free.num_free == 40
