"""Result types shared by every probe (DESIGN.md "Errors").

A probe never raises on missing hardware: it returns a result whose `status` says what it saw.
`lost` is reserved for evidence that does not come from CUDA itself; `error` means the probe
ran and something answered with an error (or the probe itself failed), which on its own
decides nothing; `not_applicable` carries a `reason` (no GPU, no driver, no permission).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """What one probe concluded. The string values are stable (JSON, /health, metrics)."""

    OK = "ok"
    LOST = "lost"
    DEGRADED = "degraded"
    NOT_APPLICABLE = "not_applicable"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """Base of every probe result.

    `evidence` holds the raw values the probe read (file contents, NVML codes, log lines),
    so a crash report can show them without the reader re-running anything.
    """

    #: Stable probe name: "pci", "nvml", "cuda", "kernel_log", "child".
    probe: str
    #: The probe's conclusion.
    status: Status
    #: Why the status is not `ok` (empty when ok), in words for a human.
    reason: str = ""
    #: Raw evidence; JSON-ready values only.
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: every field, enums as their string values."""
        out: dict[str, Any] = _jsonable(dataclasses.asdict(self))
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def not_applicable(probe: str, reason: str, **evidence: Any) -> ProbeResult:
    """A plain result for a probe that cannot run here (no GPU, no driver, no permission)."""
    return ProbeResult(probe=probe, status=Status.NOT_APPLICABLE, reason=reason, evidence=evidence)
