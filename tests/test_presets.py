"""Named configs (leankit.presets): every preset parses, overrides win, other strings pass through."""

import pytest

from leankit.config import KVConfig
from leankit.presets import PRESETS, resolve


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses_to_its_spec(name):
    assert KVConfig.parse(resolve(name)) == KVConfig.parse(PRESETS[name].spec)
    assert KVConfig.parse(resolve(name.upper())) == KVConfig.parse(PRESETS[name].spec)


def test_overrides_after_a_preset_win():
    cfg = KVConfig.parse(resolve("neutral:th=0.3,window=32"))
    assert cfg == KVConfig.parse("K8V4-K4V2", th=0.3, tl=0.0, group_size=32, rotate=True, window=32)


def test_other_strings_pass_through_unchanged():
    for text in ("K4V2", "K8V4-K4V2:th=0.2,tl=0", "nonsense"):
        assert resolve(text) == text
    with pytest.raises(ValueError, match="unknown override"):
        resolve("neutral:bogus=1")


def test_recommended_preset_is_the_measured_one():
    p = PRESETS["neutral"]
    assert p.spec == "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1"
    assert p.spec.split(":")[1] in p.command  # the command measures exactly this config


def test_kvconfig_parse_and_leancache_take_preset_names():
    from leankit.cache import LeanCache
    from leankit.testing import tiny_model

    assert KVConfig.parse("neutral") == KVConfig.parse(PRESETS["neutral"].spec)
    assert KVConfig.parse("Compact:tl=0.1").tl == 0.1
    cache = LeanCache(tiny_model("llama-mha"), "k8v4:group_size=8")  # head_dim 16
    assert cache.cfg == KVConfig.parse("K8V4", group_size=8)
    with pytest.raises(ValueError, match="cannot parse") as e:
        KVConfig.parse("nutral")
    assert "preset name: " + ", ".join(PRESETS) in str(e.value)  # a mistyped preset is shown the names
