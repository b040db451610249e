"""The API edge over real HTTP (fake engine): every bad input is a 400 naming its field, the
connection and the engine survive it, and the server's limits hold (body size, disconnects,
tokenization off the event loop, the OpenAPI document, API key sources, /health contents)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_backend import MAX_MODEL_LEN, ByteTokenizer
from ftrs_server_harness import FAKE_DEFAULT_MAX_TOKENS, ServerProcess, scrape

from ftrs.errors import ConfigError, FtrsError, ModelLoadError

MODEL = "fake"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
SURROGATE = "a\udc80b"

# (name, endpoint, body, status, code, param)
BAD: list[tuple[str, str, dict[str, Any], int, str, str | None]] = [
    ("seed below int64", "chat", {**CHAT, "seed": -(2**63) - 1, "temperature": 1.0}, 400, "invalid_request", "seed"),
    ("seed above uint64", "chat", {**CHAT, "seed": 2**64, "temperature": 1.0}, 400, "invalid_request", "seed"),
    ("seed a float", "chat", {**CHAT, "seed": 1.5}, 400, "invalid_request", "seed"),
    ("temperature 3", "chat", {**CHAT, "temperature": 3.0}, 400, "invalid_request", "temperature"),
    ("temperature 1e308", "chat", {**CHAT, "temperature": 1e308}, 400, "invalid_request", "temperature"),
    ("temperature a string", "chat", {**CHAT, "temperature": "hot"}, 400, "invalid_request", "temperature"),
    ("top_p 0", "chat", {**CHAT, "top_p": 0}, 400, "invalid_request", "top_p"),
    ("top_p 1.5", "chat", {**CHAT, "top_p": 1.5}, 400, "invalid_request", "top_p"),
    ("repetition_penalty 1e-300", "chat", {**CHAT, "repetition_penalty": 1e-300}, 400, "invalid_request", "repetition_penalty"),
    ("repetition_penalty 1e300", "chat", {**CHAT, "repetition_penalty": 1e300}, 400, "invalid_request", "repetition_penalty"),
    ("presence_penalty 3", "chat", {**CHAT, "presence_penalty": 3}, 400, "invalid_request", "presence_penalty"),
    ("frequency_penalty -3", "completion", {**COMPLETION, "frequency_penalty": -3}, 400, "invalid_request", "frequency_penalty"),
    ("max_tokens true", "chat", {**CHAT, "max_tokens": True}, 400, "invalid_request", "max_tokens"),
    ("role wizard", "chat", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ("role empty", "chat", {**CHAT, "messages": [{"role": "", "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ("role missing", "chat", {**CHAT, "messages": [{"content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ("stream yes", "chat", {**CHAT, "stream": "yes"}, 400, "invalid_request", "stream"),
    ("stream 1", "completion", {**COMPLETION, "stream": 1}, 400, "invalid_request", "stream"),
    ("completion logprobs true", "completion", {**COMPLETION, "logprobs": True}, 400, "invalid_request", "logprobs"),
    ("completion logprobs 21", "completion", {**COMPLETION, "logprobs": 21}, 400, "invalid_request", "logprobs"),
    ("top_logprobs 21", "chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "invalid_request", "top_logprobs"),
    ("prompt of bools", "completion", {**COMPLETION, "prompt": [True, False]}, 400, "invalid_request", "prompt[0]"),
    ("token id out of vocab", "completion", {**COMPLETION, "prompt": [1, 10**6]}, 400, "invalid_request", "prompt"),
    ("text part of a number", "chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "invalid_request", "messages[0].content[0].text"),
    ("text part without text", "chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "invalid_request", "messages[0].content[0]"),
    ("image part", "chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "invalid_request", "messages[0].content"),
    ("surrogate in prompt", "completion", {**COMPLETION, "prompt": SURROGATE}, 400, "invalid_request", "prompt"),
    ("surrogate in prompt list", "completion", {**COMPLETION, "prompt": [SURROGATE]}, 400, "invalid_request", "prompt[0]"),
    ("surrogate in content", "chat", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, 400, "invalid_request", "messages[0].content"),
    ("surrogate in a text part", "chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     400, "invalid_request", "messages[0].content[0].text"),
    ("surrogate in role", "chat", {**CHAT, "messages": [{"role": SURROGATE, "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ("surrogate in name", "chat", {**CHAT, "messages": [{"role": "user", "content": "x", "name": SURROGATE}]}, 400, "invalid_request", "messages[0].name"),
    ("surrogate in model", "chat", {**CHAT, "model": SURROGATE}, 400, "invalid_request", "model"),
    ("surrogate in stop", "completion", {**COMPLETION, "stop": [SURROGATE]}, 400, "invalid_request", "stop[0]"),
    ("an empty stop string in a list", "chat", {**CHAT, "stop": ["a", ""]}, 400, "invalid_request", "stop[1]"),
    ("max_completion_tokens 0 beside max_tokens", "chat", {**CHAT, "max_completion_tokens": 0, "max_tokens": 5},
     400, "invalid_request", "max_completion_tokens"),
    # JSON carried as it is (schemas, arguments, template variables): keys and values checked too
    ("surrogate in a tool schema key", "chat", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {SURROGATE: {"type": "string"}}}}}]},
     400, "invalid_request", "tools[0].function.parameters"),
    ("surrogate in a tool schema value", "chat", {**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "description": SURROGATE}}}]},
     400, "invalid_request", "tools[0].function.parameters"),
    ("surrogate in a response schema key", "chat", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {SURROGATE: {"type": "string"}}}}}},
     400, "invalid_request", "response_format.json_schema.schema"),
    ("surrogate in chat_template_kwargs", "chat", {**CHAT, "chat_template_kwargs": {"x": [SURROGATE]}},
     400, "invalid_request", "chat_template_kwargs"),
    ("surrogate in tool call arguments", "chat", {**CHAT, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {SURROGATE: 1}}}]},
        {"role": "user", "content": "x"}]}, 400, "invalid_request", "messages[0].tool_calls[0].function.arguments"),
    ("surrogate escaped in tool call arguments text", "chat", {**CHAT, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"k": "\\udc80"}'}}]},
        {"role": "user", "content": "x"}]}, 400, "invalid_request", "messages[0].tool_calls[0].function.arguments"),
    ("tool without a name", "chat", {**CHAT, "tools": [{"type": "function", "function": {"parameters": {}}}]},
     400, "invalid_request", "tools[0].function.name"),
    ("forced tool with a schema that cannot compile", "chat", {**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     400, "invalid_request", "tools[1].function.parameters"),
    ("tool_choice naming no tool", "chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                            "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "invalid_request", "tool_choice"),
    ("tool arguments not JSON", "chat", {**CHAT, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "user", "content": "x"}]}, 400, "invalid_request", "messages[0].tool_calls[0].function.arguments"),
    ("schema that cannot compile", "chat", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     400, "invalid_request", "response_format.json_schema.schema"),
    ("json_schema without a schema", "chat", {**CHAT, "response_format": {"type": "json_schema"}},
     400, "invalid_request", "response_format.json_schema"),
    ("response_format type xml", "chat", {**CHAT, "response_format": {"type": "xml"}}, 400, "invalid_request", "response_format.type"),
    ("tool_choice auto", "chat", {**CHAT, "tool_choice": "auto"}, 400, "invalid_request", "tool_choice"),
    ("function_call auto", "chat", {**CHAT, "function_call": "auto"}, 400, "invalid_request", "function_call"),
    ("assistant tool_call without function", "chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
     400, "invalid_request", "messages[0].tool_calls[0].function"),
    ("chat_template_kwargs overriding messages", "chat", {**CHAT, "chat_template_kwargs": {"messages": []}},
     400, "invalid_request", "chat_template_kwargs"),
    ("audio", "chat", {**CHAT, "audio": {"voice": "x"}}, 400, "invalid_request", "audio"),
    ("n 0", "chat", {**CHAT, "n": 0}, 400, "invalid_request", "n"),
    ("n above --max-n", "chat", {**CHAT, "n": 9}, 400, "invalid_request", "n"),
    ("n above --max-n on completions", "completion", {**COMPLETION, "n": 9}, 400, "invalid_request", "n"),
    ("logit_bias key not an id", "chat", {**CHAT, "logit_bias": {"a": 10}}, 400, "invalid_request", "logit_bias"),
    ("logit_bias 101", "completion", {**COMPLETION, "logit_bias": {"65": 101}}, 400, "invalid_request", "logit_bias"),
    ("logit_bias id past the vocab", "chat", {**CHAT, "logit_bias": {"258": 1}}, 400, "invalid_request", "logit_bias"),
    ("logit_bias a string", "chat", {**CHAT, "logit_bias": {"65": "up"}}, 400, "invalid_request", "logit_bias"),
    ("suffix", "completion", {**COMPLETION, "suffix": "x"}, 400, "invalid_request", "suffix"),
    ("echo", "completion", {**COMPLETION, "echo": True}, 400, "invalid_request", "echo"),
    ("best_of 2", "completion", {**COMPLETION, "best_of": 2}, 400, "invalid_request", "best_of"),
]

ACCEPTED: list[tuple[str, str, dict[str, Any]]] = [
    ("seed at the int64 floor", "chat", {**CHAT, "seed": -(2**63), "temperature": 1.0}),
    ("seed at the uint64 ceiling", "chat", {**CHAT, "seed": 2**64 - 1, "temperature": 1.0}),
    ("tool_choice none", "chat", {**CHAT, "tool_choice": "none", "tools": []}),
    ("response_format text", "chat", {**CHAT, "response_format": {"type": "text"}}),
    ("response_format json_object", "chat", {**CHAT, "response_format": {"type": "json_object"}}),
    ("a named tool_choice", "chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                     "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("empty logit_bias", "chat", {**CHAT, "logit_bias": {}}),
    ("logit_bias in range", "chat", {**CHAT, "logit_bias": {"65": 100, "66": -100, "67": 0.5}}),
    ("logit_bias on completions", "completion", {**COMPLETION, "logit_bias": {"65": -100}}),
    ("developer role", "chat", {**CHAT, "messages": [{"role": "developer", "content": "be brief"},
                                                       {"role": "user", "content": "x"}]}),
    ("nulls for optional fields", "chat", {**CHAT, "n": None, "stream": None, "temperature": None, "stop": None}),
    ("unknown fields ignored", "chat", {**CHAT, "store": True, "metadata": {"a": "b"}, "frobnicate": 3}),
    ("unknown field with a surrogate ignored", "completion", {**COMPLETION, "frobnicate": SURROGATE}),
]

URL = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def _post(http: httpx.Client, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` as ASCII JSON: a lone surrogate travels as the escape `\\udc80`, as a client
    written in another language would send it (httpx's own encoder refuses it)."""
    return http.post(URL[endpoint], content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def http(fake_server: ServerProcess) -> Any:
    with httpx.Client(base_url=fake_server.url, headers=fake_server.headers, timeout=15) as c:
        yield c


@pytest.mark.parametrize("name,endpoint,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field_and_the_connection_serves_on(
        http: httpx.Client, name: str, endpoint: str, body: dict[str, Any], status: int, code: str,
        param: str | None) -> None:
    r = _post(http, endpoint, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err
    assert err["message"].startswith(param) if param else err["message"]
    assert "start:" not in err["message"]  # no grammar source in the message
    assert r.headers.get("connection") != "close"  # the keep-alive connection is intact
    ok = http.post(URL[endpoint], json=CHAT if endpoint == "chat" else COMPLETION)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("name,endpoint,body", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_supported_values_and_unknown_fields_are_served(http: httpx.Client, name: str, endpoint: str,
                                                        body: dict[str, Any]) -> None:
    r = _post(http, endpoint, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_chat_without_max_tokens_gets_the_default_cap_or_the_context_rest(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "no cap given"}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == FAKE_DEFAULT_MAX_TOKENS
    long = "y" * (MAX_MODEL_LEN - 30)
    body = {"model": MODEL, "messages": [{"role": "user", "content": long}]}
    prompt_len = len(ByteTokenizer().apply_chat_template(body["messages"]).encode())  # type: ignore[arg-type]
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert MAX_MODEL_LEN - prompt_len < FAKE_DEFAULT_MAX_TOKENS
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_len


def test_a_body_over_the_cap_is_413_declared_or_chunked(http: httpx.Client) -> None:
    big = {**COMPLETION, "prompt": "x" * (5 * 2**20)}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["code"] == "request_too_large"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    def chunks() -> Any:
        yield b'{"model": "fake", "prompt": "'
        for _ in range(80):
            yield b"x" * 65536
        yield b'"}'

    r = httpx.post(http.base_url.join("/v1/completions"), content=chunks(), timeout=15,
                   headers={**http.headers, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_models_by_id_and_unknown_ids(http: httpx.Client) -> None:
    r = http.get("/v1/models/fake")
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    assert r.json()["max_model_len"] == MAX_MODEL_LEN
    r = http.get("/v1/models/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert httpx.get(http.base_url.join("/v1/models/fake")).status_code == 401


def test_openapi_and_docs_need_the_key_and_document_400_not_422(http: httpx.Client,
                                                               fake_server: ServerProcess) -> None:
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(fake_server.url + path, timeout=5).status_code == 401, path
    doc = http.get("/openapi.json").json()
    assert "422" not in str(doc["paths"])
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "/v1/models/{model_id}" in doc["paths"]
    assert "swagger-ui" in http.get("/docs").text


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(fake_server: ServerProcess) -> None:
    url = fake_server.url
    before = scrape(url)
    body = {"model": MODEL, "prompt": "walk away", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(url + "/v1/completions", json=body, headers=fake_server.headers, timeout=0.3)
    deadline = time.monotonic() + 10
    while scrape(url)["ftrs_requests_total{status=aborted}"] == before["ftrs_requests_total{status=aborted}"]:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    after = scrape(url)
    assert after["ftrs_requests_total{status=success}"] == before["ftrs_requests_total{status=success}"]
    assert after["ftrs_generation_tokens_total"] - before["ftrs_generation_tokens_total"] < 480


def test_a_slow_tokenization_does_not_stall_health(fake_server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "__slow_tokenize__"}], "max_tokens": 2}
    with cf.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, fake_server.url + "/v1/chat/completions", json=body,
                           headers=fake_server.headers, timeout=30)
        time.sleep(0.5)  # the slow request is tokenizing now (for 3 s)
        health = httpx.get(fake_server.url + "/health", timeout=1.5)  # ReadTimeout if the loop is held
        assert health.status_code == 200
        assert not slow.done()
        assert slow.result().status_code == 200


# ------------------------------------------------------------------ in-process, no server needed


def _app_with_failure(err: FtrsError) -> Any:
    from ftrs.config import EngineConfig
    from ftrs.server.app import ServeSettings, create_app

    app = create_app(ServeSettings(engine=EngineConfig(model="fake"), backend="fake_backend"))
    client = app.state.engine
    client.state, client.failure = "failed", err
    return app


def test_health_shows_class_and_message_never_a_traceback_or_absolute_path() -> None:
    tb = ['Traceback (most recent call last):\n', '  File "/srv/ftrs/python/ftrs/engine/core.py", line 9\n']
    err = ModelLoadError("/home/someone/models/m.gguf", "RuntimeError: boom", evidence={"traceback": tb})

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app_with_failure(err))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/health")

    r = asyncio.run(get())
    assert r.status_code == 503
    text = r.text
    assert "Traceback" not in text and "core.py" not in text and "/home/" not in text, text
    assert r.json()["error"] == {"type": "ModelLoadError", "message": "m.gguf: RuntimeError: boom"}


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_api_key_from_flag_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrs.server.cli import resolve_api_key

    monkeypatch.delenv("FTRS_API_KEY", raising=False)
    assert resolve_api_key(_args()) is None
    monkeypatch.setenv("FTRS_API_KEY", "from-env")
    assert resolve_api_key(_args()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(_args(api_key_file=key_file)) == "from-file"
    assert resolve_api_key(_args(api_key="from-flag", api_key_file=key_file)) == "from-flag"
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ConfigError, match="api_key_file"):
            resolve_api_key(_args(api_key_file=bad))
