"""The prompt step: SDPA output with its lse captured, and significance from that lse.

``prompt_attention`` must return exactly (bitwise) what transformers' ``sdpa_attention_forward``
returns, and its significance must equal :func:`leankit.attention.step_received` (which runs its
own softmax) on left-padded, GQA and MHA prompts of odd lengths. With ``exact=False`` (lossy
caches) a padded batch runs each row's span alone: equal to fp32 rounding, zero at padding.
"""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from leankit.attention import step_received
from leankit.hf import cache_kwargs
from leankit.prompt_attention import _lse_capture, prompt_attention, received_from_lse


class _Module(torch.nn.Module):  # what sdpa_attention_forward reads from an attention module
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _prompt(seed, b, hkv, g, n, pads, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, n, 64, generator=gen).to(dtype) * 2
    k = torch.randn(b, hkv, n, 64, generator=gen).to(dtype) * 2
    v = torch.randn(b, hkv, n, 64, generator=gen).to(dtype)
    real = torch.ones(b, n, dtype=torch.bool)
    for row, p in enumerate(pads):
        real[row, :p] = False
    pos = (real.cumsum(1) - 1).clamp_min(0).to(torch.int32)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = (causal.view(1, 1, n, n) & real.view(b, 1, 1, n)) if any(pads) else None
    return q, k, v, real, pos, mask


@pytest.mark.parametrize("b,hkv,g,n,pads", [(3, 3, 3, 37, [0, 5, 36]), (1, 4, 1, 130, [0]), (2, 1, 7, 9, [0, 0]),
                                            (2, 2, 2, 1, [0, 0])])
def test_prompt_attention_is_sdpa_and_significance_matches(b, hkv, g, n, pads):
    seed = int(torch.randint(0, 1 << 30, ()))
    q, k, v, real, pos, mask = _prompt(seed, b, hkv, g, n, pads)
    module = _Module(g)
    want = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)[0]
    out, recv = prompt_attention(module, q, k, v, mask, 0.125, significance=True, q_pos=pos, k_real=real,
                                 ordered=True)
    assert torch.equal(out, want), f"seed {seed}"
    ref = step_received(q, k, pos, real, 0.125, ordered=True)
    torch.testing.assert_close(recv, ref, rtol=2e-5, atol=2e-6, msg=f"seed {seed}")
    assert torch.equal(recv[~real.view(b, 1, n).expand_as(recv)], torch.zeros(int((~real).sum()) * hkv))
    out2, none = prompt_attention(module, q, k, v, mask, 0.125, significance=False, q_pos=pos, k_real=real,
                                  ordered=True)
    assert none is None and torch.equal(out2, want)


def test_capture_leaves_sdpa_unchanged_and_records_lse():
    q, k, v, _real, _pos, mask = _prompt(0, 2, 3, 3, 21, [0, 4])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    box = {}
    with _lse_capture(box):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    assert F.scaled_dot_product_attention is torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(got, want) and box["lse"].shape == (2, 9, 21)
    # The lse is the softmax normalizer of each real query row.
    s = torch.einsum("bhqf,bhkf->bhqk", q, k.repeat_interleave(3, 1)) * 0.2
    s = s.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(box["lse"][1, :, 4:], torch.logsumexp(s, -1)[1, :, 4:])


@pytest.mark.parametrize("chunk_elems,min_rows", [(64, 1), (3000, 5), (75272, 16), (1 << 18, 16), (1 << 20, 16)])
def test_received_from_lse_in_many_query_chunks(monkeypatch, chunk_elems, min_rows):
    # Small chunks force many query chunks, each with its own causal diagonal block and key range;
    # 75272 puts 4 of the 6 (sequence, KV head) pairs in one batched chunk and 2 in the next, and
    # 1 << 18 all 6 in one.
    import leankit.prompt_attention as pa

    monkeypatch.setattr(pa, "_CHUNK_ELEMS", chunk_elems)
    monkeypatch.setattr(pa, "_MIN_ROWS", min_rows)
    seed = int(torch.randint(0, 1 << 30, ()))
    q, k, _v, real, pos, mask = _prompt(seed, 2, 3, 2, 97, [0, 11])
    s = torch.einsum("bhqf,bhkf->bhqk", q, k.repeat_interleave(2, 1)) * 0.125
    lse = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)
    recv = received_from_lse(q, k, lse, real, 0.125)
    ref = step_received(q, k, pos, real, 0.125, ordered=True)
    torch.testing.assert_close(recv, ref, rtol=2e-5, atol=2e-6, msg=f"seed {seed}")
    assert torch.equal(recv[1, :, :11], torch.zeros(3, 11))  # row 1's padding keys


