import pytest

from leankit.config import GRAMMAR, OVERRIDE_GRAMMAR, KVConfig, Precision, fp16_token_bytes, split_overrides


@pytest.mark.parametrize("spec,high,low", [
    ("FP16", (16, 16), None), ("K8V4", (8, 4), None), ("K4V8", (4, 8), None), ("k4v2", (4, 2), None),
    ("K8V4-K4V2", (8, 4), (4, 2)), ("K4V2-K4V1", (4, 2), (4, 1)), ("K16V8", (16, 8), None),
])
def test_parse_grammar(spec, high, low):
    cfg = KVConfig.parse(spec)
    assert (cfg.high.k_bits, cfg.high.v_bits) == high
    assert (None if cfg.low is None else (cfg.low.k_bits, cfg.low.v_bits)) == low
    assert cfg.policy == ("leankv" if low else "full")


@pytest.mark.parametrize("bad", ["", "K8", "K3V4", "K8V4-", "K8V4-K4V2-K2V1", "FP8", "K8 V4", "V4K8", "K32V4",
                                 "K\u0668V4"])  # an Arabic-Indic 8: int() reads it, the grammar does not
def test_bad_spec_shows_grammar(bad):
    with pytest.raises(ValueError) as e:
        KVConfig.parse(bad)
    assert "K<b>V<b>" in str(e.value)


def test_non_string_spec():
    with pytest.raises(ValueError, match="grammar"):
        KVConfig.parse(84)


def test_overrides_and_errors():
    cfg = KVConfig.parse("K8V4-K4V2", th=0.1, tl=0.01, window=32, page_size=4096, group_size=32)
    assert (cfg.th, cfg.tl, cfg.window, cfg.page_size, cfg.group_size) == (0.1, 0.01, 32, 4096, 32)
    assert KVConfig.parse("FP16", policy="h2o", budget=0.2).policy == "h2o"
    with pytest.raises(ValueError, match="unknown"):
        KVConfig.parse("K8V4", windw=3)
    with pytest.raises(ValueError, match="window"):
        KVConfig.parse("K8V4", window=-1)
    with pytest.raises(ValueError, match="page_size"):
        KVConfig.parse("K8V4", page_size=1000)
    with pytest.raises(ValueError, match="budget"):
        KVConfig.parse("FP16", policy="h2o")
    with pytest.raises(ValueError, match="policy"):
        KVConfig.parse("K8V4", policy="magic")
    with pytest.raises(ValueError, match="tl"):
        KVConfig.parse("K8V4-K4V2", th=0.01, tl=0.1)
    with pytest.raises(ValueError):
        Precision(3, 4)


def test_inline_overrides():
    cfg = KVConfig.parse("K8V4-K4V2:th=0.2, tl=0,group_size=32,low_group_size=16,window=8")
    assert (cfg.th, cfg.tl, cfg.group_size, cfg.low_group_size, cfg.window) == (0.2, 0.0, 32, 16, 8)
    assert KVConfig.parse("K8V4-K4V2:th=0.2", th=0.4).th == 0.4  # keyword arguments win
    assert KVConfig.parse("FP16:policy=h2o,budget=0.3").budget == 0.3
    assert KVConfig.parse("K8V4:") == KVConfig.parse("K8V4")
    assert split_overrides("K4V4:group_size=32") == ("K4V4", {"group_size": 32})
    for bad, msg in [("K8V4:th", "key=value"), ("K8V4:thresh=0.1", "unknown override"),
                     ("K8V4:window=big", "bad value"), ("K8V4:group_size=2.5", "bad value"),
                     ("K8V4-K4V2:window=\u0663", "bad value"),
                     ("K8V4-K4V2:th=0.01,tl=0.1", "tl"), ("K9V4:th=0.1", "K<b>V<b>")]:
        with pytest.raises(ValueError, match=msg):
            KVConfig.parse(bad)


@pytest.mark.parametrize("bad,says", [("K8V4:th", "is not key=value"), ("K8V4:thresh=0.1", "known: window"),
                                      ("K8V4:window=big", "window takes an integer"),
                                      ("K8V4-K4V2:th=high", "th takes a number"),
                                      ("neutral:rotate=maybe", "rotate takes a boolean")])
def test_a_malformed_override_shows_the_override_grammar(bad, says):
    """README: "A malformed spec or override raises ValueError showing the grammar": an override's
    error shows how overrides are written (and a bad value the type its setting takes), as a
    malformed tier's shows GRAMMAR."""
    with pytest.raises(ValueError) as err:
        KVConfig.parse(bad)
    assert says in str(err.value) and OVERRIDE_GRAMMAR in str(err.value)


