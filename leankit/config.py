"""KV cache configuration: the precision grammar and the exact byte model.

A configuration string names one or two *precision tiers* (LeanKV §4):

    FP16                 every token unquantized
    K<b>V<b>             one tier, keys at b bits and values at b bits
    K<b>V<b>-K<b>V<b>    a high tier, then a low tier (LeanKV's unified compression)

optionally followed by overrides after a colon, ``K8V4-K4V2:th=0.2,tl=0,group_size=32``,
with ``b`` in {16, 8, 4, 2, 1}; 16 means "unquantized" (kept in the model's own dtype, so an
fp32 model stays lossless). Mirror settings such as ``K4V8`` are legal on purpose: the paper's
Hetero-KV ablation (Fig. 7) compares them.

The byte model here is the one every other part of leankit uses (pages, memory report,
planner): a token of one KV head at precision ``K<bk>V<bv>`` costs

    k_data + k_meta + v_data + v_meta + score + position

bytes, where quantized data is ``head_dim * bits / 8`` bytes, metadata is one fp16 scale and one
fp16 minimum per quantization group (Eq. 2), the running significance score is fp16 and the
position is int32 (the six segments of a unified page, §5.2).

ACT pages (HybridServe §3.3, CAPTURE) live in the same pool and hold a layer's input activation
instead: ``hidden`` values in the model dtype plus the int32 position, per token and *layer*
(one activation serves every KV head). A token's vector is split into ``S`` channel slices of
``C = hidden / S`` values, one slice per page, so a page of ``page_size`` bytes holds ``T``
tokens' slices without wasting most of itself when ``hidden * itemsize`` is close to or above
``page_size`` (see :func:`act_geometry`). Per token and layer, with page padding::

    ACT = page_size * S / T                       ~ hidden * itemsize + 4 S
    KV  = page_size / T_kv * num_kv_heads         ~ 2 * num_kv_heads * head_dim * itemsize (+ meta)

so ACT saves memory only when ``hidden < 2 * num_kv_heads * head_dim`` at the same dtype: about
half for MHA (``hidden = heads * head_dim``), and never for GQA models with
``hidden > 2 * num_kv_heads * head_dim`` (SmolLM2: 576 against 384). :func:`act_kv_token_bytes`
gives both numbers so a planner can decline ACT.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

VALID_BITS = (16, 8, 4, 2, 1)
POLICIES = ("full", "leankv", "h2o", "streaming")
ACT_ORDERS = ("ratio", "prefix")  # how ACT blocks are placed (leankit.act_store)

GRAMMAR = (
    "KV config grammar: 'FP16' | 'K<b>V<b>' | 'K<b>V<b>-K<b>V<b>' (high tier, then low tier), "
    "with b in {16, 8, 4, 2, 1} and 16 meaning unquantized. Examples: 'FP16', 'K8V4', 'K4V8', "
    "'K8V4-K4V2'."
)

SCORE_BYTES = 2  # fp16 running significance per token
POSITION_BYTES = 4  # int32 position per token
META_BYTES_PER_GROUP = 4  # fp16 scale + fp16 minimum
PAGE_ALIGN = 16  # every page segment starts on a 16-byte boundary (128-bit loads)
# Default bytes per unified page. A quantized token of a 64- or 128-wide head is 40-200 bytes,
# so 2 KB pages hold 10-50 of them. An unquantized token is 262-1030 bytes (fp16 or fp32, head_dim
# 64 or 128), which a 2 KB page holds only 1-7 times over with up to a quarter of it left unused,
# and every page costs a page-table entry, a lookup and a loop start in attention: configs with no
# quantized side default to 8 KB pages (15-31 tokens, at most about a tenth unused).
QUANTIZED_PAGE_SIZE = 2048
DENSE_PAGE_SIZE = 8192

_TIER_RE = re.compile(r"^K([0-9]+)V([0-9]+)$")  # ASCII digits: \d and int() also take other scripts
def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


# The type of every setting a config string may override (``KVConfig`` fields).
_OVERRIDE_TYPES = {"window": int, "compress_every": int, "page_size": int, "group_size": int, "low_group_size": int, "sink": int,
                   "th": float, "tl": float, "budget": float, "policy": str, "rotate": _parse_bool,
                   "act": float, "act_order": str}
# Largest integer setting: positions and counts are int32 on the pages and in the page table.
INT32_MAX = 2**31 - 1
# Settings whose default is ``None`` ("not set"), so ``None`` is a legal keyword value for them.
_NULLABLE = ("group_size", "low_group_size", "budget", "page_size")
# Settings only some policies read: giving one to a policy that ignores it is an error, not a no-op.
_POLICY_SETTINGS = {"th": ("leankv",), "tl": ("leankv",), "compress_every": ("leankv",), "budget": ("h2o",),
                    "sink": ("streaming",)}


def _spec_value(value) -> str:
    """``value`` as the spec grammar writes it (``rotate`` as 1/0, floats in their shortest form)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def check_override_types(overrides: dict) -> dict:
    """Check keyword overrides against the same typed table the string grammar uses.

    Python values must already have the field's type (an int is accepted for a float field, and
    0/1 for ``rotate``); a string such as ``th="0.3"`` raises ``ValueError`` naming the setting,
    the value and the type expected. Returns ``overrides`` with ints widened to floats.
    """
    out = {}
    for key, val in overrides.items():
        kind = _OVERRIDE_TYPES.get(key)
        if kind is None:
            out[key] = val  # unknown keys are reported by the caller, with the full list
            continue
        if val is None and key in _NULLABLE:
            ok = True
        elif kind is float:
            ok = isinstance(val, (int, float)) and not isinstance(val, bool)
            val = float(val) if ok else val
        elif kind is int:
            ok = isinstance(val, int) and not isinstance(val, bool)
        elif kind is _parse_bool:
            ok = isinstance(val, bool) or (isinstance(val, int) and val in (0, 1))
            val = bool(val) if ok else val
        else:
            ok = isinstance(val, kind)
        if not ok:
            name = "bool" if kind is _parse_bool else kind.__name__
            raise ValueError(f"KV config override {key}={val!r} must be a {name}, got {type(val).__name__}")
        out[key] = val
    return out


