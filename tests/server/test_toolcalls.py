"""Tool-call parsers: hand-written model outputs, fed whole and in every piece size; arguments
checked against json.loads / json.dumps; forced grammars compiled and run by llguidance."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import llguidance
import pytest

from ftrs.errors import ConfigError, InvalidRequest
from ftrs.models.tiny import tiny_tokenizer
from ftrs.server.structured import special_tag_ids
from ftrs.server.toolbase import ToolParser
from ftrs.server.toolcalls import TOOL_PARSERS, ToolCallDelta, choose_tool_parser

CHUNKS = (1, 2, 3, 7, 10_000)
ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <today> & tomorrow",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
#: tools of any arguments, for outputs that call `f` and `g`
ANY = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
       for n in ("f", "g")]


def run(parser: str, text: str, chunk: int, tools: list[dict[str, Any]] | None = None
        ) -> tuple[str, list[tuple[str, str, str]], list[ToolCallDelta]]:
    """(content, calls as (id, name, arguments), deltas) of `text` fed in `chunk`-sized pieces,
    `tools` offered (default TOOLS and ANY)."""
    p = TOOL_PARSERS[parser](TOOLS + ANY if tools is None else tools)
    content, deltas = "", []
    for i in range(0, len(text), chunk):
        c, d = p.feed(text[i:i + chunk])
        content += c
        deltas += d
    c, d = p.finish()
    return content + c, [(x.id, x.name, x.arguments) for x in p.calls], deltas + d


def assemble(deltas: list[ToolCallDelta], ids: re.Pattern[str] = ID) -> list[tuple[str, str, str]]:
    """What a streaming client builds: per index, the first delta's id and name, and the
    concatenated arguments; indices must come 0, 1, ... in order."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.index == len(calls), "indices are dense and in order"
            assert d.id is not None and ids.fullmatch(d.id) and d.name
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None, "id and name come once"
        calls[d.index][2] += d.arguments
    return [(a, b, c) for a, b, c in calls.values()]


def check(parser: str, text: str, content: str,
          calls: list[tuple[str, dict[str, Any]]]) -> None:
    for chunk in CHUNKS:
        got_content, got_calls, deltas = run(parser, text, chunk)
        assert got_content == content, chunk
        assert [(n, json.loads(a)) for _, n, a in got_calls] == calls, chunk
        for call_id, _, args in got_calls:
            assert ID.fullmatch(call_id)
            assert args == json.dumps(json.loads(args))  # laid out as json.dumps writes it
        if calls or not deltas:  # (a malformed call may have streamed its start)
            assert assemble(deltas) == got_calls, chunk


# --- hermes -------------------------------------------------------------------------------

def test_hermes_parallel_calls_and_the_text_before_them() -> None:
    text = ('Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "now", '
            '"arguments": {}}\n</tool_call>')
    check("hermes", text, "Let me look that up.",
          [("get_weather", {"city": "Paris", "days": 2}), ("now", {})])


def test_hermes_arguments_are_rewritten_as_json_dumps_writes_them() -> None:
    text = ('<tool_call>{"name":"f","arguments":{"s":"caf\\u00e9 \\/ \u00e9\\n","x":1E2,'
            '"y":[true,null,-0.50],"z":{ }}}</tool_call>')
    _, calls, deltas = run("hermes", text, 1)
    expected = '{"s": "caf\\u00e9 / \\u00e9\\n", "x": 100.0, "y": [true, null, -0.5], "z": {}}'
    assert calls[0][2] == expected
    assert "".join(d.arguments for d in deltas) == expected
    assert len(deltas) > 10  # streamed in pieces, not at the end


