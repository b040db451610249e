"""The link guard: a ceiling on the prefill chunk (`max_prefill_length`) for offload modes.

A pure function of the link, the model's fetch volumes, prior crash reports, the guard window,
the user's request and the time the caller says it is; it reads no hardware and no clock. The
rule, with `L` the requested `max_prefill_length`, `W` the guard window (s), `F` the floor
(tokens), `A` the loss age window (`--guard-loss-max-age-days`, 30 days), `BW` the link
bandwidth (measured H2D over a real link, else the nominal figure of the current generation and
width), `H` the hit rate and `bytes(C)` the fetch model's prefill-chunk bytes at `H`,
`L_moe · D(C) · (1 − H) · B` (`guard.fetch`). `H` is a bound the caller knows, not a
measurement: the fraction of all experts the device cache has slots for (`--moe-cache-rate`,
or `--moe-cache-size` over every expert). When neither is given the cache is sized from free
memory at load and its share is not known here: `H = 0`, the reasons say no cache hits were
counted, and a larger cache rate is never advised (that cache may hold every expert). A chunk
past a few dozen tokens touches every expert of a layer, so at most that fraction of its experts
can be hits: `bytes(C)` is what such a chunk moves once the cache is warm. At `H = 1` every
expert has a slot and a warm cache moves nothing; the first fill after start moves every expert
once whatever the chunk size, so no cap shortens it.

0. Resident strategy, or hybrid on a CPU device (`device_is_cpu`: every miss is computed in
   place from the host pool, no byte crosses a link): no cap, and nothing said about the link.
   `--no-link-guard` together with an explicit `--max-prefill-length`: no cap, and a warning
   that says so. `--no-link-guard` alone does not switch the guard off (there must be a length
   the user chose).
1. Window: a chunk may keep the link busy for at most `W` seconds of demand fetches, so
   `cap = L` if `bytes(L) ≤ BW·W`, else `cap = max{C : bytes(C) ≤ BW·W}`. When that C is below
   `F`, no useful chunk fits: capping would not shorten the fetch (bytes(C) saturates at every
   expert of every layer after a few dozen tokens), so the guard warns with the numbers and
   leaves `cap = L`; the warning names only remedies that change `bytes(C)` (a larger cache
   rate only while `H < 1` and the cache's size was given; one sized at load is told to give it).
2. Down-shift: the link runs below its maximum gen or width → `cap = max(F, cap // 2)`.
3. Device loss: the DeviceLost crash reports for this device (or naming no device) that are
   at most `A` old count; fault drills (`--fault-inject`: the report says `"drill": true`) are
   no losses and never count (they are listed in the reasons as "drill, ignored"); older ones are listed in the reasons as "expired, ignored" and cap
   nothing (a report whose time cannot be read counts; without a `now`, none expires). With
   `C_lost` the smallest largest-prefill-chunk recorded in the counted reports' flight
   recorders and `k` the number of counted reports at `C_lost` plus those that recorded no
   chunk: `cap = min(cap, max(F, C_lost >> k))`, or `cap = max(F, cap >> k)` when none
   recorded a chunk. One loss halves; a loss at the new ceiling lowers `C_lost` and halves
   from there (failed attempts bisect the safe size); repeated losses at one size halve once
   each (several recent losses are stricter than one); and all of it fades as the reports age
   past `A`.
4. The guard never raises the request: `cap = min(cap, L)`; it is reported (`cap_tokens`) only
   when below `L`.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrs.errors import ConfigError
from ftrs.guard.fetch import FetchModel
from ftrs.guard.link import LinkState
from ftrs.health.crash import CrashReport
from ftrs.health.sysfs import normalize_bdf

logger = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 0.5
DEFAULT_FLOOR = 256
#: Days after which a DeviceLost report no longer caps (EngineConfig.guard_loss_max_age_days).
DEFAULT_LOSS_MAX_AGE_DAYS = 30.0
#: Strategies that fetch experts over the link while serving (hybrid fetches the misses its
#: cost model gives the link: at most what offload would).
OFFLOAD_STRATEGIES = ("offload", "hybrid", "auto")


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


def check_window_s(window_s: float, flag: str = "--link-guard-window") -> float:
    """The guard window `W`, seconds: a finite number > 0, else ConfigError."""
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not (
            math.isfinite(window_s) and window_s > 0):
        raise ConfigError(f"{flag}: must be a finite number of seconds > 0, got {window_s}")
    return float(window_s)


def check_loss_max_age_days(days: float, flag: str = "--guard-loss-max-age-days") -> float:
    """The loss age window `A`, days: > 0 (inf: reports never expire), else ConfigError."""
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not days > 0:
        raise ConfigError(f"{flag}: must be > 0, got {days}")
    return float(days)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def report_bdf(report: CrashReport) -> str | None:
    """The PCI address a crash report is about, if it names one (a field of another type names
    none: `CrashReport` may be built from any dict)."""
    probes = report.data.get("probes")
    found = [probes.get(k) for k in ("pci", "nvml", "kernel_log")] if isinstance(
        probes, dict) else []
    evidence = report.evidence if isinstance(report.evidence, dict) else {}
    for candidate in (evidence.get("bdf"), *(p.get("bdf") for p in found
                                             if isinstance(p, dict))):
        if isinstance(candidate, str) and candidate:
            try:
                return normalize_bdf(candidate)
            except ValueError:
                continue
    return None


def lost_chunk_tokens(report: CrashReport) -> int | None:
    """The largest prefill chunk in the report's flight recorder (None if none recorded). A
    step's `chunk_tokens` counts when it is a whole number > 0; anything else records none."""
    steps = report.data.get("flight_recorder")
    chunks = [s.get("chunk_tokens") for s in steps if isinstance(s, dict)] if isinstance(
        steps, list) else []
    sizes = [c for c in chunks if isinstance(c, int) and not isinstance(c, bool) and c > 0]
    return max(sizes) if sizes else None


