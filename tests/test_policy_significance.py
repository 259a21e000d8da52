"""Significance scores stored in the pages equal the dense definition, in both phases."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leankit.cache import LeanCache
from leankit.hf import cache_kwargs
from leankit.page_table import HIGH
from leankit.policy import read_tier_meta, significance_cutoffs

F = 16


def _cache(hq=4, hkv=2):
    cfg = LlamaConfig(vocab_size=64, hidden_size=hq * F, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=F, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    # Two unquantized tiers and thresholds 0: nothing moves, so scores can be compared exactly.
    cache = LeanCache(model, "FP16-FP16", th=0.0, tl=0.0, window=4, page_size=512, max_seq_len=128)
    cache.pool.storage.fill_(0xFF)  # stale bytes are NaN patterns: they must never leak into scores
    return cache


def _dense_probs(q, k, q_pos, k_pos, keep):
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * F ** -0.5
    vis = keep.repeat_interleave(g, 1).unsqueeze(2) & (k_pos.view(1, 1, 1, -1) <= q_pos.view(1, 1, -1, 1))
    return torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0)  # [B, Hq, Q, N]


def _page_scores(cache):
    m = read_tier_meta(cache, HIGH, torch.tensor([0]))
    order = torch.argsort(torch.where(m.valid, m.pos, 1 << 20), -1)
    n = int(m.valid.sum(-1).max())
    return torch.gather(m.score, -1, order)[0, ..., :n], torch.gather(m.pos, -1, order)[0, ..., :n]


def test_scores_follow_the_prompt_mean_then_the_running_rule():
    torch.manual_seed(0)
    hq, hkv, n = 4, 2, 20
    cache = _cache(hq, hkv)
    g = hq // hkv
    k_all = torch.randn(1, hkv, n + 3, F) * 2
    v_all = torch.randn(1, hkv, n + 3, F)
    pos = torch.arange(n).view(1, -1)
    cache.begin_step(1, n, attention_mask=torch.ones(1, n), position_ids=pos)
    q = torch.randn(1, hq, n, F) * 2
    cache.layers[0].update(k_all[:, :, :n], v_all[:, :, :n])
    cache.attend(0, q, F ** -0.5)
    cache.end_step()
    p = _dense_probs(q, k_all[:, :, :n], pos[0], torch.arange(n), torch.ones(1, hkv, n, dtype=torch.bool))
    p = p.view(1, hkv, g, n, n).mean(2)  # average over the group's query heads
    expected = torch.stack([p[..., i:, i].mean(-1) for i in range(n)], -1)  # mean over the N - i later queries
    got, got_pos = _page_scores(cache)
    assert got_pos[0, 0].tolist() == list(range(n))
    torch.testing.assert_close(got[0], expected[0], rtol=2e-3, atol=1e-6)  # fp16 score segment
    # Generation: three decode queries, the running mean s <- s + (p - s) / (q - pos + 1).
    run = expected.clone()
    for i in range(3):
        t = n + i
        cache.begin_step(1, 1, attention_mask=torch.ones(1, t + 1), position_ids=torch.tensor([[t]]))
        qd = torch.randn(1, hq, 1, F) * 2
        cache.layers[0].update(k_all[:, :, t: t + 1], v_all[:, :, t: t + 1])
        cache.attend(0, qd, F ** -0.5)
        cache.end_step()
        pd = _dense_probs(qd, k_all[:, :, : t + 1], torch.tensor([t]), torch.arange(t + 1),
                          torch.ones(1, hkv, t + 1, dtype=torch.bool)).view(1, hkv, g, 1, t + 1).mean(2)[..., 0, :]
        run = torch.cat([run, torch.zeros(1, hkv, 1)], -1)
        nq = t - torch.arange(t + 1) + 1
        run = run + (pd - run) / nq
    got, _ = _page_scores(cache)
    torch.testing.assert_close(got[0], run[0], rtol=5e-3, atol=1e-5)


def test_cutoffs_do_not_depend_on_the_normalization_scale():
    """Scores are stored unnormalized; the normalization to sum 1 is one factor per head."""
    torch.manual_seed(1)
    s = torch.rand(3, 40)
    elig = torch.rand(3, 40) > 0.2
    z = s.sum(-1) + 0.5
    pm = torch.rand(3) * 0.1
    a = significance_cutoffs(s, elig, z, pm, (0.05, 0.3))
    b = significance_cutoffs(s * 8.0, elig, z * 8.0, pm * 8.0, (0.05, 0.3))
    torch.testing.assert_close(a * 8.0, b)


def test_significance_from_kept_logits_equals_the_second_pass():
    """Decode and short chunks take the significance from the logits attention kept
    (``received_from_logits``); it must equal the second pass over the keys, including dead
    slots, pruned tokens, both tiers, padding queries and several query chunks."""
    from leankit_kernels import testing as ktesting

    from leankit.attention import paged_attention_ref, received_attention_ref, received_from_logits

    gen = torch.Generator().manual_seed(7)
    for q_len, query_chunk in ((1, 512), (13, 5)):
        fc = ktesting.build_paged_kv("K8V4-K4V2", 3, 2, 16, torch.tensor([40, 23, 5]), prune_frac=0.2,
                                     low_group_size=8, generator=gen)
        q, q_pos = ktesting.random_queries(3, 6, q_len, 16, fc.ctx, generator=gen)
        q_valid = torch.rand(3, q_len, generator=gen) > 0.3
        out, lse, logits = paged_attention_ref(q, fc.kv, q_pos, 0.25, query_chunk=query_chunk, return_logits=True)
        out2, lse2 = paged_attention_ref(q, fc.kv, q_pos, 0.25, query_chunk=query_chunk)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        got = received_from_logits(logits, lse, 3, q_valid)
        ref = received_attention_ref(q, fc.kv, q_pos, 0.25, lse, q_valid)
        assert len(got) == len(ref) == 2
        for a, b in zip(got, ref):
            assert a.shape == b.shape and bool((b > 0).any())
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32: matmul shapes differ by query chunk


def test_live_page_score_update_equals_the_padded_one(monkeypatch):
    """Decode on the CPU path takes its significance from the live-page attention
    (:class:`~leankit.decode_attention.LiveSlots`), on the compiled kernels with the new token and
    the merge in one call (:func:`~leankit.decode_attention.decode_step_attention`), else through
    the torch composition; the stored scores, tiers and tokens of both must be those of the padded
    path (``live_slots`` off) over prompt, decode and Algorithm 1 steps."""
    import leankit.cache as cache_mod
    from leankit import decode_attention, native
    from leankit.page_table import LOW

    cfg = LlamaConfig(vocab_size=96, hidden_size=4 * F, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=F, max_position_embeddings=256)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (2, 37))
    results = []
    real_ref = cache_mod.paged_attention_ref
    real_serves = decode_attention.serves_decode_step
    modes = (("fused", True), ("live", False), ("padded", False))
    for mode, fused in modes:
        def ref(*a, live_slots=False, _live=mode != "padded", **k):
            return real_ref(*a, live_slots=live_slots and _live, **k)
        monkeypatch.setattr(cache_mod, "paged_attention_ref", ref)
        served = []

        def serves(*a, _fused=fused, _served=served):
            _served.append(_fused and real_serves(*a))
            return _served[-1]
        monkeypatch.setattr(decode_attention, "serves_decode_step", serves)
        cache = LeanCache(model, "K8V4-K4V2", th=0.3, tl=0.05, low_group_size=8, window=4, compress_every=1,
                          page_size=256, max_seq_len=128)
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=8, do_sample=False)
        tiers = []
        for tier in (HIGH, LOW):
            m = read_tier_meta(cache, tier, torch.tensor([0, 1]))
            key = torch.where(m.valid, m.pos, 1 << 20)
            order = torch.argsort(key, -1)
            tiers.append((torch.gather(key, -1, order), torch.gather(m.score, -1, order)))
        results.append((out, tiers))
        assert any(served) is (fused and native.kernels() is not None), mode
    out_b, tiers_b = results[-1]  # the padded path
    assert int((tiers_b[1][0] < (1 << 20)).sum()) > 0  # the low tier is in use
    for (mode, _), (out_a, tiers_a) in zip(modes, results[:-1]):
        assert torch.equal(out_a, out_b), mode
        for (pos_a, score_a), (pos_b, score_b) in zip(tiers_a, tiers_b):
            assert torch.equal(pos_a, pos_b), mode
            torch.testing.assert_close(score_a, score_b, rtol=2e-3, atol=1e-6, msg=mode)  # fp16 score segment


def _chunked_logits(model, ids, spec, prompt, chunk):
    cache = LeanCache(model, spec)
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], position_ids=torch.arange(prompt)[None], **cache_kwargs(model, cache))
        out = model(input_ids=ids[:, prompt:prompt + chunk], position_ids=torch.arange(prompt, prompt + chunk)[None],
                    **cache_kwargs(model, cache))
    return out.logits[0], cache


def test_a_multi_token_step_keeps_every_querys_window_in_the_high_tier():
    """Algorithm 1 runs before a step's attention, so in a chunk fed after the prompt it may only
    place the tokens its first query no longer has in its window: the chunk's queries whose
    window holds every stored token attend exactly as the one-tier high config does."""
    from leankit.testing import tiny_model

    model = tiny_model("llama-gqa", seed=3)
    torch.manual_seed(3)
    ids = torch.randint(4, model.config.vocab_size, (1, 40))
    prompt, chunk, window = 12, 24, 16
    one_tier, _ = _chunked_logits(model, ids, f"K8V4:window={window}", prompt, chunk)
    for spec in (f"K8V4-K4V2:th=0.4,tl=0,window={window},compress_every=1",
                 f"K8V4-K4V2:th=0.4,tl=0.1,window={window},compress_every=1"):
        two_tier, cache = _chunked_logits(model, ids, spec, prompt, chunk)
        inside = window - prompt  # queries prompt .. window - 1 have every stored token in their window
        torch.testing.assert_close(two_tier[:inside], one_tier[:inside], rtol=0, atol=1e-6)
        # the next step places what the chunk's first query left behind: compression still happens
        with torch.no_grad():
            model(input_ids=ids[:, prompt + chunk:prompt + chunk + 1],
                  position_ids=torch.tensor([[prompt + chunk]]), **cache_kwargs(model, cache))
        lens = cache.table.lens.long()  # [tier, layer, B, H]
        stored = prompt + chunk + 1
        assert int(lens[1].sum()) > 0, "nothing reached the low tier"
        assert int(lens.sum(0).max()) <= stored and (int(lens.sum(0).min()) < stored) == ("tl=0.1" in spec)
