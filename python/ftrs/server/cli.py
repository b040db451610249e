"""`ftrs serve`: arguments and the run loop.

`add_serve_arguments(parser)` adds the server's own options plus one option per `EngineConfig`
field (`moe_cache_size` -> `--moe-cache-size`), typed from the field's annotation; options left
out keep the dataclass default. `run_serve(args)` starts uvicorn in this process (the API
process), which spawns the engine process; it logs loading progress and one line with the URL
when the engine is ready, and returns the process exit code.

SIGINT or SIGTERM stops the server on request (docs/device-loss.md "Exit codes"): the
listening socket closes, every request in flight ends at once with 503
`server_shutting_down` in its endpoint's shape (`EngineClient.begin_stop`), the engine is
stopped, and the exit code is 0, during the model's load too. uvicorn alone would let the
requests run for its graceful timeout, then cut them, and re-raise the signal at the end
(a SIGTERM would end the process with -15).

Before it binds or spawns anything, `run_serve` refuses what the engine would refuse at once
(`preflight`: the device, the kernels, the CPU kernel family, a model path that is not there or
not readable, an expert cache smaller than the model's top_k, a CUDA copy backend off CUDA;
exit 2 or 3, as `ftrs generate`) and binds the listening address itself
(`bind_sockets`), handing the socket to uvicorn: an address in use or not on this host is one
`cannot listen on HOST:PORT: ...` line and exit 1, and no engine starts.

The API key comes from `--api-key`, else `--api-key-file` (first line), else `$FTRS_API_KEY`
(read through `ftrs.config.env_flag`, the one place environment variables are read).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from ftrs.config import add_engine_arguments, engine_config_from_args, env_flag
from ftrs.errors import ConfigError, FtrsError

if TYPE_CHECKING:
    import torch

    from ftrs.config import EngineConfig
    from ftrs.server.engine_client import Classifier, EngineClient

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # larger request bodies get 413
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30  # a request body not whole this long after its headers: 408
DEFAULT_MAX_TOKENS = 1024  # of a chat request without max_tokens (OpenAI: the context's rest)
DEFAULT_MAX_N = 8  # choices one request may ask for (`n`)
MAX_PORT = 65535
EXIT_CANNOT_START = 1  # docs/device-loss.md "Exit codes": the server could not start


def port_number(text: str | int) -> int:
    """`--port`: a TCP port, 1-65535. 0 (any free port) is refused: the server names its URL
    before it binds, so it would name the wrong one. Raises ConfigError; `run_serve` checks the
    option (argparse keeps its text), so a refusal is one `ftrs serve:` line like the others."""
    try:
        port = int(text)
    except ValueError:
        raise ConfigError(f"--port: {text!r} is not a number; give a port 1-{MAX_PORT}") from None
    if not 1 <= port <= MAX_PORT:
        raise ConfigError(f"--port: {port} is out of range; give a port 1-{MAX_PORT}")
    return port


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `ftrs serve`: server options, then one per EngineConfig field."""
    parser.add_argument("--model", default="demo", help="model directory, GGUF file, or 'demo'")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", default=8000,
                        help=f"port to listen on, 1-{MAX_PORT} (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` (all endpoints but /health and "
                             "/metrics); also --api-key-file or $FTRS_API_KEY")
    parser.add_argument("--api-key-file", default=None, type=Path,
                        help="read the API key from the first line of this file")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--request-body-timeout", type=int, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        help="seconds a request body may take to arrive whole, from its headers; "
                             f"later: 408 (default {DEFAULT_REQUEST_BODY_TIMEOUT_S})")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="max_tokens of a chat request that sets none, or what is left of the "
                             f"context if less (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help=f"largest `n` (choices per request) accepted (default {DEFAULT_MAX_N})")
    from ftrs.server.reasoning import REASONING_PARSERS
    from ftrs.server.toolcalls import TOOL_PARSERS

    parser.add_argument("--tool-parser", default=None,
                        help="how tool calls are read from the output: "
                             f"{', '.join(sorted(TOOL_PARSERS))} (default: chosen from the chat "
                             "template)")
    parser.add_argument("--reasoning-parser", default=None,
                        help="how reasoning is split from the answer: "
                             f"{', '.join(sorted(REASONING_PARSERS))} (default: chosen from the "
                             "chat template; none if it has neither <think> nor channels)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the --model value)")
    parser.add_argument("--engine-backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-link-guard", action="store_true",
                        help="with an explicit --max-prefill-length, do not cap it")
    parser.add_argument("--link-guard-window", type=float, default=0.5,
                        help="seconds of expert fetch one prefill chunk may take, finite and > 0 "
                             "(default 0.5)")
    add_engine_arguments(parser)


