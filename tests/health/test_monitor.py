from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from ftrs.errors import DeviceError, DeviceLost, DeviceUnhealthy, EngineHang, KernelFault
from ftrs.health.child import ChildResult
from ftrs.health.monitor import DeviceMonitor, MonitorConfig
from ftrs.health.result import Status
from ftrs.health.state import DeviceState

from .fakes import GPU_BDF, XID_79_LINE, FakeNvml, FakeSysfs, wait_until


class Recorder:
    def __init__(self) -> None:
        self.faults: list[DeviceError] = []
        self.samples: list[DeviceState] = []
        self.lock = threading.Lock()

    def on_fault(self, err: DeviceError) -> None:
        with self.lock:
            self.faults.append(err)

    def on_sample(self, state: DeviceState) -> None:
        with self.lock:
            self.samples.append(state)


def _monitor(sysfs: FakeSysfs, rec: Recorder, nvml: FakeNvml | None = None, *,
             kernel_log: list[str] | None = None,
             clock: Callable[[], float] = time.monotonic) -> DeviceMonitor:
    cfg = MonitorConfig(bdf=GPU_BDF, sysfs_root=str(sysfs.root), fast_interval_s=0.005,
                        slow_interval_s=0.02, kernel_log=kernel_log or [],
                        use_nvml=nvml is not None)
    return DeviceMonitor(cfg, nvml=nvml, on_fault=rec.on_fault, on_sample=rec.on_sample,
                         clock=clock)


def test_loss_mid_run_calls_on_fault_exactly_once(sysfs: FakeSysfs, fake_nvml: FakeNvml) -> None:
    rec = Recorder()
    mon = _monitor(sysfs, rec, fake_nvml, kernel_log=[XID_79_LINE])
    mon.start()
    try:
        assert wait_until(lambda: mon.slow_samples >= 3)
        assert rec.faults == [] and mon.state.state == "ok" and mon.state.up
        assert mon.state.power_w == 210.0 and mon.state.link_width_max == 16
        sysfs.gpu.set_vendor(0xFFFF)
        assert wait_until(lambda: len(rec.faults) > 0)
        time.sleep(0.1)  # more ticks would have had time to report again
        assert wait_until(lambda: not mon.running)
    finally:
        mon.stop()
    assert len(rec.faults) == 1
    err = rec.faults[0]
    assert isinstance(err, DeviceLost)
    assert err.evidence["pci_vendor"] == "0xffff" and err.evidence["xid"] == 79
    assert mon.state.state == "lost" and not mon.state.up
    assert rec.samples[-1].state == "lost"
    assert mon.probe_seconds_total > 0
    assert mon.diagnose("CUDA error: unspecified launch failure") is not None
    assert len(rec.faults) == 1  # diagnose after the fact does not report twice


def test_injected_loss_runs_the_real_detection_path(sysfs: FakeSysfs) -> None:
    rec = Recorder()
    mon = _monitor(sysfs, rec)
    mon.start()
    try:
        assert wait_until(lambda: mon.fast_samples >= 5)
        mon.inject("device_lost")
        assert wait_until(lambda: len(rec.faults) == 1)
    finally:
        mon.stop()
    assert not mon.running
    err = rec.faults[0]
    assert isinstance(err, DeviceLost) and err.evidence["decided_by"] == [
        "pci_config_vendor=0xffff"]


def test_vanished_device_directory_is_lost_once_seen(sysfs: FakeSysfs) -> None:
    rec = Recorder()
    mon = _monitor(sysfs, rec)
    assert mon.tick() is None
    sysfs.remove_gpu()
    err = mon.tick()
    assert isinstance(err, DeviceLost) and err.evidence["pci_device_dir"] == "missing"
    assert rec.faults == [err]


def test_wrong_bdf_is_not_applicable_not_lost(sysfs: FakeSysfs) -> None:
    rec = Recorder()
    cfg = MonitorConfig(bdf="0000:65:00.0", sysfs_root=str(sysfs.root), use_nvml=False,
                        kernel_log=None)
    mon = DeviceMonitor(cfg, on_fault=rec.on_fault, on_sample=rec.on_sample)
    assert mon.tick() is None and mon.tick() is None
    assert rec.faults == [] and mon.state.state == "not_applicable" and mon.state.up


