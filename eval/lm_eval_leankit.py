"""lm-evaluation-harness integration: every scored token goes through a compressing LeanCache.

lm-eval's stock ``HFLM`` scores a request with one forward over context + continuation, which
never reads a KV cache, so it cannot tell a compressed cache from an exact one. ``LeanKitLM``
scores each request the way a server would see it:

1. prefill ``context[:-1]`` into a fresh :class:`~leankit.cache.LeanCache` (prompt-phase
   compression happens here);
2. feed ``[context[-1]] + continuation[:-1]`` with explicit ``position_ids``, in chunks of at most
   ``chunk`` tokens, so the cache compresses between chunks (rolling perplexity windows, whose
   context is one token, are scored exactly this way);
3. sum the log-probabilities of the continuation tokens.

``generate_until`` passes a fresh LeanCache to ``model.generate`` for every batch.

Use it from Python::

    import lm_eval
    from eval.lm_eval_leankit import LeanKitLM
    lm = LeanKitLM(pretrained="smollm2-135m", kv="K8V4-K4V2", kv_overrides={"th": 0.5})
    lm_eval.simple_evaluate(model=lm, tasks=[...])

or on the command line (the module registers the model name ``leankit``)::

    python -m eval.lm_eval_leankit --tasks hellaswag --kv K8V4 --include-path my_tasks/
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tqdm import tqdm  # noqa: E402

import leankit  # noqa: E402
from leankit.cache import LeanCache  # noqa: E402
from leankit.config import KVConfig  # noqa: E402


@register_model("leankit")
class LeanKitLM(HFLM):
    """An lm-eval model whose log-likelihoods and generations read a compressing LeanCache.

    Args:
        pretrained: an embedded model name (``"smollm2-135m"``), a local checkpoint directory, or
            an already loaded model (then pass ``tokenizer=`` too).
        kv: KV config string (see :meth:`leankit.KVConfig.parse`).
        kv_overrides: dict of KVConfig overrides (``th``, ``tl``, ``window`` ...), or a string
            ``"th=0.5,tl=0.01"`` as given on lm-eval's command line.
        chunk: largest number of continuation tokens fed per forward (compression runs between
            chunks).
        **kwargs: passed to ``HFLM`` (``batch_size``, ``max_length`` ...).
    """

    def __init__(self, pretrained="smollm2-135m", kv: str = "K8V4", kv_overrides=None, chunk: int = 64,
                 tokenizer=None, **kwargs):
        if isinstance(pretrained, str):
            model, tok = leankit.load_model(pretrained)
        else:
            model, tok = pretrained, tokenizer
        if isinstance(kv_overrides, str):
            kv_overrides = _parse_overrides(kv_overrides)
        self.kv = KVConfig.parse(kv, **(kv_overrides or {}))
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = int(chunk)
        leankit.enable(model)
        super().__init__(pretrained=model, tokenizer=tok, backend="causal", **kwargs)

    def _new_cache(self) -> LeanCache:
        return LeanCache(self.model, self.kv)

    @torch.no_grad()
    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """``(sum log p(continuation | context), continuation is the greedy choice)`` through the cache."""
        if not context:
            raise ValueError("lm-eval always passes at least one context token (the prefix token)")
        ids = torch.tensor(context + continuation, device=self.model.device).view(1, -1)
        n_ctx = len(context)
        cache = self._new_cache()
        if n_ctx > 1:
            self.model(input_ids=ids[:, : n_ctx - 1], position_ids=torch.arange(n_ctx - 1, device=ids.device)[None],
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
        logprob, greedy = 0.0, True
        start = n_ctx - 1
        end = ids.shape[1] - 1  # the last token is only ever a target
        while start < end:
            stop = min(start + self.chunk, end)
            out = self.model(input_ids=ids[:, start:stop], position_ids=torch.arange(start, stop, device=ids.device)[None],
                             past_key_values=cache, use_cache=True)
            logp = F.log_softmax(out.logits[0].float(), dim=-1)
            target = ids[0, start + 1: stop + 1]
            logprob += float(logp.gather(-1, target[:, None]).sum())
            greedy = greedy and bool((logp.argmax(-1) == target).all())
            start = stop
        return logprob, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        results = []
        for (key, context_enc, continuation_enc) in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                                                         desc="leankit loglikelihood"):
            answer = self.score(list(context_enc), list(continuation_enc))
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs["past_key_values"] = self._new_cache()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def _parse_overrides(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ValueError(f"override {part!r} is not key=value")
        k, v = part.split("=", 1)
        try:
            out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else float(v)
        except ValueError:
            out[k.strip()] = v.strip()
    return out


def main(argv=None) -> dict:
    """Run lm-eval tasks with a LeanCache-backed model and print the results table."""
    import argparse

    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    ap = argparse.ArgumentParser(description="lm-eval through a compressing LeanCache")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv", default="K8V4")
    ap.add_argument("--kv-overrides", default="", help='e.g. "th=0.5,tl=0.01"')
    ap.add_argument("--tasks", required=True, help="comma-separated task names")
    ap.add_argument("--include-path", default=None, help="folder with local task YAMLs")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--num-fewshot", type=int, default=None)
    a = ap.parse_args(argv)
    lm = LeanKitLM(pretrained=a.model, kv=a.kv, kv_overrides=a.kv_overrides)
    tm = TaskManager(include_path=a.include_path, include_defaults=a.include_path is None)
    res = lm_eval.simple_evaluate(model=lm, tasks=a.tasks.split(","), task_manager=tm, limit=a.limit,
                                  num_fewshot=a.num_fewshot)
    print(make_table(res))
    return res


if __name__ == "__main__":
    main()
