"""Split-K paged decode attention, fused score update and received attention vs leankit's references.

Runs under Triton's CPU interpreter on hand-filled caches (``BidirectionalPageTable.grow`` +
``PagePool.write_rows``): per-head tier mixes, pruning, shuffled slots, scattered page ids and a
poisoned pool (dead slots are NaN / position -1). Kernel outputs and scratch start as NaN.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels import testing
from leankit_kernels.paged_attention import paged_attention, received_attention, score_update_ref
from leankit_kernels.prefill_attention import prefill_attention

from leankit.attention import paged_attention_ref, received_attention_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
_poison = pytest.fixture(autouse=True)(testing.poison_outputs)


# spec, dtype, kv heads, GQA ratio, context per sequence, splits, group size, prune fraction, pool fill
DECODE_CASES = [
    ("K8V4-K4V2", F32, 3, 3, [65, 7], None, None, 0.1, 0xFF),
    ("K8V4-K4V2", F16, 1, 7, [257], 3, None, 0.2, 0xFF),
    ("K4V2-K2V1", F32, 5, 1, [63, 1, 20], 2, 16, 0.0, None),
    ("K8V4-K4V2", F32, 3, 7, [1, 7], 1, None, 0.0, 0xFF),
    ("FP16", F32, 3, 3, [7, 65], 1, None, 0.0, 0xFF),
    ("FP16", F16, 3, 1, [63], 2, None, 0.3, 0xFF),
    ("K8V8", F32, 1, 3, [257], 5, None, 0.0, 0xFF),
    ("K8V4", F16, 3, 7, [65, 1], 1, None, 0.1, None),
    ("K4V2", F32, 5, 3, [63], 2, 32, 0.0, 0xFF),
    ("K16V4-K4V1", F32, 3, 3, [65], 2, None, 0.0, 0xFF),
    ("K8V4-K4V2", BF16, 3, 3, [65, 7], 2, None, 0.1, 0xFF),
    ("K4V2-K2V1", F16, 3, 3, [65, 7], 2, None, 0.1, 0xFF),  # fp16 word-level unpack of 2-bit keys
    ("K4V2", F16, 3, 3, [130, 20], 3, None, 0.1, 0xFF),  # values in permuted columns, through the partials
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{testing.case_id(*c[:5])}-s{c[5]}")
def test_decode_matches_reference(case):
    spec, dtype, hkv, g, ctx, splits, gs, prune, fill = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, 1, dtype=dtype, prune_frac=prune,
                                          group_size=gs, fill=fill)
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=splits)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")


@pytest.mark.parametrize("spec", ["K8V8", "K8V4", "K8V4-K4V2"])
def test_fp16_decode_keeps_small_values_out_of_subnormals(spec):
    """fp16 operands, values near 1e-3: the ``p s`` operand (probability times the value scale) is
    lifted by a power of two before its fp16 MMA, so its products do not round to fp16's absolute
    subnormal grid (K8V8 erred 9x the fp16 tolerance without the lift)."""
    gen, seed = testing.fresh_generator()
    fc = testing.build_paged_kv(spec, 2, 2, 64, torch.tensor([200, 37]), dtype=F16, generator=gen, scale_v=1e-3)
    q, q_pos = testing.random_queries(2, 8, 1, 64, fc.ctx, dtype=F16, generator=gen)
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=2)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")


@pytest.mark.parametrize("spec", ["K2V2", "K4V2-K2V1", "K4V2"])
def test_fp16_decode_keeps_small_queries_out_of_subnormals(spec):
    """fp16 operands, queries near 1e-4 against keys near 5e3 (logits of the usual size): the query
    operand of 2- and 4-bit keys is divided by up to 2^8 to meet the codes' column scales, which put
    it among fp16's subnormals (absolute rounding: K2V2 erred 6x the fp16 tolerance) unless it is
    lifted by a power of two first."""
    gen, seed = testing.fresh_generator()
    fc = testing.build_paged_kv(spec, 2, 2, 64, torch.tensor([40, 17]), dtype=F16, generator=gen, scale_k=5e3)
    q, q_pos = testing.random_queries(2, 6, 1, 64, fc.ctx, dtype=F16, generator=gen)
    q = (q.float() * 1e-4).to(F16)
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=2)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")


def test_decode_query_that_sees_nothing_and_empty_cache():
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [40, 9], 3, 2, 1)
    q_pos[1] = -1  # before every stored key
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")
    empty = testing.build_paged_kv("K8V4", 2, 3, 64, torch.tensor([0, 0]), generator=gen)
    out, lse = paged_attention(q, empty.kv, q_pos, 0.125)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


@pytest.mark.parametrize("spec,g,ctx,splits", [("K8V4-K4V2", 3, [65, 33], None), ("K4V2", 7, [63], 3),
                                               ("K8V4-K4V2", 1, [257, 7, 1], 1)])
def test_fused_score_update_matches_reference(spec, g, ctx, splits):
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, 3, g, 1, prune_frac=0.1)
    if len(ctx) > 1:
        q_pos[1] -= 4  # some stored keys lie in this query's future: they must keep their score
    q_valid = torch.ones(len(ctx), 1, dtype=torch.bool)
    q_valid[-1] = len(ctx) < 3  # a finished row updates nothing
    before = fc.kv.pool.storage.clone()
    _, ref_lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    score_update_ref(q, fc.kv, q_pos, 0.125, ref_lse, q_valid)
    expected = fc.kv.pool.storage.clone()
    fc.kv.pool.storage.copy_(before)
    paged_attention(q, fc.kv, q_pos, 0.125, update_scores=True, q_valid=q_valid, num_splits=splits)
    got = fc.kv.pool.storage
    assert (got != before).any(), "no score was updated"
    for tier, lay in enumerate(fc.kv.layouts):
        ids, valid = fc.kv.table.tier_pages(tier, fc.kv.layer)
        ids = ids[valid].unique()
        off = lay.offset("score")
        a = got[ids.long(), off: off + 2 * lay.tokens].contiguous().view(torch.float16).float()
        e = expected[ids.long(), off: off + 2 * lay.tokens].contiguous().view(torch.float16).float()
        live = torch.isfinite(e)
        # fp16 storage: the kernel's p_bar differs from the reference in the last fp32 bits, which
        # can flip one fp16 rounding (2^-11 relative): the fp16 tolerance covers it.
        assert torch.equal(live, torch.isfinite(a)), f"seed {seed}"
        torch.testing.assert_close(a[live], e[live], rtol=2e-3, atol=1e-7, msg=f"seed {seed}")
    # Only score segments may change: everything else byte for byte.
    scores = torch.zeros_like(got, dtype=torch.bool)
    for lay in fc.kv.layouts:
        off = lay.offset("score")
        scores[:, off: off + 2 * lay.tokens] = True
    assert torch.equal(got[~scores], before[~scores]), f"non-score bytes changed (seed {seed})"


@pytest.mark.parametrize("spec,dtype,g,ctx", [("K8V4-K4V2", F32, 3, [65, 7]), ("FP16", F16, 7, [63]),
                                              ("K4V2", F32, 1, [257])])
def test_received_attention_decode_matches_reference(spec, dtype, g, ctx):
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, 3, g, 1, dtype=dtype, prune_frac=0.1)
    _, lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    got = received_attention(q, fc.kv, q_pos, 0.125, lse)
    ref = received_attention_ref(q, fc.kv, q_pos, 0.125, lse)
    testing.assert_all_close_normwise(got, ref, dtype, f"received (seed {seed})")


@pytest.mark.parametrize("gs,low_gs", [(None, 32), (32, 16), (16, 64)])
def test_tiers_with_their_own_group_size(gs, low_gs):
    """High and low pages quantized at different group sizes (``low_group_size``): decode, the fused
    score update and received attention each read a tier's metadata with that tier's group count."""
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [65, 20], 3, 3, 1, prune_frac=0.1, group_size=gs,
                                          low_group_size=low_gs)
    assert fc.kv.layouts[0].groups != fc.kv.layouts[1].groups
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=2)
    ref_lse = testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")
    got = received_attention(q, fc.kv, q_pos, 0.125, ref_lse)
    ref = received_attention_ref(q, fc.kv, q_pos, 0.125, ref_lse)
    testing.assert_all_close_normwise(got, ref, F32, f"received (seed {seed})")


def test_multi_query_routes_to_prefill():
    fc, q, q_pos = testing.attention_case(testing.fresh_generator()[0], "K8V4-K4V2", [20], 3, 3, 5)
    a = paged_attention(q, fc.kv, q_pos, 0.125)
    b = prefill_attention(q, fc.kv, q_pos, 0.125)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError):
        paged_attention(q, fc.kv, q_pos, 0.125, update_scores=True)


def _score_bytes(kv):
    """Mask of every byte of the pool that lies in a score segment."""
    storage = kv.pool.storage
    mask = torch.zeros_like(storage, dtype=torch.bool)
    for lay in kv.layouts:
        off = lay.offset("score")
        mask[:, off: off + 2 * lay.tokens] = True
    return mask


@pytest.mark.parametrize("spec,g,ctx", [("K8V4-K4V2", 3, [65, 20]), ("K4V2", 2, [41])])
def test_saved_logits_score_update_with_caller_lse(spec, g, ctx):
    """``save_logits=True`` + :func:`apply_score_update` with an lse the caller changed (as when it
    merges extra keys into the softmax) equals the reference update with that lse; the decode call
    itself leaves every byte alone."""
    from leankit_kernels.paged_attention import apply_score_update

    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, 3, g, 1, prune_frac=0.1)
    q_valid = torch.ones(len(ctx), 1, dtype=torch.bool)
    before = fc.kv.pool.storage.clone()
    out, lse, saved = paged_attention(q, fc.kv, q_pos, 0.125, save_logits=True, num_splits=2)
    assert torch.equal(fc.kv.pool.storage, before), "save_logits alone must not write the pool"
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")
    extra = torch.rand(lse.shape, generator=gen) * 2.0  # log-mass of keys merged in by the caller
    merged = torch.logaddexp(lse, extra)
    score_update_ref(q, fc.kv, q_pos, 0.125, merged, q_valid)
    expected = fc.kv.pool.storage.clone()
    fc.kv.pool.storage.copy_(before)
    apply_score_update(fc.kv, saved, merged, q_pos, q_valid)
    got = fc.kv.pool.storage
    sc = _score_bytes(fc.kv)
    assert torch.equal(got[~sc], before[~sc]), f"non-score bytes changed (seed {seed})"
    for tier, lay in enumerate(fc.kv.layouts):
        ids, valid = fc.kv.table.tier_pages(tier, fc.kv.layer)
        ids = ids[valid].unique().long()
        off = lay.offset("score")
        ga = got[ids, off: off + 2 * lay.tokens].contiguous().view(torch.float16).float()
        ea = expected[ids, off: off + 2 * lay.tokens].contiguous().view(torch.float16).float()
        live = torch.isfinite(ea)
        assert torch.equal(live, torch.isfinite(ga)), f"seed {seed}"
        torch.testing.assert_close(ga[live], ea[live], rtol=2e-3, atol=1e-7, msg=f"seed {seed}")
    assert not torch.equal(got, before), "no score was updated"
    with pytest.raises(ValueError, match="lse has shape"):
        apply_score_update(fc.kv, saved, merged[:, :1], q_pos, q_valid)


def test_save_logits_is_decode_only():
    fc, q, q_pos = testing.attention_case(testing.fresh_generator()[0], "K8V4", [20], 3, 3, 4)
    with pytest.raises(ValueError, match="decode"):
        paged_attention(q, fc.kv, q_pos, 0.125, save_logits=True)


@pytest.mark.parametrize("spec,dtype,page_size", [("K4V2", F16, 8192), ("K8V4-K4V2", F32, 4096)])
def test_decode_page_tiles_whole_and_partial(spec, dtype, page_size):
    """Tiles of several whole pages, and pages longer than the largest tile (read in slot runs):
    the decode output and lse match the reference."""
    from leankit_kernels.paged_attention import DECODE_MAX_ROWS, decode_tile_rows

    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, [301, 40], 3, 3, 1, dtype=dtype, prune_frac=0.1,
                                          page_size=page_size)
    assert any(lay.tokens > DECODE_MAX_ROWS for lay in fc.kv.layouts) or \
        any(decode_tile_rows(lay.tokens) // lay.tokens > 1 for lay in fc.kv.layouts)
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=2)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")


@pytest.mark.parametrize("spec", ["FP16", "K8V4-K4V2", "K8V4"])
def test_fp32_gpu_tiles_match_reference(spec, monkeypatch):
    """The decode tiles an fp32 model gets on a GPU (at most FP32_DECODE_ROWS slots, fewer than a
    page holds, so pages are read in slot runs), walked by the interpreter: output and lse match
    the reference."""
    import leankit_kernels.paged_attention as pa

    tiling = pa.decode_tiling
    monkeypatch.setattr(pa, "decode_tiling", lambda targs, dot_bytes=2, gpu=False: tiling(targs, dot_bytes, gpu=True))
    monkeypatch.setattr(pa, "_DECODE_PLANS", {})
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, [97, 30], 3, 3, 1, dtype=F32, prune_frac=0.1, page_size=16384)
    plan = pa.decode_tiling(pa.tiles.tier_args(fc.kv.layouts), 4)
    assert max(plan.values()) == pa.FP32_DECODE_ROWS < max(lay.tokens for lay in fc.kv.layouts), plan
    out, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=2)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")


def test_split_sizing_by_occupancy_and_per_head_work():
    """Residency from registers (allocated per warp in units of 8 per thread), and splits sized by the
    pages of all heads: one long head among short ones is split finer than when every head is
    assumed as long as the longest; uniform heads split the same either way."""
    from leankit_kernels.paged_attention import choose_splits, resident_programs

    assert resident_programs(128, 0, 4) == 4 and resident_programs(121, 0, 4) == 4
    assert resident_programs(168, 0, 4) == 3 and resident_programs(255, 0, 4) == 2
    assert resident_programs(64, 60_000, 4, sm_shared=228 * 1024) == 3  # shared memory binds first
    g, f, ps, sms = 4, 128, 4096, 132
    uniform = choose_splits(8, 1000, g, f, ps, sms, total_pages=8 * 1000, resident=2)
    assert uniform == choose_splits(8, 1000, g, f, ps, sms, resident=2)
    skewed = choose_splits(8, 20000, g, f, ps, sms, total_pages=20000 + 7 * 100, resident=2)
    longest = choose_splits(8, 20000, g, f, ps, sms, resident=2)
    assert skewed > 4 * longest
    # the programs that find pages (pages per split = ceil(20000 / splits)) fit the resident slots
    pps = -(-20000 // skewed)
    busy = -(-20000 // pps) + 7 * -(-100 // pps)
    assert 2 * sms * 0.8 <= busy <= 2 * sms, busy
    # short contexts: a split never reads fewer pages than the partials' traffic bound allows
    assert -(-1000 // choose_splits(8, 1000, g, f, ps, sms, 1070, resident=2)) >= 16
    # more resident programs per SM, more splits; the partials' traffic bound still holds
    assert choose_splits(8, 1000, g, f, ps, sms, 8 * 1000, resident=4) >= uniform
    assert choose_splits(1, 3, g, f, ps, sms, 3, resident=4) <= 3
    assert choose_splits(2, 40, g, f, ps, None) == 2 and choose_splits(2, 9, g, f, ps, None) == 1


@pytest.mark.parametrize("seed", range(4))
def test_splits_never_spill_a_few_programs_into_another_wave(seed):
    """A launch whose programs overflow the resident slots by a few runs a nearly empty second wave
    (on an H100, d64 x 96 heads x 16k: 5 splits = 480 programs for 396 slots took 1.43x as long
    as 4 splits = 384). The split count is the least modelled time ``waves x (pages per split +
    overhead)`` (the fewest splits among equals) over every count the traffic bound allows whose
    launch takes at most four waves more than one split per head (checked against all of them, on
    random layer shapes), and for heads of equal length it is the most splits of that many
    waves."""
    import random

    from leankit_kernels.paged_attention import SPLIT_BYTES_RATIO, choose_splits, split_time

    rng = random.Random(seed)
    for _ in range(200):
        bh, max_pages = rng.randint(1, 600), rng.randint(1, 5000)
        g, f, ps, sms, res = rng.choice([1, 3, 4, 8]), rng.choice([64, 128]), rng.choice([2048, 4096]), 132, rng.randint(1, 8)
        total = rng.choice([None, rng.randint(max_pages, bh * max_pages)])
        s = choose_splits(bh, max_pages, g, f, ps, sms, total, res)
        work = total if total is not None else bh * max_pages
        min_pages = max(1, -(-SPLIT_BYTES_RATIO * 8 * g * (f + 2) // ps))
        cap = max(1, -(-max_pages // min_pages))
        assert 1 <= s <= cap
        slots = res * sms
        w0 = -(-split_time(bh, max_pages, work, slots, 1)[1] // slots)
        # every split count whose launch takes at most four waves more than one split per head's
        shortlist = {k: split_time(bh, max_pages, work, slots, k) for k in range(1, cap + 1)}
        shortlist = {k: t for k, (t, busy) in shortlist.items() if -(-busy // slots) <= w0 + 4}
        best = min(shortlist.values())
        assert shortlist[s] == best and s == min(k for k, t in shortlist.items() if t == best), \
            (bh, max_pages, g, f, ps, res, total, s, shortlist[s], best)
        pps = -(-max_pages // s)
        if total is None and pps > 1:  # equal heads: no split count of as many waves has shorter programs
            shorter = -(-max_pages // (pps - 1))  # the fewest splits with fewer pages each
            assert shorter > cap or bh * shorter > -(-bh * s // slots) * slots, (bh, max_pages, s, slots)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_output_in_fp32_for_a_16bit_query(splits):
    """``out_dtype=torch.float32`` (a rotated cache's output, rotated back in fp32): the decode
    kernel or the split reduce writes fp32, which rounds to the 16-bit output bit for bit and
    matches the fp32 reference more closely in norm (the reference of the fp16 query computed in
    fp32: a reference rounded to fp16 itself favours the rounded output). The final rounding adds
    an error independent of the kernel's own (its fp16 probabilities and dequantized K/V), so the
    norm of the error grows: over 320 random cases the norm ratio wide/narrow never passed 1 (at
    most 0.885 in the 120 where it was recorded). The largest single element's error can go either
    way (seed 739255795 at both split counts, none of the 320), which is why the check is
    normwise. lse is the same either way. Prefill refuses it."""
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [65, 20], 3, 3, 1, dtype=F16, prune_frac=0.1)
    narrow, lse = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=splits)
    wide, lse2 = paged_attention(q, fc.kv, q_pos, 0.125, num_splits=splits, out_dtype=F32)
    assert narrow.dtype == F16 and wide.dtype == F32
    assert torch.equal(wide.to(F16), narrow) and torch.equal(lse, lse2), f"seed {seed}"
    ref_out, _ = paged_attention_ref(q.float(), fc.kv, q_pos, 0.125)
    testing.assert_close_normwise(wide, ref_out, F16, f"out (seed {seed})")
    assert (wide - ref_out).norm() < (narrow.float() - ref_out).norm(), f"seed {seed}"
    q4 = torch.cat([q] * 4, dim=2)
    with pytest.raises(ValueError, match="decode"):
        paged_attention(q4, fc.kv, q_pos.expand(-1, 4), 0.125, out_dtype=F32)


def _own_token_reference(q, kv, q_pos, scale, k_new, v_new, real):
    """The torch composition a decode step runs without the fused own token: paged attention over
    the earlier tokens, the step's exact attention to its own key, merged by log-sum-exp."""
    from leankit.attention import merge_attention, step_attention

    out_old, lse_old = paged_attention_ref(q.float(), kv, q_pos, scale)
    out_new, lse_new, recv = step_attention(q, k_new, v_new, q_pos, real, scale, lse_other=lse_old, received=True)
    out, lse = merge_attention(out_old, lse_old, out_new, lse_new)
    return out, lse, recv


# spec, dtype, kv heads, GQA ratio, context per sequence, splits, prune fraction
OWN_TOKEN_CASES = [
    ("K8V4", F16, 3, 3, [65, 7], 1, 0.0),
    ("K8V4", F32, 2, 7, [130, 1, 33], 3, 0.1),
    ("K8V4-K4V2", F32, 3, 3, [65, 7], None, 0.1),
    ("K4V2", F16, 1, 5, [257], 4, 0.2),
    ("FP16", F16, 3, 1, [63, 20], 2, 0.0),
    ("K8V4-K4V2", BF16, 2, 3, [40, 9], 1, 0.1),
]


@pytest.mark.parametrize("case", OWN_TOKEN_CASES, ids=lambda c: f"{testing.case_id(*c[:5])}-s{c[5]}")
def test_decode_step_attention_folds_the_own_token_into_the_launch(case):
    """:func:`decode_step_attention` (the own token merged by the decode kernel or the split reduce)
    equals the torch composition it replaces and the two-launch kernel path (paged attention, then
    :func:`merge_own_token`), for one split and several, with pad rows (no significance) and a row
    whose query sees no stored key; its lse drives the same score update."""
    from leankit_kernels.own_token import merge_own_token
    from leankit_kernels.paged_attention import apply_score_update, decode_step_attention

    spec, dtype, hkv, g, ctx, splits, prune = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, 1, dtype=dtype, prune_frac=prune)
    b, f = len(ctx), q.shape[-1]
    q_pos[-1] = -1  # the last row sees no stored key: its own token alone
    k_new = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2)  # a model's head views
    v_new = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2)
    real = torch.rand(b, 1, generator=gen) < 0.7
    real[0] = True
    before = fc.kv.pool.storage.clone()
    out, lse, saved, recv = decode_step_attention(q, fc.kv, q_pos, 0.125, k_new, v_new, real, significance=True,
                                                  num_splits=splits, out_dtype=F32)
    assert torch.equal(fc.kv.pool.storage, before), "the decode launch must not write the pool"
    ref_out, ref_lse, ref_recv = _own_token_reference(q, fc.kv, q_pos, 0.125, k_new, v_new, real)
    msg = f"(seed {seed})"
    assert out.shape == ref_out.shape and out.dtype == F32 and recv.shape == ref_recv.shape
    testing.assert_close_normwise(out, ref_out, dtype, "out " + msg)
    testing.assert_close_normwise(lse, ref_lse, dtype, "lse " + msg)
    testing.assert_close_normwise(recv, ref_recv, dtype, "received " + msg)
    assert torch.isfinite(lse).all() and torch.equal(recv[~real.view(-1)], torch.zeros_like(recv[~real.view(-1)]))
    # the same numbers as the two-launch path (paged attention, then the merge kernel)
    old_out, old_lse, old_saved = paged_attention(q, fc.kv, q_pos, 0.125, save_logits=True, num_splits=splits,
                                                  out_dtype=F32)
    two_out, two_lse, two_recv = merge_own_token(q, k_new, v_new, old_out, old_lse, real, 0.125, received=True)
    torch.testing.assert_close(out, two_out, rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(lse, two_lse, rtol=1e-5, atol=1e-6, msg=msg)
    torch.testing.assert_close(recv, two_recv, rtol=1e-5, atol=1e-7, msg=msg)
    # in the model's dtype: the fp32 result rounded once
    narrow, lse2, _, recv2 = decode_step_attention(q, fc.kv, q_pos, 0.125, k_new, v_new, real, num_splits=splits)
    assert narrow.dtype == dtype and recv2 is None and torch.equal(lse2, lse)
    if dtype != BF16:  # the interpreter truncates to bf16 where a GPU rounds to nearest
        assert torch.equal(narrow, out.to(dtype)), msg
    # the saved logits with this lse update the scores as the reference update does
    apply_score_update(fc.kv, saved, lse, q_pos, real)
    got = fc.kv.pool.storage.clone()
    fc.kv.pool.storage.copy_(before)
    apply_score_update(fc.kv, old_saved, two_lse, q_pos, real)
    torch.testing.assert_close(got.view(torch.float16).float(), fc.kv.pool.storage.view(torch.float16).float(),
                               rtol=2e-3, atol=1e-7, equal_nan=True, msg=msg)


def test_decode_step_attention_over_an_empty_cache_and_bad_shapes():
    """No page to read: the output is the own token's value, its probability 1; a step with two
    tokens per row, or new K/V of another shape, is refused."""
    from leankit_kernels.paged_attention import decode_step_attention

    gen, seed = testing.fresh_generator()
    q = torch.randn(2, 6, 1, 64, generator=gen)
    empty = testing.build_paged_kv("K8V4", 2, 3, 64, torch.tensor([0, 0]), generator=gen)
    k_new, v_new = torch.randn(2, 3, 1, 64, generator=gen), torch.randn(2, 3, 1, 64, generator=gen)
    real = torch.tensor([[True], [False]])
    q_pos = torch.tensor([[4], [9]])
    out, lse, saved, recv = decode_step_attention(q, empty.kv, q_pos, 0.125, k_new, v_new, real, significance=True)
    expect = v_new.transpose(1, 2).repeat_interleave(2, dim=2)  # [B, 1, Hq, F]: each head's group shares v
    torch.testing.assert_close(out, expect, msg=f"seed {seed}")
    torch.testing.assert_close(recv.view(-1), torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), msg=f"seed {seed}")
    assert saved is None and torch.isfinite(lse).all()
    with pytest.raises(ValueError, match="one query and one new token"):
        decode_step_attention(torch.cat([q, q], 2), empty.kv, q_pos, 0.125, k_new, v_new, real)
    with pytest.raises(ValueError, match="one query and one new token"):
        decode_step_attention(q, empty.kv, q_pos, 0.125, k_new[:, :2], v_new, real)


@pytest.mark.parametrize("shape,why", [((2, 4, 1, 32), "head_dim=64"), ((2, 5, 1, 64), "multiple of the 2 KV"),
                                       ((3, 4, 1, 64), "batch=2"), ((2, 1, 1, 64), "multiple of the 2 KV")])
def test_a_query_the_pages_cannot_serve_raises_before_any_launch(shape, why):
    """The kernels index pages and output by the layer's shapes: a query that does not match would
    read or write out of bounds, so the launchers refuse it first (host shapes only)."""
    gen, _ = testing.fresh_generator()
    fc = testing.build_paged_kv("K8V4", 2, 2, 64, torch.tensor([20, 9]), generator=gen)
    q = torch.randn(*shape, generator=gen)
    q_pos = torch.full(shape[:1] + (1,), 8)
    with pytest.raises(ValueError, match=why):
        paged_attention(q, fc.kv, q_pos, 0.1, num_splits=1)
    with pytest.raises(ValueError, match=why):
        prefill_attention(q, fc.kv, q_pos, 0.1)
