"""Triton kernels for the GPU path, each beside its pure-torch reference, chosen once per engine.

`select_kernels(config.kernels, device)` returns a `Kernels` whose four ops share the
reference's signature whichever side was chosen:
- `auto` (default): Triton on a CUDA device when Triton imports, the torch references otherwise;
- `torch`: the references everywhere (`--kernels torch`, for debugging);
- `triton`: the kernels, or a `ConfigError` where they cannot run. On the CPU they run only
  under Triton's interpreter (`TRITON_INTERPRET=1` before the first kernel import: tests only,
  it is slow).

Modules: `norm` (RMSNorm + residual, rotary in place), `moe` (fused MoE over cache slots),
`attention` (paged attention through a block table). Kernel modules are imported on first
selection, so `import ftrs.kernels` costs nothing and the interpreter knob is read late.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ftrs.errors import ConfigError
from ftrs.kernels._triton import interpreting, triton_importable

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Kernels:
    """The ops behind one choice; signatures as the references in the kernel modules."""

    name: str  # "triton" | "torch"
    rms_norm: Callable[..., Any]  # (x, weight, eps, residual=None) -> (out, new_residual)
    rotary_: Callable[..., None]  # (q, k, cos, sin, positions): in place
    fused_moe: Callable[..., torch.Tensor]  # (x, ids, weights, slot_of, SlotWeights, out=None)
    paged_attention: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, PagedMeta, scale)


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA with Triton, or the interpreter on the CPU."""
    if not triton_importable():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreting()


def select_kernels(mode: str, device: torch.device) -> Kernels:
    if mode not in KERNEL_MODES:
        raise ConfigError(f"kernels: expected one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    if mode == "triton" and not triton_runs_on(device):
        why = "Triton does not import" if not triton_importable() else f"device {device} is not CUDA"
        raise ConfigError(f"kernels: triton cannot run here ({why}); use --kernels auto or torch")
    use = mode == "triton" or (mode == "auto" and device.type == "cuda" and triton_runs_on(device))
    from ftrs.kernels import attention, moe, norm

    if use:
        log.debug("kernels: triton on %s", device)
        return Kernels("triton", norm.rms_norm_triton, norm.rotary_triton_, moe.fused_moe_triton,
                       attention.paged_attention_triton)
    log.debug("kernels: torch references on %s", device)
    return Kernels("torch", norm.rms_norm_ref, norm.rotary_ref_, moe.fused_moe_ref,
                   attention.paged_attention_ref)


__all__ = ["KERNEL_MODES", "Kernels", "select_kernels", "triton_runs_on"]
