"""Host time of leankit's part of a decode step on the kernel backend, with every launch stubbed.

    python bench/layer_host.py                       # K8V4, the neutral config, FP16
    python bench/layer_host.py --kv K4V2 --steps 60 --profile 25

On a GPU an eager decode step is host-bound at small batch (``results/gpu-h100/gpu_step.md``:
SmolLM2's step costs about 1 ms a layer in Python and launches, against tens of µs of device
work). What leankit adds to each layer is its attention function: the step store, the decode
launcher (the pages and the step's own token; a rotated cache merges its own token in a launch of
its own) and (LeanKV) the fused score update. This measures that
Python work on any machine: a tiny Llama model with SmolLM2's head layout (9 query heads, 3 KV
heads, head_dim 64) runs a real prompt on the kernel backend, then every Triton launch of leankit
is replaced by a stub (nothing runs, no interpreter) and decode steps are timed:

    layer   µs of leankit's attention function per decoder layer (what repeats per layer)
    step    µs of the step's own open and close (the pre- and post-forward hooks)
    launches  Triton launches per layer (inside the attention function) and per step (its open
            and close): on a GPU each costs Triton's own launch work on top of the µs above
    sdpa    µs of transformers' SDPA attention per layer on DynamicCache, same model and
            shapes, run for real on the CPU (a yardstick: its own update plus the attention)

Each figure is the best mean over rounds of 8 steps (as ``timeit`` takes the best of its
repeats): on a shared machine that is the code's own cost, the others add what else ran.

Under the stub no kernel writes anything, so nothing the device would report can steer the run:
LeanKV's Algorithm 1 (which runs ``compress_every`` steps apart) is held off, as the step status
read back does on the steps between its runs, and every measured step is such a step (the
Algorithm 1 step is counted in launches by ``tests/test_sync_free.py``). ``--profile N`` prints the N functions with the most own
time (cProfile) of the last config, per layer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

# The child process that measures a config runs leankit's kernel backend (through Triton's
# interpreter for the real prompt, before the launches are stubbed).
WORKER_ENV = {"LEANKIT_BACKEND": "triton", "TRITON_INTERPRET": "1"}

KERNEL_MODULES = ("own_token", "quant", "step_rows", "act_to_kv", "page_alloc", "prefill_attention",
                  "prompt_significance", "paged_attention", "tiles", "prompt_plan")
DEFAULT_KVS = ("K8V4", "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1", "FP16")


class _Compiled:
    n_regs = 0


class _Launcher:
    """Stands in for ``kernel_for(kernel, device)``: a launch that runs nothing, counted."""

    launches = 0  # every stubbed launch of the process

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _Launcher.launches += 1
            return _Compiled()

        return launch


def _model(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=97, hidden_size=576, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


class _Timed:
    """Wraps a callable and records each call's wall time in µs."""

    def __init__(self, fn):
        self.fn, self.us, self.launches = fn, [], 0

    def __call__(self, *args, **kwargs):
        n = _Launcher.launches
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.us.append((time.perf_counter() - t) * 1e6)
        self.launches += _Launcher.launches - n
        return out


def _decode_inputs(model, cache, batch: int, context: int):
    from leankit.hf import cache_kwargs

    ids = torch.randint(4, 97, (batch, context))
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    return out.logits[:, -1:].argmax(-1), torch.full((batch, 1), context - 1)


