"""Quantize/pack kernel vs the reference format (leankit.quant + PageLayout.encode + PagePool.write_rows).

Runs under Triton's CPU interpreter. The pool bytes must be identical, byte for byte.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from leankit_kernels.quant import dequantize_from_pages, quantize_into_pages
from leankit_kernels.testing import assert_close_normwise, fresh_generator, poison_outputs

from leankit.config import KVConfig
from leankit.pages import PageLayout, PagePool
from leankit.quant import NonFiniteKVError

_poison = pytest.fixture(autouse=True)(poison_outputs)


def _setup(spec, dtype, n, head_dim=64, group_size=None, gen=None, tier=0, **overrides):
    cfg = KVConfig.parse(spec, group_size=group_size, **overrides)
    lay = PageLayout.build(cfg, tier, head_dim, dtype)
    pages = (n + lay.tokens - 1) // lay.tokens + 2
    pool = PagePool(pages, cfg.page_size)
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=gen, dtype=torch.uint8))
    perm = torch.randperm(pages * lay.tokens, generator=gen)[:n]  # scattered (page, slot) targets
    page, slot = perm // lay.tokens, perm % lay.tokens
    return lay, pool, page, slot


def _reference_write(pool, lay, page, slot, rows):
    """The pool bytes after the reference PagePool.write_rows (on a copy)."""
    ref = PagePool(pool.num_pages, pool.page_size)
    ref.storage.copy_(pool.storage)
    ref.write_rows(lay, page, slot, rows)
    return ref.storage


def _data(n, f, dtype, gen):
    """Never-zero, mixed-scale data: normal rows, large rows, a constant row (scale 0)."""
    k = torch.randn(n, f, generator=gen) * torch.rand(n, 1, generator=gen).mul(8).add(0.01)
    v = torch.randn(n, f, generator=gen) + torch.randn(n, 1, generator=gen)
    if n > 2:
        k[1] = 0.75  # constant group -> s16 == 0, Q = 0
        v[2, : f // 2] = -1.5
    return k.to(dtype), v.to(dtype)


def _check(spec, dtype, n, group_size=None, head_dim=64, tier=0, **overrides):
    gen, seed = fresh_generator()
    lay, pool, page, slot = _setup(spec, dtype, n, head_dim, group_size, gen, tier, **overrides)
    k, v = _data(n, head_dim, dtype, gen)
    pos = torch.randint(0, 10_000, (n,), generator=gen)
    score = torch.rand(n, generator=gen)
    ref = _reference_write(pool, lay, page, slot, lay.encode(k, v, score, pos))
    quantize_into_pages(pool.storage, lay, page, slot, k, v, pos, score)
    diff = (pool.storage != ref).nonzero()
    assert diff.numel() == 0, f"seed {seed}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"
    return lay, pool, page, slot, seed


@pytest.mark.parametrize("spec", ["K8V4", "K4V2", "K2V1", "K1V8", "K8V8", "K16V4", "K4V16", "FP16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 65])
def test_quantize_bytes_match_reference(spec, dtype, n):
    _check(spec, dtype, n)


@pytest.mark.parametrize("spec,gs", [("K4V2", 16), ("K8V4", 32), ("K1V2", 8)])
def test_quantize_groups_bytes_match_reference(spec, gs):
    _check(spec, torch.float32, 63, group_size=gs)


@pytest.mark.parametrize("tier,groups", [(0, 1), (1, 2)])
def test_quantize_tier_with_its_own_group_size(tier, groups):
    """``low_group_size`` gives the low tier's pages their own group count; the high tier keeps one group."""
    lay = _check("K8V4-K4V2", torch.float32, 37, tier=tier, low_group_size=32)[0]
    assert lay.groups == groups


def test_quantize_head_dim_128_bf16():
    _check("K4V2", torch.bfloat16, 7, head_dim=128)


