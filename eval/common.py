"""Shared helpers for the evaluation scripts: config strings, timing, result files."""

from __future__ import annotations

import json
import time
from pathlib import Path

from leankit.config import KVConfig, split_overrides
from leankit.outputs import output_problem


def parse_config(text: str) -> tuple[str, dict]:
    """``"K8V4-K4V2:th=0.2,tl=0"`` -> ``("K8V4-K4V2", {"th": 0.2, "tl": 0.0})`` (validated)."""
    spec, kw = split_overrides(text)
    KVConfig.parse(spec, **kw)  # fail early on a bad config
    return spec, kw


def label(spec: str, kw: dict) -> str:
    """Readable name of a config with its overrides."""
    return spec + ("" if not kw else ":" + ",".join(f"{k}={v}" for k, v in kw.items()))


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def add_run_options(ap) -> None:
    """Add the options every evaluation script shares: ``--threads`` and ``--out``."""
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")


def check_run_options(ap, args) -> None:
    """Refuse bad ``--threads``/``--out`` values through ``ap.error``, before the model loads."""
    if args.threads < 0:
        ap.error(f"--threads must be at least 0 (0: torch's default), got {args.threads}")
    problem = output_problem(args.out)
    if problem:
        ap.error(f"--out: {problem}")


def check_configs_fit(ap, model, configs) -> None:
    """Refuse, through ``ap.error``, a config only the loaded model can reject (a group size that
    does not divide its head_dim ...), before any document is scored rather than as a traceback."""
    from leankit.cache import LeanCache

    for spec, kw in configs:
        try:
            LeanCache(model, spec, max_seq_len=16, **kw)
        except ValueError as err:
            ap.error(f"{label(spec, kw)} does not fit the model: {err}")


def start_run(args):
    """Apply ``--threads`` and load the evaluation model: ``(model, tokenizer)``."""
    import torch

    from .model import load_smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_smollm2()


def write_json(path: str | None, payload: dict) -> None:
    """Write results (if a path is given), creating the parent directory."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2))