def test_hermes_name_is_streamed_before_the_arguments_are_complete() -> None:
    p = TOOL_PARSERS["hermes"](TOOLS)
    content, deltas = p.feed('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert content == "Sure."
    assert len(deltas) == 1 and deltas[0].name == "get_weather" and deltas[0].index == 0
    assert deltas[0].arguments == '{"ci'
    content, deltas = p.feed('ty": "Oslo"}}\n</tool_call>')
    assert content == "" and "".join(d.arguments for d in deltas) == 'ty": "Oslo"}'
    assert p.calls[0].arguments == '{"city": "Oslo"}'


def test_hermes_holds_back_what_might_be_a_tag_and_releases_it_when_not() -> None:
    p = TOOL_PARSERS["hermes"](TOOLS)
    assert p.feed("Use <tool")[0] == "Use"
    assert p.feed("s> wisely")[0] == " <tools> wisely"
    assert p.finish() == ("", [])


@pytest.mark.parametrize("text", [
    "Plain answer.\n", "a < b and <b>bold</b>, <tool_cal", "  spaced  \n\n", "</tool_call> stray",
])
def test_text_without_calls_is_content_unchanged(text: str) -> None:
    for parser in TOOL_PARSERS:
        if parser == "llama3_json" and text.lstrip().startswith("{"):
            continue
        for chunk in CHUNKS:
            content, calls, deltas = run(parser, text, chunk)
            assert (content, calls, deltas) == (text, [], []), (parser, chunk)


def test_hermes_malformed_call_is_content_not_lost() -> None:
    text = "Try <tool_call>{not json}</tool_call> again"
    check("hermes", text, text, [])
    text = '<tool_call>{"arguments": {"a": 1}}</tool_call>'  # no name
    check("hermes", text, text, [])
    text = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'  # arguments not an object
    check("hermes", text, text, [])


def test_hermes_cut_off_call_is_content_unless_its_object_is_complete() -> None:
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    for chunk in CHUNKS:
        content, calls, _ = run("hermes", cut, chunk)
        assert (content, calls) == (cut, [])
    whole = '<tool_call>\n{"name": "now", "arguments": {}}\n'
    check("hermes", whole, "", [("now", {})])


def test_hermes_arguments_as_a_string_and_name_after_arguments() -> None:
    text = ('<tool_call>{"arguments": "{\\"city\\": \\"Rome\\"}", "name": "get_weather"}'
            '</tool_call><tool_call>{"arguments": {"b": [1, 2]}, "name": "g"}</tool_call>')
    check("hermes", text, "", [("get_weather", {"city": "Rome"}), ("g", {"b": [1, 2]})])


def test_hermes_random_arguments_round_trip() -> None:
    rng = random.Random(7)

    def value(depth: int) -> Any:
        r = rng.random()
        if depth > 2 or r < 0.4:
            return rng.choice([0, -3, 2.5, 1e21, "x\"y\\z\u00e9\U0001F600\t", "", True, None])
        if r < 0.7:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{rng.randint(0, 9)}\u00fc": value(depth + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(200):
        args = {"a": value(0), "b": value(0)}
        written = json.dumps({"name": "f", "arguments": args}, indent=rng.choice([None, 2]),
                             ensure_ascii=rng.random() < 0.5)
        _, calls, deltas = run("hermes", f"<tool_call>{written}</tool_call>", rng.randint(1, 9))
        assert json.loads(calls[0][2]) == args
        assert calls[0][2] == json.dumps(args)
        assert "".join(d.arguments for d in deltas) == json.dumps(args)


# --- mistral and llama3_json --------------------------------------------------------------

def test_mistral_list_format() -> None:
    text = ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
            '{"name": "now", "arguments": {}}]')
    check("mistral", text, "Checking.", [("get_weather", {"city": "Lyon"}), ("now", {})])
    unclosed = '[TOOL_CALLS][{"name": "now", "arguments": {}}'  # cut before "]": the call stands
    check("mistral", unclosed, "", [("now", {})])


def test_mistral_name_args_format_with_and_without_call_id() -> None:
    text = ('[TOOL_CALLS]get_weather[ARGS]{"city":"Nice","days":1}'
            '[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}')
    check("mistral", text, "", [("get_weather", {"city": "Nice", "days": 1}), ("now", {})])


def test_mistral_malformed_is_content() -> None:
    text = "[TOOL_CALLS][{\"name\": oops}]"
    check("mistral", text, text, [])
    text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": "
    check("mistral", text, text, [])


