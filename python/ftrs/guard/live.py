"""The adaptive guard while serving (issue 6, item 5): the engine process's side.

`LiveGuard` sits between the device monitor and the engine. The monitor thread hands it every
slow sample (`on_sample`); the `AdaptiveGuard` decides whether the link shows stress (PCIe
replays or AER totals rising, the link down-shifting) and, when it does, halves the prefill
ceiling and asks for pacing; once the link has been quiet for `relax_after_s`
(`--guard-relax-after`) it steps back one level per quiet period (the rule is in
`guard.adaptive`). The step loop applies each change before the next step (`before_step`), so
the scheduler is only ever touched from the thread that runs it:

- the engine's step token budget (`EngineCore.set_step_budget`) becomes the new ceiling;
- the offload strategy's copy engine (`EngineCore.transfer_engine()`, its
  `TransferEngine.set_pacing(bytes_per_s)`) paces expert
  copies at the guard's rate, and back at the startup rate (0: off) when fully relaxed. Without
  a copy engine (resident strategy) or without the setter, pacing is recorded as "requested"
  and not applied.

`stats()` is the dict every `StepStats.guard` carries to the API process: the live ceiling,
the pacing, the level, the tighten and relax counts and the last events, for
`ftrs_prefill_cap_tokens`, `ftrs_pcie_pacing_bytes_per_second`, `ftrs_adaptive_guard_events`
and `/health`'s `adaptive_guard`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ftrs.guard.adaptive import DEFAULT_RELAX_AFTER_S, AdaptiveGuard, GuardEvent
from ftrs.guard.policy import DEFAULT_FLOOR
from ftrs.health.state import DeviceState

logger = logging.getLogger(__name__)

#: Events kept in `stats()` (the guard keeps all of them).
RECENT_EVENTS = 5


def _copy_engine(engine: Any) -> Any:
    get = getattr(engine, "transfer_engine", None)
    return get() if callable(get) else None


class LiveGuard:
    """Feeds monitor samples to an `AdaptiveGuard` and applies its ceiling and pacing to the
    engine between steps. `engine` needs `set_step_budget` (EngineCore); without it the
    guard still decides and reports, and applies nothing. `relax_after_s` defaults to the
    engine's `config.guard_relax_after` when it has one."""

    def __init__(self, engine: Any, cap_tokens: int, *, floor: int = DEFAULT_FLOOR,
                 pacing_gbps: float | None = None, relax_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.startup_cap_tokens = cap_tokens
        if relax_after_s is None:
            relax_after_s = float(getattr(getattr(engine, "config", None), "guard_relax_after",
                                          DEFAULT_RELAX_AFTER_S))
        self.guard = AdaptiveGuard(cap_tokens, floor=floor, pacing_gbps=pacing_gbps,
                                   relax_after_s=relax_after_s, clock=clock)
        self._lock = threading.Lock()
        self._pending = False  # a change the step loop has not applied yet
        self.applied_cap: int = cap_tokens
        self.applied_level = 0
        self.applied_pacing_gbps: float | None = pacing_gbps
        self.pacing_mode = "on" if pacing_gbps else "off"  # on | off | requested

    def on_sample(self, state: DeviceState, now: float | None = None) -> None:
        """Monitor thread: one slow sample (at `now`, default the guard's clock)."""
        if self.guard.observe(state, now) is not None:
            with self._lock:
                self._pending = True

    def before_step(self) -> None:
        """Step thread: apply a tightening or relax step the monitor found since the last step."""
        with self._lock:
            if not self._pending:
                return
            self._pending = False
        cap, pacing, level = self.guard.snapshot()
        set_budget = getattr(self.engine, "set_step_budget", None)
        if callable(set_budget):
            set_budget(cap)
        looser, self.applied_level = level < self.applied_level, level
        self.applied_cap = cap
        if pacing is not None and pacing != self.applied_pacing_gbps:
            self.pacing_mode = self._set_pacing(pacing)
            self.applied_pacing_gbps = pacing
        elif pacing is None and self.applied_pacing_gbps is not None and self._pacing_off():
            self.pacing_mode, self.applied_pacing_gbps = "off", None
        log = logger.info if looser else logger.warning
        log("adaptive guard: step budget now %d tokens (was %d at startup), level %d; pacing %s",
            cap, self.startup_cap_tokens, level,
            f"{pacing:g} GB/s ({self.pacing_mode})" if pacing is not None else "off")

    def _pacing_off(self) -> bool:
        """Turn the copy engine's pacing off (rate 0); False when the engine refused."""
        setter = getattr(_copy_engine(self.engine), "set_pacing", None)
        if callable(setter):
            try:
                setter(0.0)
            except Exception as exc:  # never let pacing take the engine down
                logger.warning("adaptive guard: could not turn pacing off: %s", exc)
                return False
        return True

    def _set_pacing(self, gbps: float) -> str:
        copier = _copy_engine(self.engine)
        setter = getattr(copier, "set_pacing", None)
        if not callable(setter):
            logger.warning("adaptive guard: pacing %g GB/s requested, but the MoE strategy has "
                           "no copy engine to pace", gbps)
            return "requested"
        try:
            setter(gbps * 1e9)
        except Exception as exc:  # never let pacing take the engine down
            logger.warning("adaptive guard: could not turn pacing on: %s", exc)
            return "requested"
        return "on"

    def stats(self) -> dict[str, Any]:
        """What `StepStats.guard` carries (picklable, small)."""
        events = self.guard.events
        pacing = self.applied_pacing_gbps
        return {
            "prefill_cap_tokens": self.applied_cap,
            "startup_cap_tokens": self.startup_cap_tokens,
            "pacing_gbps": pacing,
            "pacing": self.pacing_mode,
            "pcie_pacing_bytes_per_second": (pacing * 1e9
                                             if pacing is not None and self.pacing_mode == "on"
                                             else 0.0),
            "event_count": self.guard.tighten_count,
            "level": self.guard.level,
            "max_level": self.guard.max_level,
            "relax_count": self.guard.relax_count,
            "relax_after_s": self.guard.relax_after_s,
            "events": [event_dict(e) for e in events[-RECENT_EVENTS:]],
        }


def event_dict(event: GuardEvent) -> dict[str, Any]:
    return {"kind": event.kind, "level": event.level, "reason": event.reason,
            "cap_tokens": event.cap_tokens, "pacing_gbps": event.pacing_gbps,
            "sample_time": event.sample_time}


__all__ = ["LiveGuard", "event_dict"]
