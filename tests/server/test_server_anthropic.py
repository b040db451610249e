"""The Anthropic Messages API: translation to the chat path, the content-block encoder, and the
routes against live servers with the official `anthropic` client.

Expected values come from Anthropic's documented wire format (written out by hand here) and
from the `anthropic` SDK, which parses the events and errors independently of ftrs.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from ftrs_server_harness import ServerProcess

from ftrs.errors import InvalidRequest
from ftrs.server.anthropic import BlockEncoder, error_type
from ftrs.server.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat
from ftrs.server.serving import ChoiceEvent
from ftrs.server.toolcalls import ToolCall, ToolCallDelta

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def _req(**kw: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}
    return MessagesRequest.model_validate(body)


# ------------------------------------------------------------------------------- translation


def test_history_with_tools_becomes_the_openai_shaped_chat() -> None:
    tr = to_chat(_req(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call the tool", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.3, top_p=0.9, top_k=5, metadata={"user_id": "u"}))
    chat = tr.chat.model_dump(exclude_none=True)
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[0]["content"] == "Be brief.\nUse tools."
    assert msgs[2]["content"] == "Let me look."
    assert msgs[2]["reasoning_content"] == "I should call the tool"  # the thinking block's text
    call = msgs[2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert msgs[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}
    assert msgs[4]["content"] == "And tomorrow?"
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER["input_schema"]}}]
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["temperature"], chat["top_p"], chat["top_k"], chat["max_tokens"]) == (
        ["END"], 0.3, 0.9, 5, 8)
    assert tr.origins == ["system", "messages[0].content", "messages[1].content",
                          "messages[2].content[0]", "messages[2].content"]


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"),
    ({"type": "none"}, "none"),
    ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice_maps_to_openai(choice: dict[str, Any], expected: Any) -> None:
    chat = to_chat(_req(tools=[WEATHER], tool_choice=choice)).chat
    assert chat.model_dump(exclude_none=True)["tool_choice"] == expected


_USE_T = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
_RESULT_T = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]}


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "a"}, _USE_T, _RESULT_T, _USE_T]},
     "messages[3].content[0].id"),  # tool_use ids are unique
    ({"messages": [{"role": "user", "content": "a"}, _USE_T,
                   {"role": "user", "content": [*_RESULT_T["content"], *_RESULT_T["content"]]}]},
     "messages[2].content[1].tool_use_id"),  # a call is answered once
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {"x": "a\udc80"}}]}]}, "messages[1].content"),
    # Anthropic: every message has content but an optional final assistant one
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                   {"role": "user", "content": "b"}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": " \n"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": ""}]}]},
     "messages[0].content[1].text"),
])
def test_bad_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        to_chat(_req(**fields))
    assert info.value.evidence["param"] == param
    assert info.value.message.startswith(f"{param}: ")


def test_errors_of_the_chat_path_name_the_messages_fields() -> None:
    tr = to_chat(_req(system="s", tools=[WEATHER], messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]))
    assert tr.rename("messages[3].content") == "messages[2].content[0]"
    assert tr.rename("messages[2].tool_calls[0].function.arguments") == "messages[1].content"
    assert tr.rename("messages[0]") == "system"
    assert tr.rename("tools[0].function.parameters") == "tools[0].input_schema"
    assert tr.rename("stop") == "stop_sequences"
    assert tr.rename("stop[1]") == "stop_sequences[1]"
    assert tr.rename("top_k") == "top_k"


def test_output_format_and_thinking_reach_the_chat_request() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = to_chat(_req(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
                        thinking={"type": "disabled"})).chat.model_dump(exclude_none=True, by_alias=True)
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["reasoning_effort"] == "low"
    assert to_chat(_req(output_config={"effort": "max"})).chat.reasoning_effort == "high"
    assert to_chat(_req(output_config={"effort": "unheard-of"})).chat.reasoning_effort is None
    adaptive = to_chat(_req(thinking={"type": "adaptive"})).chat
    assert adaptive.chat_template_kwargs == {"enable_thinking": True}
    assert to_chat(_req()).chat.chat_template_kwargs is None


def test_count_tokens_body_needs_no_max_tokens_and_translates_the_same() -> None:
    body = {"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    counted = to_chat(CountTokensRequest.model_validate(body)).chat
    generated = to_chat(MessagesRequest.model_validate({**body, "max_tokens": 3})).chat
    assert counted.messages == generated.messages and counted.tools == generated.tools


def test_error_types_follow_anthropic() -> None:
    assert [error_type(s) for s in (400, 401, 404, 413, 500, 503)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
        "api_error", "overloaded_error"]


def test_openapi_documents_the_anthropic_error_shape_on_its_routes_only() -> None:
    from ftrs.server.app import ServeSettings, create_app

    doc = create_app(ServeSettings()).openapi()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses
        for status in ("400", "401", "404", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


# ----------------------------------------------------------------------------------- encoder


def _events() -> list[ChoiceEvent]:
    return [
        ChoiceEvent(0, reasoning="Think"),
        ChoiceEvent(0, reasoning=" more", text="Hello"),
        ChoiceEvent(0, text=" world", tool_calls=[ToolCallDelta(0, "call_a", "get_weather", '{"ci')]),
        ChoiceEvent(0, tool_calls=[ToolCallDelta(0, None, None, 'ty": "Paris"}')]),
        ChoiceEvent(0, tool_calls=[ToolCallDelta(1, "call_b", "get_weather", '{"city": "Rome"}')],
                    finish_reason="tool_calls"),
    ]


def test_encoder_emits_one_block_at_a_time_in_anthropic_order() -> None:
    enc = BlockEncoder()
    out = [ev for e in _events() for ev in enc.feed(e)] + enc.close()
    start = {"type": "content_block_start"}
    assert out == [
        {**start, "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Think"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": " more"}},
        {"type": "content_block_stop", "index": 0},
        {**start, "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hello"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " world"}},
        {"type": "content_block_stop", "index": 1},
        {**start, "index": 2, "content_block": {"type": "tool_use", "id": "call_a", "name": "get_weather",
                                                "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"ci'}},
        {"type": "content_block_delta", "index": 2,
         "delta": {"type": "input_json_delta", "partial_json": 'ty": "Paris"}'}},
        {"type": "content_block_stop", "index": 2},
        {**start, "index": 3, "content_block": {"type": "tool_use", "id": "call_b", "name": "get_weather",
                                                "input": {}}},
        {"type": "content_block_delta", "index": 3,
         "delta": {"type": "input_json_delta", "partial_json": '{"city": "Rome"}'}},
        {"type": "content_block_stop", "index": 3},
    ]
    assert enc.content == [
        {"type": "thinking", "thinking": "Think more", "signature": ""},
        {"type": "text", "text": "Hello world"},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_b", "name": "get_weather", "input": {"city": "Rome"}},
    ]


def test_the_sdk_accumulates_the_encoder_events_into_the_same_content() -> None:
    from anthropic.lib.streaming._messages import accumulate_event

    enc = BlockEncoder()
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}}
    events = [start, *(ev for e in _events() for ev in enc.feed(e)), *enc.close()]
    snapshot = None
    bufs: dict[int, bytes] = {}
    for ev in events:
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == enc.content


def test_non_stream_keeps_only_complete_calls() -> None:
    enc = BlockEncoder()
    enc.feed(ChoiceEvent(0, tool_calls=[ToolCallDelta(0, "call_bad", "f", '{"a": ')]))
    enc.feed(ChoiceEvent(0, text="<tool_call>raw</tool_call>"))
    enc.feed(ChoiceEvent(0, tool_calls=[ToolCallDelta(1, "call_ok", "f", '{"a": 1}')]))
    enc.close()
    enc.keep_calls([ToolCall("call_ok", "f", '{"a": 1}')])
    assert enc.content == [{"type": "text", "text": "<tool_call>raw</tool_call>"},
                           {"type": "tool_use", "id": "call_ok", "name": "f", "input": {"a": 1}}]


# ------------------------------------------------------------------------ live: tiny model

TINY_KEY = "anthropic-test-key"
LIVE_OPTIONS = ["--device", "cpu", "--dtype", "float32"]
FORECAST = {"name": "forecast", "description": "Weather forecast for a city",
            "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                             "properties": {"city": {"type": "string", "maxLength": 12},
                                            "metric": {"type": "boolean"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from ftrs.models.tiny import make_tiny

    model = make_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)
    server = ServerProcess(["--model", str(model), "--served-model-name", "tiny", *LIVE_OPTIONS],
                           api_key=TINY_KEY, backend=None)
    try:
        server.wait("ok")
        server.model_dir = model
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def demo_server() -> Any:
    from ftrs.models.demo import demo_dir

    if not (demo_dir() / ".complete").is_file():
        pytest.skip("the demo model is not built (`ftrs models demo`)")
    server = ServerProcess(["--model", str(demo_dir()), "--served-model-name", "demo", *LIVE_OPTIONS],
                           api_key=TINY_KEY, backend=None)
    try:
        server.wait("ok", timeout=600)
        yield server
    finally:
        server.stop()


def _anthropic(server: Any, **kw: Any) -> Any:
    return anthropic.Anthropic(base_url=server.url, **{"api_key": TINY_KEY, **kw}, max_retries=0, timeout=60)


def _expected_prompt_ids(model_dir: Any, system: str, user: str) -> list[int]:
    """The ChatML prompt of the tiny model, written out by hand, through its tokenizer."""
    from ftrs.models.tokenizer import Tokenizer

    text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return list(Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False))


def _block_order_ok(types: list[str]) -> bool:
    """message_start, pings, (content_block_start, deltas, content_block_stop)*, message_delta,
    message_stop: Anthropic's documented order."""
    types = [t for t in types if t != "ping"]
    if types[:1] != ["message_start"] or types[-2:] != ["message_delta", "message_stop"]:
        return False
    body, open_block = types[1:-2], False
    for t in body:
        if t == "content_block_start" and not open_block:
            open_block = True
        elif t == "content_block_delta" and open_block:
            pass
        elif t == "content_block_stop" and open_block:
            open_block = False
        else:
            return False
    return not open_block


