"""The composed planner, its monotonicity, the CLI and the timeline."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leankit.planner import (
    Allowed,
    Choice,
    HardwareProfile,
    Limits,
    Workload,
    evaluate,
    format_plan,
    get_hardware,
    get_model,
    hardware_names,
    plan,
)
from leankit.planner import planner as pl
from leankit.planner.cli import add_plan_parser, main, run_plan
from leankit.planner.hardware import GB, GiB, fit_linear

RTX = get_hardware("rtx4090-pcie4")
OPT30 = get_model("opt-30b")
SMOL = get_model("smollm2-135m")

# a CPU-only machine like a laptop: one memory, memcpy as "link", fp32 matmul
CPU_BOX = HardwareProfile(name="detected:cpu", h2d_bw=8 * GB, d2h_bw=8 * GB, gpu_flops=100e9, gpu_mem_bw=16 * GB,
                          cpu_flops=100e9, cpu_mem_bw=16 * GB, gpu_mem=16 * GiB, host_mem=16 * GiB, gpu_freq=3e9,
                          cpu_freq=3e9, cpu_threads=2, device="cpu", cpu_attn_efficiency=0.3)


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="leankit")
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    return parser.parse_args(["plan", *argv])


# ------------------------------------------------------------------------------- the simulation


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), *[st.floats(0, 10) for _ in range(6)])
def test_closed_form_layer_time_equals_the_event_simulation(m, x, kvl, res, host, rest, w):
    link, gpu = pl._sim(m, x, kvl, res, host, rest, w)
    terms = pl._sim_terms(m, (x, 0), (kvl, 0), (res, 0), (host, 0), (rest, 0), (w, 0))
    assert max(a for a, _ in terms) == pytest.approx(max(link, gpu), rel=1e-12, abs=1e-12)


def test_one_minibatch_reduces_to_kvpr_eq10_plus_attention():
    # m = 1, no resident ACT, no weights: x*l + max(r*l, kv*(s'-l)) + rest
    x, kv, r, rest = 0.3, 1.6, 0.9, 0.25
    link, gpu = pl._sim(1, x, kv, 0.0, r, rest, 0.0)
    assert max(link, gpu) == pytest.approx(x + max(r, kv) + rest)


# ------------------------------------------------------------------------------- plans


def test_smollm2_on_a_cpu_machine_declines_activation_caching_because_of_gqa():
    p = plan("smollm2-135m", CPU_BOX, Workload(8, 256, 32))
    assert p.feasible and p.choice.mode == "kv"
    assert p.reasons["activation_cache"].startswith("declined")
    assert "grouped-query attention" in p.reasons["activation_cache"]
    assert "1152 B" in p.reasons["activation_cache"] and "768 B" in p.reasons["activation_cache"]
    assert p.reasons["kvpr"].startswith("declined")
    assert p.reasons["attention_offload"].startswith("not applicable")
    assert "6 hardware threads" in p.reasons["threads"]
    assert p.throughput > 0 and len(p.layers) == 30
    assert all(lc.link == 0 for lc in p.layers)  # one memory: nothing crosses a link
    assert "declined" in format_plan(p)


@pytest.mark.parametrize("hw_name", hardware_names())
def test_every_preset_plans_smollm2_and_declines_activation_caching(hw_name):
    p = plan("smollm2-135m", hw_name, Workload(16, 256, 16))
    assert p.feasible
    assert p.choice.mode != "hybrid"
    assert "grouped-query attention" in p.reasons["activation_cache"]
    assert p.baseline is not None and p.throughput >= p.baseline.throughput * (1 - 1e-12)


@pytest.mark.parametrize("hw_name", hardware_names())
def test_every_preset_plans_opt13b_with_a_breakdown(hw_name):
    p = plan("opt-13b", hw_name, Workload(32, 256, 8), Allowed(kv_configs=(None, "K8V4")))
    assert p.feasible, p.infeasible_reason
    assert len(p.layers) == 40
    assert p.step_time == pytest.approx(sum(lc.time for lc in p.layers))
    assert set(p.reasons) >= {"activation_cache", "kvpr", "attention_offload", "kv_quantization",
                              "weight_placement", "threads"}
    assert p.speedup >= 1 - 1e-12  # the baseline is among the candidates


def test_opt30b_hybrid_beats_kv_only_and_reports_algorithm1():
    p = plan(OPT30, RTX, Workload(128, 512, 32), Allowed(kvpr=False, attention_offload=False))
    assert p.choice.mode == "hybrid"
    assert p.speedup > 1.1
    assert p.reasons["activation_cache"].startswith("chosen")
    assert p.algorithm1 is not None and p.algorithm1.act_host > 0
    lay = p.layers[0]
    assert lay.act_load > 0 and lay.recompute > 0
    assert lay.link == pytest.approx(lay.act_load + lay.kv_load + lay.weight_load)
    assert p.minibatch_report["minibatches"] >= 1


def test_infeasible_when_memory_is_too_small():
    p = plan(OPT30, RTX, Workload(128, 512, 32), limits=Limits(host_mem=20 * GiB, gpu_mem=8 * GiB))
    assert not p.feasible and "no feasible plan" in p.infeasible_reason


def test_activation_share_respects_host_memory():
    wl = Workload(128, 1920, 128)
    loose = evaluate(OPT30, RTX, wl, Choice(None, "hybrid", 0))
    need_kv_only = evaluate(OPT30, RTX, wl, Choice(None, "kv", 0)).memory["host_used"]
    tight = evaluate(OPT30, RTX, wl, Choice(None, "hybrid", 0), limits=Limits(host_mem=need_kv_only * 0.8))
    assert tight.feasible and tight.memory["host_used"] <= need_kv_only * 0.8 * (1 + 1e-9)
    assert tight.act_share["host tokens as ACT"] >= loose.act_share["host tokens as ACT"] - 1e-12


def test_measured_fits_replace_analytic_rates():
    slow = RTX.replace(fits={"t_kv_gen": fit_linear([1, 2], [10e-6, 20e-6])}, fit_model="opt-30b")
    wl = Workload(128, 1024, 4)
    a = evaluate(OPT30, RTX, wl, Choice(None, "hybrid", 0))
    b = evaluate(OPT30, slow, wl, Choice(None, "hybrid", 0))
    assert 0 <= b.act_share["host tokens as ACT"] < a.act_share["host tokens as ACT"]
    assert b.layers[0].recompute / b.layers[0].gpu_cache_tokens > a.layers[0].recompute / a.layers[0].gpu_cache_tokens


# ------------------------------------------------------------------------------- monotonicity

MODES_K = [("kv", 0), ("kv", 10), ("hybrid", 0), ("hybrid", 12), ("kvpr", 0), ("kvpr", 6), ("attn_offload", 8)]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODES_K), st.floats(1.0, 8.0), st.sampled_from([None, "K8V4"]), st.integers(1, 3))
def test_more_bandwidth_never_predicts_slower_for_a_fixed_plan(mode_k, f, kv, which):
    mode, k = mode_k
    if mode in ("hybrid", "kvpr", "attn_offload") and kv is not None:
        kv = None  # OPT activations beat K8V4 bytes only at fp16
    wl = Workload(64, 384, 24)
    fast = {1: RTX.replace(h2d_bw=RTX.h2d_bw * f, d2h_bw=RTX.d2h_bw * f),
            2: RTX.replace(gpu_flops=RTX.gpu_flops * f, gpu_mem_bw=RTX.gpu_mem_bw * f),
            3: RTX.replace(cpu_mem_bw=RTX.cpu_mem_bw * f, cpu_flops=RTX.cpu_flops * f)}[which]
    a = evaluate(OPT30, RTX, wl, Choice(kv, mode, k), detail=False)
    b = evaluate(OPT30, fast, wl, Choice(kv, mode, k), detail=False)
    assert a.feasible == b.feasible
    assert b.total_time <= a.total_time * (1 + 1e-12)


@settings(max_examples=8, deadline=None)
@given(st.floats(1.0, 6.0), st.sampled_from(["opt-13b", "llama-2-7b"]))
def test_more_bandwidth_never_predicts_slower_for_the_best_plan(f, name):
    wl = Workload(48, 256, 8)
    al = Allowed(kv_configs=(None, "K8V4"))
    a = plan(name, RTX, wl, al)
    b = plan(name, RTX.replace(h2d_bw=RTX.h2d_bw * f, d2h_bw=RTX.d2h_bw * f), wl, al)
    assert b.total_time <= a.total_time * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["K2V2", "K4V2", "K4V4", "K8V4", "K8V8", "K16V8", "FP16"]),
       st.sampled_from(["K4V4", "K8V4", "K8V8", "K16V16"]), st.sampled_from(["opt-13b", "llama-3-8b"]))
def test_more_bits_never_predict_less_link_traffic(lo, hi, name):
    m = get_model(name)
    def bits(s):
        return (16, 16) if s == "FP16" else tuple(int(t) for t in s[1:].split("V"))

    lb, hb = bits(lo), bits(hi)
    if not (hb[0] >= lb[0] and hb[1] >= lb[1]):
        return
    wl = Workload(32, 512, 4)
    a = evaluate(m, RTX, wl, Choice(lo, "kv", 0))
    b = evaluate(m, RTX, wl, Choice(hi, "kv", 0))
    assert b.layers[0].kv_load >= a.layers[0].kv_load
    assert m.kv_bytes_per_token(hi) >= m.kv_bytes_per_token(lo)


# ------------------------------------------------------------------------------- CLI and timeline


def test_cli_issue_example_prints_a_table(capsys):
    rc = run_plan(_parse("--model", "opt-30b", "--hardware", "rtx4090-pcie4", "--batch", "128", "--prompt", "512",
                         "--gen", "16"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "per-layer decode breakdown" in out and "mechanisms:" in out and "speedup" in out


def test_cli_json_and_kv_list(capsys):
    rc = main(["plan", "--model", "llama-3-8b", "--hardware", "l40", "--kv", "fp16,K8V4,K4V2", "--gen", "8",
               "--no-attn-offload", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["feasible"] and len(d["layers"]) == 32
    assert "kv_quantization" in d["reasons"] and d["speedup"] >= 1 - 1e-12


def test_cli_rejects_unknown_names_with_the_valid_ones(capsys):
    assert run_plan(_parse("--model", "gpt-9", "--hardware", "a100")) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m" in err and "opt-30b" in err
    assert run_plan(_parse("--model", "opt-13b", "--hardware", "tpu")) == 2
    err = capsys.readouterr().err
    assert "rtx4090-pcie4" in err and "detect" in err
    assert run_plan(_parse("--model", "opt-13b", "--hardware", "a100", "--kv", "K3V3")) == 2


def test_cli_reads_a_saved_profile(tmp_path, capsys):
    path = CPU_BOX.save(tmp_path / "box.json")
    rc = run_plan(_parse("--model", "smollm2-135m", "--hardware", str(path), "--batch", "4", "--gen", "4"))
    out = capsys.readouterr().out
    assert rc == 0 and "grouped-query attention" in out


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    from leankit.planner.timeline import draw_timeline, segments

    p = plan(OPT30, RTX, Workload(64, 256, 8), Allowed(attention_offload=False))
    lanes = segments(p)
    assert lanes["PCIe h2d"] and lanes["GPU"]
    out = draw_timeline(p, tmp_path / "t.png")
    assert out.stat().st_size > 5000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_timeline_flag(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    rc = run_plan(_parse("--model", "opt-13b", "--hardware", "a100", "--batch", "32", "--gen", "4", "--timeline",
                         str(path)))
    assert rc == 0 and path.exists() and "timeline written" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_detect_on_this_machine(tmp_path, capsys):
    prof = tmp_path / "detect.json"
    rc = run_plan(_parse("--model", "smollm2-135m", "--hardware", "detect", "--save-profile", str(prof),
                         "--batch", "8", "--gen", "16"))
    out = capsys.readouterr().out
    assert rc == 0 and prof.exists()
    assert "R^2" in out and "activation_cache   declined" in out and "grouped-query attention" in out


def test_a_config_dict_without_layer_types_gets_its_class_layer_types():
    """A config.json often leaves the layer types to its config class (Gemma3's sliding-window
    pattern, Qwen2's max_window_layers): planned as the model runs, not every layer sliding."""
    from leankit.planner import from_hf_config

    gemma = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
             "sliding_window": 512, "sliding_window_pattern": 6}
    spec = from_hf_config(gemma)
    assert spec.cache_layers == 4 and spec.sliding_layers == tuple(i for i in range(26) if (i + 1) % 6)
    qwen = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "sliding_window": 32768,
            "use_sliding_window": True, "max_window_layers": 21}
    assert from_hf_config(qwen).sliding_layers == (21, 22, 23)
    assert from_hf_config({**qwen, "use_sliding_window": False}).sliding_layers == ()


