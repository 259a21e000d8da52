"""Ahead-of-time compile check of every leankit kernel, no GPU needed.

    python -m leankit_kernels.aot [--arch 80 90] [--jobs 2]

Compiles each kernel with the constexprs of realistic deployments (Llama-3-8B-like heads:
head_dim 128, 32 query / 8 KV heads, 4096-byte pages; SmolLM2-like heads: head_dim 64, 9 / 3
heads, 2048-byte pages; fp16 models, plus an fp32 decode variant; the ACT->KV recompute at the
layer shapes of Llama-3-8B, Qwen3-8B, OPT-13B and SmolLM2) for ``sm_80`` and ``sm_90``,
runs the ``ptxas -v`` that ships with Triton (the one Triton itself uses for that arch) on the
PTX, and prints registers, shared memory and spills per (kernel, arch). Exits with status 1 if
any kernel spills (spill stores/loads or a stack frame) or fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

os.environ.pop("TRITON_INTERPRET", None)  # compile for real GPUs, never the interpreter

import torch
import triton
import triton.language as tl

# name -> (head_dim, query heads per KV head, page_size)
MODELS = {"llama3": (128, 4, 4096), "smollm2": (64, 3, 2048)}


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


def _layouts(spec: str, model: str, dtype=torch.float16, **overrides):
    from leankit.config import KVConfig
    from leankit.pages import PageLayout

    f, _, ps = MODELS[model]
    cfg = KVConfig.parse(spec, page_size=ps, **overrides)
    return tuple(PageLayout.build(cfg, t, f, dtype) for t in range(len(cfg.tiers)))


def cases() -> list[Case]:
    """The compile matrix (every kernel at least once, the decode kernel for every config)."""
    from .paged_attention import BLOCK_N_DECODE, group_pad
    from .prefill_attention import BLOCK_M, BLOCK_N, prefill_warps
    from .quant import layout_constexprs, quant_block_n
    from .tiles import tier_args

    out = []
    fp = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
    for spec in ("K8V4", "K4V2", "K2V1", "FP16"):
        lay = _layouts(spec, "llama3")[0]
        out.append(Case(f"quantize {spec} d128", "quant", "_quantize_kernel",
                        {"k_ptr": "*fp16", "v_ptr": "*fp16", "page_ptr": "*i32", "slot_ptr": "*i32", "pos_ptr": "*i32",
                             "score_ptr": "*fp32", "pool": "*u8", "err": "*i32"},
                        dict(layout_constexprs(lay), BLOCK_N=quant_block_n(128)),
                        options={"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False}))
    lay = _layouts("K4V2", "llama3")[0]
    out.append(Case("dequantize K4V2 d128", "quant", "_dequantize_kernel",
                    {"pool": "*u8", "page_ptr": "*i32", "slot_ptr": "*i32", "k_out": "*fp32", "v_out": "*fp32",
                         "score_out": "*fp32", "pos_out": "*i32"}, dict(layout_constexprs(lay), BLOCK_N=16)))

    def decode(spec, model, dname="fp16", save=False, direct=False, low_group_size=None):
        f, g, _ = MODELS[model]
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dname]
        targs = tier_args(_layouts(spec, model, dtype, low_group_size=low_group_size))
        dot_t = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[dname]
        prec = "ieee" if dname == "fp32" else "tf32"
        tag = ("+scores" if save else "") + (" direct" if direct else "") + ("" if dname == "fp16" else f" {dname}")
        tag += "" if low_group_size is None else f" low-gs{low_group_size}"
        return Case(f"decode {spec} d{f} G{g}{tag}", "paged_attention", "_decode_kernel",
                    {"q_ptr": fp[dname], "qpos_ptr": "*i32", "pool": "*u8", "tab_ptr": "*i32", "np_ptr": "*i32",
                         "len_ptr": "*i32", "part_acc": "*fp32", "part_ml": "*fp32", "out_ptr": fp[dname], "lse_ptr": "*fp32",
                         "lg_ptr": "*fp32"},
                    dict(targs, G=g, G_PAD=group_pad(g), BLOCK_N=BLOCK_N_DECODE, DOT=dot_t, PREC=prec,
                         SAVE_LOGITS=save, DIRECT=direct), divisible=("stride_qb", "stride_qh"))

    for spec in ("FP16", "K8V8", "K8V4", "K4V2", "K8V4-K4V2"):
        out.append(decode(spec, "llama3"))
    out.append(decode("K8V4-K4V2", "llama3", save=True))
    out.append(decode("K8V4-K4V2", "llama3", direct=True))
    out.append(decode("K8V4-K4V2", "smollm2"))
    out.append(decode("K8V4-K4V2", "smollm2", save=True, low_group_size=32))
    out.append(decode("K8V4", "smollm2", dname="fp32"))
    out.append(decode("K8V4-K4V2", "llama3", dname="bf16"))
    out.append(Case("decode reduce d128 G4", "paged_attention", "_decode_reduce_kernel",
                    {"part_acc": "*fp32", "part_ml": "*fp32", "out_ptr": "*fp16", "lse_ptr": "*fp32"},
                    {"G": 4, "G_PAD": 16, "F": 128}))
    targs = tier_args(_layouts("K8V4-K4V2", "llama3"))
    out.append(Case("score update K8V4-K4V2", "paged_attention", "_score_update_kernel",
                    {"lg_ptr": "*fp32", "lse_ptr": "*fp32", "qpos_ptr": "*i32", "qvalid_ptr": "*i32", "pool": "*u8",
                         "tab_ptr": "*i32", "len_ptr": "*i32"},
                    {"G": 4, "G_PAD": 16, "PAGE_SIZE": targs["PAGE_SIZE"], "BLOCK_N": 64, "HAS_LOW": True,
                         "HI": targs["HI"], "LO": targs["LO"]}))
    for spec in ("FP16", "K8V4-K4V2"):
        targs = tier_args(_layouts(spec, "llama3"))
        common = dict(targs, G=4, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT=tl.float16, PREC="tf32")
        out.append(Case(f"prefill {spec} d128 G4", "prefill_attention", "_prefill_kernel",
                        {"q_ptr": "*fp16", "qpos_ptr": "*i32", "pool": "*u8", "tab_ptr": "*i32", "len_ptr": "*i32",
                             "out_ptr": "*fp16", "lse_ptr": "*fp32"}, common,
                        divisible=("stride_qb", "stride_qh", "stride_qq"),
                        options={"num_warps": prefill_warps(128), "num_stages": 2}))
    targs = tier_args(_layouts("K8V4-K4V2", "llama3"))
    out.append(Case("received K8V4-K4V2 d128 G4", "prefill_attention", "_received_kernel",
                    {"q_ptr": "*fp16", "qpos_ptr": "*i32", "qv_ptr": "*i32", "lse_ptr": "*fp32", "pool": "*u8",
                         "tab_ptr": "*i32", "len_ptr": "*i32", "out_h": "*fp32", "out_l": "*fp32"},
                    dict(targs, G=4, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DOT=tl.float16, PREC="tf32"),
                    divisible=("stride_qb", "stride_qh", "stride_qq"),
                    options={"num_warps": prefill_warps(128), "num_stages": 2}))
    out += act_to_kv_cases()
    from .page_alloc import BLOCK as ABLOCK

    out.append(Case("page alloc grow", "page_alloc", "_grow_kernel",
                    {"extra_ptr": "*i32", "npages_ptr": "*i32", "tables_ptr": "*i32", "ring_ptr": "*i32"},
                    {"BLOCK": ABLOCK}))
    out.append(Case("page alloc shrink", "page_alloc", "_shrink_kernel",
                    {"drop_ptr": "*i32", "npages_ptr": "*i32", "tables_ptr": "*i32", "ring_ptr": "*i32"},
                    {"BLOCK": ABLOCK}))
    return out


# name -> (hidden, KV heads, head_dim, norm, bias, k_norm, rope) of real layer shapes
ACT_MODELS = {"llama3-8b": (4096, 8, 128, 1, False, False, True), "qwen3-8b": (4096, 8, 128, 1, False, True, True),
              "opt-13b": (5120, 40, 128, 2, True, False, False), "smollm2": (576, 3, 64, 1, False, False, True)}


def act_to_kv_cases() -> list[Case]:
    """The fused ACT->KV projection for each layer shape of :data:`ACT_MODELS` (fp16), plus fp32 SmolLM2."""
    from .act_to_kv import BLOCK_M, act_block_k

    out = []
    for name, (d, h, f, norm, bias, knorm, rope) in ACT_MODELS.items():
        for dname in ("fp16", "fp32") if name == "smollm2" else ("fp16",):
            ptr = {"fp16": "*fp16", "fp32": "*fp32"}[dname]
            args = ("a_ptr", "w_ptr", "b_ptr", "nw_ptr", "nb_ptr", "knw_ptr", "cos_ptr", "sin_ptr", "k_out", "v_out")
            dot, prec = (tl.float16, "tf32") if dname == "fp16" else (tl.float32, "ieee")
            out.append(Case(f"act_to_kv {name}" + ("" if dname == "fp16" else f" {dname}"), "act_to_kv",
                            "_act_to_kv_kernel", dict.fromkeys(args, ptr),
                            {"D": d, "H": h, "F": f, "NORM": norm, "HAS_BIAS": bias, "HAS_KNORM": knorm,
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

    mod = importlib.import_module(f"leankit_kernels.{case.module}")
    fn = getattr(mod, case.kernel)
    if not hasattr(fn, "arg_names") or type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError("kernels were imported under TRITON_INTERPRET=1; run the AOT check in a fresh process")
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in case.constexprs:
            sig[name] = "constexpr"
        elif name in case.pointers:
            sig[name] = case.pointers[name]
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

    def grab(pat, default=0):
        mm = re.search(pat, log)
        return int(mm.group(1)) if mm else default

    return {"kernel": case.label, "arch": arch, "regs": grab(r"Used (\d+) registers"),
                "shared": int(k.metadata.shared), "stack": grab(r"(\d+) bytes stack frame"),
                "spill_st": grab(r"(\d+) bytes spill stores"), "spill_ld": grab(r"(\d+) bytes spill loads"),
                "warps": case.options["num_warps"]}


def _run(args):
    i, cc = args
    case = cases()[i]
    try:
        return compile_case(case, cc)
    except Exception as e:  # noqa: BLE001 -- any compile failure is reported in the table and fails the run
        return {"kernel": case.label, "arch": f"sm_{cc}", "error": f"{type(e).__name__}: {e}"[:400]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default 80 90)")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="parallel compiles")
    ap.add_argument("--only", default="", help="compile only kernels whose label contains this text")
    a = ap.parse_args(argv)
    todo = [(i, cc) for i, c in enumerate(cases()) if a.only in c.label for cc in a.arch]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_run, todo))
    else:
        rows = [_run(t) for t in todo]
    hdr = f"{'kernel':<42} {'arch':<7} {'warps':>5} {'regs':>5} {'shared B':>9} {'stack B':>7} {'spill st/ld B':>13}"
    print(hdr)
    print("-" * len(hdr))
    bad = 0
    for r in rows:
        if "error" in r:
            bad += 1
            print(f"{r['kernel']:<42} {r['arch']:<7} COMPILE ERROR: {r['error']}")
            continue
        spill = r["spill_st"] + r["spill_ld"] + r["stack"]
        bad += spill > 0
        flag = "  <-- SPILL" if spill else ""
        print(f"{r['kernel']:<42} {r['arch']:<7} {r['warps']:>5} {r['regs']:>5} {r['shared']:>9} {r['stack']:>7} "
              f"{r['spill_st']:>6}/{r['spill_ld']:<6}{flag}")
    print(f"\n{len(rows)} compiles, {bad} failing (spills or errors)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
