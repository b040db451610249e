"""The Responses API: its translation into the chat request (items, tools, formats, the fields
errors name), and real HTTP on loopback with the official `openai` client on the fake engine:
the answer's items whole and streamed (the SDK's own stream accumulator agrees with the body),
reasoning and function calls, `max_output_tokens`, and the 400s of a stateless server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from ftrs.errors import InvalidRequest
from ftrs.server.responses_api_protocol import ResponsesRequest, to_chat

TOOL = {"type": "function", "name": "w", "description": "Weather",
        "parameters": {"type": "object", "properties": {"d": {"type": "integer"}}}}


def _chat(**body: Any) -> dict[str, Any]:
    req = ResponsesRequest.model_validate({"model": "m", **body})
    return to_chat(req).chat.model_dump(exclude_none=True, by_alias=True)


def test_items_become_the_chat_conversation() -> None:
    chat = _chat(instructions="Be brief.", tools=[TOOL], tool_choice={"type": "function", "name": "w"},
                 parallel_tool_calls=False, max_output_tokens=7, temperature=0.5,
                 text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                 reasoning={"effort": "high"}, input=[
                     {"role": "user", "content": "Weather?"},
                     {"type": "reasoning", "id": "rs_1", "summary": [],
                      "content": [{"type": "reasoning_text", "text": "Call w."}]},
                     {"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": "Checking."}]},
                     {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"d": 1}'},
                     {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                     {"role": "developer", "content": [{"type": "input_text", "text": "Short."}]}])
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "developer"]
    assert msgs[0]["content"] == "Be brief."
    assert msgs[2]["content"] == "Checking." and msgs[2]["reasoning_content"] == "Call w."
    assert msgs[2]["tool_calls"] == [{"id": "c1", "type": "function",
                                      "function": {"name": "w", "arguments": '{"d": 1}'}}]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "rain"}
    assert msgs[4]["content"] == "Short."
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "w", "description": "Weather", "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert (chat["parallel_tool_calls"], chat["max_tokens"], chat["temperature"]) == (False, 7, 0.5)
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert chat["reasoning_effort"] == "high"
    assert _chat(input="Hi")["messages"] == [{"role": "user", "content": "Hi"}]


def test_reasoning_comes_back_from_its_content_summary_or_sealed_text() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}
    for item, text in (
            ({"content": [{"type": "reasoning_text", "text": "A."}],
              "summary": [{"type": "summary_text", "text": "B."}]}, "A."),
            ({"summary": [{"type": "summary_text", "text": "B."}]}, "B."),
            ({"summary": [], "encrypted_content": "C."}, "C.")):
        msgs = _chat(input=[{"role": "user", "content": "q"},
                            {"type": "reasoning", "id": "rs_1", **item}, call])["messages"]
        assert msgs[1]["reasoning_content"] == text


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "name": "w", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    # not valid Unicode, found by the chat request: named as the Responses request names it
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\ud800"}]},
     "input[1].content"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        _chat(**body)
    assert e.value.evidence["param"] == param


def test_the_chat_paths_fields_are_named_as_the_responses_request_names_them() -> None:
    tr = to_chat(ResponsesRequest.model_validate({"model": "m", "input": "hi"}))
    assert tr.rename("messages") == "input"  # a prompt past the context: the input is too long
    assert tr.rename("max_completion_tokens") == "max_output_tokens"
    # text.format holds json_schema's fields itself: a bad schema is text.format.schema
    assert tr.rename("response_format.json_schema.schema") == "text.format.schema"
    assert tr.rename("response_format.type") == "text.format.type"
    assert tr.rename("response_format") == "text.format"
    assert _chat(input="hi", reasoning={"effort": "none"}).get("reasoning_effort") is None


# ------------------------------------------------------------------------ live, on the fake engine

@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from ftrs_server_harness import ServerProcess

    proc = ServerProcess(["--model", "fake", "--reasoning-parser", "qwen3"])
    try:
        proc.wait("ok")
        yield proc
    finally:
        proc.stop()


def _client(server: Any) -> Any:
    import openai
    from ftrs_server_harness import API_KEY

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


ANSWER = '<think>Plan: call w.</think>Sure.<tool_call>{"name": "w", "arguments": {"d": 3}}</tool_call>'


def test_a_plain_answer(server: Any) -> None:
    r = _client(server).responses.create(model="fake", input="SAY:Hello there.")
    assert r.status == "completed" and r.output_text == "Hello there."
    assert [i.type for i in r.output] == ["message"]
    assert r.usage is not None and r.usage.output_tokens == len(b"Hello there.") + 1  # and EOS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.id.startswith("resp_") and r.store is False
    raw = _client(server).responses.with_raw_response.create(model="fake", input="SAY:Hi.")
    created = json.loads(raw.text)["created_at"]
    assert isinstance(created, int), created  # whole seconds, as OpenAI's (it was time.time())


def test_reasoning_text_and_a_call_whole_and_streamed(server: Any) -> None:
    c = _client(server)
    kw: dict[str, Any] = {"model": "fake", "input": f"SAY:{ANSWER}", "tools": [TOOL]}
    r = c.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "Plan: call w."
    assert r.output_text == "Sure."
    call = r.output[2]
    assert (call.name, json.loads(call.arguments), call.status) == ("w", {"d": 3}, "completed")
    assert call.call_id.startswith("call_")
    assert r.usage.output_tokens_details.reasoning_tokens > 0

    events = list(c.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in r.output]
    assert final.output_text == "Sure." and final.output[2].arguments == call.arguments
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Plan: call w."

    with c.responses.stream(**kw) as s:  # the SDK rebuilds the response from the events
        built = s.get_final_response()
    assert built.output_text == "Sure." and built.output[2].arguments == call.arguments


def test_sealed_reasoning_round_trips(server: Any) -> None:
    """`include: ["reasoning.encrypted_content"]` puts the reasoning text in the reasoning item
    (whole and streamed), which a stateless client sends back as it got it."""
    c = _client(server)
    kw: dict[str, Any] = {"model": "fake", "input": f"SAY:{ANSWER}", "tools": [TOOL],
                          "include": ["reasoning.encrypted_content"]}
    item = c.responses.create(**kw).output[0]
    assert item.type == "reasoning" and item.encrypted_content == "Plan: call w."
    done = [e.item for e in c.responses.create(**kw, stream=True)
            if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert done[0].encrypted_content == "Plan: call w."
    assert c.responses.create(model="fake", input=f"SAY:{ANSWER}").output[0].encrypted_content is None
    back = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    msgs = _chat(input=[{"role": "user", "content": "q"}, back,
                        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}])
    assert msgs["messages"][1]["reasoning_content"] == "Plan: call w."


def test_a_tool_loop_in_items_and_the_output_limit(server: Any) -> None:
    c = _client(server)
    items = [{"role": "user", "content": "SAY:Done now."},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"d": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"}]
    assert c.responses.create(model="fake", input=items, tools=[TOOL]).output_text == "Done now."
    short = c.responses.create(model="fake", input="SAY:A long answer here.", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == "A l"
    assert short.output[-1].status == "incomplete"  # the message the limit cut
    with c.responses.stream(model="fake", input="SAY:A long answer here.", max_output_tokens=3) as st:
        done = [e.item for e in st if e.type == "response.output_item.done"]
    assert done[-1].status == "incomplete"
    assert c.responses.create(model="fake", input="SAY:Done now.").output[-1].status == "completed"


def test_stateless_fields_are_400s_in_the_openai_shape(server: Any) -> None:
    import openai

    c = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="fake", input="hi", previous_response_id="resp_x")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="hi")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a\udc80": {"type": "string"}}}}]}, "tools[0]"),
    ({"metadata": {"a\udc80": "x"}}, "metadata"),
])
def test_a_lone_surrogate_anywhere_in_the_json_is_a_400(
        server: Any, stream: bool, extra: dict[str, Any], param: str) -> None:
    """A surrogate in a metadata key used to be found only when the answer was written: a 500
    after generating, or a 200 with an empty stream."""
    import httpx

    body = {"model": "fake", "input": "hi", "max_output_tokens": 4, "stream": stream, **extra}
    r = httpx.post(server.url + "/v1/responses", content=json.dumps(body).encode(), timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()
