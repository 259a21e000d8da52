"""bench/turn_step.py on a tiny model: both routes and DynamicCache are timed after the routes' logits
are checked against each other, and the padded route really takes the padded tiles and the second
significance pass (nothing here checks a time)."""

import pytest
import torch

from leankit import native

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("turn_step")


@pytest.mark.parametrize("kv", ["K8V4", "K8V4-K4V2:th=0.3,tl=0.05,group_size=8"])
def test_measure_times_both_routes_and_dynamic_cache(bench, kv):
    from leankit.hf import enable
    from leankit.testing import tiny_model

    model = tiny_model("llama-gqa")
    enable(model)
    times = bench.measure(model, kv, batch=2, context=37, new=70, repeat=1, seed=3)
    assert set(times) == {"live", "padded", "DynamicCache"} and all(t > 0 for t in times.values())


def test_the_padded_route_takes_the_padded_tiles_and_the_second_pass(bench, monkeypatch):
    from leankit import cache as cache_mod
    from leankit import decode_attention
    from leankit.hf import enable
    from leankit.testing import tiny_model

    model = tiny_model("llama-gqa")
    enable(model)
    live_calls, passes = [], []
    real_live, real_pass = decode_attention.live_page_attention, cache_mod.received_attention_ref
    monkeypatch.setattr(decode_attention, "live_page_attention",
                        lambda q, *a, **k: live_calls.append(q.shape[2]) or real_live(q, *a, **k))
    monkeypatch.setattr(cache_mod, "received_attention_ref", lambda *a, **k: passes.append(1) or real_pass(*a, **k))
    first, second = torch.randint(3, 90, (2, 30)), torch.randint(3, 90, (2, 80))

    def make():
        return cache_mod.LeanCache(model, "K8V4-K4V2:th=0.3,tl=0.05,group_size=8")

    with bench.padded_route():
        bench._turn(model, make, first, second)
    assert live_calls == [] and len(passes) == model.config.num_hidden_layers
    passes.clear()
    bench._turn(model, make, first, second)
    assert live_calls == [80] * model.config.num_hidden_layers and passes == []
    assert decode_attention.supports.__module__ == "leankit.decode_attention"  # the route is undone
