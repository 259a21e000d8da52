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
from leankit.pages import PagePool


def _tiny_llama():
    # A fixed seed: greedy decoding of two backends is compared token for token, and a fixed
    # model keeps near-tied logits (a 1e-6 difference flipping an argmax) out of CI.
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
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
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
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


@pytest.mark.parametrize("spec,overrides", [("K8V4", {}), ("FP16", {}), ("K8V4-K4V2", {"window": 3}),
                                            ("K8V4-K4V2", {"window": 3, "rotate": True})])
def test_triton_backend_generates_same_tokens(spec, overrides, monkeypatch):
    import leankit_kernels.page_alloc as pa
    import leankit_kernels.paged_attention as pa_attn
    import leankit_kernels.prefill_attention as pf
    import leankit_kernels.quant as qu

    _garbage_pool(monkeypatch)
    model = _tiny_llama()
    ref, ref_cache = _generate(model, spec, "torch", monkeypatch, **overrides)
    calls = {}
    spied = ((qu, "quantize_into_pages"), (pa_attn, "paged_attention"), (pa, "grow_pages"),
             (pf, "received_attention"))
    for mod, name in spied:
        _spy(monkeypatch, mod, name, calls)
    got, cache = _generate(model, spec, "triton", monkeypatch, **overrides)
    expected = {"quantize_into_pages", "paged_attention", "grow_pages"}
    if cache.cfg.policy == "leankv":  # significance scores come from the kernel's second pass
        expected.add("received_attention")
    assert set(calls) == expected, calls
    assert len(set(ref.flatten().tolist())) > 2, "degenerate generation"
    assert torch.equal(got, ref), f"{spec}: triton {got.tolist()} != torch {ref.tolist()}"
    assert cache.memory_report()["pages_used"] == ref_cache.memory_report()["pages_used"]
    if overrides:  # the mixed config really used both tiers
        assert cache.memory_report()["tokens_per_tier"]["low"] > 0
