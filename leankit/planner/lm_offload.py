"""LM-Offload's performance model (§3, Eqs. 1-24) and thread-level parallelism control (§4, Algorithm 3).

Performance model. FlexGen's end-to-end time (Eq. 1) is
``T = T_init + T_pf * l + T_gen * (n - 1) * l`` with ``T_gen`` the max of the six decode tasks (Eq. 2):
load_weight, load_cache, load_activation, store_cache, store_activation, compute. Quantization adds:

* weights: quantized once (``quan_pf_wgt``, Eqs. 12-15, folded into ``T_init`` by Eq. 3) and dequantized
  on every load (``dequan_wgt``, Eq. 16, added to load_weight by Eq. 4);
* KV cache: the prefill cache is quantized (Eqs. 17, 20-23, added to ``T_pf`` by Eq. 5); every step the old
  cache is dequantized (Eqs. 18, 24, added to load_cache by Eq. 6) and the new one quantized (Eq. 19,
  added to store_cache by Eq. 7);
* with attention offloading the cache never crosses the link: ``load_cache = store_cache = 0``; without
  it, loads and stores of weights and cache scale by FlexGen's ratio ``r`` (Eqs. 8-9).

Notes on reading the equations literally:

* Eqs. 17-19 count *elements* in one layer over the whole generation (Eq. 18 already multiplies the
  average cache by ``n``), so a single decode step is charged ``1/n`` of Eqs. 18 and 19.
* Eqs. 13 and 21 divide an element count by a clock frequency (one element per cycle for the min/max
  scan) and Eqs. 15 and 23 divide an element count by a bandwidth in bytes/s. Both are kept as printed;
  the min/max term is pessimistic on a GPU, where a parallel reduction runs at memory speed.
* Eq. 16 says "replace cpu_freq with gpu_freq" in Eq. 14, which has ``cpu_flops`` and no frequency; the
  dequantization normalization is charged at ``gpu_flops``.
* For GQA models the cache has ``2 * kv_dim`` values per token instead of ``2 * h_1``.
* Eq. 2 treats the three load tasks as independent. They share one link, so :func:`six_tasks` also
  reports ``link_aware`` times (same-direction tasks summed), which the composed planner uses.

Parallelism control (Algorithm 3): for each intra-op thread count of the compute task, take the inter-op
count from the maximum concurrency of its operator graph (Kahn's algorithm with profiled per-op times),
require at least five free threads for the five load/store tasks, share those in proportion to their
transfer volumes, predict throughput, keep the best. :func:`apply_threads` applies a choice with
``torch.set_num_threads`` / ``torch.set_num_interop_threads``; :func:`measure_thread_settings` times a
CPU attention workload under each setting in a fresh process, to check on this machine whether the choice
actually helps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .hardware import HardwareProfile
from .model_spec import ModelSpec

IO_TASKS = ("load_weight", "load_cache", "load_activation", "store_cache", "store_activation")


# ------------------------------------------------------------------------ Eqs. 12-16 weights
def num_weights(h1: int, h2: int) -> int:
    """``num_weights = 4 h_1^2 + 2 h_1 h_2``: Q, K, V, output projection and the two MLP matrices."""
    return 4 * h1 * h1 + 2 * h1 * h2


def quan_pf_wgt(n_weights: float, wc: float, hw: HardwareProfile) -> float:
    """Eq. 12 = Eq. 13 (min/max, ``/cpu_freq``) + Eq. 14 (3 FLOP per weight, ``/cpu_flops``) + Eq. 15
    (post-processing copy, ``/cpu_mem_bw``), for the share ``wc`` of one layer's weights kept on the CPU."""
    n = n_weights * wc
    return n / hw.cpu_freq + 3 * n / hw.cpu_flops + n / hw.cpu_mem_bw


