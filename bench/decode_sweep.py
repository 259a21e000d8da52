"""Launch-shape sweep of the decode kernel on a CUDA GPU: tile rows x warps x pipeline stages.

    python bench/decode_sweep.py --head-dim 128 --kv-heads 8 --group 4 --points 32x16384 8x4096 \
        --variants 128:4:2 64:4:2 64:8:2 --out results/gpu

The decode kernels are latency-bound (Nsight Compute: about 2 active and 0.2-0.4 eligible warps
per scheduler at 2 programs of 4 warps per SM), so the lever is how many warps an SM keeps in
flight, which the tile rows, warps per program and pipeline stages set together with the
registers and shared memory they compile to. Each variant ``rows:warps:stages`` overrides
``DECODE_MAX_ROWS``, ``DECODE_WARPS`` and ``DECODE_STAGES`` of :mod:`leankit_kernels.paged_attention`
for one launch plan, over the very synthetic cache :mod:`bench.kernels` times. Per variant it
reports the compiled registers and shared memory, programs per SM, the split count the launcher
then picks, the CUDA-graph time, the bandwidth as a fraction of a measured device copy, and the
largest difference from the first variant's output over that output's largest magnitude (every
variant computes the same attention; they differ by the fp16 output's rounding, 2^-11 relative).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import (
    Shape,
    add_shape_arguments,
    copy_bandwidth,
    decode_call,
    model_call,
    save_results,
    time_call,
)


def parse_variant(text: str) -> tuple[int, int, int]:
    """``"rows:warps:stages"`` -> ints (rows a power of two in 32..128, warps 1..8, stages 1..4)."""
    try:
        rows, warps, stages = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a variant is rows:warps:stages, got {text!r}") from None
    if rows not in (32, 64, 128) or warps not in (1, 2, 4, 8) or not 1 <= stages <= 4:
        raise argparse.ArgumentTypeError(f"rows in 32/64/128, warps in 1/2/4/8, stages in 1..4; got {text!r}")
    return rows, warps, stages


def parse_point(text: str) -> tuple[int, int]:
    """``"BxCTX"`` -> ``(batch, context)``."""
    try:
        b, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is BATCHxCONTEXT, e.g. 32x16384; got {text!r}") from None
    if b < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be positive, got {text!r}")
    return b, n


def use_variant(pa, rows: int, warps: int, stages: int) -> None:
    """Point the decode launcher at one variant: its constants, and no launch plan or programs-per-SM
    count left from another variant (the next launch works both out afresh)."""
    pa.DECODE_MAX_ROWS, pa.DECODE_WARPS, pa.DECODE_STAGES = rows, warps, stages
    pa._DECODE_PLANS.clear()
    pa._RESIDENT.clear()


def sweep(shape: Shape, batch: int, ctx: int, configs, variants, dev, copy_bw: float) -> list[dict]:
    """Time every variant of every config at one (batch, context); prints a line per variant."""
    import leankit_kernels.paged_attention as pa

    defaults = (pa.DECODE_MAX_ROWS, pa.DECODE_WARPS, pa.DECODE_STAGES)
    real_choose, real_resident = pa.choose_splits, pa.resident_programs
    splits, compiled = [], []  # what the launcher chose and measured, call by call

    def recording_choose(*args, **kwargs):
        splits.append(real_choose(*args, **kwargs))
        return splits[-1]

    def recording_resident(regs, shared, warps, sm_shared=0):
        compiled.append({"regs": regs, "shared": shared, "resident": real_resident(regs, shared, warps, sm_shared)})
        return compiled[-1]["resident"]

    pa.choose_splits, pa.resident_programs = recording_choose, recording_resident
    rows_out = []
    try:
        for spec in configs:
            call, _ = decode_call(spec, batch, ctx, shape, dev)
            nbytes = model_call(spec, batch, ctx, shape)["bytes"]
            ref = None
            for rows, warps, stages in variants:
                use_variant(pa, rows, warps, stages)
                compiled.clear()
                call()  # compiles; its registers set the programs per SM the next launches plan with
                splits.clear()
                out = call()[0].float()
                diff = 0.0 if ref is None else float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                ref = out if ref is None else ref
                graph_us, eager_us = time_call(call)
                us = graph_us if graph_us is not None else eager_us
                plan = next(iter(pa._DECODE_PLANS.values()))
                r = {"config": spec, "batch": batch, "context": ctx, "rows": rows, "warps": warps, "stages": stages,
                     "tiling": plan.tiling, **(compiled[0] if compiled else {}), "splits": splits[0] if splits else None,
                     "us": us, "eager_us": eager_us, "copy_frac": nbytes / (us * 1e-6) / copy_bw,
                     "rel_diff_vs_first": diff}
                rows_out.append(r)
                print(f"{spec:<10} B{batch} ctx{ctx} {rows:>3}:{warps}:{stages} tiles {plan.tiling} "
                      f"regs {r.get('regs')} smem {r.get('shared')} res/SM {r.get('resident')} splits {r['splits']} "
                      f"{us:8.1f} us  {r['copy_frac']:.2f} of copy  diff {diff:.1e}", flush=True)
            del call
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        pa.choose_splits, pa.resident_programs = real_choose, real_resident
        use_variant(pa, *defaults)
    return rows_out


def markdown(rows: list[dict], title: str) -> list[str]:
    """One table: each config's variants, with time and speedup against the config's first variant."""
    head = ("| config | rows:warps:stages | tiles | regs | shared B | programs/SM | splits | us | x first | "
            "of copy BW | max diff vs first / max out |")
    out = [f"### {title}", "", head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    first = {}
    for r in rows:
        base = first.setdefault(r["config"], r["us"])
        tiles = "/".join(str(v) for v in r["tiling"].values())
        out.append(f"| {r['config']} | {r['rows']}:{r['warps']}:{r['stages']} | {tiles} | {r.get('regs', '-')} | "
                   f"{r.get('shared', '-')} | {r.get('resident', '-')} | {r['splits']} | {r['us']:.1f} | "
                   f"{base / r['us']:.2f} | {r['copy_frac']:.2f} | {r['rel_diff_vs_first']:.1e} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--points", type=parse_point, nargs="+", default=[(32, 16384), (8, 4096)],
                    help="batch x context points (default: 32x16384 8x4096)")
    ap.add_argument("--configs", nargs="+", default=["FP16", "K8V4", "K4V2", "K8V4-K4V2"])
    ap.add_argument("--variants", type=parse_variant, nargs="+", default=[(128, 4, 2), (64, 4, 2), (64, 8, 2)],
                    help="rows:warps:stages; the first is the baseline of 'x first' (default: 128:4:2 64:4:2 64:8:2)")
    ap.add_argument("--out", default="", help="also write JSON + markdown into this folder")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    shape, dev = Shape(a.head_dim, a.kv_heads, a.group), torch.device("cuda")
    copy_bw = copy_bandwidth(dev)
    rows = []
    for b, n in a.points:
        rows += sweep(shape, b, n, a.configs, a.variants, dev, copy_bw)
    if a.out:
        import triton

        cmd = " ".join(argv if argv is not None else sys.argv[1:])
        device = torch.cuda.get_device_name()
        lines = [f"# Decode launch-shape sweep: d{a.head_dim}, {a.kv_heads} KV heads x {a.group}", "",
                 f"{device}, triton {triton.__version__}; `python bench/decode_sweep.py {cmd}`", ""]
        for b, n in a.points:
            lines += markdown([r for r in rows if r["batch"] == b and r["context"] == n],
                              f"batch {b}, context {n}") + [""]
        save_results(a.out, f"decode_sweep_d{a.head_dim}_h{a.kv_heads}g{a.group}",
                     {"device": device, "triton": triton.__version__, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
