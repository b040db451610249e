"""Request-body cap: an ASGI middleware that answers 413 before a large body is parsed.

`BodyLimit` reads the whole body of a request (a `Content-Length` over the cap is refused before
a byte is read; a chunked body is counted as it arrives), answers 413 in the OpenAI error shape
(Anthropic's under `/v1/messages`) when it exceeds `max_bytes`, and otherwise hands the app a
`receive` that replays the body once and then passes the connection's own messages through, so
`http.disconnect` still reaches the request's disconnect watcher.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ftrs.errors import FtrsError, InvalidRequest
from ftrs.server import anthropic
from ftrs.server.errors import RequestTooLarge, error_response

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class BodyLimit:
    """Refuse HTTP request bodies larger than `max_bytes` with 413 `request_too_large`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
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
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await _answer(scope, send, self._too_large(received))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

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


__all__ = ["BodyLimit"]
