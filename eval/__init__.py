"""leankit evaluation scripts: perplexity through a compressing cache, needle retrieval, and helpers.

Run the scripts as modules from the repository root, e.g.::

    python -m eval.perplexity --help
    python -m eval.needle --help
    python -m eval.build_task_data        # rebuilds the text of the shipped lm-eval tasks

The lm-eval model and the offline tasks install with the package (:mod:`leankit.eval`, and
``leankit lm-eval`` on the command line).
"""
