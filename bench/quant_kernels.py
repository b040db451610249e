"""Quantized CPU kernels: GB/s and GFLOP/s per GGUF type (and MXFP4, NVFP4, FP8_BLOCK in
128x128 tiles) at n = 1 and n = 8, side by side with
a numpy fp32 matmul of the same shape and the host's memcpy bandwidth, measured in one run.

    .venv/bin/python bench/quant_kernels.py [--rows 2048] [--cols 4096] [--threads 0]
    .venv/bin/python bench/quant_kernels.py --demo [--threads 1]

`--demo`: the matmuls of one batch-1 decode token of the demo MoE as its Q4_K_M file holds them
(type, shape and calls per token, read from the GGUF: attention, router, two experts per layer,
the tied Q8_0 LM head); per shape `us_per_call` and `ms_per_token`, and the total, each a median
over `--repeats` passes that take the shapes in turn. `--kernels avx2,avx512` times several
kernel families in the same passes (each shape under each family in turn) and prints each
family's total over the first's (`vs_first`: > 1 is faster).

Each type gets enough distinct copies of a `rows x cols` weight to fill `--working-set` MiB,
cycled through so the weights stream from memory as a model's experts do (not from cache).
Times are medians of `--repeats` passes. Printed as one JSON object:

- `memcpy_gbps`: bytes copied per second by numpy (a copy reads and writes each byte);
- per type and n: `ms`, `gbps` (weight bytes read per second), `gflops` (2 n rows cols / s),
  `bytes_per_weight`, `vs_fp32_numpy` (numpy fp32 time / kernel time: > 1 is faster),
  `vs_f32_kernel` (this kernel's own F32 time / this type's: the decode speed-up a quantized
  model gets over its fp32 form) and `of_memcpy` (gbps / memcpy_gbps);
- with `--reference-path`, also `reference_path_ms` and `kernel_vs_reference_path`: the same
  product through `quant.matmul` with the kernels off (torch dequantizer, then `F.linear`),
  the path a type without a kernel takes (MXFP4 before it had one);
- with `--llama-cpp` (the `bench` extra installed), per GGUF type and n also `llama_cpp_ms`
  and `vs_llama_cpp` (llama.cpp's time over ftrs's: > 1 is ftrs faster): llama.cpp's own
  `ggml_mul_mat` on the same blocks and activations, same threads (`bench/ggml_peer.py`),
  timed in passes alternating with a second timing of ftrs's kernel (whose median is the
  `ftrs_ms` beside it: a shared host drifts), and `llama_cpp_rel_diff`, the largest
  difference of the two outputs over the largest output (both round the activations: ggml
  to 8 bits, ftrs to 15).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ftrs import _core as core
from ftrs.quant.fixtures import random_blocks
from ftrs.quant.iquant import IQ_TYPES, install_grids
from ggml_peer import PEER_TYPES, GgmlMatmul
from ggml_peer import available as peer_available

install_grids(core)  # the i-quants' tables, as `ftrs.quant` hands them to the kernels

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS", "NVFP4", "FP8_BLOCK",
         *IQ_TYPES]
FP8, FP8_TILE = "FP8_BLOCK", (128, 128)  # block-scaled FP8 as DeepSeek / Qwen ship it
# Byte offsets of each block's fp16 scales (ggml block structs): set finite in random blocks.
SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks: random bytes with finite fp16 scales (floats for F32/F16/BF16)."""
    if qtype == "F32":
        return rng.standard_normal(rows * cols, dtype=np.float32).view(np.uint8)
    if qtype in ("F16", "BF16"):
        f = rng.standard_normal(rows * cols, dtype=np.float32)
        if qtype == "F16":
            return f.astype(np.float16).view(np.uint8)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype == FP8:  # finite e4m3 codes of N(0, 1) weights, then the tiles' fp32 scales
        import torch

        normal = torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32))
        w8 = normal.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(-1)
        gr, gc = -(-rows // FP8_TILE[0]), -(-cols // FP8_TILE[1])
        scales = (rng.random(gr * gc, dtype=np.float32) * 0.01 + 0.001).view(np.uint8)
        return np.concatenate([w8, scales])
    if qtype in IQ_TYPES:  # random grid indices, signs and scales under a finite fp16 d
        return random_blocks(qtype, rows, cols, rng).reshape(-1)
    block, nbytes = core.quant_block_info(qtype)
    blocks = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    for off in SCALE_FIELDS.get(qtype, ()):
        scale = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype == "MXFP4":  # e8m0 exponents 2^-10..2^1: finite weights of a trained model's range
        blocks[:, 0] = rng.integers(118, 130, len(blocks), dtype=np.uint8)
    if qtype == "NVFP4":  # e4m3 block scales 2^-3..2^5, then the fp32 tensor scale
        blocks[:, :4] = rng.integers(0x20, 0x60, (len(blocks), 4), dtype=np.uint8)
        return np.concatenate([blocks.reshape(-1), np.array([1e-3], np.float32).view(np.uint8)])
    return blocks.reshape(-1)


def median_time(fn: object, calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in range(calls):
            fn(k)  # type: ignore[operator]
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def reference_path_time(qtype: str, copies: list[np.ndarray], x: np.ndarray, rows: int,
                        cols: int, repeats: int) -> float:
    """`quant.matmul` with the kernels off: dequantize the blocks with the torch dequantizers,
    then `F.linear` (every copy in turn, as the kernel's timing does)."""
    import torch

    from ftrs.quant import QuantTensor, matmul, use_kernels

    tile = FP8_TILE if qtype == FP8 else None
    ws = [QuantTensor(qtype, (rows, cols), torch.from_numpy(c), tile) for c in copies]
    xt = torch.from_numpy(x)
    with use_kernels(False):
        return median_time(lambda k: matmul(xt, ws[k % len(ws)]), len(ws), repeats)


def llama_cpp(qtype: str, copies: list[np.ndarray], x: np.ndarray, rows: int, cols: int,
              call: object, args: argparse.Namespace) -> dict[str, float]:
    """llama.cpp's matmul on the same copies, in passes alternating with ftrs's (`call`)."""
    threads = args.threads or core.quant_threads()
    peer = GgmlMatmul(qtype, copies, x, rows, cols, threads, calls=(args.repeats + 1)
                      * len(copies) + 1)
    try:
        peer.run(0)
        theirs = peer.output(0)
        ours = np.empty_like(theirs)
        core.quant_matmul(qtype, copies[0], x, ours, rows, cols, threads)
        rel = float(np.abs(ours - theirs).max() / max(np.abs(ours).max(), 1e-30))
        t_ours, t_peer = [], []
        for _ in range(args.repeats):
            t_ours.append(median_time(call, len(copies), 1))
            t_peer.append(median_time(peer.run, len(copies), 1))
    finally:
        peer.close()
    mo, mp = statistics.median(t_ours), statistics.median(t_peer)
    return {"ftrs_ms": round(mo * 1e3, 4), "llama_cpp_ms": round(mp * 1e3, 4),
            "vs_llama_cpp": round(mp / mo, 3), "llama_cpp_rel_diff": round(rel, 5)}


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return nbytes / median_time(lambda _: np.copyto(dst, src), 1, repeats) / 1e9


def demo_shapes(top_k: int = 2) -> list[tuple[str, int, int, int]]:
    """`(qtype, rows, cols, calls per decode token)` of the demo's Q4_K_M file at batch 1."""
    import collections

    import gguf

    from ftrs.models.demo import ensure_demo_quant

    reader = gguf.GGUFReader(str(ensure_demo_quant("q4_k_m")))
    count: collections.Counter[tuple[str, int, int]] = collections.Counter()
    for t in reader.tensors:
        shape = [int(v) for v in t.shape]  # ggml order: cols first
        if len(shape) < 2:
            continue
        calls = top_k if t.name.endswith("_exps.weight") else 1
        count[t.tensor_type.name, shape[1], shape[0]] += calls
    return [(q, r, c, k) for (q, r, c), k in sorted(count.items())]


def demo(args: argparse.Namespace) -> dict[str, object]:
    """Times the demo's per-token matmul mix under each of `--kernels` (see the module doc)."""
    kernels = args.kernels.split(",")
    rng = np.random.default_rng(0)
    ws_bytes = args.working_set << 20
    cases = []
    for qtype, rows, cols, calls in demo_shapes():
        w = random_weight(qtype, rows, cols, rng)
        copies = [w.copy() for _ in range(max(2, min(calls, ws_bytes // 8 // w.nbytes)))]
        x = rng.standard_normal((1, cols), dtype=np.float32)
        out = np.empty((1, rows), np.float32)
        cases.append((qtype, rows, cols, calls, copies, x, out))
    times: dict[str, list[list[float]]] = {kern: [[] for _ in cases] for kern in kernels}
    for _ in range(args.repeats):
        for k, (qtype, rows, cols, calls, copies, x, out) in enumerate(cases):
            for kern in kernels:
                t0 = time.perf_counter()
                for j in range(calls):
                    core.quant_matmul(qtype, copies[j % len(copies)], x, out, rows, cols,
                                      args.threads, kern)
                times[kern][k].append((time.perf_counter() - t0) / calls)
    per_kernel: dict[str, object] = {}
    totals: dict[str, float] = {}
    for kern in kernels:
        rows_out = {}
        total = 0.0
        for (qtype, rows, cols, calls, copies, _, _), ts in zip(cases, times[kern]):
            t = statistics.median(ts)
            total += t * calls
            rows_out[f"{qtype} {rows}x{cols}"] = {
                "calls_per_token": calls, "us_per_call": round(t * 1e6, 2),
                "ms_per_token": round(t * calls * 1e3, 3),
                "gbps": round(copies[0].nbytes / t / 1e9, 3)}
        totals[kern] = total
        per_kernel[kern] = {"shapes": rows_out, "matmul_ms_per_token": round(total * 1e3, 3),
                            "vs_first": round(totals[kernels[0]] / total, 3)}
    return {"demo": "Q4_K_M, batch 1", "auto_kernel": core.quant_kernel(),
            "threads": args.threads or core.quant_threads(), "kernels": per_kernel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="0 = the kernels' default")
    ap.add_argument("--working-set", type=int, default=256, help="MiB of weights per type")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--demo", action="store_true", help="the demo's per-token matmul mix")
    ap.add_argument("--reference-path", action="store_true",
                    help="also time each type through quant.matmul's reference path (the torch "
                         "dequantizer, then F.linear): what a type without a kernel runs")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also time llama.cpp's ggml_mul_mat on the same blocks (bench extra)")
    ap.add_argument("--kernels", default="auto",
                    help=f"--demo: kernel families, comma-separated (here: "
                         f"{','.join(core.quant_kernels())})")
    args = ap.parse_args()
    if args.demo:
        print(json.dumps(demo(args), indent=1))
        return
    rows, cols = args.rows, args.cols
    rng = np.random.default_rng(0)
    ws_bytes = args.working_set << 20
    result: dict[str, object] = {
        "rows": rows, "cols": cols, "kernel": core.quant_kernel(),
        "threads": args.threads or core.quant_threads(),
        "memcpy_gbps": round(memcpy_gbps(ws_bytes, args.repeats), 3),
    }
    ref: dict[int, float] = {}
    fp32 = rng.standard_normal((rows, cols), dtype=np.float32)
    fp32_copies = [fp32.copy() for _ in range(max(2, ws_bytes // fp32.nbytes))]
    for n in (1, 8):
        x = rng.standard_normal((n, cols), dtype=np.float32)
        ref[n] = median_time(lambda k, x=x, ws=fp32_copies: x @ ws[k % len(ws)].T,
                             len(fp32_copies), args.repeats)
        result[f"numpy_fp32_n{n}"] = {
            "ms": round(ref[n] * 1e3, 4),
            "gbps": round(fp32.nbytes / ref[n] / 1e9, 3),
            "gflops": round(2 * n * rows * cols / ref[n] / 1e9, 3)}
    del fp32_copies
    memcpy = float(result["memcpy_gbps"])  # type: ignore[arg-type]
    f32_time: dict[int, float] = {}
    for qtype in args.types.split(","):
        w = random_weight(qtype, rows, cols, rng)
        copies = [w.copy() for _ in range(max(2, ws_bytes // w.nbytes))]
        per_type: dict[str, object] = {"bytes_per_weight": round(w.nbytes / (rows * cols), 4)}
        for n in (1, 8):
            x = rng.standard_normal((n, cols), dtype=np.float32)
            out = np.empty((n, rows), np.float32)

            def call(k: int, x: np.ndarray = x, out: np.ndarray = out,
                     copies: list[np.ndarray] = copies, qtype: str = qtype) -> None:
                if qtype == FP8:
                    core.quant_fp8_matmul(copies[k % len(copies)], x, out, rows, cols, FP8_TILE,
                                          args.threads)
                else:
                    core.quant_matmul(qtype, copies[k % len(copies)], x, out, rows, cols,
                                      args.threads)

            t = median_time(call, len(copies), args.repeats)
            if qtype == "F32":
                f32_time[n] = t
            gbps = w.nbytes / t / 1e9
            per_type[f"n{n}"] = {
                "ms": round(t * 1e3, 4), "gbps": round(gbps, 3),
                "gflops": round(2 * n * rows * cols / t / 1e9, 3),
                "vs_fp32_numpy": round(ref[n] / t, 3),
                "vs_f32_kernel": round(f32_time[n] / t, 3) if n in f32_time else None,
                "of_memcpy": round(gbps / memcpy, 3)}
            if args.llama_cpp and qtype in PEER_TYPES and peer_available():
                per_type[f"n{n}"].update(  # type: ignore[attr-defined]
                    llama_cpp(qtype, copies, x, rows, cols, call, args))
            if args.reference_path:
                tr = reference_path_time(qtype, copies, x, rows, cols, args.repeats)
                per_type[f"n{n}"]["reference_path_ms"] = round(tr * 1e3, 4)  # type: ignore[index]
                per_type[f"n{n}"]["kernel_vs_reference_path"] = round(tr / t, 2)  # type: ignore[index]
        result[qtype] = per_type
        del copies
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
