"""Prompt-phase significance over the prompt's exact keys (``leankit_kernels.prompt_significance``)
against its fp64 reference and the torch pass it replaces on the kernel backend (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels.prompt_significance import prompt_received, prompt_received_ref
from leankit_kernels.testing import assert_close_normwise, fresh_generator, poison_outputs

from leankit.attention import step_received


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_outputs(monkeypatch)


def _prompt(gen, b, hkv, g, nq, f, dtype, shuffle=False, all_pad_row=False):
    """Random queries/keys of a left-padded batch (row lengths differ), positions 0.. over each
    row's real tokens; ``shuffle`` permutes one row's positions (an unordered step)."""
    q = (torch.randn(b, hkv * g, nq, f, generator=gen) * 1.5).to(dtype)
    k = torch.randn(b, hkv, nq, f, generator=gen).to(dtype)
    real = torch.ones(b, nq, dtype=torch.bool)
    for r in range(b):
        real[r, : int(torch.randint(0, max(1, nq // 2), (1,), generator=gen))] = False
    if all_pad_row:
        real[-1] = False
    pos = (real.long().cumsum(1) - 1).clamp_min(0)
    if shuffle:
        pos[0] = pos[0][torch.randperm(nq, generator=gen)]
    return q, k, pos, real


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,f", [(2, 3, 64), (1, 4, 80), (3, 1, 16)])
def test_matches_reference_on_odd_shapes(dtype, hkv, g, f):
    gen, seed = fresh_generator()
    nq = int(torch.randint(1, 150, (1,), generator=gen))
    q, k, pos, real = _prompt(gen, 3, hkv, g, nq, f, dtype)
    got = prompt_received(q, k, pos, real, f ** -0.5)
    want = prompt_received_ref(q, k, pos, real, f ** -0.5)
    assert got.shape == (3, hkv, nq) and got.dtype == torch.float32
    assert_close_normwise(got, want, dtype, f"received (seed {seed}, nq {nq})")
    assert bool((got[~real.unsqueeze(1).expand_as(got)] == 0).all()), f"padding received something (seed {seed})"
    # each live query hands out probability 1 in all, so the G-averaged sum is the live query count
    torch.testing.assert_close(got.sum(-1), real.sum(-1, keepdim=True).float().expand(3, hkv),
                               rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-3)


@pytest.mark.parametrize("shuffle", [False, True])
def test_agrees_with_the_torch_pass_it_replaces(shuffle):
    """fp32: the kernel against :func:`leankit.attention.step_received` (the chunked torch pass),
    with positions in order and shuffled, small tiles so every loop runs several times."""
    gen, seed = fresh_generator()
    q, k, pos, real = _prompt(gen, 2, 2, 3, 97, 32, torch.float32, shuffle=shuffle)
    got = prompt_received(q, k, pos, real, 0.2, block_m=16, block_n=16)
    want = step_received(q, k, pos, real, 0.2, ordered=not shuffle)
    assert_close_normwise(got, want, torch.float32, f"vs step_received (seed {seed})")


def test_strided_inputs_and_a_row_of_padding():
    """Queries as a transposed view of ``[B, Q, Hq, F]`` (as a model produces them), keys with a
    padded last dimension; a row with no real token receives nothing and breaks nothing."""
    gen, seed = fresh_generator()
    q, k, pos, real = _prompt(gen, 3, 2, 2, 45, 64, torch.float32, all_pad_row=True)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_wide = torch.cat([k, torch.zeros_like(k)], -1)[..., :64]
    got = prompt_received(q_view, k_wide, pos, real, 0.125)
    assert_close_normwise(got, prompt_received_ref(q, k, pos, real, 0.125), torch.float32, f"seed {seed}")
    assert bool((got[2] == 0).all())


def test_an_empty_prompt_receives_nothing_on_both_paths():
    """``Q == 0``: the kernel launches nothing and the reference returns the same empty result."""
    q, k = torch.randn(2, 4, 0, 32), torch.randn(2, 2, 0, 32)
    pos, real = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool)
    for fn in (prompt_received, prompt_received_ref):
        got = fn(q, k, pos, real, 0.2)
        assert got.shape == (2, 2, 0) and got.dtype == torch.float32


def test_rejects_mismatched_keys():
    q = torch.randn(1, 4, 5, 16)
    with pytest.raises(ValueError, match="do not match"):
        prompt_received(q, torch.randn(1, 3, 5, 16), torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), 1.0)


def test_prompt_attention_takes_the_kernel_on_the_kernel_backend(monkeypatch):
    """A prompt step whose significance is not read off SDPA's lse (unordered positions) runs the
    two launches on the kernel backend and returns what the torch backend's pass returns."""
    import leankit_kernels.prompt_significance as ps

    from leankit.prompt_attention import prompt_attention

    gen, seed = fresh_generator()
    q, k, pos, real = _prompt(gen, 2, 2, 2, 30, 16, torch.float32, shuffle=True)
    v = torch.randn_like(k)

    class _Attn(torch.nn.Module):  # what sdpa_attention_forward reads off the module
        is_causal = True
        num_key_value_groups = 2

    mask = torch.zeros(2, 1, 30, 30, dtype=torch.bool)
    mask[:] = real[:, None, None, :] & (pos[:, None, None, :] <= pos[:, None, :, None])
    calls = []
    orig = ps.prompt_received
    monkeypatch.setattr(ps, "prompt_received", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    monkeypatch.setenv("LEANKIT_BACKEND", "torch")
    out_t, recv_t = prompt_attention(_Attn(), q, k, v, mask, 0.25, significance=True, q_pos=pos, k_real=real,
                                     ordered=False)
    assert not calls
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    out_k, recv_k = prompt_attention(_Attn(), q, k, v, mask, 0.25, significance=True, q_pos=pos, k_real=real,
                                     ordered=False)
    assert calls == [1]
    assert torch.equal(out_k, out_t)  # the output is SDPA's either way
    assert_close_normwise(recv_k, recv_t, torch.float32, f"seed {seed}")
