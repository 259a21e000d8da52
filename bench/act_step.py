"""Decode-step time of LeanCache with ACT blocks against the same config without them, side by side.

For each KV config, three caches (``KV``, ``KV:act=0.5``, ``KV:act=1`` by default) prefill the
same left-padded batch; then their decode steps are timed in turns, the order rotating every
round so that each sees the same machine state, and each ACT cache's median step is divided by
the median step of the cache without ACT. Absolute times are printed for context only: compare
ratios. ACT steps recompute every ACT token's K/V in every layer (the CPU reference GEMM here,
the fused Triton kernel on CUDA), which is the cost HybridServe trades for the memory.

    python bench/act_step.py --model smollm2-135m --batch 4 --context 256 --kv FP16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from decode_step import make_batch, prefill, step

import leankit
from leankit.cache import LeanCache


def measure(model, tok, batch: int, context: int, kv: str, acts: list[float], steps: int):
    """Return ``{spec: (median step s, ratio to the config without ACT, memory report)}``."""
    input_ids, mask = make_batch(tok, batch, context)
    specs = [kv] + [f"{kv}:act={a}" for a in acts]
    caches, states, times = {}, {}, {s: [] for s in specs}
    for s in specs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GQA models warn that ACT costs more bytes than KV
            caches[s] = LeanCache(model, s)
        states[s] = prefill(model, caches[s], input_ids, mask)
    for i in range(steps + 2):
        order = specs[i % len(specs):] + specs[: i % len(specs)]
        for s in order:
            t0 = time.perf_counter()
            states[s] = step(model, caches[s], states[s])
            if i >= 2:  # the first two rounds warm up
                times[s].append(time.perf_counter() - t0)
    base = statistics.median(times[kv])
    return {s: (statistics.median(times[s]), statistics.median(times[s]) / base, caches[s].memory_report())
            for s in specs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, nargs="+", default=[256])
    p.add_argument("--kv", nargs="+", default=["FP16"])
    p.add_argument("--act", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = leankit.load_model(a.model)
    print(f"{'config':>16} {'batch':>5} {'context':>7} {'step ms':>8} {'vs no ACT':>9} {'bytes/fp16':>10}")
    for ctx in a.context:
        for kv in a.kv:
            for spec, (t, r, rep) in measure(model, tok, a.batch, ctx, kv, a.act, a.steps).items():
                print(f"{spec:>16} {a.batch:>5} {ctx:>7} {t * 1e3:8.1f} {r:9.2f} {rep['ratio']:10.3f}")


if __name__ == "__main__":
    main()
