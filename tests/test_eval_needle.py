"""eval.needle's argument checks and its static baseline (no model, no downloads)."""

import pytest

from eval import needle
from leankit.config import KVConfig


def no_model(args):
    raise AssertionError("the model was loaded before the arguments were refused")


@pytest.mark.parametrize("argv,what", [(["--dynamic", "K9V4"], "K9V4"), (["--context", "0"], "--context"),
                                       (["--depths", "-0.3"], "--depths"), (["--depths", "0.5", "1.7"], "--depths"),
                                       (["--offset", "-1"], "--offset"), (["--threads", "-1"], "--threads")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, what, monkeypatch, capsys):
    """A bad config used to surface only after the model had loaded, and an empty haystack or a
    depth outside [0, 1] (-0.3 put the needle 70% in) ran as if they meant something."""
    monkeypatch.setattr(needle, "start_run", no_model)
    with pytest.raises(SystemExit) as exit_info:
        needle.main(["--dynamic", "K8V4:policy=leankv,tl=0.2", *argv])
    assert exit_info.value.code == 2 and what in capsys.readouterr().err


@pytest.mark.parametrize("dynamic", ["neutral", "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1",
                                     "FP16-K8V4:th=0.3", "K8V4:policy=leankv,tl=0.2,page_size=4096"])
@pytest.mark.parametrize("static", ["h2o", "streaming"])
def test_static_baseline_stores_tokens_like_the_high_tier(dynamic, static):
    """The static run's pages hold tokens exactly as the dynamic run's high tier does, whether the
    settings come from a preset, the spec or overrides (a preset lost group_size and rotate)."""
    cfg = KVConfig.parse(dynamic)
    spec, kw = needle.static_config(cfg, static, 0.4, 500)
    got = KVConfig.parse(spec, **kw)
    assert got.low is None and got.policy == static and got.high == cfg.high
    for key in ("page_size", "group_size", "rotate"):
        assert getattr(got, key) == getattr(cfg, key), key
    assert got.tokens_per_page(64) == cfg.tokens_per_page(64)
    if static == "h2o":
        assert got.budget == 0.4
    else:
        assert got.sink + got.window == 200