def measure(spec: str, batch: int, context: int, steps: int, layers: int, profile: int = 0) -> dict:
    """µs per layer (leankit's attention function) and per step (its open and close) of ``spec``."""
    from leankit import hf
    from leankit.cache import LeanCache
    from leankit.hf import cache_kwargs

    model = _model(layers)
    cache = LeanCache(model, spec, num_pages=20 * batch * layers * (context // 16 + steps + 64))
    nxt, pos = _decode_inputs(model, cache, batch, context)
    saved = {}
    for name in KERNEL_MODULES:
        mod = importlib.import_module("leankit_kernels." + name)
        if hasattr(mod, "kernel_for"):
            saved[mod] = mod.kernel_for
            mod.kernel_for = lambda kernel, device: _Launcher()
    attend, begin, end = _Timed(cache.attend), _Timed(cache.begin_step), _Timed(cache.end_step)

    def begin_untimed_flags(*args, **kwargs):
        # The stubbed launches leave step_rows' outputs unwritten: clear the rows' position flags
        # (outside the timed call) so the step's one read finds no row going back.
        out = begin(*args, **kwargs)
        if cache._step.behind is not None:
            cache._step.behind.zero_()
        return out

    cache.attend, cache.begin_step, cache.end_step = attend, begin_untimed_flags, end
    try:
        with torch.no_grad():
            for s in range(steps):
                pos = pos + 1
                _hold_algorithm_1(cache)
                model(input_ids=nxt, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
                if s == 1:  # warm-up steps dropped
                    for t in (attend, begin, end):
                        t.us.clear()
                        t.launches = 0
            if profile:
                _profile(model, cache, nxt, pos, layers, profile)
    finally:
        for mod, fn in saved.items():
            mod.kernel_for = fn
    del hf
    step = [b + e for b, e in zip(begin.us, end.us)]
    per_step = [sum(attend.us[i * layers:(i + 1) * layers]) / layers for i in range(len(step))]
    return {"layer": best_round(per_step), "step": best_round(step),
            "layer_launches": attend.launches / len(attend.us),
            "step_launches": (begin.launches + end.launches) / len(step)}


ROUND_STEPS = 8


def best_round(us: list[float]) -> float:
    """The least mean over rounds of :data:`ROUND_STEPS` consecutive steps (``timeit``'s best of
    N): what the code costs when nothing else on the machine gets in its way."""
    rounds = [us[i:i + ROUND_STEPS] for i in range(0, len(us) - ROUND_STEPS + 1, ROUND_STEPS)] or [us]
    return min(statistics.fmean(r) for r in rounds)


def _hold_algorithm_1(cache) -> None:
    """Make the next step one between two runs of LeanKV's Algorithm 1 (what the step status
    read back tells the policy on a real run); other policies have nothing to hold."""
    if hasattr(cache.policy, "_skip_next"):
        cache.policy._skip_next = True


def _profile(model, cache, nxt, pos, layers: int, top: int) -> None:
    import cProfile
    import pstats

    from leankit.hf import cache_kwargs

    n = 10
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        pos = pos + 1
        _hold_algorithm_1(cache)
        model(input_ids=nxt, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
    prof.disable()
    rows = []
    for (fn, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        if "leankit" in fn or "triton_kernels" in fn:
            rows.append((own, cum, calls, f"{os.path.basename(fn)}:{line} {name}"))
    print(f"{'own µs/layer':>13} {'cum µs/layer':>13} {'calls':>6}  function")
    for own, cum, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"{own * 1e6 / n / layers:13.1f} {cum * 1e6 / n / layers:13.1f} {calls:6d}  {where}")


def sdpa_us(batch: int, context: int, steps: int, layers: int) -> float:
    """Median µs per layer of transformers' SDPA attention function on a DynamicCache (real CPU work)."""
    from transformers import DynamicCache
    from transformers.integrations import sdpa_attention as sdpa

    from leankit.hf import cache_kwargs

    model = _model(layers)
    model.config._attn_implementation = "sdpa"
    cache = DynamicCache()
    ids = torch.randint(4, 97, (batch, context))
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    timed = _Timed(sdpa.sdpa_attention_forward)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    orig = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = timed
    try:
        with torch.no_grad():
            for s in range(steps):
                model(input_ids=nxt, **cache_kwargs(model, cache), use_cache=True)
                if s == 1:
                    timed.us.clear()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = orig
    per_step = [sum(timed.us[i * layers:(i + 1) * layers]) / layers for i in range(len(timed.us) // layers)]
    return best_round(per_step)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", help="LeanCache config (repeat); default: K8V4, neutral, FP16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=40)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kvs = args.kv or list(DEFAULT_KVS)
    shape = ["--batch", str(args.batch), "--context", str(args.context), "--steps", str(args.steps),
             "--layers", str(args.layers)]
    if args.worker:  # one config, its own process: a stubbed run leaves unwritten buffers behind
        if any(os.environ.get(k) != v for k, v in WORKER_ENV.items()):
            raise SystemExit(f"--worker needs the environment {WORKER_ENV}")
        r = measure(kvs[0], args.batch, args.context, args.steps, args.layers, args.profile)
        print("RESULT " + json.dumps(r))
        return
    print(f"batch {args.batch}, prompt {args.context} tokens, {args.steps} steps (2 dropped), "
          f"{args.layers} layers, kernels stubbed")
    print(f"{'config':52s} {'layer µs':>9} {'step µs':>9} {'launches a layer':>17} {'a step':>7}")
    for i, spec in enumerate(kvs):
        prof = ["--profile", str(args.profile)] if args.profile and i == len(kvs) - 1 else []
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--kv", spec, *shape, *prof],
                             capture_output=True, text=True, check=True, env={**os.environ, **WORKER_ENV})
        lines = run.stdout.splitlines()
        r = json.loads(next(x for x in lines if x.startswith("RESULT "))[7:])
        if prof:
            profile_text = "\n".join(x for x in lines if not x.startswith("RESULT "))
        print(f"{spec:52s} {r['layer']:9.0f} {r['step']:9.0f} {r['layer_launches']:17.1f} "
              f"{r['step_launches']:7.1f}", flush=True)
    print(f"{'DynamicCache + SDPA (real, CPU)':52s} {sdpa_us(args.batch, args.context, args.steps, args.layers):9.0f}")
    if args.profile:
        print(f"\nProfile of {kvs[-1]}:\n{profile_text}")


if __name__ == "__main__":
    main()
