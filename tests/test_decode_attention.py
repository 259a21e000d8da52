"""Live-page decode attention (``leankit.decode_attention``) against the padded-tile reference.

Both the torch path and the compiled CPU kernels (:mod:`leankit.native`) are checked.
The padded-tile walk of :func:`leankit.attention.paged_attention_ref` (forced with
``chunk_pages``) is the reference: it dequantizes every tile explicitly (Eq. 2). The live-page
path must give the same output, log-sum-exp and per-tier logits on hand-filled caches with
per-head tier mixes (ragged page counts), pruning, shuffled slots, scattered page ids and a
poisoned pool, for several bit widths, group sizes, GQA ratios and query counts.
"""

import pytest
import torch
from leankit_kernels import testing

from leankit import decode_attention, native
from leankit.attention import Workspace, paged_attention_ref

# spec, kv heads, GQA ratio, contexts, queries, group size, prune fraction, pool fill
CASES = [
    ("K8V4-K4V2", 3, 3, [65, 7], 1, 32, 0.1, 0xFF),
    ("K8V4-K4V2", 1, 7, [257], 1, None, 0.0, None),
    ("K4V2-K2V1", 5, 1, [63, 1, 20], 1, 16, 0.0, 0xFF),
    ("K8V4", 3, 3, [130, 1], 2, 16, 0.2, 0xFF),
    ("K4V2", 2, 5, [63], 3, 8, 0.0, None),
    ("K8V8-K2V2", 3, 2, [41, 77], 1, 32, 0.05, 0xFF),
]


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}g{c[2]}-ctx{'_'.join(map(str, c[3]))}-q{c[4]}")
def test_live_pages_match_padded_tiles(case, use_native):
    spec, hkv, g, ctx, nq, gs, prune, fill = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, nq, prune_frac=prune, group_size=gs, fill=fill,
                                          low_frac=0.6)
    assert decode_attention.supports(fc.kv.layouts, g * nq)
    fc.kv.workspace = Workspace()
    if len(ctx) > 1:
        q_pos[1] -= 3  # some stored keys lie after this row's queries
    ref_out, ref_lse, ref_logits = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=5, return_logits=True)
    for _ in range(2):  # the second call reuses the workspace buffers
        out, lse, logits = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125, return_logits=True,
                                                                use_native=use_native)
        testing.assert_close_normwise(out, ref_out, torch.float32, f"out (seed {seed})")
        testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")
        testing.assert_all_close_normwise(logits, ref_logits, torch.float32, f"logits (seed {seed})")


# Dense sides (the model dtype stored as it is) run on the compiled kernels only: spec, model dtype,
# kv heads, GQA ratio, contexts, queries, group size. The pool is poisoned (0xFF bytes: NaN in
# every dense format), so a dead slot read by mistake shows up.
DENSE_CASES = [
    ("FP16", torch.float32, 3, 3, [65, 7], 1, None),
    ("FP16", torch.float16, 2, 4, [130, 1, 33], 2, None),
    ("FP16", torch.bfloat16, 1, 7, [257], 1, None),
    ("K16V4-K4V1", torch.float32, 3, 2, [41, 77], 1, 32),
    ("K8V16-K4V2", torch.float16, 2, 3, [90, 12], 1, 16),
]


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-h{c[2]}g{c[3]}-q{c[5]}")
def test_dense_sides_on_the_compiled_kernels_match_padded_tiles(case):
    spec, dtype, hkv, g, ctx, nq, gs = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, nq, dtype=dtype, group_size=gs, fill=0xFF,
                                          low_frac=0.6)
    assert decode_attention.supports(fc.kv.layouts, g * nq, compiled=True)
    assert not decode_attention.supports(fc.kv.layouts, g * nq)  # the torch live path reads codes only
    fc.kv.workspace = Workspace()
    if len(ctx) > 1:
        q_pos[1] -= 3
    ref_out, ref_lse, ref_logits = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=5, return_logits=True)
    out, lse, logits = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125, return_logits=True)
    # both compute in fp32; the output is rounded to the model dtype
    testing.assert_close_normwise(out, ref_out, dtype, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")
    testing.assert_all_close_normwise(logits, ref_logits, torch.float32, f"logits (seed {seed})")


def test_query_that_sees_nothing_and_empty_tier():
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [40, 9], 3, 2, 1, low_frac=0.0)
    assert int(fc.kv.table.n_pages[1].sum()) == 0  # nothing in the low tier
    q_pos[1] = -1  # before every stored key
    out, lse, logits = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125, return_logits=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    assert logits[1].shape[-1] == 0
    ref_out, ref_lse = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=3)
    testing.assert_close_normwise(out, ref_out, torch.float32, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")


def test_chunks_of_pages_do_not_change_the_result(monkeypatch):
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [300, 111], 2, 3, 1, group_size=32)
    whole = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125)
    monkeypatch.setattr(decode_attention, "CHUNK_TOKENS", 40)  # a few pages per chunk
    chunked = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125)
    for a, b, what in zip(chunked, whole, ("out", "lse")):
        testing.assert_close_normwise(a, b, torch.float32, f"{what} (seed {seed})")


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("spec,gs,dtype", [("K8V4", None, torch.float32), ("K8V4-K4V2", 32, torch.float32),
                                           ("FP16", None, torch.bfloat16)])
