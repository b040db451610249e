"""Quantized blocks: the torch dequantizers against the `gguf` package's numpy reference, the
FP8 block dequantizer against the definition, and `matmul`'s dispatch against dequantize+linear."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftrs.quant import (
    FP8_BLOCK,
    QuantTensor,
    dequantize,
    dequantize_numpy,
    embedding,
    kernel_types,
    matmul,
    tensor_bytes,
    use_kernels,
)
from ftrs.quant.fixtures import RANDOM_TYPES, random_blocks
from ftrs.quant.formats import block_format


def _qt(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    return QuantTensor(qtype, (rows, cols), torch.from_numpy(raw.reshape(-1).copy()))


def _cols(qtype: str) -> int:
    return 3 * block_format(qtype).block_elems if qtype != FP8_BLOCK else 96  # three blocks


@pytest.mark.parametrize("qtype", RANDOM_TYPES)
def test_torch_dequantizer_equals_gguf_reference(qtype: str) -> None:
    w = _qt(qtype, 7, _cols(qtype))  # odd row count
    ours = dequantize(w)
    ref = dequantize_numpy(w)
    assert ours.shape == ref.shape == (7, _cols(qtype))
    assert torch.isfinite(ref).all()
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_quantized_values_roundtrip(qtype: str) -> None:
    import gguf

    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
    w = QuantTensor(qtype, (3, 64), torch.from_numpy(raw.reshape(-1).copy()))
    back = dequantize(w)
    # the reference round trip, and a sanity bound: at most one quantization step per value
    assert torch.equal(back, torch.from_numpy(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])))
    assert (back - torch.from_numpy(x)).abs().max().item() < 0.5


def test_quant_tensor_checks_its_byte_count() -> None:
    with pytest.raises(ValueError, match="needs 68 bytes"):
        QuantTensor("Q8_0", (2, 32), torch.zeros(67, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole number"):
        tensor_bytes("Q4_K", 2, 100)


def _fp8(rows: int, cols: int, block: tuple[int, int], seed: int = 0
         ) -> tuple[QuantTensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(rows, cols, generator=g) * 2).to(torch.float8_e4m3fn)
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    s = torch.rand(gr, gc, generator=g) * 0.1 + 0.01
    data = torch.cat([w8.view(torch.uint8).reshape(-1), s.view(torch.uint8).reshape(-1)])
    return QuantTensor(FP8_BLOCK, (rows, cols), data, block), w8, s


def test_fp8_block_dequantizer_scales_each_tile() -> None:
    w, w8, s = _fp8(10, 12, (4, 8))  # partial tiles at both edges
    ours = dequantize(w)
    ref = torch.empty(10, 12)
    for r in range(10):
        for c in range(12):
            ref[r, c] = w8[r, c].float() * s[r // 4, c // 8]
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("qtype", [*RANDOM_TYPES, FP8_BLOCK])
def test_reference_matmul_is_dequantize_then_linear(qtype: str) -> None:
    w = _fp8(9, 256, (4, 128))[0] if qtype == FP8_BLOCK else _qt(qtype, 9, _cols(qtype))
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(2))
    with use_kernels(False):
        y = matmul(x, w)
    assert torch.equal(y, x @ dequantize(w).T)


@pytest.mark.parametrize("qtype", RANDOM_TYPES)
def test_kernel_matmul_matches_reference(qtype: str) -> None:
    if qtype not in kernel_types():
        pytest.skip(f"no CPU kernel for {qtype} in this build")
    w = _qt(qtype, 33, _cols(qtype), seed=3)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(4))
    ref = x.double() @ dequantize(w).double().T
    y = matmul(x, w)
    # fp32 accumulation over `cols` products (the kernel may also round x to 8 bits per block,
    # as ggml's dot products do): relative to the sum of |products|, 1% covers both
    bound = (x.abs().double() @ dequantize(w).abs().double().T) * 1e-2
    assert ((y.double() - ref).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("shape", [(9, 256, (4, 128)), (130, 300, (128, 128)), (7, 48, (32, 32))])
def test_fp8_kernel_matmul_is_the_dequantized_weights_summed_in_fp32(
        shape: tuple[int, int, tuple[int, int]]) -> None:
    rows, cols, block = shape
    w = _fp8(rows, cols, block, seed=rows)[0]
    assert FP8_BLOCK in kernel_types()
    for n in (1, 3, 9):
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
        wf = dequantize(w).double()
        ref = x.double() @ wf.T
        y = matmul(x, w)
        # the reference's fp32 weights (n > 1: the row buffer holds them; n = 1: each tile's
        # sum meets its scale once): fp32 roundings of the sums alone
        bound = (x.abs().double() @ wf.abs().T) * (cols + 4) * torch.finfo(torch.float32).eps
        assert ((y.double() - ref).abs() <= bound + 1e-30).all(), (shape, n)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("qtype", [t for t in RANDOM_TYPES if t != FP8_BLOCK])
def test_embedding_of_a_quantized_table_decodes_the_rows_asked_for(qtype: str,
                                                                     kernels: bool) -> None:
    w = _qt(qtype, 11, _cols(qtype), seed=5)
    ids = torch.tensor([[3, 0], [10, 3]])
    with use_kernels(kernels):
        got = embedding(ids, w, torch.float32)
    want = dequantize_numpy(w)[ids]  # the gguf package's reference, whole table
    assert got.shape == (2, 2, w.shape[1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mxfp4_dequantizer_equals_gguf_reference() -> None:
    # random bytes are valid MXFP4 blocks; exponents 0..254 include the subnormal halves (0, 1)
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(7 * 3, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(0, 255, size=7 * 3)
    raw[:4, 0] = [0, 1, 2, 127]
    w = QuantTensor("MXFP4", (7, 96), torch.from_numpy(raw.reshape(-1).copy()))
    ours, ref = dequantize(w), dequantize_numpy(w)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert torch.equal(ours, ref)


def test_shipped_mxfp4_blocks_decode_as_transformers_does() -> None:
    from ftrs.quant.mxfp4 import from_blocks

    convert_moe_packed_tensors = pytest.importorskip(
        "transformers.integrations.mxfp4").convert_moe_packed_tensors

    rng = np.random.default_rng(6)
    blocks = torch.from_numpy(rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(110, 140, size=(3, 5, 2), dtype=np.uint8))
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, cols, rows)
    rows = from_blocks(blocks, scales)
    assert rows.shape == (3, 5, 2 * 17)
    for e in range(3):
        w = QuantTensor("MXFP4", (5, 64), rows[e].reshape(-1).contiguous())
        assert torch.equal(dequantize(w), ref[e].t())
    with pytest.raises(ValueError, match="do not match"):
        from_blocks(blocks, scales[..., :1])


def test_mxfp4_matmul_runs_the_kernel_and_the_reference_path_agrees() -> None:
    rng = np.random.default_rng(8)
    raw = rng.integers(0, 256, size=(4 * 2, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(120, 130, size=8)
    w = QuantTensor("MXFP4", (4, 64), torch.from_numpy(raw.reshape(-1).copy()))
    x = torch.randn(3, 64)
    ref = torch.nn.functional.linear(x, dequantize(w))
    with use_kernels(False):  # dequantize, then F.linear
        assert torch.equal(matmul(x, w), ref)
    # with kernels: the Rust kernel itself (its accuracy: tests/quant/test_kernels.py)
    assert "MXFP4" in kernel_types()
    from ftrs import _core

    out = np.full((3, 4), np.nan, np.float32)
    _core.quant_matmul("MXFP4", raw.reshape(-1), x.numpy(), out, 4, 64, 1)
    assert torch.equal(matmul(x, w), torch.from_numpy(out))
