"""End to end: LeanCache with LEANKIT_BACKEND=triton generates the same tokens as the torch backend.

A tiny random Llama (built from a LlamaConfig, nothing downloaded) runs ``generate`` on a
left-padded batch; with ``triton`` every page allocation, quantize/pack, prefill and decode
attention goes through the Triton kernels (CPU interpreter here).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from leankit.cache import LeanCache
from leankit.hf import cache_kwargs
from leankit.pages import PagePool


def _tiny_llama(hidden: int = 96, heads: int = 6, kv_heads: int = 2):
    """A tiny random Llama, head_dim ``hidden / heads``.

    A fixed seed: greedy decoding of two backends is compared token for token, and a fixed
    model keeps near-tied logits (a 1e-6 difference flipping an argmax) out of CI.
    """
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=101, hidden_size=hidden, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # livelier logits than the default 0.02-std init
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return model


def _generate(model, spec, backend, monkeypatch, **overrides):
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 23], [0, 0, 12, 64, 7, 70, 3]])
    mask = (ids != 0).long()
    cache = LeanCache(model, spec, **overrides)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=8,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:], cache


def _spy(monkeypatch, module, name, calls):
    fn = getattr(module, name)

    def wrapped(*a, **k):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **k)

    monkeypatch.setattr(module, name, wrapped)


def _garbage_pool(monkeypatch):
    """Fill every new pool page with fresh random bytes instead of ``torch.empty``'s leftovers.

    Each backend's run starts from different garbage, so equal tokens show that neither the
    kernels nor the reference ever read a dead slot (a stale score, position or NaN code).
    """
    init, grow = PagePool.__init__, PagePool.grow

    def noisy_init(self, *a, **k):
        init(self, *a, **k)
        self.storage.copy_(torch.randint(0, 256, self.storage.shape, dtype=torch.uint8))

    def noisy_grow(self, num_pages):
        old = self.num_pages
        grow(self, num_pages)
        tail = self.storage[old:]
        tail.copy_(torch.randint(0, 256, tail.shape, dtype=torch.uint8))

    monkeypatch.setattr(PagePool, "__init__", noisy_init)
    monkeypatch.setattr(PagePool, "grow", noisy_grow)


@pytest.mark.parametrize("spec,overrides", [("K8V4", {}), ("FP16", {}), ("K8V4-K4V2", {"window": 3, "compress_every": 1}),
                                            ("K8V4-K4V2", {"window": 3, "rotate": True, "compress_every": 1})])
def test_triton_backend_generates_same_tokens(spec, overrides, monkeypatch):
    import leankit_kernels.page_alloc as pa
    import leankit_kernels.paged_attention as pa_attn
    import leankit_kernels.prefill_attention as pf
    import leankit_kernels.quant as qu

    _garbage_pool(monkeypatch)
    model = _tiny_llama()
    ref, ref_cache = _generate(model, spec, "torch", monkeypatch, **overrides)
    calls = {}
    spied = ((qu, "store_step_tokens"), (qu, "quantize_into_pages"), (pa_attn, "paged_attention"),
             (pa_attn, "decode_step_attention"),
             (pa, "grow_pages"), (pa, "grant_token_pages"), (pf, "received_attention"),
             (pa_attn, "apply_score_update"))
    for mod, name in spied:
        _spy(monkeypatch, mod, name, calls)
    got, cache = _generate(model, spec, "triton", monkeypatch, **overrides)
    # a step's new tokens: one grant launch per step for their pages, one store launch per layer;
    # quantize_into_pages (and a grant of its own) only for the tokens Algorithm 1 moves into the
    # low tier
    # decode: the pages and the step's own token in one launcher (a rotated cache rotates the
    # paged output back first and merges its own token apart, in the model's basis)
    attention = "paged_attention" if overrides.get("rotate") else "decode_step_attention"
    expected = {"store_step_tokens", attention, "grant_token_pages"}
    t_high = cache.layouts[0].tokens
    if -(-(t_high - 1 + 7) // t_high) > 2:  # the 7-token prompt needs more than two pages per head:
        expected.add("grow_pages")  # the many-program grant
    if cache.cfg.policy == "leankv":  # decode significance: the kernel's fused update, no second pass;
        # Algorithm 1 runs every step here and reserves the new tokens' pages with its own grant
        expected = {"store_step_tokens", attention, "apply_score_update", "quantize_into_pages", "grow_pages"}
    assert set(calls) == expected, calls
    assert len(set(ref.flatten().tolist())) > 2, "degenerate generation"
    assert torch.equal(got, ref), f"{spec}: triton {got.tolist()} != torch {ref.tolist()}"
    assert cache.memory_report()["pages_used"] == ref_cache.memory_report()["pages_used"]
    if overrides:  # the mixed config really used both tiers
        assert cache.memory_report()["tokens_per_tier"]["low"] > 0


def _specialization(kernel, args: tuple, kwargs: dict, dynamic: tuple, unaligned: tuple = ()) -> tuple:
    """Triton's compile key of one launch, by its rules: every constexpr's value, and for each
    runtime argument not in ``dynamic`` (``do_not_specialize``) the classes it specializes on
    (integers: == 1, % 16 == 0, needs 64 bits; pointers: 16-byte alignment unless in ``unaligned``;
    floats: none)."""
    names = kernel.arg_names if hasattr(kernel, "arg_names") else kernel.fn.__code__.co_varnames
    key = []
    for name, v in zip(names, args):
        if name in dynamic:
            continue
        if isinstance(v, torch.Tensor):
            key.append((name, v.dtype, name in unaligned or v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or not isinstance(v, int):
            key.append((name, type(v).__name__))
        else:
            key.append((name, v == 1, v % 16 == 0, abs(v) >= 2**31))
    key.extend(sorted((k, str(v)) for k, v in kwargs.items()))
    return tuple(key)


@pytest.mark.parametrize("spec,overrides", [("K8V4", {"page_size": 256}),
                                            ("K8V4-K4V2", {"window": 3, "page_size": 256})])
def test_one_generation_compiles_at_most_two_decode_variants(spec, overrides, monkeypatch):
    """A whole ``generate`` (contexts growing over many pages, splits changing) launches the decode
    kernel with at most 2 distinct specialization keys (one with split-K, one direct), so a GPU
    compiles at most 2 variants instead of one per page-count class."""
    import leankit_kernels.paged_attention as pa_attn

    keys, dyn = set(), set()
    launches = []
    import inspect

    import triton

    # Pointers Triton leaves unspecialized on alignment, where this Triton can (tiles.jit_options).
    can = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
    unaligned = pa_attn.DECODE_UNALIGNED if can else ()
    real = pa_attn.kernel_for

    def recording(kernel, device):
        launched = real(kernel, device)
        if kernel is not pa_attn._decode_kernel:
            return launched

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    keys.add(_specialization(kernel, args, kwargs, pa_attn.DECODE_DYNAMIC, unaligned))
                    names = kernel.arg_names if hasattr(kernel, "arg_names") else kernel.fn.__code__.co_varnames
                    dyn.add(tuple(v for n, v in zip(names, args) if n in ("PPS", "NSPLIT", "LG_N", "R")))
                    launches.append(grid)
                    return launched[grid](*args, **kwargs)
                return launch
        return _Grid()

    monkeypatch.setattr(pa_attn, "kernel_for", recording)
    # Split as on an H100 (132 SMs), not the interpreter's fixed 2: splits and pages per split move.
    choose = pa_attn.choose_splits
    monkeypatch.setattr(pa_attn, "choose_splits",
                        lambda bh, mp, g, f, ps, sms, *rest: choose(bh, mp, g, f, ps, 132, *rest))
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    model = _tiny_llama()
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 23, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22, 24]])
    cache = LeanCache(model, spec, **overrides)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                       max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert len(launches) >= 23 * 2, f"decode ran {len(launches)} times"
    assert len(dyn) > 2, f"the page counts per launch hardly moved ({dyn}): the test is too short"
    assert 1 <= len(keys) <= 2, f"{len(keys)} decode variants: {keys}"


@pytest.mark.parametrize("hidden,heads,kv_heads,spec,overrides,page_head_dim", [
    (72, 6, 2, "K8V4", {}, 16),                                                  # head_dim 12
    (80, 4, 4, "FP16", {}, 32),                                                  # 20: dense pages
    (96, 4, 2, "K8V4-K4V2", {"window": 3, "compress_every": 1, "rotate": True}, 32),  # 24, rotated in blocks of 8
    (144, 6, 3, "K4V2", {"group_size": 8}, 32),                                  # 24, groups of 8: padding fills its own
])
def test_head_dim_the_kernels_do_not_tile_is_padded(hidden, heads, kv_heads, spec, overrides, page_head_dim,
                                                    monkeypatch):
    """A head_dim that is not a power of two >= 16 runs on the kernels with padded pages and gives the
    torch backend's tokens: keys/values repeat channel 0 (a whole-head group keeps its range, so the
    real channels get the same codes), queries are padded with zeros, the output is cut back."""
    import leankit_kernels.paged_attention as pa_attn
    import leankit_kernels.quant as qu

    _garbage_pool(monkeypatch)
    model = _tiny_llama(hidden, heads, kv_heads)
    ref, ref_cache = _generate(model, spec, "torch", monkeypatch, **overrides)
    calls = {}
    for mod, name in ((qu, "store_step_tokens"), (pa_attn, "paged_attention"), (pa_attn, "decode_step_attention")):
        _spy(monkeypatch, mod, name, calls)
    got, cache = _generate(model, spec, "triton", monkeypatch, **overrides)
    attention = "paged_attention" if overrides.get("rotate") else "decode_step_attention"
    assert calls.get("store_step_tokens", 0) > 0 and calls.get(attention, 0) > 0, calls
    assert ref_cache.page_head_dim == hidden // heads and cache.page_head_dim == page_head_dim
    assert all(lay.head_dim == page_head_dim for lay in cache.layouts)
    assert len(set(ref.flatten().tolist())) > 2, "degenerate generation"
    assert torch.equal(got, ref), f"{spec}: triton {got.tolist()} != torch {ref.tolist()}"
    if overrides.get("window"):
        assert cache.memory_report()["tokens_per_tier"]["low"] > 0


def test_padded_pages_keep_the_group_sizes_they_can(monkeypatch):
    """A group of the whole head stays whole when the head is padded; a smaller group must divide
    the padded width too (clear error otherwise); the torch backend keeps the model's width."""
    from leankit.cache import padded_group_sizes
    from leankit.config import KVConfig

    whole = padded_group_sizes(KVConfig.parse("K8V4-K4V2", group_size=24, low_group_size=24), 24, 32)
    assert (whole.group_size, whole.low_group_size) == (None, 32)
    assert padded_group_sizes(KVConfig.parse("K8V4", group_size=8), 24, 32).group_size == 8
    for bad in (12, 16):  # 12 does not divide the padded 32; 16 divides it, not the head's 24
        with pytest.raises(ValueError, match=f"group_size={bad}: heads of head_dim 24 are padded to 32"):
            padded_group_sizes(KVConfig.parse("K8V4", group_size=bad), 24, 32)
    with pytest.raises(ValueError, match="low_group_size=16"):  # 2-bit codes pad a head of 30 on either backend
        padded_group_sizes(KVConfig.parse("K8V4-K4V2", group_size=30, low_group_size=16), 30, 32)
    model = _tiny_llama(72, 6, 2)
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    cache = LeanCache(model, "K8V4")
    k = torch.randn(2, 2, 3, 12)
    kp, qp = cache.to_page_basis(k), cache.to_page_basis(k, query=True)
    assert kp.shape[-1] == qp.shape[-1] == 16 and torch.equal(kp[..., :12], k) and torch.equal(qp[..., :12], k)
    assert torch.equal(kp[..., 12:], k[..., :1].expand(2, 2, 3, 4)) and not qp[..., 12:].any()
    assert torch.equal(cache.from_page_basis(kp), k)


