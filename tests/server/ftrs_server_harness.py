"""Real server processes on loopback for the server tests (helpers; fixtures in conftest.py).

`ServerProcess` is `serverproc.ServerProcess` with the test API key and the fake engine backend.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

import serverproc

HERE = Path(__file__).resolve().parent
API_KEY = "test-key"
FAKE_DEFAULT_MAX_TOKENS = 40  # `--default-max-tokens` of the session's fake server


class ServerProcess(serverproc.ServerProcess):
    """A server with the test API key and, by default, the fake engine backend."""

    def __init__(self, args: list[str], api_key: str | None = API_KEY,
                 backend: str | None = "fake_backend") -> None:
        self.api_key = api_key
        extra = ["--api-key", api_key] if api_key else []
        extra += ["--engine-backend", backend] if backend else []
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"ftrs-server-{os.getpid()}-{id(self)}.log"
        super().__init__([*args, *extra], log=log, pythonpath=[HERE])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {"name{label=value,...}": value}, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
