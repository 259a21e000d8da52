"""``leankit`` command line: --version, decoding flags, streaming, progress and bad input."""

import pytest

import leankit
from leankit.cli import build_parser, main, sampling_kwargs
from leankit.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def tiny(monkeypatch):
    """Serve ``--model tiny`` from a random-init Llama and a tokenizer built in code."""
    loaded = []

    def load(name):
        assert name == "tiny"
        model, tok = tiny_model("llama-gqa"), tiny_tokenizer()
        model.generation_config.pad_token_id = tok.pad_token_id
        loaded.append(model)
        return model, tok

    monkeypatch.setattr(leankit, "load_model", load)
    return loaded


def _gen(*extra):
    return main(["generate", "--model", "tiny", "--max-new-tokens", "5", "--no-progress", *extra])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"leankit {leankit.__version__}") and "transformers" in out


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_is_a_clear_error_before_loading(tiny, capsys, prompt):
    assert _gen("--prompt", prompt) == 2
    err = capsys.readouterr().err
    assert "--prompt is empty" in err and "Traceback" not in err
    assert not tiny  # rejected before any model is loaded
    assert _gen("--prompt", "w5", "--prompt", "") == 2
    assert "--prompt #2 is empty" in capsys.readouterr().err


@pytest.mark.parametrize("flags,msg", [(["--temperature", "0"], "--temperature"), (["--top-p", "1.5"], "--top-p"),
                                       (["--top-p", "0"], "--top-p"), (["--max-new-tokens", "0"], "--max-new-tokens"),
                                       (["--stream", "--prompt", "w5", "--prompt", "w6"], "single --prompt")])
def test_bad_decoding_flags(tiny, capsys, flags, msg):
    assert main(["generate", "--model", "tiny", *flags]) == 2
    assert msg in capsys.readouterr().err
    assert not tiny


def test_sampling_flags_select_sampling():
    p = build_parser()
    assert sampling_kwargs(p.parse_args(["generate"])) == {"do_sample": False}
    assert sampling_kwargs(p.parse_args(["generate", "--temperature", "1.3"])) == \
        {"do_sample": True, "temperature": 1.3, "top_p": 0.95}
    assert sampling_kwargs(p.parse_args(["generate", "--top-p", "0.5"])) == \
        {"do_sample": True, "temperature": 0.7, "top_p": 0.5}
    assert sampling_kwargs(p.parse_args(["generate", "--sample"]))["do_sample"] is True


def test_generate_greedy_batch_prints_each_row_and_memory(tiny, capsys):
    assert _gen("--prompt", "w5 w6 w7", "--prompt", "w9") == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out.count("---") == 2 and out[-1].startswith("[leankit] KV K8V4")
    assert all(w.startswith("w") or w == "<unk>" for w in out[0].split())


def test_generate_past_the_models_positions_warns(tiny, capsys):
    args = ["generate", "--model", "tiny", "--no-progress", "--prompt", "w5 w6 w7"]  # 4 tokens with BOS
    assert main([*args, "--max-new-tokens", "509"]) == 0  # feeds positions 0..511: all within the 512
    assert "warning" not in capsys.readouterr().err
    assert main([*args, "--max-new-tokens", "510"]) == 0
    err = capsys.readouterr().err
    assert "feed the model 513 positions, beyond the 512 this model takes (max_position_embeddings)" in err


def test_generate_sampling_is_seeded(tiny, capsys):
    outs = []
    for _ in range(2):
        assert _gen("--prompt", "w5 w6", "--temperature", "1.5", "--seed", "3") == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_stream_prints_the_text_once(tiny, capsys):
    assert _gen("--prompt", "w5 w6 w7", "--stream") == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and out[1].startswith("[leankit]")  # the streamed text, then the memory line
    assert len(out[0].split()) == 5


