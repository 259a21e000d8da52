"""The offload runtime (leankit.offload) on tiny random-init models, CPU only.

Every page lives in a host pool distinct from the device working-set pool, and the working set
is scribbled with NaN bytes after every step, so a page that the pipeline failed to copy in (or
to write back) changes the logits. Each config must give the greedy tokens (and bit-identical logits) of the same config
with every page on the device: Llama MHA, Llama GQA and OPT, left-padded batches, single-tier,
FP16, a LeanKV two-tier config and ACT (ratio and KVPR prefix placement).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from leankit import LeanCache
from leankit.hf import cache_kwargs
from leankit.offload import DeviceBudgetExceeded, OffloadConfig
from leankit.page_table import HIGH
from leankit.testing import left_padded_batch, tiny_model

KINDS = ["llama-mha", "llama-gqa", "opt"]
SPECS = ["K8V4", "FP16", "K8V4-K4V2:th=0.3,tl=0.05,window=4,compress_every=2", "FP16:act=0.5",
         "K8V4:act=0.5,act_order=prefix"]


def model_of(kind: str, layers: int = 4, seed: int = 3):
    if kind == "opt":
        m = tiny_model("opt", seed=seed)
        if layers != 2:
            from transformers import AutoModelForCausalLM

            from leankit.testing import tiny_config

            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(tiny_config("opt", num_hidden_layers=layers)).eval()
        return m
    return tiny_model(kind, seed=seed, num_hidden_layers=layers)


def cache_of(model, spec, **kw):
    with warnings.catch_warnings():  # GQA models warn that ACT costs more than KV: not under test
        warnings.simplefilter("ignore")
        return LeanCache(model, spec, **kw)


def scribble(cache):
    """Fill the device working set with NaN bytes after every step: only copied (or resident) pages survive."""
    rt = cache.offload
    end = rt.end_step

    def end_and_scribble():
        end()
        free = rt.working.owner < 0  # resident pages (device_tokens) keep their slot: the rest is garbage
        rt.working.pool.storage[free] = 0xFF

    rt.end_step = end_and_scribble
    return cache


def generate(model, cache, ids, mask, new=11, eos=None, scores=False):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                             max_new_tokens=new, pad_token_id=0, eos_token_id=eos, output_logits=scores,
                             return_dict_in_generate=scores)
    return (out.sequences, torch.stack(out.logits)) if scores else out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", SPECS)
def test_offload_gives_the_tokens_of_the_device_cache(kind, spec):
    model = model_of(kind)
    ids, mask = left_padded_batch(3, 11, seed=5, pad_step=3)
    ref, ref_logits = generate(model, cache_of(model, spec), ids, mask, scores=True)
    cache = scribble(cache_of(model, spec, offload=True))
    out, logits = generate(model, cache, ids, mask, scores=True)
    assert torch.equal(out, ref)
    assert torch.equal(logits, ref_logits)  # the same bytes were read: bit-identical, not just the same argmax
    off = cache.memory_report()["offload"]
    assert off["steps"] == 11 and off["h2d_bytes_total"] > 0 and off["d2h_bytes_total"] > 0
    assert cache.offload.working.used == 0  # nothing stays on the device between steps
    assert cache.pool is cache.offload.home and cache.pool.storage.device.type == "cpu"
    assert cache.offload.working.pool.storage.data_ptr() != cache.pool.storage.data_ptr()


def _layer_pages(cache) -> list[int]:
    pages = cache.table.n_pages.sum(0).flatten(1).sum(1)
    if cache.act_store is not None:
        pages = pages + cache.act_store.table.n_blocks.sum(1) * cache.act_store.layout.slices
    return [int(p) for p in pages]


@pytest.mark.parametrize("spec", ["K8V4", "FP16:act=0.5"])
def test_fixed_device_budget_holds_the_working_set_only(spec):
    model = model_of("llama-mha", layers=5)
    ids, mask = left_padded_batch(2, 9, seed=2)
    elastic = cache_of(model, spec, offload=True)
    ref = generate(model, elastic, ids, mask, new=7)
    per_layer = _layer_pages(elastic)  # policy 'full' only grows: the last step holds the most
    bound = max(a + b for a, b in itertools.pairwise(per_layer))  # layer l and the prefetched l + 1
    assert elastic.offload.working.peak <= bound < sum(per_layer)
    fixed = scribble(cache_of(model, spec, offload={"device_pages": bound}))
    assert torch.equal(generate(model, fixed, ids, mask, new=7), ref)
    assert fixed.offload.working.pool.num_pages == bound and fixed.offload.working.peak <= bound
    assert fixed.memory_report()["offload"]["device_pages_budget"] == bound
    # prefetch=0 keeps one layer at a time, so the largest layer's pages are enough
    single = cache_of(model, spec, offload=OffloadConfig(prefetch=0, device_pages=max(per_layer)))
    assert torch.equal(generate(model, single, ids, mask, new=7), ref)
    short = cache_of(model, spec, offload={"device_pages": bound - 1})
    with pytest.raises(DeviceBudgetExceeded, match=f"budget is {bound - 1}"):
        generate(model, short, ids, mask, new=7)
    assert short._step is None and short.offload.working.used == 0  # the step was dropped
    # a refused first step leaves the cache fresh: no page held, no batch size bound
    assert short.table is None and short.free_list.num_free == short.free_list.capacity
    assert torch.equal(generate(model, short, ids[:1], mask[:1], new=3),
                       generate(model, cache_of(model, spec), ids[:1], mask[:1], new=3))


@pytest.mark.parametrize("spec", ["K8V4", "FP16:act=0.5,page_size=512"])
def test_a_step_over_the_device_budget_leaves_the_next_steps_fitting(spec):
    """A long step refused with DeviceBudgetExceeded drops its tokens and gives back the pages it had
    reserved (empty pages still take device slots in every later window of their layer), so the
    short steps that fit the budget still fit, and match a cache that never saw the refusal."""
    model = model_of("llama-mha", layers=3)
    ids, mask = left_padded_batch(2, 30, seed=5, pad_step=7)
    steps = [torch.tensor([[5 + i], [9 + i]]) for i in range(3)]
    long = torch.randint(3, 97, (2, 60), generator=torch.Generator().manual_seed(6))

    def run(cache, refused=None):  # the prompt, then (a refused step and) the short steps' logits
        out, m = [], mask
        with torch.no_grad():
            model(input_ids=ids, attention_mask=m, **cache_kwargs(model, cache), use_cache=True)
            if refused is not None:
                pages = cache.memory_report()["pages_used"]
                with pytest.raises(DeviceBudgetExceeded):
                    model(input_ids=refused, attention_mask=torch.cat([m, torch.ones_like(refused)], 1),
                          **cache_kwargs(model, cache), use_cache=True)
                assert cache.memory_report()["pages_used"] == pages
            for nxt in steps:
                m = torch.cat([m, torch.ones_like(nxt)], 1)
                out.append(model(input_ids=nxt, attention_mask=m, **cache_kwargs(model, cache), use_cache=True).logits)
        return out

    elastic = cache_of(model, spec, offload=True)
    want = run(elastic)
    budget = elastic.offload.working.peak  # what the short steps need
    got = run(cache_of(model, spec, offload={"device_pages": budget}), refused=long)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_finished_request_returns_its_host_pages():
    model = model_of("llama-gqa")
    ids, mask = left_padded_batch(3, 10, seed=4)
    ref = generate(model, cache_of(model, "K8V4"), ids, mask)
    eos = int(ref[1, ids.shape[1] + 2])  # row 1 ends after its third new token
    dev = cache_of(model, "K8V4", eos_token_id=eos)
    out_dev = generate(model, dev, ids, mask, eos=eos)
    off = scribble(cache_of(model, "K8V4", eos_token_id=eos, offload=True))
    out = generate(model, off, ids, mask, eos=eos)
    assert torch.equal(out, out_dev)
    finished = off.finished.nonzero().flatten().tolist()
    assert 1 in finished
    assert int(off.table.n_pages[:, :, finished].sum()) == 0  # host rows emptied
    rep, rep_dev = off.memory_report(), dev.memory_report()
    assert rep["pages_used"] == rep_dev["pages_used"] and rep["offload"]["host_pages"] == rep["pages_used"]
    assert off.free_list.num_free == off.free_list.capacity - rep["pages_used"]


def test_decode_step_moves_the_filled_rows_in_and_the_new_rows_out():
    model = model_of("llama-mha", layers=3)
    ids, mask = left_padded_batch(2, 8, seed=1)
    cache = cache_of(model, "K8V4", offload=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0),
                    **cache_kwargs(model, cache), use_cache=True)
        lens = cache.table.lens[HIGH].clone()
        layout = cache.layouts[HIGH]
        # full pages cross whole, a partly filled page as its filled rows
        full, rows = lens.long() // layout.tokens, lens.long() % layout.tokens
        expected_in = int(full.sum()) * cache.cfg.page_size + int(rows.sum()) * layout.token_bytes
        nxt = out.logits[:, -1:].argmax(-1)
        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
        pos = (mask2.cumsum(1) - 1)[:, -1:]
        model(input_ids=nxt, attention_mask=mask2, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
    rep = cache.memory_report()["offload"]
    assert int(rows.sum()) > 0 and rep["h2d_bytes_step"] == expected_in
    new_rows = 2 * cache.num_layers * cache.num_kv_heads  # one token per row, layer and head
    assert rep["d2h_bytes_step"] == new_rows * layout.token_bytes
    assert rep["bytes_per_step"][0][0] == 0  # the prompt step had nothing on the host yet


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_act_pages_are_recomputed_before_the_kv_copy_is_awaited(prefetch):
    """KVPR §3.3 order per layer: ACT copy issued, KV copy issued, ACT->KV recompute (waiting on the ACT
    copy's event only), then the wait for the KV copy; the recomputed K/V are the ones attention uses."""
    model = model_of("llama-mha", layers=3)
    ids, mask = left_padded_batch(2, 13, seed=7, pad_step=3)
    spec = "K8V4:act=0.4,act_order=prefix"
    ref, ref_logits = generate(model, cache_of(model, spec), ids, mask, new=4, scores=True)
    cache = scribble(cache_of(model, spec, offload={"prefetch": prefetch}))
    store, link = cache.act_store, cache.offload.link
    calls = []
    keys = store._keys
    store._keys = lambda layer: calls.append(layer) or keys(layer)
    logs = []
    end = cache.offload.end_step

    def end_and_keep():
        end()
        logs.append(link.log)
        link.log = []

    cache.offload.end_step = end_and_keep
    link.log = []
    out, logits = generate(model, cache, ids, mask, new=4, scores=True)
    assert torch.equal(out, ref) and torch.equal(logits, ref_logits)
    assert calls == list(range(cache.num_layers)) * 3  # once per layer and decode step: in the window's opening
    assert store._ahead == {}
    for log in logs[1:]:  # decode steps (the prompt step has nothing on the host)
        for layer in range(cache.num_layers):
            order = [log.index((what, layer)) for what in ("act", "kv", "recompute", "wait_kv")]
            assert order == sorted(order), (layer, log)
            if prefetch and layer + 1 < cache.num_layers:  # the next layer's copies are queued first
                assert log.index(("act", layer + 1)) < log.index(("recompute", layer))


def test_memory_report_prints_the_offload_entry():
    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(2, 19, seed=2)
    cache = cache_of(model, "K8V4:page_size=256", offload={"device_tokens": 12, "device_pages": 64})
    generate(model, cache, ids, mask, new=3)
    rep = cache.memory_report()
    off, text = rep["offload"], str(rep)
    assert off["device_resident_pages"] > 0 and off["host_pages"] == rep["pages_used"] - off["device_resident_pages"]
    assert f"host {off['host_pages']} pages" in text
    assert f"peak {off['device_pages_peak']} pages" in text and "a budget of 64 pages" in text
    assert f"{off['device_resident_pages']} resident" in text
    h2d, d2h = off["h2d_bytes_step"], off["d2h_bytes_step"]
    assert 0 < d2h < 1024 < h2d  # printed in B and KiB
    assert f"host->device {h2d / 1024:.1f} KiB, device->host {d2h} B" in text
    assert text.startswith("LeanCache K8V4") and "pages               " in text  # the cache lines stay


@pytest.mark.parametrize("bad,what", [("gpu", "offload= takes"), ({"prefetch": -1}, "prefetch"),
                                      ({"device_pages": 0}, "device_pages"), ({"device_pages": True}, "device_pages"),
                                      ({"prefetch": True}, "prefetch"), ({"depth": 2}, "unknown offload"),
                                      ({"pin": "no"}, "pin must be True or False"), ({"pin": 0}, "pin"),
                                      ({"device_pages": 2 ** 40}, (r"device working set \(offload device_pages\) of "
                                                                   r"1099511627776 pages is more than page ids"))])
def test_bad_offload_argument(bad, what):
    with pytest.raises(ValueError, match=what):
        LeanCache(tiny_model("llama-mha"), "K8V4", offload=bad)


def test_beam_search_reorders_host_pages():
    model = model_of("llama-mha", layers=3)
    ids, mask = left_padded_batch(2, 9)

    def beams(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), num_beams=3,
                                  max_new_tokens=6, do_sample=False, pad_token_id=0)

    for spec in ("K8V4", "FP16:act=0.5"):
        assert torch.equal(beams(scribble(cache_of(model, spec, offload=True))), beams(cache_of(model, spec)))


