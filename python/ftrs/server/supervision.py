"""Device supervision of the server (issue 5): the engine side and the API side.

Engine side, `EngineSupervisor` (runs in the engine process, wraps every `step()`):
- a flight recorder (`health.flight.FlightLog`, last 512 steps) records every step, and the
  step in progress when one fails or hangs; each step's StepStats carries the monitor's
  latest verdict on the device (`device`: ok, or degraded and why) to the API process;
- a `DeviceMonitor` (health.monitor) watches the device's PCI config space and, through its
  progress watchdog, the step loop (`hang_timeout`): work pending (a step running) and no step
  finished and no decoder layer computed for that long (`EngineCore.progress_at`: a prefill of
  thousands of tokens on a CPU is slow, not hung) → EngineHang;
- a device error from a step is classified by the health classifier with fresh probes
  (`monitor.diagnose`), so the same failure is DeviceLost when config space reads 0xffff and
  KernelFault when the device still answers;
- on a terminal verdict (lost, fault, hang) it writes a crash report to `$FTRS_HOME/crash/`
  with the classification, the evidence and the last steps; the caller reports the typed
  error to the API process and exits with the error's exit code. A verdict found by the
  monitor thread (a hang: the main thread is stuck) is reported and exited from there;
- DeviceOutOfMemory fails only the requests of that step (`EngineCore.fail_requests`, the
  ids from the error's `failed_step` evidence); the engine keeps serving the others.
With `--fault-inject` the monitor watches a fake sysfs tree (engine.faults) and the fault is
injected at the copy backend, so the real detection path runs on a CPU-only host.

A step that raises anything else (an engine bug, an input validation missed) is not fatal:
`step()` re-raises it and the engine process fails that step's requests and goes on
(`engine_process.StepRunner`). A CUDA error torch raises untyped counts as the device's; a
CUDA out-of-memory fails only the step's requests, like DeviceOutOfMemory.

API side, `install_policy(client, server, policy)`: what `ftrs serve` does once the engine
died. Of a device error, per `policy`: `exit`: stop serving (in-flight clients already have
their typed error) and exit with the error's code (86/87/88). `cpu`: restart the engine on
the CPU (`cpu_fallback`) and keep serving; /health then says `"degraded": true`. `restart`: restart on the
same device only when a fresh probe says the device answers; otherwise behave as `exit`. Both
restart through `schedule_restart` like any other restart: the requests in flight keep the
device error they met, and until the new engine is ready /health says "restarting" (the cause,
the restart count) and new requests get 503 `engine_restarted`.
Of anything else, once the engine had served (any exit, kill -9, `--step-fault-limit` failed
steps in a row, a restarted engine that fails to load), or of an exit without a report while
it first loads (not a load error it reported: that would fail again): restart it on the same config after a
backoff, the requests in flight told `engine_restarted`. Every restart, of either kind, takes
one from `RestartBudget` (`--engine-restarts` within `--engine-restart-window` s); with none
left a device error exits with its own code and anything else with `EngineRestarted`'s, 89.
"""

from __future__ import annotations

import asyncio
import dataclasses
import linecache
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftrs.config import EngineConfig, ftrs_home
from ftrs.engine.faults import FAKE_BDF, StepFaults, make_fake_sysfs, parse_fault_spec
from ftrs.engine.protocol import StepStats, TokenEvent
from ftrs.errors import DeviceError, DeviceOutOfMemory, EngineHang, EngineRestarted, FtrsError
from ftrs.guard.live import LiveGuard
from ftrs.server.device_probes import cuda_bdf, cuda_child_probe
from ftrs.server.errors import EngineUnavailable

logger = logging.getLogger(__name__)

Fatal = Callable[[FtrsError], None]


