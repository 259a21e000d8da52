"""eval.perplexity's scoring and its paired comparison against FP16 (tiny model, no downloads)."""

import math

import pytest
import torch

from eval.perplexity import paired_gap, score_document, token_kl
from leankit.testing import tiny_model

# Three "articles" of 30, 60 and 90 words for the word-per-token tokenizer below.
FAKE_ARTICLES = tuple((f"article {n}", " ".join(["word"] * n)) for n in (30, 60, 90))


class WordTokenizer:
    """One token per word, BOS 1: enough for ``documents`` without a real tokenizer."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [5] * len(text.split())}


def no_model(args):
    raise AssertionError("the model was loaded before the arguments were refused")


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
    # The first scored token comes from the prompt step, which attends to its own tokens exactly (a
    # lossy config's prompt runs the one-pass span attention, equal to SDPA's to fp32 rounding: a KL
    # of about 1e-8); every later one also reads quantized pages of earlier steps.
    assert kl.shape == (24,) and float(kl[0]) == pytest.approx(0.0, abs=1e-7) and bool((kl[1:] > 1e-6).all())
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
                                       (["--skip", "-1"], "--skip"), (["--config", "K8V3"], "grammar"),
                                       (["--threads", "-1"], "--threads"), (["--docs", "3", "--skip", "1"], "--docs")])
def test_bad_arguments_are_usage_errors(argv, what, capsys, monkeypatch):
    """Bad numbers, a malformed config and more documents than there are articles stop at the
    argument check, with a usage message and no model loaded (``--docs 0`` had silently scored
    every article; ``--threads -1`` and ``--docs 200`` ended in tracebacks)."""
    from eval import perplexity

    monkeypatch.setattr(perplexity, "start_run", no_model)
    monkeypatch.setattr(perplexity, "wiki_articles", lambda: FAKE_ARTICLES)
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
    monkeypatch.setattr(perplexity, "wiki_articles", lambda: FAKE_ARTICLES)
    monkeypatch.setattr(perplexity, "documents", lambda tok, n, need, skip=0: [ids[:need]])
    out = perplexity.main(["--config", "FP16:act=1", "--config", "FP16", "--docs", "1", "--context", "40",
                           "--chunk", "8", "--chunks", "2"])
    rows = {r["config"]: r for r in out["results"]}
    fp16, act = rows["FP16"], rows["FP16:act=1.0"]
    assert out["baseline"] == "FP16" and act["kl_vs_fp16"] == pytest.approx(0.0, abs=1e-6)  # the KV-only one
    assert act["ppl"] == pytest.approx(fp16["ppl"], rel=1e-6)  # lossless either way
    _, rep, _ = score_document(model, ids, "FP16", {"act": 1}, context=40, chunk=8, chunks=2)
    assert rep["act_bytes"] > 0
    assert act["kv_ratio"] == pytest.approx(rep["act_bytes"] / rep["fp16_bytes"])
    assert act["tier_fraction"] == {"high": 0.0, "low": 0.0, "pruned": 0.0}


def test_out_under_a_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """An ``--out`` that cannot be written had failed only after the first config was measured."""
    from eval import perplexity

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(perplexity, "start_run", no_model)
    monkeypatch.setattr(perplexity, "wiki_articles", lambda: FAKE_ARTICLES)
    for out in (tmp_path / "file" / "sub" / "ppl.json", tmp_path):
        with pytest.raises(SystemExit) as exit_info:
            perplexity.main(["--config", "FP16", "--docs", "1", "--out", str(out)])
        assert exit_info.value.code == 2 and "--out" in capsys.readouterr().err


def test_too_short_articles_are_a_usage_error(monkeypatch, capsys):
    """A context longer than the articles names the flags to change instead of raising."""
    from eval import perplexity

    monkeypatch.setattr(perplexity, "start_run", lambda args: (None, WordTokenizer()))
    monkeypatch.setattr(perplexity, "wiki_articles", lambda: FAKE_ARTICLES)
    assert len(perplexity.documents(WordTokenizer(), 2, 61)) == 2  # articles of 60 and 90 words, BOS first
    with pytest.raises(SystemExit) as exit_info:
        perplexity.main(["--config", "FP16", "--docs", "2", "--context", "80", "--chunk", "4", "--chunks", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--context" in err and "the longest has 91" in err


@pytest.mark.parametrize("base", ["fp16", "lossless", "K16V16"])
def test_lossless_baseline_is_found_by_its_config(base, monkeypatch):
    """Any spelling of the lossless config (lowercase, the preset, explicit bits) is the baseline:
    it runs first and every other config gets its KL and paired gap (only "FP16" had)."""
    from eval import perplexity

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 97, (1 + 24 + 2 * 4,), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(perplexity, "start_run", lambda args: (model, None))
    monkeypatch.setattr(perplexity, "wiki_articles", lambda: FAKE_ARTICLES)
    monkeypatch.setattr(perplexity, "documents", lambda tok, n, need, skip=0: [ids[:need]])
    out = perplexity.main(["--config", "K4V2", "--config", base, "--docs", "1", "--context", "24",
                           "--chunk", "4", "--chunks", "2"])
    first, lossy = out["results"]
    assert first["config"] == base == out["baseline"] and "kl_vs_fp16" not in first
    assert first["ppl_vs_fp16"] == 0.0
    assert lossy["config"] == "K4V2" and lossy["kl_vs_fp16"] > 0 and "ppl_vs_fp16_ci95" in lossy


class NumberTokenizer:
    """Each whitespace-separated number is its own token id (BOS 1), called as transformers is."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": [int(w) for w in text.split()]})