def test_token_bytes_exact():
    # K8V4 at head_dim 64: 64 B keys + 4 B meta + 32 B values + 4 B meta + 2 B score + 4 B position.
    tb = KVConfig.parse("K8V4").token_bytes(64)
    assert (tb.k_data, tb.k_meta, tb.v_data, tb.v_meta, tb.score, tb.position) == (64, 4, 32, 4, 2, 4)
    assert tb.total == 110
    assert KVConfig.parse("K4V2").token_bytes(64).total == 32 + 4 + 16 + 4 + 6
    assert KVConfig.parse("FP16").token_bytes(64).total == 256 + 6
    assert KVConfig.parse("FP16").token_bytes(64, dense_itemsize=4).total == 512 + 6
    assert KVConfig.parse("K8V4", group_size=16).token_bytes(64).k_meta == 16
    assert fp16_token_bytes(64) == 256


def test_low_tier_group_size():
    # The low tier alone at two groups: K4V2 pays 4 more metadata bytes per side, K8V4 none.
    cfg = KVConfig.parse("K8V4-K4V2", low_group_size=32)
    assert cfg.token_bytes(64, 0) == KVConfig.parse("K8V4").token_bytes(64)
    assert cfg.token_bytes(64, 1).total == 32 + 8 + 16 + 8 + 6
    assert cfg.tokens_per_page(64, 1) == 28  # 29 tokens would need 2064 bytes after 16-byte alignment
    assert KVConfig.parse("K8V4-K4V2", group_size=16, low_group_size=32).token_bytes(64, 0).k_meta == 16
    assert KVConfig.parse("K8V4-K4V2", group_size=16).tier_group_size(1) == 16
    with pytest.raises(ValueError, match="two-tier"):
        KVConfig.parse("K8V4", low_group_size=32)
    with pytest.raises(ValueError, match="low_group_size"):
        KVConfig.parse("K8V4-K4V2", low_group_size=0)
    with pytest.raises(ValueError, match="low_group_size 24 must divide head_dim 64"):
        KVConfig.parse("K8V4-K4V2", low_group_size=24).token_bytes(64, 1)
    with pytest.raises(ValueError, match="^group_size 24 must divide head_dim 64"):  # the low tier inherits it
        KVConfig.parse("K8V4-K4V2", group_size=24).token_bytes(64, 1)


def test_tokens_per_page_follow_precision():
    k84, k42 = KVConfig.parse("K8V4"), KVConfig.parse("K4V2")
    t84, t42 = k84.tokens_per_page(64), k42.tokens_per_page(64)
    assert t84 == 18 and t42 == 32
    assert 1.6 <= t42 / t84 <= 2.0  # "a K4V2 page holds about twice the tokens of a K8V4 page"
    # page-level bytes per token for K8V4 stay under 0.45 of fp16 at head_dim 64
    assert k84.kv_bytes_per_token(64) / fp16_token_bytes(64) < 0.45
    with pytest.raises(ValueError, match="cannot hold"):
        KVConfig.parse("FP16", page_size=256).tokens_per_page(128, dense_itemsize=4)


def test_default_page_size_follows_quantization():
    """Configs that quantize nothing default to 8 KB pages, the rest to 2 KB; a page size given
    explicitly (or ``None``, the default) is kept."""
    from leankit.config import DENSE_PAGE_SIZE, QUANTIZED_PAGE_SIZE

    for spec in ("FP16", "K16V16", "FP16:policy=h2o,budget=0.5", "FP16:act=0.5"):
        assert KVConfig.parse(spec).page_size == DENSE_PAGE_SIZE == 8192, spec
    for spec in ("K8V4", "K16V4", "K4V16", "K8V4-K4V2", "K16V16-K8V4"):
        assert KVConfig.parse(spec).page_size == QUANTIZED_PAGE_SIZE == 2048, spec
    assert KVConfig.parse("FP16:page_size=2048").page_size == 2048
    assert KVConfig.parse("K8V4", page_size=4096).page_size == 4096
    assert KVConfig.parse("FP16", page_size=None).page_size == 8192
    assert KVConfig.parse(KVConfig.parse("FP16"), policy="streaming").page_size == 8192  # kept by a re-parse
    # The dense default wastes at most about a tenth of a page where 2 KB pages wasted a quarter:
    # fp32 keys and values of head_dim 64 are 518 bytes a token (3 to a 2 KB page, 15 to 8 KB).
    for dim, itemsize in ((64, 2), (64, 4), (128, 2), (128, 4)):
        cfg = KVConfig.parse("FP16")
        used = cfg.tokens_per_page(dim, dense_itemsize=itemsize) * cfg.token_bytes(dim, dense_itemsize=itemsize).total
        assert used / cfg.page_size > 0.88, (dim, itemsize)
    small = KVConfig.parse("FP16:page_size=2048")
    assert small.tokens_per_page(64, dense_itemsize=4) == 3
    assert KVConfig.parse("FP16").tokens_per_page(64, dense_itemsize=4) == 15


