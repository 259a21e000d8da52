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

Compare configs or builds by the ratio of two runs' figures on one machine, never by one figure.
"""

from __future__ import annotations

import argparse
import time

import torch

from leankit import native
from leankit.bench.malloc import pin_glibc_malloc
from leankit.bench.step import decode, prefill
from leankit.bench.text import corpus_ids, left_padded, pad_id, step_batch
from leankit.cache import LeanCache, _text_config, attention_head_dim, attention_kv_heads
from leankit.config import KVConfig
from leankit.decode_attention import tier_pages
from leankit.models import load_model


def tier_passes(kernels, cache: LeanCache, layer: int, group: int, head_dim: int, gen: torch.Generator):
    """For each occupied tier of ``layer``: ``(name, tokens, pass 1 fn, pass 2 fn)`` over its live
    pages, with random scaled queries that see every stored token."""
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

        def values_pass(pages=pages, v_fmt=v_fmt, g=lay.group_size, scores=scores, shift=shift,
                        first_scores=first_scores, l_sum=l_sum, acc=acc):
            scores.copy_(first_scores)  # pass 2 turns the scores into numerators in place
            kernels.live_values(pages, scores, shift, v_fmt, g, l_sum, acc)

        name = f"tier {tier} K{lay.precision.k_bits}V{lay.precision.v_bits} ({t} tokens/page)"
        out.append((name, int(lens.sum()), scores_pass, values_pass))
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="K8V4", help="LeanCache config (default: K8V4)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="layers to time (default: first, middle, last)")
    ap.add_argument("--cold", action="store_true", help="evict the caches before every call")
    ap.add_argument("--threads", type=int, default=1)
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
    evict = torch.zeros(64 << 20) if args.cold else torch.zeros(1)
    gen = torch.Generator().manual_seed(0)
    state_name = "cold" if args.cold else "hot"
    print(f"{args.kv}, batch {args.batch}, context {args.context}, {state_name} caches, {args.threads} thread(s)")
    print("| layer | tier | tokens x heads | pass 1 ns/token | pass 2 ns/token |")
    print("|---|---|---|---|---|")
    for layer in layers:
        for name, tokens, scores_pass, values_pass in tier_passes(kernels, cache, layer, group, head_dim, gen):
            s = best_ns(scores_pass, args.cold, evict) / tokens
            v = best_ns(values_pass, args.cold, evict) / tokens
            print(f"| {layer} | {name} | {tokens} | {s:.1f} | {v:.1f} |")


if __name__ == "__main__":
    main()
