"""KVPR: I/O-aware partial KV recomputation (KVPR §3 and Appendix A).

For the current sequence length ``s'``, the CPU first sends the activations ``X[0:l]`` of the first ``l``
tokens; the GPU regenerates their K and V while the remaining ``KV[l:s']`` crosses the link. Per layer:

* Eq. 6: ``M_X[0:l] = b * l * h * p`` and ``M_KV[l:s'] = 2 * b * (s' - l) * h * p`` bytes;
* Eq. 8: regenerating ``K, V`` of ``l`` tokens costs ``N = 4 * b * l * h^2`` FLOP;
* Eq. 9: ``t_recomp = N / v_gpu``;
* Eq. 10: ``t(l) = M_X[0:l] / v_com + max(t_recomp, M_KV[l:s'] / v_com)``;
* Eq. 11: ``min_l t(l)`` over integer ``0 <= l <= s``.

The column-by-column schedule uses Eq. 10 as written; the row-by-row schedule drops its first term
(§3.2). The split is re-solved as ``s'`` grows (:func:`split_schedule`). For GQA the sizes generalize
with ``2 * h`` replaced by ``2 * kv_dim`` in ``M_KV`` and ``4 h^2`` by ``2 * h * 2 * kv_dim`` in ``N``
(``ModelSpec.kv_gen_flops_per_token``); for MHA they are the paper's formulas exactly.

Where the activation of a token is not smaller than its K+V (``M_X`` per token >= ``M_KV`` per token, as in
GQA models with few KV heads), Eq. 10 grows with ``l`` from the start and the optimum sits at ``l = 0``.

:func:`mha_pipeline` models §3.3 / Fig. 5: the coarse pipeline waits for all four MHA weights before
regenerating, the fine-grained one loads ``W_K`` and ``W_V`` first and starts at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import HardwareProfile
from .model_spec import ModelSpec

SCHEDULES = ("column", "row")


# ----------------------------------------------------------------------- Eqs. 6-9 (paper form)
def activation_bytes(b: int, l: int, h: int, p: int = 2) -> float:
    """Eq. 6: ``M_X[0:l] = b * l * h * p``."""
    return float(b * l * h * p)


def kv_bytes(b: int, s_prime: int, l: int, h: int, p: int = 2) -> float:
    """Eq. 6: ``M_KV[l:s'] = 2 * b * (s' - l) * h * p``."""
    return float(2 * b * (s_prime - l) * h * p)


def recompute_flops(b: int, l: int, h: int) -> float:
    """Eq. 8: ``N_KV[0:l] = 4 * b * l * h^2``."""
    return float(4 * b * l * h * h)


# ----------------------------------------------------------------------- per-token rates
@dataclass(frozen=True)
class KVPRRates:
    """Seconds per token of one layer for a batch: sending its activation (``x``), sending its K+V
    (``kv``), regenerating its K+V on the GPU (``r``, Eq. 9)."""

    x: float
    kv: float
    r: float

    @classmethod
    def for_model(cls, model: ModelSpec, hw: HardwareProfile, batch: int, kv_config=None) -> KVPRRates:
        """Rates for ``batch`` sequences of ``model`` on ``hw`` (``v_com = h2d_bw``, ``v_gpu = gpu_flops``)."""
        return cls(
            x=batch * model.act_bytes_per_token() / hw.h2d_bw,
            kv=batch * model.kv_bytes_per_token(kv_config) / hw.h2d_bw,
            r=batch * model.kv_gen_flops_per_token() / hw.gpu_flops,
        )


def layer_time(l: int, s_prime: int, rates: KVPRRates, schedule: str = "column", gpu_extra: float = 0.0,
               pcie_extra: float = 0.0) -> float:
    """Eq. 10 for split point ``l``; the row-by-row schedule drops the first term.

    ``gpu_extra`` is added to the recompute branch and ``pcie_extra`` to the transfer branch of the max
    (0 in the paper; e.g. the forward pass and the layer's weights when they share the window).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 <= l <= s_prime:
        raise ValueError(f"split point {l} outside [0, {s_prime}]")
    first = l * rates.x if schedule == "column" else 0.0
    return first + max(l * rates.r + gpu_extra, (s_prime - l) * rates.kv + pcie_extra)


@dataclass(frozen=True)
class KVPRSplit:
    """The solution of Eq. 11 at one sequence length."""

    s_prime: int
    l: int
    l_max: int
    time: float
    time_no_recompute: float
    time_all_recompute: float

    @property
    def interior(self) -> bool:
        """True when the optimum lies strictly between the ends (0 < l < l_max)."""
        return 0 < self.l < self.l_max

    @property
    def speedup(self) -> float:
        """Time at ``l = 0`` (transfer everything, FlexGen) over time at the optimum."""
        return self.time_no_recompute / self.time if self.time > 0 else 1.0


def solve_split(s_prime: int, rates: KVPRRates, schedule: str = "column", l_max: int | None = None,
                gpu_extra: float = 0.0, pcie_extra: float = 0.0) -> KVPRSplit:
    """Eq. 11: the integer ``l`` in ``[0, l_max]`` (default ``s'``) minimizing Eq. 10.

    Eq. 10 is piecewise linear in ``l``: before the recompute and transfer branches cross it has slope
    ``x - kv`` (column) or ``-kv`` (row), after it ``x + r`` (or ``r``). So the minimum is at the crossing
    ``l_c = (s' kv + pcie_extra - gpu_extra) / (r + kv)`` (rounded either way) when the first slope is
    negative and ``l_c`` lies inside the range, and at an end otherwise. Ties go to the smaller ``l``.
    """
    if s_prime < 0:
        raise ValueError("s_prime must be >= 0")
    lm = s_prime if l_max is None else max(0, min(int(l_max), s_prime))
    cands = {0, lm}
    denom = rates.r + rates.kv
    if denom > 0:
        lc = (s_prime * rates.kv + pcie_extra - gpu_extra) / denom
        if math.isfinite(lc):
            for c in (math.floor(lc), math.ceil(lc)):
                if 0 <= c <= lm:
                    cands.add(int(c))
    best = min(sorted(cands), key=lambda l: (layer_time(l, s_prime, rates, schedule, gpu_extra, pcie_extra), l))
    return KVPRSplit(
        s_prime=s_prime, l=best, l_max=lm,
        time=layer_time(best, s_prime, rates, schedule, gpu_extra, pcie_extra),
        time_no_recompute=layer_time(0, s_prime, rates, schedule, gpu_extra, pcie_extra),
        time_all_recompute=layer_time(lm, s_prime, rates, schedule, gpu_extra, pcie_extra),
    )


def brute_force_split(s_prime: int, rates: KVPRRates, schedule: str = "column", l_max: int | None = None,
                      gpu_extra: float = 0.0, pcie_extra: float = 0.0) -> int:
    """Reference for :func:`solve_split`: try every integer ``l`` (ties to the smaller ``l``)."""
    lm = s_prime if l_max is None else max(0, min(int(l_max), s_prime))
    return min(range(lm + 1), key=lambda l: (layer_time(l, s_prime, rates, schedule, gpu_extra, pcie_extra), l))


def split_schedule(prompt: int, gen: int, rates: KVPRRates, schedule: str = "column", cap_at_prompt: bool = True,
                   gpu_extra: float = 0.0, pcie_extra: float = 0.0) -> list[KVPRSplit]:
    """Re-solve Eq. 11 at every decode step as ``s' = prompt + j`` grows (``j = 0 .. gen-1``).

    ``cap_at_prompt`` keeps Eq. 11's constraint ``l <= s`` (only prompt activations are recomputed);
    with ``False`` any cached token may be.
    """
    out = []
    for j in range(gen):
        sp = prompt + j
        out.append(solve_split(sp, rates, schedule, prompt if cap_at_prompt else sp, gpu_extra, pcie_extra))
    return out


# ----------------------------------------------------------------------- §3.3 / Fig. 5
@dataclass(frozen=True)
class PipelineEvent:
    """One bar of a timeline: ``lane`` ("PCIe" or "GPU"), what runs, start and end in seconds."""

    lane: str
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class MHAPipeline:
    """Events of one MHA block and when the attention finishes."""

    events: tuple[PipelineEvent, ...]
    recompute_start: float
    mha_end: float


def mha_pipeline(l: int, s_prime: int, model: ModelSpec, hw: HardwareProfile, batch: int,
                 fine_grained: bool = True, kv_config=None) -> MHAPipeline:
    """KVPR Fig. 5: one MHA block with weights *and* cache offloaded.

    The link sends ``X[0:l]``, then ``KV[l:s']``, then the MHA weights: ``W_Q, W_K, W_V, W_O`` in the coarse
    pipeline (Fig. 5a: regeneration waits for all four), ``W_K, W_V, W_Q, W_O`` in the fine-grained one
    (Fig. 5b: regeneration starts once ``W_K`` and ``W_V`` are in). Attention starts when the regenerated
    KV, the transferred KV and all weights are present.
    """
    p = model.dtype_bytes
    bw = hw.h2d_bw
    w = {
        "W_Q": model.hidden * model.q_dim * p,
        "W_K": model.hidden * model.kv_dim * p,
        "W_V": model.hidden * model.kv_dim * p,
        "W_O": model.q_dim * model.hidden * p,
    }
    order = ["W_K", "W_V", "W_Q", "W_O"] if fine_grained else ["W_Q", "W_K", "W_V", "W_O"]
    events = []
    t = 0.0
    ends = {}
    for name, nbytes in [("X", batch * l * model.act_bytes_per_token()),
                         ("KV", batch * (s_prime - l) * model.kv_bytes_per_token(kv_config))] + [(k, w[k]) for k in order]:
        d = nbytes / bw
        events.append(PipelineEvent("PCIe", name, t, t + d))
        t += d
        ends[name] = t
    needed = ends["W_V"] if fine_grained else ends["W_O"]
    r_start = max(ends["X"], needed)
    r_time = batch * l * model.kv_gen_flops_per_token() / hw.gpu_flops
    events.append(PipelineEvent("GPU", "recompute KV", r_start, r_start + r_time))
    a_start = max(r_start + r_time, ends["KV"], ends["W_O"])
    proj = 2 * batch * model.attention_params() / hw.gpu_flops
    attn = batch * s_prime * model.kv_bytes_per_token(kv_config) / hw.gpu_mem_bw
    a_time = max(proj, sum(w.values()) / hw.gpu_mem_bw) + attn
    events.append(PipelineEvent("GPU", "MHA", a_start, a_start + a_time))
    return MHAPipeline(tuple(events), r_start, a_start + a_time)


def best_split_pipelined(s_prime: int, model: ModelSpec, hw: HardwareProfile, batch: int, fine_grained: bool = True,
                         kv_config=None) -> tuple[int, MHAPipeline]:
    """The ``l`` that finishes the MHA block of Fig. 5 earliest, by trying every ``l`` (ties to smaller)."""
    best_l, best = 0, mha_pipeline(0, s_prime, model, hw, batch, fine_grained, kv_config)
    for l in range(1, s_prime + 1):
        cand = mha_pipeline(l, s_prime, model, hw, batch, fine_grained, kv_config)
        if cand.mha_end < best.mha_end - 1e-15:
            best_l, best = l, cand
    return best_l, best


# ----------------------------------------------------------------------- Table 1
def table1_row(model: ModelSpec, hw: HardwareProfile, batch: int = 32, seq: int = 1024) -> dict[str, float]:
    """KVPR Table 1 for one model: one layer's fp16 KV cache (MiB, Eq. 6 with ``l = 0``), its link time
    (ms) and the time the GPU needs to read it once from its own memory (ms; the table's "Comp. Latency"
    column matches a memory-bound attention read of the cache within about 2%)."""
    nbytes = batch * seq * model.kv_bytes_per_token()
    return {
        "hidden": model.hidden,
        "kv_cache_mb": nbytes / 2**20,
        "pcie_ms": nbytes / hw.h2d_bw * 1e3,
        "comp_ms": nbytes / hw.gpu_mem_bw * 1e3,
    }


__all__ = [
    "SCHEDULES",
    "KVPRRates",
    "KVPRSplit",
    "MHAPipeline",
    "PipelineEvent",
    "activation_bytes",
    "best_split_pipelined",
    "brute_force_split",
    "kv_bytes",
    "layer_time",
    "mha_pipeline",
    "recompute_flops",
    "solve_split",
    "split_schedule",
    "table1_row",
]
