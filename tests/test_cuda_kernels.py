"""CUDA validation at real sizes (``make gpu-check``); every test skips cleanly without a GPU.

Run alone (``pytest -m cuda tests/test_cuda_kernels.py``): the other kernel test files switch on
Triton's interpreter when they are imported, which would make these run on the CPU path.
"""

import os

import pytest
import torch
from leankit_kernels.aot import ACT_MODELS

from leankit.hf import cache_kwargs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton interpreter is on")]

F16, BF16 = torch.float16, torch.bfloat16


def _case(spec, ctx, hkv, g, f, dtype, q_len=1, page_size=None):
    from leankit_kernels import testing

    gen, seed = testing.fresh_generator()
    fc = testing.build_paged_kv(spec, len(ctx), hkv, f, torch.tensor(ctx), dtype=dtype, generator=gen,
                                prune_frac=0.05, page_size=page_size or (4096 if f == 128 else 2048), device="cuda")
    q, q_pos = testing.random_queries(len(ctx), hkv * g, q_len, f, fc.ctx.cuda(), dtype=dtype, generator=gen,
                                      device="cuda")
    return fc, q, q_pos, seed


@pytest.mark.parametrize("spec", ["FP16", "K8V4", "K4V2", "K8V4-K4V2"])
@pytest.mark.parametrize("f,hkv,g", [(64, 3, 3), (128, 8, 4), (128, 2, 8), (64, 4, 1)])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("ctx", [[16384, 1000], [4097]])
def test_decode_real_sizes(spec, f, hkv, g, dtype, ctx):
    from leankit_kernels import testing
    from leankit_kernels.paged_attention import paged_attention
    from leankit_kernels.tiles import page_counts

    fc, q, q_pos, seed = _case(spec, ctx, hkv, g, f, dtype)
    out, lse = paged_attention(q, fc.kv, q_pos, f ** -0.5)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, f ** -0.5, f"(seed {seed})")
    bounds = page_counts(fc.kv.table.n_pages[:, fc.kv.layer], len(fc.kv.layouts) > 1)
    out2, lse2 = paged_attention(q, fc.kv, q_pos, f ** -0.5, page_bounds=bounds)
    testing.assert_matches_attention_ref(out2, lse2, q, fc.kv, q_pos, f ** -0.5, f"bounds (seed {seed})")


@pytest.mark.parametrize("spec", ["FP16", "K8V4-K4V2"])
@pytest.mark.parametrize("f,hkv,g", [(64, 3, 3), (128, 8, 4)])
@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_prefill_real_sizes(spec, f, hkv, g, dtype):
    """Prefill and its significance pass against the references. fp32 queries take the fp32-operand
    tiles with tf32x3 dots (prefill_config / received_config), held to fp32's tolerance."""
    from leankit_kernels import testing
    from leankit_kernels.prefill_attention import prefill_attention

    from leankit.attention import received_attention_ref

    fc, q, q_pos, seed = _case(spec, [2048, 700], hkv, g, f, dtype, q_len=300)
    out, lse, sig = prefill_attention(q, fc.kv, q_pos, f ** -0.5, return_significance=True)
    ref_lse = testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, f ** -0.5, f"(seed {seed})")
    ref_sig = received_attention_ref(q, fc.kv, q_pos, f ** -0.5, ref_lse)
    testing.assert_all_close_normwise(sig, ref_sig, dtype, f"significance (seed {seed})")


def _random_llama(hidden, heads, kv_heads, layers, vocab=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().cuda()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    return model


def _greedy(model, spec, backend, monkeypatch, new=24):
    from leankit.cache import LeanCache

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (2, 200), generator=gen).cuda()
    ids[1, :40] = 0
    cache = LeanCache(model, spec)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), **cache_kwargs(model, cache),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("shape", [(576, 9, 3, 2), (4096, 32, 8, 1)], ids=["smollm2-layers", "llama3-8b-layers"])
