"""KV-activation hybrid caching: HybridServe §4.3 (= CAPTURE §IV-C).

Three pieces, each as the papers state it:

1. **Host memory block allocation** (Algorithm 1). Step 1 (lines 11-18) compares the time to regenerate
   KV from the GPU-resident ACT blocks with the time to load one decoder block's weights,
   ``T_budget = T_load_w - T_kv_gen(#ACT_GPU)``, and adds host ACT blocks to fill a positive budget or host
   KV blocks to cover a negative one. Step 2 (lines 20-26) fills the remaining host memory,
   ``M_remaining = M_Host - S_weight - M_occupied``, with the #ACT, #KV that solve the linear system
   ``S_ACT #ACT + S_KV #KV = M_remaining`` and ``T_kv_gen(#ACT) = T_load_kv(#KV)``
   (:func:`allocate_host_blocks`). :func:`allocate_for_workload` is the same algorithm with line 24's
   memory equation replaced by a block count, for a workload that does not fill host memory.
2. **Request block allocation** (Eq. 11): every request keeps ``#ACT_req : #KV_req = #ACT_Host : #KV_Host``;
   the next block is an ACT block while the request is below the target share
   (:func:`next_block_type`).
3. **Dynamic mini-batch formation** (Eqs. 12-13): ``balance = T_kv_gen(#ACT_mb) / T_load_kv(#KV_mb)`` and
   ``F_b = max(balance, 1/balance)``; a greedy bin packing under #ACT_max / #KV_max
   (:func:`pack_minibatches`), with an exhaustive reference (:func:`pack_minibatches_exact`).

The papers' Eq. 9 (``T_PCIe = T_load_w + T_load_kv(#KV_Host)``) does not charge the link for moving host
ACT blocks, and Eq. 10 charges the GPU only for regeneration, not the forward pass. Algorithm 1 here is
the literal one. :func:`balance_split` is leankit's extension used by the planner: the same balance
(Eq. 8, minimize ``|T_PCIe - T_Computation|``) with ACT transfers on the link and the forward pass on the
GPU, solved in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TimeFn = Callable[[float], float]

BLOCK_TOKENS = 16  # tokens per KV / ACT block (CAPTURE §IV-A; vLLM's PagedAttention block)


# ------------------------------------------------------------------------------ helpers
def _t(fn: TimeFn, n: float) -> float:
    """Time of ``n`` blocks; zero blocks launch no work and take no time."""
    return 0.0 if n <= 0 else float(fn(n))


def _root(f: Callable[[float], float], lo: float, hi: float, iters: int = 200) -> float:
    """Root of a continuous ``f`` with ``f(lo) <= 0 <= f(hi)`` by bisection."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) <= 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * max(1.0, abs(hi)):
            break
    return 0.5 * (lo + hi)


def _solve_equal(fn: TimeFn, target: float, hi: float) -> float:
    """The ``x`` in ``[0, hi]`` with ``fn(x) = target`` for an increasing ``fn`` (clamped to the ends)."""
    if target <= _t(fn, 0.0) or target <= 0:
        return 0.0
    if fn(hi) <= target:
        return hi
    inv = getattr(fn, "inverse", None)  # a LinearFit solves in closed form
    if inv is not None:
        return min(hi, max(0.0, inv(target)))
    return _root(lambda x: fn(x) - target, 0.0, hi)


def _floor(x: float) -> int:
    """Floor that forgives the last bits of floating-point error (39.9999999999 -> 40)."""
    return math.floor(x + 1e-9 * max(1.0, abs(x)))


def _argmin_max(up: TimeFn, down: TimeFn, lo: float, hi: float) -> float:
    """The ``x`` in ``[lo, hi]`` minimizing ``max(up(x), down(x))`` for an increasing ``up`` and a
    non-increasing ``down``: the crossing if there is one, otherwise the better end."""
    def f(x: float) -> float:  # increasing
        return up(x) - down(x)

    if f(lo) >= 0:
        return lo
    if f(hi) <= 0:
        return hi
    return _root(f, lo, hi)


