"""`quant_matmuls`: several weights of one `x` in one call (a layer's q, k and v) give the
same bits as one `quant_matmul` each; bad sizes and overlapping outputs are refused before
anything is written; `ftrs.quant.matmul.matmuls` takes it for CPU block types only."""

from __future__ import annotations

import numpy as np
import pytest

core = pytest.importorskip("ftrs._core")
torch = pytest.importorskip("torch")

from ftrs.errors import ConfigError  # noqa: E402
from ftrs.quant.dequant import dequantize  # noqa: E402
from ftrs.quant.fixtures import random_blocks  # noqa: E402
from ftrs.quant.formats import QuantTensor  # noqa: E402
from ftrs.quant.matmul import matmul, matmuls, use_kernels  # noqa: E402

COLS = 512
SHAPES = [("Q5_1", 96), ("Q8_0", 32), ("Q6_K", 40)]  # mixed types, as a Q4_K_M file's q/k/v


def _weights(rng: np.random.Generator) -> list[tuple[str, np.ndarray, int]]:
    return [(t, random_blocks(t, rows, COLS, rng).reshape(-1).copy(), rows) for t, rows in SHAPES]


@pytest.mark.parametrize("n", [1, 3, 9])
def test_one_call_equals_one_call_per_weight_bit_for_bit(n: int) -> None:
    rng = np.random.default_rng(n)
    ws = _weights(rng)
    x = rng.standard_normal((n, COLS)).astype(np.float32)
    outs = [np.full((n, rows), np.nan, np.float32) for _, _, rows in ws]
    core.quant_matmuls(x, [(t, w, o, rows) for (t, w, rows), o in zip(ws, outs)], COLS)
    for (t, w, rows), got in zip(ws, outs):
        want = np.empty((n, rows), np.float32)
        core.quant_matmul(t, w, x, want, rows, COLS)
        np.testing.assert_array_equal(got, want)


def test_a_bad_size_is_refused_before_any_output_is_written() -> None:
    rng = np.random.default_rng(0)
    (t0, w0, r0), (t1, w1, r1), _ = _weights(rng)
    x = rng.standard_normal((1, COLS)).astype(np.float32)
    first = np.zeros((1, r0), np.float32)
    with pytest.raises(ConfigError, match="out has"):
        core.quant_matmuls(x, [(t0, w0, first, r0), (t1, w1, np.zeros(r1 + 1, np.float32), r1)],
                           COLS)
    assert not first.any()  # the first weight's result was not written either
    with pytest.raises(ConfigError, match="expected"):
        core.quant_matmuls(x, [(t0, w0, first, r0), (t1, w1[:-1], np.zeros(r1, np.float32), r1)],
                           COLS)
    assert not first.any()


def test_outputs_overlapping_each_other_or_an_input_are_refused() -> None:
    rng = np.random.default_rng(1)
    (t0, w0, r0), (t1, w1, r1), _ = _weights(rng)
    x = rng.standard_normal((1, COLS)).astype(np.float32)
    shared = np.zeros(r0 + r1, np.float32)
    with pytest.raises(ConfigError, match="another out"):
        core.quant_matmuls(x, [(t0, w0, shared[:r0], r0), (t1, w1, shared[r0 - 1:-1], r1)], COLS)
    buf = np.zeros(COLS + r0, np.float32)
    with pytest.raises(ConfigError, match="overlaps x"):
        core.quant_matmuls(buf[:COLS].reshape(1, COLS), [(t0, w0, buf[COLS - 1:-1], r0)], COLS)


def test_matmuls_equals_matmul_and_falls_back_for_what_the_call_does_not_take() -> None:
    rng = np.random.default_rng(2)
    qts = [QuantTensor(t, (rows, COLS), torch.from_numpy(w)) for t, w, rows in _weights(rng)]
    x = torch.randn(2, COLS)
    bias = torch.randn(qts[1].shape[0])
    got = matmuls(x, qts, (None, bias, None))
    for g, w, b in zip(got, qts, (None, bias, None)):
        assert torch.equal(g, matmul(x, w, b))
    plain = torch.randn(8, COLS)  # a float weight among them: each goes its own way
    mixed = matmuls(x, [qts[0], plain], (None, None))
    assert torch.equal(mixed[0], matmul(x, qts[0])) and torch.equal(mixed[1], x @ plain.T)
    with use_kernels(False):  # the reference path, as `matmul` takes it
        ref = matmuls(x, qts, (None, None, None))
    for r, w in zip(ref, qts):
        assert torch.equal(r, x @ dequantize(w, torch.float32).T)
