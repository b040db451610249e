"""Kernel log probe: NVRM Xid lines and PCIe AER lines for one GPU.

Accepts the three shapes the same message takes:

    6,1234,61234567,-;NVRM: Xid (PCI:0000:04:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    [   61.234567] NVRM: Xid (PCI:0000:04:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    Sep 22 07:45:00 host kernel: NVRM: Xid (PCI:0000:04:00): 79, pid=1234, name=python, ...

(/dev/kmsg records, `dmesg`, journal), plus `NVRM: GPU 0000:04:00.0: GPU has fallen off the
bus.`, `pcieport 0000:00:03.0: AER: ... error received: 0000:04:00.0` and
`nvidia 0000:04:00.0: PCIe Bus Error: severity=...`. Xid lines name the device without its
function, so matching is on domain:bus:device. Xid 79 (or the "fallen off the bus" line) for
this device is loss evidence; an Xid for another GPU (say 154 on an idle A1000) is not.

An unreadable log (dmesg_restrict, no CAP_SYSLOG, no dmesg) is `not_applicable` with a reason.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ftrs.health.result import ProbeResult, Status, not_applicable
from ftrs.health.sysfs import normalize_bdf

logger = logging.getLogger(__name__)

XID_FALLEN_OFF_BUS = 79
_ADDR = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
_XID = re.compile(rf"NVRM: Xid \(PCI:(?P<addr>{_ADDR})\): (?P<xid>\d+),?\s*(?P<rest>.*)")
_FALLEN = re.compile(rf"NVRM: GPU (?:at PCI:)?(?P<addr>{_ADDR}):? GPU has fallen off the bus")
_AER_PORT = re.compile(rf"pcieport (?P<port>{_ADDR}): AER: (?P<what>.*)")
_BUS_ERROR = re.compile(rf"\S+ (?P<dev>{_ADDR}): PCIe Bus Error: severity=(?P<sev>[^,]+)")
_SOURCE = re.compile(rf"(?:received|from):? (?P<src>{_ADDR})")
_KMSG_PREFIX = re.compile(r"^\d+,\d+,(?P<us>\d+),[^;]*;")
_DMESG_PREFIX = re.compile(r"^\[\s*(?P<s>\d+\.\d+)\]\s*")
_TAIL_LINES = 50
_MAX_RECORDS = 200_000


@dataclass(frozen=True)
class KernelEvent:
    """One parsed line. `device` is domain:bus:device (no function); `port` for AER lines."""

    kind: str  # "xid" | "fallen_off_bus" | "aer"
    device: str
    line: str
    xid: int | None = None
    severity: str = ""  # AER: "corrected" | "nonfatal" | "fatal"
    port: str = ""
    timestamp: float | None = None  # seconds since boot, when the format carries it


@dataclass(frozen=True, kw_only=True)
class KernelLogResult(ProbeResult):
    """Events for the probed device, every GPU/AER event seen, and the log's last lines."""

    bdf: str
    source: str
    xids: tuple[int, ...] = ()
    aer: dict[str, int] | None = None
    events: tuple[KernelEvent, ...] = ()
    tail: tuple[str, ...] = ()


def _short(addr: str) -> str:
    """"0000:04:00", "0000:04:00.0" → "0000:04:00"."""
    if "." not in addr:
        addr += ".0"
    return normalize_bdf(addr)[:-2]


def _severity(text: str) -> str:
    low = text.lower()
    if "fatal" in low and "non" not in low:
        return "fatal"
    if "non-fatal" in low or "nonfatal" in low:
        return "nonfatal"
    return "corrected" if "correct" in low else ""


def _strip_prefix(raw: str) -> tuple[str, float | None]:
    m = _KMSG_PREFIX.match(raw)
    if m:
        return raw[m.end():], int(m.group("us")) / 1e6
    m = _DMESG_PREFIX.match(raw)
    if m:
        return raw[m.end():], float(m.group("s"))
    return raw, None


