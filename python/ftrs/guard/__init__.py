"""Link guard, fetch-volume model, calibration profiles (DESIGN.md "Layout": guard/).

- `fetch`: expert bytes a model moves per decode token and per prefill chunk.
- `link`: PCIe gen/width (current vs max) and measured copy bandwidth.
- `policy`: the startup prefill ceiling, a pure function (the rule is in its docstring).
- `adaptive`: tightens the ceiling and turns pacing on when the monitor sees link stress.
- `bench_strategy` / `profile`: `ftrs bench strategy` and `--moe-strategy auto`.
- `startup`: the serve-time entry point; `bundle`: the `ftrs doctor --bundle` archive.

Importing this package loads neither torch nor `ftrs._core`; the functions that need them
import them when called.
"""

from __future__ import annotations

from ftrs.guard.adaptive import AdaptiveGuard, GuardEvent
from ftrs.guard.fetch import FetchModel, fetch_model_from_spec, uniform_distinct
from ftrs.guard.link import LinkState, nominal_gbps, probe_link
from ftrs.guard.policy import DEFAULT_FLOOR, DEFAULT_WINDOW_S, GuardDecision, decide_prefill_cap

__all__ = [
    "DEFAULT_FLOOR",
    "DEFAULT_WINDOW_S",
    "AdaptiveGuard",
    "FetchModel",
    "GuardDecision",
    "GuardEvent",
    "LinkState",
    "decide_prefill_cap",
    "fetch_model_from_spec",
    "nominal_gbps",
    "probe_link",
    "uniform_distinct",
]
