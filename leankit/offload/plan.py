"""Plans become caches: the LeanCache settings a :func:`leankit.planner.plan` chose, and the link
bytes per decode step it predicts (what ``memory_report()["offload"]`` counts).

A plan names a cache format (``choice.kv``; ``None`` is the plain fp16 cache, served by leankit's
``FP16`` pages), a mode and a placement:

* ``kv``: KV pages only; ``hybrid`` (HybridServe): a static share of the host tokens held as ACT
  blocks, placed by Eq. 11's ratio (``act_order=ratio``); ``kvpr`` (KVPR): the first share of each
  row's tokens recomputed from activations (``act_order=prefix``, the mean of the per-step splits);
  ``attn_offload`` runs attention on the CPU, which leankit does not do (``ValueError``).
* the cache goes to the host tier (``offload``) whenever the plan keeps cache bytes on the host;
  the plan's GPU-resident cache tokens (``plan.memory["gpu_cache_tokens"]``) stay on the device
  (``device_tokens``: never copied) and the rest lives on the host, streamed per layer.
"""

from __future__ import annotations

import dataclasses
import math


def _plan_error(plan) -> str | None:
    if not getattr(plan, "feasible", False):
        why = getattr(plan, "infeasible_reason", "") or "not a leankit.planner Plan"
        return f"the plan is not feasible: {why}"
    return None


def act_share(plan) -> float:
    """The share of the plan's *host* tokens kept as activations (0 for ``kv``)."""
    mode = plan.choice.mode
    if mode == "hybrid":
        return float(plan.act_share.get("host tokens as ACT", 0.0))
    if mode == "kvpr":
        splits = [f for _, f in plan.kvpr_splits]
        return float(sum(splits) / len(splits)) if splits else 0.0
    return 0.0


def cache_act_share(plan, resident: float) -> float:
    """The share of *all* of a row's tokens to store as ACT so that, with ``resident`` tokens per layer
    kept on the device, the cache holds the plan's ACT tokens at its step context ``n`` tokens:

    * ``hybrid``: the resident tokens are ACT (HybridServe's GPU cache), plus ``phi`` of the host
      tokens: ``(G + phi (n - G)) / n``;
    * ``kvpr``: the resident tokens are KV; the split ``f`` applies to the host tokens:
      ``f (n - G) / n``.
    """
    share = act_share(plan)
    n = plan.workload.batch * plan.step_context
    if resident <= 0 or n <= 0:
        return share
    g = min(resident, n)
    if plan.choice.mode == "hybrid":
        return (g + share * (n - g)) / n
    return share * (n - g) / n


def cache_settings(plan) -> tuple[str, dict | None]:
    """``(kv spec, offload)`` for ``LeanCache(model, kv, offload=offload)`` from a plan.

    ``offload`` is ``None`` when the whole cache fits the device, else the
    :class:`~leankit.offload.OffloadConfig` fields: ``device_tokens`` is the plan's GPU-resident
    cache tokens per layer (absent when the plan keeps none), ``device_kind`` their kind (ACT
    blocks for ``hybrid``, KV otherwise), and the ACT share is :func:`cache_act_share`.

    Raises ``ValueError`` for an infeasible plan, CPU attention (``attn_offload``) or an ACT share
    on a two-tier format (ACT composes with policy ``full`` only).
    """
    err = _plan_error(plan)
    if err:
        raise ValueError(err)
    ch = plan.choice
    if ch.mode == "attn_offload":
        raise ValueError("the plan runs attention on the CPU (attn_offload), which LeanCache does not do: "
                         "plan again with attention offloading disallowed (Allowed(attention_offload=False), "
                         "`leankit plan --no-attn-offload`)")
    kv = ch.kv or "FP16"
    host = plan.memory.get("host_cache", 0.0) > 0 and plan.hardware.device != "cpu"
    resident = int(plan.memory.get("gpu_cache_tokens", 0.0)) if host else 0
    if ch.mode == "hybrid" and not host:
        # The whole cache fits where the plan computes, and a hybrid plan holds it there as ACT
        # blocks (CAPTURE: GPU memory holds ACT blocks only; on a CPU-only profile every token is
        # ACT): its memory check counts activation bytes, so a KV cache of the same tokens would
        # not fit the memory the plan said it does. The host share ``phi`` is moot with no host tokens.
        share = 1.0
    else:
        share = round(cache_act_share(plan, resident), 4)
    if share > 0:
        from ..config import KVConfig

        cfg = KVConfig.parse(kv)
        if cfg.low is not None or cfg.policy != "full":
            raise ValueError(f"the plan keeps {share:.0%} of tokens as activations on the two-tier format {kv!r}, "
                             "but ACT blocks compose with single-tier formats only: plan with single-tier "
                             "--kv formats, or without the activation cache and KVPR")
        order = "prefix" if ch.mode == "kvpr" else "ratio"
        kv = f"{kv}{',' if ':' in kv else ':'}act={share:g},act_order={order}"
    if not host:
        return kv, None
    if not resident:
        return kv, {}
    return kv, {"device_tokens": resident, "device_kind": "act" if ch.mode == "hybrid" else "kv"}


