"""What a request must meet before its body is parsed: the API key, a size cap, a deadline.

`BodyLimit` is an ASGI middleware. With an API key set, a request to any path but `/health` and
`/metrics` without the key is answered 401 from its headers, before a byte of its body is read
(`require_key`, the routes' own check too), so a client without the key cannot make the server
hold its body. Then it reads the whole body (a `Content-Length` over the cap is refused before a
byte is read; a chunked body is counted as it arrives) and answers 413 when it exceeds
`max_bytes`, or 408 when it has not arrived whole within `timeout_s` of the headers (a client
that declares a body and stops sending would otherwise hold its buffer for as long as it keeps
the connection). These answers are in the OpenAI error shape (Anthropic's under `/v1/messages`)
and close the connection. Otherwise the app gets a `receive` that replays the body once and then
passes the connection's own messages through, so `http.disconnect` still reaches the request's
disconnect watcher.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.datastructures import Headers

from ftrs.errors import FtrsError, InvalidRequest
from ftrs.server import anthropic
from ftrs.server.errors import RequestTimeout, RequestTooLarge, Unauthorized, error_response

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

#: the paths that answer without the API key
OPEN_PATHS = frozenset({"/health", "/metrics"})


def require_key(api_key: str | None, path: str, headers: Mapping[str, str]) -> None:
    """Raise `Unauthorized` unless `headers` carry `api_key` (when one is set): as
    `Authorization: Bearer KEY`, or under `/v1/messages` also as `x-api-key: KEY`."""
    if api_key is None:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    messages = path.startswith(anthropic.PATH_PREFIX)
    if messages:
        given.append(headers.get("x-api-key", "").strip())
    if not any(k and hmac.compare_digest(k.encode(), api_key.encode()) for k in given):
        raise Unauthorized("Incorrect or missing API key: send " + (
            "`x-api-key: <key>`" if messages else "`Authorization: Bearer <key>`"))


class BodyLimit:
    """Refuse a request without the API key before its body (401), a body larger than
    `max_bytes` (413 `request_too_large`), and one not whole within `timeout_s` (408)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float,
                 api_key: str | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.api_key = api_key

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        if path not in OPEN_PATHS:
            try:
                require_key(self.api_key, path, Headers(scope=scope))
            except Unauthorized as err:
                await _answer(scope, send, err)
                return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _answer(scope, send, InvalidRequest("invalid Content-Length header"))
                return
            if size > self.max_bytes:
                await _answer(scope, send, self._too_large(size))
                return
        first = await self._read(receive)
        if isinstance(first, FtrsError):
            await _answer(scope, send, first)
            return
        await self.app(scope, _replay([first], receive), send)

    async def _read(self, receive: Receive) -> Message | FtrsError:
        """The whole body as one `http.request` message; or the first other message (the
        client left before sending it all); or the error to answer (413, 408)."""
        chunks: list[bytes] = []
        received = 0

        async def whole() -> Message | FtrsError:
            nonlocal received
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return message
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > self.max_bytes:
                    return self._too_large(received)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        try:  # wait_for, not asyncio.timeout: Python 3.10 is supported
            return await asyncio.wait_for(whole(), self.timeout_s)
        except asyncio.TimeoutError:
            return RequestTimeout(f"the request body did not arrive whole within {self.timeout_s:g} s "
                                  f"({received} bytes came; --request-body-timeout)")

    def _too_large(self, size: int) -> FtrsError:
        return RequestTooLarge(f"the request body has {size} bytes or more; this server accepts at "
                               f"most {self.max_bytes} (--max-request-bytes)")


def _replay(first: list[Message], receive: Receive) -> Receive:
    pending = list(first)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


async def _answer(scope: MutableMapping[str, Any], send: Send, err: FtrsError) -> None:
    path = str(scope.get("path", ""))
    response = anthropic.error_response(err) if path.startswith(anthropic.PATH_PREFIX) else error_response(err)
    response.headers["connection"] = "close"  # the unread rest of the body is not drained

    async def no_body() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)


__all__ = ["OPEN_PATHS", "BodyLimit", "require_key"]
