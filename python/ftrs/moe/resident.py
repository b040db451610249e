"""`resident`: every routed expert lives on the compute device; nothing moves per step.

With the Triton kernels (`kernels.name == "triton"`), each layer the fused kernel supports is
one `fused_moe` call over views of that layer's blocks (`moe.fused`): expert `e` is slot `e`,
and nothing is read back to the host. On the CPU, a layer whose experts are all quantized runs
its routed experts in one Rust call (`quant.matmul.routed_experts_ffn`). Otherwise, or for the
other layers, each expert runs through `layers.moe` in ascending id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ftrs.layers.moe import combine_experts, plan_experts
from ftrs.models.experts import HostExperts
from ftrs.moe.base import GraphSupport, MoEStrategy, register
from ftrs.quant.matmul import LayerKernelArgs, layer_kernel_args, routed_experts_ffn

if TYPE_CHECKING:  # the kernel modules import Triton: only when the kernels are chosen
    from ftrs.kernels import Kernels
    from ftrs.kernels.moe import SlotWeights


@register("resident")
class ResidentStrategy(MoEStrategy):
    """Experts viewed in place on the CPU, or copied once to the GPU as one block."""

    name = "resident"

    def __init__(self, experts: HostExperts, device: torch.device,
                 kernels: Kernels | None = None, **_: object) -> None:
        host = experts.host_bytes()
        self._region = host if device.type == "cpu" else host.to(device)
        self._weights = experts.views(self._region)
        self._num_experts = experts.spec.num_experts
        self._moe_layers = experts.spec.moe_layers
        self._act = experts.act
        # CPU layers whose experts are all quantized: every routed expert in one kernel call
        self._kernel_args: dict[int, LayerKernelArgs] = {}
        if device.type == "cpu" and self._act.kind == "silu":
            for layer, per_layer in self._weights.items():
                args = layer_kernel_args(per_layer)
                if args is not None:
                    self._kernel_args[layer] = args
        # the fused kernel's views: per layer, its E blocks as slots 0..E-1
        self._fused: dict[int, SlotWeights] = {}
        if kernels is not None and kernels.name == "triton":
            from ftrs.moe.fused import fused_layers

            self._fused_moe = kernels.fused_moe
            self._slot_of = torch.arange(self._num_experts, dtype=torch.int32, device=device)
            self._fused = fused_layers(experts, lambda layer: self._layer_slots(experts, layer),
                                       self.name)

    def _layer_slots(self, experts: HostExperts, layer: int) -> SlotWeights:
        from ftrs.moe.fused import slot_weights

        li = experts.layer_index[layer]
        start = int(experts.layout.offset(li, 0, 0))
        block = experts.block_bytes(layer)
        region = self._region[start:start + self._num_experts * block]
        return slot_weights(experts, layer, region, self._num_experts, block)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        fused = self._fused.get(layer)
        if fused is not None:
            return self._fused_moe(x, ids, weights, self._slot_of, fused)
        out = torch.zeros_like(x)
        args = self._kernel_args.get(layer)
        if args is not None and routed_experts_ffn(x, ids, weights, args, out) is not None:
            return out
        plan = plan_experts(ids, weights, self._num_experts)
        per_layer = self._weights[layer]
        combine_experts(x, plan, None, plan.experts, lambda e: per_layer[e], out, self._act)
        return out

    def graph_support(self) -> GraphSupport:
        # the fused kernel reads nothing back; `plan_experts` reads the routing on the host
        torch_path = [layer for layer in self._moe_layers if layer not in self._fused]
        if not torch_path:
            return GraphSupport("step")
        return GraphSupport("off", f"the resident strategy runs MoE layer(s) {torch_path[:4]} "
                                   "through the per-expert loop, which reads the routing on the "
                                   "host (the fused MoE kernel is not in use there)")
