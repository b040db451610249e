from __future__ import annotations

import json

import pytest

from ftrs.health.nvml import NvmlProbe
from ftrs.health.result import not_applicable
from ftrs.health.state import build_state
from ftrs.health.sysfs import probe_pci

from .fakes import GPU_BDF, FakeNvml, FakeSysfs


def test_state_merges_sysfs_and_nvml(sysfs: FakeSysfs, fake_nvml: FakeNvml) -> None:
    sysfs.gpu.set_aer(correctable=2)
    fake_nvml.replay = 7
    s = build_state(GPU_BDF, probe_pci(GPU_BDF, root=sysfs.root),
                    NvmlProbe(GPU_BDF, nvml=fake_nvml).sample(), state="ok", sample_time=5.0)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["up"] is True and d["state"] == "ok" and d["bdf"] == GPU_BDF
    assert (d["link_gen_current"], d["link_width_max"]) == (3, 16)
    assert d["power_w"] == 210.0 and d["temperature_c"] == 71 and d["pcie_replay"] == 7
    assert d["aer_correctable"] == 2 and d["last_sample_time"] == 5.0


def test_nvml_link_is_used_when_sysfs_is_not_available(fake_nvml: FakeNvml) -> None:
    fake_nvml.link = (4, 4, 8, 16)
    s = build_state(GPU_BDF, not_applicable("pci", "no sysfs"),
                    NvmlProbe(GPU_BDF, nvml=fake_nvml).sample(), state="degraded")
    assert (s.link_gen_current, s.link_width_current, s.link_width_max) == (4, 8, 16)


def test_lost_is_down_and_unknown_states_are_rejected() -> None:
    assert build_state(GPU_BDF, None, None, state="lost").up is False
    assert build_state(GPU_BDF, None, None, state="hang").up is True
    with pytest.raises(ValueError):
        build_state(GPU_BDF, None, None, state="fine")
