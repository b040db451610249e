"""Re-serialize a JSON object as it arrives, character by character, the way `json.dumps` writes it.

Tool-call arguments are streamed to clients in pieces, and the pieces must add up to
`json.dumps(json.loads(raw))` (separators `", "` and `": "`, ASCII escapes, numbers as Python
prints them). JSON's lexemes map to that form one at a time: whitespace between lexemes is
dropped, `,` and `:` gain their space, a string character is re-escaped alone
(`json.dumps(ch)[1:-1]`; the two halves of a surrogate pair come out as the same two escapes
`json.dumps` writes for the whole character), and a number is echoed as
`json.dumps(json.loads(number))` once the character after it shows where it ends. So the echo of
a prefix is always a prefix of the final form. One difference is left: a key repeated within an
object is echoed twice while `json.loads` keeps the last; callers compare at the end.

Each piece of output is tagged with the *member*: the key of the top object's member whose value
it belongs to (None for the top object's own braces, keys and separators), so a caller can
watch `"name"` and stream `"arguments"` of `{"name": ..., "arguments": {...}}`.
"""

from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")
_PLAIN = re.compile(r'[ !#-\[\]-~]+')  # printable ASCII but '"' and '\\': echoed as they are


def _escape(ch: str) -> str:
    if " " <= ch <= "~" and ch not in '"\\':
        return ch
    return json.dumps(ch)[1:-1]


class JsonEcho:
    """One JSON object, pushed a character at a time; `done` once it closed, `error` if it cannot
    be JSON (then nothing more is echoed)."""

    def __init__(self) -> None:
        # Open containers, innermost last: [kind "o"/"a", state, key being read]. Object states:
        # "k0" after "{", "k" after ",", ":" after a key, "v" after ":", "," after a value.
        # Array states: "v0" after "[", "v" after ",", "," after a value.
        self._stack: list[list[str]] = []
        self._lex = ""  # "" between lexemes, "s" string, "n" number, "l" literal
        self._text = ""  # the number or literal so far, or the hex digits of a \u escape
        self._esc = 0  # in a string: 0 plain, 1 after a backslash, 2 in \uXXXX
        self._is_key = False
        self._key = ""  # decoded text of the key being read
        self.member: str | None = None  # top-level member whose value is being echoed
        self.done = False
        self.error = False
        self._out: list[tuple[str, str | None]] = []

    def feed(self, text: str) -> tuple[int, list[tuple[str, str | None]]]:
        """Consume `text` up to the end of the object: (characters used, the echoed pieces with
        their member tags). Nothing is echoed once `error` is set."""
        self._out = []
        i, n = 0, len(text)
        while i < n and not self.done and not self.error:
            if self._lex == "s" and self._esc == 0:
                m = _PLAIN.match(text, i)  # a run of characters that stand for themselves
                if m:
                    if self._is_key:
                        self._key += m.group()
                    self._emit(m.group())
                    i = m.end()
                    continue
            self._step(text[i])
            i += 1
        if self.error:
            return i, []
        return i, self._out

    def _emit(self, text: str) -> None:
        self._out.append((text, self.member))

    def _fail(self) -> None:
        self.error = True

    def _step(self, ch: str) -> None:
        if self._lex == "s":
            self._string_char(ch)
        elif self._lex == "n":
            if ch in _NUMBER_CHARS:
                self._text += ch
                return
            if not _NUMBER.fullmatch(self._text):
                self._fail()
                return
            self._emit(json.dumps(json.loads(self._text)))
            self._lex = ""
            self._value_done()
            self._step(ch)
        elif self._lex == "l":
            self._text += ch
            if self._text in _LITERALS:
                self._emit(self._text)
                self._lex = ""
                self._value_done()
            elif not any(lit.startswith(self._text) for lit in _LITERALS):
                self._fail()
        elif ch not in _WS:
            self._structural(ch)

    def _structural(self, ch: str) -> None:
        if not self._stack:
            if ch != "{":
                self._fail()
                return
            return self._open("o", ch)
        top = self._stack[-1]
        kind, state = top[0], top[1]
        if state in ("k0", "k") and kind == "o":
            if ch == '"':
                self._is_key, self._key = True, ""
                self._lex = "s"
                self._emit('"')
            elif ch == "}" and state == "k0":
                self._close(ch)
            else:
                self._fail()
        elif state == ":":
            if ch != ":":
                self._fail()
                return
            top[1] = "v"
            self._emit(": ")
            if len(self._stack) == 1:
                self.member = top[2]
        elif state == ",":
            if ch == ",":
                top[1] = "k" if kind == "o" else "v"
                self._emit(", ")
            elif ch == ("}" if kind == "o" else "]"):
                self._close(ch)
            else:
                self._fail()
        elif ch == "]" and state == "v0":
            self._close(ch)
        else:
            self._value_start(ch)

    def _value_start(self, ch: str) -> None:
        if ch in "{[":
            self._open("o" if ch == "{" else "a", ch)
        elif ch == '"':
            self._is_key = False
            self._lex = "s"
            self._emit('"')
        elif ch == "-" or ch.isdigit():
            self._lex, self._text = "n", ch
        elif ch in "tfn":
            self._lex, self._text = "l", ch
        else:
            self._fail()

    def _open(self, kind: str, ch: str) -> None:
        self._stack.append([kind, "k0" if kind == "o" else "v0", ""])
        self._emit(ch)

    def _close(self, ch: str) -> None:
        self._emit(ch)
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        self._stack[-1][1] = ","
        if len(self._stack) == 1:
            self.member = None

    def _string_char(self, ch: str) -> None:
        decoded: str | None = None
        if self._esc == 0:
            if ch == '"':
                self._emit('"')
                self._lex = ""
                if self._is_key:
                    self._stack[-1][1], self._stack[-1][2] = ":", self._key
                else:
                    self._value_done()
                return
            if ch == "\\":
                self._esc = 1
                return
            decoded = ch  # raw control characters are accepted, as json.loads(strict=False) does
        elif self._esc == 1:
            if ch == "u":
                self._esc, self._text = 2, ""
                return
            if ch not in _ESCAPES:
                self._fail()
                return
            decoded, self._esc = _ESCAPES[ch], 0
        else:
            if ch not in _HEX:
                self._fail()
                return
            self._text += ch
            if len(self._text) < 4:
                return
            decoded, self._esc = chr(int(self._text, 16)), 0
        if self._is_key:
            self._key += decoded
        self._emit(_escape(decoded))


__all__ = ["JsonEcho"]
