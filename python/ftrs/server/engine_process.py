"""The engine process: load the engine, then step it while it has work (DESIGN.md "How a request flows").

Messages on the pipes, all picklable:
  API -> engine: `GenerateRequest`, `AbortRequest`, `Shutdown`
  engine -> API: `EngineProgress`*, then `EngineReady` or `EngineFailed`; then one `StepOutput`
                 per step; `EngineFailed` before exiting on a fatal error.

Invariants: the loop blocks on the pipe only when the engine has no work; every step's events
and stats go out in one message, so the API side sees a request's tokens in step order. A
request the engine refuses in `add_request` gets one `TokenEvent(finish_reason="error")`. A
fatal `FtrsError` from `step()` is reported and the process exits with the error's exit code,
so a supervisor that only sees the exit code still knows what happened.

The engine is built by a *backend*: a module with `load(config) -> LoadedEngine`. The default,
`ftrs.server.backend`, builds `ftrs.engine.core.EngineCore`; tests pass a fake one.
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, Protocol

from ftrs.config import EngineConfig
from ftrs.engine.protocol import AbortRequest, GenerateRequest, StepStats, TokenEvent
from ftrs.errors import FtrsError, ModelLoadError

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the engine process needs of an engine (`ftrs.engine.core.EngineCore` is one)."""

    model_name: str
    max_model_len: int
    vocab_size: int

    def add_request(self, req: GenerateRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> tuple[list[TokenEvent], StepStats]: ...
    def has_work(self) -> bool: ...


class LoadedEngine(NamedTuple):
    engine: Engine
    tokenizer_source: Any  # picklable; the API process passes it to the backend's `load_tokenizer`


@dataclass(frozen=True)
class Shutdown:
    """Stop stepping and exit 0."""


@dataclass(frozen=True)
class EngineProgress:
    """Loading progress; `fraction` in [0, 1] or None when unknown."""

    message: str
    fraction: float | None = None


@dataclass(frozen=True)
class EngineReady:
    model_name: str
    tokenizer_source: Any
    max_model_len: int
    vocab_size: int
    pid: int


@dataclass(frozen=True)
class EngineFailed:
    """`error` is `error_to_wire(FtrsError)`; `exit_code` is what the process exits with."""

    error: dict[str, Any]
    exit_code: int
    during: str  # "load" | "step"


@dataclass(slots=True)
class StepOutput:
    events: list[TokenEvent]
    stats: StepStats | None  # None when no step ran (a request refused by `add_request`)


def error_to_wire(err: FtrsError) -> dict[str, Any]:
    """The dict form of an error that crosses the pipe (and `TokenEvent.error`)."""
    return {**err.to_dict(), "http_status": err.http_status, "code": err.code}


def _as_ftrs_error(exc: BaseException, during: str) -> FtrsError:
    if isinstance(exc, FtrsError):
        return exc
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    if during == "load":
        return ModelLoadError("engine", f"{type(exc).__name__}: {exc}", evidence={"traceback": tb[-5:]})
    return FtrsError(f"engine step failed: {type(exc).__name__}: {exc}", evidence={"traceback": tb[-5:]})


def load_backend(backend: str) -> Any:
    return importlib.import_module(backend)


def engine_main(
    config: EngineConfig, backend: str, inbox: Connection, outbox: Connection, log_level: int
) -> None:
    """Entry point of the spawned engine process. Never returns normally: exits with a code."""
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    code = 0
    try:
        code = _run(config, backend, inbox, outbox)
    finally:
        outbox.close()
        os._exit(code)


def _run(config: EngineConfig, backend: str, inbox: Connection, outbox: Connection) -> int:
    try:
        outbox.send(EngineProgress(f"loading {config.model}"))
        loaded: LoadedEngine = load_backend(backend).load(config)
    except BaseException as exc:  # the load failure is the message; the API side reports it
        err = _as_ftrs_error(exc, "load")
        logger.error("engine failed to load: %s", err.message)
        outbox.send(EngineFailed(error_to_wire(err), err.exit_code, "load"))
        return err.exit_code
    engine = loaded.engine
    outbox.send(
        EngineReady(
            model_name=engine.model_name,
            tokenizer_source=loaded.tokenizer_source,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            pid=os.getpid(),
        )
    )
    supervisor = _supervise(config, engine, outbox)
    try:
        return _loop(engine, inbox, outbox, supervisor)
    except BaseException as exc:
        err = _as_ftrs_error(exc, "step")
        logger.error("engine step failed: %s", err.message)
        try:
            outbox.send(EngineFailed(error_to_wire(err), err.exit_code, "step"))
        except OSError:
            pass
        return err.exit_code
    finally:
        if supervisor is not None:
            supervisor.close()
        close = getattr(engine, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # exiting anyway; say so and keep the original error
                logger.warning("engine close failed: %s", exc)


def _supervise(config: EngineConfig, engine: Engine, outbox: Connection) -> Any:
    """The device supervisor (flight recorder, monitor, watchdog, fault injection); None for
    engines that are not EngineCore-like (the tests' fake backend) unless a fault is injected."""
    if not hasattr(engine, "rt") and config.fault_inject is None:
        return None
    from ftrs.server.supervision import EngineSupervisor

    def on_fatal(err: FtrsError) -> None:  # monitor thread: the step loop may be stuck
        logger.error("engine fault: %s", err.message)
        try:
            outbox.send(EngineFailed(error_to_wire(err), err.exit_code, "step"))
            outbox.close()
        finally:
            os._exit(err.exit_code)

    return EngineSupervisor(config, engine, on_fatal=on_fatal)


def _loop(engine: Engine, inbox: Connection, outbox: Connection, supervisor: Any = None) -> int:
    while True:
        if not engine.has_work():
            try:
                inbox.poll(None)  # idle: block until the API side sends something
            except (EOFError, OSError):
                return 0
        aborted = False
        while inbox.poll():
            try:
                msg = inbox.recv()
            except (EOFError, OSError):
                return 0  # the API process went away
            if isinstance(msg, Shutdown):
                return 0
            if isinstance(msg, AbortRequest):
                engine.abort(msg.request_id)
                aborted = True
            elif isinstance(msg, GenerateRequest):
                try:
                    engine.add_request(msg)
                except FtrsError as err:  # refused request, not a fatal error
                    ev = TokenEvent(msg.request_id, [], finish_reason="error", error=error_to_wire(err))
                    outbox.send(StepOutput([ev], None))
        if engine.has_work() or aborted:
            # One step after an abort with nothing else to do reports the freed KV pages.
            events, stats = engine.step() if supervisor is None else supervisor.step()
            outbox.send(StepOutput(events, stats))


__all__ = [
    "Engine",
    "EngineFailed",
    "EngineProgress",
    "EngineReady",
    "LoadedEngine",
    "Shutdown",
    "StepOutput",
    "engine_main",
    "error_to_wire",
]
