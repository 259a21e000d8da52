"""The KV/ACT hybrid inside LeanCache (leankit.act_store), on tiny random-init models.

ACT tokens are stored as the decoder layers' input activations and their K/V are recomputed at
attention, so FP16 with any ACT fraction must give the greedy tokens of DynamicCache: ACT-only,
act=0.5 (HybridServe Eq. 11 ratio placement) and several KVPR prefix split points, on Llama MHA,
Llama GQA, Qwen2 (biases), Qwen3 (k_norm), Phi-3 (fused qkv_proj), Gemma3 ((1 + w) norms in fp32,
k_norm, sliding layers between the cached ones), a Qwen2 whose first and last layers slide, and
OPT (LayerNorm, learned positions), batched with left padding and row by row. Placement, memory accounting and the composition errors are checked
directly.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_opt import _batch, qwen3_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from leankit import KVConfig, LeanCache
from leankit.act_store import act_blocks, assign_act, keys_attention, next_block_is_act
from leankit.hf import cache_kwargs
from leankit.testing import tiny_model

KINDS = ["llama-mha", "llama-gqa", "qwen2", "qwen3", "phi3", "gemma3", "qwen2-mixed", "opt"]
# Sliding layers kept plain around compressed ones: the ACT store's layer l is decoder layer 1 + l.
MIXED = {"num_hidden_layers": 4, "use_sliding_window": True, "max_window_layers": 0, "sliding_window": 6,
         "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]}


def model_of(kind: str, seed: int, **kw):
    """A tiny model whose norms and biases are perturbed, so recompute must get every one of them right."""
    if kind == "qwen2-mixed":
        kind, kw = "qwen2", {**MIXED, **kw}
    m = qwen3_model(seed) if kind == "qwen3" else tiny_model(kind, seed=seed, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return m


def lean(model, spec, **kw):
    with warnings.catch_warnings():  # GQA models warn that ACT costs more than KV: not under test here
        warnings.simplefilter("ignore")
        return LeanCache(model, spec, **kw)


def _generate(model, ids, mask, cache, new=15, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), do_sample=False,
                              max_new_tokens=new, pad_token_id=0, eos_token_id=None, **kw)


def act_positions(cache, layer: int, row: int) -> list[int]:
    """Positions of the ACT tokens ``cache`` holds for (layer, row), in slot order."""
    store = cache.act_store
    n = int(store.table.lens[layer, row])
    slot = torch.arange(n)
    ids, rows = store.table.locate(layer, torch.full_like(slot, row), slot)
    return store.layout.read(cache.pool, ids, rows)[1].tolist()


# ---------------------------------------------------------------------------- config
def test_config_overrides_and_errors():
    cfg = KVConfig.parse("K8V4:act=0.5,act_order=prefix")
    assert cfg.act == 0.5 and cfg.act_order == "prefix" and str(cfg.high) == "K8V4"
    assert KVConfig.parse("FP16:act=1").act == 1.0 and KVConfig.parse("FP16").act == 0.0
    assert KVConfig.parse("FP16", act=0.25).act_order == "ratio"
    for bad, what in (("FP16:act=1.5", "act"), ("FP16:act=-0.1", "act"), ("FP16:act=half", "act"),
                      ("FP16:act=0.5,act_order=zigzag", "act_order"), ("FP16:act=nan", "act")):
        with pytest.raises(ValueError, match=what):
            KVConfig.parse(bad)


@pytest.mark.parametrize("spec,name", [("K8V4-K4V2:act=0.5", "leankv"), ("FP16:act=0.5,policy=streaming", "streaming"),
                                       ("K8V4:act=0.5,policy=h2o,budget=0.5", "h2o"),
                                       ("FP16:act=1,policy=leankv", "leankv")])
def test_act_with_per_head_policies_raises_at_construction(spec, name):
    model = tiny_model("llama-mha")
    with pytest.raises(ValueError, match=f"does not compose with policy '{name}'"):
        LeanCache(model, spec)


# ---------------------------------------------------------------------------- placement
def test_eq11_paper_example_and_closed_form():
    # HybridServe §4.3.2: a 3:1 (ACT:KV) ratio with five ACT and two KV blocks puts the next block in ACT.
    assert next_block_is_act(5, 2, 0.75)
    assert not next_block_is_act(6, 1, 0.75)  # 6 of 7 already above 3/4: the next block is KV
    for frac in (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.6, 0.75, 0.9, 1.0):
        n_act = n_kv = 0
        for n in range(1, 60):
            if next_block_is_act(n_act, n_kv, frac):
                n_act += 1
            else:
                n_kv += 1
            assert n_act == act_blocks(n, frac), (frac, n)
            assert abs(n_act - frac * n) <= 0.5 + 1e-12  # the row's ratio never drifts from frac
        assert act_blocks(torch.arange(60), frac).tolist() == [act_blocks(i, frac) for i in range(60)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keys_attention_matches_a_per_query_fp64_softmax(seed):
    """The attention over recomputed ACT keys (one sweep: max, exp, sum) against a plain fp64 softmax
    of each query's visible keys, over query chunks, GQA heads and a query that sees no key at all
    (output 0 and log-sum-exp -inf, so a merge gives it no weight; no NaN anywhere)."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, group, nq, nk, f = 2, 2, 3, 5, 37, 16
    q = torch.randn(b, hkv * group, nq, f, generator=g)
    k, v = torch.randn(b, hkv, nk, f, generator=g), torch.randn(b, hkv, nk, f, generator=g)
    k_pos = torch.stack([torch.randperm(nk, generator=g) + 10 for _ in range(b)])
    k_valid = torch.rand(b, nk, generator=g) > 0.3
    q_pos = torch.randint(12, nk + 10, (b, nq), generator=g)
    q_pos[1, 2] = 5  # below every key's position: sees nothing
    out, lse = keys_attention(q, k, v, k_pos, k_valid, q_pos, 0.3, query_chunk=2)
    assert out.shape == (b, nq, hkv * group, f) and lse.shape == (b, hkv, group * nq)
    assert not out.isnan().any() and not lse.isnan().any()
    for row in range(b):
        for head in range(hkv * group):
            kv_head, grp = divmod(head, group)
            for i in range(nq):
                seen = k_valid[row] & (k_pos[row] <= q_pos[row, i])
                got_out, got_lse = out[row, i, head], lse[row, kv_head, grp * nq + i]
                if not seen.any():
                    assert torch.equal(got_out, torch.zeros(f)) and got_lse.item() == float("-inf")
                    continue
                scores = (k[row, kv_head][seen].double() @ q[row, head, i].double()) * 0.3
                want_out = torch.softmax(scores, 0) @ v[row, kv_head][seen].double()
                torch.testing.assert_close(got_out.double(), want_out, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got_lse.double(), torch.logsumexp(scores, 0), rtol=1e-6, atol=1e-6)


