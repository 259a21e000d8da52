"""``leankit plan``: print the best offload plan for a model, a machine and a workload.

Wired into the main CLI with :func:`add_plan_parser` and :func:`run_plan`; also runnable alone as
``python -m leankit.planner.cli plan --model opt-30b --hardware rtx4090-pcie4 --batch 128 --prompt 512 --gen 128``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .hardware import MAX_MEMORY, GiB, get_hardware, hardware_names
from .model_spec import DEFAULT_MODEL, get_model, model_names

EPILOG = """examples:
  leankit plan --model opt-30b --hardware rtx4090-pcie4 --batch 128 --prompt 512 --gen 128
  leankit plan --model llama-3-8b --hardware l40 --kv FP16,K8V4,K4V2 --timeline plan.png
  leankit plan --hardware detect --save-profile profile.json      (profile this machine, SmolLM2-135M)
"""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def kv_list(text: str) -> list[str | None]:
    """Parse ``--kv``: comma-separated cache formats, each a KV config that may carry its own
    overrides, ``"fp16,K8V4:group_size=32,K8V4-K4V2:th=0.2,tl=0"``.

    A comma starts a new format unless the next item is a ``key=value`` override of the format
    before it. The tier part is upper-cased (``k8v4`` = ``K8V4``), the overrides are kept as given;
    ``fp16``/``none``/``plain`` is the plain lossless cache (``None``). Each format is validated
    with :meth:`KVConfig.parse`, so a bad one raises ``ValueError`` naming it.
    """
    from leankit.config import KVConfig

    specs: list[str] = []
    for item in _csv(text):
        if "=" in item and ":" not in item and specs and specs[-1] is not None:
            # an override of the format before it: after its colon, or the format's first one
            specs[-1] += ("," if ":" in specs[-1] else ":") + item
        elif "=" in item and ":" not in item:
            raise ValueError(f"--kv: override {item!r} does not follow a KV config (write e.g. 'K8V4:{item}')")
        else:
            head, colon, rest = item.partition(":")
            specs.append(None if head.lower() in ("fp16", "none", "plain") and not colon else
                         head.strip().upper() + colon + rest)
    for spec in specs:
        if spec is not None:
            KVConfig.parse(spec)
    return specs


def _checked(kind, ok, rule: str):
    """An argparse type: convert with ``kind`` (int or float), then require ``ok(value)``."""
    noun = "an integer" if kind is int else "a number"

    def convert(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return v

    return convert


_non_negative = _checked(float, lambda v: 0 <= v < float("inf"), "must be a finite number >= 0")
_positive_int = _checked(int, lambda v: v >= 1, "must be >= 1")
_memory_gib = _checked(float, lambda v: 0 <= v <= MAX_MEMORY / GiB,
                       "is GiB of memory: must be >= 0 and at most 2**30 (1 EiB)")
_fraction = _checked(float, lambda v: 0.0 <= v <= 1.0, "is a share of tokens and must lie in [0, 1]")


def _weight_bits(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated weight bit widths among 16, 8, 4."""
    items = _csv(text)
    if not items:
        raise argparse.ArgumentTypeError(f"needs at least one bit width among 16, 8, 4, got {text!r}")
    out = []
    for item in items:
        try:
            b = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a bit width (use 16, 8 or 4)") from None
        if b not in (16, 8, 4):
            raise argparse.ArgumentTypeError(f"bit width {b} is not among 16, 8, 4")
        out.append(b)
    return tuple(dict.fromkeys(out))


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse ``subparsers`` object and return its parser."""
    p = subparsers.add_parser(
        "plan",
        help="predict the fastest offload plan (KV quantization, activation cache, KVPR, CPU attention, weights)",
        description="Search leankit's compression and offloading mechanisms with the papers' performance models "
                    "and print the plan with the highest predicted throughput.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset ({', '.join(model_names())}) or a local HF checkpoint directory "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--hardware", default="detect",
                   help=f"preset ({', '.join(hardware_names())}), 'detect' to profile this machine, or a saved "
                        "profile .json (default detect)")
    p.add_argument("--batch", type=_positive_int, default=32, help="requests in the batch (default 32)")
    p.add_argument("--prompt", type=_positive_int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--gen", type=_positive_int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--kv", default="fp16",
                   help="comma-separated cache formats to consider: 'fp16' (plain lossless cache) and/or leankit "
                        "configs such as K8V4, K4V4, K8V4-K4V2, each with its own overrides "
                        "('fp16,K8V4:group_size=32,K8V4-K4V2:th=0.2,tl=0'; default: fp16 only)")
    p.add_argument("--high-fraction", type=_fraction, default=1.0,
                   help="share of tokens in the high tier of two-tier configs (default 1.0, an upper bound)")
    p.add_argument("--weight-bits", type=_weight_bits, default=(16,),
                   help="comma-separated bits for streamed weights among 16, 8, 4, e.g. 16,4")
    p.add_argument("--no-act", action="store_true", help="do not consider the KV-activation hybrid cache")
    p.add_argument("--no-kvpr", action="store_true", help="do not consider KVPR partial recomputation")
    p.add_argument("--no-attn-offload", action="store_true", help="do not consider CPU attention")
    p.add_argument("--no-weight-placement", action="store_true",
                   help="stream every layer's weights instead of searching how many stay on the GPU")
    p.add_argument("--gpu-mem", type=_memory_gib, default=None,
                   help="GPU memory limit in GiB, 0 included (default: the profile's)")
    p.add_argument("--host-mem", type=_memory_gib, default=None,
                   help="host memory limit in GiB, 0 included (default: the profile's)")
    p.add_argument("--timeline", metavar="PATH", default=None,
                   help="draw PCIe against compute per layer for the plan and the KV-only baseline to PATH (png)")
    p.add_argument("--save-profile", metavar="PATH", default=None,
                   help="with --hardware detect: save the measured profile as JSON")
    p.add_argument("--measure-threads", action="store_true",
                   help="run LM-Offload Algorithm 3 on this CPU from profiled per-op times and time PyTorch's default "
                        "thread setting against it (each in a fresh process)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of tables")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args) -> int:
    """Run ``leankit plan`` for parsed ``args``; returns the process exit code (0 ok, 2 bad input,
    1 no feasible plan)."""
    from .planner import Allowed, Limits, Workload, format_plan, plan

    try:
        model = get_model(args.model)
        kvs = kv_list(args.kv)
        wbits = args.weight_bits if isinstance(args.weight_bits, tuple) else _weight_bits(args.weight_bits)
        allowed = Allowed(kv_configs=tuple(dict.fromkeys(kvs)) or (None,), activation_cache=not args.no_act,
                          kvpr=not args.no_kvpr, attention_offload=not args.no_attn_offload, weight_bits=wbits,
                          weight_placement=not args.no_weight_placement, high_fraction=args.high_fraction)
        limits = Limits(gpu_mem=None if args.gpu_mem is None else args.gpu_mem * GiB,
                        host_mem=None if args.host_mem is None else args.host_mem * GiB)
        wl = Workload(args.batch, args.prompt, args.gen)
        if args.timeline and Path(args.timeline).suffix.lower() not in ("", ".png"):
            raise ValueError(f"--timeline draws a PNG: give a path ending in .png, got {args.timeline}")
        if args.save_profile is not None and str(args.hardware).lower() != "detect":
            raise ValueError("--save-profile saves what --hardware detect measures; a named profile is "
                             "already a file (drop --save-profile, or profile with --hardware detect)")
        if str(args.hardware).lower() == "detect":
            print("profiling this machine (a few seconds)...", file=sys.stderr)
        hw = get_hardware(args.hardware, model=model, save_path=args.save_profile)
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"leankit plan: error: {e}", file=sys.stderr)
        return 2
    p = plan(model, hw, wl, allowed, limits)
    if args.json:
        print(json.dumps(_summary(p), indent=2))
    else:
        if str(args.hardware).lower() == "detect":
            print(hw.summary())
            print()
        print(format_plan(p))
    if args.measure_threads:
        from .lm_offload import tune_threads_here

        r = tune_threads_here()
        st = r["algorithm3"]
        print(f"\nthread control on this machine ({r['threads']} hardware threads):")
        print("  Algorithm 3: " + (f"{st.intra_op_compute} intra-op x {st.inter_op_compute} inter-op for attention, "
                                   f"inter-op {st.inter_op} in all" if st else
                                   "no candidate (needs at least 6 threads); timing each intra-op count instead"))
        for m in r["measurements"]:
            tag = "PyTorch default" if m["requested"] == [0, 0] else f"intra {m['intra']}, inter {m['inter']}"
            print(f"  {tag:<22} {m['seconds'] * 1e3:8.2f} ms per attention step")
        d = r["measurements"][0]["seconds"]
        b = r["best"]
        print(f"  best: intra {b['intra']}, inter {b['inter']} ({d / b['seconds']:.2f}x vs the default); apply it with "
              "torch.set_num_threads / torch.set_num_interop_threads (leankit.planner.lm_offload.apply_threads)")
    if args.timeline and p.feasible:
        from .timeline import draw_timeline

        try:
            out = draw_timeline(p, args.timeline)
        except RuntimeError as e:
            print(f"leankit plan: {e}", file=sys.stderr)
            return 2
        print(f"\ntimeline written to {out}")
    return 0 if p.feasible else 1


def _summary(p) -> dict:
    d = {
        "model": p.model.name, "hardware": p.hardware.name, "feasible": p.feasible,
        "plan": p.choice.label() if p.feasible else None, "mode": p.choice.mode, "kv": p.choice.kv,
        "gpu_layers": p.choice.gpu_layers, "weight_bits": p.choice.weight_bits,
        "throughput_tok_s": p.throughput, "decode_throughput_tok_s": p.decode_throughput,
        "prefill_s": p.prefill_time, "decode_s": p.decode_time, "reasons": p.reasons,
        "infeasible_reason": p.infeasible_reason,
        "layers": [{"index": lc.index, "resident": lc.resident, "time_ms": lc.time * 1e3, "link_ms": lc.link * 1e3,
                    "gpu_ms": lc.gpu * 1e3, "bottleneck": lc.bottleneck} for lc in p.layers],
    }
    if p.baseline is not None:
        d["baseline_throughput_tok_s"] = p.baseline.throughput
        d["speedup"] = p.speedup
    return d


def main(argv=None) -> int:
    """Entry point for ``python -m leankit.planner.cli plan ...``."""
    parser = argparse.ArgumentParser(prog="leankit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
