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
    with pytest.raises(ValueError, match=r"not a readable crash report \(no schema_version\)"):
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


def _strict(text: str) -> object:
    """Parse as strict JSON: NaN and Infinity are not JSON."""
    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_a_drill_report_says_drill_and_a_real_one_does_not(tmp_path: Path) -> None:
    drill = write_crash_report(tmp_path, KernelFault("kernel_fault (injected at step 3)", evidence={
        "injected": True, "fault_inject": "kernel_fault@step=3"}))
    real = write_crash_report(tmp_path, KernelFault("CUDA error 719"))
    assert _strict(drill.read_text())["drill"] is True  # type: ignore[index]
    assert _strict(real.read_text())["drill"] is False  # type: ignore[index]
    assert load_crash_report(drill).drill and not load_crash_report(real).drill


def test_a_loss_the_probes_were_made_to_see_is_a_drill(tmp_path: Path, sysfs: FakeSysfs) -> None:
    from ftrs.health.inject import FaultInjector

    injector = FaultInjector()
    injector.inject("device_lost")
    probes = Probes(pci=injector.apply_pci(probe_pci(GPU_BDF, root=sysfs.root)))
    err = classify(None, probes) or DeviceLost("lost (drill)")
    path = write_crash_report(tmp_path, err, probes=probes)
    assert load_crash_report(path).drill


def test_reports_written_before_the_drill_flag_are_read_by_their_evidence(tmp_path: Path) -> None:
    path = write_crash_report(tmp_path, DeviceLost("lost", evidence={"injected": True}))
    data = json.loads(path.read_text())
    del data["drill"]
    path.write_text(json.dumps(data))
    assert load_crash_report(path).drill
    data["evidence"] = {}
    path.write_text(json.dumps(data))
    assert not load_crash_report(path).drill


def test_unsampled_recorder_fields_are_null_not_nan(tmp_path: Path) -> None:
    from ftrs import _core

    rec = _core.FlightRecorder(capacity=4)
    rec.record(1, time=1.5, kind="decode", tokens=1)  # no power, no temperature: NaN inside
    steps = rec.dump()
    assert any(isinstance(v, float) and v != v for v in steps[0].values())  # the NaN is real
    err = KernelFault("x", evidence={"ratio": float("inf"), "nested": [{"w": float("nan")}]})
    path = write_crash_report(tmp_path, err, flight_recorder=steps)
    data = _strict(path.read_text())
    assert isinstance(data, dict)
    step = data["flight_recorder"][0]
    assert step["power_w"] is None and step["temperature_c"] is None and step["time"] == 1.5
    assert data["evidence"]["ratio"] is None and data["evidence"]["nested"] == [{"w": None}]
