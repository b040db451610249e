"""The link guard: a ceiling on the prefill chunk (`max_prefill_length`) for offload modes.

A pure function of the link, the model's fetch volumes, prior crash reports, the guard window
and the user's request; it reads no hardware and no clock. The rule, with
`L` the requested `max_prefill_length`, `W` the guard window (s), `F` the floor (tokens),
`BW` the link bandwidth (measured H2D over a real link, else the nominal figure of the current
generation and width) and `bytes(C)` the fetch model's prefill-chunk bytes:

0. Resident strategy: no cap (no expert crosses the link while serving). `--no-link-guard`
   together with an explicit `--max-prefill-length`: no cap, and a warning that says so.
   `--no-link-guard` alone does not switch the guard off (there must be a length the user chose).
1. Window: a chunk may keep the link busy for at most `W` seconds of demand fetches, so
   `cap = L` if `bytes(L) ≤ BW·W`, else `cap = max{C : bytes(C) ≤ BW·W}`. When that C is below
   `F`, no useful chunk fits: capping would not shorten the fetch (bytes(C) saturates at every
   expert of every layer after a few dozen tokens), so the guard warns with the numbers and
   leaves `cap = L`.
2. Down-shift: the link runs below its maximum gen or width → `cap = max(F, cap // 2)`.
3. Device loss: a DeviceLost crash report exists for this device (or names no device) →
   `cap = min(cap, max(F, C_lost // 2))`, `C_lost` the smallest largest-prefill-chunk recorded
   in those reports' flight recorders; `cap = max(F, cap // 2)` when no report recorded one.
   Each further loss at the new ceiling halves it again: failed attempts bisect the safe size.
4. The guard never raises the request: `cap = min(cap, L)`; it is reported (`cap_tokens`) only
   when below `L`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrs.guard.fetch import FetchModel
from ftrs.guard.link import LinkState
from ftrs.health.crash import CrashReport
from ftrs.health.sysfs import normalize_bdf

logger = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 0.5
DEFAULT_FLOOR = 256
OFFLOAD_STRATEGIES = ("offload", "auto")


@dataclass(frozen=True)
class GuardDecision:
    """What the guard decided, why (with numbers), and what the user should know."""

    requested: int
    #: The ceiling when the guard lowers the request; None when it does not.
    cap_tokens: int | None
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def max_prefill_length(self) -> int:
        """The token budget to run with."""
        return self.cap_tokens if self.cap_tokens is not None else self.requested

    def to_dict(self) -> dict[str, Any]:
        return {"requested": self.requested, "cap_tokens": self.cap_tokens,
                "max_prefill_length": self.max_prefill_length, "reasons": list(self.reasons),
                "warnings": list(self.warnings), "numbers": dict(self.numbers)}

    def log(self, log: logging.Logger = logger) -> None:
        if self.cap_tokens is not None:
            log.warning("link guard: max_prefill_length capped %d -> %d", self.requested,
                        self.cap_tokens)
        for r in self.reasons:
            log.info("link guard: %s", r)
        for w in self.warnings:
            log.warning("link guard: %s", w)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def report_bdf(report: CrashReport) -> str | None:
    """The PCI address a crash report is about, if it names one."""
    probes = report.data.get("probes") or {}
    for candidate in (report.evidence.get("bdf"), *(
            (probes.get(k) or {}).get("bdf") for k in ("pci", "nvml", "kernel_log"))):
        if isinstance(candidate, str) and candidate:
            try:
                return normalize_bdf(candidate)
            except ValueError:
                continue
    return None


def lost_chunk_tokens(report: CrashReport) -> int | None:
    """The largest prefill chunk in the report's flight recorder (None if none recorded)."""
    sizes = [int(s.get("chunk_tokens") or 0) for s in report.data.get("flight_recorder") or []
             if isinstance(s, dict)]
    sizes = [s for s in sizes if s > 0]
    return max(sizes) if sizes else None


def device_lost_reports(reports: Sequence[CrashReport], bdf: str | None) -> list[CrashReport]:
    """DeviceLost reports about `bdf`, or about no named device."""
    want = normalize_bdf(bdf) if bdf else None
    out = []
    for r in reports:
        if r.classification != "DeviceLost":
            continue
        named = report_bdf(r)
        if named is None or want is None or named == want:
            out.append(r)
    return out


