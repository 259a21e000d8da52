"""``leankit bench``: exclusive timers, the step breakdown, the budget fit, the README writer, help texts."""

import json

import pytest
import torch

import leankit
from leankit import native
from leankit.allocator import PoolExhausted
from leankit.bench import step, text, throughput
from leankit.bench.readme import markers, replace_block, write_block
from leankit.bench.text import left_padded
from leankit.bench.timing import CATEGORIES, ExclusiveTimer, interleaved_best, lean_targets, patched
from leankit.cache import LeanCache
from leankit.cli import main
from leankit.hf import cache_kwargs
from leankit.testing import tiny_model, tiny_tokenizer

TINY_NEUTRAL = "K8V4-K4V2:th=0.25,tl=0,group_size=8,rotate=1,window=5"


class FakeClock:
    """A clock that advances only when told to."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_exclusive_timer_charges_nested_calls_once():
    clock = FakeClock()
    timer = ExclusiveTimer(clock)

    def inner():
        clock.now += 3.0

    def middle():
        clock.now += 2.0
        timed_inner()
        clock.now += 1.0
        timed_inner()

    timed_inner, timed_middle = timer.wrap(inner, "alloc"), timer.wrap(middle, "policy")
    timer.enter("attention")
    clock.now += 0.5
    timed_middle()
    clock.now += 0.25
    timer.exit()
    totals = timer.take()
    assert totals == {"attention": 0.75, "policy": 3.0, "alloc": 6.0}
    assert sum(totals.values()) == clock.now  # nothing counted twice, nothing lost
    assert timer.take() == {}


def test_exclusive_timer_closes_a_section_that_raises():
    clock = FakeClock()
    timer = ExclusiveTimer(clock)

    def boom():
        clock.now += 1.5
        raise KeyError("x")

    with pytest.raises(KeyError):
        timer.wrap(boom, "store")()
    assert timer.take() == {"store": 1.5}


def test_interleaved_best_rotates_the_order_and_keeps_each_fastest_call():
    clock, order, evictions = FakeClock(), [], []
    costs = {"a": [5.0, 3.0, 4.0], "b": [2.0, 6.0, 1.0], "c": [7.0, 7.0, 7.0]}

    def call(name):
        def fn():
            order.append(name)
            clock.now += costs[name][sum(1 for n in order if n == name) - 1]
        return fn

    best = interleaved_best({n: call(n) for n in costs}, 3, before=lambda: evictions.append(clock.now), clock=clock)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert best == {"a": 3.0, "b": 1.0, "c": 7.0}
    assert len(evictions) == 9  # before every call, outside its timed span


def test_patched_restores_every_method_even_on_error():
    targets = lean_targets()
    before = {(cls, name): cls.__dict__[name] for cls, name, _ in targets}
    assert {c for _, _, c in targets} == set(CATEGORIES) - {"model"}
    with pytest.raises(RuntimeError, match="stop"), patched(ExclusiveTimer(), targets):
        assert LeanCache.__dict__["attend"] is not before[(LeanCache, "attend")]
        raise RuntimeError("stop")
    assert all(cls.__dict__[name] is fn for (cls, name), fn in before.items())


def test_patched_rejects_an_inherited_method():
    from leankit.policy import FullPolicy

    with pytest.raises(ValueError, match="FullPolicy.store"), \
            patched(ExclusiveTimer(), [(FullPolicy, "store", "store")]):
        pass


def test_step_bench_breakdown_is_nonnegative_and_sums_to_the_step():
    model, tok = tiny_model(), tiny_tokenizer()
    attend = LeanCache.__dict__["attend"]
    rows = step.run(model, tok, batch=3, contexts=(23,), kvs=("K8V4", TINY_NEUTRAL), steps=3, warmup=1,
                    progress=False)
    assert LeanCache.__dict__["attend"] is attend  # the timers are gone after the run
    assert [r["kv_arg"] for r in rows] == ["K8V4", TINY_NEUTRAL]
    for r in rows:
        assert r["prefill_ratio"] > 0 and r["decode_ratio"] > 0
        for phase in ("prefill", "decode"):
            parts = r[f"{phase}_breakdown"]
            assert set(parts) == set(CATEGORIES)
            assert all(v >= 0 for v in parts.values()), (phase, parts)
            assert sum(parts.values()) == pytest.approx(1.0, abs=1e-9)
            assert parts["attention"] > 0 and parts["store"] > 0
        if r["kv_arg"] == "K8V4" or native.kernels() is None:  # the prompt's pages are allocated in the prefill
            assert r["prefill_breakdown"]["alloc"] > 0  # (a CPU LeanKV prompt does it inside its compiled store)
    assert rows[1]["decode_breakdown"]["policy"] > 0  # LeanKV classifies tokens leaving the window
    table = step.table(rows)
    assert table.count("\n") == 2 + 2 * len(rows) - 1 and "quantize/store" in table


def _tiny_lm():
    model, tok = tiny_model(), tiny_tokenizer()
    return model, tok


@pytest.mark.parametrize("kv", ["K8V4", TINY_NEUTRAL])
def test_throughput_batch_fits_the_budget_and_one_more_row_does_not(kv):
    model, _ = _tiny_lm()
    prompt, new = torch.arange(5, 5 + 27) % 90 + 4, 7
    kind = throughput.LeanKind(kv)
    budget = 10 * kind.cfg.page_size + 100
    fit = kind.fit(model, budget, prompt, new, 0, True, _NullBar())
    assert fit.batch >= 1
    _assert_batch_is_tight(model, lambda rows: LeanCache(model, kv, num_pages=budget // kind.cfg.page_size),
                           prompt, new, fit.batch)


def _assert_batch_is_tight(model, cache_for, prompt, new: int, batch: int) -> None:
    """``batch`` rows of ``prompt`` generate ``new`` tokens in ``cache_for(batch)``; one row more
    exhausts ``cache_for(batch + 1)``."""
    def generate(rows):
        ids, mask = left_padded([prompt] * rows, 0)
        model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache_for(rows)), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)

    generate(batch)
    with pytest.raises(PoolExhausted):
        generate(batch + 1)


class _NullBar:
    def update(self, n=1):
        pass


def test_throughput_counts_sliding_layers_for_every_cache():
    """A model whose sliding-window layers keep transformers' own cache (Gemma3: sliding, full,
    sliding, window 8): DynamicCache is counted with at most the window in those layers, and a
    LeanCache batch is charged the same bytes for them, its pages getting what is left (before,
    the pages alone were counted: a LeanCache batch ignored two thirds of the K/V it held)."""
    model = tiny_model("gemma3", seed=1)
    prompt, new = torch.arange(5, 5 + 27) % 90 + 4, 7
    tokens = len(prompt) + new
    # 1 KV head x head_dim 16, K and V, fp16: 64 bytes a token per layer
    assert throughput.plain_row_bytes(model, tokens) == 2 * 8 * 64
    assert throughput.fp16_row_bytes(model, tokens) == (tokens + 2 * 8) * 64
    assert throughput.fp16_row_bytes(model, 5) == 3 * 5 * 64  # under the window: every token everywhere
    kind = throughput.LeanKind("K8V4")
    budget = 12 * kind.cfg.page_size + 100
    fit = kind.fit(model, budget, prompt, new, 0, True, _NullBar())
    plain = throughput.plain_row_bytes(model, tokens)
    assert fit.batch >= 1 and fit.bytes_per_row > plain and fit.batch * fit.bytes_per_row <= budget + kind.cfg.page_size

    def cache_for(rows):
        cache = kind.make(model, budget, tokens, rows)
        assert cache.free_list.capacity == (budget - rows * plain) // kind.cfg.page_size
        return cache

    _assert_batch_is_tight(model, cache_for, prompt, new, fit.batch)


def test_dynamic_cache_batch_is_eight_rows_of_the_default_budget():
    model, _ = _tiny_lm()
    budget = throughput.default_budget(model, (11, 30), (2, 9))
    # 2 layers x 2 KV heads x head_dim 16, K and V, fp16
    assert budget == 8 * (30 + 9) * 2 * 2 * 16 * 2 * 2
    fit = throughput.DynamicKind().fit(model, budget, torch.ones(30, dtype=torch.long), 9, 0, False, _NullBar())
    assert fit.batch == 8


def test_dynamic_cache_is_charged_the_tokens_it_holds():
    """DynamicCache's row is the fp16 bytes of what it holds after generate: the prompt and every new
    token but the last, which is never fed back (it was charged one token more)."""
    from transformers import DynamicCache

    model, _ = _tiny_lm()
    prompt, new = torch.arange(5, 5 + 30) % 90 + 4, 9
    fit = throughput.DynamicKind().fit(model, 10 ** 9, prompt, new, 0, False, _NullBar())
    cache = DynamicCache(config=model.config)
    model.generate(input_ids=prompt[None], max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                   **cache_kwargs(model, cache))
    assert cache.get_seq_length() == len(prompt) + new - 1
    assert fit.bytes_per_row == throughput.fp16_row_bytes(model, cache.get_seq_length())


def test_throughput_run_counts_only_requested_tokens():
    model, tok = _tiny_lm()
    res = throughput.run(model, tok, requests=5, prompt_range=(9, 14), output_range=(2, 5), kvs=("K8V4",),
                         quantized=False, progress=False)
    assert [c["name"] for c in res["caches"]] == ["DynamicCache", "LeanCache K8V4"]
    assert res["budget_bytes"] == throughput.default_budget(model, (9, 14), (2, 5))
    for c in res["caches"]:
        assert c["tokens"] == res["requested_tokens"] and c["time_s"] > 0
        assert c["batches"] == -(-5 // c["batch"])
        assert 0 < c["prefill_s"] < c["time_s"]  # every batch generates 2+ tokens after its prefill
    assert res["caches"][0]["tokens_per_s_ratio"] == 1.0
    assert "budget" in throughput.notes(res) and "| LeanCache K8V4 |" in throughput.table(res)
    share = res["caches"][0]["prefill_s"] / res["caches"][0]["time_s"]
    assert f"would reach {1 / share:.2f}x" in throughput.notes(res)


@pytest.mark.parametrize("requests", [0, -3])
def test_throughput_refuses_a_bad_request_count_before_any_model_work(requests, monkeypatch):
    """``--requests 0`` is refused with the other argument checks, before the budget is fitted
    (which ran every cache's calibration generate first)."""
    model, tok = _tiny_lm()
    monkeypatch.setattr(throughput.DynamicKind, "fit", lambda *a, **k: pytest.fail("fitted before the check"))
    with pytest.raises(ValueError, match="--requests must be >= 1"):
        throughput.run(model, tok, requests=requests, prompt_range=(9, 14), output_range=(2, 5), kvs=("K8V4",),
                       quantized=False, progress=False)


def test_throughput_ceiling_runs_dynamic_cache_at_the_largest_lean_batch():
    model, tok = _tiny_lm()
    # small pages and longer prompts, so the LeanCache batch exceeds DynamicCache's (what a ceiling needs)
    res = throughput.run(model, tok, requests=12, prompt_range=(40, 50), output_range=(2, 3),
                         kvs=("K8V4:page_size=256",), quantized=False, progress=False, ceiling=True)
    top, lean = res["ceiling"], res["caches"][1]
    assert lean["batch"] > res["caches"][0]["batch"]
    assert top["batch"] == lean["batch"] and top["tokens"] == res["requested_tokens"]
    assert top["tokens_per_s_ratio"] == top["tokens_per_s"] / res["caches"][0]["tokens_per_s"]
    assert f"at batch {top['batch']}" in throughput.notes(res) and "as one batch" not in throughput.notes(res)
    fewer = {**res, "requests": top["batch"] - 1}  # fewer requests than the ceiling batch: it never ran at it
    assert f"it ran them as one batch of {top['batch'] - 1}" in throughput.notes(fewer)
    assert throughput.run(model, tok, requests=2, prompt_range=(9, 10), output_range=(2, 2), kvs=("K8V4",),
                          quantized=False, progress=False)["ceiling"] is None


def test_throughput_skips_quantized_cache_where_transformers_refuses_the_model(monkeypatch):
    """transformers' QuantizedCache refuses models with sliding-window layers (Gemma3): the run goes on
    without it and says why, instead of failing as a whole."""
    monkeypatch.setattr(throughput, "quantized_backend", lambda: ("quanto", "optimum-quanto (stand-in)"))
    model, tok = tiny_model("gemma3", seed=1), tiny_tokenizer()
    res = throughput.run(model, tok, requests=2, prompt_range=(9, 12), output_range=(2, 3), kvs=("K8V4",),
                         progress=False)
    assert [c["name"] for c in res["caches"]] == ["DynamicCache", "LeanCache K8V4"]
    skipped = [n for n in res["notes"] if n.startswith("HF QuantizedCache skipped")]
    assert len(skipped) == 1 and "full attention" in skipped[0]
    assert "HF QuantizedCache skipped" in throughput.notes(res)


def test_prompts_come_from_a_given_text_and_wrap_around_a_short_one(tmp_path):
    """--text: the requests are cut from the user's own text (tokens of the model's tokenizer),
    and a text shorter than the longest prompt is wrapped around, not refused."""
    model, tok = _tiny_lm()
    words = [f"w{i}" for i in (5, 9, 11, 40, 77)]
    path = tmp_path / "mine.txt"
    path.write_text(" ".join(words) + "\n", encoding="utf-8")
    ids = text.corpus_ids(tok, path)
    assert ids.tolist() == [int(w[1:]) for w in words]
    res = throughput.run(model, tok, requests=3, prompt_range=(9, 14), output_range=(2, 3), kvs=("K8V4",),
                         quantized=False, progress=False, text_path=path)
    assert res["text"] == "the text of mine.txt" and "prompts from the text of mine.txt" in throughput.notes(res)
    reqs = text.request_mix(ids, 3, (9, 14), (2, 3))
    for r in reqs:
        assert set(r.prompt.tolist()) <= set(ids.tolist()) and 9 <= len(r.prompt) <= 14
    default = throughput.run(model, tok, requests=2, prompt_range=(9, 10), output_range=(2, 2), kvs=("K8V4",),
                             quantized=False, progress=False)
    assert "prompts from" not in throughput.notes(default)


@pytest.mark.parametrize("content, words", [(None, "no such file"), (b"  \n\t", "holds no text"),
                                            (b"\xff\xfe\x00bad", "not UTF-8")])
def test_a_text_that_cannot_be_used_is_a_clear_error_before_the_model_loads(tmp_path, monkeypatch, capsys,
                                                                              content, words):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setattr(leankit, "load_model", lambda name: pytest.fail("the model loaded before the text was checked"))
    assert main(["bench", "throughput", "--text", str(path), "--no-progress", "--default-malloc"]) == 2
    err = capsys.readouterr().err
    assert "leankit: error" in err and words in err


def test_throughput_rejects_bad_ranges_before_any_model_work():
    model, tok = _tiny_lm()
    with pytest.raises(ValueError, match="--output-range"):
        throughput.run(model, tok, prompt_range=(9, 14), output_range=(5, 2), progress=False)


def test_sequences_beyond_the_models_positions_are_refused_before_any_model_work():
    model, tok = _tiny_lm()
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        throughput.run(model, tok, requests=2, prompt_range=(limit - 1, limit), output_range=(2, 3), progress=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        step.run(model, tok, batch=1, contexts=(limit - 2,), steps=2, warmup=1, progress=False)


def test_tensor_bytes_counts_the_inner_tensors_of_containers():
    t = torch.zeros(3, 4, dtype=torch.float16)
    assert throughput.tensor_bytes((t, {"s": torch.zeros(5), "shape": (3, 4)}, None)) == 24 + 20


def test_tensor_bytes_can_count_floats_on_the_fp16_basis():
    """QuantizedCache is held to the budget on DynamicCache's fp16 basis: its fp32 scales and residual
    count 2 bytes an element (an fp16 model would hold them so), its integer codes as they are."""
    held = (torch.zeros(3, dtype=torch.uint8), torch.zeros(5), torch.zeros(4, dtype=torch.float16),
            torch.zeros(2, dtype=torch.float64), torch.zeros(6, dtype=torch.int32))
    assert throughput.tensor_bytes(held) == 3 + 20 + 8 + 16 + 24
    assert throughput.tensor_bytes(held, 2) == 3 + 10 + 8 + 4 + 24


def test_readme_writer_replaces_only_the_marked_block(tmp_path):
    start, end = markers("step")
    other = "<!-- leankit-bench:throughput -->\nkeep me\n<!-- /leankit-bench:throughput -->"
    text = f"# t\n\nintro\n{start}\nold table\n{end}\ntail text\n{other}\n"
    out = replace_block(text, "step", "| new |")
    assert out == f"# t\n\nintro\n{start}\n| new |\n{end}\ntail text\n{other}\n"
    assert replace_block(out, "step", "| new |") == out  # idempotent
    path = tmp_path / "README.md"
    path.write_text(text)
    write_block(path, "throughput", "fresh")
    assert path.read_text() == text.replace("keep me", "fresh")
    with pytest.raises(ValueError, match="exactly one"):
        replace_block("no markers here", "step", "x")
    with pytest.raises(ValueError, match="comes before"):
        replace_block(f"{end}\n{start}\n", "step", "x")


@pytest.mark.parametrize("argv, words", [
    (["bench", "--help"], ["step", "throughput", "--write-readme", "allocation", "plot", "--plot PNG"]),
    (["bench", "step", "--help"], ["attention", "quantize/store", "policy", "allocation", "median", "--context",
                                   "timers' cost"]),
    (["bench", "throughput", "--help"], ["--budget-bytes", "decode-heavy", "prefill-heavy", "PoolExhausted",
                                         "QuantizedCache", "tokens/s", "--requests", "--plot"]),
    (["bench", "plot", "--help"], ["--json", "ceiling", "prefill and decode", "--out", "matplotlib"]),
])
def test_bench_help_explains_each_mode(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for w in words:
        assert w in out, w


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(leankit, "load_model", lambda name: _tiny_lm())


def test_bench_step_cli_writes_json_and_readme(tiny, tmp_path, capsys):
    readme = tmp_path / "README.md"
    start, end = markers("step")
    readme.write_text(f"intro\n{start}\n{end}\nend\n")
    js = tmp_path / "new" / "step.json"  # a folder the run creates
    argv = ["bench", "step", "--model", "tiny", "--batch", "2", "--context", "17", "--steps", "2", "--warmup", "1",
            "--kv", "K8V4", "--json", str(js), "--write-readme", "--readme", str(readme), "--no-progress",
            "--default-malloc"]  # the pinned allocator is checked in a process of its own below
    assert main(argv) == 0
    data = json.loads(js.read_text())
    # The command as the README shows it: without the output-only options and their (local) paths.
    assert data["command"] == ["leankit", "bench", "step", "--model", "tiny", "--batch", "2", "--context", "17",
                               "--steps", "2", "--warmup", "1", "--kv", "K8V4", "--default-malloc"]
    assert data["mode"] == "step" and len(data["results"]) == 1
    assert data["allocator"] is None
    row = data["results"][0]
    assert len(row["prefill_faults_dynamic"]) == len(row["prefill_faults_lean"]) == step.PREFILL_RUNS
    assert "Minor page faults of the measured prefills" in readme.read_text()
    text = readme.read_text()
    assert text.startswith(f"intro\n{start}\n") and text.endswith(f"{end}\nend\n")
    assert "| 17 | `K8V4` | decode |" in text and "leankit bench step --model tiny" in text and "torch " in text


def test_bench_step_cli_cuts_its_prompts_from_the_given_text(tiny, tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text(" ".join(f"w{i}" for i in range(4, 60)), encoding="utf-8")
    argv = ["bench", "step", "--model", "tiny", "--batch", "2", "--context", "11", "--steps", "1", "--warmup", "0",
            "--kv", "K8V4", "--text", str(path), "--no-progress", "--default-malloc"]
    assert main(argv) == 0
    assert "prompts from the text of notes.txt." in capsys.readouterr().out


def test_bench_cli_bad_config_is_a_clear_error(tiny, capsys):
    assert main(["bench", "step", "--kv", "K9V4", "--no-progress"]) == 2
    assert "leankit: error" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["step", "throughput", "offload"])
def test_bench_cli_repeated_config_is_a_clear_error(mode, capsys):
    """The same config twice (a preset and its spec count as one) is refused before any model loads,
    not measured twice as two rows of the table."""
    assert main(["bench", mode, "--model", "no-such-model", "--kv", "K8V4", "--kv", "k8v4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "leankit: error: --kv 'k8v4' is the same config as --kv 'K8V4'" in err


def test_quantized_cache_bytes_are_codes_scales_and_residual():
    backend, desc = throughput.quantized_backend()
    if backend != "quanto":
        pytest.skip(desc)
    model, _ = _tiny_lm()
    kind = throughput.QuantizedKind(backend, desc)
    fit = kind.fit(model, 10 ** 6, torch.arange(4, 44), 3, 0, False, _NullBar())
    # 40 prompt tokens quantized at prefill (4-bit codes: half a byte per element, plus a scale and an
    # offset per group of 16 channels), then 2 decode tokens in the residual; 2 layers, K and V, 2
    # heads. The model is fp32; its floating-point tensors count 2 bytes an element, as DynamicCache's.
    quantized = 40 * 2 * 16 // 2 + 40 * 2 * 2 * 2
    residual = 2 * 2 * 16 * 2
    assert fit.bytes_per_row == 2 * 2 * (quantized + residual)
    assert fit.batch == 10 ** 6 // fit.bytes_per_row


@pytest.mark.parametrize("abbrev", ["--js", "--read", "--no-prog"])
def test_bench_options_cannot_be_abbreviated(abbrev, capsys):
    """An abbreviated output option would keep its (local) path in the command a README records,
    which names the output options in full only: the bench parsers refuse abbreviations."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "step", abbrev, "x"])
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_write_readme_without_the_markers_fails_before_measuring(monkeypatch, tmp_path, capsys):
    """A README that lacks the run's block is an error before the model loads, not after the run."""
    readme = tmp_path / "README.md"
    start, end = markers("step")
    readme.write_text(f"intro\n{start}\n{end}\n")  # the step block only
    loaded = []
    monkeypatch.setattr(leankit, "load_model", lambda name: loaded.append(name) or _tiny_lm())
    argv = ["bench", "throughput", "--mix", "prefill-heavy", "--write-readme", "--readme", str(readme),
            "--no-progress", "--default-malloc"]
    assert main(argv) == 2
    assert "leankit-bench:throughput-prefill-heavy" in capsys.readouterr().err and loaded == []


def test_readme_command_leaves_out_output_options():
    from leankit.bench.readme import reproducible_args

    argv = ["step", "--batch", "8", "--json", "out/step.json", "--write-readme", "--readme=R.md", "--no-progress",
            "--threads", "1"]
    assert reproducible_args(argv) == ["step", "--batch", "8", "--threads", "1"]


PIN_PROBE = """
import sys, torch
from leankit.bench.malloc import minor_faults, pin_glibc_malloc
note = pin_glibc_malloc() if sys.argv[1] == "pin" else None
faults = []
for _ in range(10):  # a 64 MiB block, touched and freed, ten times over
    f0 = minor_faults()
    torch.ones(64 << 18).sum()
    faults.append(minor_faults() - f0)
print(",".join(map(str, faults)), note)
"""


@pytest.mark.skipif(not __import__("platform").libc_ver()[0] == "glibc", reason="glibc's malloc only")
def test_pinned_malloc_reuses_a_freed_block_instead_of_faulting_it_in_again():
    """Unpinned, glibc maps a 64 MiB block afresh every time (16k first-touch faults each); pinned,
    the freed block stays in the heap and is reused once the heap has grown to hold it (after at
    most four rounds, measured). Each case runs in a process of its own, as the setting is per process."""
    import subprocess
    import sys

    def probe(mode):
        out = subprocess.run([sys.executable, "-c", PIN_PROBE, mode], capture_output=True, text=True, check=True)
        faults, note = out.stdout.split(" ", 1)
        return [int(f) for f in faults.split(",")], note.strip()

    fresh, none = probe("default")
    reused, note = probe("pin")
    assert none == "None" and note.startswith("Allocator: glibc")
    assert min(fresh[-3:]) > 8000 and max(reused[-3:]) < 1000, (fresh, reused)


def test_rows_whose_sliding_window_layers_fill_the_budget_do_not_run():
    """Gemma3's plain sliding-window layers count against the budget: rows that leave no page for
    the pool do not fit (the verify step asked for batch + 1 rows and got a pool of 0 pages)."""
    model = tiny_model("gemma3", seed=1)
    prompt, new = torch.arange(5, 5 + 20) % 90 + 4, 3
    kind = throughput.LeanKind("K8V4")
    plain = throughput.plain_row_bytes(model, len(prompt) + new)
    budget = 3 * plain + kind.cfg.page_size // 2
    assert kind.pool_pages(model, budget, len(prompt) + new, 4) == 0
    assert kind.runs(model, budget, prompt, new, 0, 4) is False


def test_no_ceiling_run_where_no_leancache_batch_beats_dynamic_cache():
    """FP16 pages of an fp32 model hold fewer rows than DynamicCache: DynamicCache "over the budget"
    at that batch would be under it, so the run says so instead of mislabelling it."""
    model, tok = _tiny_lm()
    res = throughput.run(model, tok, requests=3, prompt_range=(9, 14), output_range=(2, 3), kvs=("FP16",),
                         quantized=False, progress=False, ceiling=True)
    assert res["caches"][1]["batch"] <= res["caches"][0]["batch"]
    assert res["ceiling"] is None and any(n.startswith("no ceiling run") for n in res["notes"])


def test_a_run_with_its_own_ranges_is_labelled_a_custom_mix():
    res = {"mix": "decode-heavy", "prompt_range": [512, 1024], "output_range": [128, 256]}
    assert throughput.mix_label(res) == "decode-heavy mix"
    assert throughput.mix_label({**res, "output_range": [2, 3]}) == "custom mix"
    assert throughput.mix_label({**res, "mix": "prefill-heavy"}) == "custom mix"


class _WideQuantized(throughput.DynamicKind):
    """A stand-in for HF QuantizedCache whose batch is 4x DynamicCache's (more than any LeanCache's here)."""

    name = "QuantizedCache int4 (stand-in)"

    def __init__(self, backend, description):
        pass

    def fit(self, model, budget, longest, new_tokens, pad, verify, bar, requests=None):
        fit = super().fit(model, budget, longest, new_tokens, pad, verify, bar)
        return throughput.Fit(4 * fit.batch, fit.bytes_per_row // 4, "stand-in")


@pytest.mark.parametrize("kv", ["FP16", "K8V4:page_size=256"])
def test_ceiling_runs_at_the_largest_leancache_batch_not_a_quantized_caches(kv, monkeypatch):
    """--ceiling runs DynamicCache over the budget at the largest *LeanCache* batch, as its help says:
    a wider HF QuantizedCache batch (before: max over every cache but DynamicCache) is not it, and
    where no LeanCache batch exceeds DynamicCache's there is no ceiling run at all."""
    monkeypatch.setattr(throughput, "quantized_backend", lambda: ("quanto", "stand-in"))
    monkeypatch.setattr(throughput, "QuantizedKind", _WideQuantized)
    model, tok = _tiny_lm()
    res = throughput.run(model, tok, requests=12, prompt_range=(40, 50), output_range=(2, 3), kvs=(kv,),
                         ceiling=True, progress=False)
    dyn, quant, lean = res["caches"]
    assert quant["name"] == _WideQuantized.name and quant["batch"] > max(dyn["batch"], lean["batch"])
    if lean["batch"] <= dyn["batch"]:
        assert res["ceiling"] is None and any(n.startswith("no ceiling run") for n in res["notes"])
    else:
        assert res["ceiling"]["batch"] == lean["batch"]


def test_bench_step_refuses_a_context_too_short_for_the_batch_before_measuring(monkeypatch, capsys):
    """Every --context is checked against --batch up front: before, a short last context failed only
    after the contexts before it had been measured, and their results were lost."""
    loaded = []
    monkeypatch.setattr(leankit, "load_model", lambda name: loaded.append(name) or _tiny_lm())
    argv = ["bench", "step", "--batch", "2", "--context", "17", "3", "--steps", "1", "--warmup", "0",
            "--kv", "K8V4", "--no-progress", "--default-malloc"]
    assert main(argv) == 2
    assert "--context 3 is too short for --batch 2" in capsys.readouterr().err and loaded == []
    model, tok = _tiny_lm()
    monkeypatch.setattr(step, "measure_context", lambda *a, **k: pytest.fail("measured before the check"))
    with pytest.raises(ValueError, match="--context 3 is too short"):
        step.run(model, tok, 2, (17, 3), ("K8V4",), 1, 0, progress=False)


def test_a_budget_whose_pool_cannot_be_allocated_is_a_clear_error():
    """A LeanCache's fixed pool is the whole budget, allocated up front: a budget beyond the machine's
    memory is a ValueError naming --budget-bytes (what the command line reports), not torch's
    allocator traceback."""
    model, _ = _tiny_lm()
    kind = throughput.LeanKind("K8V4")
    with pytest.raises(ValueError, match="--budget-bytes .* cannot be allocated: it has more pages than int32 page ids"):
        kind.make(model, 1 << 62, 16)
    # within the page ids, past what the machine can hold (2**31 - 1 pages of some KiB each)
    with pytest.raises(ValueError, match="--budget-bytes .* cannot be allocated on this machine"):
        kind.make(model, (2 ** 31 - 1) * kind.cfg.page_size, 16)


def test_a_budget_far_above_the_requests_is_verified_at_the_requests_only(monkeypatch):
    """An estimate of more rows than the run has requests is checked with every request at once,
    never at the estimate (a large budget estimated tens of thousands of rows, and verifying them
    took longer than the run); the batch reported stays the estimate."""
    model, _ = _tiny_lm()
    prompt, new = torch.arange(5, 5 + 9) % 90 + 4, 3
    kind = throughput.LeanKind("K8V4")
    budget = 4000 * kind.cfg.page_size
    tried, runs = [], throughput.LeanKind.runs
    monkeypatch.setattr(throughput.LeanKind, "runs", lambda self, *a: tried.append(a[-1]) or runs(self, *a))
    fit = kind.fit(model, budget, prompt, new, 0, True, _NullBar(), requests=3)
    assert fit.batch > 3 and tried == [3]
    assert fit.how.endswith("verified at 3 rows (every request at once), not beyond")
    tried.clear()
    full = kind.fit(model, 10 * kind.cfg.page_size + 100, prompt, new, 0, True, _NullBar(), requests=10 ** 6)
    assert "verified:" in full.how and max(tried) == full.batch + 1  # below the requests: verified as before


def test_the_kernel_backends_page_grants_count_in_the_calibration_peak(monkeypatch):
    """On the kernel backend (CUDA, or LEANKIT_BACKEND=triton on the CPU) a step's pages are granted on
    the device by a kernel, not through ``FreePageList.allocate``: the calibration saw a peak of 0 pages
    and the fit died on ``budget // 0``. Its peak and batch are the reference backend's."""
    model, _ = _tiny_lm()
    prompt, new = torch.arange(5, 5 + 27) % 90 + 4, 7
    kind = throughput.LeanKind("K8V4")
    budget = 10 * kind.cfg.page_size + 100
    monkeypatch.setenv("LEANKIT_BACKEND", "torch")
    ref = kind.fit(model, budget, prompt, new, 0, False, _NullBar())
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    fit = kind.fit(model, budget, prompt, new, 0, False, _NullBar())
    assert fit.bytes_per_row == ref.bytes_per_row > 0 and fit.batch == ref.batch >= 1
