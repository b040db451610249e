"""The live checks of what agents ask of the server (tools forced by a grammar, JSON-schema
outputs), shared by the test files that run them on real servers."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LIVE_OPTIONS = ["--device", "cpu", "--dtype", "float32", "--max-n", "20"]
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "Forecast of a city for some days",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "metric": {"type": "boolean"}}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["a", "b", "c"]}}}}
NAMED = {"type": "function", "function": {"name": "get_forecast"}}


def openai_client(server: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def check_forced_call(c: Any, model: str, parallel: bool, temperature: float = 1.0) -> None:
    """A named tool_choice: the call's arguments parse and follow the tool's schema, in the
    full answer and in the stream (whose pieces add up to the same call)."""
    import jsonschema

    schema = FORECAST["function"]["parameters"]  # type: ignore[index]
    msgs = [{"role": "user", "content": "What will the weather be in Oslo for the next 3 days?"}]
    kw: dict[str, Any] = {"model": model, "messages": msgs, "tools": [FORECAST], "tool_choice": NAMED,
                          "max_tokens": 200, "temperature": temperature, "seed": 5,
                          "parallel_tool_calls": parallel}
    full = c.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.function.name == "get_forecast"
        jsonschema.validate(json.loads(call.function.arguments), schema)
    args: dict[int, str] = defaultdict(str)
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                args[d.index] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [args[i] for i in sorted(args)] == [call.function.arguments for call in choice.message.tool_calls]


def check_json_schema_samples(c: Any, model: str, n: int) -> None:
    """`n` seeded samples at temperature 1.0, in one request: each parses and validates."""
    import jsonschema

    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=1.0, seed=123, n=n, max_tokens=120)
    assert len(r.choices) == n
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({choice.message.content for choice in r.choices}) > 1  # they are samples, not copies


@contextmanager
def tiny_server(root: Path, *args: str, specials: Sequence[str] = ()) -> Iterator[Any]:
    """A real server on loopback over a tiny llama written into `root` (`args`: more flags;
    `specials`: texts its tokenizer holds as special tokens)."""
    from ftrs_server_harness import ServerProcess

    from ftrs.models.tiny import make_tiny

    model = make_tiny("llama", root / "llama", seed=0, specials=specials)
    server = ServerProcess(["--model", str(model), "--served-model-name", "tiny", *LIVE_OPTIONS,
                            *args], api_key=None, backend=None)
    try:
        server.wait("ok")
        yield server
    finally:
        server.stop()
