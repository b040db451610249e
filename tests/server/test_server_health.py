"""/health, /metrics, client disconnects, and the API process outliving its engine."""

from __future__ import annotations

import time
from typing import Any

import httpx
from ftrs_server_harness import ServerProcess, scrape

REQUIRED_METRICS = [
    "ftrs_requests_total", "ftrs_requests_running", "ftrs_requests_waiting",
    "ftrs_prompt_tokens_total", "ftrs_generation_tokens_total", "ftrs_prefix_cache_hit_tokens_total",
    "ftrs_time_to_first_token_seconds", "ftrs_inter_token_latency_seconds",
    "ftrs_request_latency_seconds", "ftrs_kv_cache_usage_ratio", "ftrs_expert_cache_slots",
    "ftrs_pcie_bytes_total", "ftrs_expert_lookups_total", "ftrs_expert_prefetch_total",
    "ftrs_transfer_queue_depth", "ftrs_transfer_inflight_bytes", "ftrs_device_up",
    "ftrs_device_state", "ftrs_device_lost_total", "ftrs_prefill_cap_tokens", "ftrs_build_info",
]


def _wait_for(cond: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_health_is_ok_without_an_api_key(fake_server: ServerProcess) -> None:
    r = httpx.get(fake_server.url + "/health", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["model"] == "fake" and body["max_model_len"] == 512


def test_metrics_parse_and_follow_traffic(fake_server: ServerProcess, client: Any) -> None:
    before = scrape(fake_server.url)
    names = {k.split("{")[0] for k in before}
    for name in REQUIRED_METRICS:
        assert any(n == name or n.startswith(name + "_") for n in names), name
    client.completions.create(model="fake", prompt="count me", max_tokens=5)
    after = scrape(fake_server.url)
    assert after["ftrs_requests_total{status=success}"] == before["ftrs_requests_total{status=success}"] + 1
    assert after["ftrs_generation_tokens_total"] - before["ftrs_generation_tokens_total"] == 5
    assert after["ftrs_time_to_first_token_seconds_count"] > before["ftrs_time_to_first_token_seconds_count"]
    assert after["ftrs_inter_token_latency_seconds_count"] - before["ftrs_inter_token_latency_seconds_count"] == 4
    assert after["ftrs_device_up"] == 1 and after["ftrs_device_state{state=ok}"] == 1
    assert after["ftrs_pcie_bytes_total{direction=h2d}"] > 0  # the fake engine's counters
    bad = httpx.post(fake_server.url + "/v1/completions", headers=fake_server.headers, timeout=5,
                     json={"model": "fake", "prompt": "x", "temperature": -1})
    assert bad.status_code == 400
    rejected = scrape(fake_server.url)["ftrs_requests_total{status=rejected}"]
    assert rejected == after["ftrs_requests_total{status=rejected}"] + 1


def test_client_disconnect_mid_stream_aborts_and_frees_kv(fake_server: ServerProcess) -> None:
    url, h = fake_server.url, fake_server.headers
    aborted = scrape(url)["ftrs_requests_total{status=aborted}"]
    body = {"model": "fake", "prompt": "a long stream", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=h, timeout=10) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any(line.startswith("data: ") for line in got)
        assert scrape(url)["ftrs_kv_cache_usage_ratio"] > 0  # the request holds KV while streaming
    # closed mid-stream: the engine must drop the request and its KV
    idle = _wait_for(lambda: (m := scrape(url))["ftrs_kv_cache_usage_ratio"] == 0
                     and m["ftrs_requests_running"] == 0)
    assert idle, scrape(url)
    assert _wait_for(lambda: scrape(url)["ftrs_requests_total{status=aborted}"] == aborted + 1)


def test_engine_death_fails_requests_with_a_typed_error_and_health_says_why() -> None:
    server = ServerProcess(["--model", "fake"], api_key=None)
    try:
        server.wait("ok")
        victim = {"model": "fake", "prompt": "x", "max_tokens": 300, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=victim, timeout=30) as stream:
            r = httpx.post(server.url + "/v1/completions", timeout=30,
                           json={"model": "fake", "prompt": "__die__", "max_tokens": 50})
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "device_lost"
        assert '"code": "device_lost"' in events[-2] and events[-1] == "data: [DONE]"
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and health.json()["code"] == "device_lost"
        again = httpx.post(server.url + "/v1/completions", json={"model": "fake", "prompt": "y"}, timeout=5)
        assert again.status_code == 503 and again.json()["error"]["code"] == "device_lost"
        m = scrape(server.url)
        assert m["ftrs_device_lost_total"] == 1 and m["ftrs_device_up"] == 0
        assert m["ftrs_device_state{state=lost}"] == 1
    finally:
        server.stop()


def test_a_model_that_fails_its_first_load_exits_3_at_once() -> None:
    """A load that failed with a report fails the same way on every start: the server does not
    stay up unable to serve (docs/device-loss.md "Exit codes"), it exits with the code of a
    model that did not load, saying why in one line."""
    server = ServerProcess(["--model", "fail-load"], api_key=None)
    try:
        assert server.exit_code(timeout=30) == 3
    finally:
        server.stop()
    assert "ftrs serve: fail-load: fake load failure for tests" in server.log.read_text()


def test_health_is_503_with_a_reason_while_loading_then_200() -> None:
    server = ServerProcess(["--model", "slow-load"], api_key=None)
    try:
        body = server.wait("loading")
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code in (503, 200)  # the load may just have finished
        assert "slow-load" in str(body["reason"])
        chat = {"model": "slow-load", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        early = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=5)
        assert early.status_code in (503, 200)
        if early.status_code == 503:
            assert early.json()["error"]["code"] == "engine_unavailable"
        server.wait("ok")
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 200
    finally:
        server.stop()