def test_assign_act_ratio_blocks_follow_tokens_across_steps():
    """Tokens arriving one by one and all at once get the same kinds (placement depends on the rank only)."""
    frac, block, n = 0.6, 3, 40
    real = torch.ones(1, n, dtype=torch.bool)
    rank = torch.arange(n).view(1, -1)
    zero = torch.zeros(1, dtype=torch.long)
    at_once = assign_act(frac, "ratio", rank, real, zero, zero, torch.tensor([n]), block)[0]
    one_by_one = [bool(assign_act(frac, "ratio", torch.zeros(1, 1, dtype=torch.long), real[:, :1],
                                  torch.tensor([i]), zero, torch.ones(1, dtype=torch.long), block)) for i in range(n)]
    assert at_once.tolist() == one_by_one
    blocks = at_once.view(-1, block) if n % block == 0 else at_once[: n // block * block].view(-1, block)
    assert (blocks.all(1) | ~blocks.any(1)).all()  # a block is all ACT or all KV


# ---------------------------------------------------------------------------- exactness
def _check_lossless(kind: str, seed: int, specs):
    model = model_of(kind, seed)
    ids, mask = _batch(seed, width=13)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    for spec in specs:
        cache = lean(model, spec)
        out = _generate(model, ids, mask, cache)
        assert torch.equal(out, ref), f"{kind} seed {seed} {spec}: batch differs from DynamicCache"
        rep = cache.memory_report()
        assert rep["act_tokens"] > 0
        for r in range(ids.shape[0]):
            keep = mask[r].bool()
            alone = _generate(model, ids[r:r + 1, keep], mask[r:r + 1, keep], lean(model, spec))
            assert torch.equal(alone[0], ref[r, -alone.shape[1]:]), f"{kind} {spec} row {r}: alone differs"


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_act_only_and_half_identical_to_dynamic_cache(kind):
    # page_size 512 makes ACT blocks of a few tokens, so the ratio placement alternates inside a row.
    _check_lossless(kind, 7, ["FP16:act=1", "FP16:act=0.5,page_size=512", "FP16:act=0.3,page_size=256"])


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_prefix_splits_identical_to_dynamic_cache(kind):
    _check_lossless(kind, 4, [f"FP16:act={a},act_order=prefix" for a in (0.1, 0.37, 0.5, 0.9)])


def test_k8v4_act_only_is_lossless_and_half_generates():
    """ACT tokens are never quantized: K8V4 with act=1 holds no KV token at all."""
    model = model_of("llama-gqa", 3)
    ids, mask = _batch(3)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config))
    assert torch.equal(_generate(model, ids, mask, lean(model, "K8V4:act=1")), ref)
    cache = lean(model, "K8V4:act=0.5,page_size=512")
    out = _generate(model, ids, mask, cache)
    assert out.shape == ref.shape
    rep = cache.memory_report()
    held = (int(mask.sum()) + 3 * 14) * model.config.num_hidden_layers  # token-layers (last sample not fed)
    assert rep["act_tokens"] + rep["slots_per_tier"]["high"] // model.config.num_key_value_heads == held
    assert 0 < rep["act_tokens"] < held and rep["tokens_per_tier"]["pruned"] == 0


