"""The compiled CPU kernels (``leankit.native``) against plain-torch dequantization (Eq. 2).

Each kernel is checked on odd shapes and fresh random data: every packable bit width, group sizes
down to one byte of codes, a page stride larger than the rows (codes are a view into pages), a
ragged, sorted head index with heads that own no page, and NaN in the key metadata of slots the
caller masks later. ``tests/test_decode_attention.py`` checks the whole live-page attention with
and without these kernels against the padded-tile reference.
"""

import os
import platform
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from leankit_kernels import testing

from leankit import native
from leankit.quant import unpack

kernels = native.kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler for leankit.native")


SEGMENT_BYTES = {"position": 4, "score": 2}
# Dense side formats (the kernels' ``bits`` for an unquantized side) and the dtype each holds.
DENSE = {fmt: dtype for dtype, fmt in native.DENSE_FORMATS.items()}


def _pool_case(gen, bits, dim, group_size, rows, n_heads, tokens, side="k"):
    """Live pages of one tier scattered over a larger pool, segments at odd (unaligned) offsets.

    Returns ``(pages, lens, q_pos)``: a :class:`~leankit.native.PoolPages` over a random pool with
    a ragged, sorted head index (some heads own no page), the tier's token count per head (a
    head's last page partly dead) and each row's query position. Dead slots hold NaN scale and
    min and arbitrary positions: stale bytes the kernels must never let through. A dense format
    (:data:`DENSE`) has random finite values on live slots, NaN on dead ones, and no metadata."""
    dense = DENSE.get(bits)
    counts = torch.randint(0, 4, (n_heads,), generator=gen)
    counts[int(torch.randint(0, n_heads, (1,), generator=gen))] += 1  # at least one page
    n, groups = int(counts.sum()), dim // group_size
    nb = dim * bits // 8 if dense is None else dim * dense.itemsize
    head = torch.repeat_interleave(torch.arange(n_heads), counts)
    rank = torch.arange(n) - (torch.cumsum(counts, 0) - counts)[head]
    sizes = {f"{side}_data": nb, f"{side}_meta": 0 if dense else 4 * groups, **SEGMENT_BYTES}
    offsets, end = {}, 5
    for name, size in sizes.items():
        offsets[name], end = end, end + tokens * size + 3
    pool_pages = n + 7
    storage = torch.randint(0, 256, (pool_pages, end + 11), dtype=torch.uint8, generator=gen)
    page_id = torch.randperm(pool_pages, generator=gen)[:n]
    dead = torch.randint(0, tokens, (n_heads,), generator=gen) * (counts > 0)
    lens = (counts * tokens - dead).to(torch.int32)
    meta = torch.randn(n, tokens, groups, 2, generator=gen)
    meta[..., 0] = meta[..., 0].abs() / (1 << bits)
    meta = meta.half()
    pos = torch.randint(0, 3 * tokens * 4, (n, tokens), generator=gen, dtype=torch.int32)
    live = torch.arange(tokens) < (lens.long()[head] - rank * tokens).unsqueeze(1)
    meta[~live] = float("nan")

    def write(name, values):
        off = offsets[name]
        view = storage[:, off: off + tokens * sizes[name]]
        view[page_id] = values.contiguous().view(torch.uint8).reshape(n, -1)

    if dense is None:
        write(f"{side}_meta", meta)
    else:
        values = torch.randn(n, tokens, dim, generator=gen).to(dense)
        values[~live] = float("nan")
        write(f"{side}_data", values)
    write("position", pos)
    write("score", torch.randn(n, tokens, generator=gen).half())
    q_pos = torch.randint(0, 3 * tokens * 4, (n_heads, rows), generator=gen, dtype=torch.int32)
    pages = native.PoolPages(storage, page_id, head, rank, tokens, offsets)
    return pages, lens, q_pos


def _segment(pages, name, nbytes):
    """Segment ``name`` of every page, uint8 ``[L, T, nbytes]`` (gathered for the reference)."""
    off = pages.offsets[name]
    return pages.storage[pages.page_id, off: off + pages.tokens * nbytes].view(-1, pages.tokens, nbytes)


