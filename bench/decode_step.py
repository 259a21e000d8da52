"""Decode-step time of LeanCache vs DynamicCache, measured side by side in one run.

For each context length, a batch of real prompts is prefilled once per cache; then decode steps
of the two caches are timed alternately (A B A B ...) so both see the same machine state, and the
ratio of medians is reported. Absolute times are printed for context only: compare ratios.

    python bench/decode_step.py --model smollm2-135m --batch 8 --context 1024 --kv K8V4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import leankit
from leankit.bench.step import decode as step
from leankit.bench.step import prefill
from leankit.cache import LeanCache

FILLER = (
    "The history of computing is a story of memory. Early machines stored a few thousand words; "
    "modern accelerators hold billions of parameters, yet the cache of keys and values that a "
    "language model keeps for every token it has read still decides how many requests fit at once. "
)


def make_batch(tok, batch: int, context: int):
    """``batch`` left-padded prompts of slightly different lengths around ``context`` tokens."""
    ids = tok(FILLER * (context // 40 + 2), return_tensors="pt").input_ids[0]
    rows = [ids[i: i + context - 3 * i] for i in range(batch)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return input_ids, mask


def measure(model, tok, batch: int, context: int, kv: str, steps: int):
    """Return (median DynamicCache step s, median LeanCache step s, ratio)."""
    input_ids, mask = make_batch(tok, batch, context)
    dyn = DynamicCache(config=model.config)
    lean = LeanCache(model, kv)
    s_dyn, s_lean = prefill(model, dyn, input_ids, mask), prefill(model, lean, input_ids, mask)
    t_dyn, t_lean = [], []
    for i in range(steps + 2):
        for name in ("dyn", "lean") if i % 2 == 0 else ("lean", "dyn"):
            t0 = time.perf_counter()
            if name == "dyn":
                s_dyn = step(model, dyn, s_dyn)
                dt, lst = time.perf_counter() - t0, t_dyn
            else:
                s_lean = step(model, lean, s_lean)
                dt, lst = time.perf_counter() - t0, t_lean
            if i >= 2:  # first two rounds warm up
                lst.append(dt)
    md, ml = statistics.median(t_dyn), statistics.median(t_lean)
    return md, ml, ml / md, lean.memory_report()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, nargs="+", default=[1024])
    p.add_argument("--kv", nargs="+", default=["K8V4"])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = leankit.load_model(a.model)
    print(f"{'kv':>10} {'batch':>5} {'context':>7} {'dyn ms':>8} {'lean ms':>8} {'ratio':>6} {'kv ratio':>8}")
    for ctx in a.context:
        for kv in a.kv:
            md, ml, r, rep = measure(model, tok, a.batch, ctx, kv, a.steps)
            print(f"{kv:>10} {a.batch:>5} {ctx:>7} {md * 1e3:8.1f} {ml * 1e3:8.1f} {r:6.2f} {rep['pages_ratio']:8.3f}")


if __name__ == "__main__":
    main()
