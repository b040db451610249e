"""What agents ask of the server: n > 1, logit_bias, tools and tool_choice, response_format,
reasoning_content, over real HTTP with the official `openai` client.

The fake engine (fake_backend.py) checks the HTTP side alone; the tiny model and the demo MoE
check it end to end (`test_server_agent_live` below)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from live_agent import (
    FORECAST,
    LIVE_OPTIONS,
    PERSON,
    check_forced_call,
    check_json_schema_samples,
    openai_client,
)
from live_agent import tiny_server as live_tiny_server

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


def test_the_tool_parser_flag_picks_the_format_tools_are_offered_in() -> None:
    import argparse

    from ftrs.errors import ConfigError
    from ftrs.models.tiny import tiny_tokenizer
    from ftrs.server.cli import check_parser_flags
    from ftrs.server.prepare import Limits, render_chat
    from ftrs.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, "tools": [
        {"type": "function", "function": {"name": "get_time"}}]})
    texts = {}
    for flag in ("hermes", "mistral"):
        tok = tiny_tokenizer(512)  # ChatML without tools: they are described in a system message
        texts[flag] = render_chat(req, tok, Limits(512, 2048, 16, tool_parser=flag))[1]
    assert "<tool_call>" in texts["hermes"] and "[TOOL_CALLS]" not in texts["hermes"]
    assert "[TOOL_CALLS]" in texts["mistral"] and "<tool_call>" not in texts["mistral"]
    assert all("get_time" in t for t in texts.values())
    for bad in ({"tool_parser": "nope"}, {"reasoning_parser": "nope"}):
        with pytest.raises(ConfigError):
            check_parser_flags(argparse.Namespace(**bad))


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


def test_a_request_of_n_choices_counts_once_with_every_choices_tokens(client: Any, fake_server: Any) -> None:
    from ftrs_server_harness import scrape

    before = scrape(fake_server.url)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, n=3, seed=2)
    after = scrape(fake_server.url)

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew("ftrs_requests_total{status=success}") == 1
    assert grew("ftrs_prompt_tokens_total") == r.usage.prompt_tokens
    assert grew("ftrs_generation_tokens_total") == 15 == r.usage.completion_tokens


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
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
            {"role": "user", "content": "and?"}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format.json_schema.schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        # a schema the engine cannot compile is refused offered under "auto", not only forced
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "f"}}]}, "tools[1].function.name"),
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


# ------------------------------------------------------- live: the tiny model and the demo MoE

@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ftrs.engine.core")
    with live_tiny_server(tmp_path_factory.mktemp("tiny")) as server:
        yield server


def test_live_forced_tool_call_validates_against_the_tool_schema(tiny_server: Any) -> None:
    check_forced_call(openai_client(tiny_server), "tiny", parallel=False)


def test_live_required_tool_choice_calls_one_of_the_tools_by_its_schema(tiny_server: Any) -> None:
    import jsonschema

    schemas = {"get_forecast": FORECAST["function"]["parameters"],  # type: ignore[index]
               "get_person": PERSON}
    tools = [FORECAST, {"type": "function", "function": {"name": "get_person", "parameters": PERSON}}]
    r = openai_client(tiny_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Use a tool."}], tools=tools,
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=8)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_live_responses_api_forced_call_and_json_output(tiny_server: Any) -> None:
    """The Responses API on the real engine: a named tool_choice gives one function_call whose
    arguments follow the tool's schema; text.format json_schema gives JSON that validates."""
    import jsonschema

    c = openai_client(tiny_server)
    fn = FORECAST["function"]
    tool = {"type": "function", "name": fn["name"], "parameters": fn["parameters"]}  # type: ignore[index]
    r = c.responses.create(model="tiny", input="Weather in Oslo?", tools=[tool],
                           tool_choice={"type": "function", "name": "get_forecast"},
                           parallel_tool_calls=False,
                           max_output_tokens=200, temperature=1.0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_forecast"
    jsonschema.validate(json.loads(calls[0].arguments), fn["parameters"])  # type: ignore[index]
    r = c.responses.create(model="tiny", input="A person as JSON.", max_output_tokens=120,
                           text={"format": {"type": "json_schema", "name": "person",
                                            "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_live_json_schema_output_validates_for_20_seeded_samples(tiny_server: Any) -> None:
    check_json_schema_samples(openai_client(tiny_server), "tiny", 20)


def _check_n_3(server: Any, model: str, prompt: list[int], exact: bool = True) -> None:
    """n=3 with a seed: choice i is the request alone with seed + i; the three differ.

    `exact=False` (the demo MoE): a batch of 3 and a batch of 1 round differently on the CPU,
    which can flip a near-tie a few tokens in, so only the first token is compared."""
    import httpx

    def complete(**kw: Any) -> dict[str, Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
                "return_token_ids": True, **kw}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return dict(r.json())

    many = complete(seed=77, n=3)
    ids = [ch["token_ids"] for ch in sorted(many["choices"], key=lambda ch: ch["index"])]
    alone = [complete(seed=77 + i)["choices"][0]["token_ids"] for i in range(3)]
    if exact:
        assert ids == alone
    else:
        assert [t[:1] for t in ids] == [t[:1] for t in alone]
    assert len({tuple(t) for t in ids}) == 3
    assert many["usage"]["completion_tokens"] == sum(len(t) for t in ids)


def test_live_n_3_choices_are_the_requests_with_distinct_seeds(tiny_server: Any) -> None:
    _check_n_3(tiny_server, "tiny", [5, 9, 33, 71])


def test_live_logit_bias_moves_the_sample(tiny_server: Any) -> None:
    c = openai_client(tiny_server)
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=1.0, seed=1,
                             logit_bias={"65": 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [65] * 6  # +100 outweighs any logit gap
    plain = c.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=1.0, seed=1,
                                 extra_body={"return_token_ids": True})
    assert plain.choices[0].token_ids != [65] * 6


def test_live_bad_input_is_a_400_naming_the_field_and_the_server_serves_on(tiny_server: Any) -> None:
    import openai

    c = openai_client(tiny_server)
    msgs = [{"role": "user", "content": "hi"}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}},
         "response_format.json_schema.schema"),
        ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": "city=Oslo"}}]},
            {"role": "user", "content": "go on"}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"n": 21}, "n"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": "tiny", "messages": msgs, "max_tokens": 2, **extra})
        err: dict[str, Any] = e.value.body  # type: ignore[assignment]
        assert err["param"] == param, (extra, err)
        ok = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def demo_server() -> Iterator[Any]:
    pytest.importorskip("ftrs.engine.core")
    from ftrs_server_harness import ServerProcess

    from ftrs.models.demo import demo_dir

    if not (demo_dir() / ".complete").is_file():
        pytest.skip("the demo model is not built (`ftrs models demo`)")
    server = ServerProcess(["--model", str(demo_dir()), "--served-model-name", "demo", *LIVE_OPTIONS],
                           api_key=None, backend=None)
    try:
        server.wait("ok", timeout=600)
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_demo_forced_tool_call_validates_against_the_tool_schema(demo_server: Any) -> None:
    check_forced_call(openai_client(demo_server), "demo", parallel=True, temperature=0.7)


@pytest.mark.slow
def test_demo_json_schema_output_validates_for_20_seeded_samples(demo_server: Any) -> None:
    check_json_schema_samples(openai_client(demo_server), "demo", 20)


@pytest.mark.slow
def test_demo_n_3_choices_are_the_requests_with_distinct_seeds(demo_server: Any) -> None:
    _check_n_3(demo_server, "demo", [504, 3458, 314, 4700, 282], exact=False)


def test_continue_final_message_ends_the_prompt_inside_the_assistant_turn() -> None:
    """The prompt stops right after the final assistant text (ChatML: no `<|im_end|>` after it,
    no new assistant header); without the flag that turn is a finished one."""
    from ftrs.errors import InvalidRequest
    from ftrs.models.tiny import tiny_tokenizer
    from ftrs.server.prepare import Limits, render_chat
    from ftrs.server.protocol import ChatCompletionRequest

    tok = tiny_tokenizer(512)
    msgs = [{"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": "1, 2, 3, "}]

    def render(**kw: Any) -> str:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, **kw})
        return render_chat(req, tok, Limits(512, 2048, 16))[1]

    assert render(continue_final_message=True).endswith(
        "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n1, 2, 3,")
    finished = render()
    assert finished.endswith("1, 2, 3, <|im_end|>\n<|im_start|>assistant\n")
    for bad in ([{"role": "user", "content": "hi"}],
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]):
        req = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": bad, "continue_final_message": True})
        with pytest.raises(InvalidRequest) as e:
            render_chat(req, tok, Limits(512, 2048, 16))
        assert e.value.evidence["param"] == "continue_final_message"


