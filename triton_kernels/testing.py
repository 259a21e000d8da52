"""Builders of filled unified-page caches for the kernel tests and benchmarks.

They use only leankit's own reference machinery (``BidirectionalPageTable.grow``,
``PageLayout.encode``, ``PagePool.write_rows``), so a kernel compared against
:mod:`leankit.attention` on these caches is compared against the format's source of truth.
Also the tolerances, reference comparisons and poisoning fixture body the kernel tests share.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from leankit.allocator import FreePageList
from leankit.attention import PagedKV, paged_attention_ref
from leankit.config import KVConfig
from leankit.page_table import BidirectionalPageTable
from leankit.pages import PageLayout, PagePool

from . import tiles


@dataclass
class FilledCache:
    """A hand-filled layer cache: the :class:`PagedKV` view plus what built it."""

    kv: PagedKV
    cfg: KVConfig
    free_list: FreePageList
    ctx: torch.Tensor  # int [B]: positions 0 .. ctx[b]-1 existed (some may be pruned)


def build_paged_kv(spec: str, batch: int, kv_heads: int, head_dim: int, ctx, *, dtype=torch.float32,
                   low_frac: float = 0.5, prune_frac: float = 0.0, layers: int = 2, layer: int = 1,
                   group_size: int | None = None, low_group_size: int | None = None,
                   page_size: int | None = None, spare_pages: int = 3,
                   generator: torch.Generator | None = None, device="cpu", scale_k: float = 2.0,
                   scale_v: float = 1.0, fill: int | None = 0xFF) -> FilledCache:
    """Fill layer ``layer`` of a fresh cache with random tokens, per-head tier mixes and pruning.

    ``ctx`` (int or ``[B]``) is each sequence's context length; token ``j`` of head ``(b, h)`` has
    position ``j``. With two tiers, each head sends a random ``~low_frac`` of its tokens to the low
    tier (a different mix per head), ``prune_frac`` of tokens are dropped, and slot order inside a
    tier is shuffled (masking must go by stored position, not slot). The pool starts as ``fill``
    bytes (default ``0xFF``: NaN in every float segment, position ``-1`` -- visible to every query
    unless the slot mask works) or random bytes (``fill=None``), so dead slots hold poison; the free
    ring is shuffled so page ids are scattered.
    """
    gen = generator or torch.Generator().manual_seed(0)
    overrides = {"group_size": group_size, "low_group_size": low_group_size}  # None: the config defaults
    if page_size is not None:
        overrides["page_size"] = page_size
    cfg = KVConfig.parse(spec, **overrides)
    layouts = tuple(PageLayout.build(cfg, t, head_dim, dtype) for t in range(len(cfg.tiers)))
    two = len(layouts) > 1
    ctx = torch.as_tensor(ctx).reshape(-1).expand(batch).clone() if torch.as_tensor(ctx).numel() == 1 \
        else torch.as_tensor(ctx).reshape(-1)
    max_ctx = int(ctx.max())
    th = layouts[0].tokens
    row_len = math.ceil(max(max_ctx, 1) / th) + 1
    # Per head: which positions survive and in which tier.
    plan = {}
    for b in range(batch):
        for h in range(kv_heads):
            n = int(ctx[b])
            keep = torch.rand(n, generator=gen) >= prune_frac
            pos = torch.arange(n)[keep]
            if two:
                lf = low_frac * float(torch.rand(1, generator=gen)) * 2 if low_frac > 0 else 0.0
                low = torch.rand(pos.numel(), generator=gen) < min(lf, 1.0)
            else:
                low = torch.zeros(pos.numel(), dtype=torch.bool)
            tiers = []
            for t in range(len(layouts)):
                p = pos[low] if t == 1 else pos[~low]
                tiers.append(p[torch.randperm(p.numel(), generator=gen)])
            plan[b, h] = tiers
    lens = torch.zeros((2, layers, batch, kv_heads), dtype=torch.int32)
    for (b, h), tiers in plan.items():
        for t, p in enumerate(tiers):
            lens[t, layer, b, h] = p.numel()
    extra = torch.zeros_like(lens)
    for t, lay in enumerate(layouts):
        extra[t] = (lens[t] + lay.tokens - 1) // lay.tokens
    num_pages = int(extra.sum()) + spare_pages
    pool = PagePool(num_pages, cfg.page_size, device)
    if fill is None:
        pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=gen, dtype=torch.uint8))
    else:
        pool.storage.fill_(fill)
    free_list = FreePageList(num_pages, device)
    free_list.ring.copy_(torch.randperm(num_pages, generator=gen).to(torch.int32))
    table = BidirectionalPageTable(layers, batch, kv_heads, row_len, device)
    table.grow(extra.to(device), free_list)
    table.lens.copy_(lens)
    for t, lay in enumerate(layouts):
        bs, hs, slots, poss = [], [], [], []
        for (b, h), tiers in plan.items():
            p = tiers[t]
            bs.append(torch.full_like(p, b))
            hs.append(torch.full_like(p, h))
            slots.append(torch.arange(p.numel()))
            poss.append(p)
        if not bs:
            continue
        bb, hh, ss, pp = (torch.cat(x).to(device) for x in (bs, hs, slots, poss))
        n = bb.numel()
        if n == 0:
            continue
        k = (torch.randn(n, head_dim, generator=gen) * scale_k).to(dtype).to(device)
        v = (torch.randn(n, head_dim, generator=gen) * scale_v).to(dtype).to(device)
        score = torch.rand(n, generator=gen).to(device)
        page, off = table.locate(t, layer, bb, hh, ss, lay.tokens)
        pool.write_rows(lay, page, off, lay.encode(k, v, score, pp))
    return FilledCache(PagedKV(pool, layouts, table, layer), cfg, free_list, ctx)


def random_queries(batch: int, q_heads: int, q_len: int, head_dim: int, ctx: torch.Tensor, *,
                   dtype=torch.float32, generator: torch.Generator | None = None, device="cpu"):
    """``q [B, Hq, Q, F]`` (a non-contiguous view, as HF produces) and positions ``ctx - Q .. ctx - 1``."""
    gen = generator or torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_len, q_heads, head_dim, generator=gen).to(dtype).to(device).transpose(1, 2)
    q_pos = ctx.view(-1, 1).to(device) - q_len + torch.arange(q_len, device=device).view(1, -1)
    return q, q_pos.to(torch.int64)


def attention_case(gen: torch.Generator, spec: str, ctx: list[int], kv_heads: int, group: int, q_len: int, *,
                   dtype=torch.float32, head_dim: int = 64, **cache):
    """A filled cache of ``len(ctx)`` sequences and ``q_len`` queries per sequence for it.

    Returns ``(cache, q, q_pos)``: :func:`build_paged_kv` (extra ``cache`` options passed on) and
    :func:`random_queries` with ``kv_heads * group`` query heads, both drawn from ``gen``.
    """
    fc = build_paged_kv(spec, len(ctx), kv_heads, head_dim, torch.tensor(ctx), dtype=dtype, generator=gen,
                        **cache)
    q, q_pos = random_queries(len(ctx), kv_heads * group, q_len, head_dim, fc.ctx, dtype=dtype, generator=gen)
    return fc, q, q_pos


def case_id(spec: str, dtype: torch.dtype, kv_heads: int, group: int, ctx: list[int]) -> str:
    """Test id of an attention case, e.g. ``K8V4-K4V2-float32-h3g3-ctx65_7``."""
    return f"{spec}-{str(dtype)[6:]}-h{kv_heads}g{group}-ctx{'_'.join(map(str, ctx))}"


def poison_outputs(monkeypatch) -> None:
    """Body of the kernel tests' autouse fixture: every buffer a launcher allocates starts as NaN
    (floats) or ``-7777`` (ints), so an element a kernel forgot to write shows up."""
    monkeypatch.setattr(tiles, "POISON", True)


def fresh_generator() -> tuple[torch.Generator, int]:
    """A generator with a fresh random seed (every run tests new data); the seed is returned for repro."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


