"""A step that runs longer than `--hang-timeout` but keeps computing layers is slow, not hung: a
prompt of thousands of tokens prefilled on a CPU took 71 to 120+ s on a loaded 2-core host, and
the watchdog used to end the server for it. A step that stops computing is still a hang.

In process: a tiny real `EngineCore` behind the device supervisor, each decoder layer made
slower (sleeping before its MLP) or one layer made to block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftrs.config import EngineConfig
from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import EngineHang, FtrsError
from ftrs.sampling import SamplingParams

TIMEOUT = 1.0  # s, the hang timeout of these engines


@pytest.fixture
def supervised(tiny_models: dict[str, Path], tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, list[FtrsError]]]:
    from ftrs.engine.core import EngineCore
    from ftrs.server.supervision import EngineSupervisor

    monkeypatch.setenv("FTRS_HOME", str(tmp_path))  # the hang's crash report
    config = EngineConfig(model=str(tiny_models["llama"]), device="cpu", dtype="float32",
                          kv_tokens=256, hang_timeout=TIMEOUT)
    core = EngineCore(config, progress=False)
    fatal: list[FtrsError] = []
    sup = EngineSupervisor(config, core, on_fatal=fatal.append)
    try:
        yield core, sup, fatal
    finally:
        sup.close()
        core.close()


def _slow_layers(core: Any, seconds: Any) -> None:
    """Each decoder layer sleeps `seconds(layer)` before its MLP."""
    dec = core.rt.decoder
    mlp = dec._mlp

    def slow(layer: int, x: Any) -> Any:
        time.sleep(seconds(layer))
        return mlp(layer, x)

    dec._mlp = slow


def _one_step(core: Any, sup: Any) -> float:
    core.add_request(GenerateRequest("r", [5, 6, 7], SamplingParams(max_tokens=1,
                                                                    temperature=0)))
    t0 = time.monotonic()
    sup.step()
    return time.monotonic() - t0


def test_a_long_step_that_computes_layers_is_not_a_hang(supervised: Any) -> None:
    core, sup, fatal = supervised
    layers = core.rt.decoder.spec.num_layers
    assert layers >= 3
    _slow_layers(core, lambda layer: 0.5 * TIMEOUT)  # each layer well within the timeout
    took = _one_step(core, sup)
    time.sleep(0.3)  # the monitor checks every 0.1 s
    assert took > 1.4 * TIMEOUT  # the step itself ran past the timeout
    assert fatal == []


def test_a_step_that_stops_computing_is_a_hang(supervised: Any) -> None:
    core, sup, fatal = supervised
    _slow_layers(core, lambda layer: 2.5 * TIMEOUT if layer == 1 else 0.0)
    _one_step(core, sup)
    deadline = time.monotonic() + 5.0
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(fatal) == 1 and isinstance(fatal[0], EngineHang), fatal
    assert fatal[0].evidence["stalled_s"] > TIMEOUT
