"""``leankit bench offload``: a plan's cache with its pages on the host against the same cache with
every page on the device, side by side.

The plan (:func:`leankit.offload.plan_for_model` for the model, the batch, the context and
``--hardware``) picks the format and ACT share; the same cache is then built twice, with the host
tier (``offload={}``) and without. One left-padded batch of real-text prompts is prefilled into
each, then decode steps run in rounds, each round stepping both caches in an order that rotates
from round to round. Reported: the median decode-step times and their ratio, the bytes each
offloaded step moved host->device and device->host (counted where the copies are issued), the
planner's predicted bytes for the plan when it keeps cache on the host, and on CUDA the measured
overlap: the share of the copy-stream time hidden behind compute,
``1 - (offloaded step - device step) / copy time`` (clamped to [0, 1]).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..pages import format_bytes
from .step import decode, prefill
from .text import check_positions, corpus_ids, left_padded, pad_id, step_batch


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _copy_seconds(link) -> float:
    """Seconds the copy streams were busy since the last call (CUDA events), then forget them."""
    torch.cuda.synchronize(link.device)
    ms = sum(a.elapsed_time(b) for a, b in link.copy_events)
    link.copy_events = []
    return ms / 1e3


def run(model, tok, hardware, batch: int, context: int, steps: int, warmup: int, kv_configs, limits=None,
        progress: bool = False, text_path=None) -> dict:
    """Measure the plan's offloaded cache against the all-on-device one; returns everything measured.

    ``text_path``: a UTF-8 text file to cut the prompts from instead of the shipped articles."""
    from ..cache import LeanCache
    from ..offload import plan_for_model, predicted_link_bytes
    from ..offload.plan import cache_settings, relative_gap

    check_positions(model, context + warmup + steps, "--context plus the warm-up and timed steps")
    device = next(model.parameters()).device
    ids, mask = left_padded(step_batch(corpus_ids(tok, text_path), batch, context), pad_id(tok))
    ids, mask = ids.to(device), mask.to(device)
    prompts = tuple(int(x) for x in mask.sum(1).tolist())
    plan = plan_for_model(model, hardware, batch, prompts, steps + warmup + 1, kv_configs=kv_configs, limits=limits)
    kv, placement = cache_settings(plan)  # raises ValueError for an infeasible or unservable plan
    caches = {"device": LeanCache(model, kv), "offload": LeanCache(model, kv, offload={})}
    link = caches["offload"].offload.link
    cuda = device.type == "cuda"
    link.timing = cuda
    states, times, prefill_s = {}, {"device": [], "offload": []}, {}
    copy_s = []
    order = ["device", "offload"]
    from tqdm.auto import tqdm

    bar = tqdm(total=2 * (1 + warmup + steps), desc="offload bench", unit="step", leave=False,
               disable=not progress)
    for name in order:
        _sync(device)
        t = time.perf_counter()
        states[name] = prefill(model, caches[name], ids, mask)
        _sync(device)
        prefill_s[name] = time.perf_counter() - t
        bar.update(1)
    if cuda:
        _copy_seconds(link)
    for r in range(warmup + steps):
        for name in order[r % 2:] + order[: r % 2]:
            _sync(device)
            t = time.perf_counter()
            states[name] = decode(model, caches[name], states[name])
            _sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t)
            if cuda and name == "offload":
                c = _copy_seconds(link)
                if r >= warmup:
                    copy_s.append(c)
            bar.update(1)
    bar.close()
    rep = caches["offload"].memory_report()["offload"]
    decode_bytes = rep["bytes_per_step"][1 + warmup:]
    dev_step, off_step = statistics.median(times["device"]), statistics.median(times["offload"])
    out = {
        "plan": plan.choice.label(), "plan_places_cache_on_host": placement is not None, "config": kv,
        "hardware": hardware.name, "device": str(device), "batch": batch, "context": context, "steps": steps,
        "prefill_s": prefill_s, "device_step_s": dev_step, "offload_step_s": off_step,
        "step_ratio": off_step / dev_step,
        "h2d_bytes_step": statistics.median(b[0] for b in decode_bytes),
        "d2h_bytes_step": statistics.median(b[1] for b in decode_bytes),
        "h2d_bytes_total": rep["h2d_bytes_total"], "d2h_bytes_total": rep["d2h_bytes_total"],
        "device_pages_peak": rep["device_pages_peak"], "host_pages": rep["host_pages"],
        "pages_on_device_run": caches["device"].memory_report()["pages_used"],
    }
    if placement is not None:
        pred = predicted_link_bytes(plan)
        step = round(pred["context"] - sum(prompts) / batch) + 1
        if step < len(rep["bytes_per_step"]):
            h2d, d2h = rep["bytes_per_step"][step]
            out["predicted"] = {"h2d": pred["h2d"], "d2h": pred["d2h"], "step": step,
                                "h2d_gap": relative_gap(h2d, pred["h2d"]), "d2h_gap": relative_gap(d2h, pred["d2h"])}
    if cuda:
        copy = statistics.median(copy_s) if copy_s else 0.0
        exposed = max(off_step - dev_step, 0.0)
        out["copy_s"] = copy
        out["overlap"] = min(max(1.0 - exposed / copy, 0.0), 1.0) if copy > 0 else float("nan")
    return out


def table(res: dict) -> str:
    """The measurements as text."""
    where = ("the plan keeps cache on the host" if res["plan_places_cache_on_host"] else
             "the plan fits the cache on the device; measured with the host tier anyway")
    lines = [
        (f"plan on {res['hardware']}: {res['plan']} -> LeanCache {res['config']} ({where})"),
        f"batch {res['batch']}, context {res['context']}, {res['steps']} decode steps on {res['device']}",
        "",
        "| cache | decode step (median) | prefill | device pages (peak) |",
        "|---|---|---|---|",
        (f"| all on the device | {res['device_step_s'] * 1e3:.2f} ms | {res['prefill_s']['device'] * 1e3:.1f} ms | "
         f"{res['pages_on_device_run']} |"),
        (f"| host tier + working set | {res['offload_step_s'] * 1e3:.2f} ms | "
         f"{res['prefill_s']['offload'] * 1e3:.1f} ms | {res['device_pages_peak']} |"),
        "",
        f"step time ratio (offloaded / on device): {res['step_ratio']:.2f}x",
        (f"moved per decode step: {format_bytes(res['h2d_bytes_step'])} host->device, {format_bytes(res['d2h_bytes_step'])} "
         f"device->host (whole run: {format_bytes(res['h2d_bytes_total'])} / {format_bytes(res['d2h_bytes_total'])})"),
    ]
    if "predicted" in res:
        p = res["predicted"]
        lines.append(f"planner's prediction at decode step {p['step']}: {format_bytes(p['h2d'])} host->device "
                     f"({p['h2d_gap']:.2%} off), {format_bytes(p['d2h'])} device->host ({p['d2h_gap']:.2%} off)")
    if "overlap" in res:
        lines.append(f"overlap: copy streams busy {res['copy_s'] * 1e3:.2f} ms per step, {res['overlap']:.0%} of it "
                     "hidden behind compute")
    else:
        lines.append("overlap: none to measure on the CPU: the host tier and the working set share one memory, "
                     "so there is no link to overlap (the copies run synchronously; the ratio is their cost)")
    return "\n".join(lines)
