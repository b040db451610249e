"""Tool calls in the model's text: parsed incrementally per model family, and forced by a grammar.

A `ToolParser` sees one generation's text in pieces (`feed`, then `finish`) and returns the
content to show and `ToolCallDelta`s. The families (`TOOL_PARSERS`):
- `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
  several in a row for parallel calls;
- `mistral`: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`, or the newer
  `[TOOL_CALLS]name[ARGS]{..}` (optionally `[CALL_ID]id` before `[ARGS]`), repeated;
- `llama3_json`: `{"name": .., "parameters": {..}}` as the whole answer or after
  `<|python_tag|>`, several separated by `;`;
- `deepseek_v3` (DeepSeek-V3, R1) and `deepseek_v31` (V3.1 on): `<｜tool▁calls▁begin｜>`, then
  per call `<｜tool▁call▁begin｜>`, `function<｜tool▁sep｜>name` and the arguments in a ```json
  fence, or (V3.1) `name<｜tool▁sep｜>{..}`, then `<｜tool▁call▁end｜>` (`toolcalls_deepseek`);
  `kimi_k2` (Kimi-K2): V3.1's structure under `<|tool_calls_section_begin|>`,
  `<|tool_call_begin|>functions.name:IDX<|tool_call_argument_begin|>{..}<|tool_call_end|>`, the
  head `functions.name:IDX` being the call's id (the history then renders as the model wrote it);
- `glm45` (GLM-4.5, 4.6, 4.7): `<tool_call>name` then `<arg_key>k</arg_key><arg_value>v</arg_value>`
  per argument, `</tool_call>`; `qwen3_coder` (Qwen3-Coder; any template writing `<function=`): `<tool_call>`,
  `<function=name>`, `<parameter=k>` v `</parameter>` per argument; `minimax_m2`:
  `<minimax:tool_call>`, `<invoke name="..">`, `<parameter name="..">v</parameter>` (`toolcalls_xml`);
- `gpt_oss` (harmony): a message to `functions.name` whose body is the arguments object, as the
  `gpt_oss` reasoning parser passes it on (`toolcalls_harmony`).

Streaming contract: a call's first delta carries its `index` (0, 1, .. in the order calls are
streamed), its `id` (`call_` + 24 random hex digits, or the model's own: Kimi-K2's; the same in
`calls`) and its name, as soon as
the name is complete; later deltas carry pieces of the arguments. The arguments text is
`json.dumps(arguments)` exactly (see `jsonecho`): the pieces add up to `ToolCall.arguments`.
Text that might be the start of a tag is held back until it is decided; whitespace right before
a call, and at the end once a call was made, is dropped; all other text outside calls is content
(with no call, the content is the text unchanged). A call that turns out malformed (bad
JSON, no name, arguments not an object, cut off) is returned as content, raw; deltas already
streamed for it stay sent, and it is not in `calls`.

`forced_grammar` writes a Lark grammar in llguidance's dialect (`%json {schema}` inside Lark) that
makes the model emit calls in the family's format: the named tool (its name as a `const`, its
arguments by its `parameters` schema) or any of the tools for `"required"`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ftrs.errors import ConfigError
from ftrs.server.toolbase import (
    CallStream,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    arguments_of,
    call_schema,
    chosen_functions,
    lark_literal,
    new_call_id,
    parse_object_call,
    split_at_tag,
)
from ftrs.server.toolcalls_deepseek import (
    DeepSeekToolParser,
    DeepSeekV31ToolParser,
    KimiK2ToolParser,
)
from ftrs.server.toolcalls_harmony import HarmonyToolParser
from ftrs.server.toolcalls_xml import GlmToolParser, MiniMaxToolParser, QwenCoderToolParser
from ftrs.server.toolstate import StateToolParser


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._call: CallStream | None = None
        self._body: list[str] = []

    def _advance(self) -> None:
        while True:
            if self._call is None:
                before, after, held = split_at_tag(self._buf, self.START)
                self._show(before)
                if after is None:
                    self._buf = held
                    return
                self._enter_call()
                self._buf, self._call, self._body = after, CallStream(self._take_index), []
            else:
                before, after, held = split_at_tag(self._buf, self.END)
                self._body.append(before)
                self._stream(self._call, before)
                if after is None:
                    self._buf = held
                    return
                self._buf = after
                self._end_call(closed=True)

    def _end_call(self, closed: bool, tail: str = "") -> None:
        assert self._call is not None
        body = "".join(self._body)
        raw = self.START + body + (self.END if closed else tail)
        self._finish_call(self._call, parse_object_call(body), raw)
        self._call = None

    def _close(self) -> None:
        if self._call is not None:  # cut off before the end tag: a complete object still counts
            tail, self._buf = self._buf, ""
            self._end_call(closed=False, tail=tail)
        self._show_held()
        self._buf = ""

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        schema = call_schema(chosen_functions(tools, choice), "arguments")
        calls, nl = ('call ("\\n" call)*' if parallel else "call"), "\n"
        return (f"start: {calls}\n"
                f"call: {lark_literal(cls.START + nl, special)} body "
                f"{lark_literal(nl + cls.END, special)}\n"
                f"body: %json {schema}\n")

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call functions to help with the request. Their signatures, "
                f"one per line, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
                "To call one, write a JSON object with the function's name and arguments "
                "inside <tool_call></tool_call> tags, one call per pair of tags:\n"
                '<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n'
                "</tool_call>")

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
            + "\n</tool_call>" for n, a in calls)

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


class MistralToolParser(StateToolParser):
    name = "mistral"
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    special_tags = (TAG, ARGS, CALL_ID)

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        # "out" content; "pre" after the tag; "list" in [..] between calls; "obj" a call object;
        # "name" / "id" before [ARGS]; "args" the arguments object; "bad" malformed to the end.

    def _st_out(self) -> bool:
        before, after, held = split_at_tag(self._buf, self.TAG)
        self._show(before)
        if after is None:
            self._buf = held
            return False
        self._buf, self._raw, self._state = after, [self.TAG], "pre"
        self._enter_call()
        return True

    def _st_pre(self) -> bool:
        stripped = self._buf.lstrip()
        self._take(len(self._buf) - len(stripped))
        if not self._buf:
            return False
        if self._buf[0] == "[":
            self._take(1)
            self._state = "list"
        else:
            self._state = "name"
        return True

    def _st_list(self) -> bool:
        stripped = self._buf.lstrip()
        self._take(len(self._buf) - len(stripped))
        if not self._buf:
            return False
        ch = self._buf[0]
        if ch == "{":
            self._call, self._state = CallStream(self._take_index), "obj"
        elif ch == "," and self._call is not None:
            self._take(1)
        elif ch == "]" and self._call is not None:
            self._take(1)
            self._call, self._raw, self._state = None, [], "out"
        else:
            self._state = "bad"
        return True

    def _st_obj(self) -> bool:
        assert self._call is not None
        used = self._stream(self._call, self._buf)
        self._take(used)
        if self._call.error:
            self._state = "bad"
        elif self._call.done:
            parsed = parse_object_call(self._call.raw)
            if parsed is None:
                self._state = "bad"
            else:
                self._finish_call(self._call, parsed, "")
                self._raw, self._state = [], "list"
        return used > 0 or self._state != "obj"

    def _st_name(self) -> bool:
        found = [(i, tag) for tag in (self.ARGS, self.CALL_ID) if (i := self._buf.find(tag)) >= 0]
        if not found:
            if len(self._buf) > 256:  # no name is this long: not a call
                self._state = "bad"
                return True
            return False
        i, tag = min(found)
        name = self._buf[:i].strip()
        if not name or any(c in name for c in " \n\t{}[]\"'"):
            self._state = "bad"
            return True
        self._take(i + len(tag))
        self._call = CallStream(self._take_index, name)
        self._state = "args" if tag == self.ARGS else "id"
        return True

    def _st_id(self) -> bool:
        i = self._buf.find(self.ARGS)
        if i < 0:
            if len(self._buf) > 256:
                self._state = "bad"
                return True
            return False
        self._take(i + len(self.ARGS))
        self._state = "args"
        return True

    def _st_args(self) -> bool:
        done = self._stream_args()
        if done:
            assert self._call is not None and self._call.name is not None
            args = arguments_of({"arguments": json.loads(self._call.raw, strict=False)})
            assert args is not None  # the echo saw an object
            self._finish_call(self._call, (self._call.name, args), "")
            self._call, self._raw, self._state = None, [], "out"
        return done is not None

    def _close(self) -> None:
        if self._state == "out":
            self._show_held()
        else:  # a call section that did not end well: its text is content
            self._malformed("".join(self._raw) + self._buf)
        self._buf, self._raw, self._state = "", [], "out"

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        schema = call_schema(chosen_functions(tools, choice), "arguments")
        calls = 'body (", " body)*' if parallel else "body"
        return (f'start: {lark_literal(cls.TAG + "[", special)} {calls} "]"\n'
                f"body: %json {schema}\n")

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = json.dumps(tools, ensure_ascii=False)
        return ("You may call functions to help with the request. They are described by this "
                f"JSON list:\n{listed}\n\nTo call functions, answer with [TOOL_CALLS] followed "
                'by a JSON list of calls: [TOOL_CALLS][{"name": "function name", "arguments": '
                '{"argument": "value"}}]')

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        listed = [{"name": n, "arguments": a} for n, a in calls]
        return cls.TAG + json.dumps(listed, ensure_ascii=False)

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "\n".join(f"[TOOL_RESULTS]{r}[/TOOL_RESULTS]" for r in results)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    special_tags = (TAG,)

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        # "start" before any text; "out" content; "pre" before a call object; "obj" in one;
        # "after" after one (";" for another); "bad" malformed to the end.
        self._state = "start"
        self._call: CallStream | None = None
        self._raw: list[str] = []

    def _advance(self) -> None:
        while self._buf:
            if self._state == "bad":
                self._raw.append(self._buf)
                self._buf = ""
            elif self._state == "start":
                stripped = self._buf.lstrip()
                if not stripped:
                    return
                if stripped.startswith("{"):
                    self._open("", stripped)
                elif stripped.startswith(self.TAG):
                    self._open(self.TAG, stripped[len(self.TAG):])
                elif not self.TAG.startswith(stripped):
                    self._state = "out"
                else:
                    return
            elif self._state == "out":
                before, after, held = split_at_tag(self._buf, self.TAG)
                self._show(before)
                if after is None:
                    self._buf = held
                    return
                self._open(self.TAG, after)
            elif self._state in ("pre", "after"):
                stripped = self._buf.lstrip()
                self._raw.append(self._buf[: len(self._buf) - len(stripped)])
                self._buf = stripped
                if not stripped:
                    return
                if stripped[0] == "{" and self._state == "pre":
                    self._call, self._state = CallStream(self._take_index), "obj"
                elif stripped[0] == ";" and self._state == "after":
                    self._raw.append(";")
                    self._buf, self._state = stripped[1:], "pre"
                elif self._state == "after":
                    self._raw, self._state = [], "out"
                else:
                    self._state = "bad"
            else:
                assert self._call is not None
                used = self._stream(self._call, self._buf)
                self._raw.append(self._buf[:used])
                self._buf = self._buf[used:]
                if self._call.error:
                    self._state = "bad"
                elif self._call.done:
                    parsed = parse_object_call(self._call.raw)
                    if parsed is None:
                        self._state = "bad"
                    else:
                        self._finish_call(self._call, parsed, "")
                        self._raw, self._state = [], "after"

    def _open(self, raw: str, rest: str) -> None:
        """A call section begins with `raw` (the tag, or nothing before a bare "{")."""
        self._enter_call()
        self._raw, self._buf, self._state = [raw], rest, "pre"

    def _close(self) -> None:
        if self._state in ("start", "out"):
            self._show_held()
        elif self._state != "after":
            raw = "".join(self._raw) + self._buf
            if raw.strip() != ";":
                self._malformed(raw)
        self._buf, self._raw, self._state = "", [], "out"

    @staticmethod
    def forced_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        schema = call_schema(chosen_functions(tools, choice), "parameters")
        calls = 'body ("; " body)*' if parallel else "body"
        return f"start: {calls}\nbody: %json {schema}\n"

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You may call functions to help with the request. Their signatures, one per "
                f"line:\n{listed}\n\nTo call one, answer with only a JSON object of the form "
                '{"name": "function name", "parameters": {"argument": "value"}}.')

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "\n".join(results)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "mistral": MistralToolParser,
    "llama3_json": Llama3JsonToolParser,
    "deepseek_v3": DeepSeekToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": GlmToolParser,
    "qwen3_coder": QwenCoderToolParser,
    "minimax_m2": MiniMaxToolParser,
    "gpt_oss": HarmonyToolParser,
}


def choose_tool_parser(flag: str | None, chat_template: str | None) -> str:
    """The `--tool-parser` flag if given, else the family the chat template writes, else hermes."""
    if flag is not None:
        if flag not in TOOL_PARSERS:
            raise ConfigError(f"--tool-parser: unknown parser {flag!r}; "
                              f"known: {', '.join(sorted(TOOL_PARSERS))}")
        return flag
    template = chat_template or ""
    if "<|channel|>" in template:  # gpt-oss's harmony messages
        return "gpt_oss"
    if "<|tool_calls_section_begin|>" in template:  # Kimi-K2's
        return "kimi_k2"
    if "<minimax:tool_call>" in template:
        return "minimax_m2"
    if "<arg_key>" in template:  # GLM-4.5's members inside its <tool_call>
        return "glm45"
    if "<function=" in template:  # Qwen3-Coder's <function=..><parameter=..>
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    if "tool▁calls▁begin" in template:  # DeepSeek's: V3/R1 fence the arguments, V3.1 does not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    return "hermes"


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolParser", "choose_tool_parser",
           "new_call_id"]
