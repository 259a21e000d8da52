"""LeanKV classification: prompt-phase invariants, Algorithm 1 transitions, phase consistency."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leankit.policy import (
    HIGH,
    KEEP_HIGH,
    KEEP_LOW,
    LOW,
    PRUNED,
    plan_unified,
    significance_cutoffs,
    update_significance,
)

FAST = settings(max_examples=int(__import__("os").environ.get("LEANKIT_HYPOTHESIS_EXAMPLES", 60)), deadline=None)


def prompt_classify(scores: torch.Tensor, window: int, th: float, tl: float):
    """Prompt-phase classification of one head: the last ``window`` tokens are the window."""
    n = scores.numel()
    pos = torch.arange(n)
    valid = torch.ones(n, dtype=torch.bool)
    cand = pos < n - window
    tier = torch.full((n,), HIGH)
    z = scores.sum()
    new, tau_l, tau_h = plan_unified(scores, tier, valid, cand, torch.zeros_like(cand), z, torch.zeros(()), th, tl)
    return new, cand, tau_l, tau_h


score_lists = st.lists(st.floats(min_value=0.0, max_value=1.0, allow_nan=False, width=32), min_size=1, max_size=60)
thresholds = st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)).map(lambda t: (max(t), min(t)))


@FAST
@given(score_lists, st.integers(0, 70), thresholds)
def test_prompt_invariants(raw, window, th_tl):
    th, tl = th_tl
    scores = torch.tensor(raw, dtype=torch.float32)
    n = scores.numel()
    new, cand, tau_l, _tau_h = prompt_classify(scores, window, th, tl)
    w = min(window, n)
    n_p = int(((new == PRUNED) & cand).sum())
    n_l = int(((new == KEEP_LOW) & cand).sum())
    n_h = int(((new == KEEP_HIGH) & cand).sum())
    # Np + Nl + Nh + W = N, and the window is untouched (high).
    assert n_p + n_l + n_h + w == n
    assert bool((new[~cand] == KEEP_HIGH).all())
    z = float(scores.sum())
    if z <= 0:
        return
    mass = scores.double() / z
    pruned = float(mass[new == PRUNED].sum())
    low_or_pruned = float(mass[(new == PRUNED) | (new == KEEP_LOW)].sum())
    # Cumulative bounds: pruned mass < Tl, pruned + low mass < Th (or nothing below the threshold).
    assert n_p == 0 or pruned < tl + 1e-6
    assert (n_p + n_l) == 0 or low_or_pruned < th + 1e-6
    # Classes are ordered by significance: pruned < low < high among the classified tokens.
    s = scores[cand]
    c = new[cand]
    for lo_cls, hi_cls in ((PRUNED, KEEP_LOW), (KEEP_LOW, KEEP_HIGH), (PRUNED, KEEP_HIGH)):
        if bool((c == lo_cls).any()) and bool((c == hi_cls).any()):
            assert float(s[c == lo_cls].max()) < float(s[c == hi_cls].min())
    # Maximality: the pruned set stops exactly where the cumulative mass would reach Tl.
    if torch.isfinite(tau_l):
        reach = float(mass[cand & (scores <= tau_l)].sum())
        assert reach >= tl - 1e-6
    else:
        assert float(mass[cand].sum()) < tl + 1e-6


@FAST
@given(score_lists, st.integers(0, 10), thresholds)
def test_prompt_classes_are_a_fixed_point_of_algorithm1(raw, window, th_tl):
    """No arbitrary flip between phases: re-placing any classified token as Algorithm 1's candidate,
    with the others classified and the pruned ones folded into the pruned mass, returns its class
    and selects no victim.

    The property holds in exact arithmetic. The re-placement sums the same masses in another fp32
    order (pruned ones folded into the pruned mass first), so a cumulative significance within
    rounding of a threshold may land on either side of it: e.g. ``raw=[0.8125, 0.0354, 0.8112]``,
    window 0, ``Th = 1``, where the prompt phase's cumulative of the largest is exactly 1 and the
    re-placed one's just under. Such ties, judged in fp64, are left out."""
    th, tl = th_tl
    scores = torch.tensor(raw, dtype=torch.float32)
    n = scores.numel()
    new, cand, _, _ = prompt_classify(scores, window, th, tl)
    cum = torch.cumsum(torch.sort(scores.double()[cand]).values, 0) / max(float(scores.double().sum()), 1e-300)
    assume(all(bool(((cum - t).abs() > 1e-5 * max(t, 1e-30)).all()) for t in (th, tl)))
    z = scores.sum()
    for t in torch.nonzero(cand).flatten().tolist():
        kept = new != PRUNED
        kept[t] = True
        pruned_mass = scores[(new == PRUNED)].sum() - (scores[t] if new[t] == PRUNED else 0.0)
        tier = torch.where(new == KEEP_LOW, LOW, HIGH)
        tier[t] = HIGH
        c = torch.zeros(n, dtype=torch.bool)
        c[t] = True
        proc = cand & kept & ~c
        out, _, _ = plan_unified(scores, tier, kept, c, proc, z, pruned_mass, th, tl)
        assert int(out[t]) == int(new[t])
        others = kept & ~c
        expected = torch.where(new == KEEP_LOW, KEEP_LOW, KEEP_HIGH)
        assert torch.equal(out[others], expected[others])


def _one_head(scores, tiers, cand_idx, window_mass, pruned_mass=0.0):
    s = torch.tensor(scores, dtype=torch.float32)
    n = s.numel()
    tier = torch.tensor(tiers)
    valid = torch.ones(n, dtype=torch.bool)
    cand = torch.zeros(n, dtype=torch.bool)
    cand[cand_idx] = True
    proc = ~cand
    z = s.sum() + window_mass + pruned_mass
    return plan_unified(s, tier, valid, cand, proc, z, torch.tensor(pruned_mass), th=0.3, tl=0.1)


def test_algorithm1_high_candidate_moves_victim_to_low():
    # Z = 1: the victim (0.15) has C = 0.15, in [Tl, Th) = [0.1, 0.3); the candidate (0.5) goes high.
    new, _tau_l, _tau_h = _one_head([0.15, 0.2, 0.5], [HIGH, HIGH, HIGH], 2, window_mass=0.15)
    assert new.tolist() == [KEEP_LOW, KEEP_HIGH, KEEP_HIGH]  # line 9: victim re-quantized to low


def test_algorithm1_high_candidate_prunes_victim_below_tl():
    new, _, _ = _one_head([0.05, 0.3, 0.5], [HIGH, HIGH, HIGH], 2, window_mass=0.15)
    assert new.tolist() == [PRUNED, KEEP_HIGH, KEEP_HIGH]  # line 11: victim removed


def test_algorithm1_high_victim_above_th_stays():
    new, _, _ = _one_head([0.35, 0.4], [HIGH, HIGH], 1, window_mass=0.25)
    assert new.tolist() == [KEEP_HIGH, KEEP_HIGH]  # line 8 false, line 10 false: victim kept


def test_algorithm1_only_one_victim_per_candidate():
    # Two high tokens below Th, one candidate: only the least significant is downgraded.
    new, _, _ = _one_head([0.12, 0.13, 0.5], [HIGH, HIGH, HIGH], 2, window_mass=0.25)
    assert new.tolist() == [KEEP_LOW, KEEP_HIGH, KEEP_HIGH]


def test_algorithm1_low_candidate_prunes_low_victim():
    # low token 0.04 (C=0.04 < Tl) and candidate 0.1 (C=0.14: low); victim in KV_l is pruned (line 17).
    new, _, _ = _one_head([0.04, 0.1, 0.6], [LOW, HIGH, HIGH], 1, window_mass=0.26)
    assert new.tolist() == [PRUNED, KEEP_LOW, KEEP_HIGH]


def test_algorithm1_low_candidate_keeps_low_victim_above_tl():
    new, _, _ = _one_head([0.11, 0.12, 0.5], [LOW, HIGH, HIGH], 1, window_mass=0.27)
    assert new.tolist() == [KEEP_LOW, KEEP_LOW, KEEP_HIGH]


def test_algorithm1_pruned_candidate_selects_no_victim():
    # Candidate mass 0.02 with C < Tl: pruned, and no victim is examined (the high 0.2 token stays).
    new, _, _ = _one_head([0.02, 0.2, 0.5], [HIGH, HIGH, HIGH], 0, window_mass=0.28)
    assert new.tolist() == [PRUNED, KEEP_HIGH, KEEP_HIGH]


def test_algorithm1_pruned_mass_counts_toward_tl():
    # Without pruned mass a 0.06 candidate is pruned (C=0.06 < 0.1); with 0.05 already pruned C=0.11 -> low.
    new, _, _ = _one_head([0.06, 0.5], [HIGH, HIGH], 0, window_mass=0.44)
    assert int(new[0]) == PRUNED
    new, _, _ = _one_head([0.06, 0.5], [HIGH, HIGH], 0, window_mass=0.39, pruned_mass=0.05)
    assert int(new[0]) == KEEP_LOW


def _sequential_reference(scores, tier, cand_order, z, pruned_mass, th, tl):
    """Algorithm 1 applied one candidate at a time, in the given order.

    The cumulative significance C of a step counts the classified tokens and all of the step's
    candidates (the prompt-phase rule when nothing is classified yet). The cut-offs are
    recomputed after every placement from the current state (pruned tokens folded into the
    pruned mass) to check that they do not move within a step.
    """
    cls = torch.where(tier == LOW, KEEP_LOW, KEEP_HIGH).clone()
    alive = torch.ones_like(tier, dtype=torch.bool)
    classified = torch.zeros_like(alive)
    classified[[i for i in range(len(tier)) if i not in cand_order]] = True
    step_cand = ~classified
    pm = pruned_mass.clone()
    for c in cand_order:
        elig = alive & (classified | step_cand)
        cut = significance_cutoffs(scores, elig, z, pm, (tl, th))
        tau_l, tau_h = float(cut[0]), float(cut[1])
        s_c = float(scores[c])
        classified[c] = True
        if s_c >= tau_h:
            cls[c] = KEEP_HIGH
            pool = alive & classified & (cls == KEEP_HIGH) & (torch.arange(len(tier)) != c)
            dest = KEEP_HIGH
        elif s_c >= tau_l:
            cls[c] = KEEP_LOW
            pool = alive & classified & (cls == KEEP_LOW) & (torch.arange(len(tier)) != c)
            dest = KEEP_LOW
        else:
            cls[c] = PRUNED
            alive[c] = False
            pm = pm + scores[c]
            continue
        # Candidates still waiting are not in the tiers yet; the victim is the argmin (incl. t_c).
        pool = pool | (torch.arange(len(tier)) == c)
        sv = torch.where(pool, scores, torch.tensor(float("inf")))
        v = int(torch.argmin(sv))
        s_v = float(scores[v])
        if dest == KEEP_HIGH and tau_l <= s_v < tau_h:
            cls[v] = KEEP_LOW
        elif s_v < tau_l:
            cls[v] = PRUNED
            alive[v] = False
            pm = pm + scores[v]
    return cls


# Dyadic masses and a power-of-two total keep every cumulative sum exact, and thresholds of the
# form (j + 1/3) / 997 never coincide with one: the comparison below is free of rounding ties.
exact_thresholds = st.tuples(st.integers(0, 996), st.integers(0, 996)).map(
    lambda t: ((max(t) + 1 / 3) / 997, (min(t) + 1 / 3) / 997))


