"""LeanCache end to end on tiny random-init models: lossless equality, padding, beams, errors."""

import pytest
import torch
from transformers import DynamicCache

import leankit
from leankit import LeanCache, PoolExhausted
from leankit.cache import check_model_supported
from leankit.hf import cache_kwargs
from leankit.quant import NonFiniteKVError
from leankit.testing import left_padded_batch, tiny_config, tiny_model


def _batch(seed=0, rows=3, width=13):
    return left_padded_batch(rows, width, seed)


def _generate(model, ids, mask, cache, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                              max_new_tokens=kw.pop("max_new_tokens", 24), pad_token_id=0, eos_token_id=None, **kw)


@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa", "qwen2"])
def test_fp16_lossless_left_padded_batch(kind):
    model = tiny_model(kind)
    ids, mask = _batch()
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    out = _generate(model, ids, mask, LeanCache(model, "FP16"))
    assert torch.equal(out, ref)
    # every row of the padded batch equals generating that prompt alone
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        alone = _generate(model, ids[r:r + 1, keep], mask[r:r + 1, keep], LeanCache(model, "FP16"))
        assert torch.equal(alone[0], out[r, -alone.shape[1]:])


def test_logits_match_dynamic_cache_closely():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        b = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, LeanCache(model, "FP16"))).logits
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["K8V8", "K8V4", "K4V2", "K4V8", "K2V1", "K16V4"])
def test_quantized_configs_generate(spec):
    model = tiny_model("llama-gqa")
    ids, mask = _batch()
    cache = LeanCache(model, spec)
    out = _generate(model, ids, mask, cache)
    assert out.shape == (3, ids.shape[1] + 24)
    rep = cache.memory_report()
    real = int(mask.sum() + 3 * 23)  # the last generated token is never fed back
    assert rep["tokens_per_row"] == (mask.sum(1) + 23).tolist()
    assert rep["tokens_per_tier"] == {"high": real, "low": 0, "pruned": 0}  # tokens, not token x layer x head
    assert rep["slots_per_tier"]["high"] == real * 2 * 2  # layers * kv heads


def test_quantized_attention_close_to_fp16():
    # K8V8 logits stay close to exact attention (8-bit error is ~1/255 of each token's range)
    model = tiny_model("llama-mha")
    ids, mask = _batch(rows=2)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, LeanCache(model, "FP16"))).logits
        b = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, LeanCache(model, "K8V8"))).logits
    real = mask.bool()
    rel = (b[real] - a[real]).norm() / a[real].norm()
    assert rel < 2e-2


def test_sampling_runs_and_is_seeded():
    model = tiny_model("llama-gqa")
    ids, mask = _batch()
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, LeanCache(model, "K8V4")),
                                       do_sample=True, top_k=20, max_new_tokens=12, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def test_beam_search_matches_dynamic_cache():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), num_beams=3, max_new_tokens=10)
    cache = LeanCache(model, "FP16")
    out = _generate(model, ids, mask, cache, num_beams=3, max_new_tokens=10)
    assert torch.equal(out, ref)
    owned = cache.table.tables[cache.table.tables >= 0]
    assert owned.unique().numel() == owned.numel()  # beams never share a page


@pytest.mark.parametrize("bad", [[0, 1, 1], [0], [[0, 1]], [0.0, 1.0], [0, 2], [-1, 0]], ids=str)
def test_a_bad_beam_index_is_refused_and_leaves_the_cache_as_it_was(bad):
    """reorder_cache checks beam_idx before any page moves: a wrong length or rank, a float index or
    a row outside the batch raises ValueError, and the cache continues as if never asked (before, it
    switched to a half-built page table, leaking the old pages and giving other tokens after)."""
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    ref, cache = DynamicCache(config=model.config), LeanCache(model, "FP16")
    out = _generate(model, ids, mask, ref, max_new_tokens=3)
    _generate(model, ids, mask, cache, max_new_tokens=3)
    used = cache.memory_report()["pages_used"]
    with pytest.raises(ValueError, match="reorder_cache: beam_idx"):
        cache.reorder_cache(torch.tensor(bad))
    assert cache.memory_report()["pages_used"] == used == int(cache.table.n_pages.sum())
    more = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    assert torch.equal(_generate(model, out, more, cache, max_new_tokens=3), _generate(model, out, more, ref, max_new_tokens=3))


def test_max_new_tokens_to_model_limit():
    model = tiny_model("llama-gqa", max_position_embeddings=64)
    ids, mask = _batch(rows=1, width=10)
    cache = LeanCache(model, "K4V2")
    out = _generate(model, ids, mask, cache, max_new_tokens=54)
    assert out.shape[1] == 64


def test_pool_exhausted_leaves_cache_consistent():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    cache = LeanCache(model, "K8V4", num_pages=7)  # prefill needs 8: one per (layer, row, head)
    with pytest.raises(PoolExhausted) as e:
        _generate(model, ids, mask, cache)
    assert e.value.needed > e.value.free
    assert cache.free_list.num_free == 7  # nothing was taken
    assert cache.table is None  # a refused first step leaves the cache fresh
    assert "num_pages" in str(e.value)


def test_pages_return_on_finish():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    cache = LeanCache(model, "K8V4")
    _generate(model, ids, mask, cache, max_new_tokens=6)
    assert cache.memory_report()["pages_used"] > 0
    cache.release(torch.tensor([True, False]))
    half = cache.memory_report()["pages_used"]
    assert 0 < half
    cache.reset()
    assert cache.memory_report()["pages_used"] == 0


def test_release_takes_a_row_mask_and_refuses_row_indices():
    """``release(torch.tensor([1]))`` meant "row 1" but, as a mask, would free every row: an index
    tensor, a mask of the wrong length or a non-bool one is refused, and the cache is left as it was."""
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    cache = LeanCache(model, "K8V4")
    _generate(model, ids, mask, cache, max_new_tokens=4)
    used = cache.memory_report()["pages_used"]
    for bad in (torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([True, False, True]), torch.tensor([[True, False]])):
        with pytest.raises(ValueError, match="bool mask of the batch's 2 rows"):
            cache.release(bad)
        assert cache.memory_report()["pages_used"] == used and not bool(cache.finished.any())
    assert cache.release(torch.tensor([False, True])) > 0 and cache.finished.tolist() == [False, True]


