"""``leankit.hf``: the keyword a transformers release takes the cache by, and the cache a model output carries."""

import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache

import leankit
from leankit.hf import cache_keyword, cache_kwargs, output_cache
from leankit.testing import left_padded_batch, tiny_model


class _NewForward(torch.nn.Module):  # transformers >= 5.24
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        return cache


class _OldForward(torch.nn.Module):  # transformers <= 5.23
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        return past_key_values


def test_the_keyword_follows_the_forward_signature():
    assert cache_keyword(_NewForward()) == "cache"
    assert cache_keyword(_OldForward()) == "past_key_values"
    marker = object()
    for module in (_NewForward(), _OldForward()):
        assert module(**cache_kwargs(module, marker)) is marker  # the forward receives it under its own name


def test_an_unreadable_forward_falls_back_to_the_old_name():
    class NoSignature:
        forward = print  # a builtin: inspect.signature raises ValueError

    assert cache_keyword(NoSignature()) == "past_key_values"
    assert cache_keyword(object()) == "past_key_values"


def test_the_installed_transformers_gets_its_own_name():
    model = tiny_model("llama-gqa")
    takes_cache = "cache" in inspect.signature(model.forward).parameters
    assert cache_keyword(model) == ("cache" if takes_cache else "past_key_values")


def test_generate_uses_the_leancache_without_a_deprecation_warning():
    model = tiny_model("llama-gqa")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    cache = leankit.LeanCache(model, "K8V4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the old keyword warns from transformers 5.24 on
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
    assert out.shape == (1, 9)
    assert cache.get_seq_length() == 8  # the prompt and three fed-back tokens went through the LeanCache


def test_output_cache_returns_the_cache_of_a_forward():
    model = tiny_model("llama-gqa")
    dyn = DynamicCache()
    out = model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True, **cache_kwargs(model, dyn))
    assert output_cache(out) is dyn
    assert output_cache({"logits": out.logits}) is None


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
@pytest.mark.parametrize("kv", ["K8V4", "K8V4-K4V2:th=0.3,tl=0.05,compress_every=1", "K8V4:act=0.5"])
def test_generate_under_inference_mode_matches_no_grad(kind, kv):
    """``torch.inference_mode`` makes tensors without a version counter, the padding mask included:
    a lossy LeanCache's prompt (whose mask memo read that counter) must run under it and give the
    tokens it gives under ``no_grad``."""
    model = tiny_model(kind)
    ids, mask = left_padded_batch(3, 21)
    outs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            cache = leankit.LeanCache(model, kv)
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                       pad_token_id=0, **cache_kwargs(model, cache)))
    assert outs[1].shape == (3, 21 + 12)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv", ["K8V4", "K8V4-K4V2:th=0.3,tl=0.05,compress_every=1", "K8V4:act=0.5"])
@pytest.mark.parametrize("modes", [("inference_mode", "no_grad", "no_grad"), ("no_grad", "inference_mode", "no_grad"),
                                   ("no_grad", "no_grad", "inference_mode")])
