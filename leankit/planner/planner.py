"""The composed offload planner: LeanKV compression + FlexGen-style placement + HybridServe/CAPTURE
activation caching + KVPR partial recomputation + LM-Offload attention offloading, priced by one model.

Time model (one decode step, one layer; every layer is costed and summed):

* **Link (host to device)**: the next layer's weights when it is streamed, the host-resident KV of the
  batch, and the host-resident activations (ACT blocks, KVPR's ``X[0:l]``). A single PCIe link carries
  all of them, so they add up (LM-Offload Eq. 2 takes a max over the three load tasks; FlexGen's own cost
  model and this one do not).
* **GPU**: regenerating K, V from activations (``2 * hidden * 2 * kv_dim`` FLOP per token: KVPR Eq. 8), the
  layer's matmuls (roofline: FLOP at ``gpu_flops`` or weight bytes at ``gpu_mem_bw``, per mini-batch), the
  attention read of the whole cache at ``gpu_mem_bw`` (the term KVPR Table 1 calls computation latency),
  quantization of the new tokens of a quantized cache (LM-Offload Eq. 7 via Eqs. 21-23, with the min/max
  reduced at memory speed instead of Eq. 21's one element per cycle) and dequantization of streamed
  quantized weights (Eq. 16). The old cache is read quantized by leankit's fused attention (LeanKV §5),
  so there is no separate Eq. 24 pass; :mod:`~leankit.planner.lm_offload` keeps the literal equations.
* **Device to host**: storing the new token's KV and/or activation. A new token's KV crosses as its own
  rows of the page segments (``ModelSpec.kv_write_bytes_per_token``), not as page bytes: the padding
  of a page never moves, which is what leankit's offload runtime counts. With a leankit cache format,
  activations are priced as leankit's ACT pages hold them (values, a position per row, page padding;
  ``ModelSpec.act_bytes_per_token(kv)``); the plain fp16 cache keeps the papers' ``hidden`` values.
* **CPU**: attention when it is offloaded (the larger of FLOP at ``cpu_flops`` and cache bytes at
  ``cpu_mem_bw``).

The batch is processed in mini-batches of at most 8,192 cache tokens (CAPTURE §IV-B). Within a layer the
link sends, per mini-batch, its activations then its KV, then the next layer's weights; the GPU
regenerates a mini-batch's KV as soon as its activations have arrived (GPU-resident ACT blocks at once)
and runs its attention once its KV is in. This event simulation reduces to KVPR's Eq. 10 plus the
attention for one mini-batch, and to ``max(link, GPU)`` for many.

Mechanism parameters:

* ``hybrid``: a static share of host tokens kept as activations (chosen at the middle of the generation
  by :func:`~leankit.planner.hybrid.balance_split`, the Eq. 8 balance with ACT transfers and the forward
  pass counted), all free GPU memory holding ACT blocks (CAPTURE: "GPU memory is exclusively allocated for
  Activation cache blocks"). Algorithm 1 as published is run alongside and reported.
* ``kvpr``: the host holds K, V *and* activations of every token; the split is re-solved every step
  (KVPR §3.2) between the steady-state balance and Eq. 11's optimum.
* ``attn_offload``: the cache stays in host memory and attention runs on the CPU (FlexGen's default,
  LM-Offload §2.2).
* ``kv``: KV-only offloading (FlexGen / the baseline).

Memory limits: resident weights, embeddings, double-buffered streamed weights, mini-batch buffers and
work space must fit the GPU; what is left holds cache (ACT for ``hybrid``, KV otherwise). Streamed
weights and the host share of the cache at the final context must fit host memory. On a CPU-only profile
(``device == "cpu"``) there is one memory and no link: nothing is offloaded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from leankit.config import KVConfig, split_overrides
from leankit.presets import resolve

from . import hybrid as hyb
from . import lm_offload as lmo
from .hardware import GB, GiB, HardwareProfile, get_hardware
from .model_spec import ModelSpec, get_model

MODES = ("kv", "hybrid", "kvpr", "attn_offload")
MODE_NAMES = {
    "kv": "KV-only offloading",
    "hybrid": "KV-activation hybrid cache",
    "kvpr": "KVPR partial recomputation",
    "attn_offload": "attention offloaded to CPU",
}
MINIBATCH_TOKENS = 8192  # CAPTURE §IV-B
GPU_RESERVE = 1 * GiB  # CUDA context, allocator slack


# --------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Workload:
    """Batch size, prompt length(s) and generation length."""

    batch: int
    prompt: int | tuple[int, ...]
    gen: int

    def __post_init__(self):
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.gen < 1:
            raise ValueError(f"gen must be >= 1, got {self.gen}")
        ps = self.prompts
        if len(ps) != self.batch:
            raise ValueError(f"{len(ps)} prompt lengths for a batch of {self.batch}")
        if min(ps) < 1:
            raise ValueError("prompt lengths must be >= 1")

    # Cached (a frozen dataclass keeps its __dict__): the search costs hundreds of choices, and building
    # and summing a batch-long tuple for each made a large --batch take minutes.
    @functools.cached_property
    def prompts(self) -> tuple[int, ...]:
        """One prompt length per request."""
        if isinstance(self.prompt, int):
            return (self.prompt,) * self.batch
        return tuple(int(p) for p in self.prompt)

    @functools.cached_property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the whole batch."""
        return self.prompt * self.batch if isinstance(self.prompt, int) else sum(self.prompts)

    @property
    def mean_prompt(self) -> float:
        """Average prompt length."""
        return self.prompt_tokens / self.batch


@dataclass(frozen=True)
class Allowed:
    """Mechanisms the planner may use.

    Attributes:
        kv_configs: cache formats to consider; ``None`` is the plain fp16 cache, strings are leankit
            :class:`~leankit.config.KVConfig` specs (``"K8V4"``, ``"K8V4-K4V2"``...).
        activation_cache: HybridServe/CAPTURE hybrid caching.
        kvpr: KVPR partial recomputation.
        attention_offload: CPU attention (FlexGen / LM-Offload).
        weight_bits: bits for streamed weights (LM-Offload weight quantization; 16 = none).
        weight_placement: search how many layers stay resident on the GPU (otherwise all are streamed).
        high_fraction: share of tokens in the high tier of a two-tier config (1.0: all, an upper bound).
        minibatch_tokens: cache tokens per mini-batch buffer.
    """

    kv_configs: tuple[str | None, ...] = (None,)
    activation_cache: bool = True
    kvpr: bool = True
    attention_offload: bool = True
    weight_bits: tuple[int, ...] = (16,)
    weight_placement: bool = True
    high_fraction: float = 1.0
    minibatch_tokens: int = MINIBATCH_TOKENS

    def __post_init__(self):
        for kv in self.kv_configs:
            if kv is None:
                continue
            cfg = KVConfig.parse(kv)  # raises with the grammar on a bad spec
            given = split_overrides(resolve(kv))[1] if isinstance(kv, str) else {}
            if cfg.act or "act" in given or "act_order" in given:
                # The byte model prices every token as K/V; the ACT share and order are the planner's own
                # choice (activation_cache / kvpr), written into the cache it builds (cache_settings).
                raise ValueError(f"KV config {kv!r} sets the activation share: the planner chooses it itself "
                                 "(give the format without act=; disallow it with activation_cache=False and "
                                 "kvpr=False, `leankit plan --no-act --no-kvpr`)")
        for b in self.weight_bits:
            if b not in (16, 8, 4):
                raise ValueError(f"weight_bits must be among 16, 8, 4; got {b}")
        if not self.kv_configs:
            raise ValueError("at least one KV config is needed (None = plain fp16)")
        if not self.weight_bits:
            raise ValueError("at least one weight bit width is needed, e.g. weight_bits=(16,)")
        if not 0.0 <= self.high_fraction <= 1.0:
            raise ValueError(f"high_fraction is a share of tokens and must lie in [0, 1], got {self.high_fraction}")


