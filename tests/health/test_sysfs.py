from __future__ import annotations

import pytest

from ftrs.health.result import Status
from ftrs.health.sysfs import (
    discover_nvidia_gpus,
    normalize_bdf,
    parse_aer,
    parse_link_speed,
    probe_pci,
)

from .fakes import GPU_BDF, OTHER_GPU_BDF, PORT_BDF, FakeSysfs


@pytest.mark.parametrize(("text", "gen"), [
    ("2.5 GT/s PCIe", 1), ("5.0 GT/s PCIe", 2), ("8.0 GT/s PCIe", 3), ("16.0 GT/s PCIe", 4),
    ("32.0 GT/s PCIe", 5), ("64.0 GT/s PCIe", 6), ("8 GT/s", 3), ("Unknown", None), ("", None),
])
def test_link_speed_maps_to_generation(text: str, gen: int | None) -> None:
    assert parse_link_speed(text) == gen


def test_aer_lines_parse_to_counts() -> None:
    assert parse_aer("RxErr 2\nBadTLP 1\nTOTAL_ERR_COR 3\ngarbage\n") == {
        "RxErr": 2, "BadTLP": 1, "TOTAL_ERR_COR": 3}


def test_bdf_spellings_normalize() -> None:
    assert normalize_bdf("04:00.0") == GPU_BDF
    assert normalize_bdf("00000000:04:00.0") == GPU_BDF
    assert normalize_bdf("0000:04:00.0\n") == GPU_BDF
    with pytest.raises(ValueError):
        normalize_bdf("cuda:0")


def test_discovery_finds_display_functions_only(sysfs: FakeSysfs) -> None:
    assert discover_nvidia_gpus(sysfs.root) == [OTHER_GPU_BDF, GPU_BDF]


def test_discovery_without_pci_bus_is_empty(tmp_path: object) -> None:
    assert discover_nvidia_gpus(f"{tmp_path}/nothing") == []


def test_healthy_gpu_reads_vendor_link_aer_and_upstream(sysfs: FakeSysfs) -> None:
    sysfs.port.set_aer(correctable=5)
    r = probe_pci(GPU_BDF, root=sysfs.root)
    assert r.status is Status.OK
    assert r.vendor == 0x10DE and r.evidence["pci_vendor"] == "0x10de"
    assert r.link is not None and (r.link.current_gen, r.link.current_width) == (3, 16)
    assert r.aer is not None and r.aer.correctable == 0 and r.aer.fatal == 0
    assert r.upstream is not None and r.upstream.bdf == PORT_BDF
    assert r.upstream.aer is not None and r.upstream.aer.correctable == 5


def test_all_ones_vendor_is_lost(sysfs: FakeSysfs) -> None:
    sysfs.gpu.set_vendor(0xFFFF)
    r = probe_pci(GPU_BDF, root=sysfs.root, detail=False)
    assert r.status is Status.LOST
    assert r.evidence["pci_vendor"] == "0xffff"
    assert "all ones" in r.reason


def test_missing_device_is_lost_only_if_seen_before(sysfs: FakeSysfs) -> None:
    sysfs.remove_gpu()
    assert probe_pci(GPU_BDF, root=sysfs.root).status is Status.LOST
    never = probe_pci(GPU_BDF, root=sysfs.root, was_present=False)
    assert never.status is Status.NOT_APPLICABLE and never.reason


def test_no_sysfs_at_all_is_not_applicable(tmp_path: object) -> None:
    r = probe_pci(GPU_BDF, root=f"{tmp_path}/empty", was_present=False)
    assert r.status is Status.NOT_APPLICABLE


def test_gen3_x8_on_an_x16_link_is_degraded(sysfs: FakeSysfs) -> None:
    sysfs.gpu.set_link(width=8)
    r = probe_pci(GPU_BDF, root=sysfs.root)
    assert r.status is Status.DEGRADED
    assert "x8" in r.reason and "x16" in r.reason


def test_lower_speed_is_degraded_only_when_busy(sysfs: FakeSysfs) -> None:
    # NVIDIA GPUs drop to Gen1 when idle; that is power saving, not a fault.
    sysfs.gpu.set_link(speed="2.5 GT/s PCIe")
    assert probe_pci(GPU_BDF, root=sysfs.root).status is Status.OK
    assert probe_pci(GPU_BDF, root=sysfs.root, busy=True).status is Status.DEGRADED


def test_aer_rise_since_earlier_sample(sysfs: FakeSysfs) -> None:
    before = probe_pci(GPU_BDF, root=sysfs.root).aer
    sysfs.gpu.set_aer(correctable=4, fatal=1)
    after = probe_pci(GPU_BDF, root=sysfs.root).aer
    assert after is not None
    assert after.rise_since(before) == {"correctable": 4, "fatal": 1}
    assert after.rise_since(after) == {}


def test_result_is_json_ready(sysfs: FakeSysfs) -> None:
    import json

    d = probe_pci(GPU_BDF, root=sysfs.root).to_dict()
    assert json.loads(json.dumps(d))["status"] == "ok"
    assert d["link"]["max_width"] == 16
