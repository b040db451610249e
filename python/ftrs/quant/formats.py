"""Block formats of quantized weights: GGUF's row/block encodings and FP8 with block scales.

A GGUF quantized matrix of shape (rows, cols) is stored row-major, each row cut into blocks of
`block_elems` consecutive values encoded in `block_bytes` bytes, so a row is
`cols / block_elems * block_bytes` bytes and whole rows can be permuted, sliced and copied as
bytes. Every block carries its own scales: no tensor-wide side data.

`FP8_BLOCK` (FP8 safetensors, `quant_method == "fp8"`) differs: one `float8_e4m3fn` byte per
weight, plus one fp32 scale per (br x bc) tile of the matrix. A `QuantTensor` of this type keeps
both in one byte buffer: the rows*cols weight bytes, then the scales as fp32, row-major over the
tile grid, so the expert pool and the link carry them together.

`MXFP4` (gpt-oss's experts; the OCP microscaling format: 32 e2m1 values sharing one e8m0
power-of-two scale) is kept in ggml's `block_mxfp4` layout, a row/block encoding like the others:
per 32 values, the scale byte, then 16 bytes whose low nibbles are values 0..15 and high nibbles
values 16..31. Safetensors ship it as `*_blocks` (two values per byte, in order) and `*_scales`
tensors; `quant.mxfp4.from_blocks` rearranges those bytes into this layout without changing a
value, so whole rows can be sliced (gpt-oss interleaves gate and up rows) and the block types
share one code path.

`NVFP4` (NVIDIA's FP4: ModelOpt checkpoints, `quant_method == "modelopt"`, `quant_algo ==
"NVFP4"`, and compressed-tensors' `nvfp4-pack-quantized`) is kept in ggml's `block_nvfp4` layout: per 64 values, four e4m3 scale bytes (one per
16 values), then 8 bytes per 16 values whose low nibbles are values 0..7 and high nibbles 8..15.
The format also has one fp32 scale per tensor (`weight_scale_2`), which no block holds: a
`QuantTensor` of this type carries it after its rows (`TAIL_BYTES`), as FP8_BLOCK carries its
scales, and every weight is `e2m1 * block scale * tensor scale`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class BlockFormat(NamedTuple):
    name: str
    block_elems: int  # values per block
    block_bytes: int  # bytes per block


#: GGUF types ftrs keeps in the file's format (sizes as ggml defines them).
GGUF_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("F32", 1, 4),
    BlockFormat("F16", 1, 2),
    BlockFormat("BF16", 1, 2),
    BlockFormat("Q8_0", 32, 34),
    BlockFormat("Q4_0", 32, 18),
    BlockFormat("Q4_1", 32, 20),
    BlockFormat("Q5_0", 32, 22),
    BlockFormat("Q5_1", 32, 24),
    BlockFormat("Q2_K", 256, 84),
    BlockFormat("Q3_K", 256, 110),
    BlockFormat("Q4_K", 256, 144),
    BlockFormat("Q5_K", 256, 176),
    BlockFormat("Q6_K", 256, 210),
    BlockFormat("MXFP4", 32, 17),
    BlockFormat("IQ4_NL", 32, 18),
    BlockFormat("IQ4_XS", 256, 136),
    BlockFormat("NVFP4", 64, 36),
    BlockFormat("IQ1_S", 256, 50),
    BlockFormat("IQ1_M", 256, 56),
    BlockFormat("IQ2_XXS", 256, 66),
    BlockFormat("IQ2_XS", 256, 74),
    BlockFormat("IQ2_S", 256, 82),
    BlockFormat("IQ3_XXS", 256, 98),
    BlockFormat("IQ3_S", 256, 110),
)}
#: Bytes a tensor of the type carries after its rows: NVFP4's fp32 tensor scale.
TAIL_BYTES: dict[str, int] = {"NVFP4": 4}
#: Types whose bytes are a plain float array: they load as ordinary tensors.
FLOAT_TYPES = ("F32", "F16", "BF16")
FP8_BLOCK = "FP8_BLOCK"


def block_format(qtype: str) -> BlockFormat:
    try:
        return GGUF_FORMATS[qtype]
    except KeyError:
        raise ValueError(f"unknown quantization type {qtype!r}") from None


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` values; `cols` must be a whole number of blocks."""
    f = block_format(qtype)
    if cols % f.block_elems:
        raise ValueError(f"{qtype}: row of {cols} values is not a whole number of "
                         f"{f.block_elems}-value blocks")
    return cols // f.block_elems * f.block_bytes


def fp8_scale_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def tensor_bytes(qtype: str, rows: int, cols: int,
                 fp8_block: tuple[int, int] | None = None) -> int:
    """Bytes of a (rows, cols) matrix in `qtype`, every side buffer included."""
    if qtype == FP8_BLOCK:
        if fp8_block is None:
            raise ValueError("FP8_BLOCK needs its block shape")
        gr, gc = fp8_scale_grid(rows, cols, fp8_block)
        return rows * cols + 4 * gr * gc
    return rows * row_bytes(qtype, cols) + TAIL_BYTES.get(qtype, 0)


@dataclass(frozen=True, eq=False)
class QuantTensor:
    """A (rows, cols) weight kept in its file's encoding: `data` is a 1-D uint8 tensor of exactly
    `tensor_bytes(qtype, rows, cols)` bytes (a view into the pool, a device slot, or its own
    memory). No fp32 copy exists; `ftrs.quant.matmul` computes from the bytes."""

    qtype: str
    shape: tuple[int, int]
    data: torch.Tensor  # (nbytes,) uint8
    fp8_block: tuple[int, int] | None = None  # FP8_BLOCK only: the scale tile (br, bc)

    def __post_init__(self) -> None:
        want = tensor_bytes(self.qtype, *self.shape, fp8_block=self.fp8_block)
        if self.data.dtype != torch.uint8 or self.data.dim() != 1 or self.data.numel() != want:
            raise ValueError(f"{self.qtype} {list(self.shape)} needs {want} bytes as a 1-D uint8 "
                             f"tensor, got {self.data.dtype} {list(self.data.shape)}")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @functools.cached_property
    def is_cpu(self) -> bool:
        """Whether the bytes are in host memory (read once: a decode step asks per matmul)."""
        return bool(self.data.is_cpu)

    @functools.cached_property
    def host_array(self) -> np.ndarray:
        """The bytes as a numpy view (CPU only), made once: what the Rust kernels read."""
        return self.data.numpy()

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def to(self, device: torch.device) -> QuantTensor:
        return QuantTensor(self.qtype, self.shape, self.data.to(device), self.fp8_block)

    def rows_view(self) -> torch.Tensor:
        """(rows, row_bytes) uint8 view of the rows (GGUF block types only; without a tail)."""
        rows, cols = self.shape
        return self.data[: rows * row_bytes(self.qtype, cols)].view(rows, -1)

    @property
    def tensor_scale(self) -> float:
        """The tensor-wide scale a type with a tail carries (NVFP4), 1 otherwise."""
        if self.qtype not in TAIL_BYTES:
            return 1.0
        return float(self.data[-4:].cpu().view(torch.float32)[0])

    def __repr__(self) -> str:
        return f"QuantTensor({self.qtype}, {list(self.shape)}, {self.nbytes} bytes, {self.device})"
