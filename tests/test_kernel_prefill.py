"""Causal paged prefill attention and its significance pass vs leankit's references (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels import tiles
from leankit_kernels.prefill_attention import prefill_attention, received_attention
from leankit_kernels.testing import (
    assert_close_normwise,
    build_paged_kv,
    fresh_generator,
    random_queries,
)

from leankit.attention import paged_attention_ref, received_attention_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(tiles, "POISON", True)


# spec, dtype, kv heads, GQA ratio, context per sequence, new queries Q, prune fraction
PREFILL_CASES = [
    ("K8V4-K4V2", F32, 3, 3, [7, 3], 7, 0.0),  # row 1: queries before position 0 see nothing
    ("K8V4-K4V2", F32, 3, 3, [65, 63], 63, 0.1),
    ("FP16", F16, 1, 7, [63], 63, 0.0),
    ("K4V2", F32, 5, 1, [257], 7, 0.2),  # cached prefix pages + a new chunk
    ("K8V4", F16, 3, 3, [257], 65, 0.0),
    ("K8V4-K4V2", F32, 1, 3, [257], 257, 0.1),
    ("K4V2-K2V1", F32, 3, 1, [1, 65], 65, 0.0),
    ("FP16", F32, 3, 7, [65], 65, 0.0),
    ("K8V4-K4V2", BF16, 3, 3, [65], 7, 0.0),
]


def _ids(c):
    return f"{c[0]}-{str(c[1])[6:]}-h{c[2]}g{c[3]}-ctx{'_'.join(map(str, c[4]))}-q{c[5]}"


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_ids)
def test_prefill_matches_reference(case):
    spec, dtype, hkv, g, ctx, nq, prune = case
    gen, seed = fresh_generator()
    fc = build_paged_kv(spec, len(ctx), hkv, 64, torch.tensor(ctx), dtype=dtype, prune_frac=prune, generator=gen)
    q, q_pos = random_queries(len(ctx), hkv * g, nq, 64, fc.ctx, dtype=dtype, generator=gen)
    q_valid = q_pos >= 0
    out, lse, sig = prefill_attention(q, fc.kv, q_pos, 0.125, q_valid=q_valid, return_significance=True)
    ref_out, ref_lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    assert out.shape == ref_out.shape and out.dtype == dtype and lse.shape == ref_lse.shape
    assert_close_normwise(out, ref_out, dtype, f"out (seed {seed})")
    assert_close_normwise(lse, ref_lse, dtype, f"lse (seed {seed})")
    ref_sig = received_attention_ref(q, fc.kv, q_pos, 0.125, ref_lse, q_valid)
    assert len(sig) == len(ref_sig)
    for a, e in zip(sig, ref_sig):
        assert_close_normwise(a, e, dtype, f"significance (seed {seed})")


def test_significance_ignores_padding_queries():
    gen, seed = fresh_generator()
    fc = build_paged_kv("K8V4-K4V2", 2, 3, 64, torch.tensor([33, 20]), generator=gen)
    q, q_pos = random_queries(2, 9, 13, 64, fc.ctx, generator=gen)
    q_valid = torch.rand(2, 13, generator=gen) > 0.3
    _, lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    got = received_attention(q, fc.kv, q_pos, 0.125, lse, q_valid, block_m=16, block_n=16)
    ref = received_attention_ref(q, fc.kv, q_pos, 0.125, lse, q_valid)
    for a, e in zip(got, ref):
        assert_close_normwise(a, e, F32, f"seed {seed}")


def test_prefill_small_blocks():
    """Block shapes other than the defaults (tiles straddling many pages, many row blocks)."""
    gen, seed = fresh_generator()
    fc = build_paged_kv("K8V4-K4V2", 1, 3, 64, torch.tensor([65]), prune_frac=0.1, generator=gen)
    q, q_pos = random_queries(1, 9, 21, 64, fc.ctx, generator=gen)
    out, lse = prefill_attention(q, fc.kv, q_pos, 0.125, block_m=16, block_n=16)
    ref_out, ref_lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    assert_close_normwise(out, ref_out, F32, f"seed {seed}")
    assert_close_normwise(lse, ref_lse, F32, f"seed {seed}")
