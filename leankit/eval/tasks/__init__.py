"""Offline lm-eval tasks that ship with leankit (no network, no dataset download).

Every task builds its samples at load time from text inside this folder (``data/``), so
``leankit lm-eval --tasks <name>`` runs on a machine with no network. ``leankit lm-eval`` adds
this folder to lm-eval's task include path by itself; from Python, pass
``TaskManager(include_path=leankit.eval.tasks.TASK_DIR)``.

Tasks (the tag ``leankit_offline`` runs all of them); sources and licenses are in ``README.md``:

* ``leankit_niah_single``, ``leankit_niah_multikey``, ``leankit_niah_multivalue``,
  ``leankit_vt``: RULER-style retrieval (needle, multi-key, multi-value, variable tracking) in
  Wikipedia haystacks (:mod:`.retrieval`);
* ``leankit_wikitext``: rolling perplexity over Wikipedia articles (:mod:`.perplexity`);
* ``leankit_capitals``: few-shot generation, "<capital> is the capital of" -> country (:mod:`.fewshot`).
"""

from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent
TASKS = ("leankit_niah_single", "leankit_niah_multikey", "leankit_niah_multivalue", "leankit_vt",
         "leankit_wikitext", "leankit_capitals")
TAG = "leankit_offline"

__all__ = ["TAG", "TASKS", "TASK_DIR"]
