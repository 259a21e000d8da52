"""Decode attention over unified pages: bytes, FLOPs, roofline, and (on CUDA) measured time.

    python bench/decode_kernels.py                       # model only (no GPU needed)
    python bench/decode_kernels.py --check               # + correctness vs leankit's reference first
    python bench/decode_kernels.py --head-dim 128 --kv-heads 8 --group 4 --page-size 4096

Grid: batch {1, 8, 32} x context {1k, 4k, 16k} x configs {FP16, K8V8, K8V4, K4V2, K8V4-K4V2}.
One call = one layer's decode step (one query per sequence, all KV heads).

Byte model (what the decode kernel loads, token by token, from each live slot's page segments:
K data + K meta + V data + V meta + the int32 position; the fp16 score is not read), plus the
page-table entries, the query, the output/lse and the split-K partials. "page MB" counts whole
pages touched (an upper bound including page padding and score segments). The fp16 paged
baseline is the FP16 config through the same kernel: fp16 K and V pages (256 B per token and head
at head_dim 64) plus positions.

Roofline: predicted time = max(bytes / peak bandwidth, FLOPs / peak tensor FLOP/s) with H100 SXM
datasheet peaks (3.35 TB/s HBM3, 989 TFLOP/s dense fp16); the predicted speedup is the ratio of
those times against the FP16 row of the same (batch, context). Decode attention has an
arithmetic intensity of a few FLOP/byte, far below the ~295 FLOP/byte ridge, so it is
bandwidth-bound and the speedup is the byte ratio.

On CUDA, each row is also timed twice (the page bounds are passed in, so no host sync is timed):
replays of a CUDA graph holding one call (``triton.testing.do_bench_cudagraph``: the kernels
alone, as a decode step captured in a graph runs them), and eager calls (``do_bench``: the
Python launcher included, which at small sizes takes longer than the kernels and hides them). The
graph time gives µs, achieved GB/s (modelled bytes / time), % of the device's peak bandwidth,
the fraction of a measured device-to-device copy's bandwidth and the speedup over the FP16 row;
torch SDPA on dense fp16 K/V is timed the same way. Without CUDA the timing columns read "not
measured": nothing is ever estimated and printed as a time.

A second table models the fused ACT->KV recompute kernel (``leankit_kernels.act_to_kv``, one
layer, ``n`` tokens) on real layer shapes from the planner's presets. FLOPs are the planner's own
``ModelSpec.kv_gen_flops_per_token() * n`` (``2 * hidden * 2 * kv_dim``, KVPR Eq. 8 for MHA), so
the kernel and the time model price recomputation with one number; norm, bias and RoPE add
``O(n * hidden)`` and are left out. Bytes: the stacked ``[Wk Wv]`` weights, the norm weights and
bias, the activations once, the RoPE tables and the K/V written. Next to them: page bytes per
token and layer of an ACT block and of FP16 KV pages (``leankit.config.act_kv_token_bytes``), the
KV memory the ACT blocks save for the ``n`` tokens (negative: ACT costs more, the GQA case), and
the recompute FLOPs per byte saved.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

CONFIGS = ("FP16", "K8V8", "K8V4", "K4V2", "K8V4-K4V2")
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 4096, 16384)
H100_BW = 3.35e12  # B/s, H100 SXM HBM3 (datasheet)
H100_FLOPS = 989e12  # FLOP/s, dense fp16 tensor cores (datasheet)
H100_SMS = 132
PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "L40": 0.864e12}


@dataclass
class Shape:
    """One layer's decode shape."""

    head_dim: int = 64
    kv_heads: int = 8
    group: int = 4  # query heads per KV head
    page_size: int | None = None  # None: each config's default (2 KB quantized, 8 KB dense)
    low_frac: float = 0.5  # share of tokens in the low tier for two-tier configs
    dtype_bytes: int = 2  # fp16 model


def layouts(spec: str, shape: Shape):
    """The tier page layouts of ``spec`` (leankit's own byte model)."""
    from leankit.config import KVConfig
    from leankit.pages import PageLayout

    cfg = KVConfig.parse(spec, page_size=shape.page_size)
    dt = torch.float16 if shape.dtype_bytes == 2 else torch.float32
    return tuple(PageLayout.build(cfg, t, shape.head_dim, dt) for t in range(len(cfg.tiers)))


