"""The prompt step: the model's own SDPA, and prompt significance from the softmax it already ran.

A prompt (a step with nothing stored before it) is attended by transformers' own
``sdpa_attention_forward`` with the model's mask, so its output is exactly what an uncompressed
cache computes. LeanKV's prompt-phase significance (§4) needs each new token's attention
probability summed over the prompt's queries, ``sum_i p_ij`` with ``p_ij = exp(s_ij - lse_i)``.
The softmax statistics ``lse_i`` are the expensive half of that (a max pass, a subtraction and a
sum over every score); SDPA computes them anyway. On a CPU, SDPA runs PyTorch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``), which returns its log-sum-exp next to the
output. :func:`prompt_attention` calls that kernel with exactly the arguments
``scaled_dot_product_attention`` would give it (the bool mask as the additive ``0 / -inf`` mask,
GQA heads repeated), so the output is bitwise the same (a test checks it), and keeps the lse.

With the lse in hand, :func:`received_from_lse` needs one augmented matmul and one ``exp`` per
score: the row term ``-lse_i`` and the padding term ``-BIG`` ride in two extra columns of the
matmul (``[q*scale, -lse_i, 1] . [k, 1, -BIG*pad_j]``), only the diagonal block of each query
chunk needs the causal mask (its upper triangle is zeroed after the ``exp``), and the sum over
queries is one matrix-vector product. Scores are floored at
:data:`leankit.attention.EXP_FLOOR` before the ``exp`` (see there why). The pass runs per
(sequence, KV head) in query chunks of 1-4 MB of scores (:func:`_chunk_elems`), which the ``exp`` and the sum reread
from the core's caches (short prompts put several pairs in one chunk).

**Padded batches.** Given a mask, SDPA's CPU flash kernel computes every (query, key) block and
adds the mask to it: a left-padded batch of prompts pays for the full square of every row, the
blocks above the diagonal and the padding included, where ``is_causal`` would skip them. A
compressed (lossy) cache has no need to reproduce that computation bit for bit, so when the mask
is exactly causal attention within each row's one contiguous span of real tokens (checked once per
step, :func:`causal_spans`), each row's span is attended on its own, causally, with no block
above the diagonal and no padding computed (:func:`span_attention`): the same softmax over the
same keys, summed in other blocks, so it agrees with the masked call to fp32 rounding.
Padding positions get a zero output: nothing reads it, as no real query attends to a padding key.
The lossless ``FP16`` config keeps transformers' masked call, so its tokens stay identical to
``DynamicCache``'s. A lossy config's batch with no padding (transformers passes no mask; SDPA would
run ``is_causal``) runs the same span path, each row one span: SDPA has nothing to skip there, but
its significance would cost the flash kernel plus :func:`received_from_lse` (a second score matmul
and ``exp``), 1.7x the one pass at 1k-2k tokens, which put a batch-1 LeanKV prefill at 1.45-1.7x
``DynamicCache``'s at 2k-4k tokens.

**One pass over the scores.** The span path runs :func:`causal_received`, which computes each
span's attention, and its significance where the policy needs it, from one score matmul and one
``exp`` per score, instead of the flash kernel followed by :func:`received_from_lse` (two of
each): about 0.5x their time at 150-1k tokens and 0.6x at 1k-2k on one thread
(``bench/prompt_pass.py``), agreeing with the flash kernel's output to fp32 rounding. A cache
without significance runs the same function (0.7-0.95x the flash kernel's own time at 150-1k
tokens, about 1.0x beyond, 1.1-1.3x below 100 tokens, where fixed op costs dominate), so its output
is bitwise what a policy with significance computes.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from .attention import EXP_FLOOR, Workspace, step_received
from .backend import use_triton

# Added to a score that must not count (a padding key, a query that is not live): whatever q.k is,
# the sum lands below EXP_FLOOR, so the term is floored like every masked score (padding keys are
# then zeroed outright), and 2 * BIG still fits in fp32.
_BIG = 1e30
# Ceiling of an exponent before exp_: only a causally masked score (a key after its query) can
# exceed 0 by much, and its exp is zeroed afterwards; the ceiling keeps exp off its overflow path.
_EXP_CEIL = 80.0


def _l2_bytes(base: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The first CPU's level-2 cache in bytes, from Linux's sysfs (``base``); ``None`` where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        entries = sorted(e for e in os.listdir(base) if e.startswith("index"))  # beside them: power/, uevent
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "level")) as fh:
                if fh.read().strip() != "2":
                    continue
            with open(os.path.join(base, entry, "size")) as fh:
                size = fh.read().strip()
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError, IndexError):
            return None
    return None


def _chunk_elems(l2: int | None) -> int:
    """Scores per chunk of the prompt passes (:func:`_query_chunks`) for a core with ``l2`` bytes of L2.

    Each chunk runs a handful of ops (score matmul, causal fill, softmax, value matmul, the
    significance sum), so smaller chunks pay those ops' fixed cost more often and hand the
    matmuls fewer rows; larger ones reread the scores from further out than L2. Measured on one
    thread: on an AMD EPYC 1 MB of fp32 scores (8 MB chunks over the whole batch took about 25%
    longer at 4k tokens); on an Intel Xeon with 2 MB of L2 per core, 4 MB took a batch-1 4k
    prefill of SmolLM2 from 1.21x to 1.14x of ``DynamicCache``'s time with ``K8V4`` and from 1.25x to
    1.11x with the neutral LeanKV config (``docs/measurements.md``). So: twice the L2 where it
    is at least 2 MB (at most 4 MB, the largest measured), 1 MB otherwise (or where it cannot be read).
    """
    if l2 is not None and l2 >= 2 << 20:
        return min(2 * l2, 4 << 20) // 4
    return 1 << 18


# Scores per (sequence, KV head) chunk of the prompt passes (:func:`_chunk_elems`), and a floor on
# the chunk's rows for the matmul's efficiency.
_CHUNK_ELEMS = _chunk_elems(_l2_bytes())
_MIN_ROWS = 16
# At most 1/_SPLIT of the prompt's query rows per chunk (but at least _SPLIT_FLOOR): a chunk computes
# its whole diagonal block, upper triangle included, so one chunk over a short prompt computes
# twice the causal scores. Eighths cut that waste to about 1/16 (0.74x the one-chunk time at 300
# tokens, 0.83x at 600, on one thread, ``bench/prompt_pass.py``); below 64 rows the ops' fixed
# cost outweighs the saved scores.
_SPLIT, _SPLIT_FLOOR = 8, 64
# Entries kept per step in the mask memo: per mask, its additive form (:func:`_additive_mask`) and
# its row spans (:func:`causal_spans`); models whose sliding-window and full layers alternate pass
# two masks.
_MASK_MEMO_ENTRIES = 4


def _mask_version(mask: torch.Tensor) -> int | None:
    """``mask``'s version counter, or None for a tensor made under ``torch.inference_mode``, which
    has none: such a mask is matched by identity alone, as the memo lives for one forward step and
    transformers does not write into a step's mask while its layers run."""
    return None if mask.is_inference() else mask._version


