"""``leankit bench throughput``: generated tokens/s at a fixed KV budget, against DynamicCache.

Serving is limited by KV memory: with a budget of ``B`` bytes a cache that stores fewer bytes per
token runs larger batches. For every cache this module finds the largest batch whose rows all
fit in the budget for the mix's longest request (the top of its prompt range plus the top of its
output range), then runs the same list of real-text requests through ``model.generate`` in
batches of that size, and reports generated tokens/s and the batch, as ratios against
``DynamicCache``.

How each cache is held to the budget:

* ``DynamicCache``: counted as an **fp16** cache of the tokens it holds (padding included, as it
  stores them): ``(prompt + output) x layers x kv_heads x head_dim x 2 (K, V) x 2 bytes`` per row,
  whatever the model's dtype (an fp32 model really holds twice that). A sliding-window layer
  (Gemma3's local layers) holds at most its window of those tokens.
* HF ``QuantizedCache`` (int4, optimum-quanto, else HQQ): the bytes it holds, measured after every
  generated token of one row of the longest request: packed codes + scales + offsets + the
  full-precision residual, its floating-point tensors counted at 2 bytes an element as
  DynamicCache's are (an fp16 model holds them so; an fp32 one twice that). The copy it
  dequantizes on every step is transient and not counted.
* ``LeanCache``: for real, a fixed pool of pages, which raises ``PoolExhausted`` when it runs
  out. The peak page use of one row of the longest request is measured (at every allocation, so
  the peak inside a step counts) to estimate the batch, then the estimate is verified: that many
  rows of the longest request run in the pool and one row more exhausts it (``--no-verify``
  skips this; an estimate above ``--requests`` is verified at that many rows, the most any batch
  of the run holds). Sliding-window layers are not paged: they keep transformers' own sliding layer,
  counted as DynamicCache counts it (fp16, at most the window), so a batch of ``b`` rows gets
  the pages of ``budget - b x`` those bytes.

Every batch generates exactly the batch's longest requested output (``min_new_tokens =
max_new_tokens``, so EOS never stops a row early, the same for every cache); only each request's
own requested tokens are counted. Time is the sum of the ``generate`` calls, from the first
prefill of a batch to its last token (building the cache and padding the batch excluded); the
time to each batch's first token is reported as the prefill share, which bounds what any cache
can gain on the mix (prefill work does not shrink with a bigger batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib import metadata

import torch

from ..pages import format_bytes
from .text import Request, check_positions, corpus_ids, left_padded, pad_id, request_mix, text_source

NEUTRAL = "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1"
PRUNING = "K8V4-K4V2:th=0.3,tl=0.05"
DEFAULT_KVS = ("K8V4", NEUTRAL, PRUNING)
# name -> (prompt range, output range), both inclusive
MIXES = {"decode-heavy": ((512, 1024), (128, 256)), "prefill-heavy": ((512, 1024), (16, 32))}


# ---------------------------------------------------------------------------- bytes
def tensor_bytes(obj, float_bytes: int | None = None) -> int:
    """Bytes of every tensor reachable in ``obj`` (tensors, quantized tensor subclasses through their
    inner tensors, tuples, lists and dicts); anything else counts 0. ``float_bytes``: count each
    floating-point element at most that many bytes (2: as an fp16 model would hold it)."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = flatten()
            return sum(tensor_bytes(getattr(obj, n), float_bytes) for n in names)
        size = obj.element_size()
        if float_bytes is not None and obj.is_floating_point():
            size = min(size, float_bytes)
        return obj.numel() * size
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x, float_bytes) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, float_bytes) for x in obj.values())
    return 0


def _model_dims(model) -> tuple[int, int, int]:
    from ..cache import _text_config, attention_head_dim, attention_kv_heads

    cfg = _text_config(model.config)
    return cfg.num_hidden_layers, attention_kv_heads(cfg), attention_head_dim(cfg)


def _sliding_layers(model) -> tuple[int, int]:
    """``(sliding-window layers, their window)`` of ``model`` (``(0, 0)`` without any)."""
    from ..cache import PLAIN, _text_config, layer_types

    cfg = _text_config(model.config)
    n = sum(t == PLAIN for t in layer_types(cfg))
    return (n, int(cfg.sliding_window)) if n else (0, 0)


