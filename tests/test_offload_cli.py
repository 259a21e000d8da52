"""``leankit generate --plan auto --hardware NAME``: the planner's plan becomes the generation's cache."""

from __future__ import annotations

import pytest
import test_cli

from leankit.cli import main
from leankit.offload import plan_for_model
from leankit.planner import get_hardware
from leankit.planner.hardware import GiB
from leankit.testing import tiny_model

tiny = test_cli.tiny  # the fixture serving --model tiny


def _gen(*extra):
    return main(["generate", "--model", "tiny", "--max-new-tokens", "4", "--no-progress", "--prompt", "w5 w6 w7",
                 "--prompt", "w9", *extra])


def test_plan_auto_with_room_keeps_pages_on_the_device(tiny, capsys):
    assert _gen("--plan", "auto", "--hardware", "rtx4090") == 0
    out, err = capsys.readouterr()
    assert "plan for rtx4090-pcie4: KV-only offloading" in err and "every page on the device" in err
    assert "[leankit] KV" in out and "offload:" not in out


def test_plan_auto_with_a_small_gpu_offloads_and_matches_the_device_tokens(tiny, capsys):
    model = tiny_model("llama-gqa")
    roomy = plan_for_model(model, get_hardware("rtx4090"), 2, (4, 2), 4, kv_configs=(None, "K8V4"))
    gib = (roomy.memory["gpu_weights"] + roomy.memory["gpu_buffers"] + 1024) / GiB  # ~1 KiB of cache room
    assert _gen("--kv", "K8V4") == 0
    device_text = capsys.readouterr().out.split("[leankit]")[0]
    assert _gen("--plan", "auto", "--hardware", "rtx4090", "--gpu-mem", repr(gib)) == 0
    out, err = capsys.readouterr()
    assert "pages on the host" in err
    assert "[leankit] offload:" in out and "host->device" in out
    assert out.split("[leankit]")[0] == device_text  # the same greedy text either way (both K8V4)


@pytest.mark.parametrize("flags,msg", [
    (["--plan", "manual"], "--plan takes 'auto'"),
    (["--hardware", "rtx4090"], "--hardware only applies with --plan auto"),
    (["--gpu-mem", "2"], "--gpu-mem only applies with --plan auto"),
    (["--plan", "auto", "--hardware", "nosuch"], "unknown hardware 'nosuch'"),
    (["--plan", "auto", "--hardware", "rtx4090", "--gpu-mem", "-1"], "--gpu-mem is a memory size"),
    (["--plan", "auto", "--hardware", "rtx4090", "--kv", "K9V4"], "K9V4"),
])
def test_plan_auto_bad_input_fails_before_loading(tiny, capsys, flags, msg):
    assert _gen(*flags) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert not tiny


def test_plan_auto_infeasible_names_the_limit(tiny, capsys):
    assert _gen("--plan", "auto", "--hardware", "rtx4090", "--gpu-mem", "0.5") == 2
    err = capsys.readouterr().err
    assert "no feasible plan" in err and "has 0.5 GiB" in err


def test_plan_auto_cache_knows_the_padding_generate_feeds(tiny, monkeypatch):
    """The planned cache gets the tokenizer's padding id, as the unplanned one does, so a finished row
    fed that padding is released even when the model's configs name no padding id."""
    import leankit

    built = []
    from_plan = leankit.LeanCache.from_plan.__func__

    def record(cls, model, plan, **kwargs):
        model.generation_config.pad_token_id = None  # only the tokenizer knows it now
        model.config.pad_token_id = None
        built.append(from_plan(cls, model, plan, **kwargs))
        return built[-1]

    monkeypatch.setattr(leankit.LeanCache, "from_plan", classmethod(record))
    assert _gen("--plan", "auto", "--hardware", "rtx4090") == 0
    from leankit.testing import tiny_tokenizer

    assert tiny_tokenizer().pad_token_id in built[0].end_ids.tolist()


def test_plan_auto_on_this_cpu_is_named_as_leankit_plan_names_it(tiny, capsys):
    """On a CPU (one memory) the plan is not called offloading, as ``leankit plan`` says too."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("detect profiles the GPU here")
    assert _gen("--plan", "auto", "--hardware", "detect") == 0
    err = capsys.readouterr().err
    assert "no offloading (the CPU is the compute device, one memory)" in err and "layers resident" not in err