def test_progress_bar_counts_decoding_steps(tiny, capsys, monkeypatch):
    from leankit import cli

    seen = []
    real = cli.make_streamer

    def spy(tok, args, total):
        s = real(tok, args, total)
        seen.append(s)
        return s

    monkeypatch.setattr(cli, "make_streamer", spy)
    assert main(["generate", "--model", "tiny", "--max-new-tokens", "6", "--prompt", "w5"]) == 0
    assert seen[0].bar.total == 6 and seen[0].steps == 6


@pytest.mark.parametrize("quiet", [True, False])
def test_no_progress_also_silences_the_weight_loading_bar(monkeypatch, quiet):
    """transformers' "Loading weights" bar is off while the model loads under --no-progress, and
    back on afterwards (main may run in a process that wants it)."""
    from transformers.utils import logging as hf_logging

    seen = []

    def load(name):
        seen.append(hf_logging.is_progress_bar_enabled())
        return tiny_model("llama-gqa"), tiny_tokenizer()

    monkeypatch.setattr(leankit, "load_model", load)
    assert hf_logging.is_progress_bar_enabled()
    flags = ["--no-progress"] if quiet else []
    assert main(["generate", "--model", "tiny", "--max-new-tokens", "2", "--prompt", "w5", *flags]) == 0
    assert seen == [not quiet] and hf_logging.is_progress_bar_enabled()


def test_an_infinite_temperature_is_refused(tiny, capsys):
    """An infinite temperature samples uniformly: not a decoding anyone asks for."""
    assert main(["generate", "--model", "tiny", "--temperature", "inf"]) == 2
    assert "--temperature must be a finite number > 0" in capsys.readouterr().err and not tiny


def test_chat_on_a_model_without_a_chat_template_says_to_drop_it(tiny, capsys):
    assert tiny_tokenizer().chat_template is None
    assert main(["generate", "--model", "tiny", "--chat", "--max-new-tokens", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "drop --chat" in err and "Traceback" not in err


def test_a_checkpoint_folder_without_weights_is_a_clear_error(tmp_path, capsys):
    """A folder with a config and a tokenizer but no weight file: a one-line error, no traceback."""
    tiny_model().config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "leankit: error: cannot load the checkpoint in" in err and "Traceback" not in err


def test_a_low_tier_with_policy_full_is_refused_before_loading(tiny, capsys):
    assert main(["generate", "--model", "tiny", "--kv", "K8V4-K4V2:policy=full", "--no-progress"]) == 2
    assert "single precision tier" in capsys.readouterr().err and not tiny


def test_a_checkpoint_whose_config_transformers_refuses_is_a_clear_error(tmp_path, capsys):
    """A config.json field of the wrong type: huggingface_hub's validation error is no ValueError and
    escaped as a traceback; now one line, exit 2."""
    import json

    tiny_model().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = str(cfg["hidden_size"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot load the checkpoint in" in err and "config.json is invalid" in err and "Traceback" not in err


def test_memory_line_on_a_model_with_no_compressed_layer_prints_no_nan(monkeypatch, capsys):
    """A model whose every layer slides (Mistral with a window) pages nothing: its peak ratio is 0 / 0,
    and the memory line said 'nanx an fp16 cache'; it names the sliding-window layers' bytes instead."""
    def load(name):
        model, tok = tiny_model("mistral-sliding"), tiny_tokenizer()
        model.generation_config.pad_token_id = tok.pad_token_id
        return model, tok

    monkeypatch.setattr(leankit, "load_model", load)
    with pytest.warns(UserWarning, match="compresses nothing"):
        assert _gen("--prompt", "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[leankit] KV K8V4: no layer compressed") and "nan" not in line
    assert "2 are sliding-window layers" in line and "KiB" in line


def test_memory_line_leaves_out_a_nan_ratio():
    from leankit.cli import memory_line

    rep = {"config": "K8V4", "compressed_layers": 2, "model_layers": 2, "plain_bytes": 0, "peak_kv_bytes": 0,
           "page_size": 2048, "peak_ratio": float("nan"), "pages_used": 0}
    line = memory_line(rep)
    assert "nan" not in line and line.endswith("now 0 pages in use")
    assert "0.500x an fp16 cache" in memory_line({**rep, "peak_ratio": 0.5})
