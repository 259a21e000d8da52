"""KVPR: Table 1, Eqs. 6-11, the row/column schedules, re-solving as s' grows, the Fig. 5 pipeline."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leankit.planner import get_hardware, get_model
from leankit.planner import kvpr as kvp

A100 = get_hardware("a100-40gb-pcie4")


@pytest.mark.parametrize("name,mb,ms,comp", [("opt-6.7b", 512, 15.6, 0.3509), ("opt-13b", 640, 19.5, 0.4388),
                                             ("opt-30b", 896, 27.3, 0.6143)])
def test_table1_pcie_column(name, mb, ms, comp):
    # KVPR Table 1: batch 32, sequence 1024, fp16, 32 GB/s
    m = get_model(name)
    row = kvp.table1_row(m, A100, batch=32, seq=1024)
    assert row["hidden"] == {"opt-6.7b": 4096, "opt-13b": 5120, "opt-30b": 7168}[name]
    assert row["kv_cache_mb"] == mb
    assert round(row["pcie_ms"], 1) == ms
    # the "Comp. Latency" column is a memory-bound read of the cache at A100 HBM speed (within 2%)
    assert row["comp_ms"] == pytest.approx(comp, rel=0.02)
    # Eq. 6 in the paper's own form agrees with ModelSpec
    assert kvp.kv_bytes(32, 1024, 0, m.hidden) == 32 * 1024 * m.kv_bytes_per_token()


def test_eq6_eq8_paper_forms_match_modelspec_for_mha():
    m = get_model("opt-13b")
    assert kvp.activation_bytes(4, 100, m.hidden) == 4 * 100 * m.act_bytes_per_token()
    assert kvp.recompute_flops(4, 100, m.hidden) == 4 * 100 * m.kv_gen_flops_per_token()


def test_optimum_is_interior_when_recompute_and_transfer_cross():
    m = get_model("opt-13b")
    r = kvp.KVPRRates.for_model(m, A100, 32)
    sp = kvp.solve_split(1024, r)
    assert sp.interior
    assert sp.l == kvp.brute_force_split(1024, r)
    # at the optimum, recomputation and the remaining transfer nearly coincide (Eq. 10's max switches)
    assert abs(sp.l * r.r - (1024 - sp.l) * r.kv) <= r.r + r.kv
    assert sp.speedup > 1.2


def test_optimum_at_an_end_when_activation_is_not_smaller_than_kv():
    # SmolLM2 (GQA): one activation (1152 B) costs more link time than K+V (768 B); Eq. 10 grows with l
    m = get_model("smollm2-135m")
    r = kvp.KVPRRates.for_model(m, A100, 32)
    assert r.x >= r.kv
    sp = kvp.solve_split(1024, r)
    assert sp.l == 0 and not sp.interior and sp.speedup == 1.0


def test_optimum_at_an_end_when_the_lines_do_not_cross_in_range():
    r = kvp.KVPRRates(x=1.0, kv=2.0, r=1.0)
    # GPU already busier than any transfer: no recomputation
    assert kvp.solve_split(100, r, gpu_extra=1000.0).l == 0
    # crossing beyond the allowed range (Eq. 11's l <= s): the bound itself
    sp = kvp.solve_split(100, r, l_max=20)
    assert sp.l == 20 and not sp.interior


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 400), st.floats(0.01, 5), st.floats(0.01, 5), st.floats(0.01, 5),
       st.sampled_from(["column", "row"]), st.floats(0, 200), st.floats(0, 200))
def test_closed_form_matches_brute_force(s, x, kv, rr, sched, gx, px):
    r = kvp.KVPRRates(x=x, kv=kv, r=rr)
    sp = kvp.solve_split(s, r, sched, gpu_extra=gx, pcie_extra=px)
    bf = kvp.brute_force_split(s, r, sched, gpu_extra=gx, pcie_extra=px)
    assert sp.time == pytest.approx(kvp.layer_time(bf, s, r, sched, gx, px), rel=1e-12, abs=1e-12)
    assert sp.time <= sp.time_no_recompute + 1e-12


def test_row_schedule_drops_the_first_term():
    r = kvp.KVPRRates(x=1.0, kv=2.0, r=3.0)
    for l in (0, 5, 10):
        assert kvp.layer_time(l, 10, r, "column") == pytest.approx(kvp.layer_time(l, 10, r, "row") + l * r.x)
    assert kvp.solve_split(10, r, "row").time <= kvp.solve_split(10, r, "column").time
    with pytest.raises(ValueError):
        kvp.layer_time(11, 10, r)


def test_split_is_resolved_as_the_sequence_grows():
    m = get_model("opt-6.7b")
    r = kvp.KVPRRates.for_model(m, A100, 64)
    sched = kvp.split_schedule(128, 64, r, "column", cap_at_prompt=False)
    assert [s.s_prime for s in sched] == list(range(128, 192))
    ls = [s.l for s in sched]
    assert ls == sorted(ls) and ls[-1] > ls[0]
    capped = kvp.split_schedule(128, 64, r, "column", cap_at_prompt=True)
    assert all(s.l <= 128 for s in capped)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["opt-6.7b", "opt-13b"]), st.integers(1, 32), st.integers(16, 256))
def test_fine_grained_pipeline_never_later_than_coarse(name, batch, s_prime):
    m = get_model(name)
    for l in (0, s_prime // 3, s_prime):
        fine = kvp.mha_pipeline(l, s_prime, m, A100, batch, fine_grained=True)
        coarse = kvp.mha_pipeline(l, s_prime, m, A100, batch, fine_grained=False)
        assert fine.mha_end <= coarse.mha_end + 1e-15
        assert fine.recompute_start <= coarse.recompute_start
    # with the best split the fine-grained pipeline is never worse than transferring everything (FlexGen)
    _, best = kvp.best_split_pipelined(s_prime, m, A100, batch, True)
    assert best.mha_end <= kvp.mha_pipeline(0, s_prime, m, A100, batch, True).mha_end


def test_fine_grained_hides_recompute_behind_weight_loading():
    # small cache (KVPR Table 2 regime): weights dominate; W_K/W_V first lets recompute overlap W_Q/W_O
    m = get_model("opt-6.7b")
    fine = kvp.mha_pipeline(64, 128, m, A100, 4, fine_grained=True)
    coarse = kvp.mha_pipeline(64, 128, m, A100, 4, fine_grained=False)
    assert fine.mha_end < coarse.mha_end
    ev = {e.name: e for e in fine.events}
    assert ev["recompute KV"].start == pytest.approx(ev["W_V"].end)
