"""AOT compile check: every kernel compiles for sm_80 and sm_90 with no register spills (no GPU needed).

Runs ``python -m leankit_kernels.aot`` in a fresh process: kernels imported under
``TRITON_INTERPRET=1`` (as the other kernel tests do) cannot be compiled.
"""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is not available")


def _run(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "leankit_kernels.aot", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_aot_quick_single_kernel():
    """One small kernel, one arch: the AOT pipeline itself works (a few seconds)."""
    res = _run("--only", "page alloc grow", "--arch", "80", "--jobs", "1", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "page alloc grow" in res.stdout and "sm_80" in res.stdout and "0 failing" in res.stdout


@pytest.mark.slow
def test_aot_all_kernels_no_spills():
    """The full matrix (about 40 compiles, 1-2 min on 2 cores): no compile errors, no spills."""
    res = _run()
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if " sm_80 " in line or " sm_90a " in line]
    assert len(rows) >= 40, res.stdout
    assert "SPILL" not in res.stdout and "ERROR" not in res.stdout


def test_aot_act_to_kv_no_spills():
    """The fused ACT->KV kernel at SmolLM2's layer shape (fp16 and fp32), sm_80 and sm_90: no spills."""
    res = _run("--only", "act_to_kv smollm2", "--jobs", "1", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines()
            if "act_to_kv smollm2" in line and (" sm_80 " in line or " sm_90a " in line)]
    assert len(rows) == 4 and "SPILL" not in res.stdout and "0 failing" in res.stdout