def test_memory_report_of_an_empty_cache_prints_no_nan():
    """A fresh or reset cache holds no token: its ratios are 0 / 0, shown as '-' rather than 'nanx'."""
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, "K8V4")
    text = str(cache.memory_report())
    assert "nan" not in text.lower() and "vs fp16 cache       -" in text


def test_eos_frees_pages_during_generate():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    with torch.no_grad():
        first = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=3, pad_token_id=0,
                               eos_token_id=None)
    eos = int(first[0, ids.shape[1] + 1])  # row 0 emits this token at its second step
    cache = LeanCache(model, "K8V4", eos_token_id=eos)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False, max_new_tokens=8,
                       pad_token_id=0, eos_token_id=eos)
    assert bool(cache.finished[0])
    assert int(cache.table.n_pages[:, :, 0].sum()) == 0


def _second_turn(model, cache, first_out, first_mask, extra=(5, 6, 7, 8)):
    """Pass a finished turn back into ``cache`` with a few more prompt tokens, as with DynamicCache."""
    rows = first_out.shape[0]
    ids = torch.cat([first_out, torch.tensor([list(extra)] * rows)], 1)
    mask = torch.cat([first_mask, first_mask.new_ones(rows, ids.shape[1] - first_mask.shape[1])], 1)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                              max_new_tokens=6, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("kv", ["FP16", "K8V4"])
def test_a_new_turn_after_an_eos_continues_the_row(kv):
    """A turn that stopped on EOS leaves that EOS last in the sequence, never fed to the model; the
    next turn's chunk starts with it. Only a decode step's fed-back token ends a row, so the next
    turn continues the row's context, as a cache without ``eos_token_id`` (and DynamicCache) does."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        probe = model.generate(input_ids=ids, do_sample=False, max_new_tokens=3, pad_token_id=0, eos_token_id=None)
    eos = int(probe[0, -1])  # the greedy third token: turn 1 stops on it
    outs = []
    for cache in (LeanCache(model, kv, eos_token_id=eos), LeanCache(model, kv), DynamicCache(config=model.config)):
        with torch.no_grad():
            first = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                                   max_new_tokens=10, pad_token_id=0, eos_token_id=eos)
        assert int(first[0, -1]) == eos and first.shape[1] <= ids.shape[1] + 3
        outs.append(_second_turn(model, cache, first, mask))
        if isinstance(cache, LeanCache):
            assert cache.memory_report()["tokens_per_row"] == [outs[-1].shape[1] - 1]  # nothing was dropped
    assert torch.equal(outs[0], outs[1])
    if kv == "FP16":
        assert torch.equal(outs[0], outs[2])


def test_a_new_turn_for_a_row_that_ended_raises_and_leaves_the_cache():
    """A row that ended on EOS while the batch went on has had its pages freed: a new turn passed
    into the same cache cannot continue it, and says so before it changes anything."""
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    with torch.no_grad():
        probe = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0,
                               eos_token_id=None)
    eos = int(probe[0, ids.shape[1] + 1])  # row 0 emits it at its second step
    assert eos not in probe[1, ids.shape[1]:].tolist()  # row 1 runs on: the batch continues after row 0 ends
    cache = LeanCache(model, "K8V4", eos_token_id=eos)
    with torch.no_grad():
        first = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                               max_new_tokens=8, pad_token_id=0, eos_token_id=eos)
    assert bool(cache.finished[0]) and not bool(cache.finished[1])
    seen, lens = cache.get_seq_length(), cache.table.lens.clone()
    first_mask = torch.cat([mask, torch.ones(2, first.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with pytest.raises(ValueError, match=r"rows \[0\] .* ended their request"):
        _second_turn(model, cache, first, first_mask)
    assert cache.get_seq_length() == seen and torch.equal(cache.table.lens, lens)


def test_a_new_turn_whose_mask_hides_stored_tokens_raises_and_leaves_the_cache():
    """Without ``eos_token_id`` a row that ended early keeps its pages, and the padding ``generate``
    fed it (with mask 1) is stored as real. A new turn whose mask now hides those pads cannot be
    honoured (stored tokens stay visible), so it raises before it changes anything; the same turn
    with the earlier columns of the mask as they were gives DynamicCache's tokens."""
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    with torch.no_grad():
        probe = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0,
                               eos_token_id=None)
    eos = int(probe[0, ids.shape[1] + 1])  # row 0 emits it at its second step, then gets padding
    assert eos not in probe[1, ids.shape[1]:].tolist()
    outs = []
    for cache in (LeanCache(model, "FP16"), DynamicCache(config=model.config)):
        with torch.no_grad():
            first = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                                   max_new_tokens=8, pad_token_id=0, eos_token_id=eos)
        fed = torch.ones(2, first.shape[1] - mask.shape[1], dtype=mask.dtype)
        if isinstance(cache, LeanCache):
            seen, lens = cache.get_seq_length(), cache.table.lens.clone()
            hiding = torch.cat([mask, (first[:, ids.shape[1]:] != 0).to(mask.dtype)], 1)
            with pytest.raises(ValueError, match=r"rows \[0\]: the attention mask hides tokens"):
                _second_turn(model, cache, first, hiding)
            assert cache.get_seq_length() == seen and torch.equal(cache.table.lens, lens)
        outs.append(_second_turn(model, cache, first, torch.cat([mask, fed], 1)))
    assert torch.equal(outs[0], outs[1])


def test_reset_forgets_the_peak_of_earlier_runs():
    """A reset cache reports the peak of its own later runs, as a fresh cache would."""
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=3)
    cache = LeanCache(model, "K8V4")
    _generate(model, ids, mask, cache, max_new_tokens=6)
    cache.reset()
    fresh = LeanCache(model, "K8V4")
    for c in (cache, fresh):
        _generate(model, ids[:1, -4:], mask[:1, -4:], c, max_new_tokens=2)
    got, want = cache.memory_report(), fresh.memory_report()
    assert (got["peak_kv_bytes"], got["peak_ratio"]) == (want["peak_kv_bytes"], want["peak_ratio"])