def test_leankv_prompt_goes_to_its_tiers_in_one_launch_per_tier(monkeypatch):
    """A LeanKV prompt, classified per head before it is stored, goes to its tiers with one store
    launch per tier and layer on the kernel backend (no list of the kept tokens, which would read
    the device, and no gathered copy of them), leaving the same slots, positions, scores and
    dequantized K/V as the torch backend; pruned tokens are written nowhere."""
    import leankit_kernels.quant as qu

    from leankit.policy import read_tier_meta, read_tokens
    from leankit.testing import left_padded_batch

    _garbage_pool(monkeypatch)
    model = _tiny_llama()
    ids, mask = left_padded_batch(rows=3, width=40, pad_step=7, vocab=100)
    kept = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LEANKIT_BACKEND", backend)
        calls = {}
        if backend == "triton":
            _spy(monkeypatch, qu, "store_step_tokens", calls)
            _spy(monkeypatch, qu, "quantize_into_pages", calls)
        cache = LeanCache(model, "K8V4-K4V2", th=0.4, tl=0.1, window=4)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
        if backend == "triton":
            assert calls == {"store_step_tokens": 2 * cache.num_layers}, calls
        layers = torch.arange(cache.num_layers)
        tiers = []
        for tier, layout in enumerate(cache.layouts):
            meta = read_tier_meta(cache, tier, layers)
            slot = meta.valid.nonzero(as_tuple=True)
            page = meta.ids.repeat_interleave(layout.tokens, -1)[slot]
            k, v = read_tokens(cache.pool, layout, page, slot[-1] % layout.tokens)
            tiers.append((meta.valid, meta.pos[slot], meta.score[slot], k, v))
        kept[backend] = (tiers, cache.memory_report()["tokens_per_tier"])
    (want, want_tiers), (got, got_tiers) = kept["torch"], kept["triton"]
    assert got_tiers == want_tiers and want_tiers["low"] > 0 and want_tiers["pruned"] > 0, want_tiers
    for tier, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(g[0], w[0]), f"tier {tier}: different slots hold tokens"
        for what, a, b in zip(("position", "score", "k", "v"), g[1:], w[1:]):
            assert torch.equal(a, b), f"tier {tier}: {what} differs"


