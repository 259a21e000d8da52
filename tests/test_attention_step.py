"""The step's own tokens: exact attention, log-sum-exp merge and prompt significance vs brute force."""

import pytest
import torch

from leankit.attention import merge_attention, step_attention, step_received


def _case(seed, b=3, hq=6, hkv=2, q=11, f=16):
    g = torch.Generator().manual_seed(seed)
    real = torch.ones(b, q, dtype=torch.bool)
    real[1, :4] = False  # left padding
    real[2, :1] = False
    pos = (real.long().cumsum(1) - 1).clamp_min(0)
    return (torch.randn(b, hq, q, f, generator=g) * 2, torch.randn(b, hkv, q, f, generator=g),
            torch.randn(b, hkv, q, f, generator=g), pos, real)


def _brute(q, k, v, pos, real, scale, extra_k=None, extra_v=None):
    """Per (row, query head, query): softmax over visible new keys (+ always-visible extra keys)."""
    b, hq, nq, f = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(b, nq, hq, f, dtype=torch.float64)
    probs = torch.zeros(b, hq, nq, nq, dtype=torch.float64)  # over the new keys only
    for bi in range(b):
        for h in range(hq):
            kv_h = h // g
            for i in range(nq):
                vis = real[bi] & (pos[bi] <= pos[bi, i])
                keys, vals = k[bi, kv_h].double(), v[bi, kv_h].double()
                s = (keys @ q[bi, h, i].double()) * scale
                s = s.masked_fill(~vis, float("-inf"))
                if extra_k is not None:
                    s = torch.cat([s, (extra_k[bi, kv_h].double() @ q[bi, h, i].double()) * scale])
                    vals = torch.cat([vals, extra_v[bi, kv_h].double()])
                p = torch.softmax(s, 0)
                out[bi, i, h] = p @ vals
                probs[bi, h, i] = p[:nq]
    return out, probs


@pytest.mark.parametrize("seed", [0, 1])
def test_step_attention_and_received_match_brute_force(seed):
    q, k, v, pos, real = _case(seed)
    out, lse, recv = step_attention(q, k, v, pos, real, 0.3, received=True)
    ref, probs = _brute(q, k, v, pos, real, 0.3)
    live = real.view(3, 1, 11, 1)
    torch.testing.assert_close(out.double()[real], ref[real], rtol=1e-5, atol=1e-5)
    # received: sum over live queries, mean over the group's query heads
    want = (probs * live).sum(2).view(3, 2, 3, 11).mean(2)
    torch.testing.assert_close(recv.double(), want, rtol=1e-5, atol=1e-6)
    assert bool((recv[~real.view(3, 1, 11).expand(3, 2, 11)] == 0).all()), "pad tokens receive nothing"
    for ordered in (False, True):  # the prompt-only pass, with and without the causal cut-off
        torch.testing.assert_close(step_received(q, k, pos, real, 0.3, ordered).double(), want, rtol=1e-5, atol=1e-6)


