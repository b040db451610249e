"""RMSNorm as the reference computes it: in fp32, scaled by the weight in the model dtype.

Two variants of the Gated DeltaNet hybrids (qwen3_5_moe, qwen3_next): weights stored centred on
zero (`plus_one`: the scale is `1 + w`, applied in fp32 before the cast), and the gated norm of a
DeltaNet's output (normalise, scale, then times SiLU of the gate in fp32).

In fp32 the plain norm runs as one call (`F.rms_norm`: square, mean, add eps, rsqrt, scale, in
that order), bit-equal to the written-out form and one Python dispatch instead of six; the
hot path calls this twice per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             plus_one: bool = False) -> torch.Tensor:
    """`x`: (..., hidden) in the model dtype; returns the same shape and dtype."""
    dtype = x.dtype
    if not plus_one and dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """`rms_norm(x) * silu(gate)`, the gate in fp32; `x`, `gate`: (..., dim) in the model dtype."""
    return (rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)
