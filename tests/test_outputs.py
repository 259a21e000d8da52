"""Output paths are checked before the work that fills them (``leankit.outputs.output_problem``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from leankit.outputs import output_problem


def test_a_writable_path_passes_and_the_probe_leaves_nothing(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    assert output_problem(None) is None
    assert output_problem(tmp_path / "new" / "deeper" / "r.json") is None  # missing folders are made later
    assert output_problem(existing) is None
    assert output_problem(tmp_path / "figures", folder=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # no probe file, no folder left behind
    assert existing.read_text() == "kept"


def test_paths_that_cannot_take_output_are_named(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert "is a folder; give a file name" in output_problem(tmp_path)
    assert "is a file, not a folder" in output_problem(f, folder=True)
    assert "is a file, not a folder" in output_problem(f / "under" / "r.json")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_folder_that_refuses_files_is_found_even_for_root():
    # os.access says yes to root in /proc, where every new file fails: the check must try, not ask
    assert "takes no new files" in output_problem("/proc/leankit-results/r.json")
    assert "takes no new files" in output_problem("/proc/leankit-figures", folder=True)


@pytest.mark.skipif(os.name != "posix" or (hasattr(os, "geteuid") and os.geteuid() == 0),
                    reason="root writes into a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert "takes no new files" in output_problem(ro / "r.json")
    finally:
        ro.chmod(0o700)


def test_bench_refuses_an_unwritable_figure_folder_before_drawing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc")
    from leankit.cli import main

    results = sorted((Path(__file__).parents[1] / "results" / "step").glob("*.json"))
    assert results, "the repository ships step results"
    assert main(["bench", "plot", str(results[0]), "--out", "/proc/leankit-figures"]) == 2
    assert "--out: cannot write /proc/leankit-figures" in capsys.readouterr().err


def test_share_as_umask_allows_applies_the_process_umask(tmp_path):
    import os
    import tempfile

    from leankit.outputs import process_umask, share_as_umask_allows

    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027  # read, not changed
        assert process_umask() == 0o027
        folder = tempfile.mkdtemp(dir=tmp_path)  # 0700, as the model conversion's
        share_as_umask_allows(folder, 0o777)
        assert os.stat(folder).st_mode & 0o777 == 0o750
    finally:
        os.umask(old)