@pytest.mark.parametrize("spec,kind", [("K8V4:page_size=256", "kv"), ("FP16:act=0.5,page_size=512", "act"),
                                       ("K8V4:act=0.5,act_order=prefix,page_size=256", "kv")])
def test_resident_share_stays_on_the_device(spec, kind):
    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(3, 23, seed=6, pad_step=4)
    ref = generate(model, cache_of(model, spec), ids, mask, new=7)
    host = cache_of(model, spec, offload=True)
    assert torch.equal(generate(model, host, ids, mask, new=7), ref)
    cache = scribble(cache_of(model, spec, offload={"device_tokens": 21, "device_kind": kind}))
    assert torch.equal(generate(model, cache, ids, mask, new=7), ref)
    rt = cache.offload
    res = rt.resident
    cap = res.kv_cap if kind == "kv" else res.act_cap
    per_page = cache.layouts[HIGH].tokens if kind == "kv" else cache.act_store.layout.tokens
    assert cap is not None and abs(int(cap.sum()) * per_page - 21) <= per_page / 2  # to within a page
    heads = cache.num_kv_heads if kind == "kv" else cache.act_store.layout.slices
    assert res.pages == int(cap.sum()) * heads * cache.num_layers > 0
    assert rt.working.used == res.pages  # between steps only resident pages hold a slot
    # resident pages never cross the link: fewer bytes in than with every page on the host, and
    # the prompt's resident rows are never written back
    steps = cache.memory_report()["offload"]["bytes_per_step"]
    every = host.memory_report()["offload"]["bytes_per_step"]
    assert all(got[0] < all_[0] and got[1] <= all_[1] for got, all_ in zip(steps[1:], every[1:]))
    assert steps[0][1] < every[0][1]


