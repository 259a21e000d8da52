"""matplotlib for leankit's figures (bench results, the planner's timeline): imported only when a
figure is drawn, on the file-only Agg backend, with one clear error when it is not installed.

matplotlib is not a core dependency; the ``bench`` and ``eval`` extras bring it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class MatplotlibMissing(ModuleNotFoundError, RuntimeError):
    """matplotlib is not installed. A ``ModuleNotFoundError`` (what ``leankit``'s command line
    reports as an error) and a ``RuntimeError`` (what ``leankit plan --timeline`` reports)."""


def require_matplotlib(what: str = "drawing a figure") -> None:
    """Raise :class:`MatplotlibMissing`, naming ``what`` needed it and the extras that bring it,
    when matplotlib is not installed (so a long run that ends in a figure can check first)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MatplotlibMissing(f"{what} needs matplotlib, which is not installed: "
                                "pip install matplotlib (or pip install 'leankit-kv[bench]')")


def pyplot(what: str = "drawing a figure"):
    """matplotlib's pyplot on the Agg backend (no display needed), or :class:`MatplotlibMissing`."""
    require_matplotlib(what)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` to the PNG ``path`` (its folder created if needed) and close it."""
    import matplotlib.pyplot as plt

    out = Path(path)
    if out.is_dir():
        plt.close(fig)
        raise RuntimeError(f"{path} is a folder; give a file name for the figure (e.g. {out / 'figure.png'})")
    if not out.suffix:  # matplotlib appends the default format's extension: report the file it writes
        out = out.with_name(out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
