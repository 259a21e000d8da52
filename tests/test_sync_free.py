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
from leankit.hf import cache_kwargs
from leankit.policy import HIGH, read_tier_meta
from leankit.testing import layer_phase_hooks, left_padded_batch, tiny_model

_ROOTS = tuple(os.path.dirname(__import__(m).__file__) + os.sep for m in ("leankit", "leankit_kernels"))
_TRITON = os.path.dirname(__import__("triton").__file__) + os.sep
_THIS = os.path.abspath(__file__)


def _is_sync(func, args, kwargs) -> bool:
    """Whether the aten op ``func`` must read a device value on the host."""
    name = func._schema.name
    # aten::equal answers a Python bool: on a GPU it reads the comparison back, though its own
    # kernel does so below the dispatcher, where no _local_scalar_dense shows.
    if name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
                "aten::unique_consecutive", "aten::unique_dim", "aten::equal", "aten::allclose"):
        return True
    if name == "aten::repeat_interleave" and func._overloadname.startswith("Tensor"):
        return kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None)
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


def _leankit_site(roots: tuple[str, ...] = _ROOTS) -> str | None:
    """``file:line`` of the innermost leankit frame that issued the current op, or None when the
    op belongs to Triton's interpreter or to code outside leankit (``roots``: leankit's folders)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_TRITON):
            return None
        if path.startswith(roots):
            return f"{os.path.relpath(path, os.path.dirname(_ROOTS[0].rstrip(os.sep)))}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return None


class SyncCounter(TorchDispatchMode):
    """Counts leankit's sync-forcing ops per phase (``phase`` is set by the caller: a layer or the step).

    ``counts[(phase, op, site)]``: how often op ``op`` ran at ``site`` (``file:line (function)``).
    ``Tensor.tolist`` is counted too (it reads every element without dispatching per element), and
    so are ``torch.tensor`` / ``torch.as_tensor`` of host data with a ``device``: on a GPU that is a
    copy from pageable host memory, which waits for the stream as a read back does (found on an
    H200 under ``torch.cuda.set_sync_debug_mode``, invisible to a dispatch count on CPU tensors).
    """

    def __init__(self, roots: tuple[str, ...] = _ROOTS):
        super().__init__()
        self.roots = roots  # files under these count as leankit's
        self.counts: Counter = Counter()
        self.phase = "step"
        self._tolist = None

    def _add(self, op: str) -> None:
        site = _leankit_site(self.roots)
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
        self._factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

        def tolist(t, *a, **k):
            counter._add("tolist")
            return orig(t, *a, **k)

        def copying(name, factory):
            def make(data, *a, **k):
                if k.get("device") is not None and not isinstance(data, torch.Tensor):
                    counter._add(f"{name}(host data, device=...)")
                return factory(data, *a, **k)
            return make

        torch.Tensor.tolist = tolist
        for name, factory in self._factories.items():
            setattr(torch, name, copying(name, factory))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        for name, factory in self._factories.items():
            setattr(torch, name, factory)
        return super().__exit__(*exc)

    def total(self, phase_prefix: str = "") -> int:
        return sum(n for (ph, _, _), n in self.counts.items() if ph.startswith(phase_prefix))

    def report(self) -> str:
        lines = [f"  {n:4d}  {ph:8s} {op:22s} {site}" for (ph, op, site), n in sorted(self.counts.items())]
        return "\n".join(lines) or "  (none)"


# (name, spec, overrides): the full policy (quantized and lossless) and LeanKV with and without
# pruning; a small window and compress_every=1 make Algorithm 1 run at every decode step.
# Small pages (a few tokens each) make decode steps allocate new pages. leankv-tl0 runs
# Algorithm 1 every 4 tokens, leankv-prune at every step (leankv-1tier prunes a single tier).
# h2o and streaming evict at the end of every step (the 11-token prompt is past their budget
# and window).
CONFIGS = [
    ("K8V4", "K8V4", {"page_size": 256}),
    ("FP16", "FP16", {}),
    ("leankv-tl0", "K8V4-K4V2", {"th": 0.25, "tl": 0.0, "window": 3, "compress_every": 4, "page_size": 256}),
    ("leankv-prune", "K8V4-K4V2", {"th": 0.3, "tl": 0.1, "window": 3, "compress_every": 1, "group_size": 8,
                                   "page_size": 256}),
    ("leankv-1tier", "K8V4", {"policy": "leankv", "tl": 0.08, "window": 3, "compress_every": 1,
                              "page_size": 256}),
    ("h2o", "K8V4", {"policy": "h2o", "budget": 0.5, "page_size": 256}),
    ("streaming", "K8V4", {"policy": "streaming", "sink": 2, "window": 5, "page_size": 256}),
]
# ACT blocks (HybridServe/CAPTURE, KVPR's prefix): the step's ACT tokens are planned, granted, captured
# and stored with the KV ones, and earlier ACT tokens are recomputed by the act_to_kv kernel, whose
# smallest head_dim is 32 (an MHA model of hidden 128). Small pages make decode steps open new blocks.
ACT_MODEL = {"kind": "llama-mha", "hidden_size": 128}
ACT_CONFIGS = [
    ("act-ratio", "K8V4", {"act": 0.5, "page_size": 512}),
    ("act-only", "FP16", {"act": 1.0, "page_size": 1024}),
    ("act-prefix", "FP16", {"act": 0.4, "act_order": "prefix", "page_size": 1024}),
]


def _mark_steps(cache, counters: list, patch):
    """Tag each step's counter: ``compressed`` when the policy moved tokens (LeanKV's Algorithm 1,
    the end-of-step eviction of h2o and streaming);
    ``calls`` counts the fused decode score updates and second passes over the keys."""
    policy = cache.policy
    apply = policy.apply_classes

    def spied(*a, **k):
        counters[-1].compressed = True
        return apply(*a, **k)

    policy.apply_classes = spied
    import leankit_kernels.paged_attention as pa
    import leankit_kernels.prefill_attention as pre

    def counting(fn, name):
        def counted(*a, **k):
            counters[-1].calls[name] += 1
            return fn(*a, **k)

        return counted

    for module, name in ((pa, "apply_score_update"), (pre, "received_attention")):
        patch.setattr(module, name, counting(getattr(module, name), name))


def _prompt(model, cache):
    """Prefill a left-padded 3-row batch; returns (logits, attention mask, last positions)."""
    ids, mask = left_padded_batch(rows=3, width=11, pad_step=3)
    logits = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True).logits
    pos = mask.sum(1, keepdim=True) - 1 + (mask.shape[1] - mask.sum(1, keepdim=True))
    return logits, mask, pos


def _next_inputs(logits, mask, pos):
    """The greedy next tokens, the mask grown by them and their positions."""
    nxt = logits[:, -1:].argmax(-1)
    return nxt, torch.cat([mask, torch.ones_like(nxt)], 1), pos + 1


def count_decode_syncs(spec: str, overrides: dict, steps: int = 5, layers: int = 3, num_pages: int = 160,
                       model: dict | None = None, counter_cls: type = SyncCounter, dtype: torch.dtype | None = None):
    """Run a prompt and ``steps`` decode steps of a tiny model through a fixed-pool LeanCache on the
    kernel backend; returns one :class:`SyncCounter` per decode step (the prompt is not counted).
    A counter's ``compressed`` is true when Algorithm 1 ran in its step, ``grew`` when the pool
    grew (``num_pages=None``: an elastic pool). ``model``: :func:`tiny_model` kind and settings
    (default: the GQA Llama). ``counter_cls``: what to count (a :class:`SyncCounter` subclass).
    ``dtype``: the model's dtype (default fp32)."""
    patch = pytest.MonkeyPatch()
    try:
        patch.setenv("LEANKIT_BACKEND", "triton")
        kw = dict(model or {"kind": "llama-gqa"})
        model = tiny_model(kw.pop("kind"), num_hidden_layers=layers, **kw)
        if dtype is not None:
            model = model.to(dtype)
        cache = LeanCache(model, spec, num_pages=num_pages, **overrides)
        out = []
        with torch.no_grad():
            logits, mask, pos = _prompt(model, cache)
            for _ in range(steps):
                nxt, mask, pos = _next_inputs(logits, mask, pos)
                counter = counter_cls()
                counter.compressed, counter.calls = False, Counter()
                out.append(counter)
                if len(out) == 1:
                    _mark_steps(cache, out, patch)
                handles = layer_phase_hooks(model, counter)
                capacity = cache.free_list.capacity
                try:
                    with counter:
                        logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                                       use_cache=True).logits
                finally:
                    for h in handles:
                        h.remove()
                counter.grew = cache.free_list.capacity != capacity
                _check_page_bounds(cache)
        return out
    finally:
        patch.undo()


