"""Page allocation and recycling: circular free list + exclusive prefix sum (LeanKV §5.2, §5.3).

Requesters are the ``N = 2 * L * B * H`` (tier, layer, sequence, KV head) rows, flattened in that
order (``i = tier * L*B*H + rest``).

Grow (``_grow_kernel``) reads
    ``extra`` int32 ``[N]`` pages each requester needs now (the planning phase's demands);
    ``n_pages`` int32 ``[N]`` pages each already owns;
    ``ring`` int32 ``[capacity]`` free page ids, the free ones at ring slots
    ``head, head+1, ...`` (mod capacity).
and writes
    ``tables`` int32 ``[L*B*H, R]``: requester ``i`` takes ring slots
    ``head + excl[i] + j`` for ``j < extra[i]`` (``excl`` = exclusive prefix sum of ``extra``)
    and puts page ``j`` into column ``n_pages[i] + j`` of its row (high tier, from the left) or
    ``R - 1 - (n_pages[i] + j)`` (low tier, from the right: the bidirectional page table);
    ``n_pages[i] += extra[i]``.
Shrink (``_shrink_kernel``) is the mirror image at the tail: requester ``i`` drops its last
``drop[i] = n_pages[i] - keep[i]`` pages ``keep[i] .. n_pages[i]-1``, writes them to ring slots ``tail + excl[i] + j`` (prefix sum of the
drops), clears the table entries to ``-1`` and sets ``n_pages[i] = keep[i]``.

One launch per step for all requesters. Each program owns ``BLOCK`` consecutive requesters; it
first sums the demands of all requesters before its block (a reduction over at most ``N`` int32,
the carry of the prefix sum), then ``tl.cumsum`` within the block gives every requester its
exclusive offset: no inter-program synchronization, and the ring regions of different requesters
never overlap. The kernels read ``free_head`` / ``free_tail`` from the free list's device
counters; the host advances them by the total, or (a deferred grow, ``status=``) the device
does, and the host catches up at its next read (:class:`leankit.allocator.FreePageList`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from leankit.allocator import FreePageList, PoolExhausted

from .tiles import cdiv, flag_bytes, jit_options, kernel_for

BLOCK = 128
# A deferred grant of up to this many requesters runs as one program (two passes of
# SINGLE_GRANT_BLOCK at a time) instead of the many-program grow and a dozen torch ops around it:
# 2 * L * B * H is 1,440 at SmolLM2's 30 layers x 3 heads and batch 8, 32,768 at Llama-3-8B's 32
# x 8 heads and batch 64.
SINGLE_GRANT_MAX = 1 << 16
SINGLE_GRANT_BLOCK = 1024
# Runtime integers that change with the batch and the step: no compiled variant per value class
# (a compile stalls a GPU step for about a second).
SINGLE_GRANT_DYNAMIC = ("cap", "N", "LBH", "BH", "H", "R", "T")
MOVE_TAIL_DYNAMIC = ("LBH", "BH", "R")
TIER_PLAN_DYNAMIC = ("s_lt", "N", "LBH", "BH", "H", "T_H", "T_L")


@triton.jit
def _carry(d_ptr, c0, BLOCK: tl.constexpr):
    """Sum of the demands ``d[0 .. c0-1]`` of the requesters before this block (read-only input)."""
    tot = tl.zeros([BLOCK], tl.int32)
    for s in range(0, c0, BLOCK):
        i = s + tl.arange(0, BLOCK)
        tot += tl.maximum(tl.load(d_ptr + i, mask=i < c0, other=0), 0)
    return tl.sum(tot, 0)


@triton.jit
def _requesters(d_ptr, N, LBH, R, BLOCK: tl.constexpr):
    """This program's block of requesters ``i``: ``(i, mask, demand d[i], exclusive prefix sum of d at i,
    tier, int64 offset of the page-table row)``. ``d`` is never written by the kernels, so the carry
    may read it while other programs update ``n_pages``."""
    c0 = tl.program_id(0) * BLOCK
    i = c0 + tl.arange(0, BLOCK)
    m = i < N
    # A negative demand is read as none: the prefix sum would otherwise hand the same pages out twice
    # (the eager grant refuses it on the host; a deferred one reads nothing back).
    d = tl.maximum(tl.load(d_ptr + i, mask=m, other=0), 0)
    excl = _carry(d_ptr, c0, BLOCK) + tl.cumsum(d, 0) - d
    return i, m, d, excl, i // LBH, (i % LBH).to(tl.int64) * R


@triton.jit
def _column(tier, n, R):
    """Table column of a requester's page number ``n``: from the left (high tier) or the right (low)."""
    return tl.where(tier == 0, n, R - 1 - n)