def page_text(shape: Shape) -> str:
    """The page size of a run, in words."""
    if shape.page_size:
        return f"{shape.page_size}-byte pages"
    return "each config's default pages (2 KB quantized, 8 KB dense)"


def tier_tokens(ctx: int, n_tiers: int, low_frac: float) -> list[int]:
    """Tokens per tier for one (sequence, head)."""
    if n_tiers == 1:
        return [ctx]
    low = round(ctx * low_frac)
    return [ctx - low, low]


def model_call(spec: str, batch: int, ctx: int, shape: Shape) -> dict:
    """Modelled bytes and FLOPs of one decode call (see the module docstring)."""
    lays = layouts(spec, shape)
    f, g, h = shape.head_dim, shape.group, shape.kv_heads
    read = pages = page_bytes = 0
    for lay, n in zip(lays, tier_tokens(ctx, len(lays), shape.low_frac)):
        p = math.ceil(n / lay.tokens)
        per_tok = sum(lay.seg_bytes[i] for i in (0, 1, 2, 3, 5))  # K, K meta, V, V meta, position
        read += n * per_tok + p * 4  # + page-table entries
        pages += p
        page_bytes += p * lay.page_size
    from leankit_kernels.paged_attention import choose_splits

    bh = batch * h
    s = choose_splits(bh, pages, g, f, lays[0].page_size, H100_SMS)  # the launcher's own split rule
    io = g * f * shape.dtype_bytes * 2 + 4 * g + 16  # q in, out + lse out, table counters
    partial = (s * g * (f + 2) * 4 * 2) if s > 1 else 0  # split partials written + read by the reduce
    total = bh * (read + io + partial)
    flops = bh * 4 * g * f * ctx  # q k^T and p v (useful MACs x 2)
    return {"bytes": total, "page_bytes": bh * page_bytes, "flops": flops, "splits": s, "pages": pages,
            "token_bytes": read / ctx}


def roofline_time(m: dict) -> float:
    return max(m["bytes"] / H100_BW, m["flops"] / H100_FLOPS)


