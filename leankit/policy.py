"""Placement policies: which tier each token lives in, and when it is downgraded or pruned.

A policy is the "planning" half of LeanKV's memory management (§5.3): at the start of a step it
states every (layer, sequence, head)'s page demand, which the cache coordinates in one batched
prefix-sum allocation; per layer it places the new tokens into page slots.

``FullPolicy`` keeps every token in the high tier (the window included): the lossless /
uniform-quantization mode (``FP16``, ``K8V8``, ``K8V4``, ``K4V2`` ...).
"""

from __future__ import annotations

import torch

from .page_table import HIGH, LOW


class FullPolicy:
    """Keep every real token, in the high tier, in arrival order."""

    def __init__(self, cache):
        self.cache = cache
        self.real_seen: torch.Tensor | None = None  # int [B]: real tokens stored per row

    # -------------------------------------------------------------- protocol
    def begin_step(self, step) -> None:
        """Plan the step's pages for all layers and allocate them in one batched call."""
        cache = self.cache
        table = cache.table
        if self.real_seen is None:
            self.real_seen = torch.zeros(table.shape[1], dtype=torch.long, device=cache.device)
        t_high = cache.layouts[HIGH].tokens
        need = -torch.div(-(table.lens[HIGH] + step.n_new.view(1, -1, 1)), t_high, rounding_mode="floor")
        extra = torch.zeros_like(table.n_pages)
        extra[HIGH] = (need - table.n_pages[HIGH]).clamp_min(0)
        cache.grow_pages(extra)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, step) -> None:
        """Quantize the real new tokens of ``layer`` into the next high-tier slots."""
        cache = self.cache
        b_idx, q_idx = step.real.nonzero(as_tuple=True)
        if b_idx.numel() == 0:
            return
        heads = k.shape[1]
        n = b_idx.numel()
        h_idx = torch.arange(heads, device=k.device).repeat(n)
        b_rep = b_idx.repeat_interleave(heads)
        q_rep = q_idx.repeat_interleave(heads)
        lens = cache.table.lens[HIGH, layer]
        slot = lens[b_rep, h_idx] + step.rank[b_rep, q_rep]
        kk = k[b_rep, h_idx, q_rep]
        vv = v[b_rep, h_idx, q_rep]
        pos = step.q_pos[b_rep, q_rep]
        score = torch.zeros(kk.shape[0], device=k.device)
        cache.write_tokens(HIGH, layer, b_rep, h_idx, slot, kk, vv, pos, score)
        lens += step.n_new.view(-1, 1).to(lens.dtype)

    def after_attention(self, layer, query, scaling, lse, step) -> None:
        """Nothing to learn from attention when every token is kept."""

    def end_step(self, step) -> None:
        self.real_seen += step.n_new

    def reset(self) -> None:
        self.real_seen = None

    def reorder(self, beam_idx: torch.Tensor) -> None:
        if self.real_seen is not None:
            self.real_seen = self.real_seen.index_select(0, beam_idx)

    def logical_tokens(self) -> torch.Tensor:
        """Real tokens per live (unfinished) row that an uncompressed cache would hold."""
        if self.real_seen is None:
            return torch.zeros(0, dtype=torch.long)
        return torch.where(self.cache.finished, torch.zeros_like(self.real_seen), self.real_seen)


def make_policy(cache):
    """The placement policy for ``cache.cfg.policy``."""
    name = cache.cfg.policy
    if name == "full":
        if cache.cfg.low is not None:
            raise ValueError("policy 'full' keeps every token in the high tier; a low tier needs policy 'leankv'")
        return FullPolicy(cache)
    raise NotImplementedError(f"placement policy {name!r} is not available yet")


__all__ = ["FullPolicy", "make_policy", "HIGH", "LOW"]