def test_a_cache_moves_between_inference_mode_and_no_grad(kv, modes):
    """A cache built, filled and continued under different modes (``modes``: build, first generate,
    second generate) gives the tokens of one that never left ``no_grad``: its pages, tables and
    scores, written in place, are normal tensors even when made under ``inference_mode``, as
    ``DynamicCache``'s concatenated tensors can be used in either mode."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(3, 21)
    more = torch.cat([mask, mask.new_ones(3, 5)], 1)

    def run(build, first, second):
        with getattr(torch, build)():
            cache = leankit.LeanCache(model, kv)
        with getattr(torch, first)():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 pad_token_id=0, **cache_kwargs(model, cache))
        with getattr(torch, second)():
            return model.generate(input_ids=out, attention_mask=more, max_new_tokens=6, do_sample=False,
                                  pad_token_id=0, **cache_kwargs(model, cache))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ACT on a GQA model warns that it costs more than KV
        want = run("no_grad", "no_grad", "no_grad")
        got = run(*modes)
    assert got.shape == (3, 21 + 5 + 6)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv", ["K8V4", "K8V4-K4V2:th=0.3,tl=0.05,compress_every=1", "K8V4:act=0.5"])
def test_a_forward_with_grad_mode_on_gives_the_no_grad_logits_and_warns_once(kv):
    """A plain ``model(**inputs)`` runs with grad mode on: the cache's work then runs without
    autograd (its prompt path writes into preallocated buffers, which autograd refuses), gives the
    logits of a ``no_grad`` forward, and warns once per cache that no gradient flows through it."""
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(3, 17)
    nxt = torch.tensor([[5], [6], [7]])
    more = torch.cat([mask, mask.new_ones(3, 1)], 1)
    logits = {}
    for grad in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.set_grad_enabled(grad):
                cache = leankit.LeanCache(model, kv)
                first = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
                second = model(input_ids=nxt, attention_mask=more, use_cache=True, **cache_kwargs(model, cache))
        logits[grad] = (first.logits.detach(), second.logits.detach())
        told = [w for w in caught if "inference-only" in str(w.message)]
        assert len(told) == (1 if grad else 0)  # once per cache, over both steps and every layer
    assert first.logits.requires_grad  # the model's own layers still track gradients
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)


def test_an_image_text_model_whose_decoder_gets_built_masks():
    """Gemma3's image-text model builds its per-layer-type masks itself and hands its decoder a dict
    of them: the cache takes the rows' padding from the 2-D mask the whole model was called with,
    and a left-padded batch through FP16 gives DynamicCache's tokens (a lossy config runs too)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127,
        boi_token_index=125, eoi_token_index=126)).eval()
    ids, mask = left_padded_batch(rows=3, width=9, pad_step=3)
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model.generate(**kw, **cache_kwargs(model, DynamicCache(config=model.config)))
        got = model.generate(**kw, **cache_kwargs(model, leankit.LeanCache(model, "FP16")))
        lossy = model.generate(**kw, **cache_kwargs(model, leankit.LeanCache(model, "K8V4")))
    assert torch.equal(got, want)
    assert lossy.shape == want.shape


def _causal_4d(mask2d: torch.Tensor, q_len: int, additive: bool) -> torch.Tensor:
    """The causal mask of a 2-D padding mask as a 4-D ``[B, 1, q_len, T]`` mask (bool or additive)."""
    t = mask2d.shape[1]
    seen = torch.ones(t, t, dtype=torch.bool).tril()[-q_len:][None] & mask2d[:, None, :].bool()
    if not additive:
        return seen[:, None]
    return torch.zeros(seen.shape, dtype=torch.float32).masked_fill(~seen, torch.finfo(torch.float32).min)[:, None]


def _mask_steps(model, ids, mask, four_d, cache, additive=True, positions=True, steps=3):
    """Logits of a prompt and ``steps - 1`` greedy steps, each called with the 2-D mask or its 4-D
    causal mask (and the rows' positions, unless ``positions`` is off)."""
    p = (mask.cumsum(1) - 1).clamp_min(0) if positions else None
    m, x, out = mask, ids, []
    with torch.no_grad():
        for _ in range(steps):
            kw = {"attention_mask": _causal_4d(m, x.shape[1], additive) if four_d else m}
            if p is not None:
                kw["position_ids"] = p
                p = p[:, -1:] + 1
            out.append(model(x, **kw, **cache_kwargs(model, cache)).logits[:, -1])
            x = out[-1].argmax(-1, keepdim=True)
            m = torch.cat([m, torch.ones(m.shape[0], 1, dtype=m.dtype)], 1)
    return torch.stack(out)


def _image_text_gemma3():
    from leankit.testing import tiny_model

    # a window longer than the tests' sequences: one 4-D mask serves every layer type (transformers)
    return tiny_model("gemma3-image-text", sliding_window=64)


