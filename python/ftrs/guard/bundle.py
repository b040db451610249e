"""`ftrs doctor --bundle PATH`: one tar.gz to attach to a bug report.

Members: `report.json` and `report.txt` (the doctor report), `crash/<name>.json` (every crash
report under `$FTRS_HOME/crash`), `flight_recorder/<name>.json` (the flight-recorder steps found
in each crash report), `metrics.txt` (a `/metrics` snapshot when a server URL is given and
answers), and `manifest.json` (what is in it, and what could not be added and why). A snapshot
that fails is also logged as a warning, so the terminal says so; the bundle is still written.

No secrets: nothing reads the environment, and every text member goes through `redact`, which
blanks bearer tokens, `sk-`/`hf_` style keys, `--api-key VALUE` and `"api_key": "VALUE"` style
fields (key, token, secret, password, authorization), URL credentials, and any extra literal
the caller names (the server passes its `--api-key`).
"""

from __future__ import annotations

import io
import json
import logging
import re
import tarfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftrs.health.crash import list_crash_reports, load_crash_report

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
_SECRET_NAME = r"(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|token|secret|password|passwd|authorization)"
_PATTERNS = (
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]+"),
    re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{10,}"),
    re.compile(r"(?i)(--" + _SECRET_NAME + r"[= ]+)(\S+)"),
    re.compile(r"(?i)(\"?[A-Za-z_]*" + _SECRET_NAME + r"\"?\s*[:=]\s*\"?)([^\"\s,}]+)"),
    re.compile(r"(?i)(://)[^/@\s:]+:[^/@\s]+@"),
)


def redact(text: str, extra: Sequence[str] = ()) -> str:
    """`text` with every secret-looking value replaced by `<redacted>`."""
    for literal in extra:
        if literal:
            text = text.replace(literal, REDACTED)
    for pat in _PATTERNS:
        if pat.groups >= 2:
            text = pat.sub(lambda m: m.group(1) + REDACTED, text)
        elif pat.groups == 1:
            text = pat.sub(lambda m: m.group(1) + REDACTED + "@", text)
        else:
            text = pat.sub(REDACTED, text)
    return text


def fetch_metrics(server_url: str, timeout_s: float = 3.0) -> str:
    url = server_url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode("utf-8", "replace"))


def write_bundle(path: str | Path, report: dict[str, Any], report_text: str, *, home: Path,
                 server_url: str | None = None, extra_secrets: Sequence[str] = ()) -> Path:
    """Write the archive; returns its path (the caller says where it went). Never raises for a
    missing part (see manifest); OSError when the file cannot be written: its directory must
    exist, none is created."""
    path = Path(path)
    members: dict[str, str] = {}
    notes: list[str] = []
    members["report.json"] = json.dumps(report, indent=2, sort_keys=True, default=str)
    members["report.txt"] = report_text
    for p in list_crash_reports(home):
        try:
            crash = load_crash_report(p)
        except ValueError as e:
            notes.append(f"crash report skipped: {e}")
            continue
        members[f"crash/{p.name}"] = p.read_text(encoding="utf-8")
        steps = crash.data.get("flight_recorder") or []
        if steps:
            members[f"flight_recorder/{p.stem}.json"] = json.dumps(steps, indent=2)
    if server_url:
        try:
            members["metrics.txt"] = fetch_metrics(server_url)
        except Exception as e:  # the server may be gone: that is why there is a bundle
            notes.append(f"metrics snapshot from {redact(server_url)} failed: {e}")
            logger.warning("bundle: metrics snapshot from %s failed: %s; the bundle is written "
                           "without metrics.txt", redact(server_url), e)
    else:
        notes.append("no server URL given: no metrics snapshot")
    manifest = {"created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "members": sorted(members),
                "notes": notes, "redaction": "bearer tokens, keys, secret fields, URL credentials"}
    members["manifest.json"] = json.dumps(manifest, indent=2)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = redact(text, extra_secrets).encode("utf-8")
            info = tarfile.TarInfo(f"ftrs-doctor/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    logger.debug("bundle written: %s (%d members)", path, len(members))
    return path
