"""LeanCache.crop: dropping the newest tokens, as assisted and prompt-lookup decoding do after a
draft's rejected tokens, on both backends; what cannot roll back is refused and left as it was."""

import copy

import pytest
import torch
from transformers import DynamicCache

import leankit
from leankit import LeanCache
from leankit.hf import cache_kwargs
from leankit.testing import left_padded_batch, tiny_model

# An end id no tiny model can produce (vocabulary 97): generation runs its full length, and
# transformers 5.0's prompt lookup, which cannot take eos_token_id=None, runs too.
KW = {"do_sample": False, "pad_token_id": 0, "eos_token_id": 1000}


def _repetitive_prompt(seed: int, width: int = 7) -> torch.Tensor:
    """One row whose n-grams repeat, so prompt lookup drafts tokens (some accepted, some not)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 90, (1, width), generator=g)
    return torch.cat([base, base[:, :4], torch.randint(3, 90, (1, 3), generator=g), base], 1)


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("LEANKIT_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3", "opt"])
def test_prompt_lookup_decoding_with_fp16_gives_dynamic_caches_tokens(kind, backend, monkeypatch):
    """transformers verifies a draft in one step and crops what it rejects. FP16 then gives the
    tokens DynamicCache gives under the same decoding (and plain greedy's): Gemma3's sliding-window
    layers crop by their own rules. Rejected drafts really were cropped."""
    if kind == "gemma3" and not hasattr(DynamicCache, "activate_past_recording"):
        pytest.skip("this transformers cannot crop a sliding-window layer past its window (DynamicCache neither)")
    model = tiny_model(kind)
    drops = []  # tokens each crop dropped (transformers before 5.25 passes a length to keep, later a count)
    crop = LeanCache.crop

    def counted_crop(self, n):
        before = self.get_seq_length()
        crop(self, n)
        drops.append(before - self.get_seq_length())

    monkeypatch.setattr(LeanCache, "crop", counted_crop)
    import leankit.cache as cache_module

    merged = []  # verify steps the torch backend served in one pass (own tokens and merge)
    one_pass = cache_module.step_attention_merged
    monkeypatch.setattr(cache_module, "step_attention_merged", lambda *a: merged.append(1) or one_pass(*a))
    for seed in range(3):
        ids = _repetitive_prompt(seed)
        with torch.no_grad():
            want = model.generate(input_ids=ids, max_new_tokens=24, prompt_lookup_num_tokens=3, **KW,
                                  **cache_kwargs(model, DynamicCache(config=model.config)))
            cache = LeanCache(model, "FP16")
            got = model.generate(input_ids=ids, max_new_tokens=24, prompt_lookup_num_tokens=3, **KW,
                                 **cache_kwargs(model, cache))
            plain = model.generate(input_ids=ids, max_new_tokens=24, **KW)
        assert torch.equal(got, want) and torch.equal(got, plain)
        assert cache.get_seq_length() == got.shape[1] - 1  # the last token is never fed
    assert any(n > 0 for n in drops)
    assert (len(merged) > 0) == (backend == "torch")


def test_prompt_lookup_decoding_runs_on_a_quantized_cache():
    """A quantized full-policy cache crops too; its tokens follow its own rounding (a verify step
    attends to its draft's exact K/V, a decode step to stored codes), so only the run is checked,
    and that every head keeps exactly the tokens fed."""
    model = tiny_model("llama-gqa")
    ids = _repetitive_prompt(0)
    cache = LeanCache(model, "K8V4:rotate=1")
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=20, prompt_lookup_num_tokens=3, **KW,
                             **cache_kwargs(model, cache))
    assert out.shape[1] == ids.shape[1] + 20
    assert cache.table.lens[0].unique().tolist() == [out.shape[1] - 1]


def _prefill_and_steps(model, cache, ids, mask, steps):
    """Prefill then ``steps`` greedy one-token steps; returns the tokens fed and the final mask."""
    fed = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache)).logits
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            fed.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            logits = model(input_ids=nxt, attention_mask=mask, **cache_kwargs(model, cache)).logits
    return torch.cat(fed, 1), mask


@pytest.mark.parametrize("spec", ["FP16", "K8V4"])
@pytest.mark.parametrize("how", ["negative", "length"])
def test_a_cropped_cache_continues_as_if_the_dropped_steps_never_ran(spec, how, backend):
    """Crop a left-padded batch back by 5 of its 9 decode steps (both spellings): the next steps give
    the logits of a cache that only ever saw the kept tokens, the pages past the kept tokens are
    back in the pool, and FP16 matches a DynamicCache cropped the same way."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=3, width=11, seed=2)
    cache = LeanCache(model, spec, page_size=256)
    _, full_mask = _prefill_and_steps(model, cache, ids, mask, 9)
    seen = cache.get_seq_length()
    used = cache.free_list.capacity - cache.free_list.num_free
    cache.crop(-5 if how == "negative" else seen - 5)
    assert cache.get_seq_length() == seen - 5
    assert cache.free_list.capacity - cache.free_list.num_free < used  # the emptied pages went back
    assert cache.table.lens[0, 0].tolist() == [[int(mask[r].sum()) + 4] * 2 for r in range(3)]
    kept_mask = full_mask[:, : seen - 5]
    twin = LeanCache(model, spec, page_size=256)
    _prefill_and_steps(model, twin, ids, mask, 4)
    dyn = DynamicCache(config=model.config)
    _prefill_and_steps(model, dyn, ids, mask, 9)
    dyn.crop(-5)
    nxt = torch.tensor([[7], [8], [9]])
    step_mask = torch.cat([kept_mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        got = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, cache)).logits
        want = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, twin)).logits
        ref = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, dyn)).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    if spec == "FP16":
        assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    assert cache._last_pos.tolist() == twin._last_pos.tolist()


