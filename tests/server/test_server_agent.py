"""What agents ask of the server: n > 1, logit_bias, tools and tool_choice, response_format,
reasoning_content, over real HTTP with the official `openai` client.

The fake engine (fake_backend.py) checks the HTTP side alone; the tiny model and the demo MoE
check it end to end (`test_server_agent_live` below)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from ftrs.sampling import SEED_MAX
from ftrs.server.prepare import choice_seed

MODEL = "fake"
MSGS = [{"role": "user", "content": "pick a number"}]


def test_choice_seeds_are_distinct_and_stay_in_range() -> None:
    for seed in (0, 7, SEED_MAX - 3, SEED_MAX):
        seeds = [choice_seed(seed, i) for i in range(8)]
        assert seeds[0] == seed and len(set(seeds)) == 8
        assert all(s <= SEED_MAX for s in seeds)
    assert [choice_seed(5, i) for i in range(3)] == [5, 6, 7]


def test_n_choices_are_the_requests_seeded_seed_plus_index(client: Any) -> None:
    many = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=1.0,
                                          seed=40, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=1.0,
                                            seed=40 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == alone
    assert len(set(alone)) == 3
    assert many.usage.completion_tokens == 3 * 6
    assert many.usage.prompt_tokens == client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=1).usage.prompt_tokens  # counted once


def test_n_choices_stream_with_their_index(client: Any) -> None:
    full = client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=1.0,
                                     seed=9, n=4)
    stream = client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=1.0,
                                       seed=9, n=4, stream=True, stream_options={"include_usage": True})
    text: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [text[i] for i in range(4)] == [c.text for c in full.choices]
    assert finished == {i: "length" for i in range(4)}
    assert usage is not None and usage.completion_tokens == 20 == full.usage.completion_tokens

    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=1.0,
                                          seed=3, n=2, stream=True)
    roles: set[int] = set()
    content: dict[int, str] = defaultdict(str)
    for chunk in chat:
        for c in chunk.choices:
            if c.delta.role == "assistant":
                roles.add(c.index)
            content[c.index] += c.delta.content or ""
    assert roles == {0, 1}
    assert content[0] != content[1] and all(len(content[i]) > 0 for i in (0, 1))


def test_n_above_max_n_is_a_400_and_the_server_serves_on(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, n=9)
    body: dict[str, Any] = e.value.body  # type: ignore[assignment]
    assert body["param"] == "n" and "--max-n" in body["message"]
    ok = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, n=8)
    assert len(ok.choices) == 8



# ------------------------------------------------------------------ tools on the fake engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


def _say(text: str) -> list[dict[str, Any]]:
    """Messages that make the fake engine answer `text` (fake_backend: `SAY:<text>`)."""
    return [{"role": "user", "content": f"SAY:{text}"}]


def test_a_tool_call_in_the_output_becomes_message_tool_calls(client: Any) -> None:
    out = f"<tool_call>{json.dumps(CALL)}</tool_call>"
    r = client.chat.completions.create(model=MODEL, messages=_say(out), tools=[WEATHER], max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]


def test_a_streamed_tool_call_has_a_stable_index_and_id(client: Any) -> None:
    tool = {"type": "function", "function": {"name": "f"}}  # short: the fake context is 512 bytes
    calls = [{"name": "f", "arguments": {"c": "Paris"}}, {"name": "f", "arguments": {"c": "Oslo"}}]
    out = "Checking." + "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
    stream = client.chat.completions.create(model=MODEL, messages=_say(out), tools=[tool],
                                            max_tokens=150, stream=True)
    content, finish = "", None
    ids: dict[int, set[str]] = defaultdict(set)
    names: dict[int, str] = {}
    args: dict[int, str] = defaultdict(str)
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id:
                    ids[d.index].add(d.id)
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                args[d.index] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    assert content == "Checking."
    assert finish == "tool_calls"
    assert sorted(ids) == [0, 1] and all(len(v) == 1 for v in ids.values())
    assert ids[0] != ids[1]
    assert names == {0: "f", 1: "f"}
    assert [json.loads(args[i]) for i in (0, 1)] == [c["arguments"] for c in calls]
    full = client.chat.completions.create(model=MODEL, messages=_say(out), tools=[tool],
                                          max_tokens=150, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in full.choices[0].message.tool_calls] == [calls[0]["arguments"]]


def test_tool_choice_none_leaves_the_text_alone(client: Any) -> None:
    out = f"<tool_call>{json.dumps(CALL)}</tool_call>"
    r = client.chat.completions.create(model=MODEL, messages=_say(out), tools=[WEATHER],
                                       tool_choice="none", max_tokens=100)
    assert r.choices[0].message.content == out
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_tools_history_and_template_kwargs_reach_the_template(client: Any) -> None:
    from fake_backend import ByteTokenizer

    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    expected: list[dict[str, Any]] = [  # what a chat template is given: arguments as an object
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    prompt = ByteTokenizer().apply_chat_template(expected, tools=[WEATHER], enable_thinking=False)
    assert r.usage.prompt_tokens == len(prompt.encode())


def test_bad_tool_input_is_a_400_naming_the_field_and_the_server_serves_on(client: Any) -> None:
    import openai

    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
            {"role": "user", "content": "and?"}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format.json_schema.schema"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in cases:
        body = {"messages": MSGS, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=2, **body)
        err: dict[str, Any] = e.value.body  # type: ignore[assignment]
        assert err["param"] == param, (extra, err)
        assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).usage.completion_tokens == 2


def test_reasoning_content_is_split_from_the_answer(tmp_path: Any) -> None:
    import openai
    from ftrs_server_harness import API_KEY, ServerProcess

    server = ServerProcess(["--model", "fake", "--reasoning-parser", "qwen3"])
    try:
        server.wait("ok")
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        out = "<think>Paris is in France.</think>It is sunny."
        r = c.chat.completions.create(model=MODEL, messages=_say(out), max_tokens=100)  # type: ignore[arg-type]
        msg = r.choices[0].message
        assert (msg.reasoning_content, msg.content) == ("Paris is in France.", "It is sunny.")  # type: ignore[attr-defined]
        reasoning, content = "", ""
        stream: Any = c.chat.completions.create(model=MODEL, messages=_say(out),  # type: ignore[arg-type]
                                                max_tokens=100, stream=True)
        for chunk in stream:
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
        assert (reasoning, content) == ("Paris is in France.", "It is sunny.")
    finally:
        server.stop()