def test_str_roundtrip():
    for s in ["FP16", "K8V4", "K8V4-K4V2", "K4V8"]:
        assert str(KVConfig.parse(s)) == s
    assert "FP16" in GRAMMAR


@pytest.mark.parametrize("spec,label", [
    ("K8V4", "K8V4"), ("K8V4-K4V2", "K8V4-K4V2"), ("K8V4:policy=h2o,budget=0.5", "K8V4:policy=h2o,budget=0.5"),
    ("K8V4:sink=7,policy=streaming", "K8V4:policy=streaming,sink=7"), ("K8V4:policy=leankv,tl=0.1", "K8V4:policy=leankv,tl=0.1"),
    ("neutral", "K8V4-K4V2:group_size=32,th=0.25,rotate=1"), ("K8V4-K4V2:tl=0.05,th=0.3", "K8V4-K4V2:th=0.3,tl=0.05"),
    ("K8V4:act=0.5,act_order=prefix,page_size=256", "K8V4:page_size=256,act=0.5,act_order=prefix"),
    ("FP16:page_size=8192", "FP16")])
def test_label_names_every_setting_and_parses_back(spec, label):
    """``label()`` (what reports and the CLI print) keeps the policy and every setting away from the
    tiers' defaults, where ``str()`` gives the tiers alone, and parses back to the same config."""
    cfg = KVConfig.parse(spec)
    assert cfg.label() == label
    assert KVConfig.parse(label) == cfg


@pytest.mark.parametrize("spec", ["K4V2-K8V4", "K4V4-K8V2", "K8V2-K4V4", "K8V4-FP16"])
def test_low_tier_more_precise_than_high_rejected(spec):
    with pytest.raises(ValueError, match="more precise") as e:
        KVConfig.parse(spec)
    assert spec.split("-")[1] in str(e.value)  # names the offending tier


@pytest.mark.parametrize("spec,key", [("K8V4:tl=0.5", "tl"), ("K8V4:th=0.3", "th"), ("FP16:tl=0", "tl"),
                                      ("K8V4:policy=leankv,th=0.2", "th"), ("K8V4:budget=0.3", "budget"),
                                      ("K8V4:policy=h2o,budget=0.3,sink=2", "sink")])
def test_setting_ignored_by_policy_rejected(spec, key):
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        KVConfig.parse(spec)
    base, inline = split_overrides(spec)
    with pytest.raises(ValueError, match=rf"\b{key}\b"):  # same check for keyword overrides
        KVConfig.parse(base, **inline)


def test_settings_read_by_policy_accepted():
    assert KVConfig.parse("K8V4:policy=leankv,tl=0.2").tl == 0.2  # single-tier LeanKV prunes at tl
    assert KVConfig.parse("K8V4-K4V2", th=0.3, tl=0).th == 0.3
    assert KVConfig.parse("FP16", policy="streaming", sink=2, window=8).sink == 2
    assert KVConfig.parse("K4V2-K4V1").low == Precision(4, 1)  # equal keys, fewer value bits: fine
    assert KVConfig.parse("K8V4:policy=streaming,sink=0,window=8").window == 8
    with pytest.raises(ValueError, match="keeps no token"):
        KVConfig.parse("K8V4:policy=streaming,sink=0,window=0")


@pytest.mark.parametrize("kw", [{"th": "0.3"}, {"window": 8.0}, {"window": "8"}, {"group_size": 32.5},
                                {"rotate": "yes"}, {"rotate": 2}, {"policy": 1}, {"page_size": True}])
def test_keyword_override_types_raise_value_error(kw):
    key, val = next(iter(kw.items()))
    with pytest.raises(ValueError, match=rf"{key}={val!r}".replace("(", r"\(").replace(".", r"\.")):
        KVConfig.parse("K8V4-K4V2", **kw)


