"""leankit's offload runtime: a host tier for KV and ACT pages, a device working set of a few
layers, and a per-layer prefetch / recompute / write-back pipeline (KVPR §3-4, HybridServe §4.2).

``LeanCache(model, kv, offload=True)`` puts every page in host memory (pinned with CUDA) and
keeps only the layers in flight on the device, plus a resident share when ``device_tokens`` asks
for one; ``LeanCache.from_plan(model, plan)`` builds the cache a :func:`leankit.planner.plan` chose.

* :mod:`~leankit.offload.config` -- :class:`OffloadConfig`, what ``offload=`` takes;
* :mod:`~leankit.offload.host_pool` -- :class:`HostPool`, the host tier;
* :mod:`~leankit.offload.working_set` -- the device pages of the layers in flight;
* :mod:`~leankit.offload.resident` -- :class:`ResidentShare`, the pages that stay on the device;
* :mod:`~leankit.offload.transfers` -- :class:`Link`, every copy and its byte count;
* :mod:`~leankit.offload.pipeline` -- :class:`OffloadRuntime`, the per-layer windows;
* :mod:`~leankit.offload.plan` -- plans become caches, and their predicted link bytes.
"""

from .config import OffloadConfig
from .host_pool import HostPool
from .pipeline import OffloadRuntime, make_runtime
from .plan import cache_settings, plan_for_model, predicted_link_bytes
from .resident import ResidentShare
from .transfers import Link
from .working_set import DeviceBudgetExceeded, WindowFreeList, WorkingSet

__all__ = ["DeviceBudgetExceeded", "HostPool", "Link", "OffloadConfig", "OffloadRuntime", "ResidentShare", "WindowFreeList", "WorkingSet",
           "cache_settings", "make_runtime", "plan_for_model", "predicted_link_bytes"]
