"""The own-token merge kernel (``leankit_kernels.own_token``) against the torch composition it replaces:
``merge_attention(out_old, lse_old, *step_attention(...))`` of a decode step, under Triton's CPU
interpreter, on odd shapes, every model dtype and rows that saw no earlier key."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels import testing
from leankit_kernels.own_token import merge_own_token

from leankit.attention import merge_attention, step_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
_poison = pytest.fixture(autouse=True)(testing.poison_outputs)


def _case(gen, b, hkv, g, f, dtype):
    """Queries and new K/V as a model hands them (non-contiguous head views), a paged output and lse
    with some rows that saw no earlier key (lse -inf, output 0), and a mix of real and pad rows."""
    hq = hkv * g
    q = torch.randn(b, 1, hq, f, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2)
    out_old = torch.randn(b, 1, hq, f, generator=gen)
    lse_old = torch.randn(b, hkv, g, generator=gen) * 3
    empty = torch.rand(b, hkv, g, generator=gen) < 0.2
    lse_old[empty] = float("-inf")
    out_old.view(b, hkv, g, f)[empty] = 0.0
    real = torch.rand(b, 1, generator=gen) < 0.7
    q_pos = torch.arange(b).view(b, 1) + 5
    return q, k, v, out_old, lse_old, real, q_pos


def _reference(q, k, v, out_old, lse_old, real, q_pos, scale):
    b, hkv, g = lse_old.shape
    out_new, lse_new, recv = step_attention(q, k, v, q_pos, real, scale, lse_other=lse_old.view(b, hkv, g),
                                            received=True)
    out, lse = merge_attention(out_old, lse_old.view(b, hkv, g), out_new, lse_new)
    return out, lse, recv


@pytest.mark.parametrize("b,hkv,g,f,dtype", [
    (3, 2, 3, 64, F32), (1, 1, 1, 16, F32), (5, 3, 7, 80, F32), (2, 8, 4, 128, F16), (4, 1, 8, 96, BF16),
    (2, 4, 2, 20, F16), (3, 2, 5, 256, F32),
])
def test_own_token_merge_matches_the_torch_composition(b, hkv, g, f, dtype):
    gen, seed = testing.fresh_generator()
    q, k, v, out_old, lse_old, real, q_pos = _case(gen, b, hkv, g, f, dtype)
    scale = f ** -0.5
    ref_out, ref_lse, ref_recv = _reference(q, k, v, out_old, lse_old, real, q_pos, scale)
    out, lse, recv = merge_own_token(q, k, v, out_old, lse_old, real, scale, received=True)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and recv.shape == ref_recv.shape
    # fp32 arithmetic on the same inputs (the model-dtype inputs are widened exactly)
    testing.assert_close_normwise(out, ref_out, F32, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, F32, f"lse (seed {seed})")
    testing.assert_close_normwise(recv, ref_recv, F32, f"received (seed {seed})")
    assert torch.isfinite(lse).all()  # the new key is always seen
    out2, lse2, none = merge_own_token(q, k, v, out_old, lse_old, real, scale)
    assert none is None and torch.equal(out2, out) and torch.equal(lse2, lse)


def test_own_token_merge_rejects_steps_with_several_tokens():
    gen, _ = testing.fresh_generator()
    q, k, v, out_old, lse_old, real, _ = _case(gen, 2, 2, 2, 32, F32)
    with pytest.raises(ValueError, match="one query and one new token"):
        merge_own_token(torch.cat([q, q], 2), k, v, out_old, lse_old, real, 0.1)
    with pytest.raises(ValueError, match="shapes do not match"):
        merge_own_token(q, k, v, out_old[:, :, :3], lse_old, real, 0.1)


@pytest.mark.parametrize("bad", ["k batch", "k head_dim", "v heads", "v head_dim", "lse groups"])
def test_own_token_merge_rejects_operands_that_do_not_match_the_query(bad):
    """The kernel indexes the new key/value and the lse by the query's (B, Hkv, G, F): any other
    shape would be read out of bounds (garbage out) instead of raising."""
    gen, _ = testing.fresh_generator()
    q, k, v, out_old, lse_old, real, _ = _case(gen, 2, 2, 3, 32, F32)
    k, v, lse_old = {
        "k batch": (k[:1], v, lse_old), "k head_dim": (k[..., :16], v, lse_old), "v heads": (k, v[:, :1], lse_old),
        "v head_dim": (k, v[..., :16], lse_old), "lse groups": (k, v, torch.zeros(2, 2, 5)),
    }[bad]
    with pytest.raises(ValueError, match="shapes do not match"):
        merge_own_token(q, k, v, out_old, lse_old, real, 0.1, received=True)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_own_token_merge_stores_in_the_asked_dtype(dtype):
    """``out_dtype``: the merge runs in fp32 and rounds once as it stores, so a 16-bit output is
    the fp32 output rounded to that dtype; lse and received are fp32 either way. Rounded as torch
    rounds, bit for bit, for fp16; Triton's interpreter truncates fp32 to bf16 where a GPU rounds to
    nearest even, so bf16 is held to one unit in the last place here."""
    gen, seed = testing.fresh_generator()
    q, k, v, out_old, lse_old, real, _ = _case(gen, 3, 2, 3, 64, dtype)
    scale = 64 ** -0.5
    wide, lse, recv = merge_own_token(q, k, v, out_old, lse_old, real, scale, received=True)
    narrow, lse2, recv2 = merge_own_token(q, k, v, out_old, lse_old, real, scale, received=True, out_dtype=dtype)
    assert wide.dtype == F32 and narrow.dtype == dtype and lse2.dtype == F32
    if dtype == F16:
        assert torch.equal(narrow, wide.to(dtype)), f"seed {seed}"
    else:
        assert ((narrow.float() - wide).abs() <= wide.abs() * 2.0 ** -7).all(), f"seed {seed}"
    assert torch.equal(lse, lse2) and torch.equal(recv, recv2)
