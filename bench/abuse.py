"""Abuse run: hostile inputs against `ftrs serve --model demo` on loopback; 0 5xx, 0 engine deaths.

Starts one server (API key from `$FTRS_API_KEY`, so that path is exercised too), then:

1. a hand-written set of bad inputs (out-of-range and mistyped sampling fields, lone surrogates
   everywhere, unsupported fields, malformed and oversized bodies, deep nesting, auth probes,
   odd paths; for `/v1/messages` also malformed content blocks, tool histories that do not add
   up and `x-api-key`) and a few valid controls, each with the statuses it may get;
2. schemathesis on `/openapi.json`: positive and negative cases per operation, `model` fixed to
   the served one and `max_tokens` clamped so generation stays short.

After every request `/health` is read: an engine death shows as a non-ok status or a new engine
pid. Bounded in time (`--budget-s`) and count (`--examples` per operation and mode). Prints JSON:
per-status counts, 5xx (must be 0), engine deaths (must be 0), cases whose status was not an
expected one, and schemathesis conformance findings (informative).

    python bench/abuse.py                 # demo model, ~3 minutes
    python bench/abuse.py --examples 10   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import serverproc  # noqa: E402  (the tests' loopback server harness)

KEY = "abuse-key"
SURROGATE = "a\udc80b"
MAX_GEN_TOKENS = 1  # generation per valid request, so the run stays short on a CPU


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # JSON-encodable (ASCII escapes, so surrogates travel) or raw bytes
    expect: tuple[int, ...] = (400,)
    headers: dict[str, Any] | None = None  # None: the valid key; {} sends no key


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    engine_deaths: int = 0
    requests: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)

    def timed(self, name: str, seconds: float) -> None:
        self.slowest = sorted([*self.slowest, (seconds, name)], reverse=True)[:5]


def bad_inputs(model: str) -> list[Case]:
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

    raw = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
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
                      headers={"content-type": "text/plain", "authorization": f"Bearer {KEY}"}))

    for name, headers in (("no key", {}), ("wrong key", {"authorization": "Bearer nope"}),
                          ("basic auth", {"authorization": "Basic YTpi"}),
                          ("non-ASCII key", {"authorization": b"Bearer \xff\xfe"}),
                          ("10 kB key", {"authorization": "Bearer " + "k" * 10_000}),
                          ("bare bearer", {"authorization": "Bearer"})):
        cases.append(Case(f"auth {name}", "POST", "/v1/chat/completions", chat, (401,), headers=headers))
    for path in ("/openapi.json", "/docs", "/v1/models", f"/v1/models/{model}"):
        cases.append(Case(f"auth {path} without key", "GET", path, None, (401,), headers={}))
    for path, status in ((f"/v1/models/{model}", 200), ("/v1/models/nope", 404), ("/v1/models/%00", 404),
                         ("/v1/models/../../etc/passwd", 404), ("/v1/models/" + "x" * 5000, 404),
                         ("/v1/nothing", 404), ("/openapi.json", 200), ("/docs", 200)):
        cases.append(Case(f"GET {path[:40]}", "GET", path, None, (status,)))
    cases.append(Case("GET on a POST route", "GET", "/v1/chat/completions", None, (405,)))
    cases.append(Case("DELETE /v1/models", "DELETE", "/v1/models", None, (405,)))
    return cases + messages_inputs(model)


def messages_inputs(model: str) -> list[Case]:
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
                      headers={"x-api-key": KEY}))
    cases.append(Case("messages wrong x-api-key", "POST", "/v1/messages", base, (401,),
                      headers={"x-api-key": "nope"}))
    cases.append(Case("messages no key", "POST", "/v1/messages", base, (401,), headers={}))
    cases.append(Case("messages 5 MiB body", "POST", "/v1/messages",
                      json.dumps({**base, "system": "x" * (5 * 2**20)}).encode(), (413,),
                      headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"}))
    return cases


def _send(client: httpx.Client, case: Case) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}"} if case.headers is None else case.headers
    if isinstance(case.body, bytes):
        return client.request(case.method, case.path, content=case.body, headers=headers)
    if case.body is None:
        return client.request(case.method, case.path, headers=headers)
    data = json.dumps(case.body).encode()  # ASCII escapes: a lone surrogate travels as \\udc80
    return client.request(case.method, case.path, content=data,
                          headers={**headers, "content-type": "application/json"})


class Watch:
    """Reads /health after each request; a non-ok status or a new engine pid is a death."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.pid = self._health().get("engine_pid")

    def _health(self) -> dict[str, Any]:
        return dict(self.client.get("/health").json())

    def deaths(self) -> int:
        body = self._health()
        if body.get("status") != "ok" or body.get("engine_pid") != self.pid:
            self.pid = body.get("engine_pid")
            deadline = time.monotonic() + 120  # wait for a restart, if the server does one
            while body.get("status") != "ok" and time.monotonic() < deadline:
                time.sleep(0.5)
                body = self._health()
            self.pid = body.get("engine_pid")
            return 1
        return 0


