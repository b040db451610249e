"""The hand-written hostile inputs of `abuse.py`, each with the statuses it may get.

Imported by `abuse.py` beside it (`import abuse_cases as cases`). Out-of-range and mistyped
sampling fields, lone surrogates everywhere, unsupported fields, malformed and oversized bodies,
deep nesting, auth probes, odd paths; for `/v1/messages` also malformed content blocks, tool
histories that do not add up and `x-api-key`; and a few valid controls.

Every builder takes the served model name and the API key. With no key (`None`) no credentials
are sent, and the auth probes (marked `auth_probe`) expect 200 instead of 401: a server without a
key admits everyone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SURROGATE = "a\udc80b"
MAX_GEN_TOKENS = 1  # generation per valid request, so the run stays short on a CPU


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # JSON-encodable (ASCII escapes, so surrogates travel) or raw bytes
    expect: tuple[int, ...] = (400,)
    headers: dict[str, Any] | None = None  # None: the valid key (if any); {} sends no key
    auth_probe: bool = False  # expects 401 from a server with a key, 200 from one without


def auth_headers(key: str | None) -> dict[str, str]:
    """The valid credentials: a bearer token, or nothing when the server has no key."""
    return {} if key is None else {"authorization": f"Bearer {key}"}


def denied(key: str | None) -> tuple[int, ...]:
    """What a request with missing or wrong credentials may get."""
    return (401,) if key is not None else (200,)


def bad_inputs(model: str, key: str | None) -> list[Case]:
    """The OpenAI routes (chat, completions, models), the raw bodies and the auth probes; then
    `messages_inputs`."""
    chat: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": MAX_GEN_TOKENS}
    comp: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": MAX_GEN_TOKENS}
    cases: list[Case] = []

    def both(name: str, extra: dict[str, Any], expect: tuple[int, ...] = (400,)) -> None:
        cases.append(Case(f"chat {name}", "POST", "/v1/chat/completions", {**chat, **extra}, expect))
        cases.append(Case(f"completion {name}", "POST", "/v1/completions", {**comp, **extra}, expect))

    for seed in (-(2**63) - 1, 2**64, 10**40, 1.5, "7", True):
        both(f"seed={seed!r}", {"seed": seed, "temperature": 1.0})
    for t in (3.0, 1e308, -0.5, -1e-300, "hot", True):
        both(f"temperature={t!r}", {"temperature": t})
    for t in (1e-40, 1e-300, 5e-324, 2.0):  # in range; tiny ones are greedy
        both(f"temperature={t!r} ok", {"temperature": t, "seed": 1}, (200,))
    for p in (0, -1, 1.5, 1e308, "x"):
        both(f"top_p={p!r}", {"top_p": p})
    for k in (-2, 1.5, "5"):
        both(f"top_k={k!r}", {"top_k": k})
    for k in (10**30, 0, -1):
        both(f"top_k={k!r} ok", {"top_k": k}, (200,))
    for m in (-0.1, 1.5):
        both(f"min_p={m!r}", {"min_p": m})
    for name, value in (("presence_penalty", 3), ("presence_penalty", -1e308), ("frequency_penalty", 2.5),
                        ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 1e-300),
                        ("repetition_penalty", 1e300)):
        both(f"{name}={value!r}", {name: value})
    both("repetition_penalty=0.01 ok", {"repetition_penalty": 0.01, "temperature": 0}, (200,))
    both("repetition_penalty=100 ok", {"repetition_penalty": 100.0, "temperature": 0}, (200,))
    for mt in (0, -1, 1.5, True, "8"):
        both(f"max_tokens={mt!r}", {"max_tokens": mt})
    both("max_tokens=10**30", {"max_tokens": 10**30})
    for n in (0, 9, True):  # 9: above --max-n (8)
        both(f"n={n!r}", {"n": n})
    both("n=2 ok", {"n": 2}, (200,))
    for s in ("yes", 1, "true"):
        both(f"stream={s!r}", {"stream": s})
    for stop in (5, [5], [""], ["x"] * 17, SURROGATE, [SURROGATE]):
        both(f"stop={str(stop)[:20]!r}", {"stop": stop})
    for ids in ([-1], [10**20], [True], "1"):
        both(f"stop_token_ids={ids!r}", {"stop_token_ids": ids})
    both("stream_options without stream", {"stream_options": {"include_usage": True}})
    both("user surrogate", {"user": SURROGATE})
    both("model surrogate", {"model": SURROGATE})
    both("model number", {"model": 5})
    both("model empty", {"model": ""}, (404,))
    both("model unknown", {"model": "nope"}, (404,))
    both("logit_bias ok", {"logit_bias": {"1": 100}}, (200,))
    both("logit_bias not a map", {"logit_bias": [1]})
    both("logit_bias out of range", {"logit_bias": {"1": 101}})
    both("logit_bias outside the vocabulary", {"logit_bias": {"99999999": 1}})
    both("logit_bias key not a number", {"logit_bias": {"one": 1}})
    both("unknown fields", {"frobnicate": SURROGATE, "store": True}, (200,))
    both("ignore_eos yes", {"ignore_eos": "yes"})

    def chat_case(name: str, extra: dict[str, Any], expect: tuple[int, ...] = (400,)) -> None:
        cases.append(Case(f"chat {name}", "POST", "/v1/chat/completions", {**chat, **extra}, expect))

    def msgs(*m: Any) -> dict[str, Any]:
        return {"messages": list(m)}

    for role in ("wizard", "", SURROGATE, 5, None, "function"):
        chat_case(f"role={role!r}", msgs({"role": role, "content": "x"}))
    for role in ("system", "developer"):
        chat_case(f"role={role} ok", msgs({"role": role, "content": "be brief"}, {"role": "user", "content": "x"}), (200,))
    for content in (SURROGATE, 5, [{"type": "text", "text": 5}], [{"type": "text"}], [{"type": "text", "text": SURROGATE}],
                    [{"type": "image_url", "image_url": {"url": "http://x"}}], [5], {"text": "x"}):
        chat_case(f"content={str(content)[:30]!r}", msgs({"role": "user", "content": content}))
    chat_case("name surrogate", msgs({"role": "user", "content": "x", "name": SURROGATE}))
    chat_case("messages empty", {"messages": []})
    chat_case("messages not a list", {"messages": "hi"})
    chat_case("message not an object", {"messages": ["hi"]})
    chat_case("50 messages ok", msgs(*[{"role": "user", "content": "x"}] * 50), (200,))
    chat_case("2 MB of content", msgs({"role": "user", "content": "word " * 400_000}), (400,))
    chat_case("tools ok", {"tools": [{"type": "function", "function": {"name": "f"}}]}, (200,))
    chat_case("tool name with spaces", {"tools": [{"type": "function", "function": {"name": "f g"}}]})
    chat_case("tool parameters not an object", {"tools": [{"type": "function",
                                                          "function": {"name": "f", "parameters": 5}}]})
    chat_case("tool_choice auto without tools", {"tool_choice": "auto"})
    chat_case("tool_choice required without tools", {"tool_choice": "required"})
    chat_case("tool_choice names an unknown tool", {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}})
    chat_case("tool_choice none ok", {"tool_choice": "none"}, (200,))
    chat_case("functions", {"functions": [{"name": "f"}]})
    chat_case("response_format json ok", {"response_format": {"type": "json_object"}}, (200,))
    chat_case("response_format schema not a schema", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    chat_case("response_format schema", {"response_format": {"type": "json_schema", "json_schema": {}}})
    chat_case("response_format text ok", {"response_format": {"type": "text"}}, (200,))
    chat_case("assistant tool_calls", msgs({"role": "assistant", "tool_calls": [{"id": "1"}]}))
    chat_case("audio", {"audio": {"voice": "alloy"}})
    chat_case("modalities audio", {"modalities": ["text", "audio"]})
    chat_case("logprobs yes", {"logprobs": "yes"})
    chat_case("top_logprobs 21", {"logprobs": True, "top_logprobs": 21})
    chat_case("top_logprobs without logprobs", {"top_logprobs": 2})
    chat_case("max_completion_tokens -1", {"max_completion_tokens": -1})

    def comp_case(name: str, extra: dict[str, Any], expect: tuple[int, ...] = (400,)) -> None:
        cases.append(Case(f"completion {name}", "POST", "/v1/completions", {**comp, **extra}, expect))

    prompt: Any
    for prompt in ([True, False], [], [[]], [[1, 2], [3]], [-1], [10**30], [1.5], [SURROGATE], SURROGATE, 5,
                   None, [["x"]], {"text": "x"}):
        comp_case(f"prompt={str(prompt)[:20]!r}", {"prompt": prompt})
    comp_case("prompt of 100k token ids", {"prompt": [5] * 100_000})
    comp_case("prompt empty string", {"prompt": ""}, (200, 400))
    comp_case("logprobs true", {"logprobs": True})
    comp_case("logprobs 21", {"logprobs": 21})
    comp_case("logprobs 2 ok", {"logprobs": 2}, (200,))
    comp_case("suffix", {"suffix": "x"})
    comp_case("echo", {"echo": True})
    comp_case("best_of 3", {"best_of": 3})

    raw = {"content-type": "application/json", **auth_headers(key)}
    for name, body in (("invalid json", b"{not json"), ("empty body", b""), ("json array", b"[1, 2]"),
                       ("json string", b'"hi"'), ("json null", b"null"),
                       ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
                       ("NaN temperature", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % model.encode()),
                       ("Infinity top_p", b'{"model": "%s", "prompt": "x", "top_p": Infinity}' % model.encode()),
                       ("1e999 temperature", b'{"model": "%s", "prompt": "x", "temperature": 1e999}' % model.encode()),
                       ("invalid utf-8", b'{"model": "%s", "prompt": "\xff\xfe"}' % model.encode()),
                       ("utf-16 body ok", json.dumps(comp).encode("utf-16")),  # JSON allows UTF-16
                       ("NUL in prompt ok", json.dumps({**comp, "prompt": "a\u0000b"}).encode()),
                       ("5 MiB body", json.dumps({**comp, "prompt": "x" * (5 * 2**20)}).encode())):
        expect: tuple[int, ...] = (413,) if name == "5 MiB body" else (200,) if name.endswith(" ok") else (400,)
        cases.append(Case(f"raw {name}", "POST", "/v1/completions", body, expect, headers=raw))
    cases.append(Case("raw text/plain", "POST", "/v1/completions", json.dumps(comp).encode(), (400, 200),
                      headers={"content-type": "text/plain", **auth_headers(key)}))

    for name, headers in (("no key", {}), ("wrong key", {"authorization": "Bearer nope"}),
                          ("basic auth", {"authorization": "Basic YTpi"}),
                          ("non-ASCII key", {"authorization": b"Bearer \xff\xfe"}),
                          ("10 kB key", {"authorization": "Bearer " + "k" * 10_000}),
                          ("bare bearer", {"authorization": "Bearer"})):
        cases.append(Case(f"auth {name}", "POST", "/v1/chat/completions", chat, denied(key),
                          headers=headers, auth_probe=True))
    for path in ("/openapi.json", "/docs", "/v1/models", f"/v1/models/{model}"):
        cases.append(Case(f"auth {path} without key", "GET", path, None, denied(key), headers={},
                          auth_probe=True))
    for path, status in ((f"/v1/models/{model}", 200), ("/v1/models/nope", 404), ("/v1/models/%00", 404),
                         ("/v1/models/../../etc/passwd", 404), ("/v1/models/" + "x" * 5000, 404),
                         ("/v1/nothing", 404), ("/openapi.json", 200), ("/docs", 200)):
        cases.append(Case(f"GET {path[:40]}", "GET", path, None, (status,)))
    cases.append(Case("GET on a POST route", "GET", "/v1/chat/completions", None, (405,)))
    cases.append(Case("DELETE /v1/models", "DELETE", "/v1/models", None, (405,)))
    return cases + messages_inputs(model, key)


def messages_inputs(model: str, key: str | None) -> list[Case]:
    """The Anthropic Messages routes: malformed content blocks, tool histories that do not add
    up, out-of-range fields, its own auth header, and a few valid controls."""
    base: dict[str, Any] = {"model": model, "max_tokens": MAX_GEN_TOKENS,
                            "messages": [{"role": "user", "content": "hi"}]}
    tool = {"name": "get_weather", "description": "weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    cases: list[Case] = []

    def m(name: str, extra: dict[str, Any], expect: tuple[int, ...] = (400,),
          path: str = "/v1/messages") -> None:
        body = {k: v for k, v in {**base, **extra}.items() if v is not None}
        cases.append(Case(f"messages {name}", "POST", path, body, expect))

    m("ok", {}, (200,))
    m("stream ok", {"stream": True}, (200,))
    m("tools ok", {"tools": [tool]}, (200,))
    m("count_tokens ok", {"max_tokens": None}, (200,), "/v1/messages/count_tokens")
    m("no max_tokens", {"max_tokens": None})
    m("max_tokens 0", {"max_tokens": 0})
    m("max_tokens string", {"max_tokens": "8"})
    m("max_tokens 2^63", {"max_tokens": 2**63})
    m("temperature 1.5", {"temperature": 1.5})
    m("temperature NaN-ish string", {"temperature": "NaN"})
    m("top_k -1", {"top_k": -1})
    m("top_p 2", {"top_p": 2})
    m("stop_sequences string", {"stop_sequences": "END"})
    m("stop_sequences of ints", {"stop_sequences": [1, 2]})
    m("no messages", {"messages": []})
    m("messages not a list", {"messages": {"role": "user", "content": "hi"}})
    m("system role in messages", {"messages": [{"role": "system", "content": "x"}]})
    m("unknown role", {"messages": [{"role": "robot", "content": "x"}]})
    m("content null", {"messages": [{"role": "user", "content": None}]})
    m("content int", {"messages": [{"role": "user", "content": 5}]})
    m("block without type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]})
    m("unknown block type", {"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]})
    m("image block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    m("text block surrogate", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": SURROGATE}]}]})
    m("system surrogate", {"system": SURROGATE})
    m("system block list bad", {"system": [{"type": "image"}]})
    m("tool_result without its tool_use", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]})
    m("tool_use from the user", {"tools": [tool], "messages": [{"role": "user", "content": [use]}]})
    m("tool_use input not an object", {"tools": [tool], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{**use, "input": "Oslo"}]}]})
    m("tool without input_schema", {"tools": [{"name": "x"}]})
    # only a forced call compiles the schema; with tool_choice auto it is shown to the model
    m("tool with a broken schema", {"tools": [{**tool, "input_schema": {"type": "nope"}}]}, (200, 400))
    m("forced tool with a broken schema", {"tools": [{**tool, "input_schema": {"type": "nope"}}],
                                           "tool_choice": {"type": "any"}})
    m("tool name with spaces", {"tools": [{**tool, "name": "get weather now"}]})
    m("tool_choice unknown tool", {"tools": [tool], "tool_choice": {"type": "tool", "name": "nope"}})
    m("tool_choice tool without tools", {"tool_choice": {"type": "any"}})
    m("tool_choice bad type", {"tools": [tool], "tool_choice": {"type": "sometimes"}})
    m("thinking budget string", {"thinking": {"type": "enabled", "budget_tokens": "lots"}})
    m("metadata not an object", {"metadata": "me"})
    m("unknown model", {"model": "nope"}, (404,))
    m("count_tokens no messages", {"messages": [], "max_tokens": None}, (400,),
      "/v1/messages/count_tokens")
    cases.append(Case("messages x-api-key ok", "POST", "/v1/messages", base, (200,),
                      headers={} if key is None else {"x-api-key": key}))
    cases.append(Case("messages wrong x-api-key", "POST", "/v1/messages", base, denied(key),
                      headers={"x-api-key": "nope"}, auth_probe=True))
    cases.append(Case("messages no key", "POST", "/v1/messages", base, denied(key), headers={},
                      auth_probe=True))
    cases.append(Case("messages 5 MiB body", "POST", "/v1/messages",
                      json.dumps({**base, "system": "x" * (5 * 2**20)}).encode(), (413,),
                      headers={**auth_headers(key), "content-type": "application/json"}))
    return cases
