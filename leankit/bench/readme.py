"""Results tables in README.md, written between markers, never by hand.

A block named ``NAME`` is everything between the lines ``<!-- leankit-bench:NAME -->`` and
``<!-- /leankit-bench:NAME -->``; :func:`replace_block` swaps its content and leaves every other
byte of the file as it was.
"""

from __future__ import annotations

import datetime
import platform
import re
import shlex
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The opening and closing marker of block ``name``."""
    return f"<!-- leankit-bench:{name} -->", f"<!-- /leankit-bench:{name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the content of block ``name`` replaced by ``body``.

    Raises ``ValueError`` unless ``text`` holds exactly one opening marker followed by exactly one
    closing marker of that block.
    """
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"README must hold exactly one {start} and one {end}; found {text.count(start)} and "
                         f"{text.count(end)}: add the marker pair where the table belongs")
    i, j = text.index(start), text.index(end)
    if j < i:
        raise ValueError(f"{end} comes before {start} in the README")
    return text[: i + len(start)] + "\n" + body.strip("\n") + "\n" + text[j:]


def write_block(path: str | Path, name: str, body: str) -> None:
    """Replace block ``name`` of the file at ``path`` (see :func:`replace_block`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--readme {path} is not a file")
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_block(text, name, body), encoding="utf-8")


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else the platform module)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# Options that only say where output goes: left out of the command a README shows, which must
# reproduce the table on any machine (and name no local path).
_OUTPUT_OPTIONS = {"--json": 1, "--readme": 1, "--plot": 1, "--write-readme": 0, "--no-progress": 0}


def reproducible_args(argv: list[str]) -> list[str]:
    """``argv`` without the output-only options (``--json FILE``, ``--readme FILE``, ...)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _OUTPUT_OPTIONS:
            skip = _OUTPUT_OPTIONS[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


def provenance(argv: list[str], threads: int) -> str:
    """The lines under a table: exact command, CPU, threads, torch version and date."""
    import torch

    return (f"Command: `{shlex.join(['leankit', 'bench', *reproducible_args(argv)])}`  \n"
            f"CPU: {cpu_model()}, {threads} torch thread(s); torch {torch.__version__}; "
            f"{datetime.date.today().isoformat()}. Written by `leankit bench --write-readme`; do not edit by hand.")
