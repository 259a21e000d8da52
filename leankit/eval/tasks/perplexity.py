"""Wikitext-style rolling perplexity over whole Wikipedia articles shipped with leankit.

Like lm-eval's ``wikitext`` task, each document is one article scored with
``loglikelihood_rolling`` and reported as word perplexity, byte perplexity and bits per byte.
Through :class:`leankit.eval.LeanKitLM` the rolling windows are fed in chunks with the cache
compressing between them, so the score reflects the compressed cache. The articles are the
``perplexity`` split of the shipped text (19 articles, each cut at a paragraph end within 8,000
characters). Task metadata ``num_docs`` keeps only the first articles and ``max_chars`` cuts each
one shorter (again at a paragraph end).
"""

from __future__ import annotations

from .corpus import cut, wiki


def wikitext_docs(**kwargs):
    """lm-eval ``custom_dataset`` of ``leankit_wikitext``: ``{"test": [{"title", "url", "page"}, ...]}``."""
    import datasets

    docs = wiki("perplexity")
    n = kwargs.get("num_docs", len(docs))
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(docs):
        raise ValueError(f"task setting num_docs must be an integer in [1, {len(docs)}], got {n!r}")
    max_chars = kwargs.get("max_chars")
    if max_chars is not None and (not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1):
        raise ValueError(f"task setting max_chars must be a positive integer, got {max_chars!r}")
    rows = [{"title": d["title"], "url": d["url"], "page": cut(d["text"], max_chars) if max_chars else d["text"]}
            for d in docs[:n]]
    return {"test": datasets.Dataset.from_list(rows)}