def check_model(plan, model) -> None:
    """Raise ``ValueError`` unless ``model`` has the layer, head and head_dim shape the plan was made for."""
    from ..cache import _text_config, attention_head_dim, attention_kv_heads

    cfg = _text_config(model.config)
    got = (cfg.num_hidden_layers, cfg.hidden_size, attention_kv_heads(cfg), attention_head_dim(cfg))
    m = plan.model
    want = (m.num_layers, m.hidden, m.num_kv_heads, m.head_dim)
    if got != want:
        raise ValueError(f"the plan is for {m.name} ({want[0]} layers, hidden {want[1]}, {want[2]} KV heads of "
                         f"head_dim {want[3]}), but the model has {got[0]} layers, hidden {got[1]}, {got[2]} KV "
                         f"heads of head_dim {got[3]}: plan for this model (leankit.offload.plan_for_model)")


def model_spec(model, name: str | None = None):
    """The planner's :class:`~leankit.planner.ModelSpec` of a loaded model, at its parameters' dtype."""
    import os

    from ..planner import from_hf_config

    path = str(getattr(model.config, "_name_or_path", "") or "")
    spec = from_hf_config(model.config.to_dict(), name=name or os.path.basename(path.rstrip("/")) or None)
    itemsize = next(model.parameters()).element_size()
    return dataclasses.replace(spec, dtype_bytes=itemsize)


def plan_for_model(model, hardware, batch: int, prompt, gen: int, kv_configs=("K8V4",), limits=None, **allowed):
    """Plan for a loaded model: :func:`leankit.planner.plan` with the model's own shapes and dtype,
    the cache formats ``kv_configs`` (``None`` = plain fp16) and attention kept on the device."""
    from ..planner import Allowed, Workload, plan

    allowed.setdefault("attention_offload", False)
    return plan(model_spec(model), hardware, Workload(batch, prompt, gen),
                Allowed(kv_configs=tuple(kv_configs), **allowed), limits)


def predicted_link_bytes(plan) -> dict:
    """The plan's link bytes of one decode step at its representative context ``plan.step_context``.

    Read back from the per-layer breakdown (seconds x the profile's bandwidth, so bytes exactly as
    the planner prices them): ``h2d`` the cache (KV and ACT) copied in, ``d2h`` the new tokens
    written back, ``weights`` streamed weights (not the cache's), summed over layers.
    """
    err = _plan_error(plan)
    if err:
        raise ValueError(err)
    hw = plan.hardware
    if hw.fits and hw.fit_model == plan.model.name and plan.choice.kv is None:
        raise ValueError("this profile prices fp16 KV loads by a measured fit, not by bytes: use a preset profile")
    h2d = sum(lc.kv_load + lc.act_load for lc in plan.layers) * hw.h2d_bw
    d2h = sum(lc.store for lc in plan.layers) * hw.d2h_bw
    weights = sum(lc.weight_load for lc in plan.layers) * hw.h2d_bw
    return {"h2d": h2d, "d2h": d2h, "weights": weights, "context": plan.step_context}


def relative_gap(counted: float, predicted: float) -> float:
    """``|counted - predicted| / predicted`` (0 when both are 0, inf when only the prediction is)."""
    if predicted == 0:
        return 0.0 if counted == 0 else math.inf
    return abs(counted - predicted) / predicted


__all__ = ["act_share", "cache_act_share", "cache_settings", "check_model", "model_spec", "plan_for_model", "predicted_link_bytes",
           "relative_gap"]
