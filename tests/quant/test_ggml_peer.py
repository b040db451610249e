"""The Rust kernels against llama.cpp's own CPU matmul (`ggml_mul_mat` of the `libggml` that
`llama-cpp-python` ships, through `bench/ggml_peer.py`, which `bench/quant_kernels.py
--llama-cpp` times): the same blocks, the same activations, the same products within the two
activation roundings. It holds the peer to computing what ftrs computes (a benchmark against
a different product would mean nothing) and the kernels' block layouts to llama.cpp's.

Bound, per output: ggml rounds each activation to 8 bits under one scale per 256 (Q8_K) or
32 (Q8_0) values, off by at most `amax_256 / 254`; ftrs to 15 bits per 32, `amax_32 / 64516`
(`tests/quant/test_kernels.py`); each times `|w|`, plus the fp32 sums' `(cols + 4) eps
sum |x| |w|` for each. A wrong block layout moves an output by O(|x| |w|) per element.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

core = pytest.importorskip("ftrs._core")

from ftrs.quant import QuantTensor, dequantize  # noqa: E402
from ftrs.quant.fixtures import random_blocks  # noqa: E402
from ftrs.quant.iquant import IQ_TYPES, install_grids  # noqa: E402

# loaded from its file: bench/ on sys.path would shadow packages (its kernels.py, transformers')
_spec = importlib.util.spec_from_file_location(
    "ggml_peer", Path(__file__).resolve().parents[2] / "bench" / "ggml_peer.py")
assert _spec is not None and _spec.loader is not None
ggml_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ggml_peer)

install_grids(core)

TYPES = ["Q8_0", "Q4_K", "Q6_K", "IQ4_XS", *IQ_TYPES]


@pytest.fixture(scope="module", autouse=True)
def _needs_ggml() -> None:
    if not ggml_peer.available():
        pytest.skip("llama-cpp-python (the bench extra) is not installed")


def bounds(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, rows) bounds on |ggml - exact| and |ftrs - exact| for activations x (n, cols) and
    weights w (rows, cols)."""
    n, cols = x.shape
    a256 = np.abs(x).reshape(n, -1, 256).max(axis=2).repeat(256, axis=1)
    a32 = np.abs(x).reshape(n, -1, 32).max(axis=2).repeat(32, axis=1)
    aw = np.abs(w).astype(np.float64)
    sums = (cols + 4) * float(np.finfo(np.float32).eps) * (np.abs(x).astype(np.float64) @ aw.T)
    return (a256 / 254 * 1.01) @ aw.T + sums, (a32 / 64516 * 1.01) @ aw.T + sums


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 3])
def test_kernel_equals_llama_cpp_matmul(qtype: str, n: int) -> None:
    rows, cols = 48, 1024
    rng = np.random.default_rng(11 + n)
    raw = random_blocks(qtype, rows, cols, rng).reshape(-1).copy()
    x = rng.standard_normal((n, cols), dtype=np.float32)
    peer = ggml_peer.GgmlMatmul(qtype, [raw], x, rows, cols, threads=1, calls=2)
    try:
        peer.run(0)
        theirs = peer.output(0)
    finally:
        peer.close()
    ours = np.empty((n, rows), np.float32)
    core.quant_matmul(qtype, raw, x, ours, rows, cols, 1)
    w = dequantize(QuantTensor(qtype, (rows, cols), torch.from_numpy(raw))).numpy()
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(exact).max() > 1.0  # a product that can show a layout error
    theirs_bound, ours_bound = bounds(x, w)
    assert (np.abs(theirs - exact) <= theirs_bound).all(), qtype  # the peer computes this product
    diff = np.abs(ours.astype(np.float64) - theirs)
    assert (diff <= theirs_bound + ours_bound).all(), (qtype, float(diff.max()))
