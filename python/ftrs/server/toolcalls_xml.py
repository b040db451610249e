"""Tool calls whose arguments are written as tagged members, not JSON, parsed incrementally:
GLM-4.5's (`glm45`: GLM-4.5, 4.6, 4.7, 4.5-Air), Qwen3-Coder's (`qwen3_coder`, and any
template that writes `<function=`) and MiniMax-M2's (`minimax_m2`: a `<minimax:tool_call>`
section of `<invoke name="..">` calls with `<parameter name="..">` members). As the first two
chat templates write them:

    <tool_call>get_weather                     <tool_call>
    <arg_key>city</arg_key>                    <function=get_weather>
    <arg_value>Paris</arg_value>               <parameter=city>
    <arg_key>days</arg_key>                    Paris
    <arg_value>3</arg_value>                   </parameter>
    </tool_call>                               <parameter=days>
                                               3
                                               </parameter>
                                               </function>
                                               </tool_call>

A value is the text itself for a string, JSON (the templates' `tojson`) otherwise: the parser
reads a value as a string where the tool's schema says `string`, else as JSON (the text itself
when it is not). The arguments are streamed as JSON a member at a time, through the same
`CallStream` as every family, so the pieces add up to `json.dumps(arguments)`. The forced
grammars write the schema's properties in order (the required ones always): a string as
non-empty text without `<` (an enum as one of its strings), anything else as JSON by its own
schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from ftrs.server.toolbase import (
    CallStream,
    args_schema,
    arguments_of,
    chosen_functions,
    lark_literal,
    standalone,
)
from ftrs.server.toolstate import StateToolParser

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
FUNCTION, FUNCTION_END, PARAM, PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"
_LONGEST_NAME = 256  # no function or argument name is longer: a longer one is not a call


class _MemberToolParser(StateToolParser):
    """What both families share: the states' plumbing (`_st_<state>` methods, "out" and
    "bad" here), members typed by the schema and streamed as JSON, the call closed or shown
    as content."""

    special_tags: ClassVar[tuple[str, ...]] = (START, END)

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._props: dict[str, dict[str, Any]] = {}  # tool -> its parameters' properties
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            params = fn.get("parameters") if isinstance(fn, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                props = params.get("properties") if isinstance(params, dict) else None
                self._props[fn["name"]] = props if isinstance(props, dict) else {}
        self._key = ""
        self._members = 0

    def _until(self, tag: str) -> str | None:
        """The text before `tag` (both consumed), or None while `tag` has not come."""
        i = self._buf.find(tag)
        if i < 0:
            return None
        text = self._take(i)
        self._take(len(tag))
        return text

    SECTION = START

    def _open(self, name: str, state: str) -> bool:
        name = name.strip()
        if not name or any(c in name for c in " \t\n{}[]\"'<>="):
            return self._bad()
        self._call, self._members, self._state = CallStream(self._take_index, name), 0, state
        return True

    def _member(self, key: str, text: str) -> None:
        """One argument, its text typed by the tool's schema, streamed as a JSON member."""
        assert self._call is not None and self._call.name is not None
        value = _typed(self._props.get(self._call.name, {}).get(key), text)
        piece = ("{" if self._members == 0 else ", ") + f"{json.dumps(key)}: {json.dumps(value)}"
        self._members += 1
        self._stream(self._call, piece)

    def _close_call(self) -> bool:
        assert self._call is not None and self._call.name is not None
        self._stream(self._call, "}" if self._members else "{}")
        args = arguments_of({"arguments": json.loads(self._call.raw)})
        assert args is not None  # invariant: the object was written here
        self._finish_call(self._call, (self._call.name, args), "")
        self._call, self._raw, self._state = None, [], "out"
        return True

    def _close(self) -> None:
        if self._state == "out":
            self._show_held()
        else:  # a call that did not end: its text is content
            self._malformed("".join(self._raw) + self._buf)
        self._buf, self._raw, self._state = "", [], "out"

    # --- the format: a call is OPEN, then per member HEAD, its value and TAIL, then CLOSE ----

    OPEN = HEAD = TAIL = CLOSE = ""  # "{name}" and "{key}" stand for the call's and member's
    #: what follows a free-text value in a forced call (Qwen's newline before </parameter>
    #: belongs to the text: the grammar's text runs up to a `<`)
    TEXT_TAIL = ""

    @classmethod
    def _call_text(cls, name: str, members: list[tuple[str, str]]) -> str:
        """A call as the model writes it, its members' values already as text."""
        return (cls.OPEN.replace("{name}", name)
                + "".join(cls.HEAD.replace("{key}", k) + v + cls.TAIL for k, v in members)
                + cls.CLOSE)

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        fns = chosen_functions(tools, choice)
        lines = ['start: call ("\\n" call)*' if parallel else "start: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
        for i, (name, params) in enumerate(fns):
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            members = []
            for j, (key, schema) in enumerate(props.items()):
                members.append(f"arg_{i}_{j}" if key in required else f"arg_{i}_{j}?")
                value = _value_rule(standalone(schema, params) if isinstance(schema, dict) else {},
                                    bool(cls.TEXT_TAIL))
                tail = cls.TEXT_TAIL or cls.TAIL if value.startswith("/") else cls.TAIL
                head = lark_literal(cls.HEAD.replace("{key}", key), special)
                lines.append(f"arg_{i}_{j}: {head} value_{i}_{j} {lark_literal(tail, special)}")
                lines.append(f"value_{i}_{j}: {value}")
            lines.append(f"call_{i}: {lark_literal(cls.OPEN.replace('{name}', name), special)} "
                         f"{' '.join(members)} {lark_literal(cls.CLOSE, special)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(cls._call_text(name, [
            (k, v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
            for k, v in args.items()]) for name, args in calls)

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


