"""Fused ACT -> KV kernel vs leankit.recompute.act_to_kv_ref, under Triton's CPU interpreter.

Odd token counts, hidden sizes that are not powers of two (and not multiples of the kernel's K
step), GQA and MHA, with and without bias, k_norm, RoPE, for every input norm, in fp32 and fp16,
with fresh random data each run (the seed is printed on failure).
"""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels.act_to_kv import act_to_kv, check_act_head_dim
from leankit_kernels.testing import ACT_TO_KV_TOL, fresh_generator, poison_outputs

from leankit.recompute import ActToKVParams, act_to_kv_ref, rope_tables

_poison = pytest.fixture(autouse=True)(poison_outputs)

TOL = ACT_TO_KV_TOL  # relative to the output's max magnitude, per dtype (why: leankit_kernels.testing)


def make_params(gen, d, h, f, dtype, norm="rms", bias=False, k_norm=False, rope=True, gemma=False) -> ActToKVParams:
    """Random layer parameters; ``gemma``: Gemma3's norms (``1 + w`` held in fp32, the product
    taken before the cast)."""
    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(torch.float32 if gemma and shift else dtype)

    w = r(2 * h * f, d, scale=d ** -0.5)
    return ActToKVParams(
        norm=norm,
        norm_weight=None if norm == "none" else r(d, scale=0.3, shift=1.0),
        norm_bias=r(d, scale=0.2) if norm == "layer" else None,
        norm_eps=1e-5,
        weight=w,
        bias=r(2 * h * f, scale=0.5) if bias else None,
        num_kv_heads=h,
        head_dim=f,
        k_norm_weight=r(f, scale=0.3, shift=1.0) if k_norm else None,
        k_norm_eps=1e-6,
        inv_freq=(1.0 / 10000 ** (torch.arange(0, f, 2).float() / f)) if rope else None,
        rope_scaling=1.0,
        norm_weight_fp32=gemma,
    )


def _check(n, d, h, f, dtype, **kw):
    gen, seed = fresh_generator()
    p = make_params(gen, d, h, f, dtype, **kw)
    # Activations with a per-token offset and scale: LayerNorm's mean matters, RMSNorm's scale does.
    act = (torch.randn(n, d, generator=gen) * torch.rand(n, 1, generator=gen).mul(3).add(0.2)
           + torch.randn(n, 1, generator=gen)).to(dtype)
    pos = torch.randint(0, 4000, (n,), generator=gen)
    k_ref, v_ref = act_to_kv_ref(act, pos, p)
    k, v = act_to_kv(act, pos, p)
    assert k.shape == (n, h, f) and v.shape == (n, h, f) and k.dtype == dtype
    for name, out, ref in (("K", k, k_ref), ("V", v, v_ref)):
        err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < TOL[dtype], f"seed {seed}: {name} relative error {err:.2e} (tol {TOL[dtype]:.0e})"
    return p, act, pos, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,d,h,f,kw", [
    (1, 96, 2, 32, {}),                                              # one decode token, Llama GQA-style
    (19, 72, 3, 32, {"bias": True}),                                 # Qwen2: bias, D not a multiple of BLOCK_K
    (7, 200, 2, 64, {"k_norm": True}),                               # Qwen3: k_norm before RoPE
    (17, 136, 2, 32, {"norm": "layer", "bias": True, "rope": False}),  # OPT: LayerNorm, biases, no RoPE
    (5, 48, 1, 32, {"norm": "none", "bias": True, "rope": False}),   # OPT post-LN layer: no input norm
    (33, 80, 1, 32, {"bias": True, "k_norm": True}),                 # everything, two token blocks + tail
    (21, 40, 1, 64, {"k_norm": True, "gemma": True}),                # Gemma3: fp32 (1 + w) norms, k_norm
], ids=["llama-decode", "qwen2", "qwen3", "opt", "opt-post", "all", "gemma3"])
def test_kernel_matches_reference(n, d, h, f, kw, dtype):
    _check(n, d, h, f, dtype, **kw)


def test_kernel_bf16_matches_reference():
    _check(9, 72, 2, 32, torch.bfloat16, bias=True)


def test_kernel_bf16_gemma_norms_match_reference():
    _check(12, 56, 2, 32, torch.bfloat16, k_norm=True, gemma=True)


def test_partial_rotary_takes_the_reference(monkeypatch):
    """A head RoPE rotates only in part (Phi's partial_rotary_factor) is refused by the kernel
    and served by the reference through leankit.recompute.act_to_kv, on any backend."""
    from leankit.recompute import act_to_kv as dispatch

    gen, _ = fresh_generator()
    p = make_params(gen, 64, 2, 32, torch.float32)
    p = dataclasses.replace(p, inv_freq=p.inv_freq[:8])  # the first 16 of 32 channels rotate
    act, pos = torch.randn(5, 64, generator=gen), torch.arange(5)
    with pytest.raises(ValueError, match="rotates 16 of 32"):
        act_to_kv(act, pos, p)
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    k, v = dispatch(act, pos, p)
    k_ref, v_ref = act_to_kv_ref(act, pos, p)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_shared_rope_tables_and_strided_input():
    """Tables computed once per step give the same K; a strided activation view is read correctly."""
    gen, seed = fresh_generator()
    p = make_params(gen, 72, 2, 32, torch.float32, bias=True)
    big = torch.randn(11, 100, generator=gen)
    act = big[:, 5:77]  # row stride 100
    pos = torch.randint(0, 300, (11,), generator=gen)
    k1, v1 = act_to_kv(act, pos, p, rope=rope_tables(p, pos))
    k2, v2 = act_to_kv_ref(act.contiguous(), pos, p)
    assert (k1 - k2).abs().max() <= TOL[torch.float32] * k2.abs().max(), f"seed {seed}"
    assert (v1 - v2).abs().max() <= TOL[torch.float32] * v2.abs().max(), f"seed {seed}"


@pytest.mark.parametrize("name", ["bias", "norm_weight", "norm_bias", "k_norm_weight"])
def test_strided_parameter_views_are_read_as_their_values(name):
    """A layer parameter handed as a strided view (a column of a wider tensor) is read by value."""
    gen, seed = fresh_generator()
    p = make_params(gen, 56, 2, 32, torch.float32, norm="layer", bias=True, k_norm=True)
    vec = getattr(p, name)
    wide = torch.randn(vec.numel(), 3, generator=gen)
    wide[:, 1] = vec
    p = dataclasses.replace(p, **{name: wide[:, 1]})
    act, pos = torch.randn(9, 56, generator=gen), torch.randint(0, 300, (9,), generator=gen)
    k, v = act_to_kv(act, pos, p)
    k_ref, v_ref = act_to_kv_ref(act, pos, p)
    assert (k - k_ref).abs().max() <= TOL[torch.float32] * k_ref.abs().max(), f"seed {seed}"
    assert (v - v_ref).abs().max() <= TOL[torch.float32] * v_ref.abs().max(), f"seed {seed}"


def test_empty_and_bad_inputs():
    gen, _ = fresh_generator()
    p = make_params(gen, 64, 2, 32, torch.float32)
    k, v = act_to_kv(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long), p)
    assert k.shape == (0, 2, 32) and v.shape == (0, 2, 32)
    with pytest.raises(ValueError, match="hidden"):
        act_to_kv(torch.zeros(3, 65), torch.arange(3), p)
    with pytest.raises(ValueError, match="position"):
        act_to_kv(torch.zeros(3, 64), None, p)
    with pytest.raises(ValueError, match="head_dim"):
        check_act_head_dim(16)
    with pytest.raises(ValueError, match="head_dim"):
        check_act_head_dim(48)
