"""MXFP4 as safetensors ship it (gpt-oss: `*_blocks` and `*_scales`) into the `MXFP4` blocks ftrs
keeps (ggml's `block_mxfp4`, see `quant.formats`).

A shipped weight of shape (rows, cols) is `blocks` (rows, cols/32, 16) uint8, byte j of a group
holding values 2j (low nibble) and 2j+1 (high nibble), and `scales` (rows, cols/32) uint8 e8m0
exponents (value = e2m1 x 2**(scale - 127)). The nibble codes and exponents mean the same in both
layouts, so the conversion only moves nibbles: no value is rounded.
"""

from __future__ import annotations

import torch


def from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) blocks and (..., G) scales -> (..., G * 17) uint8 rows of MXFP4 blocks."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                         f"{list(scales.shape)} (blocks are (..., groups, 16))")
    b = blocks.int()
    vals = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # (..., G, 32) codes in order
    packed = (vals[..., :16] | (vals[..., 16:] << 4)).to(torch.uint8)
    out = torch.cat([scales.unsqueeze(-1), packed], dim=-1)  # (..., G, 17)
    return out.flatten(-2)
