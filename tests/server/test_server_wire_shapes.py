"""What the OpenAI- and Anthropic-compatible routes accept and write, against the vendors'
documented wire formats, over real HTTP on the session's fake engine (`conftest.fake_server`).

Bodies are read raw (httpx) where the question is which keys are there: the SDKs fill an absent
key with None and would hide it. Expected shapes are OpenAI's and Anthropic's API references,
written out by hand: a chat message's `content`, a choice's `logprobs` and `finish_reason` are
always there, null included; a tool's schema is a JSON Schema of an object; a tool result
answers a call; `thinking.type: "enabled"` needs `budget_tokens`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import llguidance
import openai
import pytest
from fake_backend import ByteTokenizer
from ftrs_server_harness import ServerProcess

from ftrs.models.tiny import tiny_tokenizer
from ftrs.server.anthropic_protocol import MessagesRequest, to_chat
from ftrs.server.metrics import ServerMetrics
from ftrs.server.protocol import ChatCompletionRequest, CompletionRequest, Usage
from ftrs.server.serving import ChoiceEvent
from ftrs.server.toolcalls import TOOL_PARSERS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _say(text: str) -> list[dict[str, Any]]:
    """Messages that make the fake engine answer `text` (fake_backend: `SAY:<text>`)."""
    return [{"role": "user", "content": f"SAY:{text}"}]


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)


def _chunks(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of an OpenAI stream's chunks, `[DONE]` left out."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      headers=server.headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ------------------------------------------------------------------ OpenAI: keys sent as null


def test_a_chat_answer_of_only_tool_calls_has_content_null(fake_server: ServerProcess) -> None:
    r = _post(fake_server, "/v1/chat/completions",
              {"model": "fake", "max_tokens": 200, "tools": [WEATHER], "messages": _say(CALL)})
    choice = r.json()["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
    assert (choice["logprobs"], choice["finish_reason"]) == (None, "tool_calls")
    message = choice["message"]
    assert set(message) == {"role", "content", "tool_calls"}  # no reasoning_content: null
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_a_chat_text_answer_has_openais_keys_and_no_others(fake_server: ServerProcess) -> None:
    r = _post(fake_server, "/v1/chat/completions",
              {"model": "fake", "max_tokens": 50, "tools": [WEATHER], "messages": _say("Sunny.")})
    body = r.json()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Sunny."}  # no tool_calls: null
    assert (choice["logprobs"], choice["finish_reason"]) == (None, "stop")
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                  "prompt_tokens_details"}


def test_chat_chunks_carry_finish_reason_null_until_the_last(fake_server: ServerProcess) -> None:
    chunks = _chunks(fake_server, "/v1/chat/completions",
                     {"model": "fake", "max_tokens": 200, "tools": [WEATHER],
                      "messages": _say("Let me look." + CALL)})
    choices = [c["choices"][0] for c in chunks]
    assert all(set(c) == {"index", "delta", "logprobs", "finish_reason"} for c in choices), choices
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert all(c["logprobs"] is None for c in choices)
    # a delta holds only what it adds: no null fields in it
    assert all(None not in c["delta"].values() for c in choices), choices
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(None not in t.values() and None not in t["function"].values()
               for c in choices for t in c["delta"].get("tool_calls", []))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_choices_carry_logprobs_and_finish_reason(fake_server: ServerProcess,
                                                             stream: bool) -> None:
    body = {"model": "fake", "prompt": "SAY:Hello there.", "max_tokens": 30}
    if stream:
        choices = [c["choices"][0] for c in _chunks(fake_server, "/v1/completions", body)]
    else:
        choices = _post(fake_server, "/v1/completions", body).json()["choices"]
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in choices), choices
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    assert "".join(c["text"] for c in choices) == "Hello there."


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_usage_is_null_on_every_chunk_but_the_last(fake_server: ServerProcess,
                                                            path: str) -> None:
    """With `stream_options.include_usage` OpenAI writes `usage: null` on every chunk and the
    counts on a last chunk without choices; without it, no chunk has the key."""
    body: dict[str, Any] = {"model": "fake", "max_tokens": 30}
    body.update({"messages": _say("Hello there.")} if "chat" in path
                else {"prompt": "SAY:Hello there."})
    chunks = _chunks(fake_server, path, {**body, "stream_options": {"include_usage": True}})
    assert len(chunks) >= 3
    assert all("usage" in c and c["usage"] is None and c["choices"] for c in chunks[:-1]), chunks
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0, last
    assert last["usage"]["total_tokens"] == (last["usage"]["prompt_tokens"]
                                             + last["usage"]["completion_tokens"])
    plain = _chunks(fake_server, path, body)
    assert plain and all("usage" not in c for c in plain), plain


class _Run:
    """A finished run of one choice for `responses.*_response`: its events, stamped `created`."""

    request_id, n, created = "chatcmpl-1", 1, 1_000

    def __init__(self, texts: list[str]) -> None:
        self._events = [ChoiceEvent(0, t, token_ids=[1]) for t in texts]
        self._events[-1].finish_reason = "stop"

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        async def gen() -> AsyncIterator[ChoiceEvent]:
            for e in self._events:
                yield e
        return gen()

    def usage(self) -> Usage:
        return Usage.of(3, len(self._events), 0)

    def finish_reason(self, index: int) -> str:
        return "stop"

    def calls(self, index: int) -> list[Any]:
        return []

    def token_ids(self, index: int) -> list[int]:
        return [1] * len(self._events)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("stream", [True, False])
def test_every_chunk_and_the_body_carry_the_runs_created(monkeypatch: pytest.MonkeyPatch,
                                                         chat: bool, stream: bool) -> None:
    """`created` is stamped once per request, as OpenAI's: each chunk built its own from the
    clock, so one stream that crossed a second changed its creation time."""
    import time

    from ftrs.server import responses

    ticks = iter(range(2_000, 3_000))
    monkeypatch.setattr(time, "time", lambda: float(next(ticks)))  # a second per reading
    ctx = SimpleNamespace(client=SimpleNamespace(tokenizer=ByteTokenizer()), metrics=ServerMetrics())
    body: dict[str, Any] = {"model": "fake", "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    run = _Run(["a", "b", "c"])
    if chat:
        req = ChatCompletionRequest.model_validate({**body, "messages": _say("abc")})
        resp = asyncio.run(responses.chat_response(ctx, req, run))  # type: ignore[arg-type]
    else:
        creq = CompletionRequest.model_validate({**body, "prompt": "abc"})
        resp = asyncio.run(responses.completion_response(ctx, creq, run))  # type: ignore[arg-type]
    if not stream:
        assert json.loads(bytes(resp.body))["created"] == 1_000
        return

    async def drain() -> list[str]:
        return [c if isinstance(c, str) else bytes(c).decode() async for c in resp.body_iterator]

    data = [c.removeprefix("data: ").strip() for c in asyncio.run(drain())]
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    assert len(chunks) >= 4  # (the role chunk,) three deltas, the usage chunk
    assert [c["created"] for c in chunks] == [1_000] * len(chunks), chunks


def test_one_streams_chunks_share_one_created_that_is_the_clocks(fake_server: ServerProcess) -> None:
    import time

    before = int(time.time())
    chunks = _chunks(fake_server, "/v1/chat/completions", {"model": "fake", "max_tokens": 30,
                                                           "messages": _say("Hello there.")})
    assert len({c["created"] for c in chunks}) == 1, chunks
    assert before <= chunks[0]["created"] <= time.time()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_body_that_is_not_utf8_is_an_openai_400_that_says_so(fake_server: ServerProcess,
                                                               path: str) -> None:
    """FastAPI answers such a body "There was an error parsing the body"; the client is told
    the body is not UTF-8, in OpenAI's error shape, and the server serves on."""
    body = b'{"model":"fake","max_tokens":2,"prompt":"caf\xe9","input":"caf\xe9"}'
    r = httpx.post(fake_server.url + path, content=body, timeout=30,
                   headers={**fake_server.headers, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_request"), err
    assert "not valid UTF-8" in err["message"], err
    assert _post(fake_server, "/v1/completions",
                 {"model": "fake", "prompt": "SAY:ok", "max_tokens": 5}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
@pytest.mark.parametrize("content, headers, says", [
    (b'{"model":"fake","max_tokens":2,"prompt":"hi"}',  # curl -d without -H
     {"content-type": "application/x-www-form-urlencoded"}, "not read as JSON"),
    (b"", {"content-type": "application/json"}, "has no body"),
    (b'["model"]', {"content-type": "application/json"}, "not a JSON object"),
])
def test_a_body_that_is_no_json_object_says_what_to_send(fake_server: ServerProcess, path: str,
                                                         content: bytes, headers: dict[str, str],
                                                         says: str) -> None:
    """Not pydantic's "Input should be a valid dictionary or object to extract fields from"
    nor a bare "field required": the client is told what the body must be."""
    r = httpx.post(fake_server.url + path, content=content, timeout=30,
                   headers={**fake_server.headers, **headers})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert says in message and "Content-Type: application/json" in message, message


# ------------------------------------------------------------ tools: an object schema, or none

_NOT_OBJECTS = [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                {"properties": {"city": {"type": "string"}}}, {"type": ["object", "null"]}]


@pytest.mark.parametrize("schema", _NOT_OBJECTS)
@pytest.mark.parametrize("choice", ["required", "auto", "none"])
def test_chat_tool_parameters_must_be_an_object_schema(client: Any, schema: dict[str, Any],
                                                       choice: str) -> None:
    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", max_tokens=4, messages=_say("x"),
                                       tools=tools, tool_choice=choice)
    assert e.value.body["param"] == "tools[1].function.parameters"  # type: ignore[index]
    assert 'type "object"' in e.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_input_schema_must_be_an_object_schema(fake_server: ServerProcess,
                                                        route: str) -> None:
    r = httpx.post(fake_server.url + route, headers={"x-api-key": str(fake_server.api_key)},
                   timeout=30, json={"model": "fake", "max_tokens": 4, "messages": _say("x"),
                                     "tools": [{"name": "f", "input_schema": {"type": "string"}}],
                                     "tool_choice": {"type": "any"}})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith("tools[0].input_schema:"), err


def test_responses_tool_parameters_must_be_an_object_schema(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="fake", input="x", tool_choice="required", tools=[
            {"type": "function", "name": "f", "parameters": {"type": "array", "items": {}}}])
    assert e.value.body["param"] == "tools[0].parameters"  # type: ignore[index]


@pytest.mark.parametrize("params", [{}, None])
def test_a_function_without_parameters_is_served(client: Any, params: Any) -> None:
    fn: dict[str, Any] = {"name": "now"} if params is None else {"name": "now", "parameters": params}
    r = client.chat.completions.create(model="fake", max_tokens=60, tool_choice="required",
                                       tools=[{"type": "function", "function": fn}],
                                       messages=_say('<tool_call>{"name": "now", "arguments": {}}</tool_call>'))
    assert r.choices[0].message.tool_calls[0].function.arguments == "{}"


@pytest.fixture(scope="module")
def lltok() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tiny_tokenizer(512).tk.to_str(), eos_token=2)


def _accepts(lltok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return bool(m.consume_tokens(lltok.tokenize_str(text))) and m.is_accepting()


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("params", [{}, None, {"type": "object", "properties": {}},
                                    {"type": "object", "properties": {}, "required": []}])
def test_a_forced_call_of_a_function_without_parameters_writes_empty_arguments(
        lltok: llguidance.LLTokenizer, parser: str, params: Any) -> None:
    """OpenAI's `parameters: {}` (or none), and Anthropic's object schema without properties,
    are a function without arguments: the forced grammar
    allows `{}` and nothing else, where an empty schema used to allow any JSON value, which the
    parser then refused (the "forced" call came back as text)."""
    fn: dict[str, Any] = {"name": "now"} if params is None else {"name": "now", "parameters": params}
    cls = TOOL_PARSERS[parser]
    grammar = cls.forced_grammar([{"type": "function", "function": fn}], "required", False)

    def written(args: dict[str, Any]) -> str:  # gpt-oss's <|call|> ends the turn: not forced
        return cls.format_calls([("now", args)]).removesuffix("<|call|>")

    assert _accepts(lltok, grammar, written({}))
    if parser not in ("glm45", "qwen3_coder", "minimax_m2"):  # their arguments are members
        assert not _accepts(lltok, grammar, written({"a": 1}))
        assert not _accepts(lltok, grammar, written({}).replace("{}", '"x"'))


# ------------------------------------------------------- chat: a tool result answers a call


@pytest.mark.parametrize(("result", "why"), [
    ({"role": "tool", "content": "18C"}, "required"),
    ({"role": "tool", "tool_call_id": "call_9", "content": "18C"}, "'call_9'"),
])
def test_a_tool_message_must_answer_an_earlier_call(client: Any, result: dict[str, Any],
                                                    why: str) -> None:
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", max_tokens=4, tools=[WEATHER],
                                       messages=[*history, result])
    assert e.value.body["param"] == "messages[2].tool_call_id"  # type: ignore[index]
    assert why in e.value.body["message"]  # type: ignore[index]
    early = [history[0], {"role": "tool", "tool_call_id": "call_1", "content": "18C"}, history[1]]
    with pytest.raises(openai.BadRequestError) as e:  # a result before its call answers nothing
        client.chat.completions.create(model="fake", max_tokens=4, tools=[WEATHER], messages=early)
    assert e.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]
    ok = client.chat.completions.create(model="fake", max_tokens=4, tools=[WEATHER], messages=[
        *history, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}])
    assert ok.choices[0].finish_reason is not None


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_only_a_tool_message_carries_a_tool_call_id(client: Any, role: str) -> None:
    """OpenAI refuses the key on any other message; it used to be dropped without a word."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", max_tokens=4, messages=[
            {"role": "user", "content": "hi"}, {"role": role, "content": "x", "tool_call_id": "c"}])
    assert e.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]


def test_chat_tool_call_ids_are_unique_and_answered_once(client: Any) -> None:
    """Within a turn, as /v1/messages: two calls with one id, or two results for one call, are
    refused (Messages also refuses an id reused by a later turn; chat does not, see below)."""
    def call(cid: str) -> dict[str, Any]:
        return {"id": cid, "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

    def result(cid: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": cid, "content": "18C"}

    user = {"role": "user", "content": "Weather?"}
    cases = {
        "messages[1].tool_calls[1].id": [user, {"role": "assistant", "content": None,
                                                "tool_calls": [call("a"), call("a")]}, result("a")],
        "messages[3].tool_call_id": [user, {"role": "assistant", "content": None,
                                            "tool_calls": [call("a"), call("b")]},
                                     result("a"), result("a")],
    }
    for param, messages in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="fake", max_tokens=4, tools=[WEATHER],
                                           messages=messages)
        assert e.value.body["param"] == param  # type: ignore[index]
    # an id a later turn reuses (servers that number calls per turn: call_0 each time) is a new
    # call: answered again, not refused
    again = [user, {"role": "assistant", "content": None, "tool_calls": [call("a")]}, result("a"),
             {"role": "assistant", "content": None, "tool_calls": [call("a")]}, result("a")]
    ok = client.chat.completions.create(model="fake", max_tokens=4, messages=again)
    assert ok.choices[0].finish_reason is not None


# ---------------------------------------------------------------- Responses: stream = body


@pytest.mark.parametrize(("answer", "limit", "announced"), [
    ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}, }</tool_call>',
     200, True),  # malformed after its arguments began
    ('Sure.<tool_call>{"name": "get_weather", "arguments": 5}</tool_call>', 200,
     False),  # arguments not an object: never announced
    ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris, France"}}</tool_call>',
     len('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Par'), True),  # cut
], ids=["malformed", "not-an-object", "cut"])
def test_the_streamed_final_response_is_the_body(client: Any, answer: str, limit: int | None,
                                                 announced: bool) -> None:
    """A call streamed as an item but then refused by the parser (or cut by the output limit)
    is not in the body: nor in the response of the stream's last event, which the SDK returns.
    A call whose arguments are not an object is not streamed at all."""
    tool = {"type": "function", **WEATHER["function"]}
    kw: dict[str, Any] = {"model": "fake", "input": f"SAY:{answer}", "tools": [tool],
                          "max_output_tokens": limit}

    def items(response: Any) -> list[tuple[Any, ...]]:
        return [(i.type, i.status, getattr(i, "name", None),
                 [p.text for p in getattr(i, "content", None) or []]) for i in response.output]

    body = client.responses.create(**kw)
    assert "function_call" not in [i.type for i in body.output]
    assert body.status == ("completed" if limit == 200 else "incomplete")
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        if body.status == "completed":
            assert items(stream.get_final_response()) == items(body)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert ("function_call" in added) == announced  # streamed before it was refused, or not
    final = events[-1].response
    assert (events[-1].type, final.status) == (f"response.{body.status}", body.status)
    assert items(final) == items(body)


# ------------------------------------------------------------------- Anthropic Messages API


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_body_that_is_not_utf8_is_an_anthropic_400(fake_server: ServerProcess,
                                                     route: str) -> None:
    body = b'{"model":"fake","max_tokens":2,"messages":[{"role":"user","content":"caf\xe9"}]}'
    r = httpx.post(fake_server.url + route, content=body, timeout=30,
                   headers={"x-api-key": str(fake_server.api_key), "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": r.json()["error"]["message"]}}
    assert "UTF-8" in r.json()["error"]["message"]
    ok = anthropic.Anthropic(base_url=fake_server.url, api_key=fake_server.api_key, max_retries=0)
    assert ok.messages.create(model="fake", max_tokens=1, messages=_say("x")).usage.output_tokens == 1


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_enabled_thinking_needs_budget_tokens(fake_server: ServerProcess, route: str) -> None:
    base = {"model": "fake", "max_tokens": 8, "messages": _say("x")}
    headers = {"x-api-key": str(fake_server.api_key)}
    r = httpx.post(fake_server.url + route, headers=headers, timeout=30,
                   json={**base, "thinking": {"type": "enabled"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("thinking.budget_tokens:"), err
    r = httpx.post(fake_server.url + route, headers=headers, timeout=30,
                   json={**base, "thinking": {"type": "bogus"}})
    assert r.status_code == 400 and "thinking.type" in r.json()["error"]["message"], r.text
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"},
                     {"type": "disabled"}):
        r = httpx.post(fake_server.url + route, headers=headers, timeout=30,
                       json={**base, "thinking": thinking})
        assert r.status_code == 200, (thinking, r.text)


def test_enabled_thinking_budget_becomes_the_chat_budget() -> None:
    def chat(thinking: dict[str, Any]) -> Any:
        return to_chat(MessagesRequest.model_validate({
            "model": "m", "max_tokens": 4096, "thinking": thinking,
            "messages": [{"role": "user", "content": "hi"}]})).chat

    assert chat({"type": "enabled", "budget_tokens": 2048}).thinking_token_budget == 2048
    assert chat({"type": "adaptive"}).thinking_token_budget is None


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_forced_call_follows_a_schema_with_local_references(
        lltok: llguidance.LLTokenizer, parser: str) -> None:
    """A tool schema as pydantic writes it (`$defs` and `#/$defs/...` references, and a
    recursive `#`) is forced as itself: the call object wraps it, so its references are
    rebased, and they resolve as in the tool's own schema."""
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
            "required": ["name"], "additionalProperties": False}
    fn = {"name": "go", "parameters": {
        "type": "object", "$defs": {"City": city},
        "properties": {"to": {"$ref": "#/$defs/City"},
                       "via": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["to", "via"], "additionalProperties": False}}
    other = {"name": "stop", "parameters": {}}
    cls = TOOL_PARSERS[parser]
    for tools in ([fn], [other, fn]):
        grammar = cls.forced_grammar([{"type": "function", "function": f} for f in tools],
                                     "required", False)

        def written(args: dict[str, Any]) -> str:
            return cls.format_calls([("go", args)]).removesuffix("<|call|>")

        good = {"to": {"name": "Oslo"}, "via": {"to": {"name": "Rome"}, "via": None}}
        assert _accepts(lltok, grammar, written(good)), (parser, len(tools))
        assert not _accepts(lltok, grammar, written({"to": {"name": 5}, "via": None}))


def test_history_arguments_nested_past_the_decoders_stack_are_a_400(fake_server: Any) -> None:
    """Arguments nested 5000 deep raised RecursionError in json.loads: a 500 that dropped the
    connection. They are a 400 naming the field, on chat and Responses, and the server serves."""
    deep = "[" * 5000 + "]" * 5000
    chat = {"model": "fake", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}
    responses = {"model": "fake", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]}
    headers = {"authorization": f"Bearer {fake_server.api_key}"}
    with httpx.Client(base_url=fake_server.url, headers=headers, timeout=30) as http:
        for path, body in (("/v1/chat/completions", chat), ("/v1/responses", responses)):
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "nested too deeply" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 200
