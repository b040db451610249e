from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from ftrs.errors import DeviceLost, KernelFault
from ftrs.health.classify import Probes, classify
from ftrs.health.crash import list_crash_reports, load_crash_report, write_crash_report
from ftrs.health.kmsg import probe_kernel_log
from ftrs.health.sysfs import probe_pci

from .fakes import GPU_BDF, XID_79_LINE, FakeSysfs

SECRET = "hf_SECRETTOKEN_do_not_leak_1234"


def _lost(sysfs: FakeSysfs) -> tuple[DeviceLost, Probes]:
    sysfs.gpu.set_vendor(0xFFFF)
    probes = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root),
                    kernel_log=probe_kernel_log(GPU_BDF, source=["[1.0] boot", XID_79_LINE]))
    err = classify("CUDA error: unspecified launch failure", probes)
    assert isinstance(err, DeviceLost)
    return err, probes


def test_crash_report_round_trips(tmp_path: Path, sysfs: FakeSysfs) -> None:
    err, probes = _lost(sysfs)
    steps = [{"step": i, "prefill_tokens": 8192, "fetch_bytes": 1 << 30} for i in range(100)]
    now = dt.datetime(2026, 9, 22, 7, 45, 1, 123000, tzinfo=dt.timezone.utc)
    path = write_crash_report(tmp_path, err, probes=probes, flight_recorder=steps, steps=8,
                              now=now)
    assert path == tmp_path / "crash" / "20260922T074501.123Z-DeviceLost.json"
    report = load_crash_report(path)
    assert report.classification == "DeviceLost" and report.message == err.message
    assert report.evidence["pci_vendor"] == "0xffff" and report.evidence["xid"] == 79
    data = report.data
    assert data["code"] == "device_lost" and data["exit_code"] == 86
    assert data["hint"] == err.evidence["hint"]
    assert data["probes"]["pci"]["status"] == "lost"
    assert data["kernel_log_tail"] == ["[1.0] boot", XID_79_LINE]
    assert [s["step"] for s in data["flight_recorder"]] == list(range(92, 100))
    assert data["host"]["python"] and data["host"]["kernel"] and data["ftrs_version"]
    assert list_crash_reports(tmp_path) == [path]


def test_crash_report_holds_no_environment(tmp_path: Path, sysfs: FakeSysfs,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("FTRS_TEST_SENTINEL_VAR", SECRET)
    err, probes = _lost(sysfs)
    path = write_crash_report(tmp_path, err, probes=probes)
    text = path.read_text()
    assert SECRET not in text and "FTRS_TEST_SENTINEL_VAR" not in text
    assert not {"env", "environ", "environment"} & set(json.loads(text))


def test_reports_never_overwrite_and_list_oldest_first(tmp_path: Path) -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    a = write_crash_report(tmp_path, KernelFault("first"), now=now)
    b = write_crash_report(tmp_path, KernelFault("second"), now=now)
    c = write_crash_report(tmp_path, KernelFault("third"), now=now + dt.timedelta(seconds=1))
    assert a != b and list_crash_reports(tmp_path) == [a, b, c]
    assert load_crash_report(b).message == "second"
    assert not [p for p in (tmp_path / "crash").iterdir() if p.name.endswith(".tmp")]


def test_no_crash_dir_lists_nothing(tmp_path: Path) -> None:
    assert list_crash_reports(tmp_path / "none") == []


def test_loading_something_else_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a crash report"):
        load_crash_report(bad)
    bad.write_text("{half")
    with pytest.raises(ValueError, match="not a readable crash report"):
        load_crash_report(bad)


def test_failed_write_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("ftrs.health.crash.os.replace", boom)
    with pytest.raises(OSError):
        write_crash_report(tmp_path, KernelFault("x"))
    assert list((tmp_path / "crash").iterdir()) == []
