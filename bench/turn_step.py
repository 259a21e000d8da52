"""A step of many queries after a prompt on the CPU: the compiled live-page passes vs the padded tiles.

A new turn's prompt (``--new`` tokens after ``--context`` stored ones, ``--batch`` rows) attends to the
stored pages through :func:`leankit.attention.paged_attention_ref`. Two routes, timed on the same
model and inputs, best of ``--repeat`` rounds in an order rotated each round:

* ``padded``: what such a step ran before: the padded page tiles (more than
  ``decode_attention.DECODE_ROWS`` query rows), and under a significance policy a second pass over
  the keys (:func:`leankit.attention.received_attention_ref`) for the stored tokens' significance;
* ``live``: the compiled live-page passes in query chunks that fit
  ``decode_attention.LIVE_SCORE_BYTES``, the significance taken from each chunk's scores
  (``decode_attention.step_logits_queries``, :func:`leankit.attention.long_step_attention`).

Each round prefills a fresh cache (not timed) and times the turn's forward; ``DynamicCache`` runs the
same turn for the ratio users compare. The routes' logits are checked against each other first. Needs
the compiled CPU kernels (a C compiler)::

    python bench/turn_step.py --batch 4 --context 1024 --new 128 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from leankit import decode_attention, native
from leankit.cache import LeanCache
from leankit.config import KVConfig
from leankit.hf import cache_kwargs, enable

CONFIGS = ["K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1"]


@contextlib.contextmanager
def padded_route():
    """The route a long step took before the compiled passes served it: at most ``DECODE_ROWS``
    rows on the live pages, and no logits kept for a step longer than ``LOGITS_QUERY_LIMIT``."""
    supports, keeps = decode_attention.supports, decode_attention.step_logits_queries
    decode_attention.supports = lambda layouts, rows, occupied=None, compiled=False: (
        rows <= decode_attention.DECODE_ROWS and supports(layouts, rows, occupied, compiled))
    decode_attention.step_logits_queries = lambda *args: 0
    try:
        yield
    finally:
        decode_attention.supports, decode_attention.step_logits_queries = supports, keeps


def _turn(model, make_cache, first: torch.Tensor, second: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Prefill ``first`` into a fresh cache (not timed), then time the forward of ``second`` on it."""
    cache = make_cache()
    with torch.no_grad():
        model(input_ids=first, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        out = model(input_ids=second, **cache_kwargs(model, cache), use_cache=True)
        return time.perf_counter() - t0, out.logits


def measure(model, kv: str, batch: int, context: int, new: int, repeat: int, seed: int = 0) -> dict:
    """Best times (s) of the turn's forward per route and for DynamicCache, after checking that the
    two routes' logits agree."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    first = torch.randint(3, vocab, (batch, context), generator=gen)
    second = torch.randint(3, vocab, (batch, new), generator=gen)
    cfg = KVConfig.parse(kv)

    def lean():
        return LeanCache(model, cfg, max_seq_len=context + new)

    routes = {"live": contextlib.nullcontext, "padded": padded_route,
              "DynamicCache": contextlib.nullcontext}
    makers = {"live": lean, "padded": lean, "DynamicCache": lambda: DynamicCache(config=model.config)}
    logits = {}
    for name in ("live", "padded"):
        with routes[name]():
            logits[name] = _turn(model, makers[name], first, second)[1]
    torch.testing.assert_close(logits["live"], logits["padded"], rtol=1e-3, atol=1e-3)
    best = dict.fromkeys(routes, float("inf"))
    names = list(routes)
    for i in range(repeat):
        for name in names[i % 3:] + names[: i % 3]:
            with routes[name]():
                best[name] = min(best[name], _turn(model, makers[name], first, second)[0])
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, nargs="+", default=[1024], help="stored tokens per row")
    p.add_argument("--new", type=int, nargs="+", default=[128], help="the new turn's tokens per row")
    p.add_argument("--kv", action="append", help=f"config (repeat; default: {', '.join(CONFIGS)})")
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or checkpoint folder")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args(argv)
    if native.kernels() is None:
        p.error("the compiled CPU kernels are not available (no C compiler): nothing to compare")
    if a.threads:
        torch.set_num_threads(a.threads)
    from leankit.models import load_model

    model, _ = load_model(a.model)
    enable(model)
    print(f"{a.model}, batch {a.batch}, {torch.get_num_threads()} thread(s); best of {a.repeat} rounds")
    print("| stored | new | config | live vs padded | live vs DynamicCache | padded vs DynamicCache |")
    print("|---|---|---|---|---|---|")
    for context in a.context:
        for new in a.new:
            for kv in a.kv or CONFIGS:
                t = measure(model, kv, a.batch, context, new, a.repeat)
                print(f"| {context} | {new} | `{kv}` | {t['live'] / t['padded']:.2f}x | "
                      f"{t['live'] / t['DynamicCache']:.2f}x | {t['padded'] / t['DynamicCache']:.2f}x |")


if __name__ == "__main__":
    main()