def run_cases(client: httpx.Client, cases: list[Case], watch: Watch, tally: Tally, deadline: float) -> None:
    for case in cases:
        if time.monotonic() > deadline:
            break
        tally.requests += 1
        t0 = time.monotonic()
        try:
            r = _send(client, case)
        except httpx.HTTPError as exc:
            tally.transport_errors.append(f"{case.name}: {type(exc).__name__}")
            continue
        finally:
            tally.timed(case.name, time.monotonic() - t0)
        tally.statuses[r.status_code] += 1
        if r.status_code >= 500:
            tally.server_errors.append(f"{case.name}: {r.status_code} {r.text[:200]}")
        if r.status_code not in case.expect:
            tally.unexpected.append(f"{case.name}: got {r.status_code}, expected {case.expect}: {r.text[:160]}")
        tally.engine_deaths += watch.deaths()


def run_schemathesis(base: str, model: str, examples: int, watch: Watch, tally: Tally,
                     deadline: float) -> dict[str, Any]:
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from hypothesis import HealthCheck, Phase, settings
    from schemathesis.core.result import Ok

    auth = {"Authorization": f"Bearer {KEY}"}
    doc = httpx.get(base + "/openapi.json", headers=auth, timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    findings: Counter[str] = Counter()
    per_op: dict[str, int] = {}

    def fix(case: Any) -> None:
        if isinstance(case.body, dict):
            if "model" in case.body:
                case.body["model"] = model
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                v = case.body.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and MAX_GEN_TOKENS < v < 100_000:
                    case.body[key] = MAX_GEN_TOKENS
            if "max_tokens" not in case.body and "messages" in case.body:
                case.body["max_tokens"] = MAX_GEN_TOKENS
            if "max_output_tokens" not in case.body and "input" in case.body:  # /v1/responses
                case.body["max_output_tokens"] = MAX_GEN_TOKENS
        if case.path_parameters and "model_id" in case.path_parameters and hash(str(case.path_parameters)) % 2:
            case.path_parameters["model_id"] = model

    def make_probe(op: Any, mode: Any, label: str) -> Any:
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @hypothesis.given(op.as_strategy(generation_mode=mode))
        def probe(case: Any) -> None:
            if time.monotonic() > deadline:
                return
            fix(case)
            tally.requests += 1
            per_op[label] += 1
            t0 = time.monotonic()
            try:
                response = case.call(base_url=base, headers=auth, timeout=60)
            except Exception as exc:  # transport failures are reported, not raised
                tally.transport_errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:120]}")
                return
            finally:
                tally.timed(label, time.monotonic() - t0)
            tally.statuses[response.status_code] += 1
            if response.status_code >= 500:
                tally.server_errors.append(f"{label}: {response.status_code} {response.text[:200]} "
                                           f"body={str(case.body)[:200]}")
            try:
                case.validate_response(response)
            except BaseException as exc:  # conformance findings (a group): informative, not the gate
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                for sub in getattr(exc, "exceptions", [exc]):
                    findings[f"{label}: {getattr(sub, 'title', None) or str(sub).splitlines()[0][:100]}"] += 1
            tally.engine_deaths += watch.deaths()

        return probe

    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            findings[f"schema error: {result}"[:120]] += 1
            continue
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            label = f"{op.label} {mode.value}"
            per_op[label] = 0
            try:
                make_probe(op, mode, label)()
            except hypothesis.errors.Unsatisfiable:  # no negative case exists (no inputs at all)
                pass
    return {"cases_per_operation": per_op, "conformance_findings": dict(findings.most_common(12))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--examples", type=int, default=40, help="schemathesis cases per operation and mode")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="seconds each phase (hand-written, schemathesis) may send for")
    p.add_argument("--server-args", default="--device cpu", help="extra `ftrs serve` options")
    args = p.parse_args(argv)

    log = Path(tempfile.gettempdir()) / f"ftrs-abuse-{os.getpid()}.log"
    os.environ["FTRS_API_KEY"] = KEY  # the server reads the key from the environment
    server = serverproc.ServerProcess(["--model", args.model, *args.server_args.split()], log=log)
    start = time.monotonic()
    try:
        server.wait("ok", timeout=300)
        tally = Tally()
        with httpx.Client(base_url=server.url, timeout=60) as client:
            watch = Watch(client)
            # the refusals first: they are quick, generations are slow on a busy CPU
            cases = sorted(bad_inputs(args.model), key=lambda c: 200 in c.expect)
            run_cases(client, cases, watch, tally, time.monotonic() + args.budget_s)
            hand = {"cases": len(cases), "sent": tally.requests,
                    "statuses": dict(sorted(tally.statuses.items()))}
            fuzz = run_schemathesis(server.url, args.model, args.examples, watch, tally,
                                    time.monotonic() + args.budget_s)
            alive = server.proc.poll() is None and client.get("/health").json().get("status") == "ok"
    finally:
        server.stop()
    out = {
        "model": args.model,
        "requests": tally.requests,
        "status_counts": {str(k): v for k, v in sorted(tally.statuses.items())},
        "server_errors_5xx": len(tally.server_errors),
        "engine_deaths": tally.engine_deaths,
        "server_alive_at_end": alive,
        "hand_written": hand,
        "unexpected_status": tally.unexpected[:30],
        "unexpected_status_count": len(tally.unexpected),
        "transport_errors": tally.transport_errors[:10],
        "server_error_samples": tally.server_errors[:10],
        "schemathesis": fuzz,
        "slowest_s": [[round(t, 2), name] for t, name in tally.slowest],
        "wall_s": round(time.monotonic() - start, 1),
    }
    print(json.dumps(out, indent=2))
    return 0 if not tally.server_errors and not tally.engine_deaths and alive else 1


if __name__ == "__main__":
    sys.exit(main())
