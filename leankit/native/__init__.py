"""Compiled CPU kernels (decode step, page accounting, LeanKV prompt store), built from C on first use.

The torch path of decode attention over live pages (:mod:`leankit.decode_attention`) spends most
of its time outside arithmetic: every code becomes an fp32 element in memory before a matmul can
read it (4x the bytes the page holds, 16x for 2-bit codes), and each 2 KB page is one small GEMM
that MKL runs far below its peak. ``live_attention.c`` reads each page in place in the pool, through
its id, and dequantizes each token into a small scratch row that it uses at once, the way the
Triton kernels use codes in registers on a GPU; the masks, the softmax's maxima and sums, and the
running-significance update of the live slots run inside the same loops instead of as a dozen
tensor ops per tier. ``finish_decode.c`` adds a decode step's own token (exact key and value) to
pass 2's sums, merges the two softmaxes and normalizes, in place of about twenty small tensor ops
per layer. ``store_tokens.c`` quantizes a step's new tokens straight into their slots.
``decode_step.c`` composes them into one call per layer for a decode step's attention (list the
live pages, both passes, finish) and one for its store (find each new token's slot from the page
table, store, advance the counts), so a layer's fixed work is not a string of small tensor ops.
``page_grants.c`` does the bidirectional page table's accounting (plan, grant, hand-over of
emptied high pages to the low side, recycle) in one pass each, and ``prompt_store.c`` a LeanKV
prompt's layer: the prompt-phase classification per head and the store of each tier's kept tokens
at their ranked slots, the CPU twins of ``leankit_kernels.prompt_plan`` and
``leankit_kernels.quant.store_step_tokens``, and the whole layer (rule, page grant, both tiers'
stores, recycle) in one call.
Dense (unquantized) sides are read and stored in place too, in the model's dtype
(:data:`DENSE_FORMATS`), so the lossless ``FP16`` config takes the same path.

The C files have no dependencies. They are compiled together, with the system's C compiler
(``$CC``, else ``cc``/``gcc``/``clang``), into one library in ``$LEANKIT_CACHE_DIR`` (default:
leankit's cache directory, ``$LEANKIT_CACHE``, ``$XDG_CACHE_HOME/leankit`` or ``~/.cache/leankit``), keyed by the sources and headers, the flags and the CPU's feature flags,
and loaded with :mod:`ctypes`. Without a compiler, or with ``LEANKIT_NATIVE=0``, :func:`kernels`
returns ``None`` and leankit runs the torch path, which computes the same thing
(``tests/test_native.py`` checks one against the other).

Threads: where torch runs on GNU OpenMP (its Linux wheels ship ``libgomp.so.1``) and the compiler
is GCC, the library is built with ``-fopenmp``. Loaded after torch, its ``libgomp.so.1`` dependency
resolves to the copy torch has already loaded, so the kernels split their pages over torch's own
intra-op threads (``torch.get_num_threads()``). A second OpenMP runtime would keep a second set of
workers spinning against torch's, which measured slower than one thread, so elsewhere the build is
serial. That includes Clang (and compilers built on it): its ``-fopenmp`` emits calls into LLVM's
runtime, ``libomp.so.5``, which libgomp does not provide, so where libomp is installed it would be
loaded next to torch's libgomp (:func:`_gnu_openmp`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..outputs import share_as_umask_allows
from ..quant import NonFiniteKVError

SOURCE_DIR = Path(__file__).parent  # the C files (compiled together into one library) and their headers
# The kernels' error codes (errors.h): the exception each raises here, and what it means.
ERRORS = {
    -1: (MemoryError, "no memory for the kernel's scratch"),
    -2: (ValueError, "a page id lies outside the pool"),
    -3: (ValueError, "pages are not grouped by head in ascending order"),
    -4: (ValueError, "more live pages than the output holds"),
    -5: (NonFiniteKVError, "KV states contain NaN or Inf; refusing to store them in the cache"),
    -6: (NonFiniteKVError, "KV values exceed the fp16 range of the quantization metadata"),
    -7: (ValueError, "a significance update needs the slots' positions, validity, scores and row weights"),
    -8: (NonFiniteKVError, "query or key states contain NaN or Inf; refusing to store them in the cache"),
    # The page accounting's codes (page_grants.c); leankit.page_table raises its own words for them.
    -9: (ValueError, "a page demand is negative"),
    -10: (ValueError, "a page grant would give a row more pages than it has columns"),
    -11: (RuntimeError, "the free list holds fewer pages than the grant asks for"),
    -12: (RuntimeError, "releasing more pages than are in use: double free"),
    -13: (ValueError, "a hand-over or plan names a layer, or moves pages, outside the page table"),
}
# Codes the page accounting returns for its caller to word (leankit.page_table).
NEGATIVE_DEMAND, ROW_FULL, POOL_SHORT = -9, -10, -11
# Element formats of a dense (unquantized) page side, as the kernels' ``bits`` argument (formats.h):
# the model's own values, read as they are. Quantized sides pass their code width (1, 2, 4 or 8).
DENSE_FORMATS = {torch.float16: 16, torch.bfloat16: 17, torch.float32: 32}
_DENSE_SIZE = {fmt: torch.empty((), dtype=dtype).element_size() for dtype, fmt in DENSE_FORMATS.items()}


def side_format(bits: int, dense_dtype: torch.dtype) -> int | None:
    """The kernels' ``bits`` argument for a page side stored at ``bits`` (16 = unquantized, held in
    ``dense_dtype``), or ``None`` when the kernels cannot read that dtype."""
    return bits if bits < 16 else DENSE_FORMATS.get(dense_dtype)


# Reassociation lets the compiler vectorize the dot products' sums (their order then differs from
# a sequential sum by fp32 rounding, as a BLAS's does); NaN and Inf semantics are kept, because
# the key side may read stale bytes in dead slots, which the caller masks afterwards.
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"]
ARCH_FLAGS = ["-march=native"]  # dropped if the compiler refuses it
OPENMP_FLAGS = ["-fopenmp"]  # only with GCC, where torch's own libgomp is loaded (see the module docstring)
# Seconds one compiler run may take. A compiler that never returns (a wrapper waiting on a lock or a
# network, a stopped job) must not hang the first decode step: past this the build counts as failed
# and leankit runs the torch path. The build takes seconds of CPU (about 1.5 min measured on a
# loaded 2-core machine), so this is far above a real build.
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    """Where built kernels go: ``$LEANKIT_CACHE_DIR`` (these builds alone), else leankit's cache
    directory (``$LEANKIT_CACHE``, ``$XDG_CACHE_HOME/leankit`` or ``~/.cache/leankit``)."""
    root = os.environ.get("LEANKIT_CACHE_DIR")
    if root:
        return Path(root)
    from ..models import cache_dir

    return cache_dir()


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
    """The compiler command, as a shell-quoted string: ``$CC`` (which may carry arguments, as
    ``ccache gcc`` or ``gcc -m64`` do) with its program found on ``PATH``, else ``cc``, ``gcc`` or
    ``clang``; ``None`` where none is found. A ``$CC`` that names no program on ``PATH`` is said
    in a warning before the others are tried, so the user learns which compiler built the kernels."""
    chosen = os.environ.get("CC")
    for command in (chosen, "cc", "gcc", "clang"):
        try:
            words = shlex.split(command or "")
        except ValueError:  # unbalanced quotes: not a command
            words = []
        found = shutil.which(words[0]) if words else None
        if found:
            return shlex.join([found, *words[1:]])
        if command is chosen and (chosen or "").strip():
            warnings.warn(f"leankit: $CC ({chosen!r}) is not a program on PATH; trying cc, gcc and clang "
                          "for the compiled CPU kernels", RuntimeWarning, stacklevel=3)
    return None


@functools.cache
def _gnu_openmp(cc: str) -> bool:
    """Whether ``cc``'s ``-fopenmp`` binds to GNU OpenMP (``libgomp``): GCC does; Clang and the
    compilers built on it (Intel's icx, AMD's aocc) define ``__clang__`` and call LLVM's runtime."""
    try:
        run = subprocess.run([*shlex.split(cc), "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                             text=True, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    macros = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("#define ") and
              len(line.split()) > 1}
    return run.returncode == 0 and "__GNUC__" in macros and not macros & {"__clang__", "__INTEL_COMPILER"}


def _build(cc: str, source_dir: Path | None = None) -> Path:
    """Compile (or find in the cache) the library of the C sources in ``source_dir`` (default:
    :data:`SOURCE_DIR`, read at call time) with the most of ``-march=native`` and OpenMP that the
    compiler accepts. A build that had to drop flags warns with the compiler's first error: a
    portable build runs the passes several times slower, and a source that fails only with
    ``-march=native`` (a vector path) would otherwise go unnoticed."""
    source_dir = SOURCE_DIR if source_dir is None else source_dir
    sources = sorted(source_dir.glob("*.c"))
    src = b"".join(path.name.encode() + path.read_bytes() for path in sorted(source_dir.glob("*.[ch]")))
    omp = OPENMP_FLAGS if _torch_libgomp() and _gnu_openmp(cc) else []
    wanted = ARCH_FLAGS + omp
    last_error, first_error = "", ""
    for extra in dict.fromkeys(tuple(v) for v in (wanted, omp, ARCH_FLAGS, [])):  # unique, in order
        key = hashlib.sha256(src + " ".join([cc, *FLAGS, *extra, _cpu_features()]).encode()).hexdigest()[:16]
        out = _cache_dir() / f"leankit_native-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            try:
                # errors="replace": a compiler's message in another encoding must not raise here
                run = subprocess.run([*shlex.split(cc), *FLAGS, *extra, "-o", tmp, *map(str, sources)],
                                     capture_output=True, text=True, errors="replace", check=False,
                                     timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{cc} did not finish building the kernels in {source_dir.name} within "
                                   f"{BUILD_TIMEOUT_S} s") from None
            if run.returncode == 0:
                # mkstemp's 0600 survives the linker's rewrite (it adds only the execute bits, so 0711):
                # other users of a shared cache could not load the library and would fall back to the
                # torch path. A built library is readable as the umask allows, as the converted models are.
                share_as_umask_allows(tmp, 0o755)
                os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
                if first_error:
                    dropped = " ".join(f for f in wanted if f not in extra)
                    warnings.warn(f"leankit: compiled CPU kernels built without {dropped} ({first_error})",
                                  RuntimeWarning, stacklevel=3)
                return out
            last_error = run.stderr.strip() or f"exit status {run.returncode}, no message"
            lines = last_error.splitlines() or ["no message"]
            first_error = first_error or next((ln for ln in lines if "error" in ln), lines[0])[:300]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cc} could not build the kernels in {source_dir.name}: {last_error}")