@pytest.mark.parametrize("kv", ["FP16", "K8V4"])
@pytest.mark.parametrize("additive", [True, False])
@pytest.mark.parametrize("kind", ["llama-gqa", "opt", "image-text"])
def test_a_4d_padding_mask_is_read_as_its_padding(kv, additive, kind):
    """A causal-plus-padding 4-D mask stores the same tokens and gives the same logits as its 2-D mask:
    on a plain decoder, on OPT with no positions given (they come from the padding), and on an
    image-text model whose decoder is handed the masks the outer model built."""
    model = _image_text_gemma3() if kind == "image-text" else tiny_model(kind)
    ids, mask = left_padded_batch(rows=3, width=11)
    positions = kind != "opt"
    logits = []
    for four_d in (False, True):
        cache = leankit.LeanCache(model, kv)
        logits.append(_mask_steps(model, ids, mask, four_d, cache, additive, positions))
        assert cache.memory_report()["tokens_per_row"] == (mask.sum(1) + 2).tolist()  # padding not stored
    # bool: bit-equal; additive: SDPA adds the float mask to the scores (another kernel path), ~1e-7 apart
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-6 if additive else 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_batch_broadcast_4d_mask_serves_every_row(monkeypatch, backend):
    """``[1, 1, q, k]`` (one mask for the batch) is every row's padding, on the decode path of either backend."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, 7, dtype=torch.long)
    ref = _mask_steps(model, ids, mask.expand(2, -1), False, leankit.LeanCache(model, "K8V4"), positions=False)
    got = _mask_steps(model, ids, mask, True, leankit.LeanCache(model, "K8V4"), positions=False)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    cache = leankit.LeanCache(model, "K8V4")
    with torch.no_grad(), pytest.raises(ValueError, match="batch of 2 rows has 3"):
        model(ids, attention_mask=_causal_4d(torch.ones(3, 7, dtype=torch.long), 7, True), **cache_kwargs(model, cache))


def test_padding_rows_a_mask_builder_unmasked_are_read_as_padding():
    """Some builders let an all-masked padding query see every key (so SDPA meets no empty row): those
    rows are padding; a row that sees some later keys but not all is not causal and is refused."""
    from leankit.cache import padding_mask_of

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    seen = _causal_4d(mask, 5, additive=False)
    seen[0, 0, :2] = True  # rows 0 and 1 of the padded row see every key
    assert padding_mask_of(seen, 0, 5).tolist() == mask.tolist()
    inverted = ~_causal_4d(mask, 5, additive=False)
    with pytest.raises(ValueError, match="causal mask of padding"):
        padding_mask_of(inverted, 0, 5)


def test_a_4d_mask_that_is_not_padding_is_refused_and_leaves_the_cache_fresh():
    """A block-diagonal (packed) 4-D mask cannot be honoured by later steps: a clear error, nothing stored."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 90, (1, 8))
    seen = torch.ones(8, 8, dtype=torch.bool).tril()
    seen[4:, :4] = False  # two packed sequences of 4
    cache = leankit.LeanCache(model, "K8V4")
    with torch.no_grad(), pytest.raises(ValueError, match="causal mask of padding"):
        model(ids, attention_mask=seen[None, None], **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0 and cache.table is None
    with torch.no_grad():  # the cache still serves a plain call
        model(ids, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 8


def test_switching_the_attention_implementation_after_the_cache_is_built_is_a_clear_error():
    """Only leankit's attention reads the pages; under SDPA the layers would attend to the new tokens
    alone while the cache counted them stored."""
    model = tiny_model("llama-gqa")
    cache = leankit.LeanCache(model, "FP16")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, 90, (1, 6))
    with torch.no_grad(), pytest.raises(ValueError, match="attention implementation is 'sdpa'"):
        model.generate(ids, max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0
    leankit.enable(model)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, **cache_kwargs(model, cache))
        ref = model.generate(ids, max_new_tokens=3, do_sample=False, **cache_kwargs(model, DynamicCache()))
    assert out.tolist() == ref.tolist()


def test_enable_switches_an_image_text_models_decoder_back():
    """The decoder's own (text) config can be switched alone; enable switches it back, as the error
    raised meanwhile says."""
    model = _image_text_gemma3()
    cache = leankit.LeanCache(model, "K8V4")
    model.set_attn_implementation({"text_config": "sdpa"})
    ids = torch.randint(3, 90, (1, 6))
    with torch.no_grad(), pytest.raises(ValueError, match="attention implementation is 'sdpa'"):
        model(ids, **cache_kwargs(model, cache))
    leankit.enable(model)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 6


def test_a_used_cache_handed_to_another_generate_call_is_refused():
    """A second generate call on a used LeanCache cuts its prompt by the old length and would attend
    to the old request: its mask does not cover the sequence the cache holds, so the step is refused
    before it opens, and the cache still continues its own sequence (whole mask, or the new tokens')."""
    from leankit.testing import left_padded_batch, tiny_model

    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(3, 9, seed=1)
    kw = {"do_sample": False, "max_new_tokens": 6, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        cache = leankit.LeanCache(model, "FP16")
        first = model.generate(input_ids=ids, attention_mask=mask, **kw, **cache_kwargs(model, cache))
        seen = cache.get_seq_length()
        for prompt, m in ((ids, mask), (ids[:, :5], mask[:, :5])):
            with pytest.raises(ValueError, match="pass a fresh LeanCache to each generate call"):
                model.generate(input_ids=prompt, attention_mask=m, **kw, **cache_kwargs(model, cache))
            assert cache.get_seq_length() == seen and cache._step is None
        whole = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
        more = model.generate(input_ids=first, attention_mask=whole, **kw, **cache_kwargs(model, cache))
        assert torch.equal(more, ref)
        # a manual step may bring a mask of its own tokens alone
        logits = model(input_ids=more[:, -1:], attention_mask=torch.ones(3, 1, dtype=mask.dtype),
                       **cache_kwargs(model, cache)).logits
        assert logits.shape[:2] == (3, 1)


def test_output_attentions_with_a_leancache_warns_that_no_weights_come(recwarn):
    """transformers' SDPA path warns that it returns no attention weights; a LeanCache step, which
    returns none either, says so too instead of handing back empty tuples silently."""
    from leankit import hf
    from leankit.testing import left_padded_batch, tiny_model

    hf._warn_no_attention_weights.cache_clear()
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(2, 9)
    with torch.no_grad(), pytest.warns(UserWarning, match="a LeanCache step returns no attention weights"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, output_attentions=True,
                       return_dict_in_generate=True, **cache_kwargs(model, leankit.LeanCache(model, "FP16")))


@pytest.mark.parametrize("kind", ["opt", "gemma3", "mistral-sliding"])
def test_a_mask_of_the_steps_tokens_alone_is_refused_where_the_model_reads_all_of_it(kind):
    """OPT derives positions from the whole mask, and sliding-window layers (transformers' own
    cache) mask with it: a mask of the new tokens alone would give wrong tokens, so it is refused
    before the step opens, and the whole mask still serves the step."""
    from leankit.testing import left_padded_batch, tiny_model

    model = tiny_model(kind)
    ids, mask = left_padded_batch(2, 9)
    cache = leankit.LeanCache(model, "FP16")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
        nxt = torch.tensor([[5], [6]])
        with pytest.raises(ValueError, match="read all of it"):
            model(input_ids=nxt, attention_mask=torch.ones(2, 1, dtype=mask.dtype), **cache_kwargs(model, cache))
        assert cache.get_seq_length() == 9
        whole = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        got = model(input_ids=nxt, attention_mask=whole, **cache_kwargs(model, cache)).logits
        dyn = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, dyn))
        want = model(input_ids=nxt, attention_mask=whole, **cache_kwargs(model, dyn)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_image_text_step_with_token_types_after_the_prompt_keeps_its_sliding_masks():
    """With token types, Gemma3's image-text model builds its sliding-window mask through the
    full-mask builder: a chunked prompt with an image (and a text new turn) must still give
    DynamicCache's tokens, the plain sliding layers masked as transformers masks them."""
    from leankit.testing import tiny_model

    model = tiny_model("gemma3-image-text", sliding_window=64)
    ids = torch.tensor([[1, 5, 94, 96, 96, 96, 96, 95, 7, 8, 9, 10], [0, 0, 0, 0, 94, 96, 96, 96, 96, 95, 7, 8]])
    mask = (ids != 0).long()
    torch.manual_seed(0)
    kw = {"input_ids": ids, "attention_mask": mask, "token_type_ids": (ids == 96).long(),
          "pixel_values": torch.randn(2, 3, 28, 28), "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0,
          "prefill_chunk_size": 4}
    with torch.no_grad():
        want = model.generate(**kw, **cache_kwargs(model, DynamicCache(config=model.config)))
        got = model.generate(**kw, **cache_kwargs(model, leankit.LeanCache(model, "FP16")))
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv", ["FP16", "FP16-FP16:th=0.5"])
def test_an_image_split_by_a_prefill_chunk_keeps_its_bidirectional_attention(monkeypatch, backend, kv):
    """Gemma3 lets one image's tokens see each other both ways (token types -> an or-mask). A step
    after the prompt attended its own tokens causally by position, ignoring the model's mask: with
    ``prefill_chunk_size=4`` the image tokens of a later chunk lost their bidirectional part (logits
    3.5e-3 off DynamicCache's on FP16, 0.13 in a manual chunking). Now the step's own keys follow
    the model's mask block: DynamicCache's logits, in chunks and in a new turn carrying an image, on
    either backend, with or without significance."""
    from leankit.testing import tiny_model

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("gemma3-image-text", sliding_window=64, seed=3)
    ids = torch.tensor([[1, 5, 94, 96, 96, 96, 96, 95, 7, 8, 9, 10], [0, 0, 0, 1, 94, 96, 96, 96, 96, 95, 7, 8]])
    mask = (ids != 0).long()
    types = (ids == 96).long()
    torch.manual_seed(1)
    kw = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
          "pixel_values": torch.randn(2, 3, 28, 28), "max_new_tokens": 3, "do_sample": False, "pad_token_id": 0,
          "prefill_chunk_size": 4, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        want = model.generate(**kw, **cache_kwargs(model, DynamicCache(config=model.config)))
        got = model.generate(**kw, **cache_kwargs(model, leankit.LeanCache(model, kv)))
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-5)

    # a text prompt, then a turn whose image tokens all come in one step of several queries
    pos = (mask.cumsum(1) - 1).clamp_min(0)

    def turns(cache):
        with torch.no_grad():
            model(input_ids=ids[:, :3], attention_mask=mask[:, :3], position_ids=pos[:, :3],
                  **cache_kwargs(model, cache))
            return model(input_ids=ids[:, 3:], attention_mask=mask, token_type_ids=types, position_ids=pos[:, 3:],
                         **cache_kwargs(model, cache)).logits

    want = turns(DynamicCache(config=model.config))
    got = turns(leankit.LeanCache(model, kv))
    real = mask[:, 3:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)


