"""`--on-device-lost restart`: restart on the same device only when a fresh probe says it answers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from ftrs.config import EngineConfig
from ftrs.errors import (
    ConfigError,
    DeviceError,
    DeviceLost,
    EngineHang,
    FtrsError,
    InvalidRequest,
    KernelFault,
    ModelLoadError,
)
from ftrs.server.errors import EngineUnavailable
from ftrs.server.restart_policy import RestartBudget, backoff_s, install_policy

from .fakes import FakeClient


def _fail(client: FakeClient, server: Any, err: Exception) -> None:
    async def run() -> None:
        client.on_failure(err)
        await asyncio.sleep(0.05)  # past the exit grace below

    asyncio.run(run())


def test_restart_when_the_device_answers_again() -> None:
    # the CPU device always answers a fresh probe: the engine restarts on the same device
    client, server = FakeClient(EngineConfig(device="cpu")), SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, DeviceLost("gone", evidence={"pci_vendor": "0xffff"}))
    assert not server.should_exit
    (config, degraded), = client.restarts
    assert config.device == "cpu" and degraded["mode"] == "restart"
    assert degraded["classification"] == "DeviceLost"


def test_restart_refused_when_the_device_does_not_answer() -> None:
    # a device_lost drill leaves its fake device off the bus: exit with the error's code instead
    client = FakeClient(EngineConfig(device="cpu", fault_inject="device_lost@step=3"))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, DeviceLost("gone", evidence={"decided_by": ["pci_config_vendor=0xffff"],
                                                       "bdf": "0000:01:00.0"}))
    assert server.should_exit and client.restarts == []


@pytest.mark.parametrize("err", [
    KernelFault("injected kernel_fault", evidence={"device_answers": ["pci"],
                                                   "decided_by": ["engine_error=KernelFault",
                                                                  "pci=ok"]}),
    EngineHang("no progress", evidence={"device_answers": ["pci"], "decided_by": ["watchdog"]}),
], ids=["kernel_fault", "hang"])
def test_a_drill_whose_device_still_answers_restarts(err: DeviceError) -> None:
    # the drill's classification read the fake device answering: so does the restart's probe
    client = FakeClient(EngineConfig(device="cpu", fault_inject="kernel_fault@step=2"))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, err)
    assert not server.should_exit
    (config, degraded), = client.restarts
    assert config.fault_inject is None and degraded["mode"] == "restart"


def test_a_drill_whose_device_answered_no_probe_exits() -> None:
    client = FakeClient(EngineConfig(device="cpu", fault_inject="kernel_fault@step=2"))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, KernelFault("fault", evidence={"device_answers": []}))
    assert server.should_exit and client.restarts == []


def test_restart_probes_the_engines_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs, the engine's (cuda:1, 0000:02:00.0) answers and the first is gone: the probe
    asks the card the classification names, not the host's first."""
    from ftrs.health import sysfs
    from ftrs.health.result import Status

    probed: list[str] = []

    def probe_pci(bdf: str, **_: Any) -> Any:
        probed.append(bdf)
        return SimpleNamespace(status=Status.OK if bdf == "0000:02:00.0" else Status.LOST)

    monkeypatch.setattr(sysfs, "probe_pci", probe_pci)
    monkeypatch.setattr(sysfs, "discover_nvidia_gpus",
                        lambda *_: ["0000:01:00.0", "0000:02:00.0"])
    client = FakeClient(EngineConfig(device="cuda:1"))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, KernelFault("CUDA error 700", evidence={"bdf": "0000:02:00.0",
                                                                 "device_answers": ["pci"]}))
    assert probed == ["0000:02:00.0"] and len(client.restarts) == 1 and not server.should_exit
    # no address in the evidence and two GPUs: which one failed cannot be told
    client2, server2 = FakeClient(EngineConfig(device="cuda:1")), SimpleNamespace(should_exit=False)
    install_policy(client2, server2, "restart", grace_s=0.01)
    _fail(client2, server2, KernelFault("CUDA error 700"))
    assert server2.should_exit and client2.restarts == []


def test_a_device_error_while_stopping_on_request_restarts_nothing() -> None:
    client, server = FakeClient(EngineConfig(device="cpu")), SimpleNamespace(should_exit=False)
    install_policy(client, server, "cpu", grace_s=0.01)
    client.state = "stopping"  # SIGTERM came first; the engine died in the stop's second
    _fail(client, server, DeviceLost("gone"))
    assert client.restarts == [] and not server.should_exit  # the stop goes on, exit code 0


def test_request_errors_do_not_trigger_the_policy() -> None:
    client, server = FakeClient(EngineConfig(device="cpu")), SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, InvalidRequest("bad"))
    assert not server.should_exit and client.restarts == []


# -- restarts after deaths that are not the device's (issue 13) --------------------------------


