"""Device supervisor, end to end: real `ftrs serve` processes with `--fault-inject` (issue 5).

A tiny mixtral on the CPU with the offload strategy (2 expert slots, so every step copies),
each server with its own FTRS_HOME. The scenario matrix: {device lost during prefill, during
decode, during a transfer, while idle; kernel fault; OOM; hang} x {streaming, non-streaming,
8 concurrent clients}. A fatal fault ends the server, so the three client shapes of a scenario
share one server and are in flight *together* (1 streaming + 1 non-streaming + 8 concurrent,
half of them streaming: `KIND@step=N,running=10` fires N steps after all ten are in); the
servers start in parallel once per module, so the matrix costs ~9 server starts, not ~21.
Checked for each: every client gets its typed error within 5 s, /health and /metrics show
the state, the crash report holds the last steps and the evidence, `ftrs serve` exits with
the error's code. OOM fails only the failed step's requests and keeps serving; with
`--on-device-lost cpu` a request after the loss succeeds.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from serverproc import ServerProcess

OPTIONS = ["--device", "cpu", "--dtype", "float32", "--moe-strategy", "offload",
           "--moe-cache-size", "2", "--no-moe-prefetch"]



class Server(ServerProcess):
    """`ftrs serve` on the tiny MoE with FTRS_HOME (crash reports) in `home`."""

    def __init__(self, model: Path, home: Path, *args: str) -> None:
        super().__init__(["--model", str(model), "--served-model-name", "tiny", *OPTIONS, *args],
                         log=home / "server.log", home=home)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ftrs.models.tiny import make_tiny

    return make_tiny("mixtral", tmp_path_factory.mktemp("tiny") / "mixtral", seed=0)


ALL_IN = "running=10"  # the 10 clients of `_run_shapes`
LONG_PROMPT = list(range(5, 125))  # 120 tokens: 8 chunks of 16 each, 10 of them in flight
# name: (server arguments, request body overrides)
SCENARIOS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "prefill": (["--fault-inject", f"device_lost@step=2,{ALL_IN}", "--max-prefill-length", "16"],
                {"prompt": LONG_PROMPT}),
    # resident experts: no copy, the step itself raises (a kernel launch that finds no GPU)
    "decode": (["--fault-inject", f"device_lost@step=3,{ALL_IN}", "--moe-strategy", "resident"],
               {}),
    # offload: the step's next expert copy fails in the copy backend, raised from its `wait`
    "transfer": (["--fault-inject", f"device_lost@step=3,{ALL_IN}"], {}),
    "kernel_fault": (["--fault-inject", f"kernel_fault@step=3,{ALL_IN}"], {}),
    "hang": (["--fault-inject", f"hang@step=3,{ALL_IN}", "--hang-timeout", "1.5"], {}),
    # room for 4 of the 10: the OOM fails the 4 of its step, the 6 others finish
    "oom": (["--fault-inject", f"oom@step=3,{ALL_IN}", "--max-running-requests", "4"],
            {"max_tokens": 150}),
    "cpu": (["--fault-inject", "device_lost@step=3", "--on-device-lost", "cpu"], {}),
}


@pytest.fixture(scope="module")
def fleet(tiny_mixtral: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """One server per scenario, all started at once (startup is mostly imports), all ready
    before the first test so no test's timing shares the CPU with another server's start."""
    servers = {name: Server(tiny_mixtral, tmp_path_factory.mktemp(name), *args)
               for name, (args, _) in SCENARIOS.items()}
    try:
        for server in servers.values():
            server.wait_ok()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture
def serve(tiny_mixtral: Path, tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def start(*args: str) -> Server:
        server = Server(tiny_mixtral, tmp_path, *args)
        servers.append(server)
        server.wait_ok()
        return server

    yield start
    for s in servers:
        s.stop()


BODY = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 1000, "temperature": 0,
        "ignore_eos": True}


@dataclass
class Result:
    status: int
    code: str | None  # the typed error's code, None when the request succeeded
    error: dict[str, Any] | None
    tokens: int  # completion tokens received (streamed chunks, or usage)
    finish_reason: str | None
    end: float  # monotonic time the answer ended
    last_data: float  # monotonic time of the last byte before the end (request sent, or last chunk)


def _request(url: str, stream: bool, body: dict[str, Any] | None = None) -> Result:
    body = {**BODY, **(body or {})}
    with httpx.Client(timeout=60) as c:
        if not stream:
            t0 = time.monotonic()
            r = c.post(url + "/v1/completions", json=body)
            data = r.json()
            err = data.get("error") if r.status_code != 200 else None
            tokens = 0 if err else data["usage"]["completion_tokens"]
            reason = None if err else data["choices"][0]["finish_reason"]
            return Result(r.status_code, err and err["code"], err, tokens, reason,
                          time.monotonic(), t0)
        with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            last = time.monotonic()
            if r.status_code != 200:
                r.read()
                err = r.json()["error"]
                return Result(r.status_code, err["code"], err, 0, None, time.monotonic(), last)
            err, tokens, reason = None, 0, None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    if "error" in data:
                        err = data["error"]
                        break
                    last = time.monotonic()
                    tokens += 1
                    reason = data["choices"][0].get("finish_reason") or reason
            return Result(r.status_code, err and err["code"], err, tokens, reason,
                          time.monotonic(), last)


SHAPES = ("stream", "plain", "concurrent8")


def _run_shapes(url: str, body: dict[str, Any] | None = None) -> dict[str, list[Result]]:
    """1 streaming client, 1 non-streaming client and 8 concurrent ones (half streaming), all
    in flight together; their results by shape."""
    plan = [("stream", True), ("plain", False)] + [("concurrent8", i % 2 == 1) for i in range(8)]
    with cf.ThreadPoolExecutor(len(plan)) as pool:
        futures = [(shape, pool.submit(_request, url, stream, body)) for shape, stream in plan]
        results: dict[str, list[Result]] = {shape: [] for shape in SHAPES}
        for shape, f in futures:
            results[shape].append(f.result(timeout=90))
    return results


def _check_typed(results: dict[str, list[Result]], code: str, status: int,
                 within_s: float = 5.0) -> None:
    """Every client got `code`: a stream that had begun as a final SSE error event (200),
    any other request as `status` JSON; each within `within_s` of its last data (the fault
    lands after every request is in), and all within 5 s of one another."""
    flat = [r for shape in SHAPES for r in results[shape]]
    assert len(flat) == 10 and all(results[s] for s in SHAPES)
    for r in flat:
        assert r.code == code and r.status in (200, status), flat
        assert r.end - r.last_data < within_s, flat
    ends = [r.end for r in flat]
    assert max(ends) - min(ends) < 5.0, flat


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _crash_report(home: Path, classification: str) -> dict[str, Any]:
    reports = sorted((home / "crash").glob(f"*-{classification}.json"))
    assert reports, f"no {classification} crash report in {home / 'crash'}"
    return dict(json.loads(reports[-1].read_text()))


def _watch_failed_state(url: str) -> cf.Future[dict[str, httpx.Response]]:
    """In the background: poll /health until it fails, then at once (the server exits after a
    1 s grace) a new plain request, a new streaming one and /metrics; their responses."""

    def watch() -> dict[str, httpx.Response]:
        deadline = time.monotonic() + 60
        while (health := httpx.get(url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "the server never reported the fault"
            time.sleep(0.02)
        with cf.ThreadPoolExecutor(3) as pool:
            calls = {"plain": pool.submit(httpx.post, url + "/v1/completions", json=BODY, timeout=5),
                     "stream": pool.submit(httpx.post, url + "/v1/completions",
                                           json={**BODY, "stream": True}, timeout=5),
                     "metrics": pool.submit(httpx.get, url + "/metrics", timeout=5)}
            return {"health": health, **{k: f.result() for k, f in calls.items()}}

    return cf.ThreadPoolExecutor(1).submit(watch)


def _check_failed_state(seen: dict[str, httpx.Response], code: str, classification: str,
                        status: int) -> None:
    """What the server said while it drained: /health, new requests of both kinds, /metrics."""
    h = seen["health"]
    assert h.status_code == 503
    assert h.json()["code"] == code and h.json()["classification"] == classification
    evidence = h.json()["evidence"]  # the summary: what decided, where, what to do
    assert evidence["decided_by"] and evidence["hint"] and set(evidence) <= {
        "decided_by", "bdf", "xid", "hint"}, evidence
    for kind in ("plain", "stream"):
        r = seen[kind]
        assert r.status_code == status and r.json()["error"]["code"] == code, (kind, r.text)
    m = seen["metrics"].text
    assert _metric(m, "ftrs_device_up") == 0
    assert _metric(m, "ftrs_device_lost_total") == (1 if classification == "DeviceLost" else 0)


# scenario: (code, HTTP status of a plain request, classification, exit code)
FATAL = {
    "prefill": ("device_lost", 503, "DeviceLost", 86),
    "decode": ("device_lost", 503, "DeviceLost", 86),
    "transfer": ("device_lost", 503, "DeviceLost", 86),
    "kernel_fault": ("engine_fault", 500, "KernelFault", 87),
    "hang": ("engine_hang", 503, "EngineHang", 88),
}


@pytest.mark.parametrize("scenario", list(FATAL))
def test_fatal_fault(fleet: dict[str, Server], scenario: str) -> None:
    server = fleet[scenario]
    code, status, classification, exit_code = FATAL[scenario]
    watcher = _watch_failed_state(server.url)
    results = _run_shapes(server.url, SCENARIOS[scenario][1])
    _check_typed(results, code, status, within_s=1.5 + 5 if scenario == "hang" else 5.0)
    _check_failed_state(watcher.result(timeout=60), code, classification, status)
    assert server.exit_code() == exit_code
    report = _crash_report(server.home, classification)
    ev = report["evidence"]
    assert report["exit_code"] == exit_code and ev["injected"] is True
    steps = report["flight_recorder"]
    assert steps, report
    failed = ev.get("failed_step")
    if scenario == "prefill":  # the failed step carried a prompt chunk, as did the one before
        assert failed["prefill_tokens"] > 0 and failed["request_ids"], ev
        assert steps[-1]["kind"] in ("prefill", "mixed") and steps[-1]["chunk_tokens"] > 0
        assert any(r.tokens == 0 for shape in SHAPES for r in results[shape])
    if scenario in ("decode", "transfer", "kernel_fault", "hang"):
        assert steps[-1]["kind"] == "decode", steps[-3:]
        # streams had begun: their error came as the final SSE event of a 200 response
        lone = results["stream"][0]
        assert lone.status == 200 and lone.tokens > 0, lone
    if scenario == "decode":  # no copy: raised after the step, which it names like a real one
        assert ev["layer"] == "step" and failed["request_ids"], ev
        assert failed["decode_tokens"] == 10 and failed["prefill_tokens"] == 0, ev
    if scenario in ("transfer", "kernel_fault"):  # the copy failed; its `wait` raised it
        assert ev["source"] == "copy_backend" and ev["kind"] == scenario.replace("transfer",
                                                                                 "device_lost")
        assert "offload.py" in ev["raised_at"] and "engine.wait(" in ev["raised_at"], ev
        assert failed["decode_tokens"] == 10 and failed["prefill_tokens"] == 0, ev
    if classification == "DeviceLost":
        assert "pci_config_vendor=0xffff" in ev["decided_by"]
        assert report["probes"]["pci"]["status"] == "lost"
    if scenario == "kernel_fault":
        assert ev["device_answers"] == ["pci"]
    if scenario == "hang":  # the step in progress is the report's last row
        assert "watchdog" in ev["decided_by"] and ev["step_in_progress"]["request_ids"], ev


def test_device_lost_while_idle(serve: Any) -> None:
    """No request in flight: the engine's monitor thread sees config space read 0xffff; the
    server then refuses every new request with 503 device_lost and exits 86."""
    server = serve("--fault-inject", "device_lost@after=3s")
    _check_failed_state(_watch_failed_state(server.url).result(timeout=60), "device_lost",
                        "DeviceLost", 503)
    assert server.exit_code() == 86
    report = _crash_report(server.home, "DeviceLost")
    ev = report["evidence"]
    assert "pci_config_vendor=0xffff" in ev["decided_by"] and ev["injected"] is True
    assert ev["fault_inject"] == "device_lost@after=3s"
    assert report["probes"]["pci"]["status"] == "lost"
    assert report["flight_recorder"] == []  # no step ever ran


def test_oom_fails_only_its_step_and_keeps_serving(fleet: dict[str, Server]) -> None:
    server = fleet["oom"]
    body = SCENARIOS["oom"][1]
    results = _run_shapes(server.url, body)
    flat = [r for shape in SHAPES for r in results[shape]]
    failed = [r for r in flat if r.code is not None]
    done = [r for r in flat if r.code is None]
    assert failed and all(r.code == "device_out_of_memory" and r.status in (200, 503)
                          for r in failed), flat
    assert len(failed) <= 4, flat  # the failed step carried at most 4 (max running requests)
    assert all(r.status == 200 and r.finish_reason == "length" and r.tokens == body["max_tokens"]
               for r in done) and len(done) == 10 - len(failed), flat
    r = httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert _metric(_metrics(server.url), "ftrs_device_up") == 1
    assert server.proc.poll() is None


def test_on_device_lost_cpu_keeps_serving(fleet: dict[str, Server]) -> None:
    server = fleet["cpu"]
    r = _request(server.url, stream=False)
    assert (r.status, r.code) == (503, "device_lost")
    server.wait_ok(60)
    h = httpx.get(server.url + "/health", timeout=5).json()
    assert h["degraded"] is True and h["degraded_reason"]["classification"] == "DeviceLost"
    r2 = httpx.post(server.url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=30)
    assert r2.status_code == 200, r2.text
    m = _metrics(server.url)
    assert _metric(m, "ftrs_device_up") == 0 and _metric(m, "ftrs_device_lost_total") == 1
    # the GPU stays lost (docs/device-loss.md): `degraded` is a device that serves, up 1
    assert _metric(m, 'ftrs_device_state{state="lost"}') == 1
    assert _metric(m, 'ftrs_device_state{state="degraded"}') == 0
    # the CPU engine runs resident: the offload flags are not warned about as ignored
    assert "ignores them" not in server.log.read_text()
    assert server.proc.poll() is None