PROMPT_CLASS_OUTPUTS = ("score", "cls", "rank", "new_lens", "pruned")


def prompt_rule_inputs(batch: int, heads: int, nq: int, gen: torch.Generator, ties: bool, pruned: bool):
    """Inputs of a prompt classification (``leankit.policy.prompt_classes`` and its compiled
    twins): left-padded rows (positions count real tokens only) with a few holes, received mass
    with a long tail (or drawn from a few values, so many scores tie at the cut-offs), mass already
    pruned (or none) and counts already held per tier. Returns ``(received, q_pos, real, q_last,
    pruned_mass, lens)``."""
    pad = torch.randint(0, max(1, nq // 3), (batch,), generator=gen)
    real = torch.arange(nq).view(1, -1) >= pad.view(-1, 1)
    real &= torch.rand(batch, nq, generator=gen) > 0.05  # a few holes too
    start = torch.randint(0, 50, (batch, 1), generator=gen)
    pos = (start + torch.cumsum(real.long(), 1) - 1).clamp_min(0)
    q_last = torch.where(real, pos, torch.full_like(pos, -(1 << 30))).amax(1)
    if ties:
        received = torch.randint(0, 4, (batch, heads, nq), generator=gen).float() * 0.5
    else:
        received = torch.rand(batch, heads, nq, generator=gen) ** 4 * 8
    pm = torch.rand(batch, heads, generator=gen) * 3 if pruned else torch.zeros(batch, heads)
    lens = torch.randint(0, 40, (2, batch, heads), generator=gen, dtype=torch.int32)
    return received, pos.to(torch.int32), real, q_last, pm, lens


def assert_same_prompt_classes(got, want, real: torch.Tensor, seed: int) -> None:
    """Two prompt classifications agree: the same significance on real tokens, classes, ranks of
    the kept tokens and counts, and the pruned mass within fp32 summation order."""
    from leankit.policy import KEEP_HIGH, KEEP_LOW

    for name, g, w in zip(PROMPT_CLASS_OUTPUTS, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    score, cls, rank, new_lens, pruned = got
    valid = real.unsqueeze(1).expand_as(cls)
    assert torch.equal(score[valid], want[0][valid]), f"score (seed {seed})"
    assert torch.equal(cls, want[1]), f"classes (seed {seed}): {(cls != want[1]).sum()} differ"
    kept = (cls == KEEP_HIGH) | (cls == KEEP_LOW)
    assert torch.equal(rank[kept], want[2][kept]), f"ranks (seed {seed})"
    assert torch.equal(new_lens, want[3]), f"counts (seed {seed})"
    torch.testing.assert_close(pruned, want[4], rtol=1e-5, atol=1e-6, msg=f"pruned mass (seed {seed})")


def tolerance(dtype: torch.dtype) -> float:
    """Normwise relative tolerance of a kernel result against the fp32 reference.

    * fp32: kernel and reference do the same fp32 arithmetic in another order (tiles, split-K
      merge, ``exp2`` of pre-scaled logits vs ``exp``): a few ulps times log(N), about 1e-6, so
      1e-5 has a 10x margin.
    * fp16 / bf16 inputs: the kernel rounds dequantized K/V and the probabilities to the model
      dtype for the tensor-core ``tl.dot`` (2^-11 relative each for fp16) and rounds the output to
      fp16 (2^-11 = 4.9e-4); the reference stays in fp32 until its final cast. Together about
      1e-3, under 2e-3. bf16 has 8 mantissa bits instead of 11, hence 8x looser.
    """
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


# The ACT -> KV kernel against its reference, relative to the output's max magnitude: fp32
# differs only by summation order; fp16/bf16 by the rounding of tensor-core operands and of each
# intermediate the HF order casts (normalized input, projection, k_norm), whose one-ulp flips
# the projection carries on (a few bf16 ulps of the largest K, hence 3e-2 there).
ACT_TO_KV_TOL = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def assert_close_normwise(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "",
                          tol: float | None = None) -> None:
    """``max|actual - expected| <= tol * max|expected|`` (and identical non-finite positions);
    ``tol`` defaults to :func:`tolerance` of ``dtype``."""
    a, e = actual.float(), expected.float()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    fin = torch.isfinite(e)
    assert torch.equal(torch.isfinite(a), fin), f"{what}: non-finite entries differ"
    assert torch.equal(a[~fin], e[~fin]), f"{what}: infinities differ"
    if fin.any():
        scale = e[fin].abs().max().clamp_min(1e-30)
        err = (a[fin] - e[fin]).abs().max()
        tol = tolerance(dtype) if tol is None else tol
        assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} x {scale:.3e}"


def assert_all_close_normwise(actual, expected, dtype: torch.dtype, what: str = "") -> None:
    """:func:`assert_close_normwise` for each pair of two equally long lists (e.g. one tensor per tier)."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors != {len(expected)}"
    for a, e in zip(actual, expected):
        assert_close_normwise(a, e, dtype, what)


def assert_matches_attention_ref(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, kv: PagedKV,
                                 q_pos: torch.Tensor, scale: float, what: str = "") -> torch.Tensor:
    """A kernel's ``(out, lse)`` against :func:`leankit.attention.paged_attention_ref` (dtype, shapes,
    and the normwise tolerance of ``q.dtype``). Returns the reference lse."""
    ref_out, ref_lse = paged_attention_ref(q, kv, q_pos, scale)
    assert out.dtype == q.dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape, what
    assert_close_normwise(out, ref_out, q.dtype, f"out {what}")
    assert_close_normwise(lse, ref_lse, q.dtype, f"lse {what}")
    return ref_lse
