"""bench/gpu_step.py on a CPU: the budget's byte count, the prompts it builds, and one tiny run of
the whole comparison (``--cpu``, torch backend) whose table and JSON carry every config."""

import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("gpu_step")


def _tiny(bench, monkeypatch):
    monkeypatch.setitem(bench.SHAPES, "tiny", (64, 4, 2, 2, 96, 300))
    return bench.random_model("tiny", None, torch.float32, "cpu")


def test_budget_bytes_are_a_dynamic_caches_bytes(bench, monkeypatch):
    from transformers import DynamicCache

    from leankit.bench.step import prefill

    model = _tiny(bench, monkeypatch)
    ids, mask = bench.prompts(3, 40, model.config.vocab_size, "cpu")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill(model, cache, ids, mask)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert bench.dynamic_bytes(model, 3, 40) == held


def test_prompts_are_left_padded_rows_of_different_lengths(bench):
    ids, mask = bench.prompts(10, 80, 300, "cpu")
    assert ids.shape == mask.shape == (10, 80)
    assert mask.sum(1).tolist() == [80 - 8 * (i % 8) for i in range(10)]
    assert bool((ids[mask == 0] == 0).all()) and bool((ids[mask == 1] >= 3).all())
    assert mask[:, -1].all()  # left padding: every row ends on a real token


def test_a_cpu_run_reports_every_config(bench, monkeypatch, tmp_path, capsys):
    _tiny(bench, monkeypatch)
    kvs = ["FP16:page_size=512", "K4V2:page_size=512"]
    assert bench.main(["--cpu", "--shapes", "tiny", "--contexts", "96", "--batch", "2", "--steps", "2",
                       "--warmup", "1", "--kv", *kvs, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_step.json").read_text())["rows"]
    assert [r["kv"] for r in rows] == kvs
    for r in rows:
        assert r["prefill_ratio"] > 0 and r["decode_ratio"] > 0
        assert r["budget_rows"] >= 1 and r["budget_tokens_per_s_ratio"] > 0
    fp16, k4v2 = rows
    # 2-4 bits a value: fewer bytes a row, so more rows fit the same budget
    assert k4v2["peak_ratio"] < 0.6 * fp16["peak_ratio"] and k4v2["budget_rows"] > fp16["budget_rows"]
    md = (tmp_path / "gpu_step.md").read_text()
    assert md.count("| tiny (2) | 96 | 2 |") == 2
    assert "K4V2" in capsys.readouterr().out


def test_profile_covers_every_kind_and_phase(bench, monkeypatch, tmp_path):
    _tiny(bench, monkeypatch)
    assert bench.main(["--cpu", "--shapes", "tiny", "--contexts", "64", "--batch", "2",
                       "--profile", "K8V4:page_size=512", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu_step_profile.txt").read_text()
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    kinds = ("SDPA without cuDNN", "default SDPA", "leankit-enabled model", "LeanCache K8V4")
    assert len(heads) == 8 and all(sum(k in h for h in heads) == 2 for k in kinds), heads
    assert sum("prefill" in h for h in heads) == 4 and sum("decode step" in h for h in heads) == 4
