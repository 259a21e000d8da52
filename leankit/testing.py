"""Tiny random-init models built in code, for tests and examples (no downloads)."""

from __future__ import annotations

import torch


def tiny_config(kind: str = "llama-gqa", **kw):
    """A tiny random-init config: ``llama-mha``, ``llama-gqa``, ``qwen2``, ``qwen3``, ``phi3``,
    ``gemma3`` (sliding and full layers, ``k_norm``), ``mistral-sliding`` or ``opt``."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

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
    if kind == "qwen3":  # q_norm/k_norm before RoPE, explicit head_dim
        return Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common)
    if kind == "phi3":  # fused qkv projection
        return Phi3Config(num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "gemma3":
        # three layers: sliding, full, sliding; a window of 8 so short tests cross it
        common["num_hidden_layers"] = kw.get("num_hidden_layers", 3)
        head_dim = kw.get("head_dim", 16)
        return Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=kw.get("num_key_value_heads", 1),
                                head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                sliding_window=kw.get("sliding_window", 8),
                                layer_types=kw.get("layer_types", ["sliding_attention", "full_attention",
                                                                   "sliding_attention"]),
                                **{k: v for k, v in common.items()
                                   if k not in ("sliding_window", "layer_types", "head_dim", "num_key_value_heads")})
    if kind == "mistral-sliding":  # every layer slides: nothing to compress, still served
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=kw.get("sliding_window", 8),
                             **{k: v for k, v in common.items() if k != "sliding_window"})
    if kind == "opt":
        return OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=512)
    raise ValueError(kind)


def left_padded_batch(rows: int = 3, width: int = 13, seed: int = 0, pad_step: int = 4, vocab: int = 97):
    """``(input_ids, attention_mask)`` of random tokens, row ``r`` left-padded with
    ``(r * pad_step) % (width - 2)`` pad tokens (id 0), so every row keeps at least two real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        pad = (r * pad_step) % (width - 2)
        ids[r, :pad], mask[r, :pad] = 0, 0
    return ids, mask


def tiny_model(kind: str = "llama-gqa", seed: int = 0, **kw):
    """A tiny random-init causal LM in eval mode: a :func:`tiny_config` kind, or
    ``gemma3-image-text`` (Gemma3's image-text model around the ``gemma3`` text config built from
    ``kw``, with a one-layer vision tower; image token 96, begin/end of image 94/95)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if kind == "gemma3-image-text":
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        cfg = Gemma3Config(text_config=tiny_config("gemma3", **kw).to_dict(), vision_config=vision.to_dict(),
                           mm_tokens_per_image=4, image_token_index=96, boi_token_index=94, eoi_token_index=95)
        return Gemma3ForConditionalGeneration(cfg).eval()
    return AutoModelForCausalLM.from_config(tiny_config(kind, **kw)).eval()


def tiny_tokenizer(vocab_size: int = 97):
    """A word-level fast tokenizer built in code, matching :func:`tiny_model`'s vocabulary.

    Ids 0-3 are ``<pad>``, ``<s>``, ``</s>``, ``<unk>``; the rest are the words ``w4`` ...
    ``w{vocab_size - 1}`` (anything else is ``<unk>``). It prepends ``<s>`` and pads on the left,
    as a decoder-only model wants for batched generation.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")


def layer_phase_hooks(model, target) -> list:
    """Forward hooks that set ``target.phase`` to ``"layer i"`` while decoder layer ``i`` runs and
    back to ``"step"`` after it, so a sync counter can tell a layer's host syncs from the step's.
    Returns the hook handles (``h.remove()`` each when done)."""
    handles = []
    for i, layer in enumerate(model.get_decoder().layers):
        def pre(_m, _a, i=i):
            target.phase = f"layer {i}"

        def post(_m, _a, _o):
            target.phase = "step"

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles
