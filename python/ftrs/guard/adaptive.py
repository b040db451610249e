"""Adaptive guard: shrink the prefill chunk and turn pacing on when the link shows stress, and
step back one level at a time once the link has stayed quiet.

Fed the `DeviceState` samples of `health.DeviceMonitor` (its `on_sample`). Against the previous
sample it looks for: the PCIe replay counter rising, any AER total (correctable, nonfatal,
fatal) rising, the link width dropping (or below max on the first sample), or the link speed
dropping while the monitor judged the device degraded (NVIDIA GPUs lower the speed when idle,
so an idle drop is power saving; the monitor knows whether work was pending).

The rule, with `C0` the ceiling the guard starts from (the startup guard's), `F` the floor,
`R` the relax period (`relax_after_s`, `--guard-relax-after`, 600 s by default) and level `n`:

1. Levels. Level 0 runs `C0` with the startup pacing (the user's `--pcie-pacing`, usually off).
   Level `n ≥ 1` runs `max(F, C0 >> n)` tokens with the guard's pacing on. The top level is the
   first whose ceiling is `F` (at least 1: when `C0 ≤ F`, pacing alone is the one level).
2. Tighten. A stress sample goes one level up (none past the top) and sets pacing to
   `pacing_fraction` of the link's nominal bandwidth (current gen and width), or keeps the
   pacing already set if that is lower. Every stress sample is an event, and restarts the
   quiet timer, even at the top.
3. Quiet. A sample is quiet when it shows no stress, the monitor judges the device ok (or
   has no device to judge), and the link runs at its max width. A speed below max on an ok
   device is idle power saving and counts as quiet. Any sample that is not quiet restarts the
   quiet timer; a link that stays down-shifted therefore never relaxes.
4. Relax. When every sample for `R` seconds has been quiet (measured from the last sample that
   was not quiet, or from the last tightening or relax step), the guard goes one level down:
   the ceiling doubles back toward `C0`, and pacing returns to the startup pacing only at
   level 0. The timer restarts at each step, so from level `n` a fully quiet link is back at
   `C0` after `n·R` seconds: hysteresis, one level per period, never a jump. `R = 0` never
   relaxes.

Time comes from `clock` (monotonic seconds) or the `now` given to `observe`, never from a sleep;
tests drive it by hand. `cap_tokens` and `pacing_gbps` are what the engine should run with;
`stats()` has the keys `server.metrics.ServerMetrics.observe_experts` reads
(`prefill_cap_tokens`), so the cap shows up as `ftrs_prefill_cap_tokens`, plus the level and
the tighten/relax counts. Thread-safe: the monitor thread writes, the server reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftrs.guard.link import nominal_gbps
from ftrs.guard.policy import DEFAULT_FLOOR
from ftrs.health.state import DeviceState

logger = logging.getLogger(__name__)

DEFAULT_PACING_FRACTION = 0.5
#: Seconds of a quiet link before the guard steps back one level (EngineConfig.guard_relax_after).
DEFAULT_RELAX_AFTER_S = 600.0
#: Device states in which a sample can be quiet.
QUIET_STATES = ("ok", "not_applicable")


@dataclass(frozen=True)
class GuardEvent:
    """One tightening or relax step: why, and the ceiling, pacing and level after it."""

    reason: str
    cap_tokens: int
    pacing_gbps: float | None
    sample_time: float | None
    #: "tighten" or "relax".
    kind: str = "tighten"
    level: int = 0


def top_level(cap_tokens: int, floor: int) -> int:
    """The first level whose ceiling `max(floor, cap_tokens >> n)` is the floor, at least 1."""
    n = 1
    while max(floor, cap_tokens >> n) > floor:
        n += 1
    return n


class AdaptiveGuard:
    """Holds the live prefill ceiling; `observe(state)` tightens it on link stress and relaxes
    it one level per quiet period (the rule of the module doc)."""

    def __init__(self, cap_tokens: int, *, floor: int = DEFAULT_FLOOR,
                 pacing_gbps: float | None = None,
                 pacing_fraction: float = DEFAULT_PACING_FRACTION,
                 relax_after_s: float = DEFAULT_RELAX_AFTER_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[GuardEvent], None] | None = None) -> None:
        if cap_tokens < 1:
            raise ValueError(f"cap_tokens must be >= 1, got {cap_tokens}")
        if relax_after_s < 0:
            raise ValueError(f"relax_after_s must be >= 0, got {relax_after_s}")
        #: The level-0 ceiling; relaxing never goes above it.
        self.startup_cap_tokens = cap_tokens
        #: The level-0 pacing (the user's); None is off.
        self.startup_pacing_gbps = pacing_gbps
        self.floor = min(floor, cap_tokens)
        self.max_level = top_level(cap_tokens, self.floor)
        self.pacing_fraction = pacing_fraction
        self.relax_after_s = relax_after_s
        self._clock = clock
        self._level = 0
        self._cap = cap_tokens
        self._pacing = pacing_gbps
        self._on_change = on_change
        self._last: DeviceState | None = None
        #: Start of the current quiet run: the last non-quiet sample, tightening or relax step.
        self._quiet_since: float | None = None
        self._lock = threading.Lock()
        self.events: list[GuardEvent] = []
        self.tighten_count = 0
        self.relax_count = 0

    @property
    def cap_tokens(self) -> int:
        with self._lock:
            return self._cap

    @property
    def pacing_gbps(self) -> float | None:
        with self._lock:
            return self._pacing

    @property
    def level(self) -> int:
        with self._lock:
            return self._level

    def snapshot(self) -> tuple[int, float | None, int]:
        """(ceiling, pacing, level), read together."""
        with self._lock:
            return self._cap, self._pacing, self._level

    def cap_at(self, level: int) -> int:
        """The ceiling of a level (rule 1)."""
        return max(self.floor, self.startup_cap_tokens >> level)

    def stats(self) -> dict[str, float]:
        """Gauges for the metrics registry (keys as `ServerMetrics.observe_experts` reads them)."""
        with self._lock:
            out = {"prefill_cap_tokens": float(self._cap),
                   "adaptive_guard_level": float(self._level),
                   "adaptive_guard_tighten_total": float(self.tighten_count),
                   "adaptive_guard_relax_total": float(self.relax_count)}
            if self._pacing is not None:
                out["pcie_pacing_gbps"] = self._pacing
            return out

    def observe(self, state: DeviceState, now: float | None = None) -> GuardEvent | None:
        """Take one monitor sample at `now` (default: the clock); returns the event when it
        tightened or relaxed the guard."""
        now = self._clock() if now is None else now
        with self._lock:
            before, self._last = self._last, state
            stress = _stress(before, state)
            if stress:
                return self._tighten(state, stress, now)
            if not _quiet(state):
                self._quiet_since = now
                return None
            if self._quiet_since is None:
                self._quiet_since = now
            quiet_for = now - self._quiet_since
            if self._level == 0 or self.relax_after_s <= 0 or quiet_for < self.relax_after_s:
                return None
            return self._relax(state, quiet_for, now)

    def _tighten(self, state: DeviceState, stress: list[str], now: float) -> GuardEvent:
        level = min(self._level + 1, self.max_level)
        new_cap = self.cap_at(level)
        link = nominal_gbps(state.link_gen_current, state.link_width_current)
        pacing = self._pacing
        if link is not None:
            target = round(link * self.pacing_fraction, 3)
            pacing = target if pacing is None else min(pacing, target)
        event = GuardEvent("; ".join(stress), new_cap, pacing, state.last_sample_time,
                           "tighten", level)
        changed = new_cap != self._cap or pacing != self._pacing
        self._level, self._cap, self._pacing = level, new_cap, pacing
        self._quiet_since = now
        self.events.append(event)
        self.tighten_count += 1
        logger.warning("adaptive guard: %s: prefill chunk %d tokens, pacing %s, level %d%s",
                       event.reason, new_cap,
                       f"{pacing:g} GB/s" if pacing is not None else "off (link unknown)",
                       level, "" if changed else " (already at the floor)")
        self._notify(event)
        return event

    def _relax(self, state: DeviceState, quiet_for: float, now: float) -> GuardEvent:
        level = self._level - 1
        old_cap, new_cap = self._cap, self.cap_at(level)
        pacing = self._pacing if level > 0 else self.startup_pacing_gbps
        event = GuardEvent(f"link quiet for {quiet_for:.0f} s (relax after "
                           f"{self.relax_after_s:g} s)", new_cap, pacing,
                           state.last_sample_time, "relax", level)
        self._level, self._cap, self._pacing = level, new_cap, pacing
        self._quiet_since = now
        self.events.append(event)
        self.relax_count += 1
        logger.info("adaptive guard: %s: relaxed one level to %d of %d: prefill chunk %d -> %d "
                    "tokens (startup %d), pacing %s", event.reason, level, self.max_level,
                    old_cap, new_cap, self.startup_cap_tokens,
                    f"{pacing:g} GB/s" if pacing is not None else "off")
        self._notify(event)
        return event

    def _notify(self, event: GuardEvent) -> None:
        if self._on_change is not None:
            self._on_change(event)


def _rise(name: str, before: int | None, now: int | None) -> str | None:
    if before is not None and now is not None and now > before:
        return f"{name} rose {before} -> {now}"
    return None


def _quiet(state: DeviceState) -> bool:
    """Rule 3 for a sample that showed no stress: an ok device on a link at its max width."""
    if state.state not in QUIET_STATES:
        return False
    w, w_max = state.link_width_current, state.link_width_max
    return w is None or w_max is None or w >= w_max


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