def test_text_message_stream_and_not_agree_with_usage(tiny_server: Any) -> None:
    client = _anthropic(tiny_server)
    system, user = "You are terse.", "Hello, tiny model"
    args: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "extra_body": {"temperature": 0}, "system": system,
                            "messages": [{"role": "user", "content": user}]}
    full = client.messages.create(**args)
    expected_input = len(_expected_prompt_ids(tiny_server.model_dir, system, user))
    assert full.id.startswith("msg_") and full.type == "message" and full.role == "assistant"
    assert full.model == "tiny"
    assert full.usage.input_tokens == expected_input
    assert 1 <= full.usage.output_tokens <= 12
    assert full.stop_reason == ("max_tokens" if full.usage.output_tokens == 12 else "end_turn")
    text = "".join(b.text for b in full.content if b.type == "text")

    events = list(client.messages.create(**args, stream=True))
    types = [e.type for e in events]
    assert _block_order_ok(types), types
    assert events[0].message.usage.input_tokens == expected_input
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens == full.usage.output_tokens
    assert delta.delta.stop_reason == full.stop_reason

    oa = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=TINY_KEY, max_retries=0)
    chat = oa.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": user}])
    assert chat.choices[0].message.content == text  # the same generation through either API


def test_count_tokens_equals_the_input_tokens_then_reported(tiny_server: Any) -> None:
    client = _anthropic(tiny_server)
    args: dict[str, Any] = {
        "model": "tiny", "system": [{"type": "text", "text": "Use the tools."}], "tools": [FORECAST],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "forecast",
                                               "input": {"city": "Oslo", "days": 2}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "rain"},
                                         {"type": "text", "text": "Thanks."}]}]}
    counted = client.messages.count_tokens(**args).input_tokens
    ran = client.messages.create(**args, max_tokens=2)
    assert counted == ran.usage.input_tokens
    plain = client.messages.count_tokens(model="tiny", system="Use the tools.",
                                         messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert plain.input_tokens == len(_expected_prompt_ids(tiny_server.model_dir, "Use the tools.",
                                                          "Weather in Oslo?"))
    assert counted > plain.input_tokens  # the tools and the tool turns are in the prompt


def _check_forced_tool(client: Any, model: str, **extra: Any) -> None:
    """A tool forced by name: one tool_use block whose input validates against input_schema, in
    the body and in the stream (whose input_json_delta pieces join to the same input)."""
    args: dict[str, Any] = {"model": model, "max_tokens": 200, "tools": [FORECAST],
                            "tool_choice": {"type": "tool", "name": "forecast", "disable_parallel_tool_use": True},
                            "messages": [{"role": "user", "content": "Weather in Oslo for 3 days?"}], **extra}
    msg = client.messages.create(**args)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use", msg
    assert len(uses) == 1 and uses[0].name == "forecast", msg
    jsonschema.validate(uses[0].input, FORECAST["input_schema"])

    with client.messages.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [e.type for e in events if e.type in (
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop", "ping")]
    assert _block_order_ok(types), types
    pieces: dict[int, list[str]] = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            pieces.setdefault(e.index, []).append(e.delta.partial_json)
    tool_blocks = {i: b for i, b in enumerate(final.content) if b.type == "tool_use"}
    assert len(tool_blocks) == 1 and set(pieces) == set(tool_blocks)
    for i, block in tool_blocks.items():
        joined = json.loads("".join(pieces[i]))
        jsonschema.validate(joined, FORECAST["input_schema"])
        assert joined == block.input
    assert final.stop_reason == "tool_use"


def test_forced_tool_returns_tool_use_whose_input_validates(tiny_server: Any) -> None:
    _check_forced_tool(_anthropic(tiny_server), "tiny")


@pytest.mark.slow
def test_demo_forced_tool_and_text_stream(demo_server: Any) -> None:
    client = _anthropic(demo_server)
    _check_forced_tool(client, "demo", extra_body={"temperature": 0.7})
    events = list(client.messages.create(model="demo", max_tokens=16, stream=True,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}]))
    assert _block_order_ok([e.type for e in events])
    counted = client.messages.count_tokens(model="demo", messages=[
        {"role": "user", "content": "What is the capital of France?"}]).input_tokens
    assert events[0].message.usage.input_tokens == counted
    assert next(e for e in events if e.type == "message_delta").usage.output_tokens >= 1


def test_x_api_key_and_bearer_are_accepted_a_wrong_key_is_refused(tiny_server: Any) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert _anthropic(tiny_server).messages.create(**body).usage.output_tokens == 1
    bearer = anthropic.Anthropic(base_url=tiny_server.url, auth_token=TINY_KEY, max_retries=0)
    assert bearer.messages.create(**body).usage.output_tokens == 1
    for client in (_anthropic(tiny_server, api_key="wrong"),
                   anthropic.Anthropic(base_url=tiny_server.url, auth_token="wrong", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(**body)
        body_seen: Any = info.value.body
        assert info.value.status_code == 401
        assert body_seen["type"] == "error" and body_seen["error"]["type"] == "authentication_error"
    r = httpx.post(tiny_server.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("body", "status", "kind", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "messages[0].content"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 4, "top_k": -1, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "top_k"),
    ({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": "lots"},
      "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "thinking.budget_tokens"),
    ({"max_tokens": 4, "tools": [{"name": "get weather", "input_schema": {"type": "object"}}],
      "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "tools[0].name"),
    ({"max_tokens": 4, "tools": [{"name": "f", "input_schema": {"type": "bogus"}}],
      "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "tools[0].input_schema"),
    ({"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, 404,
     "not_found_error", "model"),
])
def test_bad_requests_get_anthropic_errors_and_the_server_keeps_serving(
        tiny_server: Any, body: dict[str, Any], status: int, kind: str, param: str) -> None:
    r = httpx.post(tiny_server.url + "/v1/messages", json={"model": "tiny", **body},
                   headers={"x-api-key": TINY_KEY}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == kind and param in err["error"]["message"], err
    ok = _anthropic(tiny_server).messages.create(model="tiny", max_tokens=1,
                                                  messages=[{"role": "user", "content": "still there?"}])
    assert ok.usage.output_tokens == 1


def test_openai_routes_keep_their_error_shape(tiny_server: Any) -> None:
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []},
                   headers={"x-api-key": TINY_KEY}, timeout=30)
    assert r.status_code == 401 and set(r.json()) == {"error"}  # x-api-key is for /v1/messages only
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json={"model": "tiny"},
                   headers={"Authorization": f"Bearer {TINY_KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------ live: fake engine


def test_stop_sequence_is_reported_stream_and_not(fake_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=fake_server.url, api_key=fake_server.api_key, max_retries=0)
    args: dict[str, Any] = {"model": "fake", "extra_body": {"temperature": 0},
                            "messages": [{"role": "user", "content": "stop sequences"}]}
    full = "".join(b.text for b in client.messages.create(**args, max_tokens=60).content)
    stop = next(w for w in ("fox", "quick", "Hello", "wörld") if w in full[1:])
    cut = full[: full.index(stop)]
    msg = client.messages.create(**args, max_tokens=60, stop_sequences=["never-there", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in msg.content) == cut
    events = list(client.messages.create(**args, max_tokens=60, stop_sequences=[stop], stream=True))
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", stop)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == cut
    short = client.messages.create(**args, max_tokens=full.index(stop) // 4, stop_sequences=[stop])
    assert (short.stop_reason, short.stop_sequence) == ("max_tokens", None)


def test_an_error_after_the_stream_started_is_an_error_event() -> None:
    server = ServerProcess(["--model", "fake"], api_key=None)
    try:
        server.wait("ok")
        victim = {"model": "fake", "max_tokens": 300, "stream": True,
                  "messages": [{"role": "user", "content": "a long answer"}]}
        with httpx.stream("POST", server.url + "/v1/messages", json=victim, timeout=30) as stream:
            lines = stream.iter_lines()
            first = [next(lines) for _ in range(2)]
            r = httpx.post(server.url + "/v1/messages", timeout=30, json={
                "model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "__die__"}]})
            rest = list(lines)
        assert first[0] == "event: message_start"
        events = [line.removeprefix("event: ") for line in first + rest if line.startswith("event: ")]
        assert events[-1] == "error" and "message_stop" not in events
        data = json.loads(next(line for line in reversed(rest) if line.startswith("data: "))[6:])
        assert data["type"] == "error" and data["error"]["type"] == "overloaded_error"
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        server.stop()


def test_a_body_over_the_cap_is_a_413_in_each_routes_shape(fake_server: ServerProcess) -> None:
    big = {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    r = httpx.post(fake_server.url + "/v1/messages", json=big, headers=fake_server.headers, timeout=60)
    assert r.status_code == 413
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(fake_server.url + "/v1/chat/completions", json=big, headers=fake_server.headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def _say(text: str) -> list[dict[str, Any]]:
    """Messages that make the fake engine answer `text` (fake_backend: `SAY:<text>`)."""
    return [{"role": "user", "content": f"SAY:{text}"}]


def _blocks(content: list[Any]) -> list[dict[str, Any]]:
    """Content blocks without their ids (random per answer) and the SDK's empty fields."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in content]


def test_text_and_tool_use_blocks_from_the_output_and_back(fake_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=fake_server.url, api_key=fake_server.api_key, max_retries=0)
    out = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    args: dict[str, Any] = {"model": "fake", "max_tokens": 120, "tools": [WEATHER], "messages": _say(out)}
    msg = client.messages.create(**args)
    assert msg.stop_reason == "tool_use"
    assert _blocks(msg.content) == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}}]
    with client.messages.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text", "tool_use"]
    pieces = "".join(e.delta.partial_json for e in events
                     if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(pieces) == {"city": "Paris"}
    assert _blocks(final.content) == _blocks(msg.content) and final.stop_reason == "tool_use"
    # The answer goes back as history with a tool_result for its tool_use.
    use = msg.content[1]
    history: Any = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}]}]
    again = client.messages.create(model="fake", max_tokens=4, messages=history)
    counted = client.messages.count_tokens(model="fake", messages=history)
    assert again.usage.input_tokens == counted.input_tokens
    short = client.messages.count_tokens(model="fake", messages=history[:1]).input_tokens
    assert counted.input_tokens > short + len("Let me check.18C")  # the turns are in the prompt


def test_reasoning_becomes_a_thinking_block() -> None:
    server = ServerProcess(["--model", "fake", "--reasoning-parser", "qwen3"], api_key=None)
    try:
        server.wait("ok")
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        args: dict[str, Any] = {"model": "fake", "max_tokens": 100,
                                "messages": _say("<think>Paris is in France.</think>It is sunny.")}
        msg = client.messages.create(**args)
        assert _blocks(msg.content) == [{"type": "thinking", "thinking": "Paris is in France.", "signature": ""},
                                        {"type": "text", "text": "It is sunny."}]
        events = list(client.messages.create(**args, stream=True))
        assert _block_order_ok([e.type for e in events])
        deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
        assert {d for d in deltas} == {(0, "thinking_delta"), (1, "text_delta")}
        assert "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta") == "Paris is in France."
    finally:
        server.stop()


def test_a_final_assistant_turn_is_a_prefill_the_answer_continues() -> None:
    prefill = _req(messages=[{"role": "user", "content": "JSON please"},
                             {"role": "assistant", "content": [{"type": "text", "text": "{\"a\":"}]}])
    assert to_chat(prefill).chat.continue_final_message is True
    assert not to_chat(_req()).chat.continue_final_message  # ends with the user: a new turn


_KEY_IN_SCHEMA = {"tools": [{"name": "f", "input_schema": {
    "type": "object", "properties": {"a\udc80": {"type": "string"}}}}]}
_VALUE_IN_SCHEMA = {"tools": [{"name": "f", "input_schema": {"type": "object", "description": "x\udc80"}}],
                    "tool_choice": {"type": "any"}}


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("/v1/messages", _KEY_IN_SCHEMA, "tools[0].input_schema"),
    ("/v1/messages/count_tokens", _KEY_IN_SCHEMA, "tools[0].input_schema"),
    ("/v1/messages", _VALUE_IN_SCHEMA, "tools[0].input_schema"),
    ("/v1/messages/count_tokens", _VALUE_IN_SCHEMA, "tools[0].input_schema"),
    ("/v1/messages", {"metadata": {"user_id": "\udc80"}}, "metadata"),  # count_tokens has none
])
def test_a_lone_surrogate_anywhere_in_the_json_is_a_400(
        tiny_server: Any, route: str, extra: dict[str, Any], param: str) -> None:
    """Sent as the escape `\\udc80` (httpx refuses to encode one): not a 500 from the
    tokenizer, a 400 naming the field that carries it."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            **extra}
    r = httpx.post(tiny_server.url + route, content=json.dumps(body).encode(), timeout=30,
                   headers={"x-api-key": TINY_KEY, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in err["message"], err


def test_only_a_final_assistant_message_may_be_empty() -> None:
    body = to_chat(_req(messages=[{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": ""}])).chat
    assert [m.role for m in body.messages] == ["user", "assistant"]
