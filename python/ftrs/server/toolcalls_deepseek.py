"""DeepSeek's tool calls (DeepSeek-V3, R1, V3.1), parsed incrementally.

A call section as DeepSeek's chat templates write it (every tag is one token of its vocabulary):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGS}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3 and R1), or from V3.1 on `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>`.
One parser reads both: after the separator, an object opens V3.1's form, anything else V3's
(whose head must be the tool type, `function`). `deepseek_v3` and `deepseek_v31` differ in what
they write: the forced grammar, and calls and results for templates without tools. The streaming
contract and the handling of malformed calls are `toolcalls`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ftrs.server.toolbase import (
    CallStream,
    StateToolParser,
    args_schema,
    arguments_of,
    chosen_functions,
    lark_literal,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
_LONGEST_NAME = 256  # no function name is longer: a longer head is not a call


class DeepSeekToolParser(StateToolParser):
    name = "deepseek_v3"
    special_tags = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        # "out" content; "between" in a section, around its calls; "head" before the separator;
        # "kind" just after it; "name" V3's name line; "fence" before V3's ```json; "args" the
        # arguments object; "tail" after it, to the call's end tag; "bad" malformed to the end.
        self._head = ""
        self._fenced = False  # V3's form: a ``` closes the arguments before the end tag
        self._section_calls = 0  # (`_raw`: the section since its last complete call)

    SECTION, FIRST = CALLS_BEGIN, "between"

    def _st_out(self) -> bool:
        self._section_calls = 0
        return super()._st_out()

    def _st_between(self) -> bool:
        tag = self._after_space(CALL_BEGIN, CALLS_END)
        if tag is None:
            return self._bad()
        if tag == CALL_BEGIN:
            self._state = "head"
        elif tag == CALLS_END:
            if not self._section_calls:  # an empty section: not a call, so content
                self._malformed("".join(self._raw))
            self._raw, self._state = [], "out"
        return bool(tag)

    def _st_head(self) -> bool:
        i = self._buf.find(SEP)
        if i < 0:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        self._head = self._buf[:i].strip()
        self._take(i + len(SEP))
        self._state = "kind"
        return True

    def _st_kind(self) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == "{":  # V3.1: the head was the name
            return self._open(self._head, fenced=False)
        if self._head != "function":
            return self._bad()
        self._state = "name"
        return True

    def _st_name(self) -> bool:
        i = self._buf.find("\n")
        if i < 0:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        self._head = self._buf[:i].strip()
        self._take(i + 1)
        self._state = "fence"
        return True

    def _st_fence(self) -> bool:
        tag = self._after_space(FENCE_OPEN)
        if tag is None:
            return self._bad()
        return self._open(self._head, fenced=True) if tag else False

    def _open(self, name: str, fenced: bool) -> bool:
        if not name or any(c in name for c in " \n\t{}[]\"'"):
            return self._bad()
        self._call, self._fenced, self._state = CallStream(self._take_index, name), fenced, "args"
        return True

    def _st_args(self) -> bool:
        done = self._stream_args()
        if done:
            self._state = "tail"
        return done is not None

    def _st_tail(self) -> bool:
        tag = self._after_space(FENCE_CLOSE if self._fenced else CALL_END)
        if tag is None:
            return self._bad()
        if tag == FENCE_CLOSE:
            self._fenced = False
        elif tag == CALL_END:
            self._complete()
            return True
        return bool(tag)

    def _complete(self) -> bool:
        """The call whose arguments are complete is made (False, and "bad", if they are not an
        object)."""
        assert self._call is not None and self._call.name is not None
        args = arguments_of({"arguments": json.loads(self._call.raw, strict=False)})
        if args is None:
            self._state = "bad"
            return False
        self._finish_call(self._call, (self._call.name, args), "")
        self._call, self._raw, self._state = None, [], "between"
        self._section_calls += 1
        return True

    def _close(self) -> None:
        if self._state == "out":
            self._show(self._buf)
        elif self._state == "tail" and self._complete():
            pass  # cut off before the end tag: a complete object still counts
        elif not (self._state == "between" and self._section_calls and not self._buf.strip()):
            self._malformed("".join(self._raw) + self._buf)  # (a section left open is fine)
        self._buf, self._raw, self._state = "", [], "out"

    # --- the format -------------------------------------------------------------------------

    @classmethod
    def _call_text(cls, name: str, args: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}\n{args}\n{FENCE_CLOSE}{CALL_END}"

    _JOIN = "\n"  # between calls

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        fns = chosen_functions(tools, choice)
        join = f"{lark_literal(cls._JOIN)} " if cls._JOIN else ""
        lines = [f"start: {lark_literal(CALLS_BEGIN, special)} calls "
                 f"{lark_literal(CALLS_END, special)}",
                 f"calls: call ({join}call)*" if parallel else "calls: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
        for i, (name, params) in enumerate(fns):
            before, after = cls._call_text(name, "\0").split("\0")
            lines.append(f"call_{i}: {lark_literal(before, special)} args_{i} "
                         f"{lark_literal(after, special)}")
            lines.append(f"args_{i}: %json {args_schema(params)}")
        return "\n".join(lines) + "\n"

    _TOOLS_HEADING = "## Tools"

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        body = cls._JOIN.join(cls._call_text(n, json.dumps(a, ensure_ascii=False))
                              for n, a in calls)
        return CALLS_BEGIN + body + CALLS_END

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "<｜tool▁outputs▁begin｜>" + "\n".join(
            OUTPUT_BEGIN + r + OUTPUT_END for r in results) + "<｜tool▁outputs▁end｜>"


class DeepSeekV31ToolParser(DeepSeekToolParser):
    """V3.1's form: the name before the separator, the arguments right after it."""

    name = "deepseek_v31"
    _JOIN = ""

    @classmethod
    def _call_text(cls, name: str, args: str) -> str:
        return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "".join(OUTPUT_BEGIN + r + OUTPUT_END for r in results)


__all__ = ["DeepSeekToolParser", "DeepSeekV31ToolParser"]
