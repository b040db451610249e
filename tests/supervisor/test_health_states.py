"""What `/health` and `/metrics` say across the supervisor's states, in process (no engine
process): a degraded device (the engine's monitor verdict carried by StepStats), the restart
after a device loss with `--on-device-lost cpu`, the restart after a kill, and the evidence
summary of a fatal verdict.

The API side is the real `create_app` / `EngineClient`; the engine's messages are handed to
the client as its reader thread would (`_on_message`), and deaths as `_fail`. The app's
lifespan never runs, so no engine process is spawned (`start` is replaced where a restart
would spawn one, and records the call).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ftrs.config import EngineConfig
from ftrs.engine.protocol import StepStats
from ftrs.errors import DeviceLost, EngineRestarted
from ftrs.server.engine_client import EngineClient
from ftrs.server.engine_process import EngineReady, StepOutput
from ftrs.server.errors import EngineUnavailable
from ftrs.server.restart_policy import cpu_fallback, install_policy


def _app() -> tuple[Any, EngineClient, TestClient]:
    from ftrs.server.app import ServeSettings, create_app

    app = create_app(ServeSettings(engine=EngineConfig(model="tiny", device="cpu")))
    client: EngineClient = app.state.engine
    client.state = "ready"  # as `_become_ready` leaves it
    client.info = EngineReady("tiny", None, 128, 100, 1)
    app.state.metrics.set_device_state("ok", up=True)  # on_ready
    return app, client, TestClient(app)  # no `with`: no lifespan, no engine process


def _step(device: dict[str, Any] | None) -> StepStats:
    return StepStats(1, time.time(), 0.01, "decode", 1, 0, 0, 1, 0.1, device=device)


def _device_metrics(http: TestClient) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(("ftrs_device_state{", "ftrs_device_up ")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_degraded_device_shows_on_health_and_metrics_and_recovers() -> None:
    _, client, http = _app()
    reason = "link of 0000:01:00.0 is unhealthy: aer_counters_rising"
    client._on_message(StepOutput([], _step({"state": "degraded", "reason": reason,
                                             "bdf": "0000:01:00.0"})), client._generation)
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"  # it still serves
    assert r.json()["device"] == {"state": "degraded", "reason": reason, "bdf": "0000:01:00.0"}
    m = _device_metrics(http)
    assert m['ftrs_device_state{state="degraded"}'] == 1 and m['ftrs_device_state{state="ok"}'] == 0
    assert m["ftrs_device_up"] == 1
    client._on_message(StepOutput([], _step({"state": "ok", "reason": "", "bdf": "0000:01:00.0"})),
                       client._generation)
    assert http.get("/health").json()["device"]["state"] == "ok"
    m = _device_metrics(http)
    assert m['ftrs_device_state{state="degraded"}'] == 0 and m['ftrs_device_state{state="ok"}'] == 1


@pytest.mark.parametrize(("classification", "state"), [("DeviceLost", "lost"),
                                                       ("KernelFault", "unknown")])
def test_a_cpu_fallback_keeps_the_device_as_its_error_left_it(classification: str,
                                                             state: str) -> None:
    """docs/device-loss.md: `degraded` is a device that serves with `ftrs_device_up` 1; after
    `--on-device-lost cpu` the GPU does not serve: its state stays the error's, up 0, whatever
    the CPU engine's monitor (which watches no device) says; /health says degraded."""
    _, client, http = _app()
    client.degraded = {"mode": "cpu", "classification": classification}
    assert client.on_ready is not None
    client.on_ready(client.info)  # type: ignore[arg-type]  # the CPU engine is ready
    client._on_message(StepOutput([], _step({"state": "ok", "reason": "", "bdf": None})),
                       client._generation)
    m = _device_metrics(http)
    assert m[f'ftrs_device_state{{state="{state}"}}'] == 1 and m["ftrs_device_up"] == 0
    assert m['ftrs_device_state{state="degraded"}'] == 0, m
    assert http.get("/health").json()["degraded"] is True


def test_a_restart_on_the_same_device_reads_its_monitor_again() -> None:
    _, client, http = _app()
    client.degraded = {"mode": "restart", "classification": "KernelFault"}
    assert client.on_ready is not None
    client.on_ready(client.info)  # type: ignore[arg-type]
    assert _device_metrics(http)["ftrs_device_up"] == 1
    client._on_message(StepOutput([], _step({"state": "degraded", "reason": "aer",
                                             "bdf": "0000:01:00.0"})), client._generation)
    m = _device_metrics(http)
    assert m['ftrs_device_state{state="degraded"}'] == 1 and m["ftrs_device_up"] == 1


def test_health_link_guard_names_no_path_and_follows_a_cpu_fallback(tmp_path: Path) -> None:
    """/health is unauthenticated: the guard's drill reports are shown by file name only. After
    `--on-device-lost cpu` the guard is re-run for the resident CPU engine, so it no longer
    describes the offload link."""
    from ftrs.models.tiny import make_tiny
    from ftrs.server.app import ServeSettings, create_app

    model = make_tiny("mixtral", tmp_path / "mixtral", seed=0)
    report = str(tmp_path / "crash" / "20261207T200916.629Z-DeviceLost.json")
    guard = {"requested": 64, "cap_tokens": None, "reasons": [f"1 drill report: {report}"],
             "warnings": ["no chunk size fixes this link"],
             "numbers": {"strategy": "offload", "link_gbps": 1.0, "drill_reports": [report]}}
    app = create_app(ServeSettings(engine=EngineConfig(
        model=str(model), device="cpu", moe_strategy="offload", moe_cache_rate=0.5,
        copy_backend="simulated:1"), link_guard=guard))
    client: EngineClient = app.state.engine
    client.state, client.info = "ready", EngineReady("tiny", None, 128, 100, 1)
    http = TestClient(app)
    shown = http.get("/health").json()["link_guard"]
    assert shown["numbers"]["drill_reports"] == ["20261207T200916.629Z-DeviceLost.json"]
    assert str(tmp_path) not in str(shown)
    client.config = cpu_fallback(client.config)
    client.degraded = {"mode": "cpu", "classification": "DeviceLost"}
    assert client.on_ready is not None
    client.on_ready(client.info)
    shown = http.get("/health").json()["link_guard"]
    assert shown["numbers"]["strategy"] == "resident" and shown["warnings"] == [], shown