def test_memory_report_keys_and_ratio():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    cache = LeanCache(model, "K4V2")
    _generate(model, ids, mask, cache, max_new_tokens=4)
    rep = cache.memory_report()
    for key in ("pages_used", "pages_total", "page_size", "kv_bytes", "fp16_bytes", "ratio", "tokens_per_tier",
                "table_bytes"):
        assert key in rep
    real_tokens = int(mask.sum()) + 2 * 3
    assert rep["fp16_bytes"] == real_tokens * 2 * 2 * (2 * 16 * 2)  # layers * heads * (K+V fp16 at head_dim 16)
    assert rep["dense_bytes"] == 2 * rep["fp16_bytes"] and rep["dense_dtype"] == "float32"
    assert rep["kv_bytes"] == rep["pages_used"] * rep["page_size"]
    assert rep["table_bytes"] == cache.table.nbytes() > 0
    assert rep["total_bytes"] == rep["kv_bytes"] + rep["table_bytes"]  # no plain layers in a Llama
    assert rep["ratio"] == pytest.approx(rep["total_bytes"] / rep["fp16_bytes"])
    assert rep["dense_ratio"] == pytest.approx(rep["total_bytes"] / rep["dense_bytes"])
    assert rep["pages_ratio"] == pytest.approx(rep["kv_bytes"] / rep["fp16_bytes"])
    assert sum(rep["tokens_per_row"]) == real_tokens
    text = str(rep)
    for part in ("K4V2", "tokens per row", f"{rep['pages_used']} of {rep['pages_total']}", "float32", "page table",
                 f"{rep['ratio']:.3f}x"):
        assert part in text
    assert isinstance(rep, dict) and dict(rep)["kv_bytes"] == rep["kv_bytes"]  # callers keep dict access


def test_unsupported_models_raise():
    from transformers import AutoModelForCausalLM, GPT2Config

    with pytest.raises(ValueError, match="model types"):  # OPT is served (tests/test_opt.py); GPT-2 is not
        LeanCache(AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2)), "K8V4")
    cfg = tiny_config("qwen2")
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        check_model_supported(cfg)


def test_a_model_that_caps_its_attention_logits_is_refused():
    # Gemma3 with attn_logit_softcapping set hands its attention a softcap LeanCache would ignore
    cfg = tiny_config("gemma3")
    check_model_supported(cfg)  # None, as in every released checkpoint: served
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        check_model_supported(cfg)
    model = tiny_model("gemma3", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="caps its attention logits"):
        LeanCache(model, "K8V4")


def test_cache_built_for_another_model_names_both_shapes():
    small, deeper, wider = tiny_model("llama-gqa"), tiny_model("llama-gqa", num_hidden_layers=3), tiny_model("llama-mha")
    ids, mask = _batch(rows=2)
    for built, used in ((small, deeper), (deeper, small), (small, wider)):
        leankit.enable(used)
        cache = LeanCache(built, "K8V4")
        with pytest.raises(ValueError, match="built for a model with") as e:
            _generate(used, ids, mask, cache, max_new_tokens=2)
        msg = str(e.value)
        assert f"{built.config.num_hidden_layers} layers, {built.config.num_key_value_heads} KV heads" in msg
        assert f"{used.config.num_hidden_layers} layers, {used.config.num_key_value_heads} KV heads" in msg
        assert cache.table is None and cache.memory_report()["pages_used"] == 0  # nothing was done
    # driving the layers by hand: a wrong K/V shape or layer index is caught at update
    cache = LeanCache(small, "K8V4")
    cache.begin_step(1, 2)
    with pytest.raises(ValueError, match=r"keys of shape \(1, 4, 2, 16\)"):
        cache.update(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16), 0)
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        cache.update(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), 2)
    assert int(cache.table.lens.sum()) == 0  # no token was stored