def test_a_config_dict_is_planned_with_the_layers_its_model_slides():
    """Mistral slides every layer when a window is set, whatever ``layer_types`` says; Llama never
    slides, whatever ``sliding_window`` says (as the cache reads them, attention_layer_types)."""
    from leankit.planner import from_hf_config

    dims = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 32000, "sliding_window": 256}
    mistral = {**dims, "model_type": "mistral", "layer_types": ["full_attention", "sliding_attention"] * 2}
    assert from_hf_config(mistral).sliding_layers == (0, 1, 2, 3)
    assert from_hf_config({**mistral, "sliding_window": None}).sliding_layers == ()
    assert from_hf_config({**dims, "model_type": "llama"}).sliding_layers == ()


def test_allowed_takes_kv_config_objects_and_refuses_one_with_activations():
    from leankit.config import KVConfig

    assert Allowed(kv_configs=(KVConfig.parse("K8V4"),)).kv_configs[0].label() == "K8V4"
    with pytest.raises(ValueError, match="the planner chooses it itself"):
        Allowed(kv_configs=(KVConfig.parse("K8V4:act=0.5"),))


def test_plans_that_predict_the_same_time_go_to_the_simpler_one():
    """A transfer hidden behind compute costs nothing, so several plans can predict one time: the
    tie goes to the earlier mode, then the most resident layers, full-precision weights and cache."""
    from types import SimpleNamespace

    from leankit.planner.planner import Choice, _fastest

    def p(t, *choice):
        return SimpleNamespace(total_time=t, choice=Choice(*choice))

    streamed, resident = p(1.0, None, "kv", 0), p(1.0 + 1e-12, None, "kv", 2)
    assert _fastest([streamed, resident]) is resident
    quant_w = p(1.0, None, "kv", 2, 4)
    assert _fastest([quant_w, resident]) is resident
    quant_kv = p(1.0, "K8V4", "kv", 2)
    assert _fastest([quant_kv, resident]) is resident
    faster = p(0.9, "K8V4", "kv", 0, 4)
    assert _fastest([streamed, resident, faster]) is faster