class RestartingClient(FakeClient):
    """What install_policy needs of EngineClient for its restarts, recorded."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.ever_ready = True
        self.state = "failed"
        self.final: FtrsError | None = None

    def give_up(self, err: FtrsError) -> None:
        self.final = err


def test_restart_budget_counts_within_a_sliding_window() -> None:
    budget = RestartBudget(2, window_s=10.0)
    assert [budget.take(0.0), budget.take(1.0), budget.take(2.0)] == [1, 2, None]
    assert budget.take(10.5) == 2  # the restart at 0 s left the window; the one at 1 s did not
    assert budget.take(10.9) is None


def test_backoff_doubles_from_half_a_second_up_to_eight() -> None:
    assert [backoff_s(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_an_engine_death_restarts_with_backoff_then_past_the_bound_exits_89() -> None:
    client = RestartingClient(EngineConfig(device="cpu", engine_restarts=2))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "exit", grace_s=0.01)
    death = EngineUnavailable("engine process exited with code -9")
    for _ in range(3):
        _fail(client, server, death)
    (first, d1), (_, d2) = client.scheduled
    assert (d1, d2) == (0.5, 1.0)
    assert first.code == "engine_restarted" and first.http_status == 503
    assert first.evidence["cause"]["type"] == "EngineUnavailable" and first.evidence["attempt"] == 1
    assert client.final is not None and client.final.exit_code == 89 and server.should_exit


@pytest.mark.parametrize("err", [ModelLoadError("m", "no such file"),
                                 ConfigError("moe cache of 1 slots is below top_k=2")],
                         ids=["model", "config"])
def test_a_first_load_failure_exits_with_its_code_at_once(err: FtrsError) -> None:
    client = RestartingClient(EngineConfig(device="cpu"))
    client.ever_ready = False  # the engine never served: a restart would fail the same way
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "exit", grace_s=30.0)  # not the grace: no client waits
    _fail(client, server, err)
    assert client.scheduled == [] and client.final is None and server.should_exit


def test_a_restarted_engine_that_fails_to_load_does_not_exit_as_a_first_start() -> None:
    # the CPU fallback's engine refuses a setting: the server does not exit 2 for it
    client = RestartingClient(EngineConfig(device="cpu"))
    client.ever_ready, client.restarts = False, 1  # EngineClient's count: one restart ran
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "exit", grace_s=0.01)
    _fail(client, server, ConfigError("copy_backend=cuda needs a CUDA device"))
    assert not server.should_exit


def test_an_engine_killed_during_its_first_load_is_restarted() -> None:
    client = RestartingClient(EngineConfig(device="cpu"))
    client.ever_ready = False
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "exit", grace_s=0.01)
    _fail(client, server, EngineUnavailable("engine process exited with code -9"))
    assert len(client.scheduled) == 1 and client.final is None


def test_device_restarts_share_the_budget() -> None:
    client = RestartingClient(EngineConfig(device="cpu", engine_restarts=1))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, DeviceLost("gone"))
    assert len(client.restarts) == 1 and not server.should_exit
    _fail(client, server, DeviceLost("gone again"))  # no restart left: exit with its code, 86
    assert len(client.restarts) == 1 and server.should_exit


def test_metrics_forget_the_dead_engine() -> None:
    from ftrs.engine.protocol import StepStats
    from ftrs.server.metrics import ServerMetrics

    m = ServerMetrics()

    def step(h2d: int, running: int) -> StepStats:
        return StepStats(1, 0.0, 0.0, "decode", running, 2, 0, 1, 0.5,
                         experts={"h2d_bytes": h2d, "slots": 8})

    m.observe_step(step(1000, 3))
    m.engine_gone()
    value = {"running": m.running, "waiting": m.waiting, "kv": m.kv_usage,
             "slots": m.expert_slots}
    assert {k: g._value.get() for k, g in value.items()} == dict.fromkeys(value, 0.0)
    m.observe_step(step(3000, 1))  # the new engine's counter counts from its own start
    assert m.pcie_bytes.labels("h2d")._value.get() == 4000.0
    assert m.running._value.get() == 1.0


def test_the_cpu_fallback_drops_the_link_options_resident_would_warn_about() -> None:
    """The operator set the cache and link flags for the GPU's offload; the CPU fallback runs
    resident, which would warn that it ignores them: a combination nobody asked for."""
    from ftrs.engine.runtime import offload_options_set
    from ftrs.server.restart_policy import cpu_fallback

    served = EngineConfig(device="cuda", moe_strategy="offload", moe_cache_rate=0.5,
                          moe_cache_policy="lru", copy_backend="simulated:1", pcie_pacing=2.0,
                          fault_inject="device_lost@step=2", max_prefill_length=512)
    config = cpu_fallback(served)
    assert (config.device, config.moe_strategy, config.fault_inject) == ("cpu", "resident", None)
    assert offload_options_set(config) == [] and config.max_prefill_length == 512
