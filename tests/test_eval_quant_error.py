"""eval.quant_error on a tiny random model (no downloads)."""

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