@pytest.mark.parametrize("how", ["negative", "length"])
def test_a_cache_with_sliding_window_layers_crops_by_either_spelling(how):
    """Gemma3's sliding-window layers keep transformers' own cache layer, which from 5.25 on refuses
    a positive length: the cache hands them the count to drop, so the older spelling (a length to
    keep) crops them too, and a length past what is held leaves them alone, as it leaves the pages."""
    model = tiny_model("gemma3", sliding_window=32)  # a window the prompt does not fill
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(4))
    cache, dyn = LeanCache(model, "FP16"), DynamicCache(config=model.config)
    with torch.no_grad():
        for c in (cache, dyn):
            model(input_ids=ids, **cache_kwargs(model, c))
        cache.crop(12 + 3)  # keeps everything
        assert cache.get_seq_length() == 12
        cache.crop(-2 if how == "negative" else 10)
        dyn.crop(-2)
        assert cache.get_seq_length() == 10
        assert [layer.get_seq_length() for layer in cache.layers] == [10] * 3
        nxt = torch.tensor([[7], [8]])
        got = model(input_ids=nxt, **cache_kwargs(model, cache)).logits
        want = model(input_ids=nxt, **cache_kwargs(model, dyn)).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def _snapshot(cache):
    return (cache.get_seq_length(), cache.table.lens.clone(), cache.free_list.num_free, cache._last_pos.clone())


def _same(a, b):
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2] and torch.equal(a[3], b[3])


@pytest.mark.parametrize("spec,why", [
    ("K8V4-K4V2:th=0.25,tl=0", "policy 'leankv'"),
    ("K8V4:policy=h2o,budget=0.5", "policy 'h2o'"),
    ("FP16:act=0.5", "ACT blocks"),
])
def test_caches_that_cannot_roll_back_say_so_up_front(spec, why):
    """transformers asks is_croppable before assisted decoding and refuses with its own error
    (before 5.25 it asks nothing and the first crop refuses, naming the reason, as a direct crop
    does). Nothing changes."""
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, spec, page_size=256)
    assert not cache.is_croppable
    ids, mask = left_padded_batch(rows=2, width=9)
    _prefill_and_steps(model, cache, ids, mask, 2)
    before = _snapshot(cache)
    with pytest.raises(NotImplementedError, match=f"cannot crop: .*{why}"):
        cache.crop(-1)
    assert _same(_snapshot(cache), before)
    with pytest.raises((ValueError, NotImplementedError), match="cropped|cannot crop"):
        model.generate(input_ids=_repetitive_prompt(1), max_new_tokens=4, prompt_lookup_num_tokens=3, **KW,
                       **cache_kwargs(model, LeanCache(model, spec, page_size=256)))


