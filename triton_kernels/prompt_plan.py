"""LeanKV's prompt-phase classification of one layer, every (sequence, KV head) in one launch.

A prompt stored by the LeanKV policy is classified per head before it is written (LeanKV §4,
"Prompt Phase"; :func:`leankit.policy.plan_unified` with nothing classified yet). On the torch
path that is a sort, a cumulative sum, two threshold searches, the class rule, per-tier counts,
ranks and the pruned mass: about sixty small tensor ops a layer, each a launch of a few
microseconds on a GPU, where a short prompt's store is host-bound. Here one program per
``(b, h)`` does all of it, with no sort:

* significance: ``s_t = fp16(received_t / max(q_last - pos_t + 1, 1))``, the running mean
  :func:`leankit.policy.update_significance` gives a token's first step, rounded to the value the
  page keeps;
* cut-offs (:func:`leankit.policy.significance_cutoffs`): the cumulative significance
  ``C(x) = (pruned_mass + sum of candidate s_i <= x) / Z`` is a step function of ``x`` that only
  rises at candidate scores, so the cut-off of a threshold ``T`` is the smallest fp16 value ``x``
  with ``C(x) >= T``, found by bisection on the bits of non-negative fp16 numbers (monotone as
  integers: 15 halvings of ``[0, 0x7C00]``, both thresholds in the same pass over the tokens);
  ``0x7C00`` (inf) when no candidate reaches it;
* classes (Algorithm 1, lines 5-6 / 13-14 for every candidate): ``s >= tau_h`` high,
  ``tau_l <= s < tau_h`` low, below pruned; window tokens (``pos > q_last - W``) stay high;
  invalid (padding) slots ``-1``;
* each kept token's rank among its head's kept tokens of its tier (the store kernel puts it that
  many slots past the head's count), the heads' new counts per tier and the significance pruned.

Nothing is read back to the host. ``Z`` is the head's total (its valid scores plus the mass
already pruned) as the torch path sums it; the sums differ from a sorted cumulative sum only in
fp32 rounding order, so a token whose cumulative significance lies within rounding of a threshold
may be classified on the other side of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import empty, flag_bytes, jit_options, kernel_for

KEEP_HIGH, KEEP_LOW, PRUNED = 0, 1, 2  # leankit.policy's classes
_C_HIGH, _C_LOW, _C_PRUNED = tl.constexpr(KEEP_HIGH), tl.constexpr(KEEP_LOW), tl.constexpr(PRUNED)  # in kernels
INF_BITS = 0x7C00  # fp16 +inf: the bisection's "no cut-off" end
BISECT_STEPS = 15  # ceil(log2(0x7C00 + 1)) halvings of [0, 0x7C00]
SHORT_BLOCK, MAX_BLOCK = 256, 2048  # tokens a pass reads at once: prompts up to 256 tokens, longer ones
# Runtime integers that change from call to call: no variant per value class.
PLAN_DYNAMIC = ("s_rb", "s_rh", "s_rq", "s_pb", "s_mb", "s_lt", "s_lb", "H", "Q", "window")
PLAN_UNALIGNED = ("rec_ptr", "pos_ptr", "real_ptr", "last_ptr", "pm_ptr", "lens_ptr")


@triton.jit
def _tile_scores(rec_ptr, s_rb, s_rh, s_rq, pos_ptr, s_pb, real_ptr, s_mb, b, h, q_last, q0, Q, window,
                 BLOCK: tl.constexpr):
    """Tokens ``q0 .. q0 + BLOCK - 1`` of head ``(b, h)``: ``(q, valid, candidate, score, fp16 bits)``.

    Every pass of the kernel recomputes these from the loaded inputs rather than reading back the
    scores an earlier pass stored: a program's own global stores are not ordered before its later
    loads by other threads without a barrier, and the recompute is three cached loads and a
    division a token."""
    q = q0 + tl.arange(0, BLOCK)
    inq = q < Q
    valid = inq & (tl.load(real_ptr + b * s_mb + q, mask=inq, other=0) != 0)
    pos = tl.load(pos_ptr + b * s_pb + q, mask=inq, other=0).to(tl.int64)
    rec = tl.load(rec_ptr + b * s_rb + h * s_rh + q.to(tl.int64) * s_rq, mask=inq, other=0.0).to(tl.float32)
    n = tl.maximum(q_last - pos + 1, 1).to(tl.float32)
    s16 = tl.math.div_rn(rec, n).to(tl.float16)
    bits = s16.to(tl.int16, bitcast=True).to(tl.int32)
    cand = valid & (pos <= q_last - window)
    return q, valid, cand, s16.to(tl.float32), bits


@triton.jit(**jit_options(PLAN_DYNAMIC, PLAN_UNALIGNED))
def _prompt_classes_kernel(rec_ptr, s_rb, s_rh, s_rq, pos_ptr, s_pb, real_ptr, s_mb, last_ptr, pm_ptr, lens_ptr,
                           s_lt, s_lb, score_ptr, cls_ptr, rank_ptr, newlens_ptr, pruned_ptr, H, Q, window, th, tl_,
                           INF_B: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per ``(b, h)`` (see the module docstring)."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    q_last = tl.load(last_ptr + b).to(tl.int64)
    pm = tl.load(pm_ptr + pid)
    # Z: the valid scores (window included, non-finite ones as the torch sum takes them) + pm
    total = tl.zeros([BLOCK], tl.float32)
    for q0 in range(0, Q, BLOCK):
        _q, valid, _c, s, _b = _tile_scores(rec_ptr, s_rb, s_rh, s_rq, pos_ptr, s_pb, real_ptr, s_mb, b, h, q_last, q0,
                                         Q, window, BLOCK)
        total += tl.where(valid, s, 0.0)
    z = tl.sum(total, 0) + pm
    z = tl.where(z > 0, z, 1.0)
    # Bisection for the smallest fp16 bits x with C(x) >= T, both thresholds at once; a finite
    # candidate score adds its mass (inf and NaN are no mass, as in significance_cutoffs)
    lo_l = tl.full([], 0, tl.int32)
    hi_l = tl.full([], INF_B, tl.int32)
    lo_h = tl.full([], 0, tl.int32)
    hi_h = tl.full([], INF_B, tl.int32)
    for _halving in range(STEPS):
        mid_l = (lo_l + hi_l) // 2
        mid_h = (lo_h + hi_h) // 2
        acc_l = tl.zeros([BLOCK], tl.float32)
        acc_h = tl.zeros([BLOCK], tl.float32)
        for q0 in range(0, Q, BLOCK):
            _q, _v, cand, s, bits = _tile_scores(rec_ptr, s_rb, s_rh, s_rq, pos_ptr, s_pb, real_ptr, s_mb, b, h,
                                               q_last, q0, Q, window, BLOCK)
            mass = cand & (bits < INF_B)
            acc_l += tl.where(mass & (bits <= mid_l), s, 0.0)
            acc_h += tl.where(mass & (bits <= mid_h), s, 0.0)
        reach_l = tl.math.div_rn(pm + tl.sum(acc_l, 0), z) >= tl_
        reach_h = tl.math.div_rn(pm + tl.sum(acc_h, 0), z) >= th
        go_l = lo_l < hi_l
        go_h = lo_h < hi_h
        hi_l = tl.where(go_l & reach_l, mid_l, hi_l)
        lo_l = tl.where(go_l & ~reach_l, mid_l + 1, lo_l)
        hi_h = tl.where(go_h & reach_h, mid_h, hi_h)
        lo_h = tl.where(go_h & ~reach_h, mid_h + 1, lo_h)
    # Classes, ranks per tier, counts and the pruned mass. A NaN score (bits above inf) passes no
    # cut-off, as `nan >= tau` is false.
    n_h = tl.zeros([], tl.int64)  # kept so far per tier
    n_l = tl.zeros([], tl.int64)
    pruned = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * Q
    for q0 in range(0, Q, BLOCK):
        q, valid, cand, s, bits = _tile_scores(rec_ptr, s_rb, s_rh, s_rq, pos_ptr, s_pb, real_ptr, s_mb, b, h,
                                               q_last, q0, Q, window, BLOCK)
        num = bits <= INF_B
        cls = tl.where(num & (bits >= lo_h), _C_HIGH, tl.where(num & (bits >= lo_l), _C_LOW, _C_PRUNED))
        cls = tl.where(cand, cls, tl.where(valid, _C_HIGH, -1))
        is_h = (cls == _C_HIGH).to(tl.int64)
        is_l = (cls == _C_LOW).to(tl.int64)
        c_h = tl.cumsum(is_h, 0)
        c_l = tl.cumsum(is_l, 0)
        rank = tl.where(cls == _C_LOW, n_l + c_l, n_h + c_h) - 1
        inq = q < Q
        tl.store(score_ptr + base + q, s, mask=inq)
        tl.store(cls_ptr + base + q, cls.to(tl.int8), mask=inq)
        tl.store(rank_ptr + base + q, rank, mask=inq)
        pruned += tl.where(cls == _C_PRUNED, s, 0.0)
        n_h += tl.sum(is_h, 0)
        n_l += tl.sum(is_l, 0)
    # new_lens is [2, 1, B, H]: the low tier's counts start B * H (the program count) after the high's
    tl.store(newlens_ptr + pid, tl.load(lens_ptr + b * s_lb + h).to(tl.int64) + n_h)
    tl.store(newlens_ptr + tl.num_programs(0) + pid, tl.load(lens_ptr + s_lt + b * s_lb + h).to(tl.int64) + n_l)
    tl.store(pruned_ptr + pid, tl.sum(pruned, 0))


def _check(received, q_pos, real, q_last, pruned_mass, lens):
    if received.dim() != 3:
        raise ValueError(f"received must be [B, H, Q], got {tuple(received.shape)}")
    bsz, heads, nq = received.shape
    if q_pos.shape != (bsz, nq) or real.shape != (bsz, nq):
        raise ValueError(f"q_pos and real must be [{bsz}, {nq}], got {tuple(q_pos.shape)} and {tuple(real.shape)}")
    if q_last.shape != (bsz,):
        raise ValueError(f"q_last must be [{bsz}], got {tuple(q_last.shape)}")
    if pruned_mass.shape != (bsz, heads) or lens.shape != (2, bsz, heads):
        raise ValueError(f"pruned_mass must be [{bsz}, {heads}] and lens [2, {bsz}, {heads}], got "
                         f"{tuple(pruned_mass.shape)} and {tuple(lens.shape)}")
    if not received.is_floating_point() or not pruned_mass.is_floating_point():
        raise ValueError("received and pruned_mass must be floating point")
    return bsz, heads, nq


def prompt_classes(received: torch.Tensor, q_pos: torch.Tensor, real: torch.Tensor, q_last: torch.Tensor,
                   pruned_mass: torch.Tensor, lens: torch.Tensor, window: int, th: float, tl: float,
                   *, block: int | None = None):
    """Classify one layer's prompt tokens per (sequence, KV head) in one launch (module docstring).

    Args:
        received: float ``[B, H, Q]`` each token's received attention mass over the prompt.
        q_pos: int ``[B, Q]`` positions; real: bool ``[B, Q]`` real (not padding) tokens.
        q_last: int ``[B]`` each row's last real position.
        pruned_mass: float ``[B, H]`` significance the heads already pruned.
        lens: int ``[2, B, H]`` tokens each head holds per tier (high, low) before the prompt.
        window: recent tokens kept high (``pos > q_last - window``).
        th, tl: cumulative thresholds ``Th >= Tl`` (equal for a single tier: nothing goes low).

    Returns ``(score fp32 [B, H, Q], cls int8 [B, H, Q], rank int64 [B, H, Q], new_lens int64
    [2, 1, B, H], pruned fp32 [B, H])``: the fp16-rounded significance, the class
    (``KEEP_HIGH``/``KEEP_LOW``/``PRUNED``, ``-1`` on padding), each kept token's slot index in
    its tier's kept tokens (:func:`leankit_kernels.quant.store_step_tokens` writes it that many
    slots past the head's count),
    the heads' counts per tier after storing the kept tokens, and the mass of the pruned ones.
    """
    bsz, heads, nq = _check(received, q_pos, real, q_last, pruned_mass, lens)
    dev = received.device
    score = empty((bsz, heads, nq), torch.float32, dev)
    cls = empty((bsz, heads, nq), torch.int8, dev)
    rank = empty((bsz, heads, nq), torch.int64, dev)
    new_lens = empty((2, 1, bsz, heads), torch.int64, dev)
    pruned = empty((bsz, heads), torch.float32, dev)
    if bsz * heads == 0 or nq == 0:
        new_lens.copy_(lens.unsqueeze(1))
        pruned.zero_()
        return score, cls, rank, new_lens, pruned
    q_pos = q_pos if q_pos.stride(-1) == 1 else q_pos.contiguous()
    real = flag_bytes(real if real.stride(-1) == 1 else real.contiguous())
    pm = pruned_mass.float().contiguous()
    if lens.stride(-1) != 1:  # the kernel takes the other two strides
        lens = lens.contiguous()
    # two tile sizes, so prompts of every length share two compiled variants
    blk = block or (SHORT_BLOCK if nq <= SHORT_BLOCK else MAX_BLOCK)
    kernel_for(_prompt_classes_kernel, dev)[(bsz * heads,)](
        received, *received.stride(), q_pos, q_pos.stride(0), real, real.stride(0), q_last.contiguous(), pm, lens,
        lens.stride(0), lens.stride(1), score, cls, rank, new_lens, pruned, heads, nq, int(window), float(th),
        float(tl), INF_B=INF_BITS, STEPS=BISECT_STEPS, BLOCK=blk, num_warps=4 if blk <= SHORT_BLOCK else 8)
    return score, cls, rank, new_lens, pruned


def prompt_classes_ref(received: torch.Tensor, q_pos: torch.Tensor, real: torch.Tensor, q_last: torch.Tensor,
                       pruned_mass: torch.Tensor, lens: torch.Tensor, window: int, th: float, tl: float):
    """Plain-PyTorch reference of :func:`prompt_classes` (same arguments and results):
    :func:`leankit.policy.prompt_classes`, the prompt-phase rule of
    :func:`leankit.policy.plan_unified`."""
    from leankit.policy import prompt_classes as rule

    _check(received, q_pos, real, q_last, pruned_mass, lens)
    return rule(received, q_pos, real, q_last, pruned_mass, lens, window, th, tl)
