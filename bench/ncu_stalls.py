"""Where a kernel's warps wait: a summary of Nsight Compute's per-instruction stall samples.

    ncu --section WarpStateStats --section SourceCounters --page source --print-source sass --csv \
        -k regex:_decode_kernel --launch-skip 1 --launch-count 1 \
        python bench/decode_profile.py --configs K8V4 > k8v4.csv
    python bench/ncu_stalls.py k8v4.csv [more.csv ...] [--out stalls.md]

Reads the SASS source page (one row per instruction, ``.csv`` or ``.csv.gz``) and prints, per
file, the share of all warp-stall samples by reason (``stall_*`` columns, all samples) and by
opcode class, with the two largest reasons of each class. Reasons, as Nsight Compute names them:
``long_sb`` waits on global/local memory, ``short_sb`` on shared memory or MUFU, ``wait`` a fixed
instruction latency, ``barrier`` a ``bar.sync``, ``mio`` a full memory-input/output queue,
``selected`` is the cycle an instruction issues.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import sys

# SASS mnemonic (without predicate and modifiers) -> the class it is counted under
CLASSES = {
    "HMMA": "tensor-core MMA", "HGMMA": "tensor-core MMA",
    "LDG": "global load", "LDGSTS": "global -> shared async copy", "LDGDEPBAR": "global -> shared async copy",
    "DEPBAR": "global -> shared async copy",
    "LDS": "shared load", "LDSM": "shared load", "STS": "shared store", "BAR": "barrier",
    "PRMT": "code conversion (byte permute / mask / shift)", "LOP3": "code conversion (byte permute / mask / shift)",
    "SHF": "code conversion (byte permute / mask / shift)",
    "MUFU": "softmax (exp, max, scale)", "FMNMX": "softmax (exp, max, scale)", "SHFL": "softmax (exp, max, scale)",
    "FMUL": "fp32 arithmetic", "FFMA": "fp32 arithmetic", "FADD": "fp32 arithmetic", "FSEL": "fp32 arithmetic",
    "FSETP": "fp32 arithmetic", "HADD2": "fp16 <-> fp32 conversion", "F2FP": "fp16 <-> fp32 conversion",
    "IMAD": "integer / move (IMAD.MOV, address math)", "IADD3": "integer / move (IMAD.MOV, address math)",
    "VIADD": "integer / move (IMAD.MOV, address math)", "LEA": "integer / move (IMAD.MOV, address math)",
    "ISETP": "integer / move (IMAD.MOV, address math)", "SEL": "integer / move (IMAD.MOV, address math)",
    "MOV": "integer / move (IMAD.MOV, address math)",
}


def _open(path: str):
    return gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    """The mnemonic of one SASS line (``@!P0 IMAD.MOV.U32 R1, ...`` -> ``IMAD``)."""
    text = re.sub(r"^\s*@!?U?P[T0-9]+\s+", "", sass).strip()
    return re.split(r"[ .]", text)[0] if text else ""


def summarize(path: str) -> dict:
    """``{"samples", "reasons": {reason: samples}, "classes": {class: {"samples", reason: samples}}}``
    over every instruction row of one source-page CSV (first kernel in the file)."""
    with _open(path) as fh:
        rows = list(csv.reader(fh))
    try:
        head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    except StopIteration:
        raise ValueError(f"{path}: no SASS source page (run ncu with --page source --print-source sass --csv)") from None
    hdr = rows[head]
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    total, by_reason = 0.0, collections.Counter()
    classes: dict = collections.defaultdict(collections.Counter)
    for r in rows[head + 1:]:
        if len(r) != len(hdr) or not r[0].startswith("0x"):
            continue
        op = opcode(r[col["Source"]])
        cls = CLASSES.get(op, "other")
        for name in reasons:
            v = _num(r[col[name]])
            total += v
            by_reason[name[6:]] += v
            classes[cls]["samples"] += v
            classes[cls][name[6:]] += v
    return {"samples": total, "reasons": dict(by_reason), "classes": {k: dict(v) for k, v in classes.items()}}


def markdown(path: str, s: dict, label: str | None = None) -> list[str]:
    """Two tables: stall reasons, and opcode classes with their two largest reasons."""
    tot = s["samples"] or 1.0
    out = [f"### {label or path}", "", f"{s['samples']:.0f} warp-stall samples.", "",
           "| reason | share |", "|---|---|"]
    for name, v in sorted(s["reasons"].items(), key=lambda kv: -kv[1]):
        if v / tot >= 0.005:
            out.append(f"| {name} | {v / tot:.1%} |")
    out += ["", "| instructions | share of samples | largest reasons |", "|---|---|---|"]
    for cls, c in sorted(s["classes"].items(), key=lambda kv: -kv[1]["samples"]):
        top = sorted(((k, v) for k, v in c.items() if k != "samples"), key=lambda kv: -kv[1])[:2]
        out.append(f"| {cls} | {c['samples'] / tot:.1%} | " + ", ".join(f"{k} {v / tot:.1%}" for k, v in top) + " |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", help="ncu source-page CSV files (.csv or .csv.gz)")
    ap.add_argument("--out", default="", help="also write the tables as markdown to this file")
    a = ap.parse_args(argv)
    lines = []
    for path in a.csv:
        try:
            lines += markdown(path, summarize(path)) + [""]
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