def test_a_long_step_runs_on_the_compiled_kernels_in_query_chunks_that_fit(spec, gs, dtype, monkeypatch):
    """A step of far more than DECODE_ROWS query rows (a chunk of a long prompt scored through the
    cache) runs on the compiled live-page kernels, cut into query chunks whose scores fit
    LIVE_SCORE_BYTES, with the padded tiles' output and log-sum-exp; asked for its logits (which the
    padded tiles too hold whole), it runs whole, with the padded tiles' logits."""
    gen, seed = testing.fresh_generator()
    nq = int(torch.randint(30, 90, (), generator=gen))
    fc, q, q_pos = testing.attention_case(gen, spec, [int(torch.randint(100, 400, (), generator=gen)), 57], 3, 3,
                                          nq, dtype=dtype, group_size=gs, fill=0xFF, low_frac=0.6)
    fc.kv.workspace = Workspace()
    q_pos[1] -= 40  # the second row's queries see part of its keys
    calls = []
    real = decode_attention.live_page_attention
    monkeypatch.setattr(decode_attention, "live_page_attention", lambda q, *a, **k: calls.append(q.shape[2])
                        or real(q, *a, **k))
    ref_out, ref_lse, ref_logits = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=5, return_logits=True)
    assert calls == []  # forced padded tiles
    maxima = decode_attention.tier_page_maxima(fc.kv)
    slots = 2 * 3 * sum(p * lay.tokens for p, lay in zip(maxima, fc.kv.layouts))
    per_call = int(torch.randint(1, nq // 3, (), generator=gen))
    monkeypatch.setattr(decode_attention, "LIVE_SCORE_BYTES", per_call * 4 * 3 * slots)
    assert decode_attention.queries_per_call(fc.kv, maxima, 3) == per_call
    out, lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    assert calls == [per_call] * (nq // per_call) + ([nq % per_call] if nq % per_call else [])
    testing.assert_close_normwise(out, ref_out, dtype, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")
    calls.clear()
    # logits asked for are held whole on either path: one call, whatever the score budget
    out, lse, logits = paged_attention_ref(q, fc.kv, q_pos, 0.125, return_logits=True)
    assert calls == [nq]
    testing.assert_close_normwise(out, ref_out, dtype, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")
    testing.assert_all_close_normwise(logits, ref_logits, torch.float32, f"logits (seed {seed})")


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("spec,gs,dtype", [("K8V4-K4V2", 32, torch.float32), ("K8V4", None, torch.float32),
                                           ("FP16", None, torch.bfloat16)])
def test_a_long_step_in_query_chunks_gives_one_calls_output_and_received_mass(spec, gs, dtype):
    """:func:`leankit.attention.long_step_attention`: a long step cut into query chunks, each
    attending to the stored pages (its numerators kept) and to the step's own tokens, gives the
    output, log-sum-exp and received mass (stored slots and new tokens) of one whole call merged
    with the whole step's own attention (whose mass is the padded path's:
    ``test_live_slots_give_the_padded_received_mass``)."""
    from leankit.attention import long_step_attention, merge_attention, received_from_logits, step_attention

    gen, seed = testing.fresh_generator()
    nq, hkv, g = int(torch.randint(20, 60, (), generator=gen)), 2, 3
    fc, q, q_pos = testing.attention_case(gen, spec, [int(torch.randint(50, 200, (), generator=gen)), 31], hkv, g,
                                          nq, dtype=dtype, group_size=gs, fill=0xFF, low_frac=0.6)
    kv = fc.kv
    kv.workspace = Workspace()
    b, f = q.shape[0], q.shape[-1]
    k_new = torch.randn(b, hkv, nq, f, generator=gen).to(dtype)
    v_new = torch.randn(b, hkv, nq, f, generator=gen).to(dtype)
    real = torch.ones(b, nq, dtype=torch.bool)
    real[1, : int(torch.randint(1, nq // 2, (), generator=gen))] = False  # left padding in the step
    out_old, lse_old, live = decode_attention.live_page_attention(q.float(), kv, q_pos, 0.125, True, live_slots=True)
    out_new, lse_new, want_new = step_attention(q, k_new, v_new, q_pos, real, 0.125, lse_other=lse_old, received=True)
    want_out, want_lse = merge_attention(out_old, lse_old, out_new, lse_new)
    want_old = [t.received.clone() for t in received_from_logits(live, want_lse, g, real)]
    per_call = int(torch.randint(1, nq // 2, (), generator=gen))
    out, lse, got_old, got_new = long_step_attention(q, q, k_new, v_new, kv, q_pos, real, 0.125, per_call)
    testing.assert_close_normwise(out, want_out, torch.float32, f"out (seed {seed})")
    testing.assert_close_normwise(lse, want_lse, torch.float32, f"lse (seed {seed})")
    testing.assert_close_normwise(got_new, want_new, torch.float32, f"received by new tokens (seed {seed})")
    for tier, (t, w) in enumerate(zip(got_old, want_old, strict=True)):
        assert torch.equal(t.page_ids, live[tier].page_ids) and t.probs.shape[1] == 1
        testing.assert_close_normwise(t.received, w, torch.float32, f"received, tier {tier} (seed {seed})")


@pytest.mark.parametrize("spec,gs,rows,expected", [("K8V4-K4V2", None, 3, True), ("K8V4", 32, 64, True),
                                                    ("K8V4", 32, 65, False), ("K8V4-K4V2", 32, 4099, False),
                                                    ("K8V4", None, 1, False),
                                                    ("FP16", None, 1, False), ("K16V4-K4V1", None, 1, False)])
def test_supports(spec, gs, rows, expected):
    from leankit.config import KVConfig
    from leankit.pages import PageLayout

    cfg = KVConfig.parse(spec, group_size=gs)
    layouts = [PageLayout.build(cfg, t, 64, torch.float32) for t in range(len(cfg.tiers))]
    assert decode_attention.supports(layouts, rows) is expected
    # The compiled kernels also read dense sides of the dtypes they know, and any number of query
    # rows (the torch path at most DECODE_ROWS).
    assert decode_attention.supports(layouts, rows, compiled=True)
    wide = [PageLayout.build(cfg, t, 64, torch.float64) for t in range(len(cfg.tiers))]
    dense = any(b == 16 for t in cfg.tiers for b in (t.k_bits, t.v_bits))
    assert decode_attention.supports(wide, rows, compiled=True) is not dense
    if len(layouts) == 2 and layouts[0].groups == 1:  # an empty low tier leaves one one-group tier
        assert decode_attention.supports(layouts, rows, occupied=[True, False]) is False


@pytest.mark.parametrize("nq", [1, 2])
def test_live_slots_give_the_padded_received_mass(nq):
    """``live_slots=True`` hands back live pages only; the mass each slot received must equal the
    padded path's (:func:`received_from_logits` on the padded logits), slot for slot, and the pages'
    positions and stored scores must be those of the pool."""
    from leankit.attention import received_from_logits

    gen, seed = testing.fresh_generator()
    g = 3
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [65, 7, 40], 2, g, nq, prune_frac=0.1, group_size=32,
                                          low_frac=0.6)
    kv = fc.kv
    kv.workspace = Workspace()
    q_valid = torch.rand(3, nq, generator=gen) > 0.3
    q_valid[:, -1] = True
    out, lse, padded = decode_attention.live_page_attention(q, kv, q_pos, 0.125, return_logits=True)
    out2, lse2, live = decode_attention.live_page_attention(q, kv, q_pos, 0.125, return_logits=True, live_slots=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    want = received_from_logits(padded, lse, g, q_valid)
    got = received_from_logits(live, lse, g, q_valid)
    hkv = kv.table.shape[2]
    for tier, (w, t) in enumerate(zip(want, got)):
        pmax = int(kv.table.n_pages[tier, kv.layer].max())
        ids, valid = kv.table.tier_pages(tier, kv.layer, 0, pmax)
        assert t.page_ids.numel() == int(valid.sum()) > 0
        t_tok = kv.layouts[tier].tokens
        for i in range(t.page_ids.numel()):  # find each live page in the padded layout
            b, h = divmod(int(t.head[i]), hkv)
            rank = ((ids[b, h] == t.page_ids[i]) & valid[b, h]).nonzero()
            assert rank.numel() == 1
            r = int(rank)
            slots = slice(r * t_tok, (r + 1) * t_tok)
            ok = t.valid[i]
            torch.testing.assert_close(t.received[i][ok], w[b, h, slots][ok], rtol=1e-6, atol=1e-9,
                                       msg=f"received, tier {tier} (seed {seed})")
            seg = kv.pool.storage[t.page_ids[i]]
            lay = kv.layouts[tier]
            pos = seg[lay.offset("position"): lay.offset("position") + 4 * t_tok].view(torch.int32)
            score = seg[lay.offset("score"): lay.offset("score") + 2 * t_tok].view(torch.float16).float()
            assert torch.equal(t.pos[i][ok], pos[ok]) and torch.equal(t.score[i][ok], score[ok])


@pytest.mark.parametrize("rows", [1, 3, decode_attention.RECEIVED_MATMUL_ROWS - 1,
                                  decode_attention.RECEIVED_MATMUL_ROWS, 97])
def test_live_slots_received_is_the_row_weighted_sum_of_numerators(rows):
    """``LiveSlots.received`` on either side of its switch from a broadcast multiply to a batched
    matmul: each slot's mass is ``sum_r w[head, r] p[page, r, slot]`` (fp64 reference)."""
    gen, seed = testing.fresh_generator()
    n_pages, tokens, heads = int(torch.randint(1, 40, (), generator=gen)), 17, 5
    head = torch.randint(0, heads, (n_pages,), generator=gen)
    probs = torch.rand(n_pages, rows, tokens, generator=gen)
    probs[torch.rand(probs.shape, generator=gen) < 0.3] = 0.0  # dead slots and slots after the query
    weight = torch.rand(heads, rows, generator=gen)
    weight[:, torch.rand(rows, generator=gen) < 0.2] = 0.0  # rows that do not count
    slots = decode_attention.LiveSlots(
        page_ids=torch.arange(n_pages), head=head, probs=probs, shift=torch.zeros(heads, rows),
        valid=torch.ones(n_pages, tokens, dtype=torch.bool), pos=torch.zeros(n_pages, tokens, dtype=torch.int32),
        score=torch.zeros(n_pages, tokens), row_weight=weight)
    want = (probs.double() * weight.double()[head].unsqueeze(-1)).sum(1)
    got = slots.received
    assert got.shape == (n_pages, tokens) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")


def _padded_rank(kv, tier: int, page_id: int, head: int) -> int:
    """Rank of pool page ``page_id`` among the pages of flat head ``head`` in ``tier``."""
    hkv = kv.table.shape[2]
    pmax = int(kv.table.n_pages[tier, kv.layer].max())
    ids, valid = kv.table.tier_pages(tier, kv.layer, 0, pmax)
    b, h = divmod(head, hkv)
    rank = ((ids[b, h] == page_id) & valid[b, h]).nonzero()
    assert rank.numel() == 1
    return int(rank)


# spec, model dtype, kv heads, GQA ratio, contexts, group size
STEP_CASES = [
    ("K8V4-K4V2", torch.float32, 3, 3, [65, 7, 40], 32),
    ("K4V2", torch.float32, 2, 5, [63, 130], 8),
    ("FP16", torch.float32, 3, 3, [65, 7, 40], None),
    ("K8V4-K4V2", torch.float32, 1, 71, [50, 130], 32),  # one KV head for 71 query heads: more rows than 64
    ("K8V16-K4V2", torch.float16, 2, 3, [90, 12], 16),
]


def _decode_case(case):
    """A hand-filled cache of one of :data:`STEP_CASES` (fresh random data, a workspace) and a
    decode step over it whose last row's token is not real: ``(seed, kv, q, q_pos, real, k_new,
    v_new)``, the new keys and values fp32 ``[B, Hkv, 1, F]``."""
    spec, dtype, hkv, g, ctx, gs = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, 1, prune_frac=0.1 if gs else 0.0, group_size=gs,
                                          fill=0xFF, low_frac=0.6, dtype=dtype)
    fc.kv.workspace = Workspace()
    b, _, _, f = q.shape
    real = torch.ones(b, 1, dtype=torch.bool)
    real[-1] = False
    k_new = torch.randn(b, hkv, 1, f, generator=gen, dtype=torch.float32) * 2
    v_new = torch.randn(b, hkv, 1, f, generator=gen, dtype=torch.float32)
    return seed, fc.kv, q, q_pos, real, k_new, v_new


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-h{c[2]}g{c[3]}")
def test_decode_step_equals_paged_attention_merged_with_the_new_token(case):
    """:func:`decode_step_attention` (both passes, then the step's own token, the merge and the
    significance's row factors in one compiled call) against the torch composition it replaces:
    padded-tile paged attention, :func:`step_attention` over the new token with the other lse,
    :func:`merge_attention`, and :func:`received_from_logits` on the padded logits. One row sees
    no stored key (its query lies before all of them), one row's token is not real."""
    from leankit.attention import merge_attention, received_from_logits, step_attention

    seed, kv, q, q_pos, real, k_new, v_new = _decode_case(case)
    hkv, g = case[2], case[3]
    f = q.shape[-1]
    q_pos[1] = -1  # before every stored key: this row sees only its own token
    # Head 0's new key points away from its queries: its score lies some hundred below the stored
    # keys', so exp(stored - new) overflows fp32 unless the merge shifts by the larger of the two.
    k_new[0, 0, 0] = -100 * q[0, :g, 0].float().mean(0)
    scale = f ** -0.5
    assert decode_attention.serves_decode_step(kv, g, q.device)

    out_old, lse_old, padded = paged_attention_ref(q.float(), kv, q_pos, scale, chunk_pages=3, return_logits=True)
    out_new, lse_new, recv_new = step_attention(q.float(), k_new, v_new, q_pos, real, scale, lse_other=lse_old,
                                                received=True)
    want_out, want_lse = merge_attention(out_old, lse_old, out_new, lse_new)
    want_recv = received_from_logits(padded, want_lse, g, real)

    for _ in range(2):  # the second call reuses the workspace buffers
        out, lse, live, recv = decode_attention.decode_step_attention(q, kv, q_pos, scale, k_new, v_new, real,
                                                                      significance=True)
        testing.assert_close_normwise(out, want_out, torch.float32, f"out (seed {seed})")
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, msg=f"lse (seed {seed})")
        torch.testing.assert_close(recv, recv_new, rtol=1e-5, atol=1e-7, msg=f"new token's mass (seed {seed})")
        assert torch.equal(recv[-1], torch.zeros_like(recv[-1]))  # not real: received nothing
        for tier, t in enumerate(live):
            t_tok = kv.layouts[tier].tokens
            for i in range(t.page_ids.numel()):
                head = int(t.head[i])
                r = _padded_rank(kv, tier, int(t.page_ids[i]), head)
                ok = t.valid[i]
                got = t.received[i][ok]
                expect = want_recv[tier][head // hkv, head % hkv, r * t_tok: (r + 1) * t_tok][ok]
                torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-8,
                                           msg=f"received, tier {tier} (seed {seed})")
    # Without significance: the same attention, nothing else.
    out2, _, live2, recv2 = decode_attention.decode_step_attention(q, kv, q_pos, scale, k_new, v_new, real)
    assert live2 is None and recv2 is None
    testing.assert_close_normwise(out2, want_out, torch.float32, f"out (seed {seed})")


def test_decode_step_refuses_several_queries():
    gen, _ = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4", [20], 1, 2, 2)
    k_new = torch.zeros(1, 1, 2, q.shape[-1])
    with pytest.raises(ValueError, match="one query per sequence"):
        decode_attention.decode_step_attention(q, fc.kv, q_pos, 0.1, k_new, k_new, torch.ones(1, 2, dtype=torch.bool))


def test_decode_step_without_compiled_kernels_says_so(monkeypatch):
    gen, _ = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4", [20], 1, 2, 1)
    monkeypatch.setattr(native, "kernels_for", lambda device: None)
    assert not decode_attention.serves_decode_step(fc.kv, 2, q.device)
    k_new = torch.zeros(1, 1, 1, q.shape[-1])
    with pytest.raises(RuntimeError, match="compiled CPU kernels"):
        decode_attention.decode_step_attention(q, fc.kv, q_pos, 0.1, k_new, k_new, torch.ones(1, 1, dtype=torch.bool))


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-h{c[2]}g{c[3]}")
def test_decode_step_updates_the_running_significance_as_the_live_slots_do(case):
    """``update_significance``: the stored tokens' running significance updated inside the decode
    call writes the pool the policy's update writes from the returned live slots
    (:meth:`leankit.native.Kernels.update_scores`, a decode step's one query being its first and
    last), byte for byte, with the same attention; a row whose token is not real keeps its scores."""
    seed, kv, q, q_pos, real, k_new, v_new = _decode_case(case)
    scale = q.shape[-1] ** -0.5
    before = kv.pool.storage.clone()
    out, lse, live, recv = decode_attention.decode_step_attention(q, kv, q_pos, scale, k_new, v_new, real,
                                                                  significance=True)
    assert torch.equal(kv.pool.storage, before)  # without the update the pool is only read
    flat_pos = q_pos.reshape(-1).long()
    for t in live:
        if t.page_ids.numel():
            native.kernels().update_scores(t.pages, t.probs, t.row_weight, t.pos, t.valid, t.score, flat_pos,
                                           flat_pos, real.reshape(-1))
    want = kv.pool.storage.clone()
    kv.pool.storage.copy_(before)
    out2, lse2, live2, recv2 = decode_attention.decode_step_attention(q, kv, q_pos, scale, k_new, v_new, real,
                                                                      significance=True, update_significance=True)
    assert live2 is None
    assert torch.equal(out2, out) and torch.equal(lse2, lse) and torch.equal(recv2, recv), f"seed {seed}"
    assert torch.equal(kv.pool.storage, want), f"seed {seed}"
    assert not torch.equal(want, before)  # the update wrote something


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
@pytest.mark.parametrize("where", ["query", "key"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_decode_step_refuses_a_non_finite_query_or_key_before_it_updates_significance(where, bad):
    """With ``update_significance`` the call writes the stored tokens' significance, which a NaN/Inf
    query or own key would poison for good: it is refused before anything is written (the pool byte
    for byte as it was), whichever element of one row holds it. Without the update the pool is only
    read, and nothing is checked."""
    from leankit.quant import NonFiniteKVError

    seed, kv, q, q_pos, real, k_new, v_new = _decode_case(STEP_CASES[-1])
    gen = torch.Generator().manual_seed(seed)
    scale = q.shape[-1] ** -0.5
    poisoned = (q if where == "query" else k_new).clone()
    flat = poisoned.view(-1)
    flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = bad
    args = (poisoned, k_new) if where == "query" else (q, poisoned)
    before = kv.pool.storage.clone()
    with pytest.raises(NonFiniteKVError, match="query or key states contain NaN or Inf"):
        decode_attention.decode_step_attention(args[0], kv, q_pos, scale, args[1], v_new, real, significance=True,
                                               update_significance=True)
    assert torch.equal(kv.pool.storage, before), f"seed {seed}"
    decode_attention.decode_step_attention(args[0], kv, q_pos, scale, args[1], v_new, real, significance=True)
    assert torch.equal(kv.pool.storage, before), f"seed {seed}"


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler for leankit.native")
def test_decode_step_arguments_follow_a_replaced_page_table():
    """The per-layer kernel arguments memoized in the workspace are rebuilt when the page table's
    tensors are replaced (sequences reordered): the result is a fresh workspace's."""
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [40, 65, 7], 3, 3, 1, group_size=32, low_frac=0.6)
    kv = fc.kv
    kv.workspace = Workspace()
    b, _, _, f = q.shape
    real = torch.ones(b, 1, dtype=torch.bool)
    k_new, v_new = torch.randn(b, 3, 1, f, generator=gen), torch.randn(b, 3, 1, f, generator=gen)
    decode_attention.decode_step_attention(q, kv, q_pos, 0.125, k_new, v_new, real)
    order = torch.tensor([2, 0, 1])
    kv.table.select_sequences(order)
    got, lse, _, _ = decode_attention.decode_step_attention(q, kv, q_pos, 0.125, k_new, v_new, real)
    kv.workspace = Workspace()
    want, want_lse, _, _ = decode_attention.decode_step_attention(q, kv, q_pos, 0.125, k_new, v_new, real)
    assert torch.equal(got, want) and torch.equal(lse, want_lse), f"seed {seed}"
