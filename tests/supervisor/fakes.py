"""A stand-in for the server's `EngineClient` as `install_policy` sees it: it records the
restarts the policy asks for instead of starting engines."""

from __future__ import annotations

from typing import Any

from ftrs.config import EngineConfig
from ftrs.errors import EngineRestarted


class FakeClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.on_failure: Any = None
        #: (config, degraded) of the restarts asked for with a new config (the device policy)
        self.restarts: list[tuple[EngineConfig, dict[str, Any]]] = []
        #: every scheduled restart: what new requests are told, and the backoff
        self.scheduled: list[tuple[EngineRestarted, float]] = []

    def schedule_restart(self, err: EngineRestarted, delay_s: float,
                         config: EngineConfig | None = None,
                         degraded: dict[str, Any] | None = None) -> None:
        self.scheduled.append((err, delay_s))
        if config is not None:
            assert degraded is not None
            self.restarts.append((config, degraded))