class GlmToolParser(_MemberToolParser):
    name = "glm45"
    special_tags = (START, END, KEY, KEY_END, VALUE, VALUE_END)
    FIRST = "name"  # "name" the line after <tool_call>; "args" between members; "key",
    # "pre_value" and "value" in a member

    def _st_name(self) -> bool:
        ends = [i for tag in ("\n", KEY, END) if (i := self._buf.find(tag)) >= 0]
        if not ends:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        return self._open(self._take(min(ends)), "args")

    def _st_args(self) -> bool:
        tag = self._after_space(KEY, END)
        if tag is None:
            return self._bad()
        if tag == KEY:
            self._state = "key"
        elif tag == END:
            return self._close_call()
        return bool(tag)

    def _st_key(self) -> bool:
        key = self._until(KEY_END)
        if key is None:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        self._key, self._state = key.strip(), "pre_value"
        return True

    def _st_pre_value(self) -> bool:
        tag = self._after_space(VALUE)
        if tag is None:
            return self._bad()
        if tag:
            self._state = "value"
        return bool(tag)

    def _st_value(self) -> bool:
        text = self._until(VALUE_END)
        if text is None:
            return False
        self._member(self._key, text)
        self._state = "args"
        return True

    OPEN, HEAD, TAIL, CLOSE = START + "{name}\n", KEY + "{key}" + KEY_END + "\n" + VALUE, \
        VALUE_END + "\n", END

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call functions to help with the request. Their signatures, "
                f"one per line, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
                "For each function call, output the function name and arguments in this "
                f"format:\n{START}{{function-name}}\n{KEY}{{arg-key-1}}{KEY_END}\n"
                f"{VALUE}{{arg-value-1}}{VALUE_END}\n...\n{END}")


class QwenCoderToolParser(_MemberToolParser):
    name = "qwen3_coder"
    FIRST = "function"  # "function" before <function=; "fname" its name; "params" between
    # parameters; "key" a parameter's name; "value" its text; "end" before </tool_call>

    def _st_function(self) -> bool:
        tag = self._after_space(FUNCTION)
        if tag is None:
            return self._bad()
        if tag:
            self._state = "fname"
        return bool(tag)

    def _st_fname(self) -> bool:
        name = self._until(">")
        if name is None:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        return self._open(name, "params")

    def _st_params(self) -> bool:
        tag = self._after_space(PARAM, FUNCTION_END)
        if tag is None:
            return self._bad()
        if tag:
            self._state = "key" if tag == PARAM else "end"
        return bool(tag)

    def _st_key(self) -> bool:
        key = self._until(">")
        if key is None:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        self._key, self._state = key.strip(), "value"
        return True

    def _st_value(self) -> bool:
        text = self._until(PARAM_END)
        if text is None:
            return False
        # the template puts the value on lines of its own
        self._member(self._key, text.removeprefix("\n").removesuffix("\n"))
        self._state = "params"
        return True

    def _st_end(self) -> bool:
        tag = self._after_space(END)
        if tag is None:
            return self._bad()
        return self._close_call() if tag else False

    OPEN = START + "\n" + FUNCTION + "{name}>\n"
    HEAD, TAIL, CLOSE = PARAM + "{key}>\n", "\n" + PARAM_END + "\n", FUNCTION_END + "\n" + END
    TEXT_TAIL = PARAM_END + "\n"

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = cls._call_text("function-name", [("parameter-name", "value")])
        return ("# Tools\n\nYou have access to these functions, one per line:\n<tools>\n"
                f"{listed}\n</tools>\n\nTo call a function, reply in this format:\n{example}")


