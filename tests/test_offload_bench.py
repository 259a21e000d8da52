"""``leankit bench offload`` on a tiny model on the CPU: it runs, counts bytes, says there is no link."""

from __future__ import annotations

import json

import pytest

import leankit
from leankit.cli import main
from leankit.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def tiny(monkeypatch):
    def load(name):
        model, tok = tiny_model("llama-mha", num_hidden_layers=3), tiny_tokenizer()
        model.generation_config.pad_token_id = tok.pad_token_id
        return model, tok

    monkeypatch.setattr(leankit, "load_model", load)


def test_bench_offload_reports_ratio_bytes_and_no_link_on_cpu(tiny, tmp_path, capsys):
    js = tmp_path / "offload.json"
    argv = ["bench", "offload", "--model", "tiny", "--batch", "2", "--context", "37", "--steps", "2", "--warmup", "1",
            "--json", str(js), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "step time ratio (offloaded / on device)" in out and "host->device" in out
    assert "no link to overlap" in out
    res = json.loads(js.read_text())["results"]
    assert res["h2d_bytes_step"] > 0 and res["d2h_bytes_step"] > 0 and res["step_ratio"] > 0
    assert res["device_pages_peak"] < res["host_pages"]  # the working set is a part of the cache


def test_bench_offload_help_and_bad_input(tiny, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "offload", "--help"])
    out = capsys.readouterr().out
    assert "hidden behind compute" in out and "no link to" in out
    assert main(["bench", "offload", "--hardware", "nosuch", "--no-progress"]) == 2
    assert "unknown hardware" in capsys.readouterr().err
    assert main(["bench", "offload", "--kv", "K9V4", "--no-progress"]) == 2
