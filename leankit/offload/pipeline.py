"""The per-layer offload pipeline of a LeanCache (KVPR §3.3, HybridServe §4.2).

Pages live in the host pool (:mod:`~leankit.offload.host_pool`); the page table and the free
list hold host page ids, so all work between layers acts on the host tier. Each compressed
layer's work (its paged attention, its ACT recompute, the store of its new tokens) runs in a
*window*:

1. **prefetch** (before the window, while the previous layer computes): every page of the
   layer's rows gets a device slot; the pages that hold tokens are copied in on the copy stream,
   ACT pages first, each kind behind its own event (the first tokens' activations travel first,
   KVPR's split: the fused ACT->KV recompute needs only them), then the KV pages;
2. **open**: the layer's page-table rows are rewritten from host ids to device slots and the
   cache reads and writes the device pool; the next ``prefetch`` layers start copying in; the
   compute stream waits for the ACT event alone and recomputes the layer's ACT tokens' K/V
   (KVPR §3.3: recompute overlaps the transfer of the rest of the KV), and only then waits for
   the KV event;
3. **close**: the rows go back to host ids; what the layer changed is written back on the
   write-back stream (only the new tokens' rows under policy ``full``; whole pages when a
   significance policy rewrote every page's scores); the layer's slots are freed.

Pages of the plan's device-resident share (:mod:`~leankit.offload.resident`) keep their slot
from step to step and are never copied either way.

On the CPU the same steps run synchronously between two distinct pools.
"""

from __future__ import annotations

import functools

import torch

from ..page_table import HIGH
from ..pages import SEGMENTS, format_bytes
from .config import OffloadConfig
from .host_pool import HostPool
from .resident import ResidentShare
from .transfers import Link
from .working_set import DeviceBudgetExceeded, WindowFreeList, WorkingSet


