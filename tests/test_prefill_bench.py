"""bench/prefill_kernels.py on a CPU: the FLOP model, the unmeasured table, and that the calls it
times compute causal attention over the synthetic cache (kernels under Triton's interpreter)."""

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before leankit_kernels is imported: kernels run on CPU

import pytest
import torch


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("prefill_kernels")


def test_causal_flops_count_the_lower_triangle(bench):
    shape = bench.Shape(head_dim=64, kv_heads=2, group=3)
    # 3 tokens: 1 + 2 + 3 = 6 visible pairs, 6 query heads, q k^T and p v at 2 FLOPs a MAC
    assert bench.causal_flops(1, 3, shape) == 2 * 2 * 6 * 6 * 64
    assert bench.causal_flops(4, 3, shape) == 4 * bench.causal_flops(1, 3, shape)


def test_without_cuda_nothing_is_timed(bench, capsys):
    rows = bench.run(bench.Shape(head_dim=64), 2, prompts=(128,), measure_cuda=False)
    assert [r["config"] for r in rows] == list(bench.CONFIGS)
    assert all("prefill_us" not in r for r in rows)
    assert "not measured" in capsys.readouterr().out
    assert len(bench.markdown(rows, bench.Shape(), "none", "")) == 6  # header lines only


@pytest.mark.parametrize("spec", ["K8V4", "K8V4-K4V2"])
def test_timed_calls_compute_causal_attention_over_the_pages(bench, spec):
    from leankit.attention import paged_attention_ref, received_attention_ref

    torch.manual_seed(0)
    shape = bench.Shape(head_dim=32, kv_heads=2, group=3)
    n = 70
    prefill, significance, (q, kv, q_pos, scale) = bench.prefill_calls(spec, 2, n, shape, torch.device("cpu"))
    out, lse = prefill()
    ref, ref_lse = paged_attention_ref(q, kv, q_pos, scale)
    assert out.shape == (2, n, 6, 32)
    tol = 4 * 2.0 ** -11 * float(ref.abs().max())  # fp16 queries and output
    assert (out.float() - ref.float()).abs().max() <= tol
    assert torch.allclose(lse, ref_lse, atol=1e-2)
    sig = significance()
    ref_sig = received_attention_ref(q, kv, q_pos, scale, ref_lse)
    for got, want in zip(sig, ref_sig):
        assert torch.allclose(got.float(), want.float(), atol=1e-3)


def test_tile_sweep_tiles_agree_and_the_launch_plan_comes_back(bench, monkeypatch):
    import leankit_kernels.prefill_attention as pf

    monkeypatch.setattr(bench, "kernel_us", lambda fn: 2.0)
    real = pf.prefill_config
    tiles = [bench.parse_tile("64:32:4:2"), bench.parse_tile("16:16:2:1")]
    rows = bench.tile_sweep(bench.Shape(head_dim=32, kv_heads=2, group=3), 1, (40,), ("K8V4",), tiles,
                            device=torch.device("cpu"))
    assert [r["tile"] for r in rows] == ["64:32:4:2", "16:16:2:1"]
    assert rows[1]["rel_diff_vs_first"] <= 2 * 2.0 ** -11  # the same attention, fp16 output rounding
    assert pf.prefill_config is real
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_tile("64:24:4:2")


def test_prompt_significance_calls_agree(bench):
    """The two timed prompt-significance calls (kernel, torch pass) compute the same thing."""
    torch.manual_seed(0)
    kernel, torch_pass = bench.prompt_significance_calls(2, 70, bench.Shape(head_dim=32, kv_heads=2, group=3),
                                                         torch.device("cpu"))
    got, want = kernel(), torch_pass()
    assert got.shape == want.shape == (2, 2, 70)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(got.sum(-1), torch.full((2, 2), 70.0), rtol=1e-3, atol=0)