class EngineSupervisor:
    """Wraps the engine's steps in the engine process. `on_fatal(err)` is called (from the
    monitor thread) when the monitor finds a terminal fault the step loop cannot report."""

    def __init__(self, config: EngineConfig, engine: Any, on_fatal: Fatal | None = None) -> None:
        from ftrs.health.flight import FlightLog
        from ftrs.health.monitor import DeviceMonitor, MonitorConfig

        self.config = config
        self.engine = engine
        self.on_fatal = on_fatal
        self.recorder = FlightLog(capacity=512)
        self.step_no = 0
        self._step_started = time.time()  # wall clock, for the report of a step in progress
        self._in_step = False
        self._last_step_end = time.monotonic()
        self._fatal_lock = threading.Lock()
        self._fatal_claimed = False
        self.crash_report: Path | None = None
        self.faults: StepFaults | None = None
        self.sysfs_root: Path | None = None
        bdf: str | None = None
        if config.fault_inject:
            self.sysfs_root = make_fake_sysfs(Path(tempfile.mkdtemp(prefix="ftrs-fake-sysfs-")))
            bdf = FAKE_BDF
            self.faults = StepFaults(parse_fault_spec(config.fault_inject), self.sysfs_root)
        gpu = None if bdf is not None else cuda_bdf(engine)  # a real GPU: watch it, all probes
        mcfg = MonitorConfig(bdf=bdf or gpu, sysfs_root=str(self.sysfs_root or "/sys"),
                             hang_timeout_s=config.hang_timeout,
                             kernel_log="/dev/kmsg" if gpu else None,
                             use_nvml=gpu is not None, fast_interval_s=0.1)
        # The adaptive guard (issue 6): monitor samples in, step budget and pacing out.
        self.live_guard = LiveGuard(engine, config.max_prefill_length,
                                    pacing_gbps=config.pcie_pacing,
                                    relax_after_s=config.guard_relax_after)
        self.monitor = DeviceMonitor(mcfg, on_fault=self._monitor_fault,
                                     on_sample=self.live_guard.on_sample,
                                     child_probe=cuda_child_probe(engine),
                                     has_pending_work=lambda: self._in_step,
                                     last_step_finished_at=self._last_progress)
        self.monitor.start()
        if self.faults is not None:
            self.faults.attach_monitor(self.monitor)  # replay_growth / link_degraded drills

    def _last_progress(self) -> float:
        """The watchdog's last sign of progress: a step's end, or inside a step that runs
        long (a prompt of thousands of tokens on a CPU), its last decoder layer."""
        alive = getattr(self.engine, "progress_at", None)
        return max(self._last_step_end, alive()) if callable(alive) else self._last_step_end

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> tuple[list[TokenEvent], StepStats | None]:
        """One engine step; raises the classified DeviceError (crash report written) when fatal."""
        self.step_no += 1
        n = self.step_no
        self._in_step = True
        self._last_step_end = time.monotonic()  # the watchdog measures from the step's start
        self._step_started = time.time()
        try:
            if self.faults is not None:
                self.faults.before_step(n, self.engine)
            self.live_guard.before_step()
            events, stats = self.engine.step()
            if self.faults is not None:
                self.faults.after_step(n, self.engine, stats)
        except Exception as exc:
            self._in_step = False
            oom = _out_of_memory(exc, self.engine)
            if oom is None and not _device_related(exc):
                self._last_step_end = time.monotonic()
                raise  # not the device's: the engine process fails this step's requests
            if oom is not None:
                self._last_step_end = time.monotonic()
                self.recorder.record_unknown(n)
                return self._fail_requests(oom), None
            raise self.fatal_from(exc) from exc
        except BaseException as exc:
            self._in_step = False
            raise self.fatal_from(exc) from exc
        self._in_step = False
        self._last_step_end = time.monotonic()
        if stats is not None:
            self.recorder.record(n, stats)
            stats.guard = self.live_guard.stats()
            stats.device = self.device_state()
        return events, stats

    def device_state(self) -> dict[str, Any]:
        """The monitor's latest verdict, for the API process (`/health`, ftrs_device_state):
        "degraded" (with the reason) while its samples find the device unhealthy (DeviceUnhealthy:
        a narrowed link, rising AER or replay counters), "ok" again once they do not."""
        s = self.monitor.state
        return {"state": s.state, "reason": s.reason, "bdf": s.bdf}

    def _fail_requests(self, err: DeviceOutOfMemory) -> list[TokenEvent]:
        """Out of memory: fail the requests this step carried, keep the engine serving."""
        from ftrs.server.engine_process import error_to_wire

        fail = getattr(self.engine, "fail_requests", None)
        if fail is None:
            logger.error("out of memory at step %d: this engine cannot fail requests", self.step_no)
            return []
        # EngineCore names the requests of the failed step; an error that does not: all of them
        ids = (err.evidence.get("failed_step") or {}).get("request_ids")
        events: list[TokenEvent] = fail(ids, error_to_wire(err))
        logger.error("out of memory at step %d: failed %d request(s)%s", self.step_no,
                     len(events), "" if ids is not None else " (all: the step's were unknown)")
        return events

    # -- fatal faults -----------------------------------------------------------------------

    def _claim(self) -> bool:
        with self._fatal_lock:
            first, self._fatal_claimed = not self._fatal_claimed, True
            return first

    def classify(self, exc: BaseException) -> FtrsError:
        """The health classifier's verdict on `exc`, evidence of both merged."""
        verdict = self.monitor.diagnose(exc)
        if verdict is None:
            return exc if isinstance(exc, FtrsError) else FtrsError(
                f"engine step failed: {type(exc).__name__}: {exc}")
        extra = dict(getattr(exc, "evidence", {}) or {})
        raised_at = _raised_at(exc)
        if raised_at is not None:
            extra.setdefault("raised_at", raised_at)
        if self.faults is not None:
            extra.update(self.faults.evidence())
        verdict.evidence = {**extra, **verdict.evidence}
        return verdict

    def fatal_from(self, exc: BaseException) -> FtrsError:
        """Classify a step's exception; for a device error write the crash report. When the
        monitor thread already owns the exit, block: it ends the process."""
        if not _device_related(exc) and self.faults is None:
            return exc if isinstance(exc, FtrsError) else FtrsError(
                f"engine step failed: {type(exc).__name__}: {exc}")
        if not self._claim():
            threading.Event().wait(30)  # the monitor thread is exiting the process
        err = self.classify(exc)
        self.write_report(err, in_step=True)
        return err

    def _monitor_fault(self, verdict: DeviceError) -> None:
        """From the monitor thread: a hang, or a loss seen between steps. A loss seen while a
        step runs waits (1 s at most) for that step's own error, which says more."""
        deadline = time.monotonic() + 1.0
        while (self._in_step and not isinstance(verdict, EngineHang)
               and time.monotonic() < deadline):
            time.sleep(0.01)
        if not self._claim():
            return
        if self.faults is not None:
            verdict.evidence = {**self.faults.evidence(), **verdict.evidence}
        self.write_report(verdict, in_step=self._in_step)
        if self.on_fatal is not None:
            self.on_fatal(verdict)

    def write_report(self, err: FtrsError, in_step: bool = False) -> None:
        """The crash report; `in_step`: the fault ended (or hangs) the step in progress, which
        is recorded first (`FlightLog.record_in_progress`)."""
        from ftrs.health.classify import Probes
        from ftrs.health.crash import write_crash_report
        from ftrs.health.sysfs import probe_pci

        probes = None
        if self.sysfs_root is not None:
            probes = Probes(pci=probe_pci(FAKE_BDF, root=self.sysfs_root))
        if in_step:
            self.recorder.record_in_progress(self.step_no, self._step_started, self.engine,
                                             err.evidence)
        try:
            self.crash_report = write_crash_report(ftrs_home(), err, probes=probes,
                                                   flight_recorder=self.recorder.dump())
            err.evidence.setdefault("crash_report", str(self.crash_report))
        except OSError as e:  # the report must never mask the error itself
            logger.error("could not write the crash report: %s", e)

    def close(self) -> None:
        if self.faults is not None:
            self.faults.close()
        self.monitor.stop(1.0)


