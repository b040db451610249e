"""The numpy quantizers (Q4_K, Q6_K, Q5_1) read back through the `gguf` package's reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ftrs.quant.kquant import quantize_q4_k, quantize_q5_1, quantize_q6_k

T = gguf.GGMLQuantizationType
X = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32) * 0.1


def _rel_rmse(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(((y - x) ** 2).mean()) / x.std())


@pytest.mark.parametrize("quantize,qtype,bound", [
    (quantize_q4_k, T.Q4_K, 0.09),  # 4 bits with a min: about 1/16 of a range of ~6 sigma
    (quantize_q6_k, T.Q6_K, 0.025),  # 6 bits, symmetric
    (quantize_q5_1, T.Q5_1, 0.045),  # 5 bits with a min
])
def test_quantizer_reads_back_close(quantize: object, qtype: T, bound: float) -> None:
    raw = quantize(X)  # type: ignore[operator]
    assert raw.dtype == np.uint8 and raw.shape[0] == 5
    y = gguf.quants.dequantize(raw, qtype)
    assert y.shape == X.shape
    # a 4-bit Q4_0 written by gguf itself errs more than our 4-bit Q4_K
    q40 = gguf.quants.dequantize(gguf.quants.quantize(X, T.Q4_0), T.Q4_0)
    assert _rel_rmse(y, X) < min(bound, _rel_rmse(q40, X))


def test_q5_1_holds_a_q4_1_grid_exactly() -> None:
    grid = gguf.quants.dequantize(gguf.quants.quantize(X, T.Q4_1), T.Q4_1)
    back = gguf.quants.dequantize(quantize_q5_1(grid), T.Q5_1)
    assert np.array_equal(back, grid)


def test_rows_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 100), np.float32))
