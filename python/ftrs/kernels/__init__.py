"""Triton kernels for the GPU path and Rust ops for the CPU path, each beside its pure-torch
reference, chosen once per engine.

`select_kernels(config.kernels, device)` returns a `Kernels` whose ops share the reference's
signature whichever side was chosen:
- `auto` (default): Triton on a CUDA device when Triton imports; on the CPU the Rust ops when
  the extension has them; the torch references otherwise;
- `torch`: the references everywhere (`--kernels torch`, for debugging);
- `triton`: the kernels, or a `ConfigError` where they cannot run. On the CPU they run only
  under Triton's interpreter (`TRITON_INTERPRET=1` before the first kernel import: tests only,
  it is slow);
- `cpu`: the Rust ops (`kernels.cpu`: RMSNorm + residual, rotary in place, decode attention;
  fused MoE and paged attention stay the references), or a `ConfigError` on another device.

Modules: `norm` (RMSNorm + residual, rotary in place), `moe` (fused MoE over cache slots),
`attention` (paged attention through a block table), `cpu` (the Rust ops). Kernel modules are
imported on first selection, so `import ftrs.kernels` costs nothing and the interpreter knob is
read late.
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

KERNEL_MODES = ("auto", "torch", "triton", "cpu")


@dataclass(frozen=True)
class Kernels:
    """The ops behind one choice; signatures as the references in the kernel modules."""

    name: str  # "triton" | "cpu" | "torch"
    rms_norm: Callable[..., Any]  # (x, weight, eps, residual=None) -> (out, new_residual)
    rotary_: Callable[..., None]  # (q, k, cos, sin, positions): in place
    fused_moe: Callable[..., torch.Tensor]  # (x, ids, weights, slot_of, SlotWeights, out=None)
    paged_attention: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, PagedMeta, scale)
    # (q, k_cache, v_cache, gather, mask, scale) -> out, or None to take the torch path: the
    # decode rows of `layers.attention.paged_attention`; None: always the torch path
    decode_attention: Callable[..., torch.Tensor | None] | None = None

    @property
    def rotates_in_place(self) -> bool:
        """The decoder rotates q and k through `rotary_` (from the fp32 tables and positions),
        not through the per-forward table of the torch path."""
        return self.name != "torch"


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
    if mode == "cpu" and device.type != "cpu":
        raise ConfigError(f"kernels: cpu runs on the CPU, not on {device}; use --kernels auto")
    use = mode == "triton" or (mode == "auto" and device.type == "cuda" and triton_runs_on(device))
    from ftrs.kernels import attention, cpu, moe, norm

    if use:
        log.debug("kernels: triton on %s", device)
        return Kernels("triton", norm.rms_norm_triton, norm.rotary_triton_, moe.fused_moe_triton,
                       attention.paged_attention_triton)
    if mode == "cpu" or (mode == "auto" and device.type == "cpu"):
        if cpu.available():
            log.debug("kernels: Rust ops on the CPU")
            return Kernels("cpu", cpu.rms_norm_cpu, cpu.rotary_cpu_, moe.fused_moe_ref,
                           attention.paged_attention_ref, cpu.decode_attention_cpu)
        if mode == "cpu":
            raise ConfigError("kernels: this build of ftrs._core has no CPU ops; rebuild it "
                              "(scripts/dev-build.sh) or use --kernels torch")
    log.debug("kernels: torch references on %s", device)
    return Kernels("torch", norm.rms_norm_ref, norm.rotary_ref_, moe.fused_moe_ref,
                   attention.paged_attention_ref)


__all__ = ["KERNEL_MODES", "Kernels", "select_kernels", "triton_runs_on"]
