"""gpt-oss's tool calls (harmony), parsed incrementally.

A call is a message to `functions.NAME` whose body is the arguments object; `<|call|>` ends it
and the generation with it (one call per turn). The harmony reasoning parser
(`reasoning.HarmonyParser`) passes each call on in one canonical form, which is also what a
forced call is made to write:

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>

Content before it (a preamble) is content. The streaming contract and the handling of malformed
calls are `toolcalls`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ftrs.server.reasoning import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTIONS,
    LONGEST_HEADER,
    MESSAGE,
    START,
    harmony_call_header,
    harmony_header,
)
from ftrs.server.toolbase import (
    CallStream,
    args_schema,
    arguments_of,
    chosen_functions,
    lark_literal,
)
from ftrs.server.toolstate import StateToolParser


class HarmonyToolParser(StateToolParser):
    name = "gpt_oss"
    special_tags = (CHANNEL, CONSTRAIN, MESSAGE, CALL)
    # "out" content; "head" the header, to <|message|>; "args" the arguments object; "tail"
    # after it (an optional <|call|>); "bad" malformed to the end
    SECTION, FIRST = CHANNEL, "head"

    def _st_head(self) -> bool:
        i = self._buf.find(MESSAGE)
        if i < 0:
            return self._bad() if len(self._buf) > LONGEST_HEADER else False
        _, recipient = harmony_header(CHANNEL + self._buf[:i])
        name = recipient.removeprefix(FUNCTIONS)
        if not recipient.startswith(FUNCTIONS) or not name:
            return self._bad()
        self._take(i + len(MESSAGE))
        self._call, self._state = CallStream(self._take_index, name), "args"
        return True

    def _st_args(self) -> bool:
        done = self._stream_args()
        if not done:
            return done is not None
        assert self._call is not None and self._call.name is not None
        args = arguments_of({"arguments": json.loads(self._call.raw, strict=False)})
        if args is None:
            return self._bad()
        self._finish_call(self._call, (self._call.name, args), "")
        self._call, self._raw, self._state = None, [], "tail"
        return True

    def _st_tail(self) -> bool:
        tag = self._after_space(CALL)
        if tag == "":
            return False
        self._state = "out"  # after <|call|>, or text that is not one: content again
        return True

    def _close(self) -> None:
        if self._state in ("out", "tail"):
            self._show_held()
        else:  # a call that did not end well: its text is content
            self._malformed("".join(self._raw) + self._buf)
        self._buf, self._raw, self._state = "", [], "out"

    # --- the format -------------------------------------------------------------------------

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        """One call whatever `parallel` says: `<|call|>` ends gpt-oss's turn."""
        fns = chosen_functions(tools, choice)
        lines = ["start: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
        for i, (name, params) in enumerate(fns):
            head = lark_literal(harmony_call_header(FUNCTIONS + name), special)
            lines.append(f"call_{i}: {head} args_{i}")
            lines.append(f"args_{i}: %json {args_schema(params)}")
        return "\n".join(lines) + "\n"

    _EXAMPLE_NAME = "NAME"  # (a recipient holds no space)

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "".join(harmony_call_header(FUNCTIONS + n) + json.dumps(a, ensure_ascii=False)
                       + CALL for n, a in calls)

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        return "".join(f"{START}functions to=assistant{CHANNEL}commentary{MESSAGE}{r}{END}"
                       for r in results)


__all__ = ["HarmonyToolParser"]