def report_time(report: CrashReport) -> dt.datetime | None:
    """When the report was written (UTC): its `created_at`, else the timestamp its file name
    starts with (`20260922T074501.123Z-...`); None when neither reads."""
    try:
        when = dt.datetime.fromisoformat(report.created_at)
    except ValueError:
        stamp = report.path.name.split("-", 1)[0].partition("Z")[0]
        try:
            when = dt.datetime.strptime(stamp, "%Y%m%dT%H%M%S.%f")
        except ValueError:
            return None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)


def report_age_days(report: CrashReport, now: dt.datetime) -> float | None:
    """Days from the report to `now` (None when the report's time cannot be read)."""
    when = report_time(report)
    if when is None:
        return None
    if now.tzinfo is None:
        now = now.replace(tzinfo=dt.timezone.utc)
    return (now - when).total_seconds() / 86400.0


def is_expired(report: CrashReport, now: dt.datetime | None, max_age_days: float | None) -> bool:
    """Older than `max_age_days` at `now` (rule 3). Without a now, a window or a readable time:
    not expired."""
    if now is None or max_age_days is None:
        return False
    age = report_age_days(report, now)
    return age is not None and age > max_age_days


def device_lost_reports(reports: Sequence[CrashReport], bdf: str | None, *,
                        drills: bool = False) -> list[CrashReport]:
    """DeviceLost reports about `bdf`, or about no named device: the real losses, or with
    `drills` only the fault drills (which are no losses)."""
    want = normalize_bdf(bdf) if bdf else None
    out = []
    for r in reports:
        if r.classification != "DeviceLost" or r.drill != drills:
            continue
        named = report_bdf(r)
        if named is None or want is None or named == want:
            out.append(r)
    return out


