"""Plots of the compression evaluation: perplexity vs KV memory, and needle retrieval at equal memory.

Reads the JSON files written by :mod:`eval.perplexity` and :mod:`eval.needle` (``--out``) and draws
one PNG each (needs the ``eval`` extra for matplotlib)::

    python -m eval.plot --ppl eval/results/ppl_heldout.json --needle eval/results/needle.json \\
        --out eval/results
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from leankit.plotting import pyplot, save_png


def _load(paths: list[str]) -> list[dict]:
    return [{**json.loads(Path(p).read_text()), "source": Path(p).stem} for p in paths]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    return save_png(fig, path, dpi=130)


def _short(config: str) -> str:
    """A compact point label: ``K8V4-K4V2:th=0.3,tl=0.0,group_size=32`` -> ``K8V4-K4V2:th=0.3,tl=0,gs32``.

    ``rotate=True`` becomes ``rot`` (``rotate=False`` is dropped).
    """
    text = config.replace("low_group_size=", "low-gs").replace("group_size=", "gs")
    text = re.sub(r"(?<=[:,])rotate=True", "rot", text)
    text = re.sub(r"(,rotate=False|(?<=:)rotate=False,?)", "", text).rstrip(":")
    return re.sub(r"=0\.0(?=,|$)", "=0", text)


def _perplexity_title(payloads: list[dict]) -> str:
    """The plot's title, from the windows the files were scored on (eval.perplexity's defaults for
    files that do not record them); files scored on different windows are said to differ."""
    own = any(p.get("args", {}).get("text") for p in payloads)
    windows = {(a.get("context", 2048), a.get("chunks", 4), a.get("chunk", 64))
               for a in (p.get("args", {}) for p in payloads)}
    if len(windows) == 1:
        context, chunks, chunk = windows.pop()
        scored = f"{context}-token prefill + {chunks}x{chunk} scored"
    else:
        scored = "windows differ between files"
    return f"SmolLM2-135M, {'own text' if own else 'Wikipedia'}, {scored}"


def plot_perplexity(payloads: list[dict], out: Path) -> Path:
    """Perplexity change vs FP16 (%) against ``kv_bytes / fp16`` for every config of every file.

    Each file is normalized by its own lossless row (its ``baseline``, else ``FP16``; files scored on
    different documents are not mixed); the issue's targets (+1% at 0.33, +5% at 0.20) are drawn as a guide. Rows with a
    ``ppl_vs_fp16_ci95`` interval get it as an error bar.
    """
    plt = pyplot("drawing the evaluation plots")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    y_top = 8.0
    for i, payload in enumerate(payloads):
        rows = payload["results"]
        # eval.perplexity names its lossless baseline (however it was spelled); older files have "FP16"
        base = next((r for r in rows if r["config"] == (payload.get("baseline") or "FP16")), None)
        if base is None:
            raise ValueError("a perplexity file needs an FP16 (lossless) row to normalize against")
        args = payload.get("args", {})
        # a --text run scored windows of the user's file, not Wikipedia articles
        unit = "articles" if not args.get("text") else f"windows of {Path(args['text']).name}"
        name = f"{unit} {args.get('skip', 0)}-{args.get('skip', 0) + args.get('docs', 0) - 1}"
        if "source" in payload:
            name += f" ({payload['source']})"
        pts = [(r["kv_ratio"], 100 * (r["ppl"] / base["ppl"] - 1), _short(r["config"])) for r in rows if r is not base]
        # Points far above the targets (e.g. uniform K4V2) are pinned to the top edge, value in the label.
        shown = [(x, min(y, y_top), text if y <= y_top else f"{text} (+{y:.0f}%, off scale)") for x, y, text in pts]
        dots = ax.scatter([p[0] for p in shown], [p[1] for p in shown], label=name, marker="o^sD"[i % 4])
        # Files written with per-token NLLs carry a 95% interval of the paired gap: draw it.
        ci = [(r["kv_ratio"], 100 * r["ppl_vs_fp16"], 100 * r["ppl_vs_fp16_ci95"][0], 100 * r["ppl_vs_fp16_ci95"][1])
              for r in rows if r is not base and "ppl_vs_fp16_ci95" in r and r["ppl_vs_fp16"] * 100 <= y_top]
        if ci:
            ax.errorbar([c[0] for c in ci], [c[1] for c in ci],
                        yerr=[[c[1] - c[2] for c in ci], [c[3] - c[1] for c in ci]], fmt="none",
                        ecolor=dots.get_facecolor()[0], elinewidth=0.8, capsize=2)
        for x, y, text in shown:
            ax.annotate(text, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(5.0, color="grey", lw=0.8, ls=":")
    ax.axvline(0.33, color="grey", lw=0.8, ls="--")
    ax.axvline(0.20, color="grey", lw=0.8, ls=":")
    ax.set_ylim(-0.5, y_top + 0.5)
    ax.set_xlabel("KV bytes / fp16 DynamicCache bytes")
    ax.set_ylabel("perplexity vs FP16 (%)")
    ax.set_title(_perplexity_title(payloads))
    ax.legend(fontsize=8)
    return _save(fig, out / "perplexity_vs_memory.png")


def plot_needle(payloads: list[dict], out: Path) -> Path:
    """Needle accuracy of each dynamic config next to its memory-matched static baseline."""
    plt = pyplot("drawing the evaluation plots")
    rows = [r for p in payloads for r in p["results"]]
    rows.sort(key=lambda r: r["dynamic_ratio"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["dynamic_acc"] for r in rows], 0.4, label="per-head dynamic (LeanKV)")
    ax.bar([x + 0.2 for x in xs], [r["static_acc"] for r in rows], 0.4, label="static uniform budget")
    fp16 = [r["fp16_acc"] for r in rows if "fp16_acc" in r]
    if fp16:
        ax.axhline(sum(fp16) / len(fp16), color="grey", ls="--", lw=0.8, label="uncompressed")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['dynamic']}\nkv/fp16 {r['dynamic_ratio']:.2f}" for r in rows], fontsize=6)
    ax.set_ylabel("needle accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("Needle in Paul Graham essays at equal memory (SmolLM2-135M)")
    ax.legend(fontsize=8)
    return _save(fig, out / "needle_equal_memory.png")


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ppl", nargs="*", default=[], help="eval.perplexity JSON files")
    ap.add_argument("--needle", nargs="*", default=[], help="eval.needle JSON files")
    ap.add_argument("--out", default=".", help="directory for the PNGs")
    args = ap.parse_args(argv)
    if not args.ppl and not args.needle:
        ap.error("give --ppl and/or --needle result files")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    if args.ppl:
        made.append(plot_perplexity(_load(args.ppl), out))
    if args.needle:
        made.append(plot_needle(_load(args.needle), out))
    for p in made:
        print(p)
    return made


if __name__ == "__main__":
    main()
