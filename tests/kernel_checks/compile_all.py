"""Compile every Triton kernel for NVIDIA targets on the CPU (no GPU needed: Triton lowers to
PTX in process and assembles with the ptxas it ships). Run as a script without
TRITON_INTERPRET; prints one line per kernel variant and exits non-zero on the first failure.

    python tests/kernel_checks/compile_all.py [--quick] [ARCH ...]    # default: 80 86 90
    (86: the RTX 30 series)
    (--quick: the bf16 norm, rotary, attention and unquantized/Q8_0 MoE kernels only)
"""

from __future__ import annotations

import sys
import time
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ftrs.kernels import attention, moe, norm

FLOATS = ("eps", "scale")


def signature(fn: Any, ptrs: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = ptrs.get(p.name, ptrs["*"])
        else:
            sig[p.name] = "fp32" if p.name in FLOATS else "i32"
    missing = {p.name for p in fn.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"{fn.__name__}: constexprs {missing} not given"
    return sig


def variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    for dt in ("bf16", "fp16", "fp32"):
        out.append((f"rms_norm {dt}", norm._rms_norm_kernel, {"*": f"*{dt}"},
                    {"HAS_RES": True, "BLOCK": 1024}))
        out.append((f"rotary {dt}", norm._rotary_kernel,
                    {"*": f"*{dt}", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64"},
                    {"HALF": 64, "BLOCK": 64, "BLOCK_H": 16}))
        prec = "ieee" if dt == "fp32" else "tf32"
        for int8 in (False, True):  # a plain cache; an int8 one with its fp32 scales
            kv = {"k_ptr": "*i8", "v_ptr": "*i8", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
            out.append((f"paged_attention{' int8-KV' if int8 else ''} {dt}",
                        attention._paged_attn_kernel,
                        {"*": f"*{dt}", "table_ptr": "*i32", "q_start_ptr": "*i32",
                         "q_len_ptr": "*i32", "ctx_len_ptr": "*i32", **(kv if int8 else {})},
                        {"PAGE": 16, "GP": 4, "BLOCK_Q": 4, "BLOCK_N": 32, "BLOCK_D": 64,
                         "UPCAST": False, "PREC": prec, "INT8": int8}))
    weights = {"none": ("*bf16", "*bf16"), "Q8_0": ("*i8", "*fp16"), "FP8_BLOCK": ("*u8", "*fp32"),
               "Q4_K": ("*u8", "*fp16"), "Q5_1": ("*u8", "*fp16"), "Q6_K": ("*u8", "*fp16"),
               "MXFP4": ("*u8", "*u8"), "IQ4_NL": ("*u8", "*fp16"), "IQ4_XS": ("*u8", "*fp16"),
               **{q: ("*u8", "*fp16") for q in ("Q4_0", "Q4_1", "Q5_0", "Q2_K", "Q3_K", "Q5_K",
                                                 "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                                 "IQ3_XXS", "IQ3_S")},
               "NVFP4": ("*u8", "*fp32")}
    cases = [(q, dt, False) for q in weights for dt in (("bf16", "fp32") if q == "none"
                                                          else ("bf16",))]
    cases += [("none", "bf16", True), ("MXFP4", "bf16", True)]  # gpt_oss: biases, clamped SwiGLU
    for qtype, dt, gpt_oss in cases:
        wt, st = weights[qtype]
        w = f"*{dt}" if qtype == "none" else wt
        consts = {"QUANT": moe._QUANT_CODE[qtype], "BR": 128, "BC": 128, "BLOCK_M": 16,
                  "BLOCK_N": 64, "BLOCK_K": 64, "UPCAST": False,
                  "PREC": "ieee" if dt == "fp32" else "tf32", "HAS_BIAS": gpt_oss,
                  "CLAMP": gpt_oss, "ALPHA": 1.702, "LIMIT": 7.0}
        ptrs = {"*": f"*{dt}", "pair_ptr": "*i32", "bslot_ptr": "*i32", "g_ptr": w, "u_ptr": w,
                "d_ptr": w, "gs_ptr": st, "us_ptr": st, "ds_ptr": st, "grid_ptr": "*fp32"}
        tag = f"{qtype}{' gpt_oss' if gpt_oss else ''} {dt}"
        for name, fn in (("gate_up", moe._moe_gate_up_kernel), ("down", moe._moe_down_kernel)):
            own = {p.name for p in fn.params if p.is_constexpr}
            out.append((f"moe {name} {tag}", fn, ptrs,
                        {k: v for k, v in consts.items() if k in own}))
    return out


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    archs = [int(a) for a in sys.argv[1:] if a != "--quick"] or [80, 86, 90]
    chosen = [v for v in variants()
              if not quick or (v[0].endswith("bf16")
                               and not any(t in v[0] for t in ("FP8", "Q4_K", "Q5_1", "Q6_K")))]
    for arch in archs:
        for name, fn, ptrs, consts in chosen:
            t0 = time.perf_counter()
            src = ASTSource(fn, signature(fn, ptrs, consts), constexprs=consts)
            triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"enable_fp_fusion": False})
            print(f"sm_{arch} {name}: ok ({time.perf_counter() - t0:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
