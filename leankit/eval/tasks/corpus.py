"""Read the text shipped in ``data/`` (built by the repository's ``eval/build_task_data.py``)."""

from __future__ import annotations

import gzip
import json
from functools import cache, lru_cache
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
WIKI_SPLITS = ("perplexity", "filler")


def cut(text: str, max_chars: int) -> str:
    """The first paragraphs of ``text`` that fit in ``max_chars`` (at least the first paragraph)."""
    out, size = [], 0
    for para in text.split("\n"):
        if out and size + len(para) + 1 > max_chars:
            break
        out.append(para)
        size += len(para) + 1
    return "\n".join(out)


@cache
def wiki(split: str) -> tuple[dict, ...]:
    """The shipped Wikipedia articles of ``split`` (``"perplexity"`` or ``"filler"``), in index order.

    Each record has ``title``, ``url``, ``index`` (position in :func:`leankit.data.wiki_articles`)
    and ``text`` (markup stripped, cut at a paragraph end).
    """
    if split not in WIKI_SPLITS:
        raise ValueError(f"unknown wiki split {split!r}; known: {', '.join(WIKI_SPLITS)}")
    with gzip.open(DATA_DIR / "wiki.jsonl.gz", "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    return tuple(r for r in recs if r["split"] == split)


@lru_cache(maxsize=1)
def filler_words() -> tuple[str, ...]:
    """Every word of the filler articles, in order (the haystack pool of the retrieval tasks)."""
    return tuple(w for r in wiki("filler") for w in r["text"].split())


@lru_cache(maxsize=1)
def capitals() -> tuple[tuple[str, str], ...]:
    """``(capital, country)`` pairs of word2vec's ``capital-world`` analogies."""
    pairs = json.loads((DATA_DIR / "capitals.json").read_text(encoding="utf-8"))
    return tuple((a, b) for a, b in pairs)
