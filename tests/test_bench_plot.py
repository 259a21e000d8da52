"""Figures of ``leankit bench`` results: ``leankit.bench.plot`` and ``leankit bench plot``."""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import leankit
from leankit.bench import plot
from leankit.cli import main
from leankit.testing import tiny_model, tiny_tokenizer

RESULTS = Path(__file__).resolve().parent.parent / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _throughput(ceiling=True):
    caches = [{"name": "DynamicCache", "batch": 8, "time_s": 40.0, "prefill_s": 10.0, "tokens_per_s_ratio": 1.0},
              {"name": "LeanCache K8V4", "batch": 17, "time_s": 25.0, "prefill_s": 9.0, "tokens_per_s_ratio": 1.6},
              {"name": "LeanCache K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1", "batch": 24, "time_s": 21.0,
               "prefill_s": 9.5, "tokens_per_s_ratio": 1.9}]
    res = {"mix": "decode-heavy", "requests": 30, "budget_bytes": 3 << 20, "caches": caches}
    if ceiling:
        res["ceiling"] = {"batch": 24, "tokens_per_s_ratio": 1.2}
    return res


def _bars(ax):
    """(y, left, width) of every horizontal bar of ``ax``, bottom to top."""
    return sorted((round(p.get_y() + p.get_height() / 2, 6), p.get_x(), p.get_width()) for p in ax.patches)


def test_throughput_figure_draws_each_cache_ratio_time_split_and_bounds():
    fig = plot.plot_throughput(_throughput(), "tiny")
    ax, ax_t = fig.axes
    # bottom to top: the caches in reverse order, DynamicCache on top
    assert [w for _, _, w in _bars(ax)] == [1.9, 1.6, 1.0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["K8V4-K4V2:th=0.25,tl=0,gs32,rot", "K8V4", "DynamicCache"]
    assert any("batch 24" in t.get_text() for t in ax.texts)
    # prefill and decode stacked: prefill from 0, decode from the prefill's end, summing to the wall time
    bars = _bars(ax_t)
    for y in {b[0] for b in bars}:
        pre, dec = sorted((b for b in bars if b[0] == y), key=lambda b: b[1])
        assert pre[1] == 0 and dec[1] == pre[2]
    assert sorted(round(b[1] + b[2], 6) for b in bars if b[1] > 0) == [21.0, 25.0, 40.0]
    # the lines: DynamicCache (1), the ceiling run, and its free-decode bound time / prefill = 4
    xs = sorted(round(line.get_xdata()[0], 6) for line in ax.lines)
    assert xs == [1.0, 1.2, 4.0]
    assert ax.get_xlim()[1] >= 4.0


def test_throughput_figure_without_a_ceiling_run():
    fig = plot.plot_throughput(_throughput(ceiling=False))
    assert sorted(round(line.get_xdata()[0], 6) for line in fig.axes[0].lines) == [1.0, 4.0]


def test_step_figure_draws_both_ratios_and_a_breakdown_that_sums_to_the_step():
    parts = {"attention": 0.3, "store": 0.05, "policy": 0.02, "alloc": 0.003, "setup": 0.004}
    rows = [{"context": c, "batch": 8, "kv": "K8V4-K4V2", "kv_arg": "K8V4-K4V2:th=0.25,tl=0,group_size=32",
             "prefill_ratio": 0.9 + c / 1e4, "decode_ratio": 0.8,
             "decode_breakdown": {**parts, "model": 1 - sum(parts.values())}} for c in (512, 1024)]
    fig = plot.plot_step(rows, "tiny")
    ax, ax_b = fig.axes
    assert sorted(w for _, _, w in _bars(ax)) == sorted([0.8, 0.8, 0.9512, 1.0024])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1024: K8V4-K4V2:th=0.25,tl=0,gs32",
                                                            "512: K8V4-K4V2:th=0.25,tl=0,gs32"]
    for y in {b[0] for b in _bars(ax_b)}:
        assert sum(w for yy, _, w in _bars(ax_b) if yy == y) == pytest.approx(100.0)


@pytest.mark.parametrize("path", ["throughput/decode_heavy.json", "throughput/prefill_heavy.json",
                                  "step/context_1024.json", "step/context_4096.json"])
