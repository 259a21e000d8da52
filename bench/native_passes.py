"""The compiled CPU decode passes (``leankit/native/live_attention.c``) on a real cache.

A batch of real prompts is prefilled into a LeanCache and stepped a few times; then, for a few
layers and every tier, pass 1 (``live_scores``: masked scores and row maxima) and pass 2
(``live_values``: numerators, sums and weighted values) run on that layer's live pages, listed
from the page table as a decode step lists them. Reported per tier: nanoseconds per (token, KV
head) of each pass, best of 5 rounds of 10 calls.

Two cache states, because they differ by 2-4x on a CPU: ``hot`` calls the pass on the same pages
over and over (they stay in cache, so this is the loop's own cost), ``cold`` writes a 256 MB buffer
before every call (what a real decode step sees: between two uses of a layer's pages the whole
model's weights and every other layer's pages stream through the caches).

    python bench/native_passes.py --kv K8V4 --context 512
    python bench/native_passes.py --kv 'K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1' --cold
    python bench/native_passes.py --against HEAD      # this working tree's C sources vs HEAD's

Compare configs by the ratio of two runs' figures on one machine, never by one figure. To compare
two versions of the C sources, use ``--against REV``: the sources of git revision REV are built
too, both builds first compute the same passes (their largest difference is printed), then their
calls alternate one by one on the same pages and each keeps its fastest, so both see the same
machine state. Two separate runs on a shared machine differ by up to 40% (two builds of the same
sources measured that way); alternating, they stay within a few percent.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leankit import native
from leankit.bench.malloc import pin_glibc_malloc
from leankit.bench.step import decode, prefill
from leankit.bench.text import corpus_ids, left_padded, pad_id, step_batch
from leankit.bench.timing import interleaved_best
from leankit.cache import LeanCache, _text_config, attention_head_dim, attention_kv_heads
from leankit.config import KVConfig
from leankit.decode_attention import tier_pages
from leankit.models import load_model


@dataclass
class TierPasses:
    """The two compiled passes over one tier's live pages of a layer, ready to call, and what they
    write (``scores`` after pass 1; pass 2 adds into ``l_sum`` and ``acc`` from zero)."""

    name: str
    tokens: int  # stored tokens x KV heads of the tier
    scores_pass: object
    values_pass: object
    scores: torch.Tensor
    acc: torch.Tensor


def tier_passes(kernels, cache: LeanCache, layer: int, group: int, head_dim: int,
                gen: torch.Generator) -> list[TierPasses]:
    """For each occupied tier of ``layer``, its :class:`TierPasses` over its live pages, with
    random scaled queries (drawn from ``gen``) that see every stored token."""
    kv = cache.paged_kv(layer)
    table = kv.table
    bh = table.shape[1] * table.shape[2]
    q = torch.randn(bh, group, head_dim, generator=gen) * head_dim ** -0.5
    q_pos = torch.full((bh, group), torch.iinfo(torch.int32).max - 1, dtype=torch.int32)
    out = []
    for tier, lay in enumerate(kv.layouts):
        pages = tier_pages(kernels, kv, tier)  # as a decode step lists them
        n, t = pages.page_id.numel(), lay.tokens
        if n == 0:
            continue
        lens = table.lens[tier, layer].view(bh)
        k_fmt = native.side_format(lay.precision.k_bits, lay.dense_dtype)
        v_fmt = native.side_format(lay.precision.v_bits, lay.dense_dtype)
        scores, m = torch.empty(n, group, t), torch.empty(bh, group)

        def scores_pass(pages=pages, lens=lens, k_fmt=k_fmt, g=lay.group_size, scores=scores, m=m):
            m.fill_(float("-inf"))
            kernels.live_scores(pages, q, q_pos, lens, k_fmt, g, scores, m)

        scores_pass()
        shift, first_scores = m.nan_to_num(0.0, 0.0, 0.0), scores.clone()
        l_sum, acc = torch.zeros(bh, group), torch.zeros(bh, group, head_dim)

        p = first_scores.clone()  # pass 2's input, refilled each call

        def values_pass(pages=pages, v_fmt=v_fmt, g=lay.group_size, shift=shift, first_scores=first_scores,
                        l_sum=l_sum, acc=acc, p=p):
            p.copy_(first_scores)  # pass 2 turns the scores into numerators in place
            l_sum.zero_()
            acc.zero_()
            kernels.live_values(pages, p, shift, v_fmt, g, l_sum, acc)

        name = f"tier {tier} K{lay.precision.k_bits}V{lay.precision.v_bits} ({t} tokens/page)"
        out.append(TierPasses(name, int(lens.sum()), scores_pass, values_pass, scores, acc))
    return out


def best_ns(fn, cold: bool, evict: torch.Tensor) -> float:
    """Best of 5 rounds of 10 calls, in ns per call; ``cold``: ``evict`` is written before each call
    (outside the timed span)."""
    fn()
    best = float("inf")
    for _ in range(5):
        total = 0.0
        for _ in range(10):
            if cold:
                evict.add_(1.0)
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        best = min(best, total / 10)
    return best * 1e9


def sources_at(rev: str, out_dir: Path) -> Path:
    """The C sources and headers of ``leankit/native`` at git revision ``rev``, written into ``out_dir``."""
    root = Path(__file__).resolve().parent.parent
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", rev, "leankit/native/"],
                           capture_output=True, text=True, check=False)
    files = [f for f in names.stdout.split() if f.endswith((".c", ".h"))]
    if names.returncode or not files:
        raise SystemExit(f"--against {rev}: no leankit/native sources at that revision ({names.stderr.strip()})")
    for f in files:
        blob = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{f}"], capture_output=True, check=True)
        (out_dir / Path(f).name).write_bytes(blob.stdout)
    return out_dir


def compare_builds(builds: dict, cache: LeanCache, layers: list[int], group: int, head_dim: int, cold: bool,
                   evict: torch.Tensor, calls: int) -> list[str]:
    """Markdown rows timing the passes of two builds (``{name: Kernels}``, the newer first) on the
    same pages: each tier's pass 1 and pass 2 ns per (token, KV head) of both, and new / old."""
    rows = []
    for layer in layers:
        per_build = {name: tier_passes(k, cache, layer, group, head_dim, torch.Generator().manual_seed(layer))
                     for name, k in builds.items()}
        new, old = per_build.values()
        for a, b in zip(new, old):
            a.scores_pass(), b.scores_pass(), a.values_pass(), b.values_pass()
            live = a.scores > float("-inf")
            diff = float(torch.cat([(a.scores[live] - b.scores[live]).abs(), (a.acc - b.acc).abs().flatten()]).max())
            if not torch.equal(live, b.scores > float("-inf")):
                diff = float("inf")
            evicting = (lambda: evict.add_(1.0)) if cold else None
            s = interleaved_best({"new": a.scores_pass, "old": b.scores_pass}, calls, evicting)
            v = interleaved_best({"new": a.values_pass, "old": b.values_pass}, calls, evicting)
            n = a.tokens / 1e9  # ns per (token, KV head)
            rows.append(f"| {layer} | {a.name} | {a.tokens} | {s['new'] / n:.1f} | {s['old'] / n:.1f} | "
                        f"{s['new'] / s['old']:.3f} | {v['new'] / n:.1f} | {v['old'] / n:.1f} | "
                        f"{v['new'] / v['old']:.3f} | {diff:.2g} |")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="K8V4", help="LeanCache config (default: K8V4)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="layers to time (default: first, middle, last)")
    ap.add_argument("--cold", action="store_true", help="evict the caches before every call")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=None,
                    help="query rows per KV head (default: the model's group; a step of n queries has n x group)")
    ap.add_argument("--against", metavar="REV", help="also build the C sources of git revision REV and time both "
                    "builds call by call on the same pages (this tree's sources are 'new'; REV's entry points must "
                    "take the same arguments)")
    ap.add_argument("--calls", type=int, default=200, help="with --against: calls of each build per pass")
    args = ap.parse_args(argv)

    kernels = native.kernels()
    if kernels is None:
        raise SystemExit("the compiled CPU kernels are unavailable here (no C compiler, or LEANKIT_NATIVE=0)")
    pin_glibc_malloc()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    cfg = _text_config(model.config)
    ids, mask = left_padded(step_batch(corpus_ids(tok), args.batch, args.context), pad_id(tok))
    cache = LeanCache(model, KVConfig.parse(args.kv))
    state = prefill(model, cache, ids, mask)
    for _ in range(3):
        state = decode(model, cache, state)
    n_layers = cfg.num_hidden_layers
    layers = args.layers or sorted({0, n_layers // 2, n_layers - 1})
    group, head_dim = cfg.num_attention_heads // attention_kv_heads(cfg), attention_head_dim(cfg)
    group = args.rows or group
    evict = torch.zeros(64 << 20) if args.cold else torch.zeros(1)
    gen = torch.Generator().manual_seed(0)
    state_name = "cold" if args.cold else "hot"
    print(f"{args.kv}, batch {args.batch}, context {args.context}, {group} query rows per KV head, {state_name} "
          f"caches, {args.threads} thread(s)")
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            old = native.build_from(sources_at(args.against, Path(tmp)))
        rows = compare_builds({"new": kernels, args.against: old}, cache, layers, group, head_dim, args.cold, evict,
                              args.calls)
        print(f"this tree's sources (new) against {args.against} (old): fastest of {args.calls} alternating calls; "
              "max diff: largest difference between the two builds' live scores and value sums")
        print("| layer | tier | tokens x heads | pass 1 new ns/token | old | new / old | pass 2 new ns/token | old | "
              "new / old | max diff |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        return
    print("| layer | tier | tokens x heads | pass 1 ns/token | pass 2 ns/token |")
    print("|---|---|---|---|---|")
    for layer in layers:
        for tp in tier_passes(kernels, cache, layer, group, head_dim, gen):
            s = best_ns(tp.scores_pass, args.cold, evict) / tp.tokens
            v = best_ns(tp.values_pass, args.cold, evict) / tp.tokens
            print(f"| {layer} | {tp.name} | {tp.tokens} | {s:.1f} | {v:.1f} |")


if __name__ == "__main__":
    main()
