"""Crash reports: one JSON file per device fault, so every failed attempt counts.

Written to `<home>/crash/<UTC timestamp>-<class>.json` (home is $FTRS_HOME, resolved by
ftrs.config and passed in), atomically (temp file in the same directory, fsync, rename), so a
reader never sees half a report. Contents: the classification with its message and evidence,
every probe result, the kernel log tail, the last flight-recorder steps (with
`flight_recorder_fields`, the columns in words: which figures are per step), and host facts
(hostname, kernel, python, torch and driver versions). Deliberately no environment variables
and no command line: those carry tokens and paths users do not mean to share.

A report of a fault drill (`--fault-inject`: the error's evidence, or a probe's, says
`"injected": true`) carries a top-level `"drill": true`; the link guard does not count drills as
device losses and `ftrs doctor` lists them apart. Reports are strict JSON: a non-finite float
(the flight recorder's NaN for "not sampled") is written as null.

`load_crash_report` checks what it reads: a file that is not a report, or one whose fields
have the wrong types (hand-edited, corrupted, another version's), is a ValueError that names
the file and the field, and every reader (the link guard, `ftrs doctor`, the bundle) skips it
with that one line.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import platform
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ftrs.health.classify import Probes
from ftrs.health.flight import FIELDS as FLIGHT_FIELDS
from ftrs.health.kmsg import KernelLogResult

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_STEPS = 64


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def ftrs_version() -> str:
    try:
        from ftrs import __version__
    except ImportError:
        return _version("ftrs") or "unknown"
    return str(__version__)


def host_info() -> dict[str, Any]:
    """Facts about the host that help triage; no environment, no user names, no paths."""
    driver = None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            driver = f.readline().strip()
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "kernel": platform.release(),
            "os": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": _version("torch"),
            "nvidia_ml_py": _version("nvidia-ml-py"), "nvidia_driver": driver}


@dataclass(frozen=True)
class CrashReport:
    """A loaded report. `data` is the whole JSON document."""

    path: Path
    created_at: str
    classification: str
    message: str
    evidence: dict[str, Any]
    data: dict[str, Any]

    @property
    def drill(self) -> bool:
        """A fault drill, not a real fault: its top-level `drill` flag, or (reports written
        before the flag existed) `"injected": true` in its evidence or a probe's."""
        if "drill" in self.data:
            return self.data["drill"] is True
        return _injected(self.evidence, self.data.get("probes"))


def _injected(evidence: dict[str, Any], probes: Any) -> bool:
    """`"injected": true` in the error's evidence or in any probe's evidence."""
    if evidence.get("injected") is True:
        return True
    found = probes.values() if isinstance(probes, dict) else ()
    return any(isinstance(p, dict) and isinstance(p.get("evidence"), dict)
               and p["evidence"].get("injected") is True for p in found)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf) replaced by None, for strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def build_crash_report(
    error: BaseException, *, probes: Probes | None = None,
    kernel_log_tail: Sequence[str] | None = None,
    flight_recorder: Sequence[dict[str, Any]] | None = None, steps: int = DEFAULT_STEPS,
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """The report as a JSON-ready dict. The kernel log tail defaults to the probe's tail."""
    now = now or dt.datetime.now(dt.timezone.utc)
    evidence = dict(getattr(error, "evidence", {}) or {})
    if kernel_log_tail is None and probes is not None and isinstance(
            probes.kernel_log, KernelLogResult):
        kernel_log_tail = probes.kernel_log.tail
    recorded = list(flight_recorder or [])[-steps:] if steps > 0 else []
    probed = probes.to_dict() if probes is not None else {}
    report = {
        "schema_version": SCHEMA_VERSION,
        "created_at": now.isoformat(),
        "drill": _injected(evidence, probed),
        "classification": type(error).__name__,
        "code": getattr(error, "code", None),
        "exit_code": getattr(error, "exit_code", None),
        "message": getattr(error, "message", None) or str(error),
        "hint": evidence.get("hint"),
        "evidence": evidence,
        "probes": probed,
        "kernel_log_tail": list(kernel_log_tail or []),
        "flight_recorder": recorded,
        "flight_recorder_fields": dict(FLIGHT_FIELDS),
        "ftrs_version": ftrs_version(),
        "host": host_info(),
    }
    return dict(_finite(report))


def write_crash_report(
    home: str | Path, error: BaseException, *, probes: Probes | None = None,
    kernel_log_tail: Sequence[str] | None = None,
    flight_recorder: Sequence[dict[str, Any]] | None = None, steps: int = DEFAULT_STEPS,
    now: dt.datetime | None = None,
) -> Path:
    """Write the report atomically and return its path. Never overwrites an older report."""
    now = now or dt.datetime.now(dt.timezone.utc)
    report = build_crash_report(error, probes=probes, kernel_log_tail=kernel_log_tail,
                                flight_recorder=flight_recorder, steps=steps, now=now)
    directory = Path(home) / "crash"
    directory.mkdir(parents=True, exist_ok=True)
    utc = now.astimezone(dt.timezone.utc)
    stamp = f"{utc:%Y%m%dT%H%M%S}.{utc.microsecond // 1000:03d}Z"
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".json.tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, sort_keys=True, default=str, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        path = directory / f"{stamp}-{type(error).__name__}.json"
        n = 1
        while path.exists():  # same millisecond: "<stamp>.<n>-<class>.json" sorts after it
            path = directory / f"{stamp}.{n}-{type(error).__name__}.json"
            n += 1
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.error("crash report written: %s", path)
    return path


def list_crash_reports(home: str | Path) -> list[Path]:
    """Report paths under `<home>/crash`, oldest first (names start with a UTC timestamp)."""
    directory = Path(home) / "crash"
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.glob("*.json") if not p.name.startswith(".")),
                  key=_order)


