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
import re
from collections.abc import Mapping
from typing import Any

from ftrs.server.toolbase import (
    CallStream,
    args_schema,
    arguments_of,
    chosen_functions,
    lark_literal,
)
from ftrs.server.toolstate import StateToolParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
_LONGEST_NAME = 256  # no function name is longer: a longer head is not a call


class DeepSeekToolParser(StateToolParser):
    name = "deepseek_v3"
    special_tags = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    #: the family's tags (Kimi-K2's parser reads the same structure under its own)
    _CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP = (CALLS_BEGIN, CALLS_END, CALL_BEGIN,
                                                             CALL_END, SEP)

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
        tag = self._after_space(self._CALL_BEGIN, self._CALLS_END)
        if tag is None:
            return self._bad()
        if tag == self._CALL_BEGIN:
            self._state = "head"
        elif tag == self._CALLS_END:
            if not self._section_calls:  # an empty section: not a call, so content
                self._malformed("".join(self._raw))
            self._raw, self._state = [], "out"
        return bool(tag)

    def _st_head(self) -> bool:
        i = self._buf.find(self._SEP)
        if i < 0:
            return self._bad() if len(self._buf) > _LONGEST_NAME else False
        self._head = self._buf[:i].strip()
        self._take(i + len(self._SEP))
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
        tag = self._after_space(FENCE_CLOSE if self._fenced else self._CALL_END)
        if tag is None:
            return self._bad()
        if tag == FENCE_CLOSE:
            self._fenced = False
        elif tag == self._CALL_END:
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
            self._show_held()
        elif self._state == "tail" and self._complete():
            pass  # cut off before the end tag: a complete object still counts
        elif not (self._state == "between" and self._section_calls and not self._buf.strip()):
            self._malformed("".join(self._raw) + self._buf)  # (a section left open is fine)
        self._buf, self._raw, self._state = "", [], "out"

    # --- the format -------------------------------------------------------------------------

    @classmethod
    def _call_text(cls, name: str, args: str, index: int = 0) -> str:
        """Call number `index` of a section, written (`args`: its arguments' JSON)."""
        return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}\n{args}\n{FENCE_CLOSE}{CALL_END}"

    _JOIN = "\n"  # between calls

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        fns = chosen_functions(tools, choice)
        join = f"{lark_literal(cls._JOIN)} " if cls._JOIN else ""
        lines = [f"start: {lark_literal(cls._CALLS_BEGIN, special)} calls "
                 f"{lark_literal(cls._CALLS_END, special)}",
                 f"calls: call ({join}call)*" if parallel else "calls: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
        for i, (name, params) in enumerate(fns):
            before, after = cls._call_text(name, "\0").split("\0")
            lines.append(f"call_{i}: {cls._lark_head(before, special)} args_{i} "
                         f"{lark_literal(after, special)}")
            lines.append(f"args_{i}: %json {args_schema(params)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def _lark_head(cls, before: str, special: Mapping[str, int] | None) -> str:
        """The grammar of a call's text before its arguments (`_call_text`'s)."""
        return lark_literal(before, special)

    _TOOLS_HEADING = "## Tools"

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        body = cls._JOIN.join(cls._call_text(n, json.dumps(a, ensure_ascii=False), i)
                              for i, (n, a) in enumerate(calls))
        return cls._CALLS_BEGIN + body + cls._CALLS_END

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "<｜tool▁outputs▁begin｜>" + "\n".join(
            OUTPUT_BEGIN + r + OUTPUT_END for r in results) + "<｜tool▁outputs▁end｜>"


class DeepSeekV31ToolParser(DeepSeekToolParser):
    """V3.1's form: the name before the separator, the arguments right after it."""

    name = "deepseek_v31"
    _JOIN = ""

    @classmethod
    def _call_text(cls, name: str, args: str, index: int = 0) -> str:
        return f"{cls._CALL_BEGIN}{name}{cls._SEP}{args}{cls._CALL_END}"

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "".join(OUTPUT_BEGIN + r + OUTPUT_END for r in results)


KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:{}\[\]\"']+):(\d+)")


class KimiK2ToolParser(DeepSeekV31ToolParser):
    """Kimi-K2's calls: V3.1's structure under its own tags, each call headed by its id,
    `functions.NAME:IDX` (IDX counts the conversation's calls), which is the call's id in the
    response too, so the history the client sends back renders as the model wrote it:

        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
        <|tool_call_argument_begin|>{ARGS}<|tool_call_end|>...<|tool_calls_section_end|>
    """

    name = "kimi_k2"
    special_tags = (KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGS)
    _CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP = special_tags
    SECTION = KIMI_CALLS_BEGIN
    _TOOLS_HEADING = "# Tools"

    def _open(self, name: str, fenced: bool) -> bool:
        head = _KIMI_ID.fullmatch(name)
        if head is None or fenced:
            return self._bad()
        if not super()._open(head.group(1), fenced=False):
            return False
        assert self._call is not None
        self._call.id = name  # the model's own id, for the history it will read again
        return True

    @classmethod
    def _call_text(cls, name: str, args: str, index: int = 0) -> str:
        return f"{KIMI_CALL_BEGIN}functions.{name}:{index}{KIMI_ARGS}{args}{KIMI_CALL_END}"

    @classmethod
    def _lark_head(cls, before: str, special: Mapping[str, int] | None) -> str:
        # a call's index is the conversation's count, not known here: a number (of at most six
        # digits, so a sampling model cannot write digits until max_tokens)
        head = before.removesuffix(f"0{KIMI_ARGS}")
        return (f"{lark_literal(head, special)} /[0-9]{{1,6}}/ "
                f"{lark_literal(KIMI_ARGS, special)}")

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "\n\n".join(f"## Return of call {i}\n{r}" for i, r in enumerate(results))


__all__ = ["DeepSeekToolParser", "DeepSeekV31ToolParser", "KimiK2ToolParser"]
