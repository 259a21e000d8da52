"""A lossy prompt's attention on the CPU: the flash kernel (+ the significance pass) vs one pass.

One layer's prompt span (``--batch`` rows with no padding, ``--heads`` query heads over
``--kv-heads`` KV heads, ``--head-dim``), timed three ways on the same inputs, best of
``--repeat`` calls, rotating the order each round so all three see the same machine state:

* ``flash``: PyTorch's CPU flash kernel alone, what a config without significance ran before;
* ``flash + significance``: the flash kernel, then :func:`leankit.prompt_attention.received_from_lse`
  (a second score matmul and ``exp`` over every score), what a LeanKV config ran before;
* ``one pass``: :func:`leankit.prompt_attention.causal_received`, with and without significance,
  what both run now (one score matmul, torch's fused softmax, one value matmul, a column sum).

Each one-pass output is checked against the flash kernel's before it is timed. Report the ratios:

    python bench/prompt_pass.py --context 512 1024 2048 --threads 1
"""

from __future__ import annotations

import argparse

import torch

from leankit.attention import Workspace
from leankit.bench.timing import interleaved_best
from leankit.prompt_attention import _cpu_flash, causal_received, received_from_lse


def measure(batch: int, heads: int, kv_heads: int, head_dim: int, context: int, repeat: int, seed: int = 0) -> dict:
    """Best times (s) of the four ways at one context, after checking the one-pass output."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, context, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, context, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, context, head_dim, generator=gen)
    scale, ws = head_dim ** -0.5, Workspace()
    real = torch.ones(batch, context, dtype=torch.bool)

    def flash_sig():
        _out, lse = _cpu_flash(q, k, v, is_causal=True, scale=scale)
        return received_from_lse(q, k, lse, real, scale, ws)

    out, recv = causal_received(q, k, v, scale, ws)
    torch.testing.assert_close(out, _cpu_flash(q, k, v, is_causal=True, scale=scale)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recv, flash_sig(), rtol=1e-4, atol=1e-5)
    return interleaved_best({"flash": lambda: _cpu_flash(q, k, v, is_causal=True, scale=scale),
                  "flash + significance": flash_sig,
                  "one pass": lambda: causal_received(q, k, v, scale, ws, significance=False),
                  "one pass + significance": lambda: causal_received(q, k, v, scale, ws)}, repeat)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    a = p.parse_args(argv)
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads}")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"batch {a.batch}, {a.heads} query / {a.kv_heads} KV heads, head_dim {a.head_dim}, "
          f"{torch.get_num_threads()} thread(s); best of {a.repeat}; ratios against the flash kernel's column")
    print("| context | one pass vs flash | one pass + significance vs flash + significance |")
    print("|---|---|---|")
    for n in a.context:
        t = measure(a.batch, a.heads, a.kv_heads, a.head_dim, n, a.repeat)
        print(f"| {n} | {t['one pass'] / t['flash']:.2f}x | "
              f"{t['one pass + significance'] / t['flash + significance']:.2f}x |")


if __name__ == "__main__":
    main()
