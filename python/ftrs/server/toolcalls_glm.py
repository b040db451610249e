"""GLM-4.5's tool calls (`glm45`: GLM-4.5, 4.6, 4.7, 4.5-Air), parsed incrementally.

A call as GLM's chat template writes it (every tag is one token of its vocabulary):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

A value is the text itself for a string, JSON (the template's `tojson`) otherwise: the parser
reads a value as a string where the tool's schema says `string`, else as JSON (the text itself
when it is not). The arguments are streamed as JSON a member at a time, through the same
`CallStream` as every family, so the pieces add up to `json.dumps(arguments)`. The forced
grammar writes the schema's properties in order (the required ones always): a string as
non-empty text without `<` (an enum as one of its strings), anything else as JSON by its own
schema.
"""

from __future__ import annotations

import json
from typing import Any

from ftrs.server.toolbase import (
    CallStream,
    ToolParser,
    args_schema,
    arguments_of,
    chosen_functions,
    split_at_tag,
)

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_LONGEST_NAME = 256  # no function name is longer: a longer head is not a call


class GlmToolParser(ToolParser):
    name = "glm45"
    special_tags = (START, END, KEY, KEY_END, VALUE, VALUE_END)

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._props: dict[str, dict[str, Any]] = {}  # tool -> its parameters' properties
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            params = fn.get("parameters") if isinstance(fn, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                props = params.get("properties") if isinstance(params, dict) else None
                self._props[fn["name"]] = props if isinstance(props, dict) else {}
        # "out" content; "name" the line after <tool_call>; "args" between members; "key" and
        # "value" inside their tags; "pre_value" between them; "bad" malformed to the end
        self._state = "out"
        self._call: CallStream | None = None
        self._key = ""
        self._members = 0
        self._raw: list[str] = []  # the call's text so far, shown as content if malformed

    def _advance(self) -> None:
        while self._buf or self._state == "bad":
            if self._state == "bad":
                self._raw.append(self._buf)
                self._buf = ""
                return
            if not getattr(self, "_st_" + self._state)():
                return

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw.append(taken)
        return taken

    def _bad(self) -> bool:
        self._state = "bad"
        return True

    def _until(self, tag: str) -> str | None:
        """The text before `tag` (both consumed), or None while `tag` has not come."""
        i = self._buf.find(tag)
        if i < 0:
            return None
        text = self._take(i)
        self._take(len(tag))
        return text

    def _after_space(self, *tags: str) -> str | None:
        """The tag of `tags` the buffer starts with after whitespace (both consumed); "" while
        it may still become one; None when it cannot."""
        stripped = self._buf.lstrip()
        for tag in tags:
            if stripped.startswith(tag):
                self._take(len(self._buf) - len(stripped) + len(tag))
                return tag
        return "" if any(tag.startswith(stripped) for tag in tags) else None

    def _st_out(self) -> bool:
        before, after, held = split_at_tag(self._buf, START)
        self._show(before)
        if after is None:
            self._buf = held
            return False
        self._enter_call()
        self._raw, self._buf, self._state = [START], after, "name"
        return True

    def _st_name(self) -> bool:
        ends = [i for tag in ("\n", KEY, END) if (i := self._buf.find(tag)) >= 0]
        if not ends:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        name = self._take(min(ends)).strip()
        if not name or any(c in name for c in " \t{}[]\"'<>"):
            return self._bad()
        self._call, self._members, self._state = CallStream(self._take_index, name), 0, "args"
        return True

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
        assert self._call is not None and self._call.name is not None
        value = self._typed(self._call.name, self._key, text)
        piece = ("{" if self._members == 0 else ", ") + f"{json.dumps(self._key)}: {json.dumps(value)}"
        self._members += 1
        self._stream(self._call, piece)
        self._state = "args"
        return True

    def _typed(self, tool: str, key: str, text: str) -> Any:
        """A value's text as the tool's schema reads it: a string where it says `string`, else
        JSON (the text itself when it is not)."""
        if (self._props.get(tool, {}).get(key) or {}).get("type") == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

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
            self._show(self._buf)
        else:  # a call that did not end: its text is content
            self._malformed("".join(self._raw) + self._buf)
        self._buf, self._raw, self._state = "", [], "out"

    # --- the format -------------------------------------------------------------------------

    @staticmethod
    def forced_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool) -> str:
        fns = chosen_functions(tools, choice)
        lines = ['start: call ("\\n" call)*' if parallel else "start: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(fns))),
                 'text: /[^<]+/']
        for i, (name, params) in enumerate(fns):
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            members = []
            for j, (key, schema) in enumerate(props.items()):
                rule = f"arg_{i}_{j}"
                members.append(rule if key in required else f"{rule}?")
                head = json.dumps(f"{KEY}{key}{KEY_END}\n{VALUE}", ensure_ascii=False)
                tail = json.dumps(f"{VALUE_END}\n")
                lines.append(f"{rule}: {head} value_{i}_{j} {tail}")
                lines.append(f"value_{i}_{j}: {_value_rule(schema if isinstance(schema, dict) else {})}")
            opening = json.dumps(f"{START}{name}\n", ensure_ascii=False)
            lines.append(f"call_{i}: {opening} {' '.join(members)} {json.dumps(END)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call functions to help with the request. Their signatures, "
                f"one per line, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
                "For each function call, output the function name and arguments in this "
                f"format:\n{START}{{function-name}}\n{KEY}{{arg-key-1}}{KEY_END}\n"
                f"{VALUE}{{arg-value-1}}{VALUE_END}\n...\n{END}")

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        out = []
        for name, args in calls:
            members = "".join(
                f"{KEY}{k}{KEY_END}\n{VALUE}"
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{VALUE_END}\n"
                for k, v in args.items())
            out.append(f"{START}{name}\n{members}{END}")
        return "\n".join(out)

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def _value_rule(schema: dict[str, Any]) -> str:
    """A value's grammar: a string's text (an enum's strings), anything else JSON by its schema."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) and "<" not in e for e in enum):
        return " | ".join(json.dumps(e, ensure_ascii=False) for e in enum)
    if schema.get("type") == "string":
        return "text"
    return f"%json {args_schema(schema)}"


__all__ = ["GlmToolParser"]