def _check_page_bounds(cache) -> None:
    """The host page bounds the decode grids are sized from really bound every head's pages."""
    n = cache.table.n_pages
    if n.numel() == 0:  # no layer is compressed (every layer slides): no pages to bound
        return
    high, low, total = cache.page_bounds()
    assert int(n[0].max()) <= high and int(n.sum(0).max()) <= total, (cache.page_bounds(), n)
    if len(cache.layouts) > 1:
        assert int(n[1].max()) <= low, (cache.page_bounds(), n)


@pytest.mark.parametrize("name,spec,overrides", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_decode_step_is_sync_free_inside_layers(name, spec, overrides):
    """No host sync inside any layer of a decode step, and at most one per step (the end-of-step
    read of the error flags, allocation status and policy status), Algorithm 1 or not."""
    per_step = count_decode_syncs(spec, overrides)
    for i, c in enumerate(per_step):
        in_layers, total = c.total("layer"), c.total()
        assert in_layers == 0, f"{name} decode step {i}: {in_layers} host syncs inside layers\n" + c.report()
        assert total <= 1, (
            f"{name} decode step {i}: {total} host syncs (allowed: 1)\n" + c.report())
    if name == "leankv-tl0":  # the config does reach Algorithm 1 within the counted steps
        assert any(c.compressed for c in per_step) and not all(c.compressed for c in per_step)
    if name in ("h2o", "streaming"):  # every counted step evicts
        assert all(c.compressed for c in per_step)
    # Generation-phase significance (LeanKV §4, H2O's accumulated attention) comes from the decode
    # kernel's own logits, one fused update per layer, never from a second pass over the keys.
    fused = 3 if name.startswith(("leankv", "h2o")) else 0
    for c in per_step:
        assert c.calls["received_attention"] == 0 and c.calls["apply_score_update"] == fused, c.calls


# Ops that launch nothing on a GPU: views, and allocations from the caching allocator.
_NOT_LAUNCHES = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand",
                 "permute", "t", "transpose", "alias", "detach", "reshape", "_reshape_alias", "unbind", "split",
                 "narrow", "empty", "empty_strided", "lift_fresh"}


