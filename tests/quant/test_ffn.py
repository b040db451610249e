"""The fused expert FFN (`ftrs._core.quant_expert_ffn`, `ftrs.quant.matmul.expert_ffn`) against a
float64 reference on the `gguf`-dequantized weights.

Bound, from the kernels' own (see test_kernels.py): gate and up outputs are each within
`tolerance()` of the exact products (`eg`, `eu`); `silu` has slope at most 1.1, so
`h = silu(g) u` is within `1.1 eg (|u| + eu) + |silu(g)| eu`, plus a few fp32 roundings of the
exponential and the product (`8 eps |silu(g) u|`); the down output is within the kernel bound on
those `h` plus `|W_down| @ eh`. A wrong activation, a swapped gate/up or a layout slip moves the
result by O(|h| |w|), far above it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

core = pytest.importorskip("ftrs._core")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from ftrs.errors import ConfigError  # noqa: E402
from ftrs.quant.formats import QuantTensor  # noqa: E402
from ftrs.quant.matmul import expert_ffn  # noqa: E402

from .test_kernels import make_weights, offsets, reference, tolerance  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def silu(t: np.ndarray) -> np.ndarray:
    return t / (1.0 + np.exp(-t))


def ffn_bound(x: np.ndarray, wts: list[tuple[str, np.ndarray]],
              kernel: str) -> tuple[np.ndarray, np.ndarray]:
    """(float64 reference output, its error bound) for the FFN of `wts` = gate, up, down."""
    (tg, g_w), (tu, u_w), (td, d_w) = wts
    gf, uf, df = reference(tg, g_w), reference(tu, u_w), reference(td, d_w)
    x64 = x.astype(np.float64)
    g, u = x64 @ gf.T.astype(np.float64), x64 @ uf.T.astype(np.float64)
    eg = tolerance(x, gf, offsets(tg, g_w), core.quant_rounds_activations(tg, kernel))
    eu = tolerance(x, uf, offsets(tu, u_w), core.quant_rounds_activations(tu, kernel))
    h = silu(g) * u
    eh = 1.1 * eg * (np.abs(u) + eu) + np.abs(silu(g)) * eu + 8 * EPS32 * np.abs(h)
    hmag = (np.abs(h) + eh).astype(np.float32)
    out = h @ df.T.astype(np.float64)
    bound = (tolerance(hmag, df, offsets(td, d_w), core.quant_rounds_activations(td, kernel))
             + eh @ np.abs(df.astype(np.float64)).T)
    return out, bound


@pytest.mark.parametrize("kernel", core.quant_kernels())
@pytest.mark.parametrize("types", [("Q5_1", "Q5_1", "Q4_K"), ("Q4_K", "Q4_K", "Q6_K"),
                                   ("Q8_0", "Q8_0", "Q8_0")])
def test_fused_ffn_equals_reference_within_the_kernel_bounds(types: tuple[str, str, str],
                                                             kernel: str) -> None:
    rng = np.random.default_rng(7)
    hidden, inter = (256, 512) if types[0] == "Q4_K" else (96, 256)
    for n in (1, 3):
        gate = make_weights(types[0], inter, hidden, rng)
        up = make_weights(types[1], inter, hidden, rng)
        down = make_weights(types[2], hidden, inter, rng)
        x = (rng.standard_normal((n, hidden)) * 0.05).astype(np.float32)
        out = np.full((n, hidden), np.nan, np.float32)
        core.quant_expert_ffn(types[0], gate, types[1], up, types[2], down, x, out, hidden,
                              inter, 1, kernel)
        want, bound = ffn_bound(x, [(types[0], gate), (types[1], up), (types[2], down)],
                                kernel)
        err = np.abs(out - want)
        assert (err <= bound).all(), f"{types} n={n}: worst err/bound {(err / bound).max():.3g}"
        assert np.abs(want).max() > 10 * bound.max()  # the bound is not vacuous


def test_python_entry_reads_quant_tensors_and_declines_plain_ones() -> None:
    rng = np.random.default_rng(8)
    hidden, inter = 96, 256
    ws = [make_weights("Q5_1", inter, hidden, rng), make_weights("Q5_1", inter, hidden, rng),
          make_weights("Q4_K", hidden, inter, rng)]
    qts = [QuantTensor(t, s, torch.from_numpy(w.reshape(-1).copy())) for t, s, w in
           zip(("Q5_1", "Q5_1", "Q4_K"), [(inter, hidden), (inter, hidden), (hidden, inter)], ws)]
    x = torch.randn(2, hidden) * 0.05
    got = expert_ffn(x, *qts)
    assert got is not None and got.shape == (2, hidden)
    want, bound = ffn_bound(x.numpy(), list(zip(("Q5_1", "Q5_1", "Q4_K"), ws)), "auto")
    assert (np.abs(got.numpy() - want) <= bound).all()
    plain = torch.randn(inter, hidden)
    assert expert_ffn(x, plain, qts[1], qts[2]) is None


@pytest.mark.parametrize("bad", [{"hidden": 64}, {"inter": 128}, {"x_cols": 95}])
def test_sizes_are_checked_before_out_is_written(bad: dict[str, Any]) -> None:
    rng = np.random.default_rng(9)
    hidden, inter = 96, 256
    gate = make_weights("Q5_1", inter, hidden, rng)
    down = make_weights("Q4_K", hidden, inter, rng)
    x = np.ones((1, bad.get("x_cols", hidden)), np.float32)
    out = np.full((1, hidden), 7.0, np.float32)
    with pytest.raises(ConfigError):
        core.quant_expert_ffn("Q5_1", gate, "Q5_1", gate, "Q4_K", down, x, out,
                              bad.get("hidden", hidden), bad.get("inter", inter))
    assert (out == 7.0).all()
