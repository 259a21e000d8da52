"""A steady allocator for the benchmarks: freed memory is reused, not unmapped and faulted in again.

glibc's malloc serves a large block (above ``M_MMAP_THRESHOLD``, adjusted at run time up to
32 MiB) with a fresh ``mmap`` and unmaps it when it is freed, and it returns a freed heap top to
the OS past ``M_TRIM_THRESHOLD``. A model's big temporaries (SmolLM2's MLP activations at
8 x 1024 tokens are 50 MB each, its prompt logits 1.6 GB) are then faulted in page by page on
every use. How many of them fault depends on what the heap held before, so it changes from one
prefill to the next: measured on one prompt batch, 0.02 to 2.5 million minor faults per prefill,
up to a second of a 10-second prefill, landing on DynamicCache or LeanCache by the luck of the
order. Raising both thresholds keeps freed blocks in the heap for the next use, so each cache's
time is its own work. The benchmarks do this for their whole run (``--default-malloc`` opts
out) and report each prefill's page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
PINNED_BYTES = 2**31 - 1  # the largest value mallopt takes (an int): blocks below it come from the heap


def pin_glibc_malloc() -> str | None:
    """Raise glibc's mmap and trim thresholds to :data:`PINNED_BYTES` for this process.

    Returns a sentence for the results, or ``None`` where the C library is not glibc or refuses.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None  # not glibc: its allocator has no such knobs here
    version.restype = ctypes.c_char_p
    if not (libc.mallopt(M_MMAP_THRESHOLD, PINNED_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, PINNED_BYTES)):
        return None
    return (f"Allocator: glibc {version().decode()} malloc with its mmap and trim thresholds raised to 2 GiB, "
            "so freed blocks are reused instead of faulted in again (leankit.bench.malloc; --default-malloc "
            "leaves them as they are).")


def minor_faults() -> int:
    """Minor page faults of this process so far (first touches of fresh memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