def test_crops_that_would_drop_padding_or_more_than_seen_are_refused_and_change_nothing(backend):
    """The dropped columns must hold a real token of every row: padding there (a crop reaching into
    a left-padded prompt), more columns than seen, a row that ended on an EOS (its pages are gone)
    or a non-int length are refused before anything changes; the cache then goes on as before."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=3, width=11, seed=2)
    cache = LeanCache(model, "FP16", page_size=256)
    _prefill_and_steps(model, cache, ids, mask, 3)
    seen = cache.get_seq_length()
    before = _snapshot(cache)
    pad_columns = int((mask == 0).sum(1).max())
    for bad, err, msg in ((-(seen - pad_columns + 1), ValueError, "not show a real token"),
                          (-(seen + 1), ValueError, f"drops {seen + 1} tokens of a cache that has seen {seen}"),
                          (2.0, TypeError, "takes an int")):
        with pytest.raises(err, match=msg):
            cache.crop(bad)
        assert _same(_snapshot(cache), before)
    cache.crop(0)
    cache.crop(seen + 3)  # the older spelling: a length at or past what is held keeps everything
    assert _same(_snapshot(cache), before)

    ended = LeanCache(model, "FP16", page_size=256, eos_token_id=[5])
    with torch.no_grad():
        model(input_ids=torch.tensor([[11, 12, 13], [21, 22, 23]]), **cache_kwargs(model, ended))
        model(input_ids=torch.tensor([[5], [24]]), **cache_kwargs(model, ended))  # row 0 is fed its EOS
        model(input_ids=torch.tensor([[5], [25]]), **cache_kwargs(model, ended))  # and ends
    assert ended.finished.tolist() == [True, False]
    before = (ended.get_seq_length(), ended.table.lens.clone())
    with pytest.raises(ValueError, match="ended on an EOS"):
        ended.crop(-1)
    assert ended.get_seq_length() == before[0] and torch.equal(ended.table.lens, before[1])


def test_leankit_apply_serves_prompt_lookup_decoding():
    """``leankit.apply`` builds a fresh cache per call: with a full-policy config, prompt lookup
    decoding runs through it and gives DynamicCache's tokens for FP16."""
    model = tiny_model("qwen3")
    ids = _repetitive_prompt(4)
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=16, prompt_lookup_num_tokens=3, **KW)
        leankit.apply(model, "FP16")
        try:
            got = model.generate(input_ids=ids, max_new_tokens=16, prompt_lookup_num_tokens=3, **KW)
        finally:
            leankit.apply(model, None)
    assert torch.equal(got, want)


def test_assisted_decoding_with_a_draft_model_gives_dynamic_caches_tokens(backend):
    """A draft model proposes tokens (in its own cache); the LeanCache of the main model keeps the
    accepted ones and crops the rest: FP16 gives DynamicCache's tokens and plain greedy's."""
    model = tiny_model("llama-gqa")
    draft = tiny_model("llama-gqa", seed=3, num_hidden_layers=1)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.generate(input_ids=ids, assistant_model=draft, max_new_tokens=20, **KW)
        got = model.generate(input_ids=ids, assistant_model=draft, max_new_tokens=20, **KW,
                             **cache_kwargs(model, LeanCache(model, "FP16")))
        plain = model.generate(input_ids=ids, max_new_tokens=20, **KW)
    assert torch.equal(got, want) and torch.equal(got, plain)


