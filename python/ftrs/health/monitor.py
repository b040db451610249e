"""Device monitor: a thread that watches one GPU and the engine's progress.

Every `fast_interval_s` (0.2 s) it reads the PCI vendor id (two bytes of config space); every
`slow_interval_s` (2 s) a richer sample: link, AER, NVML power / temperature / replay / Xid
events. Each slow sample becomes a `DeviceState` for `on_sample` (metrics, flight recorder).
When a probe says lost, or the watchdog sees a stall, it gathers the rest of the evidence
(NVML, kernel log, optional child probe), classifies, and calls `on_fault` exactly once; the
thread then ends. `probe_seconds_total` is the time spent probing, so its cost is visible.

Run it where it outlives the engine (the API process); feed `last_step_finished_at` from the
engine's step records. `diagnose(error)` serves the engine's own CUDA exceptions through the
same path and the same once-only `on_fault`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftrs.errors import DeviceError, DeviceOutOfMemory, DeviceUnhealthy
from ftrs.health.classify import Probes, classify
from ftrs.health.inject import FaultInjector
from ftrs.health.kmsg import probe_kernel_log
from ftrs.health.nvml import NvmlApi, NvmlProbe
from ftrs.health.result import ProbeResult, Status, not_applicable
from ftrs.health.state import DeviceState, build_state
from ftrs.health.sysfs import PciResult, probe_pci
from ftrs.health.watchdog import Watchdog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MonitorConfig:
    """`bdf` None: no GPU to watch (CPU device); only the watchdog runs."""

    bdf: str | None
    sysfs_root: str = "/sys"
    fast_interval_s: float = 0.2
    slow_interval_s: float = 2.0
    hang_timeout_s: float = 120.0
    #: Read on suspicion only; a path, "dmesg", fixed lines (tests), or None to skip.
    kernel_log: str | Sequence[str] | None = "/dev/kmsg"
    use_nvml: bool = True


class DeviceMonitor:
    def __init__(
        self, config: MonitorConfig, *, nvml: NvmlApi | None = None,
        on_sample: Callable[[DeviceState], None] | None = None,
        on_fault: Callable[[DeviceError], None] | None = None,
        has_pending_work: Callable[[], bool] | None = None,
        last_step_finished_at: Callable[[], float] | None = None,
        child_probe: Callable[[], ProbeResult] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.injector = FaultInjector()
        self._nvml = NvmlProbe(config.bdf, nvml=nvml) if config.bdf and config.use_nvml else None
        self._on_sample = on_sample
        self._on_fault = on_fault
        self._child_probe = child_probe
        self._clock = clock
        self._pending = has_pending_work
        self._watchdog = (Watchdog(has_pending_work, last_step_finished_at, config.hang_timeout_s,
                                   clock=clock)
                          if has_pending_work is not None and last_step_finished_at is not None
                          else None)
        self._lock = threading.Lock()  # guards _state and _fault
        self._probe_lock = threading.RLock()  # one probe round at a time (NVML handle, baseline)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fault: DeviceError | None = None
        self._baseline: Probes | None = None
        self._next_slow = 0.0
        self._seen = False  # the device answered once, so a vanished directory means loss
        self.probe_seconds_total = 0.0
        self.fast_samples = 0
        self.slow_samples = 0
        self.last_unhealthy: DeviceUnhealthy | None = None
        self._state = DeviceState(up=True, state="not_applicable" if not config.bdf else "ok",
                                  bdf=config.bdf)

    # -- public surface ----------------------------------------------------------------------

    @property
    def state(self) -> DeviceState:
        with self._lock:
            return self._state

    @property
    def fault(self) -> DeviceError | None:
        with self._lock:
            return self._fault

    def inject(self, fault: str) -> None:
        """Drill: "device_lost", "link_degraded" or "replay_growth" (see health.inject)."""
        self.injector.inject(fault)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("DeviceMonitor already started")
        self._thread = threading.Thread(target=self._run, name="ftrs-device-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it; safe to call twice or before start."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._nvml is not None:
            self._nvml.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def tick(self) -> DeviceError | None:
        """One iteration (the thread calls this; tests and drills may too). The fault, if any."""
        if self.fault is not None:
            return self.fault
        with self._probe_lock:
            started = time.perf_counter()
            try:
                verdict = self._tick()
            finally:
                self.probe_seconds_total += time.perf_counter() - started
        if isinstance(verdict, (DeviceOutOfMemory, DeviceUnhealthy)):
            return None  # not terminal: the slow sample publishes degradation as state
        return self._report(verdict)

    def diagnose(self, error: BaseException | str | int | None) -> DeviceError | None:
        """Classify an error the engine saw, with every probe taken now. A terminal verdict
        (lost, fault, hang) goes to `on_fault` unless one was already reported."""
        with self._probe_lock:
            started = time.perf_counter()
            try:
                verdict = classify(error, self._full_probes(), baseline=self._baseline)
            finally:
                self.probe_seconds_total += time.perf_counter() - started
        if verdict is not None and not isinstance(verdict, (DeviceOutOfMemory, DeviceUnhealthy)):
            self._report(verdict)
        return verdict

    # -- internals ---------------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("device monitor started for %s", self.config.bdf or "no GPU")
        while not self._stop.is_set():
            try:
                if self.tick() is not None:
                    break
            except Exception:  # a probe bug must not kill supervision silently
                logger.exception("device monitor iteration failed")
            self._stop.wait(self.config.fast_interval_s)
        logger.info("device monitor stopped")

    def _busy(self) -> bool:
        return bool(self._pending()) if self._pending is not None else False

    def _pci(self, detail: bool) -> ProbeResult:
        bdf = self.config.bdf
        if bdf is None:
            return not_applicable("pci", "no GPU to watch")
        busy = self._busy()
        result = probe_pci(bdf, root=self.config.sysfs_root, detail=detail,
                           was_present=self._seen, busy=busy)
        if isinstance(result, PciResult) and result.vendor is not None:
            self._seen = True
        return self.injector.apply_pci(result, busy=busy)

    def _nvml_sample(self) -> ProbeResult | None:
        if self._nvml is None:
            return None
        return self.injector.apply_nvml(self._nvml.sample())

    def _tick(self) -> DeviceError | None:
        now = self._clock()
        if self.config.bdf is not None:
            if self._pci(detail=False).status is Status.LOST:
                return classify(None, self._full_probes())
            self.fast_samples += 1
            if now >= self._next_slow:
                self._next_slow = now + self.config.slow_interval_s
                verdict = self._slow_sample()
                if verdict is not None:
                    return verdict
        if self._watchdog is not None:
            hang = self._watchdog.check()
            if hang is not None:
                return classify(hang, self._full_probes())
        return None

    def _slow_sample(self) -> DeviceError | None:
        probes = Probes(pci=self._pci(detail=True), nvml=self._nvml_sample())
        self.slow_samples += 1
        if any(p.status is Status.LOST for p in probes.present()):
            return classify(None, self._with_extras(probes))
        verdict = classify(None, probes, baseline=self._baseline)
        self._baseline = probes
        state, reason = "ok", ""
        if isinstance(verdict, DeviceUnhealthy):
            if self.last_unhealthy is None:
                logger.warning("device degraded: %s", verdict.message)
            self.last_unhealthy = verdict
            state, reason = "degraded", verdict.message
        elif probes.pci is not None and probes.pci.status is Status.NOT_APPLICABLE:
            state, reason = "not_applicable", probes.pci.reason
        self._publish(build_state(self.config.bdf, probes.pci, probes.nvml, state=state,
                                  reason=reason, sample_time=time.time()))
        return None

    def _full_probes(self) -> Probes:
        return self._with_extras(Probes(pci=self._pci(detail=True), nvml=self._nvml_sample()))

    def _with_extras(self, probes: Probes) -> Probes:
        """Add the kernel log, and the child probe when nothing else shows a loss."""
        klog = None
        if self.config.bdf is not None and self.config.kernel_log is not None:
            klog = probe_kernel_log(self.config.bdf, source=self.config.kernel_log)
        child = None
        lost = any(p.status is Status.LOST for p in (probes.pci, probes.nvml, klog) if p)
        if self._child_probe is not None and not lost:
            child = self._child_probe()
        return Probes(pci=probes.pci, nvml=probes.nvml, kernel_log=klog, child=child)

    def _publish(self, state: DeviceState) -> None:
        with self._lock:
            if self._fault is None:
                self._state = state
        if self._on_sample is not None:
            self._on_sample(state)

    def _report(self, verdict: DeviceError | None) -> DeviceError | None:
        if verdict is None:
            return None
        with self._lock:
            if self._fault is not None:
                return self._fault
            self._fault = verdict
            state = {"DeviceLost": "lost", "EngineHang": "hang"}.get(type(verdict).__name__)
            if state is not None:
                self._state = dataclasses.replace(self._state, up=state != "lost", state=state,
                                                  reason=verdict.message,
                                                  last_sample_time=time.time())
            final = self._state
        logger.error("device fault: %s: %s", type(verdict).__name__, verdict.message)
        if self._on_sample is not None:
            self._on_sample(final)
        if self._on_fault is not None:
            self._on_fault(verdict)
        return verdict
