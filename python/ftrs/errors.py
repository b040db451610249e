"""The exception hierarchy of ftrs (DESIGN.md "Errors").

Every error carries the evidence that decided it, so a caller (the CLI, the HTTP server, a
crash report) can say *why* without re-deriving anything. The HTTP status, the OpenAI error
`code` and the process exit code live on the class, in one table, not in the callers.
"""

from __future__ import annotations

from typing import Any


class FtrsError(Exception):
    """Base of every error ftrs raises on purpose."""

    http_status: int = 500
    code: str = "internal_error"
    exit_code: int = 1

    def __init__(self, message: str, *, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.evidence: dict[str, Any] = dict(evidence or {})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: class, message, evidence."""
        return {"type": type(self).__name__, "message": self.message, "evidence": self.evidence}


class ConfigError(FtrsError):
    """A setting is invalid or contradicts another."""

    http_status = 400
    code = "invalid_config"
    exit_code = 2


class ModelLoadError(FtrsError):
    """A checkpoint cannot be loaded. `path` names the file (or directory) at fault."""

    code = "model_load_error"
    exit_code = 3

    def __init__(self, path: str, problem: str, *, evidence: dict[str, Any] | None = None) -> None:
        super().__init__(f"{path}: {problem}", evidence={"path": path, **(evidence or {})})
        self.path = path
        self.problem = problem


class InvalidRequest(FtrsError):
    """A request is malformed or asks for something the engine does not do."""

    http_status = 400
    code = "invalid_request"


class CapacityError(FtrsError):
    """The request cannot be served with the capacity at hand."""

    http_status = 503
    code = "overloaded"


class ContextLengthExceeded(CapacityError):
    """Prompt plus max_tokens is longer than the model's context or the KV pool."""

    http_status = 400
    code = "context_length_exceeded"


class DeviceError(FtrsError):
    """Something is wrong with the accelerator, not with the request."""

    http_status = 503
    code = "device_error"
    exit_code = 85


class DeviceLost(DeviceError):
    """The device left the bus (vendor read 0xffff, NVML GPU_IS_LOST, Xid 79, dead child probe)."""

    code = "device_lost"
    exit_code = 86


class KernelFault(DeviceError):
    """A CUDA error while the device still answers: an engine or kernel bug, not hardware."""

    http_status = 500
    code = "engine_fault"
    exit_code = 87


class DeviceOutOfMemory(DeviceError):
    """The device ran out of memory for one request; the engine keeps serving."""

    http_status = 503
    code = "device_out_of_memory"


class DeviceUnhealthy(DeviceError):
    """The device answers but its link or health counters say it is degraded."""

    code = "device_unhealthy"


class EngineHang(DeviceError):
    """Work was pending and no step finished within the hang timeout."""

    code = "engine_hang"
    exit_code = 88


class EngineStepError(FtrsError):
    """An engine step raised an error that is not the device's (a bug, an input that slipped
    past validation): the requests of that step fail with it and the engine goes on. Failed
    steps `--step-fault-limit` in a row end the engine process, which is then restarted."""

    code = "engine_fault"


class EngineRestarted(FtrsError):
    """The engine process died (any exit, kill -9 included) or kept failing, and is being
    restarted: the requests it held are lost. Past `--engine-restarts` restarts within
    `--engine-restart-window` seconds, `ftrs serve` exits with this code instead."""

    http_status = 503
    code = "engine_restarted"
    exit_code = 89


class ServerShuttingDown(FtrsError):
    """`ftrs serve` was asked to stop (SIGINT/SIGTERM): new requests are refused with this error,
    and every request in flight ends with it at once (a stream: as its last event), rather
    than being cut when the process exits. A stop on request is not a failure: exit code 0.
    A client may retry on another replica, or on this one once it is back."""

    http_status = 503
    code = "server_shutting_down"
    exit_code = 0


def error_from_dict(d: dict[str, Any]) -> FtrsError:
    """Rebuild a typed error from its wire dict (what the engine sends in `TokenEvent.error`);
    unknown classes keep their status and code."""
    cls = globals().get(str(d.get("type", "")))
    message = str(d.get("message", "engine error"))
    evidence = dict(d.get("evidence") or {})
    if cls is ModelLoadError:
        # Rebuilt as itself (its exit code 3, its class on /health), but answering 503: a model
        # that failed to load leaves the service unavailable, not the request at fault.
        path = str(evidence.get("path", "model"))
        problem = message.removeprefix(f"{path}: ")
        err: FtrsError = ModelLoadError(path, problem, evidence=evidence)
        err.http_status = 503
        return err
    if isinstance(cls, type) and issubclass(cls, FtrsError):
        return cls(message, evidence=evidence)
    err = FtrsError(message, evidence=evidence)
    err.http_status = int(d.get("http_status", 500))
    err.code = str(d.get("code", "internal_error"))
    return err


__all__ = [
    "CapacityError",
    "ConfigError",
    "ContextLengthExceeded",
    "DeviceError",
    "DeviceLost",
    "DeviceOutOfMemory",
    "DeviceUnhealthy",
    "EngineHang",
    "EngineRestarted",
    "EngineStepError",
    "FtrsError",
    "InvalidRequest",
    "KernelFault",
    "ModelLoadError",
    "ServerShuttingDown",
    "error_from_dict",
]