def _order(path: Path) -> tuple[str, int]:
    stamp = path.name.split("-", 1)[0]  # "20260922T074501.123Z" or "...Z.2"
    base, _, rest = stamp.partition("Z")
    n = rest.lstrip(".")
    return (base, int(n) if n.isdigit() else 0)


def load_crash_report(path: str | Path) -> CrashReport:
    """Read one report. Raises ValueError, `PATH: not a readable crash report (why)`, for a file
    that is not one: unreadable, not UTF-8 JSON, not an object, or with a field a reader relies
    on of the wrong type (`_problem`), so no reader of a report sees a malformed field. A
    missing or null `message`, `evidence`, `probes` or `flight_recorder` is empty; a
    `created_at` that is no string is "" (the guard then takes the time from the file name)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: not a readable crash report ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a readable crash report (not UTF-8 text: {e.reason} at "
                         f"byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a readable crash report (not valid JSON: {e})") from e
    why = _problem(data)
    if why is not None:
        raise ValueError(f"{path}: not a readable crash report ({why})")
    created = data.get("created_at")
    return CrashReport(path=path, created_at=created if isinstance(created, str) else "",
                       classification=data["classification"], message=data.get("message") or "",
                       evidence=data.get("evidence") or {}, data=data)


def _problem(data: Any) -> str | None:
    """What makes `data` no crash report a reader can trust, or None. A flight-recorder step's
    `chunk_tokens` is a whole number of tokens, -1 (the recorder's "not known") or null."""
    if not isinstance(data, dict):
        return f"{_shown(data)} is not a JSON object"
    if "schema_version" not in data:
        return "no schema_version"
    name = data.get("classification")
    if not isinstance(name, str) or not name:
        return f"classification is {_shown(name)}, not a name"
    for field, kind in (("message", str), ("evidence", dict), ("probes", dict),
                        ("flight_recorder", list)):
        if data.get(field) is not None and not isinstance(data[field], kind):
            return f"{field} is {_shown(data[field])}, not {_KINDS[kind]}"
    for which, probe in (data.get("probes") or {}).items():
        if probe is not None and not isinstance(probe, dict):
            return f"probes.{which} is {_shown(probe)}, not an object"
    for i, step in enumerate(data.get("flight_recorder") or []):
        if not isinstance(step, dict):
            return f"flight_recorder[{i}] is {_shown(step)}, not an object"
        chunk = step.get("chunk_tokens")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < -1):
            return f"flight_recorder[{i}].chunk_tokens is {_shown(chunk)}, not a token count"
    return None


_KINDS = {str: "a string", dict: "an object", list: "a list"}


def _shown(value: Any) -> str:
    """`value` as JSON (NaN as NaN), cut to 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"
