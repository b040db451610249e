"""The flight recorder's rows (health.flight): each figure is the step's own."""

from __future__ import annotations

from typing import Any

from ftrs.engine.protocol import StepStats
from ftrs.health.flight import FlightLog


def _stats(kind: str, prefill: int, decode: int, **experts: Any) -> StepStats:
    return StepStats(1, 100.0, 0.1, kind, 1, 0, prefill, decode, 0.2, experts=experts)


def test_cumulative_copy_counters_become_per_step_figures() -> None:
    log = FlightLog(8)
    log.record(1, _stats("prefill", 16, 0, bytes_h2d=1000, misses=4, inflight_bytes=64))
    log.record(2, _stats("decode", 0, 2, bytes_h2d=1500, misses=5, inflight_bytes=0))
    log.record(3, _stats("decode", 0, 2, bytes_h2d=1500, misses=5, inflight_bytes=0))
    rows = log.dump()
    assert [r["bytes_issued"] for r in rows] == [1000, 500, 0]
    assert [r["experts_fetched"] for r in rows] == [4, 1, 0]
    assert [r["inflight_bytes"] for r in rows] == [64, 0, 0]
    assert [(r["tokens"], r["chunk_tokens"]) for r in rows] == [(16, 16), (2, 0), (2, 0)]


def test_hybrid_counts_its_own_step_and_resident_reports_unknown() -> None:
    log = FlightLog(8)
    log.record(1, _stats("decode", 0, 1, bytes_h2d=10, misses=9, step_fetched=2))
    log.record(2, _stats("decode", 0, 1))  # resident: no copy engine
    first, second = log.dump()
    assert first["experts_fetched"] == 2 and first["bytes_issued"] == 10
    assert second["experts_fetched"] == -1 and second["bytes_issued"] == -1


def test_a_failed_step_is_recorded_from_its_evidence() -> None:
    log = FlightLog(8)
    evidence: dict[str, Any] = {"failed_step": {"step": 7, "request_ids": ["a"],
                                                "prefill_tokens": 8192, "decode_tokens": 0}}
    log.record_in_progress(3, 50.0, object(), evidence)
    (row,) = log.dump()
    assert (row["step"], row["time"], row["kind"]) == (3, 50.0, "prefill")
    assert (row["tokens"], row["chunk_tokens"]) == (8192, 8192)
    assert "step_in_progress" not in evidence  # failed_step already says it
