"""llama.cpp's own CPU matmul as a peer for the quantized kernels' benchmarks.

`GgmlMatmul` builds one ggml graph per weight copy (`ggml_mul_mat` of the copy's blocks, as
`ggml_new_tensor_2d` of the GGUF type holds them, against fp32 activations) in a context of
the `libggml-base` / `libggml-cpu` that `llama-cpp-python` ships (the `bench` extra; never a
runtime dependency), and times `ggml_graph_compute_with_ctx` on them: llama.cpp's quantized
dot products, its activation quantization (to Q8_K or Q8_0 per type), its threading. The
plain CPU buffer: the repacked layouts llama.cpp's server may pick for a few types (Q4_0,
IQ4_NL, Q4_K on some CPUs) are not in play, and no i-quant has one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

#: GGUF types this peer runs (ggml knows them all; FP8 and NVFP4 it does not run on a plain
#: context, so they are left out rather than risk an abort inside the C library).
PEER_TYPES = frozenset({
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
    "IQ2_S", "IQ3_XXS", "IQ3_S"})
GGML_TYPE_F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    lib = Path(llama_cpp.__file__).parent / "lib"
    base, cpu = sorted(lib.glob("libggml-base.so*")), sorted(lib.glob("libggml-cpu.so*"))
    if not base or not cpu:
        return None
    b = ctypes.CDLL(str(base[0]), mode=ctypes.RTLD_GLOBAL)
    c = ctypes.CDLL(str(cpu[0]), mode=ctypes.RTLD_GLOBAL)
    vp = ctypes.c_void_p
    b.ggml_init.argtypes, b.ggml_init.restype = [_InitParams], vp
    b.ggml_free.argtypes, b.ggml_free.restype = [vp], None
    b.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    b.ggml_new_tensor_2d.restype = vp
    b.ggml_nbytes.argtypes, b.ggml_nbytes.restype = [vp], ctypes.c_size_t
    b.ggml_get_data.argtypes, b.ggml_get_data.restype = [vp], vp
    b.ggml_mul_mat.argtypes, b.ggml_mul_mat.restype = [vp, vp, vp], vp
    b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [vp], vp
    b.ggml_build_forward_expand.argtypes, b.ggml_build_forward_expand.restype = [vp, vp], None
    c.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    c.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    c.ggml_cpu_init.argtypes, c.ggml_cpu_init.restype = [], None
    c.ggml_cpu_init()
    return b, c


def available() -> bool:
    """Whether llama.cpp's ggml libraries are importable here."""
    return _libs() is not None


class GgmlMatmul:
    """`out = x @ W.T` through ggml for each of `copies` (raw GGUF blocks of `qtype`, `rows` x
    `cols`) and an `n` x `cols` fp32 `x`; `run(k)` computes copy `k % len(copies)`, at most
    `calls` times (each compute takes its work buffer from the context, which ggml aborts the
    process on overrunning: the room is sized for `calls` up front)."""

    def __init__(self, qtype: str, copies: list[np.ndarray], x: np.ndarray, rows: int,
                 cols: int, threads: int, calls: int) -> None:
        import gguf

        libs = _libs()
        if libs is None or qtype not in PEER_TYPES:
            raise RuntimeError(f"no ggml peer for {qtype} here")
        self.base, self.cpu = libs
        self.threads = threads
        n = x.shape[0]
        ttype = int(gguf.GGMLQuantizationType[qtype].value)
        graph_bytes = 4 << 20  # a default graph (2048 nodes) and its tensors, with room
        work = 4 * n * cols + (128 << 10)  # a compute's work buffer: x quantized, per thread
        size = sum(c.nbytes for c in copies) + len(copies) * (graph_bytes + n * rows * 4
                                                              + n * cols * 4) + calls * work
        self.ctx = self.base.ggml_init(_InitParams(size, None, False))
        if not self.ctx:
            raise MemoryError(f"ggml_init of {size} bytes failed")
        self.calls_left = calls
        self.graphs: list[tuple[Any, Any]] = []
        for c in copies:
            w = self.base.ggml_new_tensor_2d(self.ctx, ttype, cols, rows)
            if self.base.ggml_nbytes(w) != c.nbytes:
                raise ValueError(f"{qtype}: ggml holds {self.base.ggml_nbytes(w)} bytes, "
                                 f"the copy {c.nbytes}")
            ctypes.memmove(self.base.ggml_get_data(w), c.ctypes.data, c.nbytes)
            xt = self.base.ggml_new_tensor_2d(self.ctx, GGML_TYPE_F32, cols, n)
            xs = np.ascontiguousarray(x, dtype=np.float32)
            ctypes.memmove(self.base.ggml_get_data(xt), xs.ctypes.data, xs.nbytes)
            out = self.base.ggml_mul_mat(self.ctx, w, xt)
            graph = self.base.ggml_new_graph(self.ctx)
            self.base.ggml_build_forward_expand(graph, out)
            self.graphs.append((graph, out))
        self.shape = (n, rows)

    def run(self, k: int) -> None:
        if self.calls_left == 0:
            raise RuntimeError("the ggml context's room for work buffers is spent")
        self.calls_left -= 1
        graph, _ = self.graphs[k % len(self.graphs)]
        status = self.cpu.ggml_graph_compute_with_ctx(self.ctx, graph, self.threads)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed: status {status}")

    def output(self, k: int) -> np.ndarray:
        """Copy `k`'s last result, `n` x `rows`."""
        _, out = self.graphs[k % len(self.graphs)]
        buf = (ctypes.c_float * (self.shape[0] * self.shape[1])).from_address(
            self.base.ggml_get_data(out))
        return np.frombuffer(buf, dtype=np.float32).reshape(self.shape).copy()

    def close(self) -> None:
        if self.ctx:
            self.base.ggml_free(self.ctx)
            self.ctx = None
