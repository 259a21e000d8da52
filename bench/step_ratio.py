"""Decode-step (or prefill) ratios against DynamicCache in one process, for comparing two versions
of leankit.

    python bench/step_ratio.py --context 128 --kv FP16 --kv K8V4 --kv neutral
    PYTHONPATH=/path/to/older/tree python bench/step_ratio.py --context 256     # an older version
    python bench/step_ratio.py --prefill --batch 1 --context 32 --kv K8V4 --kv neutral --kv compact

A batch of real-text prompts (``leankit bench step``'s rows) is prefilled into a DynamicCache and
into a LeanCache per ``--kv`` config; then every cache takes ``--steps`` decode steps, after
``--warmup`` rounds, once per round in an order that rotates each round. Printed: DynamicCache's
median step and each config's median step as a ratio of it, with the difference in ms. With
``--prefill`` each round times the prefill itself, into a fresh cache per config.

Why this and not ``leankit bench step``: on a shared machine DynamicCache's own step moves by a
third from one process to the next, so two versions are compared by the ratio each measures in its
own process, over several alternating runs (``leankit bench step`` instruments the steps and
prefills three times per cache, which takes much longer per run). Python imports the leankit it
finds first on ``sys.path``, so ``PYTHONPATH`` pointing at another checkout's root (or an extract
of its ``leankit/`` directory, e.g. ``git archive REV leankit | tar -x -C DIR``) runs that
version; its compiled kernels are built from its own C sources.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import leankit
from leankit.bench.malloc import pin_glibc_malloc
from leankit.bench.step import decode, prefill
from leankit.bench.text import corpus_ids, left_padded, pad_id, step_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=256, help="prompt length in tokens (default: 256)")
    ap.add_argument("--batch", type=int, default=8, help="rows (default: 8)")
    ap.add_argument("--kv", action="append", help="LeanCache config (repeat; default: FP16, K8V4 and neutral)")
    ap.add_argument("--steps", type=int, default=16, help="measured rounds (default: 16)")
    ap.add_argument("--warmup", type=int, default=2, help="rounds dropped first (default: 2)")
    ap.add_argument("--prefill", action="store_true",
                    help="time the prompt's prefill into a fresh cache each round, not decode steps")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pin_glibc_malloc()
    configs = args.kv or ["FP16", "K8V4", "neutral"]
    model, tok = leankit.load_model("smollm2-135m")
    ids, mask = left_padded(step_batch(corpus_ids(tok), args.batch, args.context), pad_id(tok))
    makers = {"DynamicCache": DynamicCache}
    makers.update({name: lambda name=name: leankit.LeanCache(model, leankit.presets.resolve(name)) for name in configs})
    caches = {name: make() for name, make in makers.items()}
    states = {name: prefill(model, cache, ids, mask) for name, cache in caches.items()}
    times = {name: [] for name in caches}
    names = list(caches)
    for i in range(args.warmup + args.steps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            if args.prefill:
                cache = makers[name]()  # made outside the timed region, as DynamicCache's is
                start = time.perf_counter()
                prefill(model, cache, ids, mask)
            else:
                start = time.perf_counter()
                states[name] = decode(model, caches[name], states[name])
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["DynamicCache"]
    parts = [f"{name} {medians[name] / base:.3f}x ({(medians[name] - base) * 1e3:+.1f} ms)" for name in configs]
    what = "prefill" if args.prefill else "step"
    print(f"{args.batch}x{args.context} {what}: DynamicCache {base * 1e3:.1f} ms; " + "; ".join(parts))


if __name__ == "__main__":
    main()
