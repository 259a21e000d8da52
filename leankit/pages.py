"""Unified paging (LeanKV §5.2): one byte pool, pages parsed by the precision they hold.

Every page is ``page_size`` bytes. A page holds tokens of a single precision tier, laid out as
six segments, each starting on a 16-byte boundary::

    [ K data  | K meta | V data  | V meta | scores | positions ]
      T x Kb    T x Km   T x Vb    T x Vm   T x 2    T x 4        (bytes)

* ``K data``/``V data``: token-major rows, one row of ``Kb = head_dim * k_bits / 8`` bytes per
  token (packed codes, see :mod:`leankit.quant`), or the raw bytes of the model dtype when the
  side is unquantized. A page's key segment is one contiguous ``[T, Kb]`` tile: a Triton program
  that loads the whole tile issues fully coalesced 128-bit loads. (LeanKV's CUDA kernel
  interleaves ``[F/(Kvec*Kgroup), N, Kgroup, Kvec]`` so each *thread group* reads contiguous
  vectors; a Triton program reads the whole tile at once, so the token-major tile already is
  contiguous per program, and it is exactly the ``[BLOCK_N, F]`` operand ``tl.dot`` wants.)
* ``K meta``/``V meta``: per token, ``G`` pairs of fp16 ``(scale, min)``, one per group.
* ``scores``: fp16 running significance per token (LeanKV §4, written by attention).
* ``positions``: int32 absolute position per token (for causal masking and the recent window).

The number of tokens per page ``T`` follows from the precision, so a K4V2 page holds about
twice the tokens of a K8V4 page.

**ACT pages** (HybridServe §3.3, CAPTURE; :class:`ActLayout`) are a second page kind in the same
pool: instead of one head's K/V they hold a layer's *input activations* (the hidden state before
the input norm) in the model dtype, from which :mod:`leankit.recompute` rebuilds the K/V of every
KV head of the layer. A token's ``hidden`` values are split into ``S`` equal channel slices
(:func:`leankit.config.act_geometry` picks ``S`` to waste the fewest page bytes), and a page
holds slice ``s`` of ``T`` consecutive tokens as two 16-byte-aligned segments::

    [ values     | positions ]
      T x C x isz  T x 4        (bytes; C = hidden / S channels, isz = model dtype size)

Every page carries its tokens' int32 positions, so each page is self-describing like a KV page
(the copy in slice 0 is the one read back). Because one ACT block serves all KV heads, ACT pages
are indexed by (layer, sequence), not by (layer, sequence, head): see
:class:`leankit.page_table.ActPageTable`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native
from .config import PAGE_ALIGN, ActGeometry, KVConfig, Precision, _align, act_geometry
from .quant import META_DTYPE, check_finite, codes_per_byte, dequantize, quantize

SEGMENTS = ("k_data", "k_meta", "v_data", "v_meta", "score", "position")


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one page at one precision tier.

    Attributes:
        precision: the tier's key/value bits.
        head_dim, group_size: channels per head and per quantization group.
        page_size: bytes per page.
        dense_dtype: dtype of unquantized sides (the model dtype).
        tokens: tokens per page ``T``.
        seg_bytes: bytes per token of each segment, in :data:`SEGMENTS` order.
        seg_offsets: byte offset of each segment inside the page.
    """

    precision: Precision
    head_dim: int
    group_size: int
    page_size: int
    dense_dtype: torch.dtype
    tokens: int
    seg_bytes: tuple[int, ...]
    seg_offsets: tuple[int, ...]

    def __hash__(self) -> int:
        # Kernel launchers look their constants up by layout at every launch: hash the fields once.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.precision, self.head_dim, self.group_size, self.page_size, self.dense_dtype,
                      self.tokens, self.seg_bytes, self.seg_offsets))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # the memoized hash is this process's (dtype hashes differ between processes): not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @classmethod
    def build(cls, cfg: KVConfig, tier: int, head_dim: int, dense_dtype: torch.dtype) -> PageLayout:
        """Lay out tier ``tier`` of ``cfg`` for heads of ``head_dim`` channels."""
        itemsize = torch.empty((), dtype=dense_dtype).element_size()
        tb = cfg.token_bytes(head_dim, tier, itemsize)
        t = cfg.tokens_per_page(head_dim, tier, itemsize)
        sizes = (tb.k_data, tb.k_meta, tb.v_data, tb.v_meta, tb.score, tb.position)
        offsets, off = [], 0
        for s in sizes:
            offsets.append(off)
            off += _align(t * s, PAGE_ALIGN)
        assert off <= cfg.page_size
        return cls(cfg.tiers[tier], head_dim, cfg.tier_group_size(tier) or head_dim, cfg.page_size, dense_dtype, t,
                   tuple(sizes), tuple(offsets))

    @property
    def groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over all six segments (no page padding)."""
        return sum(self.seg_bytes)

    def offset(self, segment: str) -> int:
        return self.seg_offsets[SEGMENTS.index(segment)]

    # -------------------------------------------------------------- encode / decode
    def _encode_side(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        if bits >= 16:
            check_finite(x)  # quantized sides catch NaN/Inf through their group metadata
            data = x.to(self.dense_dtype).contiguous().view(torch.uint8).reshape(n, -1)
            return data, x.new_empty((n, 0), dtype=torch.uint8)
        packed, scale, mn = quantize(x, bits, self.group_size)
        meta = torch.stack((scale, mn), dim=-1).contiguous().view(torch.uint8).reshape(n, -1)
        return packed, meta

    def encode(self, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, position: torch.Tensor):
        """Turn ``n`` tokens (``k``, ``v``: ``[n, head_dim]``) into the six per-token byte rows."""
        kd, km = self._encode_side(k, self.precision.k_bits)
        vd, vm = self._encode_side(v, self.precision.v_bits)
        sc = score.to(torch.float16).reshape(-1, 1).view(torch.uint8)
        pos = position.to(torch.int32).reshape(-1, 1).view(torch.uint8)
        return kd, km, vd, vm, sc, pos

    def segment(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """View segment ``name`` of gathered pages ``[..., page_size]`` as ``[..., T, bytes]``."""
        i = SEGMENTS.index(name)
        off, nb = self.seg_offsets[i], self.seg_bytes[i]
        return pages[..., off: off + self.tokens * nb].unflatten(-1, (self.tokens, nb))

    def _decode_side(self, pages: torch.Tensor, side: str, bits: int, dtype: torch.dtype) -> torch.Tensor:
        return self.decode_side(self.segment(pages, f"{side}_data"), self.segment(pages, f"{side}_meta"), bits, dtype)

    def decode_side(self, data: torch.Tensor, meta: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize one side's byte rows: ``data`` ``[..., Kb]`` and ``meta`` ``[..., 4G]`` uint8."""
        if bits >= 16:
            return data.contiguous().view(self.dense_dtype).to(dtype)
        meta = meta.contiguous().view(META_DTYPE).unflatten(-1, (self.groups, 2))
        return dequantize(data, meta[..., 0], meta[..., 1], bits, dtype)

    def decode(self, pages: torch.Tensor, dtype: torch.dtype = torch.float32):
        """Dequantize gathered pages ``[..., page_size]`` into ``(k, v, score, position)``.

        ``k``/``v`` are ``[..., T, head_dim]``; ``score`` fp32 and ``position`` int32 are ``[..., T]``.
        """
        k = self._decode_side(pages, "k", self.precision.k_bits, dtype)
        v = self._decode_side(pages, "v", self.precision.v_bits, dtype)
        return k, v, self.scores(pages), self.positions(pages)

    def scores(self, pages: torch.Tensor) -> torch.Tensor:
        """Running significance scores ``[..., T]`` (fp32) of gathered pages."""
        return self.segment(pages, "score").contiguous().view(torch.float16).squeeze(-1).float()

    def positions(self, pages: torch.Tensor) -> torch.Tensor:
        """Token positions ``[..., T]`` (int32) of gathered pages."""
        return self.segment(pages, "position").contiguous().view(torch.int32).squeeze(-1)


