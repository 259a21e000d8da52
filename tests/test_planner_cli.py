"""``leankit plan`` input handling: every bad input gives a clear error, every edge value is honoured."""

import json

import pytest

from leankit.planner import Allowed, Limits, Workload, plan
from leankit.planner.cli import kv_list, main
from leankit.planner.hardware import GiB, HardwareProfile, get_hardware

BASE = ["plan", "--model", "opt-30b", "--hardware", "rtx4090-pcie4", "--gen", "8"]


def _json(capsys, *extra):
    rc = main(BASE + ["--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def _argparse_error(capsys, *extra) -> str:
    with pytest.raises(SystemExit) as e:
        main(BASE + list(extra))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_kv_with_inline_overrides_parses():
    assert kv_list("K8V4:group_size=32") == ["K8V4:group_size=32"]
    assert kv_list("fp16, k8v4-k4v2:th=0.2,tl=0 ,K4V4") == [None, "K8V4-K4V2:th=0.2,tl=0", "K4V4"]
    with pytest.raises(ValueError, match="does not follow"):
        kv_list("th=0.2,K8V4")
    with pytest.raises(ValueError, match="unknown override"):
        kv_list("K8V4:grp=32")


def test_cli_kv_group_size_reaches_the_plan(capsys):
    rc, d = _json(capsys, "--kv", "K8V4:group_size=32", "--no-act", "--no-kvpr", "--no-attn-offload")
    assert rc == 0 and d["kv"] == "K8V4:group_size=32"


def test_gpu_mem_zero_is_honoured(capsys):
    rc, d = _json(capsys, "--gpu-mem", "0")
    assert rc == 1 and not d["feasible"]
    assert "has 0.0 GiB" in d["infeasible_reason"] or "(0.0 GiB" in d["infeasible_reason"]


def test_host_mem_zero_is_honoured(capsys):
    # OPT-30B's 56 GiB of weights cannot live on a 24 GiB GPU once the host holds nothing
    rc, d = _json(capsys, "--host-mem", "0")
    assert rc == 1 and "24.0 GiB" in d["infeasible_reason"]
    # a model that fits the GPU whole still plans with no host memory, every layer resident
    rc = main(["plan", "--model", "smollm2-135m", "--hardware", "rtx4090-pcie4", "--gen", "8", "--json",
               "--host-mem", "0"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["gpu_layers"] == 30


def test_limits_zero_differs_from_unset():
    hw = get_hardware("rtx4090-pcie4")
    assert Limits(gpu_mem=0).gpu(hw) == 0 and Limits().gpu(hw) == hw.gpu_mem
    assert Limits(host_mem=0.0).host(hw) == 0 and Limits().host(hw) == hw.host_mem
    with pytest.raises(ValueError, match="gpu_mem"):
        Limits(gpu_mem=-1)


@pytest.mark.parametrize("flag", ["--gpu-mem", "--host-mem"])
def test_negative_memory_rejected(capsys, flag):
    err = _argparse_error(capsys, flag, "-5")
    assert flag in err and ">= 0" in err
    err = _argparse_error(capsys, flag, "1e300")  # would print plans hundreds of digits wide
    assert flag in err and "at most 2**30 (1 EiB)" in err


def test_hardware_json_with_missing_fields(tmp_path, capsys):
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({"name": "mine", "h2d_bw": 1e10, "gpu_mem": 8 * GiB}))
    rc = main(["plan", "--hardware", str(p)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    for name in ("d2h_bw", "gpu_flops", "cpu_mem_bw", "host_mem"):
        assert name in err
    assert "'gpu_mem'" not in err.split("lacks")[1].split(";")[0]  # only the missing ones are named
    p.write_text("[1, 2]")
    assert main(["plan", "--hardware", str(p)]) == 2
    assert "JSON object" in capsys.readouterr().err
    p.write_text("{not json")
    assert main(["plan", "--hardware", str(p)]) == 2
    assert "bad hardware profile" in capsys.readouterr().err
    with pytest.raises(ValueError, match="lacks required"):
        HardwareProfile.from_dict({"name": "x"})


@pytest.mark.parametrize("value,msg", [(",", "at least one"), ("abc", "'abc' is not a bit width"),
                                       ("16,3", "3 is not among")])
def test_bad_weight_bits(capsys, value, msg):
    err = _argparse_error(capsys, "--weight-bits", value)
    assert "--weight-bits" in err and msg in err


@pytest.mark.parametrize("value", ["1.5", "-0.1", "x"])
def test_high_fraction_outside_unit_interval_rejected(capsys, value):
    assert "--high-fraction" in _argparse_error(capsys, "--high-fraction", value)
    with pytest.raises(ValueError, match="high_fraction"):
        Allowed(high_fraction=1.5)
    with pytest.raises(ValueError, match="weight bit"):
        Allowed(weight_bits=())


@pytest.mark.parametrize("flag", ["--batch", "--prompt", "--gen"])
def test_workload_must_be_positive(capsys, flag):
    assert flag in _argparse_error(capsys, flag, "0")


def test_huge_workload_names_the_binding_limit(capsys):
    """batch 100000 x prompt 100000: the cache of 10^10 tokens fits nowhere; the message must say so,
    not quote a candidate with many resident layers whose GPU working set overshoots by 0.2 GiB."""
    rc = main(["plan", "--model", "opt-13b", "--hardware", "a100-40gb-pcie4", "--batch", "100000", "--prompt",
               "100000", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1
    reason = d["infeasible_reason"]
    assert "cache alone needs" in reason and "before any cache" not in reason
    assert "10012800000 tokens" in reason and "552.0 GiB" in reason  # 40 GiB GPU + 512 GiB host


def test_infeasible_reason_comes_from_the_closest_candidate():
    # a cache that fits memory in total, but a GPU limit below what weights + buffers need
    p = plan("opt-30b", "rtx4090-pcie4", Workload(4, 64, 8), limits=Limits(gpu_mem=1 * GiB))
    assert not p.feasible and "closest candidate" in p.infeasible_reason
    assert "0 layers resident" in p.infeasible_reason  # the smallest GPU need, not an arbitrary one


def test_save_profile_needs_detect(tmp_path, capsys):
    """A named profile measures nothing: --save-profile with it is refused, not silently ignored."""
    out = tmp_path / "prof.json"
    assert main(["plan", "--hardware", "rtx4090", "--save-profile", str(out)]) == 2
    assert "--save-profile" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("kv", ["k8v4:act=0.5", "K8V4:act_order=prefix", "fp16,K8V4:group_size=32,act=1"])
def test_a_kv_format_carrying_an_act_share_is_refused(kv, capsys):
    """The planner prices every token as K/V and picks the ACT share itself."""
    assert main(["plan", "--hardware", "rtx4090", "--kv", kv]) == 2
    assert "the planner chooses it itself" in capsys.readouterr().err


def test_the_infeasible_memory_message_adds_up(capsys):
    """Each part of the fixed GPU memory is named, and the parts sum to the total."""
    import re

    p = plan("opt-6.7b", get_hardware("rtx4090"), Workload(4, 512, 32), Allowed(), Limits(gpu_mem=1.5 * GiB))
    assert not p.feasible
    total, *parts = (float(x) for x in re.findall(r"([0-9.]+) GiB", p.infeasible_reason)[:5])
    assert "reserve" in p.infeasible_reason and abs(sum(parts) - total) <= 0.25


def test_a_need_just_over_the_memory_does_not_print_as_the_memory():
    """A GPU a little too small: the message shows a need larger than the memory, to enough digits."""
    import re

    from leankit.planner.planner import _gib_pair

    assert _gib_pair(1.216 * GiB, 1.2 * GiB) == ("1.22", "1.20")
    assert _gib_pair(2 * GiB, 1 * GiB) == ("2.0", "1.0")
    assert _gib_pair(1.0 * GiB, 1.2 * GiB) == ("1.0", "1.2")  # a need within the memory keeps one digit
    ok = plan("opt-6.7b", get_hardware("rtx4090"), Workload(4, 512, 32), Allowed(), Limits(gpu_mem=1.5 * GiB))
    need = float(re.search(r"GPU needs ([0-9.]+) GiB", ok.infeasible_reason).group(1)) * GiB
    p = plan("opt-6.7b", get_hardware("rtx4090"), Workload(4, 512, 32), Allowed(), Limits(gpu_mem=need - 0.004 * GiB))
    assert not p.feasible
    shown_need, shown_cap = (float(x) for x in re.search(r"GPU needs ([0-9.]+) GiB.*has ([0-9.]+) GiB",
                                                         p.infeasible_reason).groups())
    assert shown_need > shown_cap, p.infeasible_reason


def test_an_override_after_a_format_without_a_colon_is_its_first_override():
    """'K8V4,group_size=32' reads as K8V4 with group_size=32, as the comma rule says; it was glued on
    with a comma into 'K8V4,group_size=32' and refused as the tier 'K8V4,GROUP_SIZE=32'."""
    assert kv_list("K8V4,group_size=32") == ["K8V4:group_size=32"]
    assert kv_list("fp16,K8V4-K4V2,th=0.2,tl=0,K4V4") == [None, "K8V4-K4V2:th=0.2,tl=0", "K4V4"]


@pytest.mark.parametrize("kv", ["K8V4-K4V2:policy=full", "K8V4-K4V2:policy=h2o,budget=0.5"])
def test_a_two_tier_format_with_a_single_tier_policy_is_refused(kv, capsys):
    """No LeanCache serves a low tier under these policies: the plan must not pick such a format."""
    assert main(BASE + ["--kv", kv]) == 2
    assert "single precision tier" in capsys.readouterr().err


@pytest.mark.parametrize("config", [
    "{not json",
    json.dumps({"model_type": "llama", "hidden_size": "128", "num_hidden_layers": 2, "num_attention_heads": 4}),
    json.dumps({"model_type": "llama", "hidden_size": 100, "num_hidden_layers": 2, "num_attention_heads": 3}),
    json.dumps({"model_type": "no-such-type", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}),
])
def test_a_local_model_config_transformers_refuses_is_a_one_line_error(tmp_path, capsys, config):
    """A checkpoint folder whose config.json transformers cannot read (bad JSON, a field of the wrong
    type, shapes that do not fit): exit 2 and one line (OSError and huggingface_hub's validation
    errors escaped as tracebacks)."""
    (tmp_path / "config.json").write_text(config)
    assert main(["plan", "--model", str(tmp_path), "--hardware", "rtx4090-pcie4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leankit plan: error: cannot read the model config in") and "\n" not in err
