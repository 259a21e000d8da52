"""Prompt-lookup decoding through a LeanCache, against DynamicCache, in one process.

    python bench/prompt_lookup.py --kv FP16 --kv K8V4 --context 400 --new 96
    python bench/prompt_lookup.py --json results/assisted/prompt_lookup.json

Prompt-lookup decoding drafts the next tokens from n-grams of the prompt, verifies the draft in
one step and rolls back what the model rejected (``LeanCache.crop``). The prompt here is a
passage of the shipped Wikipedia text (or ``--text FILE``) followed by an instruction to copy it
and its first words, so the model has something to copy; how much it does depends on the model.

Every cache generates ``--new`` greedy tokens from the same prompt, plainly and with
``prompt_lookup_num_tokens=--draft``; the runs alternate in a rotating order for ``--repeats``
rounds after one warm-up round. Printed per cache and mode: the median time as a ratio of
DynamicCache's plain run, the forward steps taken (prefill included) and new tokens per step, and
whether the tokens equal DynamicCache's (``FP16`` must: prompt lookup is exact for greedy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import leankit
from leankit.bench.malloc import pin_glibc_malloc
from leankit.bench.readme import cpu_model, reproducible_args
from leankit.bench.text import corpus_ids
from leankit.hf import cache_kwargs


def copy_prompt(tok, ids: torch.Tensor, context: int, offset: int) -> torch.Tensor:
    """``[1, S]`` ids: ``context`` corpus tokens from ``offset``, an instruction to copy them, and
    their first 20 tokens (the copy's start)."""
    passage = ids[offset: offset + context]
    if passage.numel() < context:
        raise ValueError(f"the text holds {ids.numel()} tokens, fewer than offset {offset} + context {context}")
    text = tok.decode(passage) + "\n\nCopy the passage above word for word:\n" + tok.decode(passage[:20])
    return tok([text], return_tensors="pt").input_ids


def measure(model, ids: torch.Tensor, configs: list[str], new: int, draft: int, repeats: int,
            pad_token_id: int | None = None) -> list[dict]:
    """Time greedy ``generate`` of ``new`` tokens from ``ids`` ``[1, S]`` for DynamicCache and each
    config, plain and with prompt lookup of ``draft`` tokens, alternating over ``repeats`` rounds
    after one warm-up round. One dict per cache and mode: ``ratio`` (median time over
    DynamicCache's plain median), forward ``steps``, ``tokens_per_step`` and whether the tokens
    equal DynamicCache's plain ones."""
    makers = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for name in configs:
        makers[name] = lambda spec=leankit.presets.resolve(name): leankit.LeanCache(model, spec)
    runs = [(name, d) for name in makers for d in (0, draft)]
    forwards = {"n": 0}
    counter = model.get_decoder().register_forward_pre_hook(lambda *_: forwards.__setitem__("n", forwards["n"] + 1))
    times = {run: [] for run in runs}
    tokens, steps = {}, {}
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": pad_token_id}
    try:
        for round_ in range(repeats + 1):
            for run in runs[round_ % len(runs):] + runs[: round_ % len(runs)]:
                name, d = run
                extra = {"prompt_lookup_num_tokens": d} if d else {}
                forwards["n"] = 0
                start = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(input_ids=ids, **kw, **extra, **cache_kwargs(model, makers[name]()))
                if round_:  # the first round warms up
                    times[run].append(time.perf_counter() - start)
                tokens[run], steps[run] = out[0, ids.shape[1]:], forwards["n"]
    finally:
        counter.remove()
    base = statistics.median(times[("DynamicCache", 0)])
    reference = tokens[("DynamicCache", 0)]
    return [{"cache": name, "prompt_lookup": d, "ratio": statistics.median(times[(name, d)]) / base,
             "steps": steps[(name, d)], "tokens_per_step": new / steps[(name, d)],
             "tokens_equal_dynamic": bool(torch.equal(tokens[(name, d)], reference)), "times_s": times[(name, d)]}
            for name, d in runs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", help="LeanCache config (repeat; default: FP16 and K8V4)")
    ap.add_argument("--context", type=int, default=400, help="passage tokens (default: 400)")
    ap.add_argument("--offset", type=int, default=2000, help="where the passage starts in the text (default: 2000)")
    ap.add_argument("--new", type=int, default=96, help="tokens to generate (default: 96)")
    ap.add_argument("--draft", type=int, default=8, help="prompt_lookup_num_tokens (default: 8)")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds (default: 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--model", default="smollm2-135m", help="embedded model name or checkpoint directory")
    ap.add_argument("--text", help="a UTF-8 text file instead of the shipped Wikipedia articles")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pin_glibc_malloc()
    model, tok = leankit.load_model(args.model)
    ids = copy_prompt(tok, corpus_ids(tok, args.text), args.context, args.offset)
    rows = measure(model, ids, args.kv or ["FP16", "K8V4"], args.new, args.draft, args.repeats, tok.pad_token_id)
    print(f"{args.model}, {ids.shape[1]}-token prompt, {args.new} new tokens, draft {args.draft}, "
          f"{args.threads} thread(s), {cpu_model()}")
    print("| cache | decoding | time vs DynamicCache plain | forward steps | new tokens per step "
          "| tokens equal DynamicCache's |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        mode = f"lookup {row['prompt_lookup']}" if row["prompt_lookup"] else "plain"
        print(f"| {row['cache']} | {mode} | {row['ratio']:.2f}x | {row['steps']} | {row['tokens_per_step']:.2f} | "
              f"{'yes' if row['tokens_equal_dynamic'] else 'no'} |")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        # the command without its output path, as leankit bench records it (no local path)
        command = ["python", "bench/prompt_lookup.py", *reproducible_args(sys.argv[1:] if argv is None else argv)]
        path.write_text(json.dumps({"command": command, "model": args.model, "prompt_tokens": ids.shape[1],
                                    "new": args.new, "draft": args.draft, "threads": args.threads,
                                    "torch": torch.__version__, "cpu": cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