@pytest.mark.parametrize("spec", ["FP16:act=0.5", "K8V4:act=1"])
def test_act_on_a_model_whose_every_layer_slides(spec):
    """Sliding layers keep transformers' own cache, so such a model has no layer for ACT blocks:
    the tokens are DynamicCache's and the memory report counts no ACT token (it divided by the
    zero cached layers before)."""
    model = tiny_model("mistral-sliding", seed=2)
    ids, mask = _batch(2)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), new=6)
    cache = lean(model, spec)
    assert torch.equal(_generate(model, ids, mask, cache, new=6), ref)
    rep = cache.memory_report()
    assert cache.num_layers == 0 and rep["act_tokens"] == 0 and rep["act_bytes"] == 0
    assert rep["plain_layers"] == model.config.num_hidden_layers and rep["total_bytes"] == rep["plain_bytes"] > 0


@pytest.mark.parametrize("change", ["load_state_dict", "in_place"])
def test_act_recomputes_with_the_weights_the_model_has_when_it_generates(change):
    """ACT blocks recompute K/V from stacked copies of ``[Wk Wv]``, norms and RoPE tables: weights
    that change after the cache was built (another checkpoint loaded, an in-place edit of one
    projection) are read again when the next generate starts, so FP16 ACT stays DynamicCache's tokens."""
    model = model_of("llama-gqa", 6)
    cache = lean(model, "FP16:act=0.5,page_size=512")
    ids, mask = _batch(6)
    with torch.no_grad():
        if change == "load_state_dict":
            model.load_state_dict(model_of("llama-gqa", 9).state_dict())
        else:
            model.get_decoder().layers[1].self_attn.v_proj.weight.mul_(-2.0)
    want = _generate(model, ids, mask, DynamicCache(config=model.config))
    assert torch.equal(_generate(model, ids, mask, cache), want)


def test_beam_search_with_act_matches_dynamic_cache():
    model = model_of("llama-mha", 5)
    ids, mask = _batch(5, rows=2)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), num_beams=3, new=8)
    out = _generate(model, ids, mask, lean(model, "FP16:act=0.5,page_size=512"), num_beams=3, new=8)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("spec", ["FP16:act=1", "FP16:act=0.5,page_size=512",
                                  "FP16:act=0.4,act_order=prefix,page_size=1024"])
def test_triton_backend_act_path_matches_dynamic_cache(spec, monkeypatch):
    """The fused act_to_kv kernel (interpreter on CPU) serves the recompute: same tokens."""
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    model = model_of("qwen2", 2, hidden_size=128)  # head_dim 32: the kernel's smallest tile
    ids, mask = _batch(2, rows=2, width=9)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), new=5)
    assert torch.equal(_generate(model, ids, mask, lean(model, spec), new=5), ref)


def test_rope_tables_are_shared_only_between_layers_of_one_rotary_table():
    """A step computes one RoPE table per distinct rotary table of the cached layers: Gemma3's
    cached (full-attention) layers share the global one; layers of different tables get their own."""
    import dataclasses

    from leankit.act_store import rope_groups

    model = model_of("gemma3", 1, num_hidden_layers=4,
                     layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"])
    store = lean(model, "FP16:act=0.5").act_store
    assert len(store.params) == 3 and store._rope_group == [0, 0, 0]
    local = dataclasses.replace(store.params[1], inv_freq=store.params[1].inv_freq * 10)
    p0, p2 = store.params[0], store.params[2]
    assert rope_groups([p0, local, p2]) == [0, 1, 0]
    assert rope_groups([p0, dataclasses.replace(local, inv_freq=None), local]) == [0, 1, 2]
    assert rope_groups([p0, dataclasses.replace(p2, rope_scaling=2.0)]) == [0, 1]


@pytest.mark.parametrize("kind", ["gemma3", "qwen2-mixed"])
def test_triton_backend_act_path_between_sliding_layers(kind, monkeypatch):
    """The kernel with Gemma's norms (fp32 ``1 + w`` weights, k_norm), and the store indexed by
    cached layer where sliding layers sit between them: DynamicCache's tokens."""
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    kw = {"hidden_size": 128}
    if kind == "gemma3":
        kw.update(head_dim=32, num_key_value_heads=2, layer_types=["full_attention", "sliding_attention",
                                                                   "full_attention"])
    model = model_of(kind, 3, **kw)
    ids, mask = _batch(3, rows=2, width=10)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), new=5)
    assert torch.equal(_generate(model, ids, mask, lean(model, "FP16:act=0.5,page_size=512"), new=5), ref)


