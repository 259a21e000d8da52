"""Hardware profiles: the published machines of the offloading papers, and a profiler for this one.

A :class:`HardwareProfile` holds the handful of rates every model in the planner needs: host-to-device
and device-to-host bandwidth (the PCIe link), the accelerator's fp16 matmul FLOP/s and memory
bandwidth, the host CPU's FLOP/s and memory bandwidth, clock frequencies (LM-Offload Eqs. 13 and 21
divide by them), thread count (LM-Offload Algorithm 3) and the two memory sizes.

Units are SI seconds, bytes, FLOP and Hz throughout. Memory *sizes* use binary units (a "24 GB" card
holds 24 GiB). Link bandwidths quoted as "32 GB/s" are also taken in binary units: KVPR's Table 1
(512 MB of KV cache moving in 15.6 ms at "32 GB/s") only works out with 32 GiB/s, so every PCIe figure
below follows that convention. The physical PCIe 4.0 x16 signalling limit is 31.5e9 B/s (about 29.3
GiB/s) and pinned copies typically reach 25e9 B/s, so the presets are peak figures, not measurements;
run the profiler (``get_hardware("detect")``) for measured numbers.

The profiler (:func:`profile_hardware`) measures the machine it runs on: pinned host-to-device and
device-to-host copies plus fp16 matmuls when CUDA is present, memcpy and matmul on the CPU otherwise.
It also samples the two functions HybridServe fits in its Fig. 11, ``T_kv_gen(#tokens)`` (regenerate K
and V from activations) and ``T_load_kv(#tokens)`` (move the KV cache over the link), fits each by
least squares and reports R².
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .model_spec import ModelSpec

GB = 1e9
GiB = float(2**30)
TFLOPS = 1e12
GHz = 1e9
# The most host threads a profile may name: LM-Offload Algorithm 3 tries every split of them.
MAX_CPU_THREADS = 4096
# The most memory a profile may name, device or host: an exbibyte, far past any machine (a hand-edited
# 1e308 would print plans hundreds of digits wide).
MAX_MEMORY = float(2**60)
# Every rate, size and clock of a profile lies in [MIN_RATE, MAX_RATE] (one unit to a zetta-unit per
# second): a plan's times stay finite, and nothing a machine measures falls outside.
MIN_RATE, MAX_RATE = 1.0, 1e21


# --------------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * x`` fitted by least squares, with its coefficient of determination."""

    slope: float
    intercept: float
    r2: float
    n: int = 0

    def __call__(self, x: float) -> float:
        """Evaluate the fit at ``x``."""
        return self.intercept + self.slope * x

    def inverse(self, y: float) -> float:
        """The ``x`` at which the fit equals ``y`` (``inf`` for a flat fit)."""
        if self.slope == 0:
            return math.inf
        return (y - self.intercept) / self.slope

    def to_dict(self) -> dict[str, float]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinearFit:
        """Inverse of :meth:`to_dict`; a slope or intercept that is not a finite number raises
        ``ValueError`` (a NaN fit would price every plan as NaN seconds, which no search can rank)."""
        fit = cls(float(d["slope"]), float(d["intercept"]), float(d["r2"]), int(d.get("n", 0)))
        for name in ("slope", "intercept"):
            if not math.isfinite(getattr(fit, name)):
                raise ValueError(f"a fit's {name} must be a finite number, got {getattr(fit, name)!r}")
        return fit


def fit_linear(xs, ys) -> LinearFit:
    """Ordinary least-squares line through ``(xs, ys)`` and its R² (HybridServe §4.3, Fig. 11).

    R² is ``1 - SS_res / SS_tot``; with a single distinct x (SS_tot of x = 0) the slope is undefined and
    a ``ValueError`` is raised.
    """
    xs = [float(x) for x in xs]
    ys = [float(y) for y in ys]
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"need at least two (x, y) pairs of equal length, got {len(xs)} and {len(ys)}")
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x values are equal; cannot fit a line")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LinearFit(slope, intercept, r2, n)


