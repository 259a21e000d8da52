"""bench/gpu_check.sh (``make gpu-check``) on a machine without a visible GPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_without_cuda_fails_before_writing_results(tmp_path):
    """Without CUDA every cuda test skips and the benchmarks exit 0 with unmeasured tables, so the
    check must refuse to start (non-zero, a clear line) rather than report "all passed" and
    overwrite measured results with "device: none" tables."""
    py = tmp_path / "py"  # the venv's python with no GPU visible; `-m pip` would install: a no-op here
    py.write_text(f'#!/bin/sh\n[ "$1" = "-m" ] && [ "$2" = "pip" ] && exit 0\n'
                  f'CUDA_VISIBLE_DEVICES= exec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    res = tmp_path / "res dir"
    env = {**os.environ, "GPU_PY": str(py), "GPU_RESULTS": str(res)}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env, check=False,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0, run.stdout[-2000:]
    assert "no CUDA GPU" in run.stderr
    assert not res.exists() or not any(res.glob("decode_*.json"))


def test_gpu_check_keeps_to_its_time_budget(tmp_path):
    """The steps' own timeouts add up to more than 10 minutes (caps for a slow machine); the check
    as a whole keeps to GPU_CHECK_BUDGET: a step gets what is left of it, and a step reached with
    none left is named as failed rather than run past the budget or skipped in silence."""
    import time

    # A stand-in interpreter: sees a GPU, installs nothing, and every test or benchmark run takes 3 s.
    py = tmp_path / "py"
    py.write_text('#!/bin/sh\ncase "$1" in -c|-) exit 0;; esac\n'
                  '[ "$1" = "-m" ] && [ "$2" = "pip" ] && exit 0\nsleep 3\n')
    py.chmod(0o755)
    res = tmp_path / "res"
    env = {**os.environ, "GPU_PY": str(py), "GPU_RESULTS": str(res), "GPU_CHECK_BUDGET": "5"}
    t0 = time.monotonic()
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env, check=False,
                         capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    summary = (res / "summary.txt").read_text()
    # the tests fit (3 s of 5); the step benchmark gets the 2 s left and is cut; nothing is left after it
    assert "cuda tests" not in summary and "bench step" in summary
    for step in ("bench d64: no time left", "bench d128: no time left", "bench prefill: no time left"):
        assert step in summary
    assert elapsed < 5 + 3, elapsed
