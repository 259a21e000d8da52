"""bench/native_passes.py on a tiny model: it lists every stored token of a layer and runs both
compiled passes over them (nothing here checks a time)."""

import pytest
import torch

from leankit import native, testing
from leankit.cache import LeanCache, attention_head_dim, attention_kv_heads
from leankit.config import KVConfig
from leankit.hf import cache_kwargs


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("native_passes")


@pytest.mark.parametrize("kv", ["K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=8", "FP16"])
def test_passes_cover_every_stored_token(bench, kv):
    kernels = native.kernels()
    if kernels is None:
        pytest.skip("no C compiler for leankit.native")
    model = testing.tiny_model("llama-gqa")
    cfg = model.config
    ids, mask = testing.left_padded_batch(rows=3, width=29)
    cache = LeanCache(model, KVConfig.parse(kv))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    group, head_dim = cfg.num_attention_heads // attention_kv_heads(cfg), attention_head_dim(cfg)
    for layer in range(cfg.num_hidden_layers):
        passes = bench.tier_passes(kernels, cache, layer, group, head_dim, torch.Generator().manual_seed(1))
        assert passes, "no occupied tier"
        stored = int(cache.paged_kv(layer).table.lens[:, layer].sum())
        assert sum(tokens for _, tokens, _, _ in passes) == stored == int(mask.sum()) * cfg.num_key_value_heads
        for _, _, scores_pass, values_pass in passes:
            assert bench.best_ns(scores_pass, cold=False, evict=torch.zeros(1)) > 0
            assert bench.best_ns(values_pass, cold=True, evict=torch.zeros(16)) > 0
