"""What a step fetched over the link: bytes of expert copies, from the strategy's counters.

The MoE strategy's `stats()` (what `StepStats.experts` carries) holds the copy engine's counters,
cumulative since the engine started. `h2d_bytes` reads the bytes copied host to device from them:
`h2d_bytes` where a strategy reports it, else the copies started times `expert_bytes` (demand
fetches, plus prefetches and fills that were not dropped: the names `ftrs._core`
TransferEngine.stats() uses). None when the strategy moves nothing (resident, dense models).
`server/metrics.py` counts it as `ftrs_pcie_bytes_total{direction="h2d"}`.

`note_prefill_fetch` gives a step that carried prompt tokens its own part of that counter,
`experts["prefill_fetch_bytes"]`: what it grew by between the step's start (after scheduling)
and its end, the copies of the experts the step's forward fetched (prefetches included), so the
histogram's sum is a part of the h2d counter. `server/metrics.py` observes it as
`ftrs_prefill_chunk_fetch_bytes`. Nothing here imports torch: the API process reads it too.
"""

from __future__ import annotations

from collections.abc import Mapping

from ftrs.engine.protocol import StepStats


def h2d_bytes(experts: Mapping[str, object]) -> float | None:
    """Bytes copied host to device since the engine started; None when nothing says."""
    if "h2d_bytes" in experts:
        return _number(experts["h2d_bytes"])
    parts = [_number(experts.get(k)) for k in ("demand_fetches", "prefetch_issued", "expert_bytes")]
    if any(p is None for p in parts):
        return None
    demand, issued, size = (float(p or 0) for p in parts)
    cancelled = _number(experts.get("prefetch_cancelled")) or 0.0
    fills = (_number(experts.get("fill_issued")) or 0.0) - (_number(experts.get("fill_dropped"))
                                                           or 0.0)
    return (demand + issued - cancelled + fills) * size


def note_prefill_fetch(stats: StepStats, before: float | None) -> None:
    """Set `stats.experts["prefill_fetch_bytes"]` for a step with prompt tokens: what the bytes
    counter grew by since `before` (`h2d_bytes` at the step's start; 0 when prefetches of an
    earlier step cancelled in this one outweigh its copies). A counter not reported sets
    nothing (a strategy that moves nothing)."""
    after = h2d_bytes(stats.experts)
    if stats.prefill_tokens > 0 and before is not None and after is not None:
        stats.experts["prefill_fetch_bytes"] = max(after - before, 0.0)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


__all__ = ["h2d_bytes", "note_prefill_fetch"]