# ---------------------------------------------------------------------------- CUDA measurement
def synthetic_cache(spec: str, batch: int, ctx: int, shape: Shape, device):
    """A filled layer cache for timing: random codes, valid fp16 metadata and dense values."""
    from leankit.allocator import FreePageList
    from leankit.attention import PagedKV
    from leankit.page_table import BidirectionalPageTable
    from leankit.pages import PagePool

    lays = layouts(spec, shape)
    h = shape.kv_heads
    counts = tier_tokens(ctx, len(lays), shape.low_frac)
    need = [math.ceil(n / lay.tokens) for lay, n in zip(lays, counts)]
    total_pages = batch * h * sum(need) + 1
    pool = PagePool(total_pages, lays[0].page_size, device)
    pool.storage.random_(0, 256)
    fl = FreePageList(total_pages, device)
    row = max(sum(need) + 1, math.ceil(ctx / lays[0].tokens) + 1)
    table = BidirectionalPageTable(1, batch, h, row, device)
    extra = torch.zeros((2, 1, batch, h), dtype=torch.int32, device=device)
    for t, p in enumerate(need):
        extra[t] = p
    table.grow(extra, fl)
    start = 0
    for t, (lay, n) in enumerate(zip(lays, counts)):
        table.lens[t] = n
        ids, _ = table.tier_pages(t, 0)
        ids = ids.reshape(-1).long()
        st = pool.storage
        for side, bits in (("k", lay.precision.k_bits), ("v", lay.precision.v_bits)):
            if bits >= 16:  # random bytes may be NaN/Inf as fp16: write real values
                off, nb = lay.offset(f"{side}_data"), lay.seg_bytes[0 if side == "k" else 2]
                vals = torch.randn(ids.numel(), lay.tokens * nb // 2, device=device, dtype=torch.float16)
                st[ids, off: off + lay.tokens * nb] = vals.view(torch.uint8)
            else:
                off, nb = lay.offset(f"{side}_meta"), lay.seg_bytes[1 if side == "k" else 3]
                meta = torch.empty(ids.numel(), lay.tokens * nb // 4, 2, device=device, dtype=torch.float16)
                meta[..., 0] = 2.0 / ((1 << bits) - 1)
                meta[..., 1] = -1.0
                st[ids, off: off + lay.tokens * nb] = meta.view(torch.uint8).reshape(ids.numel(), -1)
        pos = (torch.arange(lay.tokens * need[t], device=device, dtype=torch.int32) + start)
        po = lay.offset("position")
        st[ids, po: po + 4 * lay.tokens] = pos.view(need[t], lay.tokens).repeat(batch * h, 1).view(torch.uint8)
        start += n
    kv = PagedKV(pool, lays, table, 0)
    bounds = (need[0], need[1] if len(need) > 1 else 0, sum(need))
    return kv, bounds


def check_correctness(shape: Shape, device) -> None:
    """Small caches of every config: kernel vs :func:`leankit.attention.paged_attention_ref`."""
    from leankit_kernels.paged_attention import paged_attention
    from leankit_kernels.testing import assert_close_normwise, build_paged_kv, random_queries

    from leankit.attention import paged_attention_ref

    dt = torch.float16 if shape.dtype_bytes == 2 else torch.float32
    gen = torch.Generator().manual_seed(0)
    for spec in CONFIGS:
        fc = build_paged_kv(spec, 2, 3, shape.head_dim, torch.tensor([300, 77]), dtype=dt, prune_frac=0.1,
                            page_size=layouts(spec, shape)[0].page_size, generator=gen, device=device)
        q, q_pos = random_queries(2, 3 * shape.group, 1, shape.head_dim, fc.ctx.to(device), dtype=dt,
                                  generator=gen, device=device)
        out, lse = paged_attention(q, fc.kv, q_pos, shape.head_dim ** -0.5)
        ref, ref_lse = paged_attention_ref(q, fc.kv, q_pos, shape.head_dim ** -0.5)
        assert_close_normwise(out, ref, dt, f"{spec} out")
        assert_close_normwise(lse, ref_lse, dt, f"{spec} lse")
        print(f"check {spec:<10} ok (max |out - ref| = {(out.float() - ref.float()).abs().max():.2e})")


def time_call(fn) -> tuple[float | None, float]:
    """Median µs of ``fn`` as CUDA-graph replays (the kernels alone; None, with the reason printed,
    when ``fn`` cannot be captured) and as eager calls (launch overhead included); ``fn`` runs once
    first, outside the timings (compiles, allocations)."""
    import triton

    fn()
    torch.cuda.synchronize()
    try:
        graph_us = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 -- reported, and the eager time still stands
        print(f"  (no CUDA-graph timing: {type(e).__name__}: {str(e)[:200]})")
        graph_us = None
    eager_us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    return graph_us, eager_us


def decode_call(spec: str, batch: int, ctx: int, shape: Shape, device):
    """One layer's decode call over a :func:`synthetic_cache` (random fp16 queries at position
    ``ctx``, page bounds passed in, so the launch reads nothing back): ``(call, page bounds)``,
    ``call`` a zero-argument function that runs ``paged_attention`` once."""
    from leankit_kernels.paged_attention import paged_attention

    kv, bounds = synthetic_cache(spec, batch, ctx, shape, device)
    hq = shape.kv_heads * shape.group
    q = torch.randn(batch, hq, 1, shape.head_dim, device=device, dtype=torch.float16)
    q_pos = torch.full((batch, 1), ctx, device=device, dtype=torch.int64)
    scale = shape.head_dim ** -0.5
    return (lambda: paged_attention(q, kv, q_pos, scale, page_bounds=bounds)), bounds


def measure(spec: str, batch: int, ctx: int, shape: Shape, device) -> tuple[float, float]:
    """Median µs of one decode call: CUDA-graph replays and eager calls (:func:`time_call`)."""
    return time_call(decode_call(spec, batch, ctx, shape, device)[0])


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in B/s (bytes read + written per ``copy_``)."""
    import triton

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def kernel_us(fn) -> float:
    """Median µs of ``fn`` as CUDA-graph replays, or as eager calls where it cannot be captured
    (:func:`time_call`)."""
    graph_us, eager_us = time_call(fn)
    return graph_us if graph_us is not None else eager_us


def measure_sdpa(batch: int, ctx: int, shape: Shape, device, queries: int = 1) -> float:
    """Median µs (:func:`kernel_us`) of torch SDPA for ``queries`` queries a sequence over dense
    fp16 K/V of ``ctx`` tokens of the same shape (GQA): one decode query, or with ``queries ==
    ctx`` a causal prefill."""
    hq = shape.kv_heads * shape.group
    q = torch.randn(batch, hq, queries, shape.head_dim, device=device, dtype=torch.float16)
    k = torch.randn(batch, shape.kv_heads, ctx, shape.head_dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    fn = torch.nn.functional.scaled_dot_product_attention
    return kernel_us(lambda: fn(q, k, v, is_causal=queries > 1, enable_gqa=True))


def add_shape_arguments(ap: argparse.ArgumentParser, head_dim: int = 128) -> None:
    """``--head-dim``, ``--kv-heads`` and ``--group`` (one layer's :class:`Shape`) for a bench script."""
    ap.add_argument("--head-dim", type=int, default=head_dim)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")


def save_results(folder: str, name: str, payload: dict, lines: list[str]) -> str:
    """``payload`` as ``folder/name.json`` and ``lines`` as ``folder/name.md``; returns the stem."""
    import json

    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, name)
    with open(stem + ".json", "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    with open(stem + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return stem


def peak_bandwidth(device) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, bw in PEAK_BW.items():
        if key in name:
            return bw
    return None


# ---------------------------------------------------------------------------- report
def run(shape: Shape, batches=BATCHES, contexts=CONTEXTS, configs=CONFIGS, measure_cuda: bool | None = None,
        out=sys.stdout) -> list[dict]:
    """Build (and print) the table; returns its rows."""
    cuda = torch.cuda.is_available() if measure_cuda is None else measure_cuda
    device = torch.device("cuda") if cuda else None
    peak = peak_bandwidth(device) if cuda else None
    copy_bw = copy_bandwidth(device) if cuda else None
    rows = []
    for b in batches:
        for n in contexts:
            base = None
            for spec in configs:
                m = model_call(spec, b, n, shape)
                r = {"config": spec, "batch": b, "context": n, **m, "pred_us": roofline_time(m) * 1e6}
                if cuda:
                    graph_us, r["eager_us"] = measure(spec, b, n, shape, device)
                    r["timing"] = "graph" if graph_us is not None else "eager"
                    r["us"] = graph_us if graph_us is not None else r["eager_us"]
                    torch.cuda.empty_cache()
                    r["gbps"] = m["bytes"] / (r["us"] * 1e-6) / 1e9
                    r["peak_pct"] = 100 * r["gbps"] * 1e9 / peak if peak else None
                    r["copy_frac"] = r["gbps"] * 1e9 / copy_bw
                    if spec == "FP16":
                        sdpa_us = measure_sdpa(b, n, shape, device)
                    r["sdpa_us"] = sdpa_us
                    r["speedup_sdpa"] = sdpa_us / r["us"]
                if spec == "FP16":
                    base = r
                r["byte_ratio"] = r["bytes"] / base["bytes"] if base else float("nan")
                r["pred_speedup"] = base["pred_us"] / r["pred_us"] if base else float("nan")
                if cuda and base:
                    r["speedup"] = base["us"] / r["us"]
                rows.append(r)
    hdr = (f"{'config':<10} {'B':>3} {'ctx':>6} {'B/tok/head':>10} {'read MB':>9} {'page MB':>9} {'GFLOP':>7} "
           f"{'FLOP/B':>6} {'x FP16':>6} {'roofline us':>11} {'pred spdup':>10} | {'us':>12} {'GB/s':>12} "
           f"{'% peak':>12} {'speedup':>12} {'eager us':>9}")
    print(f"decode attention, one layer: head_dim {shape.head_dim}, {shape.kv_heads} KV heads x {shape.group} "
          f"query heads, {page_text(shape)}, low tier {shape.low_frac:.0%} of tokens in two-tier configs",
          file=out)
    print(f"device: {torch.cuda.get_device_name(device) if cuda else 'no CUDA device: timing not measured'}",
          file=out)
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    nm = "not measured"
    for r in rows:
        if cuda:
            pct = f"{r['peak_pct']:.0f}%" if r.get("peak_pct") else "n/a"
            t = f"{r['us']:>12.1f} {r['gbps']:>12.0f} {pct:>12} {r['speedup']:>11.2f}x {r['eager_us']:>9.1f}"
        else:
            t = f"{nm:>12} {nm:>12} {nm:>12} {nm:>12}"
        print(f"{r['config']:<10} {r['batch']:>3} {r['context']:>6} {r['token_bytes']:>10.1f} "
              f"{r['bytes'] / 1e6:>9.2f} {r['page_bytes'] / 1e6:>9.2f} {r['flops'] / 1e9:>7.3f} "
              f"{r['flops'] / r['bytes']:>6.2f} {r['byte_ratio']:>6.3f} {r['pred_us']:>11.2f} "
              f"{r['pred_speedup']:>9.2f}x | {t}", file=out)
    return rows


# ---------------------------------------------------------------------------- ACT -> KV recompute
ACT_MODELS = ("opt-13b", "opt-6.7b", "llama-3-8b", "smollm2-135m")
ACT_TOKENS = (32, 512, 4096)


def act_to_kv_call(model: str, n: int, page_size: int = 2048, dtype_bytes: int = 2) -> dict:
    """Modelled FLOPs and bytes of one ``act_to_kv`` launch (one layer, ``n`` tokens), and the
    page bytes per token of ACT against FP16 KV (see the module docstring)."""
    from leankit.config import KVConfig, act_kv_token_bytes
    from leankit.planner.model_spec import get_model

    spec = get_model(model)
    d, kv_dim, f = spec.hidden, spec.kv_dim, spec.head_dim
    rope = not spec.bias  # the OPT presets: learned positions, biases; the others: RoPE, no bias
    flops = n * spec.kv_gen_flops_per_token()
    weights = 2 * kv_dim * d + (2 * kv_dim if spec.bias else 0) + d * (2 if spec.bias else 1)
    moved = dtype_bytes * (weights + n * d + (n * f if rope else 0) + 2 * n * kv_dim)
    per_tok = act_kv_token_bytes(KVConfig.parse("FP16", page_size=page_size), d, spec.num_kv_heads, f, dtype_bytes)
    saved = n * (per_tok["kv"] - per_tok["act"])
    return {"model": spec.name, "tokens": n, "flops": flops, "bytes": moved, "act_tok": per_tok["act"],
            "kv_tok": per_tok["kv"], "saved": saved, "flop_per_saved": flops / saved if saved > 0 else float("nan"),
            "pred_us": max(moved / H100_BW, flops / H100_FLOPS) * 1e6}


def measure_act_to_kv(model: str, n: int, device) -> tuple[float | None, float]:
    """Median µs of one ``act_to_kv`` launch on random fp16 weights of the model's layer shape
    (CUDA-graph replays, eager calls: :func:`time_call`)."""
    from leankit_kernels.act_to_kv import act_to_kv

    from leankit.planner.model_spec import get_model
    from leankit.recompute import ActToKVParams, rope_tables

    spec = get_model(model)
    d, h, f = spec.hidden, spec.num_kv_heads, spec.head_dim
    dt = torch.float16
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    params = ActToKVParams(
        norm="layer" if spec.bias else "rms", norm_weight=r(d), norm_bias=r(d) if spec.bias else None,
        norm_eps=1e-5, weight=r(2 * h * f, d) * d ** -0.5, bias=r(2 * h * f) if spec.bias else None,
        num_kv_heads=h, head_dim=f,
        inv_freq=None if spec.bias else 1.0 / 10000 ** (torch.arange(0, f, 2, device=device).float() / f))
    act = r(n, d)
    pos = torch.arange(n, device=device)
    rope = rope_tables(params, pos) if params.has_rope else None
    return time_call(lambda: act_to_kv(act, pos, params, rope=rope))


def run_act_to_kv(models=ACT_MODELS, tokens=ACT_TOKENS, measure_cuda: bool | None = None,
                  out=sys.stdout) -> list[dict]:
    """Build (and print) the ACT->KV table; returns its rows."""
    cuda = torch.cuda.is_available() if measure_cuda is None else measure_cuda
    rows = []
    for m in models:
        for n in tokens:
            r = act_to_kv_call(m, n)
            if cuda:
                r["us"], r["eager_us"] = measure_act_to_kv(m, n, torch.device("cuda"))
            rows.append(r)
    print("\nACT->KV recompute (leankit_kernels.act_to_kv), one layer, fp16, 2048-byte pages", file=out)
    hdr = (f"{'model':<13} {'n':>5} {'GFLOP':>8} {'MB moved':>9} {'FLOP/B':>7} {'roofline us':>11} "
           f"{'ACT B/tok':>9} {'KV B/tok':>9} {'saved MB':>9} {'FLOP/B saved':>12} | {'graph us':>12} {'eager us':>9}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for r in rows:
        if cuda:
            t = f"{r['us']:>12.1f}" if r["us"] is not None else f"{'no graph':>12}"
            t += f" {r['eager_us']:>9.1f}"
        else:
            t = f"{'not measured':>12}"
        print(f"{r['model']:<13} {r['tokens']:>5} {r['flops'] / 1e9:>8.3f} {r['bytes'] / 1e6:>9.2f} "
              f"{r['flops'] / r['bytes']:>7.1f} {r['pred_us']:>11.2f} {r['act_tok']:>9.1f} {r['kv_tok']:>9.1f} "
              f"{r['saved'] / 1e6:>9.3f} {r['flop_per_saved']:>12.1f} | {t}", file=out)
    return rows


def write_results(rows: list[dict], shape: Shape, folder: str) -> str:
    """Write ``rows`` as JSON and a markdown table into ``folder``; returns the file stem."""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    lines = [f"# Decode attention, one layer (device: {dev})", "",
             (f"head_dim {shape.head_dim}, {shape.kv_heads} KV heads x {shape.group}, {page_text(shape)}. "
              "`python bench/decode_kernels.py`: us = median of CUDA-graph replays of one call "
              "(`triton.testing.do_bench_cudagraph`, the kernels alone); eager us = median of eager calls "
              "(`do_bench`, the Python launcher included). GB/s counts modelled bytes over the graph time; "
              "of copy BW = fraction of a measured device-to-device copy's bandwidth; x FP16 = speedup over the "
              "FP16 paged kernel; x SDPA = speedup over torch SDPA on dense fp16 K/V (graph-timed too)."), "",
             "| config | B | ctx | us | GB/s | of copy BW | x FP16 paged | x SDPA | bytes / FP16 | eager us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us" in r:
            us = f"{r['us']:.1f}" + ("" if r.get("timing", "graph") == "graph" else " (eager)")
            lines.append(f"| {r['config']} | {r['batch']} | {r['context']} | {us} | {r['gbps']:.0f} | "
                         f"{r['copy_frac']:.2f} | {r['speedup']:.2f} | {r['speedup_sdpa']:.2f} | {r['byte_ratio']:.3f} | "
                         f"{r['eager_us']:.1f} |")
        else:
            lines.append(f"| {r['config']} | {r['batch']} | {r['context']} | not measured | | | | | "
                         f"{r['byte_ratio']:.3f} | |")
    name = f"decode_d{shape.head_dim}_h{shape.kv_heads}g{shape.group}_p{shape.page_size or 'default'}"
    return save_results(folder, name, {"device": dev, "shape": shape.__dict__, "rows": rows}, lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap, head_dim=64)
    ap.add_argument("--page-size", type=int, default=None,
                    help="bytes per page for every config (default: each config's own, 2 KB quantized, 8 KB dense)")
    ap.add_argument("--low-frac", type=float, default=0.5, help="low-tier share of tokens (two-tier configs)")
    ap.add_argument("--check", action="store_true",
                    help="first compare the kernel with leankit's reference (CPU: through the Triton interpreter)")
    ap.add_argument("--out", default="", help="also write JSON + markdown results into this folder")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    a = ap.parse_args(argv)
    shape = Shape(a.head_dim, a.kv_heads, a.group, a.page_size, a.low_frac)
    if a.check:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        check_correctness(shape, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rows = run(shape, batches=tuple(a.batches), contexts=tuple(a.contexts))
    if a.out:
        print(f"results: {write_results(rows, shape, a.out)}.json/.md")
    run_act_to_kv()
    k8v4 = [r["byte_ratio"] for r in rows if r["config"] == "K8V4"]
    print(f"\nK8V4 / FP16 modelled bytes: {min(k8v4):.3f} .. {max(k8v4):.3f} "
          f"({model_call('K8V4', 1, 1024, shape)['token_bytes']:.0f} vs "
          f"{model_call('FP16', 1, 1024, shape)['token_bytes']:.0f} B per token and head, read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
