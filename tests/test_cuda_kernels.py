"""CUDA validation at real sizes (``make gpu-check``); every test skips cleanly without a GPU.

Run alone (``pytest -m cuda tests/test_cuda_kernels.py``): the other kernel test files switch on
Triton's interpreter when they are imported, which would make these run on the CPU path.
"""

import os

import pytest
import torch

from leankit.hf import cache_kwargs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interpreter is on")]

F16, BF16 = torch.float16, torch.bfloat16


def _case(spec, ctx, hkv, g, f, dtype, q_len=1, page_size=None):
    from leankit_kernels import testing

    gen, seed = testing.fresh_generator()
    fc = testing.build_paged_kv(spec, len(ctx), hkv, f, torch.tensor(ctx), dtype=dtype, generator=gen,
                                prune_frac=0.05, page_size=page_size or (4096 if f == 128 else 2048), device="cuda")
    q, q_pos = testing.random_queries(len(ctx), hkv * g, q_len, f, fc.ctx.cuda(), dtype=dtype, generator=gen,
                                      device="cuda")
    return fc, q, q_pos, seed


@pytest.mark.parametrize("spec", ["FP16", "K8V4", "K4V2", "K8V4-K4V2"])
@pytest.mark.parametrize("f,hkv,g", [(64, 3, 3), (128, 8, 4), (128, 2, 8), (64, 4, 1)])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("ctx", [[16384, 1000], [4097]])
def test_decode_real_sizes(spec, f, hkv, g, dtype, ctx):
    from leankit_kernels import testing
    from leankit_kernels.paged_attention import paged_attention
    from leankit_kernels.tiles import page_counts

    fc, q, q_pos, seed = _case(spec, ctx, hkv, g, f, dtype)
    out, lse = paged_attention(q, fc.kv, q_pos, f ** -0.5)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, f ** -0.5, f"(seed {seed})")
    bounds = page_counts(fc.kv.table.n_pages[:, fc.kv.layer], len(fc.kv.layouts) > 1)
    out2, lse2 = paged_attention(q, fc.kv, q_pos, f ** -0.5, page_bounds=bounds)
    testing.assert_matches_attention_ref(out2, lse2, q, fc.kv, q_pos, f ** -0.5, f"bounds (seed {seed})")


@pytest.mark.parametrize("spec", ["FP16", "K8V4-K4V2"])
@pytest.mark.parametrize("f,hkv,g", [(64, 3, 3), (128, 8, 4)])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_prefill_real_sizes(spec, f, hkv, g, dtype):
    from leankit_kernels import testing
    from leankit_kernels.prefill_attention import prefill_attention

    fc, q, q_pos, seed = _case(spec, [2048, 700], hkv, g, f, dtype, q_len=300)
    out, lse = prefill_attention(q, fc.kv, q_pos, f ** -0.5)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, f ** -0.5, f"(seed {seed})")


def _random_llama(hidden, heads, kv_heads, layers, vocab=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().cuda()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return model


def _greedy(model, spec, backend, monkeypatch, new=24):
    from leankit.cache import LeanCache

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (2, 200), generator=gen).cuda()
    ids[1, :40] = 0
    cache = LeanCache(model, spec)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), **cache_kwargs(model, cache),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("shape", [(576, 9, 3, 2), (4096, 32, 8, 1)], ids=["smollm2-layers", "llama3-8b-layers"])
@pytest.mark.parametrize("spec", ["FP16", "K8V4", "K8V4-K4V2"])
def test_leancache_kernel_backend_matches_torch(shape, spec, monkeypatch):
    """fp32 random-init models of real layer shapes: kernels (ieee fp32 dots) pick the same greedy tokens."""
    model = _random_llama(*shape)
    ref = _greedy(model, spec, "torch", monkeypatch)
    got = _greedy(model, spec, "auto", monkeypatch)
    assert torch.equal(got, ref), f"{spec}: kernels {got.tolist()} != torch {ref.tolist()}"


@pytest.mark.xfail(reason="the cache path still forces host syncs inside a decode step (page counts, checks); "
                          "removing them is separate work", strict=False)
def test_decode_step_without_host_sync(monkeypatch):
    from leankit.cache import LeanCache

    monkeypatch.setenv("LEANKIT_BACKEND", "auto")
    model = _random_llama(576, 9, 3, 2)
    ids = torch.randint(3, 500, (2, 64)).cuda()
    cache = LeanCache(model, "K8V4")
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        pos = torch.full((2, 1), ids.shape[1], device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(input_ids=nxt, **cache_kwargs(model, cache), position_ids=pos, use_cache=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