def run_serve(args: argparse.Namespace, classifier: Classifier | None = None) -> int:
    """Serve until interrupted. Returns the exit code (the engine's failure code if it died).

    `classifier(exit_code, last_error) -> FtrsError` decides what a dead engine means (the
    device supervisor passes one that reads the device); default `classify_engine_exit`.
    """
    from ftrs.guard.policy import check_window_s
    from ftrs.server.engine_client import DEFAULT_BACKEND

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    backend = args.engine_backend or DEFAULT_BACKEND
    try:  # the cheap checks, before the address is bound
        args.port = port_number(args.port)
        check_window_s(getattr(args, "link_guard_window", 0.5))
        engine = engine_config_from_args(args)
        if backend == DEFAULT_BACKEND:  # another backend (tests' fakes) loads its own way
            preflight(engine)
        api_key = resolve_api_key(args)
        limits = serve_limits(args)
        check_parser_flags(args)
    except FtrsError as err:
        logger.error("ftrs serve: %s", err.message)
        return err.exit_code
    try:  # before the engine starts: a port in use costs no model load
        sockets = bind_sockets(args.host, args.port)
    except OSError as e:
        why = e.strerror or str(e)
        logger.error("ftrs serve: cannot listen on %s: %s", host_port(args.host, args.port),
                     why[:1].lower() + why[1:])
        return EXIT_CANNOT_START
    try:
        return _serve_on(sockets, args, engine, backend, api_key, limits, classifier)
    finally:
        for sock in sockets:
            sock.close()


def _serve_on(sockets: list[socket.socket], args: argparse.Namespace, engine: EngineConfig,
              backend: str, api_key: str | None, limits: dict[str, int],
              classifier: Classifier | None) -> int:
    """`run_serve` once the address is bound: the link guard, then uvicorn on `sockets`."""
    import uvicorn

    from ftrs.guard.startup import apply_link_guard
    from ftrs.server.app import ServeSettings, create_app
    from ftrs.server.engine_client import classify_engine_exit

    try:
        engine, link_guard = apply_link_guard(
            engine, explicit_max_prefill=getattr(args, "max_prefill_length", None) is not None,
            no_link_guard=getattr(args, "no_link_guard", False),
            window_s=getattr(args, "link_guard_window", 0.5))
    except FtrsError as err:  # a checkpoint whose header or config.json does not read
        logger.error("ftrs serve: %s", err.message)
        return err.exit_code
    settings = ServeSettings(engine=engine, host=args.host, port=args.port, api_key=api_key,
                             served_model_name=args.served_model_name, backend=backend,
                             link_guard=link_guard.to_dict() if link_guard is not None else None,
                             link_guard_window=getattr(args, "link_guard_window", 0.5),
                             tool_parser=getattr(args, "tool_parser", None),
                             reasoning_parser=getattr(args, "reasoning_parser", None),
                             **limits)
    app = create_app(settings, classifier or classify_engine_exit)
    client: EngineClient = app.state.engine
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5)
    server = stoppable_server(config, client)
    from ftrs.server.restart_policy import install_policy

    install_policy(client, server, engine.on_device_lost)

    async def main() -> None:
        progress = asyncio.ensure_future(_report_loading(client, settings.engine.model))
        try:
            await server.serve(sockets=sockets)
        finally:
            progress.cancel()

    logger.info("ftrs serve: loading %s (http://%s/health says 503 until ready)",
                engine.model, host_port(settings.host, settings.port))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    if client.state != "stopped":  # a second Ctrl-C skipped the lifespan's shutdown
        client.shutdown(timeout=2.0)
    if client.failure is not None:
        return client.failure.exit_code
    if server.stop_signal is not None:
        logger.info("ftrs serve: stopped (%s)", signal.Signals(server.stop_signal).name)
        return 0
    return 0 if server.started else 1