@dataclass(frozen=True)
class ActLayout:
    """Byte layout of an ACT page: ``T`` tokens x ``C`` channels of one slice, then ``T`` positions.

    Attributes:
        geometry: the :class:`~leankit.config.ActGeometry` (hidden, slices ``S``, channels ``C``,
            tokens ``T``, segment offsets).
        dtype: the model dtype the activations are stored in.
    """

    geometry: ActGeometry
    dtype: torch.dtype

    @classmethod
    def build(cls, hidden: int, dtype: torch.dtype, page_size: int) -> ActLayout:
        """Lay out ACT pages of ``page_size`` bytes for ``hidden``-value activations of ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(act_geometry(hidden, itemsize, page_size), dtype)

    @property
    def hidden(self) -> int:
        return self.geometry.hidden

    @property
    def slices(self) -> int:
        return self.geometry.slices

    @property
    def tokens(self) -> int:
        return self.geometry.tokens

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    def _check(self, pool: PagePool, page_ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``page_ids`` to ``[n, S]`` and ``rows`` to ``[n]`` (int64), or raise ``ValueError``."""
        if pool.page_size != self.page_size:
            raise ValueError(f"pool pages are {pool.page_size} bytes, the ACT layout expects {self.page_size}")
        rows = rows.reshape(-1).long()
        n = rows.numel()
        if page_ids.numel() != n * self.slices:
            raise ValueError(f"ACT page ids must be [n, S={self.slices}] for n={n} rows, got {tuple(page_ids.shape)}")
        return page_ids.reshape(n, self.slices).long(), rows

    def _byte_index(self, page_ids: torch.Tensor, rows: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        """Flat pool byte index ``[n, S, nbytes]`` of row ``rows`` of a segment at ``offset``."""
        start = page_ids * self.page_size + offset + rows[:, None] * nbytes
        return start[..., None] + torch.arange(nbytes, device=page_ids.device)

    def write(self, pool: PagePool, page_ids: torch.Tensor, rows: torch.Tensor, act: torch.Tensor,
              positions: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Store ``n`` activations ``act`` ``[n, hidden]`` and their positions ``[n]``.

        Token ``i``'s slice ``s`` goes to row ``rows[i]`` of page ``page_ids[i, s]``. Checks
        everything before writing, so a bad call leaves the pool unchanged.

        ``keep`` bool ``[n]``: write only these tokens, and of them only those whose pages all
        exist (ids ``>= 0``); the others may name any slot, or none. Nothing is read back to the
        host, so a kernel-backend step can list every (row, query) instead of its ACT tokens.
        """
        g = self.geometry
        page_ids, rows = self._check(pool, page_ids, rows)
        n = rows.numel()
        if act.shape != (n, g.hidden):
            raise ValueError(f"act must be [n={n}, hidden={g.hidden}], got {tuple(act.shape)}")
        if positions.reshape(-1).shape[0] != n:
            raise ValueError(f"positions must hold one entry per token ({n}), got {tuple(positions.shape)}")
        if keep is not None and keep.numel() != n:
            raise ValueError(f"keep must hold one flag per token ({n}), got {tuple(keep.shape)}")
        if n == 0:
            return
        flat = pool.storage.view(-1)
        ok = None
        if keep is not None:
            ok = keep.reshape(-1, 1).bool() & (page_ids >= 0).all(1, keepdim=True)  # [n, 1]
            page_ids = torch.where(ok, page_ids, torch.zeros_like(page_ids))  # a real page, left unchanged
        data = act.to(self.dtype).contiguous().view(torch.uint8).reshape(n, g.slices, g.row_bytes)
        _put_bytes(flat, self._byte_index(page_ids, rows, g.data_offset, g.row_bytes), data, ok)
        pos = positions.reshape(-1, 1).to(device=flat.device, dtype=torch.int32).view(torch.uint8)
        pos = pos[:, None, :].expand(n, g.slices, 4)
        _put_bytes(flat, self._byte_index(page_ids, rows, g.position_offset, 4), pos, ok)

    def read(self, pool: PagePool, page_ids: torch.Tensor, rows: torch.Tensor):
        """Read ``n`` tokens back: ``(act [n, hidden] in the model dtype, positions [n] int32)``."""
        g = self.geometry
        page_ids, rows = self._check(pool, page_ids, rows)
        n = rows.numel()
        flat = pool.storage.view(-1)
        data = flat[self._byte_index(page_ids, rows, g.data_offset, g.row_bytes).reshape(-1)]
        act = data.view(self.dtype).reshape(n, g.hidden)
        pos = flat[self._byte_index(page_ids[:, :1], rows, g.position_offset, 4).reshape(-1)]
        return act, pos.view(torch.int32).reshape(n)

    def read_blocks(self, pool: PagePool, block_ids: torch.Tensor, live: torch.Tensor | None = None):
        """Read whole blocks: ``block_ids`` ``[..., S]`` (the ``S`` slice pages of each block).

        Returns ``(act [..., T, hidden] in the model dtype, positions [..., T] int32)`` for every
        row of every block. Dead rows hold whatever bytes the page had: with ``live`` (bool
        ``[..., T]``) the rows where it is False read as zeros instead (activations and position),
        the activations in the same pass that puts the slices' channels back in hidden order. One
        gather of each page's activation bytes per block instead of a byte index per value, which is
        how attention reads a layer's ACT tokens every step.
        """
        g = self.geometry
        if pool.page_size != self.page_size:
            raise ValueError(f"pool pages are {pool.page_size} bytes, the ACT layout expects {self.page_size}")
        if block_ids.shape[-1] != g.slices:
            raise ValueError(f"ACT block ids must end in S={g.slices} slice pages, got {tuple(block_ids.shape)}")
        lead = block_ids.shape[:-1]
        if live is not None and live.shape != (*lead, g.tokens):
            raise ValueError(f"live must be {(*lead, g.tokens)} (one flag per row of each block), got {tuple(live.shape)}")
        # the activation bytes alone, gathered from the pages in place (one copy, not a page copy and a slice of it)
        data = pool.storage[:, g.data_offset: g.data_offset + g.tokens * g.row_bytes].index_select(
            0, block_ids.reshape(-1).long())
        act = data.view(self.dtype).view(*lead, g.slices, g.tokens, g.channels).movedim(-3, -2)  # [..., T, S, C]
        if live is not None:
            act = torch.where(live[..., None, None], act, torch.zeros((), dtype=act.dtype, device=act.device))
        act = act.reshape(*lead, g.tokens, g.hidden)
        pos = pool.storage[:, g.position_offset: g.position_offset + 4 * g.tokens].index_select(
            0, block_ids[..., 0].reshape(-1).long())  # every slice page holds the positions: the first one's
        pos = pos.view(torch.int32).view(*lead, g.tokens)
        if live is not None:
            pos = torch.where(live, pos, torch.zeros((), dtype=pos.dtype, device=pos.device))
        return act, pos


def _put_bytes(flat: torch.Tensor, index: torch.Tensor, data: torch.Tensor, ok: torch.Tensor | None) -> None:
    """``flat[index] = data`` (uint8 ``[n, ...]`` each), only for tokens ``i`` with ``ok[i]`` (``None``: all).

    A skipped token's index may coincide with a written token's (it names a page it does not own),
    so its byte cannot simply be written back unchanged: which of two writes to one index lands is
    unspecified. Instead every token adds ``ok * (new - old)`` (uint8 arithmetic wraps mod 256):
    a written byte becomes ``new``, a skipped one adds 0, whatever their order.
    """
    index, data = index.reshape(-1), data.reshape(-1)
    if ok is None:
        flat[index] = data
        return
    n = ok.shape[0]
    delta = (data.view(n, -1) - flat[index].view(n, -1)) * ok.to(torch.uint8)
    flat.index_put_((index,), delta.reshape(-1), accumulate=True)


# A CPU pool that must grow reserves this many times the pages asked for. Memory a process has
# never written is not backed by RAM on the usual OSes (pages are mapped on first touch), so the
# reserve costs address space only, and growing inside it is a view instead of a copy of every
# page (at 8 x 4096 tokens a grow used to copy 330 MB in the middle of a decode step). Device
# memory is committed when allocated, so a device pool grows to exactly what it is asked.
CPU_RESERVE_FACTOR = 4


# Page ids are int32 in the page table and the free list, so a pool holds at most this many pages.
MAX_PAGES = 2 ** 31 - 1


class PoolSizeError(ValueError):
    """A pool of more pages than int32 page ids can address (:data:`MAX_PAGES`)."""


def _check_page_count(num_pages: int, what: str) -> None:
    if num_pages > MAX_PAGES:
        raise PoolSizeError(f"a {what} of {num_pages} pages is more than page ids can address (int32: at most "
                            f"{MAX_PAGES} pages)")


def format_bytes(n: float, gib_digits: int = 1) -> str:
    """``n`` bytes for a person to read: whole bytes below 1 KiB, then KiB, MiB or GiB with one
    decimal (``gib_digits`` decimals in GiB, the largest unit). Every size leankit prints (the
    memory report, the CLI's lines, the offload report, pool errors) goes through it."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.{gib_digits}f} GiB"


def _allocate(make, num_pages: int, page_size: int, device, what: str) -> torch.Tensor:
    """``make()`` of a pool of ``num_pages`` pages: refused past :data:`MAX_PAGES` before anything is
    allocated (:class:`PoolSizeError`), and an allocator failure restated as the pool it was for
    (pages, bytes, device). An out-of-memory error stays one (``torch.OutOfMemoryError``), so callers
    catching it still do."""
    _check_page_count(num_pages, what)
    try:
        return make()
    except RuntimeError as err:
        cls = torch.OutOfMemoryError if isinstance(err, torch.OutOfMemoryError) else RuntimeError
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise cls(f"cannot allocate a {what} of {num_pages} pages x {page_size} B "
                  f"({format_bytes(num_pages * page_size)}) on {torch.device(device)}: {reason}") from err


class PagePool:
    """The device's page pool: ``num_pages x page_size`` bytes in one uint8 tensor.

    ``storage`` is always ``[num_pages, page_size]`` and contiguous; on the CPU it may view the
    front of a larger, untouched reserve (see :data:`CPU_RESERVE_FACTOR`).
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu", what: str = "page pool"):
        self.page_size = page_size
        self.what = what
        self.storage = self._reserve = _allocate(lambda: torch.empty((num_pages, page_size), dtype=torch.uint8,
                                                                      device=device), num_pages, page_size, device, what)

    def __getstate__(self) -> dict:
        # Copies and pickles carry the pages only, never the untouched reserve behind them.
        return {"page_size": self.page_size, "what": self.what, "storage": self.storage.clone()}

    def __setstate__(self, state: dict) -> None:
        self.page_size = state["page_size"]
        self.what = state.get("what", "page pool")
        self.storage = self._reserve = state["storage"]

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.storage.shape[0]

    @property
    def device(self) -> torch.device:
        """The device the pages live on."""
        return self.storage.device

    def grow(self, num_pages: int) -> None:
        """Enlarge the pool to ``num_pages`` pages, keeping every existing page id and byte.

        Inside the reserve this only widens the view; past it, the pages move once into a new
        reserve (on the CPU :data:`CPU_RESERVE_FACTOR` times ``num_pages``, or exactly
        ``num_pages`` if the OS refuses that much address space).
        """
        if num_pages <= self.num_pages:
            return
        _check_page_count(num_pages, self.what)  # growing inside the reserve allocates nothing, but takes ids
        if num_pages > self._reserve.shape[0]:
            reserve = None
            if self.device.type == "cpu":
                try:
                    reserve = self.storage.new_empty((num_pages * CPU_RESERVE_FACTOR, self.page_size))
                except RuntimeError:  # address space refused (strict overcommit): grow exactly
                    reserve = None
            if reserve is None:
                reserve = _allocate(lambda: self.storage.new_empty((num_pages, self.page_size)), num_pages,
                                    self.page_size, self.device, self.what)
            reserve[: self.num_pages].copy_(self.storage)
            self._reserve = reserve
        self.storage = self._reserve[:num_pages]

    def segment_view(self, layout: PageLayout, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Typed strided view of segment ``name`` over *all* pages: ``[num_pages, T, n]``.

        No copy: indexing it with page ids gathers just that segment (one contiguous copy), which
        is how the reference attention reads pages without gathering whole pages first.
        """
        i = SEGMENTS.index(name)
        off, nb = layout.seg_offsets[i], layout.seg_bytes[i]
        raw = self.storage[:, off: off + layout.tokens * nb]
        if dtype != torch.uint8:
            raw = raw.view(dtype)
        return raw.unflatten(-1, (layout.tokens, -1))

    def gather(self, page_ids: torch.Tensor) -> torch.Tensor:
        """Copy pages ``page_ids`` (any shape) into ``[*page_ids.shape, page_size]``."""
        return self.storage.index_select(0, page_ids.reshape(-1).long()).view(*page_ids.shape, self.page_size)

    def write_rows(self, layout: PageLayout, page_ids: torch.Tensor, slots: torch.Tensor, rows) -> None:
        """Scatter per-token byte rows (from :meth:`PageLayout.encode`) into their page slots.

        ``page_ids`` and ``slots`` are ``[n]``: token ``i`` goes to slot ``slots[i]`` of page
        ``page_ids[i]``. Each of the six segments is one indexed row store into the segment's
        strided ``[num_pages, T, bytes]`` view (one index per token, not per byte).
        """
        p, s = page_ids.long(), slots.long()
        for name, nb, row in zip(SEGMENTS, layout.seg_bytes, rows):
            if nb:
                self.segment_view(layout, name)[p, s] = row.reshape(-1, nb)

    def write_tokens(self, layout: PageLayout, page_ids: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, score: torch.Tensor, position: torch.Tensor,
                     keep: torch.Tensor | None = None) -> None:
        """Quantize ``n`` tokens (``k``/``v`` ``[n, head_dim]``) into slot ``slots[i]`` of page
        ``page_ids[i]``: :meth:`PageLayout.encode` then :meth:`write_rows`. ``keep`` bool ``[n]``:
        write only these tokens. NaN/Inf K/V raise :class:`~leankit.quant.NonFiniteKVError` and
        write nothing.

        On a CPU with :mod:`leankit.native` kernels, one compiled call does it all with the same
        bytes (the torch path runs about twenty small ops per call, which dominate a decode step's
        store, and its indexed row stores of a prompt's dense rows cost more than their copy).
        """
        kernels, k_fmt, v_fmt = self._native_store(layout)
        if kernels is not None:
            page = page_ids.long()
            if keep is not None:  # a negative page id: the kernel skips the token
                page = torch.where(keep, page, torch.full_like(page, -1))
            kernels.store_tokens(self.storage, layout.tokens, layout.seg_offsets, page.contiguous(),
                                 slots.long().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                 position.to(torch.int32).reshape(-1).contiguous(),
                                 score.float().reshape(-1).contiguous(), k_fmt, v_fmt, layout.group_size)
            return
        if keep is not None:
            idx = keep.nonzero().squeeze(1)
            page_ids, slots, k, v, score, position = (t[idx] for t in (page_ids, slots, k, v, score, position))
        self.write_rows(layout, page_ids, slots, layout.encode(k, v, score, position))

    def _native_store(self, layout: PageLayout):
        """``(kernels, k_format, v_format)``: the compiled kernels that store ``layout``'s tokens in
        this pool and the formats of its two sides (:func:`leankit.native.side_format`), or
        ``(None, None, None)`` where they cannot (no kernels here, a dtype they do not read, or a
        quantization group whose codes do not fill whole bytes, such as 2-bit codes in groups of 2:
        the kernels pack each group's codes into bytes of their own)."""
        kernels = native.kernels_for(self.device)
        k_fmt = native.side_format(layout.precision.k_bits, layout.dense_dtype)
        v_fmt = native.side_format(layout.precision.v_bits, layout.dense_dtype)
        if kernels is None or k_fmt is None or v_fmt is None:
            return None, None, None
        if any(bits < 16 and layout.group_size % codes_per_byte(bits)
               for bits in (layout.precision.k_bits, layout.precision.v_bits)):
            return None, None, None
        return kernels, k_fmt, v_fmt

    def store_decode(self, layout: PageLayout, table: torch.Tensor, first_col: int, col_step: int,
                     lens: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, real: torch.Tensor,
                     score: torch.Tensor | None = None) -> bool:
        """A decode step's new tokens of one layer (``k``/``v`` ``[B, H, 1, head_dim]``) into the next
        slots of their heads' tier, in one compiled call (:meth:`leankit.native.Kernels.store_step`):
        head ``(b, h)``'s token, when ``real[b]``, goes to slot ``lens[b, h]``, on the page in column
        ``first_col + col_step * (lens[b, h] // tokens)`` of its row of ``table`` (int32
        ``[B, H, R]``), with position ``q_pos[b]`` and significance ``score[b, h, 0]`` (None: 0);
        ``lens`` (int32 ``[B, H]``) is advanced in place. Returns False, having done nothing, where
        the compiled kernels cannot take the store; NaN/Inf K/V raise
        :class:`~leankit.quant.NonFiniteKVError` with nothing written and ``lens`` unchanged."""
        kernels, k_fmt, v_fmt = self._native_store(layout)
        if kernels is None:
            return False
        batch = k.shape[0]
        kernels.store_step(self.storage, table, first_col, col_step, lens, layout.tokens, layout.seg_offsets,
                           k.float().contiguous(), v.float().contiguous(), q_pos.reshape(batch).long().contiguous(),
                           real.reshape(batch).contiguous(), None if score is None else score.float().contiguous(),
                           k_fmt, v_fmt, layout.group_size)
        return True

    def store_ranked(self, layout: PageLayout, table: torch.Tensor, first_col: int, col_step: int,
                     lens: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, cls: torch.Tensor,
                     rank: torch.Tensor, want: int, score: torch.Tensor) -> bool:
        """A classified prompt's tokens of class ``want`` of one layer (``k``/``v``
        ``[B, H, Q, head_dim]``) into their heads' tier, in one compiled call
        (:meth:`leankit.native.Kernels.store_ranked`): token ``(b, h, q)`` goes to slot
        ``lens[b, h] + rank[b, h, q]``, on the page in column ``first_col + col_step * (slot //
        tokens)`` of its row of ``table`` (int32 ``[B, H, R]``), with position ``q_pos[b, q]`` and
        significance ``score[b, h, q]``; ``lens`` (int32 ``[B, H]``) is left as it is. Returns
        False, having done nothing, where the compiled kernels cannot take the store; NaN/Inf K/V
        raise :class:`~leankit.quant.NonFiniteKVError` with nothing written."""
        kernels, k_fmt, v_fmt = self._native_store(layout)
        if kernels is None:
            return False
        batch, nq = k.shape[0], k.shape[2]
        kernels.store_ranked(self.storage, table, first_col, col_step, lens, layout.tokens, layout.seg_offsets,
                             k.float().contiguous(), v.float().contiguous(), q_pos.reshape(batch, nq).long().contiguous(),
                             cls.contiguous(), rank.contiguous(), want, score.float().contiguous(), k_fmt, v_fmt,
                             layout.group_size)
        return True

    def read_rows(self, layout: PageLayout, page_ids: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
        """Bytes ``[n, bytes]`` of segment ``name`` of the slots ``slots`` of pages ``page_ids``."""
        return self.segment_view(layout, name)[page_ids.long(), slots.long()]

    def write_scores(self, layout: PageLayout, page_ids: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrite the whole score segment of pages ``page_ids`` ``[n]`` with ``scores`` ``[n, T]``."""
        seg = self.segment_view(layout, "score", torch.float16).squeeze(-1)  # [num_pages, T]
        seg.index_copy_(0, page_ids.reshape(-1).long(), scores.reshape(-1, layout.tokens).to(torch.float16))

    def copy_slots(self, layout: PageLayout, src_pages, src_slots, dst_pages, dst_slots) -> None:
        """Copy whole tokens (all six segments) between slots of pages of the same layout."""
        sp, ss, dp, ds = src_pages.long(), src_slots.long(), dst_pages.long(), dst_slots.long()
        for name, nb in zip(SEGMENTS, layout.seg_bytes):
            if nb:
                view = self.segment_view(layout, name)
                view[dp, ds] = view[sp, ss]