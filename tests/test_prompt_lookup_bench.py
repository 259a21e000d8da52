"""bench/prompt_lookup.py on a tiny model: every cache runs plain and with prompt lookup, FP16's
tokens equal DynamicCache's in both modes, and a text too short for the passage is refused
(nothing here checks a time)."""

import pytest
import torch

from leankit.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("prompt_lookup")


def test_measure_runs_every_cache_both_ways_and_fp16_is_exact(bench):
    model = tiny_model("llama-gqa")
    g = torch.Generator().manual_seed(2)
    base = torch.randint(3, 90, (1, 8), generator=g)
    ids = torch.cat([base, base, base[:, :3]], 1)
    rows = bench.measure(model, ids, ["FP16", "K8V4"], new=12, draft=3, repeats=1, pad_token_id=0)
    assert [(r["cache"], r["prompt_lookup"]) for r in rows] == [
        ("DynamicCache", 0), ("DynamicCache", 3), ("FP16", 0), ("FP16", 3), ("K8V4", 0), ("K8V4", 3)]
    by = {(r["cache"], r["prompt_lookup"]): r for r in rows}
    assert by[("DynamicCache", 3)]["tokens_equal_dynamic"] and by[("FP16", 0)]["tokens_equal_dynamic"]
    assert by[("FP16", 3)]["tokens_equal_dynamic"]
    assert by[("DynamicCache", 0)]["steps"] == 12  # one forward per new token, the prefill included
    assert all(r["ratio"] > 0 and len(r["times_s"]) == 1 for r in rows)


def test_a_text_shorter_than_the_passage_is_refused(bench):
    tok = tiny_tokenizer()
    ids = torch.arange(3, 40)
    with pytest.raises(ValueError, match="fewer than offset 30 \\+ context 20"):
        bench.copy_prompt(tok, ids, context=20, offset=30)
    assert bench.copy_prompt(tok, ids, context=20, offset=5).shape[0] == 1
