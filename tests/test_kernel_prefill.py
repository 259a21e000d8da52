"""Causal paged prefill attention and its significance pass vs leankit's references (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels import testing
from leankit_kernels.prefill_attention import prefill_attention, received_attention

from leankit.attention import paged_attention_ref, received_attention_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
_poison = pytest.fixture(autouse=True)(testing.poison_outputs)


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


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{testing.case_id(*c[:5])}-q{c[5]}")
def test_prefill_matches_reference(case):
    spec, dtype, hkv, g, ctx, nq, prune = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, nq, dtype=dtype, prune_frac=prune)
    q_valid = q_pos >= 0
    out, lse, sig = prefill_attention(q, fc.kv, q_pos, 0.125, q_valid=q_valid, return_significance=True)
    ref_lse = testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")
    ref_sig = received_attention_ref(q, fc.kv, q_pos, 0.125, ref_lse, q_valid)
    testing.assert_all_close_normwise(sig, ref_sig, dtype, f"significance (seed {seed})")


def test_prefill_tiers_with_their_own_group_size():
    """Prefill attention and its significance over K8V4 pages at one group and K4V2 pages at two."""
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [65, 30], 3, 3, 21, prune_frac=0.1,
                                          low_group_size=32)
    out, lse, sig = prefill_attention(q, fc.kv, q_pos, 0.125, return_significance=True)
    ref_lse = testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")
    ref_sig = received_attention_ref(q, fc.kv, q_pos, 0.125, ref_lse)
    testing.assert_all_close_normwise(sig, ref_sig, F32, f"significance (seed {seed})")


def test_received_config_per_gpu():
    """The significance pass keeps its 32 x 128 tile for 16-bit operands and in the interpreter; fp32
    operands on a GPU take the spill-free tiles with tf32x3 dots up to head_dim 128."""
    from leankit_kernels.prefill_attention import (
        RECEIVED_BLOCK_M,
        RECEIVED_BLOCK_N,
        prefill_warps,
        received_config,
    )

    for cap in (None, (8, 0), (9, 0)):
        for f in (64, 128, 256):
            assert received_config(f, cap) == {"BLOCK_M": RECEIVED_BLOCK_M, "BLOCK_N": RECEIVED_BLOCK_N,
                                               "num_warps": prefill_warps(f)}
    assert received_config(64, None, operand_bytes=4)["BLOCK_N"] == RECEIVED_BLOCK_N
    assert received_config(64, (9, 0), operand_bytes=4) == {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8,
                                                            "PREC": "tf32x3"}
    assert received_config(128, (8, 0), operand_bytes=4) == {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8,
                                                             "PREC": "tf32x3"}
    assert "PREC" not in received_config(256, (9, 0), operand_bytes=4)


def test_significance_ignores_padding_queries():
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [33, 20], 3, 3, 13)
    q_valid = torch.rand(2, 13, generator=gen) > 0.3
    _, lse = paged_attention_ref(q, fc.kv, q_pos, 0.125)
    got = received_attention(q, fc.kv, q_pos, 0.125, lse, q_valid, block_m=16, block_n=16)
    ref = received_attention_ref(q, fc.kv, q_pos, 0.125, lse, q_valid)
    testing.assert_all_close_normwise(got, ref, F32, f"seed {seed}")


def test_prefill_small_blocks():
    """Block shapes other than the defaults (tiles straddling many pages, many row blocks)."""
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [65], 3, 3, 21, prune_frac=0.1)
    out, lse = prefill_attention(q, fc.kv, q_pos, 0.125, block_m=16, block_n=16)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, 0.125, f"(seed {seed})")


def test_prefill_config_per_gpu():
    """sm_90 (H100/H200) gets the tiles timed fastest on an H200 where they were timed (head_dim
    <= 128, one group per token): 64 rows and 4 warps, 128 keys a tile (64 for all-dense layers at
    head_dim >= 128). Wider heads, grouped tiers, sm_80 and the interpreter keep 64 x 32."""
    from leankit_kernels.prefill_attention import BLOCK_M, BLOCK_N, layer_kind, prefill_config
    from leankit_kernels.tiles import tier_args

    from leankit.config import KVConfig
    from leankit.pages import PageLayout

    assert prefill_config(128, (9, 0)) == {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4}
    assert prefill_config(128, (9, 0), dense=True)["BLOCK_N"] == 64
    assert prefill_config(64, (9, 0), dense=True)["BLOCK_N"] == 128
    old = (BLOCK_M, BLOCK_N, 8)
    for cap, f, grouped in (((8, 0), 128, False), (None, 128, False), ((9, 0), 256, False), ((9, 0), 128, True)):
        for dense in (False, True):
            cfg = prefill_config(f, cap, dense, grouped)
            assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]) == old, (cap, f, grouped, dense)
    assert all("maxnreg" not in prefill_config(f, (9, 0)) for f in (64, 128))
    # fp32 operands on a GPU: the spill-free tiles with tf32x3 dots, on sm_80 and sm_90 alike; the
    # interpreter and head_dim 256 keep the default tile and the launcher's precision.
    for cap in ((8, 0), (9, 0)):
        assert prefill_config(64, cap, operand_bytes=4) == {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8,
                                                           "PREC": "tf32x3"}
        assert prefill_config(128, cap, grouped=True, operand_bytes=4) == {"BLOCK_M": 16, "BLOCK_N": 32,
                                                                          "num_warps": 8, "PREC": "tf32x3"}
        assert "PREC" not in prefill_config(256, cap, operand_bytes=4)
    assert prefill_config(64, None, operand_bytes=4) == {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": 4}

    def kind(spec, **overrides):
        cfg = KVConfig.parse(spec, **overrides)
        return layer_kind(tier_args(tuple(PageLayout.build(cfg, t, 128, torch.float16) for t in range(len(cfg.tiers)))))

    assert kind("FP16") == {"dense": True, "grouped": False}
    assert kind("K8V4") == kind("K8V4-K4V2") == {"dense": False, "grouped": False}
    assert kind("K8V4", group_size=32) == {"dense": False, "grouped": True}
    assert kind("K8V4-K4V2", low_group_size=32) == {"dense": False, "grouped": True}
