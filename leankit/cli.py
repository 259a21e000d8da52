"""The ``leankit`` command line.

    leankit --version
    leankit generate --model smollm2-135m --kv K8V4 --prompt "..." [--max-new-tokens N] [--chat]
                     [--temperature T] [--top-p P] [--stream] [--plan auto --hardware NAME]
    leankit plan --model opt-30b --hardware rtx4090-pcie4 --batch 128 --prompt 512 --gen 128
    leankit bench step|throughput|offload|plot [options]     (see `leankit bench --help`)
    leankit lm-eval --tasks leankit_niah_single --model_args kv=K8V4-K4V2,th=0.3,tl=0 --limit 10
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from importlib import metadata


def memory_line(report: dict) -> str:
    """One human line summarizing :meth:`LeanCache.memory_report`."""
    from leankit.pages import format_bytes

    head = f"[leankit] KV {report['config']}: "
    if not report["compressed_layers"]:  # every layer slides: no page, and peak_ratio is NaN (0 / 0)
        return head + (f"no layer compressed (all {report['model_layers']} are sliding-window layers, kept in "
                       f"transformers' own cache: {format_bytes(report['plain_bytes'])})")
    ratio = report["peak_ratio"]
    vs = "" if math.isnan(ratio) else f", {ratio:.3f}x an fp16 cache of the same tokens"
    return (head + f"peak {format_bytes(report['peak_kv_bytes'])} of pages ({report['page_size']} B each){vs}; "
            f"now {report['pages_used']} pages in use")


DEFAULT_PROMPT = "The three most important ideas in computer science are"


def version_string() -> str:
    """``leankit X (torch Y, transformers Z)``, read from package metadata (nothing is imported)."""
    from leankit import __version__

    def ver(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"leankit {__version__} (torch {ver('torch')}, transformers {ver('transformers')})"


def check_generate_args(args) -> None:
    """Reject bad ``generate`` input before any model is loaded (``ValueError`` naming the flag)."""
    for i, p in enumerate(args.prompt or []):
        if not p.strip():
            which = f"--prompt #{i + 1}" if len(args.prompt) > 1 else "--prompt"
            raise ValueError(f"{which} is empty: give the text to continue, e.g. --prompt \"{DEFAULT_PROMPT}\"")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature is not None and not 0 < args.temperature < float("inf"):
        raise ValueError(f"--temperature must be a finite number > 0 (omit it for greedy decoding), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.stream and len(args.prompt or [None]) > 1:
        raise ValueError("--stream prints one sequence as it is generated: give a single --prompt")
    if args.plan is not None and args.plan.strip().lower() != "auto":
        raise ValueError(f"--plan takes 'auto' (plan the cache for this model, batch and --hardware), got {args.plan!r}")
    if args.plan is None:
        for flag, value in (("--hardware", args.hardware), ("--gpu-mem", args.gpu_mem), ("--host-mem", args.host_mem)):
            if value is not None:
                raise ValueError(f"{flag} only applies with --plan auto (e.g. --plan auto --hardware rtx4090)")
    for flag, value in (("--gpu-mem", args.gpu_mem), ("--host-mem", args.host_mem)):
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"{flag} is a memory size in GiB and must be >= 0, got {value}")


def sampling_kwargs(args) -> dict:
    """``generate`` keyword arguments for the decoding flags: greedy unless ``--sample``,
    ``--temperature`` or ``--top-p`` asks for sampling (then temperature 0.7, top-p 0.95 by default)."""
    if not (args.sample or args.temperature is not None or args.top_p is not None):
        return {"do_sample": False}
    return {"do_sample": True, "temperature": 0.7 if args.temperature is None else args.temperature,
            "top_p": 0.95 if args.top_p is None else args.top_p}


def make_streamer(tok, args, total: int):
    """The streamer ``generate`` reports to: the text itself with ``--stream``, else a token progress
    bar on stderr (shown only on a terminal, unless ``--no-progress``)."""
    from transformers import TextStreamer
    from transformers.generation.streamers import BaseStreamer

    if args.stream:
        return TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)

    from tqdm.auto import tqdm

    class ProgressStreamer(BaseStreamer):
        """Advance a tqdm bar by one per decoding step (the first ``put`` is the prompt)."""

        def __init__(self):
            self.bar = tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, leave=False,
                            disable=True if args.no_progress else None)
            self.prompt_seen, self.steps = False, 0

        def put(self, value):
            if self.prompt_seen:
                self.steps += 1
                self.bar.update(1)
            self.prompt_seen = True

        def end(self):
            self.bar.close()

    return ProgressStreamer()


def _warn_past_positions(model, prompt_tokens: int, new_tokens: int) -> None:
    """Say so when a generation may run past the positions the model was built for (its text
    config's ``max_position_embeddings``): EOS usually stops it sooner, so it is not refused, but
    tokens past the limit are the model extrapolating (OPT's learned position table ends there)."""
    from .cache import position_limit

    limit = position_limit(model)
    fed = prompt_tokens + new_tokens - 1  # generate feeds every token but the last one it makes
    if limit and fed > limit:
        print(f"[leankit] warning: the prompt ({prompt_tokens} tokens) and --max-new-tokens {new_tokens} may feed "
              f"the model {fed} positions, beyond the {limit} this model takes "
              "(max_position_embeddings): what it generates past them is extrapolation", file=sys.stderr)


def cmd_generate(args) -> int:
    """Generate text with a LeanCache and print it plus one memory line."""
    import torch

    import leankit

    check_generate_args(args)
    cfg = leankit.KVConfig.parse(args.kv, **({"window": args.window} if args.window is not None else {}))
    hardware = None
    if args.plan is not None:  # resolve the machine before the model loads: a bad name fails fast
        from .planner import get_hardware
        from .planner.cli import kv_list

        kv_list(args.kv)
        if args.window is not None:
            raise ValueError("--window does not apply with --plan auto (the plan picks the format); put it in "
                             "--kv, e.g. --kv 'K8V4-K4V2:window=32'")
        hardware = get_hardware(args.hardware or "detect")
    from .hf import cache_kwargs

    model, tok = leankit.load_model(args.model)
    prompts = args.prompt or [DEFAULT_PROMPT]
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"--chat: {args.model} has no chat template (a base model, not an instruct one); "
                             "drop --chat to continue the prompt as plain text")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                   for p in prompts]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=not args.chat)
    if enc.input_ids.shape[1] == 0:
        raise ValueError("the prompt gives no tokens: give some text with --prompt")
    _warn_past_positions(model, enc.input_ids.shape[1], args.max_new_tokens)
    eos = model.generation_config.eos_token_id
    if hardware is not None:
        cache = planned_cache(model, hardware, enc.attention_mask.sum(1).tolist(), args, eos, tok.pad_token_id)
    else:
        cache = leankit.LeanCache(model, cfg, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, **cache_kwargs(model, cache), pad_token_id=tok.pad_token_id,
                      streamer=make_streamer(tok, args, args.max_new_tokens), **sampling_kwargs(args))
    if gen_kwargs["do_sample"]:
        torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(**enc, **gen_kwargs)
    report = cache.memory_report()  # rows that hit EOS have already returned their pages
    if not args.stream:
        for row in out[:, enc.input_ids.shape[1]:]:
            print(tok.decode(row, skip_special_tokens=True).strip())
            print("---" if len(prompts) > 1 else "", end="\n" if len(prompts) > 1 else "")
    print(memory_line(report))
    if "offload" in report:
        print(offload_line(report["offload"]))
    return 0


