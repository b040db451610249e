"""The engine's CUDA device as the device monitor watches it: its PCI address (`cuda_bdf`, for
the config-space, NVML and kernel-log probes) and a child probe of it (`cuda_child_probe`: a
fresh process that must use the device, the fourth evidence of a loss in DESIGN.md). Both are
None when the engine runs elsewhere."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftrs.guard.link import cuda_pci_address

if TYPE_CHECKING:
    from ftrs.health.result import ProbeResult

logger = logging.getLogger(__name__)


def _engine_cuda_index(engine: Any) -> int | None:
    """The CUDA index of the engine's device (its current one for a bare `cuda`); None when
    the engine runs elsewhere or CUDA cannot say."""
    device: Any = getattr(engine, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    if device.index is not None:
        return int(device.index)
    try:
        import torch

        return int(torch.cuda.current_device())
    except Exception as exc:  # never fatal: supervision degrades to the watchdog
        logger.warning("cannot tell the engine's CUDA device (%s)", exc)
        return None


def cuda_bdf(engine: Any) -> str | None:
    """The PCI address of the engine's CUDA device, for the monitor to watch; None when the
    engine runs elsewhere or the address cannot be told (then only the watchdog runs)."""
    index = _engine_cuda_index(engine)
    if index is None:
        return None
    bdf = cuda_pci_address(index)
    if bdf is None:
        logger.warning("cannot tell the PCI address of cuda:%d: only the watchdog runs", index)
    return bdf


#: How long the child probe may take to use the device (import torch, create a context, one
#: kernel) before its silence counts as the device's: seconds of a failing step's requests.
CHILD_PROBE_TIMEOUT_S = 30.0


def cuda_child_probe(engine: Any) -> Callable[[], ProbeResult] | None:
    """The fourth evidence of a lost device (DESIGN.md): a fresh process that cannot use the
    engine's CUDA device. The monitor runs it only while classifying an error or a hang that no
    other probe explains; None when the engine runs elsewhere."""
    index = _engine_cuda_index(engine)
    if index is None:
        return None
    from ftrs.health.child import probe_child

    return functools.partial(probe_child, f"cuda:{index}", timeout_s=CHILD_PROBE_TIMEOUT_S)


__all__ = ["CHILD_PROBE_TIMEOUT_S", "cuda_bdf", "cuda_child_probe"]
