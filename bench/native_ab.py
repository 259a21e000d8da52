"""This tree's compiled CPU kernels against a git revision's, end to end, in one process.

``bench/native_passes.py --against REV`` times the two builds' passes alone; this script times what
users run on them: a new turn's forward (``--new`` tokens after ``--context`` stored ones, random
tokens, as ``bench/turn_step.py``) or greedy decode steps after a real-text prompt (as ``leankit bench
step``). Both builds serve the same model in the same process (``leankit.native.kernels_for`` is
pointed at one or the other). A turn reports the largest difference between the two builds'
logits: a change that keeps the kernels' arithmetic gives 0.

* ``turn``: best of ``--repeat`` rounds, each timing a fresh cache's turn with the new build, the old
  one and ``DynamicCache`` in an order rotated each round;
* ``decode``: one cache, ``--steps`` decode steps per build, the builds alternating step by step (so
  both see the same cache state and machine state); medians.

    python bench/native_ab.py turn --batch 4 --context 4096 --new 128 --against HEAD
    python bench/native_ab.py decode --batch 8 --context 1024 --kv K8V4 --against HEAD
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from leankit import native
from leankit.bench.malloc import pin_glibc_malloc
from leankit.bench.step import decode, prefill
from leankit.bench.text import corpus_ids, left_padded, pad_id, step_batch
from leankit.cache import LeanCache
from leankit.config import KVConfig
from leankit.models import load_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from native_passes import sources_at
from turn_step import _turn

NEUTRAL = "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1"


@contextlib.contextmanager
def serving(build):
    """Every CPU call of the compiled kernels goes to ``build`` inside the block."""
    before = native.kernels_for
    native.kernels_for = lambda device: build if torch.device(device).type == "cpu" else None
    try:
        yield
    finally:
        native.kernels_for = before


def turn(model, builds: dict, kv: str, batch: int, context: int, new: int, repeat: int) -> str:
    """A turn of ``new`` random tokens after ``context`` ones, ``batch`` rows, on each build and on
    ``DynamicCache`` (best of ``repeat`` rotated rounds); a markdown row with the ratios and the
    largest difference between the builds' logits."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    first = torch.randint(3, model.config.vocab_size, (batch, context), generator=gen)
    second = torch.randint(3, model.config.vocab_size, (batch, new), generator=gen)

    def lean():
        return LeanCache(model, KVConfig.parse(kv), max_seq_len=context + new)

    runs = {"new": (builds["new"], lean), "old": (builds["old"], lean),
            "DynamicCache": (builds["new"], lambda: DynamicCache(config=model.config))}
    logits = {}
    for name in ("new", "old"):
        with serving(runs[name][0]):
            logits[name] = _turn(model, runs[name][1], first, second)[1]
    diff = float((logits["new"] - logits["old"]).abs().max())
    best, names = dict.fromkeys(runs, float("inf")), list(runs)
    for i in range(repeat):
        for name in names[i % 3:] + names[:i % 3]:
            with serving(runs[name][0]):
                best[name] = min(best[name], _turn(model, runs[name][1], first, second)[0])
    return (f"| turn | {batch} | {context} | {new} | `{kv}` | {best['new'] / best['old']:.3f} | "
            f"{best['new'] / best['DynamicCache']:.2f}x | {best['old'] / best['DynamicCache']:.2f}x | {diff:.2g} |")


def decode_steps(model, builds: dict, kv: str, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> str:
    """``steps`` greedy decode steps per build after prefilling ``ids`` (left-padded, ``mask``) into one
    cache, the builds alternating step by step; a markdown row with the medians."""
    cache = LeanCache(model, KVConfig.parse(kv))
    with serving(builds["new"]):
        state = prefill(model, cache, ids, mask)
        for _ in range(3):
            state = decode(model, cache, state)
    times = {"new": [], "old": []}
    for i in range(steps):
        for name in ("new", "old") if i % 2 == 0 else ("old", "new"):
            with serving(builds[name]):
                t0 = time.perf_counter()
                state = decode(model, cache, state)
                times[name].append(time.perf_counter() - t0)
    new, old = statistics.median(times["new"]), statistics.median(times["old"])
    return (f"| decode | {ids.shape[0]} | {ids.shape[1]} | - | `{kv}` | {new / old:.3f} | {new * 1e3:.1f} ms | "
            f"{old * 1e3:.1f} ms | - |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["turn", "decode"])
    ap.add_argument("--kv", action="append", help=f"LeanCache config (repeat; default: {NEUTRAL})")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="stored (turn) or prompt (decode) tokens per row")
    ap.add_argument("--new", type=int, default=128, help="turn: the new turn's tokens per row")
    ap.add_argument("--repeat", type=int, default=3, help="turn: rounds")
    ap.add_argument("--steps", type=int, default=16, help="decode: steps per build")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--against", metavar="REV", default="HEAD", help="git revision whose C sources are 'old'")
    args = ap.parse_args(argv)
    new_build = native.kernels()
    if new_build is None:
        raise SystemExit("the compiled CPU kernels are unavailable here (no C compiler, or LEANKIT_NATIVE=0)")
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"new": new_build, "old": native.build_from(sources_at(args.against, Path(tmp)))}
    pin_glibc_malloc()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    print(f"this tree's C sources (new) against {args.against} (old), {args.threads} thread(s); turn: best of "
          f"{args.repeat} rotated rounds; decode: medians of {args.steps} alternating steps")
    print("| mode | batch | tokens | new tokens | config | new / old | new (turn: / DynamicCache) | "
          "old (turn: / DynamicCache) | max logit diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kv in args.kv or [NEUTRAL]:
        if args.mode == "turn":
            print(turn(model, builds, kv, args.batch, args.context, args.new, args.repeat), flush=True)
        else:
            ids, mask = left_padded(step_batch(corpus_ids(tok), args.batch, args.context), pad_id(tok))
            print(decode_steps(model, builds, kv, ids, mask, args.steps), flush=True)


if __name__ == "__main__":
    main()