# ---------------------------------------------------------------------------- placement inside the cache
@pytest.mark.parametrize("act", [0.1, 0.37, 0.5, 0.9, 1.0])
def test_prefix_split_is_exact(act):
    """The first round(act * n_prompt) real tokens of every row (every layer) are ACT, the rest KV."""
    model = model_of("opt", 1)
    ids, mask = _batch(1, rows=3, width=17)
    cache = lean(model, f"FP16:act={act},act_order=prefix")
    out = _generate(model, ids, mask, cache, new=6)
    assert out.shape[1] == ids.shape[1] + 6
    for r in range(3):
        n = int(mask[r].sum())
        split = int(act * n + 0.5) if act < 1 else n + 5  # act=1: generated tokens stay ACT too
        for layer in range(model.config.num_hidden_layers):
            assert act_positions(cache, layer, r) == list(range(split)), (act, r, layer)


def test_ratio_blocks_inside_the_cache():
    model = model_of("llama-gqa", 6)
    ids, mask = _batch(6, rows=3, width=21)
    cache = lean(model, "FP16:act=0.6,page_size=512")
    _generate(model, ids, mask, cache, new=12)
    block = cache.act_store.block
    assert 1 < block < 10  # several blocks per row
    for r in range(3):
        n = int(mask[r].sum()) + 11
        want = [p for p in range(n) if act_blocks(p // block + 1, 0.6) > act_blocks(p // block, 0.6)]
        for layer in range(model.config.num_hidden_layers):
            assert act_positions(cache, layer, r) == want


# ---------------------------------------------------------------------------- memory
def test_memory_report_splits_kv_and_act_and_frees_everything():
    model = model_of("llama-mha", 2)
    ids, mask = _batch(2)
    cache = lean(model, "FP16:act=0.5,page_size=512")
    _generate(model, ids, mask, cache)
    rep = cache.memory_report()
    kv_pages = int(cache.table.n_pages.sum())
    assert rep["kv_bytes"] == kv_pages * 512 and rep["act_pages"] == rep["pages_used"] - kv_pages > 0
    assert rep["kv_bytes"] + rep["act_bytes"] == rep["pages_used"] * 512
    assert rep["total_bytes"] == rep["kv_bytes"] + rep["act_bytes"] + rep["table_bytes"] + rep["plain_bytes"]
    assert rep["ratio"] == pytest.approx(rep["total_bytes"] / rep["fp16_bytes"])
    tokens = int(mask.sum()) + 3 * 14
    assert rep["fp16_bytes"] == tokens * 2 * 4 * 2 * 16 * 2  # every real token, ACT ones included
    text = str(rep)  # the readable report: the pages line counts both kinds, then splits them
    assert f"{rep['pages_used']} of {rep['pages_total']} in use, 512 B each: {rep['pages_used'] / 2:.1f} KiB" in text
    assert f"KV {rep['kv_bytes'] / 1024:.1f} KiB, ACT {rep['act_bytes'] / 1024:.1f} KiB ({rep['act_pages']} pages, " \
           f"{rep['act_tokens']} tokens" in text
    freed = cache.release(torch.tensor([True, False, False]))
    assert freed > 0 and cache.memory_report()["act_tokens"] < rep["act_tokens"]
    cache.reset()
    assert cache.free_list.num_free == cache.free_list.capacity


def test_mha_act_only_holds_about_half_of_fp16_kv_pages():
    """HybridServe §3.3: per token and layer ACT keeps hidden values where K/V keep 2 x hidden (MHA).

    An OPT-125m-sized layer (hidden 768 = 12 heads x 64) in fp16, 2048-byte pages; baseline: the
    FP16 LeanCache pages holding the same tokens (same dtype, both with their page metadata).
    """
    cfg = LlamaConfig(vocab_size=97, hidden_size=768, intermediate_size=64, num_hidden_layers=1, num_attention_heads=12,
                      num_key_value_heads=12, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    ids = torch.randint(3, 97, (2, 70))
    mask = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MHA in fp16: ACT saves memory, so no warning
        act = LeanCache(model, "FP16:act=1")
    kv = LeanCache(model, "FP16")
    for c in (act, kv):
        _generate(model, ids, mask, c, new=1)
    ra, rk = act.memory_report(), kv.memory_report()
    assert ra["kv_bytes"] == 0 and ra["act_tokens"] == 140
    ratio = ra["act_bytes"] / rk["kv_bytes"]
    dense = ra["act_bytes"] / rk["fp16_bytes"]
    print(f"\nACT-only / FP16 KV pages = {ratio:.3f}; / fp16 DynamicCache bytes = {dense:.3f}")
    assert ratio <= 0.52
    assert act.token_bytes()["act"] / act.token_bytes()["kv"] <= 0.52


def test_gqa_warns_and_exposes_token_bytes():
    model = tiny_model("llama-gqa")  # hidden 96 > 2 x 2 KV heads x 16 = 64
    with pytest.warns(UserWarning, match="hidden 96 vs 2 x 2 KV heads x 16 = 64") as record:
        cache = LeanCache(model, "FP16:act=0.5")
    assert [w.filename for w in record] == [__file__]  # the warning names the line that built the cache
    tb = cache.token_bytes()
    assert tb["act"] > tb["kv"] and not tb["act_saves"]
    assert LeanCache(model, "FP16").token_bytes() == tb  # a planner can ask before choosing ACT


def test_act_on_an_unsupported_architecture_is_a_clear_error():
    """A model whose K/V projections recompute does not know is refused by name, before any of
    its modules is read."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from leankit.recompute import layer_params

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="act->kv recomputation supports .* got 'gpt2'"):
        layer_params(gpt2, 0)


class _AdaptedLinear(torch.nn.Module):
    """A projection plus a low-rank update, exposing the base ``weight``/``bias`` as PEFT's LoRA layers do."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.down = torch.nn.Linear(base.in_features, 2, bias=False)
        self.up = torch.nn.Linear(2, base.out_features, bias=False)
        torch.nn.init.normal_(self.up.weight)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.up(self.down(x))


@pytest.mark.parametrize("kind,proj", [("llama-gqa", "v_proj"), ("phi3", "qkv_proj")])
def test_act_on_adapted_kv_projections_is_refused_not_silently_wrong(kind, proj):
    """Recompute multiplies the projection's ``weight`` and ``bias`` itself: a k/v (or fused qkv) projection
    wrapped by an adapter (PEFT's LoRA keeps the base weight as ``.weight``) computes something else, so an
    ACT cache is refused by name, where it gave other tokens than DynamicCache before. An adapter on the
    query projection alone leaves K/V alone and stays exact."""
    model = model_of(kind, 4)
    attn = model.get_decoder().layers[1].self_attn
    setattr(attn, proj, _AdaptedLinear(getattr(attn, proj)))
    with pytest.raises(ValueError, match=f"{proj} is a .*_AdaptedLinear.*merge the adapter"):
        lean(model, "FP16:act=0.5")
    ids, mask = _batch(4, rows=2)
    ref = _generate(model, ids, mask, DynamicCache(config=model.config), new=5)
    assert torch.equal(_generate(model, ids, mask, lean(model, "FP16"), new=5), ref)  # KV pages hold what it computed
    if kind == "llama-gqa":
        attn.q_proj = _AdaptedLinear(attn.q_proj)
        setattr(attn, proj, getattr(attn, proj).base_layer)
        ref = _generate(model, ids, mask, DynamicCache(config=model.config), new=5)
        assert torch.equal(_generate(model, ids, mask, lean(model, "FP16:act=0.5,page_size=512"), new=5), ref)


def test_act_on_a_peft_lora_model():
    peft = pytest.importorskip("peft")
    model = model_of("qwen3", 2)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"],
                                                       init_lora_weights=False)).eval()
    with pytest.raises(ValueError, match="k_proj is a peft.*merge_and_unload"):
        lean(lora, "FP16:act=1")
    merged = lora.merge_and_unload()
    ids, mask = _batch(2, rows=2)
    ref = _generate(merged, ids, mask, DynamicCache(config=merged.config), new=5)
    assert torch.equal(_generate(merged, ids, mask, lean(merged, "FP16:act=1"), new=5), ref)


@pytest.mark.parametrize("hidden,padded_hidden", [(40, 48), (120, 128)], ids=["head_dim10", "head_dim30"])
def test_act_with_heads_padded_to_whole_bytes(hidden, padded_hidden):
    """Heads whose 2-bit codes do not fill whole bytes (head_dim 10, 30) are padded in the KV pages
    (to 12, 32); the ACT side prices a KV token at the padded width, so the cache builds, a KV token
    costs what one of a model with the padded head_dim costs, and ACT blocks are stored and
    recomputed through generate."""
    model = model_of("llama-mha", 5, hidden_size=hidden)  # 4 heads: head_dim hidden / 4
    cache = lean(model, "K2V2", act=0.5)
    assert cache.page_head_dim == padded_hidden // 4
    wide = lean(model_of("llama-mha", 5, hidden_size=padded_hidden), "K2V2")
    assert cache.token_bytes()["kv"] == wide.token_bytes()["kv"]
    ids, mask = _batch(5, rows=2, width=9)
    out = _generate(model, ids, mask, cache, new=6)
    assert out.shape == (2, 15)
    assert int(cache.act_store.table.lens.sum()) > 0  # ACT blocks were stored


def test_pool_exhausted_leaves_cache_usable():
    model = model_of("llama-mha", 8)
    ids, mask = _batch(8)
    cache = lean(model, "FP16:act=1", num_pages=3)
    from leankit import PoolExhausted

    with pytest.raises(PoolExhausted):
        _generate(model, ids, mask, cache)
    # a refused first step leaves the cache fresh: no page held, no batch size bound
    assert cache.table is None and cache.act_store.table is None
    assert cache.free_list.num_free == cache.free_list.capacity


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy casts the NaN too
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", ["FP16:act=1,page_size=1024", "K8V4:act=0.5,page_size=512"])
def test_non_finite_activations_drop_the_step(spec, backend, monkeypatch):
    """A NaN in a decode step's layer input: ACT tokens (no K/V stored for them) raise
    NonFiniteKVError as K/V do, the step is dropped, and the next steps match a clean cache's
    (an ACT-only config had stored the NaN and poisoned every later step)."""
    from leankit import NonFiniteKVError

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = model_of("qwen2", 3, hidden_size=128)  # head_dim 32: the act_to_kv kernel's smallest tile
    ids, mask = _batch(3, rows=2, width=9)
    caches = [lean(model, spec), lean(model, spec)]
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        for c in caches:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, c),
                           use_cache=True).logits
    cache, clean = caches
    lens, seen = cache.act_store.table.lens.clone(), cache.get_seq_length()
    nxt, mask, pos = logits[:, -1:].argmax(-1), torch.cat([mask, mask[:, -1:]], 1), pos[:, -1:] + 1
    embeds = model.get_input_embeddings()(nxt)
    embeds[1, 0, 5] = float("nan")
    with torch.no_grad(), pytest.raises(NonFiniteKVError, match="^layer 0:") as raised:
        model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
    if spec.startswith("FP16:act=1"):  # every token is an ACT token: the message names their activations
        assert "layer input activations" in str(raised.value)
    assert torch.equal(cache.act_store.table.lens, lens) and cache.get_seq_length() == seen
    with torch.no_grad():
        for _ in range(2):
            got, want = (model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(model, c),
                               use_cache=True).logits for c in (cache, clean))
            assert torch.isfinite(got).all() and torch.equal(got, want)
            nxt, mask, pos = got[:, -1:].argmax(-1), torch.cat([mask, mask[:, -1:]], 1), pos + 1


