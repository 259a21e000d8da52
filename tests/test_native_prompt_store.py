"""The compiled LeanKV prompt store (``leankit.native``, ``prompt_store.c``) against the torch path
it replaces on a CPU: the prompt-phase rule (:func:`leankit.policy.prompt_classes`) output for
output, and the ranked store (``lk_store_ranked``) byte for byte against the per-token store
(``lk_store_tokens``, itself checked against the torch encoder in ``test_native_store.py``) at the
slots the ranks name.
"""

import copy

import pytest
import torch
from leankit_kernels.testing import assert_same_prompt_classes, fresh_generator, prompt_rule_inputs

from leankit import native
from leankit.allocator import FreePageList
from leankit.config import KVConfig
from leankit.page_table import BidirectionalPageTable
from leankit.pages import PageLayout, PagePool
from leankit.policy import KEEP_HIGH, KEEP_LOW, PRUNED, prompt_classes
from leankit.quant import NonFiniteKVError

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler for leankit.native")


@pytest.mark.parametrize("batch,heads,nq", [(1, 1, 1), (3, 2, 37), (2, 3, 301), (1, 5, 1000)])
@pytest.mark.parametrize("th,tl", [(0.25, 0.0), (0.4, 0.1), (0.3, 0.3), (0.95, 0.6), (0.0, 0.0), (1.5, 1.2)])
@pytest.mark.parametrize("ties,pruned", [(False, False), (True, True)])
def test_prompt_classes_match_the_torch_rule(batch, heads, nq, th, tl, ties, pruned):
    """Every output equals the torch rule's, for thresholds no token reaches, heads with mass
    already pruned and tied scores."""
    gen, seed = fresh_generator()
    received, pos, real, q_last, pm, lens = prompt_rule_inputs(batch, heads, nq, gen, ties, pruned)
    window = int(torch.randint(0, 6, (1,), generator=gen))
    got = kernels.prompt_classes(received, pos, real, q_last, pm, lens, window, th, tl)
    assert_same_prompt_classes(got, prompt_classes(received, pos, real, q_last, pm, lens, window, th, tl), real, seed)


def test_prompt_classes_read_strided_inputs():
    """The model's significance as a strided view and one layer's counts sliced out of the page
    table's ``[2, L, B, H]`` are read in place, with the results of contiguous copies."""
    gen, seed = fresh_generator()
    received, pos, real, q_last, pm, lens = prompt_rule_inputs(2, 3, 45, gen, False, True)
    strided = received.transpose(1, 2).contiguous().transpose(1, 2)
    table_lens = torch.randint(0, 9, (2, 4, 2, 3), generator=gen, dtype=torch.int32)
    table_lens[:, 2] = lens
    got = kernels.prompt_classes(strided, pos.long(), real, q_last, pm, table_lens[:, 2], 2, 0.3, 0.1)
    assert_same_prompt_classes(got, prompt_classes(received, pos, real, q_last, pm, lens, 2, 0.3, 0.1), real, seed)


def test_prompt_classes_take_non_finite_significance_as_the_torch_rule_does():
    """A NaN or infinite received mass carries no mass to the cut-offs; NaN passes none of them
    (pruned, as ``nan >= tau`` is false) and a NaN total makes Z = 1, on both paths."""
    gen, seed = fresh_generator()
    received, pos, real, q_last, pm, lens = prompt_rule_inputs(2, 2, 40, gen, False, False)
    real[:] = True
    pos = torch.arange(40, dtype=torch.int32).expand(2, 40).contiguous()
    q_last = torch.full((2,), 39)
    received[0, 0, 3] = float("inf")
    received[0, 1, 5] = float("-inf")
    received[1, 0, 7] = float("nan")
    got = kernels.prompt_classes(received, pos, real, q_last, pm, lens, 2, 0.3, 0.1)
    want = prompt_classes(received, pos, real, q_last, pm, lens, 2, 0.3, 0.1)
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3]), f"seed {seed}"
    assert got[1][1, 0, 7] == PRUNED and got[1][0, 0, 3] == KEEP_HIGH


