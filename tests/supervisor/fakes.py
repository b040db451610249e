"""A stand-in for the server's `EngineClient` as `install_policy` sees it: it records the
restarts the policy asks for instead of starting engines."""

from __future__ import annotations

from typing import Any

from ftrs.config import EngineConfig


class FakeClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.on_failure: Any = None
        self.restarts: list[tuple[EngineConfig, dict[str, Any]]] = []

    def restart(self, config: EngineConfig, degraded: dict[str, Any]) -> None:
        self.restarts.append((config, degraded))