def test_the_supervisor_carries_the_monitors_verdict_in_each_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drill of the QA report: AER counters rise; the monitor judges the device degraded
    and the next step's stats say so, with the monitor's reason."""
    from ftrs.server.supervision import EngineSupervisor

    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    sup = EngineSupervisor(EngineConfig.from_kwargs(
        model="x", fault_inject="replay_growth@after=0.05s"), _Idle())
    try:
        _, before = sup.step()
        assert before is not None and before.device is not None
        assert before.device["state"] == "ok" and before.device["bdf"] == "0000:01:00.0"
        deadline = time.monotonic() + 20
        while sup.monitor.state.state != "degraded" and time.monotonic() < deadline:
            time.sleep(0.1)
        _, stats = sup.step()
    finally:
        sup.close()
    assert stats is not None and stats.device is not None
    assert stats.device["state"] == "degraded", stats.device
    assert "aer" in stats.device["reason"].lower(), stats.device


class _Idle:
    def step(self) -> tuple[list[Any], StepStats]:
        return [], StepStats(1, time.time(), 0.0, "decode", 1, 0, 0, 1, 0.1)

    def num_requests(self) -> int:
        return 1


def _policy_client(policy: str, **config: Any) -> tuple[EngineClient, list[EngineConfig]]:
    """A ready EngineClient under `install_policy`; a restart's spawn is recorded, not run."""
    client = EngineClient(EngineConfig(model="tiny", device="cpu", **config))
    client._loop = asyncio.get_running_loop()
    client.state, client.ever_ready = "ready", True
    client.started_at = time.monotonic() - 100  # the dead engine started long ago
    spawned: list[EngineConfig] = []
    client.start = lambda: spawned.append(client.config)  # type: ignore[method-assign]
    install_policy(client, SimpleNamespace(should_exit=False), policy, grace_s=0.01)
    return client, spawned


def test_on_device_lost_cpu_says_restarting_with_cause_and_count_until_ready() -> None:
    async def run() -> None:
        client, spawned = _policy_client("cpu", engine_restarts=1,
                                         fault_inject="device_lost@step=3")
        in_flight: asyncio.Queue[Any] = asyncio.Queue()
        client._streams["a"] = in_flight
        client._fail(DeviceLost("GPU 0000:01:00.0 is lost", evidence={"bdf": "0000:01:00.0"}))
        told = in_flight.get_nowait()
        assert isinstance(told, DeviceLost)  # what the request met, not the restart after it
        status, body = client.health()
        assert (status, body["status"], body["code"]) == (503, "restarting", "engine_restarted")
        assert body["cause"]["type"] == "DeviceLost" and body["restarts"] == 1
        assert "restart 1 of at most 1" in body["reason"] and body["elapsed_s"] < 5
        with pytest.raises(EngineRestarted):
            client.submit(SimpleNamespace(request_id="b"))  # type: ignore[arg-type]
        assert spawned == []  # the backoff first
        await asyncio.sleep(0.8)
        assert [c.device for c in spawned] == ["cpu"] and spawned[0].fault_inject is None
        status, body = client.health()
        assert (status, body["status"], body["restarts"]) == (503, "restarting", 1)
        assert client.degraded is not None and client.degraded["mode"] == "cpu"

    asyncio.run(run())


def test_a_killed_engine_counts_its_restart_during_the_backoff() -> None:
    async def run() -> None:
        client, spawned = _policy_client("exit", engine_restarts=1)
        client._fail(EngineUnavailable("engine process exited with code -9"))
        status, body = client.health()
        assert (status, body["status"]) == (503, "restarting")
        assert body["restarts"] == 1 and "restart 1 of at most 1" in body["reason"]
        assert body["elapsed_s"] < 5  # since the death, not since the dead engine's start
        assert spawned == []

    asyncio.run(run())


def test_health_after_a_fatal_verdict_shows_the_evidence_summary_only() -> None:
    _, client, http = _app()
    client._fail(DeviceLost("GPU 0000:04:00.0 is lost", evidence={
        "decided_by": ["pci_config_vendor=0xffff"], "bdf": "0000:04:00.0", "xid": 79,
        "hint": "power-cycle the GPU", "raised_at": "/home/me/ftrs/engine/core.py:200",
        "crash_report": "/home/me/.ftrs/crash/x.json", "probes": {"pci": {"raw": "ff" * 64}}}))
    r = http.get("/health")
    body = r.json()
    assert r.status_code == 503 and body["classification"] == "DeviceLost"
    assert body["evidence"] == {"decided_by": ["pci_config_vendor=0xffff"],
                                "bdf": "0000:04:00.0", "xid": 79, "hint": "power-cycle the GPU"}
    assert body["error"] == {"type": "DeviceLost", "message": "GPU 0000:04:00.0 is lost"}
    assert "/home/me" not in r.text
