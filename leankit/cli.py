"""The ``leankit`` command line.

    leankit generate --model smollm2-135m --kv K8V4 --prompt "..." [--max-new-tokens N] [--chat]
    leankit plan --model opt-30b --hardware rtx4090-pcie4 --batch 128 --prompt 512 --gen 128
    leankit lm-eval --tasks leankit_niah_single --model_args kv=K8V4-K4V2,th=0.3,tl=0 --limit 10
"""

from __future__ import annotations

import argparse
import sys


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def memory_line(report: dict) -> str:
    """One human line summarizing :meth:`LeanCache.memory_report`."""
    return (f"[leankit] KV {report['config']}: peak {_fmt_bytes(report['peak_kv_bytes'])} of pages "
            f"({report['page_size']} B each), {report['peak_ratio']:.3f}x an fp16 cache of the same tokens; "
            f"now {report['pages_used']} pages in use")


def cmd_generate(args) -> int:
    """Generate text with a LeanCache and print it plus one memory line."""
    import torch

    import leankit

    cfg = leankit.KVConfig.parse(args.kv, **({"window": args.window} if args.window is not None else {}))
    model, tok = leankit.load_model(args.model)
    prompts = args.prompt or ["The three most important ideas in computer science are"]
    if args.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=not args.chat)
    cache = leankit.LeanCache(model, cfg, eos_token_id=model.generation_config.eos_token_id)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, past_key_values=cache, pad_token_id=tok.pad_token_id)
    if args.sample:
        torch.manual_seed(args.seed)
        gen_kwargs.update(do_sample=True, temperature=args.temperature, top_p=0.95)
    else:
        gen_kwargs.update(do_sample=False)
    with torch.no_grad():
        out = model.generate(**enc, **gen_kwargs)
    report = cache.memory_report()  # rows that hit EOS have already returned their pages
    for row in out[:, enc.input_ids.shape[1]:]:
        print(tok.decode(row, skip_special_tokens=True).strip())
        print("---" if len(prompts) > 1 else "", end="\n" if len(prompts) > 1 else "")
    print(memory_line(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``leankit`` command."""
    p = argparse.ArgumentParser(prog="leankit", description="KV cache compression for Hugging Face transformers")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text through a LeanCache and report its memory")
    g.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint directory")
    g.add_argument("--kv", default="K8V4", help="KV config, e.g. FP16, K8V4, K4V2, K8V4-K4V2, or with overrides "
                   "'K8V4-K4V2:th=0.2,tl=0,group_size=32'")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--window", type=int, default=None, help="recent window W (compressed configs)")
    g.set_defaults(func=cmd_generate)
    try:
        from .planner.cli import add_plan_parser, run_plan
    except ImportError:  # the planner is optional at import time
        pass
    else:
        add_plan_parser(sub)
        sub.choices["plan"].set_defaults(func=run_plan)
    # Listed for --help only: main() hands `lm-eval` and everything after it to lm-eval's own parser.
    sub.add_parser("lm-eval", add_help=False, help="run lm-eval (all its options) with the model 'leankit' and "
                   "leankit's offline tasks; see `leankit lm-eval run --help`")
    return p


def main(argv=None) -> int:
    """Entry point of the ``leankit`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:
        from .eval.cli import main as lm_eval_main

        return lm_eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ModuleNotFoundError) as e:
        print(f"leankit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
