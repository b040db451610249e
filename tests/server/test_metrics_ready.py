"""`ftrs_expert_cache_slots` is set when the engine is ready, not at the first step."""

from __future__ import annotations

from types import SimpleNamespace

from ftrs.config import EngineConfig
from ftrs.server.app import ServeSettings, create_app
from ftrs.server.metrics import ServerMetrics


def slots_line(metrics: ServerMetrics) -> str:
    return next(line for line in metrics.render().decode().splitlines()
                if line.startswith("ftrs_expert_cache_slots "))


def test_engine_ready_sets_the_slots() -> None:
    m = ServerMetrics()
    assert slots_line(m) == "ftrs_expert_cache_slots 0.0"
    m.engine_ready({"slots": 120, "expert_bytes": 1 << 20})
    assert slots_line(m) == "ftrs_expert_cache_slots 120.0"
    m.engine_ready(None)  # an engine without an expert cache says nothing: the gauge stays
    assert slots_line(m) == "ftrs_expert_cache_slots 120.0"
    m.engine_gone()
    assert slots_line(m) == "ftrs_expert_cache_slots 0.0"


def test_the_ready_message_reaches_the_gauge() -> None:
    app = create_app(ServeSettings(engine=EngineConfig(model="demo")))
    ready = SimpleNamespace(model_name="demo", pid=1, kv_cache=None,
                            experts={"slots": 120})  # an offload engine's ready message
    app.state.engine.on_ready(ready)
    assert slots_line(app.state.metrics) == "ftrs_expert_cache_slots 120.0"
