from __future__ import annotations

import sys

import pytest

from ftrs.errors import (
    DeviceLost,
    DeviceOutOfMemory,
    DeviceUnhealthy,
    EngineHang,
    KernelFault,
)
from ftrs.health.child import probe_child
from ftrs.health.classify import (
    HINT_FAULT,
    HINT_HANG,
    HINT_LOST,
    HINT_OOM,
    HINT_UNCHECKED,
    HINT_UNHEALTHY,
    Probes,
    classify,
    make_hang,
)
from ftrs.health.kmsg import probe_kernel_log
from ftrs.health.nvml import NvmlProbe
from ftrs.health.result import not_applicable
from ftrs.health.sysfs import probe_pci

from .fakes import (
    FIELD_REPORT_CUDA_ERROR,
    GPU_BDF,
    XID_79_LINE,
    XID_154_OTHER_LINE,
    FakeNvml,
    FakeSysfs,
)


def _cuda_error() -> RuntimeError:
    return RuntimeError(FIELD_REPORT_CUDA_ERROR.split(": ", 1)[1])


def test_field_report_719_with_all_ones_vendor_is_device_lost(sysfs: FakeSysfs) -> None:
    sysfs.gpu.set_vendor(0xFFFF)
    err = classify(_cuda_error(), Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert isinstance(err, DeviceLost)
    assert err.evidence["bdf"] == GPU_BDF
    assert err.evidence["pci_vendor"] == "0xffff"
    assert err.evidence["cuda_error_code"] == 719
    assert err.evidence["decided_by"] == ["pci_config_vendor=0xffff"]
    assert err.evidence["hint"] == HINT_LOST and "--max-prefill-length" in HINT_LOST
    assert "unspecified launch failure" in err.message and GPU_BDF in err.message


def test_field_report_with_xid_79_names_the_xid(sysfs: FakeSysfs) -> None:
    sysfs.gpu.set_vendor(0xFFFF)
    probes = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root),
                    kernel_log=probe_kernel_log(GPU_BDF, source=[XID_79_LINE,
                                                                 XID_154_OTHER_LINE]))
    err = classify(719, probes)
    assert isinstance(err, DeviceLost)
    assert err.evidence["xid"] == 79
    assert "kernel_log_xid=79" in err.evidence["decided_by"]
    assert err.evidence["kernel_log_line"] == XID_79_LINE


def test_same_cuda_error_on_a_device_that_answers_is_a_kernel_fault(
    sysfs: FakeSysfs, fake_nvml: FakeNvml,
) -> None:
    probes = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root),
                    nvml=NvmlProbe(GPU_BDF, nvml=fake_nvml).sample(),
                    kernel_log=probe_kernel_log(GPU_BDF, source=[XID_154_OTHER_LINE]))
    err = classify(_cuda_error(), probes)
    assert isinstance(err, KernelFault) and not isinstance(err, DeviceLost)
    assert err.evidence["cuda_error_code"] == 719
    assert err.evidence["device_answers"] == ["pci", "nvml"]
    assert "engine fault" in err.message


def test_cuda_error_with_no_probe_available_says_loss_was_not_checked() -> None:
    probes = Probes(pci=not_applicable("pci", "no sysfs"), nvml=not_applicable("nvml", "none"))
    err = classify(_cuda_error(), probes)
    assert isinstance(err, KernelFault)
    assert err.evidence["device_answers"] == []
    assert "could not be checked" in err.message and "ftrs doctor" in err.evidence["hint"]


def test_nvml_gpu_is_lost_is_device_lost(sysfs: FakeSysfs, fake_nvml: FakeNvml) -> None:
    fake_nvml.lost = True
    probes = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root),
                    nvml=NvmlProbe(GPU_BDF, nvml=fake_nvml).sample())
    err = classify(_cuda_error(), probes)
    assert isinstance(err, DeviceLost)
    assert err.evidence["nvml"] == "GPU_IS_LOST" and err.evidence["decided_by"] == [
        "nvml=GPU_IS_LOST"]


