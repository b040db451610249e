"""The i-quants of three bits and less: the torch dequantizers against ggml's own C decode
(`dequantize_row_*` of the `libggml-base` that `llama-cpp-python` ships, where installed), bit
for bit, and the computed sign table against the `gguf` package's. Against the `gguf` package's
numpy decode they are held by test_dequant.py, with every other type."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from ftrs.quant import QuantTensor, dequantize
from ftrs.quant.fixtures import random_blocks
from ftrs.quant.iquant import IQ_TYPES, _sign_bits


def _ggml_base() -> ctypes.CDLL:
    llama_cpp = pytest.importorskip("llama_cpp")
    found = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so*"))
    if not found:
        pytest.skip("llama_cpp ships no libggml-base here")
    return ctypes.CDLL(str(found[0]))


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_torch_decode_equals_ggml_c_decode(qtype: str) -> None:
    lib = _ggml_base()
    rows, cols = 5, 512
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(7)).reshape(-1).copy()
    ours = dequantize(QuantTensor(qtype, (rows, cols), torch.from_numpy(raw)))
    theirs = np.zeros(rows * cols, dtype=np.float32)
    fn = getattr(lib, f"dequantize_row_{qtype.lower()}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    fn(raw.ctypes.data, theirs.ctypes.data, rows * cols)
    assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0
    assert torch.equal(ours.reshape(-1), torch.from_numpy(theirs))


def test_sign_table_is_the_formats() -> None:
    import gguf

    table = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    bits = (table[:, None] >> np.arange(8)) & 1
    assert torch.equal(_sign_bits(torch.device("cpu")),
                       torch.from_numpy(np.where(bits == 0, 1.0, -1.0).astype(np.float32)))
