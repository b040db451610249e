"""Device supervision of the server (issue 5), the engine side; the API side, what `ftrs serve`
does once the engine died, is `server.restart_policy`.

`EngineSupervisor` (runs in the engine process, wraps every `step()`):
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
"""

from __future__ import annotations

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
from ftrs.errors import DeviceError, DeviceOutOfMemory, EngineHang, FtrsError
from ftrs.guard.live import LiveGuard
from ftrs.server.device_probes import cuda_bdf, cuda_child_probe

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


__all__ = ["EngineSupervisor", "cuda_bdf"]
