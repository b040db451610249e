"""OpenAI's Responses API (`POST /v1/responses`): the request, and its translation into the
`ChatCompletionRequest` every route runs.

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `background` are
400s naming the field (send the whole conversation in `input`); `store` is accepted and every
answer says `"store": false`. `to_chat` maps `instructions` → a system message first; `input` (a
string, or items) → messages: a `message` item (role user, assistant, system or developer; text
parts `input_text`/`output_text`) → a message; `reasoning` items, then an assistant message and
`function_call` items in a row → one assistant turn (the reasoning as its `reasoning_content`,
the calls as `tool_calls`, their `call_id` as the call ids); `function_call_output` → a
`role: "tool"` message answering an earlier call. Function `tools` (flat: `name`,
`description`, `parameters`) → chat tools, other tool types refused by type; `tool_choice`,
`parallel_tool_calls`, `max_output_tokens` → `max_tokens`, `temperature`, `top_p`, `text.format`
(`text`, `json_object`, `json_schema`) → `response_format`, `reasoning.effort` →
`reasoning_effort`. Image, file and other item types are 400s naming the item.

Clients that keep no state send reasoning back as `encrypted_content`, asked for with `include:
["reasoning.encrypted_content"]`; this server fills that field with the reasoning text itself
(not encrypted: there is no secret to keep from the client that received the text), so the
reasoning of a tool loop reaches the template again.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ftrs.errors import InvalidRequest
from ftrs.server.errors import param_name
from ftrs.server.protocol import ChatCompletionRequest, JsonObject, Text

_TEXT_PARTS = ("input_text", "output_text", "text")
_EFFORT = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high"}
_STATEFUL = ("previous_response_id", "conversation")


class ResponsesRequest(BaseModel):
    """The body of /v1/responses; items and tools are checked by `to_chat`, field by field."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    tools: list[JsonObject] | None = None
    tool_choice: Text | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: JsonObject | None = None
    reasoning: JsonObject | None = None
    stream: bool | None = False
    store: bool | None = None  # accepted: nothing is stored
    metadata: dict[Text, Text] | None = None
    previous_response_id: Text | None = None  # refused: nothing is stored
    conversation: Text | JsonObject | None = None  # refused likewise
    background: bool | None = None  # true is refused
    include: list[Text] | None = None  # "reasoning.encrypted_content": see the module doc


def _bad(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", evidence={"param": param})


class Translation:
    """A Responses request as a chat request; `origins[k]`: the `input` field chat message k
    came from, so an error from the chat path names the request's own field."""

    def __init__(self, chat: ChatCompletionRequest, origins: list[str]) -> None:
        self.chat = chat
        self.origins = origins

    def rename(self, param: str) -> str:
        m = re.match(r"messages\[(\d+)\]", param)
        if m and int(m.group(1)) < len(self.origins):
            return self.origins[int(m.group(1))]
        m = re.match(r"tools\[(\d+)\](?:\.function)?(\.\w+)?", param)
        if m:
            return f"tools[{m.group(1)}]{m.group(2) or ''}"
        if param.startswith("response_format"):  # text.format holds json_schema's fields flat
            rest = param.removeprefix("response_format").removeprefix(".json_schema")
            return "text.format" + rest
        return {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "reasoning_effort": "reasoning.effort", "messages": "input"}.get(param, param)


def _text(value: Any, where: str) -> str:
    """A string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, "must be a string or a list of text parts")
    out = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]", f"only text parts are supported, not {kind!r}")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{key}", "required (a non-empty string)")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts), else its summary, else
    its `encrypted_content` (which this server fills with the text itself)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _bad(f"{where}.{key}", "must be a list")
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == kind]
        if texts:
            if any(not isinstance(t, str) for t in texts):
                raise _bad(f"{where}.{key}", "a part without text")
            return "\n".join(str(t) for t in texts)
    sealed = item.get("encrypted_content")
    return sealed if isinstance(sealed, str) else ""


def _messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """Chat messages of the request, each with the field it came from."""
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    calls: set[str] = set()  # call ids of the function_call items so far

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(turn)
            origins.append(turn.pop("_origin"))
            turn = None

    def assistant(where: str) -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": "", "_origin": where}
        return turn

    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    items = [{"type": "message", "role": "user", "content": req.input}] \
        if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = "input" if isinstance(req.input, str) else f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            t = assistant(where)
            if t["content"] or t.get("tool_calls"):
                flush()
                t = assistant(where)
            text = _reasoning_text(item, where)
            if text:
                t["reasoning_content"] = "\n".join(filter(None, [t.get("reasoning_content"), text]))
        elif kind == "function_call":
            call_id = _field(item, "call_id", where)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise _bad(f"{where}.arguments", "required (the arguments' JSON text)")
            assistant(where).setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": _field(item, "name", where), "arguments": arguments}})
            calls.add(call_id)
        elif kind == "message" and item.get("role") == "assistant":
            t = assistant(where)
            if t["content"] or t.get("tool_calls"):
                flush()
                t = assistant(where)
            t["content"] = _text(item.get("content"), f"{where}.content")
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise _bad(f"{where}.role", f"must be user, assistant, system or developer, not {role!r}")
            flush()
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            origins.append(f"{where}.content")
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            if call_id not in calls:
                raise _bad(f"{where}.call_id", f"no earlier function_call has the call_id {call_id!r}")
            flush()
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{where}.output")})
            origins.append(f"{where}.output")
        else:
            raise _bad(f"{where}.type", f"unsupported input item type {kind!r} (supported: message, "
                       "function_call, function_call_output, reasoning)")
    flush()
    return out, origins


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of the chat request."""
    fields: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise _bad(f"tools[{i}].type", f"only function tools are served, not {tool.get('type')!r}")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": fn})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice", 'a named choice is {"type": "function", "name": ...}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        fields["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    return fields


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format", "type must be text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {"name": fmt.get("name") or "output", "schema": fmt.get("schema")}
    if fmt.get("strict") is not None:
        spec["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": spec}


def to_chat(req: ResponsesRequest) -> Translation:
    """The chat request that runs `req`."""
    for name in _STATEFUL:
        if getattr(req, name) is not None:
            raise _bad(name, "responses are not stored here: send the whole conversation in `input`")
    if req.background:
        raise _bad("background", "background responses are not supported")
    messages, origins = _messages(req)
    if not messages:
        raise _bad("input", "no input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream),
                            **_tools(req)}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    fmt = _response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    asked = (req.reasoning or {}).get("effort")
    effort = _EFFORT.get(str(asked))
    if asked not in (None, "none") and effort is None:
        raise _bad("reasoning.effort", f"must be one of none, {', '.join(_EFFORT)}; got {asked!r}")
    if effort is not None:
        body["reasoning_effort"] = effort
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        tr = Translation(ChatCompletionRequest.model_construct(), origins)
        param = tr.rename(param_name(first["loc"], body, missing=first["type"] == "missing")
                          or "input")
        raise _bad(param, str(first["msg"])) from None
    return Translation(chat, origins)


__all__ = ["ResponsesRequest", "Translation", "to_chat"]
