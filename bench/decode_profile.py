"""One decode call per config over a synthetic cache, for a profiler to look into.

    ncu --kernel-name regex:_decode_kernel --section SpeedOfLight --section WarpStateStats \
        python bench/decode_profile.py --head-dim 128 --kv-heads 8 --group 4 --batch 32 --context 16384

Each config's kernel runs twice (the first call compiles), over the same cache
:mod:`bench.kernels` times (``synthetic_cache``: random codes, valid metadata, page bounds
passed in), so a profiler sees the very launches the benchmark table reports.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernels import CONFIGS, Shape, add_shape_arguments, decode_call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    shape, dev = Shape(a.head_dim, a.kv_heads, a.group), torch.device("cuda")
    for spec in a.configs:
        call, bounds = decode_call(spec, a.batch, a.context, shape, dev)
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        print(f"{spec}: 2 calls, bounds {bounds}", flush=True)
        del call  # the cache it holds
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
