"""Pydantic models of Anthropic's Messages API, and the translation of a Messages request into
the `ChatCompletionRequest` every route runs.

`to_chat` maps system → a system message, text blocks → one message text (a newline between
blocks), assistant tool_use blocks → `tool_calls` (input as JSON text), tool_result blocks →
`role: "tool"` messages (`is_error` → the text prefixed `Error: `), thinking blocks → the
turn's `reasoning_content`,
`input_schema` → `parameters`, `tool_choice` auto/any/tool/none → auto/required/named/none
(`disable_parallel_tool_use` → `parallel_tool_calls: false`), `stop_sequences` → `stop`,
`output_config.format` → a `json_schema` response format, `output_config.effort` →
`reasoning_effort`, `thinking` → the template's `enable_thinking` (its `budget_tokens`, required
when `enabled`, → `thinking_token_budget`). A tool_result must answer a tool_use of an earlier
assistant turn, and only once; tool_use ids are unique in the conversation. Requests validate strictly, like the OpenAI models; unknown fields are ignored.
`Translation.rename` maps a field the chat path names in an error back to the Messages field it
came from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ftrs.errors import InvalidRequest
from ftrs.server.errors import param_name
from ftrs.server.protocol import ChatCompletionRequest, JsonObject, Text

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
    input: dict[str, Any]  # its strings are checked on the way to chat (`to_chat`)


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
    """Reasoning of an earlier turn: its text becomes the turn's `reasoning_content` (a
    redacted block, which has none, is dropped)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: Text | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class MessagesTool(_Model):
    """A client tool; server tools (`web_search_...`, `bash_...`) are refused by their type."""

    type: Literal["custom"] | None = None
    name: Text = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")  # Anthropic's rule for tool names
    description: Text | None = None
    input_schema: JsonObject


class MessagesToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    """`disabled`, or a way to think (`enabled`, `adaptive`; another type is a 400, as Anthropic
    answers it); `budget_tokens` caps the
    reasoning (the chat request's `thinking_token_budget`), required with `enabled` as
    Anthropic requires it. Anthropic's floor of 1024 and its `budget_tokens < max_tokens` are
    not imposed: the budget is a cap that counts against `max_tokens` here, and small models
    have small contexts."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    effort: Text | None = None  # → the chat's reasoning_effort, where it names one (`_EFFORT`)


class CountTokensRequest(_Model):
    """The body of /v1/messages/count_tokens, and everything a Messages request shares with it."""

    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[Text] | None = None
    stream: bool | None = False
    temperature: float | None = None  # Anthropic's range: [0, 1]
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0)  # Anthropic's range; 0 is off
    metadata: JsonObject | None = None  # accepted, ignored
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


def rename_param(param: str, origins: list[str]) -> str:
    """The Messages request's name of a chat request's field (for an error's `param`);
    `origins[k]` is the Messages field chat message k came from."""
    m = re.match(r"messages\[(\d+)\]", param)
    if m and int(m.group(1)) < len(origins):
        return origins[int(m.group(1))]
    m = re.match(r"tools\[(\d+)\](?:\.function)?(\.\w+)?", param)
    if m:
        field = {".parameters": ".input_schema", ".name": ".name", ".description": ".description"}
        return f"tools[{m.group(1)}]{field.get(m.group(2) or '', '')}"
    if param.startswith("response_format"):
        return "output_config.format.schema"
    if param.startswith("stop["):
        return "stop_sequences" + param.removeprefix("stop")
    return {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
            "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}.get(param, param)


class Translation:
    """A Messages request as a chat request, and where each chat message came from."""

    def __init__(self, chat: ChatCompletionRequest, origins: list[str]) -> None:
        self.chat = chat
        self.origins = origins  # origins[k]: the Messages field chat message k came from

    def rename(self, param: str) -> str:
        return rename_param(param, self.origins)


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
    answered: set[str] = set()  # ... and those a tool_result answered
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if not (msg.role == "assistant" and i == len(req.messages) - 1):  # it may be empty
            if not msg.content or (isinstance(msg.content, str) and not msg.content.strip()):
                raise _bad(f"{where}.content", "must not be empty or blank (only a final "
                           "assistant message may be)")
            for j, b in enumerate(msg.content if isinstance(msg.content, list) else ()):
                if isinstance(b, TextBlock) and not b.text.strip():
                    raise _bad(f"{where}.content[{j}].text", "a text block must not be blank")
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
            thoughts = [b.thinking for b in msg.content if isinstance(b, ThinkingBlock) and b.thinking]
            if thoughts:
                turn["reasoning_content"] = "\n".join(thoughts)
            for j, b in enumerate(msg.content):
                if isinstance(b, ToolUseBlock) and b.id in known:
                    raise _bad(f"{where}.content[{j}].id",
                               f"tool_use ids must be unique: {b.id!r} is used before")
                if isinstance(b, ToolUseBlock):
                    known.add(b.id)
            if uses:
                turn["tool_calls"] = _tool_calls(uses)
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
                if b.tool_use_id in answered:
                    raise _bad(f"{where}.content[{j}].tool_use_id",
                               f"the tool_use {b.tool_use_id!r} has a tool_result before")
                answered.add(b.tool_use_id)
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


_EFFORT = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


def to_chat(req: CountTokensRequest) -> Translation:
    """The chat request that runs `req` (a `MessagesRequest`, or a count_tokens body)."""
    messages, origins = _messages(req)
    if not messages:
        raise _bad("messages", "no message has content")
    body: dict[str, Any] = {"model": req.model, "messages": messages, **_tools(req)}
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and str(
            last.get("content") or "").strip():
        body["continue_final_message"] = True  # a prefill: the answer continues it
    if req.thinking is not None:
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is None:
            raise _bad("thinking.budget_tokens", 'required when type is "enabled"')
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if req.thinking.type != "disabled" and req.thinking.budget_tokens is not None:
            body["thinking_token_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise _bad("temperature", f"must be in [0, 1], got {req.temperature}")
        body.update(max_tokens=req.max_tokens, stream=bool(req.stream))
        if req.stop_sequences:
            body["stop"] = list(req.stop_sequences)
        fmt = req.output_config.format if req.output_config else None
        effort = _EFFORT.get(req.output_config.effort or "") if req.output_config else None
        if effort is not None:
            body["reasoning_effort"] = effort
        if fmt is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.schema_}}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # e.g. a lone surrogate inside a tool_use input
        first = exc.errors()[0]
        param = rename_param(param_name(first["loc"], body) or "messages", origins)
        raise _bad(param, str(first["msg"])) from None
    return Translation(chat, origins)


__all__ = [
    "AnthropicError",
    "AnthropicUsage",
    "CountTokensRequest",
    "CountTokensResponse",
    "MessagesRequest",
    "MessagesResponse",
    "Translation",
    "rename_param",
    "to_chat",
]