def test_triton_backend_refused_act_grant_leaves_cache_usable(monkeypatch):
    """Kernel backend, fixed pool: a decode step whose ACT blocks do not fit is refused whole at the
    step's end (PoolExhausted), writes nothing into pages it was not granted (the ACT tokens already
    stored read back unchanged), and the cache serves the next step once pages are free again."""
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    from leankit import PoolExhausted

    model = model_of("qwen2", 4, hidden_size=128)
    ids, mask = _batch(4, rows=2, width=9)
    cache = lean(model, "FP16:act=1,page_size=1024")
    store = cache.act_store
    layout = store.layout
    with torch.no_grad():  # size a fixed pool to the prompt's blocks plus one spare block
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    need = int(store.table.n_pages.sum())
    cache = lean(model, "FP16:act=1,page_size=1024", num_pages=need + layout.slices)
    store = cache.act_store
    pos = (mask.cumsum(1) - 1).clamp_min(0)

    def stored():  # every stored ACT token of every (layer, row): (activation bytes, position)
        out = []
        for layer in range(cache.num_layers):
            for row in range(ids.shape[0]):
                slot = torch.arange(int(store.table.lens[layer, row]))
                pid, r = store.table.locate(layer, torch.full_like(slot, row), slot)
                out.append(layout.read(cache.pool, pid, r))
        return out

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                       use_cache=True).logits
        for _ in range(2 * layout.tokens + 1):  # the spare block runs out within this many steps
            before, lens = stored(), store.table.lens.clone()
            nxt, mask, pos = logits[:, -1:].argmax(-1), torch.cat([mask, mask[:, -1:]], 1), pos[:, -1:] + 1
            try:
                logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                               use_cache=True).logits
            except PoolExhausted:
                break
        else:
            pytest.fail("the pool never ran out")
        assert torch.equal(store.table.lens, lens)
        for (a0, p0), (a1, p1) in zip(before, stored()):
            assert torch.equal(a0.view(torch.uint8), a1.view(torch.uint8)) and torch.equal(p0, p1)
        owned = int(store.table.n_pages.sum()) + int(cache.table.n_pages.sum())
        cache.free_list.sync()
        assert cache.free_list.num_free + owned == cache.free_list.capacity
        cache.release(torch.tensor([True, False]))  # frees row 0's blocks: row 1 goes on
        model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
        assert int(store.table.lens[:, 1].min()) == int(lens[:, 1].min()) + 1