def test_crop_reads_padding_from_every_step_s_mask_whatever_its_width(backend):
    """Steps may bring the whole mask, their own tokens' mask or none: the padding a step brought
    still counts when later steps bring no mask (a crop over it is refused, where it once dropped
    a padded row's real token), and a step mask of its own tokens does not hide real columns (a
    crop over them is served, where it was once refused)."""
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, "FP16")
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache))
        mask = torch.cat([torch.ones(2, 6, dtype=torch.long), torch.tensor([[1, 1, 1], [1, 0, 1]])], 1)
        model(input_ids=torch.tensor([[7, 8, 9], [7, 8, 9]]), attention_mask=mask, **cache_kwargs(model, cache))
        model(input_ids=torch.tensor([[10], [10]]), **cache_kwargs(model, cache))  # no mask
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="not show a real token"):
        cache.crop(-3)  # row 1's column of token 8 was padding
    assert _same(_snapshot(cache), before)
    cache.crop(-1)  # the last column is real in both rows
    assert cache.policy.real_seen.tolist() == [9, 8]

    steps = LeanCache(model, "FP16")
    twin = LeanCache(model, "FP16")
    with torch.no_grad():
        for c, n in ((steps, 3), (twin, 1)):
            model(input_ids=ids[:1], attention_mask=torch.ones(1, 6, dtype=torch.long), **cache_kwargs(model, c))
            for t in range(n):  # decode steps that bring their own token's mask only
                model(input_ids=torch.tensor([[20 + t]]), attention_mask=torch.ones(1, 1, dtype=torch.long),
                      **cache_kwargs(model, c))
        steps.crop(-2)
        nxt = {"input_ids": torch.tensor([[30]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}
        got = model(**nxt, **cache_kwargs(model, steps)).logits
        want = model(**nxt, **cache_kwargs(model, twin)).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_a_cache_deep_copies_after_decode_steps_and_a_crop():
    """A deep copy taken after decode steps (whose native kernel arguments the cache keeps as
    scratch) and a crop continues as the original does (transformers' prefix-cache recipe)."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=2, width=9, seed=4)
    cache = LeanCache(model, "K8V4")
    _, full_mask = _prefill_and_steps(model, cache, ids, mask, 4)
    cache.crop(-2)
    twin = copy.deepcopy(cache)
    nxt = torch.tensor([[11], [12]])
    step_mask = torch.cat([full_mask[:, :-2], torch.ones_like(nxt)], 1)
    with torch.no_grad():
        got = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, twin)).logits
        want = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, cache)).logits
    assert torch.equal(got, want)


def test_a_shallow_copy_is_refused_and_the_cache_continues():
    """copy.copy would share the pool and tables while the copy's layers still pointed at the
    original: refused by name (deepcopy is the supported copy), and the cache is untouched."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=2, width=9, seed=4)
    cache, ref = LeanCache(model, "K8V4"), LeanCache(model, "K8V4")
    for c in (cache, ref):
        _, full_mask = _prefill_and_steps(model, c, ids, mask, 2)
    with pytest.raises(TypeError, match="copy.deepcopy"):
        copy.copy(cache)
    nxt = torch.tensor([[11], [12]])
    step_mask = torch.cat([full_mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        got = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, cache)).logits
        want = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, ref)).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec", ["FP16", "K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=8,rotate=1,compress_every=2",
                                  "K8V8:policy=h2o,budget=0.6"])
def test_a_pickled_cache_continues_as_the_original_does(spec, backend):
    """pickle (unlike deepcopy) does not keep views sharing storage: the page table's memoized
    layer views, the error flags' views and the workspace's native kernel arguments must not travel
    in the pickle, or the copy writes where the original's views pointed and reads stale tables."""
    import pickle

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=2, width=9, seed=4)
    cache = LeanCache(model, spec)
    _, full_mask = _prefill_and_steps(model, cache, ids, mask, 4)
    twin = pickle.loads(pickle.dumps(cache))
    step_mask = full_mask
    for tok in (11, 12, 13):
        nxt = torch.tensor([[tok], [tok + 1]])
        step_mask = torch.cat([step_mask, torch.ones_like(nxt)], 1)
        with torch.no_grad():
            got = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, twin)).logits
            want = model(input_ids=nxt, attention_mask=step_mask, **cache_kwargs(model, cache)).logits
        assert torch.equal(got, want)
