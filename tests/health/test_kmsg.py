from __future__ import annotations

from pathlib import Path

import pytest

from ftrs.health import kmsg
from ftrs.health.kmsg import KernelLogResult, parse_line, probe_kernel_log
from ftrs.health.result import Status

from .fakes import GPU_BDF, XID_79_LINE, XID_154_OTHER_LINE

AER_PORT = "pcieport 0000:00:03.0: AER: Corrected error received: 0000:04:00.0"
BUS_ERROR = ("nvidia 0000:04:00.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, "
             "(Receiver ID)")
FATAL = "pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: 0000:04:00.0"


@pytest.mark.parametrize("line", [
    f"4,1024,61234567,-;{XID_79_LINE}",
    f"[   61.234567] {XID_79_LINE}",
    f"Sep 22 07:45:00 dell7810 kernel: {XID_79_LINE}",
])
def test_xid_79_in_every_log_shape(line: str) -> None:
    ev = parse_line(line)
    assert ev is not None and ev.kind == "xid" and ev.xid == 79 and ev.device == "0000:04:00"


def test_timestamps_from_kmsg_and_dmesg() -> None:
    a = parse_line(f"4,1024,61234567,-;{XID_79_LINE}")
    b = parse_line(f"[   61.5] {XID_79_LINE}")
    assert a is not None and a.timestamp == pytest.approx(61.234567)
    assert b is not None and b.timestamp == pytest.approx(61.5)


def test_aer_lines_name_the_source_device() -> None:
    ev = parse_line(AER_PORT)
    assert ev is not None and ev.kind == "aer" and ev.severity == "corrected"
    assert ev.device == "0000:04:00" and ev.port == "0000:00:03"
    fatal = parse_line(FATAL)
    assert fatal is not None and fatal.severity == "fatal"
    nonfatal = parse_line(FATAL.replace("(Fatal)", "(Non-Fatal)"))
    assert nonfatal is not None and nonfatal.severity == "nonfatal"


def test_field_report_log_is_lost_for_the_3090_only(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("\n".join([
        "[   10.0] nvidia: loading out-of-tree module taints kernel.",
        f"[   61.2] {XID_79_LINE}",
        "[   61.2] NVRM: GPU 0000:04:00.0: GPU has fallen off the bus.",
        f"[   61.3] {XID_154_OTHER_LINE}",
    ]) + "\n")
    r = probe_kernel_log(GPU_BDF, source=str(log))
    assert isinstance(r, KernelLogResult)
    assert r.status is Status.LOST and r.evidence["xid"] == 79
    assert "fallen off the bus" in r.reason
    assert r.tail[-1].endswith("(Node Reboot Required)")
    other = probe_kernel_log("0000:03:00.0", source=str(log))
    assert isinstance(other, KernelLogResult)
    assert other.status is Status.OK and other.xids == (154,)


def test_aer_only_is_degraded() -> None:
    r = probe_kernel_log(GPU_BDF, source=[AER_PORT, BUS_ERROR, "unrelated"])
    assert isinstance(r, KernelLogResult)
    assert r.status is Status.DEGRADED and r.aer == {"corrected": 2}


def test_events_before_since_are_ignored() -> None:
    r = probe_kernel_log(GPU_BDF, source=[f"[   61.2] {XID_79_LINE}"], since=100.0)
    assert r.status is Status.OK


def test_quiet_log_is_ok() -> None:
    assert probe_kernel_log(GPU_BDF, source=["[1.0] Linux version 6.8"]).status is Status.OK


def test_unreadable_kernel_log_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(path: str, flags: int) -> int:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("ftrs.health.kmsg.os.open", denied)
    r = probe_kernel_log(GPU_BDF, source="/dev/kmsg")
    assert r.status is Status.NOT_APPLICABLE
    assert r.reason.startswith("kernel log not readable:") and "Permission denied" in r.reason


def test_missing_log_file_is_not_applicable(tmp_path: Path) -> None:
    r = probe_kernel_log(GPU_BDF, source=str(tmp_path / "nope.log"))
    assert r.status is Status.NOT_APPLICABLE and "not readable" in r.reason


def test_real_dev_kmsg_reads_without_blocking() -> None:
    try:
        lines = kmsg.read_kernel_log("/dev/kmsg")
    except OSError as e:
        pytest.skip(f"/dev/kmsg not readable here: {e}")
    assert isinstance(lines, list)