def test_chunk_size_follows_the_cores_l2_within_the_measured_range():
    import leankit.prompt_attention as pa

    # 1 MB of scores where L2 is small or unknown, twice a large L2, never past 4 MB
    assert pa._chunk_elems(None) == pa._chunk_elems(512 << 10) == pa._chunk_elems((2 << 20) - 1) == 1 << 18
    assert pa._chunk_elems(2 << 20) == 1 << 20 and pa._chunk_elems(48 << 20) == 1 << 20
    l2 = pa._l2_bytes()
    assert l2 is None or l2 > 0
    assert pa._CHUNK_ELEMS == pa._chunk_elems(l2)


@pytest.mark.parametrize("sizes,want", [({"index0": ("1", "48K"), "index2": ("2", "2048K"), "index3": ("3", "105M")}, 2 << 20),
                                        ({"index1": ("1", "32K"), "index2": ("2", "1M")}, 1 << 20),
                                        ({"index2": ("2", "524288")}, 512 << 10),
                                        ({"index0": ("1", "32K")}, None), ({"index2": ("2", "lots")}, None),
                                        ({"index2": ("2", "")}, None), ({}, None)])
def test_l2_size_is_read_from_sysfs(tmp_path, sizes, want):
    import leankit.prompt_attention as pa

    (tmp_path / "uevent").write_text("\n")  # sysfs keeps files and folders beside the index entries
    (tmp_path / "power").mkdir()
    for entry, (level, size) in sizes.items():
        (tmp_path / entry).mkdir()
        (tmp_path / entry / "level").write_text(level + "\n")
        (tmp_path / entry / "size").write_text(size + "\n")
    assert pa._l2_bytes(str(tmp_path)) == want
    assert pa._l2_bytes(str(tmp_path / "missing")) is None


def test_received_from_lse_with_large_logits():
    # Scores far beyond exp()'s fp32 range: the lse shift keeps every term finite.
    q, k, _v, real, pos, mask = _prompt(1, 2, 2, 2, 33, [0, 3])
    q, k = q * 40, k * 40
    s = torch.einsum("bhqf,bhkf->bhqk", q, k.repeat_interleave(2, 1)) * 0.125
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    recv = received_from_lse(q, k, lse, real, 0.125)
    assert torch.isfinite(recv).all()
    torch.testing.assert_close(recv, step_received(q, k, pos, real, 0.125, ordered=True), rtol=1e-4, atol=1e-5)


def test_unordered_prompt_falls_back_to_its_own_softmax(monkeypatch):
    q, k, v, real, pos, mask = _prompt(2, 2, 2, 3, 19, [0, 6])
    module = _Module(3)

    def no_capture(box):  # the capture must not run for a prompt whose positions do not increase
        raise AssertionError("captured the lse of an unordered prompt")

    monkeypatch.setattr("leankit.prompt_attention._lse_capture", no_capture)
    out, recv = prompt_attention(module, q, k, v, mask, 0.125, significance=True, q_pos=pos, k_real=real,
                                 ordered=False)
    assert torch.equal(out, sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)[0])
    assert torch.equal(recv, step_received(q, k, pos, real, 0.125, ordered=False))


def test_additive_mask_is_converted_once_per_step_and_follows_changes():
    # Every layer of a forward gets the same bool mask: its fp32 form is built once per step.
    import leankit.prompt_attention as pa

    q, k, v, _real, _pos, mask = _prompt(3, 2, 3, 3, 21, [0, 4])
    memo = {}
    first = pa._additive_mask(mask, torch.float32, memo)
    assert pa._additive_mask(mask, torch.float32, memo) is first
    want = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    assert torch.equal(first, want)
    mask[0, 0, 5, 0] = False  # an in-place change bumps the version: converted again
    again = pa._additive_mask(mask, torch.float32, memo)
    assert again is not first and again[0, 0, 5, 0] == float("-inf")
    assert pa._additive_mask(mask.clone(), torch.float32, memo) is not again  # another tensor
    assert len(memo) <= pa._MASK_MEMO_ENTRIES
    # The attention through the memo is SDPA's, bit for bit, for every call of a step.
    box = {}
    for _ in range(2):
        box.clear()
        with _lse_capture(box, memo):
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
        assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True))