def test_merge_with_older_keys_matches_one_softmax_and_weights_received():
    q, k, v, pos, real = _case(3)
    g = torch.Generator().manual_seed(7)
    old_k, old_v = torch.randn(3, 2, 5, 16, generator=g), torch.randn(3, 2, 5, 16, generator=g)
    # the older keys' partial attention, computed densely (every query sees them)
    qg = q.view(3, 2, 3 * 11, 16)
    s_old = qg @ old_k.transpose(-1, -2) * 0.3
    lse_old = torch.logsumexp(s_old, -1)
    out_old = (torch.softmax(s_old, -1) @ old_v).view(3, 6, 11, 16).transpose(1, 2)
    out_new, lse_new, recv = step_attention(q, k, v, pos, real, 0.3, lse_other=lse_old, received=True)
    out, lse = merge_attention(out_old, lse_old, out_new, lse_new)
    ref, probs = _brute(q, k, v, pos, real, 0.3, old_k, old_v)
    torch.testing.assert_close(out.double()[real], ref[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logaddexp(lse_old, lse_new))
    want = (probs * real.view(3, 1, 11, 1)).sum(2).view(3, 2, 3, 11).mean(2)
    torch.testing.assert_close(recv.double(), want, rtol=1e-5, atol=1e-6)


def test_merge_with_an_empty_side_is_the_other_side():
    a = torch.randn(2, 3, 4, 8)
    lse_a = torch.randn(2, 2, 6)
    empty = torch.full_like(lse_a, float("-inf"))
    out, lse = merge_attention(a, lse_a, torch.zeros_like(a), empty)
    torch.testing.assert_close(out, a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = merge_attention(torch.zeros_like(a), empty, torch.zeros_like(a), empty)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("with_old", [False, True])
def test_one_token_step_equals_the_general_pass(with_old):
    """A decode step (one token per row) takes a closed form; it must equal the general chunked
    pass, finished rows (not real) included, with and without older keys' log-sum-exp."""
    from leankit.attention import _chunked_step_attention

    g = torch.Generator().manual_seed(11)
    b, hq, hkv, f = 5, 6, 2, 16
    q, k, v = (torch.randn(b, h, 1, f, generator=g) for h in (hq, hkv, hkv))
    pos = torch.randint(3, 50, (b, 1), generator=g)
    real = torch.tensor([[True], [False], [True], [True], [False]])
    lse_old = None
    if with_old:
        lse_old = torch.randn(b, hkv, hq // hkv, generator=g) + 2
        lse_old[0, 1, 2] = float("-inf")  # a row that saw no older key
    got = step_attention(q, k, v, pos, real, 0.3, lse_other=lse_old, received=True)
    ref = _chunked_step_attention(q, k, v, pos, real, 0.3, lse_old, True)
    for a, r in zip(got, ref):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_gpu_chunks_are_few_and_every_chunking_agrees(monkeypatch):
    """A GPU step takes query chunks of 64M scores (launch-bound loop otherwise): a batch-8, 4k-token
    prompt of SmolLM2's 9 query heads runs in 19 chunks a layer there, 586 on a CPU; and the result
    does not depend on the chunking (one-row chunks, the CPU size, one chunk for the whole step)."""
    import math

    from leankit import attention

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert math.ceil(4096 / attention.step_chunk_rows(8, 9, 4096, cpu)) == 586
    assert math.ceil(4096 / attention.step_chunk_rows(8, 9, 4096, gpu)) == 19
    assert attention.step_chunk_rows(1, 1, 1 << 30, gpu) == 1  # never zero rows
    q, k, v, pos, real = _case(5, q=37)
    results = []
    for elems in (1, attention.STEP_CHUNK_ELEMS, 1 << 26):
        monkeypatch.setattr(attention, "STEP_CHUNK_ELEMS", elems)
        out, lse, recv = step_attention(q, k, v, pos, real, 0.3, received=True)
        results.append((out[real], lse, recv, step_received(q, k, pos, real, 0.3, True)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed, b, hq, hkv, q, f", [(0, 3, 6, 2, 11, 16), (1, 2, 9, 3, 7, 24), (2, 1, 5, 5, 2, 8)])
def test_merged_step_equals_step_attention_then_merge(seed, b, hq, hkv, q, f):
    """The one-pass short step (own tokens and the merge with older keys) equals step_attention
    followed by merge_attention: left padding, a finished row (no real token), a row that saw no
    older key (lse -inf, output 0), and older outputs far above or below the new scores."""
    from leankit.attention import step_attention_merged

    g = torch.Generator().manual_seed(seed)
    qs, k, v = (torch.randn(b, h, q, f, generator=g) * 2 for h in (hq, hkv, hkv))
    real = torch.ones(b, q, dtype=torch.bool)
    real[0, : q // 2] = False  # left padding
    if b > 1:
        real[-1] = False  # a finished row
    pos = (real.long().cumsum(1) - 1).clamp_min(0) + 40
    lse_old = torch.randn(b, hkv, hq // hkv * q, generator=g) * 30  # far on both sides of the new scores
    out_old = torch.randn(b, q, hq, f, generator=g)
    lse_old[0, 0, :3] = float("-inf")
    out_old.view(b, q, hkv, hq // hkv, f)[0, :, 0, 0] = 0.0  # rows of head 0 that saw no older key
    out_new, lse_new, _ = step_attention(qs, k, v, pos, real, 0.3, lse_other=lse_old)
    want, want_lse = merge_attention(out_old, lse_old, out_new, lse_new)
    got, got_lse = step_attention_merged(qs, k, v, pos, real, 0.3, out_old, lse_old)
    assert got.shape == want.shape and got_lse.shape == want_lse.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(got_lse).all())


@pytest.mark.parametrize("seed, with_mask", [(4, False), (5, True), (6, False)])
def test_a_query_chunk_gives_its_rows_and_its_share_of_what_the_keys_received(seed, with_mask):
    """``first``: the step's queries cut into chunks (each over all the step's keys, with its rows'
    log-sum-exp over older keys) give the whole step's rows, and the chunks' received masses add
    up to the whole step's."""
    q, k, v, pos, real = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    b, hq, nq, _ = q.shape
    hkv, g = k.shape[1], hq // k.shape[1]
    lse_other = torch.randn(b, hkv, g * nq, generator=gen)
    own = None
    if with_mask:  # a mask that is not causal: random visibility, each query sees itself
        own = (torch.rand(b, nq, nq, generator=gen) > 0.4) | torch.eye(nq, dtype=torch.bool)
    out, lse, recv = step_attention(q, k, v, pos, real, 0.3, lse_other=lse_other, received=True, own_mask=own)
    cuts = sorted(torch.randperm(nq - 1, generator=gen)[:3].add(1).tolist())
    outs, lses, total = [], [], torch.zeros_like(recv)
    for q0, q1 in zip([0, *cuts], [*cuts, nq]):
        other = lse_other.view(b, hkv, g, nq)[..., q0:q1].reshape(b, hkv, -1)
        o, l_c, r = step_attention(q[:, :, q0:q1], k, v, pos, real, 0.3, lse_other=other, received=True,
                                   own_mask=own, first=q0)
        assert o.shape == (b, q1 - q0, hq, q.shape[-1]) and r.shape == recv.shape
        outs.append(o)
        lses.append(l_c.view(b, hkv, g, -1))
        total += r
    torch.testing.assert_close(torch.cat(outs, 1), out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(lses, 3).flatten(2), lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, recv, rtol=1e-5, atol=1e-7)


def test_a_live_query_that_sees_no_key_gets_nothing_and_gives_nothing():
    """A model mask can hide every key from a live query (its own token included): that row's
    output is 0 and its log-sum-exp -inf, and the keys' received mass stays finite and equals the
    mass from the other queries alone."""
    q, k, v, pos, real = _case(8)
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    own = torch.ones(b, nq, nq, dtype=torch.bool).tril_()
    own[0, 5] = False  # query 5 of row 0 sees nothing
    lse_other = torch.full((b, hkv, hq // hkv * nq), float("-inf"))  # and no older key either
    out, lse, recv = step_attention(q, k, v, pos, real, 0.3, lse_other=lse_other, received=True, own_mask=own)
    assert bool((out[0, 5] == 0).all())
    assert bool(torch.isneginf(lse.view(b, hkv, -1, nq)[0, :, :, 5]).all())
    assert bool(torch.isfinite(recv).all()) and bool(torch.isfinite(out).all())
    # the same step with query 5 of row 0 seeing its own token: only that query's share differs
    own_seen = own.clone()
    own_seen[0, 5, 5] = True
    _, _, recv_seen = step_attention(q, k, v, pos, real, 0.3, lse_other=lse_other, received=True, own_mask=own_seen)
    share = torch.zeros_like(recv)
    share[0, :, 5] = 1.0  # it would put all its mass (1 per query head, averaged: 1) on key 5
    torch.testing.assert_close(recv + share, recv_seen, rtol=1e-5, atol=1e-6)
