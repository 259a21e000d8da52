"""Round-trip error of SmolLM2's real keys and values, per bit width, with and without rotation.

One Wikipedia article is run through the model with a plain ``DynamicCache``; every layer's
post-RoPE keys and values then go through the stored-token round trip of a single-tier config
(:func:`leankit.policy.stored_token_reference`, the same routine the attention oracle uses), once
as they are and once in the Hadamard basis of ``rotate=1``. The relative MSE
``||x_hat - x||^2 / ||x||^2``, summed over all layers, is printed per (side, bits, group).

Example::

    python -m eval.quant_error --tokens 1024 --out eval/results/quant_error.json
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from leankit.config import KVConfig
from leankit.data import wiki_articles
from leankit.hf import cache_kwargs
from leankit.policy import stored_token_reference

from .common import add_run_options, check_run_options, start_run, write_json

CASES = (("K", 8, None), ("K", 4, None), ("K", 4, 32), ("V", 4, None), ("V", 4, 32), ("V", 2, None), ("V", 2, 32))


@torch.no_grad()
def layer_states(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE ``(keys, values)`` ``[Hkv, N, F]`` of every layer for one prompt."""
    cache = DynamicCache()
    model(input_ids=ids.view(1, -1), **cache_kwargs(model, cache))
    return [(layer.keys[0].float(), layer.values[0].float()) for layer in cache.layers]


def relative_mse(states, side: str, bits: int, group: int | None, rotate: bool) -> float:
    """``sum ||x_hat - x||^2 / sum ||x||^2`` over all layers for one side (``"K"``/``"V"``)."""
    spec = f"K{bits}V16" if side == "K" else f"K16V{bits}"
    cfg = KVConfig.parse(spec, group_size=group, rotate=rotate)
    err = ref = 0.0
    for k, v in states:
        k_hat, v_hat = stored_token_reference(k, v, cfg, 0)
        x, x_hat = (k, k_hat) if side == "K" else (v, v_hat)
        err += float((x_hat - x).pow(2).sum())
        ref += float(x.pow(2).sum())
    return err / ref


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--article", type=int, default=40, help="index into the Wikipedia articles")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens, BOS included (fewer when the article is shorter)")
    add_run_options(ap)
    args = ap.parse_args(argv)
    if args.tokens < 1:  # the slice below would wrap around and measure most of the article
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    check_run_options(ap, args)
    articles = wiki_articles()
    if not 0 <= args.article < len(articles):
        ap.error(f"--article must be between 0 and {len(articles) - 1}, got {args.article}")
    model, tok = start_run(args)
    text = articles[args.article][1]
    ids = torch.tensor([tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"][: args.tokens - 1])
    states = layer_states(model, ids)
    rows = []
    print(f"{'side':<5}{'bits':>5}{'group':>7}{'plain':>10}{'rotated':>10}{'change':>9}")
    for side, bits, group in CASES:
        plain = relative_mse(states, side, bits, group, False)
        rotated = relative_mse(states, side, bits, group, True)
        rows.append({"side": side, "bits": bits, "group": group, "plain": plain, "rotated": rotated})
        print(f"{side:<5}{bits:>5}{group or 'head':>7}{plain:>10.4f}{rotated:>10.4f}{rotated / plain - 1:>+9.0%}")
    payload = {"args": vars(args), "tokens": int(ids.numel()), "results": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
