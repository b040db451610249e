"""NVML probe: GPU_IS_LOST, critical Xid events, power, temperature, clocks, PCIe counters.

NVML comes from `nvidia-ml-py` (module `pynvml`), imported lazily on first use. The probe
talks to an object with pynvml's function names (`NvmlApi`), so tests pass a fake one and the
real module is used unchanged in production. Errors are read from the exception's `.value`
(the NVML return code), as pynvml raises them.

Never raises: no module, no driver or no such device → `not_applicable`; any query answering
NVML_ERROR_GPU_IS_LOST, or a critical Xid 79 event → `lost`; a field the board does not
support is None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftrs.health.result import ProbeResult, Status
from ftrs.health.sysfs import normalize_bdf

logger = logging.getLogger(__name__)

ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
EVENT_XID_CRITICAL = 0x8
XID_FALLEN_OFF_BUS = 79
_UNAVAILABLE = {ERROR_DRIVER_NOT_LOADED, ERROR_LIBRARY_NOT_FOUND, ERROR_FUNCTION_NOT_FOUND,
                ERROR_NO_PERMISSION, ERROR_NOT_FOUND}
#: Clock event reason bits that mean hardware is holding the GPU back (not idle or app caps).
_HW_REASONS = {0x8: "hw_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}
_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap",
            0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x100: "display_clocks",
            **_HW_REASONS}
_MAX_EVENTS_PER_SAMPLE = 16


class NvmlApi(Protocol):
    """The subset of `pynvml` this probe calls. Errors carry the NVML code in `.value`."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetHandleByPciBusId(self, pci_bus_id: str) -> Any: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int: ...
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int: ...
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any: ...


