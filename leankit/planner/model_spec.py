"""Model shapes for the planner: weight bytes per layer, KV and activation bytes per token.

A :class:`ModelSpec` is built from any Hugging Face config (:meth:`ModelSpec.from_hf_config`) or taken
from the presets (OPT-6.7B/13B/30B/66B, Llama-2-7B/70B, Llama-3-8B/70B, LLaMA-30B/65B and the default
SmolLM2-135M).

It is GQA-aware. Per token and per layer:

* the activation checkpoint (HybridServe's ACT block entry, KVPR's ``X[0:l]``) is ``hidden`` values;
* K and V together are ``2 * num_kv_heads * head_dim`` values.

For OPT (MHA, ``num_kv_heads * head_dim == hidden``) the activation is exactly half the KV (the "ACT block
is 1/2 the KV block" fact of HybridServe §4.3 / CAPTURE §IV-A). For a GQA model such as SmolLM2-135M
(hidden 576, 3 KV heads of 64) the activation (576 values) is *larger* than K+V (384 values), so caching
activations instead of KV only adds traffic; the planner declines it.

KV bytes never come from a second byte model: a plain fp16 cache is ``2 * 2 * kv_heads * head_dim`` bytes
per token per layer, and any leankit configuration is priced by :class:`leankit.config.KVConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leankit.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVConfig,
    act_geometry,
    attention_layer_types,
    reads_layer_types,
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    Attributes:
        name: display name.
        num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab: the usual shapes.
        tied_embeddings: the LM head shares the embedding matrix.
        gated_mlp: three MLP matrices (gate, up, down: Llama) instead of two (OPT).
        bias: linear layers carry biases (OPT).
        max_positions: learned position embeddings (OPT) add ``max_positions * hidden`` parameters; 0
            for rotary models.
        dtype_bytes: bytes per weight/activation element (2 for fp16/bf16).
        sliding_layers: indices of the sliding-window attention layers (Gemma3's local layers, Mistral
            with a window). Their cache holds at most ``sliding_window`` tokens a row, in the model's
            dtype, and stays on the device: LeanCache pages, compresses and offloads the others.
        sliding_window: tokens a sliding layer keeps per row.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    bias: bool = False
    max_positions: int = 0
    dtype_bytes: int = 2
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0

    def __post_init__(self):
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab",
                  "dtype_bytes"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelSpec.{f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        object.__setattr__(self, "sliding_layers", tuple(sorted(set(self.sliding_layers))))
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers must be layer indices in [0, {self.num_layers}), got {self.sliding_layers}")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window}")

    # ------------------------------------------------------------------ layers
    @property
    def cache_layers(self) -> int:
        """Layers whose cache grows with the context (full attention): the ones the planner places,
        moves and compresses."""
        return self.num_layers - len(self.sliding_layers)

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window layer (its cache bounded, kept on the device)."""
        return layer in self.sliding_layers

    def sliding_tokens(self, lengths) -> float:
        """Tokens one sliding layer holds for rows of ``lengths`` tokens (each capped at the window)."""
        return float(sum(min(n, self.sliding_window) for n in lengths)) if self.sliding_layers else 0.0

    # ------------------------------------------------------------------ shapes
    @property
    def q_dim(self) -> int:
        """Width of the query projection, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of K or V, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def is_gqa(self) -> bool:
        """True when K/V have fewer heads than Q."""
        return self.num_kv_heads < self.num_heads

    # ------------------------------------------------------------------ weights
    def attention_params(self) -> int:
        """Q, K, V and output projection weights of one layer (biases excluded)."""
        return self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + self.q_dim * self.hidden

    def mlp_params(self) -> int:
        """MLP weights of one layer (biases excluded)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    def matmul_params_per_layer(self) -> int:
        """Weights that take part in matmuls, one layer: 2 FLOP each per token."""
        return self.attention_params() + self.mlp_params()

    def params_per_layer(self) -> int:
        """All parameters of one decoder layer: matmul weights, biases, norms."""
        p = self.matmul_params_per_layer()
        if self.bias:
            p += self.q_dim + 2 * self.kv_dim + self.hidden + self.intermediate + self.hidden
            p += 4 * self.hidden  # two LayerNorms, weight and bias
        else:
            p += 2 * self.hidden  # two RMSNorm weights
        return p

    def weight_bytes_per_layer(self, bits: int = 16) -> float:
        """Bytes of one layer's weights at ``bits`` per weight (16 = the model's own dtype).

        Quantized weights add one fp16 scale and one fp16 minimum per group of 64 (FlexGen's group-wise
        scheme that LM-Offload Algorithm 2 describes).
        """
        p = self.params_per_layer()
        if bits >= 16:
            return float(p * self.dtype_bytes)
        return p * bits / 8 + p / 64 * 4

    def embedding_params(self) -> int:
        """Token embeddings, LM head when untied, learned positions, final norm."""
        p = self.vocab * self.hidden
        if not self.tied_embeddings:
            p += self.vocab * self.hidden
        p += self.max_positions * self.hidden
        p += 2 * self.hidden
        return p

    def total_params(self) -> int:
        """All parameters."""
        return self.num_layers * self.params_per_layer() + self.embedding_params()

    def weight_bytes(self) -> float:
        """All weights at the model dtype."""
        return float(self.total_params() * self.dtype_bytes)

    # ------------------------------------------------------------------ per-token bytes
    def act_bytes_per_token(self, kv: KVConfig | str | None = None) -> float:
        """Activation checkpoint bytes per token per layer.

        ``kv=None``: ``hidden`` values (HybridServe Eq. 7, the papers' figure). With a leankit
        :class:`KVConfig`, the bytes leankit's ACT pages of that config's page size take per token
        (:func:`leankit.config.act_geometry`: the values plus a position per page row, and page
        padding), which is what leankit stores and moves.
        """
        if kv is None:
            return float(self.hidden * self.dtype_bytes)
        return float(act_geometry(self.hidden, self.dtype_bytes, KVConfig.parse(kv).page_size).bytes_per_token)

    def act_write_bytes_per_token(self, kv: KVConfig | str | None = None) -> float:
        """Activation bytes one new token sends to the host per layer: its own page rows (values and a
        position per slice, no page padding) with a leankit config, ``hidden`` values without."""
        if kv is None:
            return self.act_bytes_per_token(None)
        return float(act_geometry(self.hidden, self.dtype_bytes, KVConfig.parse(kv).page_size).token_bytes)

    def kv_bytes_per_token(self, kv: KVConfig | str | None = None, high_fraction: float = 1.0) -> float:
        """K+V bytes per token per layer.

        ``kv=None`` is the plain dense cache every baseline holds (an fp16 DynamicCache / FlexGen / vLLM):
        ``2 * num_kv_heads * head_dim * dtype_bytes``. A leankit :class:`KVConfig` (or its string) is priced
        by ``KVConfig.kv_bytes_per_token``: page bytes per token including quantization metadata, score,
        position and page padding. For a two-tier config ``high_fraction`` is the share of tokens in the
        high tier; the default 1.0 prices every token at the high tier (an upper bound, since the mix
        depends on the attention pattern at run time).
        """
        if kv is None:
            return float(2 * self.kv_dim * self.dtype_bytes)
        cfg = KVConfig.parse(kv)
        hi = cfg.kv_bytes_per_token(self.head_dim, self.num_kv_heads, tier=0, dense_itemsize=self.dtype_bytes)
        if cfg.low is None:
            return float(hi)
        if not 0.0 <= high_fraction <= 1.0:
            raise ValueError(f"high_fraction must lie in [0, 1], got {high_fraction}")
        lo = cfg.kv_bytes_per_token(self.head_dim, self.num_kv_heads, tier=1, dense_itemsize=self.dtype_bytes)
        return float(high_fraction * hi + (1.0 - high_fraction) * lo)

    def kv_write_bytes_per_token(self, kv: KVConfig | str | None = None) -> float:
        """K+V bytes one new token sends to the host per layer.

        A new token is written as its own rows of the page segments (codes, group metadata, score,
        position) at the high tier, where every new token enters; a partly filled page's other rows
        and its padding stay where they are, so no page padding crosses the link. For the plain fp16
        cache (``kv=None``) this is :meth:`kv_bytes_per_token`.
        """
        if kv is None:
            return self.kv_bytes_per_token(None)
        cfg = KVConfig.parse(kv)
        return float(cfg.token_bytes(self.head_dim, 0, self.dtype_bytes).total * self.num_kv_heads)

    def act_to_kv_ratio(self, kv: KVConfig | str | None = None) -> float:
        """Activation bytes over KV bytes per token (0.5 for OPT with an fp16 cache, 1.5 for SmolLM2)."""
        return self.act_bytes_per_token() / self.kv_bytes_per_token(kv)

    # ------------------------------------------------------------------ FLOP
    def kv_gen_flops_per_token(self) -> float:
        """FLOP to regenerate one token's K and V of one layer from its activation,
        ``2 * hidden * 2 * kv_dim``; for MHA this is KVPR Eq. 8's ``4 h^2`` per token."""
        return float(2 * self.hidden * 2 * self.kv_dim)

    def decode_linear_flops_per_token(self) -> float:
        """Matmul FLOP of one layer for one new token (2 per weight)."""
        return float(2 * self.matmul_params_per_layer())

    def attention_flops(self, context: int) -> float:
        """FLOP of one new token attending to ``context`` cached tokens in one layer (QK^T and PV)."""
        return float(4 * self.q_dim * context)

    def __str__(self) -> str:
        return self.name


