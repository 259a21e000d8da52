"""Per-row state of a one-token step (a decode step), in one launch.

A forward step begins by asking, per row ``b``: is its token real (not padding, not a finished
request), where does it sit, and did the row's previous token end its request? The general path
(:meth:`leankit.cache.LeanCache.begin_step`, any number of tokens per row) answers with about
twenty small tensor ops, each a launch of a few microseconds on a GPU, before any layer runs. For
``Q = 1`` every answer is per row and elementwise, so one program per ``BLOCK`` rows writes them all:

    ended[b]   = ending[b] and tok[b] in end_ids and not finished[b]    (only with end ids)
    ending'[b] = tok[b] in end_ids[:N_EOS] and not (finished[b] or ended[b])
    continued[b] = finished[b] and mask[b, -1] != 0 and tok[b] not in end_ids   (only with end ids)
    real[b]    = mask[b, -1] != 0 and not (finished[b] or ended[b])   (mask: 1 without one)
    q_pos[b]   = position_ids[b, 0], or ``seen`` without them
    rank[b]    = 0 if real else -1;   n_new[b] = real
    q_first[b] = q_pos if real else NO_POS;   q_last[b] = q_pos if real else -NO_POS
    behind[b]  = real and q_pos <= last_pos[b]          (only with last_pos: the highest stored position)
    last_pos'[b] = max(last_pos[b], q_pos) if real else last_pos[b]

and the first program clears the step's device error flags (a step that raised midway may have
left one up). The caller releases the ended rows (a deferred prefix-sum launch) and marks them
finished. Nothing is read back to the host: ``continued`` marks rows whose request ended in an
earlier step (their pages are freed) but that are fed a real token that is no end id, which the
caller reads with the step's one host read and refuses (the general path refuses them up front);
``behind`` marks rows whose token does not come after every position the row stores (a query masks
stored keys by position, so it would not see them), read and refused the same way, and
``last_pos'`` is what the caller keeps as the rows' highest stored positions once the step ends.

Why a row ends one step after its EOS is fed (``ending``): a one-token step that feeds an EOS is
either ``generate`` feeding back the EOS a row just sampled (the row is over; ``generate`` feeds it
padding from then on) or the first step of a new ``generate`` call continuing a turn that stopped
on that EOS (the row goes on). Only the next token tells them apart, so the EOS is stored like any
token and the row ends when the token after it is an end id again (``end_ids``: the EOS ids
first, then the padding ids ``generate`` feeds a finished row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import cdiv, flag_bytes, jit_options, kernel_for

BLOCK = 128
# Runtime integers that change from step to step or call to call: no variant per value class.
STEP_ROWS_DYNAMIC = ("stride_mb", "stride_tb", "N_EOS", "N_END", "stride_pb", "seen", "N_ERR", "N_STATUS", "B")
STEP_ROWS_UNALIGNED = ("mask_ptr", "tok_ptr", "eos_ptr", "fin_ptr", "ending_ptr", "pos_ptr", "ended_ptr",
                       "next_ptr", "lastpos_ptr", "behind_ptr", "newlast_ptr")


@triton.jit(**jit_options(STEP_ROWS_DYNAMIC, STEP_ROWS_UNALIGNED))
def _step_rows_kernel(mask_ptr, stride_mb, tok_ptr, stride_tb, eos_ptr, N_EOS, N_END, fin_ptr, ending_ptr, pos_ptr,
                      stride_pb, seen, real_ptr, rank_ptr, nnew_ptr, qpos_ptr, qpos64_ptr, first_ptr, last_ptr,
                      ended_ptr, next_ptr, cont_ptr, lastpos_ptr, behind_ptr, newlast_ptr, err_ptr, N_ERR, status_ptr,
                      N_STATUS, B, NO_POS, HAS_MASK: tl.constexpr, HAS_EOS: tl.constexpr, HAS_POS: tl.constexpr,
                      HAS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``[pid * BLOCK, pid * BLOCK + BLOCK)`` of the step (see the module docstring)."""
    pid = tl.program_id(0)
    b = pid * BLOCK + tl.arange(0, BLOCK)
    m = b < B
    fin = tl.load(fin_ptr + b, mask=m, other=1) != 0
    if HAS_MASK:
        fed = tl.load(mask_ptr + b.to(tl.int64) * stride_mb, mask=m, other=0) != 0
    else:
        fed = m
    if HAS_EOS:
        tok = tl.load(tok_ptr + b.to(tl.int64) * stride_tb, mask=m, other=-1)
        hit_eos = b < 0  # all false
        for e in range(N_EOS):
            hit_eos = hit_eos | (tok == tl.load(eos_ptr + e))
        hit_end = hit_eos
        for e in range(N_EOS, N_END):
            hit_end = hit_end | (tok == tl.load(eos_ptr + e))
        ending = tl.load(ending_ptr + b, mask=m, other=0) != 0
        ended = ending & hit_end & ~fin & m
        tl.store(ended_ptr + b, ended.to(tl.int8), mask=m)
        tl.store(cont_ptr + b, (fin & fed & ~hit_end).to(tl.int64), mask=m)
        fin = fin | ended
        tl.store(next_ptr + b, (hit_eos & ~fin).to(tl.int8), mask=m)
    real = fed & ~fin
    if HAS_POS:
        pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pb, mask=m, other=0).to(tl.int64)
    else:
        pos = tl.zeros([BLOCK], tl.int64) + seen
    tl.store(real_ptr + b, real.to(tl.int8), mask=m)
    tl.store(rank_ptr + b, tl.where(real, 0, -1).to(tl.int64), mask=m)
    tl.store(nnew_ptr + b, real.to(tl.int64), mask=m)
    tl.store(qpos_ptr + b, pos.to(tl.int32), mask=m)
    tl.store(qpos64_ptr + b, pos, mask=m)
    tl.store(first_ptr + b, tl.where(real, pos, NO_POS), mask=m)
    tl.store(last_ptr + b, tl.where(real, pos, -NO_POS), mask=m)
    if HAS_LAST:
        stored = tl.load(lastpos_ptr + b, mask=m, other=0)
        tl.store(behind_ptr + b, (real & (pos <= stored)).to(tl.int64), mask=m)
        tl.store(newlast_ptr + b, tl.where(real, tl.maximum(stored, pos), stored), mask=m)
    if pid == 0:  # clear the step's error flags and allocation status
        for s in range(0, N_ERR, BLOCK):
            i = s + tl.arange(0, BLOCK)
            tl.store(err_ptr + i, tl.zeros([BLOCK], tl.int32), mask=i < N_ERR)
        j = tl.arange(0, 4)
        tl.store(status_ptr + j, tl.zeros([4], tl.int64), mask=j < N_STATUS)


