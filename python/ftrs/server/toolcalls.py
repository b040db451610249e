"""Tool calls in the model's text: parsed incrementally per model family, and forced by a grammar.

A `ToolParser` sees one generation's text in pieces (`feed`, then `finish`) and returns the
content to show and `ToolCallDelta`s. The families (`TOOL_PARSERS`):
- `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
  several in a row for parallel calls;
- `mistral`: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`, or the newer
  `[TOOL_CALLS]name[ARGS]{..}` (optionally `[CALL_ID]id` before `[ARGS]`), repeated;
- `llama3_json`: `{"name": .., "parameters": {..}}` as the whole answer or after
  `<|python_tag|>`, several separated by `;`.

Streaming contract: a call's first delta carries its `index` (0, 1, .. in the order calls are
streamed), its `id` (`call_` + 24 random hex digits, the same in `calls`) and its name, as soon as
the name is complete; later deltas carry pieces of the arguments. The arguments text is
`json.dumps(arguments)` exactly (see `jsonecho`): the pieces add up to `ToolCall.arguments`.
Text that might be the start of a tag is held back until it is decided; whitespace right before
a call is dropped; all other text outside calls is content. A call that turns out malformed (bad
JSON, no name, arguments not an object, cut off) is returned as content, raw; deltas already
streamed for it stay sent, and it is not in `calls`.

`forced_grammar` writes a Lark grammar in llguidance's dialect (`%json {schema}` inside Lark) that
makes the model emit calls in the family's format: the named tool (its name as a `const`, its
arguments by its `parameters` schema) or any of the tools for `"required"`.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ftrs.errors import ConfigError, InvalidRequest
from ftrs.server.jsonecho import JsonEcho

log = logging.getLogger(__name__)

_ARG_KEYS = ("arguments", "parameters")
# JSON in forced calls is laid out as json.dumps writes it (as engine.grammar.JSON_OPTIONS does):
# what the model is made to write is then what the parser streams.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object: json.dumps(arguments)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None  # set on the call's first delta only, with `name`
    name: str | None
    arguments: str  # the next piece of the arguments' JSON text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _split_at_tag(text: str, tag: str) -> tuple[str, str | None, str]:
    """(before, after, held): `after` is None when `tag` is not in `text`; then `held` is the end
    of `text` that might still become the tag."""
    i = text.find(tag)
    if i >= 0:
        return text[:i], text[i + len(tag):], ""
    keep = _partial_suffix(text, tag)
    return text[: len(text) - keep], None, text[len(text) - keep:]


def _arguments_of(obj: Any) -> str | None:
    """json.dumps of a call object's arguments, or None if they are not an object."""
    args: Any = next((obj[k] for k in _ARG_KEYS if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    return json.dumps(args) if isinstance(args, dict) else None


def _parse_object_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of `{"name": .., "arguments"|"parameters": {..}}`, else None."""
    try:
        obj = json.loads(text, strict=False)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _arguments_of(obj)
    return None if args is None else (obj["name"], args)


class _CallStream:
    """One call as it arrives: a call object `{"name": .., "arguments": {..}}`, or (when the name
    is known already, as in Mistral's `name[ARGS]{..}`) just the arguments object."""

    def __init__(self, take_index: Callable[[], int], name: str | None = None) -> None:
        self._take_index = take_index
        self.id = new_call_id()
        self.index = -1  # given when the first delta is sent
        self.echo = JsonEcho()
        self.raw = ""  # the text consumed (up to the object's closing brace)
        self._bare_args = name is not None
        self.name = name
        self._name_json = ""
        self._args_kind = ""  # "" undecided, "{" streamed, "x" held for the end
        self._pending = ""  # echoed arguments not yet sent
        self.sent = ""  # arguments text sent so far

    @property
    def done(self) -> bool:
        return self.echo.done

    @property
    def error(self) -> bool:
        return self.echo.error

    def feed(self, text: str) -> tuple[int, list[ToolCallDelta]]:
        """Consume `text` up to the end of the object; return how much was consumed, and deltas."""
        used = 0
        for ch in text:
            if self.echo.done:
                break
            used += 1
            self.raw += ch
            for piece, member in self.echo.push(ch):
                if self._bare_args:
                    self._pending += piece
                elif member == "name":
                    self._name_json += piece
                elif member in _ARG_KEYS:
                    if not self._args_kind:
                        self._args_kind = "{" if piece == "{" else "x"
                    if self._args_kind == "{":
                        self._pending += piece
            if self.name is None and self._name_json and self.echo.member != "name":
                name = json.loads(self._name_json)
                self.name = name if isinstance(name, str) and name else ""
        return used, self._flush()

    def _flush(self) -> list[ToolCallDelta]:
        if not self.name or self.echo.error:
            return []
        if self.index < 0:
            self.index = self._take_index()
            head = ToolCallDelta(self.index, self.id, self.name, self._pending)
            self.sent, self._pending = self._pending, ""
            return [head]
        if not self._pending:
            return []
        delta = ToolCallDelta(self.index, None, None, self._pending)
        self.sent += self._pending
        self._pending = ""
        return [delta]

    def complete(self, name: str, arguments: str) -> tuple[ToolCall, list[ToolCallDelta]]:
        """The call, once its text parsed as `name` and `arguments`; the deltas still owed."""
        deltas: list[ToolCallDelta] = []
        if self.index < 0:
            self.index = self._take_index()
            deltas.append(ToolCallDelta(self.index, self.id, name, arguments))
        elif arguments.startswith(self.sent):
            if len(arguments) > len(self.sent):
                deltas.append(ToolCallDelta(self.index, None, None, arguments[len(self.sent):]))
        else:  # a key repeated in the arguments: the streamed text kept both
            log.warning("tool call %s: streamed arguments differ from the parsed ones", self.id)
        if self.name and self.name != name:
            log.warning("tool call %s: streamed name %r, parsed %r", self.id, self.name, name)
        return ToolCall(self.id, name, arguments), deltas


def _tool_functions(tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each OpenAI-shaped tool; typed errors for bad ones."""
    out: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].function.name: a tool needs a name",
                                 evidence={"param": f"tools[{i}].function.name"})
        params = fn.get("parameters") if isinstance(fn, dict) else None
        out.append((name, params if isinstance(params, dict) else {"type": "object"}))
    return out


def _chosen_functions(tools: list[dict[str, Any]],
                      choice: str | dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    fns = _tool_functions(tools)
    if not fns:
        raise InvalidRequest("tools: tool_choice needs at least one tool", evidence={"param": "tools"})
    if choice == "required":
        return fns
    name = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    chosen = [f for f in fns if f[0] == name]
    if not chosen:
        raise InvalidRequest(f"tool_choice: no tool named {name!r} among the tools",
                             evidence={"param": "tool_choice"})
    return chosen


def _call_schema(fns: list[tuple[str, dict[str, Any]]], args_key: str) -> str:
    """JSON Schema (as text) of one call object of any of `fns`, name first."""
    options = [{"type": "object",
                "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key], "additionalProperties": False}
               for name, params in fns]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({**schema, "x-guidance": _JSON_LAYOUT})


def _text_of(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class ToolParser:
    """Base of the families; one instance per generation. `calls`: the complete calls so far."""

    name: ClassVar[str] = ""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools
        self.calls: list[ToolCall] = []
        self._buf = ""  # text received, not yet decided
        self._ws = ""  # whitespace held at the end of the content shown so far
        self._before = ""  # the whitespace dropped before the current call, if it fails
        self._next_index = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    # --- the incremental interface ----------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        self._content, self._deltas = [], []
        self._advance()
        return "".join(self._content), self._deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._content, self._deltas = [], []
        self._advance()
        self._close()
        if not self.calls:
            self._content.append(self._ws)
        self._ws = ""
        return "".join(self._content), self._deltas

    def _advance(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    # --- helpers for the families -----------------------------------------------------------

    def _take_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    def _show(self, text: str) -> None:
        """Content, with trailing whitespace held (dropped if a call follows it)."""
        if not text:
            return
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept):]
        if kept:
            self._content.append(kept)

    def _enter_call(self) -> None:
        """A call section begins: the whitespace before it is dropped unless the call fails."""
        self._before, self._ws = self._ws, ""

    def _malformed(self, raw: str) -> None:
        self._content.append(self._before + raw)
        self._before = ""

    def _finish_call(self, stream: _CallStream, parsed: tuple[str, str] | None,
                     raw: str) -> bool:
        """Record the call if it parsed, else show its raw text as content."""
        if parsed is None:
            self._malformed(raw)
            return False
        self._before = ""
        call, deltas = stream.complete(*parsed)
        self.calls.append(call)
        self._deltas.extend(deltas)
        return True

    def _stream(self, stream: _CallStream, text: str) -> int:
        used, deltas = stream.feed(text)
        self._deltas.extend(deltas)
        return used

    # --- the format, for templates and grammars ---------------------------------------------

    @staticmethod
    def forced_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool) -> str:
        raise NotImplementedError

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text that offers `tools` in this format (for templates without tools)."""
        raise NotImplementedError

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """An assistant turn's calls, (name, arguments), written as the model writes them."""
        raise NotImplementedError

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        """Tool results, as the user turn that returns them to the model."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._call: _CallStream | None = None
        self._body = ""

    def _advance(self) -> None:
        while True:
            if self._call is None:
                before, after, held = _split_at_tag(self._buf, self.START)
                self._show(before)
                if after is None:
                    self._buf = held
                    return
                self._enter_call()
                self._buf, self._call, self._body = after, _CallStream(self._take_index), ""
            else:
                before, after, held = _split_at_tag(self._buf, self.END)
                self._body += before
                self._stream(self._call, before)
                if after is None:
                    self._buf = held
                    return
                self._buf = after
                self._end_call(closed=True)

    def _end_call(self, closed: bool, tail: str = "") -> None:
        assert self._call is not None
        raw = self.START + self._body + (self.END if closed else tail)
        self._finish_call(self._call, _parse_object_call(self._body), raw)
        self._call = None

    def _close(self) -> None:
        if self._call is not None:  # cut off before the end tag: a complete object still counts
            tail, self._buf = self._buf, ""
            self._end_call(closed=False, tail=tail)
        self._show(self._buf)
        self._buf = ""

    @staticmethod
    def forced_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool) -> str:
        schema = _call_schema(_chosen_functions(tools, choice), "arguments")
        calls = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {calls}\n"
                'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
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


class MistralToolParser(ToolParser):
    name = "mistral"
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        # "out" content; "pre" after the tag; "list" in [..] between calls; "obj" a call object;
        # "name" / "id" before [ARGS]; "args" the arguments object; "bad" malformed to the end.
        self._state = "out"
        self._call: _CallStream | None = None
        self._raw = ""  # text of the current call section, shown as content if it is malformed

    def _advance(self) -> None:
        while self._buf or self._state == "bad":
            if self._state == "bad":
                self._raw += self._buf
                self._buf = ""
                return
            progressed = getattr(self, "_st_" + self._state)()
            if not progressed:
                return

    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        self._raw += text
        return text

    def _st_out(self) -> bool:
        before, after, held = _split_at_tag(self._buf, self.TAG)
        self._show(before)
        if after is None:
            self._buf = held
            return False
        self._buf, self._raw, self._state = after, self.TAG, "pre"
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
            self._call, self._state = _CallStream(self._take_index), "obj"
        elif ch == "," and self._call is not None:
            self._take(1)
        elif ch == "]" and self._call is not None:
            self._take(1)
            self._call, self._raw, self._state = None, "", "out"
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
            parsed = _parse_object_call(self._call.raw)
            if parsed is None:
                self._state = "bad"
            else:
                self._finish_call(self._call, parsed, "")
                self._raw, self._state = "", "list"
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
        self._call = _CallStream(self._take_index, name)
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
        assert self._call is not None
        self._take(self._stream(self._call, self._buf))
        if self._call.error:
            self._state = "bad"
        elif self._call.done:
            args = _arguments_of({"arguments": json.loads(self._call.raw, strict=False)})
            assert self._call.name is not None and args is not None  # the echo saw an object
            self._finish_call(self._call, (self._call.name, args), "")
            self._call, self._raw, self._state = None, "", "out"
        else:
            return False
        return True

    def _close(self) -> None:
        if self._state == "out":
            self._show(self._buf)
        else:  # a call section that did not end well: its text is content
            self._malformed(self._raw + self._buf)
        self._buf, self._raw, self._state = "", "", "out"

    @staticmethod
    def forced_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool) -> str:
        schema = _call_schema(_chosen_functions(tools, choice), "arguments")
        calls = 'body (", " body)*' if parallel else "body"
        return (f'start: "[TOOL_CALLS][" {calls} "]"\n'
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

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        # "start" before any text; "out" content; "pre" before a call object; "obj" in one;
        # "after" after one (";" for another); "bad" malformed to the end.
        self._state = "start"
        self._call: _CallStream | None = None
        self._raw = ""

    def _advance(self) -> None:
        while self._buf:
            if self._state == "bad":
                self._raw += self._buf
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
                before, after, held = _split_at_tag(self._buf, self.TAG)
                self._show(before)
                if after is None:
                    self._buf = held
                    return
                self._open(self.TAG, after)
            elif self._state in ("pre", "after"):
                stripped = self._buf.lstrip()
                self._raw += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                if not stripped:
                    return
                if stripped[0] == "{" and self._state == "pre":
                    self._call, self._state = _CallStream(self._take_index), "obj"
                elif stripped[0] == ";" and self._state == "after":
                    self._raw += ";"
                    self._buf, self._state = stripped[1:], "pre"
                elif self._state == "after":
                    self._raw, self._state = "", "out"
                else:
                    self._state = "bad"
            else:
                assert self._call is not None
                used = self._stream(self._call, self._buf)
                self._raw += self._buf[:used]
                self._buf = self._buf[used:]
                if self._call.error:
                    self._state = "bad"
                elif self._call.done:
                    parsed = _parse_object_call(self._call.raw)
                    if parsed is None:
                        self._state = "bad"
                    else:
                        self._finish_call(self._call, parsed, "")
                        self._raw, self._state = "", "after"

    def _open(self, raw: str, rest: str) -> None:
        """A call section begins with `raw` (the tag, or nothing before a bare "{")."""
        self._enter_call()
        self._raw, self._buf, self._state = raw, rest, "pre"

    def _close(self) -> None:
        if self._state in ("start", "out"):
            self._show(self._buf)
        elif self._state != "after" and (self._raw + self._buf).strip() != ";":
            self._malformed(self._raw + self._buf)
        self._buf, self._raw, self._state = "", "", "out"

    @staticmethod
    def forced_grammar(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool) -> str:
        schema = _call_schema(_chosen_functions(tools, choice), "parameters")
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
}


def choose_tool_parser(flag: str | None, chat_template: str | None) -> str:
    """The `--tool-parser` flag if given, else the family the chat template writes, else hermes."""
    if flag is not None:
        if flag not in TOOL_PARSERS:
            raise ConfigError(f"--tool-parser: unknown parser {flag!r}; "
                              f"known: {', '.join(sorted(TOOL_PARSERS))}")
        return flag
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "hermes"


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolCallDelta", "ToolParser", "choose_tool_parser",
           "new_call_id"]
