"""The real SmolLM2-135M (GQA 9q/3kv, head_dim 64) through LeanCache. Marked slow."""

import copy

import pytest
import torch
from transformers import DynamicCache

from leankit import LeanCache
from leankit.hf import cache_kwargs

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three benefits of regular exercise:\n1.",
]

LONG_TEXT = (
    "The Industrial Revolution, which began in Great Britain in the late eighteenth century, transformed the way "
    "goods were produced. Machines driven by water and later by steam replaced much of the work once done by hand. "
    "Textile mills grew in the north of England, canals and then railways carried coal and cotton across the country, "
    "and cities such as Manchester and Birmingham expanded rapidly as workers moved from the countryside. "
)


def _gen(model, tok, prompts, cache_factory, max_new_tokens=64):
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, **cache_kwargs(model, cache_factory()), do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
    return out[:, enc.input_ids.shape[1]:]


def test_fp16_identical_to_dynamic_cache_batched_and_alone(smollm2):
    model, tok = smollm2
    ref = _gen(model, tok, PROMPTS, lambda: DynamicCache(config=model.config))
    batched = _gen(model, tok, PROMPTS, lambda: LeanCache(model, "FP16"))
    assert torch.equal(batched, ref)
    for i, p in enumerate(PROMPTS):
        alone = _gen(model, tok, [p], lambda: LeanCache(model, "FP16"))
        assert torch.equal(alone[0], ref[i])


def test_the_loaded_tokenizer_pads_a_batch_on_the_left_and_its_generate_matches_dynamic_cache(smollm2):
    """load_model's tokenizer pads on the left, as batched generation needs: a batch encoded with
    its defaults runs through a LeanCache and gives DynamicCache's tokens."""
    model, tok = smollm2
    enc = tok(["Paris is", "The longest river in Europe is the"], return_tensors="pt", padding=True)
    assert enc.attention_mask[0, 0] == 0 and bool(enc.attention_mask[:, -1].all())
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tok.pad_token_id, "eos_token_id": None}
    with torch.no_grad():
        got = model.generate(**enc, **kw, **cache_kwargs(model, LeanCache(model, "FP16")))
        want = model.generate(**enc, **kw, **cache_kwargs(model, DynamicCache(config=model.config)))
    assert torch.equal(got, want)


def test_fp16_on_a_bf16_model_parts_from_dynamic_cache_only_at_a_tie(smollm2):
    """On a 16-bit model FP16 keeps the model's K/V bits but sums attention in fp32, where SDPA
    rounds its own way: logits stay within a few bf16 units of DynamicCache's, and greedy tokens
    may part only where DynamicCache's top two logits are that close."""
    model, tok = smollm2
    model = copy.deepcopy(model).to(torch.bfloat16)  # the fixture's fp32 weights stay as they are
    kw = {"do_sample": False, "max_new_tokens": 16, "pad_token_id": tok.pad_token_id, "eos_token_id": None,
          "output_scores": True, "return_dict_in_generate": True}
    for prompt in PROMPTS[:3]:
        enc = tok([prompt], return_tensors="pt")
        with torch.no_grad():
            ref = model.generate(**enc, **cache_kwargs(model, DynamicCache(config=model.config)), **kw)
            got = model.generate(**enc, **cache_kwargs(model, LeanCache(model, "FP16")), **kw)
        n = enc.input_ids.shape[1]
        for step, (a, b) in enumerate(zip(ref.scores, got.scores)):
            a, b = a[0].float(), b[0].float()
            gap = (a - b).abs().max().item()
            # bf16 keeps 8 significant bits: a unit at logit size L is L / 128
            assert gap <= 8 * a.abs().max().item() / 128, (prompt, step, gap)
            if ref.sequences[0, n + step] != got.sequences[0, n + step]:
                top2 = a.topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * gap, (prompt, step, gap)
                break


@pytest.mark.parametrize("spec,bound", [("K8V4", 0.45), ("K4V2", 0.27)])
def test_compression_ratio_at_1k_context(smollm2, spec, bound):
    model, tok = smollm2
    ids = tok(LONG_TEXT * 20, return_tensors="pt").input_ids[:, :1024]
    assert ids.shape[1] == 1024
    cache = LeanCache(model, spec)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                             do_sample=False, max_new_tokens=16, pad_token_id=tok.pad_token_id, eos_token_id=None)
    rep = cache.memory_report()
    assert rep["kv_bytes"] == rep["pages_used"] * 2048
    assert rep["pages_ratio"] <= bound, rep  # the pages alone, as the README's measurements count them
    assert rep["ratio"] == pytest.approx((rep["kv_bytes"] + rep["table_bytes"]) / rep["fp16_bytes"])
    assert rep["dense_ratio"] == pytest.approx(rep["ratio"] / 2)  # the model keeps fp32 K/V
    # The continuation stays on topic: the greedy tokens of the quantized cache agree with the
    # exact cache on most of the first 16 positions.
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
    agree = (out[0, 1024:] == ref[0, 1024:]).float().mean().item()
    assert agree >= (0.5 if spec == "K8V4" else 0.25), (spec, agree, tok.decode(out[0, 1024:]))
