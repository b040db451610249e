"""Fault injection for drills: make the probe layer *report* a fault, so that the real
verdict functions, the classifier, the monitor and `on_fault` all run as in a real failure.

Faults rewrite raw readings, then the same `judge_pci` / `judge_nvml` used by the probes
decides: `device_lost` (config space reads 0xffff, NVML answers GPU_IS_LOST),
`link_degraded` (current link Gen1 at half the max width), `replay_growth` (the NVML replay
counter and the AER correctable total grow by `step` on every sample).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ftrs.health.nvml import NvmlResult, judge_nvml, nvml_lost
from ftrs.health.result import ProbeResult, Status
from ftrs.health.sysfs import VENDOR_GONE, AerCounts, LinkInfo, PciResult, judge_pci

logger = logging.getLogger(__name__)

FAULTS = ("device_lost", "link_degraded", "replay_growth")


class FaultInjector:
    """Thread-safe set of active faults; `apply_*` is called by the monitor on each result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._replay_extra = 0
        self._step = 16

    def inject(self, fault: str, *, step: int = 16) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; expected one of {FAULTS}")
        with self._lock:
            self._active.add(fault)
            self._step = step
        logger.warning("fault injected: %s", fault)

    def clear(self) -> None:
        with self._lock:
            self._active.clear()
            self._replay_extra = 0

    @property
    def active(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._active)

    def apply_pci(self, result: ProbeResult, *, busy: bool = False) -> ProbeResult:
        active = self.active
        if not active or not isinstance(result, PciResult) or result.vendor is None:
            return result
        if "device_lost" in active:
            return _mark(judge_pci(result.bdf, VENDOR_GONE))
        link, aer = result.link, result.aer
        if "link_degraded" in active and link is not None:
            link = LinkInfo(current_gen=1, max_gen=link.max_gen,
                            current_width=max(1, (link.max_width or 2) // 2),
                            max_width=link.max_width, current_speed="2.5 GT/s PCIe",
                            max_speed=link.max_speed)
        if "replay_growth" in active and aer is not None and aer.correctable is not None:
            aer = AerCounts(correctable=aer.correctable + self._grow(), nonfatal=aer.nonfatal,
                            fatal=aer.fatal, detail=aer.detail)
        return _mark(judge_pci(result.bdf, result.vendor, link, aer, result.upstream, busy=busy))

    def apply_nvml(self, result: ProbeResult) -> ProbeResult:
        active = self.active
        if not active or not isinstance(result, NvmlResult) or result.status in (
                Status.NOT_APPLICABLE, Status.LOST):
            return result
        if "device_lost" in active:
            return _mark(nvml_lost(result.bdf, "injected"))
        fields: dict[str, Any] = {
            name: getattr(result, name) for name in (
                "power_w", "temperature_c", "clock_event_reasons", "pcie_replay",
                "link_gen_current", "link_gen_max", "link_width_current", "link_width_max")}
        if "link_degraded" in active and fields["link_width_max"]:
            fields.update(link_gen_current=1, link_width_current=fields["link_width_max"] // 2)
        if "replay_growth" in active and fields["pcie_replay"] is not None:
            fields["pcie_replay"] += self._grow()
        return _mark(judge_nvml(result.bdf, fields, result.xids, dict(result.errors)))

    def _grow(self) -> int:
        with self._lock:
            self._replay_extra += self._step
            return self._replay_extra


def _mark(result: ProbeResult) -> ProbeResult:
    result.evidence["injected"] = True
    return result