def step_rows_ref(batch: int, finished: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, seen: int = 0, last_tokens: torch.Tensor | None = None,
                  end_ids: torch.Tensor | None = None, n_eos: int | None = None,
                  ending: torch.Tensor | None = None, last_pos: torch.Tensor | None = None, no_pos: int) -> dict:
    """Plain-PyTorch reference of :func:`step_rows` (same arguments, same results; it leaves the
    error flags alone)."""
    dev = finished.device
    has_eos = last_tokens is not None and end_ids is not None and end_ids.numel() > 0
    ended = ending_next = continued = None
    fin = finished
    fed = attention_mask[:, -1:].bool() if attention_mask is not None else torch.ones(batch, 1, dtype=torch.bool,
                                                                                     device=dev)
    if has_eos:
        hit_eos = torch.isin(last_tokens, end_ids[:n_eos])
        hit_end = torch.isin(last_tokens, end_ids)
        ended = (ending & hit_end if ending is not None else torch.zeros_like(finished)) & ~finished
        continued = (finished & fed.view(-1) & ~hit_end).long()
        fin = finished | ended
        ending_next = hit_eos & ~fin
    real = fed & ~fin.view(-1, 1)
    pos = (position_ids.long() if position_ids is not None
           else torch.full((batch, 1), seen, dtype=torch.long, device=dev)).expand(batch, 1)
    flat = pos.reshape(-1)
    behind = new_last = None
    if last_pos is not None:
        behind = (real.view(-1) & (flat <= last_pos)).long()
        new_last = torch.where(real.view(-1), torch.maximum(last_pos, flat), last_pos)
    return {"real": real, "rank": real.long() - 1, "n_new": real.view(-1).long(), "q_pos": pos.to(torch.int32),
            "q_pos64": pos.clone(), "q_first": torch.where(real.view(-1), flat, no_pos),
            "q_last": torch.where(real.view(-1), flat, -no_pos), "ended": ended, "ending": ending_next,
            "continued": continued, "behind": behind, "last_pos": new_last}


