"""Fixtures of the server tests.

The session-scoped `fake_server` serves the fake backend of `fake_backend.py` with an API key
and `--default-max-tokens FAKE_DEFAULT_MAX_TOKENS`, so every test drives real HTTP, the real
engine-process pipe and the official `openai` client without a model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ftrs_server_harness import API_KEY, FAKE_DEFAULT_MAX_TOKENS, ServerProcess


@pytest.fixture(scope="session")
def fake_server() -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", "fake", "--default-max-tokens", str(FAKE_DEFAULT_MAX_TOKENS)])
    try:
        server.wait("ok")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(fake_server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


