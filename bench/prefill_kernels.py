"""Prefill attention kernels on a CUDA GPU: causal attention of a whole prompt over its pages, and
the significance pass (LeanKV §4), against torch SDPA on dense fp16 K/V of the same shape.

    python bench/prefill_kernels.py --head-dim 128 --kv-heads 8 --group 4 --batch 4 --prompts 1024 4096 \
        --out results/gpu

One layer, ``batch`` sequences of ``n`` prompt tokens each, stored in the pages of each config (the
synthetic cache of :mod:`bench.kernels`: random codes, valid metadata, positions ``0 .. n - 1``),
queried at positions ``0 .. n - 1``, so every query sees the keys at or before it (causal). Per
config and prompt length:

- ``prefill us``: ``prefill_attention`` (``_prefill_kernel``), median of CUDA-graph replays;
- ``significance us``: ``received_attention`` (``_received_kernel``, the second pass over the keys
  that turns the saved lse into each key's received probability), eager calls (it reads its page
  counts back to size its grid, which a CUDA graph cannot capture);
- ``prompt significance us`` (per prompt length, the same for every config): a prompt's own
  significance over its exact fp16 keys on the kernel backend
  (``leankit_kernels.prompt_significance.prompt_received``, two launches, graph-timed), and
  ``torch`` the chunked pass it replaced there (``leankit.attention.step_received``, eager);
- ``TFLOP/s``: the causal attention's useful FLOPs (``2 B Hq n^2 F``: ``q k^T`` and ``p v`` over the
  lower triangle) over the prefill time;
- ``x SDPA``: torch SDPA (``is_causal=True``, GQA) on dense fp16 K/V, graph-timed the same way,
  over the prefill time (above 1: the paged kernel is faster).

With ``--tiles M:N:warps:stages ...`` it times the prefill kernel once per tile instead (query
rows, keys per tile, warps, pipeline stages; the first tile is the baseline of ``x first``), with
the largest difference of each tile's output from the first's over that output's magnitude.

Without CUDA it prints the modelled FLOPs and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import Shape, add_shape_arguments, kernel_us, measure_sdpa, save_results, synthetic_cache

CONFIGS = ("FP16", "K8V4", "K4V2", "K8V4-K4V2")
PROMPTS = (1024, 4096)


def causal_flops(batch: int, n: int, shape: Shape) -> int:
    """Useful FLOPs of causal attention over ``n`` tokens: ``q k^T`` and ``p v`` (2 FLOPs a MAC each)
    over the ``n (n + 1) / 2`` visible (query, key) pairs of every query head."""
    return 2 * 2 * batch * shape.kv_heads * shape.group * (n * (n + 1) // 2) * shape.head_dim


def prefill_calls(spec: str, batch: int, n: int, shape: Shape, device):
    """``(prefill, significance, inputs)``: zero-argument calls of one layer's prefill attention and
    its significance pass over a :func:`bench.kernels.synthetic_cache` of ``n`` tokens a sequence, and
    the ``(q, kv, q_pos, scale)`` they read."""
    from leankit_kernels.prefill_attention import prefill_attention, received_attention

    kv, _ = synthetic_cache(spec, batch, n, shape, device)
    hq = shape.kv_heads * shape.group
    q = torch.randn(batch, hq, n, shape.head_dim, device=device, dtype=torch.float16)
    q_pos = torch.arange(n, device=device, dtype=torch.int64).expand(batch, n).contiguous()
    scale = shape.head_dim ** -0.5
    _, lse = prefill_attention(q, kv, q_pos, scale)
    return ((lambda: prefill_attention(q, kv, q_pos, scale)), (lambda: received_attention(q, kv, q_pos, scale, lse)),
            (q, kv, q_pos, scale))


def prompt_significance_calls(batch: int, n: int, shape: Shape, device):
    """``(kernel, torch)``: zero-argument calls of a prompt's significance over its own exact fp16
    keys (positions ``0 .. n - 1``, every token real), by the kernel and by the torch pass."""
    from leankit_kernels.prompt_significance import prompt_received

    from leankit.attention import step_received

    hq = shape.kv_heads * shape.group
    q = torch.randn(batch, hq, n, shape.head_dim, device=device, dtype=torch.float16)
    k = torch.randn(batch, shape.kv_heads, n, shape.head_dim, device=device, dtype=torch.float16)
    pos = torch.arange(n, device=device).expand(batch, n)
    real = torch.ones(batch, n, dtype=torch.bool, device=device)
    scale = shape.head_dim ** -0.5
    return (lambda: prompt_received(q, k, pos, real, scale)), (lambda: step_received(q, k, pos, real, scale, True))


def run(shape: Shape, batch: int, prompts=PROMPTS, configs=CONFIGS, measure_cuda: bool | None = None) -> list[dict]:
    """One row per (prompt length, config); timings only with CUDA."""
    cuda = torch.cuda.is_available() if measure_cuda is None else measure_cuda
    if cuda:
        import triton
    dev = torch.device("cuda") if cuda else None
    rows = []
    for n in prompts:
        flops = causal_flops(batch, n, shape)
        base = measure_sdpa(batch, n, shape, dev, queries=n) if cuda else None
        if cuda:
            sig_kernel, sig_torch = prompt_significance_calls(batch, n, shape, dev)
            prompt_sig = {"prompt_sig_us": kernel_us(sig_kernel),
                          "prompt_sig_torch_us": triton.testing.do_bench(sig_torch, warmup=5, rep=50,
                                                                        return_mode="median") * 1e3}
            del sig_kernel, sig_torch
            print(f"prompt significance B{batch} n{n}: kernel {prompt_sig['prompt_sig_us']:9.1f} us, "
                  f"torch pass {prompt_sig['prompt_sig_torch_us']:9.1f} us", flush=True)
        for spec in configs:
            r = {"config": spec, "batch": batch, "prompt": n, "flops": flops}
            if cuda:
                prefill, significance, _ = prefill_calls(spec, batch, n, shape, dev)
                r["prefill_us"] = kernel_us(prefill)
                # eager: the pass reads its page counts back to size its grid (a host sync that no
                # CUDA graph can capture); at these sizes its kernel dwarfs the launch
                significance()
                r["significance_us"] = triton.testing.do_bench(significance, warmup=10, rep=100,
                                                               return_mode="median") * 1e3
                r["tflops"] = flops / (r["prefill_us"] * 1e-6) / 1e12
                r["sdpa_us"] = base
                r["x_sdpa"] = base / r["prefill_us"]
                r.update(prompt_sig)
                del prefill, significance
                torch.cuda.empty_cache()
                print(f"{spec:<10} B{batch} n{n}: prefill {r['prefill_us']:9.1f} us ({r['tflops']:6.1f} TFLOP/s, "
                      f"{r['x_sdpa']:.2f}x SDPA {base:.1f} us), significance {r['significance_us']:9.1f} us",
                      flush=True)
            else:
                print(f"{spec:<10} B{batch} n{n}: {flops / 1e9:.1f} GFLOP causal (not measured: no CUDA)")
            rows.append(r)
    return rows


def parse_tile(text: str) -> dict:
    """``"M:N:warps:stages"`` -> prefill launch options (powers of two; M, N >= 16)."""
    try:
        m, n, w, st = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tile is BLOCK_M:BLOCK_N:warps:stages, got {text!r}") from None
    pow2 = all(v >= 16 and v & (v - 1) == 0 for v in (m, n))
    if not pow2 or w not in (1, 2, 4, 8, 16) or not 1 <= st <= 5:
        raise argparse.ArgumentTypeError(f"BLOCK_M, BLOCK_N powers of two >= 16, warps 1..16, stages 1..5; got {text!r}")
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}


def tile_sweep(shape: Shape, batch: int, prompts, configs, tiles: list[dict], device=None) -> list[dict]:
    """Prefill time of each tile per (prompt length, config), each launch plan replaced by the tile
    (a tile that does not compile, e.g. too much shared memory, is reported and skipped)."""
    import leankit_kernels.prefill_attention as pf

    dev, real = device or torch.device("cuda"), pf.prefill_config
    rows = []
    try:
        for n in prompts:
            for spec in configs:
                prefill, _, _ = prefill_calls(spec, batch, n, shape, dev)
                ref = base = None
                for tile in tiles:
                    pf.prefill_config = lambda *_a, _t=tile, **_k: dict(_t)
                    name = "{BLOCK_M}:{BLOCK_N}:{num_warps}:{num_stages}".format(**tile)
                    try:
                        out = prefill()[0].float()
                    except Exception as e:  # noqa: BLE001 -- reported; the other tiles still run
                        print(f"{spec:<10} n{n} {name}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
                        continue
                    ref = out if ref is None else ref
                    diff = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    us = kernel_us(prefill)
                    base = base or us
                    rows.append({"config": spec, "batch": batch, "prompt": n, "tile": name, "prefill_us": us,
                                 "tflops": causal_flops(batch, n, shape) / (us * 1e-6) / 1e12, "x_first": base / us,
                                 "rel_diff_vs_first": diff})
                    print(f"{spec:<10} n{n} {name:>12}: {us:9.1f} us {rows[-1]['tflops']:6.1f} TFLOP/s "
                          f"x{base / us:.2f} diff {diff:.1e}", flush=True)
                del prefill
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        pf.prefill_config = real
    return rows


def tiles_markdown(rows: list[dict], title: str) -> list[str]:
    """One table of a tile sweep: each (config, prompt) block with its tiles' times."""
    out = [f"### {title}", "", ("| config | B | prompt | BLOCK_M:BLOCK_N:warps:stages | prefill us | TFLOP/s | x first | "
           "max diff vs first / max out |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['batch']} | {r['prompt']} | {r['tile']} | {r['prefill_us']:.1f} | "
                   f"{r['tflops']:.1f} | {r['x_first']:.2f} | {r['rel_diff_vs_first']:.1e} |")
    return out


def markdown(rows: list[dict], shape: Shape, device: str, command: str) -> list[str]:
    """The results table (measured rows only)."""
    out = [f"# Prefill attention, one layer (device: {device})", "",
           (f"head_dim {shape.head_dim}, {shape.kv_heads} KV heads x {shape.group}, causal, fp16 queries; "
            f"`python bench/prefill_kernels.py {command}`. Medians of CUDA-graph replays (of eager "
            "calls for the significance pass). x SDPA above 1: the "
            "paged kernel is faster than torch SDPA (causal, GQA) on dense fp16 K/V."), "",
           ("| config | B | prompt | prefill us | TFLOP/s | SDPA us | x SDPA | significance us | significance / prefill "
            "| prompt significance us (kernel / torch) |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "prefill_us" in r:
            out.append(f"| {r['config']} | {r['batch']} | {r['prompt']} | {r['prefill_us']:.1f} | {r['tflops']:.1f} | "
                       f"{r['sdpa_us']:.1f} | {r['x_sdpa']:.2f} | {r['significance_us']:.1f} | "
                       f"{r['significance_us'] / r['prefill_us']:.2f} | "
                       f"{r['prompt_sig_us']:.1f} / {r['prompt_sig_torch_us']:.1f} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS), help="prompt lengths (tokens)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--tiles", type=parse_tile, nargs="+", default=None,
                    help="time the prefill kernel per tile BLOCK_M:BLOCK_N:warps:stages instead (the first is the baseline)")
    ap.add_argument("--out", default="", help="also write JSON + markdown results into this folder")
    a = ap.parse_args(argv)
    if a.batch < 1 or min(a.prompts) < 1:
        ap.error("batch and prompt lengths must be positive")
    shape = Shape(a.head_dim, a.kv_heads, a.group)
    if a.tiles:
        if not torch.cuda.is_available():
            print("--tiles needs a CUDA GPU", file=sys.stderr)
            return 2
        rows = tile_sweep(shape, a.batch, a.prompts, a.configs, a.tiles)
    else:
        rows = run(shape, a.batch, tuple(a.prompts), tuple(a.configs))
    if a.out and any("prefill_us" in r for r in rows):
        import triton

        device, cmd = torch.cuda.get_device_name(), " ".join(argv if argv is not None else sys.argv[1:])
        payload = {"device": device, "triton": triton.__version__, "shape": shape.__dict__, "rows": rows}
        if a.tiles:
            name = f"prefill_tiles_d{a.head_dim}_h{a.kv_heads}g{a.group}"
            lines = tiles_markdown(rows, f"{device}, triton {triton.__version__}: `python bench/prefill_kernels.py {cmd}`")
        else:
            name = f"prefill_d{a.head_dim}_h{a.kv_heads}g{a.group}"
            lines = markdown(rows, shape, device, cmd)
        print(f"results: {save_results(a.out, name, payload, lines)}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
