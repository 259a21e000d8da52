"""Needle in a haystack: per-head dynamic allocation vs a static uniform budget at equal memory.

A RULER-style needle ("The special magic number for <key> is <7 digits>.") is inserted at a
given depth of a haystack of Paul Graham essays; the chat prompt then asks for the number and
the assistant turn starts with "The special magic number for <key> is". Each sample is run:

1. through a **dynamic** LeanKV config (per-head allocation from attention significance);
2. through a **static** config with the same budget for every head (H2O heavy hitters + recent
   window, or StreamingLLM), at the precision of the dynamic config's high tier, with its
   budget set per sample so that its ``kv_bytes`` after the prompt match the dynamic run's;
3. optionally uncompressed (``--fp16``), for reference.

The answer is scored by teacher forcing through the compressed cache (one decode step per
answer token, so the generation-phase compression runs too): ``hit`` means every answer token
is the model's greedy choice (what greedy decoding would produce), and ``logp`` is the answer's
total log-probability.

Example::

    python -m eval.needle --context 1500 --depths 0.1 0.3 0.5 0.7 0.9 \\
        --dynamic "K8V4:policy=leankv,tl=0.2" --out out/needle.json
"""

from __future__ import annotations

import argparse
import math
import os
import random

import torch

from leankit.cache import LeanCache, attention_head_dim
from leankit.config import KVConfig
from leankit.data import paul_graham_essays
from leankit.hf import cache_kwargs, output_cache

from .common import (
    Timer,
    add_run_options,
    check_configs_fit,
    check_run_options,
    label,
    parse_config,
    start_run,
    write_json,
)

KEYS = ["apple", "river", "falcon", "copper", "violet", "harbor", "meadow", "lantern", "glacier", "orchid"]