def test_keyword_override_types_accepted_and_widened():
    cfg = KVConfig.parse("K8V4-K4V2", th=1, tl=0, rotate=1, group_size=None)
    assert isinstance(cfg.th, float) and cfg.th == 1.0 and cfg.rotate is True and cfg.group_size is None
    # overrides on an already-parsed config go through the same checks
    base = KVConfig.parse("K8V4-K4V2")
    assert KVConfig.parse(base, window=8).window == 8
    for kw in ({"tl": 0.5, "th": 0.2}, {"window": "8"}, {"windw": 8}):
        with pytest.raises(ValueError):
            KVConfig.parse(base, **kw)


@pytest.mark.parametrize("spec", ["K8V4:policy=H2O,budget=0.5", "K8V4:policy=Streaming,sink=4",
                                  "K8V4-K4V2:policy=LeanKV,th=0.2", "K8V4:act=0.5,act_order=Prefix"])
def test_policy_and_act_order_names_are_read_in_any_case(spec):
    """Tier names parse in any case (``k8v4``), and so do the policy and ACT order names, through
    the string and as keywords; the settings those policies read are then accepted."""
    cfg = KVConfig.parse(spec)
    assert cfg.policy == cfg.policy.lower() and cfg.act_order == cfg.act_order.lower()
    base, inline = split_overrides(spec)
    assert KVConfig.parse(base, **inline) == cfg == KVConfig.parse(cfg.label())


@pytest.mark.parametrize("spec", ["K8V4:policy=foo,budget=0.5", "K8V4-K4V2:policy=lean,th=0.2"])
def test_an_unknown_policy_is_named_before_the_settings_it_would_read(spec):
    with pytest.raises(ValueError, match="policy '.*' not in"):
        KVConfig.parse(spec)


@pytest.mark.parametrize("key", ["window", "compress_every", "sink", "page_size", "group_size"])
def test_integer_settings_beyond_int32_are_refused_when_parsed(key):
    """Positions and counts are int32 on the pages: a larger setting is refused by name at parse
    time, not by an OverflowError inside the first forward."""
    policy = {"sink": "policy=streaming,", "compress_every": ""}.get(key, "")
    spec = "K8V4-K4V2" if key in ("compress_every", "window") else "K8V4"
    with pytest.raises(ValueError, match=rf"{key} must be at most 2147483647"):
        KVConfig.parse(f"{spec}:{policy}{key}={10**20}")
    assert getattr(KVConfig.parse(f"{spec}:{policy}{key}={2**31 - 64}"), key) == 2**31 - 64


@pytest.mark.parametrize("spec", ["K8V4-K4V2:policy=full", "K8V4-K4V2:policy=h2o,budget=0.5",
                                  "K8V4-K4V2:policy=streaming,sink=2", "FP16-K8V4:policy=full"])
def test_a_low_tier_with_a_single_tier_policy_is_refused_when_parsed(spec):
    """Only LeanKV places tokens in a low tier; every LeanCache refused such a config, but the parser
    (and so ``leankit plan``, which then planned with it) accepted it."""
    with pytest.raises(ValueError, match="single precision tier"):
        KVConfig.parse(spec)
    base, inline = split_overrides(spec)
    with pytest.raises(ValueError, match="single precision tier"):
        KVConfig.parse(KVConfig.parse(base), **inline)


@pytest.mark.parametrize("spec,policy", [("neutral", "full"), ("K8V4:policy=leankv,tl=0.2", "full"),
                                         ("K8V4:policy=streaming,sink=2", "h2o")])
def test_a_policy_override_of_a_parsed_config_checks_the_settings_it_carries(spec, policy):
    """Overriding the policy of a parsed config must not keep a setting the new policy ignores:
    the result's label() did not parse back (the string path refuses the same combination)."""
    kw = {"budget": 0.5} if policy == "h2o" else {}
    with pytest.raises(ValueError):
        KVConfig.parse(spec, policy=policy, **kw)
    with pytest.raises(ValueError):
        KVConfig.parse(KVConfig.parse(spec), policy=policy, **kw)


def test_a_tier_with_an_embedded_newline_is_refused():
    with pytest.raises(ValueError, match="cannot parse tier"):
        KVConfig.parse("K8V4\n-K4V2")
    assert KVConfig.parse(" K8V4-K4V2\n").low == Precision(4, 2)  # around the whole spec: stripped