def test_an_audio_encoders_padding_mask_is_built_in_a_new_turn():
    """A composite model's encoder is switched to leankit's attention with the whole model and builds
    its bidirectional padding mask through leankit's mask function. In a new turn (a step after the
    prompt) that mask must still be built, not skipped as the decoder's unread full mask is: a new
    turn carrying audio of two lengths gives DynamicCache's logits (before, the shorter row's audio
    encoder attended over its padding frames, 0.76 off on FP16)."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2Config

    text = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, initializer_range=0.1)
    audio = {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
             "num_mel_bins": 16, "max_source_positions": 50}
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(Qwen2AudioConfig(audio_config=audio, text_config=text.to_dict(),
                                                                 audio_token_index=299)).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 290, (2, 6), generator=g)
    turn = torch.randint(3, 290, (2, 27), generator=g)
    turn[0, 1:26], turn[1, 1:16] = 299, 299  # 100 and 60 feature frames: 25 and 15 audio tokens
    feats = torch.randn(2, 16, 100, generator=g)
    frames = torch.ones(2, 100, dtype=torch.long)
    frames[1, 60:] = 0

    def turns(cache):
        with torch.no_grad():
            model(input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(model, cache))
            whole = torch.ones(2, prompt.shape[1] + turn.shape[1], dtype=torch.long)
            return model(input_ids=turn, attention_mask=whole, input_features=feats, feature_attention_mask=frames,
                         position_ids=(torch.arange(turn.shape[1]) + prompt.shape[1]).expand(2, -1),
                         **cache_kwargs(model, cache)).logits

    want = turns(DynamicCache(config=model.config))
    torch.testing.assert_close(turns(leankit.LeanCache(model, "FP16")), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_image_text_models_rows_that_end_free_their_pages(monkeypatch, backend):
    """Gemma3's image-text model embeds the ids itself and hands its decoder ``inputs_embeds`` alone:
    a row that ends on its EOS still frees its pages (the ids come from the whole model's call), and
    the tokens stay DynamicCache's. Before, no row of such a model ever ended."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("gemma3-image-text", sliding_window=64)
    ids, mask = left_padded_batch(rows=3, width=9, pad_step=3, seed=5, vocab=90)
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        free_run = model.generate(**kw, eos_token_id=None, **cache_kwargs(model, DynamicCache(config=model.config)))
        eos = int(free_run[1, ids.shape[1] + 1])  # row 1 ends on its second token
        assert eos not in free_run[0, ids.shape[1]:].tolist() and eos != 0
        want = model.generate(**kw, eos_token_id=eos, **cache_kwargs(model, DynamicCache(config=model.config)))
        cache = leankit.LeanCache(model, "FP16", eos_token_id=eos)
        got = model.generate(**kw, eos_token_id=eos, **cache_kwargs(model, cache))
    assert torch.equal(got, want)
    assert cache.finished.tolist()[1] is True
    assert cache.memory_report()["tokens_per_row"][1] == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_whose_positions_go_back_is_refused_and_leaves_the_cache_as_it_was(monkeypatch, backend):
    """A manual prefill without position_ids on a left-padded batch stores a padded row's tokens at
    positions that count its padding; generate then derives the next positions from the mask, lower
    than the stored ones. Stored tokens are masked by position, so that query would not see its row's
    prompt: silently wrong tokens before, a clear error now (the kernel backend's decode step finds it
    on the device and drops the step at its one read). With position_ids from the mask, the same
    calls give DynamicCache's tokens."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    ids = torch.tensor([[0, 0, 0, 0, 0, 0, 11, 12], [21, 22, 23, 24, 25, 26, 27, 28]])
    mask = (ids != 0).long()
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}

    def prefill_then_generate(cache, positions):
        extra = {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)} if positions else {}
        with torch.no_grad():
            nxt = model(input_ids=ids, attention_mask=mask, **extra, **cache_kwargs(model, cache)).logits[:, -1:]
            full = torch.cat([ids, nxt.argmax(-1)], 1)
            m2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            return model.generate(input_ids=full, attention_mask=m2, **kw, **cache_kwargs(model, cache))

    cache = leankit.LeanCache(model, "FP16")
    with pytest.raises(ValueError, match=r"rows \[0\]: this step's tokens sit at positions no later"):
        prefill_then_generate(cache, positions=False)
    assert cache.get_seq_length() == 8 and cache._step is None
    # the refused step left the cache as the prefill did: continuing with the stored positions works
    with torch.no_grad():
        m9 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        step = model(input_ids=torch.tensor([[5], [6]]), attention_mask=m9, position_ids=torch.tensor([[8], [8]]),
                     **cache_kwargs(model, cache)).logits
        dyn = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, dyn))
        want = model(input_ids=torch.tensor([[5], [6]]), attention_mask=m9, position_ids=torch.tensor([[8], [8]]),
                     **cache_kwargs(model, dyn)).logits
    assert torch.allclose(step, want, atol=1e-5)
    ref = prefill_then_generate(DynamicCache(config=model.config), positions=True)
    assert torch.equal(prefill_then_generate(leankit.LeanCache(model, "FP16"), positions=True), ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_right_padded_batch_is_refused_at_its_first_decode_step_with_the_cause(monkeypatch, backend):
    """transformers 5.x from some release on gives the first new token of a right-padded row a
    position just past its padding's fill value (1 for every pad), not past its real tokens: the
    step goes back. The error names the right-padded rows and the fix (pad on the left), a row
    padded on the left goes unnamed, and the refused step leaves the cache as the prompt left it.
    (Where generate counts the positions from the mask instead, as 5.0 does, they grow, and FP16
    gives DynamicCache's tokens.)"""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    ids = torch.tensor([[31, 32, 33, 34, 35, 36, 37], [41, 42, 43, 0, 0, 0, 0], [0, 0, 51, 52, 53, 54, 55],
                        [61, 62, 63, 64, 65, 0, 0]])
    mask = (ids != 0).long()
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    steps = []  # the position_ids generate passes, per forward (a DynamicCache run)
    hook = model.model.register_forward_pre_hook(lambda m, a, k: steps.append(k.get("position_ids")), with_kwargs=True)
    try:
        want = model.generate(input_ids=ids, attention_mask=mask, **kw)
    finally:
        hook.remove()
    if int(steps[1][1, 0]) >= 3:  # row 1 (3 real tokens) goes on past them: nothing to refuse
        got = model.generate(input_ids=ids, attention_mask=mask, **kw,
                             **cache_kwargs(model, leankit.LeanCache(model, "FP16")))
        assert torch.equal(got, want)
        return
    cache = leankit.LeanCache(model, "K8V4")
    with pytest.raises(ValueError, match=r"^rows \[1, 3\] are padded on the right.*padding_side = 'left'") as err:
        model.generate(input_ids=ids, attention_mask=mask, **kw, **cache_kwargs(model, cache))
    assert "rows [2]" not in str(err.value) and "[1, 2, 3]" not in str(err.value)
    assert cache.get_seq_length() == 7 and cache._step is None
    assert cache.table.lens.sum(0)[0].tolist() == [[7, 7], [3, 3], [5, 5], [5, 5]]
    # padded on the left, the same requests run (and the row padded on the left was never named)
    left = torch.stack([torch.cat([r[m.bool()].new_zeros(int((m == 0).sum())), r[m.bool()]]) for r, m in zip(ids, mask)])
    out = model.generate(input_ids=left, attention_mask=(left != 0).long(), **kw,
                         **cache_kwargs(model, leankit.LeanCache(model, "FP16")))
    assert torch.equal(out, model.generate(input_ids=left, attention_mask=(left != 0).long(), **kw))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generate_with_use_cache_false_is_refused_at_its_second_step_naming_the_flag(monkeypatch, backend):
    """use_cache=False makes generate feed the whole sequence at every step, to a cache that holds
    its prompt already (DynamicCache then stores the prompt again each step). The refusal names
    the flag, and the cache keeps what the prompt stored."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(rows=2, width=9)
    cache = leankit.LeanCache(model, "K8V4")
    with pytest.raises(ValueError, match=r"^a LeanCache was passed with use_cache=False.* the 9 tokens per row"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       eos_token_id=None, use_cache=False, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 9 and cache._step is None
    assert cache.table.lens.sum(0)[0, :, 0].tolist() == mask.sum(1).tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_used_cache_handed_an_unpadded_prompt_is_refused(monkeypatch, backend):
    """transformers drops an all-ones mask before the forward, so the mask-width check never sees a
    single unpadded prompt on a used cache; its positions, which restart below the stored ones, do.
    A prompt no longer than what the cache has seen reaches the cache as a step of no token."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    cache = leankit.LeanCache(model, "FP16")
    with torch.no_grad():
        model.generate(input_ids=torch.arange(10, 21).view(1, -1), **kw, **cache_kwargs(model, cache))
        seen = cache.get_seq_length()
        with pytest.raises(ValueError, match="positions no later than tokens this LeanCache already stores"):
            model.generate(input_ids=torch.arange(40, 50).view(1, -1), **kw, **cache_kwargs(model, cache))
        assert cache.get_seq_length() == seen and cache._step is None
        with pytest.raises(ValueError, match="a forward step of 0 tokens"):
            cache.begin_step(1, 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_refused_as_it_opens_leaves_no_position_flags_behind(monkeypatch, backend):
    """A decode step that raises after the kernel backend's step_rows ran, before the step opened
    (here its policy raises, as a row outgrowing its page-table row does), must not leave that
    launch's position flags for the next step: a correct later step would be refused, or adopt
    the failed step's positions."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    cache = leankit.LeanCache(model, "FP16")
    with torch.no_grad():
        model(input_ids=torch.arange(5, 13).view(1, -1), **cache_kwargs(model, cache))  # positions 0..7
        for bad_pos in (100, 3):
            monkeypatch.setattr(cache.policy, "begin_step", lambda step: (_ for _ in ()).throw(RuntimeError("boom")))
            # position 3 goes back: the torch backend refuses it up front, the kernel backend's
            # policy raises first (its position flag is read at the step's end, never reached)
            with pytest.raises((RuntimeError, ValueError), match="boom|positions no later"):
                model(input_ids=torch.tensor([[3]]), position_ids=torch.tensor([[bad_pos]]),
                      **cache_kwargs(model, cache))
            monkeypatch.undo()
            monkeypatch.setenv("LEANKIT_BACKEND", backend)
        model(input_ids=torch.tensor([[4, 5]]), position_ids=torch.tensor([[8, 9]]), **cache_kwargs(model, cache))
        assert cache._last_pos.tolist() == [9]
        model(input_ids=torch.tensor([[6]]), position_ids=torch.tensor([[10]]), **cache_kwargs(model, cache))
        assert cache._last_pos.tolist() == [10] and cache.get_seq_length() == 11


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_row_that_ends_in_a_step_is_not_held_to_its_positions(monkeypatch, backend):
    """A row fed an end id after its EOS ends in that step and stores nothing, so its position is
    not checked, on either backend (the torch backend checked it and refused the step)."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    eos, pad = 2, 0
    cache = leankit.LeanCache(model, "FP16", eos_token_id=eos, pad_token_id=pad)
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=torch.arange(5, 21).view(2, 8), attention_mask=mask,
              position_ids=torch.arange(8).expand(2, 8), **cache_kwargs(model, cache))
        for toks, pos in (([[eos], [30]], [[8], [8]]), ([[pad], [31]], [[8], [9]])):  # row 0's position stays
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            model(input_ids=torch.tensor(toks), attention_mask=mask, position_ids=torch.tensor(pos),
                  **cache_kwargs(model, cache))
    assert cache.finished.tolist() == [True, False] and cache._last_pos.tolist()[1] == 9


