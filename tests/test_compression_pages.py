"""Real reclaim: pruning frees slots and pages, allocation stays batched, nothing leaks."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leankit.cache import LeanCache
from leankit.hf import cache_kwargs
from leankit.page_table import HIGH, LOW

PAGE = 256


def make_cache(model, spec, **kw):
    """A LeanCache whose pool starts filled with 0xFF (NaN scores, -1 positions in dead slots)."""
    cache = LeanCache(model, spec, page_size=PAGE, max_seq_len=256, **kw)
    cache.pool.storage.fill_(0xFF)
    return cache


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def prompt(batch=2, n=90, pad=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, n), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :pad] = 0
    return ids, mask


def check_table(cache: LeanCache) -> None:
    """Every used page is owned exactly once, no free page is owned, no tier holds an empty page."""
    table = cache.table
    owned = table.tables[table.tables >= 0].long()
    assert owned.numel() == int(table.n_pages.sum())
    assert owned.unique().numel() == owned.numel(), "a page is owned twice"
    free = cache.free_list.free_ids().long()
    assert not bool(torch.isin(owned, free).any()), "an owned page is on the free list"
    assert owned.numel() + free.numel() == cache.free_list.capacity
    for t, layout in enumerate(cache.layouts):
        need = -torch.div(-table.lens[t], layout.tokens, rounding_mode="floor")
        assert torch.equal(table.n_pages[t], need), f"tier {t} holds pages it does not need"
    used_cols = (table.tables >= 0).sum(-1)
    assert torch.equal(used_cols, table.n_pages.sum(0))


def forward_steps(model, cache, ids, mask, decode=6, chunk=None):
    """Prefill, then greedy one-token steps (and optionally one chunk), checking the table each step."""
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache))
        check_table(cache)
        nxt = out.logits[:, -1:].argmax(-1)
        last = pos[:, -1:]
        for _ in range(decode):
            before = cache.table.n_pages.clone()
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            last = last + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=last, **cache_kwargs(model, cache))
            check_table(cache)
            growth = (cache.table.n_pages - before).clamp_min(0).sum(0)
            assert int(growth.max()) <= 1, "a head took more than one page in a decode step"
            nxt = out.logits[:, -1:].argmax(-1)
        if chunk:
            ext = torch.randint(3, 96, (ids.shape[0], chunk))
            mask = torch.cat([mask, torch.ones_like(ext)], 1)
            p = last + torch.arange(1, chunk + 1)
            model(input_ids=ext, attention_mask=mask, position_ids=p, **cache_kwargs(model, cache))
            check_table(cache)
    return cache


CONFIGS = [
    ("K8V4", {}),
    ("K8V4-K4V2", {"th": 0.3, "tl": 0.0, "window": 16}),
    ("K8V4-K4V2", {"th": 0.3, "tl": 0.05, "window": 16}),
    ("K8V4", {"policy": "leankv", "tl": 0.08, "window": 16}),
    ("K8V4", {"policy": "h2o", "budget": 0.3}),
    ("K8V4", {"policy": "streaming", "window": 16, "sink": 4}),
]
IDS = ["full", "leankv-noprune", "leankv-prune", "leankv-1tier", "h2o", "streaming"]


@pytest.mark.parametrize("spec,kw", CONFIGS, ids=IDS)
def test_table_stays_tight_and_nothing_leaks(model, spec, kw):
    ids, mask = prompt()
    cache = make_cache(model, spec, **kw)
    forward_steps(model, cache, ids, mask, decode=5, chunk=20)
    report = cache.memory_report()
    assert report["kv_bytes"] == report["pages_used"] * PAGE
    t = report["slots_per_tier"]
    assert t["high"] + t["low"] == int(cache.table.lens.sum())
    # A finished request gives back every page.
    freed = cache.release(torch.ones(2, dtype=torch.bool))
    assert freed > 0
    assert cache.free_list.num_free == cache.free_list.capacity
    assert cache.memory_report()["pages_used"] == 0


def test_pruning_uses_fewer_pages_than_no_pruning(model):
    ids, mask = prompt(batch=1, n=160)
    used = {}
    for tl in (0.0, 0.1):
        cache = make_cache(model, "K8V4-K4V2", th=0.3, tl=tl, window=16)
        forward_steps(model, cache, ids, mask, decode=3)
        r = cache.memory_report()
        used[tl] = r["pages_used"]
        if tl == 0.0:
            assert r["tokens_per_tier"]["pruned"] == 0
        else:
            assert r["tokens_per_tier"]["pruned"] > 0
    assert used[0.1] < used[0.0]


def test_prompt_recycles_pages_right_after_each_layer(model):
    """The conservative all-high prompt allocation shrinks as each layer is classified."""
    ids, mask = prompt(batch=1, n=160)
    full = make_cache(model, "K8V4")
    lean = make_cache(model, "K8V4-K4V2", th=0.5, tl=0.05, window=16)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, full))
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, lean))
    check_table(lean)  # exactly the pages the classified tokens need are left
    assert lean.memory_report()["pages_used"] < full.memory_report()["pages_used"]
    # Low-tier tokens live in their own pages, taken from the right end of each row.
    table = lean.table
    n_low = table.n_pages[LOW]
    assert int(n_low.sum()) > 0
    r = table.row_len
    for l_, b_, h_ in torch.nonzero(n_low).tolist():
        k = int(n_low[l_, b_, h_])
        assert bool((table.tables[l_, b_, h_, r - k:] >= 0).all())
        assert int(table.n_pages[HIGH, l_, b_, h_]) + k <= r


def test_page_calls_are_batched(model, monkeypatch):
    from leankit.page_table import BidirectionalPageTable

    calls = {"grow": 0, "shrink": 0}
    # LeanCache.grow_pages is the one batched allocation (it retries once itself after growing an
    # elastic pool); BidirectionalPageTable.shrink is the one batched recycle. On a CPU with the
    # compiled kernels a LeanKV prompt's layer plans and grants in one BidirectionalPageTable.fit
    # and sets its counts and recycles in one BidirectionalPageTable.settle (each None where it
    # leaves the work to the others), or does both, with the rule and the stores, in one
    # LeanCache.store_prompt_layer (False where it leaves the layer to those calls).
    for owner, meth, key in ((LeanCache, "grow_pages", "grow"), (BidirectionalPageTable, "shrink", "shrink"),
                             (BidirectionalPageTable, "fit", "grow"), (BidirectionalPageTable, "settle", "shrink"),
                             (LeanCache, "store_prompt_layer", ("grow", "shrink"))):
        orig, keys = getattr(owner, meth), key if isinstance(key, tuple) else (key,)

        def counted(self, *a, _orig=orig, _keys=keys, _may_pass=meth in ("fit", "settle", "store_prompt_layer"), **k):
            out = _orig(self, *a, **k)
            for name in _keys:
                calls[name] += not (_may_pass and out in (None, False))
            return out

        monkeypatch.setattr(owner, meth, counted)
    ids, mask = prompt(batch=2, n=90)
    cache = make_cache(model, "K8V4-K4V2", th=0.3, tl=0.05, window=16)
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        # Prefill: one grow for all layers at begin_step, then per layer at most one grow (low pages
        # the relabelled high pages cannot cover) and one recycle.
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache))
        assert calls["grow"] <= 1 + layers and 1 <= calls["shrink"] <= layers
        nxt, last = out.logits[:, -1:].argmax(-1), pos[:, -1:]
        for _ in range(20):
            calls.update(grow=0, shrink=0)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            last = last + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=last, **cache_kwargs(model, cache))
            nxt = out.logits[:, -1:].argmax(-1)
            assert calls["grow"] <= 1 and calls["shrink"] <= 1, "a decode step makes one batched call"


def test_leankv_without_compression_is_uniform_high_precision(model):
    """Th = Tl = 0 keeps every token high: logits equal the single-tier K8V4 cache exactly."""
    ids, mask = prompt()
    outs = []
    for spec, kw in (("K8V4", {}), ("K8V4-K4V2", {"th": 0.0, "tl": 0.0, "window": 8})):
        cache = make_cache(model, spec, **kw)
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=8,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
        outs.append(torch.stack(g.logits))
        assert cache.memory_report()["tokens_per_tier"]["low"] == 0
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_h2o_same_budget_for_every_head(model):
    ids, mask = prompt(batch=1, n=100)
    cache = make_cache(model, "K8V4", policy="h2o", budget=0.25)
    forward_steps(model, cache, ids, mask, decode=4)
    lens = cache.table.lens[HIGH, :, 0]
    n = 100 + 4
    assert bool((lens == int(torch.ceil(torch.tensor(0.25 * n)))).all())


def test_streaming_keeps_sinks_and_window(model):
    ids, mask = prompt(batch=1, n=100)
    cache = make_cache(model, "FP16", policy="streaming", window=12, sink=3)
    forward_steps(model, cache, ids, mask, decode=4)
    from leankit.policy import read_tier_meta

    m = read_tier_meta(cache, HIGH, torch.arange(3))
    for pos, valid in zip(m.pos.reshape(-1, m.pos.shape[-1]), m.valid.reshape(-1, m.pos.shape[-1])):
        kept = sorted(pos[valid].tolist())
        assert kept == [0, 1, 2] + list(range(104 - 12, 104))


def test_beam_search_with_leankv(model):
    ids, mask = prompt(batch=1, n=60)
    cache = make_cache(model, "K8V4-K4V2", th=0.3, tl=0.05, window=8)
    with torch.no_grad():
        out = model.generate(input_ids=ids.expand(2, -1), attention_mask=mask.expand(2, -1), **cache_kwargs(model, cache),
                             max_new_tokens=5, do_sample=False, num_beams=2, num_return_sequences=1)
    assert out.shape[1] == 65
    check_table(cache)


@pytest.mark.parametrize("th", [0.6, 0.95])
def test_relabel_with_tight_rows(model, th):
    """Rows barely longer than the prompt: the high pages handed to the low side overlap the
    columns they land in, and most tokens go low."""
    ids, mask = prompt(batch=2, n=160)
    cache = LeanCache(model, "K8V4-K4V2", th=th, tl=0.0, window=8, page_size=PAGE, max_seq_len=170)
    cache.pool.storage.fill_(0xFF)
    forward_steps(model, cache, ids, mask, decode=4)
    assert cache.memory_report()["tokens_per_tier"]["low"] > cache.memory_report()["tokens_per_tier"]["high"]


def test_needle_survival_counts_stored_positions(model):
    from eval.needle import needle_survival

    ids, mask = prompt(batch=1, n=100)
    full = make_cache(model, "K8V4")
    stream = make_cache(model, "K8V4", policy="streaming", window=12, sink=3)
    for cache in (full, stream):
        forward_steps(model, cache, ids, mask, decode=0)
    middle, edge = [40, 41, 42], [1, 2, 95]
    shape = (full.num_layers, full.num_kv_heads)
    assert torch.equal(needle_survival(full, middle), torch.full(shape, 3))
    assert torch.equal(needle_survival(stream, middle), torch.zeros(shape, dtype=torch.long))
    assert torch.equal(needle_survival(stream, edge), torch.full(shape, 3))  # sinks 1, 2 and window 95
