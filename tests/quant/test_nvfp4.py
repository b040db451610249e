"""NVFP4: ggml's `block_nvfp4` rows plus the fp32 tensor scale (`ftrs.quant.formats`).

Oracles: `gguf.quants.dequantize` (gguf-py's decoder of the blocks) times the tensor scale, and
for the ModelOpt conversion the format's definition written out here: value =
e2m1(code) * e4m3(weight_scale) * weight_scale_2, codes two a byte in order (low nibble first).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
core = pytest.importorskip("ftrs._core")

from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from ftrs.quant import QuantTensor, dequantize, embedding, kernel_types, matmul  # noqa: E402
from ftrs.quant.dequant import dequantize_numpy  # noqa: E402
from ftrs.quant.fixtures import random_blocks  # noqa: E402
from ftrs.quant.nvfp4 import from_modelopt  # noqa: E402

if not hasattr(gguf.GGMLQuantizationType, "NVFP4"):  # the oracle needs gguf >= 0.19
    pytest.skip("this gguf package has no NVFP4", allow_module_level=True)
NV = gguf.GGMLQuantizationType.NVFP4
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def random_nvfp4(rows: int, cols: int, rng: np.random.Generator,
                 tensor_scale: float = 0.0371) -> tuple[np.ndarray, QuantTensor]:
    """Random blocks (scale bytes 0..0x7F: zero, subnormals, 0x7F's zero, the largest) as
    (rows, row bytes), and the `QuantTensor` with the tensor scale after them."""
    raw = random_blocks("NVFP4", rows, cols, rng)
    raw[0, :4] = [0x00, 0x03, 0x7F, 0x7E]
    tail = np.frombuffer(np.float32(tensor_scale).tobytes(), np.uint8)
    data = torch.from_numpy(np.concatenate([raw.reshape(-1), tail]))
    return raw, QuantTensor("NVFP4", (rows, cols), data)


def gguf_reference(raw: np.ndarray, tensor_scale: float) -> torch.Tensor:
    blocks = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, NV), dtype=np.float32))
    return blocks * torch.tensor(tensor_scale, dtype=torch.float32)


def test_block_size_is_ggmls() -> None:
    assert core.quant_block_info("NVFP4") == GGML_QUANT_SIZES[NV] == (64, 36)


def test_every_decoder_equals_gguf_times_the_tensor_scale_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    raw, w = random_nvfp4(6, 192, rng)
    ref = gguf_reference(raw, 0.0371)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert torch.equal(dequantize(w), ref)  # torch
    assert torch.equal(dequantize_numpy(w), ref)  # gguf's blocks, then the tail
    out = np.full((6, 192), np.nan, np.float32)
    core.quant_dequantize("NVFP4", w.data.numpy(), out, 6, 192)  # Rust
    assert np.array_equal(out, ref.numpy())
    assert w.tensor_scale == pytest.approx(0.0371, rel=1e-7)


@pytest.mark.parametrize("kernel", ["auto", *core.quant_kernels()])
def test_matmul_is_the_float64_product_within_fp32_accumulation(kernel: str) -> None:
    rng = np.random.default_rng(2)
    cols = 320
    for rows, n in [(7, 1), (9, 8), (5, 11)]:
        raw, w = random_nvfp4(rows, cols, rng, tensor_scale=0.37)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        out = np.full((n, rows), np.nan, np.float32)
        core.quant_matmul("NVFP4", w.data.numpy(), x, out, rows, cols, 2, kernel)
        wf = gguf_reference(raw, 0.37).double().numpy()
        exact = x.astype(np.float64) @ wf.T
        tol = (cols + 4) * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(wf).T)
        if core.quant_rounds_activations("NVFP4", kernel):
            # x as two int8 digits per 32-block: half a step of the low digit, max|x| / 64516
            # (1 % more for the fp32 rounding of x / d), times each weight
            amax = np.abs(x.astype(np.float64)).reshape(n, -1, 32).max(axis=2)
            tol = tol + np.repeat(amax / 64516 * 1.01, 32, axis=1) @ np.abs(wf).T
        assert (np.abs(out - exact) <= tol).all(), kernel
    if kernel == "auto":  # ftrs.quant.matmul is this call
        assert "NVFP4" in kernel_types()
        assert torch.equal(matmul(torch.from_numpy(x), w), torch.from_numpy(out))


def test_a_weight_without_its_tensor_scale_is_refused() -> None:
    raw, _ = random_nvfp4(2, 64, np.random.default_rng(3))
    out = np.zeros((1, 2), np.float32)
    with pytest.raises(Exception, match="tensor scale"):
        core.quant_matmul("NVFP4", raw.reshape(-1), np.ones((1, 64), np.float32), out, 2, 64)
    with pytest.raises(ValueError, match="needs 76 bytes"):
        QuantTensor("NVFP4", (2, 64), torch.from_numpy(raw.reshape(-1).copy()))


def test_embedding_rows_carry_the_tensor_scale() -> None:
    raw, w = random_nvfp4(9, 128, np.random.default_rng(4), tensor_scale=2.5)
    ids = torch.tensor([[4, 0], [8, 4]])
    assert torch.equal(embedding(ids, w), gguf_reference(raw, 2.5)[ids])


def modelopt_tensors(rows: int, cols: int, rng: np.random.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = torch.from_numpy(rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8))
    scale = torch.from_numpy(rng.integers(0, 0x7F, (rows, cols // 16), dtype=np.uint8))
    return weight, scale.view(torch.float8_e4m3fn), torch.tensor(0.0123, dtype=torch.float32)


def by_definition(weight: torch.Tensor, scale: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    rows = weight.shape[0]
    b = weight.int()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(rows, -1)  # value 2j, then 2j + 1
    mag = torch.tensor(E2M1)[codes & 7]
    values = torch.where(codes >= 8, -mag, mag)
    s = scale.float().repeat_interleave(16, dim=1)  # torch's own e4m3 decode
    return (values * s) * ts  # the block product is exact; the tensor scale rounds once


def test_modelopt_tensors_convert_without_changing_a_value() -> None:
    rng = np.random.default_rng(5)
    weight, scale, ts = modelopt_tensors(5, 192, rng)
    data = from_modelopt(weight, scale, ts)
    w = QuantTensor("NVFP4", (5, 192), data)
    assert torch.equal(dequantize(w), by_definition(weight, scale, ts))


@pytest.mark.parametrize(("change", "needle"), [
    ("cols", "multiple of 64"),
    ("negative", "negative or NaN"),
    ("nan", "negative or NaN"),
    ("scale-shape", "weight_scale must be"),
    ("tensor-scale", "one finite value"),
])
def test_modelopt_tensors_that_do_not_fit_say_why(change: str, needle: str) -> None:
    weight, scale, ts = modelopt_tensors(3, 128, np.random.default_rng(6))
    if change == "cols":
        weight, scale = weight[:, :40], scale[:, :5]
    elif change in ("negative", "nan"):
        s = scale.view(torch.uint8).clone()
        s[1, 2] = 0xB8 if change == "negative" else 0x7F
        scale = s.view(torch.float8_e4m3fn)
    elif change == "scale-shape":
        scale = scale[:, :4]
    else:
        ts = torch.tensor([float("inf")])
    with pytest.raises(ValueError, match=needle):
        from_modelopt(weight, scale, ts)
