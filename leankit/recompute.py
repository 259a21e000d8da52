"""ACT -> KV recomputation: the K/V a decoder layer would hand the cache, rebuilt from its input.

HybridServe (§3.3, Eq. 1) and CAPTURE store a layer's *input activation* ``A`` (the hidden state
before the layer's input norm) instead of its K/V, and rebuild them when attention needs them::

    X      = norm(A)                         RMSNorm (Llama, Qwen, Phi-3, Gemma3) or LayerNorm (OPT)
    [K V]  = X [Wk Wv]^T (+ [bk bv])         one GEMM against the stacked projection weights
    K      = k_norm(K)                       per head, where the model has one (Qwen3, Gemma3)
    K      = RoPE(K, position)               rotate-half at each token's own position (none for OPT),
                                             over the first rotary_dim channels (all but partial-rotary Phi)

KVPR (§3) recomputes a prefix of the KV the same way. Nothing here touches the cache: the
functions take tensors and an :class:`ActToKVParams` read once from an HF decoder layer by
:func:`layer_params`.

:func:`act_to_kv_ref` is the plain-PyTorch reference of the fused Triton kernel
``leankit_kernels.act_to_kv`` and leankit's CPU backend. It follows the HF layers' operation
order and dtypes exactly (norm in fp32 and the weight product in the model dtype, ``F.linear``
on the stacked weight, RoPE tables computed in fp32 and cast to the model dtype), so its K/V are
identical to the ones the layer passes to ``Cache.update``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .hf import SUPPORTED_MODEL_TYPES, decoder_stack

NORMS = ("none", "rms", "layer")


@dataclass(frozen=True)
class ActToKVParams:
    """Everything needed to turn a layer's input activations into its post-RoPE K/V.

    Attributes:
        norm: ``"rms"``, ``"layer"`` or ``"none"`` (OPT with ``do_layer_norm_before=False``).
        norm_weight, norm_bias: ``[D]`` input-norm affine parameters (bias only for LayerNorm).
        norm_eps: the input norm's epsilon.
        weight: ``[2 * Hkv * F, D]`` stacked ``[Wk; Wv]`` in ``nn.Linear`` layout.
        bias: ``[2 * Hkv * F]`` stacked ``[bk; bv]`` or ``None``.
        num_kv_heads, head_dim: ``Hkv`` and ``F``.
        k_norm_weight: ``[F]`` per-head RMSNorm weight applied to K before RoPE, or ``None``.
        k_norm_eps: its epsilon.
        inv_freq: ``[R / 2]`` fp32 RoPE inverse frequencies of the first ``R <= F`` channels
            (``R = F`` but for partial-rotary models), or ``None`` for no RoPE (OPT).
        rope_scaling: the rotary ``attention_scaling`` that multiplies cos and sin.
        norm_weight_fp32: Gemma's RMSNorms (input norm and ``k_norm``): the weight, held in fp32
            as ``1 + w``, multiplies the fp32 normalized value before it is rounded to the model
            dtype. Llama's (``False``) round first and multiply in the model dtype.
    """

    norm: str
    norm_weight: torch.Tensor | None
    norm_bias: torch.Tensor | None
    norm_eps: float
    weight: torch.Tensor
    bias: torch.Tensor | None
    num_kv_heads: int
    head_dim: int
    k_norm_weight: torch.Tensor | None = None
    k_norm_eps: float = 1e-6
    inv_freq: torch.Tensor | None = None
    rope_scaling: float = 1.0
    norm_weight_fp32: bool = False

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        out = 2 * self.num_kv_heads * self.head_dim
        if self.weight.dim() != 2 or self.weight.shape[0] != out:
            raise ValueError(f"weight must be [2 * Hkv * F = {out}, hidden], got {tuple(self.weight.shape)}")
        if self.bias is not None and self.bias.shape != (out,):
            raise ValueError(f"bias must be [{out}], got {tuple(self.bias.shape)}")
        d = self.hidden_size
        if self.norm != "none" and (self.norm_weight is None or self.norm_weight.shape != (d,)):
            raise ValueError(f"norm {self.norm!r} needs norm_weight of shape [{d}]")
        if self.norm == "layer" and (self.norm_bias is None or self.norm_bias.shape != (d,)):
            raise ValueError(f"LayerNorm needs norm_bias of shape [{d}]")
        if self.k_norm_weight is not None and self.k_norm_weight.shape != (self.head_dim,):
            raise ValueError(f"k_norm_weight must be [{self.head_dim}], got {tuple(self.k_norm_weight.shape)}")
        if self.inv_freq is not None and (self.inv_freq.dim() != 1 or not 1 <= self.inv_freq.shape[0] <= self.head_dim // 2):
            raise ValueError(f"inv_freq must be [R / 2] for a rotary width R of 2 to head_dim {self.head_dim}, "
                             f"got {tuple(self.inv_freq.shape)}")

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def has_rope(self) -> bool:
        return self.inv_freq is not None

    @property
    def rotary_dim(self) -> int:
        """Channels RoPE rotates (the first ``rotary_dim`` of each head; 0 without RoPE)."""
        return 0 if self.inv_freq is None else 2 * self.inv_freq.shape[0]

    @property
    def rotates_whole_head(self) -> bool:
        """RoPE over every channel of the head, or none: what the act_to_kv kernel computes."""
        return self.rotary_dim in (0, self.head_dim)


# ---------------------------------------------------------------------------- extraction
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _decoder_layers(model):
    base = decoder_stack(model)
    return base, base.layers


def _plain_linear(attn, name: str):
    """``attn.<name>``, which must compute ``F.linear(x, weight, bias)``: recompute reads its weight and
    bias and multiplies them itself, so a module whose output is something else (a PEFT LoRA layer
    wrapping the projection, a quantized linear) would give K/V the layer never computed, silently."""
    mod = getattr(attn, name)
    if not isinstance(mod, torch.nn.Linear) or type(mod).forward is not torch.nn.Linear.forward:
        kind = f"{type(mod).__module__}.{type(mod).__qualname__}"
        raise ValueError(f"act->kv recomputation projects K/V with {name}'s weight and bias as a plain nn.Linear "
                         f"does, but {name} is a {kind} (an adapter such as PEFT's LoRA, or a quantized linear), "
                         "whose output that would not reproduce: merge the adapter into the weights "
                         "(peft's merge_and_unload()) or use a cache without act")
    return mod


def _kv_weight(mtype: str, cfg, attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stacked ``[Wk; Wv]`` (and ``[bk; bv]``) of one attention module, copied once."""
    if mtype == "phi3":  # one fused qkv_proj: rows [q | k | v]
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        f = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
        qkv = _plain_linear(attn, "qkv_proj")
        w, b = qkv.weight, qkv.bias
        rows = slice(hq * f, (hq + 2 * hkv) * f)
        return w[rows].detach().contiguous(), None if b is None else b[rows].detach().contiguous()
    k_proj, v_proj = _plain_linear(attn, "k_proj"), _plain_linear(attn, "v_proj")
    weight = torch.cat([k_proj.weight, v_proj.weight], 0).detach().contiguous()
    kb, vb = k_proj.bias, v_proj.bias
    if (kb is None) != (vb is None):
        raise ValueError("k_proj and v_proj must both have a bias or both have none")
    return weight, None if kb is None else torch.cat([kb, vb]).detach().contiguous()