class LaunchCounter(SyncCounter):
    """Counts every aten op of leankit's own that would launch work on a GPU (views and
    allocations aside), per phase: the torch ops around leankit's kernels, each a launch of a few
    microseconds on a GPU whatever its size."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        if name not in _NOT_LAUNCHES:
            self._add(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,spec,overrides", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_decode_layers_launch_only_kernels(name, spec, overrides):
    """Inside a decoder layer of a decode step, leankit runs its Triton kernels (paged attention
    with the step's own token, the step store, the fused score update) and no torch op of its own:
    a decode step's store finds slots and pages in its kernel, and a new token's significance is
    what the decode launch computed. (Step-level work, once per step, is not counted here.)"""
    per_step = count_decode_syncs(spec, overrides, steps=3, counter_cls=LaunchCounter)
    for i, c in enumerate(per_step):
        assert c.total("layer") == 0, f"{name} decode step {i}: leankit torch ops inside layers\n" + c.report()


@pytest.mark.parametrize("name,spec,overrides,bound", [
    ("K8V4", "K8V4", {"page_size": 256}, 10), ("FP16", "FP16", {}, 10),
    ("K8V4-eos", "K8V4", {"page_size": 256, "eos_token_id": [2, 40]}, 10), (*CONFIGS[2], 24)],
    ids=["K8V4", "FP16", "K8V4-eos", "leankv-tl0"])
def test_decode_step_work_outside_layers_is_a_few_launches(name, spec, overrides, bound):
    """Around its layers a decode step runs a handful of launches, not dozens: the rows' state
    (real flags, positions, ended requests, cleared flags) is one launch (``step_rows``), the
    grant for the new tokens one (``grant_token_pages``), the release of rows that ended one
    (``release_rows``); what remains is the step's one read of its flags, the lengths saved for a
    rollback and the running counts, and LeanKV's status for its next step. (Before: 48 ops for
    K8V4, 59 with end ids, 73 for LeanKV. Steps that run Algorithm 1 are not bounded here.)"""
    per_step = count_decode_syncs(spec, overrides, steps=5, counter_cls=LaunchCounter)
    plain = [c for c in per_step if not c.compressed]
    assert plain, "every counted step ran Algorithm 1"
    for i, c in enumerate(plain):
        assert c.total("step") <= bound, f"{name} decode step {i}: {c.total('step')} leankit ops outside layers\n" \
            + c.report()
        if "eos_token_id" in overrides:
            assert any("release" in site for (_, _, site) in c.counts), c.report()


def test_rotated_decode_layers_add_only_the_rotation():
    """``rotate=1``: the only torch ops inside a layer are the rotation's matmuls (query, key and
    value into the page basis, the output back)."""
    per_step = count_decode_syncs("K8V4", {"rotate": 1, "page_size": 256}, steps=2, counter_cls=LaunchCounter)
    for c in per_step:
        ops = {(op, site.split(":")[0]) for (ph, op, site) in c.counts if ph.startswith("layer")}
        assert ops and ops <= {("mm", "leankit/rotation.py"), ("bmm", "leankit/rotation.py")}, c.report()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16bit_decode_layers_convert_nothing(dtype):
    """A 16-bit model's decode layer converts nothing around the kernels: the decode launch (or,
    rotated, the merge kernel) writes the output in the model's dtype, and with ``rotate=1`` the
    paged output is written in fp32
    for its rotation back, whose fp32 matrix is made once. So the only torch ops in a layer are
    the rotation's four matmuls (query, key and value in, the output back), none without it.
    (bf16 under Triton's interpreter, which truncates where a GPU rounds, keeps one conversion
    of the output per layer: counted here as allowed.)"""
    cast = {"_to_copy"} if dtype == torch.bfloat16 else set()
    matmuls = {"mm", "bmm"}  # a rotation is one matmul, 2-D or batched by torch's choice
    for overrides, rotated in (({"page_size": 256}, False), ({"page_size": 256, "rotate": 1}, True)):
        per_step = count_decode_syncs("K8V4", overrides, steps=2, counter_cls=LaunchCounter, dtype=dtype)
        for c in per_step:
            ops = [(op, site.split(":")[0]) for (ph, op, site) in c.counts for _ in range(c.counts[(ph, op, site)])
                   if ph.startswith("layer")]
            rotation = [op for op, site in ops if op != "_to_copy"]
            assert {op for op, _ in ops} - matmuls == cast, c.report()
            assert all(op in matmuls and site == "leankit/rotation.py" for op, site in ops if op != "_to_copy"), \
                c.report()
            assert len(rotation) == (12 if rotated else 0), c.report()  # 4 a layer, 3 layers
            assert len(ops) - len(rotation) == 3 * len(cast), c.report()


@pytest.mark.parametrize("name,spec,overrides", ACT_CONFIGS, ids=[c[0] for c in ACT_CONFIGS])
def test_act_decode_step_is_sync_free_inside_layers(name, spec, overrides):
    """ACT blocks add no host read: the step's ACT grant is deferred like the KV pages', the
    captured activations are kept whole and stored under a keep flag, and the bound on earlier ACT
    tokens comes with the step's one read (leankit.act_store)."""
    per_step = count_decode_syncs(spec, overrides, steps=6, num_pages=400, model=ACT_MODEL)
    for i, c in enumerate(per_step):
        assert c.total("layer") == 0 and c.total() <= 1, f"{name} decode step {i}\n" + c.report()


@pytest.mark.parametrize("name,spec,overrides", [c for c in CONFIGS if c[0] in ("K8V4", "leankv-tl0", "h2o")],
                         ids=["K8V4", "leankv-tl0", "h2o"])
def test_elastic_pool_decode_step_reads_the_device_once(name, spec, overrides):
    """An elastic pool: a decode step's grant checks its host bound against the free list's host
    lower bound (a deferred recycle only adds free pages), so it reads the device once per step,
    like a fixed pool. Allowed extra reads: growing the pool, and the page plan of LeanKV's
    Algorithm 1, which has no host bound and is granted eagerly."""
    per_step = count_decode_syncs(spec, overrides, steps=8, num_pages=None)
    for i, c in enumerate(per_step):
        assert c.total("layer") == 0, f"{name} step {i}\n" + c.report()
        allowed = 1 + c.grew + c.compressed * name.startswith("leankv")
        assert c.total() <= allowed, f"{name} step {i}: {c.total()} host syncs (allowed: {allowed})\n" + c.report()
    assert sum(c.total() for c in per_step) <= len(per_step) + 2, [c.total() for c in per_step]


