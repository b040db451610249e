"""The i-quants of two and three bits and less (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S): torch dequantizers, any device, registered beside the others in `dequant`.

Each 256-value super-block holds indices into a grid of 8-value (IQ1/IQ2) or 4-value (IQ3)
vectors, signs, and 4- or 3-bit scales under one fp16 scale (IQ1_M spreads its fp16 over the top
nibbles of its four scale words). The grids are tables of the format, not computable: they are
read from the `gguf` package (ggml's own Python port, already the GGUF reader), once per device,
and handed to the Rust kernels (`install_grids`), which decode the same blocks on the CPU.
The sign tables are computable: entry i of the 128 is i's seven bits with an eighth that makes
the count of ones even. Operations are those of ggml's reference decode, in its order, so on the
CPU these agree with `gguf.quants.dequantize` bit for bit (tests/quant/test_iquant.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ftrs.quant.dequant import _f16, _register

IQ_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
_IQ1_DELTA = 0.125


@functools.cache
def grid(qtype: str, device: torch.device) -> torch.Tensor:
    """(entries, 8 or 4) fp32: the format's grid, as ggml's tables hold it, on `device` (made
    once per device: the fused MoE kernel reads it there)."""
    import gguf

    cls = getattr(gguf.quants, qtype)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(device)


def install_grids(core: Any) -> None:
    """Hands every i-quant's grid to the Rust extension `core` (`ftrs._core`), whose kernels
    refuse the type until then; an extension without i-quant kernels is left alone."""
    if not hasattr(core, "quant_set_grid"):
        return
    for qtype in IQ_TYPES:
        core.quant_set_grid(qtype, grid(qtype, torch.device("cpu")).reshape(-1).tolist())


@functools.cache
def _sign_bits(device: torch.device) -> torch.Tensor:
    """(128, 8) fp32 of ±1: the signs of the 8 values a 7-bit sign index stands for."""
    i = torch.arange(128, dtype=torch.int32)
    parity = sum((i >> k) & 1 for k in range(7)) & 1
    byte = i | (parity << 7)
    bits = (byte[:, None] >> torch.arange(8, dtype=torch.int32)) & 1
    return torch.where(bits == 0, 1.0, -1.0).to(device)


def _words(b: torch.Tensor, size: int) -> torch.Tensor:
    """(n, k * size) bytes -> (n, k) int64 little-endian words of `size` bytes."""
    q = b.long().view(b.shape[0], -1, size)
    out = q[..., 0]
    for k in range(1, size):
        out = out | (q[..., k] << (8 * k))
    return out


def _bit_signs(signs: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, k * 8) fp32 ±1, one bit a value (IQ2_S, IQ3_S)."""
    bits = (signs.int()[..., None] >> torch.arange(8, dtype=torch.int32, device=signs.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0).view(signs.shape[0], -1)


def _nibble_scales(scales: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) fp32 4-bit scales, low nibble first."""
    s = scales.int()
    return torch.stack([s & 0xF, s >> 4], dim=2).view(scales.shape[0], -1).float()


@_register("IQ2_XXS")
def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, then 8 x (4 grid bytes, a u32 of four 7-bit sign indices and a 4-bit scale)."""
    n = b.shape[0]
    q = b[:, 2:].reshape(n, 8, 8)
    aux = _words(q[:, :, 4:].reshape(n, 32), 4)  # (n, 8)
    db = (_f16(b[:, :2]) * (0.5 + (aux >> 28).float()) * 0.25).view(n, 8, 1, 1)
    sign_idx = (aux[:, :, None] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F
    rows = grid("IQ2_XXS", b.device)[q[:, :, :4].long()]  # (n, 8, 4, 8)
    return (db * rows * _sign_bits(b.device)[sign_idx]).view(n, 256)


@_register("IQ2_XS")
def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 32 u16 (9-bit grid index, 7-bit sign index), 16 4-bit scales a 16 values."""
    n = b.shape[0]
    qs = _words(b[:, 2:66], 2)  # (n, 32)
    db = (_f16(b[:, :2]) * (0.5 + _nibble_scales(b[:, 66:74])) * 0.25).view(n, 16, 1, 1)
    rows = grid("IQ2_XS", b.device)[qs & 511].view(n, 16, 2, 8)
    signs = _sign_bits(b.device)[qs >> 9].view(n, 16, 2, 8)
    return (db * rows * signs).view(n, 256)


@_register("IQ2_S")
def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 32 grid bytes, 32 sign bytes, 8 bytes of the indices' 2 high bits, 16 scales."""
    n = b.shape[0]
    high = (b[:, 66:74].long()[..., None] >> torch.tensor([0, 2, 4, 6], device=b.device)) & 3
    idx = b[:, 2:34].long() | (high.view(n, 32) << 8)
    db = (_f16(b[:, :2]) * (0.5 + _nibble_scales(b[:, 74:82])) * 0.25).view(n, 16, 1, 1)
    rows = grid("IQ2_S", b.device)[idx].view(n, 16, 2, 8)
    return (db * rows * _bit_signs(b[:, 34:66]).view(n, 16, 2, 8)).view(n, 256)


@_register("IQ3_XXS")
def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 64 grid bytes (4 values each), 8 u32 of four 7-bit sign indices and a scale."""
    n = b.shape[0]
    aux = _words(b[:, 66:98], 4)  # (n, 8)
    db = (_f16(b[:, :2]) * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    sign_idx = (aux[:, :, None] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F
    rows = grid("IQ3_XXS", b.device)[b[:, 2:66].long()].view(n, 8, 4, 8)
    return (db * rows * _sign_bits(b.device)[sign_idx]).view(n, 256)


@_register("IQ3_S")
def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 64 grid bytes, 8 bytes of the indices' ninth bits, 32 sign bytes, 8 scales."""
    n = b.shape[0]
    high = (b[:, 66:74].long()[..., None] >> torch.arange(8, device=b.device)) & 1
    idx = b[:, 2:66].long() | (high.view(n, 64) << 8)
    scales = b[:, 106:110].int()
    odd = (1 + 2 * torch.stack([scales & 0xF, scales >> 4], dim=2).view(n, 8)).float()
    db = (_f16(b[:, :2]) * odd).view(n, 8, 1, 1)
    rows = grid("IQ3_S", b.device)[idx].view(n, 8, 4, 8)
    return (db * rows * _bit_signs(b[:, 74:106]).view(n, 8, 4, 8)).view(n, 256)


def _iq1_values(idx: torch.Tensor, dl: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """dl * (grid row + delta), delta -0.125 where `negative`, the value groups of 8 last."""
    delta = torch.where(negative, -_IQ1_DELTA, _IQ1_DELTA)
    return dl * (grid("IQ1_S", idx.device)[idx] + delta[..., None])


@_register("IQ1_S")
def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    """fp16 d, 32 grid bytes, 8 u16: four 3-bit high index parts, a 3-bit scale, delta's sign."""
    n = b.shape[0]
    qh = _words(b[:, 34:50], 2)  # (n, 8)
    high = (qh[:, :, None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    idx = b[:, 2:34].long().view(n, 8, 4) | (high << 8)
    dl = (_f16(b[:, :2]) * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    negative = ((qh & 0x8000) != 0)[:, :, None].expand(n, 8, 4)
    return _iq1_values(idx, dl, negative).view(n, 256)


@_register("IQ1_M")
def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    """32 grid bytes, 16 bytes of two nibbles (3 high index bits, delta's sign), 4 u16 of four
    3-bit scales each whose top nibbles together are the fp16 d."""
    n = b.shape[0]
    sc = _words(b[:, 48:56], 2)  # (n, 4)
    bits = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)).sum(dim=1)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # the same 16 bits, as int16
    d = bits.to(torch.int16).view(torch.float16).float().view(n, 1)
    s = (sc[:, :, None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    dl = (d * (2 * s.view(n, 16) + 1).float()).view(n, 8, 2, 1, 1)
    qh = b[:, 32:48].long()
    nib = torch.stack([qh & 0xF, qh >> 4], dim=2).view(n, 32)
    idx = b[:, :32].long() | ((nib & 7) << 8)
    return _iq1_values(idx.view(n, 8, 2, 2), dl, (nib & 8 != 0).view(n, 8, 2, 2)).view(n, 256)


__all__ = ["IQ_TYPES", "grid", "install_grids"]
