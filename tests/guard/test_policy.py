"""The startup link guard on fake link states; expected caps computed here from the rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ftrs.errors import DeviceLost
from ftrs.guard.fetch import FetchModel
from ftrs.guard.link import LinkState, probe_link
from ftrs.guard.policy import decide_prefill_cap
from ftrs.health.crash import load_crash_report, write_crash_report

from .conftest import GPU, set_link

# The demo model's shapes in bf16: 30 MoE layers, 8 experts top-2, experts of 3 x (1536 x 576).
DEMO_EXPERT = 3 * 1536 * 576 * 2
DEMO = FetchModel("demo", DEMO_EXPERT, 30, 8, 2)
# A model whose chunk fetch grows ~linearly with the chunk: 4096 experts, top-1, 1 MB each.
WIDE = FetchModel("wide", 1_000_000, 10, 4096, 1)


def link(gen: int, width: int, max_gen: int = 3, max_width: int = 16) -> LinkState:
    return LinkState(device="cuda", bdf=GPU, gen_current=gen, gen_max=max_gen,
                     width_current=width, width_max=max_width, link_source="test")


GEN3_X16 = link(3, 16)
GEN3_X8_DOWN = link(3, 8)
GEN4_X16 = link(4, 16, max_gen=4)


def wide_fit(gbps: float, window: float = 0.5) -> int:
    """Largest C with 10 * 4096 * (1 - (1 - 1/4096)^C) * 1e6 <= gbps * 1e9 * window."""
    experts_per_layer = gbps * 1e9 * window / (10 * 1e6)
    return math.floor(math.log(1 - experts_per_layer / 4096) / math.log(1 - 1 / 4096))


def lost_report(home: Path, chunk: int | None) -> None:
    steps = [{"step": 1, "chunk_tokens": 512}, {"step": 2, "chunk_tokens": chunk}] if chunk else []
    write_crash_report(home, DeviceLost("GPU fell off the bus", evidence={"bdf": GPU}),
                       flight_recorder=steps)


def reports(home: Path) -> list:
    return [load_crash_report(p) for p in sorted((home / "crash").glob("*.json"))]


def test_gen3_x16_healthy_demo_is_not_capped() -> None:
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192)
    # every expert once: 30 * 8 * 5308416 B = 1.27 GB, 0.106 s at 12 GB/s < 0.5 s
    assert d.cap_tokens is None and d.max_prefill_length == 8192
    assert "1.27 GB" in d.reasons[0] and "0.106 s" in d.reasons[0]


def test_gen3_x8_downshift_halves() -> None:
    d = decide_prefill_cap(GEN3_X8_DOWN, DEMO, requested=8192)
    assert d.cap_tokens == 4096
    assert any("Gen3 x8" in r and "8192 -> 4096" in r for r in d.reasons)
    assert d.numbers["link_gbps"] == pytest.approx(6.0)


def test_gen4_x16_not_capped() -> None:
    d = decide_prefill_cap(GEN4_X16, DEMO, requested=8192)
    assert d.cap_tokens is None and d.numbers["link_gbps"] == pytest.approx(25.0)


def test_prior_device_loss_halves_the_chunk_it_died_at(tmp_path: Path) -> None:
    lost_report(tmp_path, 8192)
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert d.cap_tokens == 4096 and d.numbers["lost_chunk_tokens"] == 8192
    lost_report(tmp_path, 4096)  # died again at the new ceiling: bisect further
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert d.cap_tokens == 2048


def test_device_loss_without_recorded_chunk_halves_the_cap(tmp_path: Path) -> None:
    lost_report(tmp_path, None)
    d = decide_prefill_cap(GEN3_X8_DOWN, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert d.cap_tokens == 2048  # 8192 -> 4096 (down-shift) -> 2048 (loss)


def test_loss_on_another_device_does_not_count(tmp_path: Path) -> None:
    write_crash_report(tmp_path, DeviceLost("other", evidence={"bdf": "0000:03:00.0"}),
                       flight_recorder=[{"chunk_tokens": 8192}])
    assert decide_prefill_cap(GEN3_X16, DEMO, requested=8192,
                              crash_reports=reports(tmp_path)).cap_tokens is None


def test_a_drill_is_no_loss(tmp_path: Path) -> None:
    """A `--fault-inject device_lost` drill writes a DeviceLost report marked as a drill: it
    caps nothing, and is named in the reasons; a real loss after it still halves."""
    write_crash_report(tmp_path, DeviceLost("device_lost (injected at step 4)", evidence={
        "bdf": GPU, "injected": True, "fault_inject": "device_lost@step=4"}),
        flight_recorder=[{"chunk_tokens": 8192}])
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert d.cap_tokens is None and "device_lost_reports" not in d.numbers
    assert len(d.numbers["drill_reports"]) == 1 and any("drill, ignored" in r for r in d.reasons)
    lost_report(tmp_path, 8192)
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert d.cap_tokens == 4096 and d.numbers["loss_halvings"] == 1


@pytest.mark.parametrize(("state", "gbps"), [(GEN3_X16, 12.0), (GEN4_X16, 25.0)])
def test_window_caps_a_chunk_whose_fetch_exceeds_it(state: LinkState, gbps: float) -> None:
    d = decide_prefill_cap(state, WIDE, requested=8192)
    assert d.cap_tokens == wide_fit(gbps)
    assert d.cap_tokens is not None and 256 <= d.cap_tokens < 8192
    assert f"{d.cap_tokens} tokens fit" in d.reasons[0]


def test_window_then_downshift_respects_the_floor() -> None:
    fit = wide_fit(6.0)
    d = decide_prefill_cap(GEN3_X8_DOWN, WIDE, requested=8192)
    assert d.cap_tokens == max(256, fit // 2)


def test_unmeetable_window_warns_and_does_not_cap() -> None:
    slow = link(1, 1, max_gen=1, max_width=1)  # 0.1875 GB/s: even 256 tokens move 1.27 GB
    d = decide_prefill_cap(slow, DEMO, requested=8192)
    assert d.cap_tokens is None and "no chunk size fixes this link" in d.warnings[0]


def test_overrides_and_resident() -> None:
    assert decide_prefill_cap(GEN3_X8_DOWN, DEMO, requested=8192, no_link_guard=True,
                              explicit_request=True).cap_tokens is None
    alone = decide_prefill_cap(GEN3_X8_DOWN, DEMO, requested=8192, no_link_guard=True)
    assert alone.cap_tokens == 4096 and "needs an explicit" in alone.warnings[0]
    explicit = decide_prefill_cap(GEN3_X8_DOWN, DEMO, requested=8192, explicit_request=True)
    assert explicit.cap_tokens == 4096 and "--no-link-guard" in explicit.warnings[-1]
    assert decide_prefill_cap(GEN3_X8_DOWN, DEMO, requested=8192,
                              strategy="resident").cap_tokens is None


def test_probe_reads_a_downshifted_fake_tree(gpu_sysfs: Path) -> None:
    set_link(gpu_sysfs / "bus" / "pci" / "devices" / GPU, "8.0 GT/s PCIe", 8, "8.0 GT/s PCIe", 16)
    state = probe_link(sysfs_root=gpu_sysfs, use_nvml=False)
    assert (state.bdf, state.gen_current, state.width_current, state.width_max) == (GPU, 3, 8, 16)
    assert state.below_max and state.nominal_gbps == pytest.approx(6.0)
    assert decide_prefill_cap(state, DEMO, requested=8192).cap_tokens == 4096


def test_idle_speed_drop_is_not_a_downshift(gpu_sysfs: Path) -> None:
    set_link(gpu_sysfs / "bus" / "pci" / "devices" / GPU, "2.5 GT/s PCIe", 16, "8.0 GT/s PCIe", 16)
    idle = probe_link(sysfs_root=gpu_sysfs, use_nvml=False, under_load=False)
    assert not idle.below_max and idle.nominal_gbps == pytest.approx(12.0)
    assert probe_link(sysfs_root=gpu_sysfs, use_nvml=False, under_load=True).below_max
