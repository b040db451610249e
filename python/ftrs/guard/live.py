"""The adaptive guard while serving (issue 6, item 5): the engine process's side.

`LiveGuard` sits between the device monitor and the engine. The monitor thread hands it every
slow sample (`on_sample`); the `AdaptiveGuard` decides whether the link shows stress (PCIe
replays or AER totals rising, the link down-shifting) and, when it does, halves the prefill
ceiling and asks for pacing. The step loop applies the decision before the next step
(`before_step`), so the scheduler is only ever touched from the thread that runs it:

- the scheduler's step token budget (`EngineCore.scheduler.budget`) becomes the new ceiling;
- the offload strategy's copy engine (`TransferEngine.set_pacing(bytes_per_s)`) paces expert
  copies at the guard's rate. Without a copy engine (resident strategy) or without the setter,
  pacing is recorded as "requested" and not applied.

`stats()` is the dict every `StepStats.guard` carries to the API process: the live ceiling,
the pacing and the last events, for `ftrs_prefill_cap_tokens`, `ftrs_pcie_pacing_bytes_per_second`
and `/health`'s `adaptive_guard`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ftrs.guard.adaptive import AdaptiveGuard, GuardEvent
from ftrs.guard.policy import DEFAULT_FLOOR
from ftrs.health.state import DeviceState

logger = logging.getLogger(__name__)

#: Events kept in `stats()` (the guard keeps all of them).
RECENT_EVENTS = 5


def _copy_engine(engine: Any) -> Any:
    moe = getattr(getattr(engine, "rt", None), "moe", None)
    return getattr(moe, "engine", None)


class LiveGuard:
    """Feeds monitor samples to an `AdaptiveGuard` and applies its ceiling and pacing to the
    engine between steps. `engine` needs `scheduler.budget` (EngineCore); without it the
    guard still decides and reports, and applies nothing."""

    def __init__(self, engine: Any, cap_tokens: int, *, floor: int = DEFAULT_FLOOR,
                 pacing_gbps: float | None = None) -> None:
        self.engine = engine
        self.startup_cap_tokens = cap_tokens
        self.guard = AdaptiveGuard(cap_tokens, floor=floor, pacing_gbps=pacing_gbps)
        self._lock = threading.Lock()
        self._pending = False  # a tightening the step loop has not applied yet
        self.applied_cap: int = cap_tokens
        self.applied_pacing_gbps: float | None = pacing_gbps
        self.pacing_mode = "on" if pacing_gbps else "off"  # on | off | requested

    def on_sample(self, state: DeviceState) -> None:
        """Monitor thread: one slow sample."""
        if self.guard.observe(state) is not None:
            with self._lock:
                self._pending = True

    def before_step(self) -> None:
        """Step thread: apply a tightening the monitor found since the last step."""
        with self._lock:
            if not self._pending:
                return
            self._pending = False
        cap, pacing = self.guard.cap_tokens, self.guard.pacing_gbps
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "budget"):
            scheduler.budget = cap
        self.applied_cap = cap
        if pacing is not None and pacing != self.applied_pacing_gbps:
            self.pacing_mode = self._set_pacing(pacing)
            self.applied_pacing_gbps = pacing
        logger.warning("adaptive guard: step budget now %d tokens (was %d at startup); pacing %s",
                       cap, self.startup_cap_tokens,
                       f"{pacing:g} GB/s ({self.pacing_mode})" if pacing is not None else "off")

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
            "event_count": len(events),
            "events": [event_dict(e) for e in events[-RECENT_EVENTS:]],
        }


def event_dict(event: GuardEvent) -> dict[str, Any]:
    return {"reason": event.reason, "cap_tokens": event.cap_tokens,
            "pacing_gbps": event.pacing_gbps, "sample_time": event.sample_time}


__all__ = ["LiveGuard", "event_dict"]