def plain_row_bytes(model, tokens: int) -> int:
    """fp16 bytes of one row's K/V in ``model``'s sliding-window layers, holding at most their
    window of ``tokens`` (transformers' sliding layer keeps ``window - 1`` between steps and
    ``window`` within one): what LeanCache leaves to transformers' own layer there."""
    _, heads, head_dim = _model_dims(model)
    n, window = _sliding_layers(model)
    return min(tokens, window) * n * heads * head_dim * 2 * 2


def fp16_row_bytes(model, tokens: int) -> int:
    """Bytes of an fp16 K/V cache holding ``tokens`` tokens of one row of ``model``: every token in
    each full-attention layer, at most the window in each sliding-window layer."""
    layers, heads, head_dim = _model_dims(model)
    full = layers - _sliding_layers(model)[0]
    return tokens * full * heads * head_dim * 2 * 2 + plain_row_bytes(model, tokens)


def default_budget(model, prompt_range, output_range, rows: int = 8) -> int:
    """The fp16 bytes of ``rows`` rows of the mix's longest request."""
    return rows * fp16_row_bytes(model, prompt_range[1] + output_range[1])


# ---------------------------------------------------------------------------- generation
class _PeakBytes:
    """A stopping criterion that never stops: it reads ``measure()`` after every generated token."""

    def __init__(self, measure):
        self.measure, self.peak = measure, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.peak = max(self.peak, self.measure())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _FirstToken:
    """A stopping criterion that never stops: it notes when the first token is chosen, i.e. when
    the prefill forward is done."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.at is None:
            self.at = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, cache, prompts: list[torch.Tensor], new_tokens: int, pad: int, stopping=None,
             timed: dict | None = None) -> float:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens per row into ``cache``; returns its wall time.

    ``timed``: a dict whose ``"prefill_s"`` grows by the time to the first token (the prefill).
    """
    from transformers import StoppingCriteriaList

    from ..hf import cache_kwargs

    ids, mask = left_padded(prompts, pad)
    first = _FirstToken()
    kwargs = dict(**cache_kwargs(model, cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=pad, stopping_criteria=StoppingCriteriaList([first] + ([stopping] if stopping else [])))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - t0
    if timed is not None:
        timed["prefill_s"] = timed.get("prefill_s", 0.0) + (first.at - t0 if first.at is not None else elapsed)
    return elapsed


# ---------------------------------------------------------------------------- caches
@dataclass
class Fit:
    """The batch a cache runs within the budget and how it was found."""

    batch: int
    bytes_per_row: int
    how: str
    notes: list = field(default_factory=list)


class DynamicKind:
    """``DynamicCache``, counted as fp16."""

    name = "DynamicCache"
    bytes_note = "fp16 bytes of the tokens it holds (the model's own dtype may be wider)"

    def make(self, model, budget: int, max_len: int, rows: int = 1):
        from transformers import DynamicCache

        return DynamicCache(config=model.config)

    def fit(self, model, budget, longest: torch.Tensor, new_tokens: int, pad: int, verify: bool, bar,
            requests: int | None = None) -> Fit:
        # the tokens it holds: the prompt and every new token but the last, which is never fed back
        per_row = fp16_row_bytes(model, len(longest) + max(new_tokens, 1) - 1)
        return Fit(budget // per_row, per_row, "budget // fp16 bytes of one row of the longest request")


def quantized_backend() -> tuple[str | None, str]:
    """``(backend, description)`` of the HF QuantizedCache backend to use: optimum-quanto, else HQQ;
    ``(None, why)`` when neither is installed."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    if is_optimum_quanto_available():
        return "quanto", f"optimum-quanto {metadata.version('optimum-quanto')}"
    if is_hqq_available():
        return "hqq", f"hqq {metadata.version('hqq')}"
    return None, ("HF QuantizedCache skipped: neither optimum-quanto nor hqq is installed "
                  "(pip install 'leankit-kv[bench]' adds optimum-quanto)")


class QuantizedKind:
    """HF ``QuantizedCache`` at 4 bits (group of 64 channels, or head_dim if smaller; residual 128)."""

    def __init__(self, backend: str, description: str):
        self.backend, self.description = backend, description
        self.name = f"QuantizedCache int4 ({backend})"
        self.bytes_note = "codes + scales + offsets + residual, its floating-point tensors at 2 bytes (as DynamicCache)"

    def make(self, model, budget: int, max_len: int, rows: int = 1):
        from transformers.cache_utils import QuantizedCache

        head_dim = _model_dims(model)[2]
        return QuantizedCache(self.backend, model.config, nbits=4, q_group_size=min(64, head_dim))

    @staticmethod
    def nbytes(cache) -> int:
        """Bytes the cache holds now, its floating-point tensors counted at 2 bytes (fp16, as
        DynamicCache is counted whatever the model's dtype)."""
        return sum(tensor_bytes((layer._quantized_keys, layer._quantized_values, layer.keys, layer.values), 2)
                   for layer in cache.layers)

    def fit(self, model, budget, longest, new_tokens, pad, verify, bar, requests: int | None = None) -> Fit:
        cache = self.make(model, budget, len(longest) + new_tokens)
        peak = _PeakBytes(lambda: self.nbytes(cache))
        generate(model, cache, [longest], new_tokens, pad, stopping=peak)
        bar.update(1)
        return Fit(budget // peak.peak, peak.peak, "budget // peak bytes (floats at 2) of one row of the longest request")


class LeanKind:
    """``LeanCache`` with a fixed pool of pages: the budget less its rows' sliding-window layers
    (:func:`plain_row_bytes`), in pages."""

    bytes_note = ("peak pages of one row (page bytes; the page table is not counted), plus the fp16 bytes of its "
                  "sliding-window layers' K/V where the model has any")

    def __init__(self, kv: str):
        from ..config import KVConfig

        self.kv, self.cfg = kv, KVConfig.parse(kv)
        self.name = f"LeanCache {kv}"

    def pool_pages(self, model, budget: int, max_len: int, rows: int) -> int:
        """Pages left to ``rows`` rows once their sliding-window layers (if any) are counted."""
        return max(0, budget - rows * plain_row_bytes(model, max_len)) // self.cfg.page_size

    def make(self, model, budget: int, max_len: int, rows: int = 1, fixed: bool = True):
        from ..cache import LeanCache
        from ..pages import MAX_PAGES, PoolSizeError

        pages = self.pool_pages(model, budget, max_len, rows) if fixed else None
        try:
            return LeanCache(model, self.cfg, num_pages=pages, max_seq_len=max_len)
        except PoolSizeError:
            if pages is None:
                raise
            why = f": it has more pages than int32 page ids address ({MAX_PAGES})"
        except (RuntimeError, MemoryError) as err:  # the pool is allocated whole, up front
            if pages is None or "allocate" not in str(err):
                raise
            why = " on this machine"
        raise ValueError(f"{self.name}: its fixed pool of {pages} pages ({format_bytes(pages * self.cfg.page_size)}) "
                         f"for --budget-bytes {budget} cannot be allocated{why}; ask for a smaller budget")

    def runs(self, model, budget, longest, new_tokens, pad, rows: int) -> bool:
        """Whether ``rows`` rows of the longest request run in the fixed pool without exhausting it."""
        from ..allocator import PoolExhausted

        if self.pool_pages(model, budget, len(longest) + new_tokens, rows) < 1:
            return False  # the rows' sliding-window layers alone take the whole budget
        cache = self.make(model, budget, len(longest) + new_tokens, rows)
        try:
            generate(model, cache, [longest] * rows, new_tokens, pad)
        except PoolExhausted:
            return False
        return True

    def fit(self, model, budget, longest, new_tokens, pad, verify, bar, requests: int | None = None) -> Fit:
        """The batch the budget fits, from one row's peak pages, then verified (``verify``): that many
        rows of the longest request run and one more exhausts the pool. ``requests``: how many the run
        serves, when known; an estimate above it is verified at that many rows only, since no batch
        of the run holds more (verifying tens of thousands of rows of a large budget would take
        longer than the run)."""
        cache = self.make(model, budget, len(longest) + new_tokens, fixed=False)
        free_list, peak = cache.free_list, [0]
        allocate, took, mark_stale = free_list.allocate, free_list.took, free_list.mark_stale

        def tracked(demand):  # instance attributes, gone with this calibration cache
            out = allocate(demand)
            peak[0] = max(peak[0], free_list.capacity - free_list.num_free)
            return out

        def tracked_compiled(pages):  # a CPU's compiled grant takes ids from the ring in place
            took(pages)
            peak[0] = max(peak[0], free_list.capacity - free_list.num_free)

        def tracked_kernel(taken=None):
            # the kernel backend grants pages on the device, not through allocate: it marks the host
            # counters stale after each grant, so read them there (num_free syncs)
            mark_stale(taken)
            peak[0] = max(peak[0], free_list.capacity - free_list.num_free)

        free_list.allocate, free_list.took, free_list.mark_stale = tracked, tracked_compiled, tracked_kernel
        generate(model, cache, [longest], new_tokens, pad)
        bar.update(1)
        plain = plain_row_bytes(model, len(longest) + new_tokens)
        per_row = peak[0] * self.cfg.page_size + plain
        batch = budget // per_row
        if plain:
            how = (f"budget // (peak {peak[0]} pages + {plain} fp16 bytes of sliding-window layers) of one row of "
                   "the longest request")
        else:
            how = f"pool of {budget // self.cfg.page_size} pages // peak {peak[0]} pages of one row of the longest request"
        fit = Fit(batch, per_row, how)
        if not verify or batch == 0:
            return fit
        if requests is not None and batch > requests:
            if self.runs(model, budget, longest, new_tokens, pad, requests):
                bar.update(1)
                fit.how += f"; verified at {requests} rows (every request at once), not beyond"
                return fit
            fit.notes.append(f"{requests} rows (every request at once) exhausted the pool")
            batch = requests - 1
        while batch > 0 and not self.runs(model, budget, longest, new_tokens, pad, batch):
            fit.notes.append(f"{batch} rows exhausted the pool")
            batch -= 1
            bar.update(1)
        bar.update(1)
        while self.runs(model, budget, longest, new_tokens, pad, batch + 1):
            fit.notes.append(f"{batch + 1} rows fit the pool")
            batch += 1
            bar.update(1)
        bar.update(1)
        fit.batch = batch
        fit.how += f"; verified: {batch} rows run, {batch + 1} exhaust the pool"
        return fit


# ---------------------------------------------------------------------------- the run
def serve(model, kind, requests: list[Request], batch: int, budget: int, pad: int, bar) -> dict:
    """Run ``requests`` in order, ``batch`` at a time; returns time, tokens and batches.

    A LeanCache batch that exhausts its pool (a real request may need more pages than the
    calibration row) is retried from the start with one row fewer, and the retry is reported.
    """
    from ..allocator import PoolExhausted

    max_len = max(len(r.prompt) for r in requests) + max(r.output for r in requests)
    notes = []
    while batch > 0:
        elapsed, tokens, done, timed = 0.0, 0, 0, {"prefill_s": 0.0}
        try:
            for i in range(0, len(requests), batch):
                chunk = requests[i: i + batch]
                cache = kind.make(model, budget, max_len, batch)
                elapsed += generate(model, cache, [r.prompt for r in chunk], max(r.output for r in chunk), pad,
                                    timed=timed)
                tokens += sum(r.output for r in chunk)
                done += len(chunk)
                bar.update(len(chunk))
        except PoolExhausted as e:
            notes.append(f"batch {batch} exhausted the pool at request {done + 1} ({e}); rerun with {batch - 1}")
            bar.update(len(requests) - done)
            batch -= 1
            continue
        return dict(batch=batch, time_s=elapsed, prefill_s=timed["prefill_s"], tokens=tokens,
                    batches=-(-len(requests) // batch), notes=notes)
    raise ValueError(f"{kind.name} cannot run one row of these requests in a budget of {budget} bytes")


def run(model, tok, mix: str = "decode-heavy", budget: int | None = None, requests: int | None = None,
        prompt_range=None, output_range=None, kvs=DEFAULT_KVS, quantized: bool = True, verify: bool = True,
        seed: int = 0, progress: bool = True, ceiling: bool = False, text_path=None) -> dict:
    """The throughput benchmark; returns everything it measured (see the module doc).

    ``ceiling``: also run ``DynamicCache`` *over the budget* at the largest batch a LeanCache fit
    (same requests). Its tokens/s ratio is what the batch alone buys a cache whose prefill and
    decode steps cost what DynamicCache's cost at that batch: where batching buys little
    (compute-bound decode, as on a CPU) such a cache gains no more. It is not a bound on a cache
    whose steps are faster than DynamicCache's at equal batch (LeanCache's decode attention reads
    fewer bytes than DynamicCache's SDPA over the full-precision K/V), which can pass it.
    ``text_path``: a UTF-8 text file to cut the prompts from instead of the shipped articles.
    """
    from tqdm.auto import tqdm

    if mix not in MIXES:
        raise ValueError(f"unknown --mix {mix!r}; known: {', '.join(MIXES)}")
    prompt_range = tuple(prompt_range or MIXES[mix][0])
    output_range = tuple(output_range or MIXES[mix][1])
    ids, pad = corpus_ids(tok, text_path), pad_id(tok)
    request_mix(ids, 1 if requests is None else requests, prompt_range, output_range)  # checks before any model work
    # generate feeds every token but the last one it makes
    check_positions(model, prompt_range[1] + output_range[1] - 1, "the longest request's prompt and output")
    if budget is None:
        budget = default_budget(model, prompt_range, output_range)
    if budget < 1:
        raise ValueError(f"--budget-bytes must be positive, got {budget}")
    kinds, notes = [DynamicKind()], []
    if quantized:
        backend, desc = quantized_backend()
        if backend is None:
            notes.append(desc)
        else:
            kind = QuantizedKind(backend, desc)
            try:
                kind.make(model, budget, 1)  # transformers refuses some models (sliding-window layers)
            except ValueError as err:
                notes.append(f"HF QuantizedCache skipped: transformers' QuantizedCache refuses this model ({err})")
            else:
                kinds.append(kind)
                notes.append(f"HF QuantizedCache backend: {desc}")
    kinds += [LeanKind(kv) for kv in kvs]
    longest = ids.repeat(prompt_range[1] // len(ids) + 1)[: prompt_range[1]]  # the calibration prompt
    bar = tqdm(desc="fitting the budget", unit="run", leave=False, disable=not progress)
    fits = {}
    for kind in kinds:
        fits[kind.name] = kind.fit(model, budget, longest, output_range[1], pad, verify, bar, requests)
        if fits[kind.name].batch < 1:
            raise ValueError(f"{kind.name} cannot hold one row of {prompt_range[1]} + {output_range[1]} tokens in "
                             f"--budget-bytes {budget} ({fits[kind.name].bytes_per_row} bytes per row)")
    bar.close()
    n = requests if requests is not None else 3 * max(f.batch for f in fits.values())
    reqs = request_mix(ids, n, prompt_range, output_range, seed)
    bar = tqdm(total=n * len(kinds), desc="serving requests", unit="req", leave=False, disable=not progress)
    caches = []
    for kind in kinds:
        fit = fits[kind.name]
        out = serve(model, kind, reqs, fit.batch, budget, pad, bar)
        caches.append(dict(name=kind.name, fitted_batch=fit.batch, bytes_per_row=fit.bytes_per_row,
                           bytes_note=kind.bytes_note, fit=fit.how, notes=fit.notes + out.pop("notes"), **out,
                           tokens_per_s=out["tokens"] / out["time_s"]))
    bar.close()
    base = caches[0]
    top = None
    # the largest LeanCache batch, as --ceiling promises: not HF QuantizedCache's, which is no LeanCache
    batch = max((c["batch"] for c, kind in zip(caches, kinds) if isinstance(kind, LeanKind)), default=base["batch"])
    if ceiling and batch <= base["batch"]:
        notes.append(f"no ceiling run: no LeanCache batch ({batch}) exceeds DynamicCache's own ({base['batch']}), "
                     "so DynamicCache over the budget would be DynamicCache within it")
    elif ceiling:
        bar = tqdm(total=n, desc="ceiling: DynamicCache over the budget", unit="req", leave=False,
                   disable=not progress)
        out = serve(model, kinds[0], reqs, batch, budget, pad, bar)
        bar.close()
        top = dict(batch=out["batch"], time_s=out["time_s"], prefill_s=out["prefill_s"], tokens=out["tokens"],
                   tokens_per_s=out["tokens"] / out["time_s"])
    for c in caches + ([top] if top else []):
        c["tokens_per_s_ratio"] = c["tokens_per_s"] / base["tokens_per_s"]
        c["batch_ratio"] = c["batch"] / base["batch"]
    return dict(mix=mix, prompt_range=list(prompt_range), output_range=list(output_range), requests=n,
                requested_tokens=sum(r.output for r in reqs), prompt_tokens=sum(len(r.prompt) for r in reqs),
                budget_bytes=budget, seed=seed, text=text_source(text_path), caches=caches, notes=notes, ceiling=top)


def mix_label(res: dict) -> str:
    """``"<mix> mix"`` when the run used that mix's own ranges, else ``"custom mix"`` (ranges overridden)."""
    mix = res.get("mix", "")
    own = MIXES.get(mix)
    ranges = (tuple(res.get("prompt_range") or ()), tuple(res.get("output_range") or ()))
    if own is None or ranges != (tuple(own[0]), tuple(own[1])):
        return "custom mix"
    return f"{mix} mix"


def summary(res: dict) -> str:
    """The budget and the mix, in one line."""
    return (f"budget {res['budget_bytes']} bytes ({format_bytes(res['budget_bytes'])}); {mix_label(res)}: "
            f"{res['requests']} requests, prompts {res['prompt_range'][0]}-{res['prompt_range'][1]} tokens, "
            f"outputs {res['output_range'][0]}-{res['output_range'][1]} tokens ({res['requested_tokens']} "
            f"requested tokens in all, seed {res['seed']}{_text_note(res)})")


def _text_note(res: dict) -> str:
    """Where the prompts came from, said only when it is not the shipped articles (the default)."""
    text = res.get("text")  # absent from results saved before --text existed
    return f"; prompts from {text}" if text and text != text_source(None) else ""


def table(res: dict) -> str:
    """Markdown table of :func:`run`'s result."""
    head = ("| cache | batch | generate calls | bytes per row | tokens/s | tokens/s vs DynamicCache | "
            "batch vs DynamicCache | prefill share of the time |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for c in res["caches"]:
        lines.append(f"| {c['name']} | {c['batch']} | {c['batches']} | {format_bytes(c['bytes_per_row'])} | "
                     f"{c['tokens_per_s']:.2f} | "
                     f"{c['tokens_per_s_ratio']:.2f}x | {c['batch_ratio']:.2f}x | "
                     f"{c['prefill_s'] / c['time_s']:.0%} |")
    return "\n".join(lines)


def notes(res: dict) -> str:
    """How each cache's bytes were counted, and anything that happened during the run."""
    out = [summary(res) + "."] + [n + "." for n in res["notes"]]
    short = [c["name"] for c in res["caches"] if c["batch"] > res["requests"]]
    if short:
        out.append(f"Fewer requests ({res['requests']}) than the batch of {', '.join(short)}: those ran one "
                   "smaller batch, so their tokens/s does not show the batch they fit.")
    top = res.get("ceiling")
    if top:
        out.append(f"Ceiling run: DynamicCache over the budget at batch {top['batch']} makes "
                   f"{top['tokens_per_s']:.2f} tokens/s, {top['tokens_per_s_ratio']:.2f}x its in-budget rate: what "
                   "that batch alone buys a cache whose steps cost what DynamicCache's do on this machine (a cache "
                   "whose steps are faster than DynamicCache's at equal batch can pass it)"
                   + (f"; with {res['requests']} requests it ran them as one batch of {res['requests']}, so this "
                      "rate does not show that batch" if top["batch"] > res["requests"] else ""))
    base = res["caches"][0]
    if base["time_s"] > 0:
        # Prefill work grows with the prompt tokens, not the batch, so a bigger batch cannot shrink it:
        # with prefill share f of the baseline's time, no cache whose prefill is as fast gains more
        # than 1 / f, however fast its decode.
        share = base["prefill_s"] / base["time_s"]
        out.append(f"Prefill (time to each batch's first token) is {share:.0%} of DynamicCache's time: a cache "
                   f"with DynamicCache's prefill speed and a free decode would reach {1 / max(share, 1e-9):.2f}x")
    for c in res["caches"]:
        extra = "; ".join(c["notes"])
        out.append(f"{c['name']}: bytes per row = {c['bytes_note']}; batch = {c['fit']}"
                   + (f"; {extra}" if extra else "") + ".")
    return "\n".join(f"- {line}" for line in out)
