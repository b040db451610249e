"""The engine process: load the engine, then step it while it has work (DESIGN.md "How a request flows").

Messages on the pipes, all picklable:
  API -> engine: `GenerateRequest`, `AbortRequest`, `Shutdown`
  engine -> API: `EngineProgress`*, then `EngineReady` or `EngineFailed`; then one `StepOutput`
                 per step, and a `Heartbeat` every second from a thread of its own
                 (`server.liveness`: the API side's watch on a frozen engine); `EngineFailed`
                 before exiting on a fatal error. The outbox is locked: no two messages interleave.

Invariants: the loop blocks on the pipe only when the engine has no work; every step's events
and stats go out in one message, so the API side sees a request's tokens in step order. A
request the engine refuses in `add_request` gets one `TokenEvent(finish_reason="error")`.

A step that raises fails only the requests of that step, unless the error is the device's
(`StepRunner`): they get one `TokenEvent(finish_reason="error")` with the error (an untyped
exception becomes `EngineStepError`: its class and message, no traceback; the traceback is
logged here once), their KV pages are freed, and the engine goes on. `step_fault_limit` failed steps in a row, or a
`DeviceError` (the device policy: `server.supervision`), end the loop: the typed error is
reported and the process exits with the error's exit code, so a supervisor that only sees
the exit code still knows what happened. The API side then restarts the engine or exits.

Stopping is the API process's business: the engine process ignores SIGINT (Ctrl-C in a
terminal reaches the whole process group; the API process stops the engine with `Shutdown`,
or with SIGTERM while it loads and reads no messages: it exits 143 then), and every exit runs
multiprocessing's finalizers first, so a semaphore some library made here is unlinked rather
than reported leaked by the resource tracker. The loader's progress bars (tqdm) write under a
thread lock here, not tqdm's default named semaphore, so an engine killed outright (SIGKILL,
the OOM killer) leaves no semaphore behind either.

The engine is built by a *backend*: a module with `load(config) -> LoadedEngine`. The default,
`ftrs.server.backend`, builds `ftrs.engine.core.EngineCore`; tests pass a fake one.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, Protocol

from ftrs.config import EngineConfig
from ftrs.engine.protocol import AbortRequest, GenerateRequest, StepStats, TokenEvent
from ftrs.errors import DeviceError, EngineStepError, FtrsError, ModelLoadError
from ftrs.server.liveness import LockedOutbox, Outbox, start_heartbeat

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the engine process needs of an engine (`ftrs.engine.core.EngineCore` is one).
    Optional: `step_request_ids() -> list[str] | None`, the requests of the step that raised
    (without it, or when it returns None, a failed step fails every request the engine holds)."""

    model_name: str
    max_model_len: int
    vocab_size: int

    def add_request(self, req: GenerateRequest) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> tuple[list[TokenEvent], StepStats]: ...
    def has_work(self) -> bool: ...


def _kv_cache_info(engine: Engine) -> dict[str, Any] | None:
    """The engine's `kv_cache_info()` where it has one (`EngineCore` does; test engines may not)."""
    info = getattr(engine, "kv_cache_info", None)
    return None if info is None else dict(info())


def _expert_stats(engine: Engine) -> dict[str, Any] | None:
    """The engine's `expert_stats()` where it has them (none for dense models, test engines)."""
    stats = getattr(engine, "expert_stats", None)
    return (dict(stats()) or None) if stats is not None else None


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
    # the KV cache as `EngineCore.kv_cache_info()` tells it (dtype, tokens, bytes); None when
    # the engine does not say
    kv_cache: dict[str, Any] | None = None
    # the MoE strategy's counters at ready (`EngineCore.expert_stats()`: its expert-cache
    # slots, for /metrics before the first step); None for dense models and test engines
    experts: dict[str, Any] | None = None


@dataclass(frozen=True)
class EngineFailed:
    """`error` is `error_to_wire(FtrsError)`; `exit_code` is what the process exits with."""

    error: dict[str, Any]
    exit_code: int
    during: str  # "load" | "step"


@dataclass(frozen=True)
class Heartbeat:
    """The engine process is alive (sent every `liveness.HEARTBEAT_S` once it is ready)."""


