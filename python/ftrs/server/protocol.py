"""Pydantic models of the OpenAI HTTP protocol, the subset ftrs serves.

Requests validate types strictly: `"stream": "yes"`, `"max_tokens": true` or a prompt of
`[true, false]` are 400s, not coerced. Every string a request carries must be valid Unicode
(`Text`): a lone surrogate such as `"a\\udc80b"` is refused with the field's name instead of
failing later in the tokenizer or the JSON encoder. Value checks (max_tokens >= 1, temperature
in [0, 2], ...) live in `SamplingParams.validate` so the server and `ftrs.LLM` refuse the same
things with the same words. Fields the server does not act on yet but that would change the
output (`functions`, `audio`, ...) are declared loosely here and refused in `prepare.py` with
their name; unknown fields are ignored, as the OpenAI API does for forward
compatibility. Responses are plain models written as OpenAI writes them: the keys OpenAI always
sends are there, null included (a message's `content`, a choice's `logprobs` and
`finish_reason`), the other optional ones only when set (`_if_set`: `tool_calls`,
`reasoning_content`, a delta's fields); `token_ids` on a choice is an ftrs extension, filled
only when the request sets `return_token_ids`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    model_validator,
)


def new_id(prefix: str) -> str:
    """An OpenAI-looking id: `cmpl-<hex>` or `chatcmpl-<hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _valid_unicode(value: str) -> str:
    """Refuse lone surrogates (U+D800..U+DFFF), which JSON escapes can carry but UTF-8 cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate at character {exc.start}") from None
    return value


def lone_surrogate_at(value: Any, at: str = "") -> str | None:
    """Where the first string of a JSON value (keys included) that is not valid Unicode is
    (`.properties.city`, `a key at .properties`), or None when every one is."""
    if isinstance(value, str):
        return None if _encodes(value) else f"the string at {at or '.'}"
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and not _encodes(k):
                return f"a key at {at or '.'}"
            found = lone_surrogate_at(v, f"{at}.{k}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate_at(v, f"{at}[{i}]")
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _valid_json(value: Any) -> Any:
    """A JSON value carried as it is (a schema, tool arguments, template variables): every
    string in it, keys included, must be valid Unicode too."""
    where = lone_surrogate_at(value)
    if where is not None:
        raise ValueError(f"invalid Unicode: a lone surrogate in {where}")
    return value


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
#: a JSON object or value passed through as it is, with every string in it valid Unicode
JsonObject = Annotated[dict[str, Any], AfterValidator(_valid_json)]
JsonValue = Annotated[Any, AfterValidator(_valid_json)]
TokenIds = list[StrictInt]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingFields(_Request):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: Text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: JsonObject | None = None  # refused unless empty
    user: Text | None = None
    # Extensions understood by vLLM-style clients.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = False
    # ftrs extension: return the generated token ids on each choice.
    return_token_ids: bool | None = False


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: Text | None = None
    best_of: int | None = None


class ContentPart(_Request):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served."""

    type: Text
    text: Text | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs a `text` string")
        return self


class FunctionCall(_Request):
    """A call an assistant turn made; `arguments` is JSON text (OpenAI) or an object."""

    name: Text
    arguments: Text | JsonObject


class MessageToolCall(_Request):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: Text | None = None  # tool turns: the call this result answers
    reasoning_content: Text | None = None  # an earlier answer's reasoning (templates may show it)

    def text(self) -> str:
        """The message content as one string; non-text parts are refused by the caller."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")

    def has_non_text_parts(self) -> bool:
        return isinstance(self.content, list) and any(p.type != "text" for p in self.content)


class FunctionDefinition(_Request):
    name: Text = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    """`{"type": "function", "function": {"name": ...}}`: the model must call this tool."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: Text | None = None
    description: Text | None = None
    schema_: JsonObject | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # default true
    response_format: ResponseFormat | None = None
    chat_template_kwargs: JsonObject | None = None  # extension: extra template variables
    # the template's `reasoning_effort` (gpt-oss reads it) unless chat_template_kwargs sets it
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # extension (vLLM's name): at most so many reasoning tokens, then the block is closed
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # extension: the last message is an assistant turn to continue (a prefill), not a finished one
    continue_final_message: bool | None = None
    # Declared so they are refused by name (serving.py) rather than silently ignored.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[Text] | None = None


# ---------------------------------------------------------------------------------- responses


def _is_none(value: Any) -> bool:
    return value is None


def _if_set() -> Any:
    """A response field written only when it is set. The others are written always, null
    included: the keys OpenAI always sends (a message's `content`, a choice's `logprobs` and
    `finish_reason`, streamed chunks' too)."""
    return Field(default=None, exclude_if=_is_none)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = _if_set()

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # null on the chunks before the last
    token_ids: list[int] | None = _if_set()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _if_set()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = _if_set()


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunction(BaseModel):
    name: str | None = _if_set()
    arguments: str | None = _if_set()


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: `index` is stable; `id`, `type` and the name come on
    the call's first piece, argument text on the later ones."""

    index: int
    id: str | None = _if_set()
    type: Literal["function"] | None = _if_set()
    function: ResponseFunction


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None  # null when the answer is only tool calls
    reasoning_content: str | None = _if_set()
    tool_calls: list[ResponseToolCall] | None = _if_set()


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _if_set()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = _if_set()


class ChatDelta(BaseModel):
    """What a chunk adds; only the fields it adds are written (`{}` on a last chunk)."""

    role: str | None = _if_set()
    content: str | None = _if_set()
    reasoning_content: str | None = _if_set()
    tool_calls: list[DeltaToolCall] | None = _if_set()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None  # null on the chunks before the last
    token_ids: list[int] | None = _if_set()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _if_set()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "ftrs"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "DeltaToolCall",
    "ErrorBody",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDefinition",
    "JsonObject",
    "JsonSchemaFormat",
    "JsonValue",
    "MessageToolCall",
    "ModelCard",
    "ModelList",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "ResponseFunction",
    "ResponseToolCall",
    "StreamOptions",
    "Tool",
    "TopLogprob",
    "Usage",
    "lone_surrogate_at",
    "new_id",
]
