"""``leankit bench step``: prefill and decode-step time of LeanCache configs against DynamicCache.

For every context length, one left-padded batch of real-text prompts is prefilled into a
``DynamicCache`` and, per LeanCache config, into two LeanCaches (each kind three times into a
fresh cache, in rotating order; the median is its prefill time): a *plain* one (never timed
inside) whose times give the ratios, and an *instrumented* one whose steps run with exclusive
timers (:mod:`leankit.bench.timing`) to break the step down. Decode steps then run in rounds;
each round steps every cache once, in an order that rotates from round to round, so all caches
see the same machine state. Warm-up rounds are dropped; ratios are ratios of medians. The
instrumented cache measures the timers' own cost: its median step against the plain one's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..hf import cache_kwargs
from .malloc import minor_faults
from .text import check_positions, check_step_context, corpus_ids, left_padded, pad_id, step_batch
from .timing import CATEGORIES, ExclusiveTimer, breakdown, lean_targets, patched


@torch.no_grad()
def prefill(model, cache, input_ids: torch.Tensor, mask: torch.Tensor):
    """Run the prompt through ``model`` into ``cache``; returns the decode state (token, mask, position).

    Only the last position's logits are computed, as ``model.generate`` does (``logits_to_keep=1``):
    the full prompt's logits would add a vocabulary-sized matmul per token and a block of
    B x T x vocab floats (1.6 GB at 8 x 1024 tokens for SmolLM2) that no generation computes.
    """
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    keep = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                use_cache=True, **keep)
    return out.logits[:, -1].argmax(-1, keepdim=True), mask, pos[:, -1:]


def _takes_logits_to_keep(model) -> bool:
    """Whether ``model.forward`` accepts ``logits_to_keep`` (transformers' causal LMs do)."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def decode(model, cache, state):
    """One greedy decode step of every row; returns the next state."""
    tok, mask, pos = state
    mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
    pos = pos + 1
    out = model(input_ids=tok, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
    return out.logits[:, -1].argmax(-1, keepdim=True), mask, pos


@dataclass
class _Runner:
    """One cache of the comparison and what was measured on it."""

    make: object  # builds a fresh, empty cache of this kind
    timed: bool = False
    cache: object = None
    state: tuple | None = None
    prefill_s: float = 0.0
    prefill_parts: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    parts: list = field(default_factory=list)


class _Bench:
    def __init__(self, model):
        self.model, self.timer, self.targets = model, ExclusiveTimer(), lean_targets()

    def run(self, r: _Runner, fn, *args):
        """``fn(model, cache, *args)`` timed as a whole; with the exclusive timers on when ``r.timed``."""
        if r.timed:
            with patched(self.timer, self.targets):
                t0 = time.perf_counter()
                out = fn(self.model, r.cache, *args)
                dt = time.perf_counter() - t0
            return out, dt, self.timer.take()
        t0 = time.perf_counter()
        out = fn(self.model, r.cache, *args)
        return out, time.perf_counter() - t0, None


def _fractions(parts: list[dict], total: float) -> dict:
    summed = {c: sum(p[c] for p in parts) for c in CATEGORIES}
    return {c: (summed[c] / total if total else float("nan")) for c in CATEGORIES}


PREFILL_RUNS = 3  # prefills per cache kind; the median is reported


def measure_context(model, ids: torch.Tensor, pad: int, batch: int, context: int, kvs: list[str], steps: int,
                    warmup: int = 2, progress: bool = False) -> list[dict]:
    """Measure every config of ``kvs`` against DynamicCache at one context length (see the module doc)."""
    from transformers import DynamicCache

    from ..cache import LeanCache

    input_ids, mask = left_padded(step_batch(ids, batch, context), pad)
    # One short untimed prefill through every kind of cache first, so no measured call pays a first-call cost.
    for cache in [DynamicCache(config=model.config)] + [LeanCache(model, kv) for kv in kvs]:
        prefill(model, cache, input_ids[:, -16:], mask[:, -16:])
    bench = _Bench(model)
    dyn = _Runner(lambda: DynamicCache(config=model.config))
    pairs = [(kv, _Runner(lambda kv=kv: LeanCache(model, kv)), _Runner(lambda kv=kv: LeanCache(model, kv), timed=True))
             for kv in kvs]
    runners = [dyn] + [r for _, plain, timed in pairs for r in (plain, timed)]
    from tqdm.auto import tqdm

    bar = tqdm(total=len(runners) * (PREFILL_RUNS + warmup + steps), desc=f"step bench, context {context}", unit="step",
               leave=False, disable=not progress)
    # Each cache kind prefills PREFILL_RUNS fresh caches, in an order that rotates every round; the
    # median is its prefill time (a single prefill is at the mercy of the machine's state), and
    # the last round's cache goes on to decode.
    times = {id(r): [] for r in runners}
    faults = {id(r): [] for r in runners}  # minor page faults per prefill: fresh memory touched
    for j in range(PREFILL_RUNS):
        k = j % len(runners)
        for r in runners[k:] + runners[:k]:
            r.cache = r.make()
            f0 = minor_faults()
            r.state, dt, parts = bench.run(r, prefill, input_ids, mask)
            faults[id(r)].append(minor_faults() - f0)
            times[id(r)].append(dt)
            if parts is not None:
                r.prefill_parts = breakdown(parts, dt)
            bar.update(1)
    for r in runners:
        r.prefill_s = statistics.median(times[id(r)])
    for i in range(warmup + steps):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:  # the order rotates every round
            r.state, dt, parts = bench.run(r, decode, r.state)
            if i >= warmup:
                r.steps.append(dt)
                if parts is not None:
                    r.parts.append(breakdown(parts, dt))
            bar.update(1)
    bar.close()
    dyn_step = statistics.median(dyn.steps)
    rows = []
    for kv, plain, timed in pairs:
        step, step_timed = statistics.median(plain.steps), statistics.median(timed.steps)
        rows.append(dict(
            context=context, batch=batch, kv=str(plain.cache.cfg), kv_arg=kv,
            prefill_dynamic_s=dyn.prefill_s, prefill_lean_s=plain.prefill_s, prefill_ratio=plain.prefill_s / dyn.prefill_s,
            prefill_runs_dynamic_s=times[id(dyn)], prefill_runs_lean_s=times[id(plain)],
            prefill_faults_dynamic=faults[id(dyn)], prefill_faults_lean=faults[id(plain)],
            step_dynamic_s=dyn_step, step_lean_s=step, decode_ratio=step / dyn_step,
            prefill_breakdown=_fractions([timed.prefill_parts], sum(timed.prefill_parts.values())),
            decode_breakdown=_fractions(timed.parts, sum(timed.steps)),
            timer_overhead=dict(prefill_s=timed.prefill_s - plain.prefill_s, step_s=step_timed - step,
                                prefill_rel=timed.prefill_s / plain.prefill_s - 1, step_rel=step_timed / step - 1),
            pages_ratio=plain.cache.memory_report()["pages_ratio"],
        ))
    return rows


def run(model, tok, batch: int = 8, contexts=(1024, 4096), kvs=("K8V4",), steps: int = 16, warmup: int = 2,
        progress: bool = True, text_path=None) -> list[dict]:
    """The step benchmark over ``contexts`` x ``kvs``; one result dict per (context, config).

    ``text_path``: a UTF-8 text file to cut the prompts from instead of the shipped articles."""
    if batch < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"--batch and --steps must be >= 1 and warm-up >= 0, got {batch}, {steps}, {warmup}")
    for ctx in contexts:  # every context before the first is measured, not after minutes of it
        check_step_context(batch, ctx)
    check_positions(model, max(contexts) + warmup + steps, "--context plus the warm-up and timed steps")
    ids, pad = corpus_ids(tok, text_path), pad_id(tok)
    rows = []
    for ctx in contexts:
        rows += measure_context(model, ids, pad, batch, ctx, list(kvs), steps, warmup, progress)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table of :func:`run`'s rows: ratios, times and the breakdown of each LeanCache step."""
    head = ("| context | config | phase | vs DynamicCache | LeanCache ms | DynamicCache ms | attention | "
            "quantize/store | policy | allocation | step setup | model (rest) | timers' own cost |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for phase in ("prefill", "decode"):
            lean = r["prefill_lean_s"] if phase == "prefill" else r["step_lean_s"]
            dyn = r["prefill_dynamic_s"] if phase == "prefill" else r["step_dynamic_s"]
            ratio = r["prefill_ratio"] if phase == "prefill" else r["decode_ratio"]
            parts = r[f"{phase}_breakdown"]
            over = r["timer_overhead"]["prefill_rel" if phase == "prefill" else "step_rel"]
            cells = [str(r["context"]), f"`{r['kv_arg']}`", phase, f"{ratio:.2f}x", f"{lean * 1e3:.1f}", f"{dyn * 1e3:.1f}"]
            cells += [f"{100 * parts[c]:.1f}%" for c in CATEGORIES]
            cells.append(f"{100 * over:+.1f}%")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def faults_line(rows: list[dict]) -> str:
    """One sentence: the minor page faults of each measured prefill, DynamicCache's and each config's."""
    if not rows:
        return ""
    by_context: dict = {}
    for r in rows:
        by_context.setdefault(r["context"], [("DynamicCache", r["prefill_faults_dynamic"])]).append(
            (f"`{r['kv_arg']}`", r["prefill_faults_lean"]))
    parts = [f"{ctx}: " + "; ".join(f"{name} {', '.join(f'{n / 1e3:.0f}k' for n in counts)}" for name, counts in named)
             for ctx, named in by_context.items()]
    return "Minor page faults of the measured prefills, in run order (context " + " / ".join(parts) + ")."


NOTES = ("Ratios: LeanCache time / DynamicCache time, the same batch in one process (decode: ratio of medians, "
         "caches stepped in rotating order, warm-up rounds dropped; prefill: median of 3 fresh prefills each, in rotating order). Breakdown: share of "
         "the instrumented LeanCache step, exclusive times (a nested timed call counts once, in its own column); "
         "model (rest) = the step less every timed column. Timers' own cost: instrumented step vs an "
         "un-instrumented LeanCache running the same steps (measured difference, noise included).")