def _rope_of(base, cfg, layer_idx: int, mtype: str) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32, attention_scaling)`` of the rotary embedding layer ``layer_idx`` uses.

    Gemma3 keeps one table per layer type in one module (``{type}_inv_freq``); earlier versions
    kept a second module for sliding layers (``rotary_emb_local``).
    """
    kind = (getattr(cfg, "layer_types", None) or [None] * (layer_idx + 1))[layer_idx]
    rot = getattr(base, "rotary_emb", None)
    if kind == "sliding_attention" and getattr(base, "rotary_emb_local", None) is not None:
        rot = base.rotary_emb_local
    if rot is None:
        raise ValueError(f"{mtype} model has no rotary_emb module")
    inv_freq = getattr(rot, f"{kind}_inv_freq", None) if kind else None
    if inv_freq is not None:
        rope_type = rot.rope_type[kind] if isinstance(rot.rope_type, dict) else rot.rope_type
        scaling = getattr(rot, f"{kind}_attention_scaling")
    else:
        inv_freq, rope_type, scaling = rot.inv_freq, getattr(rot, "rope_type", "default"), rot.attention_scaling
    if rope_type not in _STATIC_ROPE:
        raise ValueError(f"RoPE type {rope_type!r} changes its frequencies with the sequence length; "
                         f"recomputation supports {_STATIC_ROPE}")
    return inv_freq.detach().float(), float(scaling)


def layer_params(model, layer_idx: int) -> ActToKVParams:
    """Read the norm, ``[Wk Wv]`` (+ biases), ``k_norm`` and rotary parameters of one decoder layer.

    Supports Llama-family (Llama, Mistral, SmolLM2), Qwen2 (biases), Qwen3 (``k_norm``), Phi-3
    (a fused ``qkv_proj``, partial rotary), Gemma3 (``1 + w`` norms in fp32, ``k_norm``, a RoPE
    table per layer type) and OPT (LayerNorm, biases, no RoPE). The weights are stacked into new
    tensors once; call this once per layer and reuse the result.

    Raises:
        ValueError: an unsupported architecture, a layer index out of range, or a RoPE variant
            whose frequencies change with the sequence length (``dynamic``, ``longrope``).
    """
    from .cache import _text_config

    cfg = _text_config(model.config)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:  # before any module is read
        raise ValueError(f"act->kv recomputation supports {', '.join(SUPPORTED_MODEL_TYPES)}; got {mtype!r}")
    base, layers = _decoder_layers(model)
    if not 0 <= layer_idx < len(layers):
        raise ValueError(f"layer_idx {layer_idx} out of range for {len(layers)} layers")
    layer = layers[layer_idx]
    attn = layer.self_attn
    with torch.no_grad():
        weight, bias = _kv_weight(mtype, cfg, attn)
    if mtype == "opt":
        hkv = cfg.num_attention_heads
        f = cfg.hidden_size // hkv
        ln = layer.self_attn_layer_norm
        if cfg.do_layer_norm_before:
            # layer_norm_elementwise_affine=False: a LayerNorm with no weight and no bias, i.e. ones
            # and zeros (x * 1 + 0 is exact, so the K/V stay bit-identical to the layer's)
            nw = torch.ones(cfg.hidden_size, dtype=weight.dtype, device=weight.device) if ln.weight is None \
                else ln.weight.detach()
            nb = torch.zeros_like(nw) if ln.bias is None else ln.bias.detach()
            norm, eps = "layer", ln.eps
        else:  # OPT-350m: the norm comes after attention, so K/V see the raw input
            norm, nw, nb, eps = "none", None, None, 0.0
        return ActToKVParams(norm, nw, nb, eps, weight, bias, hkv, f)
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    f = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ln = layer.input_layernorm
    k_norm = getattr(attn, "k_norm", None)
    inv_freq, scaling = _rope_of(base, cfg, layer_idx, mtype)
    gemma = mtype == "gemma3_text"  # output = (x_fp32 * rstd * (1 + w_fp32)).to(dtype)

    def norm_weight(module):
        w = module.weight.detach()
        return 1.0 + w.float() if gemma else w

    def eps_of(module):
        eps = getattr(module, "variance_epsilon", None)
        return float(module.eps if eps is None else eps)

    return ActToKVParams(
        "rms", norm_weight(ln), None, eps_of(ln), weight, bias, hkv, f,
        k_norm_weight=None if k_norm is None else norm_weight(k_norm),
        k_norm_eps=1e-6 if k_norm is None else eps_of(k_norm),
        inv_freq=inv_freq, rope_scaling=scaling, norm_weight_fp32=gemma)


def model_params(model) -> list[ActToKVParams]:
    """:func:`layer_params` of every decoder layer."""
    _, layers = _decoder_layers(model)
    return [layer_params(model, i) for i in range(len(layers))]


# ---------------------------------------------------------------------------- reference
def rope_tables(params: ActToKVParams, positions: torch.Tensor, dtype: torch.dtype | None = None):
    """``(cos, sin)`` ``[n, R / 2]`` in the model dtype for int ``positions`` ``[n]`` (``R``: the rotary width).

    HF builds ``cat(freqs, freqs)``; both halves are equal, so one half is kept. As in HF, the
    angles are computed in fp32 and cast after the ``attention_scaling`` product. One table
    serves every layer of a step (all layers share the positions and, in these models, the
    frequencies).
    """
    if not params.has_rope:
        raise ValueError("this layer has no RoPE")
    dtype = dtype or params.dtype
    freqs = positions.reshape(-1, 1).float() * params.inv_freq.to(positions.device)
    cos = freqs.cos() * params.rope_scaling
    sin = freqs.sin() * params.rope_scaling
    return cos.to(dtype), sin.to(dtype)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, the weight product in the input dtype (Llama), or in
    fp32 before the cast with ``weight_fp32`` (Gemma)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # a tensor of its own from here on
    if weight_fp32:
        return (xf * weight).to(x.dtype)
    y = xf.to(x.dtype)
    # weight * y, in place where it keeps y's dtype (the product commutes bitwise)
    return y.mul_(weight) if weight.dtype == y.dtype else weight * y


def check_act(act: torch.Tensor, positions: torch.Tensor | None, params: ActToKVParams) -> None:
    """Raise ``ValueError`` unless ``act`` is ``[n, D]`` of the weight's dtype with ``[n]`` positions."""
    if act.dim() != 2 or act.shape[1] != params.hidden_size:
        raise ValueError(f"act must be [n, hidden={params.hidden_size}], got {tuple(act.shape)}")
    if act.dtype != params.dtype:
        raise ValueError(f"act dtype {act.dtype} differs from the layer weights' {params.dtype}")
    if params.has_rope and (positions is None or positions.reshape(-1).shape[0] != act.shape[0]):
        raise ValueError(f"RoPE needs one position per token: act has {act.shape[0]} tokens, "
                         f"positions {None if positions is None else tuple(positions.shape)}")


