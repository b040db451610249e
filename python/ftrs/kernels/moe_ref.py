"""The fused MoE's weights and its torch reference: `SlotWeights` (three stacked expert matrices
of every slot, float or in their file's blocks; layouts in `ftrs.kernels.moe`'s module doc), the
dequantizers the reference reads them through, and `fused_moe_ref`, the plain computation the
kernels reproduce (and the `torch`/`cpu` kernel sets run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

_BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
          "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
          "Q5_K": (256, 176), "Q6_K": (256, 210), "MXFP4": (32, 17), "IQ4_NL": (32, 18),
          "IQ4_XS": (256, 136), "NVFP4": (64, 36), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74),
          "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ1_S": (256, 50),
          "IQ1_M": (256, 56)}  # values and bytes per block


class SlotWeights(NamedTuple):
    """Expert weights of every slot: gate (S, I, H), up (S, I, H), down (S, H, I), or their
    quantized form with `qtype` naming the encoding (see the module doc) of gate and up, and
    of down too unless `down_qtype` names another. `biases`: gate (S, I), up (S, I) and down
    (S, H) bias rows in the activations' dtype (gpt_oss); `clamp`: the clamped SwiGLU's
    (alpha, limit) instead of SiLU (gpt_oss: `(up + 1) * gate * sigmoid(alpha * gate)`, gate
    clamped above and up on both sides at `limit`)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    qtype: str = "none"
    # FP8_BLOCK: each matrix's tile scales (S, rows/br, cols/bc); NVFP4: each matrix's fp32
    # tensor scale, one per slot (S, ...) (the 4 bytes after its rows)
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    fp8_block: tuple[int, int] | None = None  # FP8_BLOCK only: the scale tile (br, bc)
    down_qtype: str | None = None  # None: `qtype`
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    clamp: tuple[float, float] | None = None  # (alpha, limit); None: SiLU

    def qtype_of(self, which: int) -> str:
        """The encoding of gate (0), up (1) or down (2)."""
        return (self.down_qtype or self.qtype) if which == 2 else self.qtype

    @classmethod
    def from_region(cls, region: torch.Tensor, num_slots: int, slot_bytes: int,
                    tensor_offsets: Sequence[int], shapes: Sequence[tuple[int, int]],
                    dtype: torch.dtype, qtype: str = "none") -> SlotWeights:
        """Strided views, no copy, of the gate/up/down of every slot of a uint8 `region` cut
        into `num_slots` blocks of `slot_bytes` (the expert pool or the offload slot buffer):
        tensor t at byte `tensor_offsets[t]` of a block, shape `shapes[t]` in `dtype` (for a
        quantized `qtype`: uint8, shape (rows, row_bytes))."""
        elt = torch.empty((), dtype=dtype).element_size()
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("slot weights: the region is a 1-D uint8 tensor")
        if slot_bytes % elt or any(o % elt for o in tensor_offsets) or region.numel() % elt:
            raise ValueError(f"slot weights: offsets and sizes must be multiples of {elt} bytes")
        typed = region.view(dtype)
        views = []
        for off, (rows, cols) in zip(tensor_offsets, shapes, strict=True):
            end = (num_slots - 1) * slot_bytes + off + rows * cols * elt
            if num_slots < 1 or end > region.numel():
                raise ValueError(f"slot weights: {num_slots} slots of {slot_bytes} bytes "
                                 f"overrun a region of {region.numel()}")
            views.append(typed.as_strided((num_slots, rows, cols), (slot_bytes // elt, cols, 1),
                                          typed.storage_offset() + off // elt))
        return cls(views[0], views[1], views[2], qtype)


def dequant_q8_0(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols/32*34) uint8 GGUF Q8_0 -> (rows, cols): fp16 scale times int8, in fp32, cast."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 34)
    d = b[..., :2].contiguous().view(torch.float16).float()  # (rows, blocks, 1)
    q = b[..., 2:].contiguous().view(torch.int8).float()  # (rows, blocks, 32)
    return (d * q).reshape(rows, -1).to(dtype)


def dequant_q4_k(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols/256*144) uint8 GGUF Q4_K -> (rows, cols), in fp32 as ggml computes it, cast."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 144)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (rows, sb, 1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    s = b[..., 4:16].long()  # (rows, sb, 12)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=-1).float()  # (rows, sb, 8)
    mn = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1).float()
    qs = b[..., 16:].long().reshape(rows, -1, 4, 1, 32)  # 4 chunks of 32 bytes, 2 sub-blocks each
    q = torch.cat((qs & 15, qs >> 4), dim=3).reshape(rows, -1, 8, 32).float()
    out = (d * sc)[..., None] * q - (dmin * mn)[..., None]
    return out.reshape(rows, -1).to(dtype)


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols) float8_e4m3fn times its (br, bc)-tile fp32 scales, in fp32, cast."""
    rows, cols = w.shape
    s = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (w.float() * s).to(dtype)


def dequant_gguf(raw: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """(rows, row bytes) uint8 of GGUF `qtype` -> (rows, cols) through `ftrs.quant`'s torch
    dequantizers, in fp32, cast."""
    from ftrs.quant.dequant import dequantize
    from ftrs.quant.formats import QuantTensor

    elems, nbytes = _BLOCK[qtype]
    rows, cols = raw.shape[0], raw.shape[1] // nbytes * elems
    return dequantize(QuantTensor(qtype, (rows, cols), raw.reshape(-1)), torch.float32).to(dtype)


def dequant_nvfp4(raw: torch.Tensor, tensor_scale: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols/64*36) uint8 NVFP4 blocks and their fp32 tensor scale (one value) -> (rows,
    cols) through `ftrs.quant`'s torch dequantizer (the scale applied last), in fp32, cast."""
    from ftrs.quant.dequant import dequantize
    from ftrs.quant.formats import QuantTensor

    ts = tensor_scale.reshape(-1).to(torch.float32)
    if ts.numel() != 1:
        raise ValueError("NVFP4: one tensor scale per matrix")
    rows, cols = raw.shape[0], raw.shape[1] // 36 * 64
    data = torch.cat((raw.reshape(-1), ts.view(torch.uint8)))
    return dequantize(QuantTensor("NVFP4", (rows, cols), data), torch.float32).to(dtype)


def _matrix(w: SlotWeights, which: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
    m = (w.gate, w.up, w.down)[which][slot]
    qtype = w.qtype_of(which)
    if qtype == "NVFP4":
        assert w.scales is not None
        return dequant_nvfp4(m.contiguous(), w.scales[which][slot], dtype)
    if qtype == "Q8_0":
        return dequant_q8_0(m, dtype)
    if qtype == "Q4_K":
        return dequant_q4_k(m, dtype)
    if qtype in _BLOCK:
        return dequant_gguf(m.contiguous(), qtype, dtype)
    if qtype == "FP8_BLOCK":
        assert w.scales is not None and w.fp8_block is not None
        return dequant_fp8_block(m, w.scales[which][slot], w.fp8_block, dtype)
    return m


def fused_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  slot_of: torch.Tensor, w: SlotWeights,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch computation the kernel reproduces: experts in ascending id, each
    `down(silu(gate x) * up x) * weight` added onto `out` (zeros when None) at its tokens, with
    `w.biases` and `w.clamp` as `layers.moe.expert_mlp` computes them (the same torch ops).
    `x`: (T, H); `ids`, `weights`: (T, k); `slot_of`: (num_experts,) int, -1 = skip."""
    out = torch.zeros_like(x) if out is None else out
    weights = weights.to(x.dtype)
    table = slot_of.tolist()
    for e in torch.unique(ids).tolist():  # ascending
        s = table[e]
        if s < 0:
            continue
        tok, pos = torch.where(ids == e)
        gate, up, down = (_matrix(w, i, s, x.dtype) for i in range(3))
        gb, ub, db = (None, None, None) if w.biases is None else (b[s] for b in w.biases)
        xs = x.index_select(0, tok)
        g, u = F.linear(xs, gate, gb), F.linear(xs, up, ub)
        if w.clamp is None:
            h = F.silu(g) * u
        else:
            alpha, limit = w.clamp
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            h = (u + 1) * (g * torch.sigmoid(g * alpha))
        y = F.linear(h, down, db) * weights[tok, pos, None]
        out.index_copy_(0, tok, out.index_select(0, tok) + y)
    return out