@pytest.mark.parametrize("spec", ["FP16", "K8V4", "K8V4-K4V2"])
def test_leancache_kernel_backend_matches_torch(shape, spec, monkeypatch):
    """fp32 random-init models of real layer shapes: kernels (ieee fp32 decode dots, tf32x3 prefill and
    significance dots) pick the same greedy tokens."""
    model = _random_llama(*shape)
    ref = _greedy(model, spec, "torch", monkeypatch)
    got = _greedy(model, spec, "auto", monkeypatch)
    assert torch.equal(got, ref), f"{spec}: kernels {got.tolist()} != torch {ref.tolist()}"


@pytest.mark.parametrize("b,hkv,g,f", [(8, 3, 3, 64), (32, 8, 4, 128), (4, 2, 8, 80)])
@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_own_token_merge_real_sizes(b, hkv, g, f, dtype):
    """A decode step's own token merged into the paged attention (one launch) against the torch
    composition it replaces, on the GPU."""
    from leankit_kernels import testing
    from leankit_kernels.own_token import merge_own_token

    from leankit.attention import merge_attention, step_attention

    gen, seed = testing.fresh_generator()
    q = torch.randn(b, 1, hkv * g, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    k = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    v = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    out_old = torch.randn(b, 1, hkv * g, f, generator=gen).cuda()
    lse_old = (torch.randn(b, hkv, g, generator=gen) * 3).cuda()
    real = (torch.rand(b, 1, generator=gen) < 0.8).cuda()
    q_pos = torch.full((b, 1), 7, device="cuda")
    out_new, lse_new, ref_recv = step_attention(q, k, v, q_pos, real, f ** -0.5, lse_other=lse_old, received=True)
    ref_out, ref_lse = merge_attention(out_old, lse_old, out_new, lse_new)
    out, lse, recv = merge_own_token(q, k, v, out_old, lse_old, real, f ** -0.5, received=True)
    for got, ref, what in ((out, ref_out, "out"), (lse, ref_lse, "lse"), (recv, ref_recv, "received")):
        testing.assert_close_normwise(got, ref, torch.float32, f"{what} (seed {seed})")


@pytest.mark.parametrize("layer", list(ACT_MODELS))
@pytest.mark.parametrize("n", [1, 37, 1000])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_act_to_kv_real_sizes(layer, n, dtype):
    """The fused ACT->KV projection at real layer shapes against its torch reference, on the GPU."""
    from leankit_kernels import testing
    from leankit_kernels.act_to_kv import NORM_CODES, act_to_kv

    from leankit.recompute import ActToKVParams, act_to_kv_ref

    # the layer shapes the AOT report compiles: (hidden, KV heads, head_dim, norm code, bias,
    # k_norm, RoPE, Gemma's fp32 (1 + w) norms)
    d, h, f, norm, bias, k_norm, rope, gemma = ACT_MODELS[layer]
    norm = next(name for name, code in NORM_CODES.items() if code == norm)
    gen, seed = testing.fresh_generator()

    def r(*shape, scale=1.0, shift=0.0, fp32=False):
        t = torch.randn(*shape, generator=gen) * scale + shift
        return t.to(torch.float32 if fp32 else dtype).cuda()

    params = ActToKVParams(
        norm, r(d, scale=0.3, shift=1.0, fp32=gemma), r(d, scale=0.2) if norm == "layer" else None, 1e-6,
        r(2 * h * f, d, scale=d ** -0.5), r(2 * h * f, scale=0.5) if bias else None, h, f,
        k_norm_weight=r(f, scale=0.3, shift=1.0, fp32=gemma) if k_norm else None,
        inv_freq=(1.0 / 10000 ** (torch.arange(0, f, 2).float() / f)).cuda() if rope else None,
        norm_weight_fp32=gemma)
    act = (torch.randn(n, d, generator=gen) * 2 + torch.randn(n, 1, generator=gen)).to(dtype).cuda()
    pos = torch.randint(0, 16384, (n,), generator=gen).cuda()
    k_ref, v_ref = act_to_kv_ref(act, pos, params)
    k, v = act_to_kv(act, pos, params)
    for got, ref, what in ((k, k_ref, "K"), (v, v_ref, "V")):
        testing.assert_close_normwise(got, ref, dtype, f"{layer} {what} (seed {seed})", testing.ACT_TO_KV_TOL[dtype])


@pytest.mark.parametrize("spec", ["K8V4", "K8V4-K4V2"])
@pytest.mark.parametrize("f,hkv,g", [(64, 3, 3), (128, 8, 4)])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("splits", [1, None])
def test_decode_step_attention_real_sizes(spec, f, hkv, g, dtype, splits):
    """The decode launch that takes the step's own token itself (one split: the decode kernel; several:
    the split reduce) against the torch composition it replaces (paged attention, the own token's
    exact attention, the log-sum-exp merge), with each new token's significance."""
    from leankit_kernels import testing
    from leankit_kernels.paged_attention import decode_step_attention

    from leankit.attention import merge_attention, paged_attention_ref, step_attention

    fc, q, q_pos, seed = _case(spec, [16384, 1000, 4097], hkv, g, f, dtype)
    gen = torch.Generator().manual_seed(seed)
    b = q.shape[0]
    k_new = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    v_new = torch.randn(b, 1, hkv, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    real = torch.tensor([[True], [False], [True]], device="cuda")
    out, lse, saved, recv = decode_step_attention(q, fc.kv, q_pos, f ** -0.5, k_new, v_new, real, significance=True,
                                                  num_splits=splits, out_dtype=torch.float32)
    out_old, lse_old = paged_attention_ref(q.float(), fc.kv, q_pos, f ** -0.5)
    out_new, lse_new, ref_recv = step_attention(q, k_new, v_new, q_pos, real, f ** -0.5, lse_other=lse_old,
                                                received=True)
    ref_out, ref_lse = merge_attention(out_old, lse_old, out_new, lse_new)
    assert saved is not None
    for got, ref, what in ((out, ref_out, "out"), (lse, ref_lse, "lse"), (recv, ref_recv, "received")):
        testing.assert_close_normwise(got, ref, dtype, f"{what} (seed {seed})")


@pytest.mark.parametrize("b,hkv,g,f,nq", [(8, 3, 3, 64, 4096), (4, 8, 4, 128, 2048), (2, 2, 8, 80, 1000)])
@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_prompt_significance_real_sizes(b, hkv, g, f, nq, dtype):
    """The prompt's significance in two launches against the chunked torch pass it replaces on a GPU
    (left-padded rows, the model's [B, Q, H, F] layout transposed)."""
    from leankit_kernels import testing
    from leankit_kernels.prompt_significance import prompt_received

    from leankit.attention import step_received

    gen, seed = testing.fresh_generator()
    q = torch.randn(b, nq, hkv * g, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    k = torch.randn(b, nq, hkv, f, generator=gen).to(dtype).transpose(1, 2).cuda()
    real = torch.ones(b, nq, dtype=torch.bool)
    for r in range(b):
        real[r, : int(torch.randint(0, nq // 3, (1,), generator=gen))] = False
    pos = (real.long().cumsum(1) - 1).clamp_min(0).cuda()
    real = real.cuda()
    got = prompt_received(q, k, pos, real, f ** -0.5)
    want = step_received(q.float(), k.float(), pos, real, f ** -0.5, ordered=True)
    testing.assert_close_normwise(got, want, dtype, f"received (seed {seed})")


@pytest.mark.parametrize("spec,b,hkv,f,nq", [("K8V4", 32, 8, 128, 1), ("K4V2", 8, 3, 64, 1), ("FP16", 8, 8, 128, 1),
                                              ("K8V4", 4, 8, 128, 300)])
@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_store_step_real_sizes(spec, b, hkv, f, nq, dtype):
    """A step's store (one launch from [B, H, Q, F] K/V) writes the bytes quantize_into_pages
    writes for the same tokens at the slots listed on the host, and advances the counts."""
    from leankit_kernels import testing
    from leankit_kernels.quant import quantize_into_pages, store_step_tokens

    from leankit.config import KVConfig
    from leankit.pages import PageLayout, PagePool

    gen, seed = testing.fresh_generator()
    lay = PageLayout.build(KVConfig.parse(spec), 0, f, dtype)
    t = lay.tokens
    lens = torch.randint(0, 4000, (b, hkv), generator=gen, dtype=torch.int32)
    cols = (int(lens.max()) + nq) // t + 2
    n_pages = b * hkv * cols
    table = torch.randperm(n_pages, generator=gen).to(torch.int32).reshape(b, hkv, cols)
    real = torch.rand(b, nq, generator=gen) < 0.9
    rank = torch.cumsum(real.int(), 1) - 1
    q_pos = torch.arange(nq, dtype=torch.int32).expand(b, nq) + 5000
    k = torch.randn(b, nq, hkv, f, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(b, nq, hkv, f, generator=gen).to(dtype).transpose(1, 2)
    score = torch.rand(b, hkv, nq, generator=gen)
    bi, qi, hi = (x.reshape(-1) for x in torch.meshgrid(torch.arange(b), torch.arange(nq), torch.arange(hkv),
                                                        indexing="ij"))
    keep = real[bi, qi]
    slot = lens[bi, hi] + rank[bi, qi]
    page = torch.where(keep, table[bi, hi, slot // t].long(), torch.full_like(slot, -1, dtype=torch.long))
    pools = [PagePool(n_pages, lay.page_size, "cuda") for _ in range(2)]
    init = torch.randint(0, 256, pools[0].storage.shape, generator=gen, dtype=torch.uint8).cuda()
    for pool in pools:
        pool.storage.copy_(init)
    quantize_into_pages(pools[0].storage, lay, page.cuda(), (slot % t).cuda(), k[bi, hi, qi].cuda(), v[bi, hi, qi].cuda(),
                        q_pos[bi, qi].cuda(), score[bi, hi, qi].cuda())
    want_lens = lens + real[:, :1].int() if nq == 1 else lens.clone()
    lens_gpu, err = lens.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda")
    store_step_tokens(pools[1].storage, lay, k.cuda(), v.cuda(), real.cuda(), rank.cuda(), q_pos.cuda(), lens_gpu,
                      table.cuda(), err, score=score.cuda())
    assert torch.equal(pools[1].storage, pools[0].storage), f"seed {seed}"
    assert torch.equal(lens_gpu.cpu(), want_lens) and int(err) == 0


@pytest.mark.parametrize("batch,heads,nq", [(8, 3, 1024), (4, 8, 4096), (2, 2, 200), (1, 4, 16384)])
@pytest.mark.parametrize("th,tl", [(0.25, 0.0), (0.4, 0.1)])
def test_prompt_classes_real_sizes(batch, heads, nq, th, tl):
    """LeanKV's one-launch prompt classification at prompt lengths from 200 to 16k tokens against
    the torch rule (sort and cumulative sum), on the GPU's own summation order: the classes may
    differ only for a token whose cumulative significance lies within fp32 rounding of a cut-off,
    so at most a few per thousand; counts, ranks and the pruned mass follow the kernel's classes."""
    from leankit_kernels import testing
    from leankit_kernels.prompt_plan import PRUNED, prompt_classes, prompt_classes_ref

    gen, seed = testing.fresh_generator()
    pad = torch.randint(0, nq // 4, (batch,), generator=gen)
    real = torch.arange(nq).view(1, -1) >= pad.view(-1, 1)
    pos = (torch.cumsum(real.long(), 1) - 1).clamp_min(0)
    q_last = pos[:, -1].clone()
    received = torch.rand(batch, heads, nq, generator=gen) ** 6 * 20
    pm = torch.rand(batch, heads, generator=gen)
    lens = torch.zeros(2, batch, heads, dtype=torch.int32)
    args = (received, pos.int(), real, q_last, pm, lens, 16, th, tl)
    got = prompt_classes(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    want = prompt_classes_ref(*args)
    score, cls, rank, new_lens, pruned = (t.cpu() for t in got)
    valid = real.unsqueeze(1).expand_as(cls)
    assert torch.equal(score[valid], want[0][valid]), f"seed {seed}"
    differ = int((cls != want[1]).sum())
    assert differ <= max(2, cls.numel() // 1000), f"{differ} classes differ (seed {seed})"
    for c in range(2):  # counts and ranks are the kernel's classes' own
        take = cls == c
        assert torch.equal(new_lens[c, 0], lens[c].long() + take.sum(-1)), f"seed {seed}"
        assert torch.equal(rank[take], (torch.cumsum(take.long(), -1) - 1)[take]), f"seed {seed}"
    want_pruned = torch.where(cls == PRUNED, score, torch.zeros_like(score)).sum(-1)
    torch.testing.assert_close(pruned, want_pruned, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers,batch,heads,row_len", [(32, 64, 8, 300), (30, 8, 3, 2000), (2, 300, 1, 40)])
def test_retiering_page_kernels_real_sizes(layers, batch, heads, row_len):
    """The page plan of a re-tiering, its deferred grant and the hand-over of emptied high pages to
    the low side at real sizes, against their torch references: rows with and without free columns between the
    sides (a full row moves pages into columns its high side leaves, where the kernel's barrier
    orders each tile's reads before its writes) and hundreds of moves per row (several tiles)."""
    from leankit_kernels import testing
    from leankit_kernels.page_alloc import (
        grow_pages,
        move_tail_pages,
        plan_tier_pages,
    )

    from leankit.allocator import FreePageList
    from leankit.page_table import BidirectionalPageTable

    gen, seed = testing.fresh_generator()
    shape = (layers, batch, heads)
    cur_h = torch.randint(0, row_len + 1, shape, generator=gen)
    room = row_len - cur_h
    full = torch.rand(shape, generator=gen) < 0.5
    cur_l = torch.where(full, room, (torch.rand(shape, generator=gen) * (room + 1)).long().clamp_max(room))
    col = torch.arange(row_len)
    used = (col < cur_h.unsqueeze(-1)) | (col >= row_len - cur_l.unsqueeze(-1))
    ids = torch.arange(used.numel(), dtype=torch.int32).view(*shape, row_len)
    tabs = []
    for dev in ("cpu", "cuda"):
        t = BidirectionalPageTable(layers, batch, heads, row_len, dev)
        t.tables.copy_(torch.where(used, ids, torch.full_like(ids, -1)))
        t.n_pages.copy_(torch.stack([cur_h, cur_l]).to(torch.int32))
        tabs.append(t)
    layers_sel = torch.randperm(layers, generator=gen)[: max(1, layers // 2)]
    lens = torch.randint(0, 4 * row_len, (2, layers_sel.numel(), batch, heads), generator=gen)
    reserve = torch.randint(0, 2, (batch,), generator=gen)
    want = tabs[0].tier_plan(layers_sel, lens, (9, 17), reserve)  # the CPU table: the torch path
    got = plan_tier_pages(tabs[1], layers_sel.cuda(), lens.cuda(), (9, 17), reserve.cuda())
    for name, g, w in zip(("need", "r", "extra"), got, want):
        assert torch.equal(g.cpu(), w), f"plan {name} (seed {seed})"
    # the deferred grant of that plan (one program up to SINGLE_GRANT_MAX requesters) against the
    # eager grow, on rows with room for it
    extra = torch.minimum(want[2], (row_len - tabs[0].n_pages.sum(0)).clamp_min(0) // 2)
    cap = int(extra.sum()) + 50
    perm = torch.randperm(cap, generator=gen).to(torch.int32)
    lists = [FreePageList(cap, dev) for dev in ("cpu", "cuda")]
    for fl in lists:
        fl.ring.copy_(perm.to(fl.ring.device))
        fl.free_head, fl.free_tail = 0, cap
    status = torch.zeros(3, dtype=torch.int64, device="cuda")
    tabs[0].grow(extra, lists[0])
    assert bool(grow_pages(tabs[1], extra.cuda(), lists[1], status=status)) and not status.any()
    assert torch.equal(tabs[1].tables.cpu(), tabs[0].tables) and torch.equal(tabs[1].n_pages.cpu(), tabs[0].n_pages)
    assert lists[1].num_free == lists[0].num_free, f"seed {seed}"
    r = torch.minimum((torch.rand(layers_sel.numel(), batch, heads, generator=gen) * (cur_h[layers_sel] + 1)).long(),
                      cur_h[layers_sel])
    tabs[0].move_tail(layers_sel, r)
    move_tail_pages(tabs[1], layers_sel.cuda(), r.cuda())
    assert torch.equal(tabs[1].n_pages.cpu(), tabs[0].n_pages), f"seed {seed}"
    assert torch.equal(tabs[1].tables.cpu(), tabs[0].tables), f"seed {seed}"


@pytest.mark.parametrize("layers,batch,heads,tokens", [(32, 64, 8, 18), (30, 8, 3, 36), (2, 300, 1, 7)])
def test_step_setup_kernels_real_sizes(layers, batch, heads, tokens):
    """A decode step's setup launches at real sizes (Llama-3-8B's 32 x 8 heads at batch 64,
    SmolLM2's, a wide batch): step_rows against its reference, grant_token_pages against the eager
    grow of the same demand, release_rows against the deferred shrink to zero pages."""
    from leankit_kernels import testing
    from leankit_kernels.page_alloc import grant_token_pages, release_rows, shrink_pages
    from leankit_kernels.step_rows import step_rows, step_rows_ref

    from leankit.allocator import FreePageList
    from leankit.page_table import BidirectionalPageTable

    gen, seed = testing.fresh_generator()
    dev = "cuda"
    finished = (torch.rand(batch, generator=gen) < 0.1).to(dev)
    mask = (torch.rand(batch, 40, generator=gen) < 0.9).long().to(dev)
    pos = torch.randint(0, 8000, (batch, 1), generator=gen).to(dev)
    tok = torch.randint(0, 100, (batch,), generator=gen).to(dev)
    eos = torch.tensor([3, 17], device=dev)
    err, status = torch.ones(layers + 1, dtype=torch.int32, device=dev), torch.ones(3, dtype=torch.int64, device=dev)
    ending = (torch.rand(batch, generator=gen) < 0.3).to(dev)
    last_pos = torch.randint(-1, 8000, (batch,), generator=gen).to(dev)
    kw = {"attention_mask": mask, "position_ids": pos, "seen": 9, "last_tokens": tok, "end_ids": eos, "n_eos": 1,
          "ending": ending, "last_pos": last_pos, "no_pos": 1 << 30}
    got, want = step_rows(batch, finished, err, status, **kw), step_rows_ref(batch, finished, **kw)
    for name, ref in want.items():
        assert torch.equal(got[name], ref), f"step_rows {name} (seed {seed})"
    assert not err.any() and not status.any()

    lens = torch.randint(0, 4000, (layers, batch, heads), generator=gen, dtype=torch.int32)
    row_len = 4100 // tokens + 4
    cap = int((lens // tokens + 3).sum()) + 100
    perm = torch.randperm(cap, generator=gen).to(torch.int32)
    pairs = []
    for _ in range(2):
        fl = FreePageList(cap, dev)
        fl.ring.copy_(perm.to(dev))
        fl.free_head, fl.free_tail = 0, cap
        table = BidirectionalPageTable(layers, batch, heads, row_len, dev)
        pairs.append((fl, table))
    n_new = got["n_new"]
    for step, (fl, table) in enumerate(pairs):
        table.lens[0].copy_(lens.to(dev))
        if step == 0:  # the eager grow of the demand (torch, then the many-program kernel)
            table.grow(table.token_demand(n_new, tokens), fl)
        else:
            grant_token_pages(table, n_new, tokens, fl, status)
    (fa, ta), (fb, tb) = pairs
    assert torch.equal(ta.tables, tb.tables) and torch.equal(ta.n_pages, tb.n_pages), f"grant (seed {seed})"
    assert fa.num_free == fb.num_free and not status.any()
    rows = got["ended"] | (torch.rand(batch, generator=gen) < 0.3).to(dev)
    keep = torch.where(rows.view(1, 1, -1, 1), torch.zeros_like(ta.n_pages), ta.n_pages)
    shrink_pages(ta, keep, fa, defer=True)
    ta.lens.masked_fill_(rows.view(1, 1, -1, 1), 0)
    release_rows(tb, rows, fb)
    for name in ("tables", "n_pages", "lens"):
        assert torch.equal(getattr(ta, name), getattr(tb, name)), f"release {name} (seed {seed})"
    assert torch.equal(fa.ring, fb.ring) and fa.num_free == fb.num_free


def test_decode_kernel_launch_replays_in_a_cuda_graph():
    """With host page bounds the decode launch reads nothing from the device, so it can be captured
    in a CUDA graph; a replay on new queries matches an eager call."""
    from leankit_kernels import testing
    from leankit_kernels.paged_attention import paged_attention
    from leankit_kernels.tiles import page_counts

    fc, q, q_pos, seed = _case("K8V4-K4V2", [4097, 1000], 8, 4, 128, F16)
    bounds = page_counts(fc.kv.table.n_pages[:, fc.kv.layer], True)
    scale = 128 ** -0.5
    paged_attention(q, fc.kv, q_pos, scale, page_bounds=bounds)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = paged_attention(q, fc.kv, q_pos, scale, page_bounds=bounds)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref, ref_lse = paged_attention(q, fc.kv, q_pos, scale, page_bounds=bounds)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=f"graph replay != eager (seed {seed})")
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    testing.assert_matches_attention_ref(out, lse, q, fc.kv, q_pos, scale, f"graph replay (seed {seed})")


class _CudaSyncLog:
    """Records each synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("warn")``) with the
    decode phase it happened in (``layer i`` or ``step``) and the innermost leankit frame."""

    def __init__(self):
        import leankit_kernels

        import leankit

        self.roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (leankit, leankit_kernels))
        self.phase = "step"
        self.events: list[tuple[str, str]] = []

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        if "synchronizing" not in str(message):
            return
        site = "outside leankit"
        for frame in reversed(traceback.extract_stack()[:-1]):
            if frame.filename.startswith(self.roots):
                site = f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
                break
        self.events.append((self.phase, site))

    def count(self, phase_prefix: str, leankit_only: bool = True) -> int:
        return sum(1 for ph, site in self.events
                   if ph.startswith(phase_prefix) and not (leankit_only and site == "outside leankit"))


SYNC_CONFIGS = [("K8V4", {"page_size": 256}), ("FP16", {}), ("K8V4", {"page_size": 256, "eos_token_id": [7, 11]}),
                ("K8V4-K4V2", {"th": 0.25, "tl": 0.0, "window": 3, "compress_every": 4, "page_size": 256}),
                ("K8V4-K4V2", {"th": 0.3, "tl": 0.1, "window": 3, "compress_every": 1, "group_size": 8,
                               "page_size": 256})]


@pytest.mark.parametrize("spec,overrides", SYNC_CONFIGS, ids=["K8V4", "FP16", "K8V4-eos", "leankv", "leankv-prune"])
def test_decode_steps_do_not_sync_inside_layers(spec, overrides, monkeypatch):
    """Real CUDA sync detection (the driver-level counterpart of tests/test_sync_free.py): over 6
    decode steps of a fixed pool, no synchronizing CUDA call from leankit inside any decoder layer,
    and at most one per step (the end-of-step read of the device flags)."""
    import warnings

    from leankit.cache import LeanCache
    from leankit.testing import layer_phase_hooks, left_padded_batch

    monkeypatch.setenv("LEANKIT_BACKEND", "auto")
    model = _random_llama(576, 9, 3, 2)
    log = _CudaSyncLog()
    handles = layer_phase_hooks(model, log)
    ids, mask = left_padded_batch(rows=3, width=11, pad_step=3, vocab=500)
    ids, mask = ids.cuda(), mask.cuda()
    cache = LeanCache(model, spec, num_pages=600, **overrides)
    per_step = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True).logits
        pos = (mask.sum(1, keepdim=True) - 1 + (mask.shape[1] - mask.sum(1, keepdim=True)))
        for _ in range(6):
            nxt = logits[:, -1:].argmax(-1)
            mask, pos = torch.cat([mask, torch.ones_like(nxt)], 1), pos + 1
            torch.cuda.synchronize()
            before = len(log.events)
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = log.showwarning
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos,
                                   **cache_kwargs(model, cache), use_cache=True).logits
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            per_step.append(log.events[before:])
    for h in handles:
        h.remove()
    for i, events in enumerate(per_step):
        ours = [e for e in events if e[1] != "outside leankit"]
        inside = [e for e in ours if e[0].startswith("layer")]
        assert not inside, f"decode step {i}: host syncs inside layers: {inside}"
        assert len(ours) <= 1, f"decode step {i}: {len(ours)} leankit host syncs (allowed 1): {ours}"
    print(f"{spec} {overrides}: syncs per step {[len(e) for e in per_step]} "
          f"(all sources), leankit's {[sum(x[1] != 'outside leankit' for x in e) for e in per_step]}")


def _compiled_variants(kernel) -> int:
    """Variants of a Triton kernel compiled in this process (every device's kernel cache: the first
    dict of each ``device_caches`` entry, whose layout varies across Triton versions)."""
    return sum(len(next(x for x in entry if isinstance(x, dict))) for entry in kernel.device_caches.values())


@pytest.mark.parametrize("spec,overrides", [("K8V4", {"page_size": 512}),
                                            ("K8V4-K4V2", {"window": 3, "compress_every": 4, "page_size": 512})])
def test_one_generation_compiles_at_most_two_decode_variants(spec, overrides, monkeypatch):
    """A whole ``generate`` whose contexts grow over many pages (splits changing) compiles at most 2
    new variants of the decode kernel (head_dim 80: a shape no other test here compiles)."""
    import leankit_kernels.paged_attention as pa

    from leankit.cache import LeanCache

    monkeypatch.setenv("LEANKIT_BACKEND", "auto")
    model = _random_llama(640, 8, 2, 2)
    before = _compiled_variants(pa._decode_kernel)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 500, (3, 90), generator=gen).cuda()
    cache = LeanCache(model, spec, **overrides)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                       max_new_tokens=160, do_sample=False, pad_token_id=0, eos_token_id=None)
    new = _compiled_variants(pa._decode_kernel) - before
    assert 1 <= new <= 2, f"{spec}: {new} decode variants compiled in one generation"


def test_available_device_memory_counts_what_the_caching_allocator_holds_unused():
    """``available_memory_bytes`` on CUDA: a freed buffer that torch's caching allocator keeps
    reserved is still memory a new allocation can take (lm-eval's ``batch_size=auto`` reads it)."""
    from leankit.planner.hardware import available_memory_bytes

    dev = torch.device("cuda")
    before = available_memory_bytes(dev)
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    during = available_memory_bytes(dev)
    assert before - during >= 500 * 2**20
    del held  # back to the caching allocator, not to the device
    assert available_memory_bytes(dev) - during >= 500 * 2**20
    assert available_memory_bytes(dev) <= torch.cuda.mem_get_info(dev)[1]
