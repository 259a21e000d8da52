"""``leankit.apply``: plain generate and text-generation pipelines get a fresh LeanCache per call."""

import pytest
import torch
from transformers import pipeline

import leankit
from leankit import LeanCache
from leankit import cache as cache_module
from leankit.hf import cache_kwargs
from leankit.testing import tiny_model, tiny_tokenizer

PROMPTS = ["w5 w6 w7 w8", "w9", "w10 w11 w12", "w13 w14"]


@pytest.fixture
def built(monkeypatch):
    """Record every LeanCache the wrapper builds."""
    caches = []
    init = cache_module.LeanCache.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        caches.append(self)

    monkeypatch.setattr(cache_module.LeanCache, "__init__", spy)
    return caches


def _pipe(model, tok, **kw):
    pipe = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    return [o[0]["generated_text"] for o in pipe(PROMPTS, max_new_tokens=6, do_sample=False, **kw)]


def test_pipeline_over_a_list_uses_a_fresh_cache_per_call(built):
    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    model.generation_config.pad_token_id = tok.pad_token_id
    ref = _pipe(model, tok)  # DynamicCache
    leankit.apply(model, "FP16")
    assert _pipe(model, tok) == ref  # lossless, one prompt per call
    assert len(built) == len(PROMPTS) and len({id(c) for c in built}) == len(PROMPTS)
    assert _pipe(model, tok, batch_size=3) == ref  # left-padded batches of 3, then 1
    assert len(built) == len(PROMPTS) + 2
    leankit.apply(model, "K8V4", window=8)  # a new config replaces the old one
    out = _pipe(model, tok)
    assert len(out) == len(PROMPTS) and built[-1].cfg == leankit.KVConfig.parse("K8V4", window=8)


def test_plain_generate_and_eos_from_the_call(built):
    model = tiny_model("qwen2")
    ids, mask = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        leankit.apply(model, "FP16")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
        assert torch.equal(out, ref) and len(built) == 1 and built[0].eos_ids.numel() == 0
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, eos_token_id=[2, 7])
        assert built[1].eos_ids.tolist() == [2, 7]
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, eos_token_id=2,
                       pad_token_id=9)  # the padding this call feeds a finished row ends it
        assert built[2].end_ids.tolist() == [2, 9]
        # a call that brings its own cache, or none at all, is left alone
        own = LeanCache(model, "K8V4")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **cache_kwargs(model, own), eos_token_id=None)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, use_cache=False, eos_token_id=None)
    assert built[3:] == [own]


def test_a_generation_config_given_any_way_is_honoured(built):
    """``use_cache`` and the stop ids come from the call's GenerationConfig, whether it is passed by
    keyword, as generate's second positional argument, or set on the model."""
    from transformers import GenerationConfig

    from leankit.testing import left_padded_batch

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(2, 9, seed=1)
    no_cache = GenerationConfig(use_cache=False, do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    stops = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=[96, 95])
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=no_cache)
        ref_stops = model.generate(ids, stops, attention_mask=mask)
        leankit.apply(model, "FP16")
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, generation_config=no_cache), ref)
        assert torch.equal(model.generate(ids, no_cache, attention_mask=mask), ref)
        model.generation_config.use_cache = False
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                                          pad_token_id=0, eos_token_id=None), ref)
        # a passed config that leaves use_cache unset takes the model's, as generate resolves it
        unset = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=0)
        if unset.use_cache is None:  # (transformers that fill unset fields from the model's config)
            assert torch.equal(model.generate(ids, unset, attention_mask=mask), model.__class__.generate(
                model, ids, unset, attention_mask=mask))
        assert built == []  # no call above stores anything in a LeanCache
        model.generation_config.use_cache = True
        assert torch.equal(model.generate(ids, stops, attention_mask=mask), ref_stops)
        model.generation_config.eos_token_id = 95
        model.generate(ids, GenerationConfig(do_sample=False, max_new_tokens=2, pad_token_id=0), attention_mask=mask)
    assert len(built) == 2 and built[0].eos_ids.tolist() == [96, 95] and built[0].end_ids.tolist() == [96, 95, 0]
    assert built[1].eos_ids.tolist() == [95]  # unset in the passed config: the model's


