"""``leankit bench``: speed of LeanCache against ``DynamicCache``, measured side by side in one run.

* :mod:`.step` — prefill and decode-step time ratios, broken down by what the cache does;
* :mod:`.throughput` — generated tokens/s at a fixed KV budget over a mix of real-text requests;
* :mod:`.timing` — exclusive wall-clock timers installed by patching methods for one run only;
* :mod:`.text` — prompts cut from the Wikipedia text shipped with leankit;
* :mod:`.readme` — the results table between markers in README.md.
"""
