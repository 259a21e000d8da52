"""eval.perplexity's scoring and its paired comparison against FP16 (tiny model, no downloads)."""

import math

import pytest
import torch

from eval.perplexity import paired_gap, score_document, token_kl
from leankit.testing import tiny_model


def test_paired_gap_interval():
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(4000, generator=gen, dtype=torch.float64) * 5
    d = 0.01 + 0.1 * torch.randn(4000, generator=gen, dtype=torch.float64)
    g = paired_gap(base + d, base)
    assert g["gap"] == pytest.approx(math.expm1(float(d.mean())))
    half = 1.96 * float(d.std()) / math.sqrt(4000)
    assert g["gap_lo"] == pytest.approx(math.expm1(float(d.mean()) - half))
    assert g["gap_hi"] == pytest.approx(math.expm1(float(d.mean()) + half))
    assert g["gap_lo"] < 0.01 < g["gap_hi"]  # the true shift lies inside
    same = paired_gap(base, base)
    assert same["gap"] == same["gap_lo"] == same["gap_hi"] == 0.0


def test_score_document_is_exact_for_a_lossless_cache():
    """FP16 keeps an fp32 model lossless, so chunked scoring through the cache equals one full forward."""
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 97, (1 + 40 + 3 * 8,), generator=torch.Generator().manual_seed(1))
    nll, rep, logprobs = score_document(model, ids, "FP16", {}, context=40, chunk=8, chunks=3)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, 39:-2]
    ref = torch.nn.functional.cross_entropy(logits, ids[40:64], reduction="none")
    assert nll.shape == (24,)
    torch.testing.assert_close(nll, ref.double(), rtol=1e-5, atol=1e-5)
    assert rep["tokens_per_tier"]["high"] > 0

    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-5)

    lossy, _, lossy_logprobs = score_document(model, ids, "K4V2", {}, context=40, chunk=8, chunks=3)
    assert not torch.allclose(lossy, nll)  # the quantized cache really is what gets scored
    kl = token_kl(logprobs, lossy_logprobs)
    # The first scored token comes from the prompt step, which attends to its own tokens exactly;
    # every later one also reads quantized pages of earlier steps.
    assert kl.shape == (24,) and float(kl[0]) == pytest.approx(0.0, abs=1e-9) and bool((kl[1:] > 0).all())
    assert torch.allclose(token_kl(logprobs, logprobs), torch.zeros(24, dtype=torch.float64), atol=1e-12)


def test_token_kl_matches_the_definition():
    gen = torch.Generator().manual_seed(2)
    p = torch.log_softmax(torch.randn(5, 11, generator=gen), -1)
    q = torch.log_softmax(torch.randn(5, 11, generator=gen), -1)
    ref = torch.stack([torch.nn.functional.kl_div(q[i].double(), p[i].double(), log_target=True, reduction="sum")
                       for i in range(5)])
    torch.testing.assert_close(token_kl(p, q), ref)
    assert bool((token_kl(p, q) > 0).all())


@pytest.mark.parametrize("argv,what", [(["--chunks", "0"], "--chunks"), (["--chunk", "0"], "--chunk"),
                                       (["--context", "0"], "--context"), (["--docs", "0"], "--docs"),
                                       (["--skip", "-1"], "--skip"), (["--config", "K8V3"], "grammar")])
def test_bad_arguments_are_usage_errors(argv, what, capsys):
    """Bad numbers and a malformed config stop at the argument check, with a usage message and no
    model loaded (``--docs 0`` had silently scored every article)."""
    from eval import perplexity

    with pytest.raises(SystemExit) as exit_info:
        perplexity.main(["--config", "FP16", *argv])
    assert exit_info.value.code == 2 and what in capsys.readouterr().err


def test_act_configs_count_their_act_pages(monkeypatch):
    """kv/fp16 counts every page in use, ACT blocks included, and an ACT-only config (no KV token in
    any tier) reports instead of dividing by zero."""
    from eval import perplexity

    model = tiny_model("llama-mha", hidden_size=64)
    ids = torch.randint(3, 97, (1 + 40 + 2 * 8,), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(perplexity, "start_run", lambda args: (model, None))
    monkeypatch.setattr(perplexity, "documents", lambda tok, n, need, skip=0: [ids[:need]])
    out = perplexity.main(["--config", "FP16", "--config", "FP16:act=1", "--docs", "1", "--context", "40",
                           "--chunk", "8", "--chunks", "2"])
    rows = {r["config"]: r for r in out["results"]}
    fp16, act = rows["FP16"], rows["FP16:act=1.0"]
    assert act["ppl"] == pytest.approx(fp16["ppl"], rel=1e-6)  # lossless either way
    _, rep, _ = score_document(model, ids, "FP16", {"act": 1}, context=40, chunk=8, chunks=2)
    assert rep["act_bytes"] > 0
    assert act["kv_ratio"] == pytest.approx(rep["act_bytes"] / rep["fp16_bytes"])
    assert act["tier_fraction"] == {"high": 0.0, "low": 0.0, "pruned": 0.0}
