"""The compiled quantize-and-store kernel (``leankit.native``, ``lk_store_tokens``) against the torch
path it replaces on a CPU: :meth:`PageLayout.encode` then :meth:`PagePool.write_rows`, byte for byte.

Each case writes fresh random tokens into random slots of a pool full of random bytes, once per
path, and compares the whole pools: codes, fp16 metadata, scores and positions must be identical
and every byte not written must be untouched.
"""

import pytest
import torch
from leankit_kernels import testing

from leankit import native
from leankit.config import KVConfig
from leankit.pages import SEGMENTS, PageLayout, PagePool
from leankit.quant import NonFiniteKVError

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler for leankit.native")


def _case(gen, spec, dim, n, tier=0, num_pages=13, dense_dtype=torch.float32):
    cfg = KVConfig.parse(spec)
    lay = PageLayout.build(cfg, tier, dim, dense_dtype)
    pool = PagePool(num_pages, cfg.page_size, torch.device("cpu"))
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8, generator=gen))
    flat = torch.randperm(num_pages * lay.tokens, generator=gen)[:n]  # distinct (page, slot) pairs
    page, slot = flat // lay.tokens, flat % lay.tokens
    # Magnitudes from ~3e-4 to ~3e3 per token. The log-scale is bounded: an unbounded exp(3 z) passed
    # 65504 (the fp16 metadata's range) for about one 64-wide token in 2400, and the encoder rightly refused it.
    scale = torch.exp((3 * torch.randn(n, 1, generator=gen)).clamp(-8.0, 8.0))
    k = torch.randn(n, dim, generator=gen) * scale + torch.randn(n, 1, generator=gen)
    v = torch.randn(n, dim, generator=gen) * scale
    k[0, : lay.group_size] = 0.75  # a constant group: scale 0, codes 0
    score = torch.rand(n, generator=gen) * 3
    pos = torch.randint(0, 1 << 20, (n,), generator=gen, dtype=torch.int32)
    return lay, pool, page, slot, k, v, score, pos


def _torch_write(pool, lay, page, slot, k, v, score, pos, keep=None):
    if keep is not None:
        page, slot, k, v, score, pos = (t[keep] for t in (page, slot, k, v, score, pos))
    pool.write_rows(lay, page, slot, lay.encode(k, v, score, pos))


def _torch_written_copy(pool, lay, page, slot, k, v, score, pos, keep=None):
    """A copy of ``pool`` with the tokens written by the torch path, for the native path to match."""
    want = PagePool(pool.num_pages, pool.page_size, pool.device)
    want.storage.copy_(pool.storage)
    _torch_write(want, lay, page, slot, k, v, score, pos, keep)
    return want


def _native_write(pool, lay, page, slot, k, v, score, pos, keep=None):
    if keep is not None:
        page = torch.where(keep, page, torch.full_like(page, -1))
    kernels.store_tokens(pool.storage, lay.tokens, lay.seg_offsets, page, slot, k, v, pos, score,
                         native.side_format(lay.precision.k_bits, lay.dense_dtype),
                         native.side_format(lay.precision.v_bits, lay.dense_dtype), lay.group_size)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# spec, head_dim, group size, tier, model dtype (what a dense side stores: fp32 copied, fp16 and
# bf16 rounded from the fp32 input to nearest even)
CASES = [("K8V4", 64, None, 0, F32), ("K4V2", 64, 32, 0, F32), ("K8V4-K4V2", 128, 64, 1, F32), ("K2V1", 40, 8, 0, F32),
         ("K8V8", 24, None, 0, F32), ("K4V4", 72, 24, 0, F32), ("K1V2", 16, 8, 0, F32),
         ("FP16", 64, None, 0, F32), ("FP16", 40, None, 0, F16), ("FP16", 24, None, 0, BF16),
         ("K16V4", 64, 32, 0, F16), ("K8V16-K4V2", 72, 24, 0, BF16)]


