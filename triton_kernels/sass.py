"""Static reading of a cubin's SASS: loops, local-memory traffic, loop body size (no GPU needed).

Used by :mod:`leankit_kernels.aot`. ``cuobjdump -sass`` (shipped in Triton's NVIDIA backend)
prints one instruction per line as ``/*addr*/  [@P] OPCODE operands ;``. A branch whose target
is at or before its own address closes a loop whose body is ``[target, branch]``; a loop that
contains no other loop is an *innermost* loop. ``LDL``/``STL`` are local-memory loads/stores:
register spills (or a stack frame). Where they sit relative to the loops decides whether a spill
costs once per program (outside every loop) or once per iteration (inside one).
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass

_INSN = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(.+?)\s*;")
_BRA = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+`?\(?(?:0x)?([0-9a-fA-F]+)")
_LOCAL = re.compile(r"\b(LDL|STL)(?:\.[A-Z0-9.]+)?\b")


@dataclass(frozen=True)
class Loop:
    """A loop body: instruction addresses ``start .. end`` (the closing branch included)."""

    start: int
    end: int
    size: int  # instructions in the body, NOPs excluded


def disassemble(cubin_path: str, tool: str) -> str:
    """SASS text of a cubin (``cuobjdump -sass``)."""
    res = subprocess.run([tool, "-sass", cubin_path], check=False, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"cuobjdump failed: {res.stderr.strip()}")
    return res.stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of every instruction, in address order."""
    return [(int(m.group(1), 16), m.group(2)) for m in _INSN.finditer(sass)]


def loops(insns: list[tuple[int, str]]) -> list[Loop]:
    """Every loop closed by a backward branch (a branch to itself, the trap after ``EXIT``, is not one)."""
    out = []
    for addr, text in insns:
        m = _BRA.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr:
            size = sum(1 for a, t in insns if target <= a <= addr and not t.startswith("NOP"))
            out.append(Loop(target, addr, size))
    return out


def innermost(all_loops: list[Loop]) -> list[Loop]:
    """Loops that contain no other loop."""
    return [lp for lp in all_loops
            if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in all_loops)]


@dataclass(frozen=True)
class LocalUse:
    """Local-memory instructions of a kernel and where they are."""

    in_loops: int
    outside: int
    reason: str  # empty when there is none


def local_memory(insns: list[tuple[int, str]], all_loops: list[Loop]) -> LocalUse:
    """Count ``LDL``/``STL`` inside and outside loop bodies, and say why the outside ones exist."""
    inside, before, after, other = 0, [], [], []
    first = min((lp.start for lp in all_loops), default=None)
    last = max((lp.end for lp in all_loops), default=None)
    for addr, text in insns:
        m = _LOCAL.search(text)
        if not m:
            continue
        if any(lp.start <= addr <= lp.end for lp in all_loops):
            inside += 1
        elif first is not None and addr < first:
            before.append(m.group(1))
        elif last is not None and addr > last:
            after.append(m.group(1))
        else:
            other.append(m.group(1))
    n_out = len(before) + len(after) + len(other)
    if not n_out:
        reason = ""
    elif "STL" in before and "LDL" in after:
        reason = (f"a value computed before the loops is parked in local memory across them "
                  f"({before.count('STL')} STL before, {after.count('LDL')} LDL after): costs once per program")
    elif not all_loops:
        reason = f"{n_out} local ops in a kernel without loops: costs once per program"
    else:
        reason = (f"{n_out} local ops between or around the loops ({len(before)} before, {len(after)} after, "
                  f"{len(other)} between): costs once per program")
    return LocalUse(inside, n_out, reason)


# What each opcode of a decode loop does, for the issue-count breakdown of the AOT report.
OPCODE_CLASSES = {
    "mma": ("HMMA", "IMMA", "HGMMA"),
    "shared memory": ("LDS", "LDSM", "STS"),
    "global loads": ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR"),
    "bit and byte ops": ("PRMT", "LOP3", "SHF", "SGXT", "BMSK"),
    "integer and address": ("IMAD", "IADD3", "VIADD", "LEA", "UIADD3", "UIMAD", "UMOV", "MOV", "ISETP", "UISETP",
                            "SEL", "PLOP3", "P2R", "R2P", "CS2R", "LDC", "ULDC", "S2R", "IABS", "IMNMX"),
    "float math": ("FMUL", "FFMA", "FADD", "HADD2", "HFMA2", "HMUL2", "FMNMX", "FSEL", "FSETP", "MUFU", "F2FP",
                   "F2F", "I2F", "F2I", "I2FP", "FCHK"),
    "sync and shuffle": ("BAR", "SHFL", "WARPSYNC", "BSSY", "BSYNC", "BRA"),
}
_CLASS_OF = {op: cls for cls, ops in OPCODE_CLASSES.items() for op in ops}


def opcode(text: str) -> str:
    """The mnemonic of one instruction's text: its predicate guard and ``.`` modifiers dropped."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0]


def loop_opcode_classes(insns: list[tuple[int, str]], loop: Loop) -> dict[str, int]:
    """Instructions of ``loop``'s body (NOPs excluded) per class of :data:`OPCODE_CLASSES`
    (``other`` for the rest)."""
    counts = Counter(_CLASS_OF.get(opcode(t), "other") for a, t in insns
                     if loop.start <= a <= loop.end and not t.startswith("NOP"))
    return {cls: counts.get(cls, 0) for cls in (*OPCODE_CLASSES, "other")}
