"""The adaptive guard on the device monitor's samples, with the supervisor's fault injection."""

from __future__ import annotations

from pathlib import Path

from ftrs.guard.adaptive import AdaptiveGuard
from ftrs.health.monitor import DeviceMonitor, MonitorConfig
from ftrs.health.state import DeviceState
from ftrs.server.metrics import ServerMetrics

from .conftest import GPU


def monitor(root: Path, guard: AdaptiveGuard, metrics: ServerMetrics) -> DeviceMonitor:
    def on_sample(state: DeviceState) -> None:
        guard.observe(state)
        metrics.observe_experts(guard.stats())

    cfg = MonitorConfig(bdf=GPU, sysfs_root=str(root), slow_interval_s=0.0, kernel_log=None,
                        use_nvml=False)
    return DeviceMonitor(cfg, on_sample=on_sample)


def cap_metric(metrics: ServerMetrics) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith("ftrs_prefill_cap_tokens "):
            return float(line.split()[1])
    raise AssertionError("ftrs_prefill_cap_tokens not in /metrics")


def test_replay_growth_shrinks_the_chunk_and_paces(gpu_sysfs: Path) -> None:
    guard, metrics = AdaptiveGuard(8192, floor=1024), ServerMetrics()
    mon = monitor(gpu_sysfs, guard, metrics)
    mon.tick()
    mon.tick()
    assert guard.cap_tokens == 8192 and guard.pacing_gbps is None  # a quiet link: no change
    assert cap_metric(metrics) == 8192
    mon.inject("replay_growth")  # the AER correctable total grows on every sample
    mon.tick()
    assert guard.cap_tokens == 4096
    assert guard.pacing_gbps == 6.0  # half of Gen3 x16's nominal 12 GB/s
    assert "AER correctable rose" in guard.events[-1].reason
    assert cap_metric(metrics) == 4096
    mon.tick()
    mon.tick()
    mon.tick()
    assert guard.cap_tokens == 1024 and cap_metric(metrics) == 1024  # halved down to the floor


def test_link_downshift_shrinks_the_chunk(gpu_sysfs: Path) -> None:
    guard, metrics = AdaptiveGuard(8192), ServerMetrics()
    mon = monitor(gpu_sysfs, guard, metrics)
    mon.tick()
    mon.inject("link_degraded")  # Gen1 at half the width
    mon.tick()
    assert guard.cap_tokens == 4096
    assert "down-shifted" in guard.events[-1].reason
    assert guard.pacing_gbps == 0.75  # half of Gen1 x8 (3 GB/s * 8/16)


def test_replay_counter_rise_alone_counts() -> None:
    guard = AdaptiveGuard(2048)
    base = DeviceState(up=True, state="ok", link_gen_current=3, link_gen_max=3,
                       link_width_current=16, link_width_max=16, pcie_replay=10)
    assert guard.observe(base) is None
    assert guard.observe(base) is None
    event = guard.observe(DeviceState(**{**base.to_dict(), "pcie_replay": 42}))
    assert event is not None and "PCIe replays rose 10 -> 42" in event.reason
    assert guard.cap_tokens == 1024


def test_idle_speed_drop_without_degraded_state_is_ignored() -> None:
    guard = AdaptiveGuard(2048)
    busy = DeviceState(up=True, state="ok", link_gen_current=3, link_gen_max=3,
                       link_width_current=16, link_width_max=16)
    guard.observe(busy)
    assert guard.observe(DeviceState(**{**busy.to_dict(), "link_gen_current": 1})) is None
    assert guard.cap_tokens == 2048
