"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the
shared generation path.

The adapter is a translator at both ends of `serving.start_chat`: `to_chat` turns a Messages
request into the `ChatCompletionRequest` every route runs (system → a system message, tool_use
blocks → assistant `tool_calls`, tool_result blocks → `role: "tool"` messages, thinking blocks
dropped, `input_schema` → `parameters`, `tool_choice` auto/any/tool/none → auto/required/named/
none, `stop_sequences` → `stop`), and `BlockEncoder` turns the run's `ChoiceEvent`s into content
blocks, one open at a time: reasoning → a thinking block, text → a text block, each tool call →
a tool_use block whose `input` arrives as `input_json_delta` pieces. The same encoder builds the
streamed events and the non-stream body, so the two always agree.

Errors on these routes leave in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`: the routes are an `APIRoute` subclass that catches its own errors (validation,
auth, typed `FtrsError`s, anything else as `api_error`), so the app's OpenAI handlers never see
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
import re
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel, ConfigDict, Field

from ftrs.errors import FtrsError, InvalidRequest
from ftrs.server.errors import Unauthorized, param_name
from ftrs.server.prepare import check_model
from ftrs.server.protocol import ChatCompletionRequest, Text
from ftrs.server.serving import ChatRun, ChoiceEvent, ServeContext, render_chat_prompt, start_chat

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------- requests


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Model):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            body = self.content or ""
        else:
            body = _join(self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Model):
    """Reasoning of an earlier turn: accepted in the history and dropped."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class Tool(_Model):
    """A client tool; server tools (`web_search_...`, `bash_...`) are refused by their type."""

    type: Literal["custom"] | None = None
    name: Text = Field(min_length=1, max_length=128)
    description: Text | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Model):
    """`disabled`, or a way to think (`enabled`, `adaptive`, ...); a budget is not enforced."""

    type: Text


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    effort: Text | None = None  # accepted, ignored


class CountTokensRequest(_Model):
    """The body of /v1/messages/count_tokens, and everything a Messages request shares with it."""

    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[Text] | None = None
    stream: bool | None = False
    temperature: float | None = None  # Anthropic's range: [0, 1]
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
    output_config: OutputConfig | None = None  # format → the chat path's json_schema


# ---------------------------------------------------------------------------------- responses


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


# -------------------------------------------------------------------------------- translation


def _bad(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", evidence={"param": param})


class Translation:
    """A Messages request as a chat request, and where each chat field came from."""

    def __init__(self, chat: ChatCompletionRequest, origins: list[str]) -> None:
        self.chat = chat
        self.origins = origins  # origins[k]: the Messages field chat message k came from

    def rename(self, param: str) -> str:
        """The Messages request's name of a chat request's field (for an error's `param`)."""
        m = re.match(r"messages\[(\d+)\]", param)
        if m and int(m.group(1)) < len(self.origins):
            return self.origins[int(m.group(1))]
        m = re.match(r"tools\[(\d+)\](?:\.function)?(\.\w+)?", param)
        if m:
            field = {".parameters": ".input_schema", ".name": ".name", ".description": ".description"}
            return f"tools[{m.group(1)}]{field.get(m.group(2) or '', '')}"
        if param.startswith("response_format"):
            return "output_config.format.schema"
        return {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
                "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}.get(param, param)


def _join(blocks: Iterable[TextBlock]) -> str:
    """Text blocks as one message text, a newline between blocks."""
    return "\n".join(b.text for b in blocks)


def _tool_calls(blocks: list[ToolUseBlock]) -> list[dict[str, Any]]:
    return [{"id": b.id, "type": "function",
             "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in blocks]


def _messages(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages of the request, each with its origin in the Messages request."""
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _join(req.system)
        out.append({"role": "system", "content": system})
        origins.append("system")
    known: set[str] = set()  # tool_use ids of the assistant turns so far
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            origins.append(f"{where}.content")
            continue
        if msg.role == "assistant":
            text = _join(b for b in msg.content if isinstance(b, TextBlock))
            uses = [b for b in msg.content if isinstance(b, ToolUseBlock)]
            for j, b in enumerate(msg.content):
                if isinstance(b, ToolResultBlock):
                    raise _bad(f"{where}.content[{j}]", "tool_result blocks belong in user messages")
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            if uses:
                turn["tool_calls"] = _tool_calls(uses)
                known.update(b.id for b in uses)
            out.append(turn)
            origins.append(f"{where}.content")
            continue
        texts: list[TextBlock] = []
        for j, b in enumerate(msg.content):
            if isinstance(b, ToolUseBlock):
                raise _bad(f"{where}.content[{j}]", "tool_use blocks belong in assistant messages")
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in known:
                    raise _bad(f"{where}.content[{j}].tool_use_id",
                               f"no earlier tool_use block has the id {b.tool_use_id!r}")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                origins.append(f"{where}.content[{j}]")
            elif isinstance(b, TextBlock):
                texts.append(b)
        if texts:
            out.append({"role": "user", "content": _join(texts)})
            origins.append(f"{where}.content")
    return out, origins


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of the chat request."""
    tools = req.tools or []
    names = [t.name for t in tools]
    fields: dict[str, Any] = {}
    if tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.input_schema}} for t in tools]
    choice = req.tool_choice
    if choice is None:
        return fields
    if choice.type in ("any", "tool") and not tools:
        raise _bad("tool_choice", f'"{choice.type}" needs `tools`')
    if choice.type == "tool":
        if not choice.name:
            raise _bad("tool_choice.name", 'required when type is "tool"')
        if choice.name not in names:
            raise _bad("tool_choice.name", f"no tool is named {choice.name!r}")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use and tools:
        fields["parallel_tool_calls"] = False
    return fields


def to_chat(req: CountTokensRequest) -> Translation:
    """The chat request that runs `req` (a `MessagesRequest`, or a count_tokens body)."""
    messages, origins = _messages(req)
    if not messages:
        raise _bad("messages", "no message has content")
    body: dict[str, Any] = {"model": req.model, "messages": messages, **_tools(req)}
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if isinstance(req, MessagesRequest):
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise _bad("temperature", f"must be in [0, 1], got {req.temperature}")
        body.update(max_tokens=req.max_tokens, stream=bool(req.stream))
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        fmt = req.output_config.format if req.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.schema_}}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    return Translation(ChatCompletionRequest.model_validate(body), origins)


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
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.warning("tool call arguments are not a JSON object: %.200r", text)
        return {}
    return value


def _stop_sequence(ctx: ServeContext, run: ChatRun, req: MessagesRequest) -> str | None:
    """The stop string that ended the choice: the first one in its decoded output."""
    if run.finish_reason(0) != "stop" or not req.stop_sequences:
        return None
    seen = getattr(run, "stop_sequence", None)
    if callable(seen):
        return seen(0)
    tokenizer = ctx.client.tokenizer
    text = tokenizer.decode(run.token_ids(0), skip_special_tokens=True) if tokenizer else ""
    hits = [(text.find(s), -len(s), s) for s in req.stop_sequences if s and s in text]
    return min(hits)[2] if hits else None


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


def _validation_error(exc: RequestValidationError) -> InvalidRequest:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return InvalidRequest(f"invalid JSON body: {errors[0].get('msg', '')}")
    # Of a union's alternatives, the deepest error says most (`messages[0].content[0].text`).
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    missing = first.get("type") == "missing"
    param = param_name(first.get("loc", ()), exc.body, missing=missing)
    msg = "field required" if missing else str(first.get("msg", "invalid request"))
    return InvalidRequest(f"{param}: {msg}" if param else msg,
                          evidence={"param": param} if param else None)


def _renamed(err: FtrsError, tr: Translation) -> FtrsError:
    """`err` with its field named as in the Messages request."""
    param = err.evidence.get("param")
    if not isinstance(param, str):
        return err
    new = tr.rename(param)
    if new != param:
        err.evidence["param"] = new
        if err.message.startswith(f"{param}:"):
            err.message = f"{new}:{err.message[len(param) + 1:]}"
            err.args = (err.message,)
    return err


def _route_class(ctx: ServeContext) -> type[APIRoute]:
    """An APIRoute whose every error, validation included, leaves in Anthropic's shape."""

    class AnthropicRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                try:
                    return await handler(request)
                except RequestValidationError as exc:
                    err: FtrsError = _validation_error(exc)
                except FtrsError as exc:
                    err = exc
                except Exception as exc:
                    logger.exception("unhandled error: %s", exc)
                    err = FtrsError(f"internal server error: {type(exc).__name__}")
                ctx.metrics.request_failed(err.http_status)
                return JSONResponse(error_body(err), status_code=err.http_status)

            return route

    return AnthropicRoute


# ------------------------------------------------------------------------------------- routes

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError, "description": why} for status, why in (
        (400, "invalid_request_error (the message names the field)"),
        (401, "authentication_error: missing or wrong key (x-api-key or Bearer)"),
        (404, "not_found_error: unknown model"),
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

    @router.post("/v1/messages", response_model=None,
                 responses={200: {"model": MessagesResponse}, **_ERRORS})
    async def messages(req: MessagesRequest, request: Request) -> Response:
        tr = to_chat(req)
        try:
            run = await start_chat(ctx, tr.chat, request, id_prefix="msg")
            events = await run.events()
        except FtrsError as err:
            raise _renamed(err, tr) from None
        msg_id = "msg_" + run.request_id.removeprefix("msg-")
        if req.stream:
            return _stream(ctx, req, run, events, msg_id)
        blocks = BlockEncoder()
        async for e in events:
            blocks.feed(e)
        blocks.close()
        blocks.keep_calls(run.calls(0))
        usage = run.usage()
        seq = _stop_sequence(ctx, run, req)
        body = MessagesResponse(id=msg_id, model=req.model, content=blocks.content,
                                stop_reason=_stop_reason(run.finish_reason(0), seq), stop_sequence=seq,
                                usage=AnthropicUsage(input_tokens=usage.prompt_tokens,
                                                     output_tokens=usage.completion_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    @router.post("/v1/messages/count_tokens", response_model=None,
                 responses={200: {"model": CountTokensResponse}, **_ERRORS})
    async def count_tokens(req: CountTokensRequest) -> CountTokensResponse:
        tr = to_chat(req)
        try:
            check_model(tr.chat, ctx.model_names)
            ids = await asyncio.to_thread(render_chat_prompt, ctx, tr.chat)
        except FtrsError as err:
            raise _renamed(err, tr) from None
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
        except FtrsError as err:
            ctx.metrics.request_failed(err.http_status)
            yield _sse(error_body(err))
            return
        for event in blocks.close():
            yield _sse(event)
        usage = run.usage()
        seq = _stop_sequence(ctx, run, req)
        yield _sse({"type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(run.finish_reason(0), seq), "stop_sequence": seq},
                    "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}})
        yield _sse({"type": "message_stop"})

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = [
    "BlockEncoder",
    "CountTokensRequest",
    "MessagesRequest",
    "MessagesResponse",
    "Translation",
    "error_body",
    "error_type",
    "install_anthropic",
    "to_chat",
]