@pytest.mark.parametrize("spec,overrides", [("K8V4", dict(policy="h2o", budget=0.5, page_size=256)),
                                            ("K8V4-K4V2", dict(th=0.3, tl=0.05, window=4, compress_every=1,
                                                               page_size=256))])
def test_a_second_turn_on_a_significance_policy_matches_the_torch_backend(spec, overrides, monkeypatch):
    """A step of several tokens after decode steps (a new turn passed into the same cache) updates
    the significance scores from the kernel's received attention, which is as wide as the pages
    heads hold, while the kernel backend reads the metadata at the host page bound: the two widths
    must meet (the step raised a shape error), and the tokens are the torch backend's."""
    model = _tiny_llama()
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 23, 9, 14], [0, 0, 12, 64, 7, 70, 3, 31, 40]])
    mask = (ids != 0).long()
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LEANKIT_BACKEND", backend)
        cache = LeanCache(model, spec, **overrides)
        with torch.no_grad():
            first = model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=4,
                                   do_sample=False, pad_token_id=0, eos_token_id=None)
            turn = torch.cat([first, torch.tensor([[50, 61, 72, 83, 94]] * 2)], 1)
            more = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
            outs[backend] = model.generate(input_ids=turn, attention_mask=more, **cache_kwargs(model, cache),
                                           max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert outs["triton"].shape == (2, ids.shape[1] + 4 + 5 + 4)
    assert torch.equal(outs["triton"], outs["torch"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_generate_call_fed_only_the_eos_that_ended_the_last_continues_the_row(backend, monkeypatch):
    """Turn 1 stops on EOS (sampled, never fed); turn 2 passes the whole sequence back with no new
    token, so its first step feeds just that EOS, as a decode step feeding back a sampled EOS would.
    The row must go on as with DynamicCache (the EOS is stored; the row ends only if an EOS or
    padding id follows), and a row that does end within one call still gives its pages back."""
    from transformers import DynamicCache

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = _tiny_llama()
    ids = torch.tensor([[5, 17, 33, 8, 91, 44, 23, 9, 61]])
    kw = {"do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        eos = int(model.generate(ids, max_new_tokens=3, eos_token_id=None, **kw)[0, -1])  # the third greedy token
        outs = []
        for cache in (DynamicCache(config=model.config), LeanCache(model, "FP16", eos_token_id=eos)):
            first = model.generate(ids, max_new_tokens=8, eos_token_id=eos, **cache_kwargs(model, cache), **kw)
            assert int(first[0, -1]) == eos and first.shape[1] == ids.shape[1] + 3
            outs.append(model.generate(first, max_new_tokens=4, eos_token_id=None, **cache_kwargs(model, cache), **kw))
        assert torch.equal(outs[1], outs[0])
        # within one call: row 0 samples the EOS at its third step and is fed padding after it
        batch = torch.cat([ids, torch.tensor([[7, 3, 19, 4, 88, 12, 50, 6, 30]])])
        cache = LeanCache(model, "FP16", eos_token_id=eos)
        model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=8, eos_token_id=eos,
                       **cache_kwargs(model, cache), **kw)
        # row 1 runs on (its tokens hold no EOS): row 0 was released while the batch went on
        assert cache.finished.tolist() == [True, False]
        assert int(cache.table.n_pages[:, :, 0].sum()) == 0 and int(cache.table.n_pages[:, :, 1].sum()) > 0


@pytest.mark.filterwarnings("ignore:act=0.5")
@pytest.mark.parametrize("spec,overrides", [("FP16", {"max_seq_len": 41}), ("K8V4:act=0.5", {"num_pages": 20})],
                         ids=["row-outgrown", "act-short-pool"])
def test_a_refused_chunk_leaves_later_steps_bit_equal_on_the_kernel_backend(spec, overrides, monkeypatch):
    """A long chunk refused midway (a row outgrows ``max_seq_len``; a fixed pool too short for the
    ACT and KV grants) leaves nothing behind on the kernel backend: no pages kept by a partial
    grant, and the kernels' grid bounds back where they were, so every later step gives the bits an
    unfailed cache gives."""
    from leankit import PoolExhausted
    from leankit.testing import left_padded_batch, tiny_model

    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    model = tiny_model("llama-gqa")
    g = torch.Generator().manual_seed(5)
    ids, mask0 = left_padded_batch(2, 9, seed=2)
    chunks = [torch.randint(3, 97, (2, 4), generator=g)] + [torch.randint(3, 97, (2, 1), generator=g) for _ in range(3)]
    big = torch.randint(3, 97, (2, 150), generator=g)

    def step(cache, x, mask):
        mask = mask0 if mask is None else torch.cat([mask, torch.ones_like(x)], 1)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)[:, -x.shape[1]:]
        with torch.no_grad():
            return model(input_ids=x, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache)).logits, mask

    failed, ref = LeanCache(model, spec, **overrides), LeanCache(model, spec, **overrides)
    _, mask_f = step(failed, ids, None)
    _, mask_r = step(ref, ids, None)
    with pytest.raises((PoolExhausted, ValueError)):
        step(failed, big, mask_f)
    assert failed.memory_report()["pages_used"] == ref.memory_report()["pages_used"]
    for x in chunks:
        a, mask_f = step(failed, x, mask_f)
        b, mask_r = step(ref, x, mask_r)
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_row_that_goes_on_after_its_request_ended_is_refused_on_both_backends(backend, monkeypatch):
    """A cache told to end rows on an id that ``generate`` does not stop on frees a row's pages
    when it is fed that id twice, then sees the row go on: its context is gone, so the step is
    refused with a clear error on the torch backend (up front) and on the kernel backend (at the
    decode step's one host read, from step_rows' flag), never answered from an empty row."""
    from leankit.testing import left_padded_batch, tiny_model

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(2, 9, seed=1)
    kw = {"do_sample": False, "max_new_tokens": 8, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
        assert ref[1, 9:12].tolist() == [32, 32, 10]  # the fixture's premise: row 1 goes on after 32, 32
        cache = LeanCache(model, "FP16", eos_token_id=32)
        with pytest.raises(ValueError, match=r"rows \[1\] of this LeanCache ended their request"):
            model.generate(input_ids=ids, attention_mask=mask, **kw, **cache_kwargs(model, cache))
        assert cache.finished.tolist() == [False, True] and cache._step is None  # the refused step was dropped