@pytest.mark.parametrize("name,spec,overrides,model", [
    ("K8V4-head12", "K8V4", {"page_size": 256}, {"kind": "llama-gqa", "hidden_size": 72}),
    ("leankv-head12", "K8V4-K4V2", {"th": 0.25, "tl": 0.0, "window": 3, "compress_every": 1, "page_size": 256},
     {"kind": "llama-gqa", "hidden_size": 72}),
    ("act-head16", "K8V4", {"act": 0.5, "page_size": 512}, {"kind": "llama-mha", "hidden_size": 64}),
], ids=["K8V4-head12", "leankv-head12", "act-head16"])
def test_heads_the_kernels_do_not_tile_stay_sync_free(name, spec, overrides, model):
    """Padded pages (head_dim 12 -> 16) and ACT recompute through the reference (head_dim 16, below
    the act_to_kv kernel's 32) add no host read: the choices are made on the host, from shapes."""
    per_step = count_decode_syncs(spec, overrides, steps=4, num_pages=400, model=model)
    for i, c in enumerate(per_step):
        assert c.total("layer") == 0 and c.total() <= 1, f"{name} decode step {i}\n" + c.report()


OTHER_FAMILIES = [
    ("qwen3-rotated-2tier", "K8V4-K4V2", {"th": 0.25, "tl": 0.0, "group_size": 16, "rotate": 1, "window": 3,
                                         "compress_every": 2, "page_size": 256}, {"kind": "qwen3"}),
    ("phi3-prune-lowgs", "K8V4-K2V1", {"th": 0.3, "tl": 0.05, "low_group_size": 8, "window": 3, "compress_every": 1,
                                       "page_size": 256}, {"kind": "phi3"}),
    ("gemma3-h2o", "K4V2", {"policy": "h2o", "budget": 0.6, "page_size": 256}, {"kind": "gemma3"}),
    ("opt-streaming", "K8V8", {"policy": "streaming", "sink": 1, "window": 4, "page_size": 256}, {"kind": "opt"}),
    # the outer model builds the decoder's masks before the decoder's step opens
    ("gemma3-image-text", "K8V4", {"page_size": 256}, {"kind": "gemma3-image-text"}),
]


@pytest.mark.parametrize("name,spec,overrides,model", OTHER_FAMILIES, ids=[c[0] for c in OTHER_FAMILIES])
def test_other_model_families_stay_sync_free(name, spec, overrides, model):
    """The bound holds for the other families' layers (q/k norms, a fused qkv projection, sliding
    layers kept plain, OPT's learned positions) under rotated, pruning and evicting configs."""
    per_step = count_decode_syncs(spec, overrides, steps=3, num_pages=600, model=model)
    for i, c in enumerate(per_step):
        assert c.total("layer") == 0 and c.total() <= 1, f"{name} decode step {i}\n" + c.report()


def test_compress_step_reads_the_device_at_most_once():
    """A step that runs LeanKV's Algorithm 1 (fixed-shape compaction, deferred grant and recycle)
    reads the device once, at its end."""
    c = count_decode_syncs(*CONFIGS[3][1:], steps=1)[0]
    assert c.compressed and c.total() <= 1, c.report()


def _decode_run(backend: str, overrides: dict, steps: int, num_pages: int, spec: str = "K8V4-K4V2"):
    """Prompt plus ``steps`` greedy decode steps through a fixed pool on ``backend`` (LeanKV unless
    ``overrides`` names another policy); returns (tokens, per-tier token counts, page counts, the
    free list, the cache)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LEANKIT_BACKEND", backend)
        model = tiny_model("llama-gqa", num_hidden_layers=2)
        cache = LeanCache(model, spec, num_pages=num_pages, **overrides)
        toks = []
        with torch.no_grad():
            logits, mask, pos = _prompt(model, cache)
            for _ in range(steps):
                nxt, mask, pos = _next_inputs(logits, mask, pos)
                toks.append(nxt)
                logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                               use_cache=True).logits
        return torch.cat(toks, 1), cache.table.lens.clone(), cache.table.n_pages.clone(), cache.free_list, cache


@pytest.mark.parametrize("overrides", [
    {"th": 0.3, "tl": 0.1, "window": 3, "compress_every": 1, "group_size": 8, "page_size": 256},
    {"th": 0.5, "tl": 0.05, "window": 2, "compress_every": 3, "page_size": 256},
], ids=["prune-every-step", "every-3"])
def test_sync_free_algorithm_1_moves_what_the_torch_backend_moves(overrides):
    """The fixed-shape Algorithm 1 of the kernel backend (masked compaction, dense page handover,
    deferred grant and recycle) keeps the same tokens in the same tiers as the torch backend's,
    with the same page counts, and the free list accounts for every page."""
    got = _decode_run("triton", overrides, steps=7, num_pages=160)
    want = _decode_run("torch", overrides, steps=7, num_pages=160)
    _assert_same_run(got, want)
    assert int(got[1][1].sum()) > 0  # tokens did go low


def _assert_same_run(got, want) -> None:
    """Two :func:`_decode_run` results agree: tokens, per-tier token and page counts; and the
    kernel run's free list accounts for every page."""
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1]), (got[1], want[1])
    assert torch.equal(got[2], want[2]), (got[2], want[2])
    cache = got[4]
    owned = cache.table.tables >= 0
    assert int(owned.sum()) == int(cache.table.n_pages.sum())
    fl = got[3]
    fl.sync()
    assert fl.num_free == fl.capacity - int(owned.sum())
    free = set(fl.free_ids().tolist())
    assert not free & set(cache.table.tables[owned].tolist())  # no page both free and owned


