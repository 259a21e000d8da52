"""Perplexity through a compressing LeanCache on real English Wikipedia text (or ``--text FILE``).

Protocol (per document and config, fresh cache each time):

1. prefill the first ``--context`` tokens (BOS + article text) with explicit positions; the
   prompt-phase compression runs right after each layer's attention;
2. score the continuation in chunks of ``--chunk`` tokens (at most 64), each fed with explicit
   ``position_ids``; before each chunk the cache compresses (LeanKV's generation phase places
   the tokens that leave the recent window; H2O/StreamingLLM evict after each step);
3. perplexity = exp(mean NLL) over all scored tokens of all documents. The memory numbers come
   from ``LeanCache.memory_report()`` after the last chunk: ``ratio = kv_bytes / fp16_bytes`` where
   ``fp16_bytes`` is what an fp16 ``DynamicCache`` holds for the same tokens.

With ``--text FILE`` (a UTF-8 plain-text file) the documents are the file's own tokens instead,
cut in order into consecutive, non-overlapping windows: each document is BOS followed by
``context + chunks * chunk - 1`` tokens of the file, exactly the ``context + chunks * chunk`` tokens
a run feeds the model. ``--skip``/``--docs`` count those windows; the tail shorter than a window
is left out.

Every config scores the same tokens, so its gap to FP16 is a *paired* difference: the script keeps
each token's NLL and reports ``ppl / ppl_FP16 - 1`` with a 95% interval from the standard error of
the per-token NLL differences (``exp(mean(d) +- 1.96 sd(d) / sqrt(n)) - 1``). A gap of a few tenths
of a percent is inside that interval on a few thousand tokens.

Example::

    python -m eval.perplexity --docs 4 --context 2048 --chunks 4 \\
        --config FP16 --config "K8V4-K4V2:th=0.5,tl=0" --out out/ppl.json
    python -m eval.perplexity --text essays.txt --docs 8 --context 2048 --chunks 4 \\
        --config FP16 --config K8V4                   # the user's own text
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from tqdm.auto import tqdm

from leankit.bench.text import corpus_ids, read_text, text_source
from leankit.cache import LeanCache
from leankit.config import KVConfig
from leankit.data import wiki_articles
from leankit.hf import cache_kwargs

from .common import (
    Timer,
    add_run_options,
    check_configs_fit,
    check_run_options,
    label,
    parse_config,
    start_run,
    write_json,
)


class TooFewArticles(ValueError):
    """Fewer Wikipedia articles than ``--docs`` (after ``--skip``) are long enough for the run."""


def documents(tok, n_docs: int, need: int, skip: int = 0) -> list[torch.Tensor]:
    """Token ids (BOS first) of ``n_docs`` Wikipedia articles with at least ``need`` tokens.

    The first ``skip`` articles that are long enough are passed over, so ``--skip`` splits the
    corpus into disjoint sets (for example, tune thresholds on ``--docs 3`` and confirm them on
    ``--skip 3 --docs 8``).
    """
    out, seen, longest = [], 0, 0
    for _, text in wiki_articles():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        longest = max(longest, len(ids) + 1)
        if len(ids) + 1 < need:
            continue
        seen += 1
        if seen > skip:
            out.append(torch.tensor([tok.bos_token_id] + ids[: need - 1]))
        if len(out) == n_docs:
            break
    if len(out) < n_docs:
        raise TooFewArticles(f"only {seen} of the {len(wiki_articles())} Wikipedia articles have {need} tokens "
                             f"(the longest has {longest}); {skip} skipped + {n_docs} scored are needed")
    return out


class TooShortText(ValueError):
    """The ``--text`` file holds fewer windows than ``--skip`` + ``--docs`` (or not even one)."""


def text_documents(tok, path, n_docs: int, length: int, skip: int = 0) -> tuple[list[torch.Tensor], int]:
    """``(documents, n_tokens)``: ``n_docs`` documents of exactly ``length`` tokens cut from the
    UTF-8 text file ``path``, and how many tokens the whole file holds.

    The file's tokens (:func:`leankit.bench.text.corpus_ids`) are cut in order into consecutive,
    non-overlapping windows of ``length - 1`` tokens, each scored after a BOS as the Wikipedia
    articles are; the first ``skip`` windows are passed over. The tail shorter than a window is
    left out. Raises :class:`TooShortText` when the file holds too few windows.
    """
    ids = corpus_ids(tok, path)
    per = length - 1
    windows = len(ids) // per
    if windows == 0:
        raise TooShortText(f"--text {path} has {len(ids)} tokens, too few for one window: a window needs "
                           f"{per} tokens of text (+ BOS = {length} = --context + --chunks x --chunk)")
    if skip + n_docs > windows:
        raise TooShortText(f"--text {path} has {len(ids)} tokens, {windows} window(s) of {per} (+ BOS = {length} "
                           f"= --context + --chunks x --chunk); {skip} skipped + {n_docs} scored are needed")
    bos = torch.tensor([tok.bos_token_id], dtype=ids.dtype)
    return [torch.cat([bos, ids[w * per: (w + 1) * per]]) for w in range(skip, skip + n_docs)], len(ids)


@torch.no_grad()
def score_document(model, ids: torch.Tensor, spec: str, kw: dict, context: int, chunk: int, chunks: int):
    """``(token_nll, memory_report, logprobs)`` of one document under one KV config.

    ``token_nll``: fp64 ``[n]``; ``logprobs``: fp32 ``[n, vocab]`` next-token log-probabilities at
    every scored position (for the KL divergence to the FP16 cache).
    """
    cache = LeanCache(model, spec, max_seq_len=context + chunk * chunks + 8, **kw)
    x = ids.view(1, -1)
    pos = torch.arange(x.shape[1]).view(1, -1)
    out = model(input_ids=x[:, :context], position_ids=pos[:, :context], **cache_kwargs(model, cache),
                logits_to_keep=1)
    logits = [out.logits[:, -1:]]
    for i in range(chunks):
        a, b = context + i * chunk, context + (i + 1) * chunk
        out = model(input_ids=x[:, a:b], position_ids=pos[:, a:b], **cache_kwargs(model, cache))
        logits.append(out.logits if i < chunks - 1 else out.logits[:, :-1])
    logits = torch.cat(logits, 1)[0].float()
    target = x[0, context: context + chunk * chunks]
    logprobs = torch.log_softmax(logits, dim=-1)
    nll = -logprobs.gather(1, target.view(-1, 1)).squeeze(1)
    return nll.double(), cache.memory_report(), logprobs


def token_kl(base_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(P_base || P)`` in nats, fp64 ``[n]``, from log-probabilities ``[n, vocab]``.

    Unlike the NLL of the one observed token, the KL compares the whole next-token distribution
    with the FP16 cache's, so its per-token spread is far smaller: it ranks configs whose
    perplexity gaps lie inside each other's intervals.
    """
    b = base_logprobs.double()
    return (b.exp() * (b - logprobs.double())).sum(-1)


