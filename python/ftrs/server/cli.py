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

The API key comes from `--api-key`, else `--api-key-file` (first line), else `$FTRS_API_KEY`
(read through `ftrs.config.env_flag`, the one place environment variables are read).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
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
    from ftrs.server.engine_client import Classifier, EngineClient

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # larger request bodies get 413
DEFAULT_MAX_TOKENS = 1024  # of a chat request without max_tokens (OpenAI: the context's rest)
DEFAULT_MAX_N = 8  # choices one request may ask for (`n`)
MAX_PORT = 65535


def port_number(text: str) -> int:
    """`--port`: a TCP port, 1-65535. 0 (any free port) is refused: the server names its URL
    before it binds, so it would name the wrong one. Raises ConfigError, which argparse passes
    through, so `ftrs` prints one `ftrs: error:` line instead of its usage."""
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
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port_number, default=8000,
                        help=f"port to listen on, 1-{MAX_PORT} (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` (all endpoints but /health and "
                             "/metrics); also --api-key-file or $FTRS_API_KEY")
    parser.add_argument("--api-key-file", default=None, type=Path,
                        help="read the API key from the first line of this file")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="max_tokens of a chat request that sets none, or what is left of the "
                             f"context if less (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help=f"largest `n` (choices per request) accepted (default {DEFAULT_MAX_N})")
    parser.add_argument("--tool-parser", default=None,
                        help="how tool calls are read from the output: hermes, mistral, llama3_json "
                             "(default: chosen from the chat template)")
    parser.add_argument("--reasoning-parser", default=None,
                        help="how reasoning is split from the answer: qwen3, deepseek_r1 "
                             "(default: chosen from the chat template; none if it has no <think>)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the --model value)")
    parser.add_argument("--engine-backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-link-guard", action="store_true",
                        help="with an explicit --max-prefill-length, do not cap it")
    parser.add_argument("--link-guard-window", type=float, default=0.5,
                        help="seconds of expert fetch one prefill chunk may take (default 0.5)")
    add_engine_arguments(parser)


def run_serve(args: argparse.Namespace, classifier: Classifier | None = None) -> int:
    """Serve until interrupted. Returns the exit code (the engine's failure code if it died).

    `classifier(exit_code, last_error) -> FtrsError` decides what a dead engine means (the
    device supervisor passes one that reads the device); default `classify_engine_exit`.
    """
    import uvicorn

    from ftrs.server.app import ServeSettings, create_app
    from ftrs.server.engine_client import DEFAULT_BACKEND, classify_engine_exit

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        engine = engine_config_from_args(args)
        from ftrs.guard.startup import apply_link_guard

        engine, link_guard = apply_link_guard(
            engine, explicit_max_prefill=getattr(args, "max_prefill_length", None) is not None,
            no_link_guard=getattr(args, "no_link_guard", False),
            window_s=getattr(args, "link_guard_window", 0.5))
        api_key = resolve_api_key(args)
        limits = serve_limits(args)
        check_parser_flags(args)
    except FtrsError as err:
        logger.error("ftrs serve: %s", err.message)
        return err.exit_code
    settings = ServeSettings(engine=engine, host=args.host, port=args.port, api_key=api_key,
                             served_model_name=args.served_model_name,
                             backend=args.engine_backend or DEFAULT_BACKEND,
                             link_guard=link_guard.to_dict() if link_guard is not None else None,
                             tool_parser=getattr(args, "tool_parser", None),
                             reasoning_parser=getattr(args, "reasoning_parser", None),
                             **limits)
    app = create_app(settings, classifier or classify_engine_exit)
    client: EngineClient = app.state.engine
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5)
    server = stoppable_server(config, client)
    from ftrs.server.supervision import install_policy

    install_policy(client, server, engine.on_device_lost)

    async def main() -> None:
        progress = asyncio.ensure_future(_report_loading(client, settings.engine.model))
        try:
            await server.serve()
        finally:
            progress.cancel()

    logger.info("ftrs serve: loading %s (http://%s:%d/health says 503 until ready)",
                engine.model, settings.host, settings.port)
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
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

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
    """`max_request_bytes`, `default_max_tokens` and `max_n` of ServeSettings, checked."""
    max_bytes = getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
    default_max = getattr(args, "default_max_tokens", DEFAULT_MAX_TOKENS)
    max_n = getattr(args, "max_n", DEFAULT_MAX_N)
    if max_bytes < 1024:
        raise ConfigError(f"max_request_bytes: must be >= 1024, got {max_bytes}")
    if default_max < 1:
        raise ConfigError(f"default_max_tokens: must be >= 1, got {default_max}")
    if max_n < 1:
        raise ConfigError(f"max_n: must be >= 1, got {max_n}")
    return {"max_request_bytes": max_bytes, "default_max_tokens": default_max, "max_n": max_n}


def check_parser_flags(args: argparse.Namespace) -> None:
    """`--tool-parser` and `--reasoning-parser` name known parsers (else ConfigError)."""
    from ftrs.server.reasoning import choose_reasoning_parser
    from ftrs.server.toolcalls import choose_tool_parser

    choose_tool_parser(getattr(args, "tool_parser", None), None)
    choose_reasoning_parser(getattr(args, "reasoning_parser", None), None)


async def _report_loading(client: EngineClient, model: str) -> None:
    """Log elapsed time (and engine progress) every few seconds until the engine is up or fails."""
    start = time.monotonic()
    while client.state in ("starting", "loading"):
        await asyncio.sleep(5.0)
        if client.state not in ("starting", "loading"):
            break
        msg = client.progress.message if client.progress else f"loading {model}"
        frac = client.progress.fraction if client.progress else None
        pct = f" {frac * 100:.0f}%" if frac is not None else ""
        logger.info("  %s%s ... %.0f s", msg, pct, time.monotonic() - start)
    if client.state == "failed" and client.failure is not None:
        logger.error("ftrs serve: the engine failed: %s (%s)", client.failure.message, client.failure.code)


def main(argv: list[str] | None = None) -> int:
    """`python -m ftrs.server`: the same as `ftrs serve`, usable before the CLI wires it."""
    parser = argparse.ArgumentParser(prog="ftrs serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    add_serve_arguments(parser)
    try:
        return run_serve(parser.parse_args(argv))
    except FtrsError as e:
        print(f"ftrs: error: {e.message}", file=sys.stderr)
        return e.exit_code


__all__ = ["add_serve_arguments", "check_parser_flags", "engine_config_from_args", "main", "port_number",
           "resolve_api_key", "run_serve", "serve_limits"]
