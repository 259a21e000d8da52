"""``LeanKitLM``: an lm-eval model whose every scored token goes through a compressing LeanCache.

lm-eval's stock ``HFLM`` scores a request with one forward over context + continuation, which
never reads a KV cache, so it cannot tell a compressed cache from an exact one. ``LeanKitLM``
scores each request the way a server would see it:

1. prefill ``context[:-1]`` into a fresh :class:`~leankit.cache.LeanCache` (prompt-phase
   compression happens here);
2. feed ``[context[-1]] + continuation[:-1]`` with explicit ``position_ids``, in chunks of at most
   ``chunk`` tokens, so the cache compresses between chunks (rolling perplexity windows, whose
   context is one token, are scored exactly this way);
3. sum the log-probabilities of the continuation tokens.

Requests that share a context (the choices of a multiple-choice question) share step 1: each
continuation is scored on a copy of the one prefilled cache, with the scores step 1 done afresh gives.

``generate_until`` passes a fresh LeanCache to ``model.generate`` for every batch.

lm-eval splits ``--model_args`` on commas, so a config string with several overrides cannot
travel whole. Every KVConfig override is therefore also a model argument of its own::

    --model_args pretrained=smollm2-135m,kv=K8V4-K4V2,th=0.3,tl=0.05,group_size=32

An argument that is neither a KVConfig override, a LeanKitLM argument nor one of the HFLM
arguments that apply to an already loaded model raises ``ValueError``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..cache import LeanCache
from ..config import KVConfig, split_overrides
from ..hf import cache_kwargs, enable
from ..models import load_model
from ..pages import format_bytes
from ..planner.hardware import available_memory_bytes
from ..presets import resolve

log = logging.getLogger(__name__)

# KVConfig fields a model argument may set (the tiers come from ``kv`` itself).
KV_OVERRIDES = tuple(f.name for f in dataclasses.fields(KVConfig) if f.name not in ("high", "low", "spec"))
# HFLM arguments that still mean something once the model is loaded (the rest configure loading).
HFLM_ARGS = ("batch_size", "max_batch_size", "max_length", "truncation", "logits_cache", "add_bos_token",
             "prefix_token_id", "softmax_dtype", "think_end_token", "enable_thinking", "chat_template_args",
             "trust_remote_code", "use_fast_tokenizer")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_config(kv, kv_overrides=None, **overrides) -> KVConfig:
    """Build the KVConfig from ``kv`` (a config string, a preset name or a KVConfig) and overrides.

    ``kv`` may carry its own overrides after a colon; ``kv_overrides`` (a dict or a
    ``"th=0.3,tl=0"`` string) comes next and keyword ``overrides`` win over both. Values arrive
    typed or as strings from lm-eval's command line and are converted to each field's type.
    """
    if isinstance(kv, KVConfig):
        spec, inline = kv, {}
    else:
        if not isinstance(kv, str):
            raise ValueError(f"model argument kv must be a config string, got {kv!r}")
        spec, inline = split_overrides(resolve(kv))
    if isinstance(kv_overrides, str):
        _, extra = split_overrides(":" + kv_overrides)
    else:
        extra = _typed(kv_overrides or {})
    return KVConfig.parse(spec, **{**inline, **extra, **_typed(overrides)})


def _typed(values: dict) -> dict:
    """``values`` (typed by lm-eval or a caller) as KVConfig overrides, through the string grammar.

    lm-eval's command line reads "None" as None: that is KVConfig's own "not set" (group_size=None,
    a whole-head group), which the string grammar cannot spell, so it goes to KVConfig.parse as is."""
    _, typed = split_overrides(":" + ",".join(f"{k}={_text(v)}" for k, v in values.items() if v is not None))
    return {**typed, **{k: None for k, v in values.items() if v is None}}


def _text(value) -> str:
    # lm-eval has already turned "0.3" into 0.3 and "true" into True; go back to the string form
    # split_overrides converts (it rejects commas inside a value, which cannot occur here). Its
    # command line reads a negative integer ("window=-1") as a float (-1.0): written back as "-1.0"
    # an integer setting would fail to parse with a message naming a value the user never wrote,
    # where "-1" reaches the range check that says what is allowed.
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _device(device) -> str:
    """The device to load on: lm-eval's CLI passes ``cuda:0`` by default, even on a machine without CUDA."""
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("leankit: device %r asked for but CUDA is not available; using cpu", device)
        return "cpu"
    return device


