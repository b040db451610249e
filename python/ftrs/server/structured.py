"""The grammar a chat request's output must follow, and its check before the request is queued.

A forced tool call (`tool_choice` required or named) is the tool parser's own grammar of its
calls over the chosen tools' schemas; `response_format` is a JSON object or schema. Either may
follow the model's reasoning where its reasoning parser offers a lead (gpt-oss's analysis).
Both are compiled as the engine will compile them (`engine.grammar.check`), so a bad schema is a
400 naming its field: a forced call's grammar that fails names the first tool whose schema
fails alone. Every offered tool's schema is compiled too (`check_tool_schemas`), forced or not:
a client learns its tool definition is broken on its first request, not its first forced call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ftrs.errors import InvalidRequest
from ftrs.sampling import StructuredSpec
from ftrs.server.reasoning import REASONING_PARSERS, opens_reasoning
from ftrs.server.toolbase import NO_ARGUMENTS, chosen_functions, tool_functions
from ftrs.server.toolcalls import TOOL_PARSERS

if TYPE_CHECKING:
    from ftrs.server.prepare import ChatSetup
    from ftrs.server.protocol import ChatCompletionRequest


def _bad(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {why}", evidence={"param": param})


def special_tag_ids(tokenizer: Any, tags: Sequence[str]) -> dict[str, int]:
    """Those of `tags` that `tokenizer` holds as single special tokens, with their ids."""
    if not hasattr(tokenizer, "special_ids"):
        return {}
    found = {t: tokenizer.special_ids([t]) for t in tags}
    return {t: next(iter(ids)) for t, ids in found.items() if len(ids) == 1}


def _lead(setup: ChatSetup, tokenizer: Any, answer: bool, prompt: str) -> str:
    """What the reasoning parser lets a grammar's text follow (see `grammar_lead`)."""
    if setup.reasoning_parser is None:
        return ""
    parser = REASONING_PARSERS[setup.reasoning_parser]
    return parser.grammar_lead(special_tag_ids(tokenizer, parser.special_tags), answer,
                               opens_reasoning(prompt))


def structured_spec(req: ChatCompletionRequest, setup: ChatSetup, tokenizer: Any,
                prompt: str) -> StructuredSpec | None:
    """The grammar the output must follow: a forced tool call, or the response_format; after
    the model's reasoning where its reasoning parser can offer that (gpt-oss's analysis)."""
    fmt = req.response_format
    forced = setup.tools is not None and setup.tool_choice != "auto"
    if fmt is not None and fmt.type != "text" and forced:
        raise _bad("response_format", "cannot be combined with a required or named tool_choice")
    if forced:
        assert setup.tools is not None and setup.tool_parser is not None
        parser = TOOL_PARSERS[setup.tool_parser]
        grammar = parser.forced_grammar(setup.tools, setup.tool_choice, setup.parallel,
                                        special_tag_ids(tokenizer, parser.special_tags))
        return StructuredSpec("lark", grammar, "tool_choice", _lead(setup, tokenizer, False, prompt))
    if fmt is None or fmt.type == "text":
        return None
    lead = _lead(setup, tokenizer, True, prompt)
    if fmt.type == "json_object":
        return StructuredSpec("json_object", "", "response_format", lead)
    if fmt.json_schema is None:
        raise _bad("response_format.json_schema", 'required when type is "json_schema"')
    if fmt.json_schema.schema_ is None:
        raise _bad("response_format.json_schema.schema", "required")
    return StructuredSpec("json_schema", json.dumps(fmt.json_schema.schema_),
                          "response_format.json_schema.schema", lead)


def check_grammar(spec: StructuredSpec, tokenizer: Any, setup: ChatSetup) -> None:
    """Compile `spec` as the engine will, so a bad schema is a 400 before anything is queued.
    A forced call's grammar holds every chosen tool's schema: when it fails, the first tool
    whose schema fails alone is named (`tools[i].function.parameters`), not the grammar."""
    from ftrs.engine import grammar

    # llguidance needs the real tokenizer's vocabulary; a test double is checked without one.
    tok = tokenizer if hasattr(tokenizer, "tk") else None
    try:
        grammar.check(spec, tok)
    except InvalidRequest:
        if spec.param != "tool_choice" or not setup.tools:
            raise
        chosen = {name for name, _ in chosen_functions(setup.tools, setup.tool_choice)}
        for i, tool in enumerate(setup.tools):
            fn = tool.get("function") or {}
            if fn.get("name") in chosen and isinstance(fn.get("parameters"), dict):
                grammar.check(StructuredSpec("json_schema", json.dumps(fn["parameters"]),
                                             f"tools[{i}].function.parameters"), tok)
        raise


def check_tool_schemas(tools: list[dict[str, Any]], tokenizer: Any) -> None:
    """Compile each tool's arguments schema as a forced call would, so a schema the engine
    cannot compile is a 400 naming `tools[i].function.parameters` whatever `tool_choice` says,
    not only when a call is forced. A forced call's grammar is compiled by `check_grammar`."""
    from ftrs.engine import grammar

    tok = tokenizer if hasattr(tokenizer, "tk") else None
    for i, (_, schema) in enumerate(tool_functions(tools)):
        if schema != NO_ARGUMENTS:
            grammar.check(StructuredSpec("json_schema", json.dumps(schema),
                                         f"tools[{i}].function.parameters"), tok)


__all__ = ["check_grammar", "check_tool_schemas", "special_tag_ids", "structured_spec"]
