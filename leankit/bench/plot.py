"""Figures of ``leankit bench throughput`` and ``leankit bench step`` results (needs matplotlib,
the ``bench`` extra).

Both draw from the payload a run writes with ``--json`` (or passes straight to ``--plot``), so a
figure can be redrawn from a kept result without measuring again::

    leankit bench plot results/throughput/decode_heavy.json results/step/context_1024.json --out results

Throughput: each cache's tokens/s against DynamicCache at the budget (its batch written beside the
bar), with the two bounds the run measured, and each cache's wall time split into prefill and
decode, which shows why no cache gets far on a prefill-heavy mix. Step: prefill and decode-step
ratios per config and context, and where the LeanCache decode step goes.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..plotting import pyplot, save_png

# The step breakdown's columns, in the order of the README table, with the colours of the figure.
STEP_PARTS = (("attention", "attention", "#4C72B0"), ("store", "quantize/store", "#CCB974"),
              ("policy", "policy", "#55A868"), ("alloc", "allocation", "#C44E52"),
              ("setup", "step setup", "#8172B3"), ("model", "model (rest)", "#BBBBBB"))


def _short(name: str) -> str:
    """A bar label: ``LeanCache K8V4-K4V2:th=0.25,...,group_size=32`` -> ``K8V4-K4V2:th=0.25,...,gs32``."""
    return name.removeprefix("LeanCache ").replace("group_size=", "gs").replace("rotate=1", "rot")


def plot_throughput(results: dict, title: str = ""):
    """The figure of one ``leankit bench throughput`` result (``results``: its ``results`` payload).

    Left: tokens/s of every cache as a multiple of DynamicCache's, with its batch; a solid line at
    1 (DynamicCache), a dashed one at the ceiling run (DynamicCache over the budget at the largest
    LeanCache batch) when there was one, and a dotted one at what a cache with DynamicCache's
    prefill and a free decode would reach. Right: each cache's wall time, prefill and decode.
    """
    caches = results.get("caches") or []
    if not caches:
        raise ValueError("a throughput result needs at least one cache row ('caches')")
    plt = pyplot("drawing bench results")
    names = [_short(c["name"]) for c in caches][::-1]  # the first cache (DynamicCache) on top
    rows = caches[::-1]
    y = range(len(rows))
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(12, 0.55 * len(rows) + 2.8), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 2]})
    ratios = [c["tokens_per_s_ratio"] for c in rows]
    ax.barh(list(y), ratios, color=["#BBBBBB" if c["name"] == "DynamicCache" else "#4C72B0" for c in rows])
    for i, c in enumerate(rows):
        ax.text(c["tokens_per_s_ratio"], i, f" {c['tokens_per_s_ratio']:.2f}x, batch {c['batch']}", va="center",
                fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    top = results.get("ceiling")
    if top:
        ax.axvline(top["tokens_per_s_ratio"], color="#C44E52", ls="--", lw=1,
                   label=f"DynamicCache over the budget, batch {top['batch']} ({top['tokens_per_s_ratio']:.2f}x)")
    marks = [top["tokens_per_s_ratio"]] if top else []
    base = next((c for c in caches if c["name"] == "DynamicCache"), None)
    if base and 0 < base["prefill_s"] < base["time_s"]:
        marks.append(base["time_s"] / base["prefill_s"])
        ax.axvline(marks[-1], color="#55A868", ls=":", lw=1.2,
                   label=f"DynamicCache's prefill, free decode ({marks[-1]:.2f}x)")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.set_xlabel("generated tokens/s vs DynamicCache")
    ax.set_xlim(0, max([*ratios, *marks]) * 1.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    prefill = [c["prefill_s"] for c in rows]
    decode = [c["time_s"] - c["prefill_s"] for c in rows]
    ax_t.barh(list(y), prefill, color="#DD8452", label="prefill")
    ax_t.barh(list(y), decode, left=prefill, color="#4C72B0", label="decode")
    ax_t.set_xlabel("wall time (s)")
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    budget = results.get("budget_bytes")
    from .throughput import mix_label

    head = f"{mix_label(results)}, {results.get('requests', '?')} requests"
    if budget:
        head += f", KV budget {budget / 2**20:.1f} MiB"
    fig.suptitle(f"{title}: {head}" if title else head, fontsize=10)
    fig.tight_layout()
    return fig


def plot_step(rows: list[dict], title: str = ""):
    """The figure of one ``leankit bench step`` result (``rows``: its ``results`` payload, one row
    per context and config).

    Left: prefill and decode-step time of each (context, config) as a multiple of DynamicCache's
    (below 1 is faster). Right: the shares of the instrumented LeanCache decode step.
    """
    if not rows:
        raise ValueError("a step result needs at least one row")
    plt = pyplot("drawing bench results")
    labels = [f"{r['context']}: {_short(r.get('kv_arg') or r['kv'])}" for r in rows][::-1]
    rows = rows[::-1]
    y = list(range(len(rows)))
    fig, (ax, ax_b) = plt.subplots(1, 2, figsize=(12, 0.6 * len(rows) + 2.8), sharey=True)
    h = 0.38
    pre = [r["prefill_ratio"] for r in rows]
    dec = [r["decode_ratio"] for r in rows]
    ax.barh([i + h / 2 for i in y], pre, height=h, color="#DD8452", label="prefill")
    ax.barh([i - h / 2 for i in y], dec, height=h, color="#4C72B0", label="decode step")
    for i in y:
        ax.text(pre[i], i + h / 2, f" {pre[i]:.2f}x", va="center", fontsize=7)
        ax.text(dec[i], i - h / 2, f" {dec[i]:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("time vs DynamicCache (same batch, one process)")
    ax.set_xlim(0, max(pre + dec) * 1.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    left = [0.0] * len(rows)
    for key, name, colour in STEP_PARTS:
        share = [100 * max(r["decode_breakdown"].get(key, 0.0), 0.0) for r in rows]
        ax_b.barh(y, share, left=left, color=colour, label=name)
        left = [a + b for a, b in zip(left, share)]
    ax_b.set_xlabel("share of the LeanCache decode step (%)")
    ax_b.set_xlim(0, max(100.0, *left))
    ax_b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    batch = rows[0].get("batch")
    head = f"batch {batch}" if batch else ""
    fig.suptitle(": ".join(x for x in (title, head) if x), fontsize=10)
    fig.tight_layout()
    return fig


def plot_payload(payload: dict, out: str | Path, title: str = "") -> Path:
    """Draw the figure of a ``--json`` payload (its ``mode`` picks the kind) into the PNG ``out``."""
    if not isinstance(payload, dict) or "mode" not in payload:
        raise ValueError("not a `leankit bench --json` results file: it has no 'mode' field "
                         "(step and throughput results have one)")
    mode = str(payload["mode"])
    results = payload.get("results")
    title = title or payload.get("model", "")
    if mode.startswith("throughput"):
        fig = plot_throughput(results or {}, title)
    elif mode == "step":
        fig = plot_step(results or [], title)
    else:
        raise ValueError(f"no figure for bench mode {mode!r} (step and throughput results have one)")
    return save_png(fig, out)


def plot_files(paths: list[str], out_dir: str | Path) -> list[Path]:
    """One PNG per ``--json`` result file, named after it, in ``out_dir``."""
    written, targets = [], {}
    for p in paths:  # two files of one name would draw into one PNG, the second over the first
        png = Path(out_dir) / (Path(p).stem + ".png")
        if png in targets:
            raise ValueError(f"{targets[png]} and {p} would both be drawn into {png}: give files of different "
                             "names, or draw them into different --out folders")
        targets[png] = p
    payloads = []
    for p in paths:  # every file read and checked before any figure is written
        what = f"{p}: not a results file written by `leankit bench ... --json`"
        try:
            payload = json.loads(Path(p).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{what} ({err})") from err
        if not isinstance(payload, dict):  # bad input: reported as the command's other input errors are
            raise ValueError(f"{what} (it holds a JSON {type(payload).__name__}, not an object)")  # noqa: TRY004
        payloads.append((p, payload))
    for p, payload in payloads:
        what = f"{p}: not a results file written by `leankit bench ... --json`"
        try:
            written.append(plot_payload(payload, Path(out_dir) / (Path(p).stem + ".png")))
        except (KeyError, TypeError, AttributeError, IndexError) as err:
            raise ValueError(f"{what} (its results lack {err})") from err
    return written
