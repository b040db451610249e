"""The fused MoE kernel (`ftrs.kernels.moe`) behind the strategies: which layers it computes,
the slot views it reads, and the slot tables of an offload wave.

A strategy given `Kernels` named "triton" computes a MoE layer with one sort of its (token,
expert) pairs and two grouped GEMMs that read every expert's weights where they lie: the
resident copy of the pool, or the offload strategy's device slot buffer, through `SlotWeights`
views made once at build. The pairs' results are added in ascending expert id
(`combine_pairs`), so the strategies stay bit-identical to each other on this path too.

A layer whose experts the kernel cannot compute keeps the per-expert torch path of
`layers.moe`: an activation other than SiLU or gpt_oss's clamped SwiGLU (expert biases ride
along as bias rows of each slot), gate and up of different types, a
type the kernel does not read (it reads the float dtypes, every GGUF block type the CPU
kernels read but IQ4's relatives it lacks, NVFP4 and `FP8_BLOCK`: `KERNEL_QTYPES`), or floats,
NVFP4 or FP8 mixed with another type. `down` may differ from gate/up among the GGUF types: a
`Q4_K_M` file's Q5_1 or Q4_K gate/up over Q6_K or Q4_K down, a `Q3_K_M`'s Q3_K over Q4_K or
Q5_K, all take the kernel. This is decided once per layer when the strategy is built, and logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ftrs.kernels.moe import SlotWeights
from ftrs.models.experts import HostExperts
from ftrs.quant.formats import FP8_BLOCK, fp8_scale_grid, row_bytes
from ftrs.quant.iquant import IQ_TYPES, grid

log = logging.getLogger(__name__)
#: The GGUF block types the kernel dequantizes itself, which gate/up and down may mix.
GGUF_KERNEL_QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                      "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
                      "IQ2_S", "IQ3_XXS", "IQ3_S")
#: Every quantized type it reads (`ftrs.kernels.moe.QTYPES`): NVFP4 and FP8 carry side
#: buffers (a tensor scale, tile scales) and are not mixed.
KERNEL_QTYPES = (*GGUF_KERNEL_QTYPES, "NVFP4", FP8_BLOCK)


def layer_qtypes(experts: HostExperts, layer: int) -> tuple[tuple[str, str] | None, str]:
    """((gate/up type, down type), "") with "none" for floats when the fused kernel computes
    model layer `layer`'s experts; (None, why not) otherwise."""
    act = experts.act
    if act.kind not in ("silu", "swiglu_clamp"):
        return None, f"activation {act.kind}"
    if len(experts.shapes) not in (3, 6):
        return None, f"{len(experts.shapes)} tensors an expert"
    fmt = experts.formats[layer][:3]
    stored = "gate/up/down stored as " + "/".join(f.qtype or "float" for f in fmt)
    if fmt[0] != fmt[1]:
        return None, stored
    qtype, down = fmt[0].qtype, fmt[2].qtype
    if fmt[2] != fmt[0] and not (qtype in GGUF_KERNEL_QTYPES and down in GGUF_KERNEL_QTYPES):
        return None, stored
    if qtype is None:
        return ("none", "none"), ""
    for qt in (qtype, down):
        if qt not in KERNEL_QTYPES:
            return None, f"{qt} has no kernel"
    assert down is not None  # a float down with quantized gate/up was refused above
    if qtype in (FP8_BLOCK, "NVFP4"):
        li = experts.layer_index[layer]
        for t, (rows, cols) in enumerate(experts.shapes[:3]):
            weights = rows * (cols if qtype == FP8_BLOCK else row_bytes(qtype, cols))
            if (int(experts.layout.tensor_offset(t, li)) + weights) % 4:
                return None, f"{qtype} scales not 4-byte aligned"
    return (qtype, down), ""


def slot_weights(experts: HostExperts, layer: int, region: torch.Tensor, num_slots: int,
                 slot_bytes: int) -> SlotWeights:
    """Views, no copy, of `num_slots` expert blocks of `region` (a 1-D uint8 tensor, block `s`
    at byte `s * slot_bytes`) in model layer `layer`'s format; `layer_qtypes` must accept it."""
    qtypes, why = layer_qtypes(experts, layer)
    if qtypes is None:
        raise ValueError(f"fused MoE: layer {layer} has no kernel ({why})")
    w = _matrices(experts, layer, region, num_slots, slot_bytes, qtypes)
    act = experts.act
    if act.kind == "swiglu_clamp":
        w = w._replace(clamp=(act.alpha, act.limit))
    if len(experts.shapes) == 6:  # bias rows (1, n) in the compute dtype, after the matrices
        li = experts.layer_index[layer]
        offsets = [int(experts.layout.tensor_offset(t, li)) for t in range(3, 6)]
        b = SlotWeights.from_region(region, num_slots, slot_bytes, offsets,
                                    list(experts.shapes[3:]), experts.dtype)
        w = w._replace(biases=(b.gate[:, 0], b.up[:, 0], b.down[:, 0]))
    return w


def _matrices(experts: HostExperts, layer: int, region: torch.Tensor, num_slots: int,
              slot_bytes: int, qtypes: tuple[str, str]) -> SlotWeights:
    """`slot_weights`' gate, up and down views."""
    qtype, down = qtypes
    li = experts.layer_index[layer]
    offsets = [int(experts.layout.tensor_offset(t, li)) for t in range(3)]
    shapes = list(experts.shapes[:3])
    if qtype == "none":
        return SlotWeights.from_region(region, num_slots, slot_bytes, offsets, shapes,
                                       experts.dtype)
    if qtype != FP8_BLOCK:  # GGUF blocks: uint8 rows
        rows = [(r, row_bytes(t, c)) for (r, c), t in zip(shapes, (qtype, qtype, down),
                                                            strict=True)]
        w = SlotWeights.from_region(region, num_slots, slot_bytes, offsets, rows, torch.uint8)
        w = w._replace(qtype=qtype, down_qtype=down if down != qtype else None)
        for t in {qtype, down} & set(IQ_TYPES):  # the grid on the device now, not mid-capture
            grid(t, region.device)
        if qtype == "NVFP4":  # each matrix's fp32 tensor scale follows its rows
            ts = SlotWeights.from_region(region, num_slots, slot_bytes,
                                         [o + r * b for o, (r, b) in zip(offsets, rows, strict=True)],
                                         [(1, 1)] * 3, torch.float32)
            w = w._replace(scales=(ts.gate, ts.up, ts.down))
        return w
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
        qtypes, why = layer_qtypes(experts, layer)
        if qtypes is None:
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