def test_prompt_classes_refuse_bad_shapes():
    received, pos, real = torch.rand(2, 3, 5), torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, 5, dtype=torch.bool)
    q_last, pm, lens = torch.zeros(2, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 2, 3, dtype=torch.int32)
    for bad in ((received[0], pos, real, q_last, pm, lens), (received, pos[:, :4], real, q_last, pm, lens),
                (received.double(), pos, real, q_last, pm, lens), (received, pos, real, q_last, pm, lens[0])):
        with pytest.raises(ValueError, match="prompt_classes"):
            kernels.prompt_classes(*bad, 1, 0.3, 0.1)


def _store_case(gen, spec, tier, batch, heads, nq, dim, tokens_free=2):
    """A layer's page table with room for every head's count plus its prompt, a pool of random
    bytes, and a classified random prompt."""
    cfg = KVConfig.parse(spec)
    layout = PageLayout.build(cfg, tier, dim, torch.float32)
    lens = torch.randint(0, 3 * layout.tokens, (2, batch, heads), generator=gen, dtype=torch.int32)
    row_len = 2 * (-(-(lens.max().item() + nq) // layout.tokens) + tokens_free)
    table = BidirectionalPageTable(1, batch, heads, row_len, "cpu")
    free = FreePageList(table.tables.numel())
    extra = torch.zeros_like(table.n_pages)
    extra[tier, 0] = -(-(lens[tier] + nq) // layout.tokens)
    table.grow(extra, free)
    pool = PagePool(free.capacity, cfg.page_size, torch.device("cpu"))
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8, generator=gen))
    k = torch.randn(batch, heads, nq, dim, generator=gen) * 3
    v = torch.randn(batch, heads, nq, dim, generator=gen)
    cls = torch.randint(-1, 3, (batch, heads, nq), generator=gen).to(torch.int8)
    take = [(cls == c).long() for c in (KEEP_HIGH, KEEP_LOW)]
    rank = torch.where(cls == KEEP_LOW, take[1].cumsum(-1), take[0].cumsum(-1)) - 1
    q_pos = torch.randint(0, 1 << 20, (batch, nq), generator=gen)
    score = torch.rand(batch, heads, nq, generator=gen) * 3
    return layout, table, pool, lens, k, v, cls, rank, q_pos, score


@pytest.mark.parametrize("spec,tier", [("K8V4-K4V2", 0), ("K8V4-K4V2", 1), ("K4V2:group_size=32", 0), ("FP16", 0)])
@pytest.mark.parametrize("batch,heads,nq", [(1, 1, 1), (2, 3, 29), (3, 2, 130)])
def test_store_ranked_writes_what_store_tokens_writes_at_the_ranked_slots(spec, tier, batch, heads, nq):
    gen, seed = fresh_generator()
    dim = 64
    layout, table, pool, lens, k, v, cls, rank, q_pos, score = _store_case(gen, spec, tier, batch, heads, nq, dim)
    want_cls = KEEP_LOW if tier else KEEP_HIGH
    k_fmt = native.side_format(layout.precision.k_bits, layout.dense_dtype)
    v_fmt = native.side_format(layout.precision.v_bits, layout.dense_dtype)
    first, step = table.tier_columns(tier)
    expected = pool.storage.clone()
    # the per-token store at the slots the ranks name
    b, h = torch.meshgrid(torch.arange(batch), torch.arange(heads), indexing="ij")
    b, h = b.reshape(-1, 1).expand(-1, nq).reshape(-1), h.reshape(-1, 1).expand(-1, nq).reshape(-1)
    slot = (lens[tier].long().unsqueeze(-1) + rank).clamp_min(0).reshape(-1)
    page, off = table.locate(tier, 0, b, h, slot, layout.tokens)
    page = torch.where(cls.reshape(-1) == want_cls, page.long(), -1)
    kernels.store_tokens(expected, layout.tokens, layout.seg_offsets, page.contiguous(), off.long().contiguous(),
                         k.reshape(-1, dim), v.reshape(-1, dim),
                         q_pos.unsqueeze(1).expand(batch, heads, nq).reshape(-1).to(torch.int32).contiguous(),
                         score.reshape(-1), k_fmt, v_fmt, layout.group_size)
    lens_before = lens.clone()
    kernels.store_ranked(pool.storage, table.tables[0], first, step, lens[tier].contiguous(), layout.tokens,
                         layout.seg_offsets, k, v, q_pos, cls, rank, want_cls, score, k_fmt, v_fmt, layout.group_size)
    assert torch.equal(pool.storage, expected), f"seed {seed}"
    assert torch.equal(lens, lens_before)


def test_store_ranked_refuses_with_nothing_written():
    """A kept token whose slot has no page, and a NaN key, are refused before any byte moves."""
    gen, seed = fresh_generator()
    layout, table, pool, lens, k, v, cls, rank, q_pos, score = _store_case(gen, "K8V4", 0, 2, 2, 17, 64)
    cls[:] = KEEP_HIGH
    rank = torch.arange(17).expand(2, 2, 17).contiguous()
    k_fmt = native.side_format(layout.precision.k_bits, layout.dense_dtype)
    v_fmt = native.side_format(layout.precision.v_bits, layout.dense_dtype)
    before = pool.storage.clone()
    args = (layout.tokens, layout.seg_offsets)
    far = rank + 10 * table.row_len * layout.tokens  # past every page of the row
    with pytest.raises(ValueError, match="no page"):
        kernels.store_ranked(pool.storage, table.tables[0], 0, 1, lens[0].contiguous(), *args, k, v, q_pos, cls, far,
                             KEEP_HIGH, score, k_fmt, v_fmt, layout.group_size)
    k[1, 1, 16, 3] = float("nan")
    with pytest.raises(NonFiniteKVError):
        kernels.store_ranked(pool.storage, table.tables[0], 0, 1, lens[0].contiguous(), *args, k, v, q_pos, cls, rank,
                             KEEP_HIGH, score, k_fmt, v_fmt, layout.group_size)
    assert torch.equal(pool.storage, before), f"seed {seed}"


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3"])
@pytest.mark.parametrize("spec", ["K8V4-K4V2:th=0.25,tl=0,group_size=16,rotate=1,window=8",
                                  "K8V4-K4V2:th=0.3,tl=0.05,window=8", "K8V4-K4V2:th=0.5,tl=0.2,window=0",
                                  "K8V4:policy=leankv,tl=0.2,window=8", "K8V4", "FP16"])
def test_a_prompt_stored_compiled_leaves_the_cache_the_torch_path_leaves(monkeypatch, kind, spec):
    """A left-padded batch's prefill, then a second turn of several tokens: through the LeanKV
    policy the compiled classification, page grants, ranked stores and recycle, and through every
    policy the compiled store of a step's tokens at their ranks, leave the same pool bytes, page
    tables, counts and pruned mass as the torch path (``kernels_for`` switched off). After the turn
    only the first layer's keys and values are compared byte for byte: the later layers' come from
    attention over the pages, which the compiled passes sum in another order."""
    import leankit.native
    from leankit import KVConfig, LeanCache
    from leankit.hf import cache_kwargs, enable
    from leankit.testing import left_padded_batch, tiny_model

    model = tiny_model(kind)
    enable(model)
    ids, mask = left_padded_batch(rows=3, width=57, seed=len(spec), pad_step=9)
    turn = torch.randint(3, 90, (3, 6), generator=torch.Generator().manual_seed(1))
    steps = [(ids, mask), (turn, torch.cat([mask, torch.ones_like(turn)], 1))]
    caches = [LeanCache(model, KVConfig.parse(spec), max_seq_len=80) for _ in range(2)]
    calls = {"store_ranked": 0, "prompt_layer": 0}

    def counting(name):
        method = getattr(leankit.native.Kernels, name)

        def counted(self, *args):
            calls[name] += 1
            return method(self, *args)
        return counted

    for name in calls:
        monkeypatch.setattr(leankit.native.Kernels, name, counting(name))
    leankv_prompt = "K4V2" in spec or "leankv" in spec
    for i, (step_ids, step_mask) in enumerate(steps):
        for cache, compiled in zip(caches, (True, False)):
            with monkeypatch.context() as m, torch.no_grad():
                if not compiled:
                    m.setattr(leankit.native, "kernels_for", lambda device: None)
                calls.update(store_ranked=0, prompt_layer=0)
                model(input_ids=step_ids, attention_mask=step_mask, **cache_kwargs(model, cache), use_cache=True)
                assert (calls["store_ranked"] + calls["prompt_layer"] > 0) == compiled, \
                    "the compiled run stores through lk_store_ranked or lk_prompt_layer"
                # a LeanKV prompt's layer is one lk_prompt_layer call; other steps store ranked tokens
                assert calls["prompt_layer"] == (cache.num_layers if compiled and i == 0 and leankv_prompt else 0)
        got, want = caches
        if i == 0 and leankv_prompt:
            pruned = want.policy.pruned_mass
            assert (want.table.lens[1] > 0).any() == ("K4V2" in spec), "the case sends no token low"
            assert pruned.gt(0).any() == ("tl=0," not in spec), "the case prunes nothing"
            torch.testing.assert_close(got.policy.pruned_mass, pruned, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.table.lens, want.table.lens) and torch.equal(got.table.n_pages, want.table.n_pages)
        assert torch.equal(got.table.tables, want.table.tables)
        layers = None if i == 0 else [0]
        for a, b in zip(_live_slots(got, layers), _live_slots(want, layers)):  # a free slot holds any bytes
            assert torch.equal(a, b), f"step {i}"
        assert (got.free_list.free_head, got.free_list.free_tail) == (want.free_list.free_head,
                                                                      want.free_list.free_tail)


def _live_slots(cache, layers=None):
    """The stored tokens' bytes (each segment of each tier's live slots, in slot order) of every
    layer, or of ``layers`` without their significance (which attention over the pages feeds)."""
    from leankit.pages import SEGMENTS
    from leankit.policy import locate_slots, read_tier_meta

    names = SEGMENTS if layers is None else [n for n in SEGMENTS if n != "score"]
    layers = torch.arange(cache.table.shape[0]) if layers is None else torch.tensor(layers)
    out = []
    for tier, layout in enumerate(cache.layouts):
        meta = read_tier_meta(cache, tier, layers)
        lay, b, h, slot = meta.valid.nonzero(as_tuple=True)
        page, off = locate_slots(cache.table, tier, layers[lay], b, h, slot, layout.tokens)
        out += [cache.pool.read_rows(layout, page, off, name) for name, nb in zip(SEGMENTS, layout.seg_bytes)
                if nb and name in names]
    return out


def _prompt_layer_case(gen, spec, batch, heads, nq, num_layers=3, dim=64, fresh=False, row_len=None):
    """A LeanKV prompt's layer ready for the store: the rule's random inputs (``prompt_rule_inputs``),
    a table of ``num_layers`` layers whose heads already hold pages for their counts (a prompt
    after a turn, or another layer's; none when ``fresh``) in rows of ``row_len`` columns (else
    room for the prompt too), a free list with room for everything and a pool of random bytes,
    random K/V, the tiers' layouts and ``prompt_layer``'s geometry rows."""
    cfg = KVConfig.parse(spec)
    layouts = [PageLayout.build(cfg, t, dim, torch.float32) for t in range(len(cfg.tiers))]
    received, q_pos, real, q_last, pruned_mass, lens = prompt_rule_inputs(batch, heads, nq, gen, ties=False,
                                                                         pruned=False)
    lens = torch.zeros_like(lens) if fresh else lens
    tokens = [lay.tokens for lay in layouts] + [1]
    held = torch.stack([-(-lens[t].long() // tokens[t]) for t in range(2)]) if len(layouts) > 1 else \
        torch.stack([-(-lens[0].long() // tokens[0]), torch.zeros_like(lens[0].long())])
    lens = lens if len(layouts) > 1 else torch.stack([lens[0], torch.zeros_like(lens[0])])
    row_len = row_len or int(held.sum(0).max()) + -(-nq // min(tokens[: len(layouts)])) + 2
    table = BidirectionalPageTable(num_layers, batch, heads, row_len, "cpu")
    free = FreePageList(table.tables.numel() + 1)
    table.grow(held.unsqueeze(1).expand(2, num_layers, batch, heads).to(torch.int32).contiguous(), free)
    table.lens.copy_(lens.unsqueeze(1).expand_as(table.lens))
    pool = PagePool(free.capacity, cfg.page_size, torch.device("cpu"))
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8, generator=gen))
    k = torch.randn(batch, heads, nq, dim, generator=gen) * 3
    v = torch.randn(batch, heads, nq, dim, generator=gen)
    rows = tuple((lay.tokens, native.side_format(lay.precision.k_bits, lay.dense_dtype),
                  native.side_format(lay.precision.v_bits, lay.dense_dtype), lay.group_size, lay.seg_offsets)
                 for lay in layouts)
    rule = (received, q_pos.long(), real, q_last, pruned_mass, 8, cfg.th if len(layouts) > 1 else cfg.tl, cfg.tl)
    return layouts, table, free, pool, rule, k, v, kernels.prompt_geometry(rows, dim)


def _layer_state(table, free, pool, pruned_mass):
    return (table.tables.clone(), table.n_pages.clone(), table.lens.clone(), free.ring.clone(), free.free_head,
            free.free_tail, pool.storage.clone(), pruned_mass.clone())


def _one_call(table, free, pool, rule, layer, geometry, k, v):
    """``lk_prompt_layer`` as ``LeanCache.store_prompt_layer`` closes it: the free list advanced by
    what it took and returned. Returns ``(code, stage)``."""
    code, stage, taken, freed = kernels.prompt_layer(*rule, table.tables, table.n_pages, table.lens, layer, free.ring,
                                                     free.free_head, free.free_tail, pool.storage, geometry, k, v)
    if stage:
        free.took(taken)
        free.returned(freed)
    return code, stage


@pytest.mark.parametrize("spec", ["K8V4-K4V2:th=0.3,tl=0.05", "K8V4-K4V2:th=0.25,tl=0,group_size=32",
                                  "K8V4:policy=leankv,tl=0.2", "K4V2-K4V2:th=0.5,tl=0.2,group_size=16"])
@pytest.mark.parametrize("batch,heads,nq", [(1, 1, 1), (2, 3, 45), (3, 2, 300)])
def test_prompt_layer_is_the_five_calls_in_one(spec, batch, heads, nq):
    """``lk_prompt_layer`` leaves the tables, counts, ring, pool bytes and pruned mass the five calls
    it replaces leave, one by one (the rule, the plan and grant, each tier's ranked store, the
    pruned mass, the settle), bit for bit, on a layer between two others that keep their pages."""
    gen, seed = fresh_generator()
    layouts, table, free, pool, rule, k, v, geometry = _prompt_layer_case(gen, spec, batch, heads, nq)
    layer, tiers = 1, len(layouts)
    t2, f2, p2 = copy.deepcopy((table, free, pool))
    received, q_pos, real, q_last, pruned_mass, window, th, tl = rule
    pm2 = pruned_mass.clone()
    # one by one, as LeanKVPolicy.store ran them
    layers = torch.tensor([layer])
    score, cls, rank, new_lens, pruned = kernels.prompt_classes(received, q_pos, real, q_last, pm2,
                                                                t2.lens[:, layer], window, th, tl)
    need = t2.fit(layers, new_lens[:tiers], tuple(lay.tokens for lay in layouts), f2)
    for tier, (want, lay) in enumerate(zip((KEEP_HIGH, KEEP_LOW), layouts)):
        first, step = t2.tier_columns(tier)
        kernels.store_ranked(p2.storage, t2.tables[layer], first, step, t2.lens[tier, layer].contiguous(), lay.tokens,
                             lay.seg_offsets, k, v, q_pos, cls, rank, want, score,
                             native.side_format(lay.precision.k_bits, lay.dense_dtype),
                             native.side_format(lay.precision.v_bits, lay.dense_dtype), lay.group_size)
    pm2 += pruned
    t2.settle(layers, new_lens, need, f2)
    assert _one_call(table, free, pool, rule, layer, geometry, k, v) == (0, 2)
    for name, got, want in zip(("tables", "n_pages", "lens", "ring", "head", "tail", "pool", "pruned mass"),
                               _layer_state(table, free, pool, pruned_mass), _layer_state(t2, f2, p2, pm2)):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want, f"{name} (seed {seed})"
    if nq >= 45:  # the case sends tokens to every tier, and prunes some where tl > 0
        classes = [KEEP_HIGH, KEEP_LOW][:tiers] + ([PRUNED] if tl > 0 else [])
        assert all((cls == c).any() for c in classes), f"{[int((cls == c).sum()) for c in range(3)]} (seed {seed})"


def test_prompt_layer_refusals_change_nothing_and_say_why():
    """A short pool and a row without room are refused before anything moves (stage 0, the pages
    asked for); NaN in a kept key fails the store after the grant (stage 1, the pages it took, no
    count moved, no pruned mass added); bad shapes are refused in Python."""
    gen, seed = fresh_generator()
    spec, case = "K8V4-K4V2:th=0.3,tl=0.05", (2, 3, 60)
    # a pool with no free page, then rows of one column, for a fresh layer's prompt
    for shrink in ("pool", "row"):
        _, table, free, pool, rule, k, v, geometry = _prompt_layer_case(
            gen, spec, *case, fresh=True, row_len=1 if shrink == "row" else None)
        if shrink == "pool":
            free.took(free.num_free)
        before = _layer_state(table, free, pool, rule[4])
        code, stage, taken, freed = kernels.prompt_layer(*rule, table.tables, table.n_pages, table.lens, 1,
                                                         free.ring, free.free_head, free.free_tail, pool.storage,
                                                         geometry, k, v)
        want = native.POOL_SHORT if shrink == "pool" else native.ROW_FULL
        assert (code, stage, freed) == (want, 0, 0) and taken > 0, f"{shrink} (seed {seed})"
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(_layer_state(table, free, pool, rule[4]), before)), f"{shrink} (seed {seed})"
    # NaN in every key: some kept token's store fails after the grant
    _, table, free, pool, rule, k, v, geometry = _prompt_layer_case(gen, spec, *case)
    lens, pm, head, held = table.lens.clone(), rule[4].clone(), free.free_head, int(table.n_pages.sum())
    code, stage, taken, freed = kernels.prompt_layer(*rule, table.tables, table.n_pages, table.lens, 1, free.ring,
                                                     free.free_head, free.free_tail, pool.storage, geometry,
                                                     torch.full_like(k, float("nan")), v)
    assert (code, stage, freed) == (-5, 1, 0) and taken == int(table.n_pages.sum()) - held > 0, f"seed {seed}"
    assert torch.equal(table.lens, lens) and torch.equal(rule[4], pm) and free.free_head == head
    with pytest.raises(ValueError, match="prompt_layer"):
        kernels.prompt_layer(*rule, table.tables, table.n_pages, table.lens, 3, free.ring, free.free_head,
                             free.free_tail, pool.storage, geometry, k, v)
    with pytest.raises(ValueError, match="prompt_layer"):
        kernels.prompt_layer(*rule, table.tables, table.n_pages, table.lens, 1, free.ring, free.free_head,
                             free.free_tail, pool.storage, geometry, k[:, :, :-1], v)