def parse_line(raw: str) -> KernelEvent | None:
    """Parse one kernel log line; None when it is neither an NVRM Xid/bus line nor AER."""
    line, ts = _strip_prefix(raw.rstrip("\n"))
    if m := _XID.search(line):
        return KernelEvent("xid", _short(m.group("addr")), line, xid=int(m.group("xid")),
                           timestamp=ts)
    if m := _FALLEN.search(line):
        return KernelEvent("fallen_off_bus", _short(m.group("addr")), line,
                           xid=XID_FALLEN_OFF_BUS, timestamp=ts)
    if m := _AER_PORT.search(line):
        src = _SOURCE.search(m.group("what"))
        port = _short(m.group("port"))
        return KernelEvent("aer", _short(src.group("src")) if src else port, line,
                           severity=_severity(m.group("what")), port=port, timestamp=ts)
    if m := _BUS_ERROR.search(line):
        return KernelEvent("aer", _short(m.group("dev")), line,
                           severity=_severity(m.group("sev")), timestamp=ts)
    return None


def _read_dev_kmsg(path: str) -> list[str]:
    """All records currently in the ring buffer, without blocking."""
    lines: list[str] = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        while len(lines) < _MAX_RECORDS:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten while reading: skip ahead
                    continue
                raise
            if not record:
                break
            lines.append(record.decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return lines


def read_kernel_log(source: str) -> list[str]:
    """Lines of the kernel log from /dev/kmsg, a file, or `dmesg`. Raises OSError."""
    if source == "dmesg":
        try:
            done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10,
                                  check=False)
        except (subprocess.TimeoutExpired, FileNotFoundError) as e:
            raise OSError(f"dmesg failed: {e}") from e
        if done.returncode != 0:
            raise OSError(f"dmesg exited {done.returncode}: {done.stderr.strip()[-200:]}")
        return done.stdout.splitlines()
    if source.startswith("/dev/kmsg"):
        return _read_dev_kmsg(source)
    with open(source, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def probe_kernel_log(
    bdf: str, *, source: str | Sequence[str] = "/dev/kmsg", since: float | None = None,
) -> ProbeResult:
    """Look for this device's Xid/bus/AER lines. `source` is a path, "dmesg", or the lines.

    `since`: ignore events stamped earlier (seconds since boot), e.g. before the engine started.
    """
    bdf = normalize_bdf(bdf)
    name = source if isinstance(source, str) else "<lines>"
    lines: Iterable[str]
    if isinstance(source, str):
        try:
            lines = read_kernel_log(source)
        except OSError as e:
            return not_applicable("kernel_log", f"kernel log not readable: {e}", source=name)
    else:
        lines = source
    lines = list(lines)
    events = [ev for ev in map(parse_line, lines) if ev is not None
              and (since is None or ev.timestamp is None or ev.timestamp >= since)]
    mine = [ev for ev in events if ev.device == bdf[:-2]]
    xids = tuple(ev.xid for ev in mine if ev.kind == "xid" and ev.xid is not None)
    aer: dict[str, int] = {}
    for ev in mine:
        if ev.kind == "aer" and ev.severity:
            aer[ev.severity] = aer.get(ev.severity, 0) + 1
    fallen = [ev for ev in mine if ev.xid == XID_FALLEN_OFF_BUS]
    status, reason = Status.OK, ""
    evidence: dict[str, object] = {"source": name}
    if xids:
        evidence["xids"] = list(xids)
    if fallen:
        status = Status.LOST
        reason = f"kernel log: {fallen[0].line.strip()}"
        evidence.update(xid=XID_FALLEN_OFF_BUS, kernel_log_line=fallen[0].line.strip())
    elif aer:
        status = Status.DEGRADED
        reason = "kernel log: PCIe AER errors for this device: " + ", ".join(
            f"{n} {k}" for k, n in sorted(aer.items()))
    return KernelLogResult(probe="kernel_log", status=status, reason=reason, bdf=bdf, source=name,
                           xids=xids, aer=aer or None, events=tuple(events),
                           tail=tuple(line.rstrip("\n") for line in lines[-_TAIL_LINES:]),
                           evidence=evidence)
