"""Experts shipped packed, one tensor per part holding every expert of a layer (gpt_oss), into
the host expert pool.

Per MoE layer a gpt_oss checkpoint holds (E experts, hidden H, expert width I):
- `gate_up_proj` (E, H, 2I) in the `x @ W` layout, gate and up columns interleaved (gate 0::2,
  up 1::2), and `down_proj` (E, I, H); or, quantized (`quant_method: mxfp4`), the same weights in
  the `Linear` layout as `*_blocks` (E, rows, cols/32, 16) and `*_scales` (E, rows, cols/32);
- `gate_up_proj_bias` (E, 2I) and `down_proj_bias` (E, H), never quantized.

Each expert becomes the pool's tensors in the decoder's order: gate (I,H), up (I,H), down (H,I)
in the `Linear` layout (compute dtype, or MXFP4 rows: `quant.mxfp4.from_blocks`), then its gate,
up and down bias rows in the compute dtype. One layer's tensors are read at a time.

`open_safetensors` is the one way the loader opens a checkpoint file (header scans included):
a file safetensors cannot read is a ModelLoadError naming it, whichever pass meets it first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ftrs.errors import ModelLoadError
from ftrs.models.arch import ArchSpec
from ftrs.models.experts import ExpertFormat, HostExperts, TensorFormat
from ftrs.models.names import DOWN, GATE, UP, PackedExperts, map_hf_name
from ftrs.quant.mxfp4 import from_blocks

MXFP4 = TensorFormat("MXFP4")
Sources = dict[int, dict[str, str]]  # layer -> part -> file holding it


def open_safetensors(path: str | Path) -> Any:
    """`safe_open(path)`; a file safetensors cannot read (cut short, a bad header, missing)
    is a ModelLoadError naming it, never safetensors' own error."""
    try:
        return safe_open(str(path), framework="pt")
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(str(path), f"cannot read safetensors: {e}") from e


def packed_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every part a layer may ship."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    return {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h),
            "gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h),
            "gate_up_proj_blocks": (e, 2 * i, h // 32, 16), "gate_up_proj_scales": (e, 2 * i, h // 32),
            "down_proj_blocks": (e, h, i // 32, 16), "down_proj_scales": (e, h, i // 32)}


def check_part(key: PackedExperts, shape: tuple[int, ...], spec: ArchSpec, source: str,
               name: str) -> None:
    if key.layer not in spec.moe_layers or not spec.expert_bias:
        raise ModelLoadError(source, f"unexpected expert tensor {name}")
    if key.part.endswith(("_blocks", "_scales")):
        width = spec.hidden_size if key.part.startswith("gate_up") else spec.moe_intermediate_size
        if width % 32:
            raise ModelLoadError(source, f"{name}: MXFP4 rows of {width} values are not a whole "
                                 "number of 32-value blocks")
    want = packed_shapes(spec)[key.part]
    if shape != want:
        raise ModelLoadError(source, f"tensor {name} has shape {list(shape)}, expected {list(want)}")


def packed_formats(sources: Sources, spec: ArchSpec, source: str) -> dict[int, ExpertFormat]:
    """Per MoE layer, the pool formats its parts imply; a missing part is a ModelLoadError."""
    out: dict[int, ExpertFormat] = {}
    for layer in spec.moe_layers:
        parts = sources.get(layer, {})
        fmt = []
        for proj in ("gate_up_proj", "down_proj"):
            quant = f"{proj}_blocks" in parts and f"{proj}_scales" in parts
            if not quant and proj not in parts:
                raise ModelLoadError(source, f"layer {layer}: no mlp.experts.{proj} (nor its "
                                     "_blocks and _scales)")
            if f"{proj}_bias" not in parts:
                raise ModelLoadError(source, f"layer {layer}: no mlp.experts.{proj}_bias")
            fmt.append(MXFP4 if quant else TensorFormat())
        out[layer] = (fmt[0], fmt[0], fmt[1], TensorFormat(), TensorFormat(), TensorFormat())
    return out


def _read(path: str, name: str) -> torch.Tensor:
    with open_safetensors(path) as f:
        return f.get_tensor(name)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


def write_packed(experts: HostExperts, sources: Sources, dtype: torch.dtype) -> None:
    """Cut every layer's parts into per-expert tensors and store them in the pool."""
    spec = experts.spec
    for layer in spec.moe_layers:
        parts = sources[layer]
        fmt = experts.formats[layer]
        prefix = f"model.layers.{layer}.mlp.experts."

        def load(part: str) -> torch.Tensor:
            return _read(parts[part], prefix + part)  # noqa: B023 (used within this iteration)

        if fmt[GATE] == MXFP4:
            gu_blocks, gu_scales = load("gate_up_proj_blocks"), load("gate_up_proj_scales")
        else:
            gate_up = load("gate_up_proj")
        if fmt[DOWN] == MXFP4:
            d_blocks, d_scales = load("down_proj_blocks"), load("down_proj_scales")
        else:
            down = load("down_proj")
        gu_bias, d_bias = load("gate_up_proj_bias"), load("down_proj_bias")
        for e in range(spec.num_experts):
            if fmt[GATE] == MXFP4:
                rows = from_blocks(gu_blocks[e], gu_scales[e])  # (2I, H/32*17)
            else:
                rows = gate_up[e].t().to(dtype)  # (2I, H)
            tensors = {GATE: rows[0::2], UP: rows[1::2]}
            if fmt[DOWN] == MXFP4:
                tensors[DOWN] = from_blocks(d_blocks[e], d_scales[e])
            else:
                tensors[DOWN] = down[e].t().to(dtype)
            tensors |= {3: gu_bias[e, 0::2].to(dtype), 4: gu_bias[e, 1::2].to(dtype),
                        5: d_bias[e].to(dtype)}
            for t, w in tensors.items():
                experts.write(layer, e, t, _bytes(w))


def sources_in(files: list[Path]) -> list[tuple[str, str, PackedExperts]]:
    """(file, tensor name, key) of every packed-expert tensor, from the headers only."""
    out = []
    for path in files:
        with open_safetensors(path) as f:
            for name in f.keys():
                key = map_hf_name(name)
                if isinstance(key, PackedExperts):
                    out.append((str(path), name, key))
    return out
