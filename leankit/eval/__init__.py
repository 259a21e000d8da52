"""lm-evaluation-harness integration: score any lm-eval task through a compressing LeanCache.

* :class:`LeanKitLM` (``from leankit.eval import LeanKitLM``) is an lm-eval model, registered
  under the name ``leankit``, whose log-likelihoods and generations read a fresh LeanCache.
* ``leankit lm-eval ...`` runs lm-eval's own command line with that model registered and the
  offline tasks of :mod:`leankit.eval.tasks` on the include path.

Needs the ``eval`` extra (``lm-eval[hf]``). lm-eval is imported only when :class:`LeanKitLM` is
first used, so the task builders work without it.
"""

from __future__ import annotations

__all__ = ["TASK_DIR", "LeanKitLM"]

from .tasks import TASK_DIR


def __getattr__(name):
    if name == "LeanKitLM":
        from .lm import LeanKitLM

        return LeanKitLM
    raise AttributeError(f"module 'leankit.eval' has no attribute {name!r}")