def dequan_wgt(n_weights: float, wc: float, hw: HardwareProfile) -> float:
    """Eq. 16: de-normalization (Eq. 14 on the GPU) + post-processing (Eq. 15 with ``gpu_mem_bw``)."""
    n = n_weights * wc
    return 3 * n / hw.gpu_flops + n / hw.gpu_mem_bw


# ------------------------------------------------------------------------ Eqs. 17-24 KV cache
def pf_kv_cache(s: int, kv_width: int, bls: int) -> float:
    """Eq. 17: prefilled cache elements of one layer, ``2 (s + 1) h_1 bls`` (``kv_width`` = h_1 for MHA)."""
    return 2.0 * (s + 1) * kv_width * bls


def old_kv_cache(s: int, n: int, kv_width: int, bls: int) -> float:
    """Eq. 18: old cache elements read over the generation, ``(2 (s + n/2) h_1 bls) * n``."""
    return 2.0 * (s + n / 2) * kv_width * bls * n


def new_kv_cache(kv_width: int, bls: int, n: int) -> float:
    """Eq. 19: newly generated cache elements over the generation, ``2 h_1 bls n``."""
    return 2.0 * kv_width * bls * n


def quan_cache(elements: float, hw: HardwareProfile, minmax_per_cycle: bool = True) -> float:
    """Eqs. 20-23 on the GPU: min/max (Eq. 21, ``/gpu_freq``) + normalization (Eq. 22, ``3/gpu_flops``) +
    post-processing (Eq. 23, ``/gpu_mem_bw``) for ``elements`` cache values.

    ``minmax_per_cycle=False`` replaces Eq. 21's one-element-per-cycle scan with a parallel reduction at
    memory speed (``elements / gpu_mem_bw``), which is how leankit's quantization kernels run.
    """
    minmax = elements / hw.gpu_freq if minmax_per_cycle else elements / hw.gpu_mem_bw
    return minmax + 3 * elements / hw.gpu_flops + elements / hw.gpu_mem_bw


def dequan_cache(elements: float, hw: HardwareProfile) -> float:
    """Eq. 24: de-normalization + post-processing, no min/max."""
    return 3 * elements / hw.gpu_flops + elements / hw.gpu_mem_bw


# ------------------------------------------------------------------------ the six tasks
@dataclass(frozen=True)
class LMOffloadConfig:
    """One offloading policy: weight share on the CPU, bits, attention placement.

    ``bls`` is FlexGen's zig-zag block size (GPU batch x number of GPU batches); ``wc`` the share of
    weights on the CPU; ``r`` FlexGen's ratio for Eqs. 8-9 (1.0 = no rescaling).
    """

    bls: int
    wc: float
    weight_bits: int = 16
    kv_bits: int = 16
    attention_offload: bool = False
    r: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.wc <= 1.0:
            raise ValueError(f"wc must lie in [0, 1], got {self.wc}")
        if self.bls <= 0:
            raise ValueError("bls must be positive")
        for b in (self.weight_bits, self.kv_bits):
            if b not in (16, 8, 4, 2, 1):
                raise ValueError(f"bits must be one of 16, 8, 4, 2, 1; got {b}")


@dataclass(frozen=True)
class LMOffloadEstimate:
    """Eq. 1's terms and the resulting throughput."""

    total: float
    t_init: float
    t_pf: float
    t_gen: float
    tasks: dict[str, float]
    link_aware_t_gen: float
    throughput: float
    config: LMOffloadConfig


def _bytes(elements: float, bits: int, dtype_bytes: int) -> float:
    if bits >= 16:
        return elements * dtype_bytes
    # FlexGen-style group-wise quantization, groups of 64 with an fp16 min and scale (LM-Offload Alg. 2).
    return elements * bits / 8 + elements / 64 * 4


