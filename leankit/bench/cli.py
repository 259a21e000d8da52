"""``leankit bench step``, ``throughput``, ``offload`` and ``plot``: the argument parsers and the printing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..outputs import output_problem
from .malloc import pin_glibc_malloc
from .readme import replace_block
from .text import read_text, text_source
from .throughput import DEFAULT_KVS, MIXES, NEUTRAL

BENCH_HELP = """\
Speed of LeanCache against transformers' DynamicCache, measured side by side in one process
(compare ratios, not absolute times: they depend on the machine and its load).

modes:
  step        prefill and decode-step time ratios per KV config, with each LeanCache step
              broken down into attention, quantize/store, policy, allocation, step setup and
              the rest (the model); exclusive timers installed for the run only
  throughput  generated tokens/s at a fixed KV budget in bytes: the largest batch each cache
              fits, the same real-text requests through model.generate, ratios against
              DynamicCache (also HF QuantizedCache int4 when optimum-quanto or hqq is installed)
  offload     a plan's cache with its pages on the host against the same cache all on the
              device: step time ratio, bytes moved per step, the planner's predicted bytes,
              and on CUDA the transfer time hidden behind compute
  plot        figures of saved step/throughput results (--json files), no measuring

The measuring modes take --json FILE (everything measured) and --write-readme (the results
table between the <!-- leankit-bench:MODE --> markers of README.md, with the command, CPU,
threads, torch and date; the prefill-heavy throughput mix writes the block
throughput-prefill-heavy); step and throughput also take --plot PNG (a figure of the results;
needs matplotlib).
"""

STEP_HELP = f"""\
Prefill and decode-step time of LeanCache configs against DynamicCache.

