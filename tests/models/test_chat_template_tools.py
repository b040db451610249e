"""Tools, tool calls and tool results through chat templates: a Qwen3-style template renders them
itself (expected prompt written out by hand, and transformers' renderer as a second oracle);
templates without tools (the tiny model's, the demo's SmolLM2) get them in the parser's format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftrs.errors import InvalidRequest
from ftrs.models.tiny import tiny_tokenizer
from ftrs.models.tokenizer import Tokenizer
from ftrs.server.toolcalls import TOOL_PARSERS

# Written for this test in the Qwen3 manner: tools in the system turn inside <tools></tools>,
# assistant calls as <tool_call> JSON (arguments as text or through tojson), results as
# <tool_response> blocks in one user turn, `enable_thinking` in the generation prompt.
QWEN3_STYLE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nFunction signatures are inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <today> & tomorrow, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]

QWEN3_EXPECTED = """<|im_start|>system
You are terse.

# Tools

Function signatures are inside <tools></tools>:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Weather <today> & tomorrow, in °C", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
<|im_start|>user
Weather in Paris, and the time?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "now", "arguments": {}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18 °C
</tool_response>
<tool_response>
noon
</tool_response><|im_end|>
<|im_start|>assistant
"""


def with_template(template: str) -> Tokenizer:
    tiny = tiny_tokenizer(512)
    return Tokenizer(tiny.tk, template, tiny.bos_token, tiny.eos_token, [2])


def test_qwen3_style_template_renders_tools_calls_and_results() -> None:
    tok = with_template(QWEN3_STYLE)
    assert tok.template_knows_tools
    assert tok.apply_chat_template(HISTORY, add_generation_prompt=True, tools=[WEATHER]) == (
        QWEN3_EXPECTED)


def test_qwen3_style_rendering_matches_transformers() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([HISTORY], tools=[WEATHER], chat_template=QWEN3_STYLE,
                                        add_generation_prompt=True)
    tok = with_template(QWEN3_STYLE)
    assert tok.apply_chat_template(HISTORY, tools=[WEATHER]) == rendered[0]
    rendered, _ = render_jinja_template([HISTORY[:2]], chat_template=QWEN3_STYLE,
                                        add_generation_prompt=True, enable_thinking=False)
    assert tok.apply_chat_template(HISTORY[:2], enable_thinking=False) == rendered[0]


def test_template_kwargs_reach_the_template() -> None:
    tok = with_template(QWEN3_STYLE)
    plain = tok.apply_chat_template(HISTORY[:2])
    assert plain.endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template(HISTORY[:2], enable_thinking=False)
    assert off == plain + "<think>\n\n</think>\n\n"


def test_tiny_template_without_tools_is_taught_them_in_the_hermes_format() -> None:
    tok = tiny_tokenizer(512)
    assert not tok.template_knows_tools
    text = tok.apply_chat_template(HISTORY[1:], tools=[WEATHER])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n")
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER]
    assert "<tool_call>" in system and "</tool_call>" in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris, and the time?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 °C\n</tool_response>\n"
        "<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_fallback_reads_content_parts_and_keeps_assistant_text_before_calls() -> None:
    tok = tiny_tokenizer(512)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Time?"}]},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "noon"}]},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "now", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tiny_template_without_tools_in_the_request_is_unchanged() -> None:
    tok = tiny_tokenizer(512)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")


def test_fallback_uses_the_chosen_parser_format() -> None:
    tok = tiny_tokenizer(512)
    tok.tool_parser = "mistral"
    text = tok.apply_chat_template(HISTORY[1:3], tools=[WEATHER])
    assert text.endswith(
        '<|im_start|>assistant\n[TOOL_CALLS][{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}, {"name": "now", "arguments": {}}]<|im_end|>\n'
        "<|im_start|>assistant\n")
    listed = text.split("JSON list:\n", 1)[1].split("\n", 1)[0]
    assert json.loads(listed) == [WEATHER]


def test_demo_template_merges_the_tools_into_its_system_message(demo_model: Path) -> None:
    tok = Tokenizer.from_dir(demo_model)
    assert tok.chat_template and not tok.template_knows_tools
    text = tok.apply_chat_template(HISTORY, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1  # no default system prompt added
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n18 °C\n</tool_response>\n"
        "<tool_response>\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_calls_written_in_a_format_parse_back(parser: str) -> None:
    fmt = TOOL_PARSERS[parser]
    calls = [("get_weather", {"city": "Zürich"}), ("now", {})]
    p = fmt([WEATHER, {"type": "function", "function": {"name": "now"}}])
    content, _ = p.feed(fmt.format_calls(calls))
    content += p.finish()[0]
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == calls


@pytest.mark.parametrize(("arguments", "why"), [("{not json", "not valid JSON"),
                                                ("[1, 2]", "must be a JSON object"),
                                                (7, "must be a JSON object")])
def test_bad_arguments_in_the_history_name_the_field(arguments: Any, why: str) -> None:
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "f", "arguments": arguments}}]}]
    for tok in (tiny_tokenizer(512), with_template(QWEN3_STYLE)):
        with pytest.raises(InvalidRequest, match=why) as e:
            tok.apply_chat_template(messages)
        assert e.value.evidence["param"] == "messages[1].tool_calls[0].function.arguments"


def test_template_kwargs_may_not_replace_the_renderers_variables() -> None:
    tok = with_template(QWEN3_STYLE)
    with pytest.raises(InvalidRequest) as e:
        tok.apply_chat_template(HISTORY[:2], **{"messages": [], "eos_token": "x"})
    assert e.value.evidence["param"] == "chat_template_kwargs"
