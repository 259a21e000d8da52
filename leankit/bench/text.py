"""Prompts for the benchmarks, cut from the Wikipedia articles shipped with leankit.

The text is the package's own offline task data (:mod:`leankit.eval.tasks.corpus`, both splits,
CC BY-SA), so the benchmarks need no download and every run sees the same tokens. ``--text FILE``
cuts them from a text of the user's own instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch


def read_text(path) -> str:
    """The UTF-8 text of ``path`` (``--text FILE``), with a clear error when it cannot be used."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--text {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise ValueError(f"--text {path} holds no text")
    return text


def check_positions(model, tokens: int, what: str) -> None:
    """Refuse a benchmark that feeds a row ``tokens`` tokens, beyond the positions the model
    was built for (its text config's ``max_position_embeddings``): OPT's position table ends there,
    and a RoPE model's output past it measures nothing a user would run (a long prefill that looks
    like a hang)."""
    from ..cache import position_limit

    limit = position_limit(model)
    if limit and tokens > limit:
        raise ValueError(f"{what} reach {tokens} tokens, beyond the {limit} positions this model takes "
                         "(max_position_embeddings); ask for shorter sequences")


def corpus_ids(tok, text_path=None) -> torch.Tensor:
    """Token ids of ``tok`` for the benchmark prompts, as one long tensor: every shipped Wikipedia
    article in order, or the text of ``text_path`` (a UTF-8 file) when one is given. Prompts longer
    than the text wrap around it."""
    if text_path is None:
        from ..eval.tasks.corpus import WIKI_SPLITS, wiki

        text = "\n\n".join(r["text"] for split in WIKI_SPLITS for r in wiki(split))
    else:
        text = read_text(text_path)
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError(f"--text {text_path} holds no tokens for this model's tokenizer")
    return ids


def text_source(text_path) -> str:
    """How a results block names where its prompts came from."""
    return "the shipped Wikipedia articles" if text_path is None else f"the text of {Path(text_path).name}"


def left_padded(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``rows`` left-padded with ``pad_id`` to the longest row."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def pad_id(tok) -> int:
    """The tokenizer's pad id, else its eos id (SmolLM2 has both)."""
    pid = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pid is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad batches with")
    return pid


def check_step_context(batch: int, context: int) -> None:
    """Refuse a ``--context`` too short for ``--batch`` rows of ``context - 3 i`` tokens (row ``i``)."""
    if context - 3 * (batch - 1) < 1:
        raise ValueError(f"--context {context} is too short for --batch {batch}: row {batch - 1} would hold "
                         f"{context - 3 * (batch - 1)} tokens")


def step_batch(ids: torch.Tensor, batch: int, context: int) -> list[torch.Tensor]:
    """``batch`` prompts of slightly different lengths (``context - 3 i`` tokens for row ``i``),
    each cut from its own stretch of ``ids`` (wrapping around when the text is short)."""
    check_step_context(batch, context)
    stride = max(len(ids) // batch, 1)
    reps = -(-(context + stride * batch) // len(ids)) + 1
    long = ids.repeat(reps)
    return [long[i * stride: i * stride + context - 3 * i] for i in range(batch)]


@dataclass(frozen=True)
class Request:
    """One request of a throughput mix: its prompt and how many tokens it asks for."""

    prompt: torch.Tensor
    output: int


def request_mix(ids: torch.Tensor, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                seed: int = 0) -> list[Request]:
    """``n`` requests drawn deterministically from ``seed``: prompt lengths uniform in
    ``prompt_range``, outputs uniform in ``output_range`` (both inclusive), each prompt a stretch of
    ``ids`` starting at a random offset."""
    for name, (lo, hi) in (("prompt", prompt_range), ("output", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"--{name}-range must be two numbers 1 <= LO <= HI, got {lo} {hi}")
    if n < 1:
        raise ValueError(f"--requests must be >= 1, got {n}")
    if len(ids) <= prompt_range[1]:
        ids = ids.repeat(prompt_range[1] // max(len(ids), 1) + 2)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        start = rng.randrange(len(ids) - length)
        out.append(Request(ids[start: start + length], rng.randint(*output_range)))
    return out
