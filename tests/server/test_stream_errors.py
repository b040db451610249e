"""An error no layer typed (a bug) while a stream is being written still ends the stream in the
route's own error event, and is counted: a client sees why, not a cut connection or an empty
200 (what /v1/responses did when encoding its first event raised)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from ftrs.server import responses, responses_api
from ftrs.server.metrics import ServerMetrics
from ftrs.server.protocol import Usage
from ftrs.server.responses_api_protocol import ResponsesRequest, to_chat


async def _broken() -> AsyncIterator[Any]:
    raise KeyError("a bug")
    yield  # an async generator  # pragma: no cover


def _body(resp: Any) -> list[str]:
    async def drain() -> list[str]:
        return [c if isinstance(c, str) else c.decode() async for c in resp.body_iterator]

    return asyncio.run(drain())


def _failed(metrics: ServerMetrics) -> float:
    return metrics.requests.labels("failed")._value.get()


def test_chat_stream_ends_in_an_error_chunk_then_done() -> None:
    metrics = ServerMetrics()
    chunks = _body(responses._stream(_broken(), metrics))
    assert chunks[-1] == "data: [DONE]\n\n"
    err = json.loads(chunks[-2].removeprefix("data: "))["error"]
    assert err["message"] == "internal server error: KeyError" and err["type"] == "server_error"
    assert _failed(metrics) == 1


def test_responses_stream_ends_in_error_and_failed_events() -> None:
    metrics = ServerMetrics()
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", "stream": True})
    ctx = SimpleNamespace(metrics=metrics)
    run = SimpleNamespace(usage=lambda: Usage.of(3, 0, 0))
    chunks = _body(responses_api._stream(ctx, req, to_chat(req), run, _broken(),  # type: ignore[arg-type]
                                         "resp_1", 0.0))
    events = [json.loads(c.split("data: ", 1)[1]) for c in chunks]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error",
                                           "response.failed"]
    assert events[2]["message"] == "internal server error: KeyError"
    assert _failed(metrics) == 1
