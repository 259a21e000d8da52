"""rotate=1: K/V quantized in an orthonormal Hadamard basis (leankit.rotation)."""

import pytest
import torch
from transformers import DynamicCache

from leankit.cache import LeanCache
from leankit.config import KVConfig
from leankit.hf import cache_kwargs
from leankit.policy import stored_token_reference
from leankit.rotation import block_size, hadamard, rotate, rotate_stored, unrotate
from leankit.testing import tiny_model


@pytest.mark.parametrize("n", [2, 16, 64, 128, 20, 80, 96])
def test_hadamard_is_orthonormal_and_symmetric(n):
    h = hadamard(n, dtype=torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(h, h.T)
    # each channel spreads evenly over its block: a power of two is one block, 96 three of 32
    b = block_size(n)
    assert b == {20: 4, 80: 16, 96: 32}.get(n, n)
    blocks = torch.block_diag(*[torch.ones(b, b, dtype=torch.float64)] * (n // b))
    torch.testing.assert_close(h.abs(), blocks * b ** -0.5)
    x = torch.randn(5, 3, n, dtype=torch.float64)
    torch.testing.assert_close(unrotate(rotate(x, h), h), x)


@pytest.mark.parametrize("n", [0, 1, 3, 45])
def test_hadamard_needs_an_even_head_dim(n):
    with pytest.raises(ValueError, match="even head_dim"):
        hadamard(n)


def test_rotate_override_parses_as_a_boolean():
    assert KVConfig.parse("K8V4-K4V2:rotate=1").rotate is True
    assert KVConfig.parse("K8V4-K4V2:rotate=false,th=0.2").rotate is False
    assert KVConfig.parse("K8V4", rotate=True).rotate is True
    assert KVConfig.parse("K8V4").rotate is False
    with pytest.raises(ValueError, match="bad value 'maybe' for 'rotate'"):
        KVConfig.parse("K8V4:rotate=maybe")


def test_rotation_lowers_the_error_of_outlier_channels():
    """Per-token min-max groups lose the small channels to one outlier; the rotation spreads it."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(257, 64, generator=gen)
    v = torch.randn(257, 64, generator=gen)
    k[:, 5] *= 12  # the outlier channels RoPE'd keys of real models show
    v[:, 41] *= 6
    plain, rot = KVConfig.parse("K4V2"), KVConfig.parse("K4V2", rotate=True)
    k0, v0 = stored_token_reference(k, v, plain, 0)
    k1, v1 = stored_token_reference(k, v, rot, 0)
    for x, e0, e1 in ((k, k0, k1), (v, v0, v1)):
        mse0, mse1 = float((e0 - x).pow(2).mean()), float((e1 - x).pow(2).mean())
        assert mse1 < 0.6 * mse0, (mse0, mse1)


def test_lossless_config_with_rotation_generates_like_dynamic_cache():
    """FP16 storage of an fp32 model: the rotation is exact up to rounding, so greedy tokens match."""
    model = tiny_model("llama-mha")
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 23], [0, 0, 12, 64, 7, 70, 3]])
    mask = (ids != 0).long()
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ref = model.generate(**cache_kwargs(model, DynamicCache()), **kw)
        cache = LeanCache(model, "FP16", rotate=True)
        got = model.generate(**cache_kwargs(model, cache), **kw)
    assert len(set(ref[:, 7:].flatten().tolist())) > 2, "degenerate generation"
    assert torch.equal(got, ref)


def test_rotation_of_a_head_dim_that_is_not_a_power_of_two():
    """head_dim 20 rotates in blocks of 4: the lossless config still gives DynamicCache's tokens
    (the rotation is exact up to rounding), a quantized one runs; an odd head_dim raises."""
    model = tiny_model("llama-mha", hidden_size=80, head_dim=20)  # 4 heads of 20 channels
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 23], [0, 0, 12, 64, 7, 70, 3]])
    kw = {"input_ids": ids, "attention_mask": (ids != 0).long(), "max_new_tokens": 10, "do_sample": False,
          "pad_token_id": 0}
    with torch.no_grad():
        ref = model.generate(**cache_kwargs(model, DynamicCache()), **kw)
        assert torch.equal(model.generate(**cache_kwargs(model, LeanCache(model, "FP16", rotate=True)), **kw), ref)
        quantized = model.generate(**cache_kwargs(model, LeanCache(model, "K8V4", rotate=True)), **kw)
    assert quantized.shape == ref.shape
    from transformers import OPTConfig, OPTForCausalLM  # no RoPE, so an odd head_dim is a legal model

    odd = OPTForCausalLM(OPTConfig(vocab_size=97, hidden_size=60, ffn_dim=64, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=64))  # 4 heads of 15
    LeanCache(odd, "FP16")  # fine without rotation
    with pytest.raises(ValueError, match="even head_dim"):
        LeanCache(odd, "FP16", rotate=True)


@pytest.mark.parametrize("n", [64, 128, 256, 96, 80, 160, 192, 320, 384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stored_rotation_of_a_row_does_not_depend_on_the_rows_beside_it(n, dtype):
    """Keys and values are rotated per step ([B, H, Q, F]) by the cache and one token at a time by the
    reference (stored_token_reference); a token's codes must not depend on how many tokens its step
    brought. A plain matmul gave most outputs of a 128-wide row a different last bit alone than in a
    batch of four; rotate_stored gives the same bits, within rounding of the exact x @ H."""
    torch.manual_seed(n)
    h = hadamard(n, dtype=dtype)
    x = (torch.randn(2, 2, 23, n) * 3).to(dtype)
    full = rotate_stored(x, h).reshape(-1, n)
    rows = x.reshape(-1, n)
    alone = torch.stack([rotate_stored(r, h) for r in rows])
    assert full.dtype == dtype and torch.equal(full, alone)
    assert torch.equal(rotate_stored(x[:, :, :7], h), rotate_stored(x, h)[:, :, :7])
    exact = (rows.double() @ hadamard(n, dtype=torch.float64)).to(dtype)
    torch.testing.assert_close(full, exact)
    # the stored tier's reference round trip rotates the same way
    cfg = KVConfig.parse("K8V4:rotate=1")
    k, v = x[0, 0, 0].float(), x[0, 1, 0].float()
    from leankit.quant import dequantize, quantize
    kr = rotate_stored(x.float(), hadamard(n))[0, 0, 0]
    packed, sc, mn = quantize(kr, 8, None)
    want = unrotate(dequantize(packed, sc, mn, 8), hadamard(n))
    torch.testing.assert_close(stored_token_reference(k, v, cfg, 0)[0], want, rtol=0, atol=0)