For each --context, a batch of --batch real-text prompts (Wikipedia articles shipped with
leankit, or --text FILE; rows left-padded, each 3 tokens shorter than the one before) is
prefilled into a DynamicCache and, per --kv config, into a plain LeanCache and an instrumented
one (3 fresh prefills of each, in rotating order; the median counts). Then --steps decode steps
(after --warmup rounds, 2 by default) step every cache once per round, in an order that rotates each round,
so every cache sees the same machine state. Reported per config:

  prefill ratio   LeanCache prefill time / DynamicCache prefill time (medians of 3)
  decode ratio    median LeanCache step / median DynamicCache step
  breakdown       share of the instrumented LeanCache step (prefill and decode) spent in
                  attention (LeanCache.attend), quantize/store (the policy's store),
                  policy (begin_step, update_scores, after_store, end_step, apply_classes),
                  allocation (grow/shrink pages, free-list allocate/release), step setup
                  (LeanCache.begin_step/end_step) and the model (the rest). Times are
                  exclusive: a nested timed call counts once, in its own column.
  timers' cost    instrumented step vs the plain LeanCache's step (measured difference)

Allocator: a prefill of 8 x 1024 tokens allocates GBs of temporaries (MLP activations, the
prompt's logits). With glibc's default thresholds, whether they are reused or mapped afresh and
faulted in page by page changes from run to run (measured: 0.02 to 2.5 million faults, up to
1 s of a 10 s prefill), so the benchmarks raise glibc's mmap and trim thresholds for their run
(--default-malloc does not) and list each prefill's minor page faults.

Default configs: K8V4 and the recommended neutral config {NEUTRAL}.
"""

THROUGHPUT_HELP = f"""\
Generated tokens/s at a fixed KV budget, against DynamicCache.

Requests (--requests, default 3 x the largest batch any cache fits) are drawn from the shipped
Wikipedia text (or --text FILE) with --seed: prompt and output lengths uniform in their ranges.
  decode-heavy (default)  prompts {MIXES['decode-heavy'][0][0]}-{MIXES['decode-heavy'][0][1]} tokens, \
outputs {MIXES['decode-heavy'][1][0]}-{MIXES['decode-heavy'][1][1]} tokens
  prefill-heavy           prompts {MIXES['prefill-heavy'][0][0]}-{MIXES['prefill-heavy'][0][1]} tokens, \
outputs {MIXES['prefill-heavy'][1][0]}-{MIXES['prefill-heavy'][1][1]} tokens

The budget (--budget-bytes; default: the fp16 bytes of 8 rows of the mix's longest request,
8 x (max prompt + max output) x 2 x layers x kv_heads x head_dim x 2) fixes each cache's batch:
  DynamicCache          counted as fp16 bytes of the tokens it holds
  HF QuantizedCache     int4 (optimum-quanto, else hqq): codes, scales, offsets and residual, its
                        floating-point tensors at 2 bytes (fp16, as DynamicCache), peak of one row
                        of the longest request
  LeanCache             a real fixed pool of budget // page_size pages (PoolExhausted when out):
                        peak pages of one row of the longest request give the batch, then that
                        batch is verified to run and one row more to exhaust (--no-verify skips;
                        a batch above --requests is verified at --requests rows)
Each batch generates exactly its longest requested output (EOS ignored, the same for every
cache); only each request's own requested tokens count. Time: the generate calls, first
prefill to last token. The prefill share (time to each batch's first token) bounds the gain
of any cache on the mix: prefill work does not shrink with a bigger batch. Default LeanCache
configs: {', '.join(DEFAULT_KVS)}.
"""


OFFLOAD_HELP = """\
A plan's cache with its pages in host memory against the same cache with every page on the device.

leankit's planner plans for the model, --batch prompts of --context tokens (real text, left-padded)
and --hardware; the cache it picks (format, ACT share) is built twice: with the host tier and a
device working set of the layers in flight, and all on the device. Both are prefilled, then decode
steps run in rounds that alternate which cache goes first. Reported: median decode-step times and
their ratio, bytes moved host->device and device->host per step (counted where the copies are
issued), the planner's predicted bytes when the plan keeps cache on the host, and on CUDA the
overlap, the share of copy-stream time hidden behind compute. On the CPU there is no link to
overlap: the copies run synchronously between two pools in the same memory.
"""

PLOT_HELP = """\
Figures of saved results, without measuring again: for each --json file written by
`leankit bench step` or `leankit bench throughput`, one PNG named after it in --out
(needs matplotlib: pip install 'leankit-kv[bench]').

  throughput  tokens/s of every cache vs DynamicCache at the budget, with its batch, the ceiling
              run and the free-decode bound; each cache's wall time split into prefill and decode
  step        prefill and decode-step ratios per context and config; the shares of the
              LeanCache decode step (attention, quantize/store, policy, allocation, setup, model)
"""


def add_bench_parser(sub) -> None:
    """Add ``bench`` with its ``step`` and ``throughput`` modes to the ``leankit`` subparsers ``sub``."""
    raw = argparse.RawDescriptionHelpFormatter
    b = sub.add_parser("bench", help="speed against DynamicCache: step time breakdown, throughput at a KV budget",
                       description=BENCH_HELP, formatter_class=raw)
    modes = b.add_subparsers(dest="mode", required=True, metavar="{step,throughput,offload,plot}")

    def common(p):
        p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint directory")
        p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default; on a machine shared with other work, 1 "
                       "avoids threads waiting on busy cores)")
        p.add_argument("--json", metavar="FILE", help="write everything measured to FILE as JSON")
        p.add_argument("--write-readme", action="store_true",
                       help="replace the results block of this mode in --readme with the table")
        p.add_argument("--readme", default="README.md", help="the README --write-readme edits (default: %(default)s)")
        p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
        p.add_argument("--text", metavar="FILE", help="a UTF-8 text file to cut the prompts from (default: the "
                       "Wikipedia articles shipped with leankit); prompts longer than the text wrap around it")
        p.add_argument("--default-malloc", action="store_true",
                       help="leave glibc's malloc thresholds as they are (by default they are raised for the run, so "
                            "freed memory is reused instead of page-faulted in again; see leankit.bench.malloc)")

    s = modes.add_parser("step", allow_abbrev=False, help="prefill and decode-step ratios with a per-step breakdown",
                         description=STEP_HELP, formatter_class=raw)
    s.add_argument("--batch", type=int, default=8, help="rows per batch (default: %(default)s)")
    s.add_argument("--context", type=int, nargs="+", default=[1024, 4096],
                   help="prompt lengths in tokens (default: %(default)s)")
    s.add_argument("--kv", action="append", metavar="CONFIG",
                   help="LeanCache config with optional overrides, e.g. 'K8V4-K4V2:th=0.25,tl=0,group_size=32,"
                        f"rotate=1' (repeat; default: K8V4 and {NEUTRAL})")
    s.add_argument("--steps", type=int, default=16, help="measured decode steps (default: %(default)s)")
    s.add_argument("--warmup", type=int, default=2, help="decode rounds dropped first (default: %(default)s)")
    common(s)
    s.add_argument("--plot", metavar="PNG", help="also draw the ratios and the decode-step breakdown into PNG")
    s.set_defaults(func=cmd_step)

    t = modes.add_parser("throughput", allow_abbrev=False, help="tokens/s at a fixed KV budget, batch each cache fits",
                         description=THROUGHPUT_HELP, formatter_class=raw)
    t.add_argument("--mix", choices=sorted(MIXES), default="decode-heavy", help="request mix (default: %(default)s)")
    t.add_argument("--budget-bytes", type=int, default=None, help="KV budget in bytes (default: see above)")
    t.add_argument("--requests", type=int, default=None, help="requests to serve (default: 3 x the largest batch)")
    t.add_argument("--prompt-range", type=int, nargs=2, metavar=("LO", "HI"), help="prompt tokens, inclusive")
    t.add_argument("--output-range", type=int, nargs=2, metavar=("LO", "HI"), help="output tokens, inclusive")
    t.add_argument("--kv", action="append", metavar="CONFIG",
                   help=f"LeanCache config (repeat; default: {', '.join(DEFAULT_KVS)})")
    t.add_argument("--no-quantized", action="store_true", help="leave HF QuantizedCache out")
    t.add_argument("--no-verify", action="store_true", help="trust the measured peak pages per row for the "
                   "LeanCache batch instead of verifying it in the fixed pool")
    t.add_argument("--seed", type=int, default=0, help="seed of the request draw (default: %(default)s)")
    t.add_argument("--ceiling", action="store_true", help="also run DynamicCache over the budget at the largest "
                   "LeanCache batch: what that batch gives a cache whose steps cost what DynamicCache's do (a "
                   "cache with faster steps at equal batch can pass it)")
    t.add_argument("--plot", metavar="PNG", help="also draw tokens/s vs DynamicCache and the prefill/decode "
                   "time of every cache into PNG")
    common(t)
    t.set_defaults(func=cmd_throughput)

    pl = modes.add_parser("plot", allow_abbrev=False, help="draw the figures of saved step/throughput results (--json files)",
                          description=PLOT_HELP, formatter_class=raw)
    pl.add_argument("files", nargs="+", metavar="JSON", help="results written by step or throughput with --json")
    pl.add_argument("--out", default=".", help="folder for the PNGs, one per file, named after it "
                    "(default: the current folder)")
    pl.set_defaults(func=cmd_plot)

    o = modes.add_parser("offload", allow_abbrev=False, help="a plan's host-tier cache against the all-on-device cache",
                         description=OFFLOAD_HELP, formatter_class=raw)
    o.add_argument("--hardware", default="rtx4090-pcie4",
                   help="hardware preset to plan for, 'detect', or a saved profile .json (default: %(default)s)")
    o.add_argument("--batch", type=int, default=4, help="rows per batch (default: %(default)s)")
    o.add_argument("--context", type=int, default=1024, help="prompt length in tokens (default: %(default)s)")
    o.add_argument("--kv", action="append", metavar="CONFIG",
                   help="cache formats the plan may pick besides fp16 (repeat; default: K8V4)")
    o.add_argument("--gpu-mem", type=float, default=None, help="GPU memory limit in GiB for the plan")
    o.add_argument("--steps", type=int, default=8, help="measured decode steps (default: %(default)s)")
    o.add_argument("--warmup", type=int, default=2, help="decode rounds dropped first (default: %(default)s)")
    common(o)
    o.set_defaults(func=cmd_offload)


def _parse_kvs(kvs) -> None:
    """Validate the --kv configs before the model loads; a config given twice (``K8V4`` and ``k8v4``
    included) is refused instead of being measured twice as two rows of the table."""
    from ..config import KVConfig

    seen = {}
    for kv in kvs:
        cfg = KVConfig.parse(kv)
        for other, ocfg in seen.items():
            if ocfg == cfg:
                raise ValueError(f"--kv {kv!r} is the same config as --kv {other!r}: give each config once")
        seen[kv] = cfg


def _setup(args, block: str):
    """Check the shared options, set threads, load the model; returns ``(model, tok)``.

    ``block``: the README block the run's table goes into with --write-readme, whose markers are
    checked here, before anything is measured."""
    import torch

    import leankit

    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    for flag in ("json", "plot"):  # an output that cannot be written fails before the measurement
        problem = output_problem(getattr(args, flag, None))
        if problem:
            raise ValueError(f"--{flag}: {problem}")
    if args.text is not None:
        read_text(args.text)  # a missing, empty or binary file fails before the model loads
    if args.write_readme:
        if not Path(args.readme).is_file():
            raise ValueError(f"--readme {args.readme} is not a file (run from the repository root or pass --readme)")
        replace_block(Path(args.readme).read_text(encoding="utf-8"), block, "")  # raises on missing markers
    if args.threads:
        torch.set_num_threads(args.threads)
    args.allocator = None if args.default_malloc else pin_glibc_malloc()
    return leankit.load_model(args.model)


def _throughput_block(args) -> str:
    """The README block of a throughput run: one per mix."""
    return "throughput" if args.mix == "decode-heavy" else f"throughput-{args.mix}"


def _check_plot(args) -> None:
    """Fail before measuring when --plot cannot be drawn: no matplotlib, or not a .png path."""
    if args.plot:
        from ..plotting import require_matplotlib

        require_matplotlib("--plot")
        if Path(args.plot).suffix.lower() != ".png":
            raise ValueError(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")


def _text_note(args) -> str:
    """The words a results block's first line carries about --text (empty for the shipped articles)."""
    return "" if args.text is None else f", prompts from {text_source(args.text)}"


def _allocator_note(args) -> str:
    """The sentence a results block carries about the allocator (empty when it was left alone)."""
    return f"\n\n{args.allocator}" if getattr(args, "allocator", None) else ""


def _finish(args, mode: str, body: str, results) -> None:
    import torch

    from .readme import cpu_model, provenance, reproducible_args, write_block

    argv = list(getattr(args, "argv", None) or [])
    threads = torch.get_num_threads()
    # the command without its output paths, as the README shows it (no local path)
    payload = {"mode": mode, "command": ["leankit", "bench", *reproducible_args(argv)], "model": args.model,
               "threads": threads, "torch": torch.__version__, "cpu": cpu_model(),
               "allocator": getattr(args, "allocator", None), "results": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # output_problem found them creatable
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    if getattr(args, "plot", None):
        from .plot import plot_payload

        print(f"wrote {plot_payload(payload, args.plot)}")
    if args.write_readme:
        write_block(args.readme, mode, body + "\n\n" + provenance(argv, threads))
        print(f"wrote the {mode} table into {args.readme}")


def cmd_step(args) -> int:
    """``leankit bench step``."""
    from . import step

    kvs = args.kv or ["K8V4", NEUTRAL]
    _parse_kvs(kvs)  # a bad or repeated config fails before the model loads
    _check_plot(args)
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or min(args.context) < 1:
        raise ValueError("--batch, --steps and --context must be >= 1 and --warmup >= 0")
    from .text import check_step_context

    for ctx in args.context:  # before the model loads, not after the contexts before it were measured
        check_step_context(args.batch, ctx)
    model, tok = _setup(args, "step")
    rows = step.run(model, tok, args.batch, args.context, kvs, args.steps, args.warmup, not args.no_progress,
                    text_path=args.text)
    body = (f"{args.model}, batch {args.batch}, {args.steps} decode steps after {args.warmup} warm-up "
            f"round{'' if args.warmup == 1 else 's'}"
            f"{_text_note(args)}.\n\n"
            f"{step.table(rows)}\n\n{step.NOTES} {step.faults_line(rows)}{_allocator_note(args)}")
    print(body)
    _finish(args, "step", body, rows)
    return 0


def cmd_throughput(args) -> int:
    """``leankit bench throughput``."""
    from . import throughput

    kvs = args.kv or list(DEFAULT_KVS)
    _parse_kvs(kvs)  # a bad or repeated config fails before the model loads
    _check_plot(args)
    model, tok = _setup(args, _throughput_block(args))
    res = throughput.run(model, tok, args.mix, args.budget_bytes, args.requests, args.prompt_range,
                         args.output_range, kvs, quantized=not args.no_quantized, verify=not args.no_verify,
                         seed=args.seed, progress=not args.no_progress, ceiling=args.ceiling, text_path=args.text)
    body = f"{args.model}.\n\n{throughput.table(res)}\n\n{throughput.notes(res)}{_allocator_note(args)}"
    print(body)
    # One README block per mix: the decode-heavy table is "throughput", the other "throughput-<mix>".
    _finish(args, _throughput_block(args), body, res)
    return 0


def cmd_offload(args) -> int:
    """``leankit bench offload``."""
    from ..planner import Limits, get_hardware
    from ..planner.hardware import GiB
    from . import offload

    kvs = args.kv or ["K8V4"]
    _parse_kvs(kvs)  # a bad or repeated config fails before the model loads
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or args.context < 1:
        raise ValueError("--batch, --steps and --context must be >= 1 and --warmup >= 0")
    if args.gpu_mem is not None and not 0 <= args.gpu_mem < float("inf"):
        raise ValueError(f"--gpu-mem is a memory size in GiB and must be >= 0, got {args.gpu_mem}")
    if args.write_readme:
        raise ValueError("bench offload has no README block: use --json FILE to keep the results")
    hw = get_hardware(args.hardware)
    model, tok = _setup(args, "offload")
    limits = Limits(gpu_mem=None if args.gpu_mem is None else args.gpu_mem * GiB)
    res = offload.run(model, tok, hw, args.batch, args.context, args.steps, args.warmup, (None, *kvs), limits,
                      progress=not args.no_progress, text_path=args.text)
    body = f"{args.model}{_text_note(args)}.\n\n{offload.table(res)}{_allocator_note(args)}"
    print(body)
    _finish(args, "offload", body, res)
    return 0


def cmd_plot(args) -> int:
    """``leankit bench plot``."""
    from .plot import plot_files

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"no such results file: {', '.join(missing)}")
    problem = output_problem(args.out, folder=True)
    if problem:
        raise ValueError(f"--out: {problem}")
    for path in plot_files(args.files, args.out):
        print(f"wrote {path}")
    return 0