def _dequant(pages, side, bits, group_size, dim):
    """fp64 ``[L, T, F]`` values of the pages' ``side`` (Eq. 2, or as stored when dense), NaN on dead slots."""
    if bits in DENSE:
        dtype = DENSE[bits]
        return _segment(pages, f"{side}_data", dim * dtype.itemsize).contiguous().view(dtype).double()
    groups = dim // group_size
    q = unpack(_segment(pages, f"{side}_data", dim * bits // 8), bits).double()  # natural column order
    m = _segment(pages, f"{side}_meta", 4 * groups).contiguous().view(torch.float16).double()
    m = m.view(*q.shape[:2], groups, 2)
    return q * m[..., 0].repeat_interleave(group_size, -1) + m[..., 1].repeat_interleave(group_size, -1)


def _visible(pages, lens, q_pos):
    """bool ``[L, R, T]``: slot holds a stored token whose position is not after the row's query."""
    live = torch.arange(pages.tokens) < (lens.long()[pages.head] - pages.rank * pages.tokens).unsqueeze(1)
    pos = _segment(pages, "position", 4).contiguous().view(torch.int32).squeeze(-1)
    return live.unsqueeze(1) & (pos.unsqueeze(1) <= q_pos[pages.head].unsqueeze(-1)), live, pos


def _scores_ref(pages, lens, q_pos, q, bits, group_size):
    keys = _dequant(pages, "k", bits, group_size, q.shape[-1])
    visible, live, pos = _visible(pages, lens, q_pos)
    s = torch.einsum("lrf,ltf->lrt", q[pages.head].double(), torch.where(live.unsqueeze(-1), keys, 0.0))
    return s.masked_fill(~visible, float("-inf")), live, pos


SHAPES = [(8, 64, 64, 3), (8, 40, 8, 1), (4, 64, 32, 6), (4, 18, 2, 2), (2, 24, 4, 5), (2, 64, 16, 3),
          (1, 32, 8, 2), (1, 72, 24, 4), (2, 128, 64, 4),
          (2, 64, 32, 3), (2, 128, 64, 2), (2, 256, 32, 3),  # 2 bits: AVX2 held sums
          (1, 64, 64, 1),  # 1 bit, whole vectors of codes: the run-time geometry copy, not held
          (4, 64, 2, 40), (8, 256, 8, 64)]  # more rows x head_dim than the stack scratch: allocated
# The geometries the C file compiles its own copies of the page loops for (head_dim, bits, group).
SPECIALIZED = [(d, b, g) for d in (64, 128, 256) for b in (8, 4, 2) for g in (32, 64, 128, 256) if g <= d] + [
    (d, fmt, d) for d in (64, 128, 256) for fmt in sorted(DENSE)]
# Dense sides (fp16, bf16, fp32; one "group" of the whole head): odd head_dims and row counts.
DENSE_SHAPES = [(32, 64, 64, 3), (16, 40, 40, 1), (17, 24, 24, 5), (32, 72, 72, 2), (16, 128, 128, 4),
                (17, 256, 256, 7), (32, 64, 64, 40)]


# Builds beside leankit's own: the architecture's baseline (no ``-march``: no F16C, FMA or AVX),
# whose portable code paths a CPU without those features runs; and on x86-64, AVX2 and FMA
# without AVX-512, whose vector paths differ from both (an AVX-512 machine builds neither).
OTHER_BUILDS = {"portable": [], "avx2": ["-mavx2", "-mfma", "-mf16c"]}


@pytest.fixture(scope="module", params=["native", *OTHER_BUILDS])
def build(request, tmp_path_factory):
    """The kernels as leankit builds them here (``-march=native``), or one of :data:`OTHER_BUILDS`."""
    if kernels is None:
        pytest.skip("no C compiler for leankit.native")
    if request.param == "native":
        return kernels
    if request.param == "avx2" and not (platform.machine() in ("x86_64", "AMD64")
                                        and {"avx2", "fma", "f16c"} <= set(native._cpu_features().split())):
        pytest.skip("this CPU cannot run an AVX2 + FMA + F16C build")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANKIT_CACHE_DIR", str(tmp_path_factory.mktemp(request.param)))
        mp.setattr(native, "ARCH_FLAGS", OTHER_BUILDS[request.param])
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a build that dropped its flags is not that build
            return native.Kernels(native._build(native._compiler()))


def _check_scores(k, bits, dim, group_size, rows, tokens=7):
    gen, seed = testing.fresh_generator()
    n_heads = 5
    pages, lens, q_pos = _pool_case(gen, bits, dim, group_size, rows, n_heads, tokens)
    n = pages.page_id.numel()
    q = torch.randn(n_heads, rows, dim, generator=gen)
    out = torch.full((n, rows, tokens), float("nan"))
    m = torch.full((n_heads, rows), float("-inf"))
    pos_out = torch.zeros(n, tokens, dtype=torch.int32)
    valid_out = torch.zeros(n, tokens, dtype=torch.bool)
    score_out = torch.zeros(n, tokens)
    k.live_scores(pages, q, q_pos, lens, bits, group_size, out, m, pos_out, valid_out, score_out)
    want, live, pos = _scores_ref(pages, lens, q_pos, q, bits, group_size)
    testing.assert_close_normwise(out, want.float(), torch.float32, f"scores (seed {seed})")
    want_m = torch.full((n_heads, rows), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, pages.head.view(-1, 1).expand(-1, rows), want.amax(-1), "amax")
    testing.assert_close_normwise(m, want_m.float(), torch.float32, f"row maxima (seed {seed})")
    assert torch.equal(valid_out, live)
    assert torch.equal(pos_out, pos.masked_fill(~live, torch.iinfo(torch.int32).max))
    stored = _segment(pages, "score", 2).contiguous().view(torch.float16).squeeze(-1).float()
    assert torch.equal(score_out, stored)


def _values_case(gen, bits, dim, group_size, rows, n_heads, tokens):
    """Pass 2's inputs over a :func:`_pool_case` of values: ``(pages, visible, live, scores, shift)``,
    scores ``[L, R, T]`` with ``-inf`` where a slot is not visible and each row's shift above its scores."""
    pages, lens, q_pos = _pool_case(gen, bits, dim, group_size, rows, n_heads, tokens, side="v")
    visible, live, _ = _visible(pages, lens, q_pos)
    scores = (3 * torch.randn(pages.page_id.numel(), rows, tokens, generator=gen)).masked_fill(~visible, float("-inf"))
    shift = torch.randn(n_heads, rows, generator=gen).abs() + 3.0
    return pages, visible, live, scores, shift


def _check_values(k, bits, dim, group_size, rows, tokens=9):
    gen, seed = testing.fresh_generator()
    n_heads = 4
    pages, visible, live, scores, shift = _values_case(gen, bits, dim, group_size, rows, n_heads, tokens)
    l0, acc0 = torch.rand(n_heads, rows, generator=gen), torch.randn(n_heads, rows, dim, generator=gen)
    p, l_sum, acc = scores.clone(), l0.clone(), acc0.clone()
    k.live_values(pages, p, shift, bits, group_size, l_sum, acc)
    want_p = torch.exp(scores.double() - shift.double()[pages.head].unsqueeze(-1))
    testing.assert_close_normwise(p, want_p.float(), torch.float32, f"numerators (seed {seed})")
    assert torch.equal(p == 0, ~visible | (want_p.float() == 0))
    values = torch.where(live.unsqueeze(-1), _dequant(pages, "v", bits, group_size, dim), 0.0)
    per_page = torch.einsum("lrt,ltf->lrf", want_p, values)
    testing.assert_close_normwise(acc, acc0.double().index_add(0, pages.head, per_page).float(), torch.float32,
                                  f"acc (seed {seed})")
    testing.assert_close_normwise(l_sum, l0.double().index_add(0, pages.head, want_p.sum(-1)).float(),
                                  torch.float32, f"l_sum (seed {seed})")


@pytest.mark.parametrize("bits,dim,group_size,rows", SHAPES + DENSE_SHAPES, ids=lambda v: str(v))
def test_live_scores_match_dequantized_dot_products(build, bits, dim, group_size, rows):
    _check_scores(build, bits, dim, group_size, rows)


@pytest.mark.parametrize("bits,dim,group_size,rows", SHAPES + DENSE_SHAPES, ids=lambda v: str(v))
def test_live_values_match_softmax_weighted_dequantized_sum(build, bits, dim, group_size, rows):
    _check_values(build, bits, dim, group_size, rows)


# Pages of more slots than the kernels dequantize at once (TOKEN_BLOCK = 16 in live_attention.c):
# a full block, and two blocks and a part, with the odd head_dims and row counts above.
@pytest.mark.parametrize("tokens", [16, 37])
@pytest.mark.parametrize("bits,dim,group_size,rows", [SHAPES[0], SHAPES[3], SHAPES[8], SHAPES[9], DENSE_SHAPES[2]],
                         ids=lambda v: str(v))
def test_pages_longer_than_a_token_block(build, bits, dim, group_size, rows, tokens):
    _check_scores(build, bits, dim, group_size, rows, tokens)
    _check_values(build, bits, dim, group_size, rows, tokens)


# Pass 1 from 32 query rows on dots a transposed block of keys with many rows at once (score_page's
# rows_key_dots in live_attention.c), the last rows and blocks of few keys as before: row counts with
# and without such a remainder, pages of one block, of a block and a part, and of a few keys.
@pytest.mark.parametrize("rows", [32, 45, 70])
@pytest.mark.parametrize("bits,dim,group_size,tokens", [(4, 64, 32, 37), (2, 72, 24, 16), (8, 128, 64, 21),
                                                         (32, 64, 64, 37), (17, 40, 40, 5)], ids=lambda v: str(v))
def test_many_rows_score_as_the_dequantized_dot_products(build, bits, dim, group_size, tokens, rows):
    _check_scores(build, bits, dim, group_size, rows, tokens)


# Pass 2 takes each page a block of tokens at a time, several rows together, from 2 query rows on
# (value_page_rows in live_attention.c), and a token at a time for one row: the shapes cover
# quantized sides with and without whole vectors of columns, 2-bit sides (the AVX2 build's held
# sums at 1 row), dense sides, and pages of one block and of several.
@pytest.mark.parametrize("rows", [2, 3, 5, 40])
@pytest.mark.parametrize("bits,dim,group_size,tokens", [(4, 64, 32, 37), (2, 64, 32, 9), (8, 40, 8, 37),
                                                         (2, 128, 64, 70), (32, 64, 64, 17), (16, 72, 72, 37),
                                                         (8, 256, 32, 40)], ids=lambda v: str(v))
def test_many_rows_give_each_row_what_it_gets_alone_bit_for_bit(build, bits, dim, group_size, tokens, rows):
    """A long step's chunk of queries (many rows per head) and a decode step (one row) add the
    same products in the same token order, so every row's numerators, sum and weighted values
    from one call over all rows equal, to the bit, that row's own one-row call."""
    gen, seed = testing.fresh_generator()
    n_heads = 4
    pages, _, _, scores, shift = _values_case(gen, bits, dim, group_size, rows, n_heads, tokens)
    acc0 = torch.randn(n_heads, rows, dim, generator=gen)
    p, l_sum, acc = scores.clone(), torch.zeros(n_heads, rows), acc0.clone()
    build.live_values(pages, p, shift, bits, group_size, l_sum, acc)
    for r in range(rows):
        p_r, l_r, acc_r = scores[:, r:r + 1].clone(), torch.zeros(n_heads, 1), acc0[:, r:r + 1].clone()
        build.live_values(pages, p_r, shift[:, r:r + 1].contiguous(), bits, group_size, l_r, acc_r)
        assert torch.equal(p[:, r:r + 1], p_r), f"row {r}: numerators (seed {seed})"
        assert torch.equal(l_sum[:, r:r + 1], l_r), f"row {r}: sums (seed {seed})"
        assert torch.equal(acc[:, r:r + 1], acc_r), f"row {r}: weighted values (seed {seed})"


@pytest.mark.parametrize("dim,bits,group_size", SPECIALIZED, ids=lambda v: str(v))
def test_common_geometries_run_their_compiled_copies_and_match(build, dim, bits, group_size):
    """Every head_dim / bit width / group size that has its own compiled copy of the page loops
    runs it (the generic loop would be several times slower) and matches the reference."""
    assert build.specialized(dim, bits, group_size)
    assert not build.specialized(dim, bits, 16) and not build.specialized(96, bits, 32)
    _check_scores(build, bits, dim, group_size, 3)
    _check_values(build, bits, dim, group_size, 3)


@needs_kernels
def test_numerators_of_extreme_scores():
    """exp over the whole range the softmax meets: 0 at and below the underflow edge (-inf
    included), 1 at 0, and close to exp between: within a few ulp where the CPU has FMA, else
    within an error that grows like |x| (the two halves of ln 2 may be merged), which is below
    1e-7 of the largest numerator everywhere."""
    x = torch.cat([torch.tensor([0.0, -1e-8, -0.5, -1.0, -10.0, -86.9, -87.0, -87.1, -100.0, float("-inf")]),
                   -torch.rand(997) * 90])
    gen, _ = testing.fresh_generator()
    pages, _, _ = _pool_case(gen, 8, 8, 8, 1, 1, x.numel(), side="v")
    pages = native.PoolPages(pages.storage, pages.page_id[:1], pages.head[:1], pages.rank[:1], pages.tokens,
                             pages.offsets)
    p = x.view(1, 1, -1).clone()
    kernels.live_values(pages, p, torch.zeros(1, 1), 8, 8, torch.zeros(1, 1), torch.zeros(1, 1, 8))
    want = torch.exp(x.double())
    want[x < -87.0] = 0.0
    err = (p.view(-1).double() - want).abs()
    rel = (err / want.clamp_min(1e-300) / (1 - x.double()))[want > 0]
    assert rel.max() < 1e-6 and err.max() < 1e-7, f"numerators off by {rel.max():.2e} x (1 + |x|) relative"
    assert (p.view(-1)[x < -87.0] == 0).all() and p.view(-1)[0] == 1.0


@needs_kernels
@pytest.mark.parametrize("first_col,col_step", [(0, 1), (-1, -1)], ids=["high", "low"])
def test_list_pages_reads_the_table_by_rank(first_col, col_step):
    gen, seed = testing.fresh_generator()
    heads, row_len = 7, 9
    table = torch.randint(0, 50, (heads, row_len), generator=gen, dtype=torch.int32)
    counts = torch.randint(0, 5, (heads,), generator=gen, dtype=torch.int32)
    first = first_col % row_len
    storage = torch.zeros(50, 16, dtype=torch.uint8)
    pages = kernels.list_pages(storage, counts, table, first, col_step, 4, {})
    head = torch.repeat_interleave(torch.arange(heads), counts.long())
    rank = torch.arange(head.numel()) - (torch.cumsum(counts.long(), 0) - counts.long())[head]
    assert torch.equal(pages.head, head) and torch.equal(pages.rank, rank), f"seed {seed}"
    assert torch.equal(pages.page_id, table[head, first + col_step * rank].long()), f"seed {seed}"
    with pytest.raises(ValueError, match="outside the page-table row"):
        kernels.list_pages(storage, torch.full((heads,), row_len + 1, dtype=torch.int32), table, first, col_step, 4, {})


@needs_kernels
def test_bad_arguments_raise_and_write_nothing():
    gen, _ = testing.fresh_generator()
    pages, lens, q_pos = _pool_case(gen, 4, 64, 32, 3, 3, 6)
    q = torch.randn(3, 3, 64, generator=gen)
    n = pages.page_id.numel()
    out, m = torch.zeros(n, 3, 6), torch.zeros(3, 3)

    def with_ids(page_id, head=pages.head):
        return native.PoolPages(pages.storage, page_id, head, pages.rank, pages.tokens, pages.offsets)

    outside = pages.page_id.clone()
    outside[-1] = pages.storage.shape[0]
    bad = [(pages, q.double(), q_pos, lens), (pages, q, q_pos.long(), lens), (pages, q, q_pos, lens[:2]),
           (pages, q.transpose(1, 2).contiguous().transpose(1, 2), q_pos, lens), (pages, q[:2], q_pos, lens),
           (with_ids(pages.page_id.int()), q, q_pos, lens)]
    for args in bad:
        with pytest.raises(ValueError):
            kernels.live_scores(*args, 4, 32, out, m)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.live_scores(with_ids(outside), q, q_pos, lens, 4, 32, out, m)
    if n > 1 and pages.head[0] != pages.head[-1]:
        with pytest.raises(ValueError, match="grouped by head"):
            kernels.live_scores(with_ids(pages.page_id.flip(0), pages.head.flip(0)), q, q_pos, lens, 4, 32, out, m)
    with pytest.raises(ValueError):  # a segment reaching past the page
        far = dict(pages.offsets, k_data=pages.storage.shape[1] - 1)
        kernels.live_scores(native.PoolPages(pages.storage, pages.page_id, pages.head, pages.rank, pages.tokens, far),
                            q, q_pos, lens, 4, 32, out, m)
    with pytest.raises(ValueError):
        kernels.live_values(pages, torch.rand(n, 3, 5), m, 4, 32, torch.zeros(3, 3), torch.zeros(3, 3, 64))
    assert not out.any() and not m.any()


def _score_update_case(gen, rows, n_heads, tokens, heads_per_seq):
    pages, lens, _ = _pool_case(gen, 4, 64, 32, rows, n_heads, tokens)
    n, t = pages.page_id.numel(), tokens
    live = torch.arange(t) < (lens.long()[pages.head] - pages.rank * t).unsqueeze(1)
    p = torch.rand(n, rows, t, generator=gen) * (torch.rand(n, rows, t, generator=gen) > 0.2)
    row_weight = torch.rand(n_heads, rows, generator=gen) / rows
    seqs = n_heads // heads_per_seq
    q_last = torch.randint(3 * t * 4, 3 * t * 5, (seqs,), generator=gen)
    q_first = q_last - torch.randint(0, 3, (seqs,), generator=gen)
    has = torch.rand(seqs, generator=gen) > 0.25
    pos = _segment(pages, "position", 4).contiguous().view(torch.int32).squeeze(-1)
    stored = torch.rand(n, t, generator=gen) * 1e-3  # down into fp16's subnormal range
    off = pages.offsets["score"]
    pages.storage[pages.page_id, off: off + 2 * t] = stored.half().view(torch.uint8).view(n, -1)
    stored = stored.half().float()
    return pages, p, row_weight, pos, live, stored, q_first, q_last, has


@needs_kernels
@pytest.mark.parametrize("rows,n_heads,tokens,heads_per_seq", [(3, 6, 7, 3), (1, 4, 5, 1), (8, 9, 17, 3)])
def test_update_scores_matches_the_running_significance_rule(rows, n_heads, tokens, heads_per_seq):
    """The per-slot update written into the pool equals :func:`leankit.policy.update_significance`
    on the received mass, rounded to fp16; dead slots and sequences without a query keep their
    bytes."""
    from leankit.policy import update_significance

    gen, seed = testing.fresh_generator()
    pages, p, w, pos, live, stored, q_first, q_last, has = _score_update_case(gen, rows, n_heads, tokens,
                                                                              heads_per_seq)
    before = pages.storage.clone()
    kernels.update_scores(pages, p, w, pos, live, stored, q_first, q_last, has)
    seq = (pages.head // heads_per_seq).unsqueeze(1)
    received = (p.double() * w.double()[pages.head].unsqueeze(-1)).sum(1)
    new = update_significance(stored.double(), pos, received, q_first[seq], q_last[seq]).half()
    got = _segment(pages, "score", 2).contiguous().view(torch.float16).squeeze(-1)
    keep = ~(live & has[seq])
    old = before[pages.page_id][:, pages.offsets["score"]: pages.offsets["score"] + 2 * tokens].view(-1, tokens, 2)
    assert torch.equal(_segment(pages, "score", 2)[keep], old[keep]), f"untouched slots changed (seed {seed})"
    ulp = torch.finfo(torch.float16).eps * new.float().abs() + 2.0 ** -24  # one fp16 step, subnormals included
    assert ((got.float() - new.float()).abs() <= ulp)[~keep].all(), f"scores (seed {seed})"
    rest = torch.ones(pages.storage.shape[0], dtype=torch.bool)
    rest[pages.page_id] = False
    assert torch.equal(pages.storage[rest], before[rest]), "pages outside the index were written"


@needs_kernels
def test_update_scores_rounds_to_fp16_as_torch_does():
    """With one row of weight 1, an empty score and the query at the token, the new score is the
    received mass itself: its fp16 bytes must be torch's cast, bit for bit (ties, subnormals,
    overflow to infinity)."""
    gen, _ = testing.fresh_generator()
    t = 64
    pages, _, _ = _pool_case(gen, 4, 64, 32, 1, 1, t)
    n = pages.page_id.numel()
    values = torch.cat([torch.tensor([0.0, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -24 * 1.5, 6.1e-5, 65504.0, 65519.0,
                                      65520.0, 1e6, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11]),
                        torch.rand(n * t - 11, generator=gen) * 10.0 ** torch.randint(-9, 4, (n * t - 11,),
                                                                                      generator=gen)])
    p = values.view(n, 1, t)
    pos = torch.full((n, t), 100, dtype=torch.int32)
    q = torch.tensor([100])
    kernels.update_scores(pages, p.contiguous(), torch.ones(1, 1), pos, torch.ones(n, t, dtype=torch.bool),
                          torch.zeros(n, t), q, q, torch.ones(1, dtype=torch.bool))
    got = _segment(pages, "score", 2).contiguous().view(torch.int16).view(-1)
    assert torch.equal(got, values.half().view(torch.int16))


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
    """Each page's scores and each head's maxima, sums and accumulation order do not depend on
    the thread count, so a call split over threads reproduces the one-thread call exactly. Forty
    heads give enough pages for a team of four."""
    gen, seed = testing.fresh_generator()
    n_heads, tokens = 40, 5
    pages, lens, q_pos = _pool_case(gen, bits, dim, group_size, rows, n_heads, tokens)
    vpages = native.PoolPages(pages.storage, pages.page_id, pages.head, pages.rank, tokens,
                              dict(pages.offsets, v_data=pages.offsets["k_data"], v_meta=pages.offsets["k_meta"]))
    n = pages.page_id.numel()
    q = torch.randn(n_heads, rows, dim, generator=gen)
    acc0 = torch.randn(n_heads, rows, dim, generator=gen)

    def both():
        s, m = torch.empty(n, rows, tokens), torch.full((n_heads, rows), float("-inf"))
        kernels.live_scores(pages, q, q_pos, lens, bits, group_size, s, m)
        shift = m.nan_to_num(neginf=0.0)
        l_sum, acc = torch.zeros(n_heads, rows), acc0.clone()
        kernels.live_values(vpages, s, shift, bits, group_size, l_sum, acc)
        return s, m, l_sum, acc

    split = both()
    torch.set_num_threads(1)
    for got, want, name in zip(split, both(), ("numerators", "maxima", "sums", "acc")):
        assert torch.equal(got, want), f"{name} differ across thread counts (seed {seed})"


def _openmp_runtimes() -> list[str]:
    """The OpenMP runtimes mapped into this process: GNU's, LLVM's or Intel's."""
    names = ("libgomp.so", "libomp.so", "libiomp5.so")
    return sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                   if any(n in line.split()[-1].rsplit("/", 1)[-1] for n in names)})


@needs_kernels
@pytest.mark.skipif(not native._torch_libgomp(), reason="torch here does not run on libgomp.so.1")
def test_built_on_torchs_openmp_runtime_and_no_second_one():
    assert kernels.parallel == native._gnu_openmp(native._compiler())
    runtimes = _openmp_runtimes()
    assert len(runtimes) == 1 and runtimes[0].endswith("/libgomp.so.1"), f"OpenMP runtimes mapped: {runtimes}"


def _fake_compiler(tmp_path, name: str, macros: str) -> str:
    """A stand-in compiler that prints ``macros`` for ``-dM -E``."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\nprintf '{macros}'\n")
    path.chmod(0o755)
    return str(path)


def test_only_gcc_builds_on_gnu_openmp(tmp_path):
    gcc = _fake_compiler(tmp_path, "gcc-like", "#define __GNUC__ 12\\n#define __STDC__ 1\\n")
    clang = _fake_compiler(tmp_path, "clang-like", "#define __GNUC__ 4\\n#define __clang__ 1\\n")
    icc = _fake_compiler(tmp_path, "icc-like", "#define __GNUC__ 12\\n#define __INTEL_COMPILER 2021\\n")
    assert native._gnu_openmp(gcc)
    assert not native._gnu_openmp(clang) and not native._gnu_openmp(icc)
    assert not native._gnu_openmp(str(tmp_path / "no-such-compiler"))


@pytest.mark.skipif(shutil.which("clang") is None, reason="no clang here")
def test_a_clang_build_is_serial_and_loads_no_second_openmp_runtime(tmp_path, monkeypatch):
    """Clang's -fopenmp calls LLVM's libomp; next to torch's libgomp that would be a second runtime."""
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path))
    before = _openmp_runtimes()
    built = native.Kernels(native._build(shutil.which("clang")))
    assert not built.parallel
    assert _openmp_runtimes() == before


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


