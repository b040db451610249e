"""The API process's side of the engine: spawn it, route its events, outlive it.

`EngineClient` spawns the engine process (multiprocessing "spawn") and owns one reader thread
that receives everything the engine sends. Token events are routed, on the event loop, to one
`asyncio.Queue` per request. When the engine dies (a fatal error it reported, or an exit
without one), every in-flight request receives the same typed error, `/health` reports it,
and new requests are refused with it.

When the engine dies after it served, the restart policy (`server.restart_policy.install_policy`)
may call `schedule_restart` (so does `--on-device-lost cpu|restart`, with another config): the
requests in flight are then told `EngineRestarted` (503, `engine_restarted`; of a device error,
that error), state is "restarting" (/health 503 with the cause and the restart count, new
requests 503 at once) through the backoff and the new engine's load, and "ready" again once it
is up. `restarts` counts a restart from the moment it is scheduled.

An engine process frozen whole (SIGSTOP, a native deadlock holding the GIL) cannot report its
own hang: a ready engine that sent nothing, not even its heartbeat, for `hang_timeout` s is
failed as `EngineHang` (decided by `api_watchdog`) and killed (`server.liveness`).

Each step's stats carry the engine's device monitor verdict (`StepStats.device`); `/health`
shows the latest as `device` (ok, or degraded with the reason) while the engine serves.

A stop on request (SIGINT/SIGTERM, `begin_stop`) tells every request in flight
`ServerShuttingDown` (503, `server_shutting_down`) at once and refuses new ones with it; state
is "stopping" until `shutdown()` stops the engine (a `Shutdown` message, or SIGTERM while it
still loads and reads no messages) and makes it "stopped".

What the error *is* comes from a classifier, `(exit_code, last_error) -> FtrsError`. The default
(`liveness.classify_engine_exit`) trusts the error the engine reported, else maps the exit code
through the table of DESIGN.md "Errors" (86 DeviceLost, 87 KernelFault, 88 EngineHang). The
device supervisor plugs a better one in (one that reads PCI config space or NVML) through
`EngineClient(classifier=...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from typing import Any

from ftrs.config import EngineConfig, ftrs_home
from ftrs.engine.protocol import AbortRequest, GenerateRequest, StepStats, TokenEvent
from ftrs.errors import DeviceError, EngineRestarted, FtrsError, ModelLoadError, ServerShuttingDown
from ftrs.health.classify import evidence_summary
from ftrs.server.engine_process import (
    EngineFailed,
    EngineProgress,
    EngineReady,
    Heartbeat,
    Shutdown,
    StepOutput,
    engine_main,
    load_backend,
    sigint_ignored,
)
from ftrs.server.errors import EngineUnavailable
from ftrs.server.liveness import HEARTBEAT_S, SilenceWatch, classify_engine_exit, report_hang

logger = logging.getLogger(__name__)

Classifier = Callable[[int | None, dict[str, Any] | None], FtrsError]
StreamItem = TokenEvent | FtrsError

DEFAULT_BACKEND = "ftrs.server.backend"


class EngineClient:
    """Spawns and supervises the engine process; must be started from a running event loop.

    States: "starting" -> "loading" -> "ready"; any -> "failed" (engine gone, `failure` says why);
    "failed" -> "restarting" -> "ready" when the restart policy restarts it (`restarting` says
    why); any -> "stopping" on a stop on request (`begin_stop`; "failed" stays); "stopped"
    after `shutdown()`. Only "ready" accepts requests.
    """

    def __init__(
        self,
        config: EngineConfig,
        backend: str = DEFAULT_BACKEND,
        classifier: Classifier = classify_engine_exit,
        on_stats: Callable[[StepStats], None] | None = None,
        on_failure: Callable[[FtrsError], None] | None = None,
        on_ready: Callable[[EngineReady], None] | None = None,
        on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.classifier = classifier
        self.on_stats = on_stats
        self.on_failure = on_failure
        self.on_ready = on_ready
        self.on_restart = on_restart  # called each time a new engine process is spawned
        self.state = "starting"
        self.info: EngineReady | None = None
        self.tokenizer: Any = None
        self.failure: FtrsError | None = None
        self.progress: EngineProgress | None = None
        self.started_at = time.monotonic()
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = asyncio.Event()
        self._proc: Any = None
        self._inbox: Any = None  # engine -> API
        self._outbox: Any = None  # API -> engine
        self._generation = 0  # bumped by restart(); messages of older engines are ignored
        self.degraded: dict[str, Any] | None = None  # set by restart(): why and how degraded
        self.restarting: EngineRestarted | None = None  # while state is "restarting": why
        self.restarts = 0  # engine restarts scheduled or run (processes after the first)
        self.restarting_since = time.monotonic()  # when the current restart began (the death)
        self.device: dict[str, Any] | None = None  # the engine's monitor verdict, last step's
        self.ever_ready = False  # an engine of this client served (a later death may restart)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=engine_main,
            args=(self.config, self.backend, to_engine_r, from_engine_w, logging.getLogger().level),
            name="ftrs-engine",
        )
        with sigint_ignored():  # Ctrl-C reaches the process group; this process stops the engine
            self._proc.start()
        to_engine_r.close()
        from_engine_w.close()  # so the reader sees EOF when the engine dies
        self._inbox, self._outbox = from_engine_r, to_engine_w
        self.state = "restarting" if self.restarting is not None else "loading"
        threading.Thread(target=self._read_loop, args=(self._generation, self._inbox, self._proc),
                         name="ftrs-engine-reader", daemon=True).start()

    def restart(self, config: EngineConfig, degraded: dict[str, Any] | None = None) -> None:
        """Spawn a fresh engine with `config` now; `/health` reports `degraded` once it is
        ready. The old engine process, if still alive, is killed first. The restart policy
        goes through `schedule_restart`, which says "restarting" until the engine is up."""
        self.restarts += 1
        self._spawn(config, degraded)

    def _spawn(self, config: EngineConfig, degraded: dict[str, Any] | None) -> None:
        for conn in (self._inbox, self._outbox):
            with contextlib.suppress(OSError, AttributeError):
                conn.close()
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()  # two engines must never share the device; its reader joins it
        self._generation += 1
        if self.on_restart is not None:
            self.on_restart()
        self.config = config
        self.degraded = degraded
        self.failure = None
        self.info = None
        self.progress = None
        self.device = None
        self.started_at = time.monotonic()
        self._ready = asyncio.Event()
        self.start()

    def schedule_restart(self, err: EngineRestarted, delay_s: float,
                         config: EngineConfig | None = None,
                         degraded: dict[str, Any] | None = None) -> None:
        """Restart the engine in `delay_s` seconds (the policy's backoff) with `config` and
        `degraded` (default: as they are). Until the new engine is ready, state is
        "restarting" and `err` is what new requests are told, and what the requests in flight
        of the dead engine are told unless it died of a device error (they keep that error)."""
        assert self._loop is not None
        self._generation += 1  # late messages of the dead engine no longer count
        self.restarting = err
        self.failure = None
        self.state = "restarting"
        self.restarts += 1  # counted now: /health says "restart 1" through the first backoff
        self.restarting_since = time.monotonic()
        self._ready = asyncio.Event()
        new_config = self.config if config is None else config
        new_degraded = self.degraded if config is None else degraded

        def go() -> None:
            if self.state == "restarting":  # not shut down during the backoff
                self._spawn(new_config, new_degraded)

        self._loop.call_later(delay_s, go)

    def give_up(self, err: FtrsError) -> None:
        """No more restarts: `err` is the failure (its exit code is the server's)."""
        self.restarting = None
        self.failure = err
        self.state = "failed"

    async def wait_ready(self, timeout: float | None = None) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self.state == "ready"

    def begin_stop(self) -> int:
        """A stop on request: from now on new requests get `ServerShuttingDown`, and so does
        every request in flight, at once; each handler answers it in its endpoint's shape.
        `shutdown()` stops the engine afterwards. Returns the number of requests told."""
        if self.state in ("stopping", "stopped"):
            return 0
        if self.state != "failed":  # a failure stays what /health and the exit code say
            self.state = "stopping"
        self._ready.set()
        told = len(self._streams)
        self._fail_all(ServerShuttingDown("server is shutting down"))
        return told

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: `Shutdown` when it is up, SIGTERM while it loads (it reads no
        messages then); terminate it if it does not exit within `timeout` seconds."""
        prev, self.state = self.state, "stopped"
        if self._proc is None:
            return
        if self.info is None and self._proc.is_alive():
            logger.info("stopping the engine while it loads")
            self._proc.terminate()
            _join(self._proc, 3.0)  # it exits between two Python calls; one long C call: SIGKILL
        else:
            if prev != "failed":
                self._send(Shutdown())
            _join(self._proc, timeout)
            if self._proc.is_alive():
                logger.warning("engine process did not exit in %.0f s; terminating it", timeout)
                self._proc.terminate()
                self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._fail_all(ServerShuttingDown("server is shutting down"))
        for conn in (self._inbox, self._outbox):
            with contextlib.suppress(OSError):
                conn.close()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else int(self._proc.pid)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------------------ requests

    def submit(self, req: GenerateRequest) -> asyncio.Queue[StreamItem]:
        """Send a request; its `TokenEvent`s (or one `FtrsError`) arrive on the returned queue."""
        if self.state != "ready":
            raise self.unavailable()
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[req.request_id] = queue
        self._send(req)
        return queue

    def abort(self, request_id: str) -> None:
        """Forget the request and tell the engine to free its KV pages."""
        if self._streams.pop(request_id, None) is not None and self.state == "ready":
            self._send(AbortRequest(request_id))

    def release(self, request_id: str) -> None:
        """The request finished normally; drop its queue."""
        self._streams.pop(request_id, None)

    def unavailable(self) -> FtrsError:
        if self.failure is not None:
            return self.failure
        if self.state in ("stopping", "stopped"):
            return ServerShuttingDown("server is shutting down")
        if self.restarting is not None:
            return self.restarting
        return EngineUnavailable(f"the engine is still loading {self.config.model}")

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for `/health`."""
        body: dict[str, Any] = {"status": self.state}
        if self.state == "ready" and self.info is not None:
            body.update(status="ok", model=self.info.model_name, engine_pid=self.info.pid,
                        max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size,
                        in_flight=len(self._streams))
            if self.info.kv_cache is not None:
                body["kv_cache"] = self.info.kv_cache
            if self.degraded is not None:
                body.update(degraded=True, degraded_reason=self.degraded)
            if self.device is not None:
                body["device"] = dict(self.device)
            return 200, body
        if self.failure is not None:
            body.update(reason=self.failure.message, code=self.failure.code,
                        classification=type(self.failure).__name__,
                        evidence=evidence_summary(self.failure), error=self.failure.to_dict())
        elif self.state == "restarting" and self.restarting is not None:
            body.update(reason=self.restarting.message, code=self.restarting.code,
                        restarts=self.restarts, cause=self.restarting.evidence.get("cause"),
                        elapsed_s=round(time.monotonic() - self.restarting_since, 1))
        elif self.state in ("starting", "loading"):
            body.update(reason=f"loading {self.config.model}",
                        elapsed_s=round(time.monotonic() - self.started_at, 1))
            if self.progress is not None:
                body["progress"] = {"message": self.progress.message,
                                    "fraction": self.progress.fraction}
        else:
            body["reason"] = "server is shutting down"
        return 503, body

    # ------------------------------------------------------------------------------ internals

    def _send(self, msg: object) -> None:
        try:
            with self._send_lock:
                self._outbox.send(msg)
        except (OSError, ValueError) as exc:  # engine gone: the reader reports it
            logger.debug("send to engine failed: %s", exc)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self._loop.call_soon_threadsafe(fn, *args)

    def _read_loop(self, gen: int, inbox: Any, proc: Any) -> None:
        """Reader thread: everything the engine sends but heartbeats goes to the loop, in order."""
        last_error: dict[str, Any] | None = None
        silence = SilenceWatch(self.config.hang_timeout)
        while True:
            try:
                if not inbox.poll(HEARTBEAT_S):
                    watching = self.state == "ready" and gen == self._generation
                    hang = silence.check(proc.pid, watching, (self.device or {}).get("bdf"))
                    if hang is not None:  # frozen whole: fail it, then kill it (its EOF follows)
                        report_hang(ftrs_home(), hang)
                        self._call(self._fail, hang)
                        proc.kill()  # a stopped process dies of SIGKILL too
                    continue
                msg = inbox.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # unpickling failed: a message cut by the engine's death,
                # or this interpreter exiting under the thread (an import in `loads` fails);
                # either way the pipe is done, and a traceback is noise
                logger.debug("engine message unreadable: %r", exc)
                break
            silence.heard()
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, EngineFailed):
                last_error = msg.error
            self._call(self._on_message, msg, gen)
        proc.join(10)
        self._call(self._on_exit, proc.exitcode, last_error, gen)

    def _on_message(self, msg: object, gen: int = 0) -> None:
        if gen != self._generation:
            return  # an engine that was replaced by restart()
        if isinstance(msg, StepOutput):
            for ev in msg.events:
                queue = self._streams.get(ev.request_id)
                if queue is not None:
                    queue.put_nowait(ev)
                    if ev.finish_reason is not None:
                        self._streams.pop(ev.request_id, None)
            if msg.stats is not None and msg.stats.device is not None:
                self.device = msg.stats.device
            if msg.stats is not None and self.on_stats is not None:
                self.on_stats(msg.stats)
        elif isinstance(msg, EngineProgress):
            self.progress = msg
            logger.info("engine: %s", msg.message)
        elif isinstance(msg, EngineReady):
            self._tasks.add(task := asyncio.ensure_future(self._become_ready(msg)))
            task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, EngineFailed):
            self._fail(self.classifier(msg.exit_code, msg.error))

    async def _become_ready(self, msg: EngineReady) -> None:
        try:
            backend = load_backend(self.backend)
            self.tokenizer = await asyncio.to_thread(backend.load_tokenizer, msg.tokenizer_source)
        except Exception as exc:
            err = exc if isinstance(exc, FtrsError) else ModelLoadError(msg.model_name, f"tokenizer: {exc}")
            self._fail(err)
            self._send(Shutdown())
            return
        self.info = msg
        if self.state in ("loading", "restarting"):
            self.state = "ready"
            self.restarting = None
            self.ever_ready = True
            logger.debug("engine ready: %s (pid %d)", msg.model_name, msg.pid)
            if self.on_ready is not None:
                self.on_ready(msg)
        self._ready.set()

    def _on_exit(self, exit_code: int | None, last_error: dict[str, Any] | None, gen: int = 0) -> None:
        if self.state in ("stopping", "stopped") or gen != self._generation:
            return  # stopped on request (a service manager signals the engine too)
        err = self.failure or self.classifier(exit_code, last_error)
        said = f"engine process exited with code {exit_code}"
        # an exit without a report is classified by its code alone: its message says just that
        logger.error("%s", err.message if err.message.startswith(said) else f"{said}: {err.message}")
        if self.failure is None:
            self._fail(err)

    def _fail(self, err: FtrsError) -> None:
        """The engine is gone (or never came up). `on_failure` (the policy) runs before the
        requests in flight are told, so they hear `engine_restarted` when it restarts."""
        if self.failure is not None:
            return
        self.failure = err
        self.restarting = None
        if self.state not in ("stopping", "stopped"):  # no restart while stopping
            self.state = "failed"
        streams, self._streams = self._streams, {}
        self._ready.set()
        try:
            if self.on_failure is not None:
                self.on_failure(err)
        finally:  # whatever the policy did, no request in flight is left waiting
            # a device error is what the requests met (a restart on the CPU comes after them)
            told = self.failure or (err if isinstance(err, DeviceError) else None) \
                or self.restarting or err
            for queue in streams.values():
                queue.put_nowait(told)

    def _fail_all(self, err: FtrsError) -> None:
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(err)


def _join(proc: Any, timeout: float) -> None:
    """`proc.join(timeout)`, and a moment more: its sentinel pipe closes as its last thread
    lets go of its files, a moment before it can be reaped (is_alive() is still True then)."""
    proc.join(timeout)
    deadline = time.monotonic() + 1.0
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


__all__ = ["DEFAULT_BACKEND", "Classifier", "EngineClient", "classify_engine_exit"]
