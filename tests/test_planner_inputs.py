"""Planner and evaluation inputs: a one-token generation plans, a hand-edited hardware profile with wrong
field types is refused with a clear ``ValueError`` (``leankit plan`` exit 2), not a traceback."""

import json

import pytest

from leankit.planner.cli import main as plan_main
from leankit.planner.hardware import PRESETS, HardwareProfile
from leankit.planner.planner import Allowed, Workload, plan


def test_gen_one_plans_with_activation_cache_allowed():
    # OPT's activation is half its KV, so the hybrid mode is costed; with gen=1 there is no decode step
    p = plan("opt-6.7b", "rtx4090", Workload(1, 1, 1))
    assert p.feasible and p.decode_time == 0 and p.throughput > 0
    p = plan("opt-6.7b", "rtx4090", Workload(32, 512, 1))
    assert p.feasible


def test_gen_one_cli_exit_code(capsys):
    assert plan_main(["plan", "--model", "opt-6.7b", "--hardware", "rtx4090", "--gen", "1"]) == 0


@pytest.mark.parametrize("change", [
    {"cpu_threads": "16"}, {"cpu_threads": 2.5}, {"cpu_threads": True}, {"cpu_threads": 10**9},
    {"cpu_attn_efficiency": "0.5"}, {"cpu_attn_efficiency": None},
    {"fits": {"t_kv_gen": {"a": 1}}}, {"fits": [1]}, {"fits": {"t_kv_gen": 3}},
    {"fits": {"t_kv_gen": {"slope": float("nan"), "intercept": 0.0, "r2": 1.0}}, "fit_model": "opt-6.7b"},
    {"fits": {"t_load_kv": {"slope": 1e-9, "intercept": float("inf"), "r2": 1.0}}, "fit_model": "opt-6.7b"},
    {"device": "tpu"}, {"gpu_mem": True}, {"h2d_bw": True}, {"gpu_mem": 1e308}, {"host_mem": 2.0 ** 61},
    {"h2d_bw": 1e-300}, {"cpu_flops": 1e300}, {"gpu_freq": 0.5},
])
def test_bad_profile_fields_are_value_errors(tmp_path, capsys, change):
    d = PRESETS["rtx4090-pcie4"].to_dict()
    d.update(change)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="bad hardware profile"):
        HardwareProfile.load(f)
    assert plan_main(["plan", "--model", "opt-6.7b", "--hardware", str(f), "--batch", "2", "--gen", "4"]) == 2
    assert "bad hardware profile" in capsys.readouterr().err


def test_good_profile_round_trips(tmp_path):
    f = PRESETS["rtx4090-pcie4"].save(tmp_path / "p.json")
    assert HardwareProfile.load(f) == PRESETS["rtx4090-pcie4"]


def test_timeline_reports_the_file_it_writes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = ["plan", "--model", "opt-30b", "--hardware", "rtx4090", "--batch", "8", "--prompt", "128", "--gen", "4"]
    assert plan_main(args + ["--timeline", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t.png").is_file()
    assert f"timeline written to {tmp_path / 't.png'}" in capsys.readouterr().out
    # a folder is refused, not reported as written
    assert plan_main(args + ["--timeline", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not (tmp_path.parent / (tmp_path.name + ".png")).exists()
    # another format is refused before the plan is printed
    assert plan_main(args + ["--timeline", str(tmp_path / "t.txt")]) == 2
    out = capsys.readouterr()
    assert "ending in .png" in out.err and not out.out and not (tmp_path / "t.txt").exists()


def test_from_plan_names_the_shape_mismatch_first():
    from types import SimpleNamespace

    from leankit.cache import LeanCache
    from leankit.planner.planner import Allowed

    p = plan("opt-6.7b", "rtx4090", Workload(2, 64, 8), Allowed())
    assert p.choice.mode == "attn_offload"  # a mode LeanCache cannot serve, for another model
    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                          head_dim=16, to_dict=dict)
    with pytest.raises(ValueError, match="the plan is for opt-6.7b"):
        LeanCache.from_plan(SimpleNamespace(config=cfg), p)



def test_eval_config_that_does_not_fit_the_model_is_an_argument_error(capsys):
    import argparse

    from eval.common import check_configs_fit
    from leankit.testing import tiny_model

    model = tiny_model()
    hd = model.config.hidden_size // model.config.num_attention_heads
    ap = argparse.ArgumentParser(prog="perplexity.py")
    check_configs_fit(ap, model, [("K8V4", {})])  # fits: no error
    with pytest.raises(SystemExit) as e:
        check_configs_fit(ap, model, [("K8V4", {"group_size": hd * 3 // 4})])
    assert e.value.code == 2
    assert "does not fit the model" in capsys.readouterr().err


def test_large_batch_plans_quickly():
    """A huge --batch is refused (or planned) in closed form, not by building and summing a batch-long
    tuple of prompt lengths for every candidate the search costs (minutes at batch 10**7)."""
    import time

    t0 = time.perf_counter()
    p = plan("smollm2-135m", "rtx4090", Workload(10**7, 512, 128), Allowed(kv_configs=(None, "K8V4")))
    assert not p.feasible and "cache alone needs" in p.infeasible_reason
    assert time.perf_counter() - t0 < 10