def test_llama3_json_bare_and_after_python_tag() -> None:
    text = ' {"name": "get_weather", "parameters": {"city": "Bern"}}; {"name": "now", "parameters": {}}'
    check("llama3_json", text, "", [("get_weather", {"city": "Bern"}), ("now", {})])
    text = 'One moment. <|python_tag|>{"name": "now", "parameters": {}}'
    check("llama3_json", text, "One moment.", [("now", {})])


def test_llama3_json_malformed_is_content() -> None:
    text = '{"name": "now", "parameters": {} trailing'
    check("llama3_json", text, text, [])


# --- deepseek_v3 and deepseek_v31 ---------------------------------------------------------

DS_V3 = ("Let me check.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
         '\n```json\n{"city": "Tokyo", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
         "function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DS_V31 = ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Tokyo",'
          '"days":2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
          "<｜tool▁calls▁end｜>")


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_reads_both_forms_of_its_calls(parser: str) -> None:
    calls = [("get_weather", {"city": "Tokyo", "days": 2}), ("now", {})]
    check(parser, DS_V3, "Let me check.", calls)
    check(parser, DS_V31, "Sure.", calls)
    # a section left open (the model stopped after its last call) keeps its calls
    check(parser, DS_V31.removesuffix("<｜tool▁calls▁end｜>") + "\n", "Sure.", calls)
    # cut off before a call's end tag: its complete arguments still make the call
    cut = DS_V3[:DS_V3.index("{}") + 2]
    check(parser, cut, "Let me check.", calls)


@pytest.mark.parametrize("text", [
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{} oops",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>now\n```json\n{}\n```",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>",
    "<｜tool▁calls▁begin｜>no call here",
    "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
])
def test_deepseek_malformed_is_content(text: str) -> None:
    # a non-function type, a name with a space, bad JSON, no call in the section
    check("deepseek_v3", "Hm. " + text, "Hm. " + text, [])


def test_deepseek_writes_its_own_form() -> None:
    v3, v31 = TOOL_PARSERS["deepseek_v3"], TOOL_PARSERS["deepseek_v31"]
    calls = [("get_weather", {"city": "Tokyo", "days": 2}), ("now", {})]
    assert v3.format_calls(calls) == DS_V3.removeprefix("Let me check.\n\n").replace(
        '{"city": "Tokyo", "days": 2}', json.dumps(calls[0][1]))
    assert v31.format_calls(calls) == DS_V31.removeprefix("Sure.").replace(
        '{"city":"Tokyo","days":2}', json.dumps(calls[0][1]))
    assert v31.format_results(["12"]) == "<｜tool▁output▁begin｜>12<｜tool▁output▁end｜>"


# --- kimi_k2 ------------------------------------------------------------------------------

KIMI = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Tokyo", "days": 2}<|tool_call_end|>'
        "<|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>")


def test_kimi_calls_keep_the_models_ids() -> None:
    """Kimi-K2 heads each call with `functions.NAME:IDX`; that is the call's id, so the
    client's history renders through Kimi's template as the model wrote it."""
    calls = [("get_weather", {"city": "Tokyo", "days": 2}), ("now", {})]
    for text in (KIMI, KIMI.removesuffix("<|tool_calls_section_end|>"),
                 KIMI[:KIMI.index("{}") + 2]):  # section left open; cut before the end tag
        for chunk in CHUNKS:
            content, got, deltas = run("kimi_k2", text, chunk)
            assert content == "Let me check."
            assert [(n, json.loads(a)) for _, n, a in got] == calls
            assert [i for i, _, _ in got] == ["functions.get_weather:0", "functions.now:1"]
            assert assemble(deltas, re.compile(r"functions\.\w+:\d")) == got
    assert TOOL_PARSERS["kimi_k2"].format_calls(calls) == KIMI.removeprefix("Let me check.")


@pytest.mark.parametrize("text", [
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.now<|tool_call_argument_begin|>{}"
    "<|tool_call_end|>",  # no index
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:x<|tool_call_argument_begin|>{}"
    "<|tool_call_end|>",
    '<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{"a": '
    "<|tool_call_end|>",  # bad JSON
    "<|tool_calls_section_begin|><|tool_calls_section_end|>",
])
def test_kimi_malformed_is_content(text: str) -> None:
    for chunk in CHUNKS:
        content, calls, _ = run("kimi_k2", "Hm. " + text, chunk)
        assert (content, calls) == ("Hm. " + text, []), chunk