def six_tasks(model: ModelSpec, hw: HardwareProfile, cfg: LMOffloadConfig, s: int, n: int) -> dict[str, float]:
    """Per-layer time of each decode task (Eq. 2's arguments) with the quantization terms of Eqs. 4, 6, 7
    and the attention-offload / ratio rules (Eqs. 8-9), for one decode step of the whole block."""
    h1, p = model.hidden, model.dtype_bytes
    kvw = model.kv_dim  # = h_1 for MHA
    nw = model.matmul_params_per_layer()
    tasks: dict[str, float] = {}
    lw = _bytes(nw * cfg.wc, cfg.weight_bits, p) / hw.h2d_bw
    if cfg.weight_bits < 16:
        lw += dequan_wgt(nw, cfg.wc, hw)  # Eq. 4
    old_step = old_kv_cache(s, n, kvw, cfg.bls) / n  # elements of old cache read in one step
    new_step = new_kv_cache(kvw, cfg.bls, n) / n
    lc = _bytes(old_step, cfg.kv_bits, p) / hw.h2d_bw
    sc = _bytes(new_step, cfg.kv_bits, p) / hw.d2h_bw
    if cfg.kv_bits < 16:
        lc += dequan_cache(old_step, hw)  # Eq. 6
        sc += quan_cache(new_step, hw)  # Eq. 7
    if cfg.attention_offload:
        lc = sc = 0.0  # the cache stays in host memory
    else:
        lw *= cfg.r  # Eqs. 8-9
        lc *= cfg.r
        sc *= cfg.r
    tasks["load_weight"] = lw
    tasks["load_cache"] = lc
    tasks["load_activation"] = cfg.bls * h1 * p / hw.h2d_bw
    tasks["store_cache"] = sc
    tasks["store_activation"] = cfg.bls * h1 * p / hw.d2h_bw
    # compute: MLP and projections on the GPU, attention on the GPU or the CPU (memory-bound reads).
    lin = max(2 * cfg.bls * nw / hw.gpu_flops, model.weight_bytes_per_layer() / hw.gpu_mem_bw)
    ctx = s + n / 2
    attn_bytes = cfg.bls * ctx * 2 * kvw * p
    attn_flops = cfg.bls * model.attention_flops(int(ctx))
    if cfg.attention_offload:
        eff = hw.cpu_attn_efficiency
        attn = max(attn_flops / (hw.cpu_flops * eff), attn_bytes / (hw.cpu_mem_bw * eff))
    else:
        attn = max(attn_flops / hw.gpu_flops, _bytes(old_step, cfg.kv_bits, p) / hw.gpu_mem_bw)
    tasks["compute"] = lin + attn
    return tasks


def estimate(model: ModelSpec, hw: HardwareProfile, cfg: LMOffloadConfig, s: int, n: int,
             t_init_base: float = 0.0) -> LMOffloadEstimate:
    """Eq. 1 with Eqs. 2-9: ``T = T_init + T_pf * l + T_gen * (n - 1) * l`` and throughput ``bls * n / T``.

    ``t_init_base`` is the time to bring weights from disk (0: already in host memory).
    """
    if n < 1:
        raise ValueError("generation length n must be >= 1")
    nw = model.matmul_params_per_layer()
    t_init = t_init_base
    if cfg.weight_bits < 16:
        t_init += quan_pf_wgt(nw, cfg.wc, hw) * model.num_layers  # Eq. 3
    # prefill of one layer: weights in, prompt compute, cache out
    p = model.dtype_bytes
    lw = _bytes(nw * cfg.wc, cfg.weight_bits, p) / hw.h2d_bw
    comp = 2 * cfg.bls * s * nw / hw.gpu_flops + 2 * cfg.bls * s * s * model.q_dim / hw.gpu_flops
    pf_el = pf_kv_cache(s, model.kv_dim, cfg.bls)
    store = _bytes(pf_el, cfg.kv_bits, p) / hw.d2h_bw
    t_pf = max(lw, comp, store)
    if cfg.kv_bits < 16 and not cfg.attention_offload:
        t_pf += quan_cache(pf_el, hw)  # Eq. 5
    tasks = six_tasks(model, hw, cfg, s, n)
    t_gen = max(tasks.values())  # Eq. 2
    h2d = tasks["load_weight"] + tasks["load_cache"] + tasks["load_activation"]
    d2h = tasks["store_cache"] + tasks["store_activation"]
    link_aware = max(h2d, d2h, tasks["compute"])
    total = t_init + t_pf * model.num_layers + t_gen * (n - 1) * model.num_layers  # Eq. 1
    return LMOffloadEstimate(total, t_init, t_pf, t_gen, tasks, link_aware, cfg.bls * n / total, cfg)