# ------------------------------------------------------------------------------------- profile
@dataclass(frozen=True)
class HardwareProfile:
    """The rates and sizes of one machine (one accelerator plus its host).

    Attributes:
        name: preset name or ``"detected"``.
        h2d_bw, d2h_bw: host-to-device / device-to-host link bandwidth, bytes/s.
        gpu_flops: accelerator fp16 matmul FLOP/s (dense).
        gpu_mem_bw: accelerator memory bandwidth, bytes/s.
        cpu_flops: host CPU FLOP/s (fp32, all cores).
        cpu_mem_bw: host memory bandwidth, bytes/s.
        gpu_mem, host_mem: memory sizes, bytes.
        gpu_freq, cpu_freq: clock frequencies, Hz (LM-Offload Eqs. 13, 21).
        cpu_threads: host hardware threads available to PyTorch (LM-Offload Algorithm 3).
        cpu_attn_efficiency: share of ``cpu_mem_bw`` / ``cpu_flops`` that attention on the CPU achieves
            (FlexGen / LM-Offload attention offloading). Presets say 1.0 (peak figures, an optimistic
            bound); the profiler measures it.
        device: ``"cuda"`` for a GPU box, ``"cpu"`` when the compute device is the host itself.
        description: where the figures come from.
        fits: measured ``t_kv_gen`` / ``t_load_kv`` (seconds as a function of tokens, one layer) for
            the model named in ``fit_model``; empty for presets.
        samples: raw profiler samples, kept so a saved profile can be re-fitted.
    """

    name: str
    h2d_bw: float
    d2h_bw: float
    gpu_flops: float
    gpu_mem_bw: float
    cpu_flops: float
    cpu_mem_bw: float
    gpu_mem: float
    host_mem: float
    gpu_freq: float = 1.41 * GHz
    cpu_freq: float = 2.0 * GHz
    cpu_threads: int = 16
    cpu_attn_efficiency: float = 1.0
    device: str = "cuda"
    description: str = ""
    fits: dict[str, LinearFit] = field(default_factory=dict, compare=False)
    fit_model: str | None = None
    samples: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for f in ("h2d_bw", "d2h_bw", "gpu_flops", "gpu_mem_bw", "cpu_flops", "cpu_mem_bw", "gpu_mem",
                  "host_mem", "gpu_freq", "cpu_freq"):
            v = getattr(self, f)
            # bool is an int to Python: a hand-edited ``"gpu_mem": true`` would plan with 1 byte
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"HardwareProfile.{f} must be a positive finite number, got {v!r}")
            # bounded: rates far outside any machine's (1e-300 B/s) overflow the plan's times to inf and NaN
            top = MAX_MEMORY if f in ("gpu_mem", "host_mem") else MAX_RATE
            if not MIN_RATE <= v <= top:
                raise ValueError(f"HardwareProfile.{f} must lie in [{MIN_RATE:g}, {top:g}] (bytes, bytes/s, "
                                 f"FLOP/s or Hz; memory at most 2**60 bytes, 1 EiB), got {v!r}")
        eff = self.cpu_attn_efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise ValueError(f"cpu_attn_efficiency must lie in (0, 1], got {eff!r}")
        thr = self.cpu_threads
        # bounded: Algorithm 3's search walks every thread count (no host has more than a few thousand)
        if isinstance(thr, bool) or not isinstance(thr, int) or not 1 <= thr <= MAX_CPU_THREADS:
            raise ValueError(f"cpu_threads must be an integer in [1, {MAX_CPU_THREADS}], got {thr!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' (a GPU box) or 'cpu' (the host computes), got {self.device!r}")

    def replace(self, **changes) -> HardwareProfile:
        """A copy with some fields changed (e.g. ``hw.replace(h2d_bw=64 * GiB)``)."""
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (fits as dicts)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["fits"] = {k: v.to_dict() for k, v in self.fits.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown hardware profile field(s) {sorted(unknown)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"hardware profile lacks required field(s) {missing}; a profile needs "
                             f"{', '.join(required)} (see `leankit plan --hardware detect --save-profile`)")
        d = dict(d)
        fits = d.get("fits", {})
        if not isinstance(fits, dict):
            raise ValueError(f"fits must be an object of named linear fits, got {type(fits).__name__}")  # noqa: TRY004 (bad input, as load reports it)
        try:
            d["fits"] = {k: LinearFit.from_dict(v) for k, v in fits.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"bad fits entry (each needs numeric slope, intercept and r2): {e!r}") from None
        return cls(**d)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON and return the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        """Read a profile written by :meth:`save`."""
        try:
            d = json.loads(Path(path).read_text())
            if not isinstance(d, dict):
                raise ValueError(f"expected a JSON object, got {type(d).__name__}")
            return cls.from_dict(d)
        except ValueError as e:  # json.JSONDecodeError is a ValueError too
            raise ValueError(f"bad hardware profile {path}: {e}") from None

    def summary(self) -> str:
        """One line per figure, human units."""
        rows = [
            f"{self.name} ({self.device})",
            f"  link h2d / d2h      {self.h2d_bw / GB:8.1f} / {self.d2h_bw / GB:.1f} GB/s",
            f"  device FLOP/s       {self.gpu_flops / TFLOPS:8.2f} TFLOP/s, memory {self.gpu_mem_bw / GB:.0f} GB/s",
            (f"  host FLOP/s         {self.cpu_flops / TFLOPS:8.2f} TFLOP/s, memory {self.cpu_mem_bw / GB:.0f} GB/s "
             f"(CPU attention at {self.cpu_attn_efficiency:.0%} of it)"),
            f"  memory device/host  {self.gpu_mem / GiB:8.1f} / {self.host_mem / GiB:.1f} GiB",
        ]
        for k, f in self.fits.items():
            sign = "-" if f.intercept < 0 else "+"
            rows.append(f"  fit {k:<16} {f.slope * 1e9:8.3f} ns/token {sign} {abs(f.intercept) * 1e6:.1f} us  "
                        f"(R^2 {f.r2:.4f})")
        return "\n".join(rows)


# ------------------------------------------------------------------------------------- presets
# Every figure carries its source. "Paper" figures are the ones the offloading papers publish for
# their machines; the rest come from the vendors' datasheets (named), and the few that nobody
# publishes are marked "assumed".
PRESETS: dict[str, HardwareProfile] = {
    "rtx4090-pcie4": HardwareProfile(
        name="rtx4090-pcie4",
        # HybridServe §5.1 / CAPTURE §V-A: "RTX 4090 ... 24GB of GDDR6X memory and PCIe 4.0 x16".
        h2d_bw=32 * GiB,  # PCIe 4.0 x16, 32 GB/s per direction (as KVPR §1 / LM-Offload Table 4 quote it)
        d2h_bw=32 * GiB,
        gpu_flops=165.2 * TFLOPS,  # NVIDIA Ada whitepaper: RTX 4090 dense fp16 tensor, fp32 accumulate
        gpu_mem_bw=1008 * GB,  # NVIDIA Ada whitepaper: 21 Gbps GDDR6X x 384 bit
        gpu_mem=24 * GiB,  # paper
        host_mem=882 * GiB,  # paper: "882GB of DDR4 memory"
        # Paper: dual-socket 16-core Xeon Gold 6326. Intel ARK: 2.9 GHz base, 2 AVX-512 FMA units
        # (64 fp32 FLOP/cycle/core), 8 channels DDR4-3200 per socket.
        cpu_flops=2 * 16 * 2.9 * GHz * 64,
        cpu_mem_bw=2 * 8 * 25.6 * GB,
        gpu_freq=2.52 * GHz,  # NVIDIA: RTX 4090 boost clock
        cpu_freq=2.9 * GHz,
        cpu_threads=32,
        description="RTX 4090 + PCIe 4.0 x16, 2x Xeon Gold 6326, 882 GB (HybridServe / CAPTURE)",
    ),
    "a100-40gb-pcie4": HardwareProfile(
        name="a100-40gb-pcie4",
        # KVPR Fig. 1 / §4: "CPU DRAM 512 GB, PCIe 32 GB/s, GPU HBM 40 GB, FP16 312 TFLOPS";
        # "AMD EPYC processor with 64 cores, operating at 2.6 GHz".
        h2d_bw=32 * GiB,  # paper (Table 1 arithmetic shows binary GB)
        d2h_bw=32 * GiB,
        gpu_flops=312 * TFLOPS,  # paper
        gpu_mem_bw=1555 * GB,  # NVIDIA A100 datasheet, 40 GB HBM2
        gpu_mem=40 * GiB,  # paper
        host_mem=512 * GiB,  # paper
        cpu_flops=64 * 2.6 * GHz * 32,  # paper's 64 cores x 2.6 GHz; Zen: 2x256-bit FMA = 32 fp32 FLOP/cycle
        cpu_mem_bw=8 * 25.6 * GB,  # AMD: 8 channels DDR4-3200 per EPYC socket
        gpu_freq=1.41 * GHz,  # NVIDIA A100 boost clock
        cpu_freq=2.6 * GHz,  # paper
        cpu_threads=64,
        description="A100-40GB + PCIe 4.0 x16 (32 GB/s), 64-core EPYC, 512 GB (KVPR)",
    ),
    "a100-40gb-pcie4-xeon6330": HardwareProfile(
        name="a100-40gb-pcie4-xeon6330",
        # LM-Offload Table 4: "2x Intel Xeon Gold 6330 CPU 56 cores in total, 240 GB host memory;
        # 1x NVIDIA A100 with 40GB; PCIe 4.0 x16, with a total bidirectional bandwidth of 64 GB/s".
        h2d_bw=32 * GiB,  # paper: 64 GB/s bidirectional = 32 GB/s per direction
        d2h_bw=32 * GiB,
        gpu_flops=312 * TFLOPS,  # NVIDIA A100 datasheet (same figure KVPR prints)
        gpu_mem_bw=1555 * GB,  # NVIDIA A100 datasheet
        gpu_mem=40 * GiB,  # paper
        host_mem=240 * GiB,  # paper
        # Intel ARK, Xeon Gold 6330: 28 cores, 2.0 GHz base, 2 AVX-512 FMA units, 8 ch DDR4-2933.
        cpu_flops=56 * 2.0 * GHz * 64,
        cpu_mem_bw=2 * 8 * 23.47 * GB,
        gpu_freq=1.41 * GHz,
        cpu_freq=2.0 * GHz,
        cpu_threads=56,  # paper: 56 physical threads (LM-Offload §4.1)
        description="A100-40GB + PCIe 4.0 x16, 2x Xeon Gold 6330, 240 GB (LM-Offload)",
    ),
    "rtx5000-pcie4x8": HardwareProfile(
        name="rtx5000-pcie4x8",
        # KVPR Appendix A.5: "AMD EPYC 32-Core CPU and an NVIDIA Quadro RTX 5000 GPU (16 GB, 89.2 TFLOPS
        # FP16 peak performance) connected via PCIe 4.0 x8 (16 GB/s bandwidth)".
        h2d_bw=16 * GiB,  # paper
        d2h_bw=16 * GiB,
        gpu_flops=89.2 * TFLOPS,  # paper
        gpu_mem_bw=448 * GB,  # NVIDIA Quadro RTX 5000 datasheet
        gpu_mem=16 * GiB,  # paper
        host_mem=256 * GiB,  # assumed: KVPR does not publish this box's DRAM
        cpu_flops=32 * 2.5 * GHz * 32,  # paper's 32 cores; 2.5 GHz assumed (not published)
        cpu_mem_bw=8 * 25.6 * GB,  # AMD: 8 channels DDR4-3200
        gpu_freq=1.815 * GHz,  # NVIDIA datasheet boost clock
        cpu_freq=2.5 * GHz,  # assumed
        cpu_threads=32,
        description="Quadro RTX 5000 + PCIe 4.0 x8 (16 GB/s), 32-core EPYC (KVPR low-end box)",
    ),
    "l40-pcie4": HardwareProfile(
        name="l40-pcie4",
        # LeanKV §5: "Nvidia L40 GPUs, each with 48GB of memory" (its ref. [42], the L40 datasheet).
        h2d_bw=32 * GiB,  # L40 datasheet: PCIe 4.0 x16, 64 GB/s bidirectional
        d2h_bw=32 * GiB,
        gpu_flops=181.05 * TFLOPS,  # L40 datasheet: fp16 tensor, dense (362.1 with sparsity)
        gpu_mem_bw=864 * GB,  # L40 datasheet
        gpu_mem=48 * GiB,  # paper
        host_mem=512 * GiB,  # assumed: LeanKV does not publish host memory
        cpu_flops=64 * 2.5 * GHz * 32,  # assumed 64-core host at 2.5 GHz (not published)
        cpu_mem_bw=8 * 25.6 * GB,  # assumed 8-channel DDR4-3200
        gpu_freq=2.49 * GHz,  # L40 datasheet boost clock
        cpu_freq=2.5 * GHz,  # assumed
        cpu_threads=64,
        description="L40 48 GB + PCIe 4.0 x16 (LeanKV); host figures assumed",
    ),
    "h100-pcie5": HardwareProfile(
        name="h100-pcie5",
        # LM-Offload §1: the CPU-GPU interconnect "can be 64 GB/s (using 16-lane PCIe5)".
        h2d_bw=64 * GiB,
        d2h_bw=64 * GiB,
        gpu_flops=756 * TFLOPS,  # NVIDIA H100 PCIe datasheet: fp16 tensor dense (1513 with sparsity)
        gpu_mem_bw=2000 * GB,  # NVIDIA H100 PCIe datasheet, 80 GB HBM2e
        gpu_mem=80 * GiB,  # datasheet
        host_mem=1024 * GiB,  # assumed
        # assumed host: 2x 56-core Xeon at 2.0 GHz, AVX-512, 8 channels DDR5-4800 per socket
        cpu_flops=112 * 2.0 * GHz * 64,
        cpu_mem_bw=2 * 8 * 38.4 * GB,
        gpu_freq=1.755 * GHz,  # datasheet boost clock
        cpu_freq=2.0 * GHz,  # assumed
        cpu_threads=112,
        description="H100 PCIe 80 GB + PCIe 5.0 x16 (64 GB/s); host figures assumed",
    ),
}

ALIASES = {
    "rtx4090": "rtx4090-pcie4",
    "4090": "rtx4090-pcie4",
    "a100": "a100-40gb-pcie4",
    "a100-kvpr": "a100-40gb-pcie4",
    "a100-lm-offload": "a100-40gb-pcie4-xeon6330",
    "rtx5000": "rtx5000-pcie4x8",
    "quadro-rtx5000": "rtx5000-pcie4x8",
    "l40": "l40-pcie4",
    "h100": "h100-pcie5",
}


def hardware_names() -> list[str]:
    """The preset names accepted by :func:`get_hardware` (plus ``"detect"`` and a JSON path)."""
    return sorted(PRESETS)


def get_hardware(name: str | HardwareProfile, model: ModelSpec | None = None, save_path: str | None = None,
                 quick: bool = True) -> HardwareProfile:
    """Resolve a hardware name: a preset, an alias, ``"detect"`` (runs :func:`profile_hardware`), or the
    path of a JSON profile saved earlier.

    Raises ``ValueError`` listing the valid names for anything else.
    """
    if isinstance(name, HardwareProfile):
        return name
    key = str(name).strip()
    low = key.lower()
    if low == "detect":
        return profile_hardware(model=model, save_path=save_path, quick=quick)
    if low in PRESETS:
        return PRESETS[low]
    if low in ALIASES:
        return PRESETS[ALIASES[low]]
    if key.endswith(".json") and Path(key).is_file():
        return HardwareProfile.load(key)
    raise ValueError(
        f"unknown hardware {name!r}; valid: {', '.join(hardware_names())}, 'detect' (profile this machine), "
        f"or the path of a saved .json profile (aliases: {', '.join(sorted(ALIASES))})"
    )


# ------------------------------------------------------------------------------------ profiler
def _best_time(fn, repeats: int, sync=None, min_window: float = 0.004) -> float:
    """Seconds per call of ``fn``: after a warm-up, calls are batched into windows of at least
    ``min_window`` seconds and the fastest of ``repeats`` windows is kept (robust to a busy machine)."""
    fn()
    if sync:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(1000, int(min_window / once)))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if sync:
            sync()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GiB


