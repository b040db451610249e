"""Child probe: can a fresh process still use the device?

A sticky CUDA error (719 and friends) poisons only the context that hit it. A new process with
a new context tells a broken engine from a broken device: it initialises CUDA and runs
`torch.ones(1, device=dev).sum().item()` under a hard timeout, in its own session so that a
hung driver call is killed with its whole process group.

Exit codes of the default child: 0 the device works; 3 torch cannot be imported (the probe
cannot run: `error`, not evidence); 4 the device is busy in exclusive-process mode (`error`);
anything else, or a timeout, means the device failed (`lost`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ftrs.health.result import ProbeResult, Status

logger = logging.getLogger(__name__)

EXIT_NO_TORCH = 3
EXIT_BUSY = 4
_STDERR_TAIL = 2000
CHILD_SCRIPT = """
import sys
try:
    import torch
except Exception as e:
    print(f"torch import failed: {e}", file=sys.stderr)
    sys.exit(3)
dev = sys.argv[1]
try:
    value = torch.ones(1, device=dev).sum().item()
except Exception as e:
    msg = str(e)
    print(f"{type(e).__name__}: {msg}", file=sys.stderr)
    sys.exit(4 if "busy or unavailable" in msg else 1)
sys.exit(0 if value == 1.0 else 2)
"""


def default_command(device: str) -> list[str]:
    return [sys.executable, "-c", CHILD_SCRIPT, device]


@dataclass(frozen=True, kw_only=True)
class ChildResult(ProbeResult):
    """`outcome` is "ok", "failed" or "timeout"; `exit_code` None on timeout."""

    outcome: str
    exit_code: int | None = None
    stderr_tail: str = ""
    seconds: float = 0.0


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def probe_child(
    device: str = "cuda:0", *, command: Sequence[str] | None = None, timeout_s: float = 60.0,
) -> ChildResult:
    """Run the child and judge it. `command` replaces the default (tests use a fake one)."""
    argv = list(command) if command is not None else default_command(device)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return ChildResult(probe="child", status=Status.ERROR, outcome="failed",
                           reason=f"child probe could not start: {e}", evidence={"argv0": argv[0]})
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        _, err = proc.communicate()
        seconds = time.monotonic() - started
        tail = err.decode("utf-8", "replace")[-_STDERR_TAIL:]
        return ChildResult(probe="child", status=Status.LOST, outcome="timeout", seconds=seconds,
                           stderr_tail=tail,
                           reason=f"a fresh process could not use {device} within {timeout_s:g} s",
                           evidence={"child": "timeout", "timeout_s": timeout_s})
    seconds = time.monotonic() - started
    tail = err.decode("utf-8", "replace")[-_STDERR_TAIL:]
    code = proc.returncode
    evidence = {"child": "ok" if code == 0 else "failed", "exit_code": code}
    if code == 0:
        return ChildResult(probe="child", status=Status.OK, outcome="ok", exit_code=0,
                           seconds=seconds, stderr_tail=tail, evidence=evidence)
    if code in (EXIT_NO_TORCH, EXIT_BUSY) and command is None:
        why = "torch not importable" if code == EXIT_NO_TORCH else "device busy (exclusive mode)"
        return ChildResult(probe="child", status=Status.ERROR, outcome="failed", exit_code=code,
                           seconds=seconds, stderr_tail=tail, evidence=evidence,
                           reason=f"child probe could not test the device: {why}")
    last = tail.strip().splitlines()[-1] if tail.strip() else ""
    return ChildResult(probe="child", status=Status.LOST, outcome="failed", exit_code=code,
                       seconds=seconds, stderr_tail=tail, evidence=evidence,
                       reason=f"a fresh process failed to use {device} (exit {code}): {last}")
