"""Named KV configs with their measured memory and quality cost.

Each preset names a config string that :meth:`leankit.KVConfig.parse` accepts, plus the numbers
measured for it on SmolLM2-135M (perplexity on held-out Wikipedia articles, 2048-token prefill
then 4 x 64 scored tokens; ``kv / fp16`` counts every page byte in use against an fp16
``DynamicCache`` of the same tokens) and the command that measured them. See
``docs/measurements.md`` for the full tables.

``resolve("neutral:th=0.3")`` turns a preset name (with optional overrides, which win) into a
config string; any other string passes through unchanged. :meth:`leankit.KVConfig.parse`
resolves preset names itself, so ``LeanCache(model, "neutral")`` and ``--kv neutral`` work.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import split_overrides


@dataclass(frozen=True)
class Preset:
    """A named config and what it was measured to cost."""

    name: str
    spec: str
    kv_over_fp16: float  # page bytes in use / an fp16 DynamicCache of the same tokens
    ppl_change: str  # perplexity against FP16 on the same tokens
    measured_on: str
    command: str
    use: str


_PPL = "python -m eval.perplexity --skip {skip} --docs {docs} --context 2048 --chunks 4"

PRESETS = {p.name: p for p in (
    Preset("lossless", "FP16", 2.139, "0 (token-identical greedy outputs)", "SmolLM2-135M (fp32), articles 3-10",
           _PPL.format(skip=3, docs=8) + " --config FP16",
           "exact reference; keeps the model's own dtype, so an fp32 model stores fp32 K/V"),
    Preset("k8v4", "K8V4", 0.444, "+0.49%", "SmolLM2-135M, articles 3-10",
           _PPL.format(skip=3, docs=8) + " --config FP16 --config K8V4",
           "short contexts and chats; the safe default"),
    Preset("neutral", "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1", 0.324,
           "+0.48% [+0.30%, +0.65%] (64-token chunks; -0.05% [-0.92%, +0.83%] token by token, articles 11-22)",
           "SmolLM2-135M, articles 11-54",
           _PPL.format(skip=11, docs=44) + ' --config FP16 --config "K8V4-K4V2:th=0.25,tl=0,group_size=32,rotate=1"',
           "long contexts (hundreds of tokens and more); keeps every token, so retrieval survives"),
    Preset("compact", "K8V4-K4V2:th=0.3,tl=0.05", 0.187, "+2.17%", "SmolLM2-135M, articles 3-10",
           _PPL.format(skip=3, docs=8) + ' --config FP16 --config "K8V4-K4V2:th=0.3,tl=0.05"',
           "long contexts where memory matters most; prunes tokens, so needle retrieval fails (0/5)"),
)}


def resolve(text: str) -> str:
    """Config string for ``text``: a preset name (``"neutral"``, ``"neutral:th=0.3"``) or any config string.

    Overrides after the preset name replace the preset's own. Anything that is not a preset
    name is returned unchanged for :meth:`leankit.KVConfig.parse` to check.
    """
    if not isinstance(text, str):
        return text
    name = text.partition(":")[0]
    preset = PRESETS.get(name.strip().lower())
    if preset is None:
        return text
    spec, kw = split_overrides(preset.spec)
    _, extra = split_overrides(text)
    kw.update(extra)
    return spec + (":" + ",".join(f"{k}={v}" for k, v in kw.items()) if kw else "")


__all__ = ["PRESETS", "Preset", "resolve"]
