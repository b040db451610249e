"""What one client's request may cost the server before it is served, and what it may hold.

- A prompt longer than the context's worth of the vocabulary's longest tokens is refused with
  the context-length 400 without being tokenized; one that may fit is tokenized as before.
- A request whose client has left is refused before it is tokenized.
- `/health` keeps answering while megabyte prompts are refused (a real tokenizer, in a server).
- With an API key, a request without it is refused from its headers, before its body is read;
  a body that does not arrive whole within `--request-body-timeout` is a 408, and the
  connection is closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from ftrs_server_harness import API_KEY, ServerProcess

from ftrs.errors import ContextLengthExceeded
from ftrs.models.tiny import tiny_tokenizer
from ftrs.server import serving
from ftrs.server.errors import ClientDisconnected
from ftrs.server.limits import BodyLimit
from ftrs.server.prepare import Limits, prepare_chat, prepare_completion
from ftrs.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_LEN = 256


class CountingTokenizer:
    """A real (tiny) tokenizer that counts its `encode` calls."""

    def __init__(self) -> None:
        self.inner = tiny_tokenizer(512)
        self.encoded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded += 1
        return self.inner.encode(text, add_special_tokens)


def _limits(tok: CountingTokenizer) -> Limits:
    return Limits(tok.vocab_size, MAX_LEN, default_max_tokens=16)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized() -> None:
    tok = CountingTokenizer()
    per_token = tok.max_chars_per_token
    assert per_token is not None
    long = "x" * (MAX_LEN * per_token + 1)
    with pytest.raises(ContextLengthExceeded) as info:
        prepare_completion(CompletionRequest(model="m", prompt=long), tok, _limits(tok))
    err = info.value
    assert err.evidence["param"] == "prompt" and err.evidence["max_model_len"] == MAX_LEN
    assert err.message == (f"This model's maximum context length is {MAX_LEN} tokens; the prompt "
                           f"has at least {MAX_LEN + 1} tokens")
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": long}]})
    with pytest.raises(ContextLengthExceeded) as info:
        prepare_chat(req, tok, _limits(tok))
    assert info.value.evidence["param"] == "messages" and info.value.code == "context_length_exceeded"
    assert tok.encoded == 0


def test_a_prompt_of_the_longest_tokens_that_fits_is_served() -> None:
    tok = CountingTokenizer()
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    assert len(longest) == tok.max_chars_per_token
    prompt = longest * (MAX_LEN - 16)  # as many tokens, exactly len / the longest entry
    plan = prepare_completion(CompletionRequest(model="m", prompt=prompt, max_tokens=16), tok,
                              _limits(tok))
    assert plan.prompt_ids == [vocab[longest]] * (MAX_LEN - 16) and tok.encoded == 1
    with pytest.raises(ContextLengthExceeded) as info:  # one more: the tokenizer's count says so
        prepare_completion(CompletionRequest(model="m", prompt=prompt + longest, max_tokens=16),
                           tok, _limits(tok))
    assert "the prompt has 241 tokens and max_tokens is 16" in info.value.message
    assert tok.encoded == 2


def _request(receive: Any) -> Any:
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": [], "query_string": b""}, receive)


def test_a_request_whose_client_left_is_refused_before_it_is_tokenized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[Any] = []

    def prepare(req: Any, tokenizer: Any, limits: Any) -> Any:
        prepared.append(req)
        raise ContextLengthExceeded("stop here")

    monkeypatch.setattr(serving, "prepare_chat", prepare)
    ctx: Any = SimpleNamespace(model_names=("m",), ready=lambda: SimpleNamespace(tokenizer=None),
                               limits=lambda: None)
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})

    async def left() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def stays() -> dict[str, Any]:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    with pytest.raises(ClientDisconnected):
        asyncio.run(serving.start_chat(ctx, req, _request(left)))
    assert prepared == []
    with pytest.raises(ContextLengthExceeded):  # a client still there: prepared, at once
        asyncio.run(asyncio.wait_for(serving.start_chat(ctx, req, _request(stays)), 5))
    assert prepared == [req]


# ---------------------------------------------------------------- BodyLimit, in process


async def _through(limit: BodyLimit, path: str, headers: dict[str, str], body: list[bytes] | None,
                   whole: bool = False) -> tuple[int, dict[str, str], bytes, list[bytes]]:
    """Run one request through `limit`: `body` is its chunks, and the client then sends nothing
    more unless the body is `whole` (None: the body must not be read at all). Returns status,
    headers, answer, and what the app read."""
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    chunks = list(body or [])
    sent: list[dict[str, Any]] = []
    read: list[bytes] = []

    async def receive() -> dict[str, Any]:
        assert body is not None, "the body was read"
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": not (whole and not chunks)}
        await asyncio.sleep(3600)  # the client sends nothing more
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        read.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limit.app = app
    await asyncio.wait_for(limit(scope, receive, send), 10)
    start = sent[0]
    answer = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, answer, read


def test_without_the_key_a_request_is_refused_before_its_body_is_read() -> None:
    limit = BodyLimit(None, max_bytes=1 << 22, timeout_s=30, api_key="k")  # type: ignore[arg-type]
    declared = {"content-length": str(1 << 22), "content-type": "application/json"}
    for path, headers in (("/v1/chat/completions", declared),
                          ("/v1/chat/completions", {**declared, "authorization": "Bearer nope"}),
                          ("/v1/chat/completions", {**declared, "x-api-key": "k"}),
                          ("/v1/nothing-here", declared)):
        status, head, answer, read = asyncio.run(_through(limit, path, headers, None))
        assert status == 401 and head["connection"] == "close", path
        assert head["www-authenticate"] == "Bearer"
        assert json.loads(answer)["error"]["code"] == "invalid_api_key"
    status, _, answer, _ = asyncio.run(_through(limit, "/v1/messages", declared, None))
    assert status == 401 and json.loads(answer)["error"]["type"] == "authentication_error"
    assert json.loads(answer)["type"] == "error"  # Anthropic's shape on its routes
    for path, key in (("/v1/chat/completions", {"authorization": "Bearer k"}),
                      ("/v1/messages", {"x-api-key": "k"}), ("/health", {}), ("/metrics", {})):
        status, _, answer, read = asyncio.run(_through(limit, path, {"content-length": "2", **key},
                                                       [b"{", b"}"], whole=True))
        assert (status, answer, read) == (200, b"ok", [b"{}"]), path


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes() -> None:
    limit = BodyLimit(None, max_bytes=1 << 22, timeout_s=0.3)  # type: ignore[arg-type]
    start = time.monotonic()
    status, head, answer, read = asyncio.run(_through(
        limit, "/v1/chat/completions", {"content-length": "1000"}, [b'{"model": ', b'"m"']))
    assert 0.3 <= time.monotonic() - start < 5
    assert status == 408 and head["connection"] == "close" and read == []
    err = json.loads(answer)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["type"]) == ("request_timeout", "invalid_request_error")
    assert "0.3 s" in err["message"] and "13 bytes came" in err["message"]
    status, _, answer, _ = asyncio.run(_through(limit, "/v1/messages", {}, [b"{"]))
    assert status == 408 and json.loads(answer)["type"] == "error"


def test_the_body_timeout_option_is_checked() -> None:
    import argparse

    from ftrs.errors import ConfigError
    from ftrs.server.cli import serve_limits

    assert serve_limits(argparse.Namespace())["request_body_timeout_s"] == 30
    assert serve_limits(argparse.Namespace(request_body_timeout=2))["request_body_timeout_s"] == 2
    with pytest.raises(ConfigError, match="request_body_timeout"):
        serve_limits(argparse.Namespace(request_body_timeout=0))


def test_the_openai_routes_declare_the_408() -> None:
    from fastapi.testclient import TestClient

    from ftrs.server.app import ServeSettings, create_app

    doc = TestClient(create_app(ServeSettings())).get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        declared = doc["paths"][path]["post"]["responses"]["408"]
        assert declared["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


# ---------------------------------------------------------------- live servers


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from ftrs.models.tiny import make_tiny

    model = make_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)
    server = ServerProcess(["--model", str(model), "--served-model-name", "tiny", "--device", "cpu",
                            "--dtype", "float32"], backend=None)
    try:
        server.wait("ok")
        yield server
    finally:
        server.stop()


def test_health_answers_while_megabyte_prompts_are_refused(tiny_server: ServerProcess) -> None:
    """Each prompt would hold the tokenizer for seconds (3.5 MB: about 3 s on the tiny byte-level
    vocabulary), with the GIL, had it been tokenized."""
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "ab " * 1_200_000}]}
    data = json.dumps(body).encode()
    headers = {**tiny_server.headers, "content-type": "application/json"}
    latencies: list[float] = []
    with cf.ThreadPoolExecutor(3) as pool:
        big = [pool.submit(httpx.post, tiny_server.url + "/v1/chat/completions", content=data,
                           headers=headers, timeout=120) for _ in range(3)]
        while not all(f.done() for f in big):
            start = time.monotonic()
            assert httpx.get(tiny_server.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.1)
    for f in big:
        r = f.result()
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "the prompt has at least" in r.json()["error"]["message"]
    assert max(latencies) < 2.0, latencies  # a loaded host; one tokenization held it ~3 s


@pytest.fixture(scope="module")
def quick_timeout_server() -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", "fake", "--request-body-timeout", "1"])
    try:
        server.wait("ok")
        yield server
    finally:
        server.stop()


def _raw(server: ServerProcess, head: str, body: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send `head` and `body` on one connection; read until the server closes it (or `wait_s`)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        start = time.monotonic()
        sock.sendall(head.encode() + body)
        got = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return got, -1.0  # still open
            if not chunk:
                return got, time.monotonic() - start
            got += chunk


def test_a_live_server_refuses_a_keyless_body_at_once_and_times_out_a_partial_one(
        quick_timeout_server: ServerProcess) -> None:
    declared = ("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                f"Content-Length: {4 << 20}\r\n")
    got, closed = _raw(quick_timeout_server, declared + "\r\n", b"", wait_s=10)
    assert got.startswith(b"HTTP/1.1 401 "), got[:200]
    assert 0 <= closed < 5 and b'"invalid_api_key"' in got
    got, closed = _raw(quick_timeout_server, declared + f"Authorization: Bearer {API_KEY}\r\n\r\n",
                       b'{"model": "fake", "messages": [', wait_s=15)
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert 0.9 <= closed < 10, closed  # answered after the 1 s deadline, then closed
    err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_timeout" and "--request-body-timeout" in err["message"]
    assert httpx.get(quick_timeout_server.url + "/health", timeout=5).status_code == 200