# ---------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_smollm2_fp16_act_half_identical_tokens(smollm2):
    model, tok = smollm2
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    runs = {}
    for spec in ("FP16", "FP16:act=0.5"):
        with torch.no_grad():
            runs[spec] = model.generate(**enc, **cache_kwargs(model, lean(model, spec)), do_sample=False, max_new_tokens=32,
                                        pad_token_id=tok.pad_token_id, eos_token_id=None, output_logits=True,
                                        return_dict_in_generate=True)
    a, b = runs["FP16"], runs["FP16:act=0.5"]
    assert torch.equal(a.sequences, b.sequences)
    diff = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
    print(f"\nSmolLM2 fp32, FP16:act=0.5 vs FP16: max |logit difference| over 32 steps = {diff:.3e}")
    assert diff < 1e-3


def test_hybrid_policy_hands_its_inner_policy_the_kv_view_for_step_status():
    # The kernel backend's per-step status read goes through the wrapper: the inner policy must
    # plan it over the KV-only view of the step, as every other hook does.
    from leankit.act_store import HybridPolicy

    class Inner:
        def __init__(self):
            self.seen = []

        def begin_step(self, step):
            self.seen.append(("begin", step))

        def step_status(self, step):
            self.seen.append(("status", step))
            return torch.tensor([7])

        def take_status(self, values):
            self.seen.append(("take", values))

    class Store:
        taken = None

        def plan(self, step):
            return ("kv view of", step)

        def step_status(self):
            return torch.tensor([3])

        def take_status(self, n_max):
            self.taken = n_max

    inner, store = Inner(), Store()
    policy = HybridPolicy(inner, store)
    full = object()
    policy.begin_step(full)
    # The same read carries the ACT store's count after the inner policy's values, and each gets its own.
    assert policy.step_status(full).tolist() == [7, 3]
    assert inner.seen == [("begin", ("kv view of", full)), ("status", ("kv view of", full))]
    policy.take_status([7, 3])
    assert inner.seen[-1] == ("take", [7]) and store.taken == 3
    with pytest.raises(RuntimeError, match="begin_step did not plan"):
        policy.step_status(object())


