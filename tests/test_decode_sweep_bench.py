"""bench/decode_sweep.py on a CPU: its argument parsing, and a sweep under Triton's interpreter
(timings stubbed) whose variants must all compute the same attention and leave the launcher's
defaults as they were."""

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before leankit_kernels is imported: kernels run on CPU

import pytest
import torch


@pytest.fixture(scope="module")
def sweep_mod(bench_script):
    return bench_script("decode_sweep")


def test_variant_and_point_parsing(sweep_mod):
    assert sweep_mod.parse_variant("64:8:1") == (64, 8, 1)
    assert sweep_mod.parse_point("32x16384") == (32, 16384)
    for bad in ("64:8", "48:4:2", "64:3:2", "64:4:0", "a:b:c"):
        with pytest.raises(argparse.ArgumentTypeError):
            sweep_mod.parse_variant(bad)
    for bad in ("32", "0x10", "8x-1", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            sweep_mod.parse_point(bad)


def test_every_variant_computes_the_same_attention_and_defaults_come_back(sweep_mod, monkeypatch):
    import leankit_kernels.paged_attention as pa

    monkeypatch.setattr(sweep_mod, "time_call", lambda fn: (1.0, 2.0))
    before = (pa.DECODE_MAX_ROWS, pa.DECODE_WARPS, pa.DECODE_STAGES, pa.resident_programs, pa.choose_splits)
    shape = sweep_mod.Shape(head_dim=32, kv_heads=2, group=3)
    rows = sweep_mod.sweep(shape, 2, 150, ["K8V4", "K8V4-K4V2"], [(128, 4, 2), (32, 8, 1)], torch.device("cpu"), 1e12)
    assert [(r["config"], r["rows"]) for r in rows] == [("K8V4", 128), ("K8V4", 32), ("K8V4-K4V2", 128),
                                                         ("K8V4-K4V2", 32)]
    for r in rows:
        assert max(r["tiling"].values()) <= r["rows"] or r["rows"] < 64  # a tile holds whole pages
        assert r["splits"] >= 1 and r["us"] == 1.0
        # the fp16 output of the same attention, summed in another order: a rounding step or two
        assert r["rel_diff_vs_first"] <= 2 * 2.0 ** -11, r
    assert (pa.DECODE_MAX_ROWS, pa.DECODE_WARPS, pa.DECODE_STAGES, pa.resident_programs, pa.choose_splits) == before
    text = "\n".join(sweep_mod.markdown(rows, "t"))
    assert text.count("| K8V4 |") == 2 and "32:8:1" in text
