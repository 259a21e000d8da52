"""Tiny random-init models built in code, for tests and examples (no downloads)."""

from __future__ import annotations

import torch


def tiny_config(kind: str = "llama-gqa", **kw):
    """A tiny random-init config: ``llama-mha``, ``llama-gqa``, ``qwen2`` or ``opt``."""
    from transformers import LlamaConfig, OPTConfig, Qwen2Config

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(kw)
    if kind == "llama-mha":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
    if kind == "llama-gqa":
        common["hidden_size"] = kw.get("hidden_size", 96)  # head_dim 16, 3 query heads per KV head
        return LlamaConfig(num_attention_heads=6, num_key_value_heads=2, **common)
    if kind == "qwen2":
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "opt":
        return OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=512)
    raise ValueError(kind)


def tiny_model(kind: str = "llama-gqa", seed: int = 0, **kw):
    """A tiny random-init causal LM in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **kw)).eval()
