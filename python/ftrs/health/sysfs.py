"""PCI probe over sysfs: is the GPU still on the bus, and how healthy is its link?

Reads, for one device (by BDF, e.g. "0000:04:00.0") under a root that defaults to "/sys":

- `bus/pci/devices/<BDF>/config`: the first two bytes are the vendor id. 0x10de is NVIDIA;
  0xffff ("all ones") means the device no longer answers config cycles, i.e. it fell off the
  bus. A device directory that disappears after it was seen is also gone.
- `current_link_speed` / `max_link_speed` ("8.0 GT/s PCIe" → Gen3) and `*_link_width`.
- AER counters `aer_dev_correctable|nonfatal|fatal` (lines "RxErr 0" ... "TOTAL_ERR_COR 3").

The same link and AER files are read for the upstream port: the parent directory of the
device's real path (`/sys/devices/pci0000:00/0000:00:03.0/0000:04:00.0` → `0000:00:03.0`).
A fake tree for tests is laid out the same way, with the `bus/pci/devices` entry a symlink.

NVIDIA GPUs lower their link speed when idle to save power, so a speed below max counts as
degraded only when the caller says the device is busy; a width below max always does.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from ftrs.health.result import ProbeResult, Status

logger = logging.getLogger(__name__)

NVIDIA_VENDOR = 0x10DE
VENDOR_GONE = 0xFFFF
_SPEED_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_BDF_RE = re.compile(r"^(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
_AER_FILES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal",
              "fatal": "aer_dev_fatal"}
_AER_TOTALS = {"correctable": "TOTAL_ERR_COR", "nonfatal": "TOTAL_ERR_NONFATAL",
               "fatal": "TOTAL_ERR_FATAL"}


def normalize_bdf(bdf: str) -> str:
    """"04:00.0", "00000000:04:00.0" (NVML) or "0000:04:00.0" → "0000:04:00.0"."""
    m = _BDF_RE.match(bdf.strip().lower())
    if m is None:
        raise ValueError(f"not a PCI address (domain:bus:device.function): {bdf!r}")
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def parse_link_speed(text: str) -> int | None:
    """"8.0 GT/s PCIe" or "8 GT/s" → 3; "Unknown" → None."""
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text)
    if m is None:
        return None
    return _SPEED_TO_GEN.get(float(m.group(1)))


def parse_aer(text: str) -> dict[str, int]:
    """Lines "NAME count" → {NAME: count}; malformed lines are skipped."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    return counts


@dataclass(frozen=True)
class LinkInfo:
    """PCIe link of one function, as sysfs reports it. None where a file is absent or odd."""

    current_gen: int | None
    max_gen: int | None
    current_width: int | None
    max_width: int | None
    current_speed: str = ""
    max_speed: str = ""

    @property
    def width_below_max(self) -> bool:
        return _below(self.current_width, self.max_width)

    @property
    def speed_below_max(self) -> bool:
        return _below(self.current_gen, self.max_gen)


def _below(current: int | None, maximum: int | None) -> bool:
    return current is not None and maximum is not None and current < maximum


@dataclass(frozen=True)
class AerCounts:
    """AER error totals since boot (None where the kernel does not expose the file)."""

    correctable: int | None = None
    nonfatal: int | None = None
    fatal: int | None = None
    #: Per-kind counters by name, e.g. {"correctable": {"RxErr": 2, "BadTLP": 1}}.
    detail: dict[str, dict[str, int]] = field(default_factory=dict)

    def rise_since(self, before: AerCounts | None) -> dict[str, int]:
        """Positive differences per kind against an earlier sample (empty if none rose)."""
        if before is None:
            return {}
        rises: dict[str, int] = {}
        for kind in _AER_FILES:
            now, then = getattr(self, kind), getattr(before, kind)
            if now is not None and then is not None and now > then:
                rises[kind] = now - then
        return rises


@dataclass(frozen=True)
class PortInfo:
    """The upstream port (root port or switch port) above the device."""

    bdf: str
    link: LinkInfo | None
    aer: AerCounts | None


@dataclass(frozen=True, kw_only=True)
class PciResult(ProbeResult):
    """Result of `probe_pci`. `vendor` is None when config space could not be read."""

    bdf: str
    vendor: int | None = None
    link: LinkInfo | None = None
    aer: AerCounts | None = None
    upstream: PortInfo | None = None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip(), 0)
    except ValueError:
        return None


def read_link(directory: Path) -> LinkInfo | None:
    """The link files of one PCI function; None when none of them exists."""
    cur_speed = _read_text(directory / "current_link_speed")
    max_speed = _read_text(directory / "max_link_speed")
    cur_width = _read_int(directory / "current_link_width")
    max_width = _read_int(directory / "max_link_width")
    if cur_speed is None and max_speed is None and cur_width is None and max_width is None:
        return None
    return LinkInfo(
        current_gen=parse_link_speed(cur_speed or ""),
        max_gen=parse_link_speed(max_speed or ""),
        current_width=cur_width,
        max_width=max_width,
        current_speed=(cur_speed or "").strip(),
        max_speed=(max_speed or "").strip(),
    )


