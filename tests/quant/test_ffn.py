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
from ftrs.layers.moe import combine_experts  # noqa: E402
from ftrs.quant.formats import QuantTensor  # noqa: E402
from ftrs.quant.matmul import (  # noqa: E402
    expert_ffn,
    layer_kernel_args,
    routed_experts_ffn,
    use_kernels,
)

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


def _layer(rng: np.random.Generator, experts: int, hidden: int,
           inter: int) -> list[tuple[QuantTensor, ...]]:
    out = []
    for e in range(experts):
        t = ("Q5_1", "Q4_K", "Q8_0")[e % 3]
        gu = [make_weights(t, inter, hidden, rng) for _ in range(2)]
        d = make_weights("Q6_K", hidden, inter, rng)
        out.append((*(QuantTensor(t, (inter, hidden), torch.from_numpy(w.reshape(-1).copy()))
                      for w in gu),
                    QuantTensor("Q6_K", (hidden, inter), torch.from_numpy(d.reshape(-1).copy()))))
    return out


@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_routed_experts_in_one_call_equal_the_per_expert_path_bit_for_bit(tokens: int) -> None:
    """The layer's one kernel call against `layers.moe.combine_experts` (one `expert_ffn` per
    expert, weighted, added in ascending id): the same floats."""
    rng = np.random.default_rng(10 + tokens)
    hidden, inter, num = 256, 256, 6
    layer = _layer(rng, num, hidden, inter)
    args = layer_kernel_args(layer)
    assert args is not None and args.inter == inter and len(args.handle) == num
    x = torch.randn(tokens, hidden) * 0.1
    ids = torch.stack([torch.randperm(num)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2), dim=-1)
    # grouped in Rust by the layer's handle, and in Python for a build without one
    for a in (args, args._replace(handle=None)):
        got = torch.zeros_like(x)
        routed = routed_experts_ffn(x, ids, weights, a, got)
        assert routed is not None
        order = [e for e, _ in routed]
        assert order == sorted(set(ids.flatten().tolist()))
        assert [n for _, n in routed] == [int((ids == e).sum()) for e in order]
        want = torch.zeros_like(x)
        combine_experts(x, ids, weights, order, lambda e: layer[e], want)
        assert torch.equal(got, want)
        assert got.abs().max() > 0
    with use_kernels(False):  # the reference path is not this call's
        assert routed_experts_ffn(x, ids, weights, args, torch.zeros_like(x)) is None


def test_the_layer_handle_refuses_an_expert_it_does_not_have() -> None:
    rng = np.random.default_rng(12)
    args = layer_kernel_args(_layer(rng, 3, 256, 256))
    assert args is not None
    x, out = torch.randn(1, 256), torch.zeros(1, 256)
    with pytest.raises(ConfigError, match="expert 3 of a layer of 3"):
        args.handle.forward(torch.tensor([[0, 3]]).numpy(), torch.ones(1, 2).numpy(), x.numpy(),
                            out.numpy())
    assert not out.any()  # refused before any work


def test_layer_kernel_args_decline_a_layer_with_a_plain_expert() -> None:
    rng = np.random.default_rng(11)
    layer = _layer(rng, 2, 256, 256)
    assert layer_kernel_args(layer) is not None
    plain = (torch.randn(256, 256), *layer[1][1:])
    assert layer_kernel_args([layer[0], plain]) is None
    assert layer_kernel_args([layer[0], layer[1][:2]]) is None  # no down


def test_routed_experts_reject_a_row_out_of_range_before_writing() -> None:
    rng = np.random.default_rng(12)
    hidden, inter = 96, 256
    gate = make_weights("Q5_1", inter, hidden, rng)
    down = make_weights("Q4_K", hidden, inter, rng)
    x = np.ones((2, hidden), np.float32)
    out = np.full((2, hidden), 7.0, np.float32)
    with pytest.raises(ConfigError, match="row 2"):
        core.quant_experts_ffn([("Q5_1", gate, "Q5_1", gate, "Q4_K", down, [0], [0.5]),
                                ("Q5_1", gate, "Q5_1", gate, "Q4_K", down, [2], [0.5])],
                               x, out, hidden, inter)
    with pytest.raises(ConfigError, match="rows and"):
        core.quant_experts_ffn([("Q5_1", gate, "Q5_1", gate, "Q4_K", down, [0, 1], [0.5])],
                               x, out, hidden, inter)
    assert (out == 7.0).all()
