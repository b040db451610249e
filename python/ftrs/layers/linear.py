"""The one dense projection of the decoder: `linear(x, w, bias)`, whatever `w` is.

A plain tensor goes to `F.linear`; a `QuantTensor` (a weight kept in its file's block format)
goes to `ftrs.quant.matmul`: the Rust CPU kernel, or dequantize-then-matmul on a GPU and in the
reference path. Every projection of attention, the dense MLPs, the routed experts and the LM
head goes through here, so a quantized checkpoint needs no other change in the model code.
`embedding` reads rows of a table that may be quantized too (a tied embedding stays in its
file's format on the CPU, so the LM head streams those bytes, not an fp32 copy).
"""

from __future__ import annotations

import torch

from ftrs.quant.matmul import Weight, embedding, matmul, matmuls

__all__ = ["Weight", "embedding", "linear", "linears"]


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x`: (..., in); `w`: (out, in). Returns (..., out) in x's dtype."""
    return matmul(x, w, bias)


def linears(x: torch.Tensor, ws: tuple[Weight, ...], biases: tuple[torch.Tensor | None, ...]
            ) -> list[torch.Tensor]:
    """`[linear(x, w, b) ...]` for several weights of one input (a layer's q, k and v), in one
    kernel call when they are CPU quantized weights."""
    return matmuls(x, ws, biases)