def test_an_act_cache_follows_the_model_to_a_16_bit_dtype():
    """Built while the model is fp32, then ``model.to(bfloat16)``: the ACT pages (fp32) still feed the
    bf16 projection, and the tokens equal DynamicCache's as a KV-only cache's do."""
    from leankit.testing import left_padded_batch

    ids, mask = left_padded_batch(2, 9)
    outs = {}
    for spec in ("FP16", "FP16:act=1", "FP16:act=0.5"):
        model = tiny_model("llama-gqa")
        cache = LeanCache(model, spec)
        model.to(torch.bfloat16)
        with torch.no_grad():
            outs[spec] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                        pad_token_id=0, **cache_kwargs(model, cache)).tolist()
            outs["dynamic"] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                             pad_token_id=0, **cache_kwargs(model, DynamicCache())).tolist()
    assert outs["FP16:act=1"] == outs["FP16:act=0.5"] == outs["FP16"] == outs["dynamic"]


@pytest.mark.parametrize("pages", [24, 30, 47])
def test_a_short_pool_names_what_an_act_step_needs_in_all(pages):
    """The ACT blocks are granted before the KV pages: the refusal counts both, out of the pages
    free before the step (the step is dropped, so its ACT blocks come back)."""
    from leankit import PoolExhausted
    from leankit.testing import left_padded_batch

    model = tiny_model("llama-mha")
    ids, mask = left_padded_batch(3, 13)
    roomy = LeanCache(model, "FP16:act=0.5,page_size=512", num_pages=200)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, roomy))
    need = roomy.memory_report()["pages_used"]
    cache = LeanCache(model, "FP16:act=0.5,page_size=512", num_pages=pages)
    with torch.no_grad(), pytest.raises(PoolExhausted, match="for ACT blocks") as e:
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
    assert (e.value.needed, e.value.free, e.value.total) == (need, pages, pages)
    assert cache.free_list.num_free == pages


@pytest.mark.parametrize("spec", ["FP16:act=0.5", "K8V4:act=0.5,act_order=prefix"])
def test_a_deep_copied_act_cache_continues_like_a_fresh_prefix(spec):
    """transformers' prefix-cache recipe: prefill a prompt once, deep-copy the cache per continuation.
    An ACT cache's policy wrapper forwards unknown attributes to its inner policy; copy probes dunder
    methods on an instance built without __init__, which recursed without end before."""
    import copy

    model = model_of("llama-gqa", 6)
    prefix = torch.arange(5, 17).view(1, -1)
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    prompt_cache = lean(model, spec)
    with torch.no_grad():
        model(input_ids=prefix, **cache_kwargs(model, prompt_cache))
        for tail in ([20, 21], [30, 31, 32]):
            ids = torch.cat([prefix, torch.tensor([tail])], 1)
            fresh = lean(model, spec)
            model(input_ids=prefix, **cache_kwargs(model, fresh))
            want = model.generate(input_ids=ids, **kw, **cache_kwargs(model, fresh))
            twin = copy.deepcopy(prompt_cache)
            # the copy shares the model and the stacked [Wk Wv] (read only): no weights are copied
            assert twin.act_store._model is model and twin.act_store.params is prompt_cache.act_store.params
            got = model.generate(input_ids=ids, **kw, **cache_kwargs(model, twin))
            assert torch.equal(got, want)


