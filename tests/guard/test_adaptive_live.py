"""The adaptive guard while serving (issue 6, item 5).

Unit level: the `KIND@after=Ts` fault form, and `LiveGuard` applying a tightening to the
scheduler's budget and the copy engine's pacing between steps. End to end: a real `ftrs serve`
(tiny mixtral on the CPU, offload strategy) with `--fault-inject replay_growth@after=1s`: the
device monitor sees the AER correctable total grow, the guard halves the step budget and turns
pacing on, `/metrics` and `/health` show it, and requests keep succeeding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftrs.engine.faults import FaultSpec, StepFaults, parse_fault_spec
from ftrs.errors import ConfigError
from ftrs.guard.live import LiveGuard
from ftrs.health.state import DeviceState
from serverproc import ServerProcess

from .conftest import FakeEngine

# ------------------------------------------------------------------------------ unit level


@pytest.mark.parametrize(("text", "spec"), [
    ("replay_growth@after=1s", FaultSpec("replay_growth", after_s=1.0)),
    ("link_degraded@after=0.5", FaultSpec("link_degraded", after_s=0.5)),
    ("replay_growth@step=3", FaultSpec("replay_growth", 3)),
    ("device_lost@step=40", FaultSpec("device_lost", 40)),
])
def test_fault_spec_forms(text: str, spec: FaultSpec) -> None:
    parsed = parse_fault_spec(text)
    assert parsed == spec
    assert parse_fault_spec(str(parsed)) == spec


@pytest.mark.parametrize("text", ["oom@after=1s", "replay_growth@after=", "bogus@step=1",
                                  "replay_growth@step=0"])
def test_fault_spec_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_fault_spec(text)


class FakeMonitor:
    def __init__(self) -> None:
        self.injected: list[str] = []

    def inject(self, kind: str) -> None:
        self.injected.append(kind)


def test_monitor_faults_fire_at_their_step_or_time() -> None:
    mon = FakeMonitor()
    faults = StepFaults(parse_fault_spec("link_degraded@step=2"))
    faults.attach_monitor(mon)
    faults.before_step(1, None)
    assert mon.injected == []
    faults.before_step(2, None)
    faults.after_step(2)  # a monitor fault never raises from the step
    faults.before_step(2, None)
    assert mon.injected == ["link_degraded"]

    timed = StepFaults(parse_fault_spec("replay_growth@after=0.05s"))
    timed.attach_monitor(mon)
    deadline = time.monotonic() + 5
    while len(mon.injected) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mon.injected == ["link_degraded", "replay_growth"]
    timed.close()


class FakeCopier:
    def __init__(self) -> None:
        self.rates: list[float] = []

    def set_pacing(self, bytes_per_s: float) -> None:
        self.rates.append(bytes_per_s)


def _state(replays: int, gen: int = 3, width: int = 16) -> DeviceState:
    return DeviceState(up=True, state="ok", link_gen_current=gen, link_gen_max=3,
                       link_width_current=width, link_width_max=16, aer_correctable=replays)


def test_live_guard_applies_between_steps() -> None:
    copier = FakeCopier()
    engine = FakeEngine(2048, copier)
    live = LiveGuard(engine, 2048, floor=256)
    live.on_sample(_state(0))
    live.before_step()
    assert engine.budget == 2048 and copier.rates == []
    assert live.stats()["event_count"] == 0 and live.stats()["pacing"] == "off"
    live.on_sample(_state(5))  # AER correctable rose: halve, pace at half of Gen3 x16
    assert engine.budget == 2048  # the monitor thread never touches the engine
    live.before_step()
    assert engine.budget == 1024
    assert copier.rates == [6.0e9]
    stats = live.stats()
    assert stats["prefill_cap_tokens"] == 1024 and stats["startup_cap_tokens"] == 2048
    assert stats["pacing"] == "on" and stats["pcie_pacing_bytes_per_second"] == 6.0e9
    assert "AER correctable rose 0 -> 5" in stats["events"][-1]["reason"]
    for n in range(6, 12):
        live.on_sample(_state(n))
        live.before_step()
    assert engine.budget == 256  # down to the floor, never below
    assert copier.rates == [6.0e9]  # the same rate is not set twice


def test_live_guard_without_a_copy_engine_records_pacing_as_requested() -> None:
    engine = FakeEngine(1024)
    live = LiveGuard(engine, 1024, floor=256)
    live.on_sample(_state(0))
    live.on_sample(_state(0, gen=3, width=8))  # width dropped: down-shift
    live.before_step()
    assert engine.budget == 512
    stats = live.stats()
    assert stats["pacing"] == "requested" and stats["pcie_pacing_bytes_per_second"] == 0.0
    assert stats["pacing_gbps"] == 3.0
    assert "down-shifted" in stats["events"][-1]["reason"]


# ------------------------------------------------------------------------------ end to end

OPTIONS = ["--device", "cpu", "--dtype", "float32", "--moe-strategy", "offload",
           "--moe-cache-size", "2", "--no-moe-prefetch", "--max-prefill-length", "2048"]
BODY = {"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}



class Server(ServerProcess):
    """`ftrs serve` on the tiny MoE with FTRS_HOME in `home`."""

    def __init__(self, model: Path, home: Path, *args: str) -> None:
        super().__init__(["--model", str(model), "--served-model-name", "tiny", *OPTIONS, *args],
                         log=home / "server.log", home=home)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    from ftrs.models.tiny import make_tiny

    model = make_tiny("mixtral", tmp_path / "mixtral", seed=0)
    home = tmp_path / "home"
    home.mkdir()
    srv = Server(model, home, "--fault-inject", "replay_growth@after=1s")
    try:
        srv.wait_ok()
        yield srv
    finally:
        srv.stop()


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


def _complete(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["usage"]["completion_tokens"] == 8
    return body


def test_injected_replay_growth_shrinks_the_chunk_while_serving(server: Server) -> None:
    startup = _gauges(server.url)["ftrs_prefill_cap_tokens"]
    assert startup >= 512, "the startup cap leaves room to halve above the floor"
    _complete(server.url)  # before the fault fires (or just after): serves either way
    deadline = time.monotonic() + 30
    gauges = _gauges(server.url)
    while gauges["ftrs_prefill_cap_tokens"] >= startup and time.monotonic() < deadline:
        time.sleep(0.5)
        _complete(server.url)  # the budget is applied before the next step
        gauges = _gauges(server.url)
    cap = gauges["ftrs_prefill_cap_tokens"]
    assert cap < startup, server.log.read_text()
    assert gauges["ftrs_adaptive_guard_events"] >= 1
    assert gauges["ftrs_adaptive_guard_level"] >= 1
    assert gauges["ftrs_adaptive_guard_relaxes"] == 0  # the injected replays keep growing
    assert gauges["ftrs_pcie_pacing_bytes_per_second"] > 0  # the copy engine paces now

    health = httpx.get(server.url + "/health", timeout=5).json()
    assert health["status"] == "ok"
    guard = health["adaptive_guard"]
    assert guard["startup_cap_tokens"] == startup
    assert guard["prefill_cap_tokens"] < startup
    assert guard["pacing"] == "on" and guard["pacing_gbps"] > 0
    assert guard["event_count"] >= 1
    assert "AER correctable rose" in guard["events"][-1]["reason"]

    _complete(server.url)  # still serving, under the tighter budget
    log = server.log.read_text()
    assert "adaptive guard" in log and "step budget now" in log