@pytest.mark.parametrize("fault", ["link_degraded", "replay_growth"])
def test_injected_degradation_marks_the_state_degraded(
    sysfs: FakeSysfs, fake_nvml: FakeNvml, fault: str,
) -> None:
    rec = Recorder()
    now = [0.0]
    mon = _monitor(sysfs, rec, fake_nvml, clock=lambda: now[0])
    assert mon.tick() is None and mon.state.state == "ok"
    mon.inject(fault)
    for _ in range(2):
        now[0] += 1.0
        assert mon.tick() is None
    assert mon.state.state == "degraded", mon.state
    assert isinstance(mon.last_unhealthy, DeviceUnhealthy)
    assert rec.faults == []  # degradation is reported, not fatal
    if fault == "link_degraded":
        assert mon.state.link_width_current == 8 and mon.state.link_gen_current == 1
    else:
        assert "pcie_replay_rise" in mon.last_unhealthy.evidence


def test_watchdog_reports_a_stalled_engine_once(sysfs: FakeSysfs) -> None:
    rec = Recorder()
    now = [100.0]
    mon = DeviceMonitor(
        MonitorConfig(bdf=GPU_BDF, sysfs_root=str(sysfs.root), hang_timeout_s=10.0,
                      use_nvml=False, kernel_log=[]),
        on_fault=rec.on_fault, clock=lambda: now[0], has_pending_work=lambda: True,
        last_step_finished_at=lambda: 100.0)
    assert mon.tick() is None
    now[0] = 115.0
    err = mon.tick()
    assert isinstance(err, EngineHang) and err.evidence["device_answers"] == ["pci"]
    assert mon.state.state == "hang" and mon.state.up
    now[0] = 200.0
    mon.tick()
    assert rec.faults == [err]


def test_idle_engine_never_hangs(sysfs: FakeSysfs) -> None:
    rec = Recorder()
    now = [100.0]
    mon = DeviceMonitor(
        MonitorConfig(bdf=None, hang_timeout_s=10.0),
        on_fault=rec.on_fault, clock=lambda: now[0], has_pending_work=lambda: False,
        last_step_finished_at=lambda: 0.0)
    for _ in range(5):
        now[0] += 1000.0
        assert mon.tick() is None
    assert rec.faults == [] and mon.state.state == "not_applicable"


def test_hang_on_a_dead_device_is_device_lost_via_child_probe() -> None:
    rec = Recorder()
    now = [0.0]
    child = ChildResult(probe="child", status=Status.LOST, outcome="timeout",
                        reason="a fresh process could not use cuda:0 within 60 s")
    mon = DeviceMonitor(MonitorConfig(bdf=None, hang_timeout_s=5.0), on_fault=rec.on_fault,
                        clock=lambda: now[0], has_pending_work=lambda: True,
                        last_step_finished_at=lambda: 0.0, child_probe=lambda: child)
    mon.tick()
    now[0] = 10.0
    err = mon.tick()
    assert isinstance(err, DeviceLost) and err.evidence["decided_by"] == ["child_probe=timeout"]


def test_stop_joins_the_thread_and_is_idempotent(sysfs: FakeSysfs) -> None:
    mon = _monitor(sysfs, Recorder())
    mon.stop()  # before start: harmless
    mon = _monitor(sysfs, Recorder())
    mon.start()
    assert wait_until(lambda: mon.fast_samples > 0)
    mon.stop()
    assert not mon.running
    mon.stop()
    with pytest.raises(RuntimeError):
        mon.start()


def test_engine_cuda_error_through_diagnose_is_reported_once(
    sysfs: FakeSysfs, fake_nvml: FakeNvml,
) -> None:
    rec = Recorder()
    mon = _monitor(sysfs, rec, fake_nvml)
    err = mon.diagnose(RuntimeError("CUDA error: unspecified launch failure"))
    assert isinstance(err, KernelFault) and not isinstance(err, DeviceLost)
    assert err.evidence["device_answers"] == ["pci", "nvml"]
    oom = mon.diagnose("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert oom is not None and type(oom).__name__ == "DeviceOutOfMemory"
    assert rec.faults == [err]  # the OOM is per request, not a fault of the engine
    assert mon.fault is err and mon.tick() is err
