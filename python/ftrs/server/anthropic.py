"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
shared generation path.

The adapter is a translator at both ends of `serving.start_chat`: `anthropic_protocol.to_chat`
turns a Messages request into the `ChatCompletionRequest` every route runs, and `BlockEncoder`
turns the run's `ChoiceEvent`s into content blocks, one open at a time: reasoning → a thinking
block, text → a text block, each tool call → a tool_use block whose `input` arrives as
`input_json_delta` pieces. The same encoder builds the streamed events and the non-stream body,
so the two always agree (the body keeps only the calls the parser completed).

Errors on these routes leave in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`: the routes are an `APIRoute` subclass that catches its own errors (validation,
a body FastAPI cannot parse, auth, typed `FtrsError`s, anything else as `api_error`), so the app's OpenAI handlers never see
them; an error after the stream started is an `error` event. A field named in an error from the
shared path (`stop`, `messages[3]`, `tools[0].function.parameters`) is renamed to the field of
the Messages request it came from. Auth accepts the server's key as `x-api-key` or as
`Authorization: Bearer`. `input_tokens` counts the whole prompt (the prefix cache is automatic,
not reported as cache reads), so `count_tokens` equals what a generation then reports.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute, APIRouter
from starlette.exceptions import HTTPException

from ftrs.errors import FtrsError
from ftrs.server.anthropic_protocol import (
    AnthropicError,
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    to_chat,
)
from ftrs.server.errors import (
    Unauthorized,
    as_ftrs_error,
    http_error,
    renamed,
    validation_error,
)
from ftrs.server.prepare import check_model
from ftrs.server.serving import (
    ChatRun,
    ChoiceEvent,
    ServeContext,
    render_chat_prompt,
    start_adapted,
)

logger = logging.getLogger(__name__)

PATH_PREFIX = "/v1/messages"  # the routes whose errors leave in Anthropic's shape

# ------------------------------------------------------------------------------------ encoder


def _stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


class BlockEncoder:
    """One choice's `ChoiceEvent`s as content-block events; `content` is the finished blocks.

    Within an event, reasoning comes before text and text before tool calls (the order the
    parsers emit them); a change of kind, or a new tool call, closes the open block."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self._kind: str | None = None  # "thinking" | "text" | "tool_use" of the open block
        self._call: int | None = None  # the open tool_use block's call index
        self._json: list[str] = []  # the open tool_use block's input pieces

    def feed(self, e: ChoiceEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if e.reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": e.reasoning}))
            self.content[-1]["thinking"] += e.reasoning
        if e.text:
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": e.text}))
            self.content[-1]["text"] += e.text
        for call in e.tool_calls:
            if self._kind != "tool_use" or call.index != self._call:
                block_id = call.id or f"toolu_{uuid.uuid4().hex[:24]}"
                out += self._open("tool_use", {"type": "tool_use", "id": block_id,
                                               "name": call.name or "", "input": {}}, force=True)
                self._call = call.index
            if call.arguments:
                self._json.append(call.arguments)
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    def close(self) -> list[dict[str, Any]]:
        """Close the open block (at the end of the choice)."""
        if self._kind is None:
            return []
        index = len(self.content) - 1
        if self._kind == "tool_use":
            self.content[-1]["input"] = _json_object("".join(self._json))
            self._json = []
        self._kind, self._call = None, None
        return [{"type": "content_block_stop", "index": index}]

    def keep_calls(self, calls: list[Any]) -> None:
        """Keep the tool_use blocks of the complete calls (`toolcalls.ToolCall`), with their
        arguments as input; a call the parser found malformed came back as text."""
        complete = {c.id: c for c in calls}
        self.content = [b for b in self.content if b["type"] != "tool_use" or b["id"] in complete]
        for b in self.content:
            if b["type"] == "tool_use":
                b["input"] = _json_object(complete[b["id"]].arguments)

    def _open(self, kind: str, block: dict[str, Any], force: bool = False) -> list[dict[str, Any]]:
        if self._kind == kind and not force:
            return []
        out = self.close()
        self.content.append(block)
        self._kind = kind
        return [*out, {"type": "content_block_start", "index": len(self.content) - 1,
                       "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        logger.warning("tool call arguments are not a JSON object: %.200r", text)
        return {}
    return value


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------- errors


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error", 529: "overloaded_error"}.get(
        status, "invalid_request_error" if status < 500 else "api_error")


def error_body(err: FtrsError) -> dict[str, Any]:
    message = err.message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"type": "error", "error": {"type": error_type(err.http_status), "message": message}}


def error_response(err: FtrsError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.http_status)


def _route_class(ctx: ServeContext) -> type[APIRoute]:
    """An APIRoute whose every error, validation included, leaves in Anthropic's shape."""

    class AnthropicRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                try:
                    return await handler(request)
                except RequestValidationError as exc:
                    err: FtrsError = validation_error(exc)
                except HTTPException as exc:  # a body FastAPI could not parse
                    err = http_error(exc)
                except FtrsError as exc:
                    err = exc
                except Exception as exc:
                    logger.exception("unhandled error: %s", exc)
                    err = FtrsError(f"internal server error: {type(exc).__name__}")
                ctx.metrics.request_failed(err.http_status)
                return error_response(err)

            return route

    return AnthropicRoute


# ------------------------------------------------------------------------------------- routes

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError, "description": why} for status, why in (
        (400, "invalid_request_error (the message names the field)"),
        (401, "authentication_error: missing or wrong key (x-api-key or Bearer)"),
        (404, "not_found_error: unknown model"),
        (413, "request_too_large: body over --max-request-bytes"),
        (503, "overloaded_error: engine loading, failed or overloaded"),
    )
}


def install_anthropic(app: FastAPI, ctx: ServeContext, api_key: str | None) -> None:
    """Register `/v1/messages` and `/v1/messages/count_tokens` on `app`; with `api_key` set,
    both need it as `x-api-key` or `Authorization: Bearer`."""

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = [request.headers.get("x-api-key", "").strip()]
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given.append(token.strip())
        if not any(k and hmac.compare_digest(k.encode(), api_key.encode()) for k in given):
            raise Unauthorized("Incorrect or missing API key: send `x-api-key: <key>`")

    router = APIRouter(route_class=_route_class(ctx), dependencies=[Depends(authorize)])

    @router.post(PATH_PREFIX, response_model=None,
                 responses={200: {"model": MessagesResponse}, **_ERRORS})
    async def messages(req: MessagesRequest, request: Request) -> Response:
        tr = to_chat(req)
        run, events = await start_adapted(ctx, tr.chat, request, "msg", tr.rename)
        msg_id = "msg_" + run.request_id.removeprefix("msg-")
        if req.stream:
            return _stream(ctx, req, run, events, msg_id)
        blocks = BlockEncoder()
        async for e in events:
            blocks.feed(e)
        blocks.close()
        blocks.keep_calls(run.calls(0))
        usage = run.usage()
        seq = run.stop_sequence(0)
        body = MessagesResponse(id=msg_id, model=req.model, content=blocks.content,
                                stop_reason=_stop_reason(run.finish_reason(0), seq), stop_sequence=seq,
                                usage=AnthropicUsage(input_tokens=usage.prompt_tokens,
                                                     output_tokens=usage.completion_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    @router.post(f"{PATH_PREFIX}/count_tokens", response_model=None,
                 responses={200: {"model": CountTokensResponse}, **_ERRORS})
    async def count_tokens(req: CountTokensRequest) -> CountTokensResponse:
        tr = to_chat(req)
        try:
            check_model(tr.chat, ctx.model_names)
            ids = await asyncio.to_thread(render_chat_prompt, ctx, tr.chat)
        except FtrsError as err:
            raise renamed(err, tr.rename) from None
        return CountTokensResponse(input_tokens=len(ids))

    app.include_router(router)


def _stream(ctx: ServeContext, req: MessagesRequest, run: ChatRun,
            events: AsyncIterator[ChoiceEvent], msg_id: str) -> StreamingResponse:
    """The SSE answer: message_start, ping, the blocks, message_delta, message_stop; an error
    after the first byte is an `error` event that ends the stream."""

    async def body() -> AsyncIterator[str]:
        start = MessagesResponse(id=msg_id, model=req.model, content=[], stop_reason=None,
                                 stop_sequence=None,
                                 usage=AnthropicUsage(input_tokens=run.usage().prompt_tokens,
                                                      output_tokens=0))
        yield _sse({"type": "message_start", "message": start.model_dump()})
        yield _sse({"type": "ping"})
        blocks = BlockEncoder()
        try:
            async for e in events:
                for event in blocks.feed(e):
                    yield _sse(event)
        except Exception as exc:
            err = as_ftrs_error(exc)
            ctx.metrics.request_failed(err.http_status)
            yield _sse(error_body(err))
            return
        for event in blocks.close():
            yield _sse(event)
        usage = run.usage()
        seq = run.stop_sequence(0)
        yield _sse({"type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(run.finish_reason(0), seq), "stop_sequence": seq},
                    "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}})
        yield _sse({"type": "message_stop"})

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = [
    "PATH_PREFIX",
    "BlockEncoder",
    "error_body",
    "error_response",
    "error_type",
    "install_anthropic",
]
