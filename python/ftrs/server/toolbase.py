"""The machinery under the tool-call parsers (`toolcalls`): call and delta types, one call streamed
from its JSON (`CallStream`), the `ToolParser` base (whitespace held before a possible call,
malformed calls back to content), and forced calls' schemas: `parameters` must be an object schema
(absent or `{}`: no arguments), so a forced call always writes arguments the parsers accept."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ftrs.errors import InvalidRequest
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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_at_tag(text: str, tag: str) -> tuple[str, str | None, str]:
    """(before, after, held): `after` is None when `tag` is not in `text`; then `held` is the end
    of `text` that might still become the tag."""
    i = text.find(tag)
    if i >= 0:
        return text[:i], text[i + len(tag):], ""
    keep = partial_suffix(text, tag)
    return text[: len(text) - keep], None, text[len(text) - keep:]


def arguments_of(obj: Any) -> str | None:
    """json.dumps of a call object's arguments, or None if they are not an object."""
    args: Any = next((obj[k] for k in _ARG_KEYS if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except (ValueError, RecursionError):
            return None
    return json.dumps(args) if isinstance(args, dict) else None


def parse_object_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of `{"name": .., "arguments"|"parameters": {..}}`, else None."""
    try:
        obj = json.loads(text, strict=False)
    except (ValueError, RecursionError):  # (a model's text nested past the decoder's stack)
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = arguments_of(obj)
    return None if args is None else (obj["name"], args)


class CallStream:
    """One call as it arrives: a call object `{"name": .., "arguments": {..}}`, or (when the name
    is known already, as in Mistral's `name[ARGS]{..}`) just the arguments object."""

    def __init__(self, take_index: Callable[[], int], name: str | None = None) -> None:
        self._take_index = take_index
        self.known: frozenset[str] | None = None  # the names offered (set by the parser)
        self.id = new_call_id()
        self.index = -1  # given when the first delta is sent
        self.echo = JsonEcho()
        self._raw: list[str] = []
        self._bare_args = name is not None
        self.name = name
        self._name_json = ""
        self._args_kind = ""  # "" undecided, "{" streamed, "x" held for the end
        self._pending: list[str] = []  # echoed arguments not yet sent
        self._sent: list[str] = []  # arguments text sent so far

    @property
    def done(self) -> bool:
        return self.echo.done

    @property
    def error(self) -> bool:
        return self.echo.error

    def feed(self, text: str) -> tuple[int, list[ToolCallDelta]]:
        """Consume `text` up to the end of the object; return how much was consumed, and deltas."""
        used, pieces = self.echo.feed(text)
        self._raw.append(text[:used])
        for piece, member in pieces:
            if self._bare_args:
                self._pending.append(piece)
            elif member == "name":
                self._name_json += piece
            elif member in _ARG_KEYS:
                if not self._args_kind:
                    self._args_kind = "{" if piece == "{" else "x"
                if self._args_kind == "{":
                    self._pending.append(piece)
        if self.name is None and self._name_json and self.echo.member != "name":
            name = json.loads(self._name_json)
            self.name = name if isinstance(name, str) and name else ""
        return used, self._flush()

    @property
    def raw(self) -> str:
        """The text consumed (up to the object's closing brace)."""
        return "".join(self._raw)

    def _flush(self) -> list[ToolCallDelta]:
        if not self.name or self.echo.error or (self.known is not None
                                                and self.name not in self.known):
            return []  # a call of a tool not offered is held: it becomes content
        if self.index < 0 and not self._bare_args and self._args_kind != "{":
            return []  # a call is announced with its arguments object: until then, it may be none
        pending = "".join(self._pending)
        self._pending = []
        if self.index < 0:
            self.index = self._take_index()
            self._sent = [pending]
            return [ToolCallDelta(self.index, self.id, self.name, pending)]
        if not pending:
            return []
        self._sent.append(pending)
        return [ToolCallDelta(self.index, None, None, pending)]

    def complete(self, name: str, arguments: str) -> tuple[ToolCall, list[ToolCallDelta]]:
        """The call, once its text parsed as `name` and `arguments`; the deltas still owed."""
        deltas: list[ToolCallDelta] = []
        sent = "".join(self._sent)
        if self.index < 0:
            self.index = self._take_index()
            deltas.append(ToolCallDelta(self.index, self.id, name, arguments))
        elif arguments.startswith(sent):
            if len(arguments) > len(sent):
                deltas.append(ToolCallDelta(self.index, None, None, arguments[len(sent):]))
        else:  # a key repeated in the arguments: the streamed text kept both
            log.warning("tool call %s: streamed arguments differ from the parsed ones", self.id)
        if self.name and self.name != name:
            log.warning("tool call %s: streamed name %r, parsed %r", self.id, self.name, name)
        return ToolCall(self.id, name, arguments), deltas


#: the arguments of a function without parameters (`parameters` absent or `{}`): none at all
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def arguments_schema(params: Any, param: str) -> dict[str, Any]:
    """The JSON Schema of a function's arguments object: `params` itself when it is an object
    schema (`"type": "object"`); `NO_ARGUMENTS` when it is absent or `{}` (OpenAI's form of a
    function without arguments) or an object schema with no properties and nothing else that
    admits one (`{"type": "object", "properties": {}}`, Anthropic's form). Any other schema is a
    400 naming `param`, as OpenAI and Anthropic refuse it: arguments are an object, and a forced
    call of a schema that allowed another value would be made to write what the tool parser
    then refuses."""
    if params is None or params == {} or (
            isinstance(params, dict) and params.get("type") == "object"
            and params.get("properties") == {} and not params.get("required")
            and set(params) <= {"type", "properties", "required", "title", "description",
                                "$schema"}):
        return dict(NO_ARGUMENTS)
    kind = params.get("type") if isinstance(params, dict) else None
    if kind != "object":
        got = f"type {json.dumps(kind)}" if kind is not None else "a schema without a type"
        raise InvalidRequest(f'{param}: must be a JSON Schema of type "object" (the arguments '
                             f"object), got {got}", evidence={"param": param})
    return dict(params)


def tool_functions(tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments schema) of each OpenAI-shaped tool; typed errors for bad ones (a missing
    or repeated name, parameters that are not an object schema: see `arguments_schema`)."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tools[{i}].function.name: a tool needs a name",
                                 evidence={"param": f"tools[{i}].function.name"})
        if name in seen:  # a call names its tool: two of one name could not be told apart
            raise InvalidRequest(f"tools[{i}].function.name: {name!r} is already the name of "
                                 f"tools[{seen[name]}]", evidence={"param": f"tools[{i}].function.name"})
        seen[name] = i
        params = fn.get("parameters") if isinstance(fn, dict) else None
        out.append((name, arguments_schema(params, f"tools[{i}].function.parameters")))
    return out


def chosen_functions(tools: list[dict[str, Any]],
                      choice: str | dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    fns = tool_functions(tools)
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


def args_schema(params: dict[str, Any]) -> str:
    """JSON Schema (as text) of one function's arguments object, laid out as json.dumps does."""
    return json.dumps({**params, "x-guidance": _JSON_LAYOUT})


def lark_literal(text: str, special: Mapping[str, int] | None = None) -> str:
    """`text` as a Lark expression in llguidance's dialect: quoted text, except that each tag of
    `special` (a tag the tokenizer holds as one special token, and that token's id) is written
    as its token, `<[id]>`. A quoted literal matches text only, never a special token: a forced
    grammar that quoted `[TOOL_CALLS]` would forbid the very token the model writes it with."""
    parts: list[str] = []
    tags = sorted((special or {}).items(), key=lambda kv: -len(kv[0]))
    while text:
        found = [(i, tag, tid) for tag, tid in tags if (i := text.find(tag)) >= 0]
        if not found:
            parts.append(json.dumps(text, ensure_ascii=False))
            break
        i, tag, tid = min(found, key=lambda f: (f[0], -len(f[1])))
        if i:
            parts.append(json.dumps(text[:i], ensure_ascii=False))
        parts.append(f"<[{tid}]>")
        text = text[i + len(tag):]
    return " ".join(parts) or '""'


def _rebase_refs(node: Any, base: str) -> Any:
    """`node` with every local `$ref` ("#", "#/...") pointing under the JSON pointer `base`."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v[:2] in ("#", "#/")
                    else _rebase_refs(v, base)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def standalone(part: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """`part` of the arguments schema `params` (a member's schema) as a schema of its own: where
    `params` has local references, `params` goes in `part`'s `$defs` and the references of both
    are rebased there, so they resolve as they do in `params`."""
    if '"$ref"' not in json.dumps(params):
        return part
    base = "#/$defs/ftrs_tool"
    out = _rebase_refs(part, base)
    out["$defs"] = {**(out.get("$defs") or {}), "ftrs_tool": _rebase_refs(params, base)}
    return dict(out)


def call_schema(fns: list[tuple[str, dict[str, Any]]], args_key: str) -> str:
    """JSON Schema (as text) of one call object of any of `fns`, name first. A tool's schema
    sits inside the call object, so one with local references (`#/$defs/City`, `#`) moves to
    the root's `$defs`, its references rebased there: they then resolve as in the tool's own."""
    defs: dict[str, Any] = {}
    options = []
    for i, (name, params) in enumerate(fns):
        if '"$ref"' in json.dumps(params):
            key = f"ftrs_tool_{i}"
            defs[key] = _rebase_refs(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        options.append({"type": "object", "properties": {"name": {"const": name}, args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return json.dumps({**schema, "x-guidance": _JSON_LAYOUT})


class ToolParser:
    """Base of the families; one instance per generation. `calls`: the complete calls so far."""

    name: ClassVar[str] = ""
    #: tags of the format that tokenizers hold as special tokens; the detokenizer keeps them
    special_tags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools
        fns = [t.get("function") for t in tools if isinstance(t, dict)]
        self.names = frozenset(f["name"] for f in fns if isinstance(f, dict)
                               and isinstance(f.get("name"), str))
        self.calls: list[ToolCall] = []
        self._buf = ""  # text received, not yet decided
        self._ws = ""  # whitespace held at the end of the content shown so far
        self._before = ""  # the whitespace dropped before the current call, if it fails
        self._next_index = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._cut = False  # finishing a generation cut off: an open call is dropped, not shown

    # --- the incremental interface ----------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        self._content, self._deltas = [], []
        self._advance()
        return "".join(self._content), self._deltas

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The end of the text. `cut`: the generation was cut off (`max_tokens`): a call
        section still open is the parser's own markup half written, not content, and is
        dropped (a call whose object is complete still counts)."""
        self._content, self._deltas = [], []
        self._advance()
        self._cut = cut
        try:
            self._close()
        finally:
            self._cut = False
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

    def _show_held(self) -> None:
        """At the end, outside a call: the text held back as a possible start of the call
        markup is content, unless the generation was cut off there (the markup half written)."""
        if not self._cut:
            self._show(self._buf)

    def _enter_call(self) -> None:
        """A call section begins: the whitespace before it is dropped unless the call fails."""
        self._before, self._ws = self._ws, ""

    def _malformed(self, raw: str) -> None:
        if not self._cut:
            self._content.append(self._before + raw)
        self._before = ""

    def _finish_call(self, stream: CallStream, parsed: tuple[str, str] | None,
                     raw: str) -> bool:
        """Record the call if it parsed and names a tool offered, else show its raw text as
        content (a call of another tool: as the format writes it, when `raw` is not given)."""
        if parsed is not None and parsed[0] not in self.names:
            log.info("a call of %r, not among the tools offered, is content", parsed[0])
            self._malformed(raw or self.format_calls([(parsed[0], json.loads(parsed[1]))]))
            return False
        if parsed is None:
            self._malformed(raw)
            return False
        self._before = ""
        call, deltas = stream.complete(*parsed)
        self.calls.append(call)
        self._deltas.extend(deltas)
        return True

    def _stream(self, stream: CallStream, text: str) -> int:
        stream.known = self.names
        used, deltas = stream.feed(text)
        self._deltas.extend(deltas)
        return used

    # --- the format, for templates and grammars ---------------------------------------------

    @classmethod
    def forced_grammar(cls, tools: list[dict[str, Any]], choice: str | dict[str, Any],
                       parallel: bool, special: Mapping[str, int] | None = None) -> str:
        """A Lark grammar of the calls `choice` forces; `special`: those of `special_tags` the
        tokenizer holds as special tokens, with their ids (see `lark_literal`)."""
        raise NotImplementedError

    _TOOLS_HEADING = "# Tools"  # of `describe_tools`' text
    _EXAMPLE_NAME = "function name"  # the function its example calls

    @classmethod
    def describe_tools(cls, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text that offers `tools` in this format (for templates without tools):
        here their signatures one per line, and an example call in the format."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = cls.format_calls([(cls._EXAMPLE_NAME, {"argument": "value"})])
        return (f"{cls._TOOLS_HEADING}\n\nYou may call functions to help with the request. Their "
                f"signatures, one per line:\n{listed}\n\nTo call functions, answer with:\n{example}")

    @classmethod
    def format_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """An assistant turn's calls, (name, arguments), written as the model writes them."""
        raise NotImplementedError

    @classmethod
    def format_results(cls, results: list[str]) -> str:
        """Tool results, as the user turn that returns them to the model."""
        raise NotImplementedError


__all__ = ["NO_ARGUMENTS", "CallStream", "ToolCall", "ToolCallDelta", "ToolParser", "args_schema",
           "arguments_of", "arguments_schema", "call_schema", "chosen_functions", "lark_literal", "new_call_id",
           "parse_object_call", "split_at_tag", "standalone", "tool_functions"]