def test_failing_child_probe_is_device_lost() -> None:
    child = probe_child(command=[sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=30)
    err = classify(_cuda_error(), Probes(pci=not_applicable("pci", "no sysfs"), child=child))
    assert isinstance(err, DeviceLost)
    assert err.evidence["child_probe"]["exit_code"] == 3
    assert err.evidence["decided_by"] == ["child_probe=failed"]


def test_passing_child_probe_keeps_it_a_kernel_fault() -> None:
    child = probe_child(command=[sys.executable, "-c", "pass"], timeout_s=30)
    err = classify(_cuda_error(), Probes(child=child))
    assert isinstance(err, KernelFault) and err.evidence["device_answers"] == ["child"]


def test_out_of_memory_is_device_out_of_memory(sysfs: FakeSysfs) -> None:
    err = classify("CUDA out of memory. Tried to allocate 2.00 GiB",
                   Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert isinstance(err, DeviceOutOfMemory)
    assert err.evidence["decided_by"] == ["cuda_out_of_memory"]


def test_loss_wins_over_out_of_memory(sysfs: FakeSysfs) -> None:
    sysfs.gpu.set_vendor(0xFFFF)
    err = classify("CUDA out of memory", Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert isinstance(err, DeviceLost)


def test_python_bug_is_not_a_device_error(sysfs: FakeSysfs) -> None:
    assert classify(KeyError("x"), Probes(pci=probe_pci(GPU_BDF, root=sysfs.root))) is None


def test_healthy_device_without_error_is_none(sysfs: FakeSysfs, fake_nvml: FakeNvml) -> None:
    probes = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root),
                    nvml=NvmlProbe(GPU_BDF, nvml=fake_nvml).sample())
    assert classify(None, probes, baseline=probes) is None


def test_narrow_link_without_cuda_error_is_unhealthy(sysfs: FakeSysfs) -> None:
    sysfs.gpu.set_link(width=8)
    err = classify(None, Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert isinstance(err, DeviceUnhealthy)
    assert err.evidence["decided_by"] == ["pci_degraded"]
    assert err.evidence["link"]["current_width"] == 8


def test_rising_aer_and_replay_counters_are_unhealthy(
    sysfs: FakeSysfs, fake_nvml: FakeNvml,
) -> None:
    nvml = NvmlProbe(GPU_BDF, nvml=fake_nvml)
    before = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root), nvml=nvml.sample())
    sysfs.port.set_aer(correctable=3)
    fake_nvml.replay = 40
    after = Probes(pci=probe_pci(GPU_BDF, root=sysfs.root), nvml=nvml.sample())
    assert classify(None, after) is None  # no baseline: absolute counts decide nothing
    err = classify(None, after, baseline=before)
    assert isinstance(err, DeviceUnhealthy)
    assert err.evidence["aer_rise"] == {"upstream_correctable": 3}
    assert err.evidence["pcie_replay_rise"] == 40


def test_hang_stays_a_hang_on_a_live_device_and_becomes_loss_on_a_dead_one(
    sysfs: FakeSysfs,
) -> None:
    hang = make_hang(130.0, 120.0)
    err = classify(hang, Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert isinstance(err, EngineHang) and err.evidence["device_answers"] == ["pci"]
    assert err.evidence["stalled_s"] == 130.0
    sysfs.gpu.set_vendor(0xFFFF)
    lost = classify(hang, Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert isinstance(lost, DeviceLost) and "EngineHang" in lost.message


@pytest.mark.parametrize(("cls", "hint"), [
    (KernelFault, HINT_FAULT), (EngineHang, HINT_HANG), (DeviceOutOfMemory, HINT_OOM),
    (DeviceUnhealthy, HINT_UNHEALTHY), (DeviceLost, HINT_LOST)])
def test_a_device_error_without_a_hint_gets_the_hint_of_its_own_class(
    sysfs: FakeSysfs, cls: type, hint: str,
) -> None:
    """A drill raises the class itself with no hint; the device still answers."""
    drill = cls(f"{cls.__name__} (injected at step 3)", evidence={"injected": True})
    err = classify(drill, Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert type(err) is cls and err.evidence["hint"] == hint
    assert err.evidence["device_answers"] == ["pci"] and err.evidence["injected"] is True


def test_a_fault_no_probe_saw_answering_says_loss_was_not_checked() -> None:
    for cls in (KernelFault, EngineHang):
        err = classify(cls("x"), Probes())
        assert err is not None and err.evidence["hint"] == HINT_UNCHECKED


def test_a_hint_the_error_carries_is_kept(sysfs: FakeSysfs) -> None:
    err = classify(KernelFault("x", evidence={"hint": "mine"}),
                   Probes(pci=probe_pci(GPU_BDF, root=sysfs.root)))
    assert err is not None and err.evidence["hint"] == "mine"
