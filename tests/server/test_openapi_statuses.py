"""`/openapi.json` declares the statuses the routes really answer: each status is first provoked
on the app itself (no engine started: `/health` is 503 "starting"; a body over
`--max-request-bytes` is 413 before any route runs), then looked up in the served document."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from ftrs.server.app import ServeSettings, create_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    # not entered as a context manager: the lifespan, which spawns the engine, never runs
    return TestClient(create_app(ServeSettings(max_request_bytes=64)))


def _declared(doc: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    responses = doc["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path}: {status} not declared"
    return responses[str(status)]


def _schema_ref(declared: dict[str, Any]) -> str:
    return str(declared["content"]["application/json"]["schema"].get("$ref", ""))


@pytest.mark.parametrize(("path", "model"), [
    ("/v1/messages", "AnthropicError"),
    ("/v1/messages/count_tokens", "AnthropicError"),
    ("/v1/responses", "ErrorResponse"),
    ("/v1/chat/completions", "ErrorResponse"),
    ("/v1/completions", "ErrorResponse"),
])
def test_a_body_over_the_limit_is_a_declared_413(client: TestClient, path: str, model: str) -> None:
    r = client.post(path, content=b'{"model": "m", "padding": "' + b"x" * 100 + b'"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 413
    body = r.json()
    kind = body["error"]["type"] if model == "AnthropicError" else body["error"]["code"]
    assert kind == "request_too_large"
    doc = client.get("/openapi.json").json()
    assert _schema_ref(_declared(doc, path, "post", 413)).endswith("/" + model)


def test_health_while_loading_is_a_declared_503(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "starting"
    doc = client.get("/openapi.json").json()
    declared = _declared(doc, "/health", "get", 503)
    schema = declared["content"]["application/json"]["schema"]
    assert schema["required"] == ["status"] and "status" in schema["properties"]
    assert "200" in doc["paths"]["/health"]["get"]["responses"]
