"""eval.plot draws the result files of eval.perplexity / eval.needle (no model needed)."""

import json

import pytest

pytest.importorskip("matplotlib")

from eval import plot


def _ppl(tmp_path, rows):
    path = tmp_path / "ppl.json"
    path.write_text(json.dumps({"args": {"docs": 2, "skip": 0}, "results": rows}))
    return str(path)


def test_plots_are_written(tmp_path):
    ppl = _ppl(tmp_path, [{"config": "FP16", "ppl": 10.0, "kv_ratio": 2.67},
                          {"config": "K8V4-K4V2:th=0.3,tl=0", "ppl": 10.1, "kv_ratio": 0.31,
                           "ppl_vs_fp16": 0.01, "ppl_vs_fp16_ci95": [0.004, 0.016]},
                          {"config": "K4V2", "ppl": 13.7, "kv_ratio": 0.25}])
    needle = tmp_path / "needle.json"
    needle.write_text(json.dumps({"results": [{"dynamic": "K8V4-K4V2:th=0.3,tl=0", "dynamic_acc": 0.8,
                                               "static_acc": 0.4, "dynamic_ratio": 0.28, "fp16_acc": 1.0}]}))
    made = plot.main(["--ppl", ppl, "--needle", str(needle), "--out", str(tmp_path / "png")])
    assert [p.name for p in made] == ["perplexity_vs_memory.png", "needle_equal_memory.png"]
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_perplexity_plot_needs_an_fp16_row(tmp_path):
    ppl = _ppl(tmp_path, [{"config": "K8V4", "ppl": 10.1, "kv_ratio": 0.44}])
    with pytest.raises(ValueError, match="FP16"):
        plot.main(["--ppl", ppl, "--out", str(tmp_path)])


def test_perplexity_plot_uses_the_named_baseline(tmp_path):
    """A file whose lossless config was written "lossless" (its ``baseline``) plots against that row."""
    path = tmp_path / "ppl.json"
    path.write_text(json.dumps({"args": {"docs": 1}, "baseline": "lossless",
                                "results": [{"config": "lossless", "ppl": 10.0, "kv_ratio": 2.67},
                                            {"config": "K8V4", "ppl": 10.1, "kv_ratio": 0.44}]}))
    made = plot.main(["--ppl", str(path), "--out", str(tmp_path / "png")])
    assert [p.name for p in made] == ["perplexity_vs_memory.png"]


def test_no_inputs_is_a_usage_error():
    with pytest.raises(SystemExit):
        plot.main([])


def test_point_labels_are_compact_and_keep_values():
    assert plot._short("K8V4-K4V2:th=0.3,tl=0.0,group_size=32") == "K8V4-K4V2:th=0.3,tl=0,gs32"
    assert plot._short("K8V4-K4V2:th=0.3,tl=0.05") == "K8V4-K4V2:th=0.3,tl=0.05"
    assert plot._short("K8V4-K4V2:th=0.2,tl=0.0,low_group_size=32") == "K8V4-K4V2:th=0.2,tl=0,low-gs32"
    assert plot._short("K8V4-K4V2:th=0.25,tl=0.0,group_size=32,rotate=True") == "K8V4-K4V2:th=0.25,tl=0,gs32,rot"
    assert plot._short("K8V4-K4V2:th=0.2,rotate=False") == "K8V4-K4V2:th=0.2"
    assert plot._short("K8V4:rotate=True") == "K8V4:rot"
    assert plot._short("K8V4:rotate=False") == "K8V4"


def test_text_runs_are_not_labelled_as_wikipedia(tmp_path, monkeypatch):
    """A file from ``eval.perplexity --text`` is labelled by its windows of that file, and the title
    stops saying Wikipedia; files of the shipped articles keep their label."""
    wiki = tmp_path / "wiki.json"
    wiki.write_text(json.dumps({"args": {"docs": 2, "skip": 3, "text": None},
                                "results": [{"config": "FP16", "ppl": 10.0, "kv_ratio": 2.1},
                                            {"config": "K8V4", "ppl": 10.1, "kv_ratio": 0.44}]}))
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"args": {"docs": 4, "skip": 0, "text": "/data/essays.txt"},
                               "text_source": "the text of essays.txt",
                               "results": [{"config": "FP16", "ppl": 20.0, "kv_ratio": 2.1},
                                           {"config": "K8V4", "ppl": 20.1, "kv_ratio": 0.44}]}))
    import matplotlib.axes

    seen = {}
    legend = matplotlib.axes.Axes.legend

    def spy_legend(self, *args, **kwargs):
        seen["labels"] = [c.get_label() for c in self.collections if not c.get_label().startswith("_")]
        return legend(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: seen.__setitem__("title", t))
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy_legend)
    plot.main(["--ppl", str(wiki), str(own), "--out", str(tmp_path / "png")])
    assert seen["labels"] == ["articles 3-4 (wiki)", "windows of essays.txt 0-3 (own)"]
    assert "Wikipedia" not in seen["title"] and "own text" in seen["title"]
    plot.main(["--ppl", str(wiki), "--out", str(tmp_path / "png")])
    assert seen["labels"] == ["articles 3-4 (wiki)"] and "Wikipedia" in seen["title"]


def test_perplexity_title_names_the_windows_the_files_were_scored_on():
    """The title gives the prefill and scored chunks each file records, not a fixed 2048 + 4x64."""
    short = {"args": {"docs": 2, "context": 512, "chunks": 3, "chunk": 32}, "results": []}
    assert plot._perplexity_title([short]) == "SmolLM2-135M, Wikipedia, 512-token prefill + 3x32 scored"
    older = {"args": {"docs": 2}, "results": []}  # written before the windows were recorded: the defaults
    assert plot._perplexity_title([older]).endswith("2048-token prefill + 4x64 scored")
    assert plot._perplexity_title([short, older]).endswith("windows differ between files")