@pytest.mark.parametrize("built_kind, built_kw, used_kind, used_kw", [
    ("qwen2", {}, "mistral-sliding", {}),  # same shape: every layer paged vs every layer sliding
    ("mistral-sliding", {}, "qwen2", {}),
    ("gemma3", {}, "gemma3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    ("gemma3", {"sliding_window": 4}, "gemma3", {}),  # its plain layers would keep too few tokens
])
def test_cache_built_for_a_model_whose_layers_attend_otherwise_is_refused(built_kind, built_kw, used_kind, used_kw):
    # same layer count, KV heads and head_dim: used to run, each layer attending over the wrong tokens
    built, used = tiny_model(built_kind, seed=1, **built_kw), tiny_model(used_kind, seed=2, **used_kw)
    ids, mask = _batch(rows=2, width=14)
    cache = LeanCache(built, "FP16")
    leankit.enable(used)
    with pytest.raises(ValueError, match="sliding-window layer.* but is used with a model with"):
        _generate(used, ids, mask, cache, max_new_tokens=3)
    assert cache.table is None and cache.memory_report()["pages_used"] == 0  # nothing was done
    # the model it was built for, and a copy of it, still use it
    twin = tiny_model(built_kind, seed=3, **built_kw)
    leankit.enable(twin)
    assert torch.equal(_generate(twin, ids, mask, cache, max_new_tokens=3),
                       _generate(twin, ids, mask, DynamicCache(config=twin.config), max_new_tokens=3))


def test_a_model_never_enabled_is_refused_before_its_sliding_layers_keep_tokens():
    # gemma3's layer 0 slides: its (transformers) layer stored the un-enabled model's K/V before the
    # paged layer 1 raised, and the cache's own model then failed on it with a shape mismatch
    built, other = tiny_model("gemma3", seed=1), tiny_model("gemma3", seed=2)
    ids, mask = _batch(rows=2, width=10)
    cache = LeanCache(built, "K8V4")
    with pytest.raises(RuntimeError, match="outside a forward step"):
        _generate(other, ids, mask, cache, max_new_tokens=3)
    assert all(getattr(layer, "keys", None) is None for layer in cache.layers)
    assert torch.equal(_generate(built, ids, mask, cache, max_new_tokens=3),
                       _generate(built, ids, mask, LeanCache(built, "K8V4"), max_new_tokens=3))


def test_bad_config_string():
    with pytest.raises(ValueError, match="grammar"):
        LeanCache(tiny_model(), "K8V3")


def test_non_finite_kv_rejected_and_the_step_dropped():
    """NaN K/V raise NonFiniteKVError naming the layer; the step's tokens of every layer are dropped."""
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, "K8V4")
    cache.begin_step(1, 2)
    cache.update(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), 0)
    cache.attend(0, torch.randn(1, 6, 2, 16), 0.25)  # layer 0 stores its two tokens
    assert int(cache.table.lens.sum()) == 2 * 2
    k = torch.randn(1, 2, 2, 16)
    k[0, 1, 1, 3] = float("nan")
    cache.update(k, torch.randn(1, 2, 2, 16), 1)
    with pytest.raises(NonFiniteKVError, match="layer 1"):
        cache.attend(1, torch.randn(1, 6, 2, 16), 0.25)
    # the dropped step was the first: the cache is fresh again (no page held, no batch size bound)
    assert cache.table is None and cache.get_seq_length() == 0 and cache.memory_report()["pages_used"] == 0

    def drive(c, g):  # one whole step of finite K/V through every layer
        c.begin_step(1, 2)
        outs = []
        for layer in range(2):
            c.update(torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 2, 2, 16, generator=g), layer)
            outs.append(c.attend(layer, torch.randn(1, 6, 2, 16, generator=g), 0.25))
        c.end_step()
        return outs

    fresh = LeanCache(model, "K8V4")
    for _ in range(2):  # the failed cache behaves exactly like a fresh one, step after step
        seed = torch.randint(0, 1 << 30, ()).item()
        for a, b in zip(drive(cache, torch.Generator().manual_seed(seed)),
                        drive(fresh, torch.Generator().manual_seed(seed)), strict=True):
            assert torch.equal(a, b)
    assert torch.equal(cache.table.lens, fresh.table.lens)


def test_enable_is_idempotent_and_fallback_works():
    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    leankit.enable(model)
    leankit.enable(model)
    assert model.config._attn_implementation == "leankit"
    dec = model.get_decoder()
    assert len(dec._forward_pre_hooks) == 1
    # an enabled model with an ordinary cache falls back to SDPA with HF's masks
    assert torch.equal(_generate(model, ids, mask, DynamicCache(config=model.config)), ref)


def test_batch_size_change_needs_fresh_cache():
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, "K8V4")
    ids, mask = _batch(rows=2)
    _generate(model, ids, mask, cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="fresh LeanCache"):
        cache.begin_step(3, 1)



def test_batch_selection_is_a_no_op_on_a_fresh_cache_and_refused_on_a_filled_one():
    """A fresh cache holds no row: selecting or repeating rows changes nothing (as in DynamicCache);
    a filled cache refuses both with NotImplementedError and stays as it was."""
    model = tiny_model("gemma3")
    cache = LeanCache(model, "K8V4")
    cache.batch_select_indices(torch.tensor([0]))
    cache.batch_repeat_interleave(2)
    ids, mask = _batch(rows=2)
    _generate(model, ids, mask, cache, max_new_tokens=2)
    seen = cache.get_seq_length()
    with pytest.raises(NotImplementedError, match="filled cache"):
        cache.batch_select_indices(torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="filled cache"):
        cache.batch_repeat_interleave(2)
    assert cache.get_seq_length() == seen and cache.table.shape[1] == 2


@pytest.mark.parametrize("spec", ["K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=8"])
def test_store_rows_are_derived_once_per_step_and_shared_by_its_layers(monkeypatch, spec):
    from leankit.policy import _Base

    model = tiny_model("llama-gqa")
    ids, mask = _batch(rows=2)
    calls, computed, kept = [], [], []
    original = _Base._store_rows

    def spy(self, step, *args):
        kept.append(step)  # held, so no later step can reuse its id
        calls.append(id(step))
        if not any(key[0] == "store_rows" for key in step.derived if isinstance(key, tuple)):
            computed.append(id(step))
        return original(self, step, *args)

    monkeypatch.setattr(_Base, "_store_rows", spy)
    # the torch store: a CPU decode step on the compiled kernels stores in one call, deriving no rows
    monkeypatch.setattr(leankit.native, "kernels_for", lambda device: None)
    _generate(model, ids, mask, LeanCache(model, spec), max_new_tokens=4)
    steps = set(calls)
    assert len(steps) >= 3 and len(calls) == len(steps) * model.config.num_hidden_layers
    assert sorted(computed) == sorted(steps)  # each step derives its rows once, for all its layers


@pytest.mark.skipif(leankit.native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["K8V4:rotate=1", "K8V4-K4V2:th=0.3,tl=0.05,group_size=16,rotate=1", "FP16"])
def test_compiled_decode_step_equals_the_torch_composition(monkeypatch, spec, dtype):
    """A CPU decode step with the compiled kernels adds its own token and merges in one call
    (:func:`leankit.decode_attention.decode_step_attention`); the logits of each step must be those
    of the torch composition it replaces (paged attention, then the new token, then the merge),
    within the model dtype's rounding, and the pages must hold the same tokens. A rotated
    low-precision model rotates the step's own token in fp32 on both paths' terms (it stays exact)."""
    from leankit import decode_attention

    model = tiny_model().to(dtype)
    ids, mask = left_padded_batch(rows=3, width=21)
    real_serves = decode_attention.serves_decode_step
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(decode_attention, "serves_decode_step", lambda *a, _f=fused: _f and real_serves(*a))
        cache = LeanCache(model, spec, page_size=256)
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=6,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences, torch.stack(out.logits).float(), cache.memory_report()["pages_used"]))
    (seq_a, logits_a, pages_a), (seq_b, logits_b, pages_b) = runs
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.equal(seq_a[:, :ids.shape[1] + 1], seq_b[:, :ids.shape[1] + 1])  # the prompt's token
    steps = int((seq_a == seq_b).all(0).long().cumprod(0).sum()) - ids.shape[1]  # steps before any split
    assert steps >= 2, "the two paths diverged at once"
    err = (logits_a[:steps] - logits_b[:steps]).abs().max() / logits_b[:steps].abs().max()
    assert err <= tol, f"logits differ by {float(err):.2e} (normwise) over the first {steps} steps"
    if dtype == torch.float32:
        assert torch.equal(seq_a, seq_b) and pages_a == pages_b