def _eos_run(backend: str, eos: int, end_at: dict, spec: str, overrides: dict, model_kw: dict, steps: int = 5):
    """A prompt and ``steps`` decode steps of a fixed-pool LeanCache (``spec``, ``overrides``)
    built with ``eos_token_id=eos`` on ``backend``, for a :func:`tiny_model` of ``model_kw``; row
    ``b`` is fed ``eos`` at step ``end_at[b]`` and padding (id 0, the model's) after it, as ``generate``
    feeds a row that sampled its EOS (other tokens: random, never ``eos``). Returns the
    per-step sync counters, each step's greedy tokens, pages in use after each step, and the cache."""
    patch = pytest.MonkeyPatch()
    try:
        patch.setenv("LEANKIT_BACKEND", backend)
        kw = dict(model_kw)
        model = tiny_model(kw.pop("kind"), num_hidden_layers=3, **kw)
        cache = LeanCache(model, spec, num_pages=400, eos_token_id=eos, **overrides)
        counters, tokens, used = [], [], []
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            logits, mask, pos = _prompt(model, cache)
            for i in range(steps):
                nxt = torch.randint(3, 97, (mask.shape[0], 1), generator=g)
                nxt[nxt == eos] = 3
                for b, at in end_at.items():
                    if at == i:
                        nxt[b] = eos
                    elif at < i:
                        nxt[b] = 0
                mask, pos = torch.cat([mask, torch.ones_like(nxt)], 1), pos + 1
                counter = SyncCounter()
                handles = layer_phase_hooks(model, counter)
                try:
                    with counter:
                        logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos,
                                       **cache_kwargs(model, cache), use_cache=True).logits
                finally:
                    for h in handles:
                        h.remove()
                counters.append(counter)
                tokens.append(logits[:, -1].argmax(-1))
                used.append(cache.free_list.capacity - cache.free_list.num_free)
        return counters, tokens, used, cache
    finally:
        patch.undo()


@pytest.mark.parametrize("spec,overrides,model_kw", [
    ("K8V4", {"page_size": 256}, {"kind": "llama-gqa"}),
    ("K8V4", {"act": 0.5, "page_size": 512}, ACT_MODEL),
], ids=["K8V4", "act-ratio"])
@pytest.mark.filterwarnings("ignore:act=0.5")  # the tiny model's ACT block outweighs its KV: only the release is tested
def test_a_row_that_ends_is_released_without_a_host_read(spec, overrides, model_kw):
    """A cache built with ``eos_token_id`` (as :func:`leankit.apply` builds it for ``generate``)
    frees a row's pages (its ACT pages too) when the row is fed padding after an EOS. On the kernel
    backend that release is deferred (no read of whether any row ended), so a decode step still
    reads the device once, never inside a layer; the pages in use after each step, the rows'
    pages and the greedy tokens of the rows still running are the torch backend's."""
    end_at = {1: 2}
    counters, tokens, used, cache = _eos_run("triton", 5, end_at, spec, overrides, model_kw)
    for i, c in enumerate(counters):
        assert c.total("layer") == 0 and c.total() <= 1, f"decode step {i}\n" + c.report()
    _, want_tokens, want_used, want = _eos_run("torch", 5, end_at, spec, overrides, model_kw)
    assert used == want_used, (used, want_used)
    assert used[3] < used[2]  # the ended row's pages came back at the step after its EOS
    assert int(cache.table.n_pages[:, :, 1].sum()) == 0 and bool(cache.finished[1])
    assert torch.equal(cache.table.n_pages, want.table.n_pages) and torch.equal(cache.table.lens, want.table.lens)
    if cache.act_store is not None:
        assert int(cache.act_store.table.n_pages[:, 1].sum()) == 0
        assert torch.equal(cache.act_store.table.n_pages, want.act_store.table.n_pages)
    for got_t, want_t in zip(tokens, want_tokens):
        assert torch.equal(got_t[[0, 2]], want_t[[0, 2]])


@pytest.mark.parametrize("pad_step", [3, 0], ids=["left-padded", "unpadded"])
def test_decode_steps_build_no_full_attention_mask(pad_step):
    """transformers builds each step's full-attention mask with ``sdpa_mask``, which first asks
    whether the padding mask is all ones: a host read on a GPU, every step. A LeanCache step after
    the prompt reads no mask in its compressed layers, so leankit's mask function returns None
    there: transformers' masking code reads the device in no decode step (the prompt still builds
    its mask), and the model's own mask is still what a prompt attends with."""
    import transformers.masking_utils as masking

    patch = pytest.MonkeyPatch()
    try:
        patch.setenv("LEANKIT_BACKEND", "triton")
        model = tiny_model("llama-gqa", num_hidden_layers=2)
        cache = LeanCache(model, "K8V4", num_pages=160, page_size=256)
        ids, mask = left_padded_batch(rows=3, width=11, pad_step=pad_step)
        with torch.no_grad():
            prompt = SyncCounter(roots=(masking.__file__,))
            with prompt:
                logits = model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True).logits
            pos = mask.sum(1, keepdim=True) - 1 + (mask.shape[1] - mask.sum(1, keepdim=True))
            for i in range(3):
                nxt, mask, pos = _next_inputs(logits, mask, pos)
                counter = SyncCounter(roots=(masking.__file__,))
                with counter:
                    logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos,
                                   **cache_kwargs(model, cache), use_cache=True).logits
                assert counter.total() == 0, f"decode step {i}\n" + counter.report()
        assert prompt.total() > 0  # the counter does see the mask check where a mask is built
    finally:
        patch.undo()