def nvml_code(exc: BaseException) -> int | None:
    """The NVML return code an exception carries (pynvml's NVMLError.value), if any."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def decode_clock_reasons(mask: int) -> list[str]:
    return [name for bit, name in sorted(_REASONS.items()) if mask & bit]


@dataclass(frozen=True, kw_only=True)
class NvmlResult(ProbeResult):
    """Result of one NVML sample. None for fields not read or not supported."""

    bdf: str
    power_w: float | None = None
    temperature_c: int | None = None
    clock_event_reasons: int | None = None
    pcie_replay: int | None = None
    link_gen_current: int | None = None
    link_gen_max: int | None = None
    link_width_current: int | None = None
    link_width_max: int | None = None
    #: Critical Xid numbers received since the previous sample, oldest first.
    xids: tuple[int, ...] = ()
    #: Queries that failed with an unexpected NVML error: name → message.
    errors: dict[str, str] = field(default_factory=dict)


class _Lost(Exception):
    def __init__(self, query: str) -> None:
        super().__init__(query)
        self.query = query


class NvmlProbe:
    """A handle on one GPU through NVML; keeps its event set between samples.

    Not thread-safe: one monitor thread owns it.
    """

    def __init__(self, bdf: str, *, nvml: NvmlApi | None = None) -> None:
        self.bdf = normalize_bdf(bdf)
        self._nvml = nvml
        self._handle: Any = None
        self._events: Any = None
        self._events_unsupported = ""
        self._unavailable = ""

    def _start(self) -> NvmlResult | None:
        """Load, init and find the device; a result when that fails, else None."""
        if self._unavailable:
            return self._na(self._unavailable)
        if self._nvml is None:
            try:
                import pynvml  # lazily: the package must import without NVML
            except ImportError as e:
                self._unavailable = f"nvidia-ml-py (pynvml) not installed: {e}"
                return self._na(self._unavailable)
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
            self._handle = self._nvml.nvmlDeviceGetHandleByPciBusId(self.bdf)
        except Exception as e:
            code = nvml_code(e)
            if code == ERROR_GPU_IS_LOST:
                return self._lost("nvmlDeviceGetHandleByPciBusId", {})
            if code in _UNAVAILABLE or code is None:
                self._unavailable = f"NVML unavailable: {e} (code {code})"
                return self._na(self._unavailable)
            return NvmlResult(probe="nvml", status=Status.ERROR, bdf=self.bdf,
                              reason=f"NVML init failed: {e}", evidence={"nvml_code": code})
        return None

    def _na(self, reason: str) -> NvmlResult:
        return NvmlResult(probe="nvml", status=Status.NOT_APPLICABLE, bdf=self.bdf, reason=reason)

    def _lost(self, query: str, fields: dict[str, Any]) -> NvmlResult:
        return nvml_lost(self.bdf, query, fields)

    def sample(self, *, xid_timeout_ms: int = 0) -> NvmlResult:
        """Read every field once and drain pending Xid events (waiting up to the timeout)."""
        if self._handle is None:
            failed = self._start()
            if failed is not None:
                return failed
        fields: dict[str, Any] = {}
        errors: dict[str, str] = {}
        api, h = self._nvml, self._handle
        assert api is not None  # set by _start
        reasons_fn = getattr(api, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            api, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        queries: list[tuple[str, Any]] = [
            ("power_w", lambda: api.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("temperature_c", lambda: api.nvmlDeviceGetTemperature(h, 0)),
            ("pcie_replay", lambda: api.nvmlDeviceGetPcieReplayCounter(h)),
            ("link_gen_current", lambda: api.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            ("link_gen_max", lambda: api.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            ("link_width_current", lambda: api.nvmlDeviceGetCurrPcieLinkWidth(h)),
            ("link_width_max", lambda: api.nvmlDeviceGetMaxPcieLinkWidth(h)),
        ]
        if reasons_fn is not None:
            queries.append(("clock_event_reasons", lambda: reasons_fn(h)))
        try:
            for name, query in queries:
                fields[name] = self._query(name, query, errors)
            xids = self._drain_xids(xid_timeout_ms, errors)
        except _Lost as lost:
            return self._lost(lost.query, fields)
        return judge_nvml(self.bdf, fields, xids, errors)

    def _query(self, name: str, query: Any, errors: dict[str, str]) -> Any:
        try:
            return query()
        except Exception as e:
            code = nvml_code(e)
            if code == ERROR_GPU_IS_LOST:
                raise _Lost(name) from e
            if code != ERROR_NOT_SUPPORTED:
                errors[name] = f"{e} (code {code})"
            return None

    def _drain_xids(self, timeout_ms: int, errors: dict[str, str]) -> tuple[int, ...]:
        api = self._nvml
        assert api is not None
        if self._events is None and not self._events_unsupported:
            try:
                events = api.nvmlEventSetCreate()
                api.nvmlDeviceRegisterEvents(self._handle, EVENT_XID_CRITICAL, events)
                self._events = events
            except Exception as e:
                if nvml_code(e) == ERROR_GPU_IS_LOST:
                    raise _Lost("nvmlDeviceRegisterEvents") from e
                self._events_unsupported = f"Xid events unavailable: {e}"
                logger.info("NVML %s: %s", self.bdf, self._events_unsupported)
        if self._events is None:
            return ()
        xids: list[int] = []
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                data = api.nvmlEventSetWait_v2(self._events, timeout_ms if not xids else 0)
            except Exception as e:
                code = nvml_code(e)
                if code == ERROR_GPU_IS_LOST:
                    raise _Lost("nvmlEventSetWait_v2") from e
                if code != ERROR_TIMEOUT:
                    errors["xid_events"] = f"{e} (code {code})"
                break
            if int(data.eventType) & EVENT_XID_CRITICAL:
                xids.append(int(data.eventData))
        return tuple(xids)

    def close(self) -> None:
        """Free the event set; safe to call more than once, never raises."""
        if self._events is not None and self._nvml is not None:
            try:
                getattr(self._nvml, "nvmlEventSetFree", lambda _s: None)(self._events)
            except Exception as e:
                logger.debug("nvmlEventSetFree failed: %s", e)
        self._events = None


def nvml_lost(bdf: str, query: str, fields: dict[str, Any] | None = None) -> NvmlResult:
    return NvmlResult(probe="nvml", status=Status.LOST, bdf=bdf,
                      reason=f"NVML answered GPU_IS_LOST to {query}",
                      evidence={"nvml": "GPU_IS_LOST", "query": query}, **(fields or {}))


def judge_nvml(bdf: str, fields: dict[str, Any], xids: tuple[int, ...] = (),
               errors: dict[str, str] | None = None) -> NvmlResult:
    """The verdict on raw NVML readings (also used by fault injection)."""
    errors = errors or {}
    evidence: dict[str, Any] = {}
    if xids:
        evidence["xids"] = list(xids)
    if XID_FALLEN_OFF_BUS in xids:
        return NvmlResult(probe="nvml", status=Status.LOST, bdf=bdf, xids=xids,
                          errors=errors, reason="NVML reported critical Xid 79 "
                          "(GPU has fallen off the bus)", evidence={**evidence, "xid": 79},
                          **fields)
    status, why = Status.OK, []
    cur, top = fields.get("link_width_current"), fields.get("link_width_max")
    if cur is not None and top is not None and cur < top:
        why.append(f"PCIe link width x{cur} below max x{top}")
    reasons = fields.get("clock_event_reasons")
    if reasons is not None:
        evidence["clock_event_reasons"] = decode_clock_reasons(reasons)
        hw = [name for bit, name in _HW_REASONS.items() if reasons & bit]
        if hw:
            why.append("clocks held down by hardware: " + ", ".join(hw))
    if why:
        status = Status.DEGRADED
    return NvmlResult(probe="nvml", status=status, bdf=bdf, reason="; ".join(why),
                      xids=xids, errors=errors, evidence=evidence, **fields)
