"""act_to_kv_ref rebuilds, bit for bit, the post-RoPE K/V an HF decoder layer hands to Cache.update.

Each tiny random-init model runs a left-padded prompt and a decode step through a recording
DynamicCache; forward pre-hooks capture every decoder layer's input hidden state (before its
input norm). The reference, fed those activations and the same positions, must give exactly the
recorded K/V.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from leankit.hf import cache_kwargs
from leankit.recompute import ActToKVParams, act_to_kv, act_to_kv_ref, layer_params, model_params, rope_tables

COMMON = {"vocab_size": 97, "num_hidden_layers": 2, "max_position_embeddings": 256, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}


def build(kind: str, seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    if kind == "llama-mha":
        m = LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=64, num_attention_heads=3,
                                         num_key_value_heads=3, **COMMON))
    elif kind == "llama-gqa":
        m = LlamaForCausalLM(LlamaConfig(hidden_size=72, intermediate_size=64, num_attention_heads=6,
                                         num_key_value_heads=2, head_dim=12, rope_theta=5000.0, **COMMON))
    elif kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(hidden_size=40, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, **COMMON))
    elif kind == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(hidden_size=56, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, **COMMON))
    elif kind == "phi3":  # one fused qkv_proj
        m = Phi3ForCausalLM(Phi3Config(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, **COMMON))
    elif kind == "phi3-partial":  # RoPE over the first half of each head only
        m = Phi3ForCausalLM(Phi3Config(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, partial_rotary_factor=0.5, **COMMON))
    elif kind == "gemma3":  # (1 + w) norms in fp32, k_norm, a RoPE table per layer type
        m = Gemma3ForCausalLM(Gemma3TextConfig(
            hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            **COMMON))
    elif kind == "opt":
        m = OPTForCausalLM(OPTConfig(hidden_size=48, ffn_dim=64, num_attention_heads=3, word_embed_proj_dim=48,
                                     **COMMON))
    elif kind == "opt-post":
        m = OPTForCausalLM(OPTConfig(hidden_size=48, ffn_dim=64, num_attention_heads=3, word_embed_proj_dim=48,
                                     do_layer_norm_before=False, **COMMON))
    elif kind == "opt-noaffine":  # LayerNorms without weight or bias (layer_norm_elementwise_affine=False)
        m = OPTForCausalLM(OPTConfig(hidden_size=48, ffn_dim=64, num_attention_heads=3, word_embed_proj_dim=48,
                                     layer_norm_elementwise_affine=False, **COMMON))
    else:
        raise ValueError(kind)
    # Random-init norms are ones and biases zeros: perturb every parameter so each one matters.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return m.to(dtype).eval()


class RecordingCache(DynamicCache):
    """A DynamicCache that keeps a copy of the K/V each layer hands to ``update``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.seen.append((layer_idx, key_states.clone(), value_states.clone()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def capture(model, ids, mask, pos, cache):
    """Run one forward; returns the recorded update() K/V and each layer's input hidden state."""
    layers = model.get_decoder().layers
    acts = {}

    def hook(i):
        def pre(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            acts[i] = hs.detach().clone()
        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        cache.seen.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache))
    finally:
        for h in handles:
            h.remove()
    return list(cache.seen), acts


def _check_model(model, seed):
    g = torch.Generator().manual_seed(seed)
    b, s = 3, 9
    ids = torch.randint(3, 97, (b, s), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    cache = RecordingCache(config=model.config)
    params = model_params(model)
    steps = [(ids, mask, pos)]
    nxt = torch.randint(3, 97, (b, 1), generator=g)
    steps.append((nxt, torch.cat([mask, torch.ones_like(nxt)], 1), pos[:, -1:] + 1))
    checked = 0
    for step_ids, step_mask, step_pos in steps:
        seen, acts = capture(model, step_ids, step_mask, step_pos, cache)
        assert [x[0] for x in seen] == list(range(len(params)))
        for layer, k_hf, v_hf in seen:
            a = acts[layer]  # [B, Q, D]
            q = a.shape[1]
            k, v = act_to_kv_ref(a.reshape(b * q, -1), step_pos.reshape(-1), params[layer])
            k = k.view(b, q, *k.shape[1:]).transpose(1, 2)
            v = v.view(b, q, *v.shape[1:]).transpose(1, 2)
            assert torch.equal(k, k_hf), f"layer {layer}: K differs by {(k - k_hf).abs().max():.3e}"
            assert torch.equal(v, v_hf), f"layer {layer}: V differs by {(v - v_hf).abs().max():.3e}"
            checked += 1
    assert checked == 2 * len(params)


KINDS = ["llama-mha", "llama-gqa", "qwen2", "qwen3", "phi3", "phi3-partial", "gemma3", "opt", "opt-post",
         "opt-noaffine"]


@pytest.mark.parametrize("kind", KINDS)
def test_reference_reproduces_layer_kv_exactly(kind):
    _check_model(build(kind, seed=len(kind)), seed=17)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "gemma3", "phi3-partial", "opt"])