@register_model("leankit")
class LeanKitLM(HFLM):
    """An lm-eval model whose log-likelihoods and generations read a compressing LeanCache.

    Args:
        pretrained: an embedded model name (``"smollm2-135m"``), a local checkpoint directory, or
            an already loaded model (then pass ``tokenizer=`` too).
        kv: KV config string (see :meth:`leankit.KVConfig.parse`) or a preset name from
            :mod:`leankit.presets` (``"neutral"``), optionally with ``:key=value`` overrides.
        kv_overrides: dict of KVConfig overrides, or a string ``"th=0.5,tl=0.01"``.
        chunk: largest number of continuation tokens fed per forward (compression runs between
            chunks).
        device: where to load a model given by name (default: CUDA if available, else CPU).
        dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` for a model given by name.
        **kwargs: each KVConfig override (``th``, ``tl``, ``group_size``, ``window``, ``rotate`` ...)
            as its own argument, winning over ``kv`` and ``kv_overrides``; and the HFLM arguments
            in ``HFLM_ARGS`` (``batch_size``, ``max_length`` ...). Anything else raises ``ValueError``.
    """

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's constructor from a ``--model_args`` string (:meth:`create_from_arg_obj`)."""
        from lm_eval import utils

        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """lm-eval's constructor from ``--model_args``: lm-eval also passes its own ``batch_size``,
        ``max_batch_size`` and ``device`` (its options' values, defaults included), and a setting
        the model arguments give too wins over those, with a warning where the two differ (HFLM
        raises a TypeError for a keyword given twice)."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        for k in sorted(set(arg_dict) & set(given)):
            if str(arg_dict[k]) != str(given[k]):
                log.warning("--model_args %s=%s overrides lm-eval's %s=%s", k, arg_dict[k], k, given[k])
        return cls(**{**given, **arg_dict})

    def __init__(self, pretrained="smollm2-135m", kv="K8V4", kv_overrides=None, chunk: int = 64, tokenizer=None,
                 device=None, dtype=None, **kwargs):
        unknown = sorted(set(kwargs) - set(KV_OVERRIDES) - set(HFLM_ARGS))
        if unknown:
            raise ValueError(
                f"unknown leankit model argument(s) {unknown}. Known: pretrained, kv, kv_overrides, chunk, tokenizer, "
                f"device, dtype; KV overrides {', '.join(KV_OVERRIDES)}; HFLM arguments {', '.join(HFLM_ARGS)}")
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in KV_OVERRIDES}
        self.kv = kv_config(kv, kv_overrides, **overrides)  # fails before the model is loaded
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"model argument chunk must be an integer >= 1, got {chunk!r}")
        self.chunk = chunk
        max_length = kwargs.get("max_length")
        # HFLM reads a falsy max_length as "not given" and falls back to the model's window, so 0 would
        # be ignored silently rather than refused
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                       or max_length < 1):
            raise ValueError(f"model argument max_length must be an integer >= 1 (tokens a request may "
                             f"read), got {max_length!r}")
        if isinstance(pretrained, str):
            if dtype is not None and str(dtype) not in DTYPES:
                raise ValueError(f"model argument dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
            model, tok = load_model(pretrained, dtype=DTYPES[str(dtype or "float32")], device=_device(device))
        else:
            if tokenizer is None:
                raise ValueError("a preloaded model needs tokenizer= as well")
            model, tok = pretrained, tokenizer
        enable(model)
        super().__init__(pretrained=model, tokenizer=tok, backend="causal", **kwargs)
        try:  # what only the model can check (a group size that must divide its head_dim ...): now,
            self._new_cache()  # not at the first request, after the tasks are built
        except ValueError as e:
            raise ValueError(f"model argument kv={self.kv.label()} does not fit {type(model).__name__}: {e}") from e

    def _new_cache(self) -> LeanCache:
        # rows as long as the longest sequence lm-eval passes (it truncates to max_length)
        return LeanCache(self.model, self.kv, max_seq_len=self.max_length + 1)

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """``(context, continuation)`` as scored: at most the last ``max_length + 1`` tokens, as
        HFLM keeps them (the last one is only ever a target), the continuation kept whole where it fits."""
        if not context:
            raise ValueError("lm-eval always passes at least one context token (the prefix token)")
        keep = self.max_length + 1
        if len(context) + len(continuation) > keep:
            full = (context + continuation)[-keep:]
            n_cont = min(len(continuation), keep - 1)
            context, continuation = full[: keep - n_cont], full[keep - n_cont:]
        return context, continuation

    @torch.no_grad()
    def _prefill(self, context: list[int]) -> LeanCache:
        """A fresh cache holding ``context[:-1]`` (step 1 of the module doc: prompt-phase compression)."""
        cache = self._new_cache()
        n = len(context) - 1
        if n > 0:
            ids = torch.tensor(context[:-1], device=self.model.device).view(1, -1)
            self.model(input_ids=ids, position_ids=torch.arange(n, device=ids.device)[None],
                       **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        return cache

    @torch.no_grad()
    def _score_on(self, cache: LeanCache, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Steps 2 and 3 of the module doc on ``cache``, which holds ``context[:-1]`` (and is consumed)."""
        ids = torch.tensor(context + continuation, device=self.model.device).view(1, -1)
        logprob, greedy = 0.0, True
        start = len(context) - 1
        end = ids.shape[1] - 1  # the last token is only ever a target
        while start < end:
            stop = min(start + self.chunk, end)
            out = self.model(input_ids=ids[:, start:stop], position_ids=torch.arange(start, stop, device=ids.device)[None],
                             **cache_kwargs(self.model, cache), use_cache=True)
            # in fp32 unless the softmax_dtype model argument asks otherwise (as HFLM reads it)
            logp = F.log_softmax(out.logits[0], dim=-1, dtype=self.softmax_dtype or torch.float32)
            target = ids[0, start + 1: stop + 1]
            logprob += float(logp.gather(-1, target[:, None]).sum())
            greedy = greedy and bool((logp.argmax(-1) == target).all())
            start = stop
        return logprob, greedy

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """``(sum log p(continuation | context), continuation is the greedy choice)`` through the cache."""
        context, continuation = self._window(context, continuation)
        return self._score_on(self._prefill(context), context, continuation)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """Scores of ``(key, context tokens, continuation tokens)`` requests, in their order.

        Requests with the same (windowed) context, such as the choices of a multiple-choice question,
        share its prefill: the context is prefilled once and each continuation scored on an
        independent copy of that cache (``copy.deepcopy``, which continues exactly as the original
        would; a copy costs a few milliseconds where a prefill of a few hundred tokens costs seconds on
        a CPU). The scores are those of :meth:`score` on each request, bit for bit."""
        windows = [self._window(list(context), list(continuation)) for _, context, continuation in requests]
        by_context: dict[tuple, list[int]] = {}
        for i, (context, _) in enumerate(windows):
            by_context.setdefault(tuple(context), []).append(i)
        results: list = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="leankit loglikelihood") as bar:
            for members in by_context.values():
                context = windows[members[0]][0]
                prefilled = self._prefill(context)
                for n, i in enumerate(members):
                    if n == len(members) - 1:
                        cache = prefilled
                    elif len(context) > 1:
                        cache = copy.deepcopy(prefilled)
                    else:  # nothing prefilled (rolling windows' one prefix token): a fresh cache
                        cache = self._new_cache()
                    results[i] = self._score_on(cache, context, windows[i][1])
                    bar.update(1)
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _detect_batch_size(self, requests=None, pos: int = 0) -> int:
        """``batch_size=auto``: the rows that fit the memory free on the model's device, from leankit's
        bytes, where HFLM probes.

        HFLM's probe runs five cacheless forwards of ``max_batch_size`` rows of ``max_length`` tokens and
        halves on out-of-memory. It never builds a cache, so it cannot see the rows a compressing cache
        frees, and on a CPU its first forwards alone (64 rows of the model's whole window, with their
        logits) take many minutes or exhaust memory. Here the batch is ``AUTO_BATCH_SHARE`` (0.6) of the
        memory available over ``row`` (at most ``max_batch_size``, at least 1), ``row`` a ``generate``
        row of ``max_length`` tokens priced by :func:`generate_row_bytes`: this config's cache bytes
        plus the prompt's working memory. The batch serves ``generate_until``; log-likelihoods are
        scored one request at a time (module doc). On a device whose free memory torch cannot tell,
        HFLM's probe runs as before."""
        available = available_memory_bytes(self.device)
        if available is None:
            return super()._detect_batch_size(requests, pos)
        row = generate_row_bytes(self._new_cache(), self.model, self.max_length)
        rows = max(1, min(int(self.max_batch_size or 1 << 30), int(AUTO_BATCH_SHARE * available) // row["total"]))
        log.info("leankit: batch_size=auto gives %d rows: %s available on %s, a row of %d tokens %s (cache %s, "
                 "prompt working memory %s)", rows, format_bytes(available), self.device, self.max_length,
                 format_bytes(row["total"]), format_bytes(row["cache"]), format_bytes(row["work"]))
        return rows

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs.update(cache_kwargs(self.model, self._new_cache()))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


# Share of the memory available that batch_size=auto fills with generate_row_bytes rows. The rest is
# for what the row model leaves out: freed blocks the allocator keeps, generate's own buffers. Measured
# on a CPU (SmolLM2-135M fp32, generate of 2-8 rows of 1,024 + 16 tokens, K8V4 and the neutral
# config and DynamicCache priced as FP16): the process's peak resident memory grew by 1.29-1.48x the
# rows' modelled bytes, so 0.6 keeps the batch within about 0.9 of what is available.
AUTO_BATCH_SHARE = 0.6


def generate_row_bytes(cache: LeanCache, model, tokens: int) -> dict:
    """Bytes one ``generate`` row of ``tokens`` tokens needs with ``cache``'s config:
    ``{"cache", "work", "total"}``.

    ``cache``: the page bytes of ``tokens`` tokens in every compressed layer, each token priced at the
    config's high tier, or as an ACT token where that costs more and the config has ACT blocks (an
    upper bound: a two-tier config moves tokens to its smaller low tier as it goes), plus one partly
    filled page per layer and KV head, plus the model's own cache of its sliding-window layers (at
    most the window each, in the model's dtype). ``work``: the largest working set of one decoder
    layer over the prompt, which ``generate`` prefills in one forward: the residual stream and its
    norm (``2 hidden``), the layer's output and its residual sum (``2 hidden``), the query and the
    attention output (``2 q_dim``), the new keys and values (``2 kv_dim``) and the gated MLP's three
    ``intermediate`` tensors (gate, up, their product), per token in the model's dtype; or the
    prompt's logits where they are larger (a model that cannot keep the last position's alone,
    ``logits_to_keep``, computes them for every prompt token, after its layers have freed theirs).
    """
    from ..planner.model_spec import from_hf_config

    spec = from_hf_config(model.config)
    itemsize = torch.empty((), dtype=cache.dtype).element_size()
    per_token = cache.token_bytes()
    token = max(per_token["kv"], per_token["act"]) if cache.cfg.act else per_token["kv"]
    pages = cache.num_layers * cache.num_kv_heads * cache.cfg.page_size  # one partly filled page each
    sliding = len(spec.sliding_layers) * spec.sliding_tokens([tokens]) * 2 * spec.kv_dim * itemsize
    cache_bytes = int(tokens * cache.num_layers * token + sliding) + pages
    work = tokens * (4 * spec.hidden + 2 * spec.q_dim + 2 * spec.kv_dim + 3 * spec.intermediate) * itemsize
    kept = 1 if model._supports_logits_to_keep() else tokens
    work = max(work, kept * (spec.hidden + spec.vocab) * itemsize)
    return {"cache": cache_bytes, "work": work, "total": cache_bytes + work}
