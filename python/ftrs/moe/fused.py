"""The fused MoE kernel (`ftrs.kernels.moe`) behind the strategies: which layers it computes,
the slot views it reads, and the slot tables of an offload wave.

A strategy given `Kernels` named "triton" computes a MoE layer with one sort of its (token,
expert) pairs and two grouped GEMMs that read every expert's weights where they lie: the
resident copy of the pool, or the offload strategy's device slot buffer, through `SlotWeights`
views made once at build. The pairs' results are added in ascending expert id
(`combine_pairs`), so the strategies stay bit-identical to each other on this path too.

A layer whose experts the kernel cannot compute keeps the per-expert torch path of
`layers.moe`: an activation other than SiLU, expert biases, or gate/up/down not all in one of
the float dtypes, `Q8_0`, `Q4_K` or `FP8_BLOCK` (a `Q4_K_M` GGUF's Q6_K `down` layers). This is
decided once per layer when the strategy is built, and logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ftrs.kernels.moe import SlotWeights
from ftrs.models.experts import HostExperts
from ftrs.quant.formats import FP8_BLOCK, fp8_scale_grid, row_bytes

log = logging.getLogger(__name__)
#: Quantized types the kernel dequantizes itself (`ftrs.kernels.moe.QTYPES`).
KERNEL_QTYPES = ("Q8_0", "Q4_K", FP8_BLOCK)


def layer_qtype(experts: HostExperts, layer: int) -> tuple[str | None, str]:
    """("none" or the quantized type, "") when the fused kernel computes model layer `layer`'s
    experts; (None, why not) otherwise."""
    act = experts.act
    if act.kind != "silu":
        return None, f"activation {act.kind}"
    if len(experts.shapes) != 3:
        return None, "expert biases"
    fmt = experts.formats[layer][:3]
    if len({(f.qtype, f.fp8_block) for f in fmt}) > 1:
        return None, "gate/up/down stored as " + "/".join(f.qtype or "float" for f in fmt)
    qtype = fmt[0].qtype
    if qtype is None:
        return "none", ""
    if qtype not in KERNEL_QTYPES:
        return None, f"{qtype} has no kernel"
    if qtype == FP8_BLOCK:
        li = experts.layer_index[layer]
        for t, (rows, cols) in enumerate(experts.shapes):
            if (int(experts.layout.tensor_offset(t, li)) + rows * cols) % 4:
                return None, "FP8 scales not 4-byte aligned"
    return qtype, ""


def slot_weights(experts: HostExperts, layer: int, region: torch.Tensor, num_slots: int,
                 slot_bytes: int) -> SlotWeights:
    """Views, no copy, of `num_slots` expert blocks of `region` (a 1-D uint8 tensor, block `s`
    at byte `s * slot_bytes`) in model layer `layer`'s format; `layer_qtype` must accept it."""
    qtype, why = layer_qtype(experts, layer)
    if qtype is None:
        raise ValueError(f"fused MoE: layer {layer} has no kernel ({why})")
    li = experts.layer_index[layer]
    offsets = [int(experts.layout.tensor_offset(t, li)) for t in range(3)]
    shapes = list(experts.shapes[:3])
    if qtype == "none":
        return SlotWeights.from_region(region, num_slots, slot_bytes, offsets, shapes,
                                       experts.dtype)
    if qtype != FP8_BLOCK:  # GGUF blocks: uint8 rows
        rows = [(r, row_bytes(qtype, c)) for r, c in shapes]
        return SlotWeights.from_region(region, num_slots, slot_bytes, offsets, rows,
                                       torch.uint8, qtype)
    block = experts.formats[layer][0].fp8_block
    assert block is not None  # invariant: an FP8_BLOCK format carries its tile
    w = SlotWeights.from_region(region, num_slots, slot_bytes, offsets, shapes,
                                torch.float8_e4m3fn, qtype)
    # the fp32 tile scales follow each matrix's weight bytes (`ftrs.quant.formats`)
    s = SlotWeights.from_region(region, num_slots, slot_bytes,
                                [o + r * c for o, (r, c) in zip(offsets, shapes, strict=True)],
                                [fp8_scale_grid(r, c, block) for r, c in shapes], torch.float32)
    return SlotWeights(w.gate, w.up, w.down, qtype, (s.gate, s.up, s.down), block)


def fused_layers(experts: HostExperts, views: Callable[[int], SlotWeights],
                 who: str) -> dict[int, SlotWeights]:
    """Per MoE layer the kernel computes, its slot views (`views(layer)`); the other layers
    are absent and logged once, grouped by reason."""
    out: dict[int, SlotWeights] = {}
    left: dict[str, list[int]] = {}
    for layer in experts.spec.moe_layers:
        qtype, why = layer_qtype(experts, layer)
        if qtype is None:
            left.setdefault(why, []).append(layer)
        else:
            out[layer] = views(layer)
    for why, layers in left.items():
        log.info("%s: MoE layers %s keep the torch path (%s)", who, layers, why)
    if out:
        log.info("%s: %d of %d MoE layers through the fused Triton kernel", who, len(out),
                 len(experts.spec.moe_layers))
    return out


def slot_table(table: list[int], device: torch.device) -> torch.Tensor:
    """A host `slot_of` list on the device, copied without waiting for the device."""
    if device.type != "cuda":
        return torch.tensor(table, dtype=torch.int32, device=device)
    host = torch.tensor(table, dtype=torch.int32, pin_memory=True)
    return host.to(device, non_blocking=True)