def test_backend_choice_follows_the_environment_at_every_call(monkeypatch):
    """``LEANKIT_BACKEND`` is read at every call (parsed once per value), so a process may switch
    backends; a value that names no backend raises every time it is asked for."""
    from leankit.backend import backend_name, use_triton

    t = torch.zeros(1)
    monkeypatch.setenv("LEANKIT_BACKEND", "torch")
    assert backend_name() == "torch" and not use_triton(t)
    monkeypatch.setenv("LEANKIT_BACKEND", " Triton ")
    assert backend_name() == "triton" and use_triton(t)
    monkeypatch.delenv("LEANKIT_BACKEND")
    assert backend_name() == "auto" and not use_triton(t)
    monkeypatch.setenv("LEANKIT_BACKEND", "")
    assert backend_name() == "auto"
    monkeypatch.setenv("LEANKIT_BACKEND", "cuda")
    for _ in range(2):
        with pytest.raises(ValueError, match="LEANKIT_BACKEND"):
            backend_name()
    monkeypatch.setenv("LEANKIT_BACKEND", "torch")
    assert backend_name() == "torch"


def test_eos_ids_take_numpy_and_tensor_ints_and_refuse_the_rest():
    """``eos_token_id`` as tokenizers and tensors hand it over (numpy ints, 0-d or 1-d integer
    tensors, lists of either) is accepted; a float or a string is a ``ValueError`` naming it."""
    np = pytest.importorskip("numpy")
    model = tiny_model("llama-gqa")
    for given, want in [(np.int64(2), [2]), (torch.tensor(2), [2]), (torch.tensor([2, 5]), [2, 5]),
                        ([np.int32(3), 4], [3, 4]), ((7,), [7]), (None, [])]:
        assert LeanCache(model, "K8V4", eos_token_id=given).eos_ids.tolist() == want
    for bad in (2.0, "2", [2.5], torch.tensor(2.0)):
        with pytest.raises(ValueError, match="eos_token_id must be a token id"):
            LeanCache(model, "K8V4", eos_token_id=bad)


@pytest.mark.parametrize("spec", ["K8V4:policy=h2o,budget=0.5", "K8V4:policy=streaming,sink=3",
                                  "K8V4-K4V2:th=0.25,group_size=8,rotate=1",
                                  "FP16:act=0.5,act_order=prefix"])
