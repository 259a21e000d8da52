"""Ahead-of-time compile check of every leankit kernel, no GPU needed.

    python -m leankit_kernels.aot [--arch 80 90] [--jobs 2]

Compiles each kernel with the constexprs of realistic deployments (Llama-3-8B-like heads:
head_dim 128, 32 query / 8 KV heads; SmolLM2-like heads: head_dim 64, 9 / 3 heads; each config
on the pages a user gets by default, 2 KB for quantized configs and 8 KB for dense ones
(``leankit.config``); fp16 models, plus fp32 decode, prefill and significance-pass variants; the ACT->KV recompute at the
layer shapes of Llama-3-8B, Qwen3-8B, OPT-13B, SmolLM2 and Gemma3-270M) for ``sm_80`` and ``sm_90``,
runs the ``ptxas -v`` that ships with Triton (the one Triton itself uses for that arch) on the
PTX, and prints registers, shared memory and spills per (kernel, arch).

It also disassembles each cubin (``cuobjdump -sass``, shipped with Triton) and finds its loops
(a backward branch closes a loop body). Local-memory traffic (``LDL``/``STL``: spills, or a stack
frame) inside a loop body fails the check; outside every loop it is reported with its reason (a
value parked across a loop, or prologue/epilogue spills) and passes. For the decode kernel it
prints the static issue metric: SASS instructions of the inner loop body times warps, per KB of
K/V page bytes (K data + K meta + V data + V meta + position) one iteration reads. Everything is
static: compiled with no GPU. ``--report FILE`` writes the tables as markdown.

Exits with status 1 if any kernel fails to compile or spills inside a loop.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

if __name__ == "__main__":  # compile for real GPUs, never the interpreter (kernels are imported later, per case);
    os.environ.pop("TRITON_INTERPRET", None)  # an import for the case tables leaves the caller's setting

import torch
import triton
import triton.language as tl

from . import sass

# name -> (head_dim, query heads per KV head, page_size; None: the config's default)
MODELS = {"llama3": (128, 4, None), "smollm2": (64, 3, None), "gemma3": (256, 4, None)}


@dataclass
class Case:
    """One compile: kernel, its pointer dtypes, constexprs and launch options."""

    label: str
    module: str
    kernel: str
    pointers: dict
    constexprs: dict
    floats: tuple = ("sm_scale",)
    divisible: tuple = ()
    options: dict = field(default_factory=lambda: {"num_warps": 4, "num_stages": 2})
    # compute capability -> (constexpr, option) overrides the launcher picks on that GPU
    arch: dict = field(default_factory=dict)
    # Decode cases with a single tier: tokens one inner-loop iteration reads, and their page bytes
    # per token (K/V data + meta + position); 0 = no issue metric for this case.
    loop_tokens: int = 0
    token_bytes: int = 0


def _layouts(spec: str, model: str, dtype=torch.float16, **overrides):
    from leankit.config import KVConfig
    from leankit.pages import PageLayout

    f, _, ps = MODELS[model]
    cfg = KVConfig.parse(spec, page_size=ps, **overrides)
    return tuple(PageLayout.build(cfg, t, f, dtype) for t in range(len(cfg.tiers)))


def cases() -> list[Case]:
    """The compile matrix (every kernel at least once, the decode kernel for every config)."""
    from .paged_attention import DECODE_STAGES, DECODE_WARPS, decode_loop_tokens, decode_tiling, group_pad
    from .prefill_attention import (
        BLOCK_M,
        BLOCK_N,
        RECEIVED_BLOCK_M,
        RECEIVED_BLOCK_N,
        layer_kind,
        prefill_config,
        prefill_warps,
        received_config,
    )
    from .quant import layout_constexprs, quant_block_n
    from .tiles import tier_args

    out = []
    # A model dtype's name -> (torch dtype, tl.dot operand type, pointer type, tl.dot precision) as the
    # launchers pick them on a GPU (leankit_kernels.tiles.dot_config)
    operands = {"fp16": (torch.float16, tl.float16, "*fp16", "tf32"), "bf16": (torch.bfloat16, tl.bfloat16, "*bf16", "tf32"),
                "fp32": (torch.float32, tl.float32, "*fp32", "ieee")}
    for spec in ("K8V4", "K4V2", "K2V1", "FP16"):
        lay = _layouts(spec, "llama3")[0]
        out.append(Case(f"quantize {spec} d128", "quant", "_quantize_kernel",
                        {"k_ptr": "*fp16", "v_ptr": "*fp16", "page_ptr": "*i32", "slot_ptr": "*i32", "pos_ptr": "*i32",
                             "score_ptr": "*fp32", "pool": "*u8", "err": "*i32"},
                        dict(layout_constexprs(lay), BLOCK_N=quant_block_n(128)),
                        options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False}))
    # A step's store straight from [B, H, Q, F] K/V: a decode step (one query: counts advanced in the
    # kernel, received significance) and a prompt (flat scores) into the low tier's pages (a LeanKV
    # prompt's classified tokens), fp16 and fp32 models
    for spec, model, dname, score, one in (("K8V4", "llama3", "fp16", 1, True), ("K4V2", "smollm2", "fp32", 2, False)):
        lay = _layouts(spec, model, operands[dname][0])[0]
        ptr = operands[dname][2]
        out.append(Case(f"store step {spec} d{lay.head_dim} {dname}", "quant", "_store_step_kernel",
                        {"k_ptr": ptr, "v_ptr": ptr, "real_ptr": "*u8", "rank_ptr": "*i64", "qpos_ptr": "*i32",
                         "score_ptr": "*fp32", "lens_ptr": "*i32", "tab_ptr": "*i32", "pool": "*u8", "err": "*i32"},
                        dict(layout_constexprs(lay), BLOCK_N=quant_block_n(lay.head_dim), SCORE=score,
                             UPDATE_LENS=one, LOW=not one), divisible=("skb", "skh", "skq", "svb", "svh", "svq"),
                        options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False}))
    lay = _layouts("K4V2", "llama3")[0]
    out.append(Case("dequantize K4V2 d128", "quant", "_dequantize_kernel",
                    {"pool": "*u8", "page_ptr": "*i32", "slot_ptr": "*i32", "k_out": "*fp32", "v_out": "*fp32",
                         "score_out": "*fp32", "pos_out": "*i32"}, dict(layout_constexprs(lay), BLOCK_N=16)))

    # A decode step's own token (paged_attention.decode_step_attention): its K/V rows in the model's
    # dtype, the row flags and, with significance, the new tokens' scores
    def own_pointers(ptr):
        return {"kn_ptr": ptr, "vn_ptr": ptr, "real_ptr": "*u8", "recv_ptr": "*fp32"}

    def decode(spec, model, dname="fp16", save=False, direct=False, low_group_size=None, own=False):
        f, g, _ = MODELS[model]
        dtype, dot_t, ptr, prec = operands[dname]
        targs = tier_args(_layouts(spec, model, dtype, low_group_size=low_group_size))
        tag = ("+scores" if save else "") + (" direct" if direct else "") + (" own" if own else "")
        tag += "" if dname == "fp16" else f" {dname}"
        tag += "" if low_group_size is None else f" low-gs{low_group_size}"
        lays = _layouts(spec, model, dtype, low_group_size=low_group_size)
        metric = len(lays) == 1 and not save and dname == "fp16"
        return Case(f"decode {spec} d{f} G{g}{tag}", "paged_attention", "_decode_kernel",
                    {"q_ptr": ptr, "qpos_ptr": "*i32", "pool": "*u8", "tab_ptr": "*i32", "np_ptr": "*i32",
                         "len_ptr": "*i32", "part_acc": "*fp32", "part_ml": "*fp32", "out_ptr": ptr, "lse_ptr": "*fp32",
                         "lg_ptr": "*fp32", **(own_pointers(ptr) if own else {})},
                    dict(targs, G=g, G_PAD=group_pad(g), DOT=dot_t, PREC=prec, SAVE_LOGITS=save, DIRECT=direct,
                         OWN=own, RECEIVED=own and save,
                         **decode_tiling(targs, dot_t.primitive_bitwidth // 8, gpu=True)),
                    options={"num_warps": DECODE_WARPS, "num_stages": DECODE_STAGES},
                    loop_tokens=decode_loop_tokens(lays[0]) if metric else 0,
                    token_bytes=read_bytes_per_token(lays[0]) if metric else 0)

    for spec in ("FP16", "K8V8", "K8V4", "K4V2", "K8V4-K4V2"):
        out.append(decode(spec, "llama3"))
    for spec in ("FP16", "K8V4", "K4V2"):
        out.append(decode(spec, "smollm2"))
    out.append(decode("K8V4-K4V2", "llama3", save=True))
    out.append(decode("K8V4-K4V2", "llama3", direct=True))
    out.append(decode("K8V4-K4V2", "smollm2"))
    out.append(decode("K8V4-K4V2", "smollm2", save=True, low_group_size=32))
    out.append(decode("K8V4", "smollm2", dname="fp32"))
    out.append(decode("FP16", "smollm2", dname="fp32"))
    out.append(decode("K8V4-K4V2", "llama3", dname="fp32"))
    out.append(decode("K8V4-K4V2", "llama3", dname="bf16"))
    out.append(decode("K8V4-K4V2", "gemma3"))
    # the one-split variants a decode step runs, its own token folded in (with significance: LeanKV)
    out.append(decode("K8V4", "llama3", direct=True, own=True))
    out.append(decode("K8V4-K4V2", "smollm2", save=True, direct=True, own=True))
    for own in (False, True):  # the reduce after several splits merges the step's own token (LeanKV: and scores it)
        out.append(Case("decode reduce d128 G4" + (" own" if own else ""), "paged_attention", "_decode_reduce_kernel",
                        {"part_acc": "*fp32", "part_ml": "*fp32", "out_ptr": "*fp16", "lse_ptr": "*fp32",
                         "q_ptr": "*fp16", **(own_pointers("*fp16") if own else {})},
                        {"G": 4, "G_PAD": 4, "F": 128, "OWN": own, "RECEIVED": own}))
    targs = tier_args(_layouts("K8V4-K4V2", "llama3"))
    out.append(Case("score update K8V4-K4V2", "paged_attention", "_score_update_kernel",
                    {"lg_ptr": "*fp32", "lse_ptr": "*fp32", "qpos_ptr": "*i32", "qvalid_ptr": "*u8", "pool": "*u8",
                         "tab_ptr": "*i32", "len_ptr": "*i32"},
                    {"G": 4, "G_PAD": 16, "PAGE_SIZE": targs["PAGE_SIZE"], "BLOCK_N": 64, "HAS_LOW": True,
                         "HI": targs["HI"], "LO": targs["LO"]}))
    # fp32 cases: an fp32 model's operands, on the tiles and tf32x3 dots prefill_config and
    # received_config pick for them.
    for spec, model, gs, dname in (("FP16", "llama3", None, "fp16"), ("K8V4-K4V2", "llama3", None, "fp16"),
                                   ("K8V4-K4V2", "llama3", 32, "fp16"), ("K8V4-K4V2", "gemma3", None, "fp16"),
                                   ("FP16", "llama3", None, "fp32"), ("K8V4-K4V2", "llama3", 32, "fp32"),
                                   ("K8V4-K4V2", "smollm2", 32, "fp32")):
        f, g, _ = MODELS[model]
        dtype, dot, ptr, prec = operands[dname]
        targs = tier_args(_layouts(spec, model, dtype, group_size=gs))
        kind = layer_kind(targs)
        common = dict(targs, G=g, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT=dot, PREC=prec)
        tag = ("" if gs is None else f" gs{gs}") + ("" if dname == "fp16" else f" {dname}")
        out.append(Case(f"prefill {spec} d{f} G{g}{tag}", "prefill_attention", "_prefill_kernel",
                        {"q_ptr": ptr, "qpos_ptr": "*i32", "pool": "*u8", "tab_ptr": "*i32", "len_ptr": "*i32",
                             "out_ptr": ptr, "lse_ptr": "*fp32"}, common,
                        divisible=("stride_qb", "stride_qh", "stride_qq"),
                        options={"num_warps": prefill_warps(f), "num_stages": 2},
                        arch={cc: prefill_config(f, (cc // 10, cc % 10), **kind, operand_bytes=dot.primitive_bitwidth // 8)
                              for cc in (80, 90)}))
    for model, dname in (("llama3", "fp16"), ("llama3", "fp32"), ("smollm2", "fp32")):
        f, g, _ = MODELS[model]
        dtype, dot, ptr, prec = operands[dname]
        targs = tier_args(_layouts("K8V4-K4V2", model, dtype))
        out.append(Case(f"received K8V4-K4V2 d{f} G{g}" + ("" if dname == "fp16" else f" {dname}"), "prefill_attention",
                        "_received_kernel",
                        {"q_ptr": ptr, "qpos_ptr": "*i32", "qv_ptr": "*i32", "lse_ptr": "*fp32", "pool": "*u8",
                             "tab_ptr": "*i32", "len_ptr": "*i32", "out_h": "*fp32", "out_l": "*fp32"},
                        dict(targs, G=g, BLOCK_M=RECEIVED_BLOCK_M, BLOCK_N=RECEIVED_BLOCK_N, DOT=dot, PREC=prec),
                        divisible=("stride_qb", "stride_qh", "stride_qq"),
                        options={"num_warps": prefill_warps(f), "num_stages": 2},
                        arch={cc: received_config(f, (cc // 10, cc % 10), operand_bytes=dot.primitive_bitwidth // 8)
                              for cc in (80, 90)}))
    # The prompt's significance over its exact keys (two passes), on the tiles its launcher takes
    for model, dname in (("llama3", "fp16"), ("smollm2", "bf16"), ("smollm2", "fp32")):
        f, g, _ = MODELS[model]
        _, dot, ptr, prec = operands[dname]
        pointers = {"q_ptr": ptr, "k_ptr": ptr, "pos_ptr": "*i32", "real_ptr": "*u8", "lse_ptr": "*fp32"}
        tag = f"d{f} G{g}" + ("" if dname == "fp16" else f" {dname}")
        strides = ("stride_qb", "stride_qh", "stride_qq", "stride_kb", "stride_kh", "stride_kq")
        nbytes = dot.primitive_bitwidth // 8
        for kernel, pick, extra in (
                ("_prompt_lse_kernel", functools.partial(prefill_config, f, dense=True, operand_bytes=nbytes), {}),
                ("_prompt_received_kernel", functools.partial(received_config, f, operand_bytes=nbytes),
                 {"out_ptr": "*fp32"})):
            base = pick(None)
            out.append(Case(f"prompt significance {kernel.split('_')[2]} {tag}", "prompt_significance", kernel,
                            dict(pointers, **extra),
                            {"G": g, "F": f, "F_PAD": f, "BLOCK_M": base["BLOCK_M"], "BLOCK_N": base["BLOCK_N"],
                             "DOT": dot, "PREC": prec}, divisible=strides,
                            options={"num_warps": base["num_warps"], "num_stages": 2},
                            arch={cc: pick((cc // 10, cc % 10)) for cc in (80, 90)}))
    for model, dname in (("llama3", "fp16"), ("smollm2", "fp32")):
        f, g, _ = MODELS[model]
        _, _, ptr, _ = operands[dname]
        out.append(Case(f"own token d{f} G{g}" + ("" if dname == "fp16" else f" {dname}"), "own_token",
                        "_own_token_kernel",
                        # as a decode step runs it: the paged output and the merged one in the model's
                        # dtype (a rotated cache's paged output is fp32: only the load's conversion differs)
                        {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "old_ptr": ptr, "lse_old_ptr": "*fp32",
                         "real_ptr": "*u8", "out_ptr": ptr, "lse_ptr": "*fp32", "recv_ptr": "*fp32"},
                        {"G": g, "G_PAD": group_pad(g), "F_PAD": f, "RECEIVED": True},
                        options={"num_warps": 1, "num_stages": 1}))
    out += act_to_kv_cases()
    from .page_alloc import BLOCK as ABLOCK

    out.append(Case("page alloc grow", "page_alloc", "_grow_kernel",
                    {"extra_ptr": "*i32", "npages_ptr": "*i32", "tables_ptr": "*i32", "ring_ptr": "*i32", "cnt_ptr": "*i64"},
                    {"BLOCK": ABLOCK}))
    out.append(Case("page alloc shrink", "page_alloc", "_shrink_kernel",
                    {"drop_ptr": "*i32", "npages_ptr": "*i32", "tables_ptr": "*i32", "ring_ptr": "*i32", "cnt_ptr": "*i64"},
                    {"BLOCK": ABLOCK}))
    single = {"extra_ptr": "*i32", "lens_ptr": "*i32", "npages_ptr": "*i32", "nnew_ptr": "*i64", "tables_ptr": "*i32",
              "ring_ptr": "*i32", "cnt_ptr": "*i64", "status_ptr": "*i64", "ok_ptr": "*u8"}
    out.append(Case("page alloc token grant", "page_alloc", "_single_grant_kernel", single,
                    {"TOKENS": True, "BLOCK": 1024}))
    out.append(Case("page alloc deferred grow", "page_alloc", "_single_grant_kernel", single,
                    {"TOKENS": False, "BLOCK": 1024}))
    out.append(Case("page alloc release rows", "page_alloc", "_release_rows_kernel",
                    {"rows_ptr": "*u8", "npages_ptr": "*i32", "lens_ptr": "*i32", "tables_ptr": "*i32",
                     "ring_ptr": "*i32", "cnt_ptr": "*i64"}, {"BLOCK": 1024}))
    out.append(Case("page alloc move tail", "page_alloc", "_move_tail_kernel",
                    {"layers_ptr": "*i64", "r_ptr": "*i64", "npages_ptr": "*i32", "tables_ptr": "*i32"},
                    {"BLOCK": 256}))
    out.append(Case("page alloc tier plan", "page_alloc", "_tier_plan_kernel",
                    {"layers_ptr": "*i64", "len_ptr": "*i64", "res_ptr": "*i64", "npages_ptr": "*i32", "need_ptr": "*i64",
                     "r_ptr": "*i64", "extra_ptr": "*i32"}, {"HAS_RES": True, "TWO": True, "BLOCK": 256}))
    from .step_rows import BLOCK as RBLOCK

    out.append(Case("step rows", "step_rows", "_step_rows_kernel",
                    {"mask_ptr": "*i64", "tok_ptr": "*i64", "eos_ptr": "*i64", "fin_ptr": "*u8", "ending_ptr": "*u8",
                     "pos_ptr": "*i64", "real_ptr": "*u8", "rank_ptr": "*i64", "nnew_ptr": "*i64", "qpos_ptr": "*i32",
                     "qpos64_ptr": "*i64", "first_ptr": "*i64", "last_ptr": "*i64", "ended_ptr": "*u8",
                     "next_ptr": "*u8", "cont_ptr": "*i64", "lastpos_ptr": "*i64", "behind_ptr": "*i64",
                     "newlast_ptr": "*i64", "err_ptr": "*i32", "status_ptr": "*i64"},
                    {"HAS_MASK": True, "HAS_EOS": True, "HAS_POS": True, "HAS_LAST": True, "BLOCK": RBLOCK}))
    from .prompt_plan import BISECT_STEPS, INF_BITS, MAX_BLOCK

    # LeanKV's prompt classification at the longest tile (prompts of 2k tokens or more), 8 warps
    out.append(Case("prompt classes", "prompt_plan", "_prompt_classes_kernel",
                    {"rec_ptr": "*fp32", "pos_ptr": "*i32", "real_ptr": "*u8", "last_ptr": "*i64", "pm_ptr": "*fp32",
                     "lens_ptr": "*i32", "score_ptr": "*fp32", "cls_ptr": "*i8", "rank_ptr": "*i64",
                     "newlens_ptr": "*i64", "pruned_ptr": "*fp32"},
                    {"INF_B": INF_BITS, "STEPS": BISECT_STEPS, "BLOCK": MAX_BLOCK}, options={"num_warps": 8}))
    return out


# Real layer shapes of the ACT->KV projection (also the CUDA test's sizes). name: (hidden, KV heads,
# head_dim, NORM (act_to_kv.NORM_CODES: 1 rms, 2 layer), bias, k_norm, RoPE,
# Gemma's fp32 (1 + w) norm weights)
ACT_MODELS = {"llama3-8b": (4096, 8, 128, 1, False, False, True, False),
              "qwen3-8b": (4096, 8, 128, 1, False, True, True, False),
              "opt-13b": (5120, 40, 128, 2, True, False, False, False),
              "smollm2": (576, 3, 64, 1, False, False, True, False),
              "gemma3-270m": (640, 1, 256, 1, False, True, True, True)}


def act_to_kv_cases() -> list[Case]:
    """The fused ACT->KV projection for each layer shape of :data:`ACT_MODELS` (fp16), plus fp32 SmolLM2."""
    from .act_to_kv import BLOCK_M, act_block_k

    out = []
    for name, (d, h, f, norm, bias, knorm, rope, w32) in ACT_MODELS.items():
        for dname in ("fp16", "fp32") if name == "smollm2" else ("fp16",):
            ptr = {"fp16": "*fp16", "fp32": "*fp32"}[dname]
            args = ("a_ptr", "w_ptr", "b_ptr", "nw_ptr", "nb_ptr", "knw_ptr", "cos_ptr", "sin_ptr", "k_out", "v_out")
            dot, prec = (tl.float16, "tf32") if dname == "fp16" else (tl.float32, "ieee")
            ptrs = dict.fromkeys(args, ptr)
            if w32:  # Gemma's norm weights are held in fp32 (1 + w)
                ptrs.update(nw_ptr="*fp32", knw_ptr="*fp32")
            out.append(Case(f"act_to_kv {name}" + ("" if dname == "fp16" else f" {dname}"), "act_to_kv",
                            "_act_to_kv_kernel", ptrs,
                            {"D": d, "H": h, "F": f, "NORM": norm, "NORM_W32": w32, "HAS_BIAS": bias, "HAS_KNORM": knorm,
                             "HAS_ROPE": rope, "DOT": dot, "PREC": prec, "BLOCK_M": BLOCK_M,
                             "BLOCK_K": act_block_k(f)},
                            floats=("eps", "k_eps"), divisible=("stride_a",)))
    return out


def _ptxas(cc: int):
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(cc).path


def compile_case(case: Case, cc: int) -> dict:
    """Compile one case for ``sm_{cc}`` and return its ptxas resource usage."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    over = case.arch.get(cc, {})
    opt_names = ("num_warps", "num_stages", "maxnreg")
    case = Case(case.label, case.module, case.kernel, case.pointers,
                dict(case.constexprs, **{k: v for k, v in over.items() if k not in opt_names}), case.floats,
                case.divisible, dict(case.options, **{k: v for k, v in over.items() if k in opt_names}),
                loop_tokens=case.loop_tokens, token_bytes=case.token_bytes)
    mod = importlib.import_module(f"leankit_kernels.{case.module}")
    fn = getattr(mod, case.kernel)
    if not hasattr(fn, "arg_names") or type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError("kernels were imported under TRITON_INTERPRET=1; run the AOT check in a fresh process")
    sig, attrs = {}, {}
    unaligned = {fn.arg_names[j] if isinstance(j, int) else j
                 for j in getattr(fn, "do_not_specialize_on_alignment", None) or ()}
    for i, name in enumerate(fn.arg_names):
        if name in case.constexprs:
            sig[name] = "constexpr"
        elif name in case.pointers:
            sig[name] = case.pointers[name]
            if name not in unaligned:  # as the launcher compiles it: no alignment claim for these
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in case.floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in case.divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", cc, 32)
    backend = triton.compiler.make_backend(target)
    opts = backend.parse_options(dict(case.options))
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=case.constexprs, attrs=attrs), target=target,
                       options=opts.__dict__)
    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as fh:
            fh.write(k.asm["ptx"])
        cmd = [_ptxas(cc), "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", ptx, "-o", os.path.join(d, "k.cubin")]
        if not case.options.get("enable_fp_fusion", True):
            cmd.insert(1, "--fmad=false")
        res = subprocess.run(cmd, check=False, capture_output=True, text=True)
        log = res.stdout + res.stderr
        if res.returncode:
            raise RuntimeError(f"ptxas failed for {case.label} {arch}:\n{log}")
        insns = sass.instructions(sass.disassemble(os.path.join(d, "k.cubin"),
                                                   os.path.join(os.path.dirname(_ptxas(cc)), "cuobjdump")))
    all_loops = sass.loops(insns)
    local = sass.local_memory(insns, all_loops)
    body = max(sass.innermost(all_loops), key=lambda lp: lp.size, default=None)  # the largest innermost loop

    def grab(pat, default=0):
        mm = re.search(pat, log)
        return int(mm.group(1)) if mm else default

    return {"kernel": case.label, "arch": arch, "regs": grab(r"Used (\d+) registers"),
                "shared": int(k.metadata.shared), "stack": grab(r"(\d+) bytes stack frame"),
                "spill_st": grab(r"(\d+) bytes spill stores"), "spill_ld": grab(r"(\d+) bytes spill loads"),
                "warps": case.options["num_warps"], "local_in_loops": local.in_loops,
                "local_outside": local.outside, "local_reason": local.reason, "loop_body": body.size if body else 0,
                "loop_kb": case.loop_tokens * case.token_bytes / 1024,
                "loop_classes": sass.loop_opcode_classes(insns, body) if body and case.loop_tokens else {}}