def decide_prefill_cap(
    link: LinkState, fetch: FetchModel, *, requested: int, crash_reports: Sequence[CrashReport] = (),
    window_s: float = DEFAULT_WINDOW_S, floor: int = DEFAULT_FLOOR, strategy: str = "offload",
    explicit_request: bool = False, no_link_guard: bool = False, hit_rate: float = 0.0,
    now: dt.datetime | None = None, max_loss_age_days: float | None = DEFAULT_LOSS_MAX_AGE_DAYS,
    device_is_cpu: bool = False, hits_unknown: bool = False,
) -> GuardDecision:
    """Apply the rule of the module doc. `explicit_request`: `--max-prefill-length` was given.
    `hit_rate`: `H`, in [0, 1]. `now`: the time the crash reports' ages are measured at (None:
    no report expires). `device_is_cpu`: the engine computes on the CPU (rule 0 for hybrid).
    `hits_unknown`: the cache is sized from free memory at load, so `H` (0) is not its share:
    the reasons say no hits were counted, and no larger cache rate is advised."""
    reasons: list[str] = []
    warnings: list[str] = []
    numbers: dict[str, Any] = {"requested": requested, "window_s": window_s, "floor": floor,
                               "strategy": strategy, "link": link.describe(),
                               "hit_rate": hit_rate, "hits_unknown": hits_unknown}
    if strategy not in OFFLOAD_STRATEGIES or fetch.num_experts == 0:
        reasons.append(f"strategy {strategy}: no experts cross the link while serving; no cap")
        return GuardDecision(requested, None, tuple(reasons), (), numbers)
    if strategy == "hybrid" and device_is_cpu:
        reasons.append("strategy hybrid on the CPU device: every miss is computed in place "
                       "from the host pool, no expert crosses a link; no cap")
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
        cached = (f" once the cache ({hit_rate:.0%} of the experts) is warm" if hit_rate else
                  " with no cache hits counted" if hits_unknown else "")
        sized = " (the cache is sized from free memory at load)" if hits_unknown else ""
        if need <= budget:
            reasons.append(f"a {requested}-token chunk moves {_gb(need)} of experts{cached}{sized}: "
                           f"{need / (gbps * 1e9):.3f} s at {gbps:.3g} GB/s ({source}), within "
                           f"the {window_s:g} s window")
        else:
            fit = fetch.largest_chunk_within(budget, requested, hit_rate)
            numbers["window_chunk_tokens"] = fit
            if fit >= floor:
                cap = fit
                reasons.append(f"a {requested}-token chunk moves {_gb(need)}{cached}{sized}: "
                               f"{need / (gbps * 1e9):.3f} s at {gbps:.3g} GB/s ({source}), over "
                               f"the {window_s:g} s window ({_gb(budget)}); {fit} tokens fit")
            else:
                at_floor = fetch.prefill_chunk_bytes(floor, hit_rate)
                remedies = (
                    "the cache is sized from free memory at load, so its hits are not counted "
                    "here: give --moe-cache-rate or --moe-cache-size to count them, or use the "
                    "resident strategy or a faster link" if hits_unknown else
                    "use " + ("a larger --moe-cache-rate, " if hit_rate < 1 else "")
                    + "the resident strategy, or a faster link")
                warnings.append(
                    f"a {requested}-token chunk moves {_gb(need)}{cached} "
                    f"({need / (gbps * 1e9):.3f} s at {gbps:.3g} GB/s), over the {window_s:g} s "
                    f"window, and even {floor} tokens move {_gb(at_floor)}: no chunk size "
                    f"fixes this link; {remedies}")
    if link.below_max:
        new = max(floor, cap // 2)
        reasons.append(f"link runs below its maximum ({link.describe()}; nominal "
                       f"{link.nominal_gbps} of {link.nominal_max_gbps} GB/s): {cap} -> {new}")
        numbers["downshift"] = True
        cap = new
    drills = device_lost_reports(crash_reports, link.bdf, drills=True)
    if drills:
        reasons.append(f"{len(drills)} DeviceLost report(s) of fault drills (latest "
                       f"{drills[-1].path.name}): drill, ignored")
        numbers["drill_reports"] = [str(r.path) for r in drills]
    cap = _loss_cap(cap, device_lost_reports(crash_reports, link.bdf), floor=floor, now=now,
                    max_age_days=max_loss_age_days, reasons=reasons, numbers=numbers)
    cap = min(cap, requested)
    numbers["cap_tokens"] = cap if cap < requested else None
    if explicit_request and cap < requested:
        warnings.append(f"your --max-prefill-length {requested} was capped to {cap}; "
                        "--no-link-guard with --max-prefill-length runs it as given")
    return GuardDecision(requested, cap if cap < requested else None, tuple(reasons),
                         tuple(warnings), numbers)


def _loss_cap(cap: int, lost: list[CrashReport], *, floor: int, now: dt.datetime | None,
              max_age_days: float | None, reasons: list[str], numbers: dict[str, Any]) -> int:
    """Rule 3: the cap after this device's DeviceLost reports; appends reasons and numbers."""
    flags = [is_expired(r, now, max_age_days) for r in lost]
    expired = [r for r, old in zip(lost, flags) if old]
    for r in expired:
        age = report_age_days(r, now) if now is not None else None
        reasons.append(f"DeviceLost report {r.path.name} is {age:.0f} days old, over the "
                       f"{max_age_days:g}-day window: expired, ignored")
    if expired:
        numbers["expired_device_lost_reports"] = [str(r.path) for r in expired]
    recent = [r for r, old in zip(lost, flags) if not old]
    if not recent:
        return cap
    chunks = [lost_chunk_tokens(r) for r in recent]
    recorded = [c for c in chunks if c is not None]
    unrecorded = len(chunks) - len(recorded)
    window = "" if now is None or not max_age_days else (
        f" in the last {max_age_days:g} days" if math.isfinite(max_age_days) else " at any age")
    if recorded:
        c_lost = min(recorded)
        k = recorded.count(c_lost) + unrecorded
        new = min(cap, max(floor, c_lost >> k))
        at = f"{recorded.count(c_lost)} at the smallest recorded chunk, {c_lost} tokens"
        if unrecorded:
            at += f", {unrecorded} with no chunk recorded"
        numbers["lost_chunk_tokens"] = c_lost
        what = _fraction(k) + f" the {c_lost}-token chunk of the loss" + ("es" if k > 1 else "")
    else:
        k = unrecorded
        new = min(cap, max(floor, cap >> k))
        at = "no chunk size recorded"
        what = _fraction(k) + f" the {cap}-token ceiling"
    floored = " (the floor)" if new == floor and new < cap else ""
    reasons.append(f"{len(recent)} DeviceLost report(s) for this device{window} ({at}; latest "
                   f"{recent[-1].path.name}): {what}{floored}: {cap} -> {new}")
    numbers["device_lost_reports"] = [str(r.path) for r in recent]
    numbers["loss_halvings"] = k
    return new


def _fraction(k: int) -> str:
    """`half`, `a quarter of`, `1/8 of`: the share `>> k` keeps."""
    return {1: "half", 2: "a quarter of"}.get(k, f"1/{1 << k} of")