class OffloadRuntime:
    """Host tier, device working set and link of one LeanCache (``cache.offload``)."""

    def __init__(self, cache, cfg: OffloadConfig):
        self.cache, self.cfg = cache, cfg
        # Any policy that rewrites pages beyond the step's new tokens (significance scores,
        # tier moves, eviction) writes whole pages back.
        self.whole_pages = bool(cache.policy.uses_significance) or cache.cfg.policy != "full"
        if cache.device.type == "cuda" and cache.cfg.policy != "full":
            raise ValueError(
                f"offload on CUDA needs policy 'full' (a single-tier config such as 'K8V4', or ACT); "
                f"policy {cache.cfg.policy!r} reorganizes pages of every layer between steps, which the "
                "host tier cannot serve on a GPU yet (it runs on the CPU)")
        if cfg.device_tokens and cache.cfg.policy != "full":
            raise ValueError(f"offload device_tokens needs policy 'full' (pages that never move); policy "
                             f"{cache.cfg.policy!r} moves pages between tiers or evicts them, so keep every page "
                             "on the host (device_tokens=0)")
        if cfg.device_tokens and cfg.device_kind == "act" and not cache.cfg.act:
            raise ValueError("offload device_kind 'act' keeps ACT blocks on the device, but the config has no "
                             f"ACT share ({cache.cfg}): add act=... or use device_kind 'kv'")
        self.resident = ResidentShare(cfg.device_tokens, cfg.device_kind, cache.device)
        self.home = HostPool(cache.pool.num_pages, cache.cfg.page_size, cfg.pin)
        cache.pool = self.home  # the page table and the free list hold host page ids
        self.home_list = cache.free_list
        self.working = WorkingSet(cache.cfg.page_size, cache.device, cfg.device_pages)
        self.link = Link(cache.device)
        self._loaded: set[int] = set()  # layers whose pages hold device slots
        self._events: dict[int, dict] = {}  # layer -> {"act": event, "kv": event} of its copies (CUDA)
        self._open: int | None = None
        self._before = None  # token counts of the open layer when it opened

    # ------------------------------------------------------------------ pages of a layer
    def _groups(self, layer: int) -> list[tuple]:
        """The layer's pages as ``(kind, ids, fill, tokens_per_page, segments)`` groups, ACT first.

        ``fill`` is the tokens each page holds (0 for a page reserved for the step's new tokens),
        ``segments`` the ``(byte offset, bytes per token)`` of the page's token-major segments: a
        partly filled page crosses the link as its filled rows only.
        """
        cache = self.cache
        out = []
        store = cache.act_store
        if store is not None and store.table is not None:
            t, g = store.table, store.layout.geometry
            row = t.tables[layer]  # [B, R]
            block = torch.arange(t.row_len, device=row.device) // t.slices
            fill = (t.lens[layer].long().view(-1, 1) - block.view(1, -1) * t.tokens).clamp(0, t.tokens)
            used = row >= 0
            out.append(("act", row[used].long(), fill[used], t.tokens,
                        ((g.data_offset, g.row_bytes), (g.position_offset, 4))))
        table = cache.table
        row = table.tables[layer]  # [B, H, R]
        col = torch.arange(table.row_len, device=row.device)
        for tier, layout in enumerate(cache.layouts):
            j = col if tier == HIGH else table.row_len - 1 - col
            mine = (j.view(1, 1, -1) < table.n_pages[tier, layer].unsqueeze(-1)) & (row >= 0)
            fill = (table.lens[tier, layer].long().unsqueeze(-1) - j.view(1, 1, -1) * layout.tokens)
            fill = fill.clamp(0, layout.tokens)
            segs = tuple((layout.seg_offsets[i], nb) for i, nb in enumerate(layout.seg_bytes) if nb)
            out.append(("kv", row[mine].long(), fill[mine], layout.tokens, segs))
        return out

    def _row_bytes(self, ids, slots, fill, segments):
        """Flat byte indices ``(host, device)`` of the filled rows of partly filled pages."""
        ps = self.cache.cfg.page_size
        dev_ = fill.device
        owner = torch.repeat_interleave(torch.arange(fill.numel(), device=dev_), fill)  # the one host sync
        row = torch.arange(owner.numel(), device=dev_) - (torch.cumsum(fill, 0) - fill)[owner]
        host_page, dev_page = (ids[owner] * ps).unsqueeze(1), (slots[owner] * ps).unsqueeze(1)
        host, dev = [], []
        for off, nb in segments:
            within = (off + row * nb).unsqueeze(1) + torch.arange(nb, device=dev_)
            host.append((host_page + within).reshape(-1))
            dev.append((dev_page + within).reshape(-1))
        return torch.cat(host), torch.cat(dev)

    # ------------------------------------------------------------------ pipeline steps
    def _prefetch(self, layer: int) -> None:
        """Give the layer's pages device slots and copy in the tokens they hold: the ACT pages first,
        then the KV pages, each kind behind its own event. Resident pages keep their slot (not fresh),
        so they are never copied."""
        events = {}
        for kind, ids, fill, tokens, segments in self._groups(layer):
            slots, fresh = self.working.assign(ids, bound=self.home.num_pages)
            # one nonzero per selection (a boolean index would sync once per tensor indexed)
            full = (fresh & (fill == tokens)).nonzero().flatten()
            tag = (kind, layer)
            ev = self.link.pages_in(self.working.pool, slots[full], self.home, ids[full], tag=tag)
            part = (fresh & (fill > 0) & (fill < tokens)).nonzero().flatten()
            if part.numel():
                host, dev = self._row_bytes(ids[part], slots[part], fill[part], segments)
                ev = self.link.bytes_in(self.working.pool, dev, self.home, host, tag=tag) or ev
            if ev is not None:  # the last copy of the kind (one stream: it covers the earlier ones)
                events[kind] = ev
        self._loaded.add(layer)
        if events:
            self._events[layer] = events

    def prune_resident(self) -> None:
        """Resident pages that went back to the free list (rows released, a step dropped) stop being
        resident and give back their device slots (``memory_report`` would count them as resident,
        and their host pages as negative, until the next step)."""
        if self.resident.active:
            self.working.drop(self.resident.prune(self.cache))

    def begin_step(self, step) -> None:
        """Start copying the first layer's pages in (the step's pages are allocated by now); a first
        window over the budget drops the step (:class:`DeviceBudgetExceeded`)."""
        self.prune_resident()  # resident pages of finished rows went back to the free list
        if self.cache.num_layers:
            try:
                self._prefetch(0)
            except DeviceBudgetExceeded:
                self._drop_step()
                raise

    def _drop_step(self) -> None:
        """Drop a step whose window does not fit the device budget: the cache goes back to its last
        completed step, and the pages the step reserved are given back, since empty pages take
        device slots in every later window of their layer (the next step, which fitted the budget
        before, must fit it again)."""
        self.cache.abort_step()
        self.forget_step()
        self.cache.trim_pages()
        self.prune_resident()
        if self.cache._seen == 0:  # a refused first step leaves the cache fresh (no batch size bound)
            self.cache.reset()

    def open(self, layer: int) -> None:
        """Make ``layer``'s pages the device's: wait for its copies, point its rows at device slots."""
        if self._open is not None:
            raise RuntimeError(f"offload window of layer {self._open} is still open when layer {layer} starts")
        cache = self.cache
        if layer not in self._loaded:
            self._prefetch(layer)
        events = self._events.pop(layer, {})
        store = cache.act_store
        act_lens = None if store is None or store.table is None else store.table.lens[layer].clone()
        self._before = (cache.table.lens[:, layer].clone(), act_lens)
        self._swap_rows(layer, self.working.slot_of)
        cache.pool = self.working.pool
        cache.free_list = WindowFreeList(self.home_list, self.working, self._grow_home)
        self._open = layer
        # The next layers' copies are queued before this layer's recompute, behind its own copies.
        for nxt in range(layer + 1, min(layer + 1 + self.cfg.prefetch, cache.num_layers)):
            if nxt not in self._loaded:
                self._prefetch(nxt)
        if act_lens is not None:  # ACT->KV recompute as soon as the ACT pages landed (KVPR §3.3)
            self._wait(events.get("act"))
            self.link.note(("recompute", layer))
            store.recompute_ahead(layer)
        self.link.note(("wait_kv", layer))
        self._wait(events.get("kv"))

    def _wait(self, event) -> None:
        """The compute stream waits for one copy event (nothing to wait for on the CPU)."""
        if event is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(event)

    def close(self, layer: int) -> None:
        """Point ``layer``'s rows back at host pages, write back what changed, free its slots."""
        cache = self.cache
        cache.pool, cache.free_list = self.home, self.home_list
        self._swap_rows(layer, self.working.owner)
        self._open = None
        self.resident.fix(cache, layer)
        self.resident.mark(cache, layer)
        groups = self._groups(layer)
        if self.whole_pages:  # every page the layer holds may have changed (scores, tier moves)
            for _, ids, fill, tokens, segments in groups:
                slots = self.working.slot_of[ids]
                full = (fill == tokens) & ~self.resident.of(ids)
                self.link.pages_out(self.home, ids[full], self.working.pool, slots[full])
                part = (fill > 0) & (fill < tokens) & ~self.resident.of(ids)
                if bool(part.any()):
                    host, dev = self._row_bytes(ids[part], slots[part], fill[part], segments)
                    self.link.bytes_out(self.home, host, self.working.pool, dev)
        else:
            self._write_new_rows(layer)
        ids = torch.cat([g[1] for g in groups])
        self.working.drop(ids[~self.resident.of(ids)])  # resident pages keep their slot
        self._loaded.discard(layer)

    def _swap_rows(self, layer: int, mapping: torch.Tensor) -> None:
        """Rewrite the layer's KV and ACT page-table rows through ``mapping`` (ids <-> slots)."""
        rows = [self.cache.table.tables[layer]]
        store = self.cache.act_store
        if store is not None and store.table is not None:
            rows.append(store.table.tables[layer])
        for row in rows:
            used = row >= 0
            row[used] = mapping[row[used].long()].to(row.dtype)

    def _write_new_rows(self, layer: int) -> None:
        """Write back the rows of the step's new tokens of ``layer`` (KV high tier and ACT)."""
        cache, ps = self.cache, self.cache.cfg.page_size
        kv_before, act_before = self._before
        dst, src = [], []

        def rows_of(before, after):
            n = (after.long() - before.long()).clamp_min(0).reshape(-1)
            owner = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
            first = torch.cumsum(n, 0) - n
            slot = before.reshape(-1).long()[owner] + torch.arange(owner.numel(), device=n.device) - first[owner]
            return owner, slot

        layout = cache.layouts[HIGH]
        owner, slot = rows_of(kv_before[HIGH], cache.table.lens[HIGH, layer])
        if owner.numel():
            heads = cache.num_kv_heads
            ids, off = cache.table.locate(HIGH, layer, owner // heads, owner % heads, slot, layout.tokens)
            ids, off = ids.long(), off.long()
            away = ~self.resident.of(ids)  # a resident page's rows stay on the device
            ids, off = ids[away], off[away]
            slots = self.working.slot_of[ids]
            for name, nb in zip(SEGMENTS, layout.seg_bytes):
                if nb:
                    within = layout.offset(name) + off * nb
                    span = torch.arange(nb, device=ids.device)
                    dst.append(((ids * ps + within)[:, None] + span).reshape(-1))
                    src.append(((slots * ps + within)[:, None] + span).reshape(-1))
        store = cache.act_store
        if act_before is not None:
            g = store.layout.geometry
            owner, slot = rows_of(act_before, store.table.lens[layer])
            if owner.numel():
                ids, row = store.table.locate(layer, owner, slot)  # [n, S], [n]
                ids, row = ids.long(), row.long()
                away = ~self.resident.of(ids[:, 0])  # a block's pages are resident together
                ids, row = ids[away], row[away]
                slots = self.working.slot_of[ids]
                for off, nb in ((g.data_offset, g.row_bytes), (g.position_offset, 4)):
                    within = (off + row * nb)[:, None]
                    span = torch.arange(nb, device=ids.device)
                    dst.append(((ids * ps + within)[..., None] + span).reshape(-1))
                    src.append(((slots * ps + within)[..., None] + span).reshape(-1))
        if dst:
            self.link.bytes_out(self.home, torch.cat(dst), self.working.pool, torch.cat(src))

    def _grow_home(self, exhausted) -> bool:
        """Grow the host pool and its free list for an elastic cache; ``False`` for a fixed pool."""
        if self.cache.fixed_pool:
            return False
        cap = self.home.num_pages
        cap = max(2 * cap, cap + exhausted.needed - exhausted.free)
        self.home.grow(cap)
        self.home_list.grow(cap)
        return True

    def end_step(self) -> None:
        """Close the step: land every write-back, free every slot, record the step's bytes."""
        if self._open is not None:  # a step cut short inside a layer
            self.close(self._open)
        self.link.close_step()
        self._forget()

    def abandon_prefetch(self) -> None:
        """Forget pages prefetched for layers not yet open (their rows are about to change)."""
        if self._open is not None:
            raise RuntimeError("rows cannot be released while an offloaded layer is computing")
        self.link.drain()
        self._forget()

    def forget_step(self) -> None:
        """Forget a dropped step: the layers prefetched for it and the link bytes it counted so far
        (they belong to no finished step, so the next step's ``bytes_per_step`` entry leaves them out)."""
        self.abandon_prefetch()
        self.link.discard_step()

    def _forget(self) -> None:
        """Free every device slot but the resident pages' and forget which layers were copied in."""
        self.working.clear(keep=self.resident.flags)
        self._loaded.clear()
        self._events.clear()

    def reset(self) -> None:
        """Forget all in-flight state (the cache freed its pages on the host)."""
        if self._open is not None:
            self.cache.pool, self.cache.free_list = self.home, self.home_list
            self._open = None
        self.resident.reset()
        self.abandon_prefetch()

    def check_reorder(self) -> None:
        """Raise ``ValueError`` where beam search cannot reorder the host tier (before anything moved).

        Beam reordering copies page bytes within one pool: on CUDA the host tier would be indexed
        with device tensors, and a resident page's bytes are on the device, not in the host pool.
        """
        if self.cache.device.type == "cuda":
            raise ValueError("beam search (reorder_cache) is not supported with offload on CUDA: the host tier "
                             "cannot reorder its pages yet; use greedy or sampling, or offload=None")
        if self.resident.active:
            raise ValueError("beam search (reorder_cache) is not supported with offload device_tokens > 0: the "
                             "resident pages' bytes live on the device only; use device_tokens=0")

    # ------------------------------------------------------------------ the layer call
    def attend(self, layer: int, run):
        """Run ``run()`` (the layer's attention and store) inside the layer's window.

        A window that does not fit a fixed device budget drops the step (``abort_step``: the cache
        stays at its last completed step) and raises :class:`DeviceBudgetExceeded`.
        """
        try:
            self.open(layer)
            return run()
        except DeviceBudgetExceeded:
            if self._open == layer:
                self.close(layer)
            self._drop_step()
            raise
        finally:
            if self._open == layer:
                self.close(layer)

    # ------------------------------------------------------------------ reporting
    def report(self, rep: dict) -> dict:
        """Add the ``offload`` entry to a memory report (see :meth:`LeanCache.memory_report`)."""
        ps = self.cache.cfg.page_size
        last = self.link.history[-1] if self.link.history else (0, 0)
        steps = len(self.link.history)
        host = rep["pages_used"] - self.resident.pages  # a resident page's bytes live on the device only
        out = dict(rep)
        out["offload"] = {
            "host_pages": host, "host_bytes": host * ps,
            "host_pool_bytes": self.home.num_pages * ps, "pinned": self.home.pinned,
            "device_pages_peak": self.working.peak, "device_bytes_peak": self.working.peak * ps,
            "device_pages_budget": self.working.budget, "prefetch": self.cfg.prefetch,
            "h2d_bytes_step": last[0], "d2h_bytes_step": last[1],
            "h2d_bytes_total": self.link.total["h2d"], "d2h_bytes_total": self.link.total["d2h"],
            "steps": steps, "bytes_per_step": list(self.link.history),
            "device_resident_pages": self.resident.pages, "device_tokens": self.cfg.device_tokens,
        }
        return offload_report(type(rep))(out)


@functools.cache
def offload_report(base: type) -> type:
    """A memory-report class like ``base`` whose ``str`` adds the ``offload`` entry's lines."""

    class OffloadMemoryReport(base):
        def __str__(self) -> str:
            o = self["offload"]
            budget = o["device_pages_budget"]
            lines = [
                super().__str__(),
                (f"  offload             host {o['host_pages']} pages ({format_bytes(o['host_bytes'])}"
                 f"{', pinned' if o['pinned'] else ''}), prefetch {o['prefetch']} layer(s)"),
                (f"  device working set  peak {o['device_pages_peak']} pages ({format_bytes(o['device_bytes_peak'])}) "
                 f"of {'an elastic budget' if budget is None else f'a budget of {budget} pages'}, "
                 f"{o['device_resident_pages']} resident"),
                (f"  link per step       host->device {format_bytes(o['h2d_bytes_step'])}, device->host "
                 f"{format_bytes(o['d2h_bytes_step'])} (last of {o['steps']} steps; total {format_bytes(o['h2d_bytes_total'])} "
                 f"in, {format_bytes(o['d2h_bytes_total'])} out)"),
            ]
            return "\n".join(lines)

    OffloadMemoryReport.__name__ = OffloadMemoryReport.__qualname__ = f"Offload{base.__name__}"
    return OffloadMemoryReport


def make_runtime(cache, spec) -> OffloadRuntime:
    """The runtime for ``LeanCache(..., offload=spec)`` (see :class:`OffloadConfig`)."""
    return OffloadRuntime(cache, OffloadConfig.parse(spec))
