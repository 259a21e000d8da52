"""HybridServe/CAPTURE: Algorithm 1, Eq. 11, Eqs. 12-13 and the greedy mini-batch packing."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from leankit.planner import hybrid as hyb
from leankit.planner.hardware import LinearFit

GEN = LinearFit(2.0, 0.0, 1.0)  # seconds per block: regeneration (GPU)
LOAD = LinearFit(1.0, 0.0, 1.0)  # seconds per block: KV over the link


def test_initial_allocation_positive_budget_adds_act_blocks():
    # Algorithm 1 line 13: T_budget = T_load_w - T_kv_gen(#ACT_GPU) = 100 - 2*10 = 80 -> 40 ACT blocks (line 15)
    a, k, budget = hyb.init_cache_alloc(100.0, 10, GEN, LOAD, 1e6, 1e6)
    assert budget == 80.0 and (a, k) == (40, 0)


def test_initial_allocation_negative_budget_adds_kv_blocks():
    # budget = 10 - 2*30 = -50 -> KV blocks with T_load_kv = 50 (line 17)
    a, k, budget = hyb.init_cache_alloc(10.0, 30, GEN, LOAD, 1e6, 1e6)
    assert budget == -50.0 and (a, k) == (0, 50)


def test_algorithm1_balances_and_fills_memory():
    s_kv, s_act = 2.0, 1.0  # S_ACT = S_KV / 2
    alloc = hyb.allocate_host_blocks(t_load_w=100.0, act_gpu=10, m_host=1000.0, s_weight=100.0, s_kv=s_kv,
                                     s_act=s_act, t_kv_gen=GEN, t_load_kv=LOAD)
    assert (alloc.act_init, alloc.kv_init) == (40, 0)
    # remaining memory 1000 - 100 - 40 = 860 = A + 2K with 2A = K  ->  A = 172, K = 344
    assert alloc.act_remain == 172 and alloc.kv_remain == 344
    assert GEN(alloc.act_remain) == pytest.approx(LOAD(alloc.kv_remain))
    used = s_act * alloc.act_host + s_kv * alloc.kv_host
    assert used <= 900.0 + 1e-9 and used > 900.0 - s_kv - s_act
    assert alloc.kv_to_act_memory_ratio() == pytest.approx(2 * 344 / (212 * 1))


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 10), st.floats(0.1, 10), st.floats(0, 500), st.integers(0, 200), st.floats(200, 5000))
def test_algorithm1_properties(g, k, tw, act_gpu, m_host):
    gen, load = LinearFit(g, 0.0, 1.0), LinearFit(k, 0.0, 1.0)
    a = hyb.allocate_host_blocks(tw, act_gpu, m_host, 50.0, 2.0, 1.0, gen, load)
    assert a.act_host >= 0 and a.kv_host >= 0
    assert 1.0 * a.act_host + 2.0 * a.kv_host <= m_host - 50.0 + 1e-6
    # step 2 balances regeneration against KV loading up to one block
    if a.act_remain and a.kv_remain:
        assert abs(gen(a.act_remain) - load(a.kv_remain)) <= max(g, k) * 2 + 1e-9


def test_workload_form_counts_blocks():
    a = hyb.allocate_for_workload(1000, 100.0, 10, 2.0, 1.0, GEN, LOAD)
    assert a.act_init == 40 and a.act_host + a.kv_host == 1000
    assert abs(GEN(a.act_remain) - LOAD(a.kv_remain)) <= 3


def test_balance_split_equalizes_link_and_gpu():
    phi = hyb.balance_split(n_host=1000, t_load_w=0.5, kv_t=1e-3, act_t=0.5e-3, gen_t=1.5e-3, gpu_fixed=0.1)
    link = 0.5 + 1000 * ((1 - phi) * 1e-3 + phi * 0.5e-3)
    gpu = 0.1 + 1000 * phi * 1.5e-3
    assert 0 < phi < 1 and link == pytest.approx(gpu)
    # activations not smaller than KV (GQA): nothing to gain
    assert hyb.balance_split(1000, 0.5, 1e-3, 1.5e-3, 1e-4) == 0.0


def test_eq11_papers_example():
    # HybridServe §4.3.2: host ratio 3:1, request with five ACT and two KV blocks -> next block is ACT
    assert hyb.next_block_type(5, 2, 3, 1) == "ACT"
    assert hyb.next_block_type(6, 2, 3, 1) == "KV"
    assert hyb.next_block_type(4, 0, 0, 5) == "KV"
    assert hyb.next_block_type(0, 4, 5, 0) == "ACT"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(0, 50), st.integers(0, 50))
def test_eq11_keeps_the_host_ratio(n, a_host, k_host):
    if a_host + k_host == 0:
        return
    a, k = hyb.allocate_request_blocks(n, a_host, k_host)
    assert a + k == n
    target = a_host / (a_host + k_host)
    assert abs(a - target * n) <= 1 + 1e-9


def test_balance_and_imbalance_definitions():
    assert hyb.balance(10, 20, GEN, LOAD) == 1.0  # 2*10 / 1*20
    assert hyb.imbalance(10, 10, GEN, LOAD) == 2.0
    assert hyb.imbalance(5, 20, GEN, LOAD) == 2.0  # balance 0.5 -> F_b = 2
    assert math.isinf(hyb.imbalance(3, 0, GEN, LOAD)) and hyb.imbalance(0, 0, GEN, LOAD) == 1.0


requests_st = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=30)


@settings(max_examples=100, deadline=None)
@given(requests_st, st.integers(12, 40), st.integers(12, 40))
def test_packing_places_every_request_once_within_capacity(reqs, act_max, kv_max):
    rs = [hyb.Request(i, a, k) for i, (a, k) in enumerate(reqs)]
    bins = hyb.pack_minibatches(rs, act_max, kv_max, GEN, LOAD)
    placed = [r.rid for b in bins for r in b]
    assert sorted(placed) == list(range(len(rs)))
    for b in bins:
        assert b, "no empty mini-batch"
        assert sum(r.act for r in b) <= act_max and sum(r.kv for r in b) <= kv_max


def test_packing_rejects_oversized_request():
    with pytest.raises(ValueError):
        hyb.pack_minibatches([hyb.Request(0, 50, 1)], 10, 10, GEN, LOAD)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=6), st.integers(8, 20))
@example(reqs=[(6, 1), (6, 1), (8, 1), (2, 2)], cap=8)  # the same bins in another order: equal cost
def test_exact_packing_is_feasible_and_never_worse_than_greedy(reqs, cap):
    rs = [hyb.Request(i, a, k) for i, (a, k) in enumerate(reqs)]
    greedy = hyb.pack_minibatches(rs, cap, cap, GEN, LOAD)
    exact = hyb.pack_minibatches_exact(rs, cap, cap, GEN, LOAD)
    assert sorted(r.rid for b in exact for r in b) == list(range(len(rs)))
    assert all(sum(r.act for r in b) <= cap and sum(r.kv for r in b) <= cap for b in exact)
    assert hyb.packing_cost(exact, GEN, LOAD) <= hyb.packing_cost(greedy, GEN, LOAD)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=7), st.integers(6, 18))
def test_greedy_uses_at_most_twice_the_optimal_bins_when_requests_share_the_ratio(sizes, cap):
    # Under Eq. 11 every request carries the host's ratio (here 1 ACT : 2 KV); greedy then behaves like
    # first-fit with one open bin, and two consecutive bins always overflow one capacity.
    rs = [hyb.Request(i, s, 2 * s) for i, s in enumerate(sizes) if 2 * s <= cap]
    if not rs:
        return
    greedy = hyb.pack_minibatches(rs, cap, cap, GEN, LOAD)
    exact = hyb.pack_minibatches_exact(rs, cap, cap, GEN, LOAD)
    assert len(greedy) <= 2 * len(exact)
    fs = {round(hyb.imbalance(sum(r.act for r in b), sum(r.kv for r in b), GEN, LOAD), 9) for b in greedy}
    assert fs == {1.0}


def test_greedy_pairs_act_heavy_with_kv_heavy_requests():
    # two ACT-only and two KV-only requests; capacity fits one of each per mini-batch
    rs = [hyb.Request(0, 4, 0), hyb.Request(1, 4, 0), hyb.Request(2, 0, 8), hyb.Request(3, 0, 8)]
    greedy = hyb.pack_minibatches(rs, 4, 8, GEN, LOAD)
    exact = hyb.pack_minibatches_exact(rs, 4, 8, GEN, LOAD)
    assert hyb.packing_cost(greedy, GEN, LOAD) == hyb.packing_cost(exact, GEN, LOAD) == (2, 1.0, 1.0)