@dataclass(frozen=True)
class Limits:
    """Memory limits overriding the hardware profile's sizes (bytes; ``None`` keeps the profile's)."""

    gpu_mem: float | None = None
    host_mem: float | None = None

    def __post_init__(self):
        for name in ("gpu_mem", "host_mem"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a non-negative number of bytes, got {v!r}")

    def gpu(self, hw: HardwareProfile) -> float:
        """GPU memory to plan with: the limit when set (0 included), else the profile's. On a CPU-only
        machine the compute device's memory is the host's."""
        if self.gpu_mem is not None:
            return self.gpu_mem
        return hw.host_mem if hw.device == "cpu" else hw.gpu_mem

    def host(self, hw: HardwareProfile) -> float:
        """Host memory to plan with: the limit when set (0 included), else the profile's."""
        return self.host_mem if self.host_mem is not None else hw.host_mem


@dataclass(frozen=True)
class Choice:
    """One point of the search space."""

    kv: str | None
    mode: str
    gpu_layers: int
    weight_bits: int = 16

    def label(self) -> str:
        """Short human-readable description."""
        kv = self.kv or "fp16"
        wb = "" if self.weight_bits == 16 else f", weights {self.weight_bits}-bit"
        return f"{MODE_NAMES[self.mode]}, cache {kv}, {self.gpu_layers} layers resident{wb}"


# --------------------------------------------------------------------------------- outputs
@dataclass
class LayerCost:
    """Time of one layer in one decode step, by component (seconds)."""

    index: int
    resident: bool
    weight_load: float = 0.0
    kv_load: float = 0.0
    act_load: float = 0.0
    store: float = 0.0
    recompute: float = 0.0
    forward: float = 0.0
    attention: float = 0.0
    quant: float = 0.0
    cpu: float = 0.0
    link: float = 0.0
    gpu: float = 0.0
    time: float = 0.0
    act_share: float = 0.0
    gpu_cache_tokens: float = 0.0
    minibatches: int = 1
    sliding: bool = False  # a sliding-window layer: its window on the device, nothing moved

    @property
    def bottleneck(self) -> str:
        """The resource that sets this layer's time."""
        res = {"PCIe h2d": self.link, "GPU": self.gpu, "PCIe d2h": self.store, "CPU": self.cpu}
        return max(res, key=res.get)


@dataclass
class Plan:
    """A costed plan. ``throughput`` is generated tokens per second end to end (prefill + decode)."""

    model: ModelSpec
    hardware: HardwareProfile
    workload: Workload
    choice: Choice
    feasible: bool
    infeasible_reason: str = ""
    memory: dict[str, float] = field(default_factory=dict)
    t_init: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    layers: list[LayerCost] = field(default_factory=list)
    step_context: float = 0.0
    act_share: dict[str, float] = field(default_factory=dict)
    kvpr_splits: list[tuple[int, float]] = field(default_factory=list)
    algorithm1: hyb.HybridAllocation | None = None
    minibatch_report: dict[str, float] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    baseline: Plan | None = None
    threads: lmo.ThreadSetting | None = None
    candidates: int = 0

    @property
    def total_time(self) -> float:
        """``T_init + prefill + decode`` (LM-Offload Eq. 1)."""
        return self.t_init + self.prefill_time + self.decode_time

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run (HybridServe §5.2's metric)."""
        if not self.feasible or self.total_time <= 0:
            return 0.0
        return self.workload.batch * self.workload.gen / self.total_time

    @property
    def decode_throughput(self) -> float:
        """Decode-phase tokens per second (KVPR §4.2's metric)."""
        if not self.feasible or self.decode_time <= 0:
            return 0.0
        return self.workload.batch * (self.workload.gen - 1) / self.decode_time

    @property
    def speedup(self) -> float:
        """Throughput over the KV-only offloading baseline's."""
        if self.baseline is None or self.baseline.throughput <= 0:
            return math.nan
        return self.throughput / self.baseline.throughput

    @property
    def step_time(self) -> float:
        """Sum of the per-layer times at the representative decode step."""
        return sum(lc.time for lc in self.layers)


# --------------------------------------------------------------------------------- helpers
def _resident_pattern(L: int, k: int) -> list[bool]:
    """Spread ``k`` resident layers evenly among ``L`` so streamed weights load during resident layers."""
    return [(i + 1) * k // L > i * k // L for i in range(L)]


def _rates(model: ModelSpec, hw: HardwareProfile, kv: str | None, high_fraction: float):
    """Per-token seconds: link time of K+V, of an activation, GPU regeneration; bytes of each."""
    kvb = model.kv_bytes_per_token(kv, high_fraction)
    actb = model.act_bytes_per_token(kv)
    kv_t = kvb / hw.h2d_bw
    gen_t = model.kv_gen_flops_per_token() / hw.gpu_flops
    # A profile measured for this model replaces the analytic per-token rates (HybridServe Fig. 11 fits).
    if hw.fit_model == model.name and hw.fits:
        if "t_kv_gen" in hw.fits and hw.fits["t_kv_gen"].slope > 0:
            gen_t = hw.fits["t_kv_gen"].slope
        if kv is None and "t_load_kv" in hw.fits and hw.fits["t_load_kv"].slope > 0:
            kv_t = hw.fits["t_load_kv"].slope
    return kvb, actb, kv_t, actb / hw.h2d_bw, gen_t


def _sim(m: int, x: float, kvl: float, res: float, host: float, rest: float, w_next: float) -> tuple[float, float]:
    """Event simulation of one layer over ``m`` identical mini-batches (per-mini-batch times): the link sends
    X then KV per mini-batch and the next layer's weights last; the GPU regenerates resident ACT at once,
    host ACT after its X, and runs the rest after its KV. Returns ``(link end, GPU end)``.

    Reference for :func:`_sim_terms`, which gives the same result in closed form."""
    link = gpu = 0.0
    for _ in range(m):
        x_end = link + x
        kv_end = x_end + kvl
        link = kv_end
        gpu += res
        gpu = max(gpu, x_end) + host
        gpu = max(gpu, kv_end) + rest
    return link + w_next, gpu


def _sim_terms(m: int, x, kvl, res, host, rest, w_next) -> list:
    """Closed form of :func:`_sim`: the layer ends at the max of these terms. With ``c = x + kvl`` per
    mini-batch on the link and ``p = res + host + rest`` on the GPU, the GPU recurrence
    ``g_k = max(g_{k-1} + p, (k-1)c + x + host + rest, k c + rest)`` unrolls to five candidates, each
    affine in its inputs (so the arguments may be ``(a, b)`` pairs meaning ``a + b * phi``)."""
    def add(*ts):
        return (sum(t[0] for t in ts), sum(t[1] for t in ts))

    def mul(k, t):
        return (k * t[0], k * t[1])

    c = add(x, kvl)
    p = add(res, host, rest)
    return [
        add(mul(m, c), w_next),  # link: all mini-batches, then the next layer's weights
        mul(m, p),  # GPU busy all along
        add(mul(m - 1, p), x, host, rest),  # first X, then the GPU never waits
        add(mul(m - 1, c), x, host, rest),  # GPU waits for the last X
        add(mul(m - 1, p), c, rest),  # first mini-batch's X and KV, then GPU-bound
        add(mul(m, c), rest),  # GPU waits for the last KV
    ]


def _pl_min(A, B, counts, lo: float, hi: float) -> tuple[float, float]:
    """Exact minimum over ``phi`` in ``[lo, hi]`` of ``sum_k counts_k * max_t (A_kt + B_kt phi)``: a convex
    piecewise-linear function, whose minimum lies at an end or at a breakpoint of one component."""
    import numpy as np

    A = np.asarray(A, dtype=float)
    B = np.asarray(B, dtype=float)
    w = np.asarray(counts, dtype=float)
    cands = [lo, hi]
    if hi > lo:
        T = A.shape[1]
        i, j = np.triu_indices(T, 1)
        db = B[:, i] - B[:, j]
        ok = np.abs(db) > 1e-300
        with np.errstate(divide="ignore", invalid="ignore"):
            xs = (A[:, j] - A[:, i]) / np.where(ok, db, 1.0)
        xs = xs[ok & (xs > lo) & (xs < hi)]
        cands += list(np.unique(xs))
    ph = np.asarray(cands)
    vals = (w[:, None] * np.max(A[:, :, None] + B[:, :, None] * ph[None, None, :], axis=1)).sum(axis=0)
    best = float(vals.min())
    # smallest phi among the minima (fewest activations for the same time)
    k = int(np.flatnonzero(vals <= best * (1 + 1e-12) + 1e-300)[np.argmin(ph[vals <= best * (1 + 1e-12) + 1e-300])])
    return float(ph[k]), float(vals[k])


def _shortfall(need: float, cap: float) -> float:
    """How far a need overshoots its memory (need / capacity; infinite for a zero capacity)."""
    return need / cap if cap > 0 else math.inf


def _gib_pair(need: float, have: float) -> tuple[str, str]:
    """``need`` and ``have`` in GiB, with as many decimals (1 to 4) as it takes for a need that
    exceeds what is had not to print as the same number ("needs 1.2 GiB, has 1.2 GiB")."""
    for digits in range(1, 5):
        a, b = f"{need / GiB:.{digits}f}", f"{have / GiB:.{digits}f}"
        if a != b or need <= have:
            break
    return a, b


def _memory_check(model, hw, wl, choice, allowed, limits, kvb, actb, act_share_host):
    """GPU and host memory accounting. Returns (ok, reason, memory dict, GPU cache tokens per layer).

    The cache of the full-attention layers (``model.cache_layers``) is what is placed: sliding-window
    layers hold at most their window a row, in the model's dtype, on the device (``gpu_window``).
    """
    L = model.num_layers
    Lc = model.cache_layers
    unified = hw.device == "cpu"
    k = choice.gpu_layers
    w16 = model.weight_bytes_per_layer(16)
    wq = model.weight_bytes_per_layer(choice.weight_bits)
    emb = model.embedding_params() * model.dtype_bytes
    B = wl.batch
    n_final = wl.prompt_tokens + B * wl.gen  # cache tokens per layer at the end
    gpu_cap = limits.gpu(hw)
    host_cap = limits.host(hw)
    work = B * (4 * model.hidden + model.intermediate) * 4
    window = len(model.sliding_layers) * model.sliding_tokens([p + wl.gen for p in wl.prompts]) * \
        model.kv_bytes_per_token(None) if model.sliding_layers else 0.0
    mem: dict[str, float] = {"gpu_capacity": gpu_cap, "host_capacity": 0.0 if unified else host_cap,
                             "gpu_window": window}
    if unified:
        per_tok = {"hybrid": actb, "kvpr": kvb + actb}.get(choice.mode, kvb)
        need = L * w16 + emb + work + window + n_final * Lc * per_tok
        mem.update(gpu_weights=L * w16 + emb, gpu_cache=n_final * Lc * per_tok, gpu_used=need, host_used=0.0)
        if need > gpu_cap:
            mem["shortfall"] = _shortfall(need, gpu_cap)
            need_s, cap_s = _gib_pair(need, gpu_cap)
            return False, f"needs {need_s} GiB, memory holds {cap_s} GiB", mem, 0.0
        return True, "", mem, float(n_final)
    mb = allowed.minibatch_tokens
    if choice.mode == "attn_offload":
        buffers = 0.0
    else:
        buffers = 2 * mb * (actb + 2 * kvb)  # ACT, KV and attention buffers, double-buffered
    streamed = L - k
    wbuf = 2 * wq if streamed else 0.0
    fixed = k * w16 + emb + wbuf + buffers + work + window + GPU_RESERVE
    mem.update(gpu_weights=k * w16 + emb + wbuf, gpu_buffers=buffers + work + GPU_RESERVE)
    if fixed > gpu_cap:
        mem["shortfall"] = _shortfall(fixed, gpu_cap)
        fixed_s, cap_s = _gib_pair(fixed, gpu_cap)
        why = (f"GPU needs {fixed_s} GiB before any cache ({k} resident layers, embeddings and "
               f"streaming buffers {mem['gpu_weights'] / GiB:.1f} GiB, cache buffers {buffers / GiB:.1f} GiB, "
               f"batch working memory {work / GiB:.1f} GiB, "
               + (f"sliding-window layers' K/V {window / GiB:.1f} GiB, " if window else "")
               + f"reserve {GPU_RESERVE / GiB:.1f} GiB), has {cap_s} GiB")
        return False, why, mem, 0.0
    free = gpu_cap - fixed
    if choice.mode == "attn_offload":
        gpu_tokens = 0.0
    elif Lc == 0:  # every layer slides: nothing to place
        gpu_tokens = float(n_final)
        mem["gpu_cache"] = 0.0
        mem["gpu_cache_tokens"] = gpu_tokens
    else:
        per_tok_gpu = actb if choice.mode == "hybrid" else kvb
        gpu_tokens = min(float(n_final), free / (Lc * per_tok_gpu))
        mem["gpu_cache"] = gpu_tokens * Lc * per_tok_gpu
        mem["gpu_cache_tokens"] = gpu_tokens  # per layer, summed over the batch (what a runtime keeps resident)
    host_tok = max(0.0, n_final - gpu_tokens)
    if choice.mode == "kvpr":
        # KV of every token plus the activations of the prompt tokens, the only ones Eq. 11 recomputes
        host_cache = host_tok * Lc * kvb + min(float(wl.prompt_tokens), host_tok) * Lc * actb
    else:
        host_per_tok = act_share_host * actb + (1 - act_share_host) * kvb if choice.mode == "hybrid" else kvb
        host_cache = host_tok * Lc * host_per_tok
    host_w = streamed * wq
    mem.update(host_weights=host_w, host_cache=host_cache, host_used=host_w + host_cache,
               gpu_used=fixed + mem.get("gpu_cache", 0.0))
    if host_w + host_cache > host_cap:
        mem["shortfall"] = _shortfall(host_w + host_cache, host_cap)
        need_s, cap_s = _gib_pair(host_w + host_cache, host_cap)
        return False, f"host needs {need_s} GiB, has {cap_s} GiB", mem, gpu_tokens
    return True, "", mem, gpu_tokens


# --------------------------------------------------------------------------------- evaluation
def evaluate(model: ModelSpec, hw: HardwareProfile, wl: Workload, choice: Choice, allowed: Allowed | None = None,
             limits: Limits | None = None, detail: bool = True) -> Plan:
    """Cost one :class:`Choice`. Returns an infeasible :class:`Plan` (with the reason) when memory does not
    suffice. ``detail`` fills the per-layer breakdown, Algorithm 1's allocation and the mini-batch report.

    The split parameters are optimized exactly: a layer's simulated time is a max-plus expression of
    affine functions of the activation share, hence convex in it, and golden-section search finds its
    minimum. ``hybrid`` picks one static share for the whole run (minimizing the total time, like a
    ratio fixed at allocation time); ``kvpr`` re-solves the share at every decode step.
    """
    allowed = allowed or Allowed()
    limits = limits or Limits()
    if choice.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {choice.mode!r}")
    L = model.num_layers
    unified = hw.device == "cpu"
    if unified and choice.mode == "attn_offload":
        return Plan(model, hw, wl, choice, False, "no separate host: the compute device is the CPU")
    if unified:
        choice = replace(choice, gpu_layers=L)
    if not 0 <= choice.gpu_layers <= L:
        raise ValueError(f"gpu_layers must lie in [0, {L}]")
    kvb, actb, kv_t, act_t, gen_t = _rates(model, hw, choice.kv, allowed.high_fraction)
    if unified:  # nothing crosses a link
        kv_t = act_t = 0.0
    if choice.mode in ("hybrid", "kvpr") and actb >= kvb:
        return Plan(model, hw, wl, choice, False, _structural_reason(model, choice.kv, actb, kvb, choice.mode))
    B = wl.batch
    prompts = wl.prompts
    kv_cfg = KVConfig.parse(choice.kv) if choice.kv is not None else None
    kvq = kv_cfg is not None and (kv_cfg.high.k_quantized or kv_cfg.high.v_quantized)
    w16 = model.weight_bytes_per_layer(16)
    wq = model.weight_bytes_per_layer(choice.weight_bits)
    P = model.matmul_params_per_layer()
    kvw = model.kv_write_bytes_per_token(choice.kv)  # a new token's own rows: what a store moves
    actw = model.act_write_bytes_per_token(choice.kv)
    resident = _resident_pattern(L, choice.gpu_layers)
    mb_tokens = allowed.minibatch_tokens

    # --- memory: the hybrid share has a floor when host memory is tight (ACT blocks are the smaller ones)
    ok, why, mem, gpu_tokens = _memory_check(model, hw, wl, choice, allowed, limits, kvb, actb, 1.0)
    phi_lo = 0.0
    if ok and choice.mode == "hybrid":
        ok0, _, _, _ = _memory_check(model, hw, wl, choice, allowed, limits, kvb, actb, 0.0)
        if not ok0:
            phi_lo = _bisect_feasible(lambda f: _memory_check(model, hw, wl, choice, allowed, limits, kvb, actb, f)[0])
    plan = Plan(model, hw, wl, choice, ok, why, mem)
    if not ok:
        return plan

    def fwd(n_tok: float, m: int, res_layer: bool) -> tuple[float, float, float]:
        """(matmuls, attention, quantization) GPU seconds of one layer at ``n_tok`` cache tokens."""
        wbytes = w16 if res_layer else wq
        lin = m * max(2 * (B / m) * P / hw.gpu_flops, wbytes / hw.gpu_mem_bw)
        if choice.mode == "attn_offload":
            return lin, 0.0, 0.0
        attn = max(model.attention_flops(1) * n_tok / hw.gpu_flops, n_tok * kvb / hw.gpu_mem_bw)
        q = 0.0
        if kvq:  # LM-Offload Eq. 7 / Eqs. 21-23: quantize the new tokens (GQA width, parallel min/max);
            # the old cache is read quantized by the fused attention kernel (LeanKV §5), so no Eq. 24 pass
            q = lmo.quan_cache(B * 2 * model.kv_dim, hw, minmax_per_cycle=False)
        if choice.weight_bits < 16 and not res_layer:
            q += lmo.dequan_wgt(P, 1.0, hw)  # Eq. 16 for a streamed layer
        return lin, attn, q

    s_sum = float(wl.prompt_tokens)
    s_sq = float(wl.batch * wl.prompt ** 2 if isinstance(wl.prompt, int) else sum(p * p for p in prompts))

    class _Layer:
        """One layer type at one context: its components and the affine terms of its time in ``phi``."""

        def __init__(self, res_layer: bool, nxt_streamed: bool, n_tok: float, window_tok: float | None = None):
            self.res_layer = res_layer
            self.n_tok = n_tok
            self.w_next = wq / hw.h2d_bw if nxt_streamed else 0.0
            self.sliding = window_tok is not None
            if self.sliding:
                # A sliding-window layer: its window of dense K/V stays on the device, nothing moves
                # but the next layer's weights.
                self.m, self.n_gpu, self.n_host, self.res_act, self.q = 1, window_tok, 0.0, 0.0, 0.0
                self.lin = fwd(window_tok, 1, res_layer)[0]  # the matmuls as any layer's; attention below
                self.attn = max(model.attention_flops(1) * window_tok / hw.gpu_flops,
                                window_tok * model.kv_bytes_per_token(None) / hw.gpu_mem_bw)
                self.store = (0.0, 0.0)
                self.terms = [(self.w_next, 0.0), (self.lin + self.attn, 0.0)]
                return
            self.m = 1 if unified or choice.mode == "attn_offload" else max(1, math.ceil(n_tok / mb_tokens))
            self.lin, self.attn, self.q = fwd(n_tok, self.m, res_layer)
            m = self.m
            if choice.mode == "attn_offload":
                eff = hw.cpu_attn_efficiency
                self.cpu = max(model.attention_flops(1) * n_tok / (hw.cpu_flops * eff),
                               n_tok * kvb / (hw.cpu_mem_bw * eff))
                self.back = B * model.q_dim * model.dtype_bytes / hw.h2d_bw
                self.store_c = B * (model.q_dim + 2 * model.kv_dim) * model.dtype_bytes / hw.d2h_bw
                t = max(self.w_next + self.back, self.lin + self.q, self.store_c, self.cpu)
                self.terms = [(t, 0.0)]
                return
            self.n_gpu = min(n_tok, gpu_tokens)
            self.n_host = n_tok - self.n_gpu
            # the step's B new tokens go to the host once the GPU's share is full (n_tok counts them)
            new_host = min(float(B), self.n_host)
            self.res_act = self.n_gpu if choice.mode == "hybrid" else 0.0
            nh = self.n_host if choice.mode in ("hybrid", "kvpr") else 0.0  # tokens that may go as ACT
            rest = (self.lin + self.attn + self.q) / m
            x = (0.0, nh * act_t / m)
            kvl = (self.n_host * kv_t / m, -nh * kv_t / m)
            res = (self.res_act * gen_t / m, 0.0)
            host = (0.0, nh * gen_t / m)
            terms = _sim_terms(m, x, kvl, res, host, (rest, 0.0), (self.w_next, 0.0))
            if unified:
                self.store = (0.0, 0.0)
            elif choice.mode == "hybrid":
                f = new_host / hw.d2h_bw
                self.store = (f * kvw, f * (actw - kvw))
            else:
                # kvpr: a decode token stores its KV only; Eq. 11 recomputes prompt tokens alone, so
                # only their activations are kept (as the memory check counts them)
                self.store = (new_host * kvw / hw.d2h_bw, 0.0)
            self.terms = terms + [self.store]

        def time(self, phi: float) -> float:
            return max(a + b * phi for a, b in self.terms)

        def cost(self, i: int, phi: float) -> LayerCost:
            lc = LayerCost(index=i, resident=self.res_layer, weight_load=self.w_next, forward=self.lin,
                           attention=self.attn, quant=self.q, minibatches=self.m, time=self.time(phi),
                           sliding=self.sliding)
            if self.sliding:
                lc.link, lc.gpu, lc.gpu_cache_tokens = self.w_next, self.lin + self.attn, self.n_gpu
                return lc
            if choice.mode == "attn_offload":
                lc.cpu, lc.store = self.cpu, self.store_c
                lc.link, lc.gpu = self.w_next + self.back, self.lin + self.q
                return lc
            phi = phi if choice.mode in ("hybrid", "kvpr") else 0.0
            n_act = phi * self.n_host
            lc.act_share = phi
            lc.gpu_cache_tokens = self.n_gpu
            lc.act_load = n_act * act_t
            lc.kv_load = (self.n_host - n_act) * kv_t
            lc.recompute = (self.res_act + n_act) * gen_t
            lc.store = self.store[0] + self.store[1] * phi
            lc.link = lc.act_load + lc.kv_load + self.w_next
            lc.gpu = lc.recompute + self.lin + self.attn + self.q
            return lc

    # layer types: (own placement, next layer's placement) decide the cost
    # layer types: (own placement, next layer's placement, sliding window) decide the cost
    def layer_key(i: int) -> tuple[bool, bool, bool]:
        return resident[i], resident[(i + 1) % L], model.is_sliding(i)

    type_count: dict[tuple[bool, bool, bool], int] = {}
    for i in range(L):
        type_count[layer_key(i)] = type_count.get(layer_key(i), 0) + 1
    keys = list(type_count)

    def layers_at(j: int) -> dict[tuple[bool, bool, bool], _Layer]:
        n_tok = float(wl.prompt_tokens + B * j)
        window_tok = model.sliding_tokens([p + j for p in prompts]) if model.sliding_layers else 0.0
        return {k: _Layer(k[0], (not k[1]) and not unified, n_tok, window_tok if k[2] else None) for k in keys}

    def kvpr_phi(lay: _Layer) -> float:
        """KVPR §3.2: the split re-solved at this step, exactly; Eq. 11 keeps it within the prompt."""
        f_max = min(1.0, s_sum / lay.n_host) if lay.n_host > 0 else 0.0
        A = [[a for a, _ in lay.terms]]
        Bm = [[b for _, b in lay.terms]]
        return _pl_min(A, Bm, [1.0], 0.0, f_max)[0]

    steps = list(range(1, wl.gen))
    idx = steps if len(steps) <= 24 else sorted({round(1 + t * (wl.gen - 2) / 12) for t in range(13)})
    # weight of each sampled step in the decode sum (exact sum, or trapezoid with whole endpoints)
    if idx == steps:
        weights = [1.0] * len(idx)
    else:
        weights = [0.0] * len(idx)
        for a in range(len(idx) - 1):
            d = idx[a + 1] - idx[a]
            weights[a] += d / 2
            weights[a + 1] += d / 2
        weights[0] += 0.5
        weights[-1] += 0.5
    sampled = [layers_at(j) for j in idx]

    def prefill_terms() -> list[tuple[int, list[tuple[float, float]]]]:
        out = []
        for key, cnt in type_count.items():
            nxt_streamed = (not key[1]) and not unified
            link = wq / hw.h2d_bw if nxt_streamed else 0.0
            gpu = 2 * s_sum * P / hw.gpu_flops + 2 * s_sq * model.q_dim / hw.gpu_flops
            if kvq and choice.mode != "attn_offload" and not key[2]:
                gpu += lmo.quan_cache(s_sum * 2 * model.kv_dim, hw, minmax_per_cycle=False)  # Eq. 5 / Eqs. 20-23
            if unified or key[2]:  # (a sliding-window layer keeps its window on the device)
                store = (0.0, 0.0)
            elif choice.mode == "attn_offload":
                store = (s_sum * kvw / hw.d2h_bw, 0.0)
            else:
                f = s_sum * (1 - (min(1.0, gpu_tokens / s_sum) if s_sum else 0.0)) / hw.d2h_bw
                if choice.mode == "hybrid":
                    store = (f * kvw, f * (actw - kvw))
                else:
                    store = (f * (kvw + (actw if choice.mode == "kvpr" else 0.0)), 0.0)
            out.append((cnt, [(link, 0.0), (gpu, 0.0), store]))
        return out

    pf_terms = prefill_terms()

    phi = 0.0
    if choice.mode == "hybrid":
        # one static share for the run: exact minimum of the total (sum of convex piecewise-linear terms)
        rows, wts = [], []
        # (gen == 1 has no decode step to sample: the prefill terms alone decide the share)
        width = max((len(lay.terms) for lays in sampled for lay in lays.values()), default=0)
        width = max(width, 3)

        def pad(ts):
            return ts + [(-1e300, 0.0)] * (width - len(ts))

        for wgt, lays in zip(weights, sampled):
            for k, lay in lays.items():
                rows.append(pad(lay.terms))
                wts.append(wgt * type_count[k])
        for cnt, ts in pf_terms:
            rows.append(pad(ts))
            wts.append(cnt)
        phi, _ = _pl_min([[a for a, _ in r] for r in rows], [[b for _, b in r] for r in rows], wts, phi_lo, 1.0)
        plan.act_share = {"host tokens as ACT": phi}
        ok, why, mem, _ = _memory_check(model, hw, wl, choice, allowed, limits, kvb, actb, phi)
        plan.memory = mem

    decode = 0.0
    for j, wgt, lays in zip(idx, weights, sampled):
        tot = share = 0.0
        for k, lay in lays.items():
            f = kvpr_phi(lay) if choice.mode == "kvpr" else phi
            tot += type_count[k] * lay.time(f)
            share += type_count[k] * f
        decode += wgt * tot
        if choice.mode == "kvpr":
            plan.kvpr_splits.append((j, share / max(model.cache_layers, 1)))
    plan.decode_time = decode if steps else 0.0
    plan.prefill_time = sum(cnt * max(a + b * phi for a, b in ts) for cnt, ts in pf_terms)
    if choice.weight_bits < 16:
        plan.t_init = (L - choice.gpu_layers) * lmo.quan_pf_wgt(P, 1.0, hw)  # Eq. 3

    if detail:
        rep = (wl.gen - 1) // 2 + 1 if wl.gen > 1 else 1
        lays = layers_at(rep)
        costs = {k: lay.cost(0, kvpr_phi(lay) if choice.mode == "kvpr" else phi) for k, lay in lays.items()}
        plan.layers = [replace(costs[layer_key(i)], index=i) for i in range(L)]
        plan.step_context = wl.mean_prompt + rep
        if choice.mode == "hybrid" and not unified:
            lc0 = next((x for x in plan.layers if not x.resident and not x.sliding),
                       next((x for x in plan.layers if not x.sliding), plan.layers[0]))
            bt = hyb.BLOCK_TOKENS
            blocks = math.ceil(plan.step_context / bt) * B
            gpu_blocks = int(lc0.gpu_cache_tokens // bt)
            # Algorithm 1 as published (Eqs. 9-10: no ACT transfer, no forward pass), per layer, this workload
            plan.algorithm1 = hyb.allocate_for_workload(
                max(0, blocks - gpu_blocks), lc0.weight_load, gpu_blocks, kvb * bt * L, actb * bt * L,
                lambda n: n * bt * gen_t, lambda n: n * bt * kv_t)
            plan.minibatch_report = _minibatch_report(wl, plan, gen_t, kv_t, allowed)
    return plan


def _bisect_feasible(ok, iters: int = 50) -> float:
    """Smallest share in [0, 1] for which ``ok(share)`` holds, assuming feasibility grows with the share."""
    if not ok(1.0):
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _minibatch_report(wl: Workload, plan: Plan, gen_t: float, kv_t: float, allowed: Allowed) -> dict[str, float]:
    """Per-request blocks under Eq. 11 at the representative step, packed by the greedy of §4.3.3."""
    lc = next((x for x in plan.layers if not x.resident and not x.sliding),
              next((x for x in plan.layers if not x.sliding), plan.layers[0]))
    phi = lc.act_share
    total_share = phi if lc.gpu_cache_tokens == 0 else None
    n_tok = wl.prompt_tokens + wl.batch * (plan.step_context - wl.mean_prompt)
    if total_share is None:
        act_tok = lc.gpu_cache_tokens + phi * (n_tok - lc.gpu_cache_tokens)
        total_share = act_tok / n_tok if n_tok else 0.0
    bt = hyb.BLOCK_TOKENS
    scale = 1000
    act_host = round(total_share * scale)
    kv_host = scale - act_host
    reqs = []
    for r, p in enumerate(wl.prompts):
        nb = math.ceil((p + plan.step_context - wl.mean_prompt) / bt)
        a, k = hyb.allocate_request_blocks(nb, act_host, kv_host)
        reqs.append(hyb.Request(r, a, k))
    cap_a, cap_k = hyb.capacities_from_buffer(allowed.minibatch_tokens)
    if any(r.act > cap_a or r.kv > cap_k for r in reqs):
        return {"minibatches": float(lc.minibatches), "worst_F_b": math.nan, "mean_F_b": math.nan}
    bins = hyb.pack_minibatches(reqs, cap_a, cap_k, lambda n: n * bt * gen_t, lambda n: n * bt * kv_t)
    n, worst, mean = hyb.packing_cost(bins, lambda n: n * bt * gen_t, lambda n: n * bt * kv_t)
    return {"minibatches": float(n), "worst_F_b": worst, "mean_F_b": mean, "act_block_share": total_share}


# --------------------------------------------------------------------------------- search
def _k_max(model: ModelSpec, hw: HardwareProfile, limits: Limits, weight_bits: int) -> int:
    gpu_cap = limits.gpu(hw)
    emb = model.embedding_params() * model.dtype_bytes
    w16 = model.weight_bytes_per_layer(16)
    wq = model.weight_bytes_per_layer(weight_bits)
    room = gpu_cap - emb - GPU_RESERVE
    if room >= model.num_layers * w16:
        return model.num_layers
    return max(0, min(model.num_layers, int((room - 2 * wq) // w16)))


def _k_candidates(k_hi: int) -> list[int]:
    """Resident-layer counts to try: every count up to 64 of them, else 65 evenly spaced. The set depends
    only on memory, never on speeds, so a faster machine can never lose a candidate (monotonic plans)."""
    if k_hi <= 64:
        return list(range(k_hi + 1))
    return sorted({round(k_hi * t / 64) for t in range(65)})


def _search_k(evalf, k_hi: int) -> list[Plan]:
    """Evaluate every candidate resident-layer count."""
    return [evalf(k) for k in _k_candidates(k_hi)]


def _infeasible_summary(model: ModelSpec, hw: HardwareProfile, wl: Workload, allowed: Allowed, limits: Limits,
                        candidates: list[Plan]) -> str:
    """Why no candidate fits.

    First a bound no choice can beat: the cache of every token at the cheapest allowed bytes per
    token against GPU and host memory together. When even that does not fit, the cache is the
    limit, whatever the weights or buffers need. Otherwise the candidate that came closest (its
    ``memory["shortfall"]``, bytes needed / bytes available, is smallest) names the binding limit;
    quoting any other would blame a resource that another choice already satisfies.
    """
    if not candidates:
        return "no feasible plan: no candidate was allowed (check --kv, --weight-bits and the --no-* flags)"
    unified = hw.device == "cpu"
    gpu_cap = limits.gpu(hw)
    total_cap = gpu_cap if unified else gpu_cap + limits.host(hw)
    per_tok = min(model.kv_bytes_per_token(kv, allowed.high_fraction) for kv in allowed.kv_configs)
    if allowed.activation_cache:
        per_tok = min(per_tok, model.act_bytes_per_token())
    tokens = wl.prompt_tokens + wl.batch * wl.gen
    cache = tokens * model.num_layers * per_tok
    bits = 16 if unified else min(allowed.weight_bits)
    weights = model.num_layers * model.weight_bytes_per_layer(bits) + model.embedding_params() * model.dtype_bytes
    where = "memory" if unified else "GPU and host memory together"
    if cache > total_cap:
        cache_s, cap_s = _gib_pair(cache, total_cap)
        return (f"no feasible plan: the cache alone needs {cache_s} GiB ({tokens} tokens x "
                f"{model.num_layers} layers x {per_tok:.0f} B per token at best), more than the {where} "
                f"({cap_s} GiB); lower --batch, --prompt or --gen, or allow a smaller --kv")
    if cache + weights > total_cap:
        need_s, cap_s = _gib_pair(weights + cache, total_cap)
        return (f"no feasible plan: the weights ({weights / GiB:.1f} GiB at {bits} bits) and the cache "
                f"({cache / GiB:.1f} GiB at best) need {need_s} GiB, more than the {where} ({cap_s} GiB)")
    best = min(candidates, key=lambda p: p.memory.get("shortfall", math.inf))
    return f"no feasible plan: the closest candidate ({best.choice.label()}) fails: {best.infeasible_reason}"


def _fastest(plans: Sequence[Plan]) -> Plan:
    """The plan with the least predicted time. Plans within a relative 1e-9 of it tie (a link
    transfer hidden behind compute costs nothing, so any share of streamed layers that stays hidden
    predicts the same time), and a tie goes to the simpler plan: the earlier mode, the most layers
    resident, full-precision weights, the fp16 cache."""
    least = min(p.total_time for p in plans)
    tied = [p for p in plans if p.total_time <= least * (1 + 1e-9)]
    return min(tied, key=lambda p: (MODES.index(p.choice.mode), -p.choice.gpu_layers, -p.choice.weight_bits,
                                    p.choice.kv is not None, p.total_time))


def plan(model: ModelSpec | str, hardware: HardwareProfile | str, workload: Workload,
         allowed: Allowed | None = None, limits: Limits | None = None) -> Plan:
    """Search the allowed mechanisms and return the plan with the highest predicted throughput.

    The returned plan carries its per-layer breakdown at the middle decode step, the KV-only offloading
    baseline (``plan.baseline``; FlexGen's configuration: fp16 cache, KV loaded every step, the best
    weight placement) and ``plan.reasons``: why each mechanism was or was not chosen.
    """
    model = get_model(model)
    hw = get_hardware(hardware) if not isinstance(hardware, HardwareProfile) else hardware
    allowed = allowed or Allowed()
    limits = limits or Limits()
    unified = hw.device == "cpu"
    L = model.num_layers
    reasons: dict[str, str] = {}

    candidates: list[Plan] = []
    structural: dict[str, str] = {}
    modes = ["kv"]
    if allowed.activation_cache:
        modes.append("hybrid")
    if allowed.kvpr:
        modes.append("kvpr")
    if allowed.attention_offload and not unified:
        modes.append("attn_offload")
    kv_list = list(dict.fromkeys(allowed.kv_configs))
    for kv in kv_list:
        kvb = model.kv_bytes_per_token(kv, allowed.high_fraction)
        actb = model.act_bytes_per_token(kv)
        for mode in modes:
            if mode in ("hybrid", "kvpr") and actb >= kvb:
                structural.setdefault(mode, _structural_reason(model, kv, actb, kvb, mode))
                continue
            if mode == "attn_offload" and kv is not None:
                continue  # the cache never crosses the link; nothing for quantization to save there
            for wb in allowed.weight_bits:
                if unified and wb != 16:
                    continue
                if unified or not allowed.weight_placement:
                    ks = [L if unified else 0]
                    candidates += [evaluate(model, hw, workload, Choice(kv, mode, k, wb), allowed, limits, False)
                                   for k in ks]
                else:
                    kh = _k_max(model, hw, limits, wb)
                    candidates += _search_k(
                        lambda k, kv=kv, mode=mode, wb=wb: evaluate(model, hw, workload, Choice(kv, mode, k, wb),
                                                                    allowed, limits, False), kh)
    feasible = [p for p in candidates if p.feasible]

    # the KV-only offloading baseline, always costed
    base_allowed = replace(allowed, kv_configs=(None,), weight_bits=(16,))
    if unified:
        base_c = [evaluate(model, hw, workload, Choice(None, "kv", L), base_allowed, limits, False)]
    else:
        base_c = _search_k(lambda k: evaluate(model, hw, workload, Choice(None, "kv", k), base_allowed, limits, False),
                           _k_max(model, hw, limits, 16))
    base_feas = [p for p in base_c if p.feasible]
    baseline = None
    if base_feas:
        b = _fastest(base_feas)
        baseline = evaluate(model, hw, workload, b.choice, base_allowed, limits, True)

    if not feasible:
        out = Plan(model, hw, workload, Choice(None, "kv", 0), False, _infeasible_summary(model, hw, workload, allowed, limits, candidates),
                   candidates=len(candidates))
        out.baseline = baseline
        out.reasons = {"feasibility": out.infeasible_reason}
        return out
    best_c = _fastest(feasible)
    best = evaluate(model, hw, workload, best_c.choice, allowed, limits, True)
    best.baseline = baseline
    best.candidates = len(candidates)

    def best_where(pred) -> Plan | None:
        ps = [p for p in feasible if pred(p.choice)]
        return min(ps, key=lambda p: p.total_time) if ps else None

    def tput(p: Plan | None) -> str:
        return f"{p.throughput:.2f} tok/s" if p else "n/a"

    ch = best.choice
    # --- per-mechanism reasons
    for mode, key in (("hybrid", "activation_cache"), ("kvpr", "kvpr"), ("attn_offload", "attention_offload")):
        allowed_flag = {"hybrid": allowed.activation_cache, "kvpr": allowed.kvpr,
                        "attn_offload": allowed.attention_offload}[mode]
        if not allowed_flag:
            reasons[key] = "not allowed"
            continue
        if mode == "attn_offload" and unified:
            reasons[key] = "not applicable: the compute device is the host CPU, there is no separate host to offload to"
            continue
        with_m = best_where(lambda c, m=mode: c.mode == m)
        without = best_where(lambda c, m=mode: c.mode != m)
        if ch.mode == mode:
            extra = ""
            if mode == "hybrid":
                share = best.minibatch_report.get("act_block_share", 0.0)
                a1 = best.algorithm1
                a1s = (f"; Algorithm 1 as published would keep {a1.act_fraction():.0%} of blocks as ACT"
                       if a1 else "")
                extra = f" ({share:.0%} of cache blocks held as activations{a1s})"
            elif mode == "kvpr" and best.kvpr_splits:
                fr = [f for _, f in best.kvpr_splits]
                extra = f" (recomputed share {min(fr):.0%}-{max(fr):.0%} of host tokens, re-solved per step)"
            if mode == "attn_offload" and hw.cpu_attn_efficiency >= 1.0:
                extra = (f" (assumes CPU attention at the host's peak {hw.cpu_mem_bw / GB:.0f} GB/s; FlexGen's "
                         "measured CPU attention in LM-Offload Table 3 implies about 1% of peak, so check with "
                         "--hardware detect or compare with --no-attn-offload)")
            reasons[key] = f"chosen{extra}: {tput(best)} vs {tput(without)} without it"
        elif mode in structural and with_m is None:
            reasons[key] = "declined: " + structural[mode]
        elif with_m is None:
            reasons[key] = "declined: no feasible plan with it fits the memory limits"
        else:
            why = ""
            if mode in ("hybrid", "kvpr"):
                lay = best.layers[0] if best.layers else None
                if lay and lay.bottleneck == "GPU":
                    why = "; the GPU, not the link, is already the bottleneck"
                elif lay and lay.link == 0:
                    why = "; no cache crosses the link in the chosen plan"
            reasons[key] = f"declined: best plan with it predicts {tput(with_m)} vs {tput(best)}{why}"
    if len(kv_list) == 1 and kv_list[0] is None:
        reasons["kv_quantization"] = ("not considered: only the lossless fp16 cache was allowed "
                                      "(allow leankit configs such as K8V4 to let the planner weigh them)")
    else:
        quant = best_where(lambda c: c.kv is not None)
        plain = best_where(lambda c: c.kv is None)
        if ch.kv is not None:
            kvb = model.kv_bytes_per_token(ch.kv, allowed.high_fraction)
            reasons["kv_quantization"] = (f"chosen {ch.kv}: {kvb:.0f} B/token/layer vs "
                                          f"{model.kv_bytes_per_token(None):.0f} B fp16; {tput(best)} vs "
                                          f"{tput(plain)} with the best fp16 plan")
        else:
            reasons["kv_quantization"] = f"declined: best quantized plan predicts {tput(quant)} vs {tput(best)}"
    wstr = (f"{ch.gpu_layers}/{L} layers resident on the GPU, {L - ch.gpu_layers} streamed over the link each "
            f"step" if not unified else "all weights in the single (host) memory")
    if ch.weight_bits < 16:
        wstr += f", streamed weights quantized to {ch.weight_bits} bits (LM-Offload Eqs. 3-4)"
    reasons["weight_placement"] = wstr
    best.reasons = reasons
    best.threads, reasons["threads"] = _thread_advice(model, hw, workload, ch)
    return best


def _structural_reason(model: ModelSpec, kv, actb: float, kvb: float, mode: str) -> str:
    what = "activation caching" if mode == "hybrid" else "recomputing KV from activations"
    gqa = (f"{model.name} uses grouped-query attention ({model.num_kv_heads} KV heads for "
           f"{model.num_heads} query heads), so " if model.is_gqa else "")
    cfg = f" with cache {kv}" if kv else ""
    return (f"{gqa}one token's activation ({actb:.0f} B/layer) is not smaller than its K+V ({kvb:.0f} B/layer"
            f"{cfg}); {what} would move and store more bytes and add GPU work")


def _thread_advice(model: ModelSpec, hw: HardwareProfile, wl: Workload, ch: Choice):
    """LM-Offload Algorithm 3 for the host CPU threads, from analytic per-op times of CPU attention."""
    T = hw.cpu_threads
    if T < 6:
        return None, (f"Algorithm 3 needs at least 6 hardware threads (one compute thread plus five load/store "
                      f"tasks); this machine has {T} (time the settings with --measure-threads)")
    ctx = int(wl.mean_prompt + wl.gen / 2)
    times = lmo.analytic_attention_times(model, hw, wl.batch, ctx, T)
    ops = lmo.attention_graph(times)
    p = model.dtype_bytes
    vols = {
        "load_weight": model.weight_bytes_per_layer(ch.weight_bits) if ch.gpu_layers < model.num_layers else 0.0,
        "load_cache": 0.0 if ch.mode == "attn_offload" else wl.batch * ctx * model.kv_bytes_per_token(ch.kv),
        "load_activation": wl.batch * model.hidden * p,
        "store_cache": 0.0 if ch.mode == "attn_offload" else wl.batch * model.kv_bytes_per_token(ch.kv),
        "store_activation": wl.batch * model.hidden * p,
    }
    st = lmo.thread_search(ops, T, vols, hw.h2d_bw, hw.cpu_mem_bw / T * 4)
    if st is None:
        return None, "Algorithm 3 found no setting that leaves five threads for load/store"
    return st, (f"Algorithm 3: {st.intra_op_compute} intra-op x {st.inter_op_compute} inter-op threads for the "
                f"attention task, inter-op {st.inter_op} in all; load/store threads {st.io_threads}")


# --------------------------------------------------------------------------------- formatting
def _ms(x: float) -> str:
    return f"{x * 1e3:9.3f}"


def _ranges(idx: Sequence[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"0,2-4,7"``."""
    out, run = [], []
    for i in sorted(idx):
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
            run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ",".join(out)


def group_layers(layers: Sequence[LayerCost]) -> list[tuple[str, int, LayerCost]]:
    """Collapse layers with identical costs into ``(layer list, count, cost)`` rows, in first-layer order."""
    groups: dict[tuple, list[LayerCost]] = {}
    for lc in layers:
        sig = (lc.resident, round(lc.time, 12), round(lc.link, 12), round(lc.gpu, 12), round(lc.weight_load, 12))
        groups.setdefault(sig, []).append(lc)
    rows = [(_ranges([x.index for x in g]), len(g), g[0]) for g in groups.values()]
    return sorted(rows, key=lambda r: r[2].index)


def plan_label(pp: Plan) -> str:
    """A plan's choice in words; on a CPU (one memory, nothing offloaded) without the offloading
    terms that would describe a GPU's."""
    if pp.hardware.device == "cpu":
        mode = {"kv": "no offloading", "hybrid": "activation cache instead of KV"}.get(pp.choice.mode, pp.choice.mode)
        return f"{mode} (the CPU is the compute device, one memory), cache {pp.choice.kv or 'fp16'}"
    return pp.choice.label()


def format_plan(p: Plan) -> str:
    """The plan as text tables: summary, memory, per-layer breakdown, mechanism reasons."""
    wl = p.workload
    title = (f"leankit plan: {p.model.name} on {p.hardware.name}, batch {wl.batch}, prompt "
             f"{wl.mean_prompt:g}, generate {wl.gen}")
    out = [title]
    if not p.feasible:
        out.append(f"  infeasible: {p.infeasible_reason}")
        return "\n".join(out)
    unified = p.hardware.device == "cpu"

    out.append(f"  plan       {plan_label(p)}")
    out.append(f"  predicted  {p.throughput:10.2f} tok/s end to end, {p.decode_throughput:.2f} tok/s decode "
               f"(prefill {p.prefill_time:.3f} s, decode {p.decode_time:.3f} s)")
    if p.baseline is not None and p.baseline.feasible:
        b = p.baseline
        out.append(f"  baseline   {b.throughput:10.2f} tok/s  ({plan_label(b)})")
        out.append(f"  speedup    {p.speedup:10.2f}x over {'the plain fp16 cache' if unified else 'KV-only offloading'}")
    m = p.memory
    if p.hardware.device == "cpu":
        out.append(f"  memory     {m.get('gpu_used', 0) / GiB:.2f} of {m.get('gpu_capacity', 0) / GiB:.1f} GiB "
                   "(one memory: the compute device is the host)")
    else:
        out.append(f"  GPU memory {m.get('gpu_used', 0) / GiB:8.2f} of {m.get('gpu_capacity', 0) / GiB:.1f} GiB "
                   f"(weights {m.get('gpu_weights', 0) / GiB:.2f}, cache {m.get('gpu_cache', 0) / GiB:.2f})")
        out.append(f"  host       {m.get('host_used', 0) / GiB:8.2f} of {m.get('host_capacity', 0) / GiB:.1f} GiB "
                   f"(weights {m.get('host_weights', 0) / GiB:.2f}, cache {m.get('host_cache', 0) / GiB:.2f})")
    if p.minibatch_report:
        r = p.minibatch_report
        out.append(f"  mini-batch {r['minibatches']:.0f} per layer (greedy packing, Eqs. 12-13), worst F_b "
                   f"{r['worst_F_b']:.3f}")
    out.append("")
    out.append(f"  per-layer decode breakdown at step context {p.step_context:g} (ms):")
    hdr = (f"  {'weights':>7} {'n':>3} {'W load':>9} {'KV load':>9} {'ACT load':>9} {'store':>9} {'recomp':>9} "
           f"{'forward':>9} {'attn':>9} {'quant':>9} {'CPU':>9} {'layer':>9}  bottleneck   layers")
    out.append(hdr)
    for rng, n, lc in group_layers(p.layers):
        out.append(f"  {('gpu' if not unified else 'cpu') if lc.resident else 'host':>7} {n:>3} {_ms(lc.weight_load)} {_ms(lc.kv_load)} "
                   f"{_ms(lc.act_load)} {_ms(lc.store)} {_ms(lc.recompute)} {_ms(lc.forward)} {_ms(lc.attention)} "
                   f"{_ms(lc.quant)} {_ms(lc.cpu)} {_ms(lc.time)}  {'CPU' if unified else lc.bottleneck:<11}  {rng}")
    out.append(f"  {'all':>7} {len(p.layers):>3} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} "
               f"{'':>9} {_ms(p.step_time)}  (one decode step)")
    out.append("  W load is the next layer's weights, prefetched during this layer; columns are busy times on")
    out.append("  their own resource (link, GPU, CPU), which overlap; 'layer' is the simulated layer time.")
    out.append("")
    out.append("  mechanisms:")
    for k, v in p.reasons.items():
        out.append(f"    {k:<18} {v}")
    return "\n".join(out)


__all__ = [
    "GB",
    "MODES",
    "Allowed",
    "Choice",
    "GiB",
    "LayerCost",
    "Limits",
    "Plan",
    "Workload",
    "evaluate",
    "format_plan",
    "group_layers",
    "plan",
]
