"""Calibration profiles: what `ftrs bench strategy` measured on this host, for `--moe-strategy auto`.

A profile is a JSON file `$FTRS_HOME/profiles/<key hash>.json` holding its key (device, host,
model, link), the measured table and the pick. `resolve_auto_strategy` answers with the pick of
the profile whose key matches exactly, and says which file it used; without one it says what
it assumed instead (resident when every expert fits the device budget, else offload). A file
at the key's path that is no usable profile (not UTF-8 JSON, another run's key, a pick or rows
of the wrong shape: `profile_problem`) is ignored with one warning that names it and what is
wrong, and the assumption follows. The choice is always stated: callers log the `auto: ...`
line at INFO (`guard.startup`), so a library user sees it with logging at INFO, or reads it
from `ftrs.LLM.auto_line`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

KEY_FIELDS = ("device", "host", "model", "link")
#: What a profile's pick may run (`auto` is what resolves to one of them).
STRATEGIES = ("resident", "offload", "hybrid")


def profile_key(*, device: str, host: str, model: str, link: str) -> dict[str, str]:
    return {"device": device, "host": host, "model": model, "link": link}


def profiles_dir(home: Path | None = None) -> Path:
    if home is None:
        from ftrs.config import ftrs_home

        home = ftrs_home()
    return Path(home) / "profiles"


def profile_path(key: dict[str, str], home: Path | None = None) -> Path:
    canon = json.dumps({k: key[k] for k in KEY_FIELDS}, sort_keys=True)
    return profiles_dir(home) / f"{hashlib.sha256(canon.encode()).hexdigest()[:16]}.json"


def write_profile(data: dict[str, Any], key: dict[str, str], home: Path | None = None) -> Path:
    """Write atomically (temp file + rename); returns the path."""
    path = profile_path(key, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data | {"key": key}, f, indent=2, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_profile(key: dict[str, str], home: Path | None = None) -> dict[str, Any] | None:
    """The profile measured under exactly this key, or None: none was written, or the file is
    no usable profile, which one warning says (`ignoring profile PATH: why`)."""
    path = profile_path(key, home)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except OSError as e:
        why = f"cannot read it ({e.strerror or e})"
    except UnicodeDecodeError as e:
        why = f"not UTF-8 text ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        why = f"not valid JSON ({e})"
    else:
        problem = profile_problem(data, key)
        if problem is None:
            data["path"] = str(path)
            return dict(data)
        why = problem
    logger.warning("ignoring profile %s: %s", path, why)
    return None


def profile_problem(data: Any, key: dict[str, str]) -> str | None:
    """Why `data` is no profile `auto` can run for `key`, or None: its key must be this run's,
    its pick a strategy `auto` runs with a label, a measured time and a cache rate in (0, 1]
    or null, its rows a list of objects."""
    if not isinstance(data, dict):
        return f"{_shown(data)} is not a JSON object"
    found = data.get("key")
    if not isinstance(found, dict):
        return _wrong(data, "key", "an object")
    other = [f"{k} {found.get(k)} (this run: {key[k]})" for k in KEY_FIELDS
             if found.get(k) != key[k]]
    if other:
        return "its key is another run's: " + ", ".join(other)
    pick = data.get("pick")
    if not isinstance(pick, dict):
        return _wrong(data, "pick", "an object")
    strategy, label = pick.get("strategy"), pick.get("label")
    total: Any = pick.get("total_s")
    rate: Any = pick.get("cache_rate")
    if strategy not in STRATEGIES:
        return _wrong(pick, "strategy", f"one of {', '.join(STRATEGIES)}", "pick.")
    if not isinstance(label, str) or not label:
        return _wrong(pick, "label", "a name", "pick.")
    if not _number(total) or total < 0:
        return _wrong(pick, "total_s", "a time in seconds", "pick.")
    if rate is not None and not (_number(rate) and 0 < rate <= 1):
        return f"pick.cache_rate is {_shown(rate)}, not in (0, 1] or null"
    rows = data.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return _wrong(data, "rows", "a list of objects")
    return None


def _wrong(d: dict[str, Any], field: str, want: str, where: str = "") -> str:
    """`pick.label is missing`, or `pick.label is VALUE, not WANT`."""
    name = where + field
    return f"{name} is missing" if field not in d else f"{name} is {_shown(d[field])}, not {want}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown(value: Any) -> str:
    """`value` as JSON, cut to 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"


class AutoChoice(NamedTuple):
    strategy: str
    cache_rate: float | None
    message: str


def resolve_auto_strategy(key: dict[str, str], *, total_expert_bytes: int,
                          device_budget_bytes: int | None, home: Path | None = None,
                          default_cache_rate: float = 0.5) -> AutoChoice:
    """What `--moe-strategy auto` runs: the matching profile's pick, else a stated assumption
    (after a profile that was there but unusable: "no usable profile")."""
    prof = load_profile(key, home)
    if prof is not None:
        pick = prof["pick"]
        ran = sum(1 for r in prof["rows"] if not r.get("error"))
        return AutoChoice(pick["strategy"], pick.get("cache_rate"),
                          f"auto: {pick['label']} from profile {prof['path']} "
                          f"(measured {pick['total_s']:.3f} s, fastest of {ran} that ran)")
    where = ", ".join(f"{k}={key[k]}" for k in KEY_FIELDS)
    none = "no usable profile" if profile_path(key, home).exists() else "no profile"
    if device_budget_bytes is None or total_expert_bytes <= device_budget_bytes:
        return AutoChoice("resident", None,
                          f"auto: {none} for {where}; assumed resident (all experts, "
                          f"{total_expert_bytes / 1e9:.2f} GB, fit the device budget); run "
                          "`ftrs bench strategy` to measure")
    return AutoChoice("offload", default_cache_rate,
                      f"auto: {none} for {where}; assumed offload at cache rate "
                      f"{default_cache_rate:g} (experts {total_expert_bytes / 1e9:.2f} GB exceed "
                      f"the device budget {device_budget_bytes / 1e9:.2f} GB); run "
                      "`ftrs bench strategy` to measure")