def _run(args):
    i, cc = args
    case = cases()[i]
    try:
        return compile_case(case, cc)
    except Exception as e:  # noqa: BLE001 -- any compile failure is reported in the table and fails the run
        return {"kernel": case.label, "arch": f"sm_{cc}", "error": f"{type(e).__name__}: {e}"[:400]}


def read_bytes_per_token(layout) -> int:
    """Page bytes the decode kernel reads per token: K/V data + meta and the int32 position."""
    from leankit.pages import SEGMENTS

    return sum(b for seg, b in zip(SEGMENTS, layout.seg_bytes) if seg != "score")


def _status(r: dict) -> tuple[bool, str]:
    """``(fails, note)`` of one compile row: an error or local memory inside a loop fails."""
    if "error" in r:
        return True, f"COMPILE ERROR: {r['error']}"
    if r["local_in_loops"]:
        return True, f"<-- SPILL IN LOOP ({r['local_in_loops']} local ops inside a loop body)"
    if r["local_outside"] or r["spill_st"] + r["spill_ld"] + r["stack"]:
        return False, f"spill outside loops: {r['local_reason'] or 'stack frame without local ops'}"
    return False, ""


def resource_table(rows: list[dict]) -> list[str]:
    """Markdown rows of registers / shared memory / spills per (kernel, arch)."""
    out = ["| kernel | arch | warps | regs | shared B | stack B | spill st/ld B | local ops in loops / outside | note |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        _bad, note = _status(r)
        if "error" in r:
            out.append(f"| {r['kernel']} | {r['arch']} | | | | | | | {note} |")
            continue
        out.append(f"| {r['kernel']} | {r['arch']} | {r['warps']} | {r['regs']} | {r['shared']} | {r['stack']} | "
                   f"{r['spill_st']}/{r['spill_ld']} | {r['local_in_loops']}/{r['local_outside']} | {note} |")
    return out


def issue_table(rows: list[dict]) -> list[str]:
    """Markdown rows of the decode inner loop's static issue count per KB of K/V page bytes read."""
    out = [("| decode kernel | arch | loop body (SASS instr) | warps | KB read per iteration | "
           "warp instr per KB | vs FP16 |"), "|---|---|---|---|---|---|---|"]
    met = [r for r in rows if "error" not in r and r["loop_kb"]]
    for r in met:
        r["per_kb"] = r["loop_body"] * r["warps"] / r["loop_kb"]
    for r in met:
        d = r["kernel"].split()[2]
        ref = [x for x in met if x["arch"] == r["arch"] and x["kernel"].split()[1] == "FP16"
               and x["kernel"].split()[2] == d]
        ratio = f"{r['per_kb'] / ref[0]['per_kb']:.2f}x" if ref else "-"
        out.append(f"| {r['kernel']} | {r['arch']} | {r['loop_body']} | {r['warps']} | {r['loop_kb']:.2f} | "
                   f"{r['per_kb']:.1f} | {ratio} |")
    return out


def opcode_table(rows: list[dict]) -> list[str]:
    """Markdown rows of the decode inner loop's instructions per opcode class
    (:data:`leankit_kernels.sass.OPCODE_CLASSES`), as warp instructions per KB of K/V read, so the
    columns of a row add up to its issue count per KB."""
    met = [r for r in rows if "error" not in r and r["loop_kb"] and r.get("loop_classes")]
    if not met:
        return []
    classes = list(met[0]["loop_classes"])
    out = ["| decode kernel | arch | " + " | ".join(classes) + " |", "|---|---|" + "---|" * len(classes)]
    for r in met:
        per_kb = [r["loop_classes"][c] * r["warps"] / r["loop_kb"] for c in classes]
        out.append(f"| {r['kernel']} | {r['arch']} | " + " | ".join(f"{x:.1f}" for x in per_kb) + " |")
    return out


def main(argv=None) -> int:
    """``python -m leankit_kernels.aot``: compile every kernel case for the given archs and print (and
    optionally write) the register, spill and SASS tables; returns 1 if a loop spills or a compile fails."""
    ap = argparse.ArgumentParser(prog="python -m leankit_kernels.aot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default 80 90)")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="parallel compiles")
    ap.add_argument("--only", default="", help="compile only kernels whose label contains this text")
    ap.add_argument("--report", default="", help="also write the tables as markdown to this file")
    a = ap.parse_args(argv)
    todo = [(i, cc) for i, c in enumerate(cases()) if a.only in c.label for cc in a.arch]
    if not todo:  # a mistyped --only compiled nothing and passed ("0 compiles, 0 failing")
        ap.error(f"--only {a.only!r} matches no kernel; labels: {', '.join(c.label for c in cases())}")
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_run, todo))
    else:
        rows = [_run(t) for t in todo]
    bad = sum(_status(r)[0] for r in rows)
    res, iss, ops = resource_table(rows), issue_table(rows), opcode_table(rows)
    print("\n".join(res))
    if len(iss) > 2:
        print("\nDecode inner loop, static issue count (SASS instructions x warps per KB of K/V page bytes read):")
        print("\n".join(iss))
        print("\nThe same per opcode class (warp instructions per KB):")
        print("\n".join(ops))
    print(f"\n{len(rows)} compiles, {bad} failing (compile errors or spills inside a loop)")
    if a.report:
        with open(a.report, "w") as fh:
            fh.write(f"# AOT compile report (static)\n\nCompiled with no GPU by `python -m leankit_kernels.aot`, "
                     f"Triton {triton.__version__} (its bundled ptxas and cuobjdump), torch {torch.__version__}. "
                     "Registers and spills from `ptxas -v`; loops and local-memory instructions from "
                     "`cuobjdump -sass` of the same cubin. Nothing here was run on a GPU.\n\n")
            fh.write("\n".join(res) + "\n")
            if len(iss) > 2:
                fh.write("\n## Decode inner loop issue count\n\nStatic SASS instructions of the innermost loop "
                         "body (one iteration) times warps per program, divided by the K/V page bytes "
                         "(K data + K meta + V data + V meta + int32 position) that iteration reads. A "
                         "proxy for an issue-bound loop; measured GB/s on a GPU decides.\n\n")
                fh.write("\n".join(iss) + "\n")
                fh.write("\nThe same per opcode class: warp instructions per KB of K/V read, so a row's columns add up "
                         "to its issue count per KB (shared memory: LDS/LDSM/STS; bit and byte ops: PRMT/LOP3/SHF, the "
                         "code unpack; integer and address: IMAD/IADD3/ISETP/SEL ...; float math: the softmax and the "
                         "scale/min terms; `leankit_kernels.sass.OPCODE_CLASSES`).\n\n")
                fh.write("\n".join(ops) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