@dataclass(slots=True)
class StepOutput:
    events: list[TokenEvent]
    stats: StepStats | None  # None when no step ran (a request refused by `add_request`)


def error_to_wire(err: FtrsError) -> dict[str, Any]:
    """The dict form of an error that crosses the pipe (and `TokenEvent.error`)."""
    return {**err.to_dict(), "http_status": err.http_status, "code": err.code}


def _as_ftrs_error(exc: BaseException, during: str) -> FtrsError:
    """The typed error that crosses the pipe: class and message only; the traceback stays in
    this process's log (clients and /health never see one)."""
    if isinstance(exc, FtrsError):
        return exc
    logger.error("engine %s failed:\n%s", during,
                 "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
    evidence = {"exception": type(exc).__name__}
    if during == "load":
        return ModelLoadError("engine", f"{type(exc).__name__}: {exc}", evidence=evidence)
    what = "engine step failed" if during == "step" else "the engine could not take the request"
    return EngineStepError(f"{what}: {type(exc).__name__}: {exc}", evidence=evidence)


def load_backend(backend: str) -> Any:
    return importlib.import_module(backend)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Around the engine's spawn (milliseconds): a child inherits an ignored SIGINT, so a
    Ctrl-C during its start (imports, unpickling) cannot kill it before `engine_main` ignores
    SIGINT itself. Does nothing outside the main thread (only it may set signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit(code: int) -> None:
    """End the engine process now (no interpreter teardown: a lost device can hang it), after
    multiprocessing's own finalizers, which unlink the named semaphores made in this process;
    `os._exit` alone leaves them to the resource tracker's "leaked semaphore" warning."""
    try:
        mp_util._run_finalizers(0)  # type: ignore[attr-defined]  # what a normal exit runs
    finally:
        os._exit(code)


def bars_without_semaphore() -> None:
    """Progress bars in this process take a thread lock: tqdm's default also makes a named
    multiprocessing semaphore, which a process killed before its finalizers run leaves to the
    resource tracker ("leaked semaphore objects" when the server stops). No other process
    draws bars with this one."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _on_sigterm(signum: int, _frame: object) -> None:
    _exit(128 + signum)


def engine_main(
    config: EngineConfig, backend: str, inbox: Connection, outbox: Connection, log_level: int
) -> None:
    """Entry point of the spawned engine process. Never returns normally: exits with a code."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process owns stopping
        signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(level=log_level, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    bars_without_semaphore()
    code = 0
    locked = LockedOutbox(outbox)  # the step loop, `on_fatal` and the heartbeat all send
    try:
        code = _run(config, backend, inbox, locked)
    finally:
        locked.close()
        _exit(code)


def _run(config: EngineConfig, backend: str, inbox: Connection, outbox: Outbox) -> int:
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
            kv_cache=_kv_cache_info(engine),
            experts=_expert_stats(engine),
        )
    )
    heartbeat = start_heartbeat(outbox.send, Heartbeat())
    supervisor = _supervise(config, engine, outbox)
    try:
        step = engine.step if supervisor is None else supervisor.step
        return _loop(engine, inbox, outbox, StepRunner(engine, step, config.step_fault_limit))
    except BaseException as exc:
        err = _as_ftrs_error(exc, "step")
        logger.error("engine step failed: %s", err.message)
        try:
            outbox.send(EngineFailed(error_to_wire(err), err.exit_code, "step"))
        except OSError:
            pass
        return err.exit_code
    finally:
        heartbeat.set()
        if supervisor is not None:
            supervisor.close()
        close = getattr(engine, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:  # exiting anyway; say so and keep the original error
                logger.warning("engine close failed: %s", exc)


def _supervise(config: EngineConfig, engine: Engine, outbox: Outbox) -> Any:
    """The device supervisor (flight recorder, monitor, watchdog, fault injection); None for
    engines that are not EngineCore-like (the tests' fake backend) unless a fault is injected."""
    if not hasattr(engine, "transfer_engine") and config.fault_inject is None:
        return None
    from ftrs.server.supervision import EngineSupervisor

    def on_fatal(err: FtrsError) -> None:  # monitor thread: the step loop may be stuck
        logger.error("engine fault: %s", err.message)
        try:
            outbox.send(EngineFailed(error_to_wire(err), err.exit_code, "step"))
            outbox.close()
        finally:
            _exit(err.exit_code)

    return EngineSupervisor(config, engine, on_fatal=on_fatal)


class StepRunner:
    """Runs the engine's steps so that no single bad step ends the engine.

    `live` holds the ids of the requests the engine holds, as far as the messages tell (added
    by `add`, dropped on abort and on a finishing event). A step that raises anything but a
    `DeviceError` fails the requests it carried (the engine's `step_request_ids()` when it has
    one and knows them, else every live request): each is aborted (its KV pages freed) and gets
    an error event. `fault_limit` failed steps in a row raise `EngineStepError` instead: an
    engine that fails every step is broken, and only a fresh process helps.
    """

    def __init__(self, engine: Engine, step: Callable[[], tuple[list[TokenEvent], StepStats | None]],
                 fault_limit: int = 3) -> None:
        self.engine = engine
        self._step = step
        self.fault_limit = fault_limit
        self.live: set[str] = set()
        self.failed_in_a_row = 0

    def add(self, req: GenerateRequest) -> TokenEvent | None:
        """Hand `req` to the engine; an error event when the engine refuses it."""
        try:
            self.engine.add_request(req)
        except Exception as exc:  # refused request (or a validation gap): not a fatal error
            err = exc if isinstance(exc, FtrsError) else _as_ftrs_error(exc, "add_request")
            return TokenEvent(req.request_id, [], finish_reason="error", error=error_to_wire(err))
        self.live.add(req.request_id)
        return None

    def abort(self, request_id: str) -> None:
        self.live.discard(request_id)
        try:
            self.engine.abort(request_id)
        except Exception as exc:  # the request is gone for the API side either way
            logger.error("abort of %s failed: %s: %s", request_id, type(exc).__name__, exc)

    def step(self) -> tuple[list[TokenEvent], StepStats | None]:
        try:
            events, stats = self._step()
        except DeviceError:
            raise  # the device policy decides (crash report, exit code, restart)
        except Exception as exc:
            self.failed_in_a_row += 1
            err = _as_ftrs_error(exc, "step")  # logs the traceback of an untyped error
            if isinstance(exc, FtrsError):
                logger.error("engine step failed: %s", err.message, exc_info=exc)
            if self.failed_in_a_row >= self.fault_limit:
                raise EngineStepError(
                    f"{self.failed_in_a_row} engine steps failed in a row; the last: {err.message}",
                    evidence={**err.evidence, "failed_in_a_row": self.failed_in_a_row}) from exc
            events, stats = self._fail_step(err), None
        else:
            self.failed_in_a_row = 0
        for ev in events:
            if ev.finish_reason is not None:
                self.live.discard(ev.request_id)
        return events, stats

    def _fail_step(self, err: FtrsError) -> list[TokenEvent]:
        ids_of = getattr(self.engine, "step_request_ids", None)
        ids = ids_of() if callable(ids_of) else None
        failed = sorted(self.live) if ids is None else [i for i in ids if i in self.live]
        wire = error_to_wire(err)
        events = []
        for rid in failed:
            self.abort(rid)
            events.append(TokenEvent(rid, [], finish_reason="error", error=wire))
        logger.error("failed %d request(s) of the failed step (%d in a row)", len(events),
                     self.failed_in_a_row)
        return events


def _loop(engine: Engine, inbox: Connection, outbox: Outbox, runner: StepRunner) -> int:
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
                runner.abort(msg.request_id)
                aborted = True
            elif isinstance(msg, GenerateRequest):
                refused = runner.add(msg)
                if refused is not None:
                    outbox.send(StepOutput([refused], None))
        if engine.has_work() or aborted:
            # One step after an abort with nothing else to do reports the freed KV pages.
            events, stats = runner.step()
            outbox.send(StepOutput(events, stats))


__all__ = [
    "Engine",
    "EngineFailed",
    "EngineProgress",
    "EngineReady",
    "Heartbeat",
    "LoadedEngine",
    "Shutdown",
    "StepOutput",
    "StepRunner",
    "engine_main",
    "error_to_wire",
    "sigint_ignored",
]
