"""Routed-expert weights in the host expert pool (`ftrs._core.ExpertPool`).

The pool holds every (MoE layer, expert) as one contiguous block: gate, up, down back to back,
each aligned, in the layout computed by Rust. Torch reads it without a copy through the buffer
protocol; the resident strategy takes views (or one device copy), the offload strategy hands
the pool to the Rust transfer engine.
"""

from __future__ import annotations

import torch

from ftrs.layers.moe import ExpertWeights
from ftrs.models.arch import ArchSpec

_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class HostExperts:
    """All routed experts of a model in one aligned host region, filled by Rust."""

    def __init__(self, spec: ArchSpec, dtype: torch.dtype) -> None:
        self.spec = spec
        self.dtype = dtype
        self.shapes = spec.expert_shapes
        self.layer_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        elt = torch.tensor([], dtype=dtype).element_size()
        self.tensor_bytes = [r * c * elt for r, c in self.shapes]
        from ftrs import _core

        self.layout = _core.ExpertLayout(len(spec.moe_layers), spec.num_experts, self.tensor_bytes)
        self.pool = _core.ExpertPool(self.layout, _DTYPE_NAME[dtype])

    @property
    def expert_bytes(self) -> int:
        """Bytes of one (layer, expert) block, alignment included: the unit of every transfer."""
        return int(self.layout.expert_bytes)

    @property
    def num_experts_total(self) -> int:
        return len(self.spec.moe_layers) * self.spec.num_experts

    def host_bytes(self) -> torch.Tensor:
        """The whole pool as a uint8 tensor, without a copy. Valid while `self` lives."""
        return torch.frombuffer(self.pool, dtype=torch.uint8)

    def block_views(self, region: torch.Tensor, base: int) -> ExpertWeights:
        """Typed views of the three tensors of the block that starts at byte `base` of `region`."""
        out = []
        for t, (rows, cols) in enumerate(self.shapes):
            start = base + int(self.layout.tensor_offset(t))
            raw = region[start:start + self.tensor_bytes[t]]
            out.append(raw.view(self.dtype).view(rows, cols))
        return out[0], out[1], out[2]

    def views(self, region: torch.Tensor) -> dict[int, list[ExpertWeights]]:
        """Per model layer, per expert, the weight views into `region` (the pool or its device copy)."""
        res: dict[int, list[ExpertWeights]] = {}
        for layer, li in self.layer_index.items():
            res[layer] = [self.block_views(region, int(self.layout.offset(li, e, 0)))
                          for e in range(self.spec.num_experts)]
        return res
