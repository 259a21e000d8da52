"""leankit's Triton kernels (installed as ``leankit_kernels``).

One family per file, each with its kernels, its launcher and a docstring of the memory it reads
and writes. All of them read and write the unified page format of :mod:`leankit.pages` (LeanKV
§5.2): a uint8 pool of equal-size pages, each holding tokens of one precision tier as six
16-byte-aligned, token-major segments (K data, K meta, V data, V meta, fp16 score, int32
position), addressed through the bidirectional page table of :mod:`leankit.page_table`.

* :mod:`.quant` -- Hetero-KV quantize + bit-pack of new tokens straight into their page slots
  (bits 8/4/2/1 per side, or the raw model dtype), byte-identical to
  ``PagePool.write_rows(layout.encode(...))``; plus the dequantize/unpack kernel for tests.
* :mod:`.paged_attention` -- decode attention (``Q == 1``): one program per (sequence, KV head,
  split) walking the split's high-tier pages then its low-tier pages (§6.2), dequantizing on the
  fly, the G query heads of a GQA group sharing every K/V tile through ``tl.dot``, online
  softmax, flash-decoding split-K + reduce, and an optional fused running-significance update of
  the pages' score segments. ``paged_attention(q, kv, q_pos, scale) -> (out, lse)`` is the entry
  point for attention over the pages (``Q > 1`` goes to the prefill kernel);
  ``decode_step_attention`` is a decode step's, which also takes the step's own new token (exact
  K/V) into the same launch: a one-split program starts its softmax with it, the split reduce
  merges it.
* :mod:`.own_token` -- a decode step's exact attention to its own new token, merged with a
  finished paged attention by log-sum-exp (and the token's initial significance), in one launch:
  the path of a rotated cache, whose paged output is rotated back before the merge.
* :mod:`.prefill_attention` -- causal FlashAttention-style prefill over the pages (prompt plus
  cached prefix) with causal tile skipping by stored position, and the significance pass
  ``received_attention`` (probability each key received, recomputed from the saved lse).
* :mod:`.act_to_kv` -- the fused ACT -> KV recompute (HybridServe / CAPTURE / KVPR): a layer's
  stored input activations -> input norm -> one ``tl.dot`` GEMM against the stacked ``[Wk Wv]``
  -> bias -> ``k_norm`` -> RoPE, one launch per layer and step, into a dense ``[n, Hkv, F]`` K/V
  scratch tile; the kernel mirror of :func:`leankit.recompute.act_to_kv_ref`.
* :mod:`.page_alloc` -- one-launch page allocation/recycling: exclusive prefix sum
  (``tl.cumsum``) over every (tier, layer, sequence, head) demand against the circular free list,
  writing page ids into the bidirectional table (high from the left, low from the right).
* :mod:`.codes` -- quantized codes of a page tile as exact fp16 MMA operands, unpacked a 32-bit
  word at a time, with scale and min applied per key after the matmuls.
* :mod:`.tiles` -- shared tile loaders (slot -> page -> bytes, unpack, dequantize), the
  online-softmax steps both attention kernels run, and launcher helpers; :mod:`.testing` -- cache
  builders and tolerances shared by tests and benchmarks;
  :mod:`.aot` -- ``python -m leankit_kernels.aot``: compile every kernel for sm_80/sm_90 without a
  GPU, report registers / shared memory / spills from ``ptxas -v``, fail on any spill.

CUDA tensors run the compiled kernels; CPU tensors (``LEANKIT_BACKEND=triton``) run them through
Triton's interpreter, which is how the test suite checks them against the PyTorch references.
"""
