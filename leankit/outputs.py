"""Where results go: checking an output path before the work that fills it.

Benchmarks and evaluations write their JSON, figures and tables after minutes of measurement, so a
path under a file or in a read-only folder is refused up front, not after the work is done.
"""

from __future__ import annotations

import os
from pathlib import Path


def output_problem(path: str | Path | None, folder: bool = False) -> str | None:
    """Why ``path`` cannot receive output (``None`` when it can), found without writing anything.

    ``path`` is a file to write, or with ``folder`` a folder to write files into; missing folders
    count as creatable when their nearest existing ancestor is a writable folder.
    """
    if not path:
        return None
    p = Path(path)
    if not folder and p.is_dir():
        return f"{path} is a folder; give a file name"
    if folder and p.exists() and not p.is_dir():
        return f"{path} is a file, not a folder"
    parent = p if folder else p.parent
    while not parent.exists():  # the nearest existing ancestor is where the missing folders are made
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"cannot write {path}: permission denied"
    return None


__all__ = ["output_problem"]
