"""A streamed tool call is announced (its id and name sent) only once its arguments object
has begun: a call whose arguments are not an object is refused at its end and shown as text,
and a client must not have been told of a call that then does not exist."""

from __future__ import annotations

import pytest

from ftrs.server.toolcalls import TOOL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": "]["}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
])
@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_a_call_whose_arguments_are_not_an_object_is_never_announced(text: str,
                                                                     chunk: int) -> None:
    p = TOOL_PARSERS["hermes"](TOOLS)
    content, deltas = "", []
    for i in range(0, len(text), chunk):
        c, d = p.feed(text[i:i + chunk])
        content, deltas = content + c, deltas + d
    c, d = p.finish()
    assert deltas + d == [] and p.calls == []
    assert content + c == text


def test_a_call_is_announced_with_the_first_piece_of_its_arguments() -> None:
    p = TOOL_PARSERS["hermes"](TOOLS)
    assert p.feed('<tool_call>{"name": "f", "arguments": ')[1] == []
    (delta,) = p.feed('{"a')[1]
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"a')


@pytest.mark.parametrize(("parser", "call", "start"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "<tool_c"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}]', "[TOOL_CA"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', "<|python_t"),
    ("gpt_oss", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>',
     "<|chan"),
])
def test_a_cut_inside_the_next_calls_start_tag_is_not_content(parser: str, call: str,
                                                              start: str) -> None:
    # max_tokens cut the generation inside the start tag of a second call: that half tag is
    # the parser's markup, dropped like an open call; a generation that just ends keeps it
    p = TOOL_PARSERS[parser](TOOLS)
    content, _ = p.feed(call + "\n" + start)
    rest, _ = p.finish(cut=True)
    assert content + rest == "" and [c.name for c in p.calls] == ["f"]
    p = TOOL_PARSERS[parser](TOOLS)
    content, _ = p.feed("Well " + start[:3])
    rest, _ = p.finish()
    assert content + rest == "Well " + start[:3]