def test_resident_share_errors_and_finished_rows():
    model = model_of("llama-gqa", layers=3)
    with pytest.raises(ValueError, match="device_tokens needs policy 'full'"):
        cache_of(model, "K8V4-K4V2:th=0.3,tl=0.05", offload={"device_tokens": 8})
    with pytest.raises(ValueError, match="no ACT share"):
        cache_of(model, "K8V4", offload={"device_tokens": 8, "device_kind": "act"})
    with pytest.raises(ValueError, match="device_kind"):
        OffloadConfig(device_kind="gpu")
    ids, mask = left_padded_batch(3, 21, seed=4)
    spec = "K8V4:page_size=256"  # pages of 6 tokens: several full pages per row
    ref = generate(model, cache_of(model, spec), ids, mask)
    eos = int(ref[1, ids.shape[1] + 2])  # row 1 ends after its third new token
    dev = cache_of(model, spec, eos_token_id=eos)
    out_dev = generate(model, dev, ids, mask, eos=eos)
    off = scribble(cache_of(model, spec, eos_token_id=eos, offload={"device_tokens": 30}))
    assert torch.equal(generate(model, off, ids, mask, eos=eos), out_dev)
    assert 1 in off.finished.nonzero().flatten().tolist()
    held = off.table.tables[off.table.tables >= 0].long()
    assert bool(off.offload.resident.of(held).any())  # the live rows keep theirs
    assert off.offload.resident.pages == int(off.offload.resident.of(held).sum())  # row 1's went back
    assert off.offload.working.used == off.offload.resident.pages
    assert off.free_list.num_free == off.free_list.capacity - off.memory_report()["pages_used"]
    with pytest.raises(ValueError, match="beam search"):
        off.reorder_cache(torch.tensor([0, 0, 2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_beam_search_with_offload_on_cuda_is_refused_clearly():
    model = model_of("llama-mha", layers=3).cuda()
    ids, mask = left_padded_batch(2, 9)
    cache = cache_of(model, "K8V4", offload=True)
    with pytest.raises(ValueError, match="beam search .* not supported with offload on CUDA"), torch.no_grad():
        model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **cache_kwargs(model, cache), num_beams=3,
                       max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_prefetch_reads_the_device_rarely():
    """The prefetch's blocking reads (a GPU stall each): no scalar read, and one nonzero per selection."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {"_local_scalar_dense": 0, "nonzero": 0, "repeat_interleave": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in self.n:
                self.n[name] += 1
            return func(*args, **(kwargs or {}))

    model = model_of("llama-mha", layers=3)
    ids, mask = left_padded_batch(2, 30, seed=1)
    cache = cache_of(model, "K8V4:act=0.5,act_order=prefix", offload=True)
    rt, reads = cache.offload, Reads()
    prefetch = rt._prefetch

    def counted(layer):
        with reads:
            prefetch(layer)

    rt._prefetch = counted
    generate(model, cache, ids, mask, new=4)
    calls = 4 * cache.num_layers
    assert reads.n["_local_scalar_dense"] == 0  # no .item()/int()/bool() of a device value
    # per group (ACT, KV): the used pages, the pages without a slot, free slots, full and partial pages
    assert reads.n["nonzero"] <= calls * 2 * 5
    assert reads.n["repeat_interleave"] <= calls * 2  # partly filled pages: one expansion per group


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1,compress_every=4"])
def test_smollm2_offload_is_exact(smollm2, spec):
    model, tok = smollm2
    tok.padding_side = "left"
    enc = tok(["The capital of France is", "A KV cache stores the keys and values of"], return_tensors="pt",
              padding=True)
    ref, ref_logits = generate(model, cache_of(model, spec), enc.input_ids, enc.attention_mask, new=12, scores=True)
    cache = scribble(cache_of(model, spec, offload={"device_pages": 256}))
    out, logits = generate(model, cache, enc.input_ids, enc.attention_mask, new=12, scores=True)
    assert torch.equal(out, ref) and torch.equal(logits, ref_logits)
    assert cache.offload.working.peak <= 256 < cache.memory_report()["pages_used"]


@pytest.mark.parametrize("spec", ["K8V4", "FP16:act=0.5"])
def test_a_step_that_raises_inside_a_layer_leaves_the_offloaded_cache_as_it_was(spec):
    """An error inside a decoder layer drops the step; the pages the runtime prefetched for the
    layers after it belong to the dropped step and are forgotten, so a later step that needs new
    pages reads its own (before, it read stale device slots: 'a page id lies outside the pool')."""
    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(2, 9, seed=4)

    class Boom(Exception):
        pass

    def boom(*args):
        raise Boom

    def run(fail: bool):
        cache = scribble(cache_of(model, spec, page_size=512, offload=True))
        out = generate(model, cache, ids, mask, new=5)
        if fail:  # a new turn that raises inside layer 0, after layer 1's pages were prefetched
            handle = model.model.layers[0].register_forward_hook(boom)
            try:
                with pytest.raises(Boom):
                    bad = torch.cat([out, torch.full((2, 2), 7)], 1)
                    generate(model, cache, bad, torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype)], 1), new=2)
            finally:
                handle.remove()
            assert not cache.offload._loaded  # no layer of the dropped step stays prefetched
        turn = torch.cat([out, torch.full((2, 30), 9)], 1)  # a longer turn: new pages
        return generate(model, cache, turn, torch.cat([mask, torch.ones(2, 35, dtype=mask.dtype)], 1), new=3)

    assert torch.equal(run(True), run(False))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", ["K8V4", "FP16:act=0.5", "FP16"])
def test_non_finite_kv_inside_an_offloaded_layer_drops_the_step(spec):
    """NaN K/V raised inside an offloaded layer's window: the error is NonFiniteKVError (it was
    masked by 'rows cannot be released while an offloaded layer is computing', raised from the
    window still open), no layer stays prefetched, and a later, longer turn matches a cache that
    never saw the bad step (it read the stale prefetched slots: IndexError)."""
    from leankit import NonFiniteKVError

    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(2, 9, seed=4)

    def run(fail: bool):
        cache = scribble(cache_of(model, spec, page_size=512, offload=True))
        out = generate(model, cache, ids, mask, new=5)
        if fail:  # a new turn (the token generate did not feed, two more) with a NaN in one embedding
            bad_mask = torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype)], 1)
            turn = torch.cat([out[:, -1:], torch.full((2, 2), 7)], 1)
            embeds = model.get_input_embeddings()(turn).detach().clone()
            embeds[0, 0, 3] = float("nan")
            with torch.no_grad(), pytest.raises(NonFiniteKVError, match="^layer 0:"):
                model(inputs_embeds=embeds, attention_mask=bad_mask, position_ids=bad_mask.cumsum(1)[:, -3:] - 1,
                      **cache_kwargs(model, cache), use_cache=True)
            assert cache._step is None and not cache.offload._loaded and cache.offload.working.used == 0
        turn = torch.cat([out, torch.full((2, 30), 9)], 1)  # a longer turn: new pages
        return generate(model, cache, turn, torch.cat([mask, torch.ones(2, 35, dtype=mask.dtype)], 1), new=3)

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_prompt_whose_own_pages_overflow_the_device_budget_leaves_the_cache_fresh(prefetch):
    """LeanKV stores a prompt's pages layer by layer, inside the layer's window: a budget too small
    for them raises DeviceBudgetExceeded (it was a RuntimeError about releasing rows), gives every
    host page back (the pages taken for the refused slots leaked) and leaves the cache fresh, not
    bound to the refused batch, so a smaller request then gives a fresh cache's tokens."""
    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(3, 13, seed=10)
    small, small_mask = ids[:1, -3:], mask[:1, -3:]
    spec = "K8V4-K4V2:th=0.3,tl=0.05,window=4,compress_every=2"
    elastic = cache_of(model, spec, page_size=512, offload={"prefetch": prefetch})
    want = generate(model, elastic, small, small_mask, new=3)
    off = {"prefetch": prefetch, "device_pages": elastic.offload.working.peak}  # what the small request needs
    cache = scribble(cache_of(model, spec, page_size=512, offload=off))
    with pytest.raises(DeviceBudgetExceeded, match=f"budget is {off['device_pages']} "):
        generate(model, cache, ids, mask, new=5)
    assert cache.table is None and cache.free_list.num_free == cache.free_list.capacity
    assert cache.offload.working.used == 0
    assert torch.equal(generate(model, cache, small, small_mask, new=3), want)


def test_a_short_pool_inside_an_offloaded_layer_raises_pool_exhausted_and_leaves_the_cache_fresh():
    """A fixed host pool (num_pages) too short for a LeanKV prompt, whose pages are granted inside
    each layer's window: PoolExhausted (it was a RuntimeError about releasing rows), and the refused
    first step leaves the cache fresh with every page free (it held the pages of the layers before)."""
    from leankit import PoolExhausted

    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(3, 13, seed=10)
    cache = scribble(cache_of(model, "K8V4-K4V2:th=0.3,tl=0.05,window=4,compress_every=2", page_size=512, num_pages=8,
                              offload=True))
    with pytest.raises(PoolExhausted):
        generate(model, cache, ids, mask, new=5)
    assert cache.table is None and cache.free_list.num_free == cache.free_list.capacity == 8


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("spec", ["K8V4", "FP16:act=0.5"])
def test_a_copied_offloaded_cache_grows_its_host_pool(spec, how):
    """A deepcopy or a pickle of an offloaded cache continues as the original does, also when the
    next turn needs more host pages than the pool holds (the copy's HostPool had lost its ``pin``
    attribute, so its first grow raised AttributeError)."""
    import copy
    import io

    if how == "pickle" and "act" in spec:
        pytest.skip("a cache with ACT blocks does not pickle (README)")
    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(3, 11, seed=15)
    cache = cache_of(model, spec, page_size=512, offload=True)
    out = generate(model, cache, ids, mask, new=4)
    if how == "deepcopy":
        twin = copy.deepcopy(cache)
    else:
        buf = io.BytesIO()
        torch.save(cache, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert twin.offload.home.pin == cache.offload.home.pin
    turn = torch.cat([out, torch.randint(3, 90, (3, 60), generator=torch.Generator().manual_seed(3))], 1)
    turn_mask = torch.cat([mask, torch.ones(3, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    capacity = twin.offload.home.num_pages
    got = generate(model, twin, turn, turn_mask, new=3)
    assert twin.offload.home.num_pages > capacity  # the turn did grow the copy's host pool
    assert torch.equal(got, generate(model, cache, turn, turn_mask, new=3))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("how", ["non-finite", "budget"])
def test_a_dropped_step_does_not_count_its_link_bytes_in_the_next_step(how):
    """The copies a dropped step had issued (its first layers' pages) crossed the link, so they stay in
    the totals, but they are no finished step's bytes: the next step's ``bytes_per_step`` entry and
    ``h2d_bytes_step`` are those of a cache that never saw the dropped step (they included them)."""
    from leankit import NonFiniteKVError

    model = model_of("llama-mha", layers=3)
    ids, mask = left_padded_batch(2, 30, seed=5, pad_step=7)
    long = torch.randint(3, 97, (2, 60), generator=torch.Generator().manual_seed(6))

    def fwd(cache, x, m, embeds=None):
        pos = (m.cumsum(1) - 1)[:, -x.shape[1]:].clamp_min(0)
        inputs = {"input_ids": x} if embeds is None else {"inputs_embeds": embeds}
        with torch.no_grad():
            return model(**inputs, attention_mask=m, position_ids=pos, **cache_kwargs(model, cache),
                         use_cache=True).logits

    def run(offload, fail):
        cache = cache_of(model, "K8V4", offload=offload)
        nxt = fwd(cache, ids, mask)[:, -1:].argmax(-1)
        m = torch.cat([mask, torch.ones_like(nxt)], 1)
        if fail and how == "budget":  # a long step whose window does not fit the budget
            with pytest.raises(DeviceBudgetExceeded):
                fwd(cache, long, torch.cat([mask, torch.ones_like(long)], 1))
        elif fail:  # a step whose K/V turn NaN in layer 0, after layer 1's pages were prefetched
            embeds = model.get_input_embeddings()(nxt).detach().clone()
            embeds[0, 0, 0] = float("nan")
            with pytest.raises(NonFiniteKVError):
                fwd(cache, nxt, m, embeds)
        fwd(cache, nxt, m)
        return cache.memory_report()["offload"]

    budget = None
    if how == "budget":
        probe = cache_of(model, "K8V4", offload=True)
        nxt = fwd(probe, ids, mask)[:, -1:].argmax(-1)
        fwd(probe, nxt, torch.cat([mask, torch.ones_like(nxt)], 1))
        budget = probe.offload.working.peak
    offload = {"device_pages": budget} if budget else True
    clean, dropped = run(offload, False), run(offload, True)
    assert clean["bytes_per_step"][1][0] > 0
    assert dropped["bytes_per_step"] == clean["bytes_per_step"]
    assert dropped["h2d_bytes_step"] == clean["h2d_bytes_step"]
    assert dropped["h2d_bytes_total"] > clean["h2d_bytes_total"]  # the dropped step's copies did cross


def test_released_rows_give_back_their_resident_pages_at_once():
    """``cache.release(rows)`` between steps returns the rows' resident pages: the memory report counts
    them neither as resident nor (negatively) against the host pages, and their device slots are
    freed (they stayed flagged until the next step: ``host_pages`` went to -30 after releasing every row)."""
    model = model_of("llama-gqa", layers=3)
    ids, mask = left_padded_batch(3, 21, seed=4)
    spec = "K8V4:page_size=256"
    cache = cache_of(model, spec, offload={"device_tokens": 30})
    out = generate(model, cache, ids, mask, new=3)
    rt = cache.offload
    assert rt.resident.pages > 0
    for rows in ([True, False, False], [True, True, True]):
        cache.release(torch.tensor(rows))
        rep = cache.memory_report()
        off = rep["offload"]
        held = cache.table.tables[cache.table.tables >= 0].long()
        assert off["device_resident_pages"] == rt.resident.pages == int(rt.resident.of(held).sum())
        assert off["host_pages"] == rep["pages_used"] - off["device_resident_pages"] >= 0
        assert rt.working.used == rt.resident.pages
    assert rep["pages_used"] == 0 and off["device_resident_pages"] == 0 and rt.working.used == 0
    # the released cache serves a new batch as a fresh one does
    cache.reset()
    assert torch.equal(generate(model, cache, ids, mask, new=3), out)
