"""Live-page decode attention (``leankit.decode_attention``) against the padded-tile reference.

The padded-tile walk of :func:`leankit.attention.paged_attention_ref` (forced with
``chunk_pages``) is the reference: it dequantizes every tile explicitly (Eq. 2). The live-page
path must give the same output, log-sum-exp and per-tier logits on hand-filled caches with
per-head tier mixes (ragged page counts), pruning, shuffled slots, scattered page ids and a
poisoned pool, for several bit widths, group sizes, GQA ratios and query counts.
"""

import pytest
import torch
from leankit_kernels import testing

from leankit import decode_attention
from leankit.attention import Workspace, paged_attention_ref

# spec, kv heads, GQA ratio, contexts, queries, group size, prune fraction, pool fill
CASES = [
    ("K8V4-K4V2", 3, 3, [65, 7], 1, 32, 0.1, 0xFF),
    ("K8V4-K4V2", 1, 7, [257], 1, None, 0.0, None),
    ("K4V2-K2V1", 5, 1, [63, 1, 20], 1, 16, 0.0, 0xFF),
    ("K8V4", 3, 3, [130, 1], 2, 16, 0.2, 0xFF),
    ("K4V2", 2, 5, [63], 3, 8, 0.0, None),
    ("K8V8-K2V2", 3, 2, [41, 77], 1, 32, 0.05, 0xFF),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}g{c[2]}-ctx{'_'.join(map(str, c[3]))}-q{c[4]}")
def test_live_pages_match_padded_tiles(case):
    spec, hkv, g, ctx, nq, gs, prune, fill = case
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, spec, ctx, hkv, g, nq, prune_frac=prune, group_size=gs, fill=fill,
                                          low_frac=0.6)
    assert decode_attention.supports(fc.kv.layouts, g * nq)
    fc.kv.workspace = Workspace()
    if len(ctx) > 1:
        q_pos[1] -= 3  # some stored keys lie after this row's queries
    ref_out, ref_lse, ref_logits = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=5, return_logits=True)
    for _ in range(2):  # the second call reuses the workspace buffers
        out, lse, logits = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125, return_logits=True)
        testing.assert_close_normwise(out, ref_out, torch.float32, f"out (seed {seed})")
        testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")
        testing.assert_all_close_normwise(logits, ref_logits, torch.float32, f"logits (seed {seed})")


def test_query_that_sees_nothing_and_empty_tier():
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [40, 9], 3, 2, 1, low_frac=0.0)
    assert int(fc.kv.table.n_pages[1].sum()) == 0  # nothing in the low tier
    q_pos[1] = -1  # before every stored key
    out, lse, logits = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125, return_logits=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    assert logits[1].shape[-1] == 0
    ref_out, ref_lse = paged_attention_ref(q, fc.kv, q_pos, 0.125, chunk_pages=3)
    testing.assert_close_normwise(out, ref_out, torch.float32, f"out (seed {seed})")
    testing.assert_close_normwise(lse, ref_lse, torch.float32, f"lse (seed {seed})")


def test_chunks_of_pages_do_not_change_the_result(monkeypatch):
    gen, seed = testing.fresh_generator()
    fc, q, q_pos = testing.attention_case(gen, "K8V4-K4V2", [300, 111], 2, 3, 1, group_size=32)
    whole = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125)
    monkeypatch.setattr(decode_attention, "CHUNK_TOKENS", 40)  # a few pages per chunk
    chunked = decode_attention.live_page_attention(q, fc.kv, q_pos, 0.125)
    for a, b, what in zip(chunked, whole, ("out", "lse")):
        testing.assert_close_normwise(a, b, torch.float32, f"{what} (seed {seed})")


@pytest.mark.parametrize("spec,gs,rows,expected", [("K8V4-K4V2", None, 3, True), ("K8V4", 32, 64, True),
                                                    ("K8V4", 32, 65, False), ("K8V4", None, 1, False),
                                                    ("FP16", None, 1, False), ("K16V4-K4V1", None, 1, False)])
def test_supports(spec, gs, rows, expected):
    from leankit.config import KVConfig
    from leankit.pages import PageLayout

    cfg = KVConfig.parse(spec, group_size=gs)
    layouts = [PageLayout.build(cfg, t, 64, torch.float32) for t in range(len(cfg.tiers))]
    assert decode_attention.supports(layouts, rows) is expected
    if len(layouts) == 2 and layouts[0].groups == 1:  # an empty low tier leaves one one-group tier
        assert decode_attention.supports(layouts, rows, occupied=[True, False]) is False