# --- glm45 --------------------------------------------------------------------------------

GLM = ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris 75"
       "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
       "<tool_call>now\n</tool_call>")


def test_glm_members_become_json_arguments_typed_by_the_schema() -> None:
    calls = [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]
    check("glm45", GLM, "Checking.", calls)
    # "city" is a string in the schema: digits stay text; "days" is not: read as JSON
    digits = GLM.replace("Paris 75", "75").replace("<arg_value>3<", "<arg_value>[1, 2]<")
    check("glm45", digits, "Checking.", [("get_weather", {"city": "75", "days": [1, 2]}),
                                         ("now", {})])


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
    "<tool_call>get_weather\n<arg_value>Paris</arg_value>\n</tool_call>",
    "<tool_call>get weather\n</tool_call>",
])
def test_glm_malformed_or_cut_off_is_content(text: str) -> None:
    check("glm45", "So: " + text, "So: " + text, [])


def test_glm_writes_its_own_form() -> None:
    calls = [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]
    assert TOOL_PARSERS["glm45"].format_calls(calls) == GLM.removeprefix("Checking.\n")


# --- qwen3_coder ---------------------------------------------------------------------------

QWEN = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis 75\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=now>\n</function>\n</tool_call>")


def test_qwen3_coder_parameters_become_json_arguments_typed_by_the_schema() -> None:
    calls = [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]
    check("qwen3_coder", QWEN, "I will check.", calls)
    two_lines = QWEN.replace("Paris 75", "line one\nline two")  # one newline each side is framing
    check("qwen3_coder", two_lines, "I will check.",
          [("get_weather", {"city": "line one\nline two", "days": 3}), ("now", {})])
    assert TOOL_PARSERS["qwen3_coder"].format_calls(calls) == QWEN.removeprefix("I will check.\n")


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
    "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
])
def test_qwen3_coder_malformed_or_cut_off_is_content(text: str) -> None:
    check("qwen3_coder", "So: " + text, "So: " + text, [])


# --- minimax_m2 ---------------------------------------------------------------------------

MINIMAX = ('Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
           'Paris 75</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
           '<invoke name="now">\n</invoke>\n</minimax:tool_call>')


def test_minimax_invokes_in_one_section_become_calls() -> None:
    calls = [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]
    check("minimax_m2", MINIMAX, "Let me look.", calls)
    # a section left open after its last call keeps the calls
    check("minimax_m2", MINIMAX.removesuffix("</minimax:tool_call>"), "Let me look.", calls)
    one = TOOL_PARSERS["minimax_m2"].format_calls(calls[:1])
    check("minimax_m2", one, "", calls[:1])


@pytest.mark.parametrize("text", [
    '<minimax:tool_call>\n<invoke name="now">\n<parameter name="x">1</parameter>\n',
    '<minimax:tool_call>\n<parameter name="x">1</parameter>\n</minimax:tool_call>',
    "<minimax:tool_call>\n</minimax:tool_call>",
])
def test_minimax_malformed_or_cut_off_is_content(text: str) -> None:
    check("minimax_m2", "So: " + text, "So: " + text, [])


# --- choosing a parser --------------------------------------------------------------------

def test_choose_tool_parser_flag_wins_and_unknown_names_the_known_ones() -> None:
    assert choose_tool_parser("mistral", "<tool_call>") == "mistral"
    with pytest.raises(ConfigError) as e:
        choose_tool_parser("qwen", None)
    for name in ("hermes", "mistral", "llama3_json"):
        assert name in str(e.value)


