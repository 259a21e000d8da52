"""Compiled CPU kernels for the decode step, built from C on first use.

The torch path of decode attention over live pages (:mod:`leankit.decode_attention`) spends most
of its time outside arithmetic: every code becomes an fp32 element in memory before a matmul can
read it (4x the bytes the page holds, 16x for 2-bit codes), and each 2 KB page is one small GEMM
that MKL runs far below its peak. ``live_attention.c`` reads each page's codes once and uses them
while they sit in registers, the way the Triton kernels do on a GPU.

The C file has no dependencies. It is compiled with the system's C compiler (``$CC``, else
``cc``/``gcc``/``clang``) into ``$LEANKIT_CACHE_DIR`` (default ``~/.cache/leankit``), keyed by the
source, the flags and the CPU's feature flags, and loaded with :mod:`ctypes`. Without a compiler,
or with ``LEANKIT_NATIVE=0``, :func:`kernels` returns ``None`` and leankit runs the torch path,
which computes the same thing (``tests/test_native.py`` checks one against the other).

Threads: where torch runs on GNU OpenMP (its Linux wheels ship ``libgomp.so.1``), the library is
built with ``-fopenmp``. Loaded after torch, its ``libgomp.so.1`` dependency resolves to the copy
torch has already loaded, so the kernels split their pages over torch's own intra-op threads
(``torch.get_num_threads()``). A second OpenMP runtime would keep a second set of workers
spinning against torch's, which measured slower than one thread, so elsewhere the build is serial.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("live_attention.c")
# Reassociation lets the compiler vectorize the dot products' sums (their order then differs from
# a sequential sum by fp32 rounding, as a BLAS's does); NaN and Inf semantics are kept, because
# the key side may read stale bytes in dead slots, which the caller masks afterwards.
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"]
ARCH_FLAGS = ["-march=native"]  # dropped if the compiler refuses it
OPENMP_FLAGS = ["-fopenmp"]  # only where torch's own libgomp is loaded (see the module docstring)

_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    root = os.environ.get("LEANKIT_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leankit"


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), so a shared cache never hands
    one CPU a library built for another."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _torch_libgomp() -> bool:
    """Whether this process has a ``libgomp.so.1`` mapped (torch's, once torch is imported), which
    a ``-fopenmp`` build then shares instead of loading a runtime of its own."""
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith("/libgomp.so.1") for line in f)
    except OSError:
        return False


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str) -> Path:
    """Compile (or find in the cache) the library with the most of ``-march=native`` and OpenMP
    that the compiler accepts."""
    src = SOURCE.read_bytes()
    omp = OPENMP_FLAGS if _torch_libgomp() else []
    last_error = ""
    for extra in dict.fromkeys(tuple(v) for v in (ARCH_FLAGS + omp, omp, ARCH_FLAGS, [])):  # unique, in order
        key = hashlib.sha256(src + " ".join([cc, *FLAGS, *extra, _cpu_features()]).encode()).hexdigest()[:16]
        out = _cache_dir() / f"live_attention-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            run = subprocess.run([cc, *FLAGS, *extra, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                 check=False)
            if run.returncode == 0:
                os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
                return out
            last_error = run.stderr.strip()
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: {last_error}")


class Kernels:
    """The loaded library, with argument checks in front of its two entry points."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int]
        for fn in (lib.lk_key_scores, lib.lk_value_accumulate):
            fn.argtypes, fn.restype = args, ctypes.c_int
        self._key, self._value = lib.lk_key_scores, lib.lk_value_accumulate
        lib.lk_parallel.restype = ctypes.c_int
        self.parallel = bool(lib.lk_parallel())  # splits its pages over torch's threads

    @staticmethod
    def _args(per_head, per_page, head, codes, meta, bits, group_size):
        """Check the operands of either kernel and return the arguments between its first and last
        pointer. ``per_head`` is fp32 ``[BH, R, F]`` (queries or accumulator), ``per_page`` fp32
        ``[L, R, T]`` (scores or probabilities)."""
        n, tokens, nb = codes.shape
        dim = nb * 8 // bits
        tensors = (per_head, per_page, head, codes, meta)
        ok = (per_head.dtype == per_page.dtype == meta.dtype == torch.float32 and head.dtype == torch.int64
              and codes.dtype == torch.uint8 and all(t.device.type == "cpu" for t in tensors)
              and all(t.is_contiguous() for t in (per_head, per_page, head, meta))
              and codes.stride(2) == 1 and codes.stride(1) == nb and head.shape == (n,)
              and dim % group_size == 0 and meta.shape == (n, tokens, dim // group_size * 2)
              and per_head.dim() == 3 and per_head.shape[2] == dim
              and per_page.shape == (n, per_head.shape[1], tokens))
        if not ok:
            raise ValueError("native live-page kernel: unexpected dtypes, devices, shapes or strides "
                             "(want q/acc fp32 [BH, R, F], scores/p fp32 [L, R, T], head int64 [L], "
                             "codes uint8 [L, T, F*bits/8] with contiguous rows, meta fp32 [L, T, 2G])")
        return (head.data_ptr(), codes.data_ptr(), codes.stride(0), n, tokens, dim, per_head.shape[1], bits,
                group_size, meta.data_ptr())

    def key_scores(self, q: torch.Tensor, head: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor,
                   out: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
        """Scores ``out[l, r, t] = sum_g s_g (q[head[l], r]_g . Q_g) + m_g sum(q[head[l], r]_g)``.

        ``q`` fp32 ``[BH, R, F]`` scaled queries; ``head`` int64 ``[L]``; ``codes`` uint8
        ``[L, T, F * bits / 8]`` (rows contiguous, any page stride); ``meta`` fp32 ``[L, T, 2G]``
        (scale, min per group); ``out`` fp32 ``[L, R, T]``, written.
        """
        if self._key(q.data_ptr(), *self._args(q, out, head, codes, meta, bits, group_size), out.data_ptr(),
                     torch.get_num_threads()):
            raise MemoryError("native key_scores: no memory for the kernel's scratch")
        return out

    def value_accumulate(self, p: torch.Tensor, head: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor,
                         acc: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
        """``acc[head[l], r] += sum_t p[l, r, t] (s_g Q_g + m_g)`` per group: the values' share of
        the attention output, unnormalized. ``p`` fp32 ``[L, R, T]`` (0 on dead slots, whose
        scale and min must be 0); ``acc`` fp32 ``[BH, R, F]``, added to."""
        if self._value(p.data_ptr(), *self._args(acc, p, head, codes, meta, bits, group_size), acc.data_ptr(),
                       torch.get_num_threads()):
            raise MemoryError("native value_accumulate: no memory for the kernel's scratch")
        return acc


def kernels() -> Kernels | None:
    """The compiled kernels, built on first call; ``None`` where they cannot be had (no compiler,
    a failed build, or ``LEANKIT_NATIVE=0``), after one warning that says why."""
    if os.environ.get("LEANKIT_NATIVE", "1") == "0":
        return None
    if "kernels" in _state:
        return _state["kernels"]
    with _lock:
        if "kernels" not in _state:
            found = None
            cc = _compiler()
            try:
                if cc is None:
                    raise RuntimeError("no C compiler found (set CC)")
                found = Kernels(_build(cc))
            except (RuntimeError, OSError) as err:
                warnings.warn(f"leankit: compiled CPU kernels unavailable, using the torch path ({err})",
                              RuntimeWarning, stacklevel=2)
            _state["kernels"] = found
    return _state["kernels"]
