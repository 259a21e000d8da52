"""What ``LeanCache(model, kv, offload=...)`` takes: :class:`OffloadConfig` and its parser."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class OffloadConfig:
    """Where the pages of a LeanCache live and how the per-layer pipeline moves them.

    Every page (KV at any precision, or ACT) lives in a host pool; the device keeps a working set
    of the layer being computed plus the ``prefetch`` layers after it, and the step's new pages.

    Attributes:
        prefetch: layers whose host pages are copied in ahead of the layer being computed (0: a
            layer's pages are copied in when it starts; 1: while layer ``l`` computes, layer
            ``l + 1``'s pages copy in, KVPR §3.3 / HybridServe §4.2).
        device_pages: a fixed device budget in pages. ``None`` lets the working-set pool grow to
            what the largest window needs; a fixed budget raises ``DeviceBudgetExceeded`` (a
            ``RuntimeError``) naming the pages needed when a window does not fit, and the step
            is dropped (the cache stays at its last completed step).
        pin: pin the host pool when CUDA is present (page-locked memory is what lets a copy run
            on a side stream while the device computes). Ignored without CUDA.
    """

    prefetch: int = 1
    device_pages: int | None = None
    pin: bool = True

    def __post_init__(self):
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"offload prefetch must be an integer >= 0 (layers ahead), got {self.prefetch!r}")
        if self.device_pages is not None and (not isinstance(self.device_pages, int) or self.device_pages < 1):
            raise ValueError(f"offload device_pages must be a positive integer or None, got {self.device_pages!r}")

    @classmethod
    def parse(cls, spec) -> OffloadConfig:
        """Read ``offload=``: ``True``/``"host"`` (defaults), an :class:`OffloadConfig`, or a dict of its
        fields (``{"prefetch": 1, "device_pages": 64}``). Raises ``ValueError`` naming a bad value."""
        if isinstance(spec, OffloadConfig):
            return spec
        if spec is True or (isinstance(spec, str) and spec.strip().lower() == "host"):
            return cls()
        if isinstance(spec, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(spec) - names)
            if unknown:
                raise ValueError(f"unknown offload option(s) {unknown}; valid: {sorted(names)}")
            return cls(**spec)
        raise ValueError(f"offload= takes True, 'host', an OffloadConfig or a dict of "
                         f"{[f.name for f in fields(cls)]}; got {spec!r}")
