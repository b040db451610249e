"""Fakes for the health tests: a sysfs tree laid out like the real one, and a fake NVML.

The tree mirrors /sys: the function lives under
`devices/pci0000:00/<port>/<bdf>` and `bus/pci/devices/<bdf>` is a symlink to it, so the
upstream port is found the way it is on a real host (the parent of the resolved path).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The field report's host: RTX 3090 on 0000:04:00.0, an idle RTX A1000 on 0000:03:00.0.
GPU_BDF = "0000:04:00.0"
PORT_BDF = "0000:00:03.0"
OTHER_GPU_BDF = "0000:03:00.0"
FIELD_REPORT_CUDA_ERROR = "torch.AcceleratorError: CUDA error: unspecified launch failure"
XID_79_LINE = ("NVRM: Xid (PCI:0000:04:00): 79, pid=2291, name=python3, "
               "GPU has fallen off the bus.")
XID_154_OTHER_LINE = ("NVRM: Xid (PCI:0000:03:00): 154, GPU recovery action changed from "
                      "0x0 (None) to 0x2 (Node Reboot Required)")


def aer_text(**counts: int) -> str:
    return "".join(f"{name} {n}\n" for name, n in counts.items())


@dataclass
class FakeFunction:
    """One PCI function in the fake tree; setters write the files the probe reads."""

    path: Path

    def set_vendor(self, vendor: int) -> None:
        config = bytearray((self.path / "config").read_bytes())
        config[0:2] = vendor.to_bytes(2, "little")
        (self.path / "config").write_bytes(bytes(config))

    def set_link(self, speed: str = "8.0 GT/s PCIe", width: int = 16,
                 max_speed: str = "8.0 GT/s PCIe", max_width: int = 16) -> None:
        (self.path / "current_link_speed").write_text(speed + "\n")
        (self.path / "max_link_speed").write_text(max_speed + "\n")
        (self.path / "current_link_width").write_text(f"{width}\n")
        (self.path / "max_link_width").write_text(f"{max_width}\n")

    def set_aer(self, correctable: int = 0, nonfatal: int = 0, fatal: int = 0) -> None:
        (self.path / "aer_dev_correctable").write_text(
            aer_text(RxErr=correctable, BadTLP=0, TOTAL_ERR_COR=correctable))
        (self.path / "aer_dev_nonfatal").write_text(
            aer_text(Undefined=0, TLP=nonfatal, TOTAL_ERR_NONFATAL=nonfatal))
        (self.path / "aer_dev_fatal").write_text(
            aer_text(Undefined=0, DLP=fatal, TOTAL_ERR_FATAL=fatal))


@dataclass
class FakeSysfs:
    root: Path
    gpu: FakeFunction
    port: FakeFunction

    def remove_gpu(self) -> None:
        """The kernel removed the device (e.g. after a surprise link down)."""
        os.unlink(self.root / "bus" / "pci" / "devices" / GPU_BDF)


def add_function(root: Path, parent: Path, bdf: str, vendor: int, klass: int) -> FakeFunction:
    path = parent / bdf
    path.mkdir(parents=True)
    config = bytearray(64)
    config[0:2] = vendor.to_bytes(2, "little")
    config[9:12] = klass.to_bytes(3, "little")
    (path / "config").write_bytes(bytes(config))
    (path / "vendor").write_text(f"0x{vendor:04x}\n")
    (path / "class").write_text(f"0x{klass:06x}\n")
    link = root / "bus" / "pci" / "devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(path, link.parent))
    return FakeFunction(path)


def build_sysfs(root: Path) -> FakeSysfs:
    """A healthy Gen3 x16 RTX 3090 behind a root port, plus its audio function and an A1000."""
    rc = root / "devices" / "pci0000:00"
    port = add_function(root, rc, PORT_BDF, 0x8086, 0x060400)
    gpu = add_function(root, port.path, GPU_BDF, 0x10DE, 0x030000)
    add_function(root, port.path, "0000:04:00.1", 0x10DE, 0x040300)  # HDMI audio
    other_port = add_function(root, rc, "0000:00:02.0", 0x8086, 0x060400)
    add_function(root, other_port.path, OTHER_GPU_BDF, 0x10DE, 0x030000)
    for f in (gpu, port):
        f.set_link()
        f.set_aer()
    return FakeSysfs(root, gpu, port)


class FakeNVMLError(Exception):
    """Shaped like pynvml.NVMLError: the NVML return code is in `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeEvent:
    eventType: int
    eventData: int


@dataclass
class FakeNvml:
    """A fake `pynvml` for one device. Set `lost` to make every query answer GPU_IS_LOST."""

    bus_id: str = GPU_BDF
    lost: bool = False
    init_error: int | None = None
    power_mw: int = 210_000
    temperature: int = 71
    replay: int = 0
    link: tuple[int, int, int, int] = (3, 3, 16, 16)  # gen cur, gen max, width cur, width max
    reasons: int = 0
    xid_queue: list[int] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def _check(self, name: str) -> None:
        self.calls.append(name)
        if self.lost:
            raise FakeNVMLError(15)

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlDeviceGetHandleByPciBusId(self, pci_bus_id: str) -> str:
        self._check("handle")
        if pci_bus_id != self.bus_id:
            raise FakeNVMLError(6)
        return "handle"

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        self._check("power")
        return self.power_mw

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._check("temperature")
        return self.temperature

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        self._check("replay")
        return self.replay

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        self._check("gen")
        return self.link[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self.link[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self.link[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self.link[3]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        self._check("reasons")
        return self.reasons

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        self.calls.append("register")

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> FakeEvent:
        self._check("wait")
        if not self.xid_queue:
            raise FakeNVMLError(10)  # NVML_ERROR_TIMEOUT
        return FakeEvent(0x8, self.xid_queue.pop(0))


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()