def compare_quantization(model: ModelSpec, hw: HardwareProfile, s: int, n: int, bls: int, wc: float,
                         bits: Sequence[int] = (16, 4)) -> dict[str, LMOffloadEstimate]:
    """The three uses of the model listed at the end of LM-Offload §3.2: weight quantization or not, KV
    quantization or not, with and without attention offloading. Keys look like ``"gpu-attn w4 kv16"``."""
    out = {}
    for attn in (False, True):
        for wb in bits:
            for kb in bits:
                if attn and kb < 16:
                    continue  # the cache never leaves host memory, nothing to (de)quantize
                cfg = LMOffloadConfig(bls=bls, wc=wc, weight_bits=wb, kv_bits=kb, attention_offload=attn)
                key = f"{'cpu' if attn else 'gpu'}-attn w{wb} kv{kb}"
                out[key] = estimate(model, hw, cfg, s, n)
    return out


# ------------------------------------------------------------------------ Algorithm 3
@dataclass(frozen=True)
class OpProfile:
    """One operator of the compute task: its predecessors and its time (s) per intra-op thread count."""

    name: str
    deps: tuple[str, ...]
    times: Mapping[int, float]

    def time(self, threads: int) -> float:
        """Profiled time at ``threads`` (nearest profiled count at or below, else the smallest)."""
        keys = sorted(self.times)
        below = [k for k in keys if k <= threads]
        return float(self.times[below[-1] if below else keys[0]])


def _topo(ops: Sequence[OpProfile]) -> list[OpProfile]:
    """Kahn's algorithm; raises ``ValueError`` on a cycle or an unknown dependency."""
    by = {o.name: o for o in ops}
    for o in ops:
        for d in o.deps:
            if d not in by:
                raise ValueError(f"op {o.name!r} depends on unknown op {d!r}")
    indeg = {o.name: len(o.deps) for o in ops}
    children: dict[str, list[str]] = {o.name: [] for o in ops}
    for o in ops:
        for d in o.deps:
            children[d].append(o.name)
    ready = [o.name for o in ops if indeg[o.name] == 0]
    order = []
    while ready:
        name = ready.pop(0)
        order.append(by[name])
        for c in children[name]:
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if len(order) != len(ops):
        raise ValueError("operator graph has a cycle")
    return order


def _schedule(ops: Sequence[OpProfile], intra: int, inter: int | None) -> tuple[float, int]:
    """Event-driven list scheduling in Kahn order with at most ``inter`` operators running at once
    (``None``: unbounded). Returns ``(makespan, most operators running at once)``."""
    pending = _topo(ops)
    done: set[str] = set()
    running: list[tuple[float, str]] = []
    t = 0.0
    most = 0
    while pending or running:
        for o in list(pending):
            if (inter is None or len(running) < inter) and all(d in done for d in o.deps):
                running.append((t + o.time(intra), o.name))
                pending.remove(o)
        most = max(most, len(running))
        if not running:  # pragma: no cover - _topo guarantees progress
            break
        running.sort()
        t = running[0][0]
        while running and running[0][0] <= t:
            done.add(running.pop(0)[1])
    return t, most


def max_concurrency(ops: Sequence[OpProfile], intra: int) -> int:
    """Algorithm 3 line 4: the most operators that run at once when every op starts as soon as its
    inputs are ready (Kahn's topological order, profiled times at ``intra`` threads)."""
    return max(1, _schedule(ops, intra, None)[1])