def test_apply_none_and_remove_restore_the_model():
    model = tiny_model("llama-gqa")
    attn = model.config._attn_implementation
    leankit.apply(model, "K8V4")
    assert "generate" in model.__dict__ and model.config._attn_implementation == "leankit"
    leankit.apply(model, "K4V2")  # re-applying keeps the original to restore
    leankit.apply(model, None)
    assert "generate" not in model.__dict__ and model.config._attn_implementation == attn
    leankit.apply(model, "K8V4")
    leankit.remove(model)
    assert "generate" not in model.__dict__
    assert leankit.remove(model) is model  # removing twice is harmless


def test_remove_restores_each_sub_models_attention_of_a_composite_model():
    # apply switches the vision tower to "leankit" with the text model; remove used to set the whole
    # model to the top-level name, so an eager vision tower came back as sdpa (no attention weights)
    model = tiny_model("gemma3-image-text", seed=1)
    model.set_attn_implementation({"": "sdpa", "text_config": "sdpa", "vision_config": "eager"})
    leankit.apply(model, "K8V4")
    assert model.config.vision_config._attn_implementation == "leankit"
    leankit.apply(model, None)
    cfg = model.config
    assert (cfg._attn_implementation, cfg.text_config._attn_implementation,
            cfg.vision_config._attn_implementation) == ("sdpa", "sdpa", "eager")
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        out = model.model.vision_tower(pixel_values=pixels, output_attentions=True)
    assert out.attentions and out.attentions[0] is not None  # eager's weights, as before apply


def test_apply_rejects_bad_input_and_leaves_the_model_alone():
    model = tiny_model("llama-gqa")
    for bad in ("K8V3", "K4V2-K8V4"):
        with pytest.raises(ValueError):
            leankit.apply(model, bad)
    with pytest.raises(ValueError, match="th"):
        leankit.apply(model, "K8V4", th="0.3")
    with pytest.raises(ValueError, match="overrides"):
        leankit.apply(model, None, window=3)
    assert "generate" not in model.__dict__ and not hasattr(model, "_leankit_apply")
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="model types"):  # OPT is served; GPT-2 is not
        leankit.apply(gpt2, "K8V4")


def test_a_deep_copied_model_generates_with_its_own_weights():
    """``copy.deepcopy`` of an applied model: the copy's ``generate`` runs the copy, not the original."""
    import copy

    from leankit.testing import left_padded_batch

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(2, 9, seed=1)
    leankit.apply(model, "FP16")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        out = twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            return_dict_in_generate=True)
        leankit.apply(twin, None)
        ref = twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out.sequences, ref)  # (it gave the original model's tokens)
    assert type(out[1]).__name__ == "LeanCache"  # the cache this call was handed
    assert model.generate.leankit_config == leankit.KVConfig.parse("FP16")


def test_a_default_cache_implementation_is_overridden_and_a_calls_own_is_left_alone(built):
    """A model whose generation config names a cache_implementation (a generation_config.json's
    "static") gets a LeanCache, where transformers refused the pair; a call that names its own gets
    that cache, as one that passes its own cache does."""
    from transformers import GenerationConfig

    from leankit.testing import left_padded_batch

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(2, 9, seed=1)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        model.generation_config.cache_implementation = "static"
        leankit.apply(model, "FP16")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        assert torch.equal(out, ref) and len(built) == 1
        # a pipeline passes a copy of the model's generation config: the same default, a LeanCache too
        copy_config = GenerationConfig.from_dict(model.generation_config.to_dict())
        assert copy_config.cache_implementation == "static"
        out = model.generate(ids, copy_config, attention_mask=mask, max_new_tokens=5, do_sample=False)
        assert torch.equal(out, ref) and len(built) == 2
        for own in ({"cache_implementation": "dynamic"},
                    {"generation_config": GenerationConfig(cache_implementation="dynamic", max_new_tokens=5)}):
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 return_dict_in_generate=True, **own)
            assert type(res[1]).__name__ == "DynamicCache" and torch.equal(res.sequences, ref)
        assert len(built) == 2


def test_a_model_leankit_hooked_still_pickles():
    """The hooks ``enable`` installs and ``apply``'s generate pickle with the model (torch.save(model))."""
    import io

    from leankit.testing import left_padded_batch

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(2, 9, seed=1)
    leankit.apply(model, "K8V4")
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False), ref)
