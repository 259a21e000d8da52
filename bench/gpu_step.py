"""Whole-model prefill and decode steps on a CUDA GPU: LeanCache (kernel backend) against
DynamicCache side by side in one run, and decode tokens/s at a fixed KV budget.

    python bench/gpu_step.py --out results/gpu                  # both shapes, 1k and 4k tokens
    python bench/gpu_step.py --shapes smollm2 --contexts 1024 --batch 8
    python bench/gpu_step.py --shapes smollm2 --contexts 1024 --profile neutral --out results/gpu

No weights are needed: each shape is a random-init ``LlamaForCausalLM`` in bf16 with a real
model's layer shapes (``smollm2``: SmolLM2-135M, all 30 layers; ``llama3-8b``: Llama-3-8B's layers,
``--llama-layers`` of its 32, vocabulary 32k instead of 128k so its output matmul does not
dominate a model of a quarter of the layers). Prompts are random token ids, left-padded rows of
slightly different lengths around the context.

The baseline is ``DynamicCache`` on a twin of the model (same weights) that leankit never
touched, with torch SDPA's cuDNN backend switched off (:func:`no_cudnn_sdpa` says why); the same
cache on torch's default SDPA choice is timed beside it and reported in its own column.

Per (shape, context): every cache kind prefills a fresh cache three times, in an order that
rotates (median = its prefill time); then decode steps run in rounds, each round stepping every
cache once in a rotating order, with the device synchronized around each call (a decode step
reads its flags back once anyway). Times are wall clock per whole-model call, eager (no CUDA
graph): the Python launch work of every layer is included, as in ``model.generate``.

Fixed budget: the budget is the bytes of a bf16 ``DynamicCache`` holding ``--batch`` rows of
context + steps tokens. Each LeanCache config gets a fixed pool of ``budget // page_size`` pages
and as many rows as its measured pages per row allow (from the batch run's peak pages); if the
pool runs out the batch shrinks by one and runs again. Decode tokens/s = rows / median step time,
reported against DynamicCache's ``--batch`` rows. Prefill is left out of that figure (it does
not depend on the batch limit the way decode does; its ratio is in the first table).

``--profile KV`` instead runs ``torch.profiler`` over one prefill and a few decode steps of each
baseline and of LeanCache ``KV`` and writes the top ops (host and device time) to
``gpu_step_profile.txt``.

Report ratios; absolute times are printed for context. Random weights give the LeanKV policy
attention patterns unlike a trained model's, so its high/low split (printed) is not a real one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import save_results

SHAPES = {  # hidden, heads, kv heads, layers, intermediate, vocab
    "smollm2": (576, 9, 3, 30, 1536, 49152),
    "llama3-8b": (4096, 32, 8, 32, 14336, 32000),
}
KVS = ("FP16", "K8V4", "K4V2", "neutral")
PREFILL_RUNS = 3


def random_model(shape: str, layers: int | None, dtype: torch.dtype, device: str = "cuda"):
    """A random-init Llama of ``shape``'s layer sizes on ``device`` (``layers`` overrides the count)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, n_layers, inter, vocab = SHAPES[shape]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers or n_layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=16384,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype=dtype)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def prompts(batch: int, context: int, vocab: int, device, seed: int = 0):
    """``batch`` left-padded rows of random ids, row ``i`` ``context - 8 (i % 8)`` tokens long."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, context, dtype=torch.long)
    mask = torch.zeros(batch, context, dtype=torch.long)
    for i in range(batch):
        n = max(context - 8 * (i % 8), 16)
        ids[i, context - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, context - n:] = 1
    return ids.to(device), mask.to(device)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args):
    """``(result, seconds)`` of ``fn(*args)`` with the device synchronized on both sides."""
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - t0


def dynamic_bytes(model, rows: int, tokens: int) -> int:
    """K/V bytes of a ``DynamicCache`` in the model's dtype: ``rows`` x ``tokens`` tokens."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    item = torch.empty((), dtype=model.dtype).element_size()
    return rows * tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * item