# The override half of the grammar, which every override error repeats (as GRAMMAR is for the tiers).
OVERRIDE_GRAMMAR = ("Overrides follow the config after a colon as comma-separated key=value pairs, e.g. "
                    "'K8V4-K4V2:th=0.2,tl=0,group_size=32'.")
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a name", _parse_bool: "a boolean (1/0, true/false)"}


def split_overrides(text: str) -> tuple[str, dict]:
    """Split ``"K8V4-K4V2:th=0.2,tl=0"`` into ``("K8V4-K4V2", {"th": 0.2, "tl": 0.0})``.

    Each value is converted to the type of the ``KVConfig`` field it sets; an unknown key or a
    bad value raises ``ValueError``. Without a colon the overrides are empty.
    """
    spec, _, rest = text.partition(":")
    kw: dict = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, val = (x.strip() for x in item.partition("="))
        if not eq or not val:
            raise ValueError(f"override {item!r} of {text!r} is not key=value. {OVERRIDE_GRAMMAR}")
        if key not in _OVERRIDE_TYPES:
            raise ValueError(f"unknown override {key!r} in {text!r}; known: {', '.join(_OVERRIDE_TYPES)}. "
                             f"{OVERRIDE_GRAMMAR}")
        if key in kw:  # which one was meant is a guess: say so rather than keep one silently
            raise ValueError(f"override {key!r} is given twice in {text!r}")
        try:
            if not val.isascii():  # int() and float() read digits of any script ("\u0668" is 8)
                raise ValueError(val)
            kw[key] = _OVERRIDE_TYPES[key](val)
        except ValueError:
            raise ValueError(f"bad value {val!r} for {key!r} in {text!r}: {key} takes "
                             f"{_TYPE_NAMES[_OVERRIDE_TYPES[key]]}. {OVERRIDE_GRAMMAR}") from None
    return spec.strip(), kw


