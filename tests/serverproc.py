"""A real `ftrs serve` process on a free loopback port, for every test that needs one.

`tests/` is on `sys.path` (its conftest.py sits in a folder without `__init__.py`), so any test
module imports this as `serverproc`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m ftrs serve ARGS --port P`, its output in `log`, stopped by `stop()`."""

    def __init__(self, args: Sequence[str], *, log: Path, home: Path | None = None,
                 pythonpath: Sequence[Path] = (), port: int | None = None,
                 new_session: bool = False) -> None:
        """`port`: None picks a free one. `new_session`: the server leads its own process
        group, so a test can signal the group as a terminal's Ctrl-C does (`os.killpg`)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.log = log
        env = dict(os.environ)
        if home is not None:
            env["FTRS_HOME"] = str(home)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "python"), *map(str, pythonpath), env.get("PYTHONPATH", "")])
        self._log = log.open("w")
        cmd = [sys.executable, "-m", "ftrs", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=new_session)

    def wait(self, status: str = "ok", timeout: float = 120.0) -> dict[str, object]:
        """Wait until /health reports `status` ("ok" or "failed"); fail if the server exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text()}")
            try:
                body = httpx.get(self.url + "/health", timeout=2).json()
                if body.get("status") == status:
                    return dict(body)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not {status} in {timeout} s:\n{self.log.read_text()}")

    def wait_ok(self, timeout: float = 120.0) -> None:
        self.wait("ok", timeout)

    def exit_code(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"server did not exit:\n{self.log.read_text()}") from e

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