# ------------------------------------------------------------------------------ Algorithm 1
@dataclass(frozen=True)
class HybridAllocation:
    """Result of Algorithm 1: host ACT and KV block counts and their parts."""

    act_init: int
    kv_init: int
    act_remain: int
    kv_remain: int
    t_budget: float
    act_gpu: int
    s_kv: float
    s_act: float

    @property
    def act_host(self) -> int:
        """#ACT_Host = ACT_init + ACT_remain (Algorithm 1 line 9)."""
        return self.act_init + self.act_remain

    @property
    def kv_host(self) -> int:
        """#KV_Host = KV_init + KV_remain (Algorithm 1 line 9)."""
        return self.kv_init + self.kv_remain

    def kv_to_act_memory_ratio(self, include_gpu: bool = False) -> float:
        """Host memory given to KV blocks over memory given to ACT blocks (the "KV-to-ACT ratio" of
        HybridServe §5.5); ``include_gpu`` adds the GPU-resident ACT blocks to the ACT side."""
        act = self.act_host + (self.act_gpu if include_gpu else 0)
        if act == 0:
            return math.inf
        return (self.kv_host * self.s_kv) / (act * self.s_act)

    def act_fraction(self, include_gpu: bool = True) -> float:
        """Share of blocks held as activations."""
        act = self.act_host + (self.act_gpu if include_gpu else 0)
        total = act + self.kv_host
        return act / total if total else 0.0


def init_cache_alloc(t_load_w: float, act_gpu: float, t_kv_gen: TimeFn, t_load_kv: TimeFn,
                     max_act: float, max_kv: float) -> tuple[int, int, float]:
    """Algorithm 1 lines 11-18: the initial allocation. Returns ``(ACT_init, KV_init, T_budget)``.

    ``max_act`` / ``max_kv`` bound the search (e.g. host memory over the block size).
    """
    act_init = kv_init = 0  # line 12
    t_budget = t_load_w - _t(t_kv_gen, act_gpu)  # line 13
    if t_budget >= 0:  # line 14
        act_init = _floor(_solve_equal(t_kv_gen, t_budget, max_act))  # line 15
    else:
        kv_init = _floor(_solve_equal(t_load_kv, -t_budget, max_kv))  # line 17
    return act_init, kv_init, t_budget  # line 18


def alloc_remain(act_init: int, kv_init: int, m_host: float, s_weight: float, s_kv: float, s_act: float,
                 t_kv_gen: TimeFn, t_load_kv: TimeFn) -> tuple[int, int]:
    """Algorithm 1 lines 20-26: split the remaining host memory so that ``T_kv_gen(#ACT) = T_load_kv(#KV)``
    subject to ``S_ACT #ACT + S_KV #KV = M_remaining``. Returns ``(ACT_remain, KV_remain)``."""
    m_occupied = s_act * act_init + s_kv * kv_init  # line 22
    m_remaining = m_host - s_weight - m_occupied  # line 23
    if m_remaining <= 0:
        return 0, 0
    a_max = m_remaining / s_act

    def kv_of(a: float) -> float:  # line 24 solved for #KV
        return max(0.0, (m_remaining - s_act * a) / s_kv)

    # line 25: T_kv_gen rises with #ACT while T_load_kv(#KV(#ACT)) falls; solve for the crossing.
    a = _argmin_max(lambda x: _t(t_kv_gen, x), lambda x: _t(t_load_kv, kv_of(x)), 0.0, a_max)
    act = _floor(a)
    kv = _floor(kv_of(act))
    return act, kv  # line 26