@triton.jit
def _grow_kernel(extra_ptr, npages_ptr, tables_ptr, ring_ptr, cnt_ptr, cap, N, LBH, R, BLOCK: tl.constexpr):
    """Hand ``extra[i]`` pages from the ring head to each requester of this block (see module doc).
    The head counter is read from the device (``cnt_ptr[0]``), so the host need not know it."""
    head = tl.load(cnt_ptr) % cap
    i, m, d, excl, tier, row = _requesters(extra_ptr, N, LBH, R, BLOCK)
    npg = tl.load(npages_ptr + i, mask=m, other=0)
    for j in range(tl.max(d, 0)):
        take = m & (j < d)
        pid = tl.load(ring_ptr + (head + excl + j) % cap, mask=take, other=-1)
        tl.store(tables_ptr + row + _column(tier, npg + j, R), pid, mask=take)
    tl.store(npages_ptr + i, npg + d, mask=m)


@triton.jit
def _shrink_kernel(drop_ptr, npages_ptr, tables_ptr, ring_ptr, cnt_ptr, cap, N, LBH, R, BLOCK: tl.constexpr):
    """Return each requester's last ``drop[i]`` pages to the ring tail (``cnt_ptr[1]``), in prefix-sum order."""
    tail = tl.load(cnt_ptr + 1) % cap
    i, m, d, excl, tier, row = _requesters(drop_ptr, N, LBH, R, BLOCK)
    keep = tl.load(npages_ptr + i, mask=m, other=0) - d
    for j in range(tl.max(d, 0)):
        take = m & (j < d)
        col = _column(tier, keep + j, R)
        pid = tl.load(tables_ptr + row + col, mask=take, other=-1)
        tl.store(ring_ptr + (tail + excl + j) % cap, pid, mask=take)
        tl.store(tables_ptr + row + col, tl.full([BLOCK], -1, tl.int32), mask=take)
    tl.store(npages_ptr + i, keep, mask=m)