def test_cache_converts_the_prompt_mask_once_and_drops_it_with_the_step(monkeypatch):
    import leankit.prompt_attention as pa
    from leankit import LeanCache
    from leankit.testing import tiny_model

    made = []
    convert = pa._additive_mask

    def spied(mask, dtype, memo):
        out = convert(mask, dtype, memo)
        made.append(out)
        return out

    monkeypatch.setattr(pa, "_additive_mask", spied)
    # The masked path, as for a mask the span path does not take (a sliding window narrower than the prompt).
    monkeypatch.setattr(pa, "causal_spans", lambda *a: None)
    model = tiny_model("llama-gqa", num_hidden_layers=2)
    cache = LeanCache(model, "K8V4-K4V2", th=0.25, tl=0.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    assert len(made) == 2 and made[0] is made[1]  # one conversion, used by both layers
    converted = weakref.ref(made[0])
    made.clear()
    gc.collect()
    assert converted() is None  # the memo went with the step: nothing holds the mask after it


def _in_thread(fn):
    """Run ``fn`` in a new thread; re-raise what it raised."""
    import threading

    err = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test's thread
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, err


def test_capture_records_only_its_own_threads_calls():
    # Thread A is inside a capture while thread B runs SDPA on other data: B's call must pass
    # through unrecorded (B gets plain SDPA), and A's box must get A's own lse.
    import threading

    qa, ka, va, _r, _p, mask = _prompt(4, 2, 3, 3, 21, [0, 4])
    qb, kb, vb = qa.flip(2).contiguous(), ka.flip(2).contiguous(), va.flip(2).contiguous()
    entered, b_done = threading.Event(), threading.Event()
    box = {}

    def a():
        with _lse_capture(box):
            entered.set()
            assert b_done.wait(30)
            assert "lse" not in box, "thread B's SDPA call was recorded into thread A's box"
            F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, scale=0.2, enable_gqa=True)

    ta, err = _in_thread(a)
    assert entered.wait(30)
    got_b = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=0.2, enable_gqa=True)
    b_done.set()
    ta.join(30)
    if err:
        raise err[0]
    s = torch.einsum("bhqf,bhkf->bhqk", qa, ka.repeat_interleave(3, 1)) * 0.2
    torch.testing.assert_close(box["lse"][1, :, 4:], torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)[1, :, 4:])
    assert torch.equal(got_b, torch.ops.aten.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=0.2,
                                                                          enable_gqa=True))


def test_overlapping_captures_restore_sdpa():
    # A enters, B enters, A leaves, B leaves: SDPA is the original afterwards (restoring in the order
    # each capture saw it would leave A's wrapper installed for good).
    import threading

    original = F.scaled_dot_product_attention
    q, k, v, _r, _p, _mask = _prompt(5, 1, 2, 2, 13, [0])
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    boxes = {"a": {}, "b": {}}

    def a():
        with _lse_capture(boxes["a"]):
            a_in.set()
            assert b_in.wait(30)
            F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
        a_out.set()

    def b():
        assert a_in.wait(30)
        with _lse_capture(boxes["b"]):
            b_in.set()
            assert a_out.wait(30)
            F.scaled_dot_product_attention(q * 2, k, v, scale=0.3, enable_gqa=True)

    (ta, ea), (tb, eb) = _in_thread(a), _in_thread(b)
    ta.join(30)
    tb.join(30)
    for e in ea + eb:
        raise e
    assert F.scaled_dot_product_attention is original
    s = torch.einsum("bhqf,bhkf->bhqk", q, k.repeat_interleave(2, 1)) * 0.3
    for name, scale in (("a", 1), ("b", 2)):
        causal_free = torch.logsumexp(s * scale, -1)  # no mask, not causal
        torch.testing.assert_close(boxes[name]["lse"], causal_free)


# --------------------------------------------------------------------------- span path (lossy caches)
@pytest.mark.parametrize("b,hkv,g,n,pads,right", [(3, 3, 3, 37, [0, 5, 36], False), (4, 2, 2, 300, [0, 1, 2, 299], False),
                                                  (2, 1, 7, 9, [0, 8], False), (3, 3, 1, 41, [0, 7, 40], True),
                                                  (1, 2, 3, 17, [4], False)])
