"""Where results go: checking an output path before the work that fills it.

Benchmarks and evaluations write their JSON, figures and tables after minutes of measurement, so a
path under a file or in a read-only folder is refused up front, not after the work is done.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def output_problem(path: str | Path | None, folder: bool = False) -> str | None:
    """Why ``path`` cannot receive output (``None`` when it can), found before the work that fills it.

    ``path`` is a file to write, or with ``folder`` a folder to write files into; missing folders
    count as creatable when their nearest existing ancestor is a writable folder. Writability is
    probed, not read from permission bits: a root user passes ``os.access`` on read-only mounts
    (``/sys``) and on ``/proc``, where every write fails. The probe is a temporary file made and
    removed in that folder, and an existing ``path`` opened for append; neither changes anything.
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
    try:
        fd, probe = tempfile.mkstemp(prefix=".leankit-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write {path}: {parent} takes no new files ({e.strerror or e})"
    if not folder and p.exists():
        try:
            with open(p, "ab"):
                pass
        except OSError as e:
            return f"cannot write {path}: {e.strerror or e}"
    return None



def process_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (``/proc/self/status``):
    setting and restoring it (the only portable way) would briefly widen the files other threads
    create meanwhile."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_as_umask_allows(path: str | Path, mode: int) -> None:
    """Give ``path`` ``mode`` less the process umask. ``mkstemp``/``mkdtemp`` create private files
    (0600/0700), which would hide a shared cache directory's entries from its other users."""
    os.chmod(path, mode & ~process_umask())


__all__ = ["output_problem", "process_umask", "share_as_umask_allows"]