@triton.jit
def _token_demand(lens_ptr, npages_ptr, nnew_ptr, i, m, BH, H, T):
    """High-tier pages requester ``i`` (of the high tier's ``L*B*H``) lacks for its tokens plus
    its row's new ones: ``max(ceil((lens[i] + n_new[b]) / T) - n_pages[i], 0)``, ``b = i // H % B``."""
    n = tl.load(lens_ptr + i, mask=m, other=0) + tl.load(nnew_ptr + (i % BH) // H, mask=m, other=0).to(tl.int32)
    need = (n + T - 1) // T - tl.load(npages_ptr + i, mask=m, other=0)
    return tl.maximum(need, 0)


@triton.jit
def _grant_check(total, cnt_ptr, status_ptr):
    """A deferred grant of ``total`` pages against the ring's free ids: ``(head counter, 1 if granted
    else 0)``. The first refusal of the step records ``(1, pages needed, pages free)`` in ``status``
    for end_step to raise; a refused grant hands out nothing."""
    head_count = tl.load(cnt_ptr)
    free = tl.load(cnt_ptr + 1) - head_count
    first = (total > free) & (tl.load(status_ptr) == 0)
    e = tl.arange(0, 4)
    record = tl.where(e == 0, 1, tl.where(e == 1, total, free))
    first_v = (e * 0 + first.to(tl.int32)) != 0  # the scalar as a vector: the interpreter refuses a scalar bool here
    tl.store(status_ptr + e, record, mask=(e < 3) & first_v)
    return head_count, (total <= free).to(tl.int32)


@triton.jit(**jit_options(SINGLE_GRANT_DYNAMIC))
def _single_grant_kernel(extra_ptr, lens_ptr, npages_ptr, nnew_ptr, tables_ptr, ring_ptr, cnt_ptr, status_ptr, ok_ptr,
                         cap, N, LBH, BH, H, R, T, TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """A deferred grant whole, in one program: the demand of every requester, its total against the
    ring's free ids and the refusal record (:func:`_grant_check`), the grant in prefix-sum order
    (as :func:`_grow_kernel`), the head counter's advance and the ``ok`` flag. One program, so it
    reads the head before anything moves it and no other program can see it half-advanced.

    The demand is ``extra[i]`` for the ``N`` requesters of both tiers (:func:`grow_pages` with
    ``status``), or with ``TOKENS`` what the high tier's ``N = L*B*H`` requesters lack for their
    tokens and their rows' new ones (:func:`_token_demand`, :func:`grant_token_pages`)."""
    r = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], tl.int64)
    for s in range(0, N, BLOCK):
        i = s + r
        tot += _demand(extra_ptr, lens_ptr, npages_ptr, nnew_ptr, i, i < N, BH, H, T, TOKENS).to(tl.int64)
    total = tl.sum(tot, 0)
    head_count, grant = _grant_check(total, cnt_ptr, status_ptr)
    head = head_count % cap
    carry = total * 0
    for s in range(0, N, BLOCK):
        i = s + r
        m = i < N
        d = _demand(extra_ptr, lens_ptr, npages_ptr, nnew_ptr, i, m, BH, H, T, TOKENS) * grant
        excl = carry + (tl.cumsum(d, 0) - d).to(tl.int64)
        npg = tl.load(npages_ptr + i, mask=m, other=0)
        tier = i // LBH
        row = (i % LBH).to(tl.int64) * R
        for j in range(tl.max(d, 0)):
            take = m & (j < d)
            pid = tl.load(ring_ptr + (head + excl + j) % cap, mask=take, other=-1)
            tl.store(tables_ptr + row + _column(tier, npg + j, R), pid, mask=take)
        tl.store(npages_ptr + i, npg + d, mask=m)
        carry += tl.sum(d, 0).to(tl.int64)
    tl.store(cnt_ptr, head_count + total * grant)
    tl.store(ok_ptr, grant.to(tl.int8))


@triton.jit
def _demand(extra_ptr, lens_ptr, npages_ptr, nnew_ptr, i, m, BH, H, T, TOKENS: tl.constexpr):
    """Pages requester ``i`` is granted: ``extra[i]``, or with ``TOKENS`` :func:`_token_demand`."""
    if TOKENS:
        return _token_demand(lens_ptr, npages_ptr, nnew_ptr, i, m, BH, H, T)
    return tl.maximum(tl.load(extra_ptr + i, mask=m, other=0), 0)  # (negative: none, as in _requesters)


