"""`DeviceState`: the one-line summary of the device for /health and /metrics.

Built from the latest probe results; the server maps it to `device_up`, `device_state`,
`gpu_power_watts`, `gpu_temperature_celsius`, `pcie_link_gen{kind}`, `pcie_link_width{kind}`
and `pcie_replay_total` (DESIGN.md "Metrics"). Link figures come from sysfs when readable,
else from NVML.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ftrs.health.nvml import NvmlResult
from ftrs.health.result import ProbeResult, Status
from ftrs.health.sysfs import PciResult

STATES = ("ok", "degraded", "lost", "not_applicable", "hang")


@dataclass(frozen=True)
class DeviceState:
    """`up` is False only when the device is lost; a hang keeps it up (the engine is stuck)."""

    up: bool
    #: One of STATES.
    state: str
    bdf: str | None = None
    link_gen_current: int | None = None
    link_gen_max: int | None = None
    link_width_current: int | None = None
    link_width_max: int | None = None
    power_w: float | None = None
    temperature_c: int | None = None
    pcie_replay: int | None = None
    aer_correctable: int | None = None
    aer_nonfatal: int | None = None
    aer_fatal: int | None = None
    #: Wall-clock time (seconds since the epoch) of the sample this state comes from.
    last_sample_time: float | None = None
    #: Why the state is not ok, in words.
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_state(
    bdf: str | None, pci: ProbeResult | None, nvml: ProbeResult | None, *, state: str,
    reason: str = "", sample_time: float | None = None,
) -> DeviceState:
    """Merge the latest PCI and NVML results into one DeviceState with the given state."""
    if state not in STATES:
        raise ValueError(f"unknown device state {state!r}; expected one of {STATES}")
    fields: dict[str, Any] = {}
    if isinstance(nvml, NvmlResult) and nvml.status is not Status.NOT_APPLICABLE:
        fields.update(power_w=nvml.power_w, temperature_c=nvml.temperature_c,
                      pcie_replay=nvml.pcie_replay, link_gen_current=nvml.link_gen_current,
                      link_gen_max=nvml.link_gen_max, link_width_current=nvml.link_width_current,
                      link_width_max=nvml.link_width_max)
    if isinstance(pci, PciResult):
        if pci.link is not None:
            link = pci.link
            sysfs_link = {"link_gen_current": link.current_gen, "link_gen_max": link.max_gen,
                          "link_width_current": link.current_width,
                          "link_width_max": link.max_width}
            fields.update({k: v for k, v in sysfs_link.items() if v is not None})
        if pci.aer is not None:
            fields.update(aer_correctable=pci.aer.correctable, aer_nonfatal=pci.aer.nonfatal,
                          aer_fatal=pci.aer.fatal)
    return DeviceState(up=state != "lost", state=state, bdf=bdf, last_sample_time=sample_time,
                       reason=reason, **fields)