def test_pickling_an_act_cache_is_refused_by_name_and_leaves_it_usable():
    """An ACT cache recomputes through the model, which a pickle would have to carry (hooks and all):
    pickle refuses it with a message that names ACT, not a failure about a local function."""
    import pickle

    model = model_of("llama-gqa", 6)
    cache = lean(model, "FP16:act=0.5")
    ids = torch.arange(5, 17).view(1, -1)
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        first = model.generate(input_ids=ids, **kw, **cache_kwargs(model, cache))
        with pytest.raises(TypeError, match=r"ACT blocks \(act > 0\) cannot be pickled"):
            pickle.dumps(cache)
        more = torch.cat([first, torch.tensor([[40, 41]])], 1)  # the cache continues after the refusal
        got = model.generate(input_ids=more, **kw, **cache_kwargs(model, cache))
        want = model.generate(input_ids=more, **kw, **cache_kwargs(model, DynamicCache()))
    assert torch.equal(got, want)


def test_a_reorder_the_pool_cannot_serve_leaves_kv_and_act_rows_as_they_were():
    """Beam search copies a row's KV pages, frees the old ones, then copies its ACT blocks. A fixed
    pool with room for the KV copy but not, after it, for the ACT copy refused the ACT blocks after
    the KV rows had moved: the rows no longer matched. The refusal now comes first, nothing moved."""
    from leankit import PoolExhausted
    from leankit.testing import left_padded_batch

    model = model_of("llama-gqa", 3)  # ACT blocks take more pages than the KV pages here
    ids, mask = left_padded_batch(2, 13, seed=1)
    spec, beams = "FP16:act=0.5,page_size=512", torch.tensor([0, 0])
    roomy = lean(model, spec, num_pages=400)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, roomy))
    kv_need = int(roomy.table.n_pages.index_select(2, beams).sum())
    act_need = int(roomy.act_store.table.n_pages.index_select(1, beams).sum())
    used = roomy.memory_report()["pages_used"]
    assert act_need > kv_need  # the KV copy fits where the ACT copy does not
    cache = lean(model, spec, num_pages=used + kv_need)
    nxt = torch.tensor([[5], [6]])
    step = {"attention_mask": torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache))
        kv, act = cache.table.tables.clone(), cache.act_store.table.tables.clone()
        with pytest.raises(PoolExhausted, match="KV pages and ACT blocks"):
            cache.reorder_cache(beams)
        assert torch.equal(cache.table.tables, kv) and torch.equal(cache.act_store.table.tables, act)
        assert cache.free_list.num_free == kv_need
        got = model(input_ids=nxt, **step, **cache_kwargs(model, cache)).logits
        want = model(input_ids=nxt, **step, **cache_kwargs(model, roomy)).logits
    assert torch.equal(got, want)


def test_an_act_cache_used_with_another_model_of_its_shape_is_refused():
    """KV pages hold what the running model computed, so a KV-only cache serves any model of its
    shape; ACT blocks are recomputed with the cache's own model's weights, which gave another
    model's generate silently wrong tokens. It is refused before any step work, and the cache
    goes on serving its own model."""
    from leankit.testing import left_padded_batch

    own, other = model_of("llama-gqa", 2), model_of("llama-gqa", 7)
    lean(other, "FP16")  # the other model is a leankit model too (hooks and attention in place)
    ids, mask = left_padded_batch(2, 10, seed=1)
    cache = lean(own, "FP16:act=0.5,page_size=512")
    with pytest.raises(ValueError, match="ACT blocks.*another model"):
        _generate(other, ids, mask, cache, new=4)
    assert torch.equal(_generate(own, ids, mask, cache, new=4),
                       _generate(own, ids, mask, DynamicCache(config=own.config), new=4))


@pytest.mark.parametrize("spec", ["FP16:act=0.5,page_size=512", "K8V4:act=0.4,page_size=512"])
def test_a_later_step_refused_for_its_kv_pages_gives_back_its_act_blocks(spec):
    """A step after the first whose ACT blocks were granted but whose KV pages the pool refuses never
    opens, so no drop_failed_step ran for it: its ACT blocks stayed with their rows (no ACT token in
    them) and the pool lost them for good. The refusal must leave the cache as it was before it."""
    from leankit import PoolExhausted
    from leankit.testing import left_padded_batch

    model = tiny_model("llama-mha")
    ids, mask = left_padded_batch(2, 40)
    cut = 9
    hits = 0
    for pages in range(4, 60):
        cache = LeanCache(model, spec, num_pages=pages)
        with torch.no_grad():
            try:
                model(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], **cache_kwargs(model, cache))
            except PoolExhausted:
                continue
            free, act_pages = cache.free_list.num_free, cache.act_store.table.n_pages.clone()
            try:
                model(input_ids=ids[:, cut:], attention_mask=mask, **cache_kwargs(model, cache))
                continue
            except PoolExhausted as e:
                if "for ACT blocks, " not in str(e):  # refused by the ACT grant itself: nothing granted
                    continue
        hits += 1
        assert cache.free_list.num_free == free
        assert torch.equal(cache.act_store.table.n_pages, act_pages)
    assert hits, "no pool size refused the second step for its KV pages"