@triton.jit
def _release_rows_kernel(rows_ptr, npages_ptr, lens_ptr, tables_ptr, ring_ptr, cnt_ptr, cap, N, LBH, BH, H, R,
                         BLOCK: tl.constexpr):
    """Every page of the sequences ``b`` with ``rows[b] != 0`` back to the ring tail, in one program
    (see :func:`release_rows`): the same ring order as :func:`_shrink_kernel` with ``keep = 0`` for
    those rows, their table entries cleared, page and token counts zeroed, the tail advanced.
    A step in which no row ended (the usual one) reads the ``B`` flags and stops there."""
    r = tl.arange(0, BLOCK)
    n_rows = BH // H
    ended = tl.zeros([BLOCK], tl.int32)
    for s in range(0, n_rows, BLOCK):
        ended += (tl.load(rows_ptr + s + r, mask=s + r < n_rows, other=0) != 0).to(tl.int32)
    if tl.sum(ended, 0) == 0:
        return
    tail_count = tl.load(cnt_ptr + 1)
    tail = tail_count % cap
    carry = tail_count * 0
    for s in range(0, N, BLOCK):
        i = s + r
        m = i < N
        rest = i % LBH
        gone = m & (tl.load(rows_ptr + (rest % BH) // H, mask=m, other=0) != 0)
        npg = tl.load(npages_ptr + i, mask=m, other=0)
        d = tl.where(gone, npg, 0)
        excl = carry + (tl.cumsum(d, 0) - d).to(tl.int64)
        row = rest.to(tl.int64) * R
        tier = i // LBH
        for j in range(tl.max(d, 0)):
            take = j < d
            col = _column(tier, j, R)
            pid = tl.load(tables_ptr + row + col, mask=take, other=-1)
            tl.store(ring_ptr + (tail + excl + j) % cap, pid, mask=take)
            tl.store(tables_ptr + row + col, tl.full([BLOCK], -1, tl.int32), mask=take)
        tl.store(npages_ptr + i, npg - d, mask=m)
        tl.store(lens_ptr + i, tl.zeros([BLOCK], tl.int32), mask=gone)
        carry += tl.sum(d, 0).to(tl.int64)
    tl.store(cnt_ptr + 1, tail_count + carry)


@triton.jit(**jit_options(MOVE_TAIL_DYNAMIC))
def _move_tail_kernel(layers_ptr, r_ptr, npages_ptr, tables_ptr, LBH, BH, R, BLOCK: tl.constexpr):
    """One program per (listed layer, sequence, head) row: its last ``r`` high pages become its
    newest low pages (the bidirectional table's Fig. 5 reuse). High page ``cur_h - 1 - i`` goes to
    the low column ``R - 1 - cur_l - i``, i.e. to high column ``cur_h - 1 - i + gap`` with the
    row's free gap ``gap = R - cur_l - cur_h >= 0``: a destination is the source of a smaller or
    equal ``i``, so a tile's sources are read before any of its writes (the barrier) and no later
    tile reads what an earlier one wrote. A source is cleared to ``-1`` unless a move fills it
    (``i + gap < r``), so no column is written twice."""
    pid = tl.program_id(0)
    lp = pid // BH
    rest = pid % BH
    lay = tl.load(layers_ptr + lp).to(tl.int64)
    head = lay * BH + rest  # the row among the table's L * B * H
    rr = tl.load(r_ptr + pid).to(tl.int32)
    cur_h = tl.load(npages_ptr + head)
    cur_l = tl.load(npages_ptr + LBH + head)
    gap = R - cur_l - cur_h
    row = tables_ptr + head * R
    for i0 in range(0, rr, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < rr
        page = tl.load(row + (cur_h - 1 - i), mask=m, other=-1)
        tl.debug_barrier()
        tl.store(row + (R - 1 - cur_l - i), page, mask=m)
        tl.store(row + (cur_h - 1 - i), tl.full([BLOCK], -1, tl.int32), mask=m & (i + gap >= rr))
    tl.store(npages_ptr + head, cur_h - rr)
    tl.store(npages_ptr + LBH + head, cur_l + rr)


@triton.jit(**jit_options(TIER_PLAN_DYNAMIC))
def _tier_plan_kernel(layers_ptr, len_ptr, s_lt, res_ptr, npages_ptr, need_ptr, r_ptr, extra_ptr, N, LBH, BH, H,
                      T_H, T_L, HAS_RES: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr):
    """Heads ``[pid * BLOCK, pid * BLOCK + BLOCK)`` of the ``N = L' * B * H`` listed (layer, sequence,
    head) rows: the pages each tier needs, the surplus high pages its low side takes over and the
    pages to grant (see :func:`plan_tier_pages`)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    lp = i // BH
    rest = i % BH
    head = tl.load(layers_ptr + lp, mask=m, other=0).to(tl.int64) * BH + rest  # row among L * B * H
    len_h = tl.load(len_ptr + i, mask=m, other=0).to(tl.int64)
    if HAS_RES:
        len_h += tl.load(res_ptr + rest // H, mask=m, other=0).to(tl.int64)
    need_h = (len_h + T_H - 1) // T_H
    cur_h = tl.load(npages_ptr + head, mask=m, other=0).to(tl.int64)
    if TWO:
        need_l = (tl.load(len_ptr + s_lt + i, mask=m, other=0).to(tl.int64) + T_L - 1) // T_L
        cur_l = tl.load(npages_ptr + LBH + head, mask=m, other=0).to(tl.int64)
    else:
        need_l = tl.zeros([BLOCK], tl.int64)
        cur_l = tl.zeros([BLOCK], tl.int64)
    r = tl.minimum(tl.maximum(cur_h - need_h, 0), tl.maximum(need_l - cur_l, 0))
    tl.store(need_ptr + i, need_h, mask=m)
    tl.store(need_ptr + N + i, need_l, mask=m)
    tl.store(r_ptr + i, r, mask=m)
    tl.store(extra_ptr + head, tl.maximum(need_h - cur_h, 0).to(tl.int32), mask=m)
    tl.store(extra_ptr + LBH + head, tl.maximum(need_l - cur_l - r, 0).to(tl.int32), mask=m)


def _check_tables(table, lens: bool = False) -> None:
    """The table tensors a kernel indexes flat: contiguous int32 (``lens`` too, shaped like
    ``n_pages``, where the kernel reads or writes token counts)."""
    for name in ("tables", "n_pages") + (("lens",) if lens else ()):
        t = getattr(table, name)
        if not t.is_contiguous() or t.dtype != torch.int32:
            raise ValueError(f"page table {name} must be a contiguous int32 tensor")
    if lens and table.lens.shape != table.n_pages.shape:
        raise ValueError("page table lens must be shaped like n_pages")


def grow_pages(table, extra: torch.Tensor, free_list: FreePageList, *, block: int = BLOCK,
               status: torch.Tensor | None = None, taken: int | None = None,
               total: int | None = None, tiers: int = 2) -> int | torch.Tensor:
    """Kernel path of :meth:`leankit.page_table.BidirectionalPageTable.grow` (one launch).

    ``extra`` int ``[2, L, B, H]``, or with ``tiers=1`` one page count per row of a single-sided
    table (every row filled from the left: the ACT rows of :class:`leankit.page_table.ActPageTable`).
    Raises :class:`~leankit.allocator.PoolExhausted` (changing nothing) when the ring holds too few
    free ids. Returns the number of pages handed out.

    With ``status`` (int64 ``[3]`` on the device, zero while no allocation has failed) nothing is
    read back to the host: the total and the check run on the device, a grant that does not fit
    is refused whole (no page moves, ``n_pages`` unchanged) and the first refusal writes
    ``(1, pages needed, pages free)`` into ``status`` for the caller to read and raise later. The
    free list's device counters advance; its host counters are stale until it next syncs.
    Returns the device bool ``ok`` (the grant was made) then. The caller guarantees that no page-table row can overflow.
    ``taken`` (with ``status``): a host bound on ``extra.sum()``, which keeps the free list's
    host lower bound on its free pages (:attr:`~leankit.allocator.FreePageList.free_floor`) valid.
    ``total`` (without ``status``): ``extra.sum()`` if the caller has already read it.
    """
    _check_tables(table)
    if extra.shape != table.n_pages.shape:  # the kernels index it flat, one demand per n_pages entry
        raise ValueError(f"extra must be shaped like n_pages {tuple(table.n_pages.shape)}, got {tuple(extra.shape)}")
    extra = extra.to(device=table.tables.device, dtype=torch.int32).contiguous()
    cnt = free_list.device_counters()
    n = extra.numel()
    cap = free_list.capacity
    grid = (cdiv(n, block),)
    if status is not None and n <= SINGLE_GRANT_MAX:  # one launch, no torch op around it
        ok = torch.empty((), dtype=torch.bool, device=extra.device)
        kernel_for(_single_grant_kernel, extra.device)[(1,)](
            extra, extra, table.n_pages, extra, table.tables, free_list.ring, cnt, status, ok.view(torch.uint8), cap, n,
            n // tiers, 1, 1, table.row_len, 1, TOKENS=False, BLOCK=SINGLE_GRANT_BLOCK, num_warps=4)
        free_list.mark_stale(taken)
        return ok
    if status is not None:
        # the kernel reads a negative demand as none (_requesters): the head counter must advance
        # by the pages it hands out, or a later grant hands the same ones out again
        total = extra.clamp_min(0).sum(dtype=torch.int64)
        free = cnt[1] - cnt[0]
        ok = total <= free
        first = ~ok & (status[0] == 0)
        status.copy_(torch.where(first, torch.stack([torch.ones_like(total), total, free]), status))
        extra = extra * ok.to(torch.int32)  # a refused grant hands out nothing
        kernel_for(_grow_kernel, extra.device)[grid](extra, table.n_pages, table.tables, free_list.ring, cnt, cap, n,
                                                     n // tiers, table.row_len, BLOCK=block, num_warps=4)
        cnt[0:1].add_(total * ok)
        free_list.mark_stale(taken)
        return ok
    if total is None:
        # one read for both: as BidirectionalPageTable.grow, a negative demand is refused (the prefix
        # sum would give pages twice)
        negative, total = torch.stack(((extra < 0).sum(), extra.sum(dtype=torch.int64))).tolist()
        if negative:
            raise ValueError("a page demand is negative: grow only adds pages (shrink gives them back)")
    if total == 0:
        return 0
    if total > free_list.num_free:
        raise PoolExhausted(total, free_list.num_free, free_list.capacity)
    free_list.sync()  # the kernel reads the device counters: they must be current
    kernel_for(_grow_kernel, extra.device)[grid](extra, table.n_pages, table.tables, free_list.ring, cnt, cap, n,
                                                 n // tiers, table.row_len, BLOCK=block, num_warps=4)
    free_list.free_head += total
    return total


def grant_token_pages(table, n_new: torch.Tensor, tokens_per_page: int, free_list: FreePageList,
                      status: torch.Tensor, *, taken: int | None = None, block: int = 1024) -> None:
    """Deferred grant of the high-tier pages a step's new tokens need, in one launch and no host read.

    What :func:`grow_pages` with ``status`` does for ``extra = table.token_demand(n_new,
    tokens_per_page)`` (:meth:`leankit.page_table.BidirectionalPageTable.token_demand`), with the
    demand, its total, the check against the free ids, the refusal record in ``status`` (``(1, pages needed, pages free)``, first refusal only; a refused grant
    moves nothing) and the head counter's advance all in one single-program kernel instead of a
    dozen small tensor ops around the grant. ``n_new`` int ``[B]``: new tokens per row. ``taken``:
    a host bound on the pages granted (see :func:`grow_pages`). The caller guarantees that no
    page-table row can overflow.

    One program walks every requester twice (``block`` at a time): a decode step's demand is a few
    thousand requesters at most, which one program covers in a few iterations.
    """
    _check_tables(table, lens=True)
    if n_new.dim() != 1 or n_new.shape[0] != table.lens.shape[2]:
        raise ValueError(f"n_new must be [batch={table.lens.shape[2]}], got {tuple(n_new.shape)}")
    if tokens_per_page < 1:
        raise ValueError(f"tokens_per_page must be >= 1, got {tokens_per_page}")
    _, n_layers, batch, heads = table.lens.shape
    lbh = n_layers * batch * heads
    cnt = free_list.device_counters()
    ok = torch.empty((), dtype=torch.bool, device=table.tables.device)  # the status records a refusal
    kernel_for(_single_grant_kernel, table.tables.device)[(1,)](
        table.lens, table.lens, table.n_pages, n_new.contiguous(), table.tables, free_list.ring, cnt, status,
        ok.view(torch.uint8), free_list.capacity, lbh, lbh, batch * heads, heads, table.row_len, tokens_per_page,
        TOKENS=True, BLOCK=block, num_warps=4)
    free_list.mark_stale(taken)


def release_rows(table, rows: torch.Tensor, free_list: FreePageList, *, tiers: int = 2, block: int = 1024) -> None:
    """Deferred release of every page of the sequences where ``rows[b]`` is true, in one launch.

    What ``shrink_pages(table, keep, free_list, defer=True)`` with ``keep`` 0 for those rows (their
    own page counts elsewhere) does, plus zeroing their token counts, with no tensor op around the
    launch: one program finds each requester's drop from its row's flag, returns the pages to the
    ring tail in prefix-sum order, and advances the tail counter itself. ``table``: a
    :class:`~leankit.page_table.BidirectionalPageTable` (``tiers=2``) or an
    :class:`~leankit.page_table.ActPageTable` (``tiers=1``, one row per (layer, sequence)). The
    free list's host counters are stale until it next syncs (a release only adds free pages).
    """
    _check_tables(table, lens=True)
    batch = table.n_pages.shape[-1] if tiers == 1 else table.n_pages.shape[2]
    if rows.shape != (batch,):
        raise ValueError(f"rows must be [batch={batch}], got {tuple(rows.shape)}")
    heads = 1 if tiers == 1 else table.n_pages.shape[3]
    n = table.n_pages.numel()
    kernel_for(_release_rows_kernel, table.tables.device)[(1,)](
        flag_bytes(rows.contiguous()), table.n_pages, table.lens, table.tables, free_list.ring, free_list.device_counters(),
        free_list.capacity, n, n // tiers, batch * heads, heads, table.row_len, BLOCK=block, num_warps=4)
    free_list.mark_stale(taken=0)


def shrink_pages(table, keep: torch.Tensor, free_list: FreePageList, *, block: int = BLOCK,
                 defer: bool = False, tiers: int = 2) -> int | None:
    """Kernel path of :meth:`leankit.page_table.BidirectionalPageTable.shrink` (one launch).

    ``keep`` int ``[2, L, B, H]`` (already clipped to ``n_pages``), or with ``tiers=1`` one page
    count per row of a single-sided table (the ACT rows of :class:`leankit.page_table.ActPageTable`,
    filled from the left). Returns the pages freed.

    With ``defer`` nothing is read back to the host: the kernel reads the tail from the free
    list's device counters, the device adds the total to it, and the host counters are stale
    until the free list next syncs. Returns None then. (A drop never exceeds the pages the heads
    own, so the double-free check of the eager path cannot fail here.)
    """
    _check_tables(table)
    keep = keep.to(device=table.tables.device, dtype=torch.int32)
    drop = (table.n_pages - keep).contiguous()
    if defer:
        n = drop.numel()
        cnt = free_list.device_counters()
        kernel_for(_shrink_kernel, drop.device)[(cdiv(n, block),)](
            drop, table.n_pages, table.tables, free_list.ring, cnt, free_list.capacity, n, n // tiers, table.row_len,
            BLOCK=block, num_warps=4)
        cnt[1:2].add_(drop.sum(dtype=torch.int64))
        free_list.mark_stale(taken=0)  # a release only adds free pages
        return None
    total = int(drop.sum())
    if total == 0:
        return 0
    cap = free_list.capacity
    if total > cap - free_list.num_free:  # (num_free syncs the host counters)
        raise RuntimeError("releasing more pages than are in use: double free")
    n = drop.numel()
    kernel_for(_shrink_kernel, drop.device)[(cdiv(n, block),)](drop, table.n_pages, table.tables, free_list.ring,
                                             free_list.device_counters(), cap, n, n // tiers, table.row_len, BLOCK=block,
                                             num_warps=4)
    free_list.free_tail += total
    return total


def move_tail_pages(table, layers: torch.Tensor, r: torch.Tensor, *, block: int = 256) -> None:
    """Hand the last ``r[l', b, h]`` (emptied) high pages of each head of ``layers`` to its low
    side, newest low pages first in the order they were high (LeanKV Fig. 5: a downgrade reuses the
    pages it empties), in one launch and with no host read. ``layers`` int ``[L']`` (distinct),
    ``r`` int ``[L', B, H]`` with ``0 <= r <= n_pages[HIGH]``. Kernel path of
    :meth:`leankit.page_table.BidirectionalPageTable.move_tail`."""
    _check_tables(table)
    n_layers, batch, heads = table.tables.shape[:3]
    if r.shape != (layers.numel(), batch, heads):
        raise ValueError(f"r must be [{layers.numel()}, {batch}, {heads}], got {tuple(r.shape)}")
    if r.numel() == 0:
        return
    kernel_for(_move_tail_kernel, r.device)[(r.numel(),)](
        layers.contiguous(), r.contiguous(), table.n_pages, table.tables, n_layers * batch * heads, batch * heads,
        table.row_len, BLOCK=block, num_warps=4)


def plan_tier_pages(table, layers: torch.Tensor, lens: torch.Tensor, tokens: tuple[int, ...],
                    reserve: torch.Tensor | None = None, *, block: int = 256):
    """Kernel path of :meth:`leankit.page_table.BidirectionalPageTable.tier_plan` (one launch, no
    host read): the pages each tier of the heads of ``layers`` needs for ``lens`` ``[tiers, L', B,
    H]`` tokens (last three dims contiguous), the surplus high pages the low side takes over and the
    grant. Returns ``(need int64 [2, L', B, H], r int64 [L', B, H], extra int32 [2, L, B, H])``.
    """
    _check_tables(table)
    n_layers, batch, heads = table.tables.shape[:3]
    tiers = len(tokens)
    if lens.shape != (tiers, layers.numel(), batch, heads) or not lens[0].is_contiguous():
        raise ValueError(f"lens must be [{tiers}, {layers.numel()}, {batch}, {heads}] with its last three dims "
                         f"contiguous, got {tuple(lens.shape)}")
    if reserve is not None and reserve.shape != (batch,):
        raise ValueError(f"reserve must be [{batch}], got {tuple(reserve.shape)}")
    dev = lens.device
    n = layers.numel() * batch * heads
    need = torch.empty((2, layers.numel(), batch, heads), dtype=torch.int64, device=dev)
    r = torch.empty((layers.numel(), batch, heads), dtype=torch.int64, device=dev)
    extra = torch.zeros_like(table.n_pages)
    if n:
        res = reserve.contiguous() if reserve is not None else r
        kernel_for(_tier_plan_kernel, dev)[(cdiv(n, block),)](
            layers.contiguous(), lens, lens.stride(0) if tiers > 1 else 0, res, table.n_pages, need, r, extra, n,
            n_layers * batch * heads, batch * heads, heads, tokens[0], tokens[-1], HAS_RES=reserve is not None,
            TWO=tiers > 1, BLOCK=block, num_warps=4)
    return need, r, extra
