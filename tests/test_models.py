"""Offline model resolution: an embedded model is converted once, even by runs started together."""

import threading
import time

import pytest

from leankit import models


def test_runs_started_together_convert_an_embedded_model_once(tmp_path, monkeypatch):
    """Three loaders race on a fresh cache directory: one converts, the others wait on the lock and
    then find the published checkpoint (unlocked, a late converter deleted the checkpoint another
    run was loading)."""
    monkeypatch.setenv("LEANKIT_CACHE", str(tmp_path))
    calls = []

    def slow_convert(name, target):
        calls.append(name)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    found = []
    threads = [threading.Thread(target=lambda: found.append(models.model_path("smollm2-135m"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["smollm2-135m"]
    assert found == [tmp_path / "models" / "smollm2-135m"] * 3
    assert models.model_path("smollm2-135m") == found[0] and len(calls) == 1  # converted once, for good


def test_a_directory_without_config_json_is_named_as_such(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        models.model_path(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model"):
        models.model_path(str(tmp_path / "missing"))