@FAST
@given(st.lists(st.integers(1, 1024), min_size=2, max_size=24, unique=True), st.data(), exact_thresholds)
def test_batched_candidates_equal_sequential_algorithm1(raw, data, th_tl):
    th, tl = th_tl
    n = len(raw)
    scores = torch.tensor(raw, dtype=torch.float32) / 1024
    k = data.draw(st.integers(1, n))
    cand_idx = data.draw(st.permutations(range(n)))[:k]
    tier = torch.tensor([data.draw(st.sampled_from([HIGH, LOW])) for _ in range(n)])
    tier[cand_idx] = HIGH
    pm = torch.tensor(data.draw(st.integers(0, 200)) / 1024)
    # The window holds the rest of the mass: the total is a power of two.
    z = torch.tensor(2.0 ** (int(torch.ceil(torch.log2(scores.sum() + pm))) + data.draw(st.integers(0, 1))))
    cand = torch.zeros(n, dtype=torch.bool)
    cand[cand_idx] = True
    batched, _, _ = plan_unified(scores, tier, torch.ones(n, dtype=torch.bool), cand, ~cand, z, pm, th, tl)
    seq = _sequential_reference(scores, tier, cand_idx, z, pm, th, tl)
    assert batched.tolist() == seq.tolist()


# ------------------------------------------------------------------------ significance rule
@FAST
@given(st.floats(0.0, 1.0), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12), st.integers(0, 5))
def test_chunk_update_equals_sequential_running_mean(s0, probs, age):
    """A multi-query step is the running rule s <- s + (p - s)/n applied once per query."""
    pos = torch.tensor([0])
    q_first = age + 1 if age >= 0 else 0
    s_seq = torch.tensor([s0])
    for i, p in enumerate(probs):
        q = q_first + i
        n = q - 0 + 1
        s_seq = s_seq + (p - s_seq) / n
    s_chunk = update_significance(torch.tensor([s0]), pos, torch.tensor([sum(probs)]),
                                  torch.tensor(q_first), torch.tensor(q_first + len(probs) - 1))
    torch.testing.assert_close(s_chunk, s_seq.float(), rtol=1e-5, atol=1e-6)


def test_prompt_significance_is_the_mean_over_later_queries():
    torch.manual_seed(0)
    n = 9
    p = torch.softmax(torch.randn(n, n).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), -1e9), -1)
    received = p.sum(0)  # token i: sum over queries j >= i
    s = update_significance(torch.zeros(n), torch.arange(n), received, torch.tensor(0), torch.tensor(n - 1))
    expected = torch.stack([p[i:, i].mean() for i in range(n)])
    torch.testing.assert_close(s, expected)


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), thresholds, st.floats(0.0, 0.5))
def test_prompt_phase_shortcut_classifies_as_the_general_rule(seed, n, ths, pruned):
    """``proc=None`` (nothing classified yet: the prompt phase, which skips the victim search) gives
    the classes and cut-offs of the general rule with ``proc`` all false, on batched random heads
    with dead slots and ties; and the cut-offs of several thresholds at once equal one at a time."""
    th, tl = ths
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 3, n, generator=g)
    scores = torch.where(torch.rand(2, 3, n, generator=g) < 0.2, scores.roll(1, -1), scores)  # ties
    valid = torch.rand(2, 3, n, generator=g) < 0.9
    cand = valid & (torch.rand(2, 3, n, generator=g) < 0.8)
    z = torch.where(valid, scores, 0).sum(-1) + pruned
    pm = torch.full((2, 3), pruned)
    general = plan_unified(scores, torch.full((2, 3, n), HIGH), valid, cand, torch.zeros_like(cand), z, pm, th, tl)
    shortcut = plan_unified(scores, HIGH, valid, cand, None, z, pm, th, tl)
    for a, b in zip(general, shortcut):
        assert torch.equal(a, b)
    both = significance_cutoffs(scores, valid, z, pm, (tl, th))
    for i, t in enumerate((tl, th)):
        assert torch.equal(both[..., i], significance_cutoffs(scores, valid, z, pm, (t,))[..., 0])
