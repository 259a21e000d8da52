"""eval.quant_error on a tiny random model (no downloads)."""

import pytest
import torch

from eval.quant_error import layer_states, relative_mse
from leankit.testing import tiny_model


def test_relative_mse_orders_bit_widths():
    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 97, (57,), generator=torch.Generator().manual_seed(4))
    states = layer_states(model, ids)
    assert len(states) == 2 and states[0][0].shape == (2, 57, 16)
    for rotate in (False, True):
        for side in ("K", "V"):
            e8, e4, e2 = (relative_mse(states, side, b, None, rotate) for b in (8, 4, 2))
            assert 0 < e8 < e4 < e2 < 1, (side, rotate, e8, e4, e2)
            # groups of 8 have narrower ranges than whole heads, so a smaller error
            assert relative_mse(states, side, 2, 8, rotate) < e2


@pytest.mark.parametrize("argv,what", [(["--tokens", "0"], "--tokens"), (["--tokens", "-5"], "--tokens"),
                                       (["--article", "3"], "--article"), (["--article", "-1"], "--article")])
def test_bad_arguments_are_refused_before_the_model_loads(argv, what, monkeypatch, capsys):
    """``--tokens 0`` or ``-5`` had wrapped around the slice and measured most of the article, and
    an article past the end raised an IndexError after the model had loaded."""
    from eval import quant_error

    def no_model(args):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr(quant_error, "start_run", no_model)
    monkeypatch.setattr(quant_error, "wiki_articles", lambda: (("a", "x"), ("b", "y"), ("c", "z")))
    with pytest.raises(SystemExit) as exit_info:
        quant_error.main(argv)
    assert exit_info.value.code == 2 and what in capsys.readouterr().err
