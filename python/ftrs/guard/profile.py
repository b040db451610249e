"""Calibration profiles: what `ftrs bench strategy` measured on this host, for `--moe-strategy auto`.

A profile is a JSON file `$FTRS_HOME/profiles/<key hash>.json` holding its key (device, host,
model, link), the measured table and the pick. `resolve_auto_strategy` answers with the pick of
the profile whose key matches exactly, and says which file it used; without one it says what
it assumed instead (resident when every expert fits the device budget, else offload), so the
choice is never silent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

KEY_FIELDS = ("device", "host", "model", "link")


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
    """The profile measured under exactly this key, or None."""
    path = profile_path(key, home)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or "pick" not in data:
        logger.warning("ignoring profile %s: key or pick missing", path)
        return None
    data["path"] = str(path)
    return data


class AutoChoice(NamedTuple):
    strategy: str
    cache_rate: float | None
    message: str


def resolve_auto_strategy(key: dict[str, str], *, total_expert_bytes: int,
                          device_budget_bytes: int | None, home: Path | None = None,
                          default_cache_rate: float = 0.5) -> AutoChoice:
    """What `--moe-strategy auto` runs: the matching profile's pick, else a stated assumption."""
    prof = load_profile(key, home)
    if prof is not None:
        pick = prof["pick"]
        return AutoChoice(str(pick["strategy"]), pick.get("cache_rate"),
                          f"auto: {pick['label']} from profile {prof['path']} "
                          f"(measured {pick['total_s']:.3f} s, fastest of "
                          f"{sum(1 for r in prof['rows'] if not r.get('error'))} that ran)")
    where = ", ".join(f"{k}={key[k]}" for k in KEY_FIELDS)
    if device_budget_bytes is None or total_expert_bytes <= device_budget_bytes:
        return AutoChoice("resident", None,
                          f"auto: no profile for {where}; assumed resident (all experts, "
                          f"{total_expert_bytes / 1e9:.2f} GB, fit the device budget); run "
                          "`ftrs bench strategy` to measure")
    return AutoChoice("offload", default_cache_rate,
                      f"auto: no profile for {where}; assumed offload at cache rate "
                      f"{default_cache_rate:g} (experts {total_expert_bytes / 1e9:.2f} GB exceed "
                      f"the device budget {device_budget_bytes / 1e9:.2f} GB); run "
                      "`ftrs bench strategy` to measure")