def test_plot_command_draws_the_saved_results(path, tmp_path, capsys):
    assert main(["bench", "plot", str(RESULTS / path), "--out", str(tmp_path)]) == 0
    png = tmp_path / (Path(path).stem + ".png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_refuses_results_it_has_no_figure_for(tmp_path, capsys):
    bad = tmp_path / "offload.json"
    bad.write_text(json.dumps({"mode": "offload", "results": {}}))
    assert main(["bench", "plot", str(bad), "--out", str(tmp_path)]) == 2
    assert "no figure for bench mode 'offload'" in capsys.readouterr().err
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"results": {}}))  # valid JSON, but not a results file
    assert main(["bench", "plot", str(bare), "--out", str(tmp_path)]) == 2
    assert "has no 'mode' field" in capsys.readouterr().err
    assert main(["bench", "plot", str(tmp_path / "missing.json")]) == 2
    assert "no such results file" in capsys.readouterr().err
    text = tmp_path / "notes.txt"
    text.write_text("not json")
    assert main(["bench", "plot", str(text), "--out", str(tmp_path)]) == 2
    assert f"{text}: not a results file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one cache"):
        plot.plot_throughput({"caches": []})


def test_a_bad_plot_path_fails_before_the_model_loads(monkeypatch, capsys):
    def no_model(name):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(leankit, "load_model", no_model)
    assert main(["bench", "throughput", "--plot", "out.svg", "--no-progress"]) == 2
    assert "--plot writes a PNG" in capsys.readouterr().err


def test_bench_step_cli_draws_its_plot_and_keeps_the_path_out_of_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(leankit, "load_model", lambda name: (tiny_model(), tiny_tokenizer()))
    js, png = tmp_path / "step.json", tmp_path / "step.png"
    argv = ["bench", "step", "--model", "tiny", "--batch", "2", "--context", "17", "--steps", "2", "--warmup", "1",
            "--kv", "K8V4", "--json", str(js), "--plot", str(png), "--no-progress", "--default-malloc"]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "--plot" not in json.loads(js.read_text())["command"]


def test_missing_matplotlib_is_one_clear_error_for_every_figure(monkeypatch, capsys):
    """Without matplotlib, --plot fails before the model loads, and the planner's timeline raises
    the RuntimeError its command reports: one error, naming what needed it and how to install it."""
    import importlib.util

    from leankit.plotting import MatplotlibMissing

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(leankit, "load_model", lambda name: pytest.fail("the model must not load"))
    assert main(["bench", "step", "--plot", "step.png", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'leankit-kv[bench]'" in err
    with pytest.raises(RuntimeError, match="drawing bench results needs matplotlib"):
        plot.plot_throughput(_throughput())
    from leankit.planner.timeline import draw_timeline

    with pytest.raises(MatplotlibMissing, match="drawing the timeline needs matplotlib"):
        draw_timeline(None, "timeline.png")


@pytest.mark.parametrize("payload,why", [([1, 2], "JSON list"), ({"mode": "step", "results": [{"kv": "K8V4"}]}, "lack"),
                                         ({"mode": "throughput", "results": {"caches": [{"name": "x"}]}}, "lack")])
def test_plot_names_a_json_file_that_is_not_a_results_file(tmp_path, capsys, payload, why):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(payload))
    assert main(["bench", "plot", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: not a results file" in err and why in err and "Traceback" not in err


def test_outputs_that_cannot_be_written_fail_before_any_work(tmp_path, capsys, monkeypatch):
    """--out under a file for plot; --json under a file for a measurement, refused before the model loads."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    good = tmp_path / "step.json"
    good.write_text(json.dumps({"mode": "step", "results": []}))
    assert main(["bench", "plot", str(good), "--out", str(blocker / "figs")]) == 2
    assert "is a file" in capsys.readouterr().err
    monkeypatch.setattr(leankit, "load_model", lambda name: pytest.fail("the model loaded"))
    assert main(["bench", "step", "--model", "tiny", "--json", str(blocker / "x.json"), "--no-progress"]) == 2
    assert "--json" in capsys.readouterr().err
    assert main(["bench", "step", "--model", "tiny", "--json", str(tmp_path), "--no-progress"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_plot_refuses_two_results_files_that_would_draw_into_one_png(tmp_path, capsys):
    """Two results files of one name in different folders would both be drawn into <out>/<name>.png,
    the second over the first (both reported as written): refused, and nothing is drawn."""
    paths = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "run.json"
        path.write_text(json.dumps({"mode": "throughput", "model": folder, "results": _throughput()}))
        paths.append(str(path))
    out = tmp_path / "figs"
    assert main(["bench", "plot", *paths, "--out", str(out)]) == 2
    assert "would both be drawn into" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_plot_reads_every_file_before_drawing_any(tmp_path, capsys):
    """A results file that cannot be read fails the command before the files before it are drawn."""
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"mode": "throughput", "model": "m", "results": _throughput()}))
    bad.write_text("[1]")
    out = tmp_path / "figs"
    assert main(["bench", "plot", str(good), str(bad), "--out", str(out)]) == 2
    assert not (out / "good.png").exists()
