"""The API side's watch on a frozen engine process (`server.liveness`): the silence check, the
verdict's evidence, the state of a real stopped process, the heartbeat and the locked outbox."""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ftrs.errors import EngineHang
from ftrs.health.crash import load_crash_report
from ftrs.server.liveness import (
    MIN_SILENCE_S,
    LockedOutbox,
    SilenceWatch,
    engine_hang,
    process_state,
    report_hang,
    start_heartbeat,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_process_state_reads_a_stopped_child_as_stopped() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while process_state(child.pid) != "S (sleeping)":
            assert time.monotonic() < deadline, process_state(child.pid)
            time.sleep(0.01)
        child.send_signal(signal.SIGSTOP)
        while process_state(child.pid) != "T (stopped)":
            assert time.monotonic() < deadline, process_state(child.pid)
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait(5)
    assert process_state(child.pid) is None  # reaped: nothing to read


def test_silence_past_the_timeout_is_a_hang_once_and_only_while_watching() -> None:
    clock = Clock()
    watch = SilenceWatch(3.0, clock=clock)
    clock.now += 3.0
    assert watch.check(4242, watching=True) is None  # not past the timeout yet
    watch.heard()
    clock.now += 3.5
    assert watch.check(4242, watching=False) is None  # loading, restarting, stopping
    hang = watch.check(4242, watching=True)
    assert isinstance(hang, EngineHang) and hang.code == "engine_hang"
    assert hang.evidence["silent_s"] == 3.5 and hang.evidence["hang_timeout_s"] == 3.0
    assert hang.evidence["decided_by"] == ["api_watchdog"] and hang.evidence["pid"] == 4242
    assert "(pid 4242) sent nothing, not even its heartbeat, for 3.5 s" in hang.message
    clock.now += 10
    assert watch.check(4242, watching=True) is None  # one verdict per engine process


def test_a_hang_timeout_shorter_than_three_heartbeats_waits_for_three() -> None:
    clock = Clock()
    watch = SilenceWatch(0.5, clock=clock)  # the engine's own watchdog fires at 0.5 s
    clock.now += MIN_SILENCE_S
    assert watch.check(7, watching=True) is None  # an idle engine between beats
    clock.now += 0.1
    hang = watch.check(7, watching=True, bdf="0000:01:00.0")
    assert hang is not None and hang.evidence["hang_timeout_s"] == 0.5
    assert hang.evidence["bdf"] == "0000:01:00.0"  # the GPU the engine's monitor watched


def test_the_verdict_names_the_process_state_and_its_crash_report_loads(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(child.pid) != "T (stopped)":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hang = engine_hang(child.pid, 8.25, 8.0)
    finally:
        child.kill()
        child.wait(5)
    assert hang.evidence["process_state"] == "T (stopped)"
    assert "SIGSTOP" in hang.evidence["hint"] and "T (stopped)" in hang.message
    report_hang(tmp_path, hang)
    (path,) = (tmp_path / "crash").glob("*-EngineHang.json")
    report = load_crash_report(path)
    assert report.classification == "EngineHang" and not report.drill
    assert report.evidence["decided_by"] == ["api_watchdog"]


def test_a_report_that_cannot_be_written_is_logged_not_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    home = tmp_path / "file"
    home.write_text("not a directory")
    with caplog.at_level(logging.ERROR, logger="ftrs.server.liveness"):
        report_hang(home, engine_hang(1, 5.0, 4.0))  # no exception: clients are told regardless
    assert "could not write the crash report of the hang" in caplog.text
    assert "sent nothing, not even its heartbeat" in caplog.text


def test_the_heartbeat_beats_and_stops_quietly_when_the_pipe_closes() -> None:
    r, w = mp.Pipe(duplex=False)
    out = LockedOutbox(w)
    stop = start_heartbeat(out.send, "beat", period_s=0.01)
    try:
        assert r.poll(5) and r.recv() == "beat"
        out.close()
        deadline = time.monotonic() + 5
        while any(t.name == "ftrs-heartbeat" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the heartbeat outlived its pipe"
            time.sleep(0.01)
    finally:
        stop.set()
        r.close()


def test_messages_from_several_threads_arrive_whole() -> None:
    """Large messages (bigger than the pipe's buffer) from 4 threads at once: each is received
    intact, in each thread's order."""
    r, w = mp.Pipe(duplex=False)
    out = LockedOutbox(w)
    per_thread, size = 20, 200_000

    def sender(k: int) -> None:
        for i in range(per_thread):
            out.send((k, i, bytes([k]) * size))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    seen: dict[int, list[int]] = {k: [] for k in range(4)}
    for _ in range(4 * per_thread):
        k, i, payload = r.recv()
        assert payload == bytes([k]) * size
        seen[k].append(i)
    for t in threads:
        t.join(10)
    assert all(order == list(range(per_thread)) for order in seen.values())
    w.close()
    r.close()