def test_span_attention_agrees_with_the_masked_call(b, hkv, g, n, pads, right):
    # exact=False on a padded prompt: each row's span alone, with is_causal. Real positions agree with
    # transformers' masked SDPA to fp32 rounding, padding positions are zero, significance as before.
    seed = int(torch.randint(0, 1 << 30, ()))
    q, k, v, real, pos, mask = _prompt(seed, b, hkv, g, n, pads)
    if right:  # the same rows right-padded: real tokens first
        real = real.flip(1)
        pos = (real.cumsum(1) - 1).clamp_min(0).to(torch.int32)
        mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n) & real.view(b, 1, 1, n)
    module = _Module(g)
    want = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)[0]
    memo = {}
    out, recv = prompt_attention(module, q, k, v, mask, 0.125, significance=True, q_pos=pos, k_real=real,
                                 ordered=True, exact=False, mask_memo=memo)
    assert memo, "the span path did not run"
    live = real.view(b, n, 1, 1).expand_as(out)
    # fp64 attention under the same mask, [B, Q, Hq, F] as SDPA returns it (padding rows dropped)
    sc = torch.einsum("bhqf,bhkf->bhqk", q.double(), k.double().repeat_interleave(g, 1)) * 0.125
    exact = torch.einsum("bhqk,bhkf->bqhf", sc.masked_fill(~mask, float("-inf")).softmax(-1),
                         v.double().repeat_interleave(g, 1))
    _assert_as_accurate(out[live], want[live], exact[live], f"seed {seed}")
    assert torch.equal(out[~live], torch.zeros(int((~live).sum())))
    ref = step_received(q, k, pos, real, 0.125, ordered=True)
    torch.testing.assert_close(recv, ref, rtol=2e-5, atol=2e-6, msg=f"seed {seed}")
    out2, none = prompt_attention(module, q, k, v, mask, 0.125, significance=False, q_pos=pos, k_real=real,
                                  ordered=True, exact=False, mask_memo=memo)
    # Significance never changes the output: bitwise the same without it.
    assert none is None and torch.equal(out2, out)


def _causal_fp64(q, k, v, scale):
    # Causal attention of unpadded rows in fp64: the yardstick for the fp32 paths.
    g, n = q.shape[1] // k.shape[1], q.shape[2]
    s = torch.einsum("bhqf,bhkf->bhqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bhkf->bhqf", s.softmax(-1), v.double().repeat_interleave(g, 1))


def _assert_as_accurate(got, baseline, exact, msg=""):
    # ``got`` misses the fp64 result by no more than the fp32 path it replaces does (plus 1e-6: at
    # these sizes fp32 rounding alone moves a result by a few 1e-7).
    err = (got.double() - exact).abs().max().item()
    base = (baseline.double() - exact).abs().max().item()
    assert err <= 1.5 * base + 1e-6, f"error {err:.3g} vs the replaced path's {base:.3g} {msg}"


@pytest.mark.parametrize("chunk_elems,min_rows", [(64, 1), (3000, 5), (75272, 16), (1 << 18, 16), (1 << 20, 16)])
@pytest.mark.parametrize("b,hkv,g,n,fv", [(2, 3, 2, 97, 64), (1, 1, 7, 5, 48), (3, 2, 1, 1, 64), (1, 3, 3, 130, 80)])
def test_causal_received_matches_flash_and_lse_significance(monkeypatch, chunk_elems, min_rows, b, hkv, g, n, fv):
    # One chunk or many: each with its own diagonal block, key range and group of (sequence, KV
    # head) pairs; value width apart from the key width.
    import leankit.prompt_attention as pa

    monkeypatch.setattr(pa, "_CHUNK_ELEMS", chunk_elems)
    monkeypatch.setattr(pa, "_MIN_ROWS", min_rows)
    seed = int(torch.randint(0, 1 << 30, ()))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, n, 64, generator=gen) * 2
    k = torch.randn(b, hkv, n, 64, generator=gen) * 2
    v = torch.randn(b, hkv, n, fv, generator=gen)
    out, recv = pa.causal_received(q, k, v, 0.125)
    exact = _causal_fp64(q, k, v, 0.125)
    if fv == 64:  # what the span path ran before: the flash kernel (it takes one head width only)
        _assert_as_accurate(out, pa._cpu_flash(q, k, v, is_causal=True, scale=0.125)[0], exact, f"seed {seed}")
    else:
        torch.testing.assert_close(out.double(), exact, rtol=2e-5, atol=2e-5, msg=f"seed {seed}")
    pos = torch.arange(n, dtype=torch.int32).expand(b, n)
    ref = step_received(q, k, pos, torch.ones(b, n, dtype=torch.bool), 0.125, ordered=True)
    torch.testing.assert_close(recv, ref, rtol=2e-5, atol=2e-6, msg=f"seed {seed}")