@dataclass(frozen=True)
class PoolPages:
    """Pages of one tier read in place from a page pool: which pages, whose, and where in a page
    each segment lies. Built by :meth:`Kernels.list_pages`.

    ``storage`` is the pool, uint8 ``[num_pages, page_bytes]`` and contiguous; ``page_id``,
    ``head`` and ``rank`` are int64 ``[L]``: the pool id of each page, the (sequence, KV head) row
    it belongs to (grouped by head, ascending) and its rank among that head's pages.
    ``offsets`` maps segment names (``k_data``, ``k_meta``, ``v_data``, ``v_meta``, ``score``,
    ``position``) to their byte offset inside a page; a token's entry of a segment follows at
    ``offset + t * bytes_per_token``.
    """

    storage: torch.Tensor
    page_id: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor
    tokens: int
    offsets: dict


class DecodeTier(ctypes.Structure):
    """One tier of one layer as :meth:`Kernels.decode_attention` reads it (``struct
    lk_decode_tier`` in ``decode_step.c``): the layer's page-table rows and counts, the tier's page
    geometry, and the buffers its live pages are listed and scored into. ``n_listed`` is written by
    the call: how many live pages the tier had (the valid prefix of the listing buffers)."""

    _fields_ = [("n_pages", ctypes.c_void_p), ("table", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("row_len", ctypes.c_int64), ("first_col", ctypes.c_int64), ("col_step", ctypes.c_int64),
                ("capacity", ctypes.c_int64), ("tokens", ctypes.c_int32), ("k_bits", ctypes.c_int32),
                ("v_bits", ctypes.c_int32), ("group_size", ctypes.c_int32), ("k_data", ctypes.c_int64),
                ("k_meta", ctypes.c_int64), ("v_data", ctypes.c_int64), ("v_meta", ctypes.c_int64),
                ("pos_off", ctypes.c_int64), ("score_off", ctypes.c_int64), ("head", ctypes.c_void_p),
                ("rank", ctypes.c_void_p), ("page_id", ctypes.c_void_p), ("scores", ctypes.c_void_p),
                ("pos_out", ctypes.c_void_p), ("valid_out", ctypes.c_void_p), ("score_out", ctypes.c_void_p),
                ("n_listed", ctypes.c_int64)]


class Kernels:
    """The loaded library, with argument checks in front of its entry points."""

    def __init__(self, path: Path):
        self.path = path
        self._offsets: dict = {}  # segment offsets (a tuple) -> the int64 tensor store_tokens passes
        lib = ctypes.CDLL(str(path))
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.lk_list_pages.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        lib.lk_list_pages.restype = i64
        pages = [ptr, i64, i64, ptr, ptr]  # pool, page bytes, pool pages, page ids, heads
        geometry = [i32, i32, i32, i32, i32]  # tokens, dim, rows, bits, group size
        lib.lk_live_scores.argtypes = [*pages, ptr, i64, *geometry, i64, i64, i64, i64,
                                       ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32]
        lib.lk_live_values.argtypes = [*pages, i64, *geometry, i64, i64, ptr, ptr, ptr, ptr, i32]
        lib.lk_update_scores.argtypes = [*pages, i64, i32, i32, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32]
        lib.lk_live_scores.restype = lib.lk_live_values.restype = lib.lk_update_scores.restype = i32
        self._lib = lib
        lib.lk_store_tokens.argtypes = [ptr, i64, i64, ptr, ptr, i64, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ptr,
                                        i32]
        lib.lk_store_tokens.restype = i32
        lib.lk_decode_attention.argtypes = [ptr, i64, i64, i32, ptr, i64, i32, i32, i32, ptr, ctypes.c_float, ptr,
                                            ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32]
        lib.lk_decode_attention.restype = i32
        lib.lk_store_step.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i32, i32, i32, i32, i32, i32, ptr,
                                      ptr, ptr, ptr, ptr, ptr, i32]
        lib.lk_store_step.restype = i32
        i64p = ctypes.POINTER(ctypes.c_int64)
        lib.lk_grant_pages.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64p]
        lib.lk_recycle_pages.argtypes = [ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64p]
        lib.lk_move_tail.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ptr]
        lib.lk_plan_pages.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i32, ptr, i64, i64, ptr, ptr, ptr]
        lib.lk_fit_pages.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i32, ptr, i64, i64, ptr, i64, i64,
                                     i64, ptr, i64p]
        lib.lk_prompt_classes.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                          i64, ctypes.c_double, ctypes.c_double, ptr, ptr, ptr, ptr, ptr]
        lib.lk_store_ranked.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i32, i32, i32, i32, i32,
                                        ptr, ptr, ptr, ptr, ptr, ptr, i32, ptr, i32]
        lib.lk_settle_pages.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64p]
        lib.lk_prompt_layer.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_double,
                                        ctypes.c_double, ptr, ptr, ptr, i64, i64, i64, i32, ptr, i64, i64, i64, ptr,
                                        i64, i64, ptr, i32, ptr, ptr, i32, ptr]
        for fn in (lib.lk_grant_pages, lib.lk_recycle_pages, lib.lk_move_tail, lib.lk_plan_pages, lib.lk_fit_pages,
                   lib.lk_settle_pages, lib.lk_prompt_classes, lib.lk_store_ranked, lib.lk_prompt_layer):
            fn.restype = i32
        lib.lk_parallel.restype = i32
        lib.lk_specialized.argtypes = [i32, i32, i32]
        lib.lk_specialized.restype = i32
        self.parallel = bool(lib.lk_parallel())  # splits its pages over torch's threads

    def specialized(self, dim: int, bits: int, group_size: int) -> bool:
        """Whether pages of this geometry run a copy of the page loops compiled for it (the common
        head_dims, bit widths and group sizes), rather than the generic one."""
        return bool(self._lib.lk_specialized(dim, bits, group_size))

    def list_pages(self, storage: torch.Tensor, n_pages: torch.Tensor, table: torch.Tensor, first_col: int,
                   col_step: int, tokens: int, offsets: dict, out: tuple | None = None) -> PoolPages:
        """The live pages of one tier of one layer, in head order then rank order.

        ``n_pages`` int32 ``[BH]``: pages each (sequence, KV head) row holds in the tier;
        ``table`` int32 ``[BH, row_len]``: the layer's page-table rows, where the tier's page of
        rank ``j`` sits in column ``first_col + col_step * j``. ``out``: three int64 buffers of at
        least ``BH * row_len`` entries to list into (default: new ones). ``tokens`` and
        ``offsets`` describe the tier's pages (see :class:`PoolPages`).
        """
        heads, row_len = table.shape
        ok = (n_pages.dtype == table.dtype == torch.int32 and n_pages.shape == (heads,)
              and n_pages.is_contiguous() and table.is_contiguous() and storage.dtype == torch.uint8
              and storage.dim() == 2 and storage.is_contiguous()
              and all(t.device.type == "cpu" for t in (storage, n_pages, table)))
        if not ok:
            raise ValueError("native list_pages: want n_pages int32 [BH], table int32 [BH, row_len] and a "
                             "contiguous uint8 [num_pages, page_bytes] pool, all contiguous on the CPU")
        capacity = heads * row_len
        if out is None:
            out = tuple(torch.empty(capacity, dtype=torch.int64) for _ in range(3))
        if any(b.dtype != torch.int64 or b.numel() < capacity or not b.is_contiguous() for b in out):
            raise ValueError(f"native list_pages: out must be three contiguous int64 buffers of >= {capacity}")
        head, rank, page_id = out
        n = self._lib.lk_list_pages(n_pages.data_ptr(), heads, table.data_ptr(), row_len, first_col, col_step,
                                    capacity, head.data_ptr(), rank.data_ptr(), page_id.data_ptr())
        if n < 0:
            raise ValueError("native list_pages: a page count or column lies outside the page-table row")
        # Page ids are checked against the pool by each pass, before it writes anything.
        return PoolPages(storage, page_id[:n], head[:n], rank[:n], tokens, offsets)

    @staticmethod
    def _pages(pages: PoolPages, segments: dict) -> list:
        """Check the pool, the page index and that each of ``segments`` (name: bytes per token)
        fits in a page; return the page arguments every pass takes first."""
        storage, t = pages.storage, pages.tokens
        ok = (storage.dtype == torch.uint8 and storage.dim() == 2 and storage.is_contiguous()
              and storage.device.type == "cpu"
              and all(x.dtype == torch.int64 and x.is_contiguous() and x.shape == pages.page_id.shape
                      for x in (pages.page_id, pages.head, pages.rank))
              and all(0 <= pages.offsets.get(name, -1) and pages.offsets[name] + t * nb <= storage.shape[1]
                      for name, nb in segments.items()))
        if not ok:
            raise ValueError("native live-page kernel: pool, page index or segment geometry does not fit "
                             "(want a contiguous uint8 pool, int64 [L] ids/heads/ranks, segments inside a page)")
        return [storage.data_ptr(), storage.shape[1], storage.shape[0], pages.page_id.data_ptr(),
                pages.head.data_ptr()]

    @staticmethod
    def _codes(side: str, bits: int, group_size: int, dim: int) -> dict:
        """The segments of ``side``'s codes and metadata (name: bytes per token), after checking
        that ``bits`` codes in groups of ``group_size`` fill whole bytes of a ``dim`` row; a dense
        format (:data:`DENSE_FORMATS`) has ``dim`` values and no metadata."""
        if bits in _DENSE_SIZE and dim > 0:
            return {f"{side}_data": dim * _DENSE_SIZE[bits], f"{side}_meta": 0}
        if not (bits in (1, 2, 4, 8) and dim > 0 and group_size > 0 and dim % group_size == 0
                and group_size % (8 // bits) == 0):
            raise ValueError(f"native live-page kernel: {bits}-bit codes in groups of {group_size} do not "
                             f"fill whole bytes of a {dim}-wide row")
        return {f"{side}_data": dim * bits // 8, f"{side}_meta": 4 * (dim // group_size)}

    @staticmethod
    def _check_result(code: int, name: str, bad_page: str | None = None) -> None:
        """Raise what a kernel's error ``code`` (``errors.h``) means; ``bad_page``: the caller's own
        words for LK_BAD_PAGE."""
        if code == 0:
            return
        kind, message = ERRORS[code]
        if code == -2 and bad_page:
            message = bad_page
        raise kind(message if kind is NonFiniteKVError else f"native {name}: {message}")

    def live_scores(self, pages: PoolPages, q: torch.Tensor, q_pos: torch.Tensor, lens: torch.Tensor,
                    bits: int, group_size: int, out: torch.Tensor, m: torch.Tensor,
                    pos_out: torch.Tensor | None = None, valid_out: torch.Tensor | None = None,
                    score_out: torch.Tensor | None = None) -> torch.Tensor:
        """Pass 1: ``out[l, r, t] = sum_g s_g (q[h, r]_g . Q_g) + m_g sum(q[h, r]_g)`` with
        ``h = head[l]`` where slot ``t`` of page ``l`` is visible to row ``r``, else -inf; raises
        ``m[h, r]`` to each row's maximum.

        ``q`` fp32 ``[BH, R, F]`` scaled queries; ``q_pos`` int32 ``[BH, R]``; ``lens`` int32
        ``[BH]`` tokens of the tier per head; ``out`` fp32 ``[L, R, T]``; ``m`` fp32 ``[BH, R]``.
        Optional outputs ``[L, T]``: ``pos_out`` int32 positions (int32 max on dead slots),
        ``valid_out`` bool, ``score_out`` fp32 stored significance. A refused call writes nothing.
        """
        n, t = pages.page_id.numel(), pages.tokens
        dim = q.shape[-1] if q.dim() == 3 else -1
        args = self._pages(pages, {**self._codes("k", bits, group_size, dim), "position": 4, "score": 2})
        bh, rows = q.shape[:2]
        extras = ((pos_out, torch.int32), (valid_out, torch.bool), (score_out, torch.float32))
        ok = (q.dtype == out.dtype == m.dtype == torch.float32 and q_pos.dtype == lens.dtype == torch.int32
              and all(x.is_contiguous() and x.device.type == "cpu" for x in (q, q_pos, lens, out, m))
              and q_pos.shape == m.shape == (bh, rows) and lens.shape == (bh,) and out.shape == (n, rows, t)
              and all(x is None or (x.dtype == dt and x.shape == (n, t) and x.is_contiguous())
                      for x, dt in extras))
        if not ok:
            raise ValueError("native live_scores: want q fp32 [BH, R, F], q_pos int32 [BH, R], lens int32 [BH], "
                             "out fp32 [L, R, T], m fp32 [BH, R], optional [L, T] outputs, all contiguous")
        offs = pages.offsets
        code = self._lib.lk_live_scores(*args, pages.rank.data_ptr(), n, t, dim, rows, bits, group_size,
                                        offs["k_data"], offs["k_meta"], offs["position"], offs["score"],
                                        q.data_ptr(), q_pos.data_ptr(), lens.data_ptr(), out.data_ptr(),
                                        m.data_ptr(), *(None if x is None else x.data_ptr() for x, _ in extras),
                                        torch.get_num_threads())
        self._check_result(code, "live_scores")
        return out

    def live_values(self, pages: PoolPages, p: torch.Tensor, shift: torch.Tensor, bits: int, group_size: int,
                    l_sum: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """Pass 2: ``p[l, r, t] <- exp(p[l, r, t] - shift[h, r])`` (pass 1's scores become the
        softmax numerators), ``l_sum[h, r] += sum_t p``, and
        ``acc[h, r] += sum_t p[l, r, t] (s_g Q_g + m_g)`` per group, ``h = head[l]``.

        ``p`` fp32 ``[L, R, T]``; ``shift`` and ``l_sum`` fp32 ``[BH, R]``; ``acc`` fp32
        ``[BH, R, F]``. A refused call writes nothing.
        """
        n, t = pages.page_id.numel(), pages.tokens
        dim = acc.shape[-1] if acc.dim() == 3 else -1
        args = self._pages(pages, self._codes("v", bits, group_size, dim))
        bh, rows = acc.shape[:2]
        ok = (p.dtype == shift.dtype == l_sum.dtype == acc.dtype == torch.float32
              and all(x.is_contiguous() and x.device.type == "cpu" for x in (p, shift, l_sum, acc))
              and shift.shape == l_sum.shape == (bh, rows) and p.shape == (n, rows, t))
        if not ok:
            raise ValueError("native live_values: want p fp32 [L, R, T], shift and l_sum fp32 [BH, R], "
                             "acc fp32 [BH, R, F], all contiguous")
        offs = pages.offsets
        code = self._lib.lk_live_values(*args, n, t, dim, rows, bits, group_size, offs["v_data"], offs["v_meta"],
                                        p.data_ptr(), shift.data_ptr(), l_sum.data_ptr(), acc.data_ptr(),
                                        torch.get_num_threads())
        self._check_result(code, "live_values")
        return acc

    def _offsets_tensor(self, offsets) -> torch.Tensor:
        """The six segment offsets as the int64 tensor the store kernels read: one small tensor per
        page geometry, not one per call (a decode step stores once per layer)."""
        offs = self._offsets.get(tuple(offsets))
        if offs is None:
            offs = self._offsets[tuple(offsets)] = torch.tensor(offsets, dtype=torch.int64)
        return offs

    def store_tokens(self, storage: torch.Tensor, tokens: int, offsets: tuple, page_id: torch.Tensor,
                     slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                     score: torch.Tensor, k_bits: int, v_bits: int, group_size: int) -> None:
        """Quantize ``n`` tokens into their page slots, byte for byte as
        :meth:`leankit.pages.PageLayout.encode` then :meth:`leankit.pages.PagePool.write_rows`.

        ``storage`` uint8 ``[num_pages, page_bytes]``; ``tokens`` slots per page; ``offsets`` the
        six segments' byte offsets in :data:`leankit.pages.SEGMENTS` order. ``page_id`` and
        ``slot`` (int64 ``[n]``): where each token goes (a negative page id skips the token);
        ``k``, ``v`` fp32 ``[n, F]``; ``k_bits`` / ``v_bits`` a code width or a dense format
        (:func:`side_format`); ``position`` int32 and ``score`` fp32 ``[n]``. Raises
        :class:`leankit.quant.NonFiniteKVError` for NaN/Inf K/V or metadata beyond fp16, and
        ``ValueError`` for a page id or slot outside the pool; a refused call writes nothing.
        """
        n, dim = k.shape if k.dim() == 2 else (-1, -1)
        self._codes("k", k_bits, group_size, dim)
        self._codes("v", v_bits, group_size, dim)
        ok = (storage.dtype == torch.uint8 and storage.dim() == 2 and storage.is_contiguous()
              and k.dtype == v.dtype == score.dtype == torch.float32 and position.dtype == torch.int32
              and page_id.dtype == slot.dtype == torch.int64 and v.shape == (n, dim)
              and page_id.shape == slot.shape == position.shape == score.shape == (n,) and len(offsets) == 6
              and all(x.is_contiguous() and x.device.type == "cpu" for x in (storage, k, v, position, score,
                                                                             page_id, slot)))
        if not ok:
            raise ValueError("native store_tokens: want a contiguous uint8 [num_pages, page_bytes] pool, fp32 "
                             "[n, F] k and v, int64 [n] page ids and slots, int32 [n] positions, fp32 [n] scores")
        offs = self._offsets_tensor(offsets)
        code = self._lib.lk_store_tokens(storage.data_ptr(), storage.shape[1], storage.shape[0], page_id.data_ptr(),
                                         slot.data_ptr(), n, tokens, dim, k_bits, v_bits, group_size, offs.data_ptr(),
                                         k.data_ptr(), v.data_ptr(), position.data_ptr(), score.data_ptr(),
                                         torch.get_num_threads())
        self._check_result(code, "store_tokens", bad_page="a page id lies outside the pool or a slot outside its page")

    def decode_attention(self, storage: torch.Tensor, tiers, q: torch.Tensor, scale: float, q_pos: torch.Tensor,
                         k_new: torch.Tensor, v_new: torch.Tensor, real: torch.Tensor, scratch: tuple,
                         out: torch.Tensor, lse: torch.Tensor, row_weight: torch.Tensor | None = None,
                         received: torch.Tensor | None = None, update_significance: bool = False) -> None:
        """A decode step's whole attention for one layer in one call (``decode_step.c``): each tier's
        live pages listed (:meth:`list_pages`), pass 1 and pass 2 over them (:meth:`live_scores`,
        :meth:`live_values`), the same functions, so the same bits; then ``finish_decode.c`` adds the
        step's own token (exact key and value) to pass 2's sums, merges the two softmaxes and
        normalizes.

        ``storage``: the pool; ``tiers``: a ctypes array of :class:`DecodeTier` (their
        ``n_listed`` written); ``q`` fp32 ``[B, Hq, 1, F]`` the queries in the pages' basis,
        unscaled (``Hq = Hkv * G``); ``q_pos`` int64 ``[B]``; ``k_new``/``v_new`` fp32
        ``[B, Hkv, 1, F]``; ``real`` bool ``[B]``; ``scratch``: the scaled query rows fp32
        ``[BH, G, F]``, their positions int32 ``[BH, G]``, then ``shift`` and ``l_sum`` fp32
        ``[BH, G]`` (written: each row's maximum, 0 where it sees nothing, and its numerators'
        sum). Writes ``out`` fp32 ``[B, 1, Hq, F]`` and ``lse`` fp32 ``[BH, G]``; when given,
        ``row_weight`` fp32 ``[BH, G]``: ``exp(shift - lse) / G`` for rows of real tokens that saw
        a stored key, else 0, and ``received`` fp32 ``[BH]``: the mass the new token received,
        averaged over the group (0 where not real).

        ``update_significance``: then LeanKV's running significance of every live slot (§4), in
        place in the pages' score segments, as :meth:`update_scores` computes it from this step's
        numerators and ``row_weight`` (each sequence's one query is both its first and its last;
        a sequence whose token is not real keeps its scores). Needs ``row_weight`` and every
        tier's ``pos_out``, ``valid_out`` and ``score_out`` buffers. A NaN or Inf in ``q`` or
        ``k_new`` is then refused before anything is written (:class:`leankit.quant.NonFiniteKVError`,
        the pool as it was): it would leave NaN in the significance for good.
        """
        b, hq, nq, f = q.shape if q.dim() == 4 else (-1, -1, -1, -1)
        hkv = k_new.shape[1] if k_new.dim() == 4 else -1
        q_rows, row_pos, shift, l_sum = scratch
        g = hq // hkv if hkv > 0 else -1
        bh = b * hkv
        f32 = (q, k_new, v_new, q_rows, shift, l_sum, out, lse)
        ok = (nq == 1 and g > 0 and hq == g * hkv and storage.dtype == torch.uint8 and storage.dim() == 2
              and storage.is_contiguous() and k_new.shape == v_new.shape == (b, hkv, 1, f)
              and q_pos.dtype == torch.int64 and q_pos.shape == (b,) and q_pos.is_contiguous()
              and real.dtype == torch.bool and real.shape == (b,) and real.is_contiguous()
              and row_pos.dtype == torch.int32 and row_pos.shape == (bh, g) and row_pos.is_contiguous()
              and q_rows.shape == (bh, g, f) and out.shape == (b, 1, hq, f)
              and shift.shape == l_sum.shape == lse.shape == (bh, g)
              and all(x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu" for x in f32)
              and (row_weight is None or (row_weight.dtype == torch.float32 and row_weight.shape == (bh, g)
                                          and row_weight.is_contiguous()))
              and (received is None or (received.dtype == torch.float32 and received.shape == (bh,)
                                        and received.is_contiguous())))
        if not ok:
            raise ValueError("native decode_attention: want q fp32 [B, Hq, 1, F], k_new and v_new fp32 "
                             "[B, Hkv, 1, F], q_pos int64 [B], real bool [B], fp32 [BH, G, F] query rows, int32 "
                             "[BH, G] positions, fp32 [BH, G] shift, l_sum and lse, out fp32 [B, 1, Hq, F], all "
                             "contiguous on the CPU")
        code = self._lib.lk_decode_attention(
            storage.data_ptr(), storage.shape[1], storage.shape[0], len(tiers), tiers, bh, hkv, g, f, q.data_ptr(),
            scale, q_pos.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), real.data_ptr(), q_rows.data_ptr(),
            row_pos.data_ptr(), shift.data_ptr(), l_sum.data_ptr(), out.data_ptr(), lse.data_ptr(),
            None if row_weight is None else row_weight.data_ptr(), None if received is None else received.data_ptr(),
            int(update_significance), torch.get_num_threads())
        self._check_result(code, "decode_attention")

    def store_step(self, storage: torch.Tensor, table: torch.Tensor, first_col: int, col_step: int,
                   lens: torch.Tensor, tokens: int, offsets: tuple, k: torch.Tensor, v: torch.Tensor,
                   q_pos: torch.Tensor, real: torch.Tensor, score: torch.Tensor | None, k_bits: int, v_bits: int,
                   group_size: int) -> None:
        """A decode step's store for one layer in one call (``decode_step.c``): each (sequence, head)
        whose token is real gets it quantized into its tier's next slot, found from its token count
        and its page-table row, and its count advanced; byte for byte what :meth:`store_tokens`
        writes for the same slots.

        ``table`` int32 ``[B, H, row_len]`` (the tier's page of rank ``j`` in column
        ``first_col + col_step * j``) and ``lens`` int32 ``[B, H]`` (advanced in place), both
        contiguous; ``tokens`` and ``offsets`` as for :meth:`store_tokens`; ``k``/``v`` fp32
        ``[B, H, 1, F]``; ``q_pos`` int64 and ``real`` bool ``[B]``; ``score`` fp32 ``[B, H, 1]``
        or None (0). Raises :class:`leankit.quant.NonFiniteKVError` or ``ValueError`` (a slot
        without a page) with nothing written and ``lens`` unchanged.
        """
        b, h, nq, dim = k.shape if k.dim() == 4 else (-1, -1, -1, -1)
        self._codes("k", k_bits, group_size, dim)
        self._codes("v", v_bits, group_size, dim)
        ok = (nq == 1 and storage.dtype == torch.uint8 and storage.dim() == 2 and storage.is_contiguous()
              and k.dtype == v.dtype == torch.float32 and v.shape == k.shape and k.is_contiguous()
              and v.is_contiguous() and table.dtype == lens.dtype == torch.int32 and table.dim() == 3
              and table.shape[:2] == lens.shape == (b, h) and table.is_contiguous() and lens.is_contiguous()
              and q_pos.dtype == torch.int64 and q_pos.shape == real.shape == (b,) and q_pos.is_contiguous()
              and real.dtype == torch.bool and real.is_contiguous() and len(offsets) == 6
              and (score is None or (score.dtype == torch.float32 and score.shape == (b, h, 1)
                                     and score.is_contiguous()))
              and all(x.device.type == "cpu" for x in (storage, k, v, table, lens, q_pos, real)))
        if not ok:
            raise ValueError("native store_step: want a contiguous uint8 pool, fp32 [B, H, 1, F] k and v, int32 "
                             "[B, H, R] table and [B, H] lens, int64 q_pos and bool real [B], fp32 [B, H, 1] "
                             "score or None, all contiguous on the CPU")
        offs = self._offsets_tensor(offsets)
        code = self._lib.lk_store_step(storage.data_ptr(), storage.shape[1], storage.shape[0], table.data_ptr(),
                                       table.shape[2], first_col, col_step, lens.data_ptr(), b * h, h, tokens, dim,
                                       k_bits, v_bits, group_size, offs.data_ptr(), k.data_ptr(), v.data_ptr(),
                                       q_pos.data_ptr(), real.data_ptr(),
                                       None if score is None else score.data_ptr(), torch.get_num_threads())
        self._check_result(code, "store_step", bad_page="a new token's slot has no page in its page-table row")

    def update_scores(self, pages: PoolPages, p: torch.Tensor, row_weight: torch.Tensor, pos: torch.Tensor,
                      valid: torch.Tensor, stored: torch.Tensor, q_first: torch.Tensor, q_last: torch.Tensor,
                      has: torch.Tensor) -> None:
        """LeanKV's running significance of the pages' live slots, written in place into their fp16
        score segments (:func:`leankit.policy.update_significance` per slot).

        ``p`` fp32 ``[L, R, T]`` softmax numerators; ``row_weight`` fp32 ``[BH, R]``: what a row's
        numerator counts for (``exp(shift - lse) / group``, 0 for rows that do not count), so a
        slot received ``sum_r p * row_weight``; ``pos`` int32, ``valid`` bool and ``stored`` fp32
        ``[L, T]`` as pass 1 wrote them; ``q_first``, ``q_last`` (integers) and ``has`` (bool)
        ``[B]`` per sequence. Slots not valid, and sequences without a query, keep their bytes.
        """
        n, t = pages.page_id.numel(), pages.tokens
        args = self._pages(pages, {"score": 2})
        bh, rows = row_weight.shape
        b = has.numel()
        ok = (p.dtype == row_weight.dtype == stored.dtype == torch.float32 and pos.dtype == torch.int32
              and valid.dtype == has.dtype == torch.bool and b > 0 and bh % b == 0
              and not q_first.is_floating_point() and not q_last.is_floating_point()
              and q_first.numel() == q_last.numel() == b and p.shape == (n, rows, t)
              and pos.shape == valid.shape == stored.shape == (n, t)
              and all(x.is_contiguous() and x.device.type == "cpu" for x in (p, row_weight, pos, valid, stored, has)))
        if not ok:
            raise ValueError("native update_scores: want p fp32 [L, R, T], row_weight fp32 [BH, R], pos int32, "
                             "valid bool and stored fp32 [L, T], integer q_first/q_last and bool has [B]")
        q_first = q_first.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        q_last = q_last.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        code = self._lib.lk_update_scores(*args, n, t, rows, pages.offsets["score"], bh // b, p.data_ptr(),
                                          row_weight.data_ptr(), pos.data_ptr(), valid.data_ptr(), stored.data_ptr(),
                                          q_first.data_ptr(), q_last.data_ptr(), has.data_ptr(),
                                          torch.get_num_threads())
        self._check_result(code, "update_scores")

    # ---------------------------------------------------------------- page accounting (page_grants.c)
    @staticmethod
    def _table_args(tables: torch.Tensor, n_pages: torch.Tensor, *counts: torch.Tensor) -> tuple[int, int]:
        """Check a page table (int32 ``[L, B, H, R]``), its counts (int32 ``[2, L, B, H]``) and the
        per-side ``counts`` shaped like them, all contiguous on the CPU; return ``(rows, R)``."""
        # written out, not as generators over the tensors: a decode step makes several of these calls
        shape = n_pages.shape
        ok = (tables.dtype == torch.int32 and tables.dim() == 4 and tables.is_contiguous() and tables.is_cpu
              and n_pages.dtype == torch.int32 and shape[0] == 2 and shape[1:] == tables.shape[:3]
              and n_pages.is_contiguous() and n_pages.is_cpu)
        for c in counts:
            ok = ok and c.dtype == torch.int32 and c.shape == shape and c.is_contiguous() and c.is_cpu
        if not ok:
            raise ValueError("native page accounting: want int32 tables [L, B, H, R] and int32 [2, L, B, H] page "
                             "counts, all contiguous on the CPU")
        return n_pages[0].numel(), tables.shape[3]

    @staticmethod
    def _ring_args(ring: torch.Tensor, head: int, tail: int) -> list:
        if not (ring.dtype == torch.int32 and ring.dim() == 1 and ring.is_contiguous() and ring.is_cpu
                and 0 <= tail - head <= ring.numel()):
            raise ValueError("native page accounting: want an int32 [capacity] ring on the CPU and "
                             "0 <= tail - head <= capacity")
        return [ring.data_ptr(), ring.numel(), head, tail]

    def grant_pages(self, tables: torch.Tensor, n_pages: torch.Tensor, extra: torch.Tensor, ring: torch.Tensor,
                    head: int, tail: int) -> tuple[int, int]:
        """Give side ``t`` of every (layer, sequence, head) row ``extra[t, l, b, h]`` more pages,
        taken in ring order from the free ids ``ring[c % capacity]``, ``head <= c < tail``: the ids
        and columns of :meth:`leankit.page_table.BidirectionalPageTable.grow`'s torch path, in one
        pass. ``tables`` and ``n_pages`` are written in place. Returns ``(code, pages)``: ``code``
        0 (granted; the caller advances its head by ``pages``), :data:`NEGATIVE_DEMAND`,
        :data:`ROW_FULL` or :data:`POOL_SHORT` (nothing changed); ``pages`` the pages asked for."""
        rows, row_len = self._table_args(tables, n_pages, extra)
        total = ctypes.c_int64(0)
        code = self._lib.lk_grant_pages(tables.data_ptr(), n_pages.data_ptr(), extra.data_ptr(), rows, row_len,
                                        *self._ring_args(ring, head, tail), ctypes.byref(total))
        return code, total.value

    def recycle_pages(self, tables: torch.Tensor, n_pages: torch.Tensor, keep: torch.Tensor, ring: torch.Tensor,
                      head: int, tail: int) -> int:
        """Return every page past ``keep[t, l, b, h]`` (at most ``n_pages``) of each side to the ring
        at ``tail``, clear its column and set ``n_pages`` to ``keep``: the order of
        :meth:`leankit.page_table.BidirectionalPageTable.shrink`'s torch path, in one pass. Returns
        the pages freed (the caller advances its tail by them); raises ``RuntimeError`` on a double
        free, with nothing changed."""
        rows, row_len = self._table_args(tables, n_pages, keep)
        freed = ctypes.c_int64(0)
        code = self._lib.lk_recycle_pages(tables.data_ptr(), n_pages.data_ptr(), keep.data_ptr(), rows, row_len,
                                          *self._ring_args(ring, head, tail), ctypes.byref(freed))
        self._check_result(code, "recycle_pages")
        return freed.value

    @staticmethod
    def _layer_args(tables: torch.Tensor, layers: torch.Tensor, per_layer: torch.Tensor) -> None:
        shape = per_layer.shape
        ok = (layers.dtype == per_layer.dtype == torch.int64 and layers.dim() == 1 and per_layer.dim() >= 3
              and shape[-3] == layers.numel() and shape[-2:] == tables.shape[1:3]
              and layers.is_contiguous() and per_layer.is_contiguous() and layers.is_cpu and per_layer.is_cpu)
        if not ok:
            raise ValueError("native page accounting: want int64 layers [L'] and int64 [..., L', B, H] counts, "
                             "contiguous")

    def move_tail(self, tables: torch.Tensor, n_pages: torch.Tensor, layers: torch.Tensor, r: torch.Tensor) -> None:
        """Hand the last ``r[l', b, h]`` high pages of each row of ``layers`` to its low side, as
        :meth:`leankit.page_table.BidirectionalPageTable.move_tail`'s torch path does, in one pass.
        Raises ``ValueError`` (nothing moved) for a layer outside the table or an ``r`` outside
        ``[0, n_pages[HIGH]]``."""
        self._table_args(tables, n_pages)
        self._layer_args(tables, layers, r)
        heads = tables.shape[1] * tables.shape[2]
        code = self._lib.lk_move_tail(tables.data_ptr(), n_pages.data_ptr(), tables.shape[0], heads,
                                      tables.shape[3], layers.data_ptr(), layers.numel(), r.data_ptr())
        self._check_result(code, "move_tail")

    def _plan_args(self, name: str, tables: torch.Tensor, n_pages: torch.Tensor, layers: torch.Tensor,
                   lens: torch.Tensor, tokens: tuple[int, ...], reserve: torch.Tensor | None) -> int:
        """Check a page plan's arguments (:meth:`plan_pages`); return its tier count, one per page
        size in ``tokens`` (a single side needs no low pages)."""
        self._table_args(tables, n_pages)
        self._layer_args(tables, layers, lens)
        tiers = len(tokens)
        ok = (lens.dim() == 4 and tiers in (1, 2) and lens.shape[0] >= tiers and min(tokens) > 0
              and (reserve is None or (reserve.dtype == torch.int64 and reserve.shape == (tables.shape[1],)
                                       and reserve.is_contiguous())))
        if not ok:
            raise ValueError(f"native {name}: want 1 or 2 positive page sizes, lens int64 [tiers, L', B, H] "
                             "with a row for each, and reserve int64 [B] or None")
        return tiers

    def plan_pages(self, tables: torch.Tensor, n_pages: torch.Tensor, layers: torch.Tensor, lens: torch.Tensor,
                   tokens: tuple[int, ...], reserve: torch.Tensor | None):
        """:meth:`leankit.page_table.BidirectionalPageTable.tier_plan` in one pass: ``lens`` int64
        ``[tiers, L', B, H]`` (a row per page size in ``tokens``), ``reserve`` int64 ``[B]`` or
        None. Returns ``(need int64 [2, L', B, H], r int64 [L', B, H], extra int32 [2, L, B, H])``."""
        tiers = self._plan_args("plan_pages", tables, n_pages, layers, lens, tokens, reserve)
        need = torch.empty((2, *lens.shape[1:]), dtype=torch.int64)
        r = torch.empty(lens.shape[1:], dtype=torch.int64)
        extra = torch.empty_like(n_pages)
        heads = tables.shape[1] * tables.shape[2]
        code = self._lib.lk_plan_pages(n_pages.data_ptr(), tables.shape[0], heads, tables.shape[2], layers.data_ptr(),
                                       layers.numel(), lens.data_ptr(), tiers,
                                       None if reserve is None else reserve.data_ptr(), tokens[0],
                                       tokens[1] if tiers > 1 else 1, need.data_ptr(), r.data_ptr(), extra.data_ptr())
        self._check_result(code, "plan_pages")
        return need, r, extra

    def fit_pages(self, tables: torch.Tensor, n_pages: torch.Tensor, layers: torch.Tensor, lens: torch.Tensor,
                  tokens: tuple[int, ...], reserve: torch.Tensor | None, ring: torch.Tensor, head: int,
                  tail: int) -> tuple[int, int, torch.Tensor]:
        """:meth:`plan_pages`, then its grant (:meth:`move_tail` of the surplus high pages, then
        :meth:`grant_pages` of the rest), in one call, with the grant's checks made before anything
        moves. Returns ``(code, pages, need)`` as :meth:`grant_pages` returns its first two (a
        refused call changes nothing) and ``need`` int64 ``[2, L', B, H]`` the pages each side keeps."""
        tiers = self._plan_args("fit_pages", tables, n_pages, layers, lens, tokens, reserve)
        need = torch.empty((2, *lens.shape[1:]), dtype=torch.int64)
        taken = ctypes.c_int64(0)
        code = self._lib.lk_fit_pages(tables.data_ptr(), n_pages.data_ptr(), tables.shape[0],
                                      tables.shape[1] * tables.shape[2], tables.shape[2], tables.shape[3],
                                      layers.data_ptr(), layers.numel(), lens.data_ptr(), tiers,
                                      None if reserve is None else reserve.data_ptr(), tokens[0],
                                      tokens[1] if tiers > 1 else 1, *self._ring_args(ring, head, tail),
                                      need.data_ptr(), ctypes.byref(taken))
        return code, taken.value, need

    def settle_pages(self, tables: torch.Tensor, n_pages: torch.Tensor, lens: torch.Tensor, layers: torch.Tensor,
                     new_lens: torch.Tensor, need: torch.Tensor, ring: torch.Tensor, head: int, tail: int) -> int:
        """The end of a re-tiering of the rows of ``layers`` in one pass: their token counts
        (``lens`` int32 ``[2, L, B, H]``) set to ``new_lens`` and the pages past ``need`` (both int64
        ``[2, L', B, H]``) recycled to the ring at ``tail`` as :meth:`recycle_pages` does, in its
        order. Returns the pages freed; raises ``ValueError`` (a layer outside the table, a negative
        need) or ``RuntimeError`` (a double free) with nothing changed."""
        self._table_args(tables, n_pages, lens)
        self._layer_args(tables, layers, new_lens)
        self._layer_args(tables, layers, need)
        if not (new_lens.shape[0] == need.shape[0] == 2 and new_lens.dim() == need.dim() == 4):
            raise ValueError("native settle_pages: want new_lens and need int64 [2, L', B, H]")
        freed = ctypes.c_int64(0)
        code = self._lib.lk_settle_pages(tables.data_ptr(), n_pages.data_ptr(), lens.data_ptr(), tables.shape[0],
                                         tables.shape[1] * tables.shape[2], tables.shape[3], layers.data_ptr(),
                                         layers.numel(), new_lens.data_ptr(), need.data_ptr(),
                                         *self._ring_args(ring, head, tail), ctypes.byref(freed))
        self._check_result(code, "settle_pages")
        return freed.value

    # ---------------------------------------------------------------- LeanKV prompt store (prompt_store.c)
    def prompt_classes(self, received: torch.Tensor, q_pos: torch.Tensor, real: torch.Tensor, q_last: torch.Tensor,
                       pruned_mass: torch.Tensor, lens: torch.Tensor, window: int, th: float, tl: float):
        """LeanKV's prompt-phase classification of one layer (``prompt_store.c``): the CPU twin of
        :func:`leankit_kernels.prompt_plan.prompt_classes`, with the same arguments and results
        (``received`` fp32 ``[B, H, Q]``, ``q_pos`` integer and ``real`` bool ``[B, Q]``, ``q_last``
        integer ``[B]``, ``pruned_mass`` fp32 ``[B, H]``, ``lens`` int32 ``[2, B, H]``). Returns
        ``(score fp32 [B, H, Q], cls int8 [B, H, Q], rank int64 [B, H, Q], new_lens int64
        [2, 1, B, H], pruned fp32 [B, H])``."""
        bsz, heads, nq = received.shape if received.dim() == 3 else (-1, -1, -1)
        ok = (received.dtype == pruned_mass.dtype == torch.float32 and lens.dtype == torch.int32
              and real.dtype == torch.bool and not q_pos.is_floating_point() and not q_last.is_floating_point()
              and q_pos.shape == real.shape == (bsz, nq) and q_last.shape == (bsz,)
              and pruned_mass.shape == (bsz, heads) and lens.shape == (2, bsz, heads)
              and all(x.is_cpu for x in (received, q_pos, real, q_last, pruned_mass, lens)))
        if not ok:
            raise ValueError("native prompt_classes: want received fp32 [B, H, Q], integer q_pos and bool real "
                             "[B, Q], integer q_last [B], pruned_mass fp32 [B, H] and lens int32 [2, B, H] on the CPU")
        q_pos, q_last = q_pos.long().contiguous(), q_last.long().contiguous()
        real, pruned_mass = real.contiguous(), pruned_mass.contiguous()
        score = torch.empty((bsz, heads, nq), dtype=torch.float32)
        cls = torch.empty((bsz, heads, nq), dtype=torch.int8)
        rank = torch.empty((bsz, heads, nq), dtype=torch.int64)
        new_lens = torch.empty((2, 1, bsz, heads), dtype=torch.int64)
        pruned = torch.empty((bsz, heads), dtype=torch.float32)
        code = self._lib.lk_prompt_classes(received.data_ptr(), *received.stride(), q_pos.data_ptr(), real.data_ptr(),
                                           q_last.data_ptr(), pruned_mass.data_ptr(), lens.data_ptr(), *lens.stride(),
                                           bsz, heads, nq, int(window), float(th), float(tl), score.data_ptr(),
                                           cls.data_ptr(), rank.data_ptr(), new_lens.data_ptr(), pruned.data_ptr())
        self._check_result(code, "prompt_classes")
        return score, cls, rank, new_lens, pruned

    def prompt_geometry(self, tiers: tuple, dim: int) -> torch.Tensor:
        """The int64 ``[tiers, 10]`` rows :meth:`prompt_layer` reads its tiers' pages by: per tier
        ``(tokens, k_bits, v_bits, group_size, offsets)`` (``offsets`` the six segment offsets, the
        bits as :meth:`store_ranked` takes them), checked as that store checks them. A cache builds
        them once (:meth:`leankit.cache.LeanCache.store_prompt_layer`)."""
        if not 1 <= len(tiers) <= 2:
            raise ValueError(f"native prompt_layer: want 1 or 2 tiers, got {len(tiers)}")
        for tokens, k_bits, v_bits, group_size, offsets in tiers:
            self._codes("k", k_bits, group_size, dim)
            self._codes("v", v_bits, group_size, dim)
            if tokens <= 0 or len(offsets) != 6:
                raise ValueError("native prompt_layer: want a positive page size and six segment offsets per tier")
        return torch.tensor([[t, kb, vb, gs, *offs] for t, kb, vb, gs, offs in tiers], dtype=torch.int64)

    def prompt_layer(self, received: torch.Tensor, q_pos: torch.Tensor, real: torch.Tensor, q_last: torch.Tensor,
                     pruned_mass: torch.Tensor, window: int, th: float, tl: float, tables: torch.Tensor,
                     n_pages: torch.Tensor, lens: torch.Tensor, layer: int, ring: torch.Tensor, head: int, tail: int,
                     storage: torch.Tensor, geometry: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[int, int, int, int]:
        """One LeanKV prompt layer (``prompt_store.c``'s ``lk_prompt_layer``) in one call:
        :meth:`prompt_classes`, :meth:`fit_pages` for ``layer``, :meth:`store_ranked` of each tier
        of ``geometry`` (:meth:`prompt_geometry`), ``pruned_mass += pruned`` and
        :meth:`settle_pages`, with the same bytes, ids and counts as those calls one by one.

        ``received`` fp32 ``[B, H, Q]``; ``q_pos`` int64 and ``real`` bool ``[B, Q]``; ``q_last``
        int64 ``[B]``; ``pruned_mass`` fp32 ``[B, H]`` (the layer's row, updated in place);
        ``tables`` int32 ``[L, B, H, R]``, ``n_pages`` and ``lens`` int32 ``[2, L, B, H]`` (updated
        in place); ``ring`` the free list's int32 ring, ``head <= c < tail``; ``storage`` the uint8
        pool; ``k``/``v`` fp32 ``[B, H, Q, F]``. All on the CPU, all but ``received`` contiguous.

        Returns ``(code, stage, taken, freed)``: ``code`` 0 or an error code (``errors.h``) of the
        step that failed; ``stage`` 0 (nothing changed: the classification, or the grant refused
        with ``taken`` the pages it asked for), 1 (``taken`` pages granted from the ring's head, a
        store failed, no count moved) or 2 (stored; ``freed`` pages returned to the ring at
        ``tail``). The caller advances its free list by ``taken`` from stage 1 on and by ``freed``."""
        _, row_len = self._table_args(tables, n_pages, lens)  # the page table, as the page accounting checks it
        ring_args = self._ring_args(ring, head, tail)
        bsz, heads, nq = received.shape if received.dim() == 3 else (-1, -1, -1)
        dim = k.shape[-1]
        ok = (received.dtype == pruned_mass.dtype == k.dtype == v.dtype == torch.float32
              and q_pos.dtype == q_last.dtype == torch.int64 and real.dtype == torch.bool
              and storage.dtype == torch.uint8 and storage.dim() == 2 and geometry.dtype == torch.int64
              and geometry.dim() == 2 and geometry.shape[1] == 10 and geometry.shape[0] in (1, 2)
              and q_pos.shape == real.shape == (bsz, nq) and q_last.shape == (bsz,)
              and pruned_mass.shape == (bsz, heads) and tables.shape[1:3] == (bsz, heads)
              and 0 <= layer < tables.shape[0] and k.shape == v.shape == (bsz, heads, nq, dim))
        for x in (received, q_pos, real, q_last, pruned_mass, storage, geometry, k, v):
            ok = ok and x.is_cpu
        for x in (q_pos, real, q_last, pruned_mass, storage, geometry, k, v):
            ok = ok and x.is_contiguous()
        if not ok:
            raise ValueError("native prompt_layer: want fp32 received [B, H, Q], int64 q_pos and bool real [B, Q], "
                             "int64 q_last [B], fp32 pruned_mass [B, H], a layer of the table, a uint8 pool, int64 "
                             "geometry [tiers, 10] and fp32 k, v [B, H, Q, F], on the CPU and contiguous (received "
                             "may be strided)")
        result = (ctypes.c_int64 * 3)()
        code = self._lib.lk_prompt_layer(
            received.data_ptr(), *received.stride(), q_pos.data_ptr(), real.data_ptr(), q_last.data_ptr(),
            pruned_mass.data_ptr(), bsz, heads, nq, int(window), float(th), float(tl), tables.data_ptr(),
            n_pages.data_ptr(), lens.data_ptr(), tables.shape[0], row_len, layer, geometry.shape[0], *ring_args,
            storage.data_ptr(), storage.shape[1], storage.shape[0], geometry.data_ptr(), dim,
            k.data_ptr(), v.data_ptr(), torch.get_num_threads(), result)
        return code, result[0], result[1], result[2]

    def store_ranked(self, storage: torch.Tensor, table: torch.Tensor, first_col: int, col_step: int,
                     lens: torch.Tensor, tokens: int, offsets: tuple, k: torch.Tensor, v: torch.Tensor,
                     q_pos: torch.Tensor, cls: torch.Tensor, rank: torch.Tensor, want: int, score: torch.Tensor,
                     k_bits: int, v_bits: int, group_size: int) -> None:
        """The tokens of class ``want`` of a classified prompt into their tier (``prompt_store.c``),
        byte for byte what :meth:`store_tokens` writes for the same slots: token ``(b, h, q)`` goes
        to slot ``lens[b, h] + rank[b, h, q]`` of its head, on the page in column
        ``first_col + col_step * (slot // tokens)`` of its row of ``table`` (int32 ``[B, H, R]``).
        ``k``/``v`` fp32 ``[B, H, Q, F]``, ``q_pos`` int64 ``[B, Q]``, ``cls`` int8, ``rank`` int64
        and ``score`` fp32 ``[B, H, Q]`` (as :meth:`prompt_classes` returns them), all contiguous;
        ``lens`` int32 ``[B, H]`` is not advanced. Raises as :meth:`store_step` does, with nothing
        written."""
        b, h, nq, dim = k.shape if k.dim() == 4 else (-1, -1, -1, -1)
        self._codes("k", k_bits, group_size, dim)
        self._codes("v", v_bits, group_size, dim)
        ok = (storage.dtype == torch.uint8 and storage.dim() == 2 and storage.is_contiguous()
              and k.dtype == v.dtype == score.dtype == torch.float32 and v.shape == k.shape
              and table.dtype == lens.dtype == torch.int32 and table.dim() == 3 and table.shape[:2] == lens.shape == (b, h)
              and q_pos.dtype == rank.dtype == torch.int64 and q_pos.shape == (b, nq) and cls.dtype == torch.int8
              and cls.shape == rank.shape == score.shape == (b, h, nq) and len(offsets) == 6)
        for x in (storage, table, lens, k, v, q_pos, cls, rank, score):
            ok = ok and x.is_contiguous() and x.is_cpu
        if not ok:
            raise ValueError("native store_ranked: want a contiguous uint8 pool, fp32 [B, H, Q, F] k and v, int32 "
                             "[B, H, R] table and [B, H] lens, int64 [B, Q] q_pos, int8 cls, int64 rank and fp32 "
                             "score [B, H, Q], all contiguous on the CPU")
        offs = self._offsets_tensor(offsets)
        code = self._lib.lk_store_ranked(storage.data_ptr(), storage.shape[1], storage.shape[0], table.data_ptr(),
                                         table.shape[2], first_col, col_step, lens.data_ptr(), b * h, h, nq, tokens,
                                         dim, k_bits, v_bits, group_size, offs.data_ptr(), k.data_ptr(), v.data_ptr(),
                                         q_pos.data_ptr(), cls.data_ptr(), rank.data_ptr(), int(want), score.data_ptr(),
                                         torch.get_num_threads())
        self._check_result(code, "store_ranked", bad_page="a kept token's slot has no page in its page-table row")


def kernels() -> Kernels | None:
    """The compiled kernels, built on first call; ``None`` where they cannot be had (no compiler or
    a failed build, after one warning that says why) or are switched off (``LEANKIT_NATIVE=0``,
    silently: the caller asked for the torch path)."""
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


def build_from(source_dir: str | Path) -> Kernels:
    """The kernels compiled from another copy of their C sources (``*.c`` and ``*.h`` in
    ``source_dir``, e.g. an older revision's), with the flags :func:`kernels` uses, for timing two
    versions side by side in one process (``bench/native_passes.py --against REV``). Raises
    ``RuntimeError`` when there is no compiler or the build fails."""
    source_dir = Path(source_dir)
    if not any(source_dir.glob("*.c")):
        raise ValueError(f"no C sources in {source_dir}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) found")
    return Kernels(_build(cc, source_dir))


def kernels_for(device) -> Kernels | None:
    """The kernels that run a step's per-page work on ``device``: :func:`kernels` on a CPU, else
    None (the torch path, or the Triton kernels on a GPU)."""
    return kernels() if torch.device(device).type == "cpu" else None
