"""`ftrs serve` refuses an invalid invocation before it listens or starts an engine: one line
and the exit code of docs/device-loss.md "Exit codes" (2 config, 3 model, 1 cannot listen)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from ftrs_server_harness import ServerProcess

import serverproc
from ftrs.server.cli import bind_sockets

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def serve(*argv: str, port: int | None = None,
          timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`python -m ftrs serve ARGV` on a free port, without the Triton interpreter the test
    session sets (a CPU host then has no Triton to run); fails if it is still up after
    `timeout` (the bug: it bound and sat in a failed state)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(HERE),
                                         env.get("PYTHONPATH", "")])
    argv = ("--port", str(port or serverproc.free_port()), *argv)
    return subprocess.run([sys.executable, "-m", "ftrs", "serve", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftrs serve: "), lines
    return lines[0]


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
REFUSED = [
    pytest.param(("--device", "cuda"), 2, "device 'cuda' requested but CUDA is not available",
                 marks=NO_CUDA, id="cuda-without-a-gpu"),
    pytest.param(("--device", "cpu", "--kernels", "triton"), 2,
                 "kernels: triton cannot run here (device cpu is not CUDA)", id="triton-on-cpu"),
    pytest.param(("--model", "/nonexistent.gguf"), 3, "/nonexistent.gguf: no such file or "
                 "directory", id="missing-model"),
]


@pytest.mark.parametrize(("argv", "code", "says"), REFUSED)
def test_an_invalid_invocation_exits_before_listening(argv: tuple[str, ...], code: int,
                                                      says: str) -> None:
    proc = serve(*argv)
    assert proc.returncode == code, proc.stderr
    assert says in one_line(proc)  # no "loading", no engine exit, no uvicorn line


def test_a_file_that_is_no_model_exits_3(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("not a model")
    proc = serve("--model", str(f))
    assert proc.returncode == 3
    assert f"{f}: a model is a checkpoint directory or a .gguf file" in one_line(proc)


def test_a_busy_port_is_one_line_and_exit_1_without_an_engine() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the fake backend: a model the engine would take seconds to load, never started
        proc = serve("--model", "slow-load", "--engine-backend", "fake_backend", port=port)
    assert proc.returncode == 1
    assert one_line(proc) == f"ftrs serve: cannot listen on 127.0.0.1:{port}: address already in use"


def test_an_address_not_on_this_host_is_one_line_and_exit_1() -> None:
    proc = serve("--host", "192.0.2.1", "--model", "fake", "--engine-backend", "fake_backend")
    assert proc.returncode == 1
    assert one_line(proc).startswith("ftrs serve: cannot listen on 192.0.2.1:")
    assert "cannot assign requested address" in one_line(proc)


def test_bind_sockets_holds_the_address() -> None:
    socks = bind_sockets("127.0.0.1", 0)
    try:
        assert len(socks) == 1
        port = socks[0].getsockname()[1]
        socks[0].listen()
        with pytest.raises(OSError) as e:
            bind_sockets("127.0.0.1", port)
        assert e.value.errno == errno.EADDRINUSE
    finally:
        for s in socks:
            s.close()


def test_the_server_serves_on_the_socket_it_bound() -> None:
    server = ServerProcess(["--model", "fake"], api_key=None)
    try:
        server.wait_ok()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        server.proc.terminate()
        assert server.exit_code() == 0
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ftrs.models.tiny import make_tiny

    return make_tiny("mixtral", tmp_path_factory.mktemp("tiny") / "mixtral", seed=0)  # top-2


@pytest.mark.parametrize(("argv", "says"), [
    (("--moe-strategy", "offload", "--moe-cache-size", "1"),
     "moe cache of 1 slots (--moe-cache-size 1) is below top_k=2"),
    (("--moe-strategy", "hybrid", "--moe-cache-size", "1"),
     "moe cache of 1 slots (--moe-cache-size 1) is below top_k=2"),
    (("--moe-strategy", "offload", "--moe-cache-rate", "0.001"),
     "moe cache of 1 slots (--moe-cache-rate 0.001 of 24 experts) is below top_k=2"),
    pytest.param(("--moe-strategy", "offload", "--copy-backend", "cuda"),
                 "copy_backend=cuda needs a CUDA device", marks=NO_CUDA),
    pytest.param(("--moe-strategy", "hybrid", "--copy-backend", "cuda:5"),
                 "copy_backend=cuda:5 needs a CUDA device", marks=NO_CUDA),
], ids=["cache-size", "hybrid-cache-size", "cache-rate", "cuda-copy", "cuda-n-copy"])
def test_an_expert_cache_the_engine_would_refuse_exits_2_before_listening(
        tiny_moe: Path, argv: tuple[str, ...], says: str) -> None:
    """Read from config.json, not found by the engine after the bind and the load."""
    proc = serve("--model", str(tiny_moe), "--device", "cpu", *argv)
    assert proc.returncode == 2, proc.stderr
    assert says in one_line(proc)


def test_a_resident_model_ignores_the_cache_flags_at_preflight(tiny_moe: Path) -> None:
    from ftrs.config import EngineConfig
    from ftrs.server.cli import preflight

    preflight(EngineConfig(model=str(tiny_moe), device="cpu", moe_cache_size=1))  # resident


def test_a_config_error_of_the_first_engine_exits_2_at_once() -> None:
    """The backstop: a setting only the engine's load refuses ends the server with its code and
    one `ftrs serve:` line, rather than a server that listens and can never serve."""
    proc = serve("--model", "bad-config", "--engine-backend", "fake_backend", timeout=40)
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert "ftrs serve: fake setting refused by the engine at load" in lines, lines
    assert not any("the engine failed" in line for line in lines), lines


@pytest.mark.parametrize(("argv", "line"), [
    (("--port", "0"), "ftrs serve: --port: 0 is out of range; give a port 1-65535"),
    (("--port", "http"), "ftrs serve: --port: 'http' is not a number; give a port 1-65535"),
    (("--link-guard-window", "inf"),
     "ftrs serve: --link-guard-window: must be a finite number of seconds > 0, got inf"),
    (("--moe-cache-policy", "x"),
     "ftrs serve: moe_cache_policy: expected lrfu, lru or lfru, got 'x'"),
], ids=["port-0", "port-text", "window-inf", "cache-policy"])
def test_option_refusals_are_one_ftrs_serve_line(argv: tuple[str, ...], line: str) -> None:
    proc = serve("--model", "fake", "--engine-backend", "fake_backend", *argv)
    assert proc.returncode == 2
    assert one_line(proc) == line
