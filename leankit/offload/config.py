"""What ``LeanCache(model, kv, offload=...)`` takes: :class:`OffloadConfig` and its parser."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class OffloadConfig:
    """Where the pages of a LeanCache live and how the per-layer pipeline moves them.

    Every page (KV at any precision, or ACT) has a home in a host pool; the device keeps a working
    set of the layer being computed plus the ``prefetch`` layers after it, and the step's new pages.
    A plan that keeps part of the cache on the GPU (``device_tokens``) keeps those pages on the
    device for good: they are never copied either way.

    Attributes:
        prefetch: layers whose host pages are copied in ahead of the layer being computed (0: a
            layer's pages are copied in when it starts; 1: while layer ``l`` computes, layer
            ``l + 1``'s pages copy in, KVPR §3.3 / HybridServe §4.2).
        device_pages: a fixed device budget in pages. ``None`` lets the working-set pool grow to
            what the largest window needs; a fixed budget raises ``DeviceBudgetExceeded`` (a
            ``RuntimeError``) naming the pages needed when a window does not fit, and the step
            is dropped (the cache stays at its last completed step).
        device_tokens: cache tokens per layer, summed over the batch, that stay on the device (the
            planner's GPU-resident cache, ``plan.memory["gpu_cache_tokens"]``). The share is fixed
            at the first step: each row keeps the first pages of kind ``device_kind`` in proportion
            to its tokens of that kind, so that the kept tokens sum to
            ``device_tokens`` (to a page per row). Needs policy ``full`` (pages that never move).
        device_kind: the kind of page the resident share holds: ``"kv"`` (the planner's ``kv`` and
            ``kvpr`` modes) or ``"act"`` (``hybrid``: HybridServe keeps ACT blocks on the GPU; needs
            ``act=``).
        pin: pin the host pool when CUDA is present (page-locked memory is what lets a copy run
            on a side stream while the device computes). Ignored without CUDA.
    """

    prefetch: int = 1
    device_pages: int | None = None
    device_tokens: int = 0
    device_kind: str = "kv"
    pin: bool = True

    def __post_init__(self):
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ValueError(f"offload prefetch must be an integer >= 0 (layers ahead), got {self.prefetch!r}")
        pages = self.device_pages
        if pages is not None and (not isinstance(pages, int) or isinstance(pages, bool) or pages < 1):
            raise ValueError(f"offload device_pages must be a positive integer or None, got {self.device_pages!r}")
        if not isinstance(self.device_tokens, int) or isinstance(self.device_tokens, bool) or self.device_tokens < 0:
            raise ValueError(f"offload device_tokens must be an integer >= 0 (tokens per layer kept on the device), "
                             f"got {self.device_tokens!r}")
        if not isinstance(self.pin, bool):  # a string such as "no" is truthy: it would pin, silently
            raise ValueError(f"offload pin must be True or False, got {self.pin!r}")  # noqa: TRY004 (every offload= field is a ValueError)
        if self.device_kind not in ("kv", "act"):
            raise ValueError(f"offload device_kind must be 'kv' or 'act', got {self.device_kind!r}")

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