def read_aer(directory: Path) -> AerCounts | None:
    """The AER counter files of one PCI function; None when the kernel exposes none."""
    detail: dict[str, dict[str, int]] = {}
    for kind, name in _AER_FILES.items():
        text = _read_text(directory / name)
        if text is not None:
            detail[kind] = parse_aer(text)
    if not detail:
        return None
    totals = {kind: detail[kind].get(_AER_TOTALS[kind]) if kind in detail else None
              for kind in _AER_FILES}
    return AerCounts(detail=detail, **totals)


def device_dir(root: str | Path, bdf: str) -> Path:
    return Path(root) / "bus" / "pci" / "devices" / normalize_bdf(bdf)


def upstream_port_dir(root: str | Path, bdf: str) -> Path | None:
    """The parent of the device's real sysfs path, if that parent is a PCI function."""
    parent = device_dir(root, bdf).resolve().parent
    try:
        normalize_bdf(parent.name)
    except ValueError:
        return None  # the device hangs directly off a root complex ("pci0000:00")
    return parent


def read_vendor(root: str | Path, bdf: str) -> int:
    """Vendor id from the first two bytes of config space. Raises OSError if unreadable."""
    with open(device_dir(root, bdf) / "config", "rb") as f:
        raw = f.read(2)
    if len(raw) < 2:
        raise OSError(f"short read of config space ({len(raw)} bytes)")
    return int.from_bytes(raw, "little")


def discover_nvidia_gpus(root: str | Path = "/sys") -> list[str]:
    """BDFs of NVIDIA display-class functions (vendor 0x10de, class 0x03xxxx), sorted."""
    devices = Path(root) / "bus" / "pci" / "devices"
    try:
        entries = sorted(p for p in devices.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        vendor = _read_int(entry / "vendor")
        klass = _read_int(entry / "class")
        if vendor == NVIDIA_VENDOR and klass is not None and klass >> 16 == 0x03:
            found.append(entry.name)
    return found


def probe_pci(
    bdf: str, *, root: str | Path = "/sys", detail: bool = True, was_present: bool = True,
    busy: bool = False,
) -> PciResult:
    """Probe one device. `detail=False` reads only the vendor id (the cheap, frequent check).

    `was_present`: the device was seen before, so a missing directory means it left the bus.
    `busy`: the device has work, so a link speed below max counts as degraded.
    """
    bdf = normalize_bdf(bdf)
    directory = device_dir(root, bdf)
    if not directory.exists():
        if was_present:
            return PciResult(probe="pci", status=Status.LOST, bdf=bdf,
                             reason=f"PCI device {bdf} disappeared from {directory.parent}",
                             evidence={"device_dir": str(directory), "exists": False})
        return PciResult(probe="pci", status=Status.NOT_APPLICABLE, bdf=bdf,
                         reason=f"no PCI device {bdf} under {directory.parent}")
    try:
        vendor = read_vendor(root, bdf)
    except OSError as e:
        return PciResult(probe="pci", status=Status.ERROR, bdf=bdf,
                         reason=f"config space not readable: {e}")
    if not detail:
        return judge_pci(bdf, vendor)
    up_dir = upstream_port_dir(root, bdf)
    upstream = (PortInfo(bdf=up_dir.name, link=read_link(up_dir), aer=read_aer(up_dir))
                if up_dir is not None else None)
    return judge_pci(bdf, vendor, read_link(directory), read_aer(directory), upstream, busy=busy)


def judge_pci(
    bdf: str, vendor: int, link: LinkInfo | None = None, aer: AerCounts | None = None,
    upstream: PortInfo | None = None, *, busy: bool = False,
) -> PciResult:
    """The verdict on raw readings (also used by fault injection, so drills run this path)."""
    evidence: dict[str, object] = {"pci_vendor": f"0x{vendor:04x}"}
    if vendor == VENDOR_GONE:
        return PciResult(probe="pci", status=Status.LOST, bdf=bdf, vendor=vendor,
                         reason=f"config space of {bdf} reads all ones (vendor 0xffff)",
                         evidence=evidence)
    status, reason = Status.OK, ""
    if link is not None and (link.width_below_max or (busy and link.speed_below_max)):
        status = Status.DEGRADED
        reason = (f"PCIe link runs at Gen{link.current_gen} x{link.current_width}, "
                  f"max Gen{link.max_gen} x{link.max_width}")
    return PciResult(probe="pci", status=status, reason=reason, bdf=bdf, vendor=vendor,
                     link=link, aer=aer, upstream=upstream, evidence=evidence)
