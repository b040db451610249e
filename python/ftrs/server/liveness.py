"""Is the engine process alive at all? A heartbeat, watched from the API process.

The progress watchdog (`health/watchdog.py`) runs in the engine process's monitor thread, so it
cannot fire when that whole process is frozen: SIGSTOP, a frozen cgroup, a native deadlock
that holds the GIL, an uninterruptible (D-state) driver call. So, once ready, the engine sends a
`Heartbeat` every `HEARTBEAT_S` from a thread of its own (`start_heartbeat`), and the API
process's reader counts every message it receives as a sign of life (`SilenceWatch`). Silent
for `--hang-timeout` s (at least `MIN_SILENCE_S`) while the client is ready: `EngineHang`
(503 `engine_hang`), decided by `api_watchdog`, with the process's state from /proc in its
evidence; the reader writes the crash report (`report_hang`), fails the client with it (the
restart policy acts) and kills the process. An engine whose step blocks in Python still
beats: that hang stays the engine watchdog's, with its richer evidence.

A dead engine is classified by the client's classifier; the default, `classify_engine_exit`,
trusts the error the engine reported, else its exit code.

Several threads of the engine send on its outbox (the step loop, the supervisor's `on_fatal`
from the monitor thread, the heartbeat): `LockedOutbox` keeps their messages whole on the pipe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ftrs.errors import DeviceLost, EngineHang, FtrsError, KernelFault, error_from_dict

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the engine's heartbeat period, and how often the API side looks
#: The shortest silence that counts, whatever `--hang-timeout`: three missed heartbeats, so a
#: short hang timeout (a drill's 1.5 s) stays the engine watchdog's and an idle engine between
#: two beats is not a hang.
MIN_SILENCE_S = 3 * HEARTBEAT_S

#: /proc/<pid>/stat's state letters (proc(5)).
_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep", "Z": "zombie",
           "T": "stopped", "t": "tracing stop", "X": "dead", "I": "idle", "W": "paging",
           "P": "parked"}

_HINTS = {
    "T": "the engine process is stopped (SIGSTOP, a debugger, a frozen cgroup): find what "
         "stopped it",
    "t": "the engine process is stopped by a debugger or tracer",
    "D": "the engine process is stuck in a driver call (uninterruptible sleep): check the "
         "kernel log (dmesg) for the device",
}
_HINT_OTHER = ("the engine process neither exited nor answered: a native call holding the GIL "
               "or a deadlock; check the engine log for its last step")


class Outbox(Protocol):
    """What the engine process sends its messages through (a `Connection`, a `LockedOutbox`)."""

    def send(self, obj: Any) -> None: ...
    def close(self) -> None: ...


class LockedOutbox:
    """A connection whose `send` takes a lock: messages from several threads never interleave
    on the pipe. `close` passes through (a send after it raises OSError, as on the pipe)."""

    def __init__(self, conn: Outbox) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._conn.send(obj)

    def close(self) -> None:
        self._conn.close()


def start_heartbeat(send: Callable[[Any], None], message: Any,
                    period_s: float = HEARTBEAT_S) -> threading.Event:
    """Send `message` every `period_s` from a daemon thread until the returned event is set or
    the pipe is closed (the engine exits: it stops quietly)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(period_s):
            try:
                send(message)
            except (OSError, ValueError):
                return

    threading.Thread(target=beat, name="ftrs-heartbeat", daemon=True).start()
    return stop


def process_state(pid: int) -> str | None:
    """The state of process `pid` from /proc/<pid>/stat, e.g. "T (stopped)"; None when it
    cannot be read (no /proc, the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and ")"
    if not fields:
        return None
    letter = fields[0]
    return f"{letter} ({_STATES.get(letter, 'unknown')})"


def engine_hang(pid: int, silent_s: float, timeout_s: float, bdf: str | None = None) -> EngineHang:
    """The API side's verdict on an engine process that sent nothing for `silent_s` s; `bdf`:
    its GPU as its monitor last reported it (`--on-device-lost restart` probes that one)."""
    state = process_state(pid)
    return EngineHang(
        f"the engine process (pid {pid}) sent nothing, not even its heartbeat, for "
        f"{silent_s:.1f} s (hang timeout {timeout_s:g} s)"
        + (f"; its state: {state}" if state else ""),
        evidence={"silent_s": round(silent_s, 3), "hang_timeout_s": timeout_s, "pid": pid,
                  "process_state": state, "decided_by": ["api_watchdog"],
                  "hint": _HINTS.get(state[0] if state else "", _HINT_OTHER),
                  **({"bdf": bdf} if bdf else {})})


class SilenceWatch:
    """When the API process last heard from one engine process; `check` says when that is
    too long ago. One per engine process (its reader thread's)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s  # the hang timeout the verdict names
        self.limit_s = max(timeout_s, MIN_SILENCE_S)  # the silence it takes
        self._clock = clock
        self.last_heard = clock()
        self.fired = False  # at most one verdict per engine process

    def heard(self) -> None:
        self.last_heard = self._clock()

    def check(self, pid: int, watching: bool, bdf: str | None = None) -> EngineHang | None:
        """The `EngineHang` once, when `watching` (the client is ready and this is its current
        engine) and nothing was heard for longer than `limit_s`; else None."""
        silent_s = self._clock() - self.last_heard
        if self.fired or not watching or silent_s <= self.limit_s:
            return None
        self.fired = True
        return engine_hang(pid, silent_s, self.timeout_s, bdf)


def classify_engine_exit(exit_code: int | None, last_error: dict[str, Any] | None) -> FtrsError:
    """The default classifier of a dead engine (`EngineClient(classifier=...)`): its own report
    if it sent one, else the exit-code table of DESIGN.md "Errors"."""
    from ftrs.server.errors import EngineUnavailable  # FastAPI: not in the engine process

    if last_error is not None:
        return error_from_dict(last_error)
    evidence = {"exit_code": exit_code}
    for cls in (DeviceLost, KernelFault, EngineHang):
        if exit_code == cls.exit_code:
            return cls(f"engine process exited with code {exit_code} ({cls.__name__})",
                       evidence=evidence)
    return EngineUnavailable(f"engine process exited with code {exit_code}", evidence=evidence)


def report_hang(home: Path, err: EngineHang) -> None:
    """Log the verdict and write its crash report; a report that cannot be written is logged."""
    from ftrs.health.crash import write_crash_report

    logger.error("%s", err.message)
    try:
        write_crash_report(home, err)
    except Exception as exc:  # the clients are told and the engine is killed all the same
        logger.error("could not write the crash report of the hang: %s", exc)


__all__ = ["HEARTBEAT_S", "MIN_SILENCE_S", "LockedOutbox", "Outbox", "SilenceWatch",
           "classify_engine_exit", "engine_hang", "process_state", "report_hang",
           "start_heartbeat"]
