"""LeanKV's one-launch prompt classification (``leankit_kernels.prompt_plan``) against its torch
reference, the prompt-phase rule of ``leankit.policy.plan_unified`` (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels.prompt_plan import KEEP_HIGH, KEEP_LOW, PRUNED, prompt_classes, prompt_classes_ref
from leankit_kernels.testing import assert_same_prompt_classes, fresh_generator, prompt_rule_inputs

from leankit.policy import significance_cutoffs


@pytest.mark.parametrize("batch,heads,nq,block", [(1, 1, 1, None), (3, 2, 37, None), (2, 3, 301, 64),
                                                  (1, 5, 1000, 256)])
@pytest.mark.parametrize("th,tl", [(0.25, 0.0), (0.4, 0.1), (0.3, 0.3), (0.95, 0.6), (0.0, 0.0), (1.5, 1.2)])
@pytest.mark.parametrize("ties,pruned", [(False, False), (True, True)])
def test_prompt_classes_match_reference(batch, heads, nq, block, th, tl, ties, pruned):
    """Every output equals the torch rule's, over tiles of any count (``block`` below the prompt
    length), thresholds no token reaches, heads with mass already pruned and tied scores."""
    gen, seed = fresh_generator()
    received, pos, real, q_last, pm, lens = prompt_rule_inputs(batch, heads, nq, gen, ties, pruned)
    window = int(torch.randint(0, 6, (1,), generator=gen))
    got = prompt_classes(received, pos, real, q_last, pm, lens, window, th, tl, block=block)
    want = prompt_classes_ref(received, pos, real, q_last, pm, lens, window, th, tl)
    assert_same_prompt_classes(got, want, real, seed)


def test_prompt_classes_fill_every_output_of_a_poisoned_launch(monkeypatch):
    """Under the kernel tests' poison (outputs start as NaN or the integer type's poison, an int8
    one included) every output the rule defines is written."""
    from leankit_kernels import testing

    testing.poison_outputs(monkeypatch)
    gen, seed = fresh_generator()
    received, pos, real, q_last, pm, lens = prompt_rule_inputs(2, 3, 45, gen, False, True)
    got = prompt_classes(received, pos, real, q_last, pm, lens, 2, 0.3, 0.1, block=32)
    assert_same_prompt_classes(got, prompt_classes_ref(received, pos, real, q_last, pm, lens, 2, 0.3, 0.1), real, seed)


def test_prompt_classes_follow_the_cumulative_rule():
    """On one hand-made head: window tokens stay high, candidates below cumulative ``Tl`` are
    pruned, below ``Th`` low, the rest high, and the counts and ranks follow."""
    # scores 1, 2, 3, 4 (received = score, every token seen by one query: q_last = pos), plus two
    # window tokens of 10; Z = 30: cumulative 1/30, 3/30, 6/30, 10/30 (+ the window's 20/30)
    received = torch.tensor([[[3.0, 1.0, 4.0, 2.0, 10.0, 10.0]]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    real = torch.ones(1, 6, dtype=torch.bool)
    q_last = torch.tensor([5])
    received[0, 0] *= (5 - pos[0] + 1).float()  # the significance divides by the queries that saw a token
    lens = torch.tensor([[[7]], [[2]]], dtype=torch.int32)
    score, cls, rank, new_lens, pruned = prompt_classes(received, pos, real, q_last, torch.zeros(1, 1), lens, 2,
                                                        0.25, 0.1)
    assert score[0, 0].tolist() == [3.0, 1.0, 4.0, 2.0, 10.0, 10.0]
    # cumulative of 1 = 1/30 < 0.1: pruned; 2 -> 3/30 = 0.1 >= Tl: low; 3 -> 6/30 < 0.25: low; 4 -> 10/30: high
    assert cls[0, 0].tolist() == [KEEP_LOW, PRUNED, KEEP_HIGH, KEEP_LOW, KEEP_HIGH, KEEP_HIGH]
    assert rank[0, 0].tolist()[2] == 0 and rank[0, 0].tolist()[4:] == [1, 2]  # high: 4, then the window
    assert rank[0, 0, 0] == 0 and rank[0, 0, 3] == 1  # low, in arrival order
    assert new_lens.view(-1).tolist() == [7 + 3, 2 + 2]
    assert pruned.item() == 1.0
    cut = significance_cutoffs(score[0, 0, :4], torch.ones(4, dtype=torch.bool), torch.tensor(30.0),
                               torch.tensor(0.0), (0.1, 0.25))
    assert cut.tolist() == [2.0, 4.0]


def test_prompt_classes_single_tier_prunes_only():
    """``Th == Tl`` (a single-tier LeanKV config): nothing goes low, and something is pruned.

    Head (0, 0) holds no pruned mass, so the least of its many candidates has a cumulative
    significance of at most 1 / candidates < 0.2 and must go; a head whose pruned mass already
    reaches 0.2 of the total prunes nothing (the random ``pm`` of the others, up to 3, does that
    for about 0.6% of seeds)."""
    gen, seed = fresh_generator()
    received, pos, real, q_last, pm, lens = prompt_rule_inputs(2, 3, 50, gen, False, True)
    pm[0, 0] = 0.0
    got = prompt_classes(received, pos, real, q_last, pm, lens, 3, 0.2, 0.2)
    assert not (got[1] == KEEP_LOW).any() and (got[1] == PRUNED).any(), f"seed {seed}"
    assert_same_prompt_classes(got, prompt_classes_ref(received, pos, real, q_last, pm, lens, 3, 0.2, 0.2), real, seed)


def test_prompt_classes_check_shapes():
    received = torch.rand(2, 3, 5)
    pos, real = torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, 5, dtype=torch.bool)
    q_last, pm, lens = torch.zeros(2, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="received"):
        prompt_classes(received[0], pos, real, q_last, pm, lens, 1, 0.3, 0.1)
    with pytest.raises(ValueError, match="q_pos"):
        prompt_classes(received, pos[:, :4], real, q_last, pm, lens, 1, 0.3, 0.1)
    with pytest.raises(ValueError, match="q_last"):
        prompt_classes(received, pos, real, q_last[:1], pm, lens, 1, 0.3, 0.1)
    with pytest.raises(ValueError, match="lens"):
        prompt_classes(received, pos, real, q_last, pm, lens[0], 1, 0.3, 0.1)


def test_prompt_classes_of_an_empty_prompt_keep_the_counts():
    """No token (``Q == 0``) or no head: nothing launches, the counts stay, nothing is pruned."""
    lens = torch.tensor([[[3, 4]], [[5, 6]]], dtype=torch.int32)
    got = prompt_classes(torch.rand(1, 2, 0), torch.zeros(1, 0, dtype=torch.int32), torch.ones(1, 0, dtype=torch.bool),
                         torch.zeros(1, dtype=torch.long), torch.zeros(1, 2), lens, 3, 0.3, 0.1)
    assert got[0].shape == (1, 2, 0) and torch.equal(got[3], lens.long().unsqueeze(1))
    assert not got[4].any()
