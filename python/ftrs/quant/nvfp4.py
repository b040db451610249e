"""NVFP4 as ModelOpt checkpoints ship it into the `NVFP4` bytes ftrs keeps (ggml's
`block_nvfp4` rows, then the tensor scale; see `quant.formats`).

A shipped (rows, cols) weight is `weight` (rows, cols/2) uint8, byte j holding values 2j (low
nibble) and 2j+1 (high nibble) as e2m1 codes; `weight_scale` (rows, cols/16) float8_e4m3fn, one
scale per 16 values; `weight_scale_2`, one fp32 for the tensor; each value is
`e2m1 * weight_scale * weight_scale_2`. `input_scale` quantizes activations for FP4 tensor cores;
ftrs computes with unquantized activations (weight-only, as GPUs without FP4 units run these
checkpoints) and does not read it. The codes and scale bytes mean the same in both layouts, so the
conversion only moves nibbles: no value is rounded.
"""

from __future__ import annotations

import torch

BLOCK = 64  # values per ggml block: four 16-value groups


def from_modelopt(weight: torch.Tensor, scale: torch.Tensor,
                  tensor_scale: torch.Tensor) -> torch.Tensor:
    """(rows, cols/2) codes, (rows, cols/16) e4m3 scales and the fp32 tensor scale -> the 1-D
    uint8 `NVFP4` bytes of the (rows, cols) weight. ValueError says what does not fit."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"NVFP4 weight must be 2-D uint8, got {weight.dtype} "
                         f"{list(weight.shape)}")
    rows, cols = int(weight.shape[0]), 2 * int(weight.shape[1])
    if cols % BLOCK:
        raise ValueError(f"NVFP4 rows of {cols} values: ftrs keeps NVFP4 in blocks of {BLOCK} "
                         "(ggml's layout), so a row must be a multiple of 64")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (rows, cols // 16):
        raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn {[rows, cols // 16]}, got "
                         f"{scale.dtype} {list(scale.shape)}")
    sb = scale.contiguous().view(torch.uint8)
    if bool((sb >= 0x7F).any()):  # e4m3's NaN, or a sign: no block scale is negative
        raise ValueError("NVFP4 weight_scale holds a negative or NaN scale")
    if tensor_scale.numel() != 1 or not bool(torch.isfinite(tensor_scale.float()).all()):
        raise ValueError(f"NVFP4 weight_scale_2 must be one finite value, got "
                         f"{list(tensor_scale.shape)}")
    b = weight.int()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(rows, cols // 16, 16)  # in order
    packed = (codes[..., :8] | (codes[..., 8:] << 4)).to(torch.uint8)  # (rows, groups, 8)
    blocks = torch.cat([sb.view(rows, cols // BLOCK, 4),
                        packed.reshape(rows, cols // BLOCK, 32)], dim=-1)
    ts = tensor_scale.float().reshape(1).contiguous().view(torch.uint8)
    return torch.cat([blocks.reshape(-1), ts])
