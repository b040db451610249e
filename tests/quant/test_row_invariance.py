"""Which Rust kernels compute an activation row the same whatever rows are beside it.

A seeded request gives the same tokens alone or batched only if every matrix of the model does
(docs/api.md, `seed`). The integer-product kernels do: per 32-block the products are exact
integers, and each row's blocks are summed in one order whatever the group. The AVX2 kernels that
decode to fp32 (F32, F16, BF16, Q4_0, Q5_0: `quant/simd.rs`) keep 4, 2 or 1 accumulator chains
per row by the size of the row's group, so their sums round by the batch: those are the types
docs/api.md names, and the portable family has no such kernel. The oracle is each row computed
alone, by the same family.
"""

from __future__ import annotations

import numpy as np
import pytest

core = pytest.importorskip("ftrs._core")

from ftrs.quant.fixtures import random_blocks  # noqa: E402
from ftrs.quant.formats import tensor_bytes  # noqa: E402
from ftrs.quant.matmul import block_kernel_types  # noqa: E402

#: decoded to fp32 by the AVX2 kernels, in chains set by the group's size (docs/api.md)
GROUP_DEPENDENT = frozenset({"F32", "F16", "BF16", "Q4_0", "Q5_0"})
ROWS, COLS = 48, 512


def _weights(qtype: str, rng: np.random.Generator) -> np.ndarray:
    if qtype in ("F32", "F16", "BF16"):
        w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        if qtype == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
        return w.view(np.uint8).reshape(-1)
    blocks = np.ascontiguousarray(random_blocks(qtype, ROWS, COLS, rng)).view(np.uint8).reshape(-1)
    tail = tensor_bytes(qtype, ROWS, COLS) - blocks.size  # NVFP4's tensor scale
    return np.concatenate([blocks, np.frombuffer(np.float32(0.5).tobytes(), np.uint8)[:tail]])


@pytest.mark.parametrize("family", core.quant_kernels())
def test_every_integer_kernel_computes_a_row_the_same_in_any_batch(family: str) -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((40, COLS)).astype(np.float32)
    claimed = sorted(t for t in block_kernel_types()
                     if family == "portable" or t not in GROUP_DEPENDENT)
    assert {"Q4_K", "Q6_K", "Q8_0", "Q5_1"} <= set(claimed)  # the demo's Q4_K_M file
    for qtype in claimed:
        w = _weights(qtype, rng)
        alone = np.empty((40, ROWS), np.float32)
        for i in range(40):
            core.quant_matmul(qtype, w, x[i:i + 1], alone[i:i + 1], ROWS, COLS, 1, family)
        for n in (2, 3, 5, 8, 9, 17, 40):
            out = np.empty((n, ROWS), np.float32)
            core.quant_matmul(qtype, w, x[:n], out, ROWS, COLS, n, family)
            np.testing.assert_array_equal(out, alone[:n], err_msg=f"{qtype} {family} n={n}")