def planned_cache(model, hardware, prompts: list[int], args, eos, pad=None):
    """``--plan auto``: plan for this model, batch and machine, print the plan, build its cache."""
    import leankit
    from leankit.offload import plan_for_model
    from leankit.planner import Limits
    from leankit.planner.cli import kv_list
    from leankit.planner.hardware import GiB

    limits = Limits(gpu_mem=None if args.gpu_mem is None else args.gpu_mem * GiB,
                    host_mem=None if args.host_mem is None else args.host_mem * GiB)
    kvs = tuple(dict.fromkeys([None, *kv_list(args.kv)]))
    plan = plan_for_model(model, hardware, len(prompts), tuple(prompts), args.max_new_tokens, kv_configs=kvs,
                          limits=limits)
    if not plan.feasible:
        raise ValueError(f"--plan auto on {hardware.name}: {plan.infeasible_reason}")
    cache = leankit.LeanCache.from_plan(model, plan, eos_token_id=eos, pad_token_id=pad)
    where = "pages on the host, the layers in flight on the device" if cache.offload else "every page on the device"
    from .planner.planner import plan_label

    print(f"[leankit] plan for {hardware.name}: {plan_label(plan)}, predicted {plan.throughput:.1f} tok/s "
          f"-> LeanCache {cache.cfg}{':act=' + format(cache.cfg.act, 'g') if cache.cfg.act else ''}, {where}",
          file=sys.stderr)
    return cache