def _memo_get(memo: dict | None, mask: torch.Tensor, kind):
    """The memo's entry ``kind`` of ``mask``: only for the same tensor object, unmodified since."""
    hit = memo.get((id(mask), kind)) if memo is not None else None
    if hit is not None and hit[0] is mask and hit[1] == _mask_version(mask):
        return hit[2]
    return None


def _memo_put(memo: dict | None, mask: torch.Tensor, kind, value):
    """Keep ``value`` as the memo's entry ``kind`` of ``mask`` (the oldest entry makes room); returns it."""
    if memo is not None:
        if len(memo) >= _MASK_MEMO_ENTRIES:
            memo.pop(next(iter(memo)))
        memo[(id(mask), kind)] = (mask, _mask_version(mask), value)
    return value


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype, memo: dict | None) -> torch.Tensor:
    """``mask`` (bool, True = attend) as the additive ``0 / -inf`` mask SDPA builds from it.

    ``memo``: conversions kept for one forward step. Every layer of a forward receives the same
    mask tensor, and at 8 x 4096 tokens its fp32 form is 512 MB, rebuilt per layer otherwise
    (about 0.3 s a layer on one core). An entry matches only the same tensor object, unmodified
    since (its version counter), converted to the same dtype.
    """
    hit = _memo_get(memo, mask, dtype)
    if hit is not None:
        return hit
    return _memo_put(memo, mask, dtype,
                     torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")))


def causal_spans(mask: torch.Tensor | None, k_real: torch.Tensor, memo: dict | None = None) -> list | None:
    """Each row's real tokens as one span ``(start, end)``, if ``mask`` is exactly causal attention
    within those spans; else ``None``.

    ``mask``: transformers' bool mask ``[B or 1, 1, Q, Q]`` of a prompt (True = attend), or an
    additive float mask of the same shape whose entries are 0 (attend) or at most the dtype's lowest
    finite value (``-inf``, or the ``finfo.min`` transformers' eager masks use: hidden, since its
    softmax weight is exactly 0); any other value (a soft bias) answers ``None``. ``k_real``:
    bool ``[B, Q]``, the real (non-padding) tokens. The answer is a list of ``B`` spans when every
    row's real tokens are contiguous (left or right padding, or none) and every real query ``i`` of
    row ``b`` may attend exactly the keys ``start_b <= j <= i``: then the row's attention is
    ``is_causal`` attention over its span alone. Padding queries' rows are not looked at (their
    output is not used). A sliding-window mask narrower than the prompt, or any other pattern,
    answers ``None``. ``memo``: the step's mask memo (see :func:`_additive_mask`); the check reads
    the mask once per step.
    """
    if mask is None or not (mask.dtype == torch.bool or mask.is_floating_point()) or mask.dim() != 4 \
            or mask.shape[1] != 1:
        return None
    b, q = k_real.shape
    if tuple(mask.shape) not in ((b, 1, q, q), (1, 1, q, q)):
        return None
    hit = _memo_get(memo, mask, "spans")
    if hit is not None:
        return hit or None
    real = k_real.to(device="cpu", dtype=torch.bool)
    counts = real.sum(1).tolist()
    starts = real.to(torch.uint8).argmax(1).tolist()  # first real token (0 for a row with none)
    cols = torch.arange(q, device=mask.device)
    spans = []
    for row in range(b):
        s, e = starts[row], starts[row] + counts[row]
        if e > s:  # a row with real tokens: contiguous, and each query i sees exactly keys s..i
            want = (cols >= s) & (cols <= torch.arange(s, e, device=mask.device).view(-1, 1))  # [n, Q]
            given = mask[row if mask.shape[0] > 1 else 0, 0, s:e]
            if given.is_floating_point():  # additive: 0 attends, the lowest values hide
                seen = given == 0
                if not bool((seen | (given <= torch.finfo(given.dtype).min)).all()):
                    return _memo_put(memo, mask, "spans", []) or None
                given = seen
            if not bool(real[row, s:e].all()) or not torch.equal(given, want):
                return _memo_put(memo, mask, "spans", []) or None
        spans.append((s, e))
    return _memo_put(memo, mask, "spans", spans)


def _cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
               scale: float | None, attn_mask: torch.Tensor | None = None):
    """PyTorch's CPU flash kernel, ``(out, lse)``: the kernel SDPA dispatches to, called directly to keep
    its log-sum-exp. It takes as many KV heads as query heads, so GQA heads are repeated first, as
    SDPA does before calling it."""
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                      attn_mask=attn_mask, scale=scale)


