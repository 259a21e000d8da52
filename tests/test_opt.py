"""OPT (and Qwen3's k_norm) in LeanCache, on tiny random-init models (no downloads).

OPT differs from the Llama family in everything around attention: LayerNorm, learned positions
with an offset of 2, projection biases, no RoPE, a query pre-scaled before the attention call
(which then gets ``scaling=1.0``), and no ``num_key_value_heads`` in its config. Qwen3 applies a
per-head RMSNorm to K before RoPE. The cache only sees post-RoPE K/V, so FP16 must be lossless.
"""

from __future__ import annotations

import pytest
import torch
from test_oracle import Driver
from transformers import DynamicCache, OPTConfig, OPTForCausalLM, Qwen3Config, Qwen3ForCausalLM

from leankit import LeanCache
from leankit.hf import cache_kwargs


def opt_model(seed: int, **kw) -> OPTForCausalLM:
    """A tiny OPT: hidden 64, 4 heads of 16 channels (MHA), 2 layers."""
    cfg = {"vocab_size": 97, "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
           "word_embed_proj_dim": 64}
    cfg.update(kw)
    torch.manual_seed(seed)
    return OPTForCausalLM(OPTConfig(**cfg)).eval()


def qwen3_model(seed: int) -> Qwen3ForCausalLM:
    """A tiny Qwen3: GQA 6/2 heads of 16 channels with q_norm/k_norm."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=80, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # random-init norms are all ones: make k_norm actually change K
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def _batch(seed: int, rows: int = 3, width: int = 11, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = (r * 3 + seed) % (width - 3)
        ids[r, :pad] = 0
        mask[r, :pad] = 0
    return ids, mask


def _generate(model, ids, mask, cache, new=17):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                              max_new_tokens=new, pad_token_id=0, eos_token_id=None)


def _check_lossless(model, seed):
    ids, mask = _batch(seed)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    out = _generate(model, ids, mask, LeanCache(model, "FP16"))
    assert torch.equal(out, ref), f"seed {seed}: FP16 LeanCache differs from DynamicCache"
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        alone = _generate(model, ids[r:r + 1, keep], mask[r:r + 1, keep], LeanCache(model, "FP16"))
        ref_alone = _generate(model, ids[r:r + 1, keep], mask[r:r + 1, keep], DynamicCache(config=model.config))
        assert torch.equal(alone, ref_alone), f"seed {seed} row {r}: alone differs from DynamicCache"
        assert torch.equal(alone[0], out[r, -alone.shape[1]:]), f"seed {seed} row {r}: batch differs from alone"


@pytest.mark.parametrize("seed", [3, 11])
def test_opt_fp16_greedy_identical_to_dynamic_cache(seed):
    _check_lossless(opt_model(seed), seed)


def test_opt_post_layernorm_variant_is_lossless():
    """OPT-350m style: LayerNorm after attention (``do_layer_norm_before=False``)."""
    _check_lossless(opt_model(5, do_layer_norm_before=False), 5)


@pytest.mark.parametrize("seed", [2, 9])
def test_qwen3_fp16_greedy_identical_to_dynamic_cache(seed):
    _check_lossless(qwen3_model(seed), seed)


def test_opt_forward_without_positions_matches_dynamic_cache():
    """No ``position_ids``: OPT derives them from the padding mask, and so must the cache's pre-hook."""
    model = opt_model(4)
    ids, mask = _batch(4)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        cache = LeanCache(model, "FP16")
        b = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache)).logits
        # a decode step after the prompt, again without positions
        nxt = torch.full((ids.shape[0], 1), 5)
        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
        dyn = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, dyn))
        a2 = model(input_ids=nxt, attention_mask=mask2, **cache_kwargs(model, dyn)).logits
        b2 = model(input_ids=nxt, attention_mask=mask2, **cache_kwargs(model, cache)).logits
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b2, a2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["K8V4", "K4V2", "K8V4-K4V2"])
def test_opt_quantized_generates(spec):
    model = opt_model(7)
    ids, mask = _batch(7)
    cache = LeanCache(model, spec)
    out = _generate(model, ids, mask, cache, new=9)
    assert out.shape == (ids.shape[0], ids.shape[1] + 9)
    rep = cache.memory_report()
    assert rep["kv_bytes"] > 0 and rep["tokens_per_tier"]["high"] > 0
    # every real token of every layer and head is held (no policy prunes with these defaults)
    real = int(mask.sum()) + ids.shape[0] * 8  # the last sampled token is never fed back
    assert sum(rep["slots_per_tier"].values()) == real * model.config.num_hidden_layers * 4


def test_opt_k8v4_paged_attention_matches_oracle():
    """A cache sized from an OPT config (no num_key_value_heads: MHA) agrees with the dense oracle."""
    model = opt_model(8)
    cache = LeanCache(model, "K8V4", page_size=256, max_seq_len=128)
    assert cache.num_kv_heads == 4 and cache.head_dim == 16
    drv = Driver(cache, 4, 4, seed=8)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    drv.prompt_then_decode(mask, 3)
    assert drv.worst < 1e-3, f"paged attention deviates from the oracle by {drv.worst:.2e} (relative)"
