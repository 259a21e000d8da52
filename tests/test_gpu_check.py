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
