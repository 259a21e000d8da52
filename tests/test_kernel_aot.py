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


def test_aot_only_that_matches_no_kernel_fails():
    """A mistyped --only used to compile nothing and pass ("0 compiles, 0 failing", status 0)."""
    res = _run("--only", "no such kernel", "--arch", "80", "--jobs", "1", timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "matches no kernel" in res.stderr and "page alloc grow" in res.stderr


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


def test_loop_opcode_classes_of_synthetic_sass():
    """Opcodes lose their predicate guard and modifiers; the body's classes count every non-NOP
    instruction of the loop once, and instructions outside the loop not at all."""
    from leankit_kernels import sass

    text = """
        /*0000*/  MOV R1, c[0x0][0x28] ;
        /*0010*/  @!P0 LDS.U16 R2, [R3] ;
        /*0020*/  HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/  @P1 PRMT R5, R6, 0x4140, RZ ;
        /*0040*/  NOP ;
        /*0050*/  LOP3.LUT R7, R7, 0xf, RZ, 0xc0, !PT ;
        /*0060*/  MUFU.EX2 R9, R9 ;
        /*0070*/  FOO R1, R2 ;
        /*0080*/  @P2 BRA 0x10 ;
        /*0090*/  EXIT ;
    """
    insns = sass.instructions(text)
    assert sass.opcode("@!P0 LDS.U16 R2, [R3]") == "LDS" and sass.opcode("@UP3 HMMA.16816.F32 R4") == "HMMA"
    loops = sass.loops(insns)
    assert len(loops) == 1 and loops[0].size == 7  # 0x10 .. 0x80, the NOP not counted
    classes = sass.loop_opcode_classes(insns, loops[0])
    assert classes == {"mma": 1, "shared memory": 1, "global loads": 0, "bit and byte ops": 2,
                       "integer and address": 0, "float math": 1, "sync and shuffle": 1, "other": 1}
    assert sum(classes.values()) == loops[0].size


def test_decode_loop_opcode_table_adds_up_to_the_issue_count():
    """The per-class breakdown of a real decode loop (K8V4 d64, sm_90a) sums to its issue count per KB."""
    res = _run("--only", "decode K8V4 d64 G3", "--arch", "90", "--jobs", "1", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("| decode K8V4 d64 G3 | sm_90a |")]
    issue = [line for line in lines if line.count("|") == 8]  # kernel, arch + 5 columns of the issue table
    classes = [line for line in lines if line.count("|") == 11]  # kernel, arch + 8 classes
    assert len(issue) == 1 and len(classes) == 1, res.stdout
    per_kb = float(issue[0].split("|")[6])
    parts = [float(x) for x in classes[0].split("|")[3:11]]
    assert parts[0] > 0 and abs(sum(parts) - per_kb) < 0.05 * len(parts), (parts, per_kb)


def test_importing_the_case_tables_leaves_the_interpreter_setting():
    """Only ``python -m leankit_kernels.aot`` turns the interpreter off: a test module importing its
    case tables (tests/test_cuda_kernels.py) must not switch every later kernel test of the same
    pytest process off the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import os, leankit_kernels.aot; print(os.environ.get('TRITON_INTERPRET'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    assert out.stdout.strip() == "1"
