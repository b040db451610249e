"""Device health: probes, classifier, monitor and crash reports (DESIGN.md "Errors").

Pure Python; imports neither torch nor NVML nor `ftrs._core` at import time. Every probe takes
a root path or a handle, returns a typed result with a `Status`, and never raises on missing
hardware. See `classify` for how a failure becomes DeviceLost / KernelFault / ... and
`DeviceMonitor` for the supervising thread.
"""

from __future__ import annotations

from ftrs.health.child import ChildResult, probe_child
from ftrs.health.classify import Probes, classify
from ftrs.health.crash import (
    CrashReport,
    list_crash_reports,
    load_crash_report,
    write_crash_report,
)
from ftrs.health.cuda import CudaResult, parse_cuda_error, probe_cuda_event
from ftrs.health.inject import FAULTS, FaultInjector
from ftrs.health.kmsg import KernelLogResult, probe_kernel_log
from ftrs.health.monitor import DeviceMonitor, MonitorConfig
from ftrs.health.nvml import NvmlProbe, NvmlResult
from ftrs.health.result import ProbeResult, Status
from ftrs.health.state import DeviceState
from ftrs.health.sysfs import PciResult, discover_nvidia_gpus, normalize_bdf, probe_pci
from ftrs.health.watchdog import Watchdog

__all__ = [
    "FAULTS",
    "ChildResult",
    "CrashReport",
    "CudaResult",
    "DeviceMonitor",
    "DeviceState",
    "FaultInjector",
    "KernelLogResult",
    "MonitorConfig",
    "NvmlProbe",
    "NvmlResult",
    "PciResult",
    "ProbeResult",
    "Probes",
    "Status",
    "Watchdog",
    "classify",
    "discover_nvidia_gpus",
    "list_crash_reports",
    "load_crash_report",
    "normalize_bdf",
    "parse_cuda_error",
    "probe_child",
    "probe_cuda_event",
    "probe_kernel_log",
    "probe_pci",
    "write_crash_report",
]
