"""Bidirectional page table (LeanKV §5.2) over every (layer, sequence, KV head).

One fixed-length row per (layer, sequence, head): high-precision page ids grow from the left
(columns ``0, 1, ...``) and low-precision ids from the right (columns ``R-1, R-2, ...``), so a
single row of ``R = ceil(max_seq_len / min(T_high, T_low)) + 1`` entries serves both tiers (the
two ends never meet, whichever tier's page holds fewer tokens: a low tier with a small
``low_group_size`` can; the ``+1`` covers the two partially filled tail pages).

Tokens of a tier are kept dense: tier ``t`` of a head holds ``lens[t]`` tokens in slots
``0 .. lens[t]-1``, slot ``s`` living at offset ``s % T_t`` of the page in column
``s // T_t`` (high) or ``R - 1 - s // T_t`` (low). Removing a token moves the tier's last token
into its slot, so pruning frees memory for real instead of masking it.

All growth and recycling for a step is one :meth:`FreePageList.allocate` /
:meth:`FreePageList.release` call covering every (tier, layer, sequence, head): no Python loop
over heads.

**ACT pages** (:class:`ActPageTable`) are indexed by (layer, sequence), one row each, not per
head: an activation block is the input of the whole layer, and recomputing it yields the K/V of
every KV head at once (one GEMM against the stacked weights), so a per-head row would store the
same bytes ``H`` times or point ``H`` entries at one page. A row lists the ACT pages of its
sequence block by block: a block is ``T`` consecutive ACT tokens split into ``S`` channel slices,
so ACT slot ``s`` (the ``s``-th ACT token of the row) lives in row ``s % T`` of the pages in
columns ``(s // T) * S .. (s // T) * S + S - 1``. ACT tokens are appended in order and never
moved (no per-head pruning applies to them), which keeps this a plain left-to-right row; the
pages come from the same :class:`~leankit.allocator.FreePageList` as KV pages.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import native
from .allocator import FreePageList, PoolExhausted, exclusive_cumsum
from .backend import use_triton

HIGH, LOW = 0, 1


def ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    """``ceil(a / b)`` elementwise for an int tensor ``a``: the pages that hold ``a`` tokens, ``b`` to a page."""
    return -torch.div(-a, b, rounding_mode="floor")


class LayerViews(NamedTuple):
    """Views of one layer of a :class:`BidirectionalPageTable` (they share its storage)."""

    tables: torch.Tensor  # int32 [B, H, R]
    n_pages: torch.Tensor  # int32 [2, B, H]
    lens: torch.Tensor  # int32 [2, B, H]
    tier_lens: tuple  # lens[t] per tier: int32 [B, H] each


class BidirectionalPageTable:
    """Per-(layer, sequence, head) page rows plus per-tier token and page counts.

    Attributes:
        tables: int32 ``[L, B, H, R]`` page ids, ``-1`` where empty.
        n_pages: int32 ``[2, L, B, H]`` pages owned per tier (high, low).
        lens: int32 ``[2, L, B, H]`` tokens stored per tier.
    """

    def __init__(self, num_layers: int, batch: int, heads: int, row_len: int, device):
        self.row_len = row_len
        self.tables = torch.full((num_layers, batch, heads, row_len), -1, dtype=torch.int32, device=device)
        self.n_pages = torch.zeros((2, num_layers, batch, heads), dtype=torch.int32, device=device)
        self.lens = torch.zeros((2, num_layers, batch, heads), dtype=torch.int32, device=device)
        self._views: tuple = ((), {})  # (the tensors the memo was cut from, {layer: LayerViews})

    def __getstate__(self) -> dict:
        # pickle keeps the tables' identity but not the memoized views' storage sharing: unpickled,
        # the views would be copies, and writes through them would miss the tables. Cut them afresh.
        state = dict(self.__dict__)
        state["_views"] = ((), {})
        return state

    def layer_views(self, layer: int) -> LayerViews:
        """One layer's views of the table (:class:`LayerViews`), memoized.

        A decode step slices the same layer out of the same three tensors in every launcher of
        every layer (a few microseconds of host time each); the views are cut once and reused for
        as long as ``tables``, ``n_pages`` and ``lens`` are the tensors they were cut from (the
        memo starts over when any of them is replaced, e.g. by :meth:`select_sequences`)."""
        src, memo = self._views
        if len(src) != 3 or src[0] is not self.tables or src[1] is not self.n_pages or src[2] is not self.lens:
            src, memo = (self.tables, self.n_pages, self.lens), {}
            self._views = (src, memo)
        views = memo.get(layer)
        if views is None:
            lens = self.lens[:, layer]
            views = memo[layer] = LayerViews(self.tables[layer], self.n_pages[:, layer], lens, tuple(lens.unbind(0)))
        return views

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, batch, heads)``."""
        return tuple(self.tables.shape[:3])

    def nbytes(self) -> int:
        """Metadata bytes: the table rows plus the per-tier counters."""
        return sum(t.numel() * t.element_size() for t in (self.tables, self.n_pages, self.lens))

    @staticmethod
    def column(tier: int | torch.Tensor, j: torch.Tensor, row_len: int) -> torch.Tensor:
        """Column of the ``j``-th page of ``tier``: from the left for high, from the right for low."""
        if isinstance(tier, int):
            return j if tier == HIGH else row_len - 1 - j
        return torch.where(tier == HIGH, j, row_len - 1 - j)

    def tier_columns(self, tier: int) -> tuple[int, int]:
        """``(first_col, col_step)``: the page of rank ``j`` of ``tier`` sits in column
        ``first_col + col_step * j`` of a row (:meth:`column`: high pages from the left, low pages
        from the right), the form the compiled kernels walk a row in."""
        first = int(self.column(tier, 0, self.row_len))
        return first, int(self.column(tier, 1, self.row_len)) - first

    # ------------------------------------------------------------------ growth
    def grow(self, extra: torch.Tensor, free_list: FreePageList,
             status: torch.Tensor | None = None, taken: int | None = None) -> torch.Tensor | None:
        """Give every (tier, layer, seq, head) ``extra[t, l, b, h]`` more pages in one allocation.

        Raises :class:`~leankit.allocator.PoolExhausted` (nothing changed) if the pool is short,
        and ``ValueError`` if a row would overflow (sequence longer than ``max_seq_len``).

        ``status`` (kernel backend only): a deferred grant that reads nothing back to the host; a
        short pool is recorded in ``status`` instead of raised (see
        :func:`leankit_kernels.page_alloc.grow_pages`). The caller guarantees that no row overflows.
        Returns the grant's device bool ``ok`` then, else None. ``taken``: a host bound on
        ``extra.sum()`` for the free list's lower bound on its free pages (None: unknown).
        """
        if extra.shape != self.n_pages.shape:  # a demand that broadcast would count pages it never gave
            raise ValueError(f"extra must be shaped like n_pages {tuple(self.n_pages.shape)}, got {tuple(extra.shape)}")
        extra = extra.to(torch.int32)
        if status is not None:
            from leankit_kernels.page_alloc import grow_pages

            return grow_pages(self, extra, free_list, status=status, taken=taken)
        compiled = self._compiled(free_list)
        if compiled is not None:  # the same ids in the same columns, in one pass (native/page_grants.c)
            code, total = compiled.grant_pages(self.tables, self.n_pages, extra.contiguous(), free_list.ring,
                                               free_list.free_head, free_list.free_tail)
            self._take_grant(code, total, free_list)
            return None
        # One host read: the total, the row check and (if a deferred kernel moved them) the free
        # list's device counters.
        stale = free_list.stale
        parts = [extra.sum(dtype=torch.int64).view(1),
                 self._overflows(extra).long().view(1), (extra < 0).any().long().view(1)]
        values = torch.cat(parts + ([free_list.counters] if stale else [])).tolist()
        if stale:
            free_list.load(*values[3:])
        total, overflow, negative = values[0], values[1], values[2]
        if negative:  # the prefix sum would hand the same pages out twice
            raise ValueError(self._NEGATIVE)
        if total == 0:
            return
        if overflow:
            raise ValueError(self._OVERFLOW.format(self.row_len))
        if use_triton(self.tables):  # Triton backend: one prefix-sum launch (leankit_kernels.page_alloc)
            from leankit_kernels.page_alloc import grow_pages

            grow_pages(self, extra, free_list, total=total)
            return
        ids, offsets = free_list.allocate(extra)
        flat_extra = extra.reshape(-1).long()
        owner = torch.repeat_interleave(torch.arange(flat_extra.numel(), device=ids.device), flat_extra)
        j_in_owner = torch.arange(ids.numel(), device=ids.device) - offsets[owner]
        tier, rest = owner // self.lens[0].numel(), owner % self.lens[0].numel()
        j = self.n_pages.reshape(-1)[owner].long() + j_in_owner
        col = self.column(tier, j, self.row_len)
        self.tables.view(-1, self.row_len)[rest, col] = ids.to(torch.int32)
        self.n_pages += extra

    def token_demand(self, n_new: torch.Tensor, tokens_per_page: int) -> torch.Tensor:
        """Pages each head's high tier lacks to hold its stored tokens plus its row's ``n_new[b]``
        new ones (``tokens_per_page`` to a high page): int32 ``[2, L, B, H]``, the low tier's 0.

        A step's new tokens go to the high tier first (LeanKV §5.3 reserves their room before any
        layer stores); :func:`leankit_kernels.page_alloc.grant_token_pages` computes the same
        demand inside its grant.
        """
        need = ceil_div(self.lens[HIGH] + n_new.view(1, -1, 1).to(self.lens.dtype), tokens_per_page)
        extra = torch.zeros_like(self.n_pages)
        extra[HIGH] = (need - self.n_pages[HIGH]).clamp_min(0)
        return extra

    def grant_tokens(self, n_new: torch.Tensor, tokens_per_page: int, free_list: FreePageList,
                     status: torch.Tensor, taken: int | None = None) -> None:
        """The deferred :meth:`grow` of ``token_demand(n_new, tokens_per_page)`` (kernel backend):
        one launch computes the demand and grants it with no host read; a short pool is recorded
        in ``status`` and the grant refused whole. The caller guarantees that no row overflows."""
        from leankit_kernels.page_alloc import grant_token_pages

        grant_token_pages(self, n_new, tokens_per_page, free_list, status, taken=taken)

    def _compiled(self, free_list) -> native.Kernels | None:
        """The compiled kernels that grant and recycle this table's pages in place in the ring of
        ``free_list`` (a CPU table, a plain :class:`FreePageList`), else None: the torch path, or the
        kernel backend, or a free list that hands out ids of its own (the offload window's)."""
        if use_triton(self.tables) or type(free_list) is not FreePageList:
            return None
        return native.kernels_for(self.tables.device)

    _OVERFLOW = "a sequence outgrew its page-table row ({} pages): raise max_seq_len of the LeanCache"
    _NEGATIVE = "a page demand is negative: grow only adds pages (shrink gives them back)"

    def _take_grant(self, code: int, pages: int, free_list: FreePageList) -> None:
        """Close a compiled grant: where ``code`` is 0 advance the free list's head past the
        ``pages`` ids it took from the ring, else raise what ``code`` means, in the torch path's
        words (the grant changed nothing)."""
        if code == native.NEGATIVE_DEMAND:
            raise ValueError(self._NEGATIVE)
        if code == native.ROW_FULL:
            raise ValueError(self._OVERFLOW.format(self.row_len))
        if code == native.POOL_SHORT:
            raise PoolExhausted(pages, free_list.num_free, free_list.capacity)
        native.Kernels._check_result(code, "grant_pages")
        if pages:
            free_list.took(pages)

    def _overflows(self, extra: torch.Tensor) -> torch.Tensor:
        """Device bool: granting ``extra[t, l, b, h]`` pages would make some head outgrow its row."""
        return ((self.n_pages + extra).sum(0) > self.row_len).any()

    def check_rows(self, extra: torch.Tensor) -> None:
        """Raise ``ValueError`` if granting ``extra[t, l, b, h]`` pages would make any head outgrow its
        page-table row (one host read); :meth:`grow` makes the same check as it grants."""
        if bool(self._overflows(extra)):
            raise ValueError(self._OVERFLOW.format(self.row_len))

    def tier_plan(self, layers: torch.Tensor, lens: torch.Tensor, tokens: tuple[int, ...],
                  reserve: torch.Tensor | None = None):
        """The page accounting of a re-tiering (LeanKV §5.3 and Fig. 5): for every head of ``layers``
        that will hold ``lens[t]`` tokens in tier ``t`` (plus ``reserve[b]`` high slots),

        * ``need[t] = ceil(tokens_t / T_t)`` pages, ``T_t`` = ``tokens[t]`` per page;
        * ``r = min((cur_h - need_h)+, (need_l - cur_l)+)`` high pages the low side takes over once
          they are empty (``cur_t`` the pages it owns; :meth:`move_tail`);
        * ``extra``, the grant for :meth:`grow`: ``(need_h - cur_h)+`` high and
          ``(need_l - cur_l - r)+`` low pages, zero outside ``layers``.

        ``layers`` int ``[L']`` (distinct), ``lens`` int ``[tiers, L', B, H]``, ``tokens`` one count
        per tier (a single tier needs and gets no low pages), ``reserve`` int ``[B]`` or None.
        Returns ``(need int64 [2, L', B, H], r int64 [L', B, H], extra int32 [2, L, B, H])``. On the
        kernel backend one launch (:func:`leankit_kernels.page_alloc.plan_tier_pages`); no host read
        either way.
        """
        if use_triton(self.tables):
            from leankit_kernels.page_alloc import plan_tier_pages

            return plan_tier_pages(self, layers, lens, tokens, reserve)
        compiled = native.kernels_for(self.tables.device)
        if compiled is not None:  # one pass over the heads (native/page_grants.c)
            return compiled.plan_pages(self.tables, self.n_pages, layers.long().contiguous(),
                                       lens.long().contiguous(), tokens,
                                       None if reserve is None else reserve.reshape(-1).long().contiguous())
        len_h = lens[HIGH].long() + (0 if reserve is None else reserve.view(1, -1, 1).long())
        need_h = ceil_div(len_h, tokens[0])
        two = len(tokens) > 1
        need_l = ceil_div(lens[LOW].long(), tokens[1]) if two else torch.zeros_like(need_h)
        cur_h = self.n_pages[HIGH].index_select(0, layers).long()
        cur_l = self.n_pages[LOW].index_select(0, layers).long() if two else torch.zeros_like(need_h)
        r = torch.minimum((cur_h - need_h).clamp_min(0), (need_l - cur_l).clamp_min(0))
        extra = torch.zeros_like(self.n_pages)
        extra[HIGH, layers] = (need_h - cur_h).clamp_min(0).to(extra.dtype)
        extra[LOW, layers] = (need_l - cur_l - r).clamp_min(0).to(extra.dtype)
        return torch.stack([need_h, need_l]), r, extra

    def fit(self, layers: torch.Tensor, lens: torch.Tensor, tokens: tuple[int, ...], free_list: FreePageList,
            reserve: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`tier_plan`, then its grant (:meth:`move_tail`, then :meth:`grow`), in one compiled
        call on a CPU (``native/page_grants.c``): the same ids in the same columns. Returns ``need``
        as :meth:`tier_plan` does, or None, having done nothing, where the compiled kernels do not
        take it (:meth:`_compiled`; the caller plans and grants in steps). Raises as :meth:`grow`
        does (``ValueError`` for a row that would overflow,
        :class:`~leankit.allocator.PoolExhausted` for a short pool), with nothing changed."""
        compiled = self._compiled(free_list)
        if compiled is None:
            return None
        code, total, need = compiled.fit_pages(self.tables, self.n_pages, layers.long().contiguous(),
                                               lens.long().contiguous(), tokens,
                                               None if reserve is None else reserve.reshape(-1).long().contiguous(),
                                               free_list.ring, free_list.free_head, free_list.free_tail)
        self._take_grant(code, total, free_list)
        return need

    def move_tail(self, layers: torch.Tensor, r: torch.Tensor) -> None:
        """Hand the last ``r[l', b, h]`` (emptied) high pages of each head of ``layers`` to its low
        side, newest low pages first in the order they were high (LeanKV Fig. 5: a downgrade reuses
        the pages it empties). ``layers`` int ``[L']`` (distinct), ``0 <= r <= n_pages[HIGH]``.

        On the kernel backend one launch with no host read
        (:func:`leankit_kernels.page_alloc.move_tail_pages`); the torch path reads the total once.
        """
        if use_triton(self.tables):
            from leankit_kernels.page_alloc import move_tail_pages

            move_tail_pages(self, layers, r)
            return
        compiled = native.kernels_for(self.tables.device)
        if compiled is not None:  # one pass over the heads (native/page_grants.c)
            compiled.move_tail(self.tables, self.n_pages, layers.long().contiguous(), r.long().contiguous())
            return
        total = int(r.sum())
        if total == 0:
            return
        flat = r.reshape(-1).long()
        owner = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat)
        i = torch.arange(total, device=flat.device) - exclusive_cumsum(flat)[owner]
        li, bi, hi = torch.unravel_index(owner, r.shape)
        lay = layers[li]
        cur_h = self.n_pages[HIGH][lay, bi, hi].long()
        cur_l = self.n_pages[LOW][lay, bi, hi].long()
        src = self.column(HIGH, cur_h - 1 - i, self.row_len)
        dst = self.column(LOW, cur_l + i, self.row_len)
        ids = self.tables[lay, bi, hi, src].clone()
        # Clear before writing: the moved high columns and the new low columns may overlap (the
        # final high and low extents never do, since a row's pages never exceed its length).
        self.tables[lay, bi, hi, src] = -1
        self.tables[lay, bi, hi, dst] = ids
        self.n_pages[HIGH, layers] -= r.to(self.n_pages.dtype)
        self.n_pages[LOW, layers] += r.to(self.n_pages.dtype)

    def shrink(self, keep: torch.Tensor, free_list: FreePageList, defer: bool = False) -> torch.Tensor | int | None:
        """Recycle pages so that tier ``t`` of each head keeps ``keep[t, l, b, h]`` pages.

        The pages past ``keep`` (the tail of each side) return to the free list in one
        prefix-sum-ordered release. Returns the number of pages freed.

        ``defer`` (kernel backend only): release without reading anything back to the host; the
        free list's device tail advances and its host counters catch up at their next read
        (:func:`leankit_kernels.page_alloc.shrink_pages`). Returns None then.
        """
        keep = torch.minimum(keep.to(torch.int32), self.n_pages)
        if defer and use_triton(self.tables):
            from leankit_kernels.page_alloc import shrink_pages

            return shrink_pages(self, keep, free_list, defer=True)
        compiled = self._compiled(free_list)
        if compiled is not None:  # the same ids back in the same order, in one pass (native/page_grants.c)
            freed = compiled.recycle_pages(self.tables, self.n_pages, keep.contiguous(), free_list.ring,
                                           free_list.free_head, free_list.free_tail)
            if freed:
                free_list.returned(freed)
            return freed
        drop = (self.n_pages - keep).reshape(-1).long()
        total = int(drop.sum())
        if total == 0:
            return 0
        if use_triton(self.tables):  # Triton backend: one prefix-sum launch (leankit_kernels.page_alloc)
            from leankit_kernels.page_alloc import shrink_pages

            return shrink_pages(self, keep, free_list)
        offsets = exclusive_cumsum(drop)
        owner = torch.repeat_interleave(torch.arange(drop.numel(), device=drop.device), drop)
        j = keep.reshape(-1)[owner].long() + torch.arange(total, device=drop.device) - offsets[owner]
        tier, rest = owner // self.lens[0].numel(), owner % self.lens[0].numel()
        col = self.column(tier, j, self.row_len)
        rows = self.tables.view(-1, self.row_len)
        ids = rows[rest, col].clone()
        rows[rest, col] = -1
        free_list.release(ids)
        self.n_pages.copy_(keep)
        return total

    def settle(self, layers: torch.Tensor, lens: torch.Tensor, need: torch.Tensor, free_list: FreePageList) -> int | None:
        """The end of a re-tiering of ``layers`` in one compiled call on a CPU
        (``native/page_grants.c``): their token counts set to ``lens`` and every page past ``need``
        (both ``[2, L', B, H]``) recycled, as ``lens.index_copy_`` then :meth:`shrink` of the same
        pages would (the same ids back in the same order). Returns the pages freed, or None, having
        done nothing, where the compiled kernels do not take it (:meth:`_compiled`)."""
        compiled = self._compiled(free_list)
        if compiled is None:
            return None
        freed = compiled.settle_pages(self.tables, self.n_pages, self.lens, layers.long().contiguous(),
                                      lens.long().contiguous(), need.long().contiguous(), free_list.ring,
                                      free_list.free_head, free_list.free_tail)
        if freed:
            free_list.returned(freed)
        return freed

    def release_sequences(self, seq_mask: torch.Tensor, free_list: FreePageList, defer: bool = False) -> int | None:
        """Return every page of the sequences where ``seq_mask[b]`` is true (finished requests).

        Returns the pages freed; with ``defer``, None (see :meth:`shrink`: nothing is read back).
        On the kernel backend a deferred release is one launch
        (:func:`leankit_kernels.page_alloc.release_rows`)."""
        if defer and use_triton(self.tables):
            from leankit_kernels.page_alloc import release_rows

            release_rows(self, seq_mask.bool(), free_list)
            return None
        keep = torch.where(seq_mask.view(1, 1, -1, 1), torch.zeros_like(self.n_pages), self.n_pages)
        freed = self.shrink(keep, free_list, defer=defer)
        self.lens.masked_fill_(seq_mask.view(1, 1, -1, 1), 0)
        return freed

    # ------------------------------------------------------------------ lookup
    def locate(self, tier: int, layer: int, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor,
               tokens_per_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_id, offset)`` of slot ``slot`` of tier ``tier`` for heads ``(layer, b, h)``."""
        col = self.column(tier, slot.long() // tokens_per_page, self.row_len)
        page = self.tables[layer][b.long(), h.long(), col]
        return page, slot % tokens_per_page

    def tier_pages(self, tier: int, layer: int, start: int = 0, count: int | None = None):
        """Page ids of ``tier`` for all (seq, head) of ``layer``, in tier order.

        Returns ``(ids [B, H, P], valid [B, H, P])`` covering tier pages ``start .. start+P-1``
        (``P`` = the largest count over heads when ``count`` is None). Invalid entries hold 0.
        """
        n = self.n_pages[tier, layer]
        if count is None:
            count = max(int(n.max()) - start, 0) if n.numel() else 0
        j = torch.arange(start, start + count, device=n.device)
        col = self.column(tier, j, self.row_len)
        ids = self.tables[layer][:, :, col]
        valid = j.view(1, 1, -1) < n.unsqueeze(-1)
        return torch.where(valid, ids, torch.zeros_like(ids)), valid

    def select_sequences(self, index: torch.Tensor) -> None:
        """Keep/reorder sequences by ``index`` (no page copies; callers guarantee exclusivity)."""
        self.tables = self.tables.index_select(1, index)
        self.n_pages = self.n_pages.index_select(2, index)
        self.lens = self.lens.index_select(2, index)


class ActPageTable:
    """ACT page rows, one per (layer, sequence) (see the module docstring).

    Attributes:
        slices, tokens: ``S`` pages per block and ``T`` tokens per page (from the ACT layout).
        tables: int32 ``[L, B, R]`` page ids, ``-1`` where empty (``R`` = blocks x ``S``).
        n_pages: int32 ``[L, B]`` pages owned (``S`` per block, filled from the left);
        ``n_blocks`` (``n_pages / S``) the blocks owned; ``lens``: int32 ``[L, B]`` ACT tokens stored.
    """

    def __init__(self, num_layers: int, batch: int, max_tokens: int, slices: int, tokens: int, device):
        self.slices, self.tokens = slices, tokens
        self.row_len = -(-max_tokens // tokens) * slices
        self.tables = torch.full((num_layers, batch, self.row_len), -1, dtype=torch.int32, device=device)
        # Pages, not blocks: the prefix-sum grant (leankit_kernels.page_alloc) counts pages per row.
        self.n_pages = torch.zeros((num_layers, batch), dtype=torch.int32, device=device)
        self.lens = torch.zeros((num_layers, batch), dtype=torch.int32, device=device)

    @property
    def n_blocks(self) -> torch.Tensor:
        """int32 ``[L, B]`` blocks owned per row."""
        return self.n_pages // self.slices

    def nbytes(self) -> int:
        """Metadata bytes: the rows plus the counters."""
        return sum(t.numel() * t.element_size() for t in (self.tables, self.n_pages, self.lens))

    def blocks_needed(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Extra blocks ``[L, B]`` each row needs to append ``new_tokens[l, b]`` more ACT tokens."""
        total = self.lens + new_tokens.to(torch.int32)
        return (torch.div(total + self.tokens - 1, self.tokens, rounding_mode="floor") - self.n_blocks).clamp_min(0)

    def grow(self, extra_blocks: torch.Tensor, free_list: FreePageList,
             status: torch.Tensor | None = None, taken: int | None = None) -> torch.Tensor | None:
        """Give row ``(l, b)`` ``extra_blocks[l, b]`` more blocks (``S`` pages each) in one allocation.

        Raises :class:`~leankit.allocator.PoolExhausted` (nothing changed) if the pool is short,
        ``ValueError`` if a row would overflow.

        ``status`` (kernel backend only): the deferred grant of
        :meth:`BidirectionalPageTable.grow`: one prefix-sum launch that reads nothing back (a short
        pool is recorded in ``status`` and the grant refused whole); returns its device bool ``ok``.
        The caller guarantees that no row overflows; ``taken`` is a host bound on the pages granted.
        """
        extra = extra_blocks.to(torch.int32) * self.slices  # pages
        if status is not None:
            from leankit_kernels.page_alloc import grow_pages

            return grow_pages(self, extra, free_list, status=status, taken=taken, tiers=1)
        if int(extra.sum()) == 0:
            return None
        if bool(((self.n_pages + extra) > self.row_len).any()):
            raise ValueError(f"a sequence outgrew its ACT row ({self.row_len // self.slices} blocks)")
        pages = extra.reshape(-1)
        ids, offsets = free_list.allocate(pages)
        owner = torch.repeat_interleave(torch.arange(pages.numel(), device=ids.device), pages.long())
        col = self.n_pages.reshape(-1)[owner].long() + torch.arange(ids.numel(), device=ids.device) - offsets[owner]
        self.tables.view(-1, self.row_len)[owner, col] = ids.to(torch.int32)
        self.n_pages += extra
        return None

    def shrink_to_lens(self, free_list: FreePageList) -> int:
        """Return the blocks past the ones each row's ACT tokens fill (a dropped step's grant);
        returns the pages freed. Reads the device (an error path, not a step's)."""
        keep = torch.minimum(ceil_div(self.lens, self.tokens) * self.slices, self.n_pages)
        past = torch.arange(self.row_len, device=self.tables.device) >= keep.unsqueeze(-1)
        drop = past & (self.tables >= 0)
        ids = self.tables[drop]
        if ids.numel():
            free_list.release(ids)
            self.tables[drop] = -1
        self.n_pages.copy_(keep)
        return int(ids.numel())

    def locate(self, layer: int, b: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page ids [n, S], row [n])`` of ACT slots ``slot`` of sequences ``b`` in ``layer``."""
        slot = slot.reshape(-1).long()
        col = (slot // self.tokens * self.slices)[:, None] + torch.arange(self.slices, device=slot.device)
        return self.tables[layer][b.reshape(-1).long()[:, None], col], slot % self.tokens

    def release_sequences(self, seq_mask: torch.Tensor, free_list: FreePageList, defer: bool = False) -> int | None:
        """Return every ACT page of the sequences where ``seq_mask[b]`` is true; returns the count.

        ``defer`` (kernel backend only): one prefix-sum release that reads nothing back to the host
        (:func:`leankit_kernels.page_alloc.release_rows`, token counts zeroed in the same launch);
        returns None."""
        if defer:
            from leankit_kernels.page_alloc import release_rows

            release_rows(self, seq_mask.bool(), free_list, tiers=1)
            return None
        rows = self.tables[:, seq_mask.bool()]
        ids = rows[rows >= 0]
        if ids.numel():
            free_list.release(ids)
        self.tables[:, seq_mask.bool()] = -1
        self.n_pages[:, seq_mask.bool()] = 0
        self.lens[:, seq_mask.bool()] = 0
        return int(ids.numel())
