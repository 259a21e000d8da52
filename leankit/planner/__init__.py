"""leankit's offload planner: performance models of KV/weight offloading and the mechanisms that relieve it.

* :mod:`~leankit.planner.hardware` -- :class:`HardwareProfile`, the papers' machines, the profiler;
* :mod:`~leankit.planner.model_spec` -- :class:`ModelSpec` (GQA-aware bytes and FLOP per token);
* :mod:`~leankit.planner.hybrid` -- HybridServe/CAPTURE Algorithm 1, Eq. 11, mini-batch packing (Eqs. 12-13);
* :mod:`~leankit.planner.kvpr` -- KVPR's split solver (Eqs. 6-11) and the Fig. 5 pipeline;
* :mod:`~leankit.planner.lm_offload` -- LM-Offload Eqs. 1-24 and Algorithm 3 thread control;
* :mod:`~leankit.planner.planner` -- the composed planner; :mod:`~leankit.planner.timeline` -- its plot;
* :mod:`~leankit.planner.cli` -- ``leankit plan``.

Nothing here imports torch at module load; the profiler and thread tools import it when called.
"""

from .hardware import (
    PRESETS as HARDWARE_PRESETS,
)
from .hardware import (
    HardwareProfile,
    LinearFit,
    fit_linear,
    get_hardware,
    hardware_names,
    profile_hardware,
)
from .model_spec import PRESETS as MODEL_PRESETS
from .model_spec import ModelSpec, from_hf_config, get_model, model_names
from .planner import Allowed, Choice, LayerCost, Limits, Plan, Workload, evaluate, format_plan, plan

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "Allowed",
    "Choice",
    "HardwareProfile",
    "LayerCost",
    "Limits",
    "LinearFit",
    "ModelSpec",
    "Plan",
    "Workload",
    "evaluate",
    "fit_linear",
    "format_plan",
    "from_hf_config",
    "get_hardware",
    "get_model",
    "hardware_names",
    "model_names",
    "plan",
    "profile_hardware",
]