def _query_chunks(nq: int, g: int, pairs: int):
    """The query chunks of a causal pass over ``nq`` tokens: ``(q0, q1, pairs per chunk)``.

    Query rows per chunk: the chunk's scores ``[G*rows, q1]`` stay near ``_CHUNK_ELEMS`` (near the
    core for the passes that follow the matmul), with at least ``_MIN_ROWS`` rows so the matmul keeps its
    efficiency, and at most an eighth of the prompt (``_SPLIT``; at least ``_SPLIT_FLOOR`` rows) so
    the masked upper triangle of the diagonal blocks stays a small part of the scores. Early chunks see few keys, so they take more rows; short prompts batch several
    (sequence, KV head) pairs into one chunk instead of launching tiny ops per pair.
    """
    q0 = 0
    cap = max(_SPLIT_FLOOR, -(-nq // _SPLIT))
    while q0 < nq:
        rows = max(_MIN_ROWS, int((math.sqrt(q0 * q0 + 4 * _CHUNK_ELEMS / g) - q0) / 2))  # G*rows*(q0+rows) <= elems
        rows = min(rows, cap)
        q1 = min(nq, q0 + rows)
        yield q0, q1, max(1, min(pairs, _CHUNK_ELEMS // (g * (q1 - q0) * q1)))
        q0 = q1


def _chunk_scores(q_rows: torch.Tensor, keys_t: torch.Tensor, flat: torch.Tensor, p0: int, p1: int, q0: int,
                  q1: int) -> torch.Tensor:
    """Scores ``[p1 - p0, G*(q1 - q0), q1]`` (in ``flat``) of query rows ``q0:q1`` of pairs ``p0:p1``
    against their keys ``0:q1``. ``q_rows``: ``[pairs, G, n, F]``; ``keys_t``: ``[pairs, F, n]``."""
    g, f = q_rows.shape[1], q_rows.shape[-1]
    m = g * (q1 - q0)
    e = flat[: (p1 - p0) * m * q1].view(p1 - p0, m, q1)
    if p1 - p0 == 1:  # a plain matmul reads the key slice in place (a batched one copies it)
        torch.mm(q_rows[p0, :, q0:q1].reshape(m, f), keys_t[p0, :, :q1], out=e[0])
    else:
        torch.bmm(q_rows[p0:p1, :, q0:q1].reshape(p1 - p0, m, f), keys_t[p0:p1, :, :q1], out=e)
    return e


def causal_received(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    ws: Workspace | None = None, *, significance: bool = True):
    """``is_causal`` attention of prompts with no padding and their significance, in one pass over
    the scores: ``(out [B, Hq, n, Fv] in the query's dtype, received [B, Hkv, n] fp32, or None
    without significance)``.

    The flash kernel followed by :func:`received_from_lse` computes every score twice (once in
    the kernel, once more in the significance pass) and runs ``exp`` on each score twice. Here each
    chunk of query rows sees all of its keys ``0..q1`` at once (its scores ``[G*rows, q1]`` stay
    near ``_CHUNK_ELEMS``, near the core), so its softmax needs no running rescale and is torch's own fused one:

        p_ij = softmax_j(s_ij)            (the diagonal block masked to -inf first)
        out_i = sum_j p_ij v_j            (one matmul)
        received_j += sum_i p_ij          (LeanKV §4, prompt phase; one batched matrix-vector product)

    One score matmul, one ``exp`` and one value matmul per score: about 0.5-0.6x the flash kernel
    plus the significance pass at 150-2k tokens on one thread. Without significance it costs about
    what the flash kernel alone costs (0.7-1.1x; more below 100 tokens), and is what a lossy cache runs, so that a policy's
    significance never changes the attention output: the output is bitwise the same with or
    without it (a LeanKV cache that keeps every token high gives exactly the logits of its
    single-tier twin). It agrees with the flash kernel's output to fp32 rounding. Each query
    row attends to keys ``0..i`` of its own sequence; the caller hands only real tokens (one span
    per row, :func:`span_attention`).
    """
    b, hq, n, f = query.shape
    hkv, fv = key.shape[1], value.shape[-1]
    g = hq // hkv
    pairs = b * hkv  # (sequence, KV head) pairs, each with its own keys
    ws = ws or Workspace()
    dev = query.device
    # Both written in one pass from the model's strided views ([B, H, n, F] transposed from
    # [B, n, H, F]), split but never merged across rows: merging B with H would copy them first.
    q_scaled = ws.get("causal_q", (pairs, g, n, f), torch.float32, dev)
    torch.mul(query.reshape(b, hkv, g, n, f), scale, out=q_scaled.view(b, hkv, g, n, f))
    k_t = ws.get("causal_k", (pairs, f, n), torch.float32, dev)  # keys on the last dim
    k_t.view(b, hkv, f, n).copy_(key.transpose(2, 3))
    v32 = value.reshape(pairs, n, fv)
    if v32.dtype != torch.float32:
        v32 = ws.get("causal_v", (pairs, n, fv), torch.float32, dev).copy_(v32)
    out = torch.empty((pairs, g, n, fv), device=dev)
    recv = torch.zeros((pairs, 1, n), device=dev) if significance else None
    flat = ws.get("recv_scores", (max(_CHUNK_ELEMS, g * _MIN_ROWS * n),), torch.float32, dev)
    for q0, q1, per in _query_chunks(n, g, pairs):
        r = q1 - q0
        after = torch.full((r, r), float("-inf"), device=dev).triu_(1)  # -inf on keys after their query, else 0
        ones = torch.ones((per, 1, g * r), device=dev) if significance else None
        for p0 in range(0, pairs, per):
            p1 = min(pairs, p0 + per)
            e = _chunk_scores(q_scaled, k_t, flat, p0, p1, q0, q1)
            # The chunk's own block is causal inside: zero the keys after each query, then add -inf
            # there (x + 0 is x), the masked fill in two plain passes, which run about 4x faster on
            # a CPU than masked_fill_ with a broadcast mask (a NaN after the query still goes).
            e.view((p1 - p0) * g, r, q1)[..., q0:q1].tril_().add_(after)
            # softmax's own max, exp, sum and scaling in one kernel
            torch.softmax(e, -1, out=e)
            if r == n:  # one chunk holds every query: the value product lands in place
                torch.bmm(e, v32[p0:p1], out=out[p0:p1].view(p1 - p0, g * r, fv))
            else:
                out[p0:p1, :, q0:q1] = torch.bmm(e, v32[p0:p1, :q1]).view(p1 - p0, g, r, fv)
            if significance:
                recv[p0:p1, :, :q1].baddbmm_(ones[: p1 - p0], e)  # sum over the chunk's queries
    out = out.view(b, hq, n, fv).to(query.dtype)
    return out, (recv.view(b, hkv, n).div_(g) if significance else None)


def span_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list, scaling: float, *,
                   significance: bool, ws: Workspace | None = None):
    """Prompt attention of each row over its real span only (see the module docstring).

    ``spans`` from :func:`causal_spans`. Returns ``(out [B, Q, Hq, F], received [B, Hkv, Q] or
    None)`` as :func:`prompt_attention` does; padding positions get zero output and zero
    significance. Each span runs :func:`causal_received` (attention and, if asked, significance in
    one pass over the scores); rows with one span in common (a batch with no padding) run as one
    call.
    """
    b, hq, nq, _ = query.shape
    hkv = key.shape[1]
    if set(spans) == {(0, nq)}:  # no padding: one call, nothing to zero around it
        o, r = causal_received(query, key, value, scaling, ws, significance=significance)
        return o.transpose(1, 2).contiguous(), r
    out = query.new_zeros((b, nq, hq, value.shape[-1]))
    received = torch.zeros((b, hkv, nq), device=query.device) if significance else None
    groups = [(slice(0, b), spans[0])] if len(set(spans)) == 1 else \
        [(slice(row, row + 1), span) for row, span in enumerate(spans)]
    for rows, (s, e) in groups:
        if e <= s:
            continue
        o, r = causal_received(query[rows, :, s:e], key[rows, :, s:e], value[rows, :, s:e], scaling, ws,
                               significance=significance)
        out[rows, s:e] = o.transpose(1, 2)
        if significance:
            received[rows, :, s:e] = r
    return out, received


# The capture swaps ``F.scaled_dot_product_attention`` (which transformers' SDPA path looks up at each
# call) for :func:`_capturing_sdpa` while any thread is inside :func:`_lse_capture`. What a call
# records, and where, is the calling thread's own state: another thread's SDPA calls (a second
# model, a DynamicCache run beside a LeanCache one) pass through untouched and never land in this
# thread's box. The swap is counted under a lock, so overlapping captures install it once and the
# last one out restores the function it found.
_capture = threading.local()
_swap_lock = threading.Lock()
_swap = {"users": 0, "original": None}


def _original_sdpa():
    """The SDPA function the capture wraps (the current one when no capture is installed)."""
    return _swap["original"] or F.scaled_dot_product_attention


def _capturing_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """``F.scaled_dot_product_attention`` that, inside this thread's :func:`_lse_capture`, also records
    the CPU flash kernel's lse of the first call it serves (every other call goes to the original)."""
    active = getattr(_capture, "active", None)
    if active is not None and query.device.type == "cpu" and dropout_p == 0.0 and query.dim() == 4 \
            and "lse" not in active[0]:
        box, mask_memo = active
        try:  # a private dispatcher query: a torch without it (or with another signature) just falls back
            choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                             enable_gqa=enable_gqa)
        except (AttributeError, TypeError, RuntimeError):
            choice = None
        if choice == SDPBackend.FLASH_ATTENTION.value and (enable_gqa or key.shape[1] == query.shape[1]):
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = _additive_mask(attn_mask, query.dtype, mask_memo)
            out, box["lse"] = _cpu_flash(query, key, value, is_causal=is_causal, scale=scale, attn_mask=attn_mask)
            return out
    return _original_sdpa()(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def _lse_capture(box: dict, mask_memo: dict | None = None):
    """Run the body with this thread's ``F.scaled_dot_product_attention`` calls also recording the CPU
    flash kernel's lse into ``box`` (the first call the flash kernel serves).

    Calls that the flash kernel would not serve (another device or backend, dropout) go to the
    original function unchanged, and ``box`` gets no lse; so do other threads' calls. Captures nest
    and overlap across threads. ``mask_memo``: see :func:`_additive_mask`.
    """
    with _swap_lock:
        if _swap["users"] == 0 and F.scaled_dot_product_attention is not _capturing_sdpa:
            _swap["original"] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _capturing_sdpa
        _swap["users"] += 1
    outer = getattr(_capture, "active", None)
    _capture.active = (box, mask_memo)
    try:
        yield
    finally:
        _capture.active = outer
        with _swap_lock:
            _swap["users"] -= 1
            # Restored unless someone wrapped it since (their wrapper may still call this one, so
            # the original stays known to it).
            if _swap["users"] == 0 and F.scaled_dot_product_attention is _capturing_sdpa:
                F.scaled_dot_product_attention = _swap["original"]
                _swap["original"] = None


def received_from_lse(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, k_real: torch.Tensor,
                      scale: float, ws: Workspace | None = None) -> torch.Tensor:
    """Prompt significance ``[B, Hkv, Q]`` given the softmax's log-sum-exp ``lse`` ``[B, Hq, Q]``.

    ``sum_i exp(s_ij - lse_i)`` over the live queries ``i`` at or after key ``j``, averaged over the
    ``G`` query heads of each KV group (LeanKV §4, prompt phase). The step's real tokens must have
    increasing positions (:attr:`leankit.cache.StepState.ordered`), so that "at or after" is
    "at a later index" and a chunk of queries sees no key past its last query.

    ``ws``: scratch reused across layers. The augmented operands are tens of MB; fresh tensors
    of that size are page-faulted on first touch, which measured about a third of the matmul
    that fills them.
    """
    b, hq, nq, f = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    ws = ws or Workspace()
    dev = q.device
    live = k_real.view(b, 1, 1, nq)
    # q_aug = [q * scale, -lse_i, 1] and k_aug = [k, 1, -BIG * pad_j]: one matmul gives s_ij - lse_i,
    # pushed far below the exp floor for padding keys and rows that do not count.
    q_aug = ws.get("recv_q", (b, hkv, g, nq, f + 2), torch.float32, dev)
    torch.mul(q.view(b, hkv, g, nq, f).float(), scale, out=q_aug[..., :f])
    torch.where(live & torch.isfinite(lse.view(b, hkv, g, nq)), -lse.view(b, hkv, g, nq).float(),
                torch.full((), -_BIG, device=dev), out=q_aug[..., f])
    q_aug[..., f + 1] = 1.0
    k_aug = ws.get("recv_k", (b, hkv, f + 2, nq), torch.float32, dev)  # keys on the last dim: [B, Hkv, F+2, Q]
    k_aug[:, :, :f].copy_(k.transpose(-1, -2))
    k_aug[:, :, f] = 1.0
    k_aug[:, :, f + 1].copy_(torch.where(k_real, 0.0, -_BIG).view(b, 1, nq))
    pairs = b * hkv  # (sequence, KV head) pairs, each with its own keys
    qa, ka = q_aug.view(pairs, g, nq, f + 2), k_aug.view(pairs, f + 2, nq)
    recv = torch.zeros((pairs, 1, nq), device=dev)
    flat = ws.get("recv_scores", (max(_CHUNK_ELEMS, g * _MIN_ROWS * nq),), torch.float32, dev)
    for q0, q1, per in _query_chunks(nq, g, pairs):  # the clamp, exp and sum reread each chunk from L2
        ones = torch.ones((per, 1, g * (q1 - q0)), device=dev)
        for p0 in range(0, pairs, per):
            p1 = min(pairs, p0 + per)
            e = _chunk_scores(qa, ka, flat, p0, p1, q0, q1)
            # Keys after a query in the chunk's own block are clamped like the rest (their scores
            # were never bounded by that query's lse) and zeroed after the exp.
            e.clamp_(EXP_FLOOR, _EXP_CEIL).exp_()
            e.view((p1 - p0) * g, q1 - q0, q1)[..., q0:q1].tril_()  # (3-d: a 4-d tril_ measured 4x slower)
            recv[p0:p1, :, :q1].baddbmm_(ones[: p1 - p0], e)  # sum over the chunk's queries
    recv = recv.view(b, hkv, nq)
    return recv.masked_fill_(~k_real.view(b, 1, nq), 0.0) / g


def prompt_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float, *, significance: bool, q_pos: torch.Tensor, k_real: torch.Tensor,
                     ordered: bool, ws: Workspace | None = None, mask_memo: dict | None = None,
                     exact: bool = True):
    """The prompt's attention through transformers' SDPA, and (if asked) its tokens' significance.

    Returns ``(out [B, Q, Hq, F], received [B, Hkv, Q] or None)``. The significance reuses the
    SDPA kernel's log-sum-exp where it ran PyTorch's CPU flash kernel on a prompt whose positions
    increase; otherwise it is :func:`leankit.attention.step_received`'s own pass (on the kernel
    backend, :func:`leankit_kernels.prompt_significance.prompt_received`'s two launches). ``ws``: the
    cache's scratch (:class:`~leankit.attention.Workspace`) for that pass. ``mask_memo``: the
    step's mask memo (:func:`_additive_mask`, :func:`causal_spans`), shared by its layers.

    ``exact``: return bitwise what transformers' SDPA returns. With ``exact=False`` (a lossy
    cache), a CPU batch with no mask (no padding) or whose mask is causal within each row's real
    span runs :func:`span_attention` instead, which skips the masked blocks, takes the significance
    from the same softmax, and agrees with SDPA to fp32 rounding.
    """
    if not exact and query.device.type == "cpu" and (ordered or not significance) \
            and key.shape[2] == query.shape[2]:
        if attention_mask is None:
            # no mask: a batch with no padding, which SDPA runs with is_causal (as it does where the
            # module is causal); every row is one span of all its tokens
            causal = module is None or getattr(module, "is_causal", True)
            spans = [(0, query.shape[2])] * query.shape[0] if causal and bool(k_real.all()) else None
        else:
            spans = causal_spans(attention_mask, k_real, mask_memo)
        if spans is not None:
            return span_attention(query, key, value, spans, scaling, significance=significance, ws=ws)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    box: dict = {}
    capture = significance and ordered and query.device.type == "cpu"
    with _lse_capture(box, mask_memo) if capture else contextlib.nullcontext():
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)[0]
    if not significance:
        return out, None
    lse = box.get("lse")
    if lse is not None and lse.shape == query.shape[:3]:
        return out, received_from_lse(query, key, lse, k_real, scaling, ws)
    if use_triton(query):  # two launches (leankit_kernels.prompt_significance), not a chunk loop
        from leankit_kernels.prompt_significance import prompt_received

        return out, prompt_received(query, key, q_pos, k_real, scaling)
    return out, step_received(query, key, q_pos, k_real, scaling, ordered)