@pytest.mark.parametrize(("template", "expected"), [
    ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", "llama3_json"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
     "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']}}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
     "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", "deepseek_v31"),
    ("{{ '\\n<tool_call>' + tc.name }}{% for k, v in _args.items() %}<arg_key>{{ k }}"
     "</arg_key>{% endfor %}", "glm45"),
    ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "qwen3_coder"),
    ("{{- '<minimax:tool_call>\\n' }}{{- '<invoke name=\"' + tool_call.name + '\">' }}",
     "minimax_m2"),
    ("{{- '<|start|>assistant to=functions.' + tc.name + '<|channel|>commentary json' }}",
     "gpt_oss"),
    ("{%- for tool_call in message.tool_calls -%}<|tool_calls_section_begin|>"
     "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>", "kimi_k2"),
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_choose_tool_parser_from_the_template(template: str | None, expected: str) -> None:
    assert choose_tool_parser(None, template) == expected


# --- forced grammars ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def lltok() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tiny_tokenizer(512).tk.to_str(), eos_token=2)


def accepts(lltok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return bool(m.consume_tokens(lltok.tokenize_str(text))) and m.is_accepting()


NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED = [  # (parser, choice, parallel, accepted, rejected)
    ("hermes", NAMED, False,
     ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'],
     ['<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
      '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>',
      'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
      '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>']),
    ("hermes", "required", True,
     ['<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>\n'
      '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'],
     ["", '<tool_call>\n{"name": "later", "arguments": {}}\n</tool_call>']),
    ("mistral", NAMED, False,
     ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}]'],
     ['[TOOL_CALLS][{"name": "now", "arguments": {}}]']),
    ("llama3_json", "required", True,
     ['{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}'],
     ['{"name": "now", "arguments": {}}']),
    ("deepseek_v3", "required", True,
     [DS_V3.removeprefix("Let me check.\n\n")],
     [DS_V31.removeprefix("Sure."), "Hi " + DS_V3.removeprefix("Let me check.\n\n")]),
    ("glm45", "required", True,
     [GLM.removeprefix("Checking.\n")],
     ["<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
      "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
      "<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>"]),
    ("qwen3_coder", NAMED, False,
     ["<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
      "</function>\n</tool_call>"],
     ["<tool_call>\n<function=now>\n</function>\n</tool_call>",
      "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
      "</tool_call>"]),
    ("minimax_m2", "required", False,
     ['<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n'
      "</invoke>\n</minimax:tool_call>"],
     ['<minimax:tool_call>\n<invoke name="later">\n</invoke>\n</minimax:tool_call>']),
    ("gpt_oss", NAMED, True,  # one call whatever parallel says: <|call|> ends the turn
     ['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
      '{"city": "Oslo", "days": 2}'],
     ['<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}',
      '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
      '{"city": "Oslo"}<|call|><|channel|>commentary to=functions.get_weather '
      '<|constrain|>json<|message|>{"city": "Oslo"}',
      '<|channel|>final<|message|>{"city": "Oslo"}']),
    ("kimi_k2", "required", True,
     ["<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
      '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>'
      "functions.now:4<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"],
     ["<|tool_calls_section_begin|><|tool_call_begin|>functions.now<|tool_call_argument_begin|>"
      "{}<|tool_call_end|><|tool_calls_section_end|>",
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.later:0"
      "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
      "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:1234567"  # 7 digits
      "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"]),
    ("deepseek_v31", NAMED, False,
     ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"],
     ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>",
      '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"days": 1}'
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"]),
]


@pytest.mark.parametrize(("parser", "choice", "parallel", "good", "bad"), FORCED)
def test_forced_grammar_compiles_accepts_its_format_and_rejects_others(
        lltok: llguidance.LLTokenizer, parser: str, choice: Any, parallel: bool,
        good: list[str], bad: list[str]) -> None:
    grammar = TOOL_PARSERS[parser].forced_grammar(TOOLS, choice, parallel)
    assert llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(grammar), lltok) == ""
    for text in good:
        assert accepts(lltok, grammar, text), text
        _, calls, _ = run(parser, text, 3)  # and the parser reads what the grammar forces
        assert calls and all(json.loads(a) is not None for _, _, a in calls)
    for text in bad:
        assert not accepts(lltok, grammar, text), text


@pytest.mark.parametrize(("parser", "choice", "parallel", "good", "bad"),
                         [f for f in FORCED
                          if any(t in f[3][0] for t in TOOL_PARSERS[f[0]].special_tags)])
