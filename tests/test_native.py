"""The compiled CPU kernels (``leankit.native``) against plain-torch dequantization (Eq. 2).

Each kernel is checked on odd shapes and fresh random data: every packable bit width, group sizes
down to one byte of codes, a page stride larger than the rows (codes are a view into pages), a
ragged, sorted head index with heads that own no page, and NaN in the key metadata of slots the
caller masks later. ``tests/test_decode_attention.py`` checks the whole live-page attention with
and without these kernels against the padded-tile reference.
"""

import warnings
from pathlib import Path

import pytest
import torch
from leankit_kernels import testing

from leankit import native
from leankit.quant import unpack

kernels = native.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler for leankit.native")


def _case(gen, bits, dim, group_size, rows, n_heads, tokens):
    """Codes as a strided view into fake pages, fp32 meta ``[L, T, 2G]``, a sorted head index."""
    counts = torch.randint(0, 4, (n_heads,), generator=gen)
    counts[int(torch.randint(0, n_heads, (1,), generator=gen))] += 1  # at least one page
    head = torch.repeat_interleave(torch.arange(n_heads), counts)
    n, nb, groups = int(counts.sum()), dim * bits // 8, dim // group_size
    pages = torch.randint(0, 256, (n, tokens * nb + 37), dtype=torch.uint8, generator=gen)
    codes = pages[:, 5: 5 + tokens * nb].view(n, tokens, nb)  # page stride tokens * nb + 37
    meta = torch.randn(n, tokens, groups, 2, generator=gen)
    meta[..., 0] = meta[..., 0].abs() / (1 << bits)
    return head, codes, meta.reshape(n, tokens, 2 * groups).contiguous()


def _dequant(codes, meta, bits, group_size):
    n, tokens, _ = codes.shape
    q = unpack(codes, bits).float()  # [L, T, F], natural column order
    m = meta.view(n, tokens, -1, 2)
    scale = m[..., 0].repeat_interleave(group_size, -1)
    low = m[..., 1].repeat_interleave(group_size, -1)
    return q * scale + low


SHAPES = [(8, 64, 64, 3), (8, 40, 8, 1), (4, 64, 32, 6), (4, 18, 2, 2), (2, 24, 4, 5), (2, 64, 16, 3),
          (1, 32, 8, 2), (1, 72, 24, 4),
          (4, 64, 2, 40), (8, 256, 8, 64)]  # more (row, group) sums than head_dim: the scratch must fit them


@needs_kernels
@pytest.mark.parametrize("bits,dim,group_size,rows", SHAPES, ids=lambda v: str(v))
def test_key_scores_match_dequantized_dot_products(bits, dim, group_size, rows):
    gen, seed = testing.fresh_generator()
    n_heads, tokens = 5, 7
    head, codes, meta = _case(gen, bits, dim, group_size, rows, n_heads, tokens)
    q = torch.randn(n_heads, rows, dim, generator=gen)
    out = torch.full((head.numel(), rows, tokens), float("nan"))
    kernels.key_scores(q, head, codes, meta, out, bits, group_size)
    want = torch.einsum("lrf,ltf->lrt", q[head].double(), _dequant(codes, meta, bits, group_size).double())
    testing.assert_close_normwise(out, want.float(), torch.float32, f"scores (seed {seed})")


@needs_kernels
@pytest.mark.parametrize("bits,dim,group_size,rows", SHAPES, ids=lambda v: str(v))
def test_value_accumulate_matches_dequantized_weighted_sum(bits, dim, group_size, rows):
    gen, seed = testing.fresh_generator()
    n_heads, tokens = 4, 9
    head, codes, meta = _case(gen, bits, dim, group_size, rows, n_heads, tokens)
    p = torch.rand(head.numel(), rows, tokens, generator=gen)
    p[p < 0.2] = 0.0  # masked slots
    acc0 = torch.randn(n_heads, rows, dim, generator=gen)
    acc = kernels.value_accumulate(p, head, codes, meta, acc0.clone(), bits, group_size)
    per_page = torch.einsum("lrt,ltf->lrf", p.double(), _dequant(codes, meta, bits, group_size).double())
    want = acc0.double().index_add(0, head, per_page)
    testing.assert_close_normwise(acc, want.float(), torch.float32, f"acc (seed {seed})")


@needs_kernels
def test_nan_key_metadata_stays_in_its_own_slot():
    """Dead slots may hold NaN scale/min (stale bytes); the caller masks their scores afterwards,
    so the kernel must not let them leak into any other slot."""
    gen, _ = testing.fresh_generator()
    head, codes, meta = _case(gen, 4, 64, 32, 3, 3, 6)
    meta[:, 4:] = float("nan")
    q = torch.randn(3, 3, 64, generator=gen)
    out = kernels.key_scores(q, head, codes, meta, torch.empty(head.numel(), 3, 6), 4, 32)
    assert torch.isnan(out[..., 4:]).all() and torch.isfinite(out[..., :4]).all()


