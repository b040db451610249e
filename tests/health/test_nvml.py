from __future__ import annotations

import sys

import pytest

from ftrs.health.nvml import NvmlProbe, NvmlResult, nvml_code
from ftrs.health.result import Status

from .fakes import GPU_BDF, FakeNvml, FakeNVMLError


def test_healthy_sample_reads_every_field(fake_nvml: FakeNvml) -> None:
    r = NvmlProbe(GPU_BDF, nvml=fake_nvml).sample()
    assert isinstance(r, NvmlResult) and r.status is Status.OK
    assert r.power_w == 210.0 and r.temperature_c == 71 and r.pcie_replay == 0
    assert (r.link_gen_current, r.link_gen_max, r.link_width_current, r.link_width_max) == (
        3, 3, 16, 16)
    assert r.xids == ()


def test_gpu_is_lost_on_any_query_is_lost(fake_nvml: FakeNvml) -> None:
    probe = NvmlProbe(GPU_BDF, nvml=fake_nvml)
    assert probe.sample().status is Status.OK
    fake_nvml.lost = True
    r = probe.sample()
    assert r.status is Status.LOST
    assert r.evidence["nvml"] == "GPU_IS_LOST"


def test_critical_xid_79_event_is_lost_and_other_xids_are_recorded(fake_nvml: FakeNvml) -> None:
    probe = NvmlProbe(GPU_BDF, nvml=fake_nvml)
    fake_nvml.xid_queue = [13]
    r = probe.sample()
    assert r.status is Status.OK and r.xids == (13,)
    fake_nvml.xid_queue = [154, 79]
    r = probe.sample()
    assert r.status is Status.LOST and r.xids == (154, 79) and r.evidence["xid"] == 79


def test_narrow_link_and_hardware_slowdown_are_degraded(fake_nvml: FakeNvml) -> None:
    fake_nvml.link = (3, 3, 8, 16)
    r = NvmlProbe(GPU_BDF, nvml=fake_nvml).sample()
    assert r.status is Status.DEGRADED and "x8" in r.reason
    fake_nvml.link = (3, 3, 16, 16)
    fake_nvml.reasons = 0x80 | 0x1
    r = NvmlProbe(GPU_BDF, nvml=fake_nvml).sample()
    assert r.status is Status.DEGRADED and "hw_power_brake_slowdown" in r.reason


def test_no_driver_is_not_applicable_and_not_retried(fake_nvml: FakeNvml) -> None:
    fake_nvml.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    probe = NvmlProbe(GPU_BDF, nvml=fake_nvml)
    assert probe.sample().status is Status.NOT_APPLICABLE
    assert probe.sample().status is Status.NOT_APPLICABLE
    assert fake_nvml.calls.count("nvmlInit") == 1


def test_unknown_device_is_not_applicable(fake_nvml: FakeNvml) -> None:
    r = NvmlProbe("0000:65:00.0", nvml=fake_nvml).sample()
    assert r.status is Status.NOT_APPLICABLE and "NVML unavailable" in r.reason


def test_unsupported_field_is_none_not_an_error() -> None:
    class NoReplay(FakeNvml):
        def nvmlDeviceGetPcieReplayCounter(self, handle: object) -> int:
            raise FakeNVMLError(3)  # NOT_SUPPORTED

    r = NvmlProbe(GPU_BDF, nvml=NoReplay()).sample()
    assert r.status is Status.OK and r.pcie_replay is None and r.errors == {}


def test_real_pynvml_on_a_machine_without_driver_is_not_applicable() -> None:
    # The test machine has no NVIDIA driver; with one, the device may simply not exist.
    r = NvmlProbe("0000:7f:1f.7").sample()
    assert r.status is Status.NOT_APPLICABLE and r.reason


def test_missing_pynvml_module_is_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    r = NvmlProbe(GPU_BDF).sample()
    assert r.status is Status.NOT_APPLICABLE and "pynvml" in r.reason


def test_real_pynvml_errors_carry_their_code() -> None:
    pynvml = pytest.importorskip("pynvml")
    assert nvml_code(pynvml.NVMLError(15)) == 15
    assert nvml_code(pynvml.NVMLError_GpuIsLost()) == 15
    assert nvml_code(ValueError("x")) is None