def make_sample(tok, hay_ids: list[int], context: int, depth: float, rng: random.Random):
    """``(prompt ids, answer ids, value)`` for one needle at ``depth`` (0 = start, 1 = end)."""
    key = rng.choice(KEYS)
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = f" The special magic number for {key} is {value}. "
    text = tok.decode(hay_ids[:context])
    cut = text.find(". ", int(len(text) * depth))
    cut = len(text) if cut < 0 else cut + 2
    doc = text[:cut] + needle + text[cut:]
    question = f"What is the special magic number for {key} mentioned in the text above?"
    msgs = [{"role": "user", "content": doc + "\n\n" + question}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt += f"The special magic number for {key} is"
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tok(" " + value + ".", add_special_tokens=False)["input_ids"]
    return torch.tensor(p_ids), torch.tensor(a_ids), value


@torch.no_grad()
def run(model, prompt: torch.Tensor, answer: torch.Tensor, spec: str | None, kw: dict,
        positions: list[int] | None = None):
    """Teacher-forced answer through a cache (``spec=None``: HF's uncompressed DynamicCache).

    With ``positions`` (the needle's prompt positions) the result also holds ``heads_with_needle``:
    how many (layer, KV head) pairs still store every needle token after the prompt phase.
    """
    n = prompt.numel()
    cache = None if spec is None else LeanCache(model, spec, max_seq_len=n + answer.numel() + 8, **kw)
    x = prompt.view(1, -1)
    out = model(input_ids=x, position_ids=torch.arange(n).view(1, -1), **cache_kwargs(model, cache),
                use_cache=True, logits_to_keep=1)
    report = cache.memory_report() if cache is not None else None
    survival = None
    if cache is not None and positions:
        survival = int((needle_survival(cache, positions) == len(positions)).sum())
    past = output_cache(out) if cache is None else cache
    logp, hit = 0.0, True
    for i, tok_id in enumerate(answer.tolist()):
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        logp += float(lp[tok_id])
        hit &= int(lp.argmax()) == tok_id
        out = model(input_ids=torch.tensor([[tok_id]]), position_ids=torch.tensor([[n + i]]),
                    **cache_kwargs(model, past), use_cache=True)
    return {"hit": bool(hit), "logp": logp, "prompt_report": report, "heads_with_needle": survival,
            "final_report": cache.memory_report() if cache is not None else None}


def needle_positions(tok, prompt: torch.Tensor, value: str) -> list[int]:
    """Prompt positions of the needle's value tokens (its first occurrence, inside the haystack)."""
    ids, val = prompt.tolist(), tok(" " + value, add_special_tokens=False)["input_ids"]
    for i in range(len(ids) - len(val) + 1):
        if ids[i: i + len(val)] == val:
            return list(range(i, i + len(val)))
    raise ValueError(f"needle value {value!r} not found in the prompt tokens")


def needle_survival(cache: LeanCache, positions: list[int]) -> torch.Tensor:
    """``[layers, kv_heads]`` count of needle tokens still stored (any tier) for sequence 0."""
    from leankit.policy import read_tier_meta

    want = torch.tensor(positions, dtype=torch.int32)
    kept = torch.zeros(cache.num_layers, cache.num_kv_heads, dtype=torch.long)
    layers = torch.arange(cache.num_layers)
    for tier in range(len(cache.layouts)):
        m = read_tier_meta(cache, tier, layers)  # pos/valid: [L, B, H, S]
        hit = torch.isin(m.pos[:, 0], want) & m.valid[:, 0]
        kept += hit.sum(-1)
    return kept


def full_pages(cfg: KVConfig, model, n_tokens: int) -> int:
    """Pages a single-tier cache at ``cfg``'s high precision needs to keep all ``n_tokens``."""
    c = model.config
    t = cfg.tokens_per_page(attention_head_dim(c), 0, torch.empty((), dtype=model.dtype).element_size())
    return c.num_hidden_layers * c.num_key_value_heads * math.ceil(n_tokens / t)


def static_config(cfg: KVConfig, static: str, budget: float, prompt_tokens: int) -> tuple[str, dict]:
    """``(spec, overrides)`` of the static baseline for dynamic config ``cfg`` at ``budget``.

    The static run stores its tokens exactly like the dynamic run's high tier: same precision,
    page size, quantization group and rotation, taken from the parsed config (a preset or the
    spec's own overrides set them as well as keyword overrides do), so the two differ only in
    which tokens each head keeps. Settings equal to the static spec's defaults are left out of
    the overrides, so the label names only what was carried over.
    """
    spec = str(cfg.high)
    if static == "h2o":
        kw = {"policy": "h2o", "budget": budget}
    else:
        keep = max(int(budget * prompt_tokens), cfg.sink + 1)
        kw = {"policy": "streaming", "window": keep - cfg.sink, "sink": cfg.sink}
    plain = KVConfig.parse(spec)
    kw.update({k: getattr(cfg, k) for k in ("page_size", "group_size", "rotate") if getattr(cfg, k) != getattr(plain, k)})
    return spec, kw


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dynamic", action="append", required=True,
                    help='dynamic LeanKV config, e.g. "K8V4:policy=leankv,tl=0.2" (repeatable)')
    ap.add_argument("--static", default="h2o", choices=("h2o", "streaming"),
                    help="static uniform-budget baseline matched to each dynamic run's memory")
    ap.add_argument("--context", type=int, default=1500, help="haystack tokens")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offset", type=int, default=0, help="haystack starts at this essay token")
    ap.add_argument("--fp16", action="store_true", help="also run uncompressed")
    ap.add_argument("--survival", action="store_true",
                    help="count the (layer, KV head) pairs that still store every needle token after the prompt")
    add_run_options(ap)
    args = ap.parse_args(argv)
    if args.context < 1:
        ap.error(f"--context must be at least 1 haystack token, got {args.context}")
    if args.offset < 0:
        ap.error(f"--offset must be at least 0, got {args.offset}")
    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        ap.error(f"--depths must lie in [0, 1] (0 = start of the haystack, 1 = end), got {bad}")
    check_run_options(ap, args)
    try:  # every config is checked before the model loads
        dynamic = [parse_config(d) for d in args.dynamic]
    except ValueError as err:
        ap.error(str(err))
    model, tok = start_run(args)
    hay = "\n\n".join(t for _, t in paul_graham_essays())
    hay_ids = tok(hay, add_special_tokens=False)["input_ids"]
    if args.offset + args.context > len(hay_ids):  # a shorter haystack would pass silently
        ap.error(f"--offset {args.offset} + --context {args.context} runs past the essays' {len(hay_ids)} tokens")
    hay_ids = hay_ids[args.offset:]
    check_configs_fit(ap, model, dynamic)
    rng = random.Random(args.seed)
    samples = [make_sample(tok, hay_ids, args.context, d, rng) for d in args.depths]
    needles = [needle_positions(tok, p, value) if args.survival else None for p, _, value in samples]
    rows = []
    for spec, kw in dynamic:
        cfg = KVConfig.parse(spec, **kw)
        per = []
        with Timer() as t:
            for (p, a, value), depth, pos in zip(samples, args.depths, needles, strict=True):
                d = run(model, p, a, spec, kw, pos)
                used = d["prompt_report"]["pages_used"]
                budget = min(1.0, used / full_pages(cfg, model, p.numel()))
                static_spec, skw = static_config(cfg, args.static, budget, p.numel())
                s = run(model, p, a, static_spec, skw, pos)
                row = {"depth": depth, "value": value, "prompt_tokens": int(p.numel()),
                       "dynamic": {"hit": d["hit"], "logp": d["logp"], "kv_bytes": d["prompt_report"]["kv_bytes"],
                                   "ratio": d["prompt_report"]["pages_ratio"],
                                   "tokens_per_tier": d["prompt_report"]["tokens_per_tier"],
                                   "heads_with_needle": d["heads_with_needle"]},
                       "static": {"config": label(static_spec, skw), "hit": s["hit"], "logp": s["logp"],
                                  "kv_bytes": s["prompt_report"]["kv_bytes"], "ratio": s["prompt_report"]["pages_ratio"],
                                  "heads_with_needle": s["heads_with_needle"]}}
                if args.fp16:
                    f = run(model, p, a, None, {})
                    row["fp16"] = {"hit": f["hit"], "logp": f["logp"]}
                per.append(row)
                print(f"  depth {depth:.2f}: dynamic hit={d['hit']} logp={d['logp']:.2f} "
                      f"(kv/fp16 {row['dynamic']['ratio']:.3f}) | static {row['static']['config']} hit={s['hit']} "
                      f"logp={s['logp']:.2f} (kv/fp16 {row['static']['ratio']:.3f})"
                      + (f" | fp16 hit={row['fp16']['hit']} logp={row['fp16']['logp']:.2f}" if args.fp16 else "")
                      + (f" | layer-heads keeping the whole needle: dynamic {d['heads_with_needle']}, static "
                         f"{s['heads_with_needle']}" if args.survival else ""),
                      flush=True)
        summary = {"dynamic": label(spec, kw), "static": args.static, "samples": per, "seconds": t.seconds}
        fields = {"dynamic": ("hit", "logp", "ratio"), "static": ("hit", "logp", "ratio")}
        if args.fp16:
            fields["fp16"] = ("hit", "logp")
        for side, keys in fields.items():  # means over the samples: dynamic_acc, static_logp, ...
            for key in keys:
                summary[f"{side}_{'acc' if key == 'hit' else key}"] = sum(r[side][key] for r in per) / len(per)
        rows.append(summary)
        write_json(args.out, {"args": vars(args), "results": rows, "partial": True})
        print(f"{summary['dynamic']}: dynamic acc {summary['dynamic_acc']:.2f} logp {summary['dynamic_logp']:.2f} "
              f"kv/fp16 {summary['dynamic_ratio']:.3f} | static {args.static} acc {summary['static_acc']:.2f} "
              f"logp {summary['static_logp']:.2f} kv/fp16 {summary['static_ratio']:.3f}  ({t.seconds:.0f}s)", flush=True)
    payload = {"args": vars(args), "results": rows,
               "cmd": "python -m eval.needle " + " ".join(os.sys.argv[1:] if argv is None else argv)}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
