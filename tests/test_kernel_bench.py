"""The decode benchmark's byte model (bench/decode_kernels.py): no GPU needed, nothing timed."""

import io

import pytest


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("decode_kernels")


def test_k8v4_reads_at_most_045_of_fp16_at_head_dim_64(bench):
    shape = bench.Shape(head_dim=64)
    for b in bench.BATCHES:
        for n in bench.CONTEXTS:
            k8v4 = bench.model_call("K8V4", b, n, shape)
            fp16 = bench.model_call("FP16", b, n, shape)
            assert k8v4["bytes"] <= 0.45 * fp16["bytes"], (b, n)
            assert k8v4["page_bytes"] <= 0.45 * fp16["page_bytes"], (b, n)
    # Per token and head: 64 + 4 (K, meta) + 32 + 4 (V, meta) + 4 (position) bytes read.
    assert bench.model_call("K8V4", 1, 1024, shape)["token_bytes"] == pytest.approx(108, abs=0.5)


def test_without_cuda_timings_are_not_measured(bench):
    out = io.StringIO()
    rows = bench.run(bench.Shape(), batches=(1,), contexts=(1024,), measure_cuda=False, out=out)
    text = out.getvalue()
    assert len(rows) == len(bench.CONFIGS)
    assert all("us" not in r and "gbps" not in r for r in rows)
    assert text.count("| not measured not measured not measured not measured") == len(bench.CONFIGS)
    ratio = {r["config"]: r["byte_ratio"] for r in rows}
    assert ratio["FP16"] == 1.0 and ratio["K4V2"] < ratio["K8V4-K4V2"] < ratio["K8V4"] < ratio["K8V8"] < 1.0


def test_act_to_kv_model_agrees_with_planner(bench):
    """The kernel's modelled FLOPs are the planner's kv_gen_flops_per_token; ACT saves memory on MHA only."""
    from leankit.planner.model_spec import get_model

    for name in bench.ACT_MODELS:
        spec = get_model(name)
        r = bench.act_to_kv_call(name, 37)
        assert r["flops"] == 37 * spec.kv_gen_flops_per_token() == 37 * 2 * spec.hidden * 2 * spec.kv_dim
        # the weights alone are a lower bound on the bytes moved
        assert r["bytes"] > 2 * 2 * spec.kv_dim * spec.hidden
        assert (r["saved"] > 0) == (not spec.is_gqa), name
    opt = bench.act_to_kv_call("opt-13b", 100)
    assert opt["act_tok"] / opt["kv_tok"] <= 0.52


def test_act_to_kv_without_cuda_not_measured(bench):
    out = io.StringIO()
    rows = bench.run_act_to_kv(models=("opt-13b",), tokens=(8, 64), measure_cuda=False, out=out)
    assert len(rows) == 2 and all("us" not in r for r in rows)
    assert out.getvalue().count("| not measured") == 2


def test_launcher_host_time_is_measured_with_the_launch_stubbed(bench_script):
    """bench/launch_overhead.py times paged_attention's host work with Triton's launch stubbed
    (nothing runs, no interpreter), and puts the real launch back afterwards."""
    import leankit_kernels.paged_attention as pa

    overhead = bench_script("launch_overhead")
    real = pa.kernel_for
    us = overhead.launcher_us("K8V4-K4V2", overhead.Shape(64, 2, 2), batch=2, context=100, calls=3, rounds=1)
    assert 0 < us < 1e6
    assert pa.kernel_for is real


def test_host_grid_arithmetic_matches_triton():
    """The launchers' host cdiv / next_power_of_2 agree with Triton's on every small input."""
    import triton
    from leankit_kernels import tiles

    for a in range(300):
        for b in range(1, 40):
            assert tiles.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in range(5000):
        assert tiles.next_power_of_2(n) == triton.next_power_of_2(n), n


def test_layer_host_time_runs_each_config_in_its_own_process(bench_script, capsys):
    """bench/layer_host.py times leankit's decode-layer host work with every launch stubbed; each
    config runs in a child process (a stubbed run leaves unwritten buffers behind), whose figures
    the parent prints, with DynamicCache's SDPA beside them."""
    layer_host = bench_script("layer_host")
    assert layer_host.best_round([5.0] * 8 + [1.0] * 8 + [3.0]) == 1.0
    layer_host.main(["--kv", "K8V4", "--steps", "12", "--layers", "2", "--context", "9", "--batch", "2"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("K8V4 "))
    layer_us, step_us, layer_launches, step_launches = (float(x) for x in row.split()[1:])
    assert 0 < layer_us < 1e6 and 0 < step_us < 1e6
    # store, paged attention with the step's own token (+ its split reduce); the step: rows and token grant
    assert 2 <= layer_launches <= 3 and 1 <= step_launches <= 3
    sdpa = next(line for line in out.splitlines() if line.startswith("DynamicCache"))
    assert float(sdpa.split()[-1]) > 0
