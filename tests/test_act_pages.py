"""ACT pages in isolation: the byte model, the page layout, the (layer, sequence) table, recompute_kv."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from leankit.allocator import FreePageList, PoolExhausted
from leankit.config import PAGE_ALIGN, KVConfig, act_geometry, act_kv_token_bytes
from leankit.page_table import ActPageTable
from leankit.pages import ActLayout, PagePool
from leankit.recompute import act_to_kv_ref, layer_params, recompute_kv


# ---------------------------------------------------------------------------- byte model
@pytest.mark.parametrize("hidden,itemsize,page_size", [(768, 2, 2048), (576, 2, 2048), (576, 4, 2048),
                                                       (5120, 2, 4096), (200, 4, 256), (100, 2, 128)])
def test_geometry_fits_and_is_best(hidden, itemsize, page_size):
    g = act_geometry(hidden, itemsize, page_size)
    assert g.slices * g.channels == hidden
    assert g.position_offset % PAGE_ALIGN == 0
    assert g.position_offset + ((g.tokens * 4 + 15) // 16) * 16 <= page_size  # both segments fit
    # one more token would not fit
    assert ((g.tokens + 1) * g.row_bytes + 15) // 16 * 16 + ((g.tokens + 1) * 4 + 15) // 16 * 16 > page_size
    # no other aligned slice count packs better
    for s in range(1, hidden + 1):
        if hidden % s or (hidden // s * itemsize) % PAGE_ALIGN:
            continue
        rb = hidden // s * itemsize
        t = page_size // (rb + 4)
        while t and ((t * rb + 15) // 16 * 16 + (t * 4 + 15) // 16 * 16) > page_size:
            t -= 1
        if t:
            assert g.bytes_per_token <= page_size * s / t + 1e-9


def test_opt_mha_act_is_about_half_of_kv():
    """OPT-125m-like layer (hidden 768 = 12 heads x 64), fp16, 2048-byte pages."""
    fp16 = act_kv_token_bytes(KVConfig.parse("FP16:page_size=2048"), 768, 12, 64, 2)
    g = act_geometry(768, 2, 2048)
    assert (g.slices, g.channels, g.tokens) == (4, 192, 5)
    assert fp16["act"] == pytest.approx(2048 * 4 / 5)  # 1638.4 B per token and layer
    assert fp16["kv"] == pytest.approx(2048 / 7 * 12)  # FP16 pages hold 7 tokens of one head
    assert fp16["act_over_kv"] <= 0.52 and fp16["act_saves"]
    # against quantized KV the activations cost more: K8V4 already stores under half of fp16
    assert not act_kv_token_bytes(KVConfig.parse("K8V4"), 768, 12, 64, 2)["act_saves"]


def test_smollm2_gqa_act_costs_more_than_kv():
    """SmolLM2: hidden 576 > 2 x 3 KV heads x 64 = 384, so a planner must decline ACT."""
    for itemsize in (2, 4):
        r = act_kv_token_bytes(KVConfig.parse("FP16"), 576, 3, 64, itemsize)
        assert r["act_over_kv"] > 1.1 and not r["act_saves"]


def test_geometry_errors():
    with pytest.raises(ValueError, match="cannot hold"):
        act_geometry(7, 4, 16)
    with pytest.raises(ValueError, match="positive"):
        act_geometry(0, 2, 2048)


# ---------------------------------------------------------------------------- layout
def _pool(pages, page_size, gen):
    pool = PagePool(pages, page_size)
    pool.storage.copy_(torch.randint(0, 256, pool.storage.shape, generator=gen, dtype=torch.uint8))
    return pool


def _scattered_write(hidden, dtype, page_size, n, seed):
    """A layout, a pool of random bytes (and a copy of it) and ``n`` tokens to write to scattered
    targets: every (token, slice) on its own page, at a random row; ``(lay, pool, before, page_ids,
    rows, act, pos, gen)``."""
    gen = torch.Generator().manual_seed(seed)
    lay = ActLayout.build(hidden, dtype, page_size)
    pages = n * lay.slices + 4
    pool = _pool(pages, page_size, gen)
    rows = torch.randint(0, lay.tokens, (n,), generator=gen)
    page_ids = torch.randperm(pages, generator=gen)[: n * lay.slices].view(n, lay.slices)
    act = torch.randn(n, hidden, generator=gen).to(dtype)
    pos = torch.randint(0, 10_000, (n,), generator=gen)
    return lay, pool, pool.storage.clone(), page_ids, rows, act, pos, gen


@pytest.mark.parametrize("hidden,dtype,page_size", [(72, torch.float32, 512), (96, torch.float16, 256),
                                                    (40, torch.bfloat16, 2048)])
def test_layout_round_trip_touches_only_its_rows(hidden, dtype, page_size):
    lay, pool, before, page_ids, rows, act, pos, _ = _scattered_write(hidden, dtype, page_size, 13, hidden)
    lay.write(pool, page_ids, rows, act, pos)
    got, got_pos = lay.read(pool, page_ids, rows)
    assert torch.equal(got, act) and torch.equal(got_pos, pos.to(torch.int32))
    changed = (pool.storage != before).any(1).nonzero().flatten()
    assert set(changed.tolist()) <= set(page_ids.flatten().tolist())


@pytest.mark.parametrize("hidden,dtype,page_size", [(72, torch.float32, 512), (40, torch.bfloat16, 2048)])
def test_layout_write_with_keep_writes_only_kept_tokens(hidden, dtype, page_size):
    """``keep`` (the kernel backend's dense listing): kept tokens land as without it; a token not
    kept, or naming a missing page (-1), changes nothing, even where it names a kept token's slot."""
    lay, pool, before, page_ids, rows, act, pos, gen = _scattered_write(hidden, dtype, page_size, 11, hidden + 1)
    keep = torch.rand(11, generator=gen) < 0.5
    keep[0], keep[1], keep[2] = True, False, True
    page_ids[1], rows[1] = page_ids[0], rows[0]  # a dropped token on a kept token's slot
    page_ids[2, -1] = -1  # a kept token whose last slice page was never granted
    lay.write(pool, page_ids, rows, act, pos, keep=keep)
    written = keep & (page_ids >= 0).all(1)
    got, got_pos = lay.read(pool, page_ids[written], rows[written])
    assert torch.equal(got, act[written]) and torch.equal(got_pos, pos[written].to(torch.int32))
    changed = set((pool.storage != before).any(1).nonzero().flatten().tolist())
    assert changed and changed <= set(page_ids[written].flatten().tolist())
    with pytest.raises(ValueError, match="keep"):
        lay.write(pool, page_ids, rows, act, pos, keep=keep[:-1])


@pytest.mark.parametrize("hidden,dtype,page_size", [(72, torch.float32, 512), (96, torch.float16, 256),
                                                    (40, torch.bfloat16, 2048), (576, torch.float32, 2048)])
def test_read_blocks_is_read_of_every_row_and_zeroes_dead_rows(hidden, dtype, page_size):
    """Whole blocks read at once equal the per-token read of each of their rows; with ``live``, a
    dead row reads as zeros whatever its bytes (NaN patterns included), position 0 included, a live
    one as without it."""
    gen = torch.Generator().manual_seed(hidden + page_size)
    lay = ActLayout.build(hidden, dtype, page_size)
    lead = (3, 2)  # [rows of the batch, blocks]
    n_blocks = lead[0] * lead[1]
    pages = n_blocks * lay.slices + 5
    pool = _pool(pages, page_size, gen)
    nan = torch.full((), float("nan"), dtype=dtype).view(torch.uint8 if dtype.itemsize == 1 else
                                                           {2: torch.int16, 4: torch.int32}[dtype.itemsize])
    pool.storage[0].view(nan.dtype)[:] = nan  # a page of NaN patterns, named by the first block below
    block_ids = torch.randperm(pages - 1, generator=gen)[: n_blocks * lay.slices].add_(1).view(*lead, lay.slices)
    block_ids[0, 0, 0] = 0
    act, pos = lay.read_blocks(pool, block_ids)
    assert act.shape == (*lead, lay.tokens, hidden) and pos.shape == (*lead, lay.tokens) and pos.dtype == torch.int32
    rows = torch.arange(lay.tokens).repeat(n_blocks)
    want, want_pos = lay.read(pool, block_ids.reshape(n_blocks, 1, lay.slices).expand(-1, lay.tokens, -1)
                              .reshape(-1, lay.slices), rows)
    assert torch.equal(act.reshape(-1, hidden).view(torch.uint8), want.view(torch.uint8))  # NaN bits too
    assert torch.equal(pos.reshape(-1), want_pos)
    live = torch.rand(*lead, lay.tokens, generator=gen) < 0.6
    live[0, 0] = False  # the NaN page's rows are dead
    masked, masked_pos = lay.read_blocks(pool, block_ids, live=live)
    assert torch.equal(masked[live].view(torch.uint8), act[live].view(torch.uint8))
    assert torch.equal(masked_pos[live], pos[live])
    assert torch.equal(masked[~live], torch.zeros(int((~live).sum()), hidden, dtype=dtype))
    assert torch.equal(masked_pos[~live], torch.zeros(int((~live).sum()), dtype=torch.int32))
    with pytest.raises(ValueError, match="live"):
        lay.read_blocks(pool, block_ids, live=live[..., 1:])


def test_layout_bad_calls_leave_pool_unchanged():
    gen = torch.Generator().manual_seed(1)
    lay = ActLayout.build(64, torch.float32, 512)
    pool = _pool(8, 512, gen)
    before = pool.storage.clone()
    ids = torch.zeros(3, lay.slices, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden"):
        lay.write(pool, ids, torch.zeros(3), torch.zeros(3, 65), torch.zeros(3))
    with pytest.raises(ValueError, match="page ids"):
        lay.write(pool, torch.zeros(2, lay.slices), torch.zeros(3), torch.zeros(3, 64), torch.zeros(3))
    with pytest.raises(ValueError, match="positions"):
        lay.write(pool, ids, torch.zeros(3), torch.zeros(3, 64), torch.zeros(2))
    with pytest.raises(ValueError, match="bytes"):
        lay.write(PagePool(2, 256), ids, torch.zeros(3), torch.zeros(3, 64), torch.zeros(3))
    assert torch.equal(pool.storage, before)


# ---------------------------------------------------------------------------- table
def test_table_grow_locate_release():
    gen = torch.Generator().manual_seed(2)
    lay = ActLayout.build(96, torch.float16, 256)  # several slices per token
    assert lay.slices > 1
    layers, batch = 2, 3
    fl = FreePageList(64)
    table = ActPageTable(layers, batch, max_tokens=40, slices=lay.slices, tokens=lay.tokens, device="cpu")
    new = torch.tensor([[5, 0, 2 * lay.tokens + 1], [1, 3, 0]])
    extra = table.blocks_needed(new)
    assert extra.tolist() == [[1, 0, 3], [1, 1, 0]]
    table.grow(extra, fl)
    assert fl.num_free == 64 - int(extra.sum()) * lay.slices
    owned = table.tables[table.tables >= 0]
    assert owned.unique().numel() == owned.numel()  # every page belongs to one (layer, seq, block, slice)
    table.lens += new.to(torch.int32)
    # locate: slot s of (layer 0, seq 2) is row s % T of the S pages of block s // T
    slot = torch.arange(int(new[0, 2]))
    ids, rows = table.locate(0, torch.full_like(slot, 2), slot)
    assert ids.shape == (slot.numel(), lay.slices) and (ids >= 0).all()
    assert torch.equal(ids, table.tables[0, 2].view(-1, lay.slices)[slot // lay.tokens])
    assert torch.equal(rows, slot % lay.tokens)
    # write through the table, read back
    pool = _pool(64, 256, gen)
    act = torch.randn(slot.numel(), 96, generator=gen).half()
    lay.write(pool, ids, rows, act, slot)
    assert torch.equal(lay.read(pool, ids, rows)[0], act)
    # one more token on a full row needs a new block; the pool can run out without changing state
    small = FreePageList(lay.slices - 1)
    t2 = ActPageTable(1, 1, 40, lay.slices, lay.tokens, "cpu")
    with pytest.raises(PoolExhausted):
        t2.grow(torch.ones(1, 1, dtype=torch.int32), small)
    assert int(t2.n_blocks.sum()) == 0 and (t2.tables < 0).all() and small.num_free == lay.slices - 1
    freed = table.release_sequences(torch.tensor([False, False, True]), fl)
    assert freed == 3 * lay.slices and (table.tables[:, 2] < 0).all() and int(table.lens[:, 2].sum()) == 0
    with pytest.raises(ValueError, match="outgrew"):
        table.grow(torch.full((layers, batch), 100), fl)


# ---------------------------------------------------------------------------- recompute
def _tiny(kind):
    torch.manual_seed(3)
    common = {"vocab_size": 97, "num_hidden_layers": 2, "max_position_embeddings": 256}
    if kind == "opt":
        m = OPTForCausalLM(OPTConfig(hidden_size=64, ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=64,
                                     **common))
    else:
        m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, **common))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


@pytest.mark.parametrize("kind", ["opt", "llama"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_recompute_kv_from_pages(kind, backend, monkeypatch):
    """Activations stored through the table come back as the K/V of the original activations."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    gen = torch.Generator().manual_seed(4)
    model = _tiny(kind)
    params = layer_params(model, 1)
    lay = ActLayout.build(64, torch.float32, 512)
    fl = FreePageList(32)
    table = ActPageTable(2, 2, 64, lay.slices, lay.tokens, "cpu")
    n = torch.tensor([[0, 0], [11, 6]])
    table.grow(table.blocks_needed(n), fl)
    table.lens += n.to(torch.int32)
    pool = _pool(32, 512, gen)
    b = torch.cat([torch.zeros(11, dtype=torch.long), torch.ones(6, dtype=torch.long)])
    slot = torch.cat([torch.arange(11), torch.arange(6)])
    ids, rows = table.locate(1, b, slot)
    act = torch.randn(17, 64, generator=gen)
    pos = torch.cat([torch.arange(11) + 3, torch.arange(6)])
    lay.write(pool, ids, rows, act, pos)
    k, v, got_pos = recompute_kv(pool, lay, ids, rows, params)
    k_ref, v_ref = act_to_kv_ref(act, pos, params)
    assert torch.equal(got_pos, pos.to(torch.int32))
    if backend == "torch":
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    else:
        torch.testing.assert_close(k, k_ref, rtol=5e-6, atol=5e-6 * float(k_ref.abs().max()))
        torch.testing.assert_close(v, v_ref, rtol=5e-6, atol=5e-6 * float(v_ref.abs().max()))
    with pytest.raises(ValueError, match="hidden"):
        recompute_kv(pool, ActLayout.build(32, torch.float32, 512), ids, rows, params)
