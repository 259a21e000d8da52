"""The inline PTX of :mod:`leankit_kernels.codes`, run through an emulation of the PTX it uses.

The decode kernel turns 8- and 4-bit key codes into fp16 MMA operands with ``prmt`` / ``and``
(``BYTE_CODES_PTX``, ``NIBBLES_PTX``). That path runs on a GPU only (Triton's interpreter takes
the plain-Triton path), so here each string is executed by a small interpreter of exactly the
instructions it contains, following the PTX ISA's definition of ``prmt.b32`` (default mode) and
``and.b32``, with the operands bound as Triton binds them for ``pack=4``: outputs first (each fp16
result in two registers, elements 0-1 then 2-3, the lower element in the low half), then the input
register holding four uint8 elements (element ``i`` in byte ``i``). The fp16 values must be what
the plain path computes: the subnormal ``c 2^-24`` for a byte code, ``(lo 2^-24, 16 hi 2^-24)`` for
nibbles (:func:`leankit_kernels.codes.code_unit`).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from leankit_kernels import codes


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """``prmt.b32 d, a, b, c`` (default mode): byte ``i`` of ``d`` is byte ``c[4i+2:4i]`` of the
    eight bytes ``{b, a}`` (``a`` bytes 0-3, ``b`` bytes 4-7), or that byte's sign bit replicated
    when ``c[4i+3]`` is set."""
    src = [(a >> (8 * j)) & 0xFF for j in range(4)] + [(b >> (8 * j)) & 0xFF for j in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(a.dtype)
        out |= byte << (8 * i)
    return out


def run_ptx(ptx: str, regs: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Execute ``ptx`` (the instructions :mod:`leankit_kernels.codes` uses) on uint32 vectors.

    ``regs`` is the asm's constraint string (``=r`` outputs, then ``r`` inputs), ``inputs`` one
    uint32 array per input register. Returns the output registers in operand order.
    """
    kinds = regs.split(",")
    n_out = sum(k.startswith("=") for k in kinds)
    assert len(kinds) - n_out == len(inputs), (regs, len(inputs))
    env: dict[str, np.ndarray] = {f"${n_out + i}": x.astype(np.uint64) & 0xFFFFFFFF for i, x in enumerate(inputs)}

    shape = inputs[0].shape

    def val(tok: str) -> np.ndarray:
        """A register's value, or an immediate broadcast to the registers' shape."""
        if tok.startswith("$") or re.fullmatch(r"[A-Za-z_]\w*", tok):
            return env[tok]
        return np.full(shape, int(tok, 0), np.uint64)

    handled = 0
    for stmt in ptx.replace("\n", " ").replace("\t", " ").split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        if op == "prmt.b32":
            d, a, b, c = args
            env[d] = _prmt(val(a), val(b), int(c, 0))
        elif op == "and.b32":
            d, a, b = args
            env[d] = val(a) & val(b)
        else:
            raise AssertionError(f"the emulation knows prmt.b32 and and.b32 only, the PTX uses {op!r}")
        handled += 1
    assert handled > 0
    return [env[f"${i}"] for i in range(n_out)]


def _pack4(byt: np.ndarray) -> np.ndarray:
    """Four uint8 elements per 32-bit register, element ``i`` in byte ``i`` (Triton's pack=4)."""
    q = byt.reshape(-1, 4).astype(np.uint64)
    return q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)


def _fp16_elements(*regs: np.ndarray) -> np.ndarray:
    """fp16 values of output registers holding two elements each (the lower one in the low half),
    back in element order: ``regs`` are one result's registers, elements 0-1 first."""
    halves = [((r >> (16 * h)) & 0xFFFF).astype(np.uint16) for r in regs for h in (0, 1)]
    return np.stack(halves, 1).reshape(-1).view(np.float16)


@pytest.fixture(params=[0, 1, 2])
def code_bytes(request):
    """Every byte value once plus fresh random bytes (length a multiple of 4, as pack=4 wants)."""
    rng = np.random.default_rng(request.param)
    return np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, 4 * 97, dtype=np.uint8)])


UNIT = 2.0 ** -24  # codes.code_unit(tl.float16)


def test_byte_codes_ptx_gives_code_in_subnormal_units(code_bytes):
    out = run_ptx(codes.BYTE_CODES_PTX.value, codes.BYTE_CODES_REGS.value, [_pack4(code_bytes)])
    got = _fp16_elements(*out).astype(np.float64)
    np.testing.assert_array_equal(got, code_bytes.astype(np.float64) * UNIT)


def test_nibbles_ptx_gives_low_and_sixteen_times_high_nibble(code_bytes):
    out = run_ptx(codes.NIBBLES_PTX.value, codes.NIBBLES_REGS.value, [_pack4(code_bytes)])
    lo = _fp16_elements(out[0], out[1]).astype(np.float64)
    hi = _fp16_elements(out[2], out[3]).astype(np.float64)
    np.testing.assert_array_equal(lo, (code_bytes & 15) * UNIT)
    np.testing.assert_array_equal(hi, (code_bytes & 240) * UNIT)  # 16 * high nibble


def test_emulated_prmt_follows_the_isa_examples():
    """The emulation itself: identity, byte reversal, and sign replication (selector bit 3)."""
    a = np.array([0x8070_3210], np.uint64)
    b = np.array([0x7654_FEDC], np.uint64)
    assert int(_prmt(a, b, 0x3210)[0]) == 0x8070_3210
    assert int(_prmt(a, b, 0x0123)[0]) == 0x1032_7080
    assert int(_prmt(a, b, 0x7654)[0]) == 0x7654_FEDC
    assert int(_prmt(a, b, 0x0008)[0]) == 0x1010_1000  # byte 0 of a (0x10): sign 0 -> 0x00
    assert int(_prmt(a, b, 0x000B)[0]) == 0x1010_10FF  # byte 3 of a (0x80): sign 1 -> 0xFF
