from __future__ import annotations

import sys
import time

from ftrs.health.child import CHILD_SCRIPT, probe_child
from ftrs.health.result import Status


def test_child_exiting_zero_is_ok() -> None:
    r = probe_child(command=[sys.executable, "-c", "pass"], timeout_s=30)
    assert r.status is Status.OK and r.outcome == "ok" and r.exit_code == 0


def test_child_failing_is_lost_with_exit_code_and_stderr() -> None:
    cmd = [sys.executable, "-c",
           "import sys; print('CUDA error: no CUDA-capable device', file=sys.stderr); sys.exit(3)"]
    r = probe_child("cuda:0", command=cmd, timeout_s=30)
    assert r.status is Status.LOST and r.outcome == "failed" and r.exit_code == 3
    assert "no CUDA-capable device" in r.stderr_tail and "exit 3" in r.reason


def test_child_hanging_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    r = probe_child(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert r.status is Status.LOST and r.outcome == "timeout" and r.exit_code is None


def test_child_that_cannot_start_is_an_error_not_evidence() -> None:
    r = probe_child(command=["/nonexistent/python"], timeout_s=5)
    assert r.status is Status.ERROR


def test_default_script_compiles_and_reports_missing_torch_as_inconclusive() -> None:
    compile(CHILD_SCRIPT, "<child>", "exec")
    # Without torch in the child (-I -S: isolated, no site-packages) the probe is inconclusive.
    r = probe_child(command=[sys.executable, "-I", "-S", "-c", CHILD_SCRIPT, "cuda:0"],
                    timeout_s=30)
    assert r.exit_code == 3