def test_text_windows_are_consecutive_and_counted_by_skip(tmp_path):
    """--text cuts the file's tokens in order into non-overlapping windows of context + chunks x chunk
    tokens (BOS first); --skip and --docs count windows and the short tail is left out."""
    from eval.perplexity import TooShortText, text_documents

    path = tmp_path / "own.txt"
    path.write_text(" ".join(str(i) for i in range(10, 10 + 23)) + "\n", encoding="utf-8")  # 23 tokens
    docs, n = text_documents(NumberTokenizer(), path, n_docs=4, length=6)  # windows of 5 + BOS
    assert n == 23 and [d.tolist() for d in docs] == [[1, *range(10 + 5 * w, 15 + 5 * w)] for w in range(4)]
    assert all(d.dtype == torch.long for d in docs)
    docs, _ = text_documents(NumberTokenizer(), path, n_docs=2, length=6, skip=2)
    assert [d.tolist() for d in docs] == [[1, 20, 21, 22, 23, 24], [1, 25, 26, 27, 28, 29]]
    with pytest.raises(TooShortText, match=r"has 23 tokens, 4 window\(s\) of 5 .*2 skipped \+ 3 scored"):
        text_documents(NumberTokenizer(), path, n_docs=3, length=6, skip=2)
    with pytest.raises(TooShortText, match="has 23 tokens, too few for one window: a window needs 24 tokens"):
        text_documents(NumberTokenizer(), path, n_docs=1, length=25)
    assert len(text_documents(NumberTokenizer(), path, n_docs=1, length=24)[0][0]) == 24


def test_text_file_is_scored_and_named(tmp_path, monkeypatch, capsys):
    """main() with --text scores the file's windows (not Wikipedia: wiki_articles is never read),
    prints where the text came from and names it in the JSON."""
    import json

    from eval import perplexity

    model = tiny_model("llama-gqa")
    path = tmp_path / "own.txt"
    gen = torch.Generator().manual_seed(7)
    path.write_text(" ".join(str(int(i)) for i in torch.randint(3, 97, (3 * 31 + 4,), generator=gen)), encoding="utf-8")
    monkeypatch.setattr(perplexity, "start_run", lambda args: (model, NumberTokenizer()))
    monkeypatch.setattr(perplexity, "wiki_articles", no_model)
    out = perplexity.main(["--text", str(path), "--config", "FP16", "--config", "K4V2", "--docs", "2", "--skip", "1",
                           "--context", "24", "--chunk", "4", "--chunks", "2", "--out", str(tmp_path / "p.json")])
    printed = capsys.readouterr().out
    assert "text: the text of own.txt (97 tokens; windows 1 to 2 of 32 tokens, BOS first)" in printed
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["text_source"] == out["text_source"] == "the text of own.txt" and saved["args"]["text"] == str(path)
    assert out["results"][0]["tokens"] == 2 * 8 and out["results"][1]["kl_vs_fp16"] > 0
    docs, _ = perplexity.text_documents(NumberTokenizer(), path, 2, 32, skip=1)
    nll = [perplexity.score_document(model, d, "FP16", {}, 24, 4, 2)[0] for d in docs]
    assert out["results"][0]["doc_nll"] == pytest.approx([float(x.mean()) for x in nll])


@pytest.mark.parametrize("content,docs,expect", [
    (b"\xff\xfe caf\xe9", "1", "is not UTF-8"),
    (b"  \n", "1", "holds no text"),
    (None, "1", "no such file"),
    (" ".join(["5"] * 40).encode(), "1", "has 40 tokens, too few for one window: a window needs 55 tokens"),
    (" ".join(["5"] * 120).encode(), "3", "has 120 tokens, 2 window(s) of 55"),
], ids=["not-utf8", "blank", "missing", "under-one-window", "too-few-windows"])
def test_bad_text_files_are_usage_errors(tmp_path, monkeypatch, capsys, content, docs, expect):
    """A missing, empty or non-UTF-8 --text stops before the model loads; one too short for a window
    (or for --skip + --docs windows) says how many tokens it has and how many a window needs."""
    from eval import perplexity

    path = tmp_path / "own.txt"
    if content is not None:
        path.write_bytes(content)
    loads = "too few" in expect or "window(s)" in expect
    monkeypatch.setattr(perplexity, "start_run", (lambda args: (None, NumberTokenizer())) if loads else no_model)
    monkeypatch.setattr(perplexity, "wiki_articles", no_model)
    with pytest.raises(SystemExit) as exit_info:
        perplexity.main(["--text", str(path), "--config", "FP16", "--docs", docs, "--context", "48", "--chunk", "4",
                         "--chunks", "2"])
    assert exit_info.value.code == 2 and expect in capsys.readouterr().err