def test_causal_received_with_large_logits_and_half_inputs():
    # Scores far beyond exp()'s fp32 range stay finite (the row max shift); bf16 and fp16 inputs are
    # computed in fp32 and returned in their own dtype.
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 33, 64, generator=gen) * 40, torch.randn(2, 2, 33, 64, generator=gen) * 40, \
        torch.randn(2, 2, 33, 64, generator=gen)
    from leankit.prompt_attention import _cpu_flash, causal_received

    out, recv = causal_received(q, k, v, 0.125)
    assert torch.isfinite(out).all() and torch.isfinite(recv).all()
    _assert_as_accurate(out, _cpu_flash(q, k, v, is_causal=True, scale=0.125)[0], _causal_fp64(q, k, v, 0.125))
    pos = torch.arange(33, dtype=torch.int32).expand(2, 33)
    ref = step_received(q, k, pos, torch.ones(2, 33, dtype=torch.bool), 0.125, ordered=True)
    torch.testing.assert_close(recv, ref, rtol=1e-4, atol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        qh, kh, vh = (t.to(dtype) for t in (q / 40, k / 40, v))
        out_h, recv_h = causal_received(qh, kh, vh, 0.125)
        assert out_h.dtype == dtype and recv_h.dtype == torch.float32
        # computed from the half inputs in fp32, then rounded once to the half dtype
        torch.testing.assert_close(out_h, _causal_fp64(qh, kh, vh, 0.125).to(dtype))
        ref_h = step_received(qh.float(), kh.float(), pos, torch.ones(2, 33, dtype=torch.bool), 0.125, ordered=True)
        torch.testing.assert_close(recv_h, ref_h, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("b,hkv,g,n", [(1, 3, 3, 130), (2, 2, 3, 29), (3, 1, 7, 1)])
def test_unpadded_lossy_prompt_runs_one_span_per_row(monkeypatch, b, hkv, g, n):
    # transformers passes no mask for a batch with no padding: a lossy cache's prompt runs the span
    # path (each row one span), its output as accurate as SDPA's against fp64 and its significance
    # that of the separate pass (SDPA's flash kernel plus received_from_lse cost 1.7x the one pass).
    import leankit.prompt_attention as pa

    q, k, v, real, pos, mask = _prompt(4, b, hkv, g, n, [0] * b)
    assert mask is None
    module = _Module(g)
    ran = []
    span = pa.span_attention
    monkeypatch.setattr(pa, "span_attention", lambda *a, **kw: ran.append(a[3]) or span(*a, **kw))
    want = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)[0]
    out, recv = prompt_attention(module, q, k, v, None, 0.125, significance=True, q_pos=pos, k_real=real,
                                 ordered=True, exact=False)
    assert ran == [[(0, n)] * b]
    _assert_as_accurate(out.transpose(1, 2), want.transpose(1, 2), _causal_fp64(q, k, v, 0.125))
    torch.testing.assert_close(recv, step_received(q, k, pos, real, 0.125, ordered=True), rtol=2e-5, atol=2e-6)
    alone, none = prompt_attention(module, q, k, v, None, 0.125, significance=False, q_pos=pos, k_real=real,
                                   ordered=True, exact=False)
    assert none is None and torch.equal(alone, out)  # the policy's significance never changes the output
    # exact (the lossless config) and a module that is not causal keep transformers' SDPA, bitwise
    ran.clear()
    exact, _ = prompt_attention(module, q, k, v, None, 0.125, significance=False, q_pos=pos, k_real=real,
                                ordered=True, exact=True)
    assert torch.equal(exact, want) and ran == []
    module.is_causal = False
    full, _ = prompt_attention(module, q, k, v, None, 0.125, significance=False, q_pos=pos, k_real=real,
                               ordered=True, exact=False)
    assert torch.equal(full, sdpa_attention_forward(module, q, k, v, None, scaling=0.125)[0]) and ran == []


def test_causal_spans_accepts_only_causal_masks_within_one_span():
    from leankit.prompt_attention import causal_spans

    _q, _k, _v, real, _pos, mask = _prompt(0, 3, 1, 1, 12, [0, 3, 11])
    assert causal_spans(mask, real) == [(0, 12), (3, 12), (11, 12)]
    causal = torch.ones(12, 12, dtype=torch.bool).tril().view(1, 1, 12, 12)
    assert causal_spans(causal, torch.ones(1, 12, dtype=torch.bool)) == [(0, 12)]  # a mask shared by the batch
    assert causal_spans(None, real) is None
    window = mask & ~torch.ones(12, 12, dtype=torch.bool).tril(-5)  # sliding window of 5 < 12 tokens
    assert causal_spans(window, real) is None
    wide = mask & ~torch.ones(12, 12, dtype=torch.bool).tril(-12)  # a window wider than the prompt is causal
    assert causal_spans(wide, real) == [(0, 12), (3, 12), (11, 12)]
    holed = real.clone()
    holed[0, 4] = False  # a padding token inside a row's real tokens
    assert causal_spans(mask & holed.view(3, 1, 1, 12), holed) is None
    peek = mask.clone()
    peek[1, 0, 5, 6] = True  # a real query sees a later key
    assert causal_spans(peek, real) is None
    blind = mask.clone()
    blind[2, 0, 11, 11] = False  # a real query misses itself
    assert causal_spans(blind, real) is None
    pad_rows = mask.clone()
    pad_rows[1, 0, :3] = True  # what padding queries see is not looked at
    assert causal_spans(pad_rows, real) == [(0, 12), (3, 12), (11, 12)]
    assert causal_spans(mask.float(), real) is None and causal_spans(mask[:, :, :5], real) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_spans_reads_additive_masks_as_their_bool_mask(dtype):
    """An additive mask (0 attends; -inf or the dtype's lowest value, as transformers' eager masks
    use, hides) gives the spans of its bool mask; a soft bias, on a hidden or a seen key, gives None."""
    from leankit.prompt_attention import causal_spans

    _q, _k, _v, real, _pos, mask = _prompt(0, 3, 1, 1, 12, [0, 3, 11])
    want = causal_spans(mask, real)
    for hide in (float("-inf"), torch.finfo(dtype).min):
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, hide)
        assert causal_spans(additive, real) == want
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    soft_hidden = additive.clone()
    soft_hidden[0, 0, 4, 9] = -30.0  # a later key only damped, not hidden
    assert causal_spans(soft_hidden, real) is None
    soft_seen = additive.clone()
    soft_seen[1, 0, 6, 4] = -0.5  # a seen key with a bias
    assert causal_spans(soft_seen, real) is None
    peek = additive.clone()
    peek[1, 0, 5, 6] = 0.0  # a real query sees a later key
    assert causal_spans(peek, real) is None


