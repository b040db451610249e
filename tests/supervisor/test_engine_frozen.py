"""An engine process that is frozen whole (SIGSTOP, a frozen cgroup, a native deadlock that
holds the GIL) is noticed by the API process: its heartbeats stop, and after `--hang-timeout`
s of silence the API side declares `EngineHang` (503 `engine_hang`), writes the crash report,
kills the process and lets the policy act. The engine's own watchdog cannot: it is frozen too.

Real `ftrs serve` processes over the fake engine of `faulty_backend.py` (`__slow__`: 20 ms
steps, so requests are still running when the engine is stopped).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from serverproc import ServerProcess

HERE = Path(__file__).resolve().parent
HANG_TIMEOUT_S = 3.0
TOLD_WITHIN_S = HANG_TIMEOUT_S + 6.0  # the timeout, the reader's 1 s poll, a loaded host


class Server(ServerProcess):
    def __init__(self, home: Path, *args: str) -> None:
        super().__init__(["--model", "fake", "--engine-backend", "faulty_backend", "--device",
                          "cpu", "--hang-timeout", str(HANG_TIMEOUT_S), *args],
                         log=home / "server.log", home=home,
                         pythonpath=[HERE, HERE.parent / "server"])

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=5)

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and s.labels == labels:
                    return float(s.value)
        raise KeyError(name)


def _unfreeze(pid: int | None) -> None:
    """Whatever the test stopped, it does not leave stopped (nor running)."""
    if pid is not None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _wait_in_flight(server: Server, n: int) -> None:
    deadline = time.monotonic() + 20
    while server.health().json().get("in_flight") != n:
        assert time.monotonic() < deadline, server.health().text
        time.sleep(0.05)


def test_a_stopped_engine_is_declared_hung_and_restarted(tmp_path: Path) -> None:
    server = Server(tmp_path, "--on-device-lost", "restart")
    stopped: int | None = None
    try:
        server.wait_ok()
        pid = int(server.health().json()["engine_pid"])
        answers: dict[str, httpx.Response] = {}

        def plain() -> None:
            answers["plain"] = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "fake", "prompt": "__slow__ plain", "max_tokens": 400})

        waiter = threading.Thread(target=plain)
        body = {"model": "fake", "prompt": "__slow__", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            waiter.start()
            _wait_in_flight(server, 2)
            os.kill(pid, signal.SIGSTOP)
            stopped, at = pid, time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            told_s = time.monotonic() - at
        waiter.join(TOLD_WITHIN_S)
        print(f"\nengine stopped: the streaming client was told in {told_s:.2f} s "
              f"(hang timeout {HANG_TIMEOUT_S:g} s)")
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_hang", error
        assert f"pid {pid}" in error["message"] and "heartbeat" in error["message"]
        assert told_s < TOLD_WITHIN_S
        assert answers["plain"].status_code == 503, answers["plain"].text
        assert answers["plain"].json()["error"]["code"] == "engine_hang"
        health = server.health()  # the 0.5 s backoff, then the new engine's load
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "restarting", health.text
        assert health.json()["cause"]["type"] == "EngineHang"
        (report,) = (tmp_path / "crash").glob("*-EngineHang.json")
        evidence = json.loads(report.read_text())["evidence"]
        assert evidence["decided_by"] == ["api_watchdog"] and evidence["pid"] == pid
        assert evidence["process_state"] == "T (stopped)"
        assert evidence["silent_s"] >= HANG_TIMEOUT_S == evidence["hang_timeout_s"]
        server.wait_ok(timeout=60)
        assert int(server.health().json()["engine_pid"]) != pid
        after = httpx.post(server.url + "/v1/completions", timeout=30,
                           json={"model": "fake", "prompt": "after", "max_tokens": 5})
        assert after.status_code == 200, after.text
        assert server.metric("ftrs_engine_restarts_total") == 1
        assert server.metric("ftrs_requests_total", status="failed") == 2
        assert server.proc.poll() is None
    finally:
        _unfreeze(stopped)
        server.stop()


@pytest.mark.parametrize("sigterms", [False, True], ids=["alone", "sigterms"])
def test_a_stopped_idle_engine_ends_the_server_with_88_by_default(tmp_path: Path,
                                                                   sigterms: bool) -> None:
    """`--on-device-lost exit` (the default): an EngineHang is a device error like the
    engine's own watchdog's, so the server exits 88 after its grace, idle or not. With
    `sigterms`, a service manager stops the unit that is already exiting: SIGTERMs from the
    moment the exit is decided (its grace, then the teardown after serve() returns) leave the
    fault's code, not the signal's death (143)."""
    server = Server(tmp_path)
    stopped: int | None = None
    try:
        server.wait_ok()
        stopped = int(server.health().json()["engine_pid"])
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.monotonic() + TOLD_WITHIN_S + 5
        while sigterms and "exiting with code 88" not in server.log.read_text():
            assert time.monotonic() < deadline and server.proc.poll() is None, \
                server.log.read_text()
            time.sleep(0.05)
        while sigterms and server.proc.poll() is None and time.monotonic() < deadline + 10:
            with contextlib.suppress(ProcessLookupError):
                server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        assert server.exit_code(timeout=TOLD_WITHIN_S + 5) == 88, server.log.read_text()
    finally:
        _unfreeze(stopped)
        server.stop()
    log = server.log.read_text()
    assert "not even its heartbeat" in log, log
    assert list((tmp_path / "crash").glob("*-EngineHang.json"))
