import copy

import pytest
import torch

import leankit.pages as pages_mod
from leankit.config import KVConfig
from leankit.pages import SEGMENTS, PageLayout, PagePool
from leankit.quant import dequantize, quantize

SPECS = ["FP16", "K8V8", "K8V4", "K4V2", "K4V1", "K4V8", "K2V4"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_layout_arithmetic(spec, head_dim, dtype):
    cfg = KVConfig.parse(spec)
    lay = PageLayout.build(cfg, 0, head_dim, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert lay.tokens == cfg.tokens_per_page(head_dim, dense_itemsize=itemsize)
    # segments are 16-byte aligned, in order, disjoint, inside the page
    ends = []
    for off, nb in zip(lay.seg_offsets, lay.seg_bytes):
        assert off % 16 == 0
        ends.append(off + lay.tokens * nb)
    for i in range(1, len(SEGMENTS)):
        assert lay.seg_offsets[i] >= ends[i - 1]
    assert ends[-1] <= cfg.page_size
    # one more token would not fit
    tb = lay.seg_bytes
    assert sum(-(-(lay.tokens + 1) * s // 16) * 16 for s in tb) > cfg.page_size
    assert lay.token_bytes == cfg.token_bytes(head_dim, dense_itemsize=itemsize).total


@pytest.mark.parametrize("spec", SPECS)
def test_write_and_decode_roundtrip(spec):
    cfg = KVConfig.parse(spec, group_size=16)
    lay = PageLayout.build(cfg, 0, 64, torch.float32)
    pool = PagePool(5, cfg.page_size)
    pool.storage.random_(0, 256)  # stale garbage everywhere
    n = lay.tokens + 3
    page = torch.tensor([3] * lay.tokens + [1, 1, 1])
    slot = torch.cat([torch.randperm(lay.tokens), torch.tensor([0, 2, 1])])
    k, v = torch.randn(n, 64), torch.randn(n, 64)
    score, pos = torch.rand(n), torch.randint(0, 10_000, (n,))
    pool.write_rows(lay, page, slot, lay.encode(k, v, score, pos))
    pages = pool.gather(torch.tensor([3, 1]))
    kd, vd, sd, pd = lay.decode(pages)
    got_k = torch.stack([kd[0 if p == 3 else 1, s] for p, s in zip(page.tolist(), slot.tolist())])
    got_v = torch.stack([vd[0 if p == 3 else 1, s] for p, s in zip(page.tolist(), slot.tolist())])
    got_p = torch.stack([pd[0 if p == 3 else 1, s] for p, s in zip(page.tolist(), slot.tolist())])
    got_s = torch.stack([sd[0 if p == 3 else 1, s] for p, s in zip(page.tolist(), slot.tolist())])

    def expect(x, bits):
        if bits == 16:
            return x
        return dequantize(*quantize(x, bits, 16), bits)

    assert torch.equal(got_k, expect(k, cfg.high.k_bits))
    assert torch.equal(got_v, expect(v, cfg.high.v_bits))
    assert torch.equal(got_p, pos.int())
    assert torch.equal(got_s, score.half().float())


def test_pool_grow_keeps_bytes():
    pool = PagePool(3, 256)
    pool.storage.random_(0, 256)
    before = pool.storage.clone()
    pool.grow(7)
    assert pool.num_pages == 7 and torch.equal(pool.storage[:3], before)


def test_cpu_pool_grows_inside_its_reserve_without_moving_pages():
    pool = PagePool(3, 256)
    pool.storage.random_(0, 256)
    pool.grow(5)  # past the first (exact) allocation: the pages move once, into a reserve
    first = pool.storage.clone()
    base = pool.storage.data_ptr()
    for n in range(6, 5 * pages_mod.CPU_RESERVE_FACTOR + 1):
        pool.grow(n)
        pool.storage[n - 1].fill_(n % 256)
        assert pool.storage.shape == (n, 256) and pool.storage.is_contiguous()
        assert pool.storage.data_ptr() == base  # a wider view, no copy
    assert torch.equal(pool.storage[:5], first)
    pool.grow(5 * pages_mod.CPU_RESERVE_FACTOR + 1)  # past the reserve: one move, bytes kept
    assert pool.storage.data_ptr() != base and torch.equal(pool.storage[:5], first)
    assert all(int(pool.storage[n - 1, 0]) == n % 256 for n in range(6, 5 * pages_mod.CPU_RESERVE_FACTOR + 1))
    pool.grow(4)  # never shrinks
    assert pool.num_pages == 5 * pages_mod.CPU_RESERVE_FACTOR + 1


def test_pool_grows_exactly_when_the_reserve_is_refused(monkeypatch):
    monkeypatch.setattr(pages_mod, "CPU_RESERVE_FACTOR", 1 << 50)  # more address space than exists
    pool = PagePool(2, 256)
    pool.storage.random_(0, 256)
    before = pool.storage.clone()
    pool.grow(9)
    assert pool.storage.shape == (9, 256) and torch.equal(pool.storage[:2], before)
    assert pool.storage.untyped_storage().nbytes() == 9 * 256


def test_pool_copies_carry_its_pages_not_its_reserve():
    pool = PagePool(2, 256)
    pool.grow(3)
    pool.storage.random_(0, 256)
    assert pool.storage.untyped_storage().nbytes() > 3 * 256  # the reserve behind the view
    twin = copy.deepcopy(pool)
    assert torch.equal(twin.storage, pool.storage) and twin.storage.untyped_storage().nbytes() == 3 * 256
    twin.grow(4)
    twin.storage[3].fill_(7)
    assert torch.equal(twin.storage[:3], pool.storage) and pool.num_pages == 3


def test_a_pool_past_int32_page_ids_or_past_memory_is_refused_in_leankit_terms():
    with pytest.raises(ValueError, match="more than page ids can address"):
        PagePool(pages_mod.MAX_PAGES + 1, 256)
    pool = PagePool(2, 256)
    with pytest.raises(ValueError, match="int32"):
        pool.grow(2 ** 40)
    assert pool.num_pages == 2  # the refused grow left the pool as it was
    # more bytes than any machine has (and more than the OS will map), within the page-id bound
    with pytest.raises(RuntimeError, match=r"cannot allocate a page pool of 2147483647 pages x 1048576 B"):
        PagePool(pages_mod.MAX_PAGES, 1 << 20)
    big = PagePool(2, 1 << 20)
    with pytest.raises(RuntimeError, match=r"cannot allocate a page pool of 2147483647 pages"):
        big.grow(pages_mod.MAX_PAGES)
    assert big.num_pages == 2


def test_k4v2_page_holds_about_twice_k8v4():
    cfg = KVConfig.parse("K8V4-K4V2")
    hi = PageLayout.build(cfg, 0, 64, torch.float16)
    lo = PageLayout.build(cfg, 1, 64, torch.float16)
    assert lo.tokens > hi.tokens and 1.6 <= lo.tokens / hi.tokens <= 2.0


def test_layout_hash_is_memoized_but_not_pickled():
    """A layout's hash is computed once (launchers look constants up by layout at every launch),
    equals the hash of an equal layout, and is not carried into a pickle (dtype hashes are per
    process)."""
    import pickle

    cfg = KVConfig.parse("K8V4-K4V2")
    a = PageLayout.build(cfg, 0, 64, torch.float16)
    b = PageLayout.build(cfg, 0, 64, torch.float16)
    assert a is not b and a == b and hash(a) == hash(b) == hash(a)
    assert {a: 1}[b] == 1
    c = pickle.loads(pickle.dumps(a))
    assert c == a and "_hash" not in c.__dict__ and hash(c) == hash(a)
    assert copy.deepcopy(a) == a
    assert PageLayout.build(cfg, 1, 64, torch.float16) != a


def test_page_table_row_holds_max_seq_len_when_low_pages_hold_fewer_tokens():
    """A small low_group_size gives the low tier more metadata per token than the high one, so a
    low page holds fewer tokens (2 against 6 here): the page-table row, sized by the high tier's
    pages alone, overflowed ('raise max_seq_len') for a 90-token prompt under max_seq_len=100 once
    the prompt phase moved its tokens low."""
    from leankit.cache import LeanCache
    from leankit.testing import tiny_model

    model = tiny_model("llama-mha")  # head_dim 16
    cache = LeanCache(model, "K8V4-K4V2", page_size=256, max_seq_len=100, low_group_size=2, th=0.99, tl=0.0,
                      window=1, compress_every=1)
    assert cache.layouts[1].tokens < cache.layouts[0].tokens
    ids = torch.randint(3, 97, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        for t in range(8):
            model(input_ids=ids[:, t : t + 1], past_key_values=cache)
    lens = cache.table.lens
    assert int(lens[1].sum()) > 0 and bool((lens.sum(0) == 98).all())


@pytest.mark.parametrize("n,digits,want", [(0, 1, "0 B"), (1023, 1, "1023 B"), (1024, 1, "1.0 KiB"),
                                           (1536 * 1024, 1, "1.5 MiB"), (3 * 2**30, 2, "3.00 GiB"),
                                           (2**50, 1, "1048576.0 GiB"), (-2048, 1, "-2.0 KiB")])
def test_format_bytes_is_the_one_size_format(n, digits, want):
    """Every printed size (memory report, CLI lines, offload report, pool errors) reads the same:
    whole bytes, then one decimal in KiB and MiB, GiB at the caller's precision and never beyond."""
    assert pages_mod.format_bytes(n, gib_digits=digits) == want
