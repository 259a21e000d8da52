"""lm-eval integration: LeanKitLM scores through a compressing LeanCache (tiny model fast, SmolLM2 slow)."""

import json
import math

import pytest
import torch

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"), ("Spain", "Madrid"),
            ("Germany", "Berlin")]


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def any_model(request):
    """The tiny random Llama with a byte tokenizer, and (slow) the real SmolLM2."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2")
    from test_eval_tasks import byte_tokenizer

    from leankit.testing import tiny_model

    tok = byte_tokenizer()
    return tiny_model("llama-gqa", seed=3, vocab_size=len(tok), max_position_embeddings=1024), tok


def test_score_matches_full_forward_when_lossless(any_model):
    from leankit.eval import LeanKitLM

    model, tok = any_model
    lm = LeanKitLM(pretrained=model, tokenizer=tok, kv="FP16", chunk=3, batch_size=1)
    ctx = tok("The capital of France is", add_special_tokens=False).input_ids
    cont = tok(" Paris, a city on the Seine.", add_special_tokens=False).input_ids
    got, _ = lm.score(ctx, cont)
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
    want = float(sum(logits[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
    assert got == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("softmax_dtype", [None, "float64"])
def test_scores_take_their_log_softmax_in_the_softmax_dtype_asked_for(softmax_dtype, monkeypatch):
    """The ``softmax_dtype`` model argument (HFLM's) sets the log-softmax's dtype; fp32 without it."""
    from leankit.eval import lm as lm_mod
    from leankit.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model(), tiny_tokenizer()
    lm = lm_mod.LeanKitLM(pretrained=model, tokenizer=tok, kv="K8V4", chunk=4, batch_size=1,
                          softmax_dtype=softmax_dtype)
    dtypes, real = [], torch.nn.functional.log_softmax
    monkeypatch.setattr(lm_mod.F, "log_softmax", lambda x, dim, dtype: dtypes.append(dtype) or real(x, dim, dtype=dtype))
    score, _ = lm.score(torch.randint(4, 97, (11,)).tolist(), torch.randint(4, 97, (6,)).tolist())
    assert math.isfinite(score)
    assert dtypes == [torch.float64 if softmax_dtype else torch.float32] * 2  # 6 tokens in chunks of 4


def test_loglikelihood_truncates_to_max_length_as_hflm_does():
    """A request longer than ``max_length`` keeps its last ``max_length + 1`` tokens, as HFLM does
    (FP16 then gives HFLM's scores); one longer than the model's positions is scored, not refused."""
    from lm_eval.models.huggingface import HFLM

    import leankit
    from leankit.eval import LeanKitLM
    from leankit.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama-gqa", max_position_embeddings=128), tiny_tokenizer()
    gen = torch.Generator().manual_seed(4)
    ctx, cont = torch.randint(4, 97, (60,), generator=gen).tolist(), torch.randint(4, 97, (9,), generator=gen).tolist()
    requests = [(None, ctx, cont), (None, ctx[:20], cont)]
    got = LeanKitLM(pretrained=model, tokenizer=tok, kv="FP16", max_length=32)._loglikelihood_tokens(requests)
    leankit.remove(model)
    want = HFLM(pretrained=model, tokenizer=tok, backend="causal", max_length=32)._loglikelihood_tokens(requests)
    for (a, greedy_a), (b, greedy_b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-3) and greedy_a == greedy_b
    long = torch.randint(4, 97, (300,), generator=gen).tolist()  # past the model's 128 positions
    (score, _), = LeanKitLM(pretrained=model, tokenizer=tok, kv="K8V4")._loglikelihood_tokens([(None, long, cont)])
    assert math.isfinite(score)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["K8V4-K4V2:th=0.25,tl=0,group_size=8,rotate=1", "K8V4:policy=h2o,budget=0.5",
                                "K8V4-K4V2:th=0.3,tl=0.05", "K8V4:act=0.5"])
def test_requests_sharing_a_context_share_its_prefill_with_the_scores_of_their_own(kv, monkeypatch):
    """The choices of a multiple-choice question share their context: it is prefilled once and each
    continuation scored on a copy, with the very scores a fresh prefill per request gives (compressing
    configs, whose prompt-phase compression and later chunks move and score tokens), in request
    order, with lm-eval's cache hook called once per request. Rolling windows, whose context is one
    token, get fresh caches."""
    import copy

    from leankit.cache import LeanCache
    from leankit.eval import LeanKitLM
    from leankit.eval import lm as lm_mod
    from leankit.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
    lm = LeanKitLM(pretrained=model, tokenizer=tok, kv=kv, chunk=4, batch_size=1)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    ctx_a, ctx_b = (torch.randint(4, 97, (n,), generator=gen).tolist() for n in (37, 23))
    conts = [torch.randint(4, 97, (n,), generator=gen).tolist() for n in (1, 9, 5, 13, 2)]
    requests = [(("a", 0), ctx_a, conts[0]), (("b", 0), ctx_b, conts[1]), (("a", 1), ctx_a, conts[2]),
                (None, [1], conts[3]), (("a", 2), ctx_a, conts[4]), (("r", 1), [1], conts[1])]
    want = [lm.score(list(c), list(x)) for _, c, x in requests]
    prefills, copies, hooked = [], [], []
    real_prefill, real_copy = lm._prefill, copy.deepcopy
    monkeypatch.setattr(lm, "_prefill", lambda context: prefills.append(len(context)) or real_prefill(context))
    monkeypatch.setattr(lm_mod.copy, "deepcopy",
                        lambda x, memo=None: (memo is None and isinstance(x, LeanCache) and copies.append(1))
                        or real_copy(x, memo))
    monkeypatch.setattr(lm.cache_hook, "add_partial", lambda kind, key, answer: hooked.append((key, answer)))
    got = lm._loglikelihood_tokens(requests)
    assert got == want
    assert sorted(prefills) == [1, 23, 37]  # one prefill per distinct context
    assert len(copies) == 2  # context a's first two choices; its last takes the prefilled cache itself
    assert hooked == [(key, answer) for (key, _, _), answer in zip(requests, want, strict=True) if key is not None]


def test_local_task_through_cache(smollm2, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from leankit.eval import LeanKitLM

    model, tok = smollm2
    data = tmp_path / "capitals.jsonl"
    data.write_text("\n".join(json.dumps({"country": c, "capital": k, "choices": [k2 for _, k2 in CAPITALS],
                                          "label": i}) for i, (c, k) in enumerate(CAPITALS)))
    (tmp_path / "capitals.yaml").write_text(
        "task: leankit_capitals\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: 'The capital of {{country}} is'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\n"
        "target_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n")
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    accs = {}
    for kv in ("FP16", "K8V4"):
        lm = LeanKitLM(pretrained=model, tokenizer=tok, kv=kv, batch_size=1)
        res = lm_eval.simple_evaluate(model=lm, tasks=["leankit_capitals"], task_manager=tm)
        accs[kv] = res["results"]["leankit_capitals"]["acc,none"]
    assert accs["FP16"] >= 4 / 6  # SmolLM2 knows most of these capitals
    assert accs["K8V4"] >= accs["FP16"] - 1 / 6


def test_a_model_argument_lm_eval_also_passes_wins_over_lm_evals_value(caplog):
    """``--model_args batch_size=2`` next to lm-eval's own ``batch_size`` (its option's value or
    default, passed on every call, from a string or a dict of model arguments): the model argument
    wins, with a warning, where HFLM raises a TypeError for the keyword given twice."""
    from leankit.eval.lm import LeanKitLM
    from leankit.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model(), tiny_tokenizer()
    lm = LeanKitLM.create_from_arg_obj({"pretrained": model, "tokenizer": tok, "kv": "K8V4", "batch_size": 2},
                                       {"batch_size": 1, "max_batch_size": None, "device": None})
    assert lm.batch_size == 2 and "overrides lm-eval's batch_size=1" in caplog.text
    caplog.clear()
    lm = LeanKitLM.create_from_arg_obj({"pretrained": model, "tokenizer": tok, "kv": "K8V4"},
                                       {"batch_size": 3, "device": None})
    assert lm.batch_size == 3 and "overrides" not in caplog.text


def test_without_lm_eval_the_command_says_which_extra_in_one_line(monkeypatch, capsys):
    """No lm-eval installed: `leankit lm-eval` exits 2 with one line naming the `eval` extra,
    not a traceback (as a missing model package is reported)."""
    import sys

    from leankit.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # importing it raises ModuleNotFoundError
    assert main(["lm-eval", "run", "--tasks", "leankit_capitals"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leankit lm-eval: error:") and "leankit-kv[eval]" in err
    assert "Traceback" not in err


def test_batch_size_auto_fits_the_configs_rows_in_free_memory_without_a_forward(monkeypatch):
    """``batch_size=auto`` runs no probing forward: the batch is the share of the memory available
    that rows of ``max_length`` tokens take with the config (its pages, an upper bound of what a
    real row's pages take, plus the prompt's working memory), so a more compressing config gets
    more rows; lm-eval's ``max_batch_size`` caps it, 1 is the floor, and ``generate_until`` runs
    in batches of it. Where the free memory is unknown, HFLM's own probe decides."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from leankit.eval import lm as lm_mod
    from leankit.hf import cache_kwargs
    from leankit.testing import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama-gqa", max_position_embeddings=1024), tiny_tokenizer()
    free = [int(torch.randint(1 << 28, 1 << 30, ()))]
    monkeypatch.setattr(lm_mod, "available_memory_bytes", lambda device: free[0])
    max_length = int(torch.randint(64, 400, ()))
    rows, row_bytes = {}, {}
    for kv in ("FP16", "K8V4", "K4V2"):
        lm = lm_mod.LeanKitLM(pretrained=model, tokenizer=tok, kv=kv, batch_size="auto", max_batch_size=10 ** 6,
                              max_length=max_length)
        row = lm_mod.generate_row_bytes(lm._new_cache(), model, max_length)
        assert row["total"] == row["cache"] + row["work"] > row["cache"] > 0
        # a real row of max_length tokens takes at most the modelled pages
        cache = lm._new_cache()
        with torch.no_grad():
            model(input_ids=torch.randint(4, 97, (1, max_length)), **cache_kwargs(model, cache), use_cache=True)
        assert 0.5 * row["cache"] < cache.memory_report()["total_bytes"] <= row["cache"]
        with monkeypatch.context() as m:
            m.setattr(model, "forward", lambda *a, **k: pytest.fail("batch_size=auto ran a forward"))
            rows[kv] = lm._detect_batch_size()
        assert rows[kv] == int(lm_mod.AUTO_BATCH_SHARE * free[0]) // row["total"]
        row_bytes[kv] = row["cache"]
    assert row_bytes["FP16"] > row_bytes["K8V4"] > row_bytes["K4V2"]
    assert rows["FP16"] < rows["K8V4"] < rows["K4V2"]

    lm = lm_mod.LeanKitLM(pretrained=model, tokenizer=tok, kv="K8V4", batch_size="auto", max_batch_size=3,
                          max_length=max_length)
    assert lm._detect_batch_size() == 3  # lm-eval's cap
    free[0] = 0
    assert lm._detect_batch_size() == 1  # the floor: one row always runs
    lm.max_batch_size = 10 ** 6
    free[0] = math.ceil(2 * lm_mod.generate_row_bytes(lm._new_cache(), model, max_length)["total"]
                        / lm_mod.AUTO_BATCH_SHARE)
    batches = []
    real_generate = lm._model_generate
    monkeypatch.setattr(lm, "_model_generate",
                        lambda context, *a, **k: batches.append(context.shape[0]) or real_generate(context, *a, **k))
    requests = [Instance("generate_until", {}, (" ".join(["w5"] * n), {"until": ["\n"], "max_gen_toks": 3}), i)
                for i, n in enumerate((3, 7, 2, 5, 4))]
    out = lm.generate_until(requests, disable_tqdm=True)
    assert len(out) == 5 and all(isinstance(o, str) for o in out)
    assert sorted(batches) == [1, 2, 2]  # two rows a batch
    free[0] = None
    monkeypatch.setattr(HFLM, "_detect_batch_size", lambda self, requests=None, pos=0: 7)
    assert lm._detect_batch_size() == 7