def test_a_cc_that_is_not_on_path_is_said_before_the_fallback(monkeypatch):
    """``$CC`` naming no program warns (naming it) and the usual compilers are tried; a ``$CC``
    that is found, or none set, stays silent."""
    monkeypatch.setenv("CC", "no-such-compiler-xyz -O2")
    with pytest.warns(RuntimeWarning, match="no-such-compiler-xyz"):
        fallback = native._compiler()
    assert fallback is None or "no-such-compiler-xyz" not in fallback
    monkeypatch.delenv("CC")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native._compiler() == fallback
        if fallback is not None:
            monkeypatch.setenv("CC", fallback)
            assert native._compiler() == fallback


def _stand_in_compiler(tmp_path, body: str) -> str:
    """A shell script standing in for the C compiler: it answers the macro probe (``-dM``) at once
    and runs ``body`` for the build."""
    cc = tmp_path / "stand-in-cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *-dM*) exit 0;; esac\n{body}\n')
    cc.chmod(0o755)
    return str(cc)


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_a_compiler_that_never_returns_counts_as_a_failed_build(monkeypatch, tmp_path):
    """A hung compiler must not hang the first decode step: the build times out, leankit warns once
    and runs the torch path."""
    import time

    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path / "builds"))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 2, raising=False)
    cc = _stand_in_compiler(tmp_path, "exec sleep 30")
    monkeypatch.setattr(native, "_compiler", lambda: cc)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="torch path.*did not finish"):
        assert native.kernels() is None
    assert time.monotonic() - start < 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.kernels() is None  # decided once


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_a_failed_build_whose_message_is_not_utf8_warns_and_runs_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path / "builds"))
    monkeypatch.setattr(native, "_state", {})
    cc = _stand_in_compiler(tmp_path, "printf 'fichier introuvable: caf\\351.c error\\n' >&2; exit 1")
    monkeypatch.setattr(native, "_compiler", lambda: cc)
    with pytest.warns(RuntimeWarning, match="torch path.*could not build"):
        assert native.kernels() is None


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_cc_with_arguments_runs_its_program_with_them(monkeypatch, tmp_path):
    """``CC="ccache gcc"`` or ``CC="gcc -m64"`` names a program and its arguments, as make reads it;
    a failed build with nothing on stderr still says why."""
    cc = _stand_in_compiler(tmp_path, 'echo "$@" > "$(dirname "$0")/args"; exit 1')
    monkeypatch.setenv("CC", f"{cc} --wrapped-flag")
    assert native._compiler() == f"{cc} --wrapped-flag"
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path / "builds"))
    monkeypatch.setattr(native, "_state", {})
    with pytest.warns(RuntimeWarning, match="could not build.*exit status 1, no message"):
        assert native.kernels() is None
    assert (tmp_path / "args").read_text().split()[0] == "--wrapped-flag"
    monkeypatch.setenv("CC", "'unbalanced")  # not a command: the next compiler on PATH, as for a missing one
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "cc").symlink_to(cc)
    assert native._compiler() == shlex.join([str(tmp_path / "cc")])


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("LEANKIT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning (README, "Compiled CPU kernels")
        assert native.kernels() is None


@needs_kernels
def test_a_build_that_drops_flags_says_why(monkeypatch, tmp_path):
    """A source that compiles only without the architecture flags still gives a library, and a warning
    with the compiler's error, rather than a silent portable build."""
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path))
    src = tmp_path / "src"
    src.mkdir()
    for path in native.SOURCE_DIR.glob("*.[ch]"):
        (src / path.name).write_bytes(path.read_bytes())
    with open(src / "live_attention.c", "a") as f:
        f.write('\n#ifdef LEANKIT_BROKEN_VECTOR_PATH\n#error "a broken vector path"\n#endif\n')
    monkeypatch.setattr(native, "ARCH_FLAGS", ["-DLEANKIT_BROKEN_VECTOR_PATH"])
    cc = native._compiler()
    with pytest.warns(RuntimeWarning, match="built without -DLEANKIT_BROKEN_VECTOR_PATH.*a broken vector path"):
        built = native._build(cc, src)
    # only the failing flag is dropped: OpenMP stays where it applies
    assert native.Kernels(built).parallel == (native._torch_libgomp() and native._gnu_openmp(cc))


def test_build_is_cached_and_keyed_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path))
    cc = native._compiler()
    first = native._build(cc)
    assert first.parent == tmp_path and native._build(cc) == first  # reused, not rebuilt
    src = tmp_path / "src"
    src.mkdir()
    for path in native.SOURCE_DIR.glob("*.[ch]"):
        (src / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(native, "SOURCE_DIR", src)
    assert native._build(cc) == first  # the same sources elsewhere: the same library
    (src / "fp16.h").write_text((src / "fp16.h").read_text() + "\n/* changed */\n")  # a header counts too
    assert native._build(cc) != first


def test_a_built_library_is_readable_by_other_users_of_a_shared_cache(tmp_path, monkeypatch):
    """mkstemp creates the build's file 0600 and the linker only adds execute bits (0711): another
    user of a shared $LEANKIT_CACHE_DIR could not dlopen it and ran the torch path. The library
    follows the umask, as the converted models do."""
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "one.c").write_text("int lk_one(void) { return 1; }\n")
    monkeypatch.setenv("LEANKIT_CACHE_DIR", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        out = native._build(cc, src)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