def test_memory_report_names_the_whole_config(spec):
    """The report (and the CLI line built from it) names the policy and settings, not the tiers alone."""
    import warnings

    from leankit.config import KVConfig

    model = tiny_model("llama-mha")
    ids, mask = _batch(rows=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cache = LeanCache(model, spec)
    _generate(model, ids, mask, cache, max_new_tokens=3)
    rep = cache.memory_report()
    assert rep["config"] == KVConfig.parse(spec).label()
    assert KVConfig.parse(rep["config"]) == cache.cfg
    assert rep["config"] in str(rep)


def test_short_pool_in_an_algorithm_1_step_on_the_torch_backend_moves_nothing(monkeypatch):
    """Algorithm 1 on the torch backend checks its page grant before it compacts a tier: a step
    whose grant does not fit a fixed pool raises PoolExhausted with every stored token where it was
    (compaction had already overwritten high-tier slots in place: one token lost, another twice)."""
    from leankit.policy import HIGH, LOW, read_tier_meta

    monkeypatch.setenv("LEANKIT_BACKEND", "torch")
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(3, 11)
    kw = dict(th=0.3, tl=0.05, compress_every=1, window=4, page_size=256)
    probe = LeanCache(model, "K8V4-K4V2", **kw)
    _generate(model, ids, mask, probe, max_new_tokens=1)
    cache = LeanCache(model, "K8V4-K4V2", num_pages=int(probe.table.n_pages.sum()) + 1, **kw)
    layers = torch.arange(cache.num_layers)

    def stored():
        metas = [read_tier_meta(cache, t, layers) for t in (HIGH, LOW)]
        return ([torch.where(m.valid, m.pos, -1) for m in metas] + [torch.where(m.valid, m.score, 0) for m in metas]
                + [cache.table.lens.clone(), cache.table.tables.clone(), cache.policy.pruned_mass.clone()])

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
    nxt = out.logits[:, -1:].argmax(-1)
    for step in range(12):
        before = stored()
        more = torch.cat([mask, torch.ones_like(nxt)], 1)
        try:
            with torch.no_grad():
                out = model(input_ids=nxt, attention_mask=more, use_cache=True, **cache_kwargs(model, cache))
        except PoolExhausted as e:
            assert e.needed > e.free
            break
        mask, nxt = more, out.logits[:, -1:].argmax(-1)
    else:
        raise AssertionError("the pool never ran short")
    for a, b in zip(before, stored()):
        assert torch.equal(a, b)


def _fresh_logits(model, spec, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **cache_kwargs(model, LeanCache(model, spec, **kw)), use_cache=True).logits


@pytest.mark.parametrize("spec", ["FP16", "K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=8", "K8V4:act=0.5"])
def test_failed_first_step_leaves_the_cache_fresh(spec):
    """A prompt refused in a layer (NaN K/V from bad embeddings) frees every page it took and binds
    no batch size: the same cache then serves another batch exactly as a fresh cache does."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(5))
    bad = model.get_input_embeddings()(ids).detach().repeat(2, 1, 1)
    bad[1, 4] = float("nan")
    cache = LeanCache(model, spec)
    with pytest.raises(NonFiniteKVError), torch.no_grad():
        model(inputs_embeds=bad, **cache_kwargs(model, cache), use_cache=True)
    assert cache.table is None and cache.get_seq_length() == 0
    assert cache.memory_report()["pages_used"] == 0
    with torch.no_grad():
        got = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
    assert torch.equal(got, _fresh_logits(model, spec, ids))


@pytest.mark.parametrize("spec", ["K8V4-K4V2:th=0.25,tl=0,group_size=8", "K8V4-K4V2:th=0.3,tl=0.05"])
def test_two_tier_prompt_refused_by_a_short_pool_leaves_the_cache_fresh(spec):
    """A two-tier prompt takes its pages layer by layer: a fixed pool that runs out at a later
    layer gives every page back, and a smaller batch then fits the same cache."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
    one_row = LeanCache(model, spec)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, one_row), use_cache=True)
    pages = one_row.memory_report()["pages_used"]
    cache = LeanCache(model, spec, num_pages=pages + pages // 2)  # one row fits, two do not
    with pytest.raises(PoolExhausted), torch.no_grad():
        model(input_ids=ids.repeat(2, 1), **cache_kwargs(model, cache), use_cache=True)
    assert cache.table is None and cache.memory_report()["pages_used"] == 0
    with torch.no_grad():
        got = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
    assert torch.equal(got, _fresh_logits(model, spec, ids, num_pages=pages + pages // 2))


def test_row_overflow_in_a_re_tiering_step_moves_no_token():
    """A step whose re-tiering would outgrow a page-table row is refused before compaction rewrites
    any slot: the cache's page bytes are untouched and its next step equals an unfailed cache's."""
    model = tiny_model("llama-gqa")
    spec = "K8V4-K4V2:th=0.3,tl=0,group_size=8,page_size=256"
    ids = torch.randint(3, model.config.vocab_size, (2, 100), generator=torch.Generator().manual_seed(7))
    failed, ref = LeanCache(model, spec, max_seq_len=40), LeanCache(model, spec, max_seq_len=40)
    with torch.no_grad():
        for c in (failed, ref):
            model(input_ids=ids[:, :30], **cache_kwargs(model, c), use_cache=True)
        pool_before = failed.pool.storage.clone()
        with pytest.raises(ValueError, match="outgrew its page-table row"):
            model(input_ids=ids[:, 30:90], **cache_kwargs(model, failed), use_cache=True)
        assert torch.equal(failed.pool.storage[: pool_before.shape[0]], pool_before)
        assert torch.equal(failed.table.lens, ref.table.lens) and failed._step is None
        a = model(input_ids=ids[:, 30:31], **cache_kwargs(model, failed), use_cache=True).logits
        b = model(input_ids=ids[:, 30:31], **cache_kwargs(model, ref), use_cache=True).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=8"])
def test_an_error_outside_attention_drops_the_step(spec, monkeypatch):
    """An exception anywhere in the forward (here the last layer's MLP, after every layer stored
    its tokens) drops the step: the cache continues as if the call had never been made."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(8))
    failed, ref = LeanCache(model, spec), LeanCache(model, spec)
    mlp = model.model.layers[-1].mlp
    with torch.no_grad():
        for c in (failed, ref):
            model(input_ids=ids[:, :16], **cache_kwargs(model, c), use_cache=True)
        real_forward = mlp.forward

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(mlp, "forward", broken)
        with pytest.raises(RuntimeError, match="boom"):
            model(input_ids=ids[:, 16:20], **cache_kwargs(model, failed), use_cache=True)
        monkeypatch.setattr(mlp, "forward", real_forward)
        assert failed._step is None and failed.get_seq_length() == 16
        assert torch.equal(failed.table.lens, ref.table.lens)
        a = model(input_ids=ids[:, 16:], **cache_kwargs(model, failed), use_cache=True).logits
        b = model(input_ids=ids[:, 16:], **cache_kwargs(model, ref), use_cache=True).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["FP16", "K8V4:act=0.5"])
@pytest.mark.parametrize("q_len", [4, 1])
def test_a_step_cut_short_by_keyboard_interrupt_is_dropped_at_the_next_step(spec, q_len):
    """A KeyboardInterrupt (Ctrl-C in generate) raised in a later layer is not an ``Exception``, so
    torch runs no ``always_call`` hook and the failure hook never drops the step: the earlier layers'
    tokens stayed stored. The next step drops it first, and continues as a cache that never saw it."""
    model = tiny_model("llama-gqa", num_hidden_layers=3)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    failed, ref = LeanCache(model, spec), LeanCache(model, spec)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    with torch.no_grad():
        for c in (failed, ref):
            model(input_ids=ids[:, :16], **cache_kwargs(model, c), use_cache=True)
        hook = model.model.layers[2].register_forward_hook(interrupt)
        try:
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=ids[:, 16:16 + q_len], **cache_kwargs(model, failed), use_cache=True)
        finally:
            hook.remove()
        assert failed.get_seq_length() == 16
        a = model(input_ids=ids[:, 16:], **cache_kwargs(model, failed), use_cache=True).logits
        b = model(input_ids=ids[:, 16:], **cache_kwargs(model, ref), use_cache=True).logits
        assert torch.equal(failed.table.lens, ref.table.lens) and failed._step is None
    assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ["K8V4:page_size=256", "K8V4:act=0.5,page_size=512",
                                  "K8V4-K4V2:th=0.25,tl=0,group_size=8,page_size=512,compress_every=1000"])
def test_a_dropped_step_gives_back_the_pages_it_reserved(spec):
    """A new turn refused in a later layer (NaN K/V) had reserved pages for its tokens in every head:
    dropping it gives them back, so a fixed pool that serves an unfailed cache's next steps (here a
    row that grows while the refused turn's longer row does not) serves the failed cache's too."""
    model = tiny_model("llama-gqa", num_hidden_layers=3)
    g = torch.Generator().manual_seed(11)
    prompt, turn = torch.randint(3, 97, (2, 40), generator=g), torch.randint(3, 97, (2, 60), generator=g)

    def nan(module, args, output):
        return output * float("nan")

    def decode(cache, n):
        ids = prompt
        for t in range(n):
            nxt = torch.full((2, 1), 10 + t)
            ids = torch.cat([ids, nxt], 1)
            out = model(input_ids=nxt, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache))
        return out.logits

    with torch.no_grad():
        probe = LeanCache(model, spec)
        model(input_ids=prompt, **cache_kwargs(model, probe))
        decode(probe, 40)
        pages = probe.memory_report()["pages_used"]
        failed, ref = LeanCache(model, spec, num_pages=pages), LeanCache(model, spec, num_pages=pages)
        for c in (failed, ref):
            model(input_ids=prompt, **cache_kwargs(model, c))
        mask = torch.ones(2, 100, dtype=torch.long)
        mask[1, 40:-1] = 0  # row 0 brings 60 tokens, row 1 one
        hook = model.model.layers[1].register_forward_hook(nan)
        try:
            with pytest.raises(NonFiniteKVError):
                model(input_ids=turn, attention_mask=mask, **cache_kwargs(model, failed))
        finally:
            hook.remove()
        assert failed.memory_report()["pages_used"] == ref.memory_report()["pages_used"]
        assert torch.equal(failed.table.n_pages, ref.table.n_pages)
        assert torch.equal(decode(failed, 40), decode(ref, 40))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("poison", ["embeddings", "query"])
@pytest.mark.parametrize("spec", ["K8V4:policy=h2o,budget=0.5", "K8V4-K4V2:th=0.3,tl=0.05"])
def test_a_non_finite_step_leaves_the_significance_as_it_was(spec, poison, compiled, monkeypatch):
    """NaN/Inf queries are refused before attention adds them to the stored tokens' significance:
    after the dropped step every score is what it was, and the next step equals an unfailed cache's.
    A NaN input poisons queries, keys and values alike; a NaN query alone (one element of the first
    layer's query projection) reaches only the significance, where the store cannot see it. Both on
    the compiled CPU decode call, which checks them itself, and on the torch path."""
    import leankit.native
    from leankit.policy import read_tier_meta

    if compiled and leankit.native.kernels() is None:
        pytest.skip("no C compiler for leankit.native")
    if not compiled:
        monkeypatch.setattr(leankit.native, "kernels_for", lambda device: None)
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    failed, ref = LeanCache(model, spec), LeanCache(model, spec)
    with torch.no_grad():
        for c in (failed, ref):
            model(input_ids=ids, **cache_kwargs(model, c), use_cache=True)
        tiers, layers = range(len(failed.layouts)), torch.arange(model.config.num_hidden_layers)
        before = [read_tier_meta(failed, t, layers).score.clone() for t in tiers]
        if poison == "embeddings":
            bad = model.get_input_embeddings()(ids[:, :1]) * float("nan")
            call = {"inputs_embeds": bad}
        else:
            def nan_query(module, args, out):
                out = out.clone()
                out[1, 0, 3] = float("nan")
                return out

            hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(nan_query)
            call = {"input_ids": ids[:, :1]}
        try:
            with pytest.raises(NonFiniteKVError, match="layer 0"):
                model(**call, **cache_kwargs(model, failed), use_cache=True)
        finally:
            if poison == "query":
                hook.remove()
        for t in tiers:
            assert torch.equal(read_tier_meta(failed, t, layers).score, before[t])
        a = model(input_ids=ids[:, 3:4], **cache_kwargs(model, failed), use_cache=True).logits
        b = model(input_ids=ids[:, 3:4], **cache_kwargs(model, ref), use_cache=True).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw,msg", [({"max_seq_len": 0}, "max_seq_len must be a positive integer, got 0"),
                                    ({"max_seq_len": -5}, "max_seq_len must be a positive integer"),
                                    ({"max_seq_len": 10.5}, "max_seq_len must be a positive integer"),
                                    ({"num_pages": 2.5}, "num_pages must be a positive integer, got 2.5"),
                                    ({"num_pages": 0}, "num_pages must be a positive integer"),
                                    ({"num_pages": True}, "num_pages must be a positive integer")])
def test_bad_sizes_are_refused_when_the_cache_is_built(kw, msg):
    """A zero size is not "the default" and a fractional one is not rounded."""
    with pytest.raises(ValueError, match=msg):
        LeanCache(tiny_model("llama-gqa"), "K8V4", **kw)


def test_kv_wider_than_the_pages_are_rounded_with_one_warning():
    """Built for a bf16 model that then goes to fp32 (or autocast hands it fp32 K/V): the pages
    round the K/V to bf16, so FP16 is no longer lossless, and the cache says so once. A cache built
    wider than the K/V (fp32 pages, a bf16 model) holds them exactly and says nothing."""
    import warnings

    from leankit.testing import left_padded_batch, tiny_model

    ids, mask = left_padded_batch(2, 9)
    model = tiny_model("llama-gqa").to(torch.bfloat16)
    cache = LeanCache(model, "FP16")
    model.to(torch.float32)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       **cache_kwargs(model, cache))
    said = [w for w in caught if "pages round them to bfloat16" in str(w.message)]
    assert len(said) == 1 and "float32 keys" in str(said[0].message)
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, "FP16")
    model.to(torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
    assert not [w for w in caught if "pages round" in str(w.message)]


@pytest.mark.parametrize("shape", [(3, 2, 7), (2, 6), (3, 7)], ids=["3-d", "short", "rows"])
def test_positions_of_another_shape_are_refused_and_leave_the_cache_fresh(shape):
    """One position per token, ``[B, Q]`` or ``[Q]``: multimodal RoPE's ``[3, B, Q]`` sections, a
    position row of the wrong length or a batch of another size get a clear error, not a raw
    broadcast error mid-step, and the cache stays fresh."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=2, width=7)
    cache = LeanCache(model, "K8V4")
    with torch.no_grad(), pytest.raises(ValueError, match="one position per token"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.zeros(shape, dtype=torch.long),
              **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0 and cache.table is None


def test_a_cache_built_from_something_other_than_a_model_says_what_it_needs():
    with pytest.raises(TypeError, match="leankit.load_model"):
        LeanCache("smollm2-135m", "K8V4")
    with pytest.raises(TypeError, match="got a dict"):
        LeanCache({"config": None}, "K8V4")


def test_max_seq_len_sizes_rows_in_whole_pages_and_is_no_exact_cap():
    """README: ``max_seq_len`` sizes each page-table row in whole pages (at least ``max_seq_len``
    tokens, plus a page), so a row may pass it; only a row that outgrows its page-table row raises,
    and that step is dropped."""
    model = tiny_model("llama-gqa")
    cache = LeanCache(model, "K8V4", max_seq_len=12)
    per_page = cache.layouts[0].tokens
    capacity = cache.row_len * per_page
    assert cache.row_len == -(-12 // per_page) + 1 and capacity > 12
    ids = torch.randint(3, model.config.vocab_size, (1, capacity + 1), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        model(input_ids=ids[:, :capacity], **cache_kwargs(model, cache), use_cache=True)  # past 12: accepted
        assert cache.get_seq_length() == capacity
        with pytest.raises(ValueError, match="outgrew its page-table row"):
            model(input_ids=ids[:, capacity:], **cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == capacity and cache._step is None


def test_a_decode_step_that_raised_does_not_leave_the_causal_mask_skipped():
    """A LeanCache step after the prompt skips building the plain causal mask (no layer reads it). A
    step of the bare decoder stack that raised midway must not leave that switch on for masks built outside any leankit forward
    afterwards (the "leankit" mask function, as an encoder run on its own reaches it)."""
    from transformers.masking_utils import causal_mask_function

    from leankit import hf

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    cache = LeanCache(model, "K8V4")
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
        def fail(module, args, output):
            raise RuntimeError("a layer failed")

        hook = model.model.layers[1].register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="a layer failed"):  # the decoder stack called on its own
            model.model(input_ids=ids[:, :1], **cache_kwargs(model, cache), use_cache=True)
        hook.remove()
    assert hf._FULL_MASK_UNUSED.get() is False
    mask = hf.leankit_mask(batch_size=1, q_length=4, kv_length=4, mask_function=causal_mask_function,
                           attention_mask=torch.tensor([[0, 1, 1, 1]]).bool())
    assert mask is not None and not bool(mask[0, 0, 1, 0])  # the padded key stays hidden


def test_is_initialized_says_whether_the_cache_holds_state():
    """transformers' ``Cache.is_initialized`` (read by some models to tell a prefill from a decode
    step) is False on a fresh or reset LeanCache and True once a step has filled it, copies included."""
    import copy

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    cache = LeanCache(model, "K8V4")
    assert cache.is_initialized is False
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    assert cache.is_initialized is True and copy.deepcopy(cache).is_initialized is True
    cache.reset()
    assert cache.is_initialized is False


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("spec", ["K8V4-K4V2:th=0.3,tl=0.05", "K8V4:policy=h2o,budget=0.5",
                                  "K8V4-K4V2:th=0.25,tl=0,group_size=8,rotate=1"])
def test_a_long_step_takes_its_significance_from_the_compiled_kernels_logits(spec, chunked, monkeypatch):
    """A step of more queries than LOGITS_QUERY_LIMIT after a prompt (a second turn's prompt) takes
    the stored tokens' significance from the compiled kernels' live-slot logits, with no second
    pass over the keys: in one call where they fit the score budget, else (``chunked``, a budget
    of a few queries) in query chunks that do, each merged with the step's own tokens. The stored
    scores are the second pass's to their fp16 storage's rounding, the step's logits equal to
    fp32 rounding."""
    import leankit.cache
    import leankit.native
    from leankit import decode_attention
    from leankit.policy import read_tier_meta

    if leankit.native.kernels() is None:
        pytest.skip("no C compiler for leankit.native")
    model = tiny_model("llama-gqa")
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    vocab, layers = model.config.vocab_size, torch.arange(model.config.num_hidden_layers)
    first = torch.randint(3, vocab, (2, int(torch.randint(20, 90, (), generator=gen))), generator=gen)
    n2 = leankit.cache.LOGITS_QUERY_LIMIT + int(torch.randint(1, 60, (), generator=gen))
    second = torch.randint(3, vocab, (2, n2), generator=gen)
    runs = {}
    for from_logits in (True, False):
        with monkeypatch.context() as m:
            if not from_logits:
                m.setattr(decode_attention, "step_logits_queries", lambda *a: 0)
            elif chunked:  # room for the scores of 5 to 20 queries per call
                per_call = int(torch.randint(5, 21, (), generator=gen))
                slots = 2 * model.config.num_key_value_heads * first.shape[1]
                group = model.config.num_attention_heads // model.config.num_key_value_heads
                m.setattr(decode_attention, "LIVE_SCORE_BYTES", 4 * group * slots * per_call)
            passes, real = [], leankit.cache.received_attention_ref
            m.setattr(leankit.cache, "received_attention_ref",
                      lambda *a, _passes=passes, _real=real, **k: _passes.append(1) or _real(*a, **k))
            calls, live = [], decode_attention.live_page_attention
            m.setattr(decode_attention, "live_page_attention",
                      lambda q, *a, _calls=calls, _live=live, **k: _calls.append(q.shape[2]) or _live(q, *a, **k))
            cache = LeanCache(model, spec)
            with torch.no_grad():
                model(input_ids=first, **cache_kwargs(model, cache), use_cache=True)
                logits = model(input_ids=second, **cache_kwargs(model, cache), use_cache=True).logits
            scores = [read_tier_meta(cache, t, layers).score.float() for t in range(len(cache.layouts))]
            runs[from_logits] = (logits, scores, len(passes), calls)
    assert runs[True][2] == 0 and runs[False][2] == len(layers)  # the second pass, once a layer, only without
    with_logits = runs[True][3]
    if chunked:  # every layer's step in query chunks, each a call of its own
        assert len(with_logits) > len(layers) and sum(with_logits) == n2 * len(layers)
        assert max(with_logits) < n2
    else:
        assert with_logits == [n2] * len(layers)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=2 ** -10, atol=1e-6)  # fp16 scores: one unit in the last place