def preflight(engine: EngineConfig) -> None:
    """Refuse now what the engine process would refuse as it starts, before minutes of loading
    (`ftrs generate` meets the same checks before its load): the device (`resolve_device`),
    `--kernels` (`select_kernels`), `--cpu-kernels` (the core's families), a model path
    that is not there, not readable, or neither a directory nor a .gguf file, and the expert
    cache and copy backend of offload or hybrid (`preflight_experts`). Raises
    ConfigError (exit 2) or ModelLoadError (exit 3). Reads no weights, and makes no CUDA
    context in this process."""
    from ftrs import _core
    from ftrs.kernels import select_kernels, triton_runs_on

    device = preflight_device(engine.device)
    if ((engine.kernels == "triton" and not triton_runs_on(device))
            or (engine.kernels == "cpu" and device.type != "cpu")):
        select_kernels(engine.kernels, device)  # raises the engine's own ConfigError
    if engine.cpu_kernels not in ("auto", *_core.quant_kernels()):
        _core.quant_set_kernel(engine.cpu_kernels)  # a family this CPU lacks: ConfigError
    preflight_model(engine.model)
    preflight_experts(engine, device)


def preflight_experts(engine: EngineConfig, device: torch.device) -> None:
    """ConfigError for what `moe.offload` refuses as offload or hybrid build their slots, read
    from config.json or the GGUF header: a `--copy-backend cuda[:N]` off CUDA, and fewer slots
    (`--moe-cache-size`, or `--moe-cache-rate` of all experts) than the model's top_k. The demo
    is a MoE; before it is built its figures are not known, so only its copy backend is."""
    if engine.moe_strategy not in ("offload", "hybrid"):
        return  # resident uses neither; `auto` is resolved after the bind (the link guard)
    from ftrs.guard.startup import expert_fetch
    from ftrs.models.demo import demo_dir

    built = engine.model != "demo" or (demo_dir() / ".complete").is_file()
    fetch = expert_fetch(engine) if built else None
    if fetch is not None and not fetch.num_experts:
        return  # a dense model: no strategy is built, no flag acts
    spec = engine.copy_backend
    if spec.split(":")[0] == "cuda" and device.type != "cuda":
        raise ConfigError(f"copy_backend={spec} needs a CUDA device (--moe-strategy "
                          f"{engine.moe_strategy} on {device.type})")
    if fetch is None:
        return
    total = fetch.num_experts * fetch.num_moe_layers
    slots = engine.moe_cache_size if engine.moe_cache_size is not None else (
        math.ceil(engine.moe_cache_rate * total) if engine.moe_cache_rate is not None else None)
    if slots is not None and slots < fetch.top_k:  # the message of `moe.offload.cache_slots`
        given = (f"--moe-cache-size {slots}" if engine.moe_cache_size is not None else
                 f"--moe-cache-rate {engine.moe_cache_rate:g} of {total} experts")
        raise ConfigError(f"moe cache of {slots} slots ({given}) is below top_k={fetch.top_k}: "
                          "nothing could run")


def preflight_device(name: str) -> torch.device:
    """The device `resolve_device` gives, without asking CUDA for its current device (that
    would make a CUDA context in the API process): "cuda" and "auto" with CUDA are its first."""
    import torch

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", 0)
    from ftrs.engine.runtime import resolve_device

    return resolve_device(name)  # "cuda" without CUDA, cuda:N past the count, a bad name


def preflight_model(model: str) -> None:
    """ModelLoadError for a model path the loader would refuse before reading a weight."""
    from ftrs.errors import ModelLoadError
    from ftrs.models.load import resolve_model

    if model == "demo":  # built on first use, by the engine
        return
    path = resolve_model(model)  # "no such file or directory"
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(str(path), "a model is a checkpoint directory or a .gguf file")
        try:
            path.open("rb").close()
        except OSError as e:
            raise ModelLoadError(str(path), f"cannot read: {e.strerror or e}") from e
    elif not path.is_dir():
        raise ModelLoadError(str(path), "neither a checkpoint directory nor a .gguf file")
    elif not os.access(path, os.R_OK | os.X_OK):
        raise ModelLoadError(str(path), "cannot read the directory: permission denied")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The listening sockets of `host:port`, bound as asyncio's `create_server` binds them (each
    address the host resolves to, SO_REUSEADDR, IPv6 only on an IPv6 socket); uvicorn listens
    on them. OSError (or socket.gaierror) when one cannot be bound; none is left open then."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def stoppable_server(config: Any, client: EngineClient) -> Any:
    """A uvicorn.Server that stops on SIGINT/SIGTERM the way the module docstring says;
    `stop_signal` is the signal that stopped it (None: it was not stopped on request)."""
    import uvicorn

    class Server(uvicorn.Server):
        stop_signal: int | None = None
        _loop: asyncio.AbstractEventLoop | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal once serve() returns; a stop on request is 0
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            self._loop = asyncio.get_running_loop()
            handlers = {sig: signal.signal(sig, self.handle_exit)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                signal.signal(signal.SIGINT, handlers[signal.SIGINT])
                # the teardown after serve() ends in the exit code already decided: a SIGTERM
                # now (a service manager stopping a failing unit) must not make 86-89 a 143.
                # Ignored, not handled: the interpreter's exit resets a handler to the default
                # (killed by the signal) but keeps SIG_IGN; SIGKILL still ends a stuck exit
                signal.signal(signal.SIGTERM, signal.SIG_IGN)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)  # a second SIGINT forces the exit
            if self.stop_signal is None and self._loop is not None:
                self.stop_signal = sig
                with contextlib.suppress(RuntimeError):  # the loop is closing
                    self._loop.call_soon_threadsafe(_begin_stop, client, sig)

    return Server(config)


