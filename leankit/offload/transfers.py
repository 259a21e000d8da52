"""The link: every host<->device copy of the offload runtime is issued here, and counted here.

Bytes are counted where each copy is issued, per direction, for the current step and in total
(``memory_report()`` shows them). On CUDA the host-to-device copies run on one side stream and
the device-to-host write-backs on another, each followed by an event the compute stream waits on
(HybridServe §4.2's three concurrent tasks: load, compute, store). On the CPU the same calls copy
synchronously between two distinct pools, so the bytes moved are exactly those a GPU would move.
"""

from __future__ import annotations

import torch


class Link:
    """Host<->device copies with byte counters (and CUDA streams and events when on a GPU)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
        self._pending_out: list = []  # (host pool, host byte index or ids, staged tensor, event)
        self._keep: list = []  # host staging buffers that must live until their copy ran
        self.timing = False  # record CUDA events around copies (for the measured overlap)
        self.copy_events: list = []
        self.log: list | None = None  # set to a list to record the issue order of copies and waits
        self.reset_counts()

    # ------------------------------------------------------------------ counters
    def reset_counts(self) -> None:
        """Zero every counter."""
        self.step = {"h2d": 0, "d2h": 0}
        self.total = {"h2d": 0, "d2h": 0}
        self.history: list[tuple[int, int]] = []  # (h2d, d2h) bytes of each finished step

    def close_step(self) -> None:
        """Finish the step: drain write-backs, append the step's bytes to the history."""
        self.drain()
        self.history.append((self.step["h2d"], self.step["d2h"]))
        self.step = {"h2d": 0, "d2h": 0}

    def discard_step(self) -> None:
        """Forget the open step's counts (a dropped step): its copies stay in ``total``, since they
        crossed the link, but they are no step's bytes, so the next step starts its count at 0
        (before, the next finished step's entry in ``history`` included them)."""
        self.drain()
        self.step = {"h2d": 0, "d2h": 0}

    def _count(self, way: str, nbytes: int) -> None:
        self.step[way] += nbytes
        self.total[way] += nbytes

    def note(self, what) -> None:
        """Record ``what`` in the issue-order log (when ``log`` is a list): copies record their tag
        when issued, the pipeline records its recomputes and waits."""
        if self.log is not None:
            self.log.append(what)

    # ------------------------------------------------------------------ host -> device
    def pages_in(self, dst, slots: torch.Tensor, src, ids: torch.Tensor, tag=None):
        """Copy whole host pages ``src[ids]`` into device pages ``dst[slots]``; returns the copy's event
        (``None`` on the CPU, where the copy is done on return). ``tag`` names the copy in ``log``."""
        n = ids.numel()
        if n == 0:
            return None
        self._count("h2d", n * src.page_size)
        self.note(tag)
        if not self.cuda:
            dst.storage.index_copy_(0, slots.long(), src.storage.index_select(0, ids.long()))
            return None
        idx = ids.long().cpu()  # host memory is indexed with host indices: one device read per copy
        staged = torch.empty((idx.numel(), src.page_size), dtype=torch.uint8, pin_memory=src.storage.is_pinned())
        torch.index_select(src.storage, 0, idx, out=staged)  # gathered straight into pinned memory
        self._keep.append(staged)
        self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))  # slots are free on the device
        with torch.cuda.stream(self.h2d_stream):
            start = self._mark()
            dst.storage.index_copy_(0, slots.long(), staged.to(self.device, non_blocking=True))
            self._span(start)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return ev

    def bytes_in(self, dst, dst_index: torch.Tensor, src, src_index: torch.Tensor, tag=None):
        """Copy the host bytes at flat index ``src_index`` to the device bytes at ``dst_index`` (the
        filled rows of a partly filled page: its empty rows never cross the link); returns the event."""
        n = dst_index.numel()
        if n == 0:
            return None
        self._count("h2d", n)
        self.note(tag)
        if not self.cuda:
            dst.storage.view(-1)[dst_index] = src.storage.view(-1)[src_index]
            return None
        idx = src_index.cpu()
        staged = torch.empty(idx.shape, dtype=torch.uint8, pin_memory=src.storage.is_pinned())
        torch.index_select(src.storage.view(-1), 0, idx, out=staged)
        self._keep.append(staged)
        self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d_stream):
            start = self._mark()
            dst.storage.view(-1)[dst_index] = staged.to(self.device, non_blocking=True)
            self._span(start)
            ev = torch.cuda.Event()
            ev.record(self.h2d_stream)
        return ev

    # ------------------------------------------------------------------ device -> host
    def pages_out(self, dst, ids: torch.Tensor, src, slots: torch.Tensor) -> None:
        """Write device pages ``src[slots]`` back to host pages ``dst[ids]``."""
        n = ids.numel()
        if n == 0:
            return
        self._count("d2h", n * src.page_size)
        if not self.cuda:
            dst.storage.index_copy_(0, ids.long(), src.storage.index_select(0, slots.long()))
            return
        self._out(dst, ids.long(), src.storage.index_select(0, slots.long()), pages=True)

    def bytes_out(self, dst, dst_index: torch.Tensor, src, src_index: torch.Tensor) -> None:
        """Write the device bytes at flat index ``src_index`` back to the host bytes at ``dst_index``
        (the rows of a step's new tokens: a page's untouched rows never cross the link)."""
        n = dst_index.numel()
        if n == 0:
            return
        self._count("d2h", n)
        if not self.cuda:
            dst.storage.view(-1)[dst_index] = src.storage.view(-1)[src_index]
            return
        self._out(dst, dst_index, src.storage.view(-1)[src_index], pages=False)

    def _out(self, dst, index: torch.Tensor, gathered: torch.Tensor, pages: bool) -> None:
        # The gather ran on the compute stream; the copy to pinned host memory runs on the
        # write-back stream once the compute stream reached this point.
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            start = self._mark()
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            self._span(start)
            ev = torch.cuda.Event()
            ev.record(self.d2h_stream)
        gathered.record_stream(self.d2h_stream)
        self._pending_out.append((dst, index, host, ev, pages))

    def drain(self) -> None:
        """Wait for the write-backs and land them in the host pool (CUDA; nothing to do on the CPU)."""
        for dst, index, host, ev, pages in self._pending_out:
            ev.synchronize()
            if pages:
                dst.storage.index_copy_(0, index.cpu(), host)
            else:
                dst.storage.view(-1)[index.cpu()] = host
        self._pending_out = []
        self._keep = []

    # ------------------------------------------------------------------ timing (CUDA)
    def _mark(self):
        if not self.timing:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _span(self, start) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.copy_events.append((start, end))
