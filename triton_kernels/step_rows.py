"""Per-row state of a one-token step (a decode step), in one launch.

A forward step begins by asking, per row ``b``: is its token real (not padding, not a finished
request), where does it sit, and did the row's previous token end its request? The general path
(:meth:`leankit.cache.LeanCache.begin_step`, any number of tokens per row) answers with about
twenty small tensor ops, each a launch of a few microseconds on a GPU, before any layer runs. For
``Q = 1`` every answer is per row and elementwise, so one program per ``BLOCK`` rows writes them all:

    ended[b]   = tok[b] in eos_ids and not finished[b]          (only with end ids)
    real[b]    = mask[b, -1] != 0 and not (finished[b] or ended[b])   (mask: 1 without one)
    q_pos[b]   = position_ids[b, 0], or ``seen`` without them
    rank[b]    = 0 if real else -1;   n_new[b] = real
    q_first[b] = q_pos if real else NO_POS;   q_last[b] = q_pos if real else -NO_POS

and the first program clears the step's device error flags (a step that raised midway may have
left one up). The caller releases the ended rows (a deferred prefix-sum launch) and marks them
finished. Nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import cdiv, flag_bytes, jit_options, kernel_for

BLOCK = 128
# Runtime integers that change from step to step or call to call: no variant per value class.
STEP_ROWS_DYNAMIC = ("stride_mb", "stride_tb", "N_EOS", "stride_pb", "seen", "N_ERR", "N_STATUS", "B")
STEP_ROWS_UNALIGNED = ("mask_ptr", "tok_ptr", "eos_ptr", "fin_ptr", "pos_ptr", "ended_ptr")


@triton.jit(**jit_options(STEP_ROWS_DYNAMIC, STEP_ROWS_UNALIGNED))
def _step_rows_kernel(mask_ptr, stride_mb, tok_ptr, stride_tb, eos_ptr, N_EOS, fin_ptr, pos_ptr, stride_pb, seen,
                      real_ptr, rank_ptr, nnew_ptr, qpos_ptr, qpos64_ptr, first_ptr, last_ptr, ended_ptr,
                      err_ptr, N_ERR, status_ptr, N_STATUS, B, NO_POS,
                      HAS_MASK: tl.constexpr, HAS_EOS: tl.constexpr, HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``[pid * BLOCK, pid * BLOCK + BLOCK)`` of the step (see the module docstring)."""
    pid = tl.program_id(0)
    b = pid * BLOCK + tl.arange(0, BLOCK)
    m = b < B
    fin = tl.load(fin_ptr + b, mask=m, other=1) != 0
    if HAS_EOS:
        tok = tl.load(tok_ptr + b.to(tl.int64) * stride_tb, mask=m, other=-1)
        hit = b < 0  # all false
        for e in range(N_EOS):
            hit = hit | (tok == tl.load(eos_ptr + e))
        ended = hit & ~fin & m
        tl.store(ended_ptr + b, ended.to(tl.int8), mask=m)
        fin = fin | ended
    if HAS_MASK:
        real = (tl.load(mask_ptr + b.to(tl.int64) * stride_mb, mask=m, other=0) != 0) & ~fin
    else:
        real = ~fin
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
    if pid == 0:  # clear the step's error flags and allocation status
        for s in range(0, N_ERR, BLOCK):
            i = s + tl.arange(0, BLOCK)
            tl.store(err_ptr + i, tl.zeros([BLOCK], tl.int32), mask=i < N_ERR)
        j = tl.arange(0, 4)
        tl.store(status_ptr + j, tl.zeros([4], tl.int64), mask=j < N_STATUS)


def step_rows_ref(batch: int, finished: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, seen: int = 0, last_tokens: torch.Tensor | None = None,
                  eos_ids: torch.Tensor | None = None, no_pos: int) -> dict:
    """Plain-PyTorch reference of :func:`step_rows` (same arguments, same results; it leaves the
    error flags alone)."""
    dev = finished.device
    has_eos = last_tokens is not None and eos_ids is not None and eos_ids.numel() > 0
    ended = torch.isin(last_tokens, eos_ids) & ~finished if has_eos else None
    fin = finished | ended if has_eos else finished
    real = attention_mask[:, -1:].bool() if attention_mask is not None else torch.ones(batch, 1, dtype=torch.bool,
                                                                                      device=dev)
    real = real & ~fin.view(-1, 1)
    pos = (position_ids.long() if position_ids is not None
           else torch.full((batch, 1), seen, dtype=torch.long, device=dev)).expand(batch, 1)
    flat = pos.reshape(-1)
    return {"real": real, "rank": real.long() - 1, "n_new": real.view(-1).long(), "q_pos": pos.to(torch.int32),
            "q_pos64": pos.clone(), "q_first": torch.where(real.view(-1), flat, no_pos),
            "q_last": torch.where(real.view(-1), flat, -no_pos), "ended": ended}


