"""RMSNorm as the reference computes it: in fp32, scaled by the weight in the model dtype.

In fp32 the same steps run as one call (`F.rms_norm`: square, mean, add eps, rsqrt, scale, in
that order), bit-equal to the written-out form and one Python dispatch instead of six; the
hot path calls this twice per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x`: (..., hidden) in the model dtype; returns the same shape and dtype."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