def test_round_half_even_ties():
    """(x - min) / scale hits exact .5 ties: codes must round to even like torch.round."""
    gen, seed = fresh_generator()
    f, n = 64, 16
    cfg = KVConfig.parse("K8V8")
    lay = PageLayout.build(cfg, 0, f, torch.float32)
    step = 0.25  # exact in fp16, so scale16 == 0.25 when max - min == 255 * 0.25
    x = torch.zeros(n, f)
    x[:, 1] = 255 * step
    x[:, 2:] = (torch.randint(0, 254, (n, f - 2), generator=gen).float() + 0.5) * step
    x = x + torch.randint(-3, 4, (n, 1), generator=gen).float()  # shift: min stays exact in fp16
    pool = PagePool(2, cfg.page_size)
    pool.storage.fill_(0xA5)
    page, slot = torch.arange(n) // lay.tokens, torch.arange(n) % lay.tokens  # real slots of two pages
    pos, score = torch.arange(n), torch.rand(n, generator=gen)
    rows = lay.encode(x, x, score, pos)
    ref = _reference_write(pool, lay, page, slot, rows)
    quantize_into_pages(pool.storage, lay, page, slot, x, x, pos, score)
    assert torch.equal(pool.storage, ref), f"seed {seed}"
    codes = rows[0].long()
    assert (codes[:, 2:] % 2 == 0).all(), "ties must land on even codes"


@settings(max_examples=12, deadline=None)
@given(bits=st.sampled_from([(8, 4), (4, 2), (2, 1), (1, 1), (4, 8)]), n=st.integers(1, 40),
       scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**31 - 1))
def test_quantize_property(bits, n, scale, seed):
    """Random shapes and magnitudes: bytes identical to the reference."""
    gen = torch.Generator().manual_seed(seed)
    spec = f"K{bits[0]}V{bits[1]}"
    lay, pool, page, slot = _setup(spec, torch.float32, n, 32, None, gen)
    k = torch.randn(n, 32, generator=gen) * scale
    v = torch.rand(n, 32, generator=gen) * scale + scale
    pos, score = torch.randint(0, 99, (n,), generator=gen), torch.rand(n, generator=gen)
    ref = _reference_write(pool, lay, page, slot, lay.encode(k, v, score, pos))
    quantize_into_pages(pool.storage, lay, page, slot, k, v, pos, score)
    assert torch.equal(pool.storage, ref)


@pytest.mark.parametrize("spec", ["K8V8", "K4V2"])
@pytest.mark.parametrize("magnitude", [1e-5, 1e-6, 1e-7])
def test_groups_with_subnormal_steps_match_the_reference(spec, magnitude):
    """Data whose quantization steps are fp16 subnormals, where the scale rounds up, not to
    nearest (leankit.quant.round_scale_up_if_subnormal): bytes identical to the reference."""
    gen, seed = fresh_generator()
    n = 37
    lay, pool, page, slot = _setup(spec, torch.float32, n, 64, None, gen)
    k = torch.randn(n, 64, generator=gen) * magnitude
    v = torch.rand(n, 64, generator=gen) * magnitude - magnitude / 3
    pos, score = torch.randint(0, 99, (n,), generator=gen), torch.rand(n, generator=gen)
    ref = _reference_write(pool, lay, page, slot, lay.encode(k, v, score, pos))
    quantize_into_pages(pool.storage, lay, page, slot, k, v, pos, score)
    assert torch.equal(pool.storage, ref), f"seed {seed}"


def _signed_zero_groups(gen, n: int, dim: int, dtype) -> torch.Tensor:
    """``[n, dim]`` rows of +0 and -0 at random, half of them with one positive element: groups
    whose minimum, or whose step too, is a zero of either sign."""
    x = torch.where(torch.rand(n, dim, generator=gen) < 0.5, -0.0, 0.0)
    x[::2, 0] = 1.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_groups_of_signed_zeros_match_the_reference(dtype):
    """A group holding +0 and -0 stores a +0 minimum (and step), whichever zero a reduction finds."""
    gen, seed = fresh_generator()
    n = 23
    lay, pool, page, slot = _setup("K4V2", dtype, n, 64, None, gen)
    k, v = _signed_zero_groups(gen, n, 64, dtype), _signed_zero_groups(gen, n, 64, dtype).flip(1)
    pos, score = torch.randint(0, 99, (n,), generator=gen), torch.rand(n, generator=gen)
    ref = _reference_write(pool, lay, page, slot, lay.encode(k, v, score, pos))
    quantize_into_pages(pool.storage, lay, page, slot, k, v, pos, score)
    assert torch.equal(pool.storage, ref), f"seed {seed}"


