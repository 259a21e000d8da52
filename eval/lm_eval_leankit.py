"""lm-eval through a compressing LeanCache: the script form of ``leankit lm-eval``.

The model class lives in the installed package (``from leankit.eval import LeanKitLM``); this
module re-exports it for older imports and runs lm-eval's command line with the model ``leankit``
registered and the offline tasks of ``leankit.eval.tasks`` on the include path::

    python -m eval.lm_eval_leankit --tasks leankit_niah_single \\
        --model_args pretrained=smollm2-135m,kv=K8V4-K4V2,th=0.3,tl=0,group_size=32 --limit 10
"""

from __future__ import annotations

import sys

from leankit.eval.cli import main
from leankit.eval.lm import LeanKitLM

__all__ = ["LeanKitLM", "main"]

if __name__ == "__main__":
    sys.exit(main())