def no_cudnn_sdpa():
    """Torch SDPA without its cuDNN backend (flash, memory-efficient, math). On an H200 with torch
    2.11, SDPA picked cuDNN attention for a decode step's one query with a padding mask and spent
    about 7 ms of host time per call building a cuDNN graph for each new key length (profiled with
    ``--profile``: 108 ms a decode step of SmolLM2's shape at batch 8, against 46 ms once the graphs
    of those lengths were cached), which no caching helps in a generation whose length grows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def run_kinds(makers: dict, ids, mask, steps: int, warmup: int, prefill_runs: int = PREFILL_RUNS) -> dict:
    """Prefill and decode-step times of every cache kind of ``makers`` (name -> ``(model, zero-arg
    cache factory[, context manager factory each call runs under])``). ``prefill_runs`` timed
    prefills follow an untimed one (0: the prefill is not timed, ``prefill_s`` is None)."""
    from leankit.bench.step import decode, prefill

    names = list(makers)
    pre = {n: [] for n in names}
    caches, states = {}, {}
    for j in range(prefill_runs + 1):  # the first round warms up (compiles), untimed
        k = j % len(names)
        for n in names[k:] + names[:k]:
            model, make, *under = makers[n]
            caches[n] = make()
            with under[0]() if under else contextlib.nullcontext():
                states[n], dt = timed(prefill, model, caches[n], ids, mask)
            if j:
                pre[n].append(dt)
    step = {n: [] for n in names}
    for i in range(warmup + steps):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            model, _, *under = makers[n]
            with under[0]() if under else contextlib.nullcontext():
                states[n], dt = timed(decode, model, caches[n], states[n])
            if i >= warmup:
                step[n].append(dt)
    return {n: {"prefill_s": statistics.median(pre[n]) if pre[n] else None, "step_s": statistics.median(step[n]), "cache": caches[n]}
            for n in names}


def measure(model, stock, shape: str, context: int, batch: int, kvs, steps: int, warmup: int) -> list[dict]:
    """Side-by-side rows for one (shape, context): batch ratios, then the fixed-budget run.
    ``DynamicCache`` runs on ``stock``, a twin of ``model`` (same weights) that leankit never
    touched (transformers' own SDPA attention and masks, no hooks)."""
    from transformers import DynamicCache

    from leankit.allocator import PoolExhausted
    from leankit.cache import LeanCache
    from leankit.presets import resolve

    ids, mask = prompts(batch, context, model.config.vocab_size, model.device)
    # The baseline: DynamicCache on SDPA without cuDNN (see no_cudnn_sdpa); torch's default choice
    # is measured beside it and reported, not used for the ratios.
    makers = {"DynamicCache": (stock, lambda: DynamicCache(config=stock.config), no_cudnn_sdpa),
              "DynamicCache, default SDPA": (stock, lambda: DynamicCache(config=stock.config))}
    for kv in kvs:
        makers[kv] = (model, lambda kv=kv: LeanCache(model, kv, max_seq_len=context + warmup + steps + 8))
    res = run_kinds(makers, ids, mask, steps, warmup)
    dyn = res.pop("DynamicCache")
    dyn_default = res.pop("DynamicCache, default SDPA")
    budget = dynamic_bytes(model, batch, context + warmup + steps)
    rows = []
    for kv, r in res.items():
        rep = r["cache"].memory_report()
        row = {"shape": shape, "layers": model.config.num_hidden_layers, "context": context, "batch": batch,
               "kv": kv, "config": resolve(kv), "dtype": str(model.dtype).removeprefix("torch."),
               "prefill_dynamic_s": dyn["prefill_s"], "prefill_lean_s": r["prefill_s"],
               "prefill_ratio": r["prefill_s"] / dyn["prefill_s"],
               "step_dynamic_s": dyn["step_s"], "step_lean_s": r["step_s"], "decode_ratio": r["step_s"] / dyn["step_s"],
               "prefill_dynamic_default_sdpa_s": dyn_default["prefill_s"],
               "step_dynamic_default_sdpa_s": dyn_default["step_s"],
               "peak_ratio": rep["peak_ratio"], "tiers": rep["tokens_per_tier"], "budget_bytes": budget}
        # fixed budget: the pool holds the DynamicCache's bytes; rows from the measured peak pages
        page = rep["page_size"]
        per_row = rep["peak_kv_bytes"] / batch
        fit = int(budget // page * page // per_row) if per_row else batch
        got = None
        while fit >= 1:
            if fit == batch:  # the batch run's peak fits the pool
                got = r
                break
            fit_ids, fit_mask = prompts(fit, context, model.config.vocab_size, model.device, seed=1)
            try:
                make = lambda kv=kv, pages=budget // page: LeanCache(
                    model, kv, num_pages=pages, max_seq_len=context + warmup + steps + 8)
                got = run_kinds({kv: (model, make)}, fit_ids, fit_mask, steps, warmup, prefill_runs=0)[kv]
                break
            except PoolExhausted:
                fit -= 1
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        if got is None:  # not one row fits the budget (pages of a short context are mostly padding)
            row.update(budget_rows=0, budget_step_s=None, budget_tokens_per_s_ratio=0.0)
        else:
            row.update(budget_rows=fit, budget_step_s=got["step_s"],
                       budget_tokens_per_s_ratio=(fit / got["step_s"]) / (batch / dyn["step_s"]))
        rows.append(row)
        del got
        print(f"{shape} {context:>5} {kv:>10}: prefill {row['prefill_ratio']:.2f}x, decode step "
              f"{row['decode_ratio']:.2f}x DynamicCache; {fit} rows in the budget of {batch}: "
              f"{row['budget_tokens_per_s_ratio']:.2f}x decode tokens/s", flush=True)
    return rows


def profile(model, stock, context: int, batch: int, kv: str, steps: int = 3, top: int = 12) -> str:
    """Where prefill and decode time go: ``torch.profiler`` over one prefill and ``steps`` decode
    steps of DynamicCache on the stock model (SDPA without cuDNN, the baseline, and torch's default
    choice), DynamicCache on the leankit-enabled model (leankit's hooks and attention registration,
    no LeanCache) and LeanCache ``kv``; the wall time of each and its top ops by self CPU time and
    by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import DynamicCache

    from leankit.bench.step import decode, prefill
    from leankit.cache import LeanCache

    ids, mask = prompts(batch, context, model.config.vocab_size, model.device)
    kinds = {"DynamicCache, stock model, SDPA without cuDNN": (stock, lambda: DynamicCache(config=stock.config),
                                                                no_cudnn_sdpa),
             "DynamicCache, stock model, default SDPA": (stock, lambda: DynamicCache(config=stock.config),
                                                         contextlib.nullcontext),
             "DynamicCache, leankit-enabled model": (model, lambda: DynamicCache(config=model.config),
                                                     contextlib.nullcontext),
             f"LeanCache {kv}": (model, lambda: LeanCache(model, kv, max_seq_len=context + 3 * steps + 8),
                                 contextlib.nullcontext)}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out = []

    def report(title: str, prof, walls: list[float]) -> None:
        out.append(f"## {title}: {statistics.median(walls) * 1e3:.2f} ms (median of {len(walls)})")
        ka = prof.key_averages()
        out.append(ka.table(sort_by="self_cpu_time_total", row_limit=top))
        if torch.cuda.is_available():
            out.append(ka.table(sort_by="self_cuda_time_total", row_limit=top // 2))

    for name, (m, make, under) in kinds.items():
        with under():
            prefill(m, make(), ids, mask)  # warm-up (compiles, allocator)
            cache = make()
            with torch_profile(activities=acts) as prof:
                state, dt = timed(prefill, m, cache, ids, mask)
            report(f"{name}, prefill", prof, [dt])
            for _ in range(2 * steps):  # warm-up
                state = decode(m, cache, state)
            walls = []
            with torch_profile(activities=acts) as prof:
                for _ in range(steps):
                    state, dt = timed(decode, m, cache, state)
                    walls.append(dt)
            report(f"{name}, decode step", prof, walls)
    return "\n".join(out)


def table(rows: list[dict], device: str, argv: str) -> list[str]:
    """The markdown lines of the results."""
    lines = [f"# Whole-model steps on a GPU, LeanCache kernel backend vs DynamicCache (device: {device})", "",
             (f"`python bench/gpu_step.py {argv}`: random-init Llama models with real layer shapes "
             "(bf16), eager calls (no CUDA graph), medians; see the script's docstring. Prefill and "
             "decode step are ratios to DynamicCache at the same batch (lower is faster), on SDPA "
             "without its cuDNN backend (bench/gpu_step.py `no_cudnn_sdpa`); the last column is "
             "DynamicCache's decode step on torch's default SDPA choice over it. Budget rows = rows "
             "a pool of DynamicCache's bytes holds; tokens/s at budget = decode tokens/s with those "
             "rows against DynamicCache's rows (higher is better)."), "",
             ("| shape (layers) | context | batch | config | prefill x | decode step x | KV bytes / bf16 "
             "| budget rows | decode tokens/s at budget x | DynamicCache step ms | default SDPA step x |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} ({r['layers']}) | {r['context']} | {r['batch']} | {r['config']} | "
                     f"{r['prefill_ratio']:.2f} | {r['decode_ratio']:.2f} | {r['peak_ratio']:.3f} | "
                     f"{r['budget_rows']} | {r['budget_tokens_per_s_ratio']:.2f} | {r['step_dynamic_s'] * 1e3:.1f} | "
                     f"{r['step_dynamic_default_sdpa_s'] / r['step_dynamic_s']:.2f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2", "llama3-8b"])
    ap.add_argument("--llama-layers", type=int, default=8, help="layers of the llama3-8b shape (32 in the model)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv", nargs="+", default=list(KVS), help="LeanCache configs or preset names")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for gpu_step.json/.md")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (torch backend; a smoke test of this script)")
    ap.add_argument("--profile", metavar="KV", default=None,
                    help="instead of the tables: profile decode steps of DynamicCache (stock and leankit-enabled "
                         "model) and LeanCache KV at the first shape and context")
    args = ap.parse_args(argv)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    if not (torch.cuda.is_available() or args.cpu):
        print("gpu_step: needs a CUDA GPU (nothing measured)")
        return 0
    os.environ.setdefault("LEANKIT_BACKEND", "auto")
    where = "cpu" if args.cpu else "cuda"
    device = torch.cuda.get_device_name() if where == "cuda" else "CPU"
    rows = []
    for shape in args.shapes:
        layers = args.llama_layers if shape == "llama3-8b" else None
        model = random_model(shape, layers, torch.bfloat16, where)
        stock = random_model(shape, layers, torch.bfloat16, where)  # same weights; DynamicCache's
        if args.profile:
            with torch.no_grad():
                text = profile(model, stock, args.contexts[0], args.batch, args.profile)
            print(text)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "gpu_step_profile.txt"), "w") as fh:
                    fh.write(text + "\n")
            return 0
        with torch.no_grad():
            for ctx in args.contexts:
                rows += measure(model, stock, shape, ctx, args.batch, args.kv, args.steps, args.warmup)
                if args.out:  # after every context, so a run cut short keeps what it measured
                    lines = table(rows, device, argv_text)
                    save_results(args.out, "gpu_step", {"device": device, "rows": rows}, lines)
        del model, stock
        if where == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(table(rows, device, argv_text)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