def decide_prefill_cap(
    link: LinkState, fetch: FetchModel, *, requested: int, crash_reports: Sequence[CrashReport] = (),
    window_s: float = DEFAULT_WINDOW_S, floor: int = DEFAULT_FLOOR, strategy: str = "offload",
    explicit_request: bool = False, no_link_guard: bool = False, hit_rate: float = 0.0,
) -> GuardDecision:
    """Apply the rule of the module doc. `explicit_request`: `--max-prefill-length` was given."""
    reasons: list[str] = []
    warnings: list[str] = []
    numbers: dict[str, Any] = {"requested": requested, "window_s": window_s, "floor": floor,
                               "strategy": strategy, "link": link.describe()}
    if strategy not in OFFLOAD_STRATEGIES or fetch.num_experts == 0:
        reasons.append(f"strategy {strategy}: no experts cross the link while serving; no cap")
        return GuardDecision(requested, None, tuple(reasons), (), numbers)
    if no_link_guard and explicit_request:
        warnings.append(f"link guard off (--no-link-guard): running {requested}-token chunks "
                        "as requested, whatever the link")
        return GuardDecision(requested, None, (), tuple(warnings), numbers)
    if no_link_guard:
        warnings.append("--no-link-guard needs an explicit --max-prefill-length; guard applied")

    cap = requested
    gbps, source = link.effective_gbps()
    numbers |= {"link_gbps": gbps, "link_gbps_source": source,
                "chunk_bytes_at_requested": fetch.prefill_chunk_bytes(requested, hit_rate)}
    if gbps is None:
        warnings.append("link bandwidth unknown: the window rule was skipped")
    else:
        budget = gbps * 1e9 * window_s
        need = fetch.prefill_chunk_bytes(requested, hit_rate)
        numbers |= {"window_budget_bytes": budget, "fetch_time_s_at_requested": need / (gbps * 1e9)}
        if need <= budget:
            reasons.append(f"a {requested}-token chunk moves {_gb(need)} of experts: "
                           f"{need / (gbps * 1e9):.3f} s at {gbps:.3g} GB/s ({source}), within "
                           f"the {window_s:g} s window")
        else:
            fit = fetch.largest_chunk_within(budget, requested, hit_rate)
            numbers["window_chunk_tokens"] = fit
            if fit >= floor:
                cap = fit
                reasons.append(f"a {requested}-token chunk moves {_gb(need)}: "
                               f"{need / (gbps * 1e9):.3f} s at {gbps:.3g} GB/s ({source}), over "
                               f"the {window_s:g} s window ({_gb(budget)}); {fit} tokens fit")
            else:
                at_floor = fetch.prefill_chunk_bytes(floor, hit_rate)
                warnings.append(
                    f"a {requested}-token chunk moves {_gb(need)} ({need / (gbps * 1e9):.3f} s at "
                    f"{gbps:.3g} GB/s), over the {window_s:g} s window, and even {floor} tokens "
                    f"move {_gb(at_floor)}: no chunk size fixes this link; use a larger "
                    "--moe-cache-rate, the resident strategy, or a faster link")
    if link.below_max:
        new = max(floor, cap // 2)
        reasons.append(f"link runs below its maximum ({link.describe()}; nominal "
                       f"{link.nominal_gbps} of {link.nominal_max_gbps} GB/s): {cap} -> {new}")
        numbers["downshift"] = True
        cap = new
    lost = device_lost_reports(crash_reports, link.bdf)
    if lost:
        chunks = [c for c in (lost_chunk_tokens(r) for r in lost) if c is not None]
        if chunks:
            c_lost = min(chunks)
            new = min(cap, max(floor, c_lost // 2))
            reasons.append(f"{len(lost)} DeviceLost report(s) for this device, the smallest at a "
                           f"{c_lost}-token chunk ({lost[-1].path.name}): {cap} -> {new}")
            numbers["lost_chunk_tokens"] = c_lost
        else:
            new = max(floor, cap // 2)
            reasons.append(f"{len(lost)} DeviceLost report(s) for this device, no chunk size "
                           f"recorded ({lost[-1].path.name}): {cap} -> {new}")
        numbers["device_lost_reports"] = [str(r.path) for r in lost]
        cap = new
    cap = min(cap, requested)
    numbers["cap_tokens"] = cap if cap < requested else None
    if explicit_request and cap < requested:
        warnings.append(f"your --max-prefill-length {requested} was capped to {cap}; "
                        "--no-link-guard with --max-prefill-length runs it as given")
    return GuardDecision(requested, cap if cap < requested else None, tuple(reasons),
                         tuple(warnings), numbers)
