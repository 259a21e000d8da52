"""Host time of leankit's decode launcher per call, with Triton's own launch stubbed out.

    python bench/launch_overhead.py [--batch 8] [--context 1024] [--calls 2000] [--profile]

On a GPU an eager decode call costs the launcher's Python work plus Triton's launch, and at
small batch and context that, not the kernel, sets a layer's time (results/gpu: eager calls of
110-330 µs around kernels of 8-60 µs on an H200). This measures the first part on any machine:
``paged_attention`` over a synthetic cache (``bench/decode_kernels.py``'s ``decode_call``), page bounds passed in, with
``kernel_for`` returning a stub so nothing runs and no interpreter is involved. Reported per
config as µs per call (best of 5 rounds); ``--profile`` adds a cProfile of the last config.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import CONFIGS, Shape, add_shape_arguments, decode_call


class _Compiled:
    n_regs = 0  # no register count: the launcher keeps its default occupancy


class _Launcher:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Compiled()


def launcher_us(spec: str, shape: Shape, batch: int, context: int, calls: int, rounds: int = 5) -> float:
    """Best-of-``rounds`` µs per ``paged_attention`` call of ``spec`` with the launch stubbed."""
    import leankit_kernels.paged_attention as pa

    call, _ = decode_call(spec, batch, context, shape, torch.device("cpu"))
    real = pa.kernel_for
    pa.kernel_for = lambda kernel, device: _Launcher()
    try:
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - t) / calls)
    finally:
        pa.kernel_for = real
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--profile", action="store_true", help="cProfile the last config's calls")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = Shape(a.head_dim, a.kv_heads, a.group)
    for spec in a.configs:
        us = launcher_us(spec, shape, a.batch, a.context, a.calls)
        print(f"{spec:<10} {us:7.1f} us per decode call (launcher host work, launch stubbed)")
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        launcher_us(a.configs[-1], shape, a.batch, a.context, a.calls, rounds=1)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