def _p(name, layers, hidden, heads, kv_heads, inter, vocab, **kw) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=hidden // heads, intermediate=inter, vocab=vocab, **kw)


_OPT = {"tied_embeddings": True, "gated_mlp": False, "bias": True, "max_positions": 2050}
# Shapes from each model's published config.json (OPT paper Table 1 for OPT; Meta's model cards).
PRESETS: dict[str, ModelSpec] = {
    "opt-6.7b": _p("opt-6.7b", 32, 4096, 32, 32, 16384, 50272, **_OPT),
    "opt-13b": _p("opt-13b", 40, 5120, 40, 40, 20480, 50272, **_OPT),
    "opt-30b": _p("opt-30b", 48, 7168, 56, 56, 28672, 50272, **_OPT),
    "opt-66b": _p("opt-66b", 64, 9216, 72, 72, 36864, 50272, **_OPT),
    "llama-2-7b": _p("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama-2-70b": _p("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    "llama-3-8b": _p("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama-3-70b": _p("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama-30b": _p("llama-30b", 60, 6656, 52, 52, 17920, 32000),  # LLaMA-1 (LM-Offload Table 3)
    "llama-65b": _p("llama-65b", 80, 8192, 64, 64, 22016, 32000),
    "smollm2-135m": _p("smollm2-135m", 30, 576, 9, 3, 1536, 49152, tied_embeddings=True),
}
DEFAULT_MODEL = "smollm2-135m"

_MODEL_ALIASES = {
    "smollm2": "smollm2-135m",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "facebook/opt-6.7b": "opt-6.7b",
    "facebook/opt-13b": "opt-13b",
    "facebook/opt-30b": "opt-30b",
    "facebook/opt-66b": "opt-66b",
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "llama2-7b": "llama-2-7b",
    "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
}


def model_names() -> list[str]:
    """Preset names accepted by :func:`get_model`."""
    return sorted(PRESETS)


def _get(cfg: Any, *names: str, default=None):
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def from_hf_config(cfg: Any, name: str | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face config object or its dict.

    Understands Llama-style (``num_key_value_heads``, ``head_dim``, ``intermediate_size``), OPT
    (``ffn_dim``, learned positions, biases) and GPT-2 style (``n_embd``, ``n_layer``, ``n_head``,
    ``n_inner``) field names.
    """
    if not isinstance(cfg, dict) and hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()  # its fields as stored (no deprecated-alias properties)
    text = _get(cfg, "text_config")
    if text is not None and _get(cfg, "hidden_size", "n_embd", "d_model") is None:
        # a composite (image-text) config: the decoder's shapes live in its text config, as
        # LeanCache reads them; the outer config still names the model and its dtype
        name = name or _get(cfg, "_name_or_path", "name_or_path", default=None) or None
        outer_dtype = _get(cfg, "dtype", "torch_dtype")
        cfg = dict(text)
        if outer_dtype is not None and _get(cfg, "dtype", "torch_dtype") is None:
            cfg["dtype"] = outer_dtype
    model_type = str(_get(cfg, "model_type", default="") or "")
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    if hidden is None or layers is None or heads is None:
        raise ValueError("config lacks hidden_size / num_hidden_layers / num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads", "n_kv_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=None) or hidden // heads
    inter = _get(cfg, "intermediate_size", "ffn_dim", "n_inner", default=None) or 4 * hidden
    vocab = _get(cfg, "vocab_size", default=32000)
    tied = bool(_get(cfg, "tie_word_embeddings", default=model_type in ("opt", "gpt2")))
    is_opt = model_type == "opt"
    is_gpt2 = model_type == "gpt2"
    gated = not (is_opt or is_gpt2 or _get(cfg, "ffn_dim") is not None)
    bias = bool(is_opt or is_gpt2 or _get(cfg, "attention_bias", default=False))
    max_pos = int(_get(cfg, "max_position_embeddings", "n_positions", default=0) or 0) if (is_opt or is_gpt2) else 0
    if is_opt:
        max_pos += 2  # OPT's learned positions carry an offset of 2
    torch_dtype = str(_get(cfg, "dtype", "torch_dtype", default="float16"))
    dtype_bytes = 4 if "float32" in torch_dtype else 2
    label = name or _get(cfg, "_name_or_path", "name_or_path", default=None) or model_type or "hf-model"
    types = _layer_types(cfg, model_type, int(layers)) if isinstance(cfg, dict) else [FULL_ATTENTION] * int(layers)
    sliding = tuple(i for i, t in enumerate(types) if t == SLIDING_ATTENTION)
    return ModelSpec(name=str(label), num_layers=int(layers), hidden=int(hidden), num_heads=int(heads),
                     num_kv_heads=int(kv_heads), head_dim=int(head_dim), intermediate=int(inter), vocab=int(vocab),
                     tied_embeddings=tied, gated_mlp=gated, bias=bias, max_positions=max_pos,
                     dtype_bytes=dtype_bytes, sliding_layers=sliding,
                     sliding_window=int(_get(cfg, "sliding_window", default=0) or 0) if sliding else 0)


def _layer_types(cfg: dict, model_type: str, layers: int) -> list[str]:
    """Attention type of every layer of a config dict. A ``config.json`` often leaves ``layer_types``
    to its config class (Gemma3's ``sliding_window_pattern``, Qwen2's ``max_window_layers``), so the
    class transformers registers for ``model_type`` derives them when the dict has none."""
    if not cfg.get("layer_types") and model_type and reads_layer_types(model_type):
        try:
            from transformers import AutoConfig

            fields = {k: v for k, v in cfg.items() if k != "model_type"}
            derived = getattr(AutoConfig.for_model(model_type, **fields), "layer_types", None)
        except (ValueError, TypeError, KeyError):  # a model type transformers does not know
            derived = None
        if derived and len(derived) == layers:
            return list(derived)
    return attention_layer_types({**cfg, "model_type": model_type, "num_hidden_layers": layers})


ModelSpec.from_hf_config = staticmethod(from_hf_config)  # type: ignore[attr-defined]


def one_line_message(err: BaseException) -> str:
    """An exception's message on one line (transformers' and huggingface_hub's span several), for
    the one-line errors of the CLIs; its type's name where the message is empty."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) or type(err).__name__


def get_model(name: str | ModelSpec | Any) -> ModelSpec:
    """Resolve a model: a preset name or alias, a HF config object/dict, or a local checkpoint directory
    (read with ``transformers.AutoConfig``, no network).

    Raises ``ValueError`` listing the valid preset names otherwise.
    """
    if isinstance(name, ModelSpec):
        return name
    if not isinstance(name, str):
        return from_hf_config(name)
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key in _MODEL_ALIASES:
        return PRESETS[_MODEL_ALIASES[key]]
    import os

    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(name, local_files_only=True)
        except Exception as err:  # bad JSON (OSError), a field of the wrong type or shape
            # (huggingface_hub's StrictDataclass errors, which are no ValueError), an unknown model_type
            raise ValueError(f"cannot read the model config in {name}: {one_line_message(err)}") from err
        return from_hf_config(hf_config, name=os.path.basename(name))
    raise ValueError(
        f"unknown model {name!r}; valid presets: {', '.join(model_names())} "
        "(or a local directory holding a Hugging Face config.json)"
    )
