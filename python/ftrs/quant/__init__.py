"""Quantized weights kept in their file's format: block formats, `QuantTensor`, reference
dequantizers (numpy and torch) and the `matmul` that dispatches to the Rust CPU kernels."""

from __future__ import annotations

from ftrs.quant.dequant import TORCH_TYPES, dequantize, dequantize_numpy
from ftrs.quant.formats import (
    FLOAT_TYPES,
    FP8_BLOCK,
    GGUF_FORMATS,
    BlockFormat,
    QuantTensor,
    block_format,
    row_bytes,
    tensor_bytes,
)
from ftrs.quant.matmul import Weight, embedding, kernel_types, matmul, use_kernels

__all__ = ["FLOAT_TYPES", "FP8_BLOCK", "GGUF_FORMATS", "TORCH_TYPES", "BlockFormat",
           "QuantTensor", "Weight", "block_format", "dequantize", "dequantize_numpy",
           "embedding", "kernel_types", "matmul", "row_bytes", "tensor_bytes", "use_kernels"]