def allocate_host_blocks(t_load_w: float, act_gpu: int, m_host: float, s_weight: float, s_kv: float,
                         s_act: float, t_kv_gen: TimeFn, t_load_kv: TimeFn) -> HybridAllocation:
    """Algorithm 1 (Hybrid Cache Allocation Policy), literally.

    Args:
        t_load_w: weight load latency of one decoder block (seconds).
        act_gpu: number of ACT blocks resident in GPU memory.
        m_host: total host memory (bytes); s_weight: total weight bytes held there.
        s_kv, s_act: bytes of one KV block and one ACT block (``S_ACT = S_KV / 2`` for OPT).
        t_kv_gen, t_load_kv: per-layer time as a function of the number of blocks (the fitted lines of
            HybridServe Fig. 11, e.g. :class:`~leankit.planner.hardware.LinearFit`).
    """
    if s_kv <= 0 or s_act <= 0:
        raise ValueError("block sizes must be positive")
    m_free = max(0.0, m_host - s_weight)
    act_init, kv_init, t_budget = init_cache_alloc(t_load_w, act_gpu, t_kv_gen, t_load_kv,
                                                   m_free / s_act, m_free / s_kv)
    # Step 1 may not take more memory than exists.
    if act_init * s_act > m_free:
        act_init = int(m_free // s_act)
    if kv_init * s_kv > m_free:
        kv_init = int(m_free // s_kv)
    act_rem, kv_rem = alloc_remain(act_init, kv_init, m_host, s_weight, s_kv, s_act, t_kv_gen, t_load_kv)
    return HybridAllocation(act_init, kv_init, act_rem, kv_rem, t_budget, act_gpu, s_kv, s_act)


def allocate_for_workload(total_blocks: int, t_load_w: float, act_gpu: int, s_kv: float, s_act: float,
                          t_kv_gen: TimeFn, t_load_kv: TimeFn) -> HybridAllocation:
    """Algorithm 1 for a workload of ``total_blocks`` host blocks (per layer) instead of a full host memory:
    step 1 unchanged, step 2 solves ``#ACT + #KV = remaining blocks`` with ``T_kv_gen(#ACT) = T_load_kv(#KV)``."""
    if total_blocks < 0:
        raise ValueError("total_blocks must be >= 0")
    act_init, kv_init, t_budget = init_cache_alloc(t_load_w, act_gpu, t_kv_gen, t_load_kv, total_blocks, total_blocks)
    act_init = min(act_init, total_blocks)
    kv_init = min(kv_init, total_blocks - act_init)
    rem = total_blocks - act_init - kv_init
    a = _argmin_max(lambda x: _t(t_kv_gen, x), lambda x: _t(t_load_kv, rem - x), 0.0, float(rem))
    act_rem = round(a)
    return HybridAllocation(act_init, kv_init, act_rem, rem - act_rem, t_budget, act_gpu, s_kv, s_act)


# ------------------------------------------------------------------------------ leankit balance
def balance_split(n_host: float, t_load_w: float, kv_t: float, act_t: float, gen_t: float,
                  gpu_fixed: float = 0.0, pcie_fixed: float = 0.0) -> float:
    """Fraction ``phi`` of ``n_host`` host tokens to hold as activations so that the link and the GPU
    finish together (HybridServe Eq. 8), counting what Eqs. 9-10 leave out.

    Link: ``t_load_w + pcie_fixed + n_host * ((1 - phi) * kv_t + phi * act_t)``;
    GPU: ``gpu_fixed + n_host * phi * gen_t`` (``gpu_fixed``: regeneration of GPU-resident ACT blocks plus
    the forward pass). ``kv_t``, ``act_t``, ``gen_t`` are seconds per token. Returns ``phi`` in [0, 1];
    0 when activations are not smaller than KV (``act_t >= kv_t``: nothing to gain).
    """
    if n_host <= 0 or act_t >= kv_t:
        return 0.0
    num = t_load_w + pcie_fixed + n_host * kv_t - gpu_fixed
    den = n_host * (kv_t - act_t + gen_t)
    return min(1.0, max(0.0, num / den))


# ------------------------------------------------------------------------------ Eq. 11
def next_block_type(act_req: int, kv_req: int, act_host: int, kv_host: int) -> str:
    """Type of a request's next block under Eq. 11 (``#ACT_req : #KV_req = #ACT_Host : #KV_Host``).

    An ACT block while the request's ACT share is below the host's: with a 3:1 host ratio and a request
    holding five ACT and two KV blocks, the next block is ACT (HybridServe §4.3.2's example).
    """
    if act_host <= 0:
        return "KV"
    if kv_host <= 0:
        return "ACT"
    return "ACT" if act_req * kv_host < act_host * kv_req or (act_req == 0 and kv_req == 0) else "KV"


def allocate_request_blocks(n_blocks: int, act_host: int, kv_host: int) -> tuple[int, int]:
    """(#ACT_req, #KV_req) for a request of ``n_blocks`` blocks, block by block under Eq. 11."""
    a = k = 0
    for _ in range(n_blocks):
        if next_block_type(a, k, act_host, kv_host) == "ACT":
            a += 1
        else:
            k += 1
    return a, k


# ------------------------------------------------------------------------------ Eqs. 12-13
@dataclass(frozen=True)
class Request:
    """A request's blocks in the current layer: ``act`` ACT blocks and ``kv`` KV blocks."""

    rid: int
    act: int
    kv: int


def balance(act_mb: int, kv_mb: int, t_kv_gen: TimeFn, t_load_kv: TimeFn) -> float:
    """Eq. 12: ``T_kv_gen(#ACT_mb) / T_load_kv(#KV_mb)`` (1.0 for an empty mini-batch, ``inf`` when only
    ACT blocks need work, 0 when only KV blocks do)."""
    g = _t(t_kv_gen, act_mb)
    k = _t(t_load_kv, kv_mb)
    if g == 0 and k == 0:
        return 1.0
    if k == 0:
        return math.inf
    return g / k


def imbalance(act_mb: int, kv_mb: int, t_kv_gen: TimeFn, t_load_kv: TimeFn) -> float:
    """Eq. 13: ``F_b = max(balance, 1 / balance)`` (>= 1; 1 is perfect balance)."""
    b = balance(act_mb, kv_mb, t_kv_gen, t_load_kv)
    if b == 0 or math.isinf(b):
        return math.inf
    return max(b, 1.0 / b)


def _not_worse(new: float, cur: float) -> bool:
    """``new <= cur`` up to floating-point noise (equal ratios must compare equal)."""
    if math.isinf(cur):
        return True
    return new <= cur * (1 + 1e-9)


def pack_minibatches(requests: Sequence[Request], act_max: int, kv_max: int, t_kv_gen: TimeFn,
                     t_load_kv: TimeFn) -> list[list[Request]]:
    """HybridServe §4.3.3's greedy mini-batch formation.

    Open a mini-batch; scan the unplaced requests in order and add each one that (1) fits the remaining
    #ACT_max / #KV_max capacity and (2) does not raise ``F_b`` (Eq. 13) of the mini-batch; rescan until a
    pass adds nothing, then open a new mini-batch. Condition (2) is "does not raise" rather than the
    paper's "reduces": under Eq. 11 every request carries the same ACT:KV ratio, adding one leaves ``F_b``
    unchanged, and a strict reading would put each request in a mini-batch of its own.

    Raises ``ValueError`` if a request alone exceeds the capacities.
    """
    for r in requests:
        if r.act > act_max or r.kv > kv_max or r.act < 0 or r.kv < 0:
            raise ValueError(f"request {r.rid} ({r.act} ACT, {r.kv} KV blocks) exceeds the mini-batch capacity "
                             f"({act_max} ACT, {kv_max} KV)")
    remaining = list(requests)
    bins: list[list[Request]] = []
    while remaining:
        cur: list[Request] = []
        a = k = 0
        added = True
        while added and remaining:
            added = False
            keep = []
            for r in remaining:
                fits = a + r.act <= act_max and k + r.kv <= kv_max
                if fits and (not cur or _not_worse(imbalance(a + r.act, k + r.kv, t_kv_gen, t_load_kv),
                                                   imbalance(a, k, t_kv_gen, t_load_kv))):
                    cur.append(r)
                    a += r.act
                    k += r.kv
                    added = True
                else:
                    keep.append(r)
            remaining = keep
        bins.append(cur)
    return bins


def packing_cost(bins: Sequence[Sequence[Request]], t_kv_gen: TimeFn, t_load_kv: TimeFn) -> tuple[int, float, float]:
    """``(number of mini-batches, worst F_b, mean F_b)`` of a packing; lower is better, in that order."""
    fs = [imbalance(sum(r.act for r in b), sum(r.kv for r in b), t_kv_gen, t_load_kv) for b in bins]
    if not fs:
        return 0, 1.0, 1.0
    # fsum: the mean must not depend on the order of the bins (two packings with the same bins
    # in another order would compare unequal by a rounding of the running sum)
    return len(bins), max(fs), math.fsum(fs) / len(fs)


def _set_partitions(items: list):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def pack_minibatches_exact(requests: Sequence[Request], act_max: int, kv_max: int, t_kv_gen: TimeFn,
                           t_load_kv: TimeFn, max_requests: int = 9) -> list[list[Request]]:
    """Exhaustive reference for small cases: the feasible packing with the fewest mini-batches, then the
    lowest worst ``F_b``, then the lowest mean ``F_b`` (:func:`packing_cost`)."""
    reqs = list(requests)
    if len(reqs) > max_requests:
        raise ValueError(f"exact packing is exponential; at most {max_requests} requests")
    best, best_cost = None, None
    for part in _set_partitions(reqs):
        if any(sum(r.act for r in b) > act_max or sum(r.kv for r in b) > kv_max for b in part):
            continue
        cost = packing_cost(part, t_kv_gen, t_load_kv)
        if best_cost is None or cost < best_cost:
            best, best_cost = part, cost
    if best is None:
        raise ValueError("no feasible packing: a request exceeds the mini-batch capacity")
    return best


def capacities_from_buffer(buffer_tokens: int, block_tokens: int = BLOCK_TOKENS) -> tuple[int, int]:
    """#ACT_max and #KV_max from a GPU buffer of ``buffer_tokens`` tokens per kind (CAPTURE §IV-B: the ACT
    and KV buffers each hold a mini-batch of up to 8,192 tokens)."""
    n = buffer_tokens // block_tokens
    return n, n


__all__ = [
    "BLOCK_TOKENS",
    "HybridAllocation",
    "Request",
    "alloc_remain",
    "allocate_for_workload",
    "allocate_host_blocks",
    "allocate_request_blocks",
    "balance",
    "balance_split",
    "capacities_from_buffer",
    "imbalance",
    "init_cache_alloc",
    "next_block_type",
    "pack_minibatches",
    "pack_minibatches_exact",
    "packing_cost",
]