@pytest.mark.parametrize("spec,dim,group_size,tier,dtype", CASES, ids=lambda v: str(v))
def test_store_writes_the_bytes_encode_and_write_rows_write(spec, dim, group_size, tier, dtype):
    gen, seed = testing.fresh_generator()
    spec = spec if group_size is None else f"{spec}:group_size={group_size}"
    lay, pool, page, slot, k, v, score, pos = _case(gen, spec, dim, 29, tier, dense_dtype=dtype)
    want = _torch_written_copy(pool, lay, page, slot, k, v, score, pos)
    _native_write(pool, lay, page, slot, k, v, score, pos)
    for name in SEGMENTS:
        got, ref = pool.segment_view(lay, name), want.segment_view(lay, name)
        assert torch.equal(got, ref), f"segment {name} differs (seed {seed}, {spec}, dim {dim})"
    assert torch.equal(pool.storage, want.storage), f"bytes outside the written slots differ (seed {seed})"


@pytest.mark.parametrize("spec", ["K8V8", "K4V2:group_size=16"])
@pytest.mark.parametrize("magnitude", [1e-5, 1e-6, 1e-7])
def test_groups_with_subnormal_steps_write_the_torch_bytes(spec, magnitude):
    """Tokens whose quantization steps are fp16 subnormals: the scale rounds up there
    (leankit.quant.round_scale_up_if_subnormal), on both paths, byte for byte."""
    gen, seed = testing.fresh_generator()
    lay, pool, page, slot, k, v, score, pos = _case(gen, spec, 64, 29)
    k, v = k * magnitude, v * magnitude
    want = _torch_written_copy(pool, lay, page, slot, k, v, score, pos)
    _native_write(pool, lay, page, slot, k, v, score, pos)
    assert torch.equal(pool.storage, want.storage), f"seed {seed}, {spec}, magnitude {magnitude}"


def test_groups_of_signed_zeros_write_the_torch_bytes():
    """A group holding +0 and -0 stores a +0 minimum (and step) on both paths."""
    gen, seed = testing.fresh_generator()
    lay, pool, page, slot, k, v, score, pos = _case(gen, "K4V2", 64, 21)
    k = torch.where(torch.rand(k.shape, generator=gen) < 0.5, -0.0, 0.0)
    v = torch.where(torch.rand(v.shape, generator=gen) < 0.5, -0.0, 0.0)
    k[::2, 0], v[1::2, 5] = 1.0, 2.0
    want = _torch_written_copy(pool, lay, page, slot, k, v, score, pos)
    _native_write(pool, lay, page, slot, k, v, score, pos)
    assert torch.equal(pool.storage, want.storage), f"seed {seed}"


def test_keep_skips_tokens_and_many_tokens_split_over_threads():
    """A token with ``keep`` false (negative page id) writes nothing; enough tokens for a team of
    threads give the one-thread bytes."""
    gen, seed = testing.fresh_generator()
    lay, pool, page, slot, k, v, score, pos = _case(gen, "K4V2:group_size=32", 64, 600, num_pages=40)
    keep = torch.rand(600, generator=gen) < 0.7
    want = _torch_written_copy(pool, lay, page, slot, k, v, score, pos, keep)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        _native_write(pool, lay, page, slot, k, v, score, pos, keep)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(pool.storage, want.storage), f"seed {seed}"


# (a dense fp32 side has no fp16 metadata: any finite value fits, so "beyond_fp16" needs a quantized V)
@pytest.mark.parametrize("bad,spec", [(bad, spec) for spec in ("K8V4", "FP16", "K16V4")
                                      for bad in ("nan", "inf", "beyond_fp16", "page", "slot")
                                      if not (spec == "FP16" and bad == "beyond_fp16")])
def test_refused_store_raises_and_writes_nothing(bad, spec):
    gen, _ = testing.fresh_generator()
    lay, pool, page, slot, k, v, score, pos = _case(gen, spec, 64, 9)
    before = pool.storage.clone()
    if bad == "nan":
        v[7, 3] = float("nan")
    elif bad == "inf":
        k[8, 60] = float("-inf")
    elif bad == "beyond_fp16":  # finite, but (max - min) / 15 does not fit the fp16 scale
        v[5, :2] = torch.tensor([-6e5, 6e5])
    elif bad == "page":
        page[4] = pool.num_pages
    else:
        slot[4] = lay.tokens
    with pytest.raises(NonFiniteKVError if bad in ("nan", "inf", "beyond_fp16") else ValueError):
        _native_write(pool, lay, page, slot, k, v, score, pos)
    assert torch.equal(pool.storage, before)
    with pytest.raises(ValueError):  # wrong dtypes or shapes are refused before the kernel runs
        kernels.store_tokens(pool.storage, lay.tokens, lay.seg_offsets, page, slot, k.double(), v, pos, score,
                             8, 4, 64)
    with pytest.raises(ValueError):
        kernels.store_tokens(pool.storage, lay.tokens, lay.seg_offsets, page, slot, k, v, pos, score, 3, 4, 64)


