"""The flight recorder's rows: one per engine step, for crash reports and the link guard.

`FlightLog` wraps `ftrs._core.FlightRecorder` (a lock-free ring of the last 512 steps) and turns
a step's `StepStats` into a row. Every figure of a row is the step's own (`FIELDS` says each in
words, and every crash report carries it): the copy engine's counters (`bytes_h2d`, `misses`)
are cumulative since the engine started, so a row holds their difference from the previous
step's; the hybrid strategy counts its own step (`step_fetched`). -1 means not known.

The step that fails or hangs is recorded when the fault is found (`record_in_progress`): a hung
step returns no StepStats, and without that row the report of a hang in a long prefill would
hold none of the step that matters. What it carried (its requests, decode rows and prompt tokens
still to compute) and when it started go to the error's evidence as `step_in_progress`.
"""

from __future__ import annotations

import time
from typing import Any

from ftrs.engine.protocol import StepStats

#: The columns of a row, in words (the crash report's `flight_recorder_fields`).
FIELDS = {
    "step": "the supervisor's step number (1-based)",
    "time": "when the step ended (seconds since the epoch); a step in progress: when it started",
    "kind": "prefill, decode, mixed, idle or unknown",
    "tokens": "tokens the step computed (prefill + decode)",
    "chunk_tokens": "prompt tokens the step computed (its prefill chunk)",
    "bytes_issued": "per step: bytes the copy engine moved host to device during the step",
    "inflight_bytes": "at the step's end: bytes of expert copies still in flight",
    "experts_fetched": "per step: expert lookups that missed the device's expert cache "
                       "(fetched, or waited for a copy in flight); hybrid: experts it fetched",
    "power_w": "GPU power at the step (not sampled: null)",
    "temperature_c": "GPU temperature at the step (not sampled: null)",
    "link_gen": "PCIe link generation at the step (-1: not sampled)",
    "link_width": "PCIe link width at the step (-1: not sampled)",
}
KINDS = ("prefill", "decode", "mixed", "idle")


def _num(d: dict[str, Any], *keys: str) -> int:
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(v)
    return -1


def _kind(prefill: int, decode: int) -> str:
    if prefill < 0 or decode < 0 or prefill + decode == 0:
        return "unknown"
    return "mixed" if prefill and decode else "prefill" if prefill else "decode"


class FlightLog:
    """The last `capacity` steps; `record(step, stats)` after each step that returned."""

    def __init__(self, capacity: int = 512) -> None:
        from ftrs import _core

        self.recorder = _core.FlightRecorder(capacity=capacity)
        self._totals: dict[str, int] = {}  # the cumulative counters at the last step's end

    def _delta(self, key: str, total: int) -> int:
        """This step's part of a cumulative counter (-1 when the engine does not report it)."""
        if total < 0:
            return -1
        last = self._totals.get(key, 0)
        self._totals[key] = total
        return total - last if total >= last else total  # smaller: a fresh copy engine

    def record(self, step: int, stats: StepStats) -> None:
        ex = stats.experts or {}
        kind = stats.kind if stats.kind in KINDS else "unknown"
        issued = self._delta("bytes_h2d", _num(ex, "bytes_h2d", "h2d_bytes"))
        missed = self._delta("misses", _num(ex, "misses"))
        fetched = _num(ex, "step_fetched")  # the hybrid strategy's own count of this step
        self.recorder.record(
            step, time=stats.time, kind=kind,
            tokens=stats.prefill_tokens + stats.decode_tokens, chunk_tokens=stats.prefill_tokens,
            bytes_issued=issued, inflight_bytes=_num(ex, "inflight_bytes"),
            experts_fetched=fetched if fetched >= 0 else missed)

    def record_unknown(self, step: int) -> None:
        """A step that failed without saying what it did (out of memory before it ran)."""
        self.recorder.record(step, time=time.time(), kind="unknown")

    def record_in_progress(self, step: int, started_at: float, engine: Any,
                           evidence: dict[str, Any]) -> None:
        """The step that failed (its `failed_step` evidence says what it carried) or hangs
        (the engine says): one row, timed at its start; for a step with no
        `failed_step`, `evidence["step_in_progress"]` says what it carried."""
        failed = evidence.get("failed_step")
        if isinstance(failed, dict) and "prefill_tokens" in failed:
            prefill, decode = int(failed["prefill_tokens"]), int(failed["decode_tokens"])
            self.recorder.record(step, time=started_at, kind=_kind(prefill, decode),
                                 tokens=prefill + decode, chunk_tokens=prefill)
            return
        carried = step_carried(engine)
        decode, pending = carried.get("decode_tokens", -1), carried.get("prompt_tokens_pending", -1)
        kind = _kind(pending, decode)
        self.recorder.record(step, time=started_at, kind=kind,
                             tokens=decode if kind == "decode" else -1,
                             chunk_tokens=0 if kind == "decode" else -1)
        evidence.setdefault("step_in_progress", {
            "step": step, "started_at": round(started_at, 3),
            "running_s": round(time.time() - started_at, 3), "kind": kind, **carried})

    def dump(self) -> list[dict[str, Any]]:
        return self.recorder.dump()


def step_carried(engine: Any) -> dict[str, Any]:
    """What the engine's current step carries (`EngineCore.step_carried()`: its requests, the
    decode rows among them, the prompt tokens they still have to compute, the token budget);
    {} from an engine that cannot say."""
    carried = getattr(engine, "step_carried", None)
    return dict(carried()) if callable(carried) else {}


__all__ = ["FIELDS", "FlightLog", "step_carried"]