@dataclass(frozen=True)
class ThreadSetting:
    """Algorithm 3's output."""

    intra_op_compute: int
    inter_op_compute: int
    io_threads: dict[str, int]
    predicted_step: float
    compute_time: float
    io_time: float

    @property
    def inter_op(self) -> int:
        """``inter_op_p = inter_op_p_compute + 5`` (one op per load/store task)."""
        return self.inter_op_compute + len(self.io_threads)

    @property
    def total_threads(self) -> int:
        """Threads in use: compute plus load/store."""
        return self.intra_op_compute * self.inter_op_compute + sum(self.io_threads.values())


def _share(free: int, volumes: Mapping[str, float]) -> dict[str, int]:
    """Split ``free`` threads over the load/store tasks in proportion to their volumes, at least one each."""
    names = list(volumes)
    out = {k: 1 for k in names}
    left = free - len(names)
    tot = sum(max(0.0, volumes[k]) for k in names)
    if left > 0 and tot > 0:
        raw = {k: left * max(0.0, volumes[k]) / tot for k in names}
        for k in names:
            out[k] += math.floor(raw[k])
        rest = free - sum(out.values())
        for k in sorted(names, key=lambda k: raw[k] - math.floor(raw[k]), reverse=True)[:rest]:
            out[k] += 1
    return out


def thread_search(ops: Sequence[OpProfile], max_threads: int, io_volumes: Mapping[str, float], link_bw: float,
                  per_thread_copy_bw: float, io_tasks: int = 5) -> ThreadSetting | None:
    """Algorithm 3 (GET_OPTIMAL_PARALLELISM_SETTING).

    Args:
        ops: the compute task's operator graph with profiled per-op times.
        max_threads: hardware threads available.
        io_volumes: bytes moved by each load/store task in one step (keys: the five IO tasks).
        link_bw: bandwidth of the link the load/store tasks share (bytes/s).
        per_thread_copy_bw: host copy bandwidth one thread sustains (bytes/s).

    Returns ``None`` when no setting leaves five threads for the load/store tasks (fewer than
    ``io_tasks + 1`` hardware threads).
    """
    best: ThreadSetting | None = None
    for intra in range(1, max_threads - io_tasks + 1):  # line 3
        inter = max_concurrency(ops, intra)  # line 4
        free = max_threads - inter * intra  # lines 5-6
        if free < io_tasks:  # line 7
            continue
        io = _share(free, io_volumes)  # line 10
        compute_t = _schedule(ops, intra, inter)[0]
        io_t = max((io_volumes[k] / min(link_bw, io[k] * per_thread_copy_bw) for k in io_volumes), default=0.0)
        step = max(compute_t, io_t)  # line 11: the six tasks run concurrently (Eq. 2)
        if best is None or step < best.predicted_step:  # lines 14-16
            best = ThreadSetting(intra, inter, io, step, compute_t, io_t)
    return best


def attention_graph(times: Mapping[str, Mapping[int, float]]) -> list[OpProfile]:
    """The CPU attention task as an operator graph (LM-Offload Fig. 6's shape): the new K and V are
    appended independently, scores need K, the weighted sum needs the probabilities and V."""
    deps = {
        "append_k": (),
        "append_v": (),
        "qk": ("append_k",),
        "softmax": ("qk",),
        "pv": ("softmax", "append_v"),
        "merge_heads": ("pv",),
    }
    return [OpProfile(k, deps[k], times[k]) for k in deps]