@pytest.mark.parametrize("spec", ["K8V4", "K4V2", "K2V1", "K16V4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_matches_decode(spec, dtype):
    lay, pool, page, slot, seed = _check(spec, dtype, 37, group_size=16 if spec == "K4V2" else None)
    k, v, score, pos = dequantize_from_pages(pool.storage, lay, page, slot)
    rk, rv, rs, rp = lay.decode(pool.gather(page))
    i = torch.arange(page.numel())
    # fp32 dequantization s * Q + min: same two roundings as the reference (1e-5 normwise, fp32).
    assert_close_normwise(k, rk[i, slot], torch.float32, f"k seed {seed}")
    assert_close_normwise(v, rv[i, slot], torch.float32, f"v seed {seed}")
    assert torch.equal(score, rs[i, slot]) and torch.equal(pos, rp[i, slot])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy sees the overflow too
def test_non_finite_and_overflow_raise():
    lay = PageLayout.build(KVConfig.parse("K8V4"), 0, 32, torch.float32)
    pool = PagePool(2, lay.page_size)
    page, slot = torch.zeros(2, dtype=torch.long), torch.arange(2)
    pos, score = torch.arange(2), torch.zeros(2)
    k = torch.randn(2, 32)
    bad = k.clone()
    bad[0, 3] = float("nan")
    with pytest.raises(NonFiniteKVError):
        quantize_into_pages(pool.storage, lay, page, slot, bad, k, pos, score)
    big = k.clone()
    big[1, 0] = -1e6  # min beyond fp16 range
    with pytest.raises(NonFiniteKVError):
        quantize_into_pages(pool.storage, lay, page, slot, k, big, pos, score)


def _step_case(spec, dtype, bsz, heads, nq, head_dim, gen, **overrides):
    """A layer's page table (distinct pages, one column -1: a page the step did not get), per-head
    token counts, a step's left-padded real mask and the [B, H, Q, F] K/V as a model lays them out
    ([B, Q, H, F] transposed: strided)."""
    cfg = KVConfig.parse(spec, **overrides)
    lay = PageLayout.build(cfg, 0, head_dim, dtype)
    t = lay.tokens
    lens = torch.randint(0, 3 * t, (bsz, heads), generator=gen, dtype=torch.int32)
    cols = (int(lens.max()) + nq) // t + 2
    pages = bsz * heads * cols + 1
    pool = PagePool(pages, cfg.page_size)
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=gen, dtype=torch.uint8))
    table = torch.randperm(pages, generator=gen)[: bsz * heads * cols].to(torch.int32).reshape(bsz, heads, cols)
    table[0, 0, (int(lens[0, 0]) + nq - 1) // t] = -1  # the last new token of row 0, head 0 has no page
    real = torch.ones(bsz, nq, dtype=torch.bool)
    for b in range(bsz):
        real[b, : torch.randint(0, nq, (1,), generator=gen).item() if b else 0] = False  # left padding
    real[-1] = False if bsz > 2 else real[-1]  # a finished row stores nothing
    k, v = _data(bsz * nq * heads, head_dim, dtype, gen)
    k = k.reshape(bsz, nq, heads, head_dim).transpose(1, 2)
    v = v.reshape(bsz, nq, heads, head_dim).transpose(1, 2)
    q_pos = (torch.arange(nq) + 40).expand(bsz, nq).to(torch.int32)  # expanded: stride 0 over rows
    return lay, pool, table, lens, real, k, v, q_pos


def _step_reference(pool, lay, table, lens, real, rank, k, v, q_pos, score, low=False):
    """Pool bytes after writing every real token with a page at slot lens[b, h] + rank[b, q]
    (``real``/``rank`` ``[B, Q]``, or per head ``[B, H, Q]``) through the reference
    PagePool.write_rows; ``low``: the tier's pages from the right of the table row."""
    bsz, heads, nq, _ = k.shape
    if real.dim() == 2:
        real, rank = (x.unsqueeze(1).expand(bsz, heads, nq) for x in (real, rank))
    pages, slots, rows = [], [], []
    for b in range(bsz):
        for q in range(nq):
            for h in range(heads):
                if not real[b, h, q]:
                    continue
                slot = int(lens[b, h]) + int(rank[b, h, q])
                col = slot // lay.tokens
                page = int(table[b, h, table.shape[2] - 1 - col if low else col])
                if page < 0:
                    continue
                pages.append(page)
                slots.append(slot % lay.tokens)
                rows.append((k[b, h, q], v[b, h, q], float(score[b, h, q]), int(q_pos[b, q])))
    ref = PagePool(pool.num_pages, pool.page_size)
    ref.storage.copy_(pool.storage)
    if rows:
        kk = torch.stack([r[0] for r in rows])
        vv = torch.stack([r[1] for r in rows])
        sc = torch.tensor([r[2] for r in rows])
        ps = torch.tensor([r[3] for r in rows])
        ref.write_rows(lay, torch.tensor(pages), torch.tensor(slots), lay.encode(kk, vv, sc, ps))
    return ref.storage


@pytest.mark.parametrize("spec,overrides", [("K8V4", {}), ("K4V2", {}), ("FP16", {}), ("K8V4", {"group_size": 16}),
                                            ("K2V1", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nq,score_kind", [(1, "none"), (1, "per_token"), (5, "flat"), (3, "none")])
def test_store_step_tokens_matches_the_reference(spec, overrides, dtype, nq, score_kind):
    """The step store writes each real token of [B, H, Q, F] K/V into slot lens + rank of its
    head's page, byte for byte as the reference write; padding, finished rows and a token whose
    page is missing (-1) are skipped; with one query per row the counts advance by the real flags."""
    from leankit_kernels.quant import store_step_tokens

    gen, seed = fresh_generator()
    bsz, heads, head_dim = 3, 2, 32
    lay, pool, table, lens, real, k, v, q_pos = _step_case(spec, dtype, bsz, heads, nq, head_dim, gen, **overrides)
    rank = torch.cumsum(real.int(), 1) - 1  # int64, as the cache computes it
    score3 = torch.rand(bsz, heads, nq, generator=gen)
    if score_kind == "none":
        score, want_score = None, torch.zeros_like(score3)
    elif score_kind == "per_token":
        score, want_score = score3, score3
    else:  # token order (b Q + q) H + h
        score, want_score = score3.permute(0, 2, 1).reshape(-1).clone(), score3
    want = _step_reference(pool, lay, table, lens, real, rank, k, v, q_pos, want_score)
    want_lens = lens + real[:, :1].int() if nq == 1 else lens.clone()
    err = torch.zeros(1, dtype=torch.int32)
    store_step_tokens(pool.storage, lay, k, v, real, rank, q_pos, lens, table, err, score=score)
    diff = (pool.storage != want).nonzero()
    assert diff.numel() == 0, f"seed {seed}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"
    assert torch.equal(lens, want_lens), f"seed {seed}"
    assert int(err) == 0


@pytest.mark.parametrize("spec,tier", [("K8V4-K4V2", 1), ("K8V4-K4V2", 0), ("K4V2-K2V1", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_step_tokens_per_head_into_a_tier(spec, tier, dtype):
    """A LeanKV prompt's store: each head keeps its own tokens (``real``/``rank`` ``[B, H, Q]``) in
    one tier, the low tier's pages read from the right of the table row; counts left to the caller."""
    from leankit_kernels.quant import store_step_tokens

    gen, seed = fresh_generator()
    bsz, heads, nq, head_dim = 3, 2, 9, 32
    _, _, _, _, real, k, v, q_pos = _step_case("K8V4", dtype, bsz, heads, nq, head_dim, gen)
    cfg = KVConfig.parse(spec)
    lay = PageLayout.build(cfg, tier, head_dim, dtype)
    lens = torch.randint(0, 2 * lay.tokens, (bsz, heads), generator=gen, dtype=torch.int32)
    cols = (int(lens.max()) + nq) // lay.tokens + 1
    # this tier's own pool: its pages hold a different token count than _step_case's K8V4 pool was sized for
    pages = bsz * heads * cols + 1
    pool = PagePool(pages, cfg.page_size)
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=gen, dtype=torch.uint8))
    table = torch.randperm(pages, generator=gen)[: bsz * heads * cols].to(torch.int32).reshape(bsz, heads, cols)
    take = real.unsqueeze(1) & (torch.rand(bsz, heads, nq, generator=gen) < 0.6)  # per head: some pruned
    rank = torch.cumsum(take.int(), -1) - 1
    score = torch.rand(bsz, heads, nq, generator=gen)
    want = _step_reference(pool, lay, table, lens, take, rank, k, v, q_pos, score, low=tier == 1)
    before = lens.clone()
    err = torch.zeros(1, dtype=torch.int32)
    store_step_tokens(pool.storage, lay, k, v, take, rank, q_pos, lens, table, err, score=score, low=tier == 1,
                      update_lens=False)
    diff = (pool.storage != want).nonzero()
    assert diff.numel() == 0, f"seed {seed}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"
    assert torch.equal(lens, before) and int(err) == 0, f"seed {seed}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy sees the NaN too
def test_store_step_tokens_flags_non_finite_values():
    """NaN K/V raise the error flag (read by the caller once per step); padding holding NaN does not."""
    from leankit_kernels.quant import store_step_tokens

    gen, _ = fresh_generator()
    lay, pool, table, lens, real, k, v, q_pos = _step_case("K8V4", torch.float32, 3, 2, 1, 32, gen)
    rank = torch.cumsum(real.int(), 1) - 1
    err = torch.zeros(1, dtype=torch.int32)
    k = k.clone()
    k[2, 1, 0, 5] = float("nan")  # row 2 is finished: never stored, never checked
    store_step_tokens(pool.storage, lay, k, v, real, rank, q_pos, lens.clone(), table, err)
    assert int(err) == 0
    k[1, 0, 0, 3] = float("inf")
    store_step_tokens(pool.storage, lay, k, v, real, rank, q_pos, lens.clone(), table, err)
    assert int(err) == 1


def test_store_step_tokens_rejects_bad_shapes():
    from leankit_kernels.quant import store_step_tokens

    gen, _ = fresh_generator()
    lay, pool, table, lens, real, k, v, q_pos = _step_case("K8V4", torch.float32, 3, 2, 1, 32, gen)
    rank = torch.cumsum(real.int(), 1) - 1
    err = torch.zeros(1, dtype=torch.int32)
    before = pool.storage.clone()
    with pytest.raises(ValueError, match="lens"):
        store_step_tokens(pool.storage, lay, k, v, real, rank, q_pos, lens.long(), table, err)
    with pytest.raises(ValueError, match="real"):
        store_step_tokens(pool.storage, lay, k, v, real[:, :0], rank, q_pos, lens, table, err)
    with pytest.raises(ValueError, match="score"):
        store_step_tokens(pool.storage, lay, k, v, real, rank, q_pos, lens, table, err, score=torch.zeros(5))
    assert torch.equal(pool.storage, before)


@pytest.mark.parametrize("where", ["row", "page", "negative row"])
def test_a_slot_outside_the_pool_raises_and_writes_nothing(where):
    """As the reference's indexing raises: a row past the page's T slots would land in the next
    segment (another token's metadata), a page past the pool outside it."""
    cfg = KVConfig.parse("K8V4")
    lay = PageLayout.build(cfg, 0, 64, torch.float32)
    gen, _ = fresh_generator()
    k = torch.randn(2, 64, generator=gen)
    page, slot = {"row": ([0, 1], [0, lay.tokens]), "page": ([0, 2], [0, 1]), "negative row": ([1, 0], [-1, 3])}[where]
    pool = PagePool(2, cfg.page_size)
    pool.storage.zero_()
    with pytest.raises(IndexError, match="outside the pool"):
        quantize_into_pages(pool.storage, lay, torch.tensor(page), torch.tensor(slot), k, k, torch.tensor([5, 6]),
                            torch.tensor([0.5, 0.5]))
    assert not pool.storage.any()
    with pytest.raises(IndexError, match="outside the pool"):
        dequantize_from_pages(pool.storage, lay, torch.tensor(page), torch.tensor(slot))


@pytest.mark.parametrize("short", ["page", "slot", "pos", "score"])
def test_per_token_tensors_of_another_length_raise_and_write_nothing(short):
    """The kernel reads token ``i``'s page, slot, position and score at index ``i``: one shorter
    than ``k`` would be read past its end (a crash, or garbage rows written), so it raises."""
    cfg = KVConfig.parse("K8V4")
    lay = PageLayout.build(cfg, 0, 32, torch.float32)
    gen, _ = fresh_generator()
    k = torch.randn(5, 32, generator=gen)
    args = {"page": torch.zeros(5, dtype=torch.long), "slot": torch.arange(5), "pos": torch.arange(5),
            "score": torch.rand(5, generator=gen)}
    args[short] = args[short][:2]
    pool = PagePool(2, cfg.page_size)
    pool.storage.zero_()
    with pytest.raises(ValueError, match="one value per token"):
        quantize_into_pages(pool.storage, lay, args["page"], args["slot"], k, k, args["pos"], args["score"])
    assert not pool.storage.any()
    if short in ("page", "slot"):  # reading back: one slot for five pages would broadcast past check_slots
        page, slot = (torch.zeros(5, dtype=torch.long), torch.tensor([1])) if short == "slot" else \
            (torch.zeros(1, dtype=torch.long), torch.arange(5))
        with pytest.raises(ValueError, match="one value per token"):
            dequantize_from_pages(pool.storage, lay, page, slot)


def test_the_in_step_store_never_writes_past_a_full_row():
    """store_step_tokens skips a slot past the head's R pages instead of writing the next head's page."""
    from leankit_kernels.quant import store_step_tokens

    cfg = KVConfig.parse("K8V4")
    lay = PageLayout.build(cfg, 0, 64, torch.float32)
    t = lay.tokens
    gen, _ = fresh_generator()
    pool = PagePool(2, cfg.page_size)
    pool.storage.zero_()
    err = torch.zeros(1, dtype=torch.int32)
    table = torch.tensor([[[0], [1]]], dtype=torch.int32)  # one page a head
    kk = torch.randn(1, 2, 1, 64, generator=gen)
    store_step_tokens(pool.storage, lay, kk, kk, torch.tensor([[True]]), torch.zeros(1, 1, dtype=torch.long),
                      torch.tensor([[111]], dtype=torch.int32), torch.tensor([[t - 1, 0]], dtype=torch.int32), table,
                      err, update_lens=False)
    page1 = pool.storage[1].clone()
    store_step_tokens(pool.storage, lay, kk, kk, torch.tensor([[True]]), torch.zeros(1, 1, dtype=torch.long),
                      torch.tensor([[222]], dtype=torch.int32), torch.tensor([[t, 1]], dtype=torch.int32), table, err,
                      update_lens=False)  # head 0's row is full: its token has nowhere to go
    assert dequantize_from_pages(pool.storage, lay, torch.tensor([1]), torch.tensor([0]))[3].item() == 111
    assert dequantize_from_pages(pool.storage, lay, torch.tensor([1]), torch.tensor([1]))[3].item() == 222
    assert not torch.equal(pool.storage[1], page1)  # head 1's token did land, in its own slot