@needs_kernels
def test_bad_arguments_raise_and_write_nothing():
    gen, _ = testing.fresh_generator()
    head, codes, meta = _case(gen, 4, 64, 32, 3, 3, 6)
    q = torch.randn(3, 3, 64, generator=gen)
    out = torch.zeros(head.numel(), 3, 6)
    bad = [(q.double(), head, codes, meta, out), (q, head.int(), codes, meta, out),
           (q.transpose(1, 2).contiguous().transpose(1, 2), head, codes, meta, out),
           (q, head, codes, meta[:, :, :2].contiguous(), out), (q, head, codes, meta, out[:, :2]),
           (q[..., :32].contiguous(), head, codes, meta, out)]
    for args in bad:
        with pytest.raises(ValueError):
            kernels.key_scores(*args, 4, 32)
    with pytest.raises(ValueError):
        kernels.value_accumulate(torch.rand(head.numel(), 3, 5), head, codes, meta, torch.zeros(3, 3, 64), 4, 32)
    assert not out.any()


@pytest.fixture
def four_threads():
    """Four torch threads (the kernels' team), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("bits,dim,group_size,rows", [(4, 64, 32, 3), (2, 40, 8, 5), (8, 24, 24, 1)])
def test_split_over_threads_gives_the_one_thread_result_bit_for_bit(four_threads, bits, dim, group_size, rows):
    """Each page's scores and each head's accumulation order do not depend on the thread count,
    so a call split over threads reproduces the one-thread call exactly. Forty heads give enough
    pages for a team of four."""
    gen, seed = testing.fresh_generator()
    n_heads, tokens = 40, 5
    head, codes, meta = _case(gen, bits, dim, group_size, rows, n_heads, tokens)
    q = torch.randn(n_heads, rows, dim, generator=gen)
    p = torch.rand(head.numel(), rows, tokens, generator=gen)
    acc0 = torch.randn(n_heads, rows, dim, generator=gen)

    def both():
        return (kernels.key_scores(q, head, codes, meta, torch.empty(head.numel(), rows, tokens), bits, group_size),
                kernels.value_accumulate(p, head, codes, meta, acc0.clone(), bits, group_size))

    split = both()
    torch.set_num_threads(1)
    for got, want, name in zip(split, both(), ("scores", "acc")):
        assert torch.equal(got, want), f"{name} differ across thread counts (seed {seed})"


@needs_kernels
def test_value_side_with_an_unsorted_head_index_is_still_exact(four_threads):
    """Two threads must never add into one head's accumulator: an unsorted index runs on one."""
    gen, seed = testing.fresh_generator()
    head, codes, meta = _case(gen, 4, 64, 32, 3, 40, 6)
    order = torch.randperm(head.numel(), generator=gen)
    head, codes, meta = head[order].contiguous(), codes[order], meta[order].contiguous()
    p = torch.rand(head.numel(), 3, 6, generator=gen)
    acc = kernels.value_accumulate(p, head, codes, meta, torch.zeros(40, 3, 64), 4, 32)
    per_page = torch.einsum("lrt,ltf->lrf", p.double(), _dequant(codes, meta, 4, 32).double())
    want = torch.zeros(40, 3, 64, dtype=torch.float64).index_add(0, head, per_page)
    testing.assert_close_normwise(acc, want.float(), torch.float32, f"acc (seed {seed})")


@needs_kernels
@pytest.mark.skipif(not native._torch_libgomp(), reason="torch here does not run on libgomp.so.1")
def test_built_on_torchs_openmp_runtime_and_no_second_one():
    maps = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line]
    assert kernels.parallel
    assert len(set(maps)) == 1, f"two OpenMP runtimes mapped: {sorted(set(maps))}"


def test_without_a_compiler_leankit_warns_once_and_runs_the_torch_path(monkeypatch):
    from leankit import decode_attention
    from leankit.attention import paged_attention_ref

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="torch path"):
        assert native.kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.kernels() is None  # decided once
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [50, 21], 2, 3, 1, group_size=32, low_frac=0.5)
    out, lse = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125)
    ref_out, ref_lse = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=4)
    testing.assert_close_normwise(out, ref_out, torch.float32, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("LEANKIT_NATIVE", "0")
    assert native.kernels() is None


@needs_kernels
def test_build_is_cached_and_keyed_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path))
    cc = native._compiler()
    first = native._build(cc)
    assert first.parent == tmp_path and native._build(cc) == first  # reused, not rebuilt
    src = tmp_path / "live_attention.c"
    src.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(native, "SOURCE", src)
    assert native._build(cc) != first