def offload_line(off: dict) -> str:
    """One human line summarizing ``memory_report()["offload"]``."""
    from leankit.pages import format_bytes

    return (f"[leankit] offload: {format_bytes(off['host_bytes'])} of pages on the host, device working set peak "
            f"{off['device_pages_peak']} pages ({format_bytes(off['device_bytes_peak'])}); moved "
            f"{format_bytes(off['h2d_bytes_total'])} host->device and {format_bytes(off['d2h_bytes_total'])} "
            f"device->host in {off['steps']} steps")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``leankit`` command."""
    p = argparse.ArgumentParser(prog="leankit", description="KV cache compression for Hugging Face transformers")
    p.add_argument("--version", action="version", version=version_string())
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text through a LeanCache and report its memory")
    g.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint directory")
    g.add_argument("--kv", default="K8V4", help="KV config, e.g. FP16, K8V4, K4V2, K8V4-K4V2, or with overrides "
                   "'K8V4-K4V2:th=0.2,tl=0,group_size=32'")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature > 0 (implies --sample; default 0.7 when sampling)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling mass in (0, 1] (implies --sample; default 0.95 when sampling)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument("--window", type=int, default=None, help="recent window W (compressed configs)")
    g.add_argument("--plan", default=None, metavar="auto",
                   help="'auto': let leankit's planner pick the cache format, ACT share and host/device placement "
                        "for this model, batch and --hardware (--kv lists the formats it may pick besides fp16)")
    g.add_argument("--hardware", default=None,
                   help="with --plan auto: a hardware preset (rtx4090-pcie4, a100-40gb-pcie4, ..., see `leankit plan "
                        "--help`), 'detect' (default) or a saved profile .json")
    g.add_argument("--gpu-mem", type=float, default=None, help="with --plan auto: GPU memory limit in GiB")
    g.add_argument("--host-mem", type=float, default=None, help="with --plan auto: host memory limit in GiB")
    g.set_defaults(func=cmd_generate)
    try:
        from .planner.cli import add_plan_parser, run_plan
    except ImportError:  # the planner is optional at import time
        pass
    else:
        add_plan_parser(sub)
        sub.choices["plan"].set_defaults(func=run_plan)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
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
    args.argv = argv[1:] if argv[:1] == ["bench"] else argv  # the exact command, for tables that record it
    with _quiet_loading(getattr(args, "no_progress", False)):
        try:
            return args.func(args)
        except (ValueError, ModuleNotFoundError) as e:
            print(f"leankit: error: {e}", file=sys.stderr)
            return 2


@contextlib.contextmanager
def _quiet_loading(quiet: bool):
    """With ``--no-progress``, transformers' own bars (the "Loading weights" one) stay off too."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