def test_an_earlier_turns_reasoning_reaches_the_template() -> None:
    """`reasoning_content` of an assistant turn is passed on as the templates read it: Qwen3's
    key, and gpt-oss's `thinking`, which its template refuses beside content on a turn with
    calls (so it is left out there: that template then takes the content as the analysis)."""
    from ftrs.models.tiny import tiny_tokenizer
    from ftrs.models.tokenizer import Tokenizer
    from ftrs.server.prepare import Limits, render_chat
    from ftrs.server.protocol import ChatCompletionRequest

    template = ("{{ tools | length if tools else '' }}{% for m in messages %}[{{ m.role }}|{{ m.content }}"
                "{% if m.reasoning_content is defined %}|rc={{ m.reasoning_content }}{% endif %}"
                "{% if m.thinking is defined %}|th={{ m.thinking }}{% endif %}]{% endfor %}")
    tok = Tokenizer(tiny_tokenizer(512).tk, template, None, "<|im_end|>", [2])
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "", "reasoning_content": "Ask the clock.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
            {"role": "assistant", "content": "Checking again.", "reasoning_content": "Once more.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
            {"role": "assistant", "content": "It is noon.", "reasoning_content": "Done."}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs})
    text = render_chat(req, tok, Limits(512, 2048, 16))[1]
    assert "[assistant||rc=Ask the clock.|th=Ask the clock.]" in text
    assert "[assistant|Checking again.|rc=Once more.]" in text
    assert "[assistant|It is noon.|rc=Done.|th=Done.]" in text
    assert "[user|Time?]" in text  # nothing added to other roles


def test_reasoning_effort_is_the_templates_variable() -> None:
    import pydantic

    from ftrs.models.tiny import tiny_tokenizer
    from ftrs.models.tokenizer import Tokenizer
    from ftrs.server.prepare import Limits, render_chat
    from ftrs.server.protocol import ChatCompletionRequest

    template = "Reasoning: {{ reasoning_effort | default('medium') }}|{{ messages[0].content }}"
    tok = Tokenizer(tiny_tokenizer(512).tk, template, None, "<|im_end|>", [2])

    def render(**kw: Any) -> str:
        req = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})
        return render_chat(req, tok, Limits(512, 2048, 16))[1]

    assert render() == "Reasoning: medium|hi"
    assert render(reasoning_effort="high") == "Reasoning: high|hi"
    assert render(reasoning_effort="high",
                  chat_template_kwargs={"reasoning_effort": "low"}) == "Reasoning: low|hi"
    with pytest.raises(pydantic.ValidationError, match="reasoning_effort"):
        render(reasoning_effort="extreme")
