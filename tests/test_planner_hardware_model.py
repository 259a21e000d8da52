"""Hardware profiles, presets, the least-squares fit, and ModelSpec bytes (leankit.planner)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leankit.config import KVConfig
from leankit.planner import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareProfile,
    fit_linear,
    from_hf_config,
    get_hardware,
    get_model,
    hardware_names,
    model_names,
)
from leankit.planner.hardware import GB, TFLOPS, GiB

# ------------------------------------------------------------------------------- fit


def test_fit_linear_exact_line_has_r2_one():
    xs = [256, 512, 1024, 2048, 4096]
    f = fit_linear(xs, [3e-6 + 2e-9 * x for x in xs])
    assert f.slope == pytest.approx(2e-9, rel=1e-9)
    assert f.intercept == pytest.approx(3e-6, rel=1e-6)
    assert f.r2 == pytest.approx(1.0, abs=1e-12)
    assert f.inverse(f(777)) == pytest.approx(777)


def test_fit_linear_r2_matches_definition_on_noisy_points():
    xs = [1, 2, 3, 4, 5]
    ys = [1.1, 1.9, 3.2, 3.8, 5.3]
    f = fit_linear(xs, ys)
    my = sum(ys) / 5
    ss_res = sum((y - f(x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    assert f.r2 == pytest.approx(1 - ss_res / ss_tot)
    assert 0.9 < f.r2 < 1.0
    with pytest.raises(ValueError):
        fit_linear([1, 1], [2, 3])


# ------------------------------------------------------------------------------- presets


def test_presets_carry_the_papers_published_figures():
    a100 = get_hardware("a100-40gb-pcie4")  # KVPR Fig. 1
    assert a100.gpu_flops == 312 * TFLOPS and a100.gpu_mem == 40 * GiB and a100.host_mem == 512 * GiB
    assert a100.h2d_bw == 32 * GiB
    lmo = get_hardware("a100-40gb-pcie4-xeon6330")  # LM-Offload Table 4
    assert lmo.host_mem == 240 * GiB and lmo.cpu_threads == 56
    rtx = get_hardware("rtx4090-pcie4")  # HybridServe §5.1
    assert rtx.gpu_mem == 24 * GiB and rtx.host_mem == 882 * GiB
    low = get_hardware("rtx5000-pcie4x8")  # KVPR Appendix A.5
    assert low.gpu_flops == pytest.approx(89.2 * TFLOPS) and low.h2d_bw == 16 * GiB and low.gpu_mem == 16 * GiB
    assert get_hardware("l40-pcie4").gpu_mem == 48 * GiB  # LeanKV §5
    assert get_hardware("h100-pcie5").h2d_bw == 64 * GiB  # LM-Offload §1, PCIe 5 x16
    assert set(hardware_names()) == set(HARDWARE_PRESETS)
    assert get_hardware("a100") is HARDWARE_PRESETS["a100-40gb-pcie4"]


def test_unknown_hardware_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_hardware("tpu-v9")
    msg = str(e.value)
    for n in hardware_names():
        assert n in msg
    assert "detect" in msg


def test_profile_json_roundtrip(tmp_path):
    hw = get_hardware("rtx4090-pcie4").replace(fits={"t_kv_gen": fit_linear([1, 2, 3], [2, 4, 6.5])},
                                               fit_model="opt-30b")
    path = hw.save(tmp_path / "p.json")
    back = get_hardware(str(path))
    assert back == hw
    assert back.fits["t_kv_gen"].slope == pytest.approx(hw.fits["t_kv_gen"].slope)
    with pytest.raises(ValueError):
        HardwareProfile.from_dict({**hw.to_dict(), "bogus": 1})
    with pytest.raises(ValueError):
        hw.replace(h2d_bw=0)


@pytest.mark.slow
def test_profiler_measures_this_cpu_and_saves_json(tmp_path):
    from leankit.planner import profile_hardware

    prof = profile_hardware(save_path=tmp_path / "detect.json")
    assert prof.device in ("cpu", "cuda")
    assert prof.h2d_bw > 0.1 * GB and prof.gpu_flops > 1e9
    assert set(prof.fits) == {"t_kv_gen", "t_load_kv"}
    for f in prof.fits.values():
        assert f.slope > 0 and -1.0 <= f.r2 <= 1.0
    assert HardwareProfile.load(tmp_path / "detect.json").fits.keys() == prof.fits.keys()


def test_available_memory_reads_the_kernels_estimate_on_the_host(monkeypatch):
    """On the host: the kernel's MemAvailable (free memory plus what it can reclaim, in kB), under
    the physical memory; a device kind torch cannot ask, or no such line, gives None."""
    from pathlib import Path

    from leankit.planner import hardware

    now = hardware.available_memory_bytes("cpu")
    assert 0 < now <= hardware._host_memory_bytes()
    kb = int(torch.randint(1, 1 << 30, ()))
    real_read = Path.read_text
    meminfo = f"MemTotal:       {2 * kb} kB\nMemFree:        12 kB\nMemAvailable:   {kb} kB\nBuffers: 3 kB\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: meminfo if str(self) == "/proc/meminfo"
                        else real_read(self, *a, **k))
    assert hardware.available_memory_bytes(torch.device("cpu")) == kb * 1024
    meminfo = "MemTotal:       1024 kB\n"
    assert hardware.available_memory_bytes("cpu") is None
    assert hardware.available_memory_bytes("meta") is None


# ------------------------------------------------------------------------------- ModelSpec


@pytest.mark.parametrize("name", ["opt-6.7b", "opt-13b", "opt-30b", "opt-66b"])
def test_opt_activation_block_is_half_the_kv_block(name):
    # HybridServe §4.3 / CAPTURE §IV-A: S_ACT = 1/2 S_KV for OPT (MHA: kv_dim == hidden)
    m = get_model(name)
    assert m.act_bytes_per_token() * 2 == m.kv_bytes_per_token()
    assert m.act_to_kv_ratio() == 0.5


def test_smollm2_shape_and_gqa_activation_larger_than_kv():
    m = get_model("smollm2-135m")
    assert (m.hidden, m.num_heads, m.num_kv_heads, m.head_dim, m.num_layers) == (576, 9, 3, 64, 30)
    assert (m.intermediate, m.vocab, m.tied_embeddings) == (1536, 49152, True)
    assert m.is_gqa
    assert m.kv_bytes_per_token() == 2 * 2 * 3 * 64 == 768
    assert m.act_bytes_per_token() == 1152 > m.kv_bytes_per_token()
    assert 130e6 < m.total_params() < 140e6


def test_param_counts_match_the_model_names():
    assert get_model("opt-30b").total_params() == pytest.approx(30e9, rel=0.02)
    assert get_model("opt-66b").total_params() == pytest.approx(66e9, rel=0.02)
    assert get_model("llama-2-7b").total_params() == pytest.approx(6.74e9, rel=0.01)
    assert get_model("llama-3-8b").total_params() == pytest.approx(8.03e9, rel=0.01)
    assert get_model("llama-2-70b").total_params() == pytest.approx(69e9, rel=0.01)


def test_gqa_kv_bytes_and_kvconfig_pricing():
    m = get_model("llama-3-8b")
    assert m.kv_bytes_per_token() == 2 * 8 * 128 * 2
    for spec in ("FP16", "K8V4", "K4V2", "K8V4-K4V2"):
        cfg = KVConfig.parse(spec)
        assert m.kv_bytes_per_token(spec) == pytest.approx(cfg.kv_bytes_per_token(128, 8, tier=0))
    lo = KVConfig.parse("K8V4-K4V2").kv_bytes_per_token(128, 8, tier=1)
    assert m.kv_bytes_per_token("K8V4-K4V2", high_fraction=0.0) == pytest.approx(lo)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(MODEL_PRESETS)), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]),
       st.sampled_from([1, 2, 4, 8, 16]))
def test_more_bits_never_fewer_bytes(name, kb, vb, extra):
    m = get_model(name)
    lo = m.kv_bytes_per_token(f"K{kb}V{vb}")
    hi_k = min(16, kb * extra)
    assert m.kv_bytes_per_token(f"K{hi_k}V{vb}") >= lo
    assert m.kv_bytes_per_token(f"K{kb}V{min(16, vb * extra)}") >= lo
    assert m.weight_bytes_per_layer(16) >= m.weight_bytes_per_layer(8) >= m.weight_bytes_per_layer(4)


def test_from_hf_config_families():
    opt = from_hf_config({"model_type": "opt", "hidden_size": 7168, "num_hidden_layers": 48,
                          "num_attention_heads": 56, "ffn_dim": 28672, "vocab_size": 50272,
                          "max_position_embeddings": 2048, "word_embed_proj_dim": 7168})
    assert opt.total_params() == get_model("opt-30b").total_params()
    assert not opt.gated_mlp and opt.bias
    smol = from_hf_config({"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                           "vocab_size": 49152, "tie_word_embeddings": True, "head_dim": 64})
    assert smol.kv_bytes_per_token() == get_model("smollm2-135m").kv_bytes_per_token()
    assert smol.total_params() == get_model("smollm2-135m").total_params()
    gpt2 = from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                           "n_positions": 1024})
    assert gpt2.intermediate == 3072 and gpt2.kv_bytes_per_token() == 2 * 768 * 2
    with pytest.raises(ValueError):
        from_hf_config({"model_type": "mystery"})


def test_from_transformers_config_object():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    m = from_hf_config(cfg, name="smol")
    assert m.kv_dim == 192 and m.num_layers == 30 and m.name == "smol"


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError) as e:
        get_model("gpt-7")
    for n in model_names():
        assert n in str(e.value)
    assert math.isclose(get_model("HuggingFaceTB/SmolLM2-135M").hidden, 576)