def _device_related(exc: BaseException) -> bool:
    """A DeviceError, or an untyped error that says CUDA (torch raises CUDA errors as
    RuntimeError): the device policy's. Anything else fails only the step's requests."""
    if isinstance(exc, DeviceError):
        return True
    from ftrs.health.cuda import parse_cuda_error

    return parse_cuda_error(exc).is_cuda


def _out_of_memory(exc: BaseException, engine: Any) -> DeviceOutOfMemory | None:
    """`exc` as DeviceOutOfMemory when it is one (typed, or CUDA's own out-of-memory error,
    then with the failed step's requests from the engine), else None."""
    if isinstance(exc, DeviceOutOfMemory):
        return exc
    if isinstance(exc, DeviceError):
        return None
    from ftrs.health.cuda import parse_cuda_error

    info = parse_cuda_error(exc)
    if not info.is_oom:
        return None
    ids_of = getattr(engine, "step_request_ids", None)
    ids = ids_of() if callable(ids_of) else None
    return DeviceOutOfMemory(f"device out of memory: {info.text}",
                             evidence={"failed_step": {"request_ids": ids}})


def _raised_at(exc: BaseException) -> str | None:
    """The innermost Python frame of `exc` and its line: where the step saw the error (a
    copy's `wait`, a kernel launch), which a sticky CUDA error alone does not say."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    path = code.co_filename
    path = path[path.rfind("ftrs/"):] if "ftrs/" in path else path
    line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
    return f"{path}:{tb.tb_lineno} in {code.co_name}: {line}"


# -------------------------------------------------------------------------------- API side


BACKOFF_FIRST_S = 0.5  # the first restart's delay; doubled per restart in the window
BACKOFF_MAX_S = 8.0


class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds; `take()` claims one."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: list[float] = []

    def take(self, now: float | None = None) -> int | None:
        """Claim a restart: its number within the window (1-based), or None when none is left."""
        now = time.monotonic() if now is None else now
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.limit:
            return None
        self._times.append(now)
        return len(self._times)


def backoff_s(attempt: int) -> float:
    """Delay before restart number `attempt` of the window: 0.5 s, 1 s, 2 s, ... at most 8 s."""
    return float(min(BACKOFF_FIRST_S * 2 ** (attempt - 1), BACKOFF_MAX_S))


def install_policy(client: Any, server: Any, policy: str, grace_s: float = 1.0) -> None:
    """Chain onto `client.on_failure`: act on a device error per `policy` (exit|restart|cpu),
    restart the engine after any other death of an engine that had served, both within the
    restart budget of `client.config`.

    `server` is the uvicorn.Server; an exit sets `server.should_exit` after `grace_s`, so the
    clients in flight receive their typed errors first.
    """
    previous = client.on_failure
    config = client.config
    budget = RestartBudget(getattr(config, "engine_restarts", 3),
                           getattr(config, "engine_restart_window", 600.0))

    def on_failure(err: FtrsError) -> None:
        if previous is not None:
            previous(err)
        if getattr(client, "state", None) in ("stopping", "stopped"):
            return  # stopped on request: no restart, the exit code stays the stop's
        if not isinstance(err, DeviceError):
            # A load that failed with a report fails the same way again: /health says why.
            # A process that vanished mid-load (the OOM killer) is worth another try.
            served = getattr(client, "ever_ready", False)
            if getattr(client, "state", None) == "failed" and (
                    served or isinstance(err, EngineUnavailable)):
                _restart_or_exit(client, server, budget, err, grace_s)
            return
        loop = asyncio.get_running_loop()
        action = policy
        if action == "restart" and not _device_answers(client.config):
            logger.error("on-device-lost restart: the device does not answer; exiting")
            action = "exit"
        attempt = budget.take() if action != "exit" else None
        if action != "exit" and attempt is None:
            logger.error("on-device-lost %s: %d restarts within %.0f s already; exiting", action,
                         budget.limit, budget.window_s)
            action = "exit"
        if action == "exit" or attempt is None:
            logger.error("ftrs serve: %s (%s); exiting with code %d", err.message, err.code,
                         err.exit_code)
            loop.call_later(grace_s, _stop, server)
            return
        config = client.config
        if action == "cpu":
            config = cpu_fallback(config)
        else:
            config = dataclasses.replace(config, fault_inject=None)
        delay = backoff_s(attempt)
        told = EngineRestarted(
            f"the device failed ({type(err).__name__}: {err.message}); restarting the engine on "
            f"{config.device} (restart {attempt} of at most {budget.limit} within "
            f"{budget.window_s:g} s)", evidence={"cause": _cause(err), "attempt": attempt,
                                                 "limit": budget.limit, "mode": action})
        logger.warning("on-device-lost %s: restarting the engine on %s in %.1f s", action,
                       config.device, delay)
        client.schedule_restart(told, delay, config=config, degraded={
            "reason": err.message, "code": err.code, "classification": type(err).__name__,
            "mode": action, "device": config.device})

    client.on_failure = on_failure


def cpu_fallback(config: EngineConfig) -> EngineConfig:
    """The config `--on-device-lost cpu` restarts with: the CPU device, no drill, and the
    `resident` strategy for a MoE: every expert is computed where the host pool holds it, in the
    checkpoint's own encoding (a quantized file's experts and projections stay quantized and run
    on the Rust kernels; `models.load`), with no slot cache or copy beside it (offload would copy
    host memory into host memory; hybrid on a CPU device computes as resident does). `dtype`
    stays as given ("auto" resolves to float32 on the CPU)."""
    return dataclasses.replace(config, device="cpu", fault_inject=None, moe_strategy="resident",
                               copy_backend="auto")


def _restart_or_exit(client: Any, server: Any, budget: RestartBudget, err: FtrsError,
                     grace_s: float) -> None:
    """The engine died of something not the device's: restart it after a backoff, or, with
    no restart left, exit 89 (`EngineRestarted`) so a service manager starts a fresh server."""
    cause = _cause(err)
    attempt = budget.take()
    if attempt is None:
        final = EngineRestarted(
            f"the engine failed ({type(err).__name__}: {err.message}) after {budget.limit} "
            f"restart(s) within {budget.window_s:g} s (--engine-restarts); the server exits",
            evidence={"cause": cause, "restarts": budget.limit})
        logger.error("ftrs serve: %s; exiting with code %d", final.message, final.exit_code)
        client.give_up(final)
        asyncio.get_running_loop().call_later(grace_s, _stop, server)
        return
    delay = backoff_s(attempt)
    told = EngineRestarted(
        f"the engine failed ({type(err).__name__}: {err.message}); restarting it "
        f"(restart {attempt} of at most {budget.limit} within {budget.window_s:g} s)",
        evidence={"cause": cause, "attempt": attempt, "limit": budget.limit})
    logger.error("engine failed: %s; restarting it in %.1f s (restart %d of at most %d)",
                 err.message, delay, attempt, budget.limit)
    client.schedule_restart(told, delay)


def _cause(err: FtrsError) -> dict[str, Any]:
    return {"type": type(err).__name__, "message": err.message, "code": err.code}


def _stop(server: Any) -> None:
    server.should_exit = True


def _device_answers(config: EngineConfig) -> bool:
    """Restart only when a fresh probe says the device is back (a fault drill never is)."""
    if config.fault_inject is not None:
        return False
    if not config.device.startswith(("cuda", "auto")):
        return True
    from ftrs.health.result import Status
    from ftrs.health.sysfs import discover_nvidia_gpus, probe_pci

    gpus = discover_nvidia_gpus()
    return bool(gpus) and probe_pci(gpus[0]).status in (Status.OK, Status.DEGRADED)


def exit_code_for(client: Any) -> int | None:
    """The code `ftrs serve` exits with: the failure's, unless the engine was restarted."""
    failure = getattr(client, "failure", None)
    return None if failure is None else int(failure.exit_code)


__all__ = ["EngineSupervisor", "RestartBudget", "backoff_s", "cuda_bdf", "exit_code_for",
           "install_policy"]