def test_forced_grammar_writes_special_tags_as_the_tokens_the_model_writes(
        parser: str, choice: Any, parallel: bool, good: list[str], bad: list[str]) -> None:
    """Where the tokenizer holds the family's tags as special tokens (Mistral's, DeepSeek's,
    GLM's), the model writes each tag as one token: the grammar must allow that token, which a
    quoted literal does not (llguidance matches it against text only)."""
    cls = TOOL_PARSERS[parser]
    tok = tiny_tokenizer(512, cls.special_tags)
    lltok = llguidance.LLTokenizer(tok.tk.to_str(), eos_token=2)
    special = special_tag_ids(tok, cls.special_tags)
    assert sorted(special) == sorted(cls.special_tags)
    grammar = cls.forced_grammar(TOOLS, choice, parallel, special)
    quoted = cls.forced_grammar(TOOLS, choice, parallel)

    def accepts_ids(grammar: str, ids: list[int]) -> bool:
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar),
                                 log_level=0)
        return m.consume_tokens(ids) and m.is_accepting()

    for text in good:
        ids = [*tok.encode(text), 2]
        assert set(special.values()) & set(ids)
        assert accepts_ids(grammar, ids), text
        assert not accepts_ids(quoted, ids), text
        shown = tok.decode(ids, keep=frozenset(special.values()))
        assert shown == text
        assert run(parser, shown, 3)[1]
    for text in bad:
        assert not accepts_ids(grammar, [*tok.encode(text), 2]), text


@pytest.mark.parametrize("parser", ["glm45", "qwen3_coder", "minimax_m2"])
def test_tagged_member_grammars_bound_a_strings_length(lltok: llguidance.LLTokenizer,
                                                       parser: str) -> None:
    """A string member's text is as long as its schema's minLength/maxLength allow (the value
    the parser reads, Qwen3-Coder's newline before the closing tag not counted)."""
    cls = TOOL_PARSERS[parser]
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "required": ["text", "tag"], "properties": {
            "text": {"type": "string", "maxLength": 5}, "tag": {"type": "string", "minLength": 2}}}}}
    grammar = cls.forced_grammar([note], "required", False)

    def call(text: str, tag: str) -> str:
        return cls.format_calls([("note", {"text": text, "tag": tag})])

    assert accepts(lltok, grammar, call("abcde", "xy"))
    assert accepts(lltok, grammar, call("a", "xyz"))
    assert not accepts(lltok, grammar, call("abcdef", "xy"))  # over maxLength
    assert not accepts(lltok, grammar, call("abc", "x"))  # under minLength
    _, calls, _ = run(parser, call("abcde", "xy"), 3, [note])
    assert [json.loads(a) for _, _, a in calls] == [{"text": "abcde", "tag": "xy"}]


def test_forced_grammar_single_call_when_not_parallel(lltok: llguidance.LLTokenizer) -> None:
    grammar = TOOL_PARSERS["hermes"].forced_grammar(TOOLS, "required", False)
    one = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert accepts(lltok, grammar, one)
    assert not accepts(lltok, grammar, one + "\n" + one)


def test_forced_grammar_bad_choice_or_tools_are_typed_errors() -> None:
    hermes = TOOL_PARSERS["hermes"]
    with pytest.raises(InvalidRequest, match="tool_choice"):
        hermes.forced_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}}, False)
    with pytest.raises(InvalidRequest, match=r"tools\[1\]\.function\.name"):
        hermes.forced_grammar([WEATHER, {"type": "function", "function": {}}], "required", False)
    with pytest.raises(InvalidRequest, match="tools"):
        hermes.forced_grammar([], "required", False)


# --- tags that tokenizers hold as special tokens ------------------------------------------