def available_memory_bytes(device: str | torch.device) -> int | None:
    """Bytes a new allocation can still take on ``device`` now: on CUDA the device's free bytes
    (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds unused; on the CPU the
    kernel's ``MemAvailable`` estimate (free memory plus reclaimable caches); ``None`` where neither
    is known (another accelerator, or no ``/proc/meminfo``)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + cached)
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        pass
    return None


def _cpu_freq_hz() -> float:
    """Highest 'cpu MHz' in /proc/cpuinfo, else 2 GHz."""
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.lower().startswith("cpu mhz")]
        if mhz:
            return max(mhz) * 1e6
    except OSError:  # pragma: no cover
        pass
    return 2.0 * GHz


def profile_hardware(model: ModelSpec | None = None, device: str | None = None, save_path: str | None = None,
                     quick: bool = True) -> HardwareProfile:
    """Measure this machine and return a :class:`HardwareProfile` (optionally saved as JSON).

    On CUDA: pinned host-to-device and device-to-host copies, device-to-device copies (memory
    bandwidth) and fp16 matmuls. On a CPU-only machine the compute device *is* the host, so "the link"
    is a host memcpy (the copy a CPU offload of the cache would perform) and matmuls run in fp32.

    With ``model`` (default: SmolLM2-135M) it also samples ``T_kv_gen(#tokens)`` -- the time to regenerate
    K and V of one layer from cached activations, ``[n, hidden] @ [hidden, 2*kv_dim]`` -- and
    ``T_load_kv(#tokens)`` -- the time to move ``n`` tokens' fp16 KV of one layer over the link -- and
    fits both by least squares, reporting R² (HybridServe Fig. 11). ``quick`` keeps the whole run to a
    few seconds.
    """
    import torch

    from .model_spec import get_model

    spec = model if model is not None else get_model("smollm2-135m")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    reps = 3 if quick else 10
    samples: dict[str, Any] = {}

    if device == "cuda":  # pragma: no cover - exercised only on GPU machines
        dev = torch.device("cuda")
        sync = torch.cuda.synchronize
        copy_sizes = [8 << 20, 32 << 20, 128 << 20] if quick else [8 << 20, 32 << 20, 128 << 20, 512 << 20]

        def link(direction: str):
            ts = []
            for n in copy_sizes:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                gpu = torch.empty(n, dtype=torch.uint8, device=dev)
                if direction == "h2d":
                    t = _best_time(lambda g=gpu, h=host: g.copy_(h, non_blocking=True), reps, sync)
                else:
                    t = _best_time(lambda g=gpu, h=host: h.copy_(g, non_blocking=True), reps, sync)
                ts.append(t)
            f = fit_linear(copy_sizes, ts)
            samples[direction] = {"bytes": copy_sizes, "seconds": ts}
            return 1.0 / f.slope if f.slope > 0 else max(copy_sizes) / max(ts)

        h2d = link("h2d")
        d2h = link("d2h")
        n = copy_sizes[-1]
        a = torch.empty(n, dtype=torch.uint8, device=dev)
        b = torch.empty_like(a)
        t = _best_time(lambda: b.copy_(a), reps, sync)
        gpu_mem_bw = 2 * n / t  # a copy reads and writes every byte
        mm = []
        for k in ([2048, 4096] if quick else [2048, 4096, 8192]):
            x = torch.randn(k, k, dtype=torch.float16, device=dev)
            y = torch.randn(k, k, dtype=torch.float16, device=dev)
            t = _best_time(lambda x=x, y=y: x @ y, reps, sync)
            mm.append((k, t, 2 * k**3 / t))
        samples["matmul"] = [{"n": k, "seconds": t, "flops": f} for k, t, f in mm]
        gpu_flops = max(f for _, _, f in mm)
        props = torch.cuda.get_device_properties(dev)
        gpu_mem = float(props.total_memory)
        gpu_freq = float(getattr(props, "clock_rate", 0) or 0) * 1e3 or 1.5 * GHz
        dtype = torch.float16
        name = f"detected:{props.name}"
    else:
        dev = torch.device("cpu")
        sync = None
        dtype = torch.float32
        name = "detected:cpu"

    # ---- host side (always measured): memcpy and fp32 matmul
    copy_sizes_cpu = [8 << 20, 16 << 20, 32 << 20, 64 << 20] if quick else [8 << 20, 32 << 20, 128 << 20, 256 << 20]
    ts = []
    for n in copy_sizes_cpu:
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.empty_like(src)
        ts.append(_best_time(lambda d=dst, s=src: d.copy_(s), reps))
    f = fit_linear(copy_sizes_cpu, ts)
    samples["memcpy"] = {"bytes": copy_sizes_cpu, "seconds": ts, "r2": f.r2}
    memcpy_bw = 1.0 / f.slope if f.slope > 0 else max(copy_sizes_cpu) / max(ts)
    cpu_mem_bw = 2 * memcpy_bw  # memcpy reads and writes each byte
    mm_cpu = []
    for k in ([256, 512, 768] if quick else [256, 512, 1024, 2048]):
        x = torch.randn(k, k)
        y = torch.randn(k, k)
        t = _best_time(lambda x=x, y=y: x @ y, reps)
        mm_cpu.append({"n": k, "seconds": t, "flops": 2 * k**3 / t})
    samples["matmul_cpu"] = mm_cpu
    cpu_flops = max(m["flops"] for m in mm_cpu)
    # CPU attention over a cache (q @ K^T, softmax, @ V), fp32: achieved bytes/s against the memcpy rate
    b, hds, ctx, hd = 8, spec.num_heads, 4096 if quick else 16384, spec.head_dim
    q = torch.randn(b, hds, 1, hd)
    kc = torch.randn(b, hds, ctx, hd)
    vc = torch.randn(b, hds, ctx, hd)
    t_attn = _best_time(lambda: torch.softmax(q @ kc.transpose(-1, -2), -1) @ vc, reps)
    attn_bw = 2 * kc.numel() * 4 / t_attn
    samples["cpu_attention"] = {"seconds": t_attn, "bytes_per_s": attn_bw}
    cpu_attn_eff = max(1e-3, min(1.0, attn_bw / cpu_mem_bw))
    host_mem = _host_memory_bytes()
    cpu_freq = _cpu_freq_hz()
    threads = torch.get_num_threads()

    if device != "cuda":
        h2d = d2h = memcpy_bw
        gpu_flops = cpu_flops
        gpu_mem_bw = cpu_mem_bw
        gpu_mem = host_mem
        gpu_freq = cpu_freq

    # ---- HybridServe Fig. 11: T_kv_gen and T_load_kv against #tokens, one layer of `spec`
    gen_tokens = [512, 1024, 2048, 3072, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    if device == "cuda":  # pragma: no cover
        gen_tokens = [4096 * k for k in (1, 2, 4, 8, 16)]
    w = torch.randn(spec.hidden, 2 * spec.kv_dim, dtype=dtype, device=dev)
    gen_t, load_t = [], []
    kv_tok = spec.kv_bytes_per_token()
    for n in gen_tokens:
        x = torch.randn(n, spec.hidden, dtype=dtype, device=dev)
        gen_t.append(_best_time(lambda x=x: x @ w, reps, sync))
    # enough tokens that the copies leave the caches (8-64 MiB)
    load_tokens = [int(mib * 2**20 // kv_tok) for mib in (8, 16, 32, 48, 64)]
    for n in load_tokens:
        nbytes = int(n * kv_tok)
        if device == "cuda":  # pragma: no cover
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        else:
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
        load_t.append(_best_time(lambda d=dst, s=src: d.copy_(s, non_blocking=device == "cuda"), reps, sync))
    fits = {"t_kv_gen": fit_linear(gen_tokens, gen_t), "t_load_kv": fit_linear(load_tokens, load_t)}
    samples["t_kv_gen"] = {"tokens": gen_tokens, "seconds": gen_t}
    samples["t_load_kv"] = {"tokens": load_tokens, "seconds": load_t, "bytes_per_token": kv_tok}

    prof = HardwareProfile(
        name=name,
        h2d_bw=float(h2d),
        d2h_bw=float(d2h),
        gpu_flops=float(gpu_flops),
        gpu_mem_bw=float(gpu_mem_bw),
        cpu_flops=float(cpu_flops),
        cpu_mem_bw=float(cpu_mem_bw),
        gpu_mem=float(gpu_mem),
        host_mem=float(host_mem),
        gpu_freq=float(gpu_freq),
        cpu_freq=float(cpu_freq),
        cpu_threads=int(os.cpu_count() or threads),
        cpu_attn_efficiency=float(cpu_attn_eff),
        device=device,
        description=("measured on this machine" + (" (CPU only: the link is a host memcpy, compute is "
                                                     "fp32 CPU matmul)" if device != "cuda" else "")),
        fits=fits,
        fit_model=spec.name,
        samples=samples,
    )
    if save_path:
        prof.save(save_path)
    return prof
