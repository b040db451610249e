"""Real server processes on loopback for the server tests (helpers; fixtures in conftest.py).

`ServerProcess` runs `python -m ftrs.server` in a subprocess (the same code path as `ftrs serve`)
and waits for `/health`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, args: list[str], api_key: str | None = API_KEY, backend: str | None = "fake_backend") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # `ftrs serve` when the CLI is there, else the server's own entry point (same options)
        entry = ["ftrs", "serve"] if (ROOT / "python/ftrs/__main__.py").is_file() else ["ftrs.server"]
        cmd = [sys.executable, "-m", *entry, "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        if backend:
            cmd += ["--engine-backend", backend]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "python"), str(HERE), env.get("PYTHONPATH", "")]
        )
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"ftrs-server-{self.port}.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait(self, status: str = "ok", timeout: float = 120.0) -> dict[str, object]:
        """Wait until /health reports `status` ("ok" or "failed")."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                body = httpx.get(self.url + "/health", timeout=2).json()
                if body.get("status") == status:
                    return dict(body)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not {status} in {timeout} s:\n{self.log.read_text()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {"name{label=value,...}": value}, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
