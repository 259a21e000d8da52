"""Placement policies: which tier each token lives in, and when it is downgraded or pruned.

A policy is the "planning" half of LeanKV's memory management (§5.3): it states every
(layer, sequence, head)'s page demand, which the cache coordinates in one batched prefix-sum
allocation (and recycling); it places tokens into page slots and moves them between tiers.

Policies (``KVConfig.policy``):

* ``full`` (:class:`FullPolicy`): every token in the high tier. Lossless ``FP16`` and uniform
  quantization (``K8V8``, ``K4V4``, ``K8V4`` ...).
* ``leankv`` (:class:`LeanKVPolicy`): LeanKV's unified compression (§4): per-head dynamic
  mixed precision and pruning from attention significance, with real reclaim.
* ``h2o`` (:class:`H2OPolicy`): static heavy-hitter budget, the same for every head.
* ``streaming`` (:class:`StreamingPolicy`): attention sinks plus the recent window.

Storage invariants shared by all policies (see :mod:`leankit.page_table`): tier ``t`` of a head
holds ``lens[t]`` tokens in slots ``0 .. lens[t]-1``. Removing a token moves a surviving token
from the tier's tail into its slot (:meth:`PagePool.copy_slots`), and pages left empty at the
tail return to the free list, so pruning frees memory rather than masking it.

Threshold interpretation (LeanKV). The paper states ``Th``/``Tl`` two ways: §4 "Prompt Phase"
prunes "the least important Np tokens, whose cumulative significance is below the threshold Tl"
and keeps at low precision "the next Nl tokens, with a cumulative significance less than Th",
while Algorithm 1 (lines 5, 8, 10, 13, 16) compares a single token's ``Score`` with ``Th``/``Tl``.
leankit uses the **cumulative** reading in both phases: ``Score(t) >= T`` in Algorithm 1 means
``C(t) >= T``, where ``C(t)`` is the normalized significance of all classified tokens of the head
whose score is at most ``Score(t)`` (the candidate included), plus the significance already
pruned from that head. Because ``C`` is monotone in the score, this is a per-head score cut-off
(:func:`significance_cutoffs`), so Algorithm 1 still compares single scores. With this reading
the prompt-phase classes are a fixed point of Algorithm 1 (re-placing any classified token as a
candidate returns its class and picks no victim), a token's class changes in the generation
phase only when its running score crosses its head's cut-off, and the pruned significance of a
head stays below ``Tl`` in both phases instead of growing by ``Tl`` at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native
from .allocator import PoolExhausted
from .backend import use_triton
from .decode_attention import LiveSlots
from .page_table import HIGH, LOW

KEEP_HIGH, KEEP_LOW, PRUNED = 0, 1, 2
_BIG = 1 << 30


# ============================================================================ significance
def update_significance(s_old: torch.Tensor, pos: torch.Tensor, received: torch.Tensor,
                        q_first: torch.Tensor, q_last: torch.Tensor) -> torch.Tensor:
    """Running significance of stored tokens after a step's queries (LeanKV §4).

    A token's significance is the **mean** attention probability it has received from the
    queries at or after its own position, averaged over the query heads of its KV group. For one
    decode query at position ``q`` this is the running-mean rule

        s <- s + (p_bar - s) / n,        n = q - pos + 1,

    where ``p_bar`` is the probability the token received from that query. A step of several
    queries ``q_first .. q_last`` applies the same rule once per query, in closed form:

        s <- s + (R - s * m) / n,   R = sum of p_bar over the step's queries,
                                    m = number of those queries that see the token,
                                    n = q_last - pos + 1.

    In the prompt phase ``s = 0`` and every query after the token sees it, so this is exactly the
    prompt-phase mean over the ``N - i`` later queries (§4, "Prompt Phase").

    Scale. The prompt phase also *normalizes* the means to sum to 1 per head. Leankit stores the
    un-normalized means in the page score segment, so the running rule above continues them
    without any rescaling; normalization is applied only where thresholds are compared
    (:func:`significance_cutoffs` divides by the head's total mass ``Z``). Since ``Z`` is one
    positive factor per head, normalizing never changes the ranking, and a score stored in the
    prompt phase and one updated in the generation phase are the same quantity.

    Args:
        s_old, pos, received: ``[..., S]`` stored scores (fp32), positions, and the probability
            mass received this step (sum over the step's queries of ``p_bar``).
        q_first, q_last: positions of the step's first and last real query, broadcastable to
            ``[..., S]``.
    """
    pos = pos.to(torch.float32)
    n = (q_last.to(torch.float32) - pos + 1).clamp_min(1.0)
    m = n - (q_first.to(torch.float32) - pos).clamp_min(0.0)
    return s_old + (received - s_old * m) / n


def significance_cutoffs(scores: torch.Tensor, eligible: torch.Tensor, total: torch.Tensor,
                         pruned_mass: torch.Tensor, thresholds) -> torch.Tensor:
    """Per-head score cut-offs equivalent to LeanKV's cumulative thresholds.

    Leankit reads every threshold comparison as a comparison of a token's **cumulative**
    normalized significance (§4, "Prompt Phase": tokens "whose cumulative significance is below
    the threshold Tl are pruned"): for a token ``t`` of a head,

        C(t) = (pruned_mass + sum of s_i over classified tokens i with s_i <= s_t) / Z,

    where ``Z`` is the head's total significance (all stored tokens, window included, plus the
    mass of the tokens already pruned). ``C`` is monotone in the score, so ``C(t) >= T`` is the
    single-token comparison ``s_t >= tau(T)`` with the cut-off

        tau(T) = the smallest eligible score s with C(s) >= T     (+inf if none reaches T).

    Ties at the cut-off are kept (never pruned or downgraded), so the set below a cut-off always
    has cumulative significance strictly below ``T``.

    Args:
        scores, eligible: ``[..., S]``; only eligible (classified or candidate) tokens count.
        total: ``[...]`` the head's total mass ``Z``.
        pruned_mass: ``[...]`` significance already pruned from the head.
        thresholds: sequence of cumulative thresholds.

    Returns:
        ``[..., len(thresholds)]`` fp32 cut-offs.
    """
    # a Python scalar, not torch.tensor(inf, device=...): on a GPU that is a host-to-device copy,
    # which waits for the stream like any read back
    inf = float("inf")
    s = torch.where(eligible, scores.float(), inf)
    sorted_s, _ = torch.sort(s, dim=-1)
    finite = torch.isfinite(sorted_s)
    mass = torch.where(finite, sorted_s, torch.zeros_like(sorted_s))
    z = total.float()
    z = torch.where(z > 0, z, torch.ones_like(z)).unsqueeze(-1)
    cum = (pruned_mass.float().unsqueeze(-1) + torch.cumsum(mass, dim=-1)) / z
    if not len(thresholds):
        return scores.new_zeros((*scores.shape[:-1], 0))
    # the thresholds side by side, [..., T, S], then one pass for all: a comparison with a Python
    # scalar each (a threshold tensor would be a host-to-device copy)
    reach = torch.stack([cum >= float(t) for t in thresholds], dim=-2) & finite.unsqueeze(-2)
    first = reach.to(torch.int8).argmax(dim=-1)  # [..., T]: the first sorted score reaching each threshold
    tau = torch.gather(sorted_s, -1, first)
    return torch.where(reach.any(-1), tau, inf)


def _rank(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Ascending rank of each masked element's score among the masked elements of its row."""
    s = torch.where(mask, scores, float("inf"))
    order = torch.argsort(s, dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(s.shape[-1], device=s.device).expand_as(order))
    return rank


def plan_unified(scores: torch.Tensor, tier: torch.Tensor, valid: torch.Tensor, cand: torch.Tensor,
                 proc: torch.Tensor, total: torch.Tensor, pruned_mass: torch.Tensor, th: float, tl: float):
    """LeanKV's unified compression decision for every head at once (§4 and Algorithm 1).

    All arguments but the thresholds are batched over leading dims (layer, sequence, head):

    Args:
        scores: ``[..., S]`` running significance of each stored token.
        tier: ``[..., S]`` current tier (``HIGH``/``LOW``) of each slot.
        valid: ``[..., S]`` slot holds a token.
        cand: ``[..., S]`` the token leaves the recent window now and must be placed: the
            candidate ``t_c`` of Algorithm 1 (in the prompt phase, every token outside the window).
        proc: ``[..., S]`` the token left the window earlier (already classified); ``None`` when
            nothing is classified yet (the prompt phase: no victims, and ``tier`` may be one int).
        total, pruned_mass: ``[...]`` see :func:`significance_cutoffs`.
        th, tl: cumulative thresholds ``Th`` and ``Tl`` (``tl <= th``).

    Returns:
        ``(new_class [..., S], tau_l [...], tau_h [...])`` with classes ``KEEP_HIGH``,
        ``KEEP_LOW``, ``PRUNED`` (``-1`` on invalid slots).

    Algorithm 1 with the cumulative reading of its thresholds (see :func:`significance_cutoffs`):

    * lines 5-6 / 13-14: a candidate with ``C >= Th`` goes to the high tier, with
      ``Tl <= C < Th`` to the low tier, else it is pruned;
    * lines 7-12: for every candidate placed in the high tier, the least significant
      classified high token is the victim: moved to the low tier if ``Tl <= C < Th``, pruned if
      ``C < Tl``, kept otherwise;
    * lines 15-18: for every candidate placed in the low tier, the least significant low token is
      the victim, pruned if ``C < Tl``.

    With ``k`` candidates in one step (a chunk, or the prompt) the cut-offs do not change while
    they are placed one by one (moving a token into the pruned mass leaves ``C`` unchanged for
    every larger score), so applying Algorithm 1 ``k`` times is the same as taking, per tier, the
    ``k_tier`` least significant classified tokens below the tier's cut-off: that is what is
    computed here, in any candidate order. In the prompt phase nothing is classified yet, so no
    victim exists and the result is the prompt-phase rule: with the candidates sorted by
    significance, cumulative ``< Tl`` pruned, ``< Th`` low, the rest high.
    """
    cand = cand & valid
    eligible = cand if proc is None else valid & (cand | proc)
    cut = significance_cutoffs(scores, eligible, total, pruned_mass, (tl, th))
    tau_l, tau_h = cut[..., 0], cut[..., 1]
    tl_, th_ = tau_l.unsqueeze(-1), tau_h.unsqueeze(-1)
    cls = torch.where(scores >= th_, KEEP_HIGH, torch.where(scores >= tl_, KEEP_LOW, PRUNED))
    if proc is None:  # the prompt phase: nothing classified yet, so no victims (see above)
        return torch.where(cand, cls, torch.where(valid, int(tier), -1)), tau_l, tau_h
    new = torch.where(valid, tier.to(cls.dtype), torch.full_like(cls, -1))
    new = torch.where(cand, cls, new)
    k_h = (cand & (cls == KEEP_HIGH)).sum(-1, keepdim=True)
    k_l = (cand & (cls == KEEP_LOW)).sum(-1, keepdim=True)
    # Algorithm 1 lines 7-12: victims among the classified high tokens below tau_h.
    pool_h = valid & proc & ~cand & (tier == HIGH) & (scores < th_)
    victim_h = pool_h & (_rank(scores, pool_h) < k_h)
    new = torch.where(victim_h, cls, new)
    # Lines 15-18: victims among the classified low tokens, pruned only below tau_l.
    pool_l = valid & proc & ~cand & (tier == LOW) & (scores < tl_)
    victim_l = pool_l & (_rank(scores, pool_l) < k_l)
    new = torch.where(victim_l, torch.full_like(new, PRUNED), new)
    return new, tau_l, tau_h


def prompt_classes(received: torch.Tensor, q_pos: torch.Tensor, real: torch.Tensor, q_last: torch.Tensor,
                   pruned_mass: torch.Tensor, lens: torch.Tensor, window: int, th: float, tl: float):
    """LeanKV's prompt-phase rule (§4) for one layer's prompt, every (sequence, KV head) at once:
    :func:`plan_unified` with nothing classified yet, on the significance each token's page keeps.

    ``received`` float ``[B, H, Q]``: each token's attention mass received over the prompt;
    ``q_pos`` int and ``real`` bool ``[B, Q]``; ``q_last`` int ``[B]`` each row's last real
    position; ``pruned_mass`` float ``[B, H]``; ``lens`` int ``[2, B, H]`` the tokens each head
    holds per tier (high, low) before the prompt; ``window`` recent tokens kept high; ``th >= tl``
    the cumulative thresholds. Returns ``(score fp32 [B, H, Q], cls int8 [B, H, Q], rank int64
    [B, H, Q], new_lens int64 [2, 1, B, H], pruned fp32 [B, H])``: the fp16-rounded significance
    (the running mean :func:`update_significance` gives a token's first step), the class
    (``KEEP_HIGH``/``KEEP_LOW``/``PRUNED``, ``-1`` on padding), each kept token's index among its
    head's kept tokens of its tier in arrival order (its slot past the head's count), the heads'
    counts once the kept tokens are stored and the significance pruned. The compiled CPU twin is
    :meth:`leankit.native.Kernels.prompt_classes`, the GPU one
    :func:`leankit_kernels.prompt_plan.prompt_classes`.
    """
    bsz, heads, nq = received.shape
    pos = q_pos.long().view(bsz, 1, nq).expand(bsz, heads, nq)
    last = q_last.long().view(bsz, 1, 1)
    score = (received.float() / (last - pos + 1).clamp_min(1).float()).to(torch.float16).float()
    valid = real.view(bsz, 1, nq).expand(bsz, heads, nq)
    cand = valid & (pos <= last - window)
    pm = pruned_mass.float()
    total = _masked_sum(score, valid) + pm
    cls, _, _ = plan_unified(score, HIGH, valid, cand, None, total, pm, th, tl)
    take = [(cls == c) for c in (KEEP_HIGH, KEEP_LOW)]
    ranks = [torch.cumsum(t.long(), -1) - 1 for t in take]
    rank = torch.where(take[1], ranks[1], ranks[0])
    new_lens = torch.stack([lens[i].long() + t.sum(-1) for i, t in enumerate(take)]).unsqueeze(1)
    pruned = _masked_sum(score, cls == PRUNED)
    return score, cls.to(torch.int8), rank, new_lens, pruned


# ============================================================================ page mechanics
def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim where ``mask`` holds (dead slots may hold any bytes, NaN included)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum(-1)


@dataclass
class TierMeta:
    """Per-slot metadata of one tier for a set of layers (all ``[L', B, H, ...]``)."""

    ids: torch.Tensor  # [L', B, H, P] page ids (0 where pvalid is false)
    pvalid: torch.Tensor  # [L', B, H, P]
    score: torch.Tensor  # [L', B, H, S] fp32 (S = P * T)
    pos: torch.Tensor  # [L', B, H, S] int32
    valid: torch.Tensor  # [L', B, H, S] slot < lens


def read_tier_meta(cache, tier: int, layers: torch.Tensor) -> TierMeta:
    """Scores and positions of every slot of ``tier`` for ``layers`` (reads two page segments only).

    The slot dim covers the most pages any head holds: read from the page counts on the torch
    backend, the cache's host bound (:meth:`LeanCache.page_bounds`) on the kernel backend.
    """
    table, layout = cache.table, cache.layouts[tier]
    t = layout.tokens
    n_pages = table.n_pages[tier].index_select(0, layers)
    if use_triton(n_pages):  # host bound on any head's pages: no device read (masked past n_pages)
        p = cache.page_bounds()[tier]
    else:
        p = int(n_pages.max()) if n_pages.numel() else 0
    j = torch.arange(p, device=n_pages.device)
    col = table.column(tier, j, table.row_len)
    ids = table.tables.index_select(0, layers)[..., col]
    pvalid = j < n_pages.unsqueeze(-1)
    ids = torch.where(pvalid, ids, torch.zeros_like(ids))
    flat = ids.reshape(-1).long()
    pool = cache.pool
    score = pool.segment_view(layout, "score", torch.float16).squeeze(-1).index_select(0, flat).float()
    pos = pool.segment_view(layout, "position", torch.int32).squeeze(-1).index_select(0, flat)
    shape = (*ids.shape[:-1], p * t)
    lens = table.lens[tier].index_select(0, layers)
    valid = torch.arange(p * t, device=lens.device) < lens.unsqueeze(-1)
    # Dead slots hold stale bytes (possibly NaN patterns): give them neutral values.
    score = torch.where(valid, score.reshape(shape), torch.zeros((), device=valid.device))
    pos = torch.where(valid, pos.reshape(shape), torch.full((), _BIG, dtype=torch.int32, device=valid.device))
    return TierMeta(ids, pvalid, score, pos, valid)


def locate_slots(table, tier: int, layer: torch.Tensor, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor,
                 tokens_per_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page_id, offset)`` of slots of tier ``tier`` for per-element ``(layer, b, h)``."""
    col = table.column(tier, slot.long() // tokens_per_page, table.row_len)
    page = table.tables[layer.long(), b.long(), h.long(), col]
    return page, slot % tokens_per_page


def read_tokens(pool, layout, page: torch.Tensor, off: torch.Tensor, dtype=torch.float32):
    """Dequantize ``n`` tokens ``(k, v)`` ``[n, F]`` from slots ``off`` of pages ``page``.

    Only the tokens' own K/V bytes are read (one indexed row load per segment).
    """
    prec = layout.precision
    k = layout.decode_side(pool.read_rows(layout, page, off, "k_data"), pool.read_rows(layout, page, off, "k_meta"),
                           prec.k_bits, dtype)
    v = layout.decode_side(pool.read_rows(layout, page, off, "v_data"), pool.read_rows(layout, page, off, "v_meta"),
                           prec.v_bits, dtype)
    return k, v


def _nth_slots(mask: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of the first ``cap`` set elements of each row of ``mask`` ``[..., S]``, in slot order.

    Returns ``(slot [..., cap], present [..., cap])``. Fixed shape with no host read (where
    ``nonzero`` would read the count back): a prefix sum ranks the set elements and a scatter puts
    each slot at its rank; the rest land in a dropped column.
    """
    s = mask.shape[-1]
    rank = torch.cumsum(mask.to(torch.int32), -1) - 1
    target = torch.where(mask & (rank < cap), rank, torch.full_like(rank, cap)).long()
    buf = torch.zeros((*mask.shape[:-1], cap + 1), dtype=torch.long, device=mask.device)
    buf.scatter_(-1, target, torch.arange(s, device=mask.device).expand_as(target))
    count = rank[..., -1:] + 1
    return buf[..., :cap], torch.arange(cap, device=mask.device) < count


def _head_grid(layers: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat ``(layer, b, h)`` of every element of a ``[L', B, H, c]`` tensor."""
    dev = layers.device
    lay = layers.view(-1, 1, 1, 1).expand(shape)
    b = torch.arange(shape[1], device=dev).view(1, -1, 1, 1).expand(shape)
    h = torch.arange(shape[2], device=dev).view(1, 1, -1, 1).expand(shape)
    return lay.reshape(-1), b.reshape(-1), h.reshape(-1)


def _copy_slots_masked(pool, layout, sp, so, dp, do, m: torch.Tensor) -> None:
    """:meth:`PagePool.copy_slots` of the pairs where ``m`` holds, at a fixed shape (no host read).

    Every other pair is replaced by the first kept pair, so it writes the same bytes to the same
    slot (or, when no pair is kept, all of them rewrite one slot with its own bytes).
    """
    n = m.numel()
    if n == 0:
        return
    idx = torch.where(m, torch.arange(n, device=m.device), m.to(torch.int8).argmax())
    sp, so, dp, do, m = (t[idx] for t in (sp, so, dp, do, m))
    pool.copy_slots(layout, torch.where(m, sp, dp), torch.where(m, so, do), dp, do)


class _Base:
    """State and protocol shared by every policy: new tokens enter the high tier in arrival order."""

    # Whether after_attention reads the step's received attention (significance policies do).
    uses_significance = False

    def __init__(self, cache):
        self.cache = cache
        self.real_seen: torch.Tensor | None = None  # int [B]: real tokens stored per row

    # -------------------------------------------------------------- state
    def _init_state(self, batch: int) -> None:
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.cache.device)

    def reset(self) -> None:
        """Forget all sequences."""
        self.real_seen = None

    def save_state(self):
        """What :meth:`load_state` needs to undo the per-layer work of a step that fails midway
        (None here: the base policies do no per-layer work a failed step must undo)."""

    def load_state(self, saved) -> None:
        """Undo the per-layer work of a failed step (see :meth:`save_state`)."""

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` becomes a copy of row ``beam_idx[i]``."""
        if self.real_seen is not None:
            self.real_seen = self.real_seen.index_select(0, beam_idx)

    def logical_tokens(self) -> torch.Tensor:
        """Real tokens per live (unfinished) row that an uncompressed cache would hold."""
        if self.real_seen is None:
            return torch.zeros(0, dtype=torch.long)
        return torch.where(self.cache.finished, torch.zeros_like(self.real_seen), self.real_seen)

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _query_span(step):
        """Per row: (has real query, first real query position, last real query position)."""
        return step.has_query, step.q_first, step.q_last

    def _grow_for_new(self, step) -> None:
        """Conservatively reserve high-tier room for the step's new tokens, one batched call (§5.3)."""
        self.cache.grow_for_tokens(step.n_new, self.cache.layouts[HIGH].tokens, step.q_len)

    # -------------------------------------------------------------- protocol
    def begin_step(self, step) -> None:
        """Plan the step's pages for all layers and allocate them in one batched call."""
        if self.real_seen is None:
            self._init_state(self.cache.table.shape[1])
        self._grow_for_new(step)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, received=None) -> None:
        """Quantize the real new tokens of ``layer`` into the next high-tier slots.

        ``k``/``v``: ``[B, H, Q, F]`` (the basis the pages hold). ``received`` ``[B, H, Q]``: the
        attention each new token received from the step's queries
        (:func:`~leankit.attention.step_attention`), which becomes its initial significance; ``None``
        stores 0 (policies that do not track significance).
        """
        cache = self.cache
        dense = use_triton(k)  # the kernel skips pad tokens itself: no host sync to list the real ones
        if dense and (received is None or k.shape[2] == 1):
            # One launch finds each token's slot and page, quantizes it and (one query per row)
            # advances the counts. A decode token's significance is what it received: its row's
            # one query gives n = m = 1 below, so s = received.
            cache.write_step_tokens(layer, k, v, step, received)
            return
        if not dense and k.shape[2] == 1 and cache.store_decode_tokens(layer, k, v, step, received):
            return  # a CPU decode step: one compiled call finds each token's slot, stores it, advances the counts
        if not dense and k.shape[2] > 1 and self._store_ranked(layer, k, v, step, received):
            return  # a CPU step of several tokens: one compiled call, each real token at its row's rank
        rows = self._store_rows(step, k.shape[0], k.shape[1], k.shape[2], k.device, dense)
        if rows is None:
            return
        b_rep, h_idx, q_rep, keep, rank, pos, q_first, q_last = rows
        # A decode step whose rows are all real (the usual one) lists every (row, head) in order, so
        # the per-token gathers below are plain views of k, v, received and the lengths.
        whole = not dense and k.shape[2] == 1 and b_rep.shape[0] == k.shape[0] * k.shape[1]
        if received is None:
            score = torch.zeros(b_rep.shape[0], device=k.device)
        elif k.shape[2] == 1:  # decode: the token is its row's one query, so n = m = 1 below and s = received
            score = (received.reshape(-1) if whole else received[b_rep, h_idx, q_rep]).float()
        else:  # the running mean of a token no query has seen yet, after this step's queries (§4)
            score = update_significance(torch.zeros(b_rep.shape[0], device=k.device), pos,
                                        received[b_rep, h_idx, q_rep], q_first, q_last)
        if dense:  # rows in the kernel's token order: the step store takes the scores as they are
            cache.write_step_tokens(layer, k, v, step, score)
            return
        lens = cache.table.lens[HIGH, layer]
        if whole:
            slot, k_rows, v_rows = lens.reshape(-1) + rank, k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1])
        else:
            slot, k_rows, v_rows = lens[b_rep, h_idx] + rank, k[b_rep, h_idx, q_rep], v[b_rep, h_idx, q_rep]
        cache.write_tokens(HIGH, layer, b_rep, h_idx, slot, k_rows, v_rows, pos, score, keep=keep)
        lens += step.n_new.view(-1, 1).to(lens.dtype)

    def _store_ranked(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, received) -> bool:
        """:meth:`store` of a CPU step of several tokens in one compiled call
        (:meth:`LeanCache.store_classed`): every real token of ``k``/``v`` ``[B, H, Q, F]`` to its
        head's next high slot plus its rank among its row's real tokens, then the counts advanced.
        The same slots, bytes and scores as the row lists of :meth:`_store_rows`, without them.
        Returns False, having done nothing, where the compiled kernels cannot take the store."""
        cache = self.cache
        b, h, q = k.shape[:3]
        key = ("store_ranked", b, h, q)
        if key not in step.derived:  # the same for every layer of the step
            real = step.real.view(b, 1, q).expand(b, h, q)
            step.derived[key] = (torch.where(real, KEEP_HIGH, -1).to(torch.int8),
                                 step.rank.long().view(b, 1, q).expand(b, h, q).contiguous())
        cls, rank = step.derived[key]
        zeros = torch.zeros((b, h, q), device=k.device)
        if received is None:
            score = zeros
        else:  # the running mean of a token no query has seen yet, after this step's queries (§4)
            _, q_first, q_last = self._query_span(step)
            pos = step.q_pos.view(b, 1, q).expand(b, h, q)
            score = update_significance(zeros, pos, received.float(), q_first.view(b, 1, 1), q_last.view(b, 1, 1))
        if not cache.store_classed(layer, HIGH, k, v, step, score, cls, rank, KEEP_HIGH):
            return False
        lens = cache.table.lens[HIGH, layer]
        lens += step.n_new.view(-1, 1).to(lens.dtype)
        return True

    def _store_rows(self, step, batch: int, heads: int, q_len: int, device, dense: bool):
        """The step's new tokens as one row per (token, KV head), the same for every layer, so
        derived once per step (``step.derived``): ``(b, h, q, keep, rank, pos, q_first, q_last)``
        per row (``keep`` None unless ``dense``), or None when the step stores nothing.

        ``dense`` (kernel backend) lists every (sequence, query) with a ``keep`` flag instead of
        the real ones only, which would read the device (``nonzero``).
        """
        key = ("store_rows", batch, heads, q_len, dense)
        if key in step.derived:
            return step.derived[key]
        if dense:
            b_idx, q_idx = (i.reshape(-1) for i in torch.meshgrid(torch.arange(batch, device=device),
                                                                  torch.arange(q_len, device=device), indexing="ij"))
        else:
            b_idx, q_idx = step.real.nonzero(as_tuple=True)
        rows = None
        if b_idx.numel():
            h_idx = torch.arange(heads, device=device).repeat(b_idx.numel())
            b_rep = b_idx.repeat_interleave(heads)
            q_rep = q_idx.repeat_interleave(heads)
            keep = step.real[b_rep, q_rep] if dense else None
            _, q_first, q_last = self._query_span(step)
            rows = (b_rep, h_idx, q_rep, keep, step.rank[b_rep, q_rep], step.q_pos[b_rep, q_rep],
                    q_first[b_rep], q_last[b_rep])
        step.derived[key] = rows
        return rows

    def after_store(self, layer: int, step) -> None:
        """Hook run once ``layer``'s new tokens are stored (nothing to do by default)."""

    def step_status(self, step) -> torch.Tensor | None:
        """Device values the policy wants read back at the end of a kernel-backend step, or None.

        The cache reads them in the same host read as its error flags (one sync per step) and
        hands them to :meth:`take_status` before :meth:`end_step`.
        """

    def take_status(self, values: list[int]) -> None:
        """Receive the values of :meth:`step_status`, read on the host."""

    def end_step(self, step) -> None:
        """Close the step."""
        self.real_seen += step.n_new

    # -------------------------------------------------------------- scores
    def update_scores(self, layer: int, step, received) -> None:
        """Add this step's received attention to the running significance of ``layer``'s stored tokens.

        ``received``: per tier ``[B, H, P_t * T_t]``, the probability mass each slot received from
        the step's queries (:func:`~leankit.attention.received_from_logits` or
        :func:`~leankit.attention.received_attention_ref`, computed with the step's final
        log-sum-exp), for the tokens stored by *earlier* steps; or, from the live-page decode,
        one :class:`~leankit.decode_attention.LiveSlots` per tier with ``received`` filled in.
        Rewrites the score segments.
        """
        cache = self.cache
        has, q_first, q_last = self._query_span(step)
        if received and isinstance(received[0], LiveSlots):
            self._update_live_scores(step, received)
            return
        layers = torch.full((1,), layer, device=cache.device)  # a fill, not a host-to-device copy
        view = (1, -1, 1, 1)
        for tier, layout in enumerate(cache.layouts):
            m = read_tier_meta(cache, tier, layers)
            if not m.score.shape[-1]:
                continue
            got = received[tier]
            width = m.score.shape[-1]
            if got.shape[-1] < width:
                # The kernel sizes its output by the pages heads hold, the metadata read on the
                # kernel backend by the host bound (page_bounds), which may be larger: the slots past
                # the output belong to no head's pages, and received nothing.
                got = torch.nn.functional.pad(got, (0, width - got.shape[-1]))
            new = update_significance(m.score, m.pos, got.unsqueeze(0), q_first.view(view), q_last.view(view))
            new = torch.where(m.valid & has.view(view), new, m.score).to(torch.float16)
            pages = new.view(*m.ids.shape, layout.tokens)
            cache.pool.write_scores(layout, m.ids[m.pvalid], pages[m.pvalid])

    def _update_live_scores(self, step, live: list[LiveSlots]) -> None:
        """:meth:`update_scores` from the live-page path: live pages only, their positions and
        scores already in hand (no second gather of the score and position segments)."""
        cache = self.cache
        has, q_first, q_last = self._query_span(step)
        heads = cache.table.shape[2]
        for layout, t in zip(cache.layouts, live):
            if not t.page_ids.numel():
                continue
            if t.pages is not None:  # the compiled kernels' pages: the same rule, per slot, in place
                native.kernels_for(cache.device).update_scores(t.pages, t.probs, t.row_weight, t.pos, t.valid, t.score,
                                                             q_first, q_last, has)
                continue
            row = (t.head // heads).unsqueeze(1)  # [L, 1] sequence of each page
            new = update_significance(t.score, t.pos, t.received, q_first[row], q_last[row])
            new = torch.where(t.valid & has[row], new, t.score)
            cache.pool.write_scores(layout, t.page_ids, new)

    # -------------------------------------------------------------- moving tokens
    def _compact(self, tier: int, layers: torch.Tensor, valid: torch.Tensor, alive: torch.Tensor) -> None:
        """Fill the holes left by removed tokens with the tier's tail tokens (each head then holds its
        ``alive.sum(-1)`` tokens in its first slots)."""
        cache = self.cache
        new_len = alive.sum(-1, keepdim=True)
        slot = torch.arange(valid.shape[-1], device=valid.device)
        hole = valid & ~alive & (slot < new_len)
        mover = alive & (slot >= new_len)
        hl, hb, hh, hs = hole.nonzero(as_tuple=True)
        ml, mb, mh, ms = mover.nonzero(as_tuple=True)
        assert hl.numel() == ml.numel(), "compaction pairs holes and movers one to one per head"
        if hl.numel():
            layout = cache.layouts[tier]
            t = layout.tokens
            dp, do = locate_slots(cache.table, tier, layers[hl], hb, hh, hs, t)
            sp, so = locate_slots(cache.table, tier, layers[ml], mb, mh, ms, t)
            cache.pool.copy_slots(layout, sp, so, dp, do)

    def apply_classes(self, layers: torch.Tensor, metas: list[TierMeta], news: list[torch.Tensor],
                      reserve: torch.Tensor | None = None, cap: int | None = None) -> torch.Tensor:
        """Execute per-slot decisions for ``layers`` with real reclaim; returns pruned mass ``[L', B, H]``.

        ``news[t]`` holds each slot's new class (``KEEP_HIGH``/``KEEP_LOW``/``PRUNED``). Tokens only
        ever move down: high -> low (re-quantized from their dequantized high-tier values) or out.
        ``reserve[b]`` extra high slots per row are kept for the step's new tokens.

        Page work is batched over all given layers, sequences and heads: surplus high pages are
        handed to the low side first (paper Fig. 5), then at most **one** allocation and **one**
        prefix-sum recycling call cover every remaining page change.

        ``cap`` (kernel backend): a host bound on the tokens any head removes from or moves out of a
        tier. The step then runs at fixed shapes with no host read (:meth:`_apply_classes_fixed`).
        """
        if cap is not None:
            return self._apply_classes_fixed(layers, metas, news, reserve, cap)
        cache = self.cache
        table = cache.table
        two = len(cache.layouts) > 1
        mh, nh = metas[HIGH], news[HIGH]
        alive_h = mh.valid & (nh == KEEP_HIGH)
        to_low = mh.valid & (nh == KEEP_LOW)
        pruned = _masked_sum(mh.score, mh.valid & (nh == PRUNED))
        if to_low.any() and not two:
            raise RuntimeError("a single-tier cache cannot downgrade tokens to a low tier")
        # 1. read the tokens going low before compaction may overwrite their slots
        li, bi, hi, si = to_low.nonzero(as_tuple=True)
        if li.numel():
            lay = layers[li]
            page, off = locate_slots(table, HIGH, lay, bi, hi, si, cache.layouts[HIGH].tokens)
            k, v = read_tokens(cache.pool, cache.layouts[HIGH], page, off)
            mv_score, mv_pos = mh.score[li, bi, hi, si], mh.pos[li, bi, hi, si]
            rank = (torch.cumsum(to_low.to(torch.int32), -1) - 1)[li, bi, hi, si]
        if two:
            ml, nl = metas[LOW], news[LOW]
            alive_l = ml.valid & (nl == KEEP_LOW)
            pruned = pruned + _masked_sum(ml.score, ml.valid & (nl == PRUNED))
        # 2. the page plan from the counts, checked before any token moves: a short fixed pool
        # raises PoolExhausted with the tiers as they were (compaction below overwrites in place)
        len_h = alive_h.sum(-1)
        len_l = alive_l.sum(-1) if two else torch.zeros_like(len_h)
        new_lens = torch.stack((len_h, len_l + to_low.sum(-1)))
        need, r, extra = self._tier_plan_checked(layers, new_lens[: 1 + two], reserve)
        # 3. compaction of each tier
        self._compact(HIGH, layers, mh.valid, alive_h)
        if two:
            self._compact(LOW, layers, ml.valid, alive_l)
        # 4. the grant: emptied high pages to the low side, then one grow
        self._grant_pages(layers, r, extra)
        # 5. re-quantize the downgraded tokens into the low tier
        if li.numel():
            slot = len_l[li, bi, hi] + rank
            cache.write_tokens(LOW, lay, bi, hi, slot, k, v, mv_pos, mv_score)
        # 6. one batched recycle of every page left empty
        self._set_lens_and_shrink(layers, new_lens, need)
        return pruned

    def _apply_classes_fixed(self, layers: torch.Tensor, metas: list[TierMeta], news: list[torch.Tensor],
                             reserve: torch.Tensor | None, cap: int) -> torch.Tensor:
        """:meth:`apply_classes` without a host read (kernel backend, one step's Algorithm 1).

        The same moves in another order: the page plan comes first, as one deferred grant whose
        device flag ``ok`` gates every later change (a refused grant moves no token and no page,
        and :meth:`LeanCache.end_step` raises ``PoolExhausted``); holes and movers are listed at
        the fixed width ``cap`` (:func:`_nth_slots`) instead of by ``nonzero``; the emptied high
        pages move to the low side by a dense rewrite of the page-table rows; the recycle is
        deferred. Sets ``self._grant_ok``.
        """
        cache, table = self.cache, self.cache.table
        two = len(cache.layouts) > 1
        mh, nh = metas[HIGH], news[HIGH]
        alive_h = mh.valid & (nh == KEEP_HIGH)
        to_low = mh.valid & (nh == KEEP_LOW) & two  # a single tier never classifies KEEP_LOW (Th = Tl)
        pruned = _masked_sum(mh.score, mh.valid & (nh == PRUNED))
        len_h = alive_h.sum(-1)
        if two:
            ml, nl = metas[LOW], news[LOW]
            alive_l = ml.valid & (nl == KEEP_LOW)
            pruned = pruned + _masked_sum(ml.score, ml.valid & (nl == PRUNED))
            len_l = alive_l.sum(-1)
        else:
            len_l = torch.zeros_like(len_h)
        final_l = len_l + to_low.sum(-1)
        # 1. page plan: one deferred grant; emptied high pages join the low side after compaction
        new_lens = torch.stack((len_h, final_l))
        need, r, ok = self._plan_pages(layers, new_lens[: 1 + two], reserve)
        self._grant_ok = ok
        # 2. read the tokens going low before compaction may overwrite their slots
        t_h = cache.layouts[HIGH].tokens
        c = min(cap, to_low.shape[-1]) if two else 0
        lo_slot, lo_has = _nth_slots(to_low & ok, c)
        lay, bi, hi = _head_grid(layers, lo_slot.shape)
        if c:
            page, off = locate_slots(table, HIGH, lay, bi, hi, lo_slot.reshape(-1), t_h)
            k, v = read_tokens(cache.pool, cache.layouts[HIGH], page.clamp_min(0), off)
            keep = lo_has.reshape(-1)
            k, v = (torch.where(keep.unsqueeze(-1), x, torch.zeros((), device=x.device)) for x in (k, v))
            mv_score = mh.score.gather(-1, lo_slot).reshape(-1)
            mv_pos = mh.pos.gather(-1, lo_slot).reshape(-1)
        # 3. compaction of each tier
        self._compact_fixed(HIGH, layers, mh.valid, alive_h, cap, ok)
        if two:
            self._compact_fixed(LOW, layers, ml.valid, alive_l, cap, ok)
        # 4. emptied high pages to the low side (Fig. 5 reuse), then the downgraded tokens re-quantized
        if two:
            table.move_tail(layers, r)
        if c:
            slot = torch.where(lo_has, len_l.unsqueeze(-1) + torch.arange(c, device=lo_has.device),
                               torch.zeros_like(lo_slot)).reshape(-1)
            cache.write_tokens(LOW, lay, bi, hi, slot, k, v, mv_pos, mv_score, keep=keep)
        # 5. token counts and one deferred recycle, both kept as they were when the grant was refused
        self._set_lens_and_shrink(layers, new_lens, need, ok=ok)
        return pruned * ok

    def _plan_pages(self, layers: torch.Tensor, lens: torch.Tensor, reserve: torch.Tensor | None,
                    new_tokens: bool = False):
        """Grant the pages of :meth:`_fit_pages` before anything moves (kernel backend: the plan
        (:meth:`~leankit.page_table.BidirectionalPageTable.tier_plan`) is one launch and the grant
        is deferred);
        ``lens`` ``[tiers, L', B, H]`` the heads' token counts per tier after the change. Returns
        ``(need, r, ok)``: ``need`` ``[2, L', B, H]`` the pages each tier keeps, ``r`` ``[L', B, H]``
        high pages that ``table.move_tail`` hands to the low side once they are empty, ``ok``
        the device flag of the grant (``r`` is zero when refused). ``new_tokens``: the counts
        include tokens not stored yet (a prompt), so a single tier may need pages too."""
        cache = self.cache
        need, r, extra = cache.table.tier_plan(layers, lens, tuple(lay.tokens for lay in cache.layouts), reserve)
        if reserve is None and not new_tokens and len(cache.layouts) == 1:
            # tokens only leave one tier: no head needs a page
            return need, r, torch.ones((), dtype=torch.bool, device=lens.device)
        # The grown low pages take the columns next to the low side's current ones and the moved
        # pages the ones after them: the grown ones never reach a high column (the final extents
        # fit the row), only the moved ones may, which table.move_tail handles.
        ok = cache.grow_pages(extra, defer=True)
        if ok is None:  # an eager grant (elastic pool) raised or succeeded
            ok = torch.ones((), dtype=torch.bool, device=lens.device)
        return need, r * ok, ok

    def _compact_fixed(self, tier: int, layers: torch.Tensor, valid: torch.Tensor, alive: torch.Tensor,
                       cap: int, ok: torch.Tensor) -> None:
        """:meth:`_compact` at the fixed width ``cap`` (a bound on any head's holes), when ``ok``:
        the ``i``-th hole below the new length takes the ``i``-th alive token at or past it."""
        cache = self.cache
        s = valid.shape[-1]
        c = min(cap, s)
        if c == 0:
            return
        new_len = alive.sum(-1, keepdim=True)
        slot = torch.arange(s, device=valid.device)
        hole = valid & ~alive & (slot < new_len) & ok
        mover = alive & (slot >= new_len) & ok
        hs, has = _nth_slots(hole, c)
        ms, _ = _nth_slots(mover, c)  # as many movers as holes in every head
        lay, bi, hi = _head_grid(layers, hs.shape)
        t = cache.layouts[tier].tokens
        dp, do = locate_slots(cache.table, tier, lay, bi, hi, hs.reshape(-1), t)
        sp, so = locate_slots(cache.table, tier, lay, bi, hi, ms.reshape(-1), t)
        _copy_slots_masked(cache.pool, cache.layouts[tier], sp, so, dp, do, has.reshape(-1))

    def _tier_plan_checked(self, layers: torch.Tensor, lens: torch.Tensor, reserve: torch.Tensor | None = None):
        """The page plan for ``lens`` ``[tiers, L', B, H]`` tokens per tier
        (:meth:`~leankit.page_table.BidirectionalPageTable.tier_plan`), checked against the pool:
        a fixed pool on the torch backend with fewer free pages than the plan grants raises
        ``PoolExhausted`` here, before the caller changes anything (a host read, free on the CPU;
        the kernel backend's grants check on the device and report at the end of the step).
        Returns ``(need, r, extra)`` for :meth:`_grant_pages` and :meth:`_set_lens_and_shrink`."""
        cache = self.cache
        table = cache.table
        need, r, extra = table.tier_plan(layers, lens, tuple(lay.tokens for lay in cache.layouts), reserve)
        if not cache._rows_fit():
            # A head that would outgrow its page-table row makes the grant raise ValueError, but the
            # caller compacts the tiers in place before granting: check the rows here, before any
            # token moves (one host read; never taken while the host bound shows the rows fit).
            table.check_rows(extra)
        if cache.fixed_pool and not use_triton(extra):
            free_list = cache.free_list
            needed = int(extra.sum())
            if needed > free_list.num_free:
                raise PoolExhausted(needed, free_list.num_free, free_list.capacity)
        return need, r, extra

    def _grant_pages(self, layers: torch.Tensor, r: torch.Tensor, extra: torch.Tensor) -> None:
        """Carry out a :meth:`_tier_plan_checked` plan: surplus high pages (``r``, empty by now) to
        the low side first (paper Fig. 5), then one batched allocation of ``extra``."""
        self.cache.table.move_tail(layers, r)
        self.cache.grow_pages(extra)

    def _fit_pages(self, layers: torch.Tensor, lens: torch.Tensor, reserve: torch.Tensor | None = None):
        """Give every head of ``layers`` the pages for ``lens`` ``[tiers, L', B, H]`` tokens per tier
        (plan, check, grant). Returns the page counts ``need`` ``[2, L', B, H]`` that
        :meth:`_set_lens_and_shrink` trims to once the tokens are written."""
        need = self.cache.fit_pages(layers, lens, reserve)  # a CPU's compiled plan and grant, one call
        if need is not None:
            return need
        need, r, extra = self._tier_plan_checked(layers, lens, reserve)
        self._grant_pages(layers, r, extra)
        return need

    def _set_lens_and_shrink(self, layers, lens: torch.Tensor, need: torch.Tensor,
                             ok: torch.Tensor | None = None) -> None:
        """Record the tiers' new token counts ``lens`` and recycle every page past ``need`` (both
        ``[2, L', B, H]``: high, low) in one call: a few launches a call, not a few per tier.

        ``ok``: the device flag of a deferred grant (kernel backend): where it is false the counts
        and pages stay as they were, and the recycle is deferred too (no host read)."""
        table = self.cache.table
        if ok is None and table.settle(layers, lens, need, self.cache.free_list) is not None:
            return  # a CPU's compiled pass (None without the kernels)
        keep = table.n_pages.clone()
        new = lens.to(table.lens.dtype)
        need = need.to(keep.dtype)
        if ok is not None:
            new = torch.where(ok, new, table.lens.index_select(1, layers))
            need = torch.where(ok, need, keep.index_select(1, layers))
        table.lens.index_copy_(1, layers, new)
        keep.index_copy_(1, layers, need)
        table.shrink(keep, self.cache.free_list, defer=ok is not None)


class FullPolicy(_Base):
    """Keep every real token, in the high tier, in arrival order."""


class LeanKVPolicy(_Base):
    """LeanKV unified compression (§4): per-head dynamic high/low precision and pruning.

    Prompt phase (a row's first step): all prompt tokens are stored in the high tier (the
    conservative allocation of Fig. 5), attention runs over them, then right after each layer's
    attention the layer's tokens are classified per head: the recent window ``W`` stays high,
    the rest is sorted by significance and split by the cumulative thresholds ``Tl``/``Th``
    (:func:`plan_unified`); tokens are compacted/re-quantized and the unused pages go back in one
    batched recycle per layer.

    Generation phase (every later step): at ``begin_step`` the tokens that leave the window of
    the step's first query are the candidates of Algorithm 1 (so every query of a multi-token
    step still sees its window ``W`` in the high tier); they and their victims are decided from the scores already
    stored in the pages, for all layers at once, and the step's pages are allocated in one
    batched call (at most one new page per head and tier for a one-token step). After each
    layer's attention the running significance of every stored token is updated
    (:func:`update_significance`).

    Thresholds: cumulative everywhere (see :func:`significance_cutoffs`). A single-tier config
    (``policy="leankv"`` with no low tier) only prunes (``Th`` is ignored).
    """

    uses_significance = True

    def __init__(self, cache):
        super().__init__(cache)
        cfg = cache.cfg
        self.window = cfg.window
        self.every = cfg.compress_every
        self.tl = cfg.tl
        self.th = cfg.th if cfg.low is not None else cfg.tl
        self.pruned_mass: torch.Tensor | None = None  # fp32 [L, B, H]
        self.watermark: torch.Tensor | None = None  # long [B]: positions below it are classified
        self.started: torch.Tensor | None = None  # bool [B]: row has stored tokens
        self._prompt_rows: torch.Tensor | None = None
        self._direct = False  # this step stores prompts only: LeanKVPolicy.store classifies them first
        self._span = None
        # Host knowledge that spares a decode step its device reads (kernel backend):
        self._all_started = False  # every live row has stored its prompt: no prompt rows can come
        self._skip_next = False  # no row can be due for Algorithm 1 at the next one-token step
        # long [B]: bound on any head's stored tokens not yet classified (pos >= watermark), and its
        # maximum over live rows as last read on the host: it bounds the tokens Algorithm 1 moves
        # per head, the width of its fixed-shape compaction on the kernel backend.
        self.unclassified: torch.Tensor | None = None
        self._cand_bound: int | None = None
        self._after = None  # (step, unclassified after it) as step_status computed it, for end_step
        self._grant_ok = None  # device flag of the last fixed-shape Algorithm 1 grant

    def _init_state(self, batch: int) -> None:
        super()._init_state(batch)
        cache = self.cache
        dev = cache.device
        self.pruned_mass = torch.zeros(cache.num_layers, batch, cache.num_kv_heads, device=dev)
        self.watermark = torch.full((batch,), -_BIG, dtype=torch.long, device=dev)
        self.started = torch.zeros(batch, dtype=torch.bool, device=dev)
        self._all_started = self._skip_next = False
        self.unclassified = torch.zeros(batch, dtype=torch.long, device=dev)
        self._cand_bound = None

    def reset(self) -> None:
        super().reset()
        self.pruned_mass = self.watermark = self.started = self._prompt_rows = self._span = None
        self._all_started = self._skip_next = False
        self.unclassified, self._cand_bound = None, None

    def reorder(self, beam_idx: torch.Tensor) -> None:
        super().reorder(beam_idx)
        if self.pruned_mass is not None:
            self.pruned_mass = self.pruned_mass.index_select(1, beam_idx)
            self.watermark = self.watermark.index_select(0, beam_idx)
            self.started = self.started.index_select(0, beam_idx)
            self.unclassified = self.unclassified.index_select(0, beam_idx)

    def save_state(self):
        # Only the prompt-phase classification (after_store, per layer) changes state mid-step.
        return None if self.pruned_mass is None else self.pruned_mass.clone()

    def load_state(self, saved) -> None:
        if saved is not None:
            self.pruned_mass.copy_(saved)

    def _total_mass(self, metas: list[TierMeta]) -> torch.Tensor:
        z = sum(_masked_sum(m.score, m.valid) for m in metas)
        return z

    def begin_step(self, step) -> None:
        """Generation phase: place the candidates leaving the window (Algorithm 1), then allocate."""
        cache = self.cache
        if self.real_seen is None:
            self._init_state(cache.table.shape[1])
        has, q_first, q_last = self._query_span(step)
        self._span = (has, q_first, q_last)
        if self._all_started:  # known on the host: no row stores a prompt (no device read)
            self._prompt_rows, self._direct = None, False
        else:
            self._prompt_rows = has & ~self.started
            # Every row with tokens stores its prompt: classify before writing (see store).
            self._direct = not bool((has & self.started).any()) and bool(has.any())
        skip, self._skip_next = self._skip_next and step.q_len == 1, False
        if skip:  # the last step's read showed no row can be due now: nothing to plan
            if not self._direct:  # a prompt-only step allocates per layer as it stores (store)
                self._grow_for_new(step)
            return
        # Candidates: stored tokens that leave the window of the step's FIRST query (pos <= q_first
        # - W), not yet classified. Algorithm 1 runs before the step's attention, so a token inside
        # any query's window must stay high: a multi-token step (a chunk, a new turn) places only
        # what its first query no longer sees in full precision, and its later queries' candidates
        # wait for the next step. W = 0 still keeps the step's own positions out (max(W, 1)).
        # Algorithm 1 runs for a row once `compress_every` of them are waiting (the last ones of
        # a request may stay high until it ends).
        cut = q_first - max(self.window, 1)
        gen = has & self.started & (cut - self.watermark + 1 >= self.every)
        # Kernel backend, every row generating: Algorithm 1 runs for the due rows at fixed shapes
        # with no device read (rows not due are masked out), the tokens it moves bounded per head
        # by the host's last read of the unclassified counts.
        fixed = self._all_started and use_triton(gen)
        if not fixed and not bool(gen.any()):
            if not self._direct:  # a prompt-only step allocates per layer as it stores (store)
                self._grow_for_new(step)
            return
        layers = torch.arange(cache.num_layers, device=cache.device)
        metas = [read_tier_meta(cache, t, layers) for t in range(len(cache.layouts))]
        news = self._plan(metas, gen, cut, self.watermark, self.pruned_mass)
        if fixed:
            cap = self._cand_bound if self._cand_bound is not None else metas[HIGH].score.shape[-1]
            self.pruned_mass += self.apply_classes(layers, metas, news, reserve=step.n_new, cap=max(cap, 0))
            gen = gen & self._grant_ok  # a refused grant moved nothing
        else:
            self.pruned_mass += self.apply_classes(layers, metas, news, reserve=step.n_new)
        self.watermark = torch.where(gen, torch.maximum(self.watermark, cut + 1), self.watermark)
        if fixed:  # the due rows' unclassified tokens now: those past the cut (the window)
            m = metas[HIGH]
            left = (m.valid & (m.pos.long() >= self.watermark.view(1, -1, 1, 1))).sum(-1).amax(dim=(0, 2))
            self.unclassified = torch.where(gen, left, self.unclassified)

    def _plan(self, metas: list[TierMeta], rows: torch.Tensor, cut: torch.Tensor, watermark: torch.Tensor,
              pruned_mass: torch.Tensor):
        """Decide every slot's class for the given rows (``[L', B, H, S]`` metadata).

        ``cut[b]``: tokens at or before this position leave the window; ``watermark[b]``: tokens
        before it are already classified; ``pruned_mass`` ``[L', B, H]``.
        """
        view = (1, -1, 1, 1)
        scores = torch.cat([m.score for m in metas], -1)
        valid = torch.cat([m.valid for m in metas], -1)
        pos = torch.cat([m.pos for m in metas], -1).long()
        tier = torch.cat([torch.full_like(m.pos, t) for t, m in enumerate(metas)], -1)
        row = rows.view(view)
        proc = valid & row & (pos < watermark.view(view))
        cand = valid & row & (tier == HIGH) & (pos >= watermark.view(view)) & (pos <= cut.view(view))
        new, _, _ = plan_unified(scores, tier, valid, cand, proc, self._total_mass(metas) + pruned_mass,
                                 pruned_mass, self.th, self.tl)
        sizes = [m.score.shape[-1] for m in metas]
        return list(torch.split(new, sizes, dim=-1))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, step, received=None) -> None:
        """Store the step's new tokens; a prompt is classified first and written to its final tiers.

        When every row of the step stores its prompt, the prompt-phase rule (§4) runs on the
        new tokens' significance before anything is written: each token is quantized once,
        straight into the tier it ends in, and pruned tokens are never written. (A step that
        mixes prompt rows with rows already generating stores high and classifies after, in
        :meth:`after_store`.)
        """
        if not self._direct or received is None:
            return super().store(layer, k, v, step, received)
        cache = self.cache
        q_last = self._span[2]
        if use_triton(k):
            # the prompt rule (prompt_classes) in one launch (leankit_kernels.prompt_plan), then the store
            from leankit_kernels.prompt_plan import prompt_classes as classify_launch

            layers = torch.full((1,), layer, device=cache.device)  # a fill, not a host-to-device copy
            score, cls, rank, new_lens, pruned = classify_launch(
                received, step.q_pos, step.real, q_last, self.pruned_mass[layer], cache.table.lens[:, layer],
                self.window, self.th, self.tl)
            self.pruned_mass[layer] += self._store_prompt_fixed(layer, layers, k, v, step, score, cls, rank, new_lens,
                                                                pruned)
            return
        # On a CPU the rule and the store run compiled (native/prompt_store.c, page_grants.c): a
        # short prompt's layer is otherwise about a hundred small tensor ops for a few hundred tokens.
        # The whole layer (rule, pages, both tiers' stores, recycle) is one call where the pool's
        # formats and free list allow it; else the rule, the pages and each tier's store one by one.
        if cache.store_prompt_layer(layer, k, v, step, received, q_last, self.pruned_mass[layer], self.window,
                                    self.th, self.tl):
            return
        layers = torch.full((1,), layer, device=cache.device)  # a fill, not a host-to-device copy
        compiled = native.kernels_for(k.device)
        classify = prompt_classes if compiled is None else compiled.prompt_classes
        score, cls, rank, new_lens, pruned = classify(received.float(), step.q_pos, step.real, q_last,
                                                      self.pruned_mass[layer], cache.table.lens[:, layer],
                                                      self.window, self.th, self.tl)
        need = self._fit_pages(layers, new_lens[: len(cache.layouts)])
        rows = None
        for tier, c in ((HIGH, KEEP_HIGH), (LOW, KEEP_LOW))[: len(cache.layouts)]:
            if cache.store_classed(layer, tier, k, v, step, score, cls, rank, c):
                continue
            # The torch store: every token of the step with a keep mask, at its head's count plus
            # its rank (a token not kept names a slot of its head's pages, or slot 0, and is skipped).
            take = cls == c
            if not bool(take.any()):  # one host read
                continue
            if rows is None:
                b, h, q = received.shape
                _, bi, hi = _head_grid(layers, (1, b, h, q))  # each token's (row, head), in k's token order
                pos = step.q_pos.long().view(b, 1, q).expand(b, h, q)
                rows = (bi, hi, k.reshape(b * h * q, -1), v.reshape(b * h * q, -1), pos.reshape(-1), score.reshape(-1))
            bi, hi, k_rows, v_rows, pos_rows, score_rows = rows
            slot = (cache.table.lens[tier, layer].long().unsqueeze(-1) + rank).clamp_min_(0)
            cache.write_tokens(tier, layer, bi, hi, slot.reshape(-1), k_rows, v_rows, pos_rows, score_rows,
                               keep=take.reshape(-1))
        self.pruned_mass[layer] += pruned
        self._set_lens_and_shrink(layers, new_lens, need)

    def _store_prompt_fixed(self, layer: int, layers: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step,
                            score: torch.Tensor, cls: torch.Tensor, rank: torch.Tensor, new_lens: torch.Tensor,
                            pruned: torch.Tensor) -> torch.Tensor:
        """:meth:`store` of a classified prompt on the kernel backend, with no host read: the pages
        as one deferred grant whose device flag ``ok`` gates everything after it (a refused grant
        writes no token and changes no count; :meth:`LeanCache.end_step` raises
        ``PoolExhausted``), surplus high pages to the low side in one launch (``table.move_tail``),
        one store launch per tier straight from the model's ``[B, H, Q, F]`` K/V (each kept
        token's slot is its head's count plus its rank among the head's tokens of that tier: no
        list of the kept tokens and no gathered copy of them), a deferred recycle. Returns the
        significance pruned (0 when refused). ``new_lens`` ``[2, 1, B, H]``: the heads' token counts
        per tier once the kept tokens are stored."""
        cache = self.cache
        two = len(cache.layouts) > 1
        need, r, ok = self._plan_pages(layers, new_lens[: 1 + two], None, new_tokens=True)
        if two:
            cache.table.move_tail(layers, r)
        for tier, c in ((HIGH, KEEP_HIGH), (LOW, KEEP_LOW))[: 1 + two]:
            take = (cls == c) & ok  # cls is -1 on invalid slots
            cache.write_step_tokens(layer, k, v, step, score, take=take, rank=rank, tier=tier)
        self._set_lens_and_shrink(layers, new_lens, need, ok=ok)
        return pruned * ok

    def after_store(self, layer: int, step) -> None:
        """Prompt phase: classify ``layer``'s tokens of the rows that just stored their prompt."""
        prompt = self._prompt_rows
        if prompt is None or self._direct:
            return
        _, q_first, q_last = self._span
        cut = q_last - self.window
        # Prompt rows have nothing classified yet: every token at or before `cut` is a candidate.
        if not bool((prompt & (cut >= q_first)).any()):
            return
        cache = self.cache
        layers = torch.full((1,), layer, device=cache.device)  # a fill, not a host-to-device copy
        metas = [read_tier_meta(cache, t, layers) for t in range(len(cache.layouts))]
        wm = torch.full_like(q_last, -_BIG)
        news = self._plan(metas, prompt, cut, wm, self.pruned_mass[layer: layer + 1])
        pruned = self.apply_classes(layers, metas, news)
        self.pruned_mass[layer] += pruned[0]

    def step_status(self, step) -> torch.Tensor | None:
        """Steps until the first row can be due for Algorithm 1, if positions advance by one per step.

        A one-token step at position ``P + k`` makes row ``b`` due once ``P + k - max(W, 1) -
        watermark + 1 >= every``, i.e. ``k >= k_b = every - 1 + max(W, 1) + watermark - P``. When
        every ``k_b >= 2`` the next one-token step cannot run Algorithm 1 and skips its device read
        (:meth:`begin_step`). A row that stored no token this step (padding) or has not started
        counts as due now; a finished row never is. A row whose positions jump ahead is found due
        here at the latest one step late (``k_b <= 0``), and the next step compresses it.
        """
        if not use_triton(step.q_pos):
            return None
        has, _, q_last = self._span
        wm, started = self.watermark, self.started
        if self._prompt_rows is not None:  # as end_step will set them for the rows that stored their prompt
            wm = torch.where(self._prompt_rows, q_last - self.window + 1, wm)
            started = started | (step.n_new > 0)
        k = (self.every - 1 + max(self.window, 1)) + wm - q_last
        k = torch.where(has & started, k, torch.zeros_like(k))
        k = torch.where(self.cache.finished, torch.full_like(k, _BIG), k)
        after = self._unclassified_after(step)
        self._after = (step, after)  # end_step keeps it (the same value: nothing changes in between)
        return torch.cat([k.min().reshape(1), after.max().reshape(1)])

    def take_status(self, values: list[int]) -> None:
        self._skip_next = values[0] >= 2
        self._cand_bound = int(values[1])

    def _unclassified_after(self, step) -> torch.Tensor:
        """``unclassified`` once the step's tokens are stored (0 for finished rows). A row that stored
        its prompt keeps its window unclassified: at most ``W`` tokens when its positions increase
        (distinct positions in ``(q_last - W, q_last]``), else all its new tokens."""
        u = self.unclassified + step.n_new
        if self._prompt_rows is not None:
            first = step.n_new.clamp_max(max(self.window, 0)) if step.ordered else step.n_new
            u = torch.where(self._prompt_rows, first, u)
        return torch.where(self.cache.finished, torch.zeros_like(u), u)

    def end_step(self, step) -> None:
        super().end_step(step)
        if use_triton(step.n_new):  # the bound of the fixed-shape Algorithm 1 (kernel backend only)
            after = self._after
            self.unclassified = after[1] if after is not None and after[0] is step else self._unclassified_after(step)
        self._after = None
        if self._prompt_rows is not None:
            _, _, q_last = self._span
            self.watermark = torch.where(self._prompt_rows, q_last - self.window + 1, self.watermark)
            self.started |= step.n_new > 0
            # A host read while some row has not started yet (the prompt step): later steps skip it.
            self._all_started = bool((self.started | self.cache.finished).all())
        self._prompt_rows = None


class _EndOfStepEviction(_Base):
    """A single-tier policy that evicts from the high tier at the end of every step, for all
    layers at once with one batched recycle (H2O, StreamingLLM).

    Torch backend: :meth:`end_step` plans and evicts eagerly. Kernel backend: the plan is made in
    :meth:`step_status`, before the step's one host read, which also carries the most tokens any
    head evicts; :meth:`end_step` then evicts at that fixed width (:meth:`apply_classes` with
    ``cap``: masked compaction and a deferred recycle) with no host read of its own.
    """

    def __init__(self, cache):
        super().__init__(cache)
        if cache.cfg.low is not None:
            raise ValueError(f"policy {cache.cfg.policy!r} keeps a single precision tier; "
                             "drop the low tier from the config")
        self._planned = None  # (layers, meta, keep) made by step_status (kernel backend)
        self._cap = None  # the most slots any head of _planned evicts, read with the step's flags

    def reset(self) -> None:
        super().reset()
        self._planned = self._cap = None

    def _keep(self, step, m: TierMeta) -> torch.Tensor:
        """bool ``[L, B, H, S]``: the valid slots the policy keeps once ``step`` is stored. Called
        before :meth:`end_step` updates the per-row state: it works from the state after the step."""
        raise NotImplementedError

    def _advance(self, step) -> None:
        """Update the per-row state for the stored step."""
        super().end_step(step)

    def _plan_eviction(self, step):
        """``(layers, meta, keep)`` of the high tier of every layer (rows without a query keep all)."""
        cache = self.cache
        layers = torch.arange(cache.num_layers, device=cache.device)
        m = read_tier_meta(cache, HIGH, layers)
        keep = m.valid & (self._keep(step, m) | ~step.has_query.view(1, -1, 1, 1))
        return layers, m, keep

    def step_status(self, step) -> torch.Tensor | None:
        """Kernel backend: plan the step's eviction; the value read back is the most slots any
        head evicts (the fixed width of :meth:`end_step`'s compaction, 0: nothing to evict)."""
        if not use_triton(step.q_pos):
            return None
        self._planned = self._plan_eviction(step)
        _, m, keep = self._planned
        return (m.valid & ~keep).sum(-1).amax().reshape(1)

    def take_status(self, values: list[int]) -> None:
        self._cap = int(values[0])

    def end_step(self, step) -> None:
        planned, cap = self._planned, self._cap
        self._planned = self._cap = None
        if planned is None or cap is None:  # torch backend: plan now, eagerly
            if not bool(step.has_query.any()):
                self._advance(step)
                return
            planned = self._plan_eviction(step)
        self._advance(step)
        layers, m, keep = planned
        new = torch.where(keep, KEEP_HIGH, PRUNED)
        if cap is not None:
            if cap > 0:
                self.apply_classes(layers, [m], [new], cap=cap)
        elif bool((m.valid & ~keep).any()):
            self.apply_classes(layers, [m], [new])


class H2OPolicy(_EndOfStepEviction):
    """H2O-style static budget: per head, the ``budget`` fraction of the row's tokens is kept.

    Half of the budget is the most recent tokens, half the heavy hitters: the tokens with the
    largest accumulated attention (running mean significance times the number of queries that
    saw the token, i.e. the sum H2O accumulates). Every head of a row keeps the same number of
    tokens; eviction runs after each step for all layers at once, with one batched recycle.
    """

    uses_significance = True

    def __init__(self, cache):
        super().__init__(cache)
        self.budget = cache.cfg.budget

    def _keep(self, step, m: TierMeta) -> torch.Tensor:
        view = (1, -1, 1, 1)
        q_last = step.q_last
        seen = self.real_seen + step.n_new  # real tokens per row once the step is stored
        k = torch.ceil(self.budget * seen.float()).long().clamp_min(1)
        recent = k // 2
        pos = m.pos.long()
        is_recent = pos > (q_last - recent).view(view)
        acc = m.score * (q_last.view(view) - pos + 1).float()
        rank = _rank(-acc, m.valid & ~is_recent)
        return is_recent | (rank < (k - recent).view(view))


class StreamingPolicy(_EndOfStepEviction):
    """StreamingLLM: keep the first ``sink`` tokens of each row and the ``window`` most recent."""

    def __init__(self, cache):
        super().__init__(cache)
        self.sink, self.window = cache.cfg.sink, cache.cfg.window
        self.first_pos: torch.Tensor | None = None

    def _init_state(self, batch: int) -> None:
        super()._init_state(batch)
        self.first_pos = torch.full((batch,), _BIG, dtype=torch.long, device=self.cache.device)

    def reset(self) -> None:
        super().reset()
        self.first_pos = None

    def reorder(self, beam_idx: torch.Tensor) -> None:
        super().reorder(beam_idx)
        if self.first_pos is not None:
            self.first_pos = self.first_pos.index_select(0, beam_idx)

    def _first_after(self, step) -> torch.Tensor:
        """Each row's first real position once the step is stored."""
        return torch.where(step.has_query, torch.minimum(self.first_pos, step.q_first), self.first_pos)

    def _advance(self, step) -> None:
        self.first_pos = self._first_after(step)
        super()._advance(step)

    def _keep(self, step, m: TierMeta) -> torch.Tensor:
        view = (1, -1, 1, 1)
        pos = m.pos.long()
        sink = pos < (self._first_after(step) + self.sink).view(view)
        return sink | (pos > (step.q_last - self.window).view(view))



# ============================================================================ oracle
def stored_token_reference(k: torch.Tensor, v: torch.Tensor, cfg, tier: int,
                           dense_dtype: torch.dtype = torch.float32,
                           entered: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_hat, v_hat)``: the dequantized values the cache holds for a token that ended in ``tier``.

    ``entered`` is the tier the token was first written to. Generation-phase tokens enter the
    high tier and a later downgrade (Algorithm 1) re-quantizes their dequantized high-tier value,
    so they hold ``low(high(x))``; a prompt token that the prompt-phase rule places low is written
    there directly and holds ``low(x)``. Use it with :func:`dense_attention_oracle`.
    With ``cfg.rotate`` the round trips run in the Hadamard basis and the result is rotated
    back, so the oracle keeps using unrotated queries.
    """
    from .quant import codes_per_byte, dequantize, pad_repeating, quantize
    from .rotation import hadamard, rotate_stored, unrotate

    def roundtrip(y, bits, group_size):
        if bits >= 16:
            return y.to(dense_dtype).float()
        f = y.shape[-1]
        width = -(-f // codes_per_byte(bits)) * codes_per_byte(bits)
        if width != f:  # as the cache pads such heads (LeanCache.to_page_basis), then cut back
            if group_size in (None, f):
                group_size = None  # the whole padded row is one group, as cache.padded_group_sizes makes it
            elif f % group_size or width % group_size:
                raise ValueError(f"group_size {group_size} of a head_dim {f} padded to {width} channels")
            # a smaller group dividing both widths (which the cache accepts) stays: the padding fills
            # groups of its own, so the real channels' groups and codes are those of the unpadded row
            y = pad_repeating(y, width)
        packed, sc, mn = quantize(y, bits, group_size)
        return dequantize(packed, sc, mn, bits)[..., :f]

    h = hadamard(k.shape[-1], k.device, k.dtype) if cfg.rotate else None
    if h is not None:
        k, v = rotate_stored(k, h), rotate_stored(v, h)  # as the cache rotates what it stores
    for t in range(entered, tier + 1):
        prec, gs = cfg.tiers[t], cfg.tier_group_size(t)
        k, v = roundtrip(k, prec.k_bits, gs), roundtrip(v, prec.v_bits, gs)
    if h is not None:
        k, v = unrotate(k, h), unrotate(v, h)
    return k, v


def dense_attention_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
                           keep: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense reference attention over explicitly given (dequantized) keys and values.

    The oracle for the paged path: given the same decisions (which tokens are kept, and the
    values each tier's quantization turns them into), attention is a plain masked softmax.

    Args:
        q: ``[B, Hq, Q, F]`` queries.
        k, v: ``[B, Hkv, N, F]`` keys/values as the cache holds them (dequantized).
        k_pos: int ``[B, Hkv, N]`` token positions.
        keep: bool ``[B, Hkv, N]``: token is stored (not pruned, not padding).
        q_pos: int ``[B, Q]`` query positions; key ``j`` is visible iff ``keep`` and
            ``k_pos[j] <= q_pos``.

    Returns:
        ``[B, Q, Hq, F]`` fp32 (0 for a query that sees no key).
    """
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = k.float().repeat_interleave(g, dim=1)
    vv = v.float().repeat_interleave(g, dim=1)
    kp = k_pos.repeat_interleave(g, dim=1)
    kept = keep.repeat_interleave(g, dim=1)
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * scale  # [B, Hq, Q, N]
    vis = kept.unsqueeze(2) & (kp.unsqueeze(2) <= q_pos.view(b, 1, nq, 1))
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vv).transpose(1, 2)


def make_policy(cache):
    """The placement policy for ``cache.cfg.policy``."""
    name = cache.cfg.policy
    if name == "full":
        if cache.cfg.low is not None:
            raise ValueError("policy 'full' keeps every token in the high tier; "
                             "a low tier needs policy 'leankv'")
        return FullPolicy(cache)
    significance = {"leankv": LeanKVPolicy, "h2o": H2OPolicy, "streaming": StreamingPolicy}
    if name not in significance:
        raise ValueError(f"unknown placement policy {name!r}")
    if cache.num_layers == 0:
        # Every layer keeps transformers' own sliding-window cache (Mistral with a window, say):
        # no page holds a token, so there is nothing to score, move or evict, and the significance
        # policies' reductions over layers would have nothing to reduce. The full policy's
        # bookkeeping over zero layers is the whole of their work.
        return FullPolicy(cache)
    return significance[name](cache)


__all__ = ["HIGH", "KEEP_HIGH", "KEEP_LOW", "LOW", "PRUNED", "FullPolicy", "H2OPolicy", "LeanKVPolicy",
           "StreamingPolicy", "dense_attention_oracle", "make_policy", "plan_unified", "read_tier_meta",
           "significance_cutoffs", "stored_token_reference", "update_significance"]
