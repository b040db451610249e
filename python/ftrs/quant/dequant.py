"""Reference dequantizers: numpy through the `gguf` package, and pure torch (any device).

The torch versions turn a (blocks, block_bytes) uint8 tensor into (blocks, block_elems) fp32 with
the same operations, in the same order, as ggml's reference C code (and the `gguf` package's
numpy port of it), so on the CPU they agree with `gguf.quants.dequantize` bit for bit (tested).
They serve the GPU path until fused kernels exist: a landed expert slot is dequantized on the
device right before its matmul, while the link still carries the quantized bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ftrs.quant.formats import (
    FLOAT_TYPES,
    FP8_BLOCK,
    TAIL_BYTES,
    QuantTensor,
    block_format,
    fp8_scale_grid,
)

_Deq = Callable[[torch.Tensor], torch.Tensor]
_TORCH: dict[str, _Deq] = {}


def _register(name: str) -> Callable[[_Deq], _Deq]:
    def deco(f: _Deq) -> _Deq:
        _TORCH[name] = f
        return f
    return deco


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian halves -> (n, 1) fp32."""
    return b.contiguous().view(torch.float16).float()


def _shifts(*s: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.int32, device=device)


@_register("Q8_0")
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) int32: low nibbles are values 0..15, high nibbles 16..31."""
    q = qs.int()
    return torch.cat([q & 0xF, q >> 4], dim=1)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) int32: bit i is value i's fifth bit."""
    w = qh.int()
    word = w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)
    return (word[:, None] >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1


@_register("Q4_0")
def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return d * (_nibbles32(b[:, 2:]) - 8).float()


@_register("Q4_1")
def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles32(b[:, 4:]).float() + m


@_register("Q5_0")
def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles32(b[:, 6:]) | (_high_bits32(b[:, 2:6]) << 4)
    return d * (q - 16).float()


@_register("Q5_1")
def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles32(b[:, 8:]) | (_high_bits32(b[:, 4:8]) << 4)
    return d * q.float() + m


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> eight 6-bit scales and eight 6-bit mins (int32)."""
    s = s.int()
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=1)
    return sc, mn


@_register("Q4_K")
def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.float()).view(n, 8, 1)
    dm = (dmin * mn.float()).view(n, 8, 1)
    qs = b[:, 16:].int().view(n, 4, 1, 32) >> _shifts(0, 4, device=b.device).view(1, 1, 2, 1)
    q = (qs & 0xF).view(n, 8, 32).float()
    return (d * q - dm).view(n, 256)


@_register("Q5_K")
def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.float()).view(n, 8, 1)
    dm = (dmin * mn.float()).view(n, 8, 1)
    ql = b[:, 48:].int().view(n, 4, 1, 32) >> _shifts(0, 4, device=b.device).view(1, 1, 2, 1)
    qh = b[:, 16:48].int().view(n, 1, 32) >> torch.arange(8, dtype=torch.int32,
                                                          device=b.device).view(1, 8, 1)
    q = ((ql & 0xF).view(n, 8, 32) | ((qh & 1) << 4)).float()
    return (d * q - dm).view(n, 256)


@_register("Q6_K")
def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128].int(), b[:, 128:192].int()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).view(n, 16, 1)
    lo = (ql.view(n, 2, 1, 64) >> _shifts(0, 4, device=b.device).view(1, 1, 2, 1)) & 0xF
    hi = (qh.view(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=b.device).view(1, 1, 4, 1)) & 3
    q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)) - 32
    return (d * q.view(n, 16, 16).float()).view(n, 256)


@_register("Q2_K")
def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16].int()
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    qs = b[:, 16:80].int().view(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=b.device).view(1, 1, 4, 1)
    q = (qs & 3).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, 256)


@_register("Q3_K")
def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed = b[:, 0:32].int(), b[:, 32:96].int(), b[:, 96:108].int()
    d = _f16(b[:, 108:110])
    low = (packed[:, 0:8].view(n, 1, 8) >> _shifts(0, 4, device=b.device).view(1, 2, 1)) & 0xF
    high = (packed[:, 8:12].view(n, 1, 4) >> _shifts(0, 2, 4, 6, device=b.device).view(1, 4, 1)) & 3
    scales = (low.reshape(n, 16) | (high.reshape(n, 16) << 4)) - 32
    dl = (d * scales.float()).view(n, 16, 1)
    ql = (qs.view(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, device=b.device).view(1, 1, 4, 1)) & 3
    qh = (hmask.view(n, 1, 32) >> torch.arange(8, dtype=torch.int32,
                                               device=b.device).view(1, 8, 1)) & 1
    q = ql.reshape(n, 16, 16) - ((qh.reshape(n, 16, 16) ^ 1) << 2)
    return (dl * q.float()).view(n, 256)


#: e2m1 values, doubled (the block scale below is halved to match), as ggml and gguf-py keep them
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """e8m0 exponent bytes -> 2**(e - 128) in fp32, built from its bits (exact, subnormals
    included, as ggml's `ggml_e8m0_to_fp32_half`)."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


@_register("MXFP4")
def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(b[:, 0:1])
    lut = torch.tensor(_E2M1_X2, dtype=torch.float32, device=b.device)
    q = b[:, 1:17].int()
    return d * lut[torch.cat([q & 0xF, q >> 4], dim=1)]


def ue4m3_half(s: torch.Tensor) -> torch.Tensor:
    """NVFP4's unsigned e4m3 scale bytes -> half their value in fp32, built from the bits as
    `gguf.quants.NVFP4.ue4m3_to_fp32` reads them (0x7F, e4m3's NaN, reads as 0; bit 7 ignored)."""
    s = s.int()
    e, m = (s >> 3) & 0xF, s & 7
    normal = (((e + 119) << 23) | (m << 20)).view(torch.float32)
    v = torch.where(e == 0, m.float() * (1.0 / 1024.0), normal)
    return torch.where(s == 0x7F, torch.zeros_like(v), v)


@_register("NVFP4")
def _nvfp4(b: torch.Tensor) -> torch.Tensor:
    """Four 16-value sub-blocks: scale byte j, then 8 bytes (low nibbles: values 0..7)."""
    n = b.shape[0]
    d = ue4m3_half(b[:, :4]).view(n, 4, 1)
    lut = torch.tensor(_E2M1_X2, dtype=torch.float32, device=b.device)
    q = b[:, 4:].int().view(n, 4, 8)
    return (d * lut[torch.cat([q & 0xF, q >> 4], dim=2)]).view(n, 64)


_IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@_register("IQ4_NL")
def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_IQ4, dtype=torch.float32, device=b.device)
    return _f16(b[:, :2]) * lut[_nibbles32(b[:, 2:])]


@_register("IQ4_XS")
def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """Eight 32-value sub-blocks, scale `d * (ls - 32)` with ls's low nibble in byte 4 + s/2
    (nibble s % 2) and its top 2 bits at bit 2s of the u16 at bytes 2..4."""
    n = b.shape[0]
    lut = torch.tensor(_IQ4, dtype=torch.float32, device=b.device)
    high_word = b[:, 2].int() | (b[:, 3].int() << 8)
    low = b[:, 4:8].int()
    low = torch.stack([low & 0xF, low >> 4], dim=2).view(n, 8)
    shifts = 2 * torch.arange(8, dtype=torch.int32, device=b.device)
    ls = low | (((high_word[:, None] >> shifts) & 3) << 4)
    dl = (_f16(b[:, 0:2]) * (ls - 32).float()).view(n, 8, 1)
    q = b[:, 8:].int().view(n, 8, 16)
    return (dl * lut[torch.cat([q & 0xF, q >> 4], dim=2)]).view(n, 256)


from ftrs.quant import iquant  # noqa: E402, F401  (registers the i-quants' dequantizers)

TORCH_TYPES = frozenset(_TORCH) | frozenset(FLOAT_TYPES) | {FP8_BLOCK}


def dequantize_fp8_block(data: torch.Tensor, rows: int, cols: int,
                         block: tuple[int, int]) -> torch.Tensor:
    """FP8_BLOCK bytes (weights, then fp32 scales over the tile grid) -> (rows, cols) fp32."""
    gr, gc = fp8_scale_grid(rows, cols, block)
    w = data[: rows * cols].view(torch.float8_e4m3fn).view(rows, cols).float()
    s = data[rows * cols:].view(torch.float32).view(gr, gc)
    s = s.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return w * s


def dequantize(w: QuantTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(rows, cols) tensor of `dtype` on `w`'s device, through the torch dequantizers."""
    rows, cols = w.shape
    if w.qtype == FP8_BLOCK:
        assert w.fp8_block is not None  # invariant: QuantTensor checks it at construction
        return dequantize_fp8_block(w.data, rows, cols, w.fp8_block).to(dtype)
    if w.qtype in FLOAT_TYPES:
        tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[w.qtype]
        return w.data.view(tdt).view(rows, cols).to(dtype)
    f = block_format(w.qtype)
    if w.qtype not in _TORCH:  # no torch version: through numpy on the host
        return dequantize_numpy(w).to(device=w.device, dtype=dtype)
    out = _TORCH[w.qtype](w.rows_view().reshape(-1, f.block_bytes)).view(rows, cols)
    if w.qtype in TAIL_BYTES:  # the tensor scale, last (one rounding, as the Rust decode)
        out = out * w.data[-4:].view(torch.float32)
    return out.to(dtype)


def dequantize_numpy(w: QuantTensor) -> torch.Tensor:
    """The `gguf` package's reference dequantizer (GGUF types), on the host, fp32."""
    import gguf

    if w.qtype not in gguf.GGMLQuantizationType.__members__:
        raise ValueError(f"{w.qtype} is not a GGUF type")
    qt = gguf.GGMLQuantizationType[w.qtype]
    raw = w.rows_view().cpu().numpy()
    arr = gguf.quants.dequantize(raw, qt)
    out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).view(*w.shape)
    return out * w.tensor_scale if w.qtype in TAIL_BYTES else out
