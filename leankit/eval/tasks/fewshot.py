"""Few-shot generation: complete "<capital> is the capital of" with the country.

The pairs are the ``capital-world`` analogies of word2vec's ``questions-words.txt`` (116 unique
capital/country pairs). The first ``FEWSHOT_PAIRS`` form the few-shot split (lm-eval's
``first_n`` sampler takes them in order, so every prompt is the same on every run); the rest are
scored by exact match of the first generated line, ignoring case and trailing punctuation.
"""

from __future__ import annotations

from .corpus import capitals

FEWSHOT_PAIRS = 16


def capital_docs(**kwargs):
    """lm-eval ``custom_dataset`` of ``leankit_capitals``: ``train`` (few-shot) and ``test`` splits."""
    import datasets

    rows = [{"capital": a, "country": b} for a, b in capitals()]
    return {"train": datasets.Dataset.from_list(rows[:FEWSHOT_PAIRS]),
            "test": datasets.Dataset.from_list(rows[FEWSHOT_PAIRS:])}


def normalize(text: str) -> str:
    """First line, stripped of spaces and trailing punctuation, lower-cased."""
    lines = text.strip().splitlines()
    return (lines[0] if lines else "").strip().rstrip(".,;:!?").strip().lower()


def process_results(doc: dict, results: list[str]) -> dict:
    """lm-eval ``process_results``: ``{"exact_match": 1.0 if the country was generated else 0.0}``."""
    return {"exact_match": float(normalize(results[0]) == doc["country"].lower())}
