"""leankit: unified KV cache compression and recomputation for Hugging Face transformers.

Quick use::

    import leankit
    model, tok = leankit.load_model("smollm2-135m")
    cache = leankit.LeanCache(model, "K8V4")
    out = model.generate(**tok("Hello", return_tensors="pt"), past_key_values=cache, max_new_tokens=32)
    print(cache.memory_report())

or, for every later ``generate`` call and pipeline over the model::

    leankit.apply(model, "K8V4")          # leankit.apply(model, None) undoes it
"""

from . import presets
from .allocator import PoolExhausted
from .apply_cache import apply, remove
from .config import KVConfig, Precision
from .quant import NonFiniteKVError

__version__ = "0.1.0"

__all__ = [
    "KVConfig",
    "LeanCache",
    "NonFiniteKVError",
    "PoolExhausted",
    "Precision",
    "__version__",
    "apply",
    "enable",
    "load_model",
    "presets",
    "remove",
]


def __getattr__(name):
    # transformers is imported lazily so that `import leankit` (and the planner) stays cheap.
    if name == "LeanCache":
        from .cache import LeanCache

        return LeanCache
    if name == "enable":
        from .hf import enable

        return enable
    if name == "load_model":
        from .models import load_model

        return load_model
    raise AttributeError(f"module 'leankit' has no attribute {name!r}")
