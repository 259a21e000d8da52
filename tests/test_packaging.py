"""The source distribution carries what the test suite reads, so the suite runs from an unpacked sdist."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_sdist_carries_the_tests_and_the_files_they_read(tmp_path):
    # built from a copy of the tracked files: setuptools would otherwise reuse the file list of an
    # egg-info an earlier build left in the tree
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=False)
    if listed.returncode:
        pytest.skip("not a git checkout")
    src = tmp_path / "src"
    for rel in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    script = f"from setuptools import build_meta as b; import sys; sys.stdout.write(b.build_sdist({str(tmp_path)!r}))"
    run = subprocess.run([sys.executable, "-c", script], cwd=src, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    with tarfile.open(tmp_path / run.stdout.strip().splitlines()[-1]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("tests/conftest.py", "tests/test_packaging.py", "Makefile", ".ci/run", "README.md",
                   "results/aot_static.md", "docs/measurements.md", "bench/gpu_check.sh", "eval/perplexity.py",
                   "leankit/native/decode_step.c", "triton_kernels/paged_attention.py"):
        assert needed in names, f"the sdist lacks {needed}"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
