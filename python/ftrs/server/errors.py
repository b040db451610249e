"""HTTP-only errors and the one mapping from `FtrsError` to the OpenAI error body.

Status and `code` come from the error class (DESIGN.md "Errors"); nothing here re-decides them.
Errors that cross the process pipe travel as `FtrsError.to_dict()` plus "http_status" and
"code"; `error_from_dict` rebuilds the original class when `ftrs.errors` knows it.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

import ftrs.errors as ftrs_errors
from ftrs.errors import FtrsError, InvalidRequest
from ftrs.server.engine_process import error_to_wire


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve."""

    http_status = 404
    code = "model_not_found"


class Unauthorized(FtrsError):
    """`--api-key` is set and the request's Bearer token is missing or wrong."""

    http_status = 401
    code = "invalid_api_key"


class EngineUnavailable(FtrsError):
    """The engine process is still loading, failed to load, or exited."""

    http_status = 503
    code = "engine_unavailable"
    exit_code = 1


def error_from_dict(d: dict[str, Any]) -> FtrsError:
    """Rebuild a typed error from its wire dict; unknown classes keep status and code."""
    cls = getattr(ftrs_errors, str(d.get("type", "")), None)
    message = str(d.get("message", "engine error"))
    evidence = dict(d.get("evidence") or {})
    if isinstance(cls, type) and issubclass(cls, FtrsError) and cls is not ftrs_errors.ModelLoadError:
        return cls(message, evidence=evidence)
    err = FtrsError(message, evidence=evidence)
    # A model that failed to load leaves the service unavailable (503), whatever its class says.
    load_failure = d.get("type") == "ModelLoadError"
    err.http_status = 503 if load_failure else int(d.get("http_status", 500))
    err.code = str(d.get("code", "internal_error"))
    return err


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(err: FtrsError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` for one typed error."""
    param = err.evidence.get("param")
    return {
        "error": {
            "message": err.message,
            "type": error_type(err.http_status),
            "param": str(param) if param is not None else None,
            "code": err.code,
        }
    }


def error_response(err: FtrsError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.http_status == 401 else None
    return JSONResponse(error_body(err), status_code=err.http_status, headers=headers)


__all__ = [
    "EngineUnavailable",
    "ModelNotFound",
    "Unauthorized",
    "error_body",
    "error_from_dict",
    "error_response",
    "error_to_wire",
]
