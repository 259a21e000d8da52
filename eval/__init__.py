"""leankit evaluation: perplexity through a compressing cache, needle retrieval, and helpers.

Run the scripts as modules from the repository root, e.g.::

    python -m eval.perplexity --help
    python -m eval.needle --help
"""