def _align(n: int, a: int = PAGE_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one token of one KV head occupies in each of the six page segments."""

    k_data: int
    k_meta: int
    v_data: int
    v_meta: int
    score: int = SCORE_BYTES
    position: int = POSITION_BYTES

    @property
    def total(self) -> int:
        """All bytes of the token, metadata included."""
        return self.k_data + self.k_meta + self.v_data + self.v_meta + self.score + self.position


@dataclass(frozen=True)
class Precision:
    """One precision tier: key bits and value bits (16 = unquantized)."""

    k_bits: int
    v_bits: int

    def __post_init__(self):
        for name, b in (("key", self.k_bits), ("value", self.v_bits)):
            if b not in VALID_BITS:
                raise ValueError(f"{name} bits {b} not in {VALID_BITS}. {GRAMMAR}")

    @property
    def k_quantized(self) -> bool:
        return self.k_bits < 16

    @property
    def v_quantized(self) -> bool:
        return self.v_bits < 16

    def token_bytes(self, head_dim: int, group_size: int | None = None, dense_itemsize: int = 2) -> TokenBytes:
        """Exact bytes per (token, KV head) for this tier.

        ``dense_itemsize`` is the element size used for an unquantized (16-bit) side: 2 for
        fp16/bf16 models, 4 when an fp32 model keeps its cache lossless.
        """
        gs = group_size or head_dim
        if head_dim % gs:
            raise ValueError(f"group_size {gs} must divide head_dim {head_dim}")
        groups = head_dim // gs

        def side(bits: int) -> tuple[int, int]:
            if bits >= 16:
                return head_dim * dense_itemsize, 0
            if (head_dim * bits) % 8:
                raise ValueError(f"head_dim {head_dim} at {bits} bits does not fill whole bytes")
            return head_dim * bits // 8, groups * META_BYTES_PER_GROUP

        kd, km = side(self.k_bits)
        vd, vm = side(self.v_bits)
        return TokenBytes(kd, km, vd, vm)

    def __str__(self) -> str:
        if self.k_bits == 16 and self.v_bits == 16:
            return "FP16"
        return f"K{self.k_bits}V{self.v_bits}"


def fp16_token_bytes(head_dim: int) -> int:
    """Bytes an fp16 DynamicCache holds per (token, KV head): K and V, nothing else."""
    return 2 * head_dim * 2


@dataclass(frozen=True)
class KVConfig:
    """A parsed KV cache configuration. Build it with :meth:`KVConfig.parse`.

    Attributes:
        high: precision of the high tier (the recent window always lives here).
        low: precision of the low tier, or ``None`` for a single-tier config.
        window: recent-window size W (LeanKV §4, default 64).
        compress_every: generation steps between two runs of LeanKV's Algorithm 1 (default 16).
            Each run places every token that left the window since the last one, which Algorithm 1
            decides the same way in any order (see :func:`leankit.policy.plan_unified`), so a run
            every ``k`` steps costs ``1/k`` of the per-step planning while at most ``k - 1`` tokens
            per head wait at high precision. ``1`` runs it at every step, as the paper does.
        th, tl: LeanKV thresholds on cumulative significance (high / prune).
        page_size: bytes per unified page; ``None`` (the default) picks ``DENSE_PAGE_SIZE`` (8 KB)
            when no tier quantizes keys or values, else ``QUANTIZED_PAGE_SIZE`` (2 KB).
        group_size: quantization group along head_dim (``None`` = whole head_dim).
        low_group_size: quantization group of the low tier (``None`` = ``group_size``). Fewer
            bits need smaller groups to keep the same error (a 4-bit key of head_dim 64 loses
            about twice the perplexity with one group as with two), while the 8-bit keys of the
            high tier do not, so a finer low tier alone buys accuracy where the bytes are cheap.
        policy: ``"full"`` (keep every token), ``"leankv"`` (per-head dynamic), ``"h2o"``
            (static heavy-hitter budget), ``"streaming"`` (sinks + recent window).
        budget: fraction of tokens kept per head for ``h2o``.
        sink: number of attention-sink tokens kept by ``streaming``.
        rotate: quantize keys and values in an orthonormal Hadamard basis along head_dim (see
            :mod:`leankit.rotation`; not part of LeanKV). Same bytes, lower quantization error;
            a head_dim that is not a power of two rotates in blocks (an odd one raises).
        act: fraction in [0, 1] of each sequence's context stored as ACT blocks (layer input
            activations, recomputed into K/V at attention; HybridServe §3.3/§4.3, KVPR §3). ``0``
            keeps every token as KV, ``1`` is ACT-only. See :mod:`leankit.act_store`.
        act_order: ``"ratio"`` places each new block by HybridServe Eq. 11 (keep ``#ACT : #KV``
            at ``act : 1 - act``); ``"prefix"`` is KVPR's split (the first tokens ACT, the rest KV).
    """

    high: Precision
    low: Precision | None = None
    window: int = 64
    compress_every: int = 16
    th: float = 0.05
    tl: float = 0.0
    page_size: int | None = None
    group_size: int | None = None
    low_group_size: int | None = None
    policy: str = "full"
    budget: float | None = None
    sink: int = 4
    rotate: bool = False
    act: float = 0.0
    act_order: str = "ratio"
    spec: str = field(default="", compare=False)

    def __post_init__(self):
        for name in ("policy", "act_order"):  # names read as tier names are: in any case
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, value.strip().lower())
        if self.page_size is None:  # resolved once, so every reader sees a number
            dense = all(not (t.k_quantized or t.v_quantized) for t in self.tiers)
            object.__setattr__(self, "page_size", DENSE_PAGE_SIZE if dense else QUANTIZED_PAGE_SIZE)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, spec: str | KVConfig, **overrides) -> KVConfig:
        """Parse ``spec`` (see the module docstring) and apply its overrides, then keyword overrides.

        Raises ``ValueError`` showing the grammar for a malformed spec or a bad override.
        """
        overrides = check_override_types(overrides)
        if isinstance(spec, KVConfig):
            if not overrides:
                return spec
            unknown = set(overrides) - set(_OVERRIDE_TYPES)
            if unknown:
                raise ValueError(f"unknown KV config override(s) {sorted(unknown)}; known: {', '.join(_OVERRIDE_TYPES)}")
            cfg = dataclasses.replace(spec, **overrides)
            # the settings carried over from ``spec`` count as given too: a policy override must not
            # keep a setting the new policy ignores (and whose label() would no longer parse)
            carried = {k for k in _POLICY_SETTINGS if getattr(spec, k) != _FIELD_DEFAULTS[k]}
            cfg._check_policy_settings(set(overrides) | carried)
            cfg.validate()
            return cfg
        if not isinstance(spec, str):
            raise ValueError(f"KV config must be a string, got {type(spec).__name__}. {GRAMMAR}")
        from .presets import PRESETS, resolve  # a preset name ("neutral", "k8v4:group_size=32") -> its config

        grammar = f"{GRAMMAR} Or a preset name: {', '.join(PRESETS)}."
        spec = resolve(spec)
        if ":" in spec:
            spec, inline = split_overrides(spec)
            overrides = {**inline, **overrides}  # keyword arguments win over the string's
        text = spec.strip().upper()
        parts = text.split("-")
        if not text or len(parts) > 2:
            raise ValueError(f"cannot parse KV config {spec!r}. {grammar}")
        tiers = []
        for part in parts:
            if part == "FP16":
                tiers.append(Precision(16, 16))
                continue
            m = _TIER_RE.fullmatch(part)  # not match: its "$" also matches before a trailing newline
            if not m:
                raise ValueError(f"cannot parse tier {part!r} of KV config {spec!r}. {grammar}")
            kb, vb = int(m.group(1)), int(m.group(2))
            if kb not in VALID_BITS or vb not in VALID_BITS:
                raise ValueError(f"bits in {part!r} of {spec!r} must be in {VALID_BITS}. {grammar}")
            tiers.append(Precision(kb, vb))
        high = tiers[0]
        low = tiers[1] if len(tiers) == 2 else None
        if low is not None and (low.k_bits > high.k_bits or low.v_bits > high.v_bits):
            raise ValueError(
                f"in KV config {spec!r} the low tier {low} is more precise than the high tier {high} "
                f"(keys {low.k_bits} > {high.k_bits} or values {low.v_bits} > {high.v_bits} bits); "
                f"write the high tier first, e.g. '{low}-{high}'"
            )
        unknown = set(overrides) - set(_OVERRIDE_TYPES)
        if unknown:
            raise ValueError(f"unknown KV config override(s) {sorted(unknown)}; known: {', '.join(_OVERRIDE_TYPES)}")
        overrides = dict(overrides)
        policy = overrides.pop("policy", "leankv" if low is not None else "full")
        cfg = cls(high=high, low=low, policy=policy, spec=spec, **overrides)
        cfg._check_policy_settings(overrides)
        cfg.validate()
        return cfg

    def _check_policy_settings(self, given) -> None:
        """Reject settings that were given but that this config's policy never reads.

        ``th`` separates the high from the low tier, so it also needs two tiers; a single-tier
        ``leankv`` config reads only ``tl`` (its pruning threshold). An unknown policy is left to
        :meth:`validate`, which names it, rather than blamed here for ignoring a setting.
        """
        if self.policy not in POLICIES:
            return
        for key in sorted(set(given) & set(_POLICY_SETTINGS)):
            users = _POLICY_SETTINGS[key]
            if self.policy not in users:
                raise ValueError(f"KV config {self.spec or self} sets {key}, which policy {self.policy!r} ignores "
                                 f"(only {', '.join(users)} reads it)")
            if key == "th" and self.low is None:
                raise ValueError(f"KV config {self.spec or self} sets th, the high/low threshold, on a single tier; "
                                 "use a two-tier config such as 'K8V4-K4V2'")

    def validate(self) -> None:
        """Check the settings that do not depend on the model."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} not in {POLICIES}")
        for name, typ in _OVERRIDE_TYPES.items():  # positions and counts are int32 on the pages
            value = getattr(self, name)
            if typ is int and value is not None and value > INT32_MAX:
                raise ValueError(f"{name} must be at most {INT32_MAX} (an int32), got {value}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.compress_every < 1:
            raise ValueError(f"compress_every must be >= 1 (steps between placement runs), got {self.compress_every}")
        if not (0.0 <= self.tl <= 1.0 and 0.0 <= self.th <= 1.0):
            raise ValueError(f"thresholds must lie in [0, 1], got th={self.th}, tl={self.tl}")
        if self.tl > self.th and self.low is not None:
            raise ValueError(f"tl ({self.tl}) must not exceed th ({self.th})")
        if self.page_size < 64 or self.page_size % PAGE_ALIGN:
            raise ValueError(f"page_size must be a multiple of {PAGE_ALIGN} and >= 64, got {self.page_size}")
        for name in ("group_size", "low_group_size"):
            gs = getattr(self, name)
            if gs is not None and gs <= 0:
                raise ValueError(f"{name} must be positive, got {gs}")
        if self.low_group_size is not None and self.low is None:
            raise ValueError(f"low_group_size needs a two-tier config such as 'K8V4-K4V2', got {self.spec or self}")
        if self.low is not None and self.policy != "leankv":  # every other policy keeps one tier
            raise ValueError(f"policy {self.policy!r} keeps a single precision tier; a low tier ({self.low}) needs "
                             f"policy 'leankv' (or drop it: '{self.high}:policy={self.policy}')")
        if self.policy == "h2o" and not (self.budget is not None and 0.0 < self.budget <= 1.0):
            raise ValueError("policy 'h2o' needs budget in (0, 1], e.g. KVConfig.parse('FP16', policy='h2o', budget=0.2)")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.policy == "streaming" and self.sink + self.window == 0:
            raise ValueError("policy 'streaming' with sink=0 and window=0 keeps no token of the context: "
                             "give it attention sinks or a recent window (e.g. sink=4,window=64)")
        if not (isinstance(self.act, (int, float)) and 0.0 <= self.act <= 1.0):
            raise ValueError(f"act must be a fraction in [0, 1] (0 = all KV, 1 = ACT-only), got {self.act!r}")
        if self.act_order not in ACT_ORDERS:
            raise ValueError(f"act_order must be one of {ACT_ORDERS}, got {self.act_order!r}")

    @property
    def lossless(self) -> bool:
        """Every token is kept unquantized and unrotated (``FP16`` with the ``full`` policy, any ACT
        fraction, whose recompute gives the same K/V), so attention over the cache computes what an
        uncompressed cache does."""
        return (self.low is None and not self.high.k_quantized and not self.high.v_quantized
                and self.policy == "full" and not self.rotate)

    # ------------------------------------------------------------------ bytes
    @property
    def tiers(self) -> tuple[Precision, ...]:
        """The tiers in order: high, then low if present."""
        return (self.high,) if self.low is None else (self.high, self.low)

    def tier_group_size(self, tier: int) -> int | None:
        """Quantization group size of tier ``tier`` (``None`` = the whole head_dim)."""
        if tier == 1 and self.low_group_size is not None:
            return self.low_group_size
        return self.group_size

    def token_bytes(self, head_dim: int, tier: int = 0, dense_itemsize: int = 2) -> TokenBytes:
        """Bytes per (token, KV head) of tier ``tier`` (0 = high, 1 = low)."""
        gs = self.tier_group_size(tier)
        if gs is not None and head_dim % gs:  # named by the setting that chose it
            name = "low_group_size" if tier == 1 and self.low_group_size is not None else "group_size"
            raise ValueError(f"{name} {gs} must divide head_dim {head_dim}")
        return self.tiers[tier].token_bytes(head_dim, gs, dense_itemsize)

    def tokens_per_page(self, head_dim: int, tier: int = 0, dense_itemsize: int = 2) -> int:
        """Tokens that fit one unified page of ``page_size`` bytes at tier ``tier``.

        Each of the six segments is padded to a 16-byte boundary, so this is the largest T with
        sum(align(T * segment_bytes)) <= page_size.
        """
        tb = self.token_bytes(head_dim, tier, dense_itemsize)
        sizes = (tb.k_data, tb.k_meta, tb.v_data, tb.v_meta, tb.score, tb.position)
        t = self.page_size // tb.total
        while t > 0 and sum(_align(t * s) for s in sizes) > self.page_size:
            t -= 1
        if t == 0:
            raise ValueError(
                f"page_size {self.page_size} cannot hold one {self.tiers[tier]} token of head_dim {head_dim}: "
                f"its {tb.total} bytes span six segments each padded to {PAGE_ALIGN} bytes, "
                f"{sum(_align(s) for s in sizes)} bytes a page at least"
            )
        return t

    def kv_bytes_per_token(self, head_dim: int, num_kv_heads: int = 1, tier: int = 0, dense_itemsize: int = 2) -> float:
        """Page bytes per token per layer at tier ``tier``, page padding included (full pages)."""
        return self.page_size / self.tokens_per_page(head_dim, tier, dense_itemsize) * num_kv_heads

    def __str__(self) -> str:
        return "-".join(str(t) for t in self.tiers)

    def label(self) -> str:
        """This config as a spec that parses back to it: the tiers, then every setting that differs
        from the tiers' defaults, the policy first (``'K8V4:policy=h2o,budget=0.5'``; ``str()``
        gives the tiers alone). Reports and the CLI name a config by it."""
        base = KVConfig.parse(str(self))
        keys = ["policy"] + [k for k in _OVERRIDE_TYPES if k != "policy"]
        changed = [f"{k}={_spec_value(getattr(self, k))}" for k in keys if getattr(self, k) != getattr(base, k)]
        return str(self) + (":" + ",".join(changed) if changed else "")


# ---------------------------------------------------------------------------- ACT pages
@dataclass(frozen=True)
class ActGeometry:
    """How ``hidden``-value activations of one token split over ACT pages of ``page_size`` bytes.

    Attributes:
        hidden, itemsize, page_size: the activation width, its element size and the page size.
        slices: ``S``, pages one token's vector spans (channel slices).
        channels: ``C = hidden / S`` values of one slice.
        tokens: ``T``, tokens per page.
        data_offset, position_offset: byte offsets of the two page segments (``[T, C]`` values,
            then ``[T]`` int32 positions, each 16-byte aligned).
    """

    hidden: int
    itemsize: int
    page_size: int
    slices: int
    channels: int
    tokens: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's slice in a page."""
        return self.channels * self.itemsize

    @property
    def data_offset(self) -> int:
        return 0

    @property
    def position_offset(self) -> int:
        return _align(self.tokens * self.row_bytes)

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies over its ``S`` pages, without page padding."""
        return self.slices * (self.row_bytes + POSITION_BYTES)

    @property
    def bytes_per_token(self) -> float:
        """Page bytes per token and layer, page padding included (full pages)."""
        return self.page_size * self.slices / self.tokens


def _act_tokens(row_bytes: int, page_size: int) -> int:
    t = page_size // (row_bytes + POSITION_BYTES)
    while t > 0 and _align(t * row_bytes) + _align(t * POSITION_BYTES) > page_size:
        t -= 1
    return t


def act_geometry(hidden: int, itemsize: int, page_size: int) -> ActGeometry:
    """The ACT page geometry with the fewest page bytes per token.

    Candidates are the slice counts ``S`` dividing ``hidden`` whose slice rows are whole 16-byte
    units (so every row load is 128-bit aligned; any divisor if none is); ties go to the smaller
    ``S`` (fewer pages per token to look up). Raises ``ValueError`` for sizes that cannot fit.
    """
    if hidden <= 0 or itemsize <= 0:
        raise ValueError(f"hidden ({hidden}) and itemsize ({itemsize}) must be positive")
    divisors = [s for s in range(1, hidden + 1) if hidden % s == 0]
    aligned = [s for s in divisors if (hidden // s * itemsize) % PAGE_ALIGN == 0] or divisors
    best = None
    for s in aligned:
        t = _act_tokens(hidden // s * itemsize, page_size)
        if t and (best is None or page_size * s / t < best.bytes_per_token):
            best = ActGeometry(hidden, itemsize, page_size, s, hidden // s, t)
    if best is None:
        raise ValueError(f"page_size {page_size} cannot hold one activation slice of hidden {hidden}")
    return best


def act_kv_token_bytes(cfg: KVConfig, hidden: int, num_kv_heads: int, head_dim: int,
                       dense_itemsize: int = 2) -> dict:
    """Page bytes per token and layer of an ACT block and of ``cfg``'s KV pages, side by side.

    Returns ``{"act", "kv", "act_over_kv", "act_saves"}``; ``kv`` prices every token at the high
    tier. ``act_saves`` is false where ACT costs at least as much as KV (GQA models with
    ``hidden >= 2 * num_kv_heads * head_dim``), the case a planner declines.
    """
    act = act_geometry(hidden, dense_itemsize, cfg.page_size).bytes_per_token
    kv = cfg.kv_bytes_per_token(head_dim, num_kv_heads, 0, dense_itemsize)
    return {"act": act, "kv": kv, "act_over_kv": act / kv, "act_saves": act < kv}


# Each setting's default, for telling a setting carried over from a parsed config from one never set
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVConfig)}

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


# How a supported model type's own attention picks its sliding layers, where it does not read
# ``layer_types``: Llama and OPT never slide (a stray ``sliding_window`` is ignored), Mistral and
# Phi-3 slide every layer whenever ``sliding_window`` is set (their mask builder reads it alone,
# ignoring a declared ``layer_types`` and ``use_sliding_window``).
NEVER_SLIDING_MODEL_TYPES = ("llama", "opt")
WINDOW_ONLY_MODEL_TYPES = ("mistral", "phi3")


def reads_layer_types(model_type: str | None) -> bool:
    """Whether a model type's attention reads a declared ``layer_types`` (not Llama, OPT,
    Mistral or Phi-3, whose sliding layers :func:`attention_layer_types` derives alone)."""
    return model_type not in NEVER_SLIDING_MODEL_TYPES + WINDOW_ONLY_MODEL_TYPES


def attention_layer_types(config) -> list[str]:
    """Attention type of every decoder layer of a (text) model config, an object or its dict, as
    the model's own attention sees it: none slides in Llama and OPT; every layer slides in Mistral
    and Phi-3 when a sliding window is set; elsewhere ``layer_types`` when the model declares it,
    else sliding for all layers when a sliding window is set and enabled, else full. LeanCache
    pages the full-attention layers; sliding-window layers keep transformers' own window-bounded
    cache (and the planner keeps them on the device)."""
    def get(name, default=None):
        return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)

    mtype = get("model_type")
    layers = int(get("num_hidden_layers"))
    if mtype in NEVER_SLIDING_MODEL_TYPES:
        return [FULL_ATTENTION] * layers
    if mtype in WINDOW_ONLY_MODEL_TYPES:
        return [SLIDING_ATTENTION if get("sliding_window") else FULL_ATTENTION] * layers
    declared = get("layer_types")
    if declared:
        return list(declared)
    sliding = get("sliding_window") if get("use_sliding_window", True) else None
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * layers
