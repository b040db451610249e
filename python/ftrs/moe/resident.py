"""`resident`: every routed expert lives on the compute device; nothing moves per step."""

from __future__ import annotations

import torch

from ftrs.layers.moe import combine_experts, plan_experts
from ftrs.models.experts import HostExperts
from ftrs.moe.base import GraphSupport, MoEStrategy, register


@register("resident")
class ResidentStrategy(MoEStrategy):
    """Experts viewed in place on the CPU, or copied once to the GPU as one block."""

    name = "resident"

    def __init__(self, experts: HostExperts, device: torch.device, **_: object) -> None:
        host = experts.host_bytes()
        self._region = host if device.type == "cpu" else host.to(device)
        self._weights = experts.views(self._region)
        self._num_experts = experts.spec.num_experts
        self._act = experts.act

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        plan = plan_experts(ids, weights, self._num_experts)
        per_layer = self._weights[layer]
        combine_experts(x, plan, None, plan.experts, lambda e: per_layer[e], out, self._act)
        return out

    def graph_support(self) -> GraphSupport:
        # `plan_experts` reads the routing on the host once per layer: not capturable
        return GraphSupport("off", "the resident strategy's per-expert loop reads the routing "
                                   "on the host (the fused MoE kernel is not in use)")