def step_rows(batch: int, finished: torch.Tensor, err_flags: torch.Tensor, alloc_status: torch.Tensor, *,
              attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
              seen: int = 0, last_tokens: torch.Tensor | None = None, eos_ids: torch.Tensor | None = None,
              no_pos: int, block: int = BLOCK) -> dict:
    """The per-row state of a one-token step, in one launch (see the module docstring).

    Args:
        batch: rows ``B``.
        finished: bool ``[B]``, rows whose request ended in an earlier step.
        err_flags: int32 ``[n]`` device error flags, cleared; alloc_status: int64 ``[<= 4]``, cleared.
        attention_mask: ``[B, S]`` (any dtype, nonzero = real; its last column is this step's), or
            None (every row real).
        position_ids: int ``[B, 1]`` (an expanded ``[1, 1]`` too: stride 0), or None (``seen``
            for every row).
        last_tokens: int ``[B]`` the rows' previous tokens and ``eos_ids`` int ``[E]``: with both,
            rows whose previous token ends its request are reported in ``ended`` (and not real).
        no_pos: the sentinel position of a row without a real token.

    Returns a dict of device tensors: ``real`` bool ``[B, 1]``, ``rank`` int64 ``[B, 1]``,
    ``n_new`` int64 ``[B]``, ``q_pos`` int32 ``[B, 1]``, ``q_pos64`` int64 ``[B, 1]``, ``q_first``
    / ``q_last`` int64 ``[B]``, ``ended`` bool ``[B]`` or None.
    """
    dev = finished.device
    if finished.shape != (batch,) or finished.dtype != torch.bool:
        raise ValueError(f"finished must be bool [{batch}], got {finished.dtype} {tuple(finished.shape)}")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != batch):
        raise ValueError(f"attention_mask must be [{batch}, S], got {tuple(attention_mask.shape)}")
    if position_ids is not None and position_ids.shape != (batch, 1):
        raise ValueError(f"position_ids must be [{batch}, 1], got {tuple(position_ids.shape)}")
    has_eos = last_tokens is not None and eos_ids is not None and eos_ids.numel() > 0
    if has_eos and last_tokens.shape != (batch,):
        raise ValueError(f"last_tokens must be [{batch}], got {tuple(last_tokens.shape)}")
    if alloc_status.numel() > 4:
        raise ValueError("alloc_status holds at most 4 values")
    out = {
        "real": torch.empty(batch, 1, dtype=torch.bool, device=dev),
        "rank": torch.empty(batch, 1, dtype=torch.int64, device=dev),
        "n_new": torch.empty(batch, dtype=torch.int64, device=dev),
        "q_pos": torch.empty(batch, 1, dtype=torch.int32, device=dev),
        "q_pos64": torch.empty(batch, 1, dtype=torch.int64, device=dev),
        "q_first": torch.empty(batch, dtype=torch.int64, device=dev),
        "q_last": torch.empty(batch, dtype=torch.int64, device=dev),
        "ended": torch.empty(batch, dtype=torch.bool, device=dev) if has_eos else None,
    }
    mask = flag_bytes(attention_mask[:, -1]) if attention_mask is not None else finished
    pos = position_ids[:, 0] if position_ids is not None else finished
    tok = last_tokens if has_eos else finished
    eos = eos_ids if has_eos else finished
    fin = flag_bytes(finished.contiguous())
    eos = eos.contiguous()
    kernel_for(_step_rows_kernel, dev)[(cdiv(batch, block),)](
        mask, mask.stride(0) if attention_mask is not None else 0, tok, tok.stride(0) if has_eos else 0, eos,
        eos.numel() if has_eos else 0, fin, pos, pos.stride(0) if position_ids is not None else 0,
        seen, out["real"].view(torch.uint8), out["rank"], out["n_new"], out["q_pos"], out["q_pos64"], out["q_first"],
        out["q_last"], out["ended"].view(torch.uint8) if has_eos else fin, err_flags, err_flags.numel(), alloc_status,
        alloc_status.numel(), batch, no_pos, HAS_MASK=attention_mask is not None, HAS_EOS=has_eos,
        HAS_POS=position_ids is not None, BLOCK=block, num_warps=4)
    return out