def act_to_kv_ref(act: torch.Tensor, positions: torch.Tensor | None, params: ActToKVParams,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Post-RoPE ``K, V`` ``[n, Hkv, F]`` of ``n`` tokens from their layer inputs ``act`` ``[n, D]``.

    ``positions`` ``[n]`` are the tokens' own positions (ignored without RoPE); ``rope`` may pass
    precomputed :func:`rope_tables` to share them across layers. Bit-identical to the K/V the HF
    layer hands to ``Cache.update`` (transposed to token-major).
    """
    check_act(act, positions, params)
    n, h, f = act.shape[0], params.num_kv_heads, params.head_dim
    if params.norm == "rms":
        x = _rms(act, params.norm_weight, params.norm_eps, params.norm_weight_fp32)
    elif params.norm == "layer":
        x = F.layer_norm(act, (params.hidden_size,), params.norm_weight, params.norm_bias, params.norm_eps)
    else:
        x = act
    kv = F.linear(x, params.weight, params.bias)  # one GEMM for K and V (HybridServe Eq. 1)
    k, v = kv.view(n, 2, h, f).unbind(1)
    if params.k_norm_weight is not None:
        k = _rms(k, params.k_norm_weight, params.k_norm_eps, params.norm_weight_fp32)
    if params.has_rope:
        cos, sin = rope if rope is not None else rope_tables(params, positions, act.dtype)
        cos = torch.cat([cos, cos], -1)[:, None, :]
        sin = torch.cat([sin, sin], -1)[:, None, :]
        r = params.rotary_dim  # HF rotates the first r channels and passes the rest through
        k_rot, k_pass = k[..., :r], k[..., r:]
        turned = torch.cat([-k_rot[..., r // 2:], k_rot[..., : r // 2]], -1)
        k = (k_rot * cos) + (turned * sin)
        if r < f:
            k = torch.cat([k, k_pass], -1)
    return k.contiguous(), v.contiguous()


def act_to_kv(act: torch.Tensor, positions: torch.Tensor | None, params: ActToKVParams,
              rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``act_to_kv_ref`` on CPU, the fused Triton kernel where :func:`leankit.backend.use_triton` says so
    and the kernel tiles the head (a power-of-two head_dim >= 32, RoPE over the whole head or none;
    other heads take the reference on any device, a host-side choice that reads nothing back)."""
    from .backend import use_triton

    if use_triton(act):
        from leankit_kernels.act_to_kv import act_kernel_tiles
        from leankit_kernels.act_to_kv import act_to_kv as kernel

        if act_kernel_tiles(params.head_dim) and params.rotates_whole_head:
            return kernel(act, positions, params, rope=rope)
    return act_to_kv_ref(act, positions, params, rope=rope)


def recompute_kv(pool, act_layout, page_ids: torch.Tensor, rows: torch.Tensor, params: ActToKVParams,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """K/V of ``n`` ACT tokens read from their pages: ``(k, v [n, Hkv, F], positions [n] int32)``.

    ``page_ids`` ``[n, S]`` and ``rows`` ``[n]`` locate the tokens (see
    :meth:`leankit.page_table.ActPageTable.locate`); the activations are read in the model dtype
    (:meth:`leankit.pages.ActLayout.read`) and projected with :func:`act_to_kv` (the Triton
    kernel on CUDA, the reference on CPU). ``rope`` may pass this step's :func:`rope_tables` for
    the same tokens, shared across layers.
    """
    if act_layout.hidden != params.hidden_size:
        raise ValueError(f"ACT pages hold hidden {act_layout.hidden}, the layer expects {params.hidden_size}")
    act, pos = act_layout.read(pool, page_ids, rows)
    k, v = act_to_kv(act.to(params.dtype), pos, params, rope=rope)  # as ActStore._keys
    return k, v, pos
