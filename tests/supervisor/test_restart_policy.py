"""`--on-device-lost restart`: restart on the same device only when a fresh probe says it answers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ftrs.config import EngineConfig
from ftrs.errors import DeviceLost, InvalidRequest
from ftrs.server.supervision import install_policy


class FakeClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.on_failure: Any = None
        self.restarts: list[tuple[EngineConfig, dict[str, Any]]] = []

    def restart(self, config: EngineConfig, degraded: dict[str, Any]) -> None:
        self.restarts.append((config, degraded))


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
    # a fault drill stands for a device that is still gone: exit with the error's code instead
    client = FakeClient(EngineConfig(device="cpu", fault_inject="device_lost@step=3"))
    server = SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, DeviceLost("gone"))
    assert server.should_exit and client.restarts == []


def test_request_errors_do_not_trigger_the_policy() -> None:
    client, server = FakeClient(EngineConfig(device="cpu")), SimpleNamespace(should_exit=False)
    install_policy(client, server, "restart", grace_s=0.01)
    _fail(client, server, InvalidRequest("bad"))
    assert not server.should_exit and client.restarts == []
