"""gpt-oss's harmony output: hand-written message runs, fed whole and in every piece size, split
into reasoning, content and tool calls by the `gpt_oss` reasoning and tool parsers together (as a
chat choice chains them); the harmony tags reach them as special tokens; and the same over real
HTTP on the fake engine, with the official `openai` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from ftrs.models.tiny import tiny_tokenizer
from ftrs.sampling import SamplingParams
from ftrs.server.prepare import Plan
from ftrs.server.reasoning import REASONING_PARSERS, choose_reasoning_parser
from ftrs.server.serving import kept_special_ids
from ftrs.server.toolcalls import TOOL_PARSERS, choose_tool_parser

CHUNKS = (1, 2, 3, 7, 10_000)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: no arguments
CALL_HEAD = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
ANALYSIS = "<|channel|>analysis<|message|>The user wants Oslo's weather.<|end|>"
NEXT = "<|start|>assistant"

Split = tuple[str, str, list[tuple[str, dict[str, Any]]]]


def run(text: str, chunk: int, tools: bool = True) -> Split:
    """(reasoning, content, calls) of `text` fed in `chunk`-sized pieces through the harmony
    reasoning parser and then (when the request has tools) the harmony tool parser."""
    r, t = REASONING_PARSERS["gpt_oss"](), TOOL_PARSERS["gpt_oss"](TOOLS) if tools else None
    reasoning = content = ""
    pieces = [text[i:i + chunk] for i in range(0, len(text), chunk)]
    for piece in [*pieces, None]:  # None: the end of the output
        rr, cc = r.feed(piece) if piece is not None else r.finish()
        if t is not None:
            cc, _ = t.feed(cc)
            if piece is None:
                cc += t.finish()[0]
        reasoning, content = reasoning + rr, content + cc
    calls = [(c.name, json.loads(c.arguments)) for c in t.calls] if t is not None else []
    return reasoning, content, calls


CASES: list[tuple[str, Split]] = [
    (ANALYSIS + NEXT + "<|channel|>final<|message|>It will rain.",
     ("The user wants Oslo's weather.", "It will rain.", [])),
    ("<|channel|>final<|message|>\n\nNo thinking.  \n", ("", "No thinking.", [])),
    (ANALYSIS + NEXT + CALL_HEAD + '{"city": "Oslo", "days": 2}',
     ("The user wants Oslo's weather.", "", [("get_weather", {"city": "Oslo", "days": 2})])),
    # the recipient before the channel, the content type without <|constrain|>
    (ANALYSIS + NEXT + ' to=functions.now<|channel|>commentary json<|message|>{}<|call|>',
     ("The user wants Oslo's weather.", "", [("now", {})])),
    (" to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Lima\"}",
     ("", "", [("get_weather", {"city": "Lima"})])),
    # a preamble is content; two analysis messages are one reasoning, a blank line apart
    (ANALYSIS + NEXT + "<|channel|>analysis<|message|>Call the tool.<|end|>" + NEXT
     + "<|channel|>commentary<|message|>Let me check.<|end|>" + NEXT + CALL_HEAD
     + '{"city": "Oslo"}',
     ("The user wants Oslo's weather.\n\nCall the tool.", "Let me check.",
      [("get_weather", {"city": "Oslo"})])),
    # a built-in tool (not the request's functions) is part of the reasoning
    ('<|channel|>analysis to=browser.search code<|message|>{"query": "Oslo"}<|call|>',
     ('{"query": "Oslo"}', "", [])),
    # not harmony at all: content as written
    ("Plain words, <|not a tag.", ("", "Plain words, <|not a tag.", [])),
    # cut off inside a header: what was said stands
    (ANALYSIS + NEXT + "<|channel|>fin", ("The user wants Oslo's weather.", "", [])),
    # cut off inside the reasoning: all of it was reasoning
    ("<|channel|>analysis<|message|>Half a thou", ("Half a thou", "", [])),
]


@pytest.mark.parametrize(("text", "want"), CASES)
def test_harmony_messages_are_split_in_every_piece_size(text: str, want: Split) -> None:
    for chunk in CHUNKS:
        assert run(text, chunk) == want, chunk


def test_a_malformed_call_is_content_not_lost() -> None:
    text = ANALYSIS + NEXT + CALL_HEAD + '{"city": Oslo}'
    for chunk in CHUNKS:
        reasoning, content, calls = run(text, chunk)
        assert (reasoning, calls) == ("The user wants Oslo's weather.", []), chunk
        assert content == CALL_HEAD + '{"city": Oslo}', chunk


def test_without_tools_the_answer_is_still_split() -> None:
    text = ANALYSIS + NEXT + "<|channel|>final<|message|>Sunny."
    assert run(text, 3, tools=False) == ("The user wants Oslo's weather.", "Sunny.", [])


def test_the_reasoning_streams_before_its_end_tag() -> None:
    p = REASONING_PARSERS["gpt_oss"]()
    assert p.feed("<|channel|>analysis<|mess") == ("", "")
    assert p.feed("age|>Step one. <|e") == ("Step one.", "")
    assert p.feed("nd|><|start|>assistant<|channel|>final<|message|>Do") == ("", "Do")
    assert p.feed("ne") == ("", "ne")
    assert p.finish() == ("", "")


def test_the_template_picks_the_harmony_parsers() -> None:
    template = "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    assert choose_reasoning_parser(None, template) == "gpt_oss"
    assert choose_tool_parser(None, template) == "gpt_oss"


def test_harmony_tags_reach_the_parsers_as_special_tokens() -> None:
    """gpt-oss's tokenizer holds every harmony tag as a special token, which the detokenizer
    drops; a chat choice keeps those of its parsers (reasoning and tools) and no others."""
    from ftrs.server.detokenize import IncrementalDetokenizer

    tags = REASONING_PARSERS["gpt_oss"].special_tags
    tok = tiny_tokenizer(512, tags)
    plan = Plan([1], (SamplingParams(),), tools=TOOLS, tool_parser="gpt_oss",
                reasoning_parser="gpt_oss")
    keep = kept_special_ids(tok, plan)
    assert keep == tok.special_ids(tags) and len(keep) == len(tags)
    assert kept_special_ids(tok, Plan([1], (SamplingParams(),), reasoning_parser="qwen3")) == set()
    text = ANALYSIS + NEXT + "<|channel|>commentary<|message|>One moment.<|end|>" + NEXT + CALL_HEAD \
        + '{"city": "Oslo"}'
    ids = [*tok.encode(text), tok.tk.token_to_id("<|call|>")]  # the stop token ends it
    assert len(ids) < len(text.encode())  # the tags are single tokens
    detok = IncrementalDetokenizer(tok, keep=keep)
    shown = "".join(detok.push([i]) for i in ids)
    assert run(shown, 10_000) == ("The user wants Oslo's weather.", "One moment.",
                                  [("get_weather", {"city": "Oslo"})])
    dropped = IncrementalDetokenizer(tok)
    assert run("".join(dropped.push([i]) for i in ids), 10_000)[2] == []


# --- over HTTP, on the fake engine ---------------------------------------------------------

@pytest.fixture(scope="module")
def harmony_server() -> Iterator[Any]:
    from ftrs_server_harness import ServerProcess

    server = ServerProcess(["--model", "fake", "--reasoning-parser", "gpt_oss",
                            "--tool-parser", "gpt_oss"])
    try:
        server.wait("ok")
        yield server
    finally:
        server.stop()


def _say(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"SAY:{text}"}]  # fake_backend answers `text`


def test_a_harmony_answer_over_http_whole_and_streamed(harmony_server: Any) -> None:
    import openai
    from ftrs_server_harness import API_KEY

    c = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key=API_KEY, max_retries=0,
                      timeout=30)
    # short: the fake engine's context is 512 bytes, the prompt holding this text and the tool
    out = ("<|channel|>analysis<|message|>Oslo.<|end|><|start|>assistant<|channel|>commentary"
           "<|message|>Hi.<|end|><|start|>assistant<|channel|>commentary to=functions.w "
           '<|constrain|>json<|message|>{"d": 3}')
    kw: dict[str, Any] = {"model": "fake", "messages": _say(out), "max_tokens": 200,
                          "tools": [{"type": "function", "function": {"name": "w"}}]}
    r = c.chat.completions.create(**kw)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (msg.reasoning_content, msg.content) == ("Oslo.", "Hi.")  # type: ignore[attr-defined]
    assert msg.tool_calls and [(t.function.name, json.loads(t.function.arguments))
                               for t in msg.tool_calls] == [("w", {"d": 3})]
    reasoning = content = args = ""
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
            args += "".join(d.function.arguments or "" for d in ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert (reasoning, content, finish) == ("Oslo.", "Hi.", "tool_calls")
    assert args == msg.tool_calls[0].function.arguments
    # the Responses API over the same run: reasoning, message and function_call items
    resp = c.responses.create(model="fake", input=f"SAY:{out}", max_output_tokens=200,
                              tools=[{"type": "function", "name": "w"}])
    assert [i.type for i in resp.output] == ["reasoning", "message", "function_call"]
    assert (resp.output[0].content[0].text, resp.output_text) == ("Oslo.", "Hi.")
    assert (resp.output[2].name, json.loads(resp.output[2].arguments)) == ("w", {"d": 3})


# --- grammars that let gpt-oss think first -------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def _harmony_tokenizer() -> Any:
    from ftrs.models.tokenizer import Tokenizer

    tk = tiny_tokenizer(512, REASONING_PARSERS["gpt_oss"].special_tags).tk
    return Tokenizer(tk, "{{ '<|start|>assistant<|channel|>final<|message|>' }}", None,
                     "<|return|>", [tk.token_to_id("<|return|>")])


def _accepts(tok: Any, spec: Any, text: str) -> bool:
    import llguidance

    from ftrs.engine import grammar

    m = llguidance.LLMatcher(grammar.ll_tokenizer(tok), grammar.grammar_text(spec), log_level=0)
    assert not m.is_error(), m.get_error()
    return bool(m.consume_tokens(tok.encode(text))) and m.is_accepting()


def test_structured_output_may_follow_one_analysis_message() -> None:
    """With the harmony tags as special tokens, a json_schema answer may follow an analysis
    message and must stand in the final channel; the reasoning parser stays on and splits it."""
    from ftrs.server.prepare import Limits, prepare_chat
    from ftrs.server.protocol import ChatCompletionRequest

    tok = _harmony_tokenizer()
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "a?"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    plan = prepare_chat(req, tok, Limits(512, 4096, 64, reasoning_parser="gpt_oss"))
    assert plan.reasoning_parser == "gpt_oss"
    spec = plan.params[0].structured
    assert spec is not None and spec.lead
    thought = "<|channel|>analysis<|message|>It is one.<|end|><|start|>assistant"
    final = '<|channel|>final<|message|>{"a": 1}'
    assert _accepts(tok, spec, thought + final)
    assert _accepts(tok, spec, final)
    assert not _accepts(tok, spec, '{"a": 1}')  # the answer stands in the final channel
    assert not _accepts(tok, spec, '<|channel|>final<|message|>{"a": "one"}')
    assert run(thought + final, 3, tools=False) == ("It is one.", '{"a": 1}', [])
    # a tokenizer without the tags as special tokens: no lead, the grammar is the whole output
    plain = prepare_chat(req, tiny_tokenizer(512), Limits(512, 4096, 64, reasoning_parser="gpt_oss"))
    assert plain.reasoning_parser is None and plain.params[0].structured.lead == ""  # type: ignore[union-attr]


def test_a_forced_call_may_follow_one_analysis_message() -> None:
    from ftrs.server.prepare import Limits, prepare_chat
    from ftrs.server.protocol import ChatCompletionRequest

    tok = _harmony_tokenizer()
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    plan = prepare_chat(req, tok, Limits(512, 4096, 64, tool_parser="gpt_oss",
                                         reasoning_parser="gpt_oss"))
    spec = plan.params[0].structured
    assert plan.reasoning_parser == "gpt_oss" and spec is not None and spec.lead
    call = CALL_HEAD + '{"city": "Oslo"}'
    assert _accepts(tok, spec, ANALYSIS + NEXT + call)
    assert _accepts(tok, spec, call)
    assert not _accepts(tok, spec, ANALYSIS + NEXT + "<|channel|>final<|message|>Sunny.")
    assert run(ANALYSIS + NEXT + call, 2) == ("The user wants Oslo's weather.", "",
                                              [("get_weather", {"city": "Oslo"})])
