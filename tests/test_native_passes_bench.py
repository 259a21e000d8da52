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
        assert sum(tp.tokens for tp in passes) == stored == int(mask.sum()) * cfg.num_key_value_heads
        for tp in passes:
            assert bench.best_ns(tp.scores_pass, cold=False, evict=torch.zeros(1)) > 0
            assert bench.best_ns(tp.values_pass, cold=True, evict=torch.zeros(16)) > 0
            # pass 1 scored exactly the stored slots; pass 2 starts from zero each call
            assert int((tp.scores > float("-inf")).sum()) == tp.tokens * group
            acc = tp.acc.clone()
            tp.values_pass()
            assert torch.equal(tp.acc, acc) and acc.abs().sum() > 0


def _tiny_cache(kv: str):
    model = testing.tiny_model("llama-gqa")
    ids, mask = testing.left_padded_batch(rows=3, width=29)
    cache = LeanCache(model, KVConfig.parse(kv))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    cfg = model.config
    return cache, cfg.num_attention_heads // attention_kv_heads(cfg), attention_head_dim(cfg)


def test_against_times_two_builds_of_the_same_pages(bench, tmp_path):
    """--against's comparison: a build of a copy of the sources computes what this build does (no
    difference at all) and both get a time per pass."""
    import shutil

    kernels = native.kernels()
    if kernels is None:
        pytest.skip("no C compiler for leankit.native")
    for f in list(native.SOURCE_DIR.glob("*.[ch]")):
        shutil.copy(f, tmp_path / f.name)
    other = native.build_from(tmp_path)
    cache, group, head_dim = _tiny_cache("K8V4-K4V2:th=0.25,tl=0,group_size=8")
    rows = bench.compare_builds({"new": kernels, "copy": other}, cache, [0, 1], group, head_dim, cold=False,
                                evict=torch.zeros(1), calls=3)
    occupied = sum(len(bench.tier_passes(kernels, cache, layer, group, head_dim, torch.Generator()))
                   for layer in (0, 1))
    assert len(rows) == occupied >= 2  # one row per occupied tier of each layer
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        s_new, s_old, s_ratio, v_new, v_old, v_ratio, diff = map(float, cells[3:])
        assert min(s_new, s_old, v_new, v_old) > 0
        assert s_ratio == pytest.approx(s_new / s_old, rel=0.01) and v_ratio == pytest.approx(v_new / v_old, rel=0.01)
        assert diff == 0


def test_sources_at_a_revision_and_a_clear_error_for_none(bench, tmp_path):
    import subprocess

    root = native.SOURCE_DIR.parent.parent
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, check=False).returncode:
        pytest.skip("not a git checkout")
    out = bench.sources_at("HEAD", tmp_path)
    assert {p.name for p in out.glob("*.c")} == {p.name for p in native.SOURCE_DIR.glob("*.c")}
    with pytest.raises(SystemExit, match="no leankit/native sources"):
        bench.sources_at("no-such-revision", tmp_path)
    with pytest.raises(ValueError, match="no C sources"):
        native.build_from(tmp_path / "empty")


def test_native_ab_times_both_builds_end_to_end_and_restores_the_kernels(bench_script, tmp_path):
    """bench/native_ab.py on a tiny model: a build of a copy of the sources gives the same logits
    as this build (no difference at all), both get a time, and the kernels leankit serves are its
    own again afterwards."""
    import shutil

    kernels = native.kernels()
    if kernels is None:
        pytest.skip("no C compiler for leankit.native")
    ab = bench_script("native_ab")
    for f in list(native.SOURCE_DIR.glob("*.[ch]")):
        shutil.copy(f, tmp_path / f.name)
    builds = {"new": kernels, "old": native.build_from(tmp_path)}
    model = testing.tiny_model("llama-gqa")
    served = native.kernels_for
    row = ab.turn(model, builds, "K8V4-K4V2:th=0.25,tl=0,group_size=8", batch=2, context=40, new=30, repeat=1)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "turn" and float(cells[5]) > 0 and float(cells[8]) == 0
    ids, mask = testing.left_padded_batch(rows=3, width=29)
    row = ab.decode_steps(model, builds, "K8V4", ids, mask, steps=2)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "decode" and float(cells[5]) > 0
    assert native.kernels_for is served