@pytest.mark.parametrize("kind,extra", [
    ("llama-gqa", {"sliding_window": 4}),  # Llama's attention ignores a stray window: no layer slides
    ("mistral-sliding", {"layer_types": ["full_attention", "sliding_attention"]}),  # Mistral slides them all
], ids=["llama-stray-window", "mistral-declared-layer-types"])
def test_layers_slide_as_the_models_own_attention_slides(kind, extra):
    """The cache reads a layer's type as the model's attention does, not from config fields that
    model ignores, so a left-padded batch that outgrows the window gives DynamicCache's tokens."""
    from leankit.cache import layer_types

    model = tiny_model(kind, **extra)
    sliding = kind.startswith("mistral")
    assert layer_types(model.config) == ["sliding_attention" if sliding else "full_attention"] * 2
    ids, mask = left_padded_batch(rows=3, width=13, pad_step=3)
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model.generate(**kw, **cache_kwargs(model, DynamicCache()))
        got = model.generate(**kw, **cache_kwargs(model, leankit.LeanCache(model, "FP16")))
    assert torch.equal(got, want)


def _image_text_opt(kind: str):
    """A tiny BLIP-2 or InstructBLIP around an OPT language model, and a left-padded batch of
    image-token prompts (image token 99) with its pixels and, for InstructBLIP, Q-Former ids."""
    import transformers as tf

    torch.manual_seed(0)
    parts = {"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
             "qformer_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "encoder_hidden_size": 32, "vocab_size": 50},
             "text_config": tf.OPTConfig(vocab_size=100, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=128, pad_token_id=0,
                                         bos_token_id=2, eos_token_id=2).to_dict(),
             "num_query_tokens": 4, "image_token_index": 99}
    if kind == "blip2":
        model = tf.Blip2ForConditionalGeneration(tf.Blip2Config(**parts)).eval()
    else:
        model = tf.InstructBlipForConditionalGeneration(tf.InstructBlipConfig(**parts)).eval()
    g = torch.Generator().manual_seed(1)
    lens, width = (9, 5, 2), 13
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for r, n in enumerate(lens):
        row = torch.cat([torch.full((4,), 99), torch.randint(5, 95, (n,), generator=g)])
        ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.randn(3, 3, 28, 28, generator=g)}
    if kind == "instructblip":
        q = torch.randint(5, 45, (3, 5), generator=g)
        inputs.update(qformer_input_ids=q, qformer_attention_mask=torch.ones_like(q))
    return model, inputs


