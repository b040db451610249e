"""The fake engine of `tests/server/fake_backend.py` with step faults, for the restart tests.

Prompt markers (in any request the engine holds when it steps):
- `__raise__`: the step raises ValueError before it runs, and names only the requests with
  the marker as its own (`step_request_ids`), as a scheduler that put them alone in the step;
- `__poison__`: this step and every later one raise RuntimeError (an engine whose state a bug
  has corrupted: only a fresh process helps);
- `__slow__`: steps take 20 ms, so a stream is still running when a test kills the engine.
"""

from __future__ import annotations

import time

from fake_backend import FakeEngine, load_tokenizer

from ftrs.config import EngineConfig
from ftrs.engine.protocol import StepStats, TokenEvent
from ftrs.server.engine_process import LoadedEngine


class FaultyEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.poisoned = False
        self._step_ids: list[str] | None = None

    def _marked(self, marker: bytes) -> list[str]:
        return [rid for rid, r in self.running.items()
                if marker in bytes(t % 256 for t in r.req.prompt_token_ids)]

    def step_request_ids(self) -> list[str] | None:
        return self._step_ids

    def step(self) -> tuple[list[TokenEvent], StepStats]:
        self._step_ids = None
        if self._marked(b"__poison__"):
            self.poisoned = True
        if self.poisoned:
            raise RuntimeError("engine state is corrupt")
        bad = self._marked(b"__raise__")
        if bad:
            self._step_ids = bad
            raise ValueError("row overflowed")
        self._step_ids = list(self.running)
        if self._marked(b"__slow__"):
            time.sleep(0.02)
        return super().step()


def load(config: EngineConfig) -> LoadedEngine:
    return LoadedEngine(FaultyEngine(), config.model)


__all__ = ["FaultyEngine", "load", "load_tokenizer"]
