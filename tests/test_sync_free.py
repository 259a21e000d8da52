"""Host syncs of a decode step under the kernel backend (``LEANKIT_BACKEND=triton``).

On a GPU every op that reads a device value back to the host (``.item()``, ``int(t)``,
``bool(t)``, ``.tolist()``, ``nonzero``, boolean-mask indexing, ``repeat_interleave`` without an
output size ...) stalls the stream until all queued work has run. A decode step of a fixed-pool
LeanCache may read the device at most once, and never inside a decoder layer (where the stall
repeats per layer).

:class:`SyncCounter` counts those ops as PyTorch dispatches them, so it finds them on CPU too:
an op counts when the innermost leankit frame on the Python stack is leankit's own code (the
cache, policies, launchers). Ops that Triton's interpreter issues to run a kernel on CPU tensors,
and ops of transformers itself, are not leankit's and are left out.

``python tests/test_sync_free.py`` prints the counts per config.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from leankit.cache import LeanCache
from leankit.testing import left_padded_batch, tiny_model

_ROOTS = tuple(os.path.dirname(__import__(m).__file__) + os.sep for m in ("leankit", "leankit_kernels"))
_TRITON = os.path.dirname(__import__("triton").__file__) + os.sep
_THIS = os.path.abspath(__file__)


def _is_sync(func, args, kwargs) -> bool:
    """Whether the aten op ``func`` must read a device value on the host."""
    name = func._schema.name
    if name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
                "aten::unique_consecutive", "aten::unique_dim"):
        return True
    if name == "aten::repeat_interleave" and func._overloadname.startswith("Tensor"):
        return kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None)
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


def _leankit_site() -> str | None:
    """``file:line`` of the innermost leankit frame that issued the current op, or None when the
    op belongs to Triton's interpreter or to code outside leankit."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_TRITON):
            return None
        if path.startswith(_ROOTS):
            return f"{os.path.relpath(path, os.path.dirname(_ROOTS[0].rstrip(os.sep)))}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return None


class SyncCounter(TorchDispatchMode):
    """Counts leankit's sync-forcing ops per phase (``phase`` is set by the caller: a layer or the step).

    ``counts[(phase, op, site)]``: how often op ``op`` ran at ``site`` (``file:line (function)``).
    ``Tensor.tolist`` is counted too (it reads every element without dispatching per element).
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.phase = "step"
        self._tolist = None

    def _add(self, op: str) -> None:
        site = _leankit_site()
        if site is not None:
            self.counts[(self.phase, op, site)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self._add(func._schema.name.removeprefix("aten::"))
        return func(*args, **kwargs)

    def __enter__(self):
        counter, orig = self, torch.Tensor.tolist
        self._tolist = orig

        def tolist(t, *a, **k):
            counter._add("tolist")
            return orig(t, *a, **k)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def total(self, phase_prefix: str = "") -> int:
        return sum(n for (ph, _, _), n in self.counts.items() if ph.startswith(phase_prefix))

    def report(self) -> str:
        lines = [f"  {n:4d}  {ph:8s} {op:22s} {site}" for (ph, op, site), n in sorted(self.counts.items())]
        return "\n".join(lines) or "  (none)"


def _phase_hooks(model, counter: SyncCounter):
    """Mark ops inside decoder layer ``i`` as phase ``layer i`` (all else is the step's)."""
    handles = []
    for i, layer in enumerate(model.get_decoder().layers):
        def pre(_m, _a, i=i):
            counter.phase = f"layer {i}"

        def post(_m, _a, _o):
            counter.phase = "step"

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles


# (name, spec, overrides): the full policy (quantized and lossless) and LeanKV with and without
# pruning; a small window and compress_every=1 make Algorithm 1 run at every decode step.
# Small pages (a few tokens each) make decode steps allocate new pages.
CONFIGS = [
    ("K8V4", "K8V4", {"page_size": 256}),
    ("FP16", "FP16", {}),
    ("leankv-tl0", "K8V4-K4V2", {"th": 0.25, "tl": 0.0, "window": 3, "page_size": 256}),
    ("leankv-prune", "K8V4-K4V2", {"th": 0.3, "tl": 0.1, "window": 3, "compress_every": 1, "group_size": 8,
                                   "page_size": 256}),
]


def count_decode_syncs(spec: str, overrides: dict, steps: int = 4, layers: int = 3, num_pages: int = 160):
    """Run a prompt and ``steps`` decode steps of a tiny model through a fixed-pool LeanCache on the
    kernel backend; returns one :class:`SyncCounter` per decode step (the prompt is not counted)."""
    prev = os.environ.get("LEANKIT_BACKEND")
    os.environ["LEANKIT_BACKEND"] = "triton"
    try:
        model = tiny_model("llama-gqa", num_hidden_layers=layers)
        ids, mask = left_padded_batch(rows=3, width=11, pad_step=3)
        cache = LeanCache(model, spec, num_pages=num_pages, **overrides)
        out = []
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            pos = mask.sum(1, keepdim=True) - 1 + (mask.shape[1] - mask.sum(1, keepdim=True))
            for _ in range(steps):
                nxt = logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(nxt)], 1)
                pos = pos + 1
                counter = SyncCounter()
                handles = _phase_hooks(model, counter)
                try:
                    with counter:
                        logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                       use_cache=True).logits
                finally:
                    for h in handles:
                        h.remove()
                out.append(counter)
        return out
    finally:
        if prev is None:
            os.environ.pop("LEANKIT_BACKEND", None)
        else:
            os.environ["LEANKIT_BACKEND"] = prev


@pytest.mark.parametrize("name,spec,overrides", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_decode_step_is_sync_free_inside_layers(name, spec, overrides):
    """No host sync inside any layer of a decode step, and at most one per step."""
    for i, c in enumerate(count_decode_syncs(spec, overrides)):
        in_layers, total = c.total("layer"), c.total()
        assert in_layers == 0 and total <= 1, (
            f"{name} decode step {i}: {in_layers} host syncs inside layers, {total} in all (allowed: 0 and 1)\n"
            + c.report())


def test_counter_sees_every_kind_of_sync():
    """The counter itself: each sync-forcing op issued from leankit code is counted once."""
    from leankit import allocator  # a leankit frame issues the ops below

    c = SyncCounter()
    x = torch.tensor([3, 0, 5])
    with c:
        allocator.exclusive_cumsum(x)  # no sync
        code = compile("int(x.sum()); bool(x.any()); x.nonzero(); x[x > 1]; x.tolist();"
                       "y = x.clone(); y[x > 1] = 0; torch.repeat_interleave(x)",
                       allocator.__file__, "exec")  # attributed to a leankit file
        exec(code, {"x": x, "torch": torch})
    ops = Counter()
    for (_ph, op, _site), n in c.counts.items():
        ops[op] += n
    assert ops["_local_scalar_dense"] == 2
    assert ops["nonzero"] == 1
    assert ops["index"] == 1 and ops["index_put_"] == 1
    assert ops["tolist"] == 1
    assert ops["repeat_interleave"] == 1
    assert c.total() == 7


if __name__ == "__main__":
    for name, spec, overrides in CONFIGS:
        per_step = count_decode_syncs(spec, overrides)
        layers = [c.total("layer") for c in per_step]
        totals = [c.total() for c in per_step]
        print(f"{name:14s} per decode step: {totals} in all, {layers} inside layers")
        if "-v" in sys.argv:
            print(per_step[-1].report())