def _begin_stop(client: EngineClient, sig: int) -> None:
    told = client.begin_stop()
    logger.info("ftrs serve: %s: stopping; %d request(s) in flight told %s", signal.Signals(sig).name,
                told, "server_shutting_down")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """`--api-key`, else the first line of `--api-key-file`, else `$FTRS_API_KEY`, else None."""
    key: str | None = getattr(args, "api_key", None)
    path: Path | None = getattr(args, "api_key_file", None)
    if key is None and path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"api_key_file: cannot read {path}: {exc}") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"api_key_file: {path} is empty")
    if key is None:
        key = env_flag("FTRS_API_KEY") or None
    if key is not None and (not key.strip() or not key.isprintable()):
        raise ConfigError("api_key: must be a non-empty printable string")
    return key


def serve_limits(args: argparse.Namespace) -> dict[str, int]:
    """`max_request_bytes`, `request_body_timeout_s`, `default_max_tokens` and `max_n` of
    ServeSettings, checked."""
    max_bytes = getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
    body_timeout = getattr(args, "request_body_timeout", DEFAULT_REQUEST_BODY_TIMEOUT_S)
    default_max = getattr(args, "default_max_tokens", DEFAULT_MAX_TOKENS)
    max_n = getattr(args, "max_n", DEFAULT_MAX_N)
    if max_bytes < 1024:
        raise ConfigError(f"max_request_bytes: must be >= 1024, got {max_bytes}")
    if body_timeout < 1:
        raise ConfigError(f"request_body_timeout: must be >= 1, got {body_timeout}")
    if default_max < 1:
        raise ConfigError(f"default_max_tokens: must be >= 1, got {default_max}")
    if max_n < 1:
        raise ConfigError(f"max_n: must be >= 1, got {max_n}")
    return {"max_request_bytes": max_bytes, "request_body_timeout_s": body_timeout,
            "default_max_tokens": default_max, "max_n": max_n}


def check_parser_flags(args: argparse.Namespace) -> None:
    """`--tool-parser` and `--reasoning-parser` name known parsers (else ConfigError)."""
    from ftrs.server.reasoning import choose_reasoning_parser
    from ftrs.server.toolcalls import choose_tool_parser

    choose_tool_parser(getattr(args, "tool_parser", None), None)
    choose_reasoning_parser(getattr(args, "reasoning_parser", None), None)


async def _report_loading(client: EngineClient, model: str) -> None:
    """Log elapsed time (and engine progress) every few seconds until the engine is up or fails
    (the restart policy says what a failure does, in its own line)."""
    start = time.monotonic()
    while client.state in ("starting", "loading"):
        await asyncio.sleep(5.0)
        if client.state not in ("starting", "loading"):
            break
        msg = client.progress.message if client.progress else f"loading {model}"
        frac = client.progress.fraction if client.progress else None
        pct = f" {frac * 100:.0f}%" if frac is not None else ""
        logger.info("  %s%s ... %.0f s", msg, pct, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    """`python -m ftrs.server`: the same as `ftrs serve`, usable before the CLI wires it."""
    parser = argparse.ArgumentParser(prog="ftrs serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_arguments(parser)
    try:
        return run_serve(parser.parse_args(argv))
    except FtrsError as e:
        print(f"ftrs: error: {e.message}", file=sys.stderr)
        return e.exit_code


__all__ = ["add_serve_arguments", "bind_sockets", "check_parser_flags", "engine_config_from_args",
           "main", "port_number", "preflight", "preflight_experts", "resolve_api_key", "run_serve",
           "serve_limits"]
