"""PCIe-versus-compute timeline of one decode step, per layer, for a plan and its KV-only baseline.

Each layer occupies ``[start, start + time)`` on the time axis (its simulated layer time). Inside it the
host-to-device lane shows the activations, KV and next-layer weights the link carries, the GPU lane the
KV regeneration and the forward pass (matmuls, attention, quantization), and, when attention is
offloaded, a CPU lane. Idle gaps are what the planner tries to close (HybridServe Fig. 8, CAPTURE Fig. 1).

matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..plotting import pyplot, save_png
from .planner import Plan

COLORS = {
    "ACT load": "#8fbf5a",
    "KV load": "#e07b39",
    "weights": "#6f8fbf",
    "store": "#c9a0dc",
    "recompute": "#3a9d5d",
    "forward": "#35608f",
    "attention": "#b03a2e",
    "quant": "#d4b106",
    "CPU attention": "#7f7f7f",
}


def segments(plan: Plan) -> dict[str, list[tuple[float, float, str]]]:
    """Bars per lane as ``(start, duration, kind)`` in seconds, one decode step, layers back to back."""
    lanes: dict[str, list[tuple[float, float, str]]] = {"PCIe h2d": [], "GPU": [], "PCIe d2h": [], "CPU": []}
    t = 0.0
    for lc in plan.layers:
        x = t
        for kind, d in (("ACT load", lc.act_load), ("KV load", lc.kv_load), ("weights", lc.weight_load)):
            if d > 0:
                lanes["PCIe h2d"].append((x, d, kind))
                x += d
        x = t
        for kind, d in (("recompute", lc.recompute), ("forward", lc.forward), ("attention", lc.attention),
                        ("quant", lc.quant)):
            if d > 0:
                lanes["GPU"].append((x, d, kind))
                x += d
        if lc.store > 0:
            lanes["PCIe d2h"].append((t, lc.store, "store"))
        if lc.cpu > 0:
            lanes["CPU"].append((t, lc.cpu, "CPU attention"))
        t += lc.time
    return {k: v for k, v in lanes.items() if v or k in ("PCIe h2d", "GPU")}


def draw_timeline(plan: Plan, path: str | Path, baseline: Plan | None = None, max_layers: int | None = None) -> Path:
    """Draw the per-layer PCIe and compute lanes of ``plan`` (top) and ``baseline`` (bottom; default
    ``plan.baseline``) for one decode step at the plan's representative context; save to ``path``.

    ``max_layers`` limits the drawing to the first layers (all by default). Raises ``RuntimeError`` with
    install instructions when matplotlib is missing.
    """
    plt = pyplot("drawing the timeline")
    baseline = baseline if baseline is not None else plan.baseline
    plans: Sequence[tuple[str, Plan]] = [("plan", plan)] + ([("KV-only baseline", baseline)] if baseline else [])
    fig, axes = plt.subplots(len(plans), 1, figsize=(13, 2.2 + 1.6 * len(plans)), squeeze=False)
    used = set()
    for ax, (title, p) in zip(axes[:, 0], plans):
        if max_layers is not None:
            p = _truncated(p, max_layers)
        lanes = segments(p)
        names = list(lanes)
        for row, name in enumerate(names):
            for start, dur, kind in lanes[name]:
                ax.broken_barh([(start * 1e3, dur * 1e3)], (row - 0.38, 0.76), facecolors=COLORS[kind],
                               edgecolor="none", label=kind if kind not in used else None)
                used.add(kind)
        t = 0.0
        for lc in p.layers:
            ax.axvline(t * 1e3, color="#dddddd", lw=0.5, zorder=0)
            t += lc.time
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.set_xlim(0, max(t * 1e3, 1e-9))
        ax.set_xlabel("ms within one decode step (vertical lines: layer boundaries)")
        ax.set_title(f"{title}: {p.choice.label()} -- {p.throughput:.1f} tok/s, step {t * 1e3:.1f} ms", fontsize=9)
    handles, labels = [], []
    for ax in axes[:, 0]:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    fig.suptitle(f"{plan.model.name} on {plan.hardware.name}: one decode step at context {plan.step_context:g}",
                 y=0.99, fontsize=10)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.945), ncol=min(9, max(1, len(labels))),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return save_png(fig, path)


def _truncated(p: Plan, n: int) -> Plan:
    from dataclasses import replace

    return replace(p, layers=p.layers[:n])
