"""SIGINT and SIGTERM stop `ftrs serve` on request: exit code 0, idle, busy or loading.

Real `ftrs serve` processes over the fake engine of `stopping_backend.py` (no model), on the
ports 8725-8729. Busy: every request in flight ends at once with 503 `server_shutting_down`
in its endpoint's shape (OpenAI error JSON, a last SSE error event and `[DONE]`, the
Anthropic error body), not with a plain-text 500 or a cut stream after uvicorn's graceful
timeout. Ctrl-C in a terminal signals the whole process group: the engine process ignores
it (no `engine_fault` from a KeyboardInterrupt in a step or a load). No exit leaves a
semaphore for the resource tracker to report.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from serverproc import ServerProcess

HERE = Path(__file__).resolve().parent
PORTS = itertools.cycle(range(8725, 8730))  # one server at a time
SLOW = "__slow__ once upon a time"  # 20 ms a step: 450 tokens outlast uvicorn's 5 s grace
LONG = 450


class Server(ServerProcess):
    def __init__(self, home: Path, model: str = "fake") -> None:
        super().__init__(["--model", model, "--engine-backend", "stopping_backend"],
                         log=home / "server.log", home=home, port=next(PORTS), new_session=True,
                         pythonpath=[HERE, HERE.parent / "server"])

    def signal(self, how: str) -> float:
        """Send `how` ("TERM", "INT", or "INTPG": SIGINT to the process group, as Ctrl-C in a
        terminal does); returns when."""
        sig = signal.SIGINT if how.startswith("INT") else signal.SIGTERM
        (os.killpg if how.endswith("PG") else os.kill)(self.proc.pid, sig)
        return time.monotonic()

    def text(self) -> str:
        return self.log.read_text()


def _completion(url: str, stream: bool) -> dict[str, Any]:
    body = {"model": "fake", "prompt": SLOW, "max_tokens": LONG, "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
        return {"status": r.status_code, "type": r.headers.get("content-type", ""), "lines": lines}


def _message(url: str, stream: bool) -> dict[str, Any]:
    body = {"model": "fake", "max_tokens": 300, "stream": stream,
            "messages": [{"role": "user", "content": SLOW}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
        return {"status": r.status_code, "type": r.headers.get("content-type", ""), "lines": lines}


def _streaming(server: Server) -> bool:
    """A probe stream has its first tokens: the engine is stepping."""
    body = {"model": "fake", "prompt": "__slow__", "max_tokens": 3, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    return r.status_code == 200 and "[DONE]" in r.text


@pytest.mark.parametrize("how", ["TERM", "INT", "INTPG"])
def test_a_stop_on_request_fails_requests_in_flight_with_503_and_exits_0(
        tmp_path: Path, how: str) -> None:
    server = Server(tmp_path)
    try:
        server.wait_ok()
        assert _streaming(server)
        with cf.ThreadPoolExecutor(4) as pool:
            calls = {"stream": pool.submit(_completion, server.url, True),
                     "plain": pool.submit(_completion, server.url, False),
                     "messages": pool.submit(_message, server.url, False),
                     "messages_stream": pool.submit(_message, server.url, True)}
            deadline = time.monotonic() + 20
            while httpx.get(server.url + "/health", timeout=5).json().get("in_flight", 0) < 4:
                assert time.monotonic() < deadline, server.text()
                time.sleep(0.05)
            time.sleep(0.3)  # every request has tokens out
            sent = server.signal(how)
            got = {name: call.result(timeout=30) for name, call in calls.items()}
            answered_s = time.monotonic() - sent
        code = server.exit_code(timeout=20)
        stopped_s = time.monotonic() - sent
    finally:
        server.stop()
    print(f"SIG{how}: clients answered in {answered_s:.2f} s, exit {code} after {stopped_s:.2f} s")
    log = server.text()
    assert code == 0, log
    assert answered_s < 4.0, log  # at once, not after uvicorn's 5 s graceful timeout

    plain = got["plain"]
    assert plain["status"] == 503 and plain["type"].startswith("application/json"), plain
    assert json.loads(plain["lines"][0])["error"]["code"] == "server_shutting_down"

    stream = got["stream"]["lines"]
    assert stream[-1] == "data: [DONE]", stream[-3:]
    last = json.loads(stream[-2].removeprefix("data: "))
    assert last["error"]["code"] == "server_shutting_down", stream[-3:]

    messages = got["messages"]
    assert messages["status"] == 503, messages
    assert json.loads(messages["lines"][0]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "server is shutting down"}}

    events = got["messages_stream"]["lines"]
    assert events[-2:] == ["event: error", 'data: {"type": "error", "error": {"type": '
                           '"overloaded_error", "message": "server is shutting down"}}'], events[-4:]

    assert "KeyboardInterrupt" not in log and "Traceback" not in log, log
    assert "engine_fault" not in log and "leaked semaphore" not in log, log


@pytest.mark.parametrize("how", ["TERM", "INTPG"])
def test_a_stop_on_request_while_idle_exits_0_with_no_leaked_semaphore(
        tmp_path: Path, how: str) -> None:
    server = Server(tmp_path)
    try:
        server.wait_ok()
        assert _streaming(server)
        server.signal(how)
        code = server.exit_code(timeout=20)
    finally:
        server.stop()
    log = server.text()
    assert code == 0, log
    assert "leaked semaphore" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("how", ["TERM", "INTPG"])
def test_a_stop_on_request_while_the_model_loads_exits_0(tmp_path: Path, how: str) -> None:
    server = Server(tmp_path, model="slow-load")
    try:
        server.wait("loading", timeout=60)
        time.sleep(1.0)  # the engine process is inside its load
        sent = server.signal(how)
        code = server.exit_code(timeout=20)
        stopped_s = time.monotonic() - sent
    finally:
        server.stop()
    log = server.text()
    print(f"SIG{how} while loading: exit {code} after {stopped_s:.2f} s")
    assert code == 0, log
    assert stopped_s < 8.0, log  # the engine is terminated, not waited for
    assert "KeyboardInterrupt" not in log and "engine load failed" not in log, log
    assert "leaked semaphore" not in log, log


def test_the_engine_process_draws_progress_bars_without_a_named_semaphore() -> None:
    """An engine killed outright (SIGKILL, the OOM killer) runs no finalizer: a semaphore it made
    is left to the resource tracker, which reports it as leaked when the server stops. The
    engine's bars (the loader's tqdm) must make none; a fresh interpreter shows what it makes."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "from tqdm import tqdm\n"
             "from tqdm.std import TqdmDefaultWriteLock as L\n"
             "if sys.argv[1] == 'engine':\n"
             "    from ftrs.server.engine_process import bars_without_semaphore\n"
             "    bars_without_semaphore()\n"
             "for _ in tqdm(range(3), disable=False, file=sys.stderr):\n"
             "    pass\n"
             "print(type(getattr(L, 'mp_lock', None)).__name__)\n")
    made = {who: subprocess.run([sys.executable, "-c", probe, who], capture_output=True,
                                text=True, check=True).stdout.strip()
            for who in ("plain", "engine")}
    assert made["plain"] == "RLock", made  # tqdm's default: the probe sees the semaphore
    assert made["engine"] == "NoneType", made