def test_deferred_release_needs_the_kernel_backend():
    """``release(defer=True)`` on the torch backend is refused (the pool's counters are host-side there)."""
    patch = pytest.MonkeyPatch()
    try:
        patch.setenv("LEANKIT_BACKEND", "torch")
        model = tiny_model("llama-gqa", num_hidden_layers=2)
        cache = LeanCache(model, "K8V4", num_pages=64)
        with torch.no_grad():
            _prompt(model, cache)
        before = cache.table.n_pages.clone()
        with pytest.raises(ValueError, match="kernel backend"):
            cache.release(torch.tensor([True, False, False]), defer=True)
        assert torch.equal(cache.table.n_pages, before) and not bool(cache.finished.any())
    finally:
        patch.undo()


def _kept_positions(cache) -> torch.Tensor:
    """Positions of the high tier's tokens, slot by slot (``-1`` past each head's count)."""
    m = read_tier_meta(cache, HIGH, torch.arange(cache.num_layers))
    width = int(cache.table.lens[HIGH].max())
    return torch.where(m.valid, m.pos, torch.full_like(m.pos, -1))[..., :width]


@pytest.mark.parametrize("overrides", [
    {"policy": "h2o", "budget": 0.45, "page_size": 256},
    {"policy": "streaming", "sink": 3, "window": 4, "page_size": 256},
], ids=["h2o", "streaming"])
def test_sync_free_eviction_keeps_what_the_torch_backend_keeps(overrides):
    """The end-of-step eviction of h2o and streaming at the fixed width read with the step's flags
    (masked compaction, deferred recycle) keeps the torch backend's tokens, in the same slots, with
    the same page counts, and the free list accounts for every page."""
    got = _decode_run("triton", overrides, steps=7, num_pages=160, spec="K8V4")
    want = _decode_run("torch", overrides, steps=7, num_pages=160, spec="K8V4")
    _assert_same_run(got, want)
    assert torch.equal(_kept_positions(got[4]), _kept_positions(want[4]))
    seen = got[4].policy.real_seen.view(1, -1, 1)
    assert bool((got[1][0] < seen).all())  # every head of every row evicted tokens
    t = got[4].layouts[0].tokens
    full = int((-(-seen // t)).sum()) * 2 * 2  # pages of the same tokens uncompressed (2 layers, 2 heads)
    assert int(got[2].sum()) < full  # ... and their pages came back


def _kernel_cache(monkeypatch, spec="K8V4", **kw):
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    model = tiny_model("llama-gqa", num_hidden_layers=3)
    ids, mask = left_padded_batch(rows=3, width=9, pad_step=3)
    cache = LeanCache(model, spec, **kw)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    return model, cache, mask


def _step(model, cache, mask, seed):
    """One decode step of random tokens (positions continue the prompt's: the logical index)."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(3, 97, (mask.shape[0], 1), generator=g)
    mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    pos = torch.full_like(nxt, mask.shape[1] - 1)
    with torch.no_grad():
        return model(input_ids=nxt, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache),
                     use_cache=True).logits, mask


def _refused_nan_step(model, cache, mask, seed: int) -> None:
    """A decode step whose keys in the model's layer 1 hold a NaN: NonFiniteKVError naming that layer."""
    from leankit.quant import NonFiniteKVError

    proj = model.get_decoder().layers[1].self_attn.k_proj
    hook = proj.register_forward_hook(lambda _m, _a, out: out.index_fill(-1, torch.tensor([3]), float("nan")))
    try:
        with pytest.raises(NonFiniteKVError, match="^layer 1:"):
            _step(model, cache, mask, seed)
    finally:
        hook.remove()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy casts the NaN too
def test_non_finite_kv_on_the_kernel_path_drops_the_step(monkeypatch):
    """NaN keys in one layer: the step's one device read raises NonFiniteKVError naming that layer,
    the step's tokens are gone from every layer, and the next step works like a fresh cache's."""
    model, cache, mask = _kernel_cache(monkeypatch, page_size=256)
    _, ref_cache, _ = _kernel_cache(monkeypatch, page_size=256)
    lens, seen = cache.table.lens.clone(), cache.get_seq_length()
    _refused_nan_step(model, cache, mask, seed=5)
    assert torch.equal(cache.table.lens, lens) and cache.get_seq_length() == seen
    got, _ = _step(model, cache, mask, seed=6)
    want, _ = _step(model, ref_cache, mask, seed=6)
    assert torch.equal(got, want)
    assert torch.equal(cache.table.lens, ref_cache.table.lens)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy casts the NaN too
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_dropped_step_leaves_the_sliding_window_layers_as_they_were(backend, monkeypatch):
    """Gemma3 with sliding layers around a compressed one: NaN keys in the compressed layer (the
    model's layer 1) drop the step, the error names that layer, and transformers' sliding-window
    layers inside the cache (which took the step's K/V before the raise, or, on the kernel backend,
    before the end-of-step read) hold what they held before it: the next steps match a clean cache's."""
    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("gemma3", layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       sliding_window=5)
    ids, mask = left_padded_batch(rows=2, width=9, pad_step=3)
    caches = [LeanCache(model, "K8V4", page_size=256) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, c), use_cache=True)
    cache, clean = caches
    held = [(layer.keys, layer.values, layer.cumulative_length) for layer in (cache.layers[0], cache.layers[2])]
    _refused_nan_step(model, cache, mask, seed=3)
    for layer, (k, v, n) in zip((cache.layers[0], cache.layers[2]), held, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.cumulative_length == n
    for seed in (4, 5, 6):  # past the window: the sliding layers drop their oldest tokens as they go
        got, grown = _step(model, cache, mask, seed)
        want, _ = _step(model, clean, mask, seed)
        mask = grown
        assert torch.equal(got, want), f"step seed {seed}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_first_step_refused_leaves_the_cache_fresh(backend, monkeypatch):
    """A prompt that does not fit a fresh cache's fixed pool raises PoolExhausted (on the torch
    backend at the grant, on the kernel backend at the step's end) and leaves the cache as fresh
    as it was: no batch size bound, no page held, and a smaller request then runs as on a new cache."""
    from leankit import PoolExhausted

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa", num_hidden_layers=2)
    ids, mask = left_padded_batch(rows=3, width=12, pad_step=3)
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    cache = LeanCache(model, "K8V4", num_pages=10, page_size=256)
    with torch.no_grad():
        with pytest.raises(PoolExhausted):
            model.generate(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), **kw)
        assert cache.table is None and cache.get_seq_length() == 0 and cache.memory_report()["pages_used"] == 0
        got, want = (model.generate(input_ids=ids[:2, 8:], attention_mask=mask[:2, 8:], **cache_kwargs(model, c), **kw)
                     for c in (cache, LeanCache(model, "K8V4", num_pages=10, page_size=256)))
    assert torch.equal(got, want)


def _short_pool_cache(monkeypatch, spec, **kw):
    """A kernel-backend cache whose fixed pool has one page more than the prompt takes."""
    _, cache, _ = _kernel_cache(monkeypatch, spec, **kw)
    return _kernel_cache(monkeypatch, spec, num_pages=int(cache.table.n_pages.sum()) + 1, **kw)


def _step_until_exhausted(model, cache, mask, steps, snapshot):
    """Decode until a step raises PoolExhausted (within ``steps``; some (layer, row, head) soon needs
    more pages than are left); returns (the error, the mask, ``snapshot()`` taken before that step)."""
    from leankit import PoolExhausted

    for seed in range(steps):
        before = snapshot()
        try:
            _, mask = _step(model, cache, mask, seed)
        except PoolExhausted as e:
            return e, mask, before
    raise AssertionError("the pool never ran short")


def test_short_fixed_pool_on_the_kernel_path_raises_at_the_end_of_the_step(monkeypatch):
    """A decode step that needs more pages than the fixed pool has left: PoolExhausted from the
    step's one read, nothing handed out, the step dropped; after freeing a row the cache goes on."""
    model, cache, mask = _short_pool_cache(monkeypatch, "K8V4", page_size=256)
    err, mask, (lens,) = _step_until_exhausted(model, cache, mask, 8, lambda: (cache.table.lens.clone(),))
    assert err.needed > err.free
    assert torch.equal(cache.table.lens, lens)  # the step was dropped
    fl, owned = cache.free_list, int((cache.table.tables >= 0).sum())
    assert not fl.stale and fl.num_free == fl.capacity - owned == 1
    assert int(cache.table.n_pages.sum()) == owned
    cache.release(torch.tensor([True, False, False]))
    _step(model, cache, mask, seed=9)  # a row's pages came back: the step fits
    assert int(cache.table.lens[:, :, 1:].sum()) == int(lens[:, :, 1:].sum()) + 3 * 2 * 2


def test_short_pool_in_an_algorithm_1_step_moves_nothing(monkeypatch):
    """A step of LeanKV's Algorithm 1 whose grant does not fit a fixed pool: PoolExhausted from the
    step's one read, no token moved or dropped and no page handed out or recycled; the cache goes on."""
    kw = {"th": 0.3, "tl": 0.1, "window": 3, "compress_every": 1, "group_size": 8, "page_size": 256}
    model, cache, mask = _short_pool_cache(monkeypatch, "K8V4-K4V2", **kw)
    _, mask, before = _step_until_exhausted(
        model, cache, mask, 10, lambda: (cache.table.lens.clone(), cache.table.tables.clone(),
                                         cache.table.n_pages.clone(), cache.policy.watermark.clone(),
                                         cache.policy.pruned_mass.clone()))
    after = (cache.table.lens, cache.table.tables, cache.table.n_pages, cache.policy.watermark,
             cache.policy.pruned_mass)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    fl = cache.free_list
    fl.sync()
    assert fl.num_free == fl.capacity - int((cache.table.tables >= 0).sum()) == 1
    cache.release(torch.tensor([True, False, False]))
    _step(model, cache, mask, seed=11)  # a row's pages came back: the step fits
    assert int(cache.table.lens[1].sum()) > 0


def test_counter_sees_every_kind_of_sync():
    """The counter itself: each sync-forcing op is counted once, and only from the given roots."""
    x = torch.tensor([3, 0, 5])

    def syncs():
        int(x.sum())
        bool(x.any())
        x.nonzero()
        x[x > 1]
        x.tolist()
        y = x.clone()
        y[x > 1] = 0
        torch.repeat_interleave(x)
        torch.repeat_interleave(x, 2)  # a host repeat count: no sync
        torch.cumsum(x, 0)
        torch.tensor([1, 2], device=x.device)  # host data copied to the device
        torch.as_tensor(x, device=x.device)  # already a tensor: no copy from the host
        torch.tensor(5)  # stays on the host

    with SyncCounter() as outside:  # this file is not leankit's
        syncs()
    assert outside.total() == 0
    c = SyncCounter(roots=(_THIS,))
    with c:
        syncs()
    ops = Counter()
    for (_ph, op, _site), n in c.counts.items():
        ops[op] += n
    assert ops["_local_scalar_dense"] == 2
    assert ops["nonzero"] == 1
    assert ops["index"] == 1 and ops["index_put_"] == 1
    assert ops["tolist"] == 1
    assert ops["repeat_interleave"] == 1
    assert ops["tensor(host data, device=...)"] == 1
    assert c.total() == 8


if __name__ == "__main__":
    for name, spec, overrides in CONFIGS:
        per_step = count_decode_syncs(spec, overrides)
        layers = [c.total("layer") for c in per_step]
        totals = [c.total() for c in per_step]
        print(f"{name:14s} per decode step: {totals} in all, {layers} inside layers")
        if "-v" in sys.argv:
            print(per_step[-1].report())


# A prompt's attention on a CPU runs CPU-only helpers (its causal spans are listed on the host);
# on a GPU it is SDPA plus the significance kernels. What a LeanKV prompt adds is its store.
_CPU_PROMPT_SITES = ("prompt_attention.py",)


def _count_leankv_prompt(monkeypatch, counter, spec: str, overrides: dict):
    """A left-padded prompt through a 3-layer GQA model and a fixed-pool LeanCache on the kernel
    backend, under ``counter`` per layer phase; returns ``(cache, counter, the (phase, op, site)
    keys of leankit's ops inside layers)``, the prompt's CPU-only attention helpers left out."""
    monkeypatch.setenv("LEANKIT_BACKEND", "triton")
    model = tiny_model("llama-gqa", num_hidden_layers=3)
    ids, mask = left_padded_batch(rows=3, width=30, pad_step=5)
    cache = LeanCache(model, spec, num_pages=300, **overrides)
    handles = layer_phase_hooks(model, counter)
    try:
        with torch.no_grad(), counter:
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    ours = [(ph, op, site) for (ph, op, site) in counter.counts
            if ph.startswith("layer") and not any(s in site for s in _CPU_PROMPT_SITES)]
    return cache, counter, ours


@pytest.mark.parametrize("spec,overrides", [("K8V4-K4V2", {"th": 0.4, "tl": 0.1, "window": 4}),
                                            ("K8V4-K4V2", {"th": 0.25, "tl": 0.0, "group_size": 8, "rotate": 1}),
                                            ("K8V4", {"policy": "leankv", "tl": 0.2, "window": 4})])
def test_leankv_prompt_store_reads_nothing_back_inside_layers(spec, overrides, monkeypatch):
    """A LeanKV prompt, classified per head, is stored on the kernel backend with no host read in
    any layer: its pages come from a deferred grant, its tokens from one store launch per tier, the
    recycle is deferred (before: a nonzero per tier, a grant, a relabel and a shrink read the device
    in every layer)."""
    cache, counter, ours = _count_leankv_prompt(monkeypatch, SyncCounter(), spec, overrides)
    assert not ours, counter.report()
    report = cache.memory_report()
    assert report["tokens_per_tier"]["pruned"] > 0 or overrides.get("tl") == 0.0, report["tokens_per_tier"]


def test_leankv_prompt_store_launches_at_most_30_ops_a_layer(monkeypatch):
    """What a LeanKV prompt's store launches around its kernels, per layer (each op a launch of
    several microseconds of host time on a GPU, where this step is host-bound: about 290 launches a
    layer at SmolLM2's shape on an H100, results/gpu-h100). The prompt phase classifies without the
    victim search of Algorithm 1 (nothing is classified yet); on the kernel backend the
    significance, both cut-offs, the classes, their ranks and counts and the pruned mass are one
    launch (leankit_kernels.prompt_plan); the page plan, the deferred grant and the hand-over of
    emptied high pages to the low side one each (leankit_kernels.page_alloc). Left: the counts and
    recycle, the rotation. 245 ops a layer at first, 170 with the cut-offs in one pass, 27 now."""
    _, counter, ours = _count_leankv_prompt(monkeypatch, LaunchCounter(), "K8V4-K4V2",
                                            {"th": 0.25, "tl": 0.0, "group_size": 8, "rotate": 1})
    n = sum(counter.counts[key] for key in ours)
    assert 0 < n <= 30 * 3, f"{n / 3:.0f} ops a layer\n" + counter.report()
    sites = {site for (_, _, site) in ours}
    assert not any(f in site for site in sites for f in ("significance_cutoffs", "plan_unified", "(tier_plan)",
                                                          "grow_pages")), sites


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_short_pool_for_a_leankv_prompt_raises_and_stores_nothing(monkeypatch, backend):
    """A LeanKV prompt whose pages do not fit a fixed pool: PoolExhausted (on the kernel backend at
    the end of the step, on a CPU from the layer's compiled store, ``lk_prompt_layer``), no token
    stored; the refused first step leaves the cache fresh (every page the layers were granted back
    on the free list, once each, no batch size bound): a smaller batch then fits."""
    from leankit import PoolExhausted, native

    monkeypatch.setenv("LEANKIT_BACKEND", backend)
    model = tiny_model("llama-gqa", num_hidden_layers=3)
    ids, mask = left_padded_batch(rows=3, width=30, pad_step=5)
    kw = {"th": 0.4, "tl": 0.1, "window": 4, "page_size": 256}
    probe = LeanCache(model, "K8V4-K4V2", **kw)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, probe), use_cache=True)
    need = probe.memory_report()["pages_used"]
    cache = LeanCache(model, "K8V4-K4V2", num_pages=need - 1, **kw)
    codes, compiled = [], native.kernels() if backend == "torch" else None
    if compiled is not None:  # the CPU run refuses in the layer's one compiled call
        layer_call = native.Kernels.prompt_layer

        def recorded(self, *args):
            codes.append(layer_call(self, *args))
            return codes[-1]
        monkeypatch.setattr(native.Kernels, "prompt_layer", recorded)
    with pytest.raises(PoolExhausted), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    assert compiled is None or codes[-1][:2] == (native.POOL_SHORT, 0), codes
    assert cache.table is None and cache.get_seq_length() == 0
    fl = cache.free_list
    fl.sync()
    free = fl.free_ids().tolist()
    assert fl.capacity == need - 1 and fl.num_free == fl.capacity and sorted(free) == list(range(fl.capacity))
    with torch.no_grad():  # two of the three rows fit
        model(input_ids=ids[:2], attention_mask=mask[:2], **cache_kwargs(model, cache), use_cache=True)
    assert cache.memory_report()["tokens_per_tier"]["low"] > 0