def step_rows(batch: int, finished: torch.Tensor, err_flags: torch.Tensor, alloc_status: torch.Tensor, *,
              attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
              seen: int = 0, last_tokens: torch.Tensor | None = None, end_ids: torch.Tensor | None = None,
              n_eos: int | None = None, ending: torch.Tensor | None = None,
              last_pos: torch.Tensor | None = None, no_pos: int, block: int = BLOCK) -> dict:
    """The per-row state of a one-token step, in one launch (see the module docstring).

    Args:
        batch: rows ``B``.
        finished: bool ``[B]``, rows whose request ended in an earlier step.
        err_flags: int32 ``[n]`` device error flags, cleared; alloc_status: int64 ``[<= 4]``, cleared.
        attention_mask: ``[B, S]`` (any dtype, nonzero = real; its last column is this step's), or
            None (every row real).
        position_ids: int ``[B, 1]`` (an expanded ``[1, 1]`` too: stride 0), or None (``seen``
            for every row).
        last_tokens: int ``[B]`` the tokens this step feeds and ``end_ids`` int ``[E]``, the EOS ids
            (the first ``n_eos``; None: all) then the padding ids: with both, rows fed an EOS now
            are reported in ``ending`` (and stay real), and rows fed an EOS last step (``ending``
            bool ``[B]``, None: none) and any end id now are reported in ``ended`` (not real).
        last_pos: int64 ``[B]``, the highest position each row stores (-1: none), or None: with it,
            ``behind`` flags the real rows whose position is not past it, and ``last_pos`` is the
            rows' highest stored position once this step's tokens are stored.
        no_pos: the sentinel position of a row without a real token.

    Returns a dict of device tensors: ``real`` bool ``[B, 1]``, ``rank`` int64 ``[B, 1]``,
    ``n_new`` int64 ``[B]``, ``q_pos`` int32 ``[B, 1]``, ``q_pos64`` int64 ``[B, 1]``, ``q_first``
    / ``q_last`` int64 ``[B]``, ``ended`` and ``ending`` bool ``[B]`` or None, ``continued`` int64
    ``[B]`` (0/1: int64, so the caller's one host read concatenates it with its other int64 flags
    in one copy) or None, ``behind`` int64 ``[B]`` (0/1, the same reason) and ``last_pos`` int64
    ``[B]``, or None without ``last_pos``.
    """
    dev = finished.device
    if finished.shape != (batch,) or finished.dtype != torch.bool:
        raise ValueError(f"finished must be bool [{batch}], got {finished.dtype} {tuple(finished.shape)}")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != batch):
        raise ValueError(f"attention_mask must be [{batch}, S], got {tuple(attention_mask.shape)}")
    if position_ids is not None and position_ids.shape != (batch, 1):
        raise ValueError(f"position_ids must be [{batch}, 1], got {tuple(position_ids.shape)}")
    has_eos = last_tokens is not None and end_ids is not None and end_ids.numel() > 0
    if has_eos and last_tokens.shape != (batch,):
        raise ValueError(f"last_tokens must be [{batch}], got {tuple(last_tokens.shape)}")
    if has_eos and ending is not None and (ending.shape != (batch,) or ending.dtype != torch.bool):
        raise ValueError(f"ending must be bool [{batch}], got {ending.dtype} {tuple(ending.shape)}")
    if last_pos is not None and (last_pos.shape != (batch,) or last_pos.dtype != torch.int64):
        raise ValueError(f"last_pos must be int64 [{batch}], got {last_pos.dtype} {tuple(last_pos.shape)}")
    if alloc_status.numel() > 4:
        raise ValueError("alloc_status holds at most 4 values")
    if has_eos and n_eos is not None and not 0 <= n_eos <= end_ids.numel():
        # the kernel reads the first n_eos ids as EOS ids: more would read past the end ids
        raise ValueError(f"n_eos must lie in [0, {end_ids.numel()}] (the end ids given), got {n_eos}")
    out = {
        "real": torch.empty(batch, 1, dtype=torch.bool, device=dev),
        "rank": torch.empty(batch, 1, dtype=torch.int64, device=dev),
        "n_new": torch.empty(batch, dtype=torch.int64, device=dev),
        "q_pos": torch.empty(batch, 1, dtype=torch.int32, device=dev),
        "q_pos64": torch.empty(batch, 1, dtype=torch.int64, device=dev),
        "q_first": torch.empty(batch, dtype=torch.int64, device=dev),
        "q_last": torch.empty(batch, dtype=torch.int64, device=dev),
        "ended": torch.empty(batch, dtype=torch.bool, device=dev) if has_eos else None,
        "ending": torch.empty(batch, dtype=torch.bool, device=dev) if has_eos else None,
        "continued": torch.empty(batch, dtype=torch.int64, device=dev) if has_eos else None,
        "behind": torch.empty(batch, dtype=torch.int64, device=dev) if last_pos is not None else None,
        "last_pos": torch.empty(batch, dtype=torch.int64, device=dev) if last_pos is not None else None,
    }
    has_last = last_pos is not None
    mask = flag_bytes(attention_mask[:, -1]) if attention_mask is not None else finished
    pos = position_ids[:, 0] if position_ids is not None else finished
    tok = last_tokens if has_eos else finished
    # [0, n_eos) of the end ids end a request, all of them end a row that fed an EOS last step
    n_eos = (end_ids.numel() if n_eos is None else n_eos) if has_eos else 0
    eos = end_ids if has_eos else finished
    fin = flag_bytes(finished.contiguous())
    ending_flags = fin if not has_eos else \
        flag_bytes(ending.contiguous()) if ending is not None else torch.zeros_like(fin)
    eos = eos.contiguous()
    # at least one program: the first clears the error flags even for an empty batch
    kernel_for(_step_rows_kernel, dev)[(max(1, cdiv(batch, block)),)](
        mask, mask.stride(0) if attention_mask is not None else 0, tok, tok.stride(0) if has_eos else 0, eos,
        n_eos, eos.numel() if has_eos else 0, fin, ending_flags, pos, pos.stride(0) if position_ids is not None else 0,
        seen, out["real"].view(torch.uint8), out["rank"], out["n_new"], out["q_pos"], out["q_pos64"], out["q_first"],
        out["q_last"], out["ended"].view(torch.uint8) if has_eos else fin,
        out["ending"].view(torch.uint8) if has_eos else fin,
        out["continued"] if has_eos else fin, last_pos.contiguous() if has_last else fin,
        out["behind"] if has_last else fin, out["last_pos"] if has_last else fin, err_flags, err_flags.numel(),
        alloc_status, alloc_status.numel(), batch, no_pos, HAS_MASK=attention_mask is not None, HAS_EOS=has_eos,
        HAS_POS=position_ids is not None, HAS_LAST=has_last, BLOCK=block, num_warps=4)
    return out
