"""The one-launch row state of a decode step (``leankit_kernels.step_rows``) against its torch
reference and against the general path of ``LeanCache.begin_step`` (interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / leankit_kernels are imported: kernels run on CPU

import pytest
import torch
from leankit_kernels.step_rows import step_rows, step_rows_ref
from leankit_kernels.testing import fresh_generator

NO_POS = 1 << 30


def _inputs(batch, gen, mask_dtype, with_mask, with_pos, with_eos, shared_pos):
    finished = torch.rand(batch, generator=gen) < 0.25
    mask = None
    if with_mask:
        mask = (torch.rand(batch, 9, generator=gen) < 0.7).to(mask_dtype)
    pos = None
    if with_pos:
        pos = torch.randint(0, 5000, (1 if shared_pos else batch, 1), generator=gen).expand(batch, 1)
    tok = eos = pads = ending = None
    if with_eos:
        eos = torch.tensor([2, 50, 7])
        tok = torch.randint(0, 60, (batch,), generator=gen)
        tok[torch.rand(batch, generator=gen) < 0.3] = 50
        tok[torch.rand(batch, generator=gen) < 0.2] = 0  # a padding id
        pads = torch.tensor([0])
        ending = torch.rand(batch, generator=gen) < 0.5
    return finished, mask, pos, tok, eos, pads, ending


@pytest.mark.parametrize("batch,block", [(1, 128), (13, 4), (200, 128)])
@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool, torch.float32])
@pytest.mark.parametrize("with_mask,with_pos,with_eos,shared_pos", [
    (True, True, True, False), (False, False, False, False), (True, False, True, False), (False, True, False, True)])
def test_step_rows_match_reference(batch, block, mask_dtype, with_mask, with_pos, with_eos, shared_pos):
    """Every output equals the reference's, for masks of any dtype, shared or per-row positions,
    with and without end ids; the error flags and allocation status are cleared."""
    gen, seed = fresh_generator()
    finished, mask, pos, tok, eos, pads, ending = _inputs(batch, gen, mask_dtype, with_mask, with_pos, with_eos,
                                                          shared_pos)
    seen = int(torch.randint(1, 3000, (1,), generator=gen))
    err = torch.randint(1, 5, (7,), generator=gen, dtype=torch.int32)
    status = torch.tensor([1, 40, 3])
    # the rows' highest stored positions: none (-1), or around this step's so some rows go back
    last_pos = torch.randint(-1, 5000, (batch,), generator=gen) if with_pos else None
    kw = {"attention_mask": mask, "position_ids": pos, "seen": seen, "last_tokens": tok,
          "end_ids": None if eos is None else torch.cat([eos, pads]), "n_eos": None if eos is None else len(eos),
          "ending": ending, "last_pos": last_pos, "no_pos": NO_POS}
    got = step_rows(batch, finished, err, status, block=block, **kw)
    want = step_rows_ref(batch, finished, **kw)
    for name, ref in want.items():
        if ref is None:
            assert got[name] is None, name
            continue
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, (name, got[name].dtype, ref.dtype)
        assert torch.equal(got[name], ref), f"{name} (seed {seed})"
    assert not err.any() and not status.any()


def test_step_rows_check_shapes():
    fin = torch.zeros(3, dtype=torch.bool)
    err, status = torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="finished"):
        step_rows(4, fin, err, status, no_pos=NO_POS)
    with pytest.raises(ValueError, match="attention_mask"):
        step_rows(3, fin, err, status, attention_mask=torch.ones(2, 5), no_pos=NO_POS)
    with pytest.raises(ValueError, match="position_ids"):
        step_rows(3, fin, err, status, position_ids=torch.zeros(3, 2, dtype=torch.long), no_pos=NO_POS)
    with pytest.raises(ValueError, match="last_tokens"):
        step_rows(3, fin, err, status, last_tokens=torch.zeros(2, dtype=torch.long), end_ids=torch.tensor([1]),
                  no_pos=NO_POS)
    with pytest.raises(ValueError, match="ending"):
        step_rows(3, fin, err, status, last_tokens=torch.zeros(3, dtype=torch.long), end_ids=torch.tensor([1]),
                  ending=torch.zeros(3, dtype=torch.long), no_pos=NO_POS)
    with pytest.raises(ValueError, match=r"n_eos must lie in \[0, 2\]"):  # more EOS ids than end ids given
        step_rows(3, fin, err, status, last_tokens=torch.zeros(3, dtype=torch.long), end_ids=torch.tensor([1, 7]),
                  n_eos=3, no_pos=NO_POS)


def test_a_row_ends_on_the_token_after_its_eos():
    """The deferred end (module docstring): an EOS fed now marks the row ending and stays real; an
    EOS or padding id fed after it ends the row; any other token clears the mark."""
    fin = torch.zeros(4, dtype=torch.bool)
    err, status = torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    end_ids = torch.tensor([9, 0])  # EOS 9, padding 0
    ending = torch.tensor([False, True, True, True])
    tok = torch.tensor([9, 9, 0, 5])  # fresh EOS; EOS after EOS; padding after EOS; a real token after EOS
    for fn in (lambda **k: step_rows(4, fin, err, status, **k), lambda **k: step_rows_ref(4, fin, **k)):
        out = fn(last_tokens=tok, end_ids=end_ids, n_eos=1, ending=ending, no_pos=NO_POS)
        assert out["ended"].tolist() == [False, True, True, False]
        assert out["ending"].tolist() == [True, False, False, False]
        assert out["real"].view(-1).tolist() == [True, False, False, True]


@pytest.mark.parametrize("eos,positions", [(True, True), (False, False), (True, False)])
def test_decode_begin_step_matches_the_general_path(eos, positions, monkeypatch):
    """``LeanCache.begin_step`` of a one-token step on the kernel backend (one launch) leaves the
    same step state, finished rows, page tables and returned positions as the general torch path,
    over a prompt and several decode steps of a left-padded batch in which rows end."""
    from leankit.cache import LeanCache
    from leankit.testing import left_padded_batch, tiny_model

    model = tiny_model("llama-gqa", num_hidden_layers=2)
    ids, mask = left_padded_batch(rows=4, width=9, pad_step=3)
    caches = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LEANKIT_BACKEND", backend)
        cache = LeanCache(model, "K8V4", num_pages=200, page_size=256, eos_token_id=[5, 9] if eos else None)
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        cache.begin_step(4, 9, mask, pos if positions else None, ids)
        cache._step = None  # the prompt stores nothing here: only the step bookkeeping is compared
        cache._seen = 9
        caches[backend] = cache
    m = mask
    for step in range(4):
        tok = torch.tensor([[5], [11 + step], [9 if step == 1 else 12], [13]])
        m = torch.cat([m, torch.ones(4, 1, dtype=m.dtype)], 1)
        if step == 2:
            m[3, -1] = 0  # a padded decode token
        pos = (m.cumsum(1) - 1)[:, -1:] if positions else None
        states, out = {}, {}
        for backend, cache in caches.items():
            monkeypatch.setenv("LEANKIT_BACKEND", backend)
            out[backend] = cache.begin_step(4, 1, m, pos, tok)
            states[backend] = cache._step
            cache.table.lens[0] += cache._step.n_new.view(1, -1, 1).to(torch.int32)  # as if the layers stored
            cache._step = None
            cache._seen += 1
            if cache._ending_next is not None:  # what end_step adopts
                cache.ending = cache._ending_next
        a, b = states["torch"], states["triton"]
        for name in ("real", "rank", "n_new", "q_pos", "has_query", "q_first", "q_last"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (step, name, x, y)
        assert a.ordered and b.ordered
        assert torch.equal(out["torch"], out["triton"]), step
        tc, kc = caches["torch"], caches["triton"]
        assert torch.equal(tc.finished, kc.finished) and torch.equal(tc.ending, kc.ending), step
        assert torch.equal(tc.table.n_pages, kc.table.n_pages) and torch.equal(tc.table.lens, kc.table.lens), step
        assert tc.free_list.num_free == kc.free_list.num_free, step
    # row 0 is fed EOS 5 at every step: ending after the first, ended at the second; row 2 is fed
    # EOS 9 once, then a real token, and goes on
    assert caches["triton"].finished.tolist() == [eos, False, False, False]


def test_an_empty_batch_still_clears_the_error_flags():
    """The first program clears the step's flags; an empty batch still runs that one program."""
    err, status = torch.ones(3, dtype=torch.int32), torch.tensor([1, 40, 3])
    step_rows(0, torch.zeros(0, dtype=torch.bool), err, status, no_pos=1 << 30)
    assert err.tolist() == [0, 0, 0] and status.tolist() == [0, 0, 0]


def test_rows_whose_token_does_not_follow_their_stored_positions_are_flagged():
    """``behind`` flags a real row whose position is at or before the highest it stores; a padding
    or finished row never is, and ``last_pos`` moves only for real rows."""
    err, status = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    fin = torch.tensor([False, False, False, True, False])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0]])
    pos = torch.tensor([[7], [5], [9], [1], [0]])
    last = torch.tensor([6, 5, -1, 4, 8])
    for fn in (lambda **k: step_rows(5, fin, err, status, **k), lambda **k: step_rows_ref(5, fin, **k)):
        out = fn(attention_mask=mask, position_ids=pos, last_pos=last, no_pos=NO_POS)
        assert out["behind"].tolist() == [0, 1, 0, 0, 0]
        assert out["last_pos"].tolist() == [7, 5, 9, 4, 8]
        assert fn(no_pos=NO_POS)["behind"] is None