@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}', "Sure.",
     [("get_weather", {"city": "Lyon"})]),
    ("llama3_json", 'One moment.<|python_tag|>{"name": "now", "parameters": {}}', "One moment.",
     [("now", {})]),
    ("deepseek_v31", DS_V31, "Sure.", [("get_weather", {"city": "Tokyo", "days": 2}), ("now", {})]),
    ("kimi_k2", KIMI, "Let me check.", [("get_weather", {"city": "Tokyo", "days": 2}), ("now", {})]),
    ("glm45", GLM, "Checking.", [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]),
    ("minimax_m2", MINIMAX, "Let me look.",
     [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]),
    ("qwen3_coder", QWEN, "I will check.",
     [("get_weather", {"city": "Paris 75", "days": 3}), ("now", {})]),
])
def test_special_token_tags_reach_the_parser_token_by_token(
        parser: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """Mistral's `[TOOL_CALLS]`/`[ARGS]` and Llama's `<|python_tag|>` are special tokens in their
    tokenizers, which the detokenizer drops; the parser's tags are kept (and nothing else)."""
    from tokenizers import AddedToken

    from ftrs.server.detokenize import IncrementalDetokenizer

    tok = tiny_tokenizer(512)
    cls = TOOL_PARSERS[parser]
    tok.tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in cls.special_tags])
    keep = tok.special_ids(cls.special_tags)
    assert len(keep) == len(cls.special_tags)
    assert tok.special_ids(["<|im_end|>", "not a token"]) == {2}  # special, but no tag
    ids = [*tok.encode(text), 2]  # the model's tokens, ending in <|im_end|>

    def stream(keep: frozenset[int]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        detok, p, out = IncrementalDetokenizer(tok, keep=keep), cls(TOOLS), ""
        for i in ids:
            c, _ = p.feed(detok.push([i]))
            out += c
        c, _ = p.finish()
        return out + c, [(x.name, json.loads(x.arguments)) for x in p.calls]

    assert stream(keep) == (content, calls)
    assert stream(frozenset())[1] == []  # dropped tags: the calls would be lost as text
    assert tok.decode(ids, keep=keep) == text  # <|im_end|> still skipped


# --- every family: a generation cut off by max_tokens -----------------------------------------

@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_call_cut_off_by_max_tokens_is_dropped_not_content(parser: str) -> None:
    """`finish(cut=True)`: the parser's own markup half written when the tokens ran out is not
    the assistant's text (it was: a forced call's second `<tool_call>\\n{"name":` came back as
    `content`). A call complete before it still counts; without the cut it stays content."""
    cls = TOOL_PARSERS[parser]
    if cls.format_calls is ToolParser.format_calls:
        pytest.skip(f"{parser} writes no calls of its own")
    both = cls.format_calls([("now", {}), ("get_weather", {"city": "Paris", "days": 2})])
    text = both[:both.index("Paris") + 2]  # the second call cut off inside its arguments
    for cut, content in ((True, ""), (False, None)):
        p = cls(TOOLS)
        got, _ = p.feed(text)
        more, _ = p.finish(cut=cut)
        assert [c.name for c in p.calls] == ["now"], (parser, text)
        if content is not None:
            assert (got + more).strip() == content, (parser, got + more)
        else:  # not cut: what did not parse is shown, not lost
            assert (got + more).strip() != ""


# --- every family: a call of a tool that was not offered --------------------------------------

@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_call_of_a_tool_not_offered_is_content_and_never_streamed(parser: str) -> None:
    """A model that calls a name it was not given (the system prompt's example, a tool of its
    training) produces text, not a call an agent cannot dispatch; a call beside it of a tool
    offered still counts."""
    cls = TOOL_PARSERS[parser]
    if cls.format_calls is ToolParser.format_calls:
        pytest.skip(f"{parser} writes no calls of its own")
    alone = cls.format_calls([("delete_everything", {"path": "/"})])
    for chunk in CHUNKS:
        content, calls, deltas = run(parser, alone, chunk, TOOLS)
        assert (calls, deltas) == ([], []), (parser, chunk)
        assert "delete_everything" in content, (parser, chunk, content)
    both = cls.format_calls([("delete_everything", {"path": "/"}), ("now", {})])
    for chunk in CHUNKS:
        content, calls, deltas = run(parser, both, chunk, TOOLS)
        assert [n for _, n, _ in calls] == ["now"], (parser, chunk)
        assert assemble(deltas, re.compile(".+")) == calls, (parser, chunk)
        assert "delete_everything" in content, (parser, chunk, content)