def mean_ci(x: torch.Tensor) -> dict:
    """Mean of ``x`` and its 95% normal interval (``mean +- 1.96 sd / sqrt(n)``)."""
    m = float(x.mean())
    se = float(x.std()) / math.sqrt(x.numel()) if x.numel() > 1 else float("nan")
    return {"mean": m, "lo": m - 1.96 * se, "hi": m + 1.96 * se}


def paired_gap(token_nll: torch.Tensor, base_nll: torch.Tensor) -> dict:
    """``ppl / ppl_base - 1`` and its 95% interval from the paired per-token NLL differences."""
    d = mean_ci(token_nll.double() - base_nll.double())
    return {"gap": math.expm1(d["mean"]), "gap_lo": math.expm1(d["lo"]), "gap_hi": math.expm1(d["hi"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True,
                    help='KV config with overrides, e.g. "K8V4-K4V2:th=0.5,tl=0" (repeatable)')
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--skip", type=int, default=0,
                    help="skip this many long-enough articles (or --text windows) first (held-out splits)")
    ap.add_argument("--text", metavar="FILE", default=None,
                    help="score a UTF-8 text file of your own instead of the Wikipedia articles, cut into "
                         "consecutive windows of --context + --chunks x --chunk tokens (BOS first)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=4)
    add_run_options(ap)
    args = ap.parse_args(argv)
    if not 1 <= args.chunk <= 64:
        ap.error(f"--chunk must be between 1 and 64, got {args.chunk}")
    for name in ("docs", "context", "chunks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.skip < 0:
        ap.error(f"--skip must be at least 0, got {args.skip}")
    check_run_options(ap, args)
    try:
        configs = [parse_config(c) for c in args.config]
    except ValueError as err:
        ap.error(str(err))
    if args.text is not None:
        try:
            read_text(args.text)  # a missing, empty or non-UTF-8 file fails before the model loads
        except ValueError as err:
            ap.error(str(err))
    elif args.skip + args.docs > len(wiki_articles()):  # the token counts need the tokenizer; this does not
        ap.error(f"--skip {args.skip} + --docs {args.docs} asks for more than the {len(wiki_articles())} "
                 "Wikipedia articles there are")
    # The baseline is the first lossless config however it is written ("FP16", "fp16", "K16V16",
    # the "lossless" preset), one without ACT blocks if there is one; it runs first, so every other
    # config's KL to it is computed as it goes.
    parsed = [(c, KVConfig.parse(c[0], **c[1])) for c in configs]
    exact = [(cfg.act != 0, i, c) for i, (c, cfg) in enumerate(parsed) if cfg.lossless]
    base = min(exact)[2] if exact else None
    if base is not None:
        configs.remove(base)
        configs.insert(0, base)
    model, tok = start_run(args)
    source = text_source(args.text)
    fed = args.context + args.chunk * args.chunks  # the tokens a run feeds the model per document
    try:
        if args.text is None:
            docs = documents(tok, args.docs, fed + 1, args.skip)
        else:
            docs, n_tokens = text_documents(tok, args.text, args.docs, fed, args.skip)
    except (TooFewArticles, TooShortText) as err:
        ap.error(f"{err}: lower --context, --chunk or --chunks, or --docs or --skip")
    except ValueError as err:  # a text the tokenizer turns into no token at all
        ap.error(str(err))
    if args.text is not None:
        print(f"text: {source} ({n_tokens} tokens; windows {args.skip} to {args.skip + args.docs - 1} of "
              f"{fed} tokens, BOS first)", flush=True)
    check_configs_fit(ap, model, configs)
    results = []
    token_nll = {}
    base_logprobs = None  # the baseline's next-token log-probabilities per document
    for i, (spec, kw) in enumerate(configs):
        nlls, reports, kls = [], [], []
        is_base = i == 0 and base is not None
        if is_base:
            base_logprobs = []
        with Timer() as t:
            for d, ids in enumerate(tqdm(docs, desc=label(spec, kw), leave=False)):
                a, rep, logprobs = score_document(model, ids, spec, kw, args.context, args.chunk, args.chunks)
                nlls.append(a)
                reports.append(rep)
                if is_base:
                    base_logprobs.append(logprobs)
                elif base_logprobs is not None:
                    kls.append(token_kl(base_logprobs[d], logprobs))
        all_nll = torch.cat(nlls)
        nll, n = float(all_nll.sum()), all_nll.numel()
        # every page in use, ACT blocks included (kv_bytes counts the KV pages alone under act=)
        ratio = sum(r["pages_used"] * r["page_size"] for r in reports) / sum(r["fp16_bytes"] for r in reports)
        tiers = {k: sum(r["tokens_per_tier"][k] for r in reports) for k in ("high", "low", "pruned")}
        tot = sum(tiers.values()) or 1  # act=1 stores no KV token: every share is 0
        row = {"config": label(spec, kw), "ppl": math.exp(nll / n), "nll": nll / n, "tokens": n,
               "kv_ratio": ratio, "pages_used": [r["pages_used"] for r in reports],
               "kv_bytes": [r["kv_bytes"] for r in reports],
               "tier_fraction": {k: v / tot for k, v in tiers.items()}, "seconds": t.seconds,
               "doc_nll": [float(x.mean()) for x in nlls]}
        if kls:
            kl = mean_ci(torch.cat(kls))
            row["kl_vs_fp16"], row["kl_vs_fp16_ci95"] = kl["mean"], [kl["lo"], kl["hi"]]
        token_nll[row["config"]] = all_nll
        results.append(row)
        write_json(args.out, {"args": vars(args), "text_source": source, "results": results, "partial": True})
        print(f"{row['config']:<44} ppl {row['ppl']:8.4f}  kv/fp16 {ratio:6.3f}  "
              f"high/low/pruned {tiers['high'] / tot:.2f}/{tiers['low'] / tot:.2f}/{tiers['pruned'] / tot:.2f}  "
              f"pages {sum(row['pages_used'])}"
              + (f"  KL {row['kl_vs_fp16']:.5f}" if kls else "") + f"  ({t.seconds:.0f}s)", flush=True)
    if base is not None:
        base_nll = token_nll[results[0]["config"]]
        print(f"relative to {results[0]['config']} (95% interval from paired per-token differences):")
        for r in results:
            g = paired_gap(token_nll[r["config"]], base_nll)
            r["ppl_vs_fp16"], r["ppl_vs_fp16_ci95"] = g["gap"], [g["gap_lo"], g["gap_hi"]]
            print(f"  {r['config']:<44} {100 * g['gap']:+.2f}%  [{100 * g['gap_lo']:+.2f}%, {100 * g['gap_hi']:+.2f}%]")
    payload = {"args": vars(args), "text_source": source, "torch_threads": torch.get_num_threads(), "results": results,
               "baseline": None if base is None else results[0]["config"],
               "cmd": "python -m eval.perplexity " + " ".join(os.sys.argv[1:] if argv is None else argv)}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
