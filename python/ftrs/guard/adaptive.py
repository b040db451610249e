"""Adaptive guard: shrink the prefill chunk and turn pacing on when the link shows stress.

Fed the `DeviceState` samples of `health.DeviceMonitor` (its `on_sample`). Against the previous
sample it looks for: the PCIe replay counter rising, any AER total (correctable, nonfatal,
fatal) rising, the link width dropping (or below max on the first sample), or the link speed
dropping while the monitor judged the device degraded (NVIDIA GPUs lower the speed when idle,
so an idle drop is power saving; the monitor knows whether work was pending). On each such
sample it halves the chunk ceiling (never below the floor) and turns pacing on at
`pacing_fraction` of the link's nominal bandwidth (current gen and width) — or keeps the
pacing already set if that is lower. It never grows back by itself: a link that misbehaved
once stays capped until the server restarts (the startup guard then sees the link afresh).

`cap_tokens` and `pacing_gbps` are what the engine should run with; `stats()` has the keys
`server.metrics.ServerMetrics.observe_experts` reads (`prefill_cap_tokens`), so the cap shows
up as `ftrs_prefill_cap_tokens`. Thread-safe: the monitor thread writes, the server reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ftrs.guard.link import nominal_gbps
from ftrs.guard.policy import DEFAULT_FLOOR
from ftrs.health.state import DeviceState

logger = logging.getLogger(__name__)

DEFAULT_PACING_FRACTION = 0.5


@dataclass(frozen=True)
class GuardEvent:
    """One tightening: why, and the ceiling and pacing after it."""

    reason: str
    cap_tokens: int
    pacing_gbps: float | None
    sample_time: float | None


class AdaptiveGuard:
    """Holds the live prefill ceiling; `observe(state)` tightens it on link stress."""

    def __init__(self, cap_tokens: int, *, floor: int = DEFAULT_FLOOR,
                 pacing_gbps: float | None = None,
                 pacing_fraction: float = DEFAULT_PACING_FRACTION,
                 on_change: Callable[[GuardEvent], None] | None = None) -> None:
        if cap_tokens < 1:
            raise ValueError(f"cap_tokens must be >= 1, got {cap_tokens}")
        self.floor = min(floor, cap_tokens)
        self.pacing_fraction = pacing_fraction
        self._cap = cap_tokens
        self._pacing = pacing_gbps
        self._on_change = on_change
        self._last: DeviceState | None = None
        self._lock = threading.Lock()
        self.events: list[GuardEvent] = []

    @property
    def cap_tokens(self) -> int:
        with self._lock:
            return self._cap

    @property
    def pacing_gbps(self) -> float | None:
        with self._lock:
            return self._pacing

    def stats(self) -> dict[str, float]:
        """Gauges for the metrics registry (keys as `ServerMetrics.observe_experts` reads them)."""
        with self._lock:
            out = {"prefill_cap_tokens": float(self._cap)}
            if self._pacing is not None:
                out["pcie_pacing_gbps"] = self._pacing
            return out

    def observe(self, state: DeviceState) -> GuardEvent | None:
        """Take one monitor sample; returns the event when it tightened the guard."""
        with self._lock:
            before, self._last = self._last, state
            stress = _stress(before, state)
            if not stress:
                return None
            new_cap = max(self.floor, self._cap // 2)
            link = nominal_gbps(state.link_gen_current, state.link_width_current)
            pacing = self._pacing
            if link is not None:
                target = round(link * self.pacing_fraction, 3)
                pacing = target if pacing is None else min(pacing, target)
            event = GuardEvent("; ".join(stress), new_cap, pacing, state.last_sample_time)
            changed = new_cap != self._cap or pacing != self._pacing
            self._cap, self._pacing = new_cap, pacing
            self.events.append(event)
        logger.warning("adaptive guard: %s: prefill chunk %d tokens, pacing %s%s", event.reason,
                       new_cap, f"{pacing:g} GB/s" if pacing is not None else "off (link unknown)",
                       "" if changed else " (already at the floor)")
        if self._on_change is not None:
            self._on_change(event)
        return event


def _rise(name: str, before: int | None, now: int | None) -> str | None:
    if before is not None and now is not None and now > before:
        return f"{name} rose {before} -> {now}"
    return None


def _stress(before: DeviceState | None, now: DeviceState) -> list[str]:
    """Why this sample shows link stress (empty: it does not)."""
    out: list[str] = []
    if before is not None:
        for name, b, n in (("PCIe replays", before.pcie_replay, now.pcie_replay),
                           ("AER correctable", before.aer_correctable, now.aer_correctable),
                           ("AER nonfatal", before.aer_nonfatal, now.aer_nonfatal),
                           ("AER fatal", before.aer_fatal, now.aer_fatal)):
            msg = _rise(name, b, n)
            if msg:
                out.append(msg)
    prev_gen = before.link_gen_current if before is not None else now.link_gen_max
    prev_width = before.link_width_current if before is not None else now.link_width_max
    g, w = now.link_gen_current, now.link_width_current
    width_drop = w is not None and prev_width is not None and w < prev_width
    speed_drop = (now.state == "degraded" and g is not None and prev_gen is not None
                  and g < prev_gen)
    if width_drop or speed_drop:
        out.append(f"link down-shifted to Gen{g} x{w} (was Gen{prev_gen} x{prev_width}, "
                   f"max Gen{now.link_gen_max} x{now.link_width_max})")
    return out