def test_causal_spans_reads_the_mask_once_per_step_and_follows_changes(monkeypatch):
    import leankit.prompt_attention as pa

    _q, _k, _v, real, _pos, mask = _prompt(0, 2, 1, 1, 10, [0, 4])
    memo, calls = {}, []
    equal = torch.equal
    monkeypatch.setattr(pa.torch, "equal", lambda a, b: calls.append(1) or equal(a, b))
    first = pa.causal_spans(mask, real, memo)
    n = len(calls)
    assert pa.causal_spans(mask, real, memo) is first and len(calls) == n  # memo hit: no second read
    mask[1, 0, 6, 7] = True  # changed in place: checked again, and no longer causal
    assert pa.causal_spans(mask, real, memo) is None and len(calls) > n
    assert len(memo) <= pa._MASK_MEMO_ENTRIES


@pytest.mark.parametrize("kv,spans", [("K8V4-K4V2:th=0.25,tl=0", True), ("K8V4", True), ("FP16", False)])
def test_cache_runs_lossy_padded_prompts_through_the_span_path(monkeypatch, kv, spans):
    # Lossy caches take the span path on a padded batch; the lossless FP16 keeps transformers' masked
    # SDPA (its tokens must equal DynamicCache's bit for bit).
    import leankit.prompt_attention as pa
    from leankit import LeanCache
    from leankit.testing import tiny_model

    ran = []
    span = pa.span_attention
    monkeypatch.setattr(pa, "span_attention", lambda *a, **kw: ran.append(1) or span(*a, **kw))
    model = tiny_model("llama-gqa", num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :10] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, LeanCache(model, kv)), use_cache=True)
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(ran) == (2 if spans else 0)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref.logits[real], rtol=1e-5, atol=1e-5)