def analytic_attention_times(model: ModelSpec, hw: HardwareProfile, batch: int, context: int,
                             max_threads: int | None = None) -> dict[str, dict[int, float]]:
    """Per-op times of CPU attention from the profile alone: each op is the larger of its FLOP over
    ``t`` cores' share of ``cpu_flops`` and its bytes over ``t`` cores' share of ``cpu_mem_bw`` (capped at
    the full bandwidth, which a few cores saturate)."""
    T = max_threads or hw.cpu_threads
    p = model.dtype_bytes
    kv_side = batch * context * model.kv_dim * p
    score = batch * model.num_heads * context * 4
    work = {
        "append_k": (0.0, 2 * batch * model.kv_dim * p),
        "append_v": (0.0, 2 * batch * model.kv_dim * p),
        "qk": (2.0 * batch * model.q_dim * context, kv_side),
        "softmax": (5.0 * batch * model.num_heads * context, 2 * score),
        "pv": (2.0 * batch * model.q_dim * context, kv_side + score),
        "merge_heads": (0.0, 2 * batch * model.q_dim * p),
    }
    per_core_flops = hw.cpu_flops / hw.cpu_threads
    per_core_bw = 4 * hw.cpu_mem_bw / hw.cpu_threads  # a core pulls more than its even share
    out: dict[str, dict[int, float]] = {}
    for k, (fl, by) in work.items():
        out[k] = {t: max(fl / (t * per_core_flops), by / min(hw.cpu_mem_bw, t * per_core_bw)) for t in range(1, T + 1)}
    return out


_BENCH = r"""
import json, sys, time, torch
intra, inter, b, h, c, d = (int(x) for x in sys.argv[1:7])
if inter > 0:
    torch.set_num_interop_threads(inter)
if intra > 0:
    torch.set_num_threads(intra)
q = torch.randn(b, h, 1, d); k = torch.randn(b, h, c, d); v = torch.randn(b, h, c, d)
def run():
    s = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, dim=-1)
    return s @ v
run()
best = 1e9
for _ in range(5):
    t0 = time.perf_counter(); run(); best = min(best, time.perf_counter() - t0)
print(json.dumps({"seconds": best, "intra": torch.get_num_threads(), "inter": torch.get_num_interop_threads()}))
"""


def measure_thread_settings(settings: Sequence[tuple[int, int]], batch: int = 8, heads: int = 9, context: int = 2048,
                            head_dim: int = 64, timeout: float = 60.0) -> list[dict]:
    """Time a CPU attention step under each ``(intra, inter)`` setting, each in a fresh Python process
    (inter-op threads can only be set before any parallel work starts). ``0`` keeps PyTorch's default.

    Returns one dict per setting: ``intra``, ``inter`` (as applied), ``seconds``.
    """
    out = []
    for intra, inter in settings:
        env = dict(os.environ)
        if intra > 0:
            env["OMP_NUM_THREADS"] = str(intra)
        res = subprocess.run([sys.executable, "-c", _BENCH, str(intra), str(inter), str(batch), str(heads),
                              str(context), str(head_dim)], capture_output=True, text=True, timeout=timeout, env=env,
                             check=False)
        if res.returncode != 0:
            raise RuntimeError(f"thread benchmark failed for {intra, inter}: {res.stderr.strip()[-400:]}")
        d = json.loads(res.stdout.strip().splitlines()[-1])
        d["requested"] = [intra, inter]
        out.append(d)
    return out


@dataclass
class ThreadApplication:
    """What :func:`apply_threads` managed to set."""

    intra: int
    inter: int
    applied_intra: bool
    applied_inter: bool
    notes: list[str] = field(default_factory=list)


def apply_threads(intra: int, inter: int | None = None) -> ThreadApplication:
    """Apply a thread setting to this process: ``torch.set_num_threads(intra)`` and, if ``inter`` is given,
    ``torch.set_num_interop_threads(inter)``. PyTorch refuses the second once inter-op work has started;
    that is reported in ``notes`` rather than raised."""
    import torch

    if intra < 1:
        raise ValueError("intra must be >= 1")
    app = ThreadApplication(intra, inter or 0, False, False)
    torch.set_num_threads(intra)
    app.applied_intra = torch.get_num_threads() == intra
    if inter:
        try:
            torch.set_num_interop_threads(inter)
            app.applied_inter = torch.get_num_interop_threads() == inter
        except RuntimeError as e:
            app.notes.append(f"inter-op threads not applied: {e}")
    return app