@pytest.mark.parametrize("kind", ["blip2", "instructblip"])
def test_an_image_text_model_around_opt_gives_dynamic_caches_logits(kind):
    """OPT inside BLIP-2 and InstructBLIP: the cache finds the decoder two ``get_decoder`` steps
    down (BLIP-2's is the whole OPT language model) and, as for OPT alone, derives a padded row's
    missing positions from its mask (the text model's type decides, not the composite's). A
    forward without positions and greedy generate both give DynamicCache's logits."""
    model, inputs = _image_text_opt(kind)
    real = inputs["attention_mask"][..., None].bool()
    with torch.no_grad():
        want = model(**inputs, **cache_kwargs(model, DynamicCache())).logits
        got = model(**inputs, **cache_kwargs(model, leankit.LeanCache(model, "FP16"))).logits
        assert torch.allclose(want * real, got * real, atol=1e-6, rtol=0)
        kw = {**inputs, "max_new_tokens": 4, "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True, "pad_token_id": 0, "eos_token_id": None}
        want = model.generate(**kw, **cache_kwargs(model, DynamicCache()))
        got = model.generate(**kw, **cache_kwargs(model, leankit.LeanCache(model, "FP16")))
    assert torch.equal(got.sequences, want.sequences)
    assert torch.allclose(torch.stack(got.logits), torch.stack(want.logits), atol=1e-6, rtol=0)


def test_attention_dropout_in_training_mode_is_refused_and_leaves_the_cache_fresh():
    """A model in training mode with attention dropout: a LeanCache applies none, so the forward is
    refused rather than silently giving eval-mode logits; the cache is left as it was."""
    model = tiny_model("llama-gqa", attention_dropout=0.5).train()
    ids, mask = left_padded_batch(rows=2, width=7)
    cache = leankit.LeanCache(model, "K8V4")
    with torch.no_grad(), pytest.raises(ValueError, match="training mode"):
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0
    model.eval()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache)).logits
        want = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, leankit.LeanCache(model, "K8V4"))).logits
    assert torch.equal(got, want)