def test_reference_reproduces_layer_kv_exactly_fp16(kind):
    """fp16 weights and activations: the reference keeps HF's casts, so equality still holds."""
    _check_model(build(kind, seed=5, dtype=torch.float16), seed=23)


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_reference_reproduces_layer_kv_exactly_bf16(kind):
    """bf16, where Gemma's order (the norm weight product before the cast) and Llama's (after)
    round differently: each model's own order is kept."""
    _check_model(build(kind, seed=6, dtype=torch.bfloat16), seed=29)


def test_gemma_norms_round_in_their_own_order():
    """Reading Gemma3's norms the Llama way (weight product after the cast) changes K in bf16:
    the order the flag selects is the one the exact test above depends on."""
    m = build("gemma3", seed=6, dtype=torch.bfloat16)
    p = layer_params(m, 1)
    assert p.norm_weight_fp32 and p.norm_weight.dtype == torch.float32
    assert torch.equal(p.norm_weight, 1.0 + m.model.layers[1].input_layernorm.weight.float())
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(64, 48, generator=g) * 3).to(torch.bfloat16)
    pos = torch.arange(64)
    k, _ = act_to_kv_ref(a, pos, p)
    llama_order = dataclasses.replace(p, norm_weight=p.norm_weight.to(torch.bfloat16),
                                      k_norm_weight=p.k_norm_weight.to(torch.bfloat16), norm_weight_fp32=False)
    k_llama, _ = act_to_kv_ref(a, pos, llama_order)
    assert not torch.equal(k, k_llama)


def test_extracted_parameters():
    m = build("qwen3", 1)
    p = layer_params(m, 1)
    attn = m.model.layers[1].self_attn
    assert p.norm == "rms" and p.num_kv_heads == 2 and p.head_dim == 16 and p.bias is None
    assert torch.equal(p.weight[:32], attn.k_proj.weight) and torch.equal(p.weight[32:], attn.v_proj.weight)
    assert torch.equal(p.k_norm_weight, attn.k_norm.weight)
    o = layer_params(build("opt", 1), 0)
    assert o.norm == "layer" and o.inv_freq is None and o.bias is not None and o.num_kv_heads == 3
    assert layer_params(build("opt-post", 1), 0).norm == "none"
    # an affine-free LayerNorm reads as weight ones and bias zeros (it raised AttributeError on None.detach)
    na = layer_params(build("opt-noaffine", 1), 0)
    assert na.norm == "layer" and torch.equal(na.norm_weight, torch.ones(48)) and torch.equal(na.norm_bias, torch.zeros(48))
    q2 = layer_params(build("qwen2", 1), 0)
    assert q2.bias is not None and q2.k_norm_weight is None and q2.has_rope
    phi = build("phi3", 1)
    p3 = layer_params(phi, 1)
    qkv = phi.model.layers[1].self_attn.qkv_proj.weight  # rows [q (4 x 16) | k (2 x 16) | v (2 x 16)]
    assert torch.equal(p3.weight, qkv[64:]) and p3.rotary_dim == 16 and not p3.norm_weight_fp32
    assert layer_params(build("phi3-partial", 1), 0).rotary_dim == 8
    gm = build("gemma3", 1)
    local, full = layer_params(gm, 0), layer_params(gm, 1)  # sliding: theta 1e4; full: 1e6
    assert local.inv_freq[1] > full.inv_freq[1] and torch.equal(full.inv_freq, gm.model.rotary_emb.full_attention_inv_freq)
    assert torch.equal(full.k_norm_weight, 1.0 + gm.model.layers[1].self_attn.k_norm.weight.float())


def test_bad_inputs_raise():
    p = layer_params(build("llama-gqa", 2), 0)
    with pytest.raises(ValueError, match="hidden"):
        act_to_kv_ref(torch.zeros(3, 5), torch.arange(3), p)
    with pytest.raises(ValueError, match="position"):
        act_to_kv_ref(torch.zeros(3, 72), torch.arange(2), p)
    with pytest.raises(ValueError, match="dtype"):
        act_to_kv_ref(torch.zeros(3, 72, dtype=torch.float64), torch.arange(3), p)
    with pytest.raises(ValueError, match="layer_idx"):
        layer_params(build("llama-gqa", 2), 2)
    with pytest.raises(ValueError, match="weight"):
        ActToKVParams("rms", torch.ones(8), None, 1e-6, torch.zeros(10, 8), None, 2, 4)
    with pytest.raises(ValueError, match="norm"):
        ActToKVParams("batch", None, None, 1e-6, torch.zeros(16, 8), None, 2, 4)


def test_rope_tables_shared_across_layers_give_same_result():
    m = build("llama-gqa", 3)
    p = model_params(m)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 72, generator=g)
    pos = torch.tensor([0, 5, 3, 100, 7, 7, 255])
    tables = rope_tables(p[0], pos)
    for lp in p:
        k1, v1 = act_to_kv_ref(a, pos, lp, rope=tables)
        k2, v2 = act_to_kv(a, pos, lp)  # CPU: the reference
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