@pytest.mark.parametrize("spec,dim,tier", [("K8V4-K4V2:group_size=32", 64, 1), ("K4V2:group_size=2", 64, 0),
                                           ("K1V1:group_size=4", 24, 0),
                                           ("K8V4-K2V1:group_size=16,low_group_size=2", 32, 1)])
def test_pool_write_tokens_takes_the_same_path_on_both_sides_of_the_switch(spec, dim, tier, monkeypatch):
    """``PagePool.write_tokens`` gives the same pool bytes with the compiled kernels present and with
    the torch path (``LEANKIT_NATIVE=0``), ``keep`` mask included. The compiled store packs each
    quantization group into bytes of its own, so a group whose codes do not fill whole bytes (2-bit
    codes in groups of 2, 1-bit in groups of 4) goes to the torch path, which packs across groups."""
    gen, seed = testing.fresh_generator()
    lay, pool, page, slot, k, v, score, pos = _case(gen, spec, dim, 31, tier)
    keep = torch.rand(31, generator=gen) < 0.5
    torch_pool = PagePool(pool.num_pages, pool.page_size, pool.device)
    torch_pool.storage.copy_(pool.storage)
    pool.write_tokens(lay, page, slot, k, v, score, pos, keep=keep)
    monkeypatch.setattr(native, "_state", {"kernels": None})
    torch_pool.write_tokens(lay, page, slot, k, v, score, pos, keep=keep)
    assert torch.equal(pool.storage, torch_pool.storage), f"seed {seed}"


@pytest.mark.parametrize("spec", ["K4V2:group_size=2",
                                  "K8V4-K2V1:group_size=16,low_group_size=2,compress_every=1,th=0.5,window=4"])
def test_generate_with_groups_that_do_not_fill_bytes(spec, monkeypatch):
    """A config whose groups do not fill whole bytes of codes generates on the CPU with the compiled
    kernels present, and gives the tokens it gives without them (the two-tier config moves most
    tokens to its low tier, whose groups are the short ones)."""
    from leankit import LeanCache
    from leankit.hf import cache_kwargs
    from leankit.testing import left_padded_batch, tiny_model

    model = tiny_model("llama-mha", hidden_size=256)  # head_dim 64
    ids, mask = left_padded_batch(3, 19)
    outs, caches = [], []
    for kernels_on in (True, False):
        if not kernels_on:
            monkeypatch.setattr(native, "_state", {"kernels": None})
        caches.append(LeanCache(model, spec))
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                       pad_token_id=0, **cache_kwargs(model, caches[-1])))
    assert outs[0].shape == (3, 19 + 24)
    if "low_group_size" in spec:
        assert caches[0].memory_report()["tokens_per_tier"]["low"] > 0
    assert torch.equal(outs[0], outs[1])


def _step_case(gen, spec, dim, batch, heads, row_len=4, low=False):
    """A pool of random bytes, a page table whose rows own pages in random order (the tier's
    columns from the left, or from the right with ``low``), token counts that put the next slot
    anywhere in the owned pages, and a decode step's tokens, some of whose rows are not real."""
    cfg = KVConfig.parse(spec)
    lay = PageLayout.build(cfg, 0, dim, torch.float32)
    num_pages = batch * heads * row_len + 7
    pool = PagePool(num_pages, cfg.page_size, torch.device("cpu"))
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, dtype=torch.uint8, generator=gen))
    owned = torch.randint(1, row_len + 1, (batch, heads), generator=gen)
    ids = torch.randperm(num_pages, generator=gen)[: batch * heads * row_len].view(batch, heads, row_len)
    table = torch.full((batch, heads, row_len), -1, dtype=torch.int32)
    first, step = (row_len - 1, -1) if low else (0, 1)
    for b in range(batch):
        for h in range(heads):
            for j in range(int(owned[b, h])):
                table[b, h, first + step * j] = ids[b, h, j]
    lens = (torch.rand(batch, heads, generator=gen) * owned * lay.tokens).long().clamp_max(owned * lay.tokens - 1)
    lens = lens.to(torch.int32)
    k = torch.randn(batch, heads, 1, dim, generator=gen) * 3
    v = torch.randn(batch, heads, 1, dim, generator=gen)
    q_pos = torch.randint(0, 1 << 20, (batch,), generator=gen)
    real = torch.rand(batch, generator=gen) < 0.7
    real[0] = True
    score = torch.rand(batch, heads, 1, generator=gen) * 2
    return lay, pool, table, first, step, lens, k, v, q_pos, real, score


