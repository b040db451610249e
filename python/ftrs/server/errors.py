"""HTTP-only errors and the one mapping from `FtrsError` to the OpenAI error body.

Status and `code` come from the error class (DESIGN.md "Errors"); nothing here re-decides them.
Errors that cross the process pipe travel as `FtrsError.to_dict()` plus "http_status" and
"code"; `error_from_dict` rebuilds the original class when `ftrs.errors` knows it.

Every message that leaves the server is valid UTF-8 (a lone surrogate a client sent cannot
break the JSON encoder), names a request field in one spelling (`messages[0].content`,
`param_name`), and, on `/health`, carries no traceback and no absolute path (`public_error`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ftrs.errors import FtrsError, InvalidRequest
from ftrs.server.engine_process import error_to_wire

logger = logging.getLogger(__name__)


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve."""

    http_status = 404
    code = "model_not_found"


class Unauthorized(FtrsError):
    """`--api-key` is set and the request's Bearer token is missing or wrong."""

    http_status = 401
    code = "invalid_api_key"


class RequestTooLarge(InvalidRequest):
    """The request body is larger than `--max-request-bytes`."""

    http_status = 413
    code = "request_too_large"


class RequestTimeout(InvalidRequest):
    """The request body did not arrive whole within `--request-body-timeout` seconds."""

    http_status = 408
    code = "request_timeout"


class ClientDisconnected(InvalidRequest):
    """The client left before its request was tokenized; the answer reaches no one (nginx's
    499), it only counts the request as aborted (`ftrs_requests_total{status="aborted"}`)."""

    http_status = 499
    code = "client_disconnected"


class EngineUnavailable(FtrsError):
    """The engine process is still loading, failed to load, or exited."""

    http_status = 503
    code = "engine_unavailable"
    exit_code = 1


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def as_ftrs_error(exc: Exception) -> FtrsError:
    """`exc` itself when typed; otherwise (a bug) logged with its traceback and answered as an
    internal error naming only its type, so a stream that already started still ends in an
    error event rather than a cut connection."""
    if isinstance(exc, FtrsError):
        return exc
    logger.error("unhandled error: %s", exc, exc_info=exc)
    return FtrsError(f"internal server error: {type(exc).__name__}")


def _utf8(text: str) -> str:
    """`text` with any lone surrogate written as `\\udXXX`, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def renamed(err: FtrsError, rename: Callable[[str], str]) -> FtrsError:
    """`err` with the field it names (`param`, and the message's leading `param:`) renamed: an
    adapter's request names its fields otherwise than the chat request it runs as."""
    param = err.evidence.get("param")
    if isinstance(param, str) and (new := rename(param)) != param:
        err.evidence["param"] = new
        if err.message.startswith(f"{param}:"):
            err.message = f"{new}:{err.message[len(param) + 1:]}"
            err.args = (err.message,)
    return err


def error_body(err: FtrsError) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` for one typed error."""
    param = err.evidence.get("param")
    return {
        "error": {
            "message": _utf8(err.message),
            "type": error_type(err.http_status),
            "param": _utf8(str(param)) if param is not None else None,
            "code": err.code,
        }
    }


def param_name(loc: Sequence[Any], body: Any, missing: bool = False) -> str | None:
    """A pydantic error location as the field's name in the request: `messages[0].content`.

    `loc` may hold names of union members (`str`, `list[ContentPart]`) between the keys; they
    are dropped by walking `body` along the location, keeping only the keys it really has (and,
    when `missing`, the last key, which names the missing field)."""
    parts: list[str] = []
    node = body
    items = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    for i, key in enumerate(items):
        last = i == len(items) - 1
        if isinstance(key, int) and isinstance(node, list) and 0 <= key < len(node):
            parts.append(f"[{key}]")
            node = node[key]
        elif isinstance(key, str) and isinstance(node, dict) and key in node:
            parts.append(f".{key}" if parts else key)
            node = node[key]
        elif missing and last and isinstance(key, str) and isinstance(node, dict):
            parts.append(f".{key}" if parts else key)  # a required field that is missing
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    """FastAPI's refusal of a body as one typed 400 naming the field, for every route."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return InvalidRequest(f"invalid JSON body: {errors[0].get('msg', '')}")
    # Of a union's alternatives, the deepest error says most (`messages[0].content[0].text`).
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    if tuple(first.get("loc", ())) == ("body",):  # no body, or one that is not an object
        what = ("the request has no body" if first.get("type") == "missing" else
                "the request body is not a JSON object" if isinstance(exc.body, (list, str, int,
                                                                                  float, bool))
                else "the request body was not read as JSON")
        return InvalidRequest(f"{what}: send a JSON object with Content-Type: application/json")
    missing = first.get("type") == "missing"
    param = param_name(first.get("loc", ()), exc.body, missing=missing)
    msg = "field required" if missing else str(first.get("msg", "invalid request"))
    return InvalidRequest(f"{param}: {msg}" if param else msg,
                          evidence={"param": param} if param else None)


_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}


def http_error(exc: HTTPException) -> FtrsError:
    """Starlette's own refusal of a request as a typed error of the same status. A body it
    could not read (FastAPI's generic "error parsing the body") says why: not UTF-8."""
    if exc.status_code == 400:
        cause = exc.__cause__
        why = f"not valid UTF-8 ({cause})" if isinstance(cause, UnicodeDecodeError) else exc.detail
        return InvalidRequest(f"invalid request body: {why}")
    err = FtrsError(str(exc.detail))
    err.http_status = exc.status_code
    err.code = _HTTP_CODES.get(exc.status_code, "http_error")
    return err


_ABS_PATH = re.compile(r"(?<![\w.:/~-])(?:/[^\s/:'\"(),]+)+/([^\s/:'\"(),]+)")


def public_error(err: FtrsError) -> dict[str, str]:
    """What `/health` may show anyone about an error: its class and message, without traceback
    (evidence stays in the logs) and with absolute paths cut to their last component."""
    return {"type": type(err).__name__, "message": scrub_paths(_utf8(err.message))}


def scrub_paths(text: str) -> str:
    return _ABS_PATH.sub(r"\1", text)


def error_response(err: FtrsError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.http_status == 401 else None
    return JSONResponse(error_body(err), status_code=err.http_status, headers=headers)


__all__ = [
    "ClientDisconnected",
    "EngineUnavailable",
    "ModelNotFound",
    "RequestTimeout",
    "RequestTooLarge",
    "Unauthorized",
    "error_body",
    "error_response",
    "error_to_wire",
    "http_error",
    "param_name",
    "public_error",
    "renamed",
    "scrub_paths",
    "validation_error",
]
