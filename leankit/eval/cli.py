"""``leankit lm-eval ...``: lm-eval's own command line, with the ``leankit`` model and tasks available.

lm-eval 0.4 finds a model name only if an imported module registered it, and finds tasks only in
its own folder and in ``--include_path``. This wrapper imports :mod:`leankit.eval.lm` (which
registers ``leankit``), defaults ``--model`` to ``leankit``, adds the shipped offline tasks to
the include path, and hands everything else to ``lm_eval.__main__.cli_evaluate`` unchanged, so
every lm-eval option works as documented by ``lm-eval run --help``.
"""

from __future__ import annotations

import os
import sys

from .tasks import TASK_DIR

SUBCOMMANDS = ("run", "ls", "validate")


def _has(argv: list[str], *flags: str) -> bool:
    return any(a in flags or any(a.startswith(f + "=") for f in flags if f.startswith("--")) for a in argv)


def lm_eval_argv(argv: list[str]) -> list[str]:
    """lm-eval's arguments for ``leankit lm-eval <argv>``: subcommand, model and include path filled in."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        return argv
    command, rest = (argv[0], argv[1:]) if argv[0] in SUBCOMMANDS else ("run", argv)
    if command == "run" and not _has(rest, "--model", "-M"):
        rest = ["--model", "leankit", *rest]
    if not _has(rest, "--include_path"):
        rest = [*rest, "--include_path", str(TASK_DIR)]
    else:
        # lm-eval's command line takes one include path, so the user's replaces the shipped one.
        # lm-eval also loads task YAML files and folders named in --tasks directly, which keeps both.
        print(f"leankit: --include_path replaces the shipped task folder ({TASK_DIR}); to use both, leave "
              "--include_path out and name your own task YAML files or folders in --tasks", file=sys.stderr)
    return [command, *rest]


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval with ``argv`` (default: ``sys.argv[1:]``); returns lm-eval's exit status."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        from lm_eval.__main__ import cli_evaluate

        from . import lm  # noqa: F401  (registers the model name "leankit")
    except ModuleNotFoundError as e:  # one line naming the extra, as a missing model package is reported
        print(f"leankit lm-eval: error: `leankit lm-eval` needs lm-eval: pip install 'leankit-kv[eval]' "
              f"(or 'lm-eval[hf]') ({e})", file=sys.stderr)
        return 2
    args = lm_eval_argv(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm-eval", *args]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse errors and --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (ValueError, ModuleNotFoundError) as e:  # a bad model argument or task setting, or an embedded
        # model whose package is missing (its message names the pip command): one clear line, no
        # traceback, as `leankit generate` reports them
        print(f"leankit lm-eval: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0