def _store_step(pool, lay, table, first, step, lens, k, v, q_pos, real, score):
    kernels.store_step(pool.storage, table, first, step, lens, lay.tokens, lay.seg_offsets, k, v, q_pos, real, score,
                       native.side_format(lay.precision.k_bits, lay.dense_dtype),
                       native.side_format(lay.precision.v_bits, lay.dense_dtype), lay.group_size)


@pytest.mark.parametrize("spec,dim,low,with_score", [("K8V4", 64, False, True), ("K4V2:group_size=32", 64, True, True),
                                                      ("FP16", 40, False, False), ("K2V1:group_size=8", 24, True, False)])
def test_store_step_finds_each_slot_from_the_table_and_advances_the_counts(spec, dim, low, with_score):
    """``store_step`` (a decode step's store of one layer in one call) writes each real row's token
    where the torch path writes it, slot ``lens`` of the page in the tier's column of its rank,
    advances the counts of real rows only, and leaves every other byte as it was."""
    gen, seed = testing.fresh_generator()
    batch, heads = 5, 3
    lay, pool, table, first, step, lens, k, v, q_pos, real, score = _step_case(gen, spec, dim, batch, heads, low=low)
    score = score if with_score else None
    b_idx, h_idx = (i.reshape(-1) for i in torch.meshgrid(torch.arange(batch), torch.arange(heads), indexing="ij"))
    keep = real[b_idx]
    slot = lens.reshape(-1).long()
    page = table[b_idx, h_idx, first + step * (slot // lay.tokens)]
    want = _torch_written_copy(pool, lay, page, slot % lay.tokens, k.reshape(-1, dim), v.reshape(-1, dim),
                               torch.zeros(batch * heads) if score is None else score.reshape(-1),
                               q_pos[b_idx].to(torch.int32), keep)
    lens_before = lens.clone()
    _store_step(pool, lay, table, first, step, lens, k, v, q_pos, real, score)
    assert torch.equal(pool.storage, want.storage), f"seed {seed}, {spec}"
    assert torch.equal(lens, lens_before + real.view(-1, 1).to(torch.int32)), f"seed {seed}"


@pytest.mark.parametrize("bad", ["nan", "no_page", "full_row"])
def test_refused_store_step_writes_nothing_and_keeps_the_counts(bad):
    gen, _ = testing.fresh_generator()
    lay, pool, table, first, step, lens, k, v, q_pos, real, score = _step_case(gen, "K8V4", 64, 4, 2)
    real[:] = True
    if bad == "nan":
        v[3, 1, 0, 5] = float("nan")
    elif bad == "no_page":  # the next slot starts a page the row does not own
        table[2, 0, 1:] = -1
        lens[2, 0] = lay.tokens
    else:  # the next slot lies past the last column of the row
        lens[1, 1] = table.shape[-1] * lay.tokens
    pool_before, lens_before = pool.storage.clone(), lens.clone()
    with pytest.raises(NonFiniteKVError if bad == "nan" else ValueError):
        _store_step(pool, lay, table, first, step, lens, k, v, q_pos, real, score)
    assert torch.equal(pool.storage, pool_before) and torch.equal(lens, lens_before)
    with pytest.raises(ValueError, match="store_step"):  # wrong shapes are refused before the kernel runs
        _store_step(pool, lay, table, first, step, lens[:, :1], k, v, q_pos, real, score)