def tune_threads_here(batch: int = 8, heads: int = 9, context: int = 2048, head_dim: int = 64,
                      max_threads: int | None = None) -> dict:
    """Algorithm 3 on this machine, then a check of whether its choice helps.

    Profiles each attention op at every intra-op thread count, runs :func:`thread_search` (load/store
    volumes taken as equal, since no transfer is involved on the host), and times PyTorch's default
    setting against the choice in fresh processes. When Algorithm 3 has no candidate (fewer than six
    hardware threads) every ``(intra, 1)`` setting is timed instead, so the report still says what helps.

    Returns ``{"threads": T, "algorithm3": ThreadSetting | None, "measurements": [...], "best": {...}}``
    where ``measurements[0]`` is PyTorch's default.
    """
    T = max_threads or os.cpu_count() or 1
    times = profile_attention_times(batch, heads, context, head_dim, thread_counts=range(1, T + 1))
    ops = attention_graph(times)
    st = thread_search(ops, T, {k: 1.0 for k in IO_TASKS}, link_bw=1e12, per_thread_copy_bw=1e12)
    settings = [(0, 0)]
    if st is not None:
        settings.append((st.intra_op_compute, st.inter_op))
    else:
        settings += [(t, 1) for t in range(1, T + 1)]
    meas = measure_thread_settings(settings, batch, heads, context, head_dim)
    best = min(meas, key=lambda d: d["seconds"])
    return {"threads": T, "algorithm3": st, "measurements": meas, "best": best}


def profile_attention_times(batch: int = 8, heads: int = 9, context: int = 2048, head_dim: int = 64,
                            thread_counts: Sequence[int] | None = None) -> dict[str, dict[int, float]]:
    """Measure each op of :func:`attention_graph` on this CPU at each intra-op thread count (in-process;
    restores the previous thread count)."""
    import time

    import torch

    prev = torch.get_num_threads()
    counts = list(thread_counts or range(1, (os.cpu_count() or 1) + 1))
    q = torch.randn(batch, heads, 1, head_dim)
    k = torch.randn(batch, heads, context, head_dim)
    v = torch.randn(batch, heads, context, head_dim)
    newk = torch.randn(batch, heads, 1, head_dim)
    out: dict[str, dict[int, float]] = {n: {} for n in ("append_k", "append_v", "qk", "softmax", "pv", "merge_heads")}

    def best(fn):
        fn()
        b = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t0)
        return b

    try:
        for t in counts:
            torch.set_num_threads(t)
            s = q @ k.transpose(-1, -2)
            pr = torch.softmax(s, -1)
            o = pr @ v
            out["append_k"][t] = best(lambda: torch.cat([k, newk], dim=2))
            out["append_v"][t] = best(lambda: torch.cat([v, newk], dim=2))
            out["qk"][t] = best(lambda: q @ k.transpose(-1, -2))
            out["softmax"][t] = best(lambda s=s: torch.softmax(s, -1))
            out["pv"][t] = best(lambda pr=pr: pr @ v)
            out["merge_heads"][t] = best(lambda o=o: o.transpose(1, 2).reshape(batch, heads * head_dim).contiguous())
    finally:
        torch.set_num_threads(prev)
    return out


__all__ = [
    "IO_TASKS",
    "LMOffloadConfig",
    "LMOffloadEstimate",
    "OpProfile",
    "ThreadApplication",
    "ThreadSetting",
    "analytic_attention_times",
    "apply_threads",
    "attention_graph",
    "compare_quantization",
    "dequan_cache",
    "dequan_wgt",
    "estimate",
    "max_concurrency",
    "measure_thread_settings",
    "new_kv_cache",
    "num_weights",
    "old_kv_cache",
    "pf_kv_cache",
    "profile_attention_times",
    "quan_cache",
    "quan_pf_wgt",
    "six_tasks",
    "thread_search",
    "tune_threads_here",
]