class MiniMaxToolParser(_MemberToolParser):
    """MiniMax-M2's: a `<minimax:tool_call>` section of `<invoke name="..">` calls, each of
    `<parameter name="..">value</parameter>` members."""

    name = "minimax_m2"
    SECTION, SECTION_END = "<minimax:tool_call>", "</minimax:tool_call>"
    INVOKE, INVOKE_END = '<invoke name="', "</invoke>"
    PARAMETER = '<parameter name="'
    special_tags = (SECTION, SECTION_END)
    FIRST = "invoke"  # "invoke" between calls; "iname" a call's name; "params" between its
    # members; "key" a member's name; "value" its text

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._section_calls = 0

    def _st_out(self) -> bool:
        self._section_calls = 0
        return super()._st_out()

    def _st_invoke(self) -> bool:
        tag = self._after_space(self.INVOKE, self.SECTION_END)
        if tag is None:
            return self._bad()
        if tag == self.INVOKE:
            self._state = "iname"
        elif tag == self.SECTION_END:
            if not self._section_calls:  # an empty section: not a call, so content
                self._malformed("".join(self._raw))
            self._raw, self._state = [], "out"
        return bool(tag)

    def _st_iname(self) -> bool:
        name = self._until('">')
        if name is None:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        return self._open(name, "params")

    def _st_params(self) -> bool:
        tag = self._after_space(self.PARAMETER, self.INVOKE_END)
        if tag is None:
            return self._bad()
        if tag == self.PARAMETER:
            self._state = "key"
        elif tag == self.INVOKE_END:
            self._close_call()
            self._state = "invoke"
            self._section_calls += 1
        return bool(tag)

    def _st_key(self) -> bool:
        key = self._until('">')
        if key is None:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        self._key, self._state = key.strip(), "value"
        return True

    def _st_value(self) -> bool:
        text = self._until(PARAM_END)
        if text is None:
            return False
        self._member(self._key, text)
        self._state = "params"
        return True

    def _close(self) -> None:
        if self._state == "invoke" and self._section_calls and not self._buf.strip():
            self._buf, self._raw, self._state = "", [], "out"  # a section left open is fine
        super()._close()

    OPEN = SECTION + "\n" + INVOKE + '{name}">\n'
    HEAD, TAIL, CLOSE = PARAMETER + '{key}">', PARAM_END + "\n", INVOKE_END + "\n" + SECTION_END

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = cls._call_text("function-name", [("parameter-name", "value")])
        return ("# Tools\n\nYou may call one or more tools. They are, one per line:\n<tools>\n"
                f"{listed}\n</tools>\n\nTo call tools, reply in this format:\n{example}")


def _typed(schema: Any, text: str) -> Any:
    """A value's text as its schema reads it: a string where it says `string`, else JSON (the
    text itself when it is not)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _value_rule(schema: dict[str, Any], newline: bool) -> str:
    """A value's grammar: a string's text (an enum's strings), anything else JSON by its schema."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) and "<" not in e for e in enum):
        return " | ".join(lark_literal(e) for e in enum)
    if schema.get("type") == "string":
        return _text_rule(schema, newline)
    return f"%json {args_schema(schema)}"


def _text_rule(schema: dict[str, Any], newline: bool) -> str:
    """A string's text: no `<`, as long as `minLength`/`maxLength` allow (not empty unless they
    say so); `newline`: the format writes a newline before its closing tag (Qwen3-Coder's,
    which the parser drops), not counted."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    hi = hi if isinstance(hi, int) and hi >= 0 else None
    lo = lo if isinstance(lo, int) and lo >= 0 else min(1, 1 if hi is None else hi)
    bound = f"{{{lo},{'' if hi is None or hi < lo else hi}}}"
    return "/[^<]" + bound + ("\\n" if newline else "") + "/"


__all__ = ["GlmToolParser", "MiniMaxToolParser", "QwenCoderToolParser"]
