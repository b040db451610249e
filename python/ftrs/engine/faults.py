"""Fault injection for drills and tests: `--fault-inject KIND@step=N` (issue 5), and for the
link-stress kinds also `KIND@after=Ts` (issue 6).

KIND is `device_lost`, `kernel_fault`, `oom` or `hang` (step faults), or `replay_growth` or
`link_degraded` (link stress, seen by the device monitor); N is the engine step (1-based, the
count of `step()` calls) at which the fault fires; with `KIND@step=N,running=R`, N counts
from the first step at which the engine holds >= R requests; T (seconds, the `s` optional) is
the time after the engine is up (`device_lost@after=Ts`: the device leaves the bus while the
engine idles, and only the monitor thread can see it). The fault is injected as low as the
CPU allows, so the real detection path runs:

- `device_lost` / `kernel_fault`: with the offload strategy, at the copy backend
  (`TransferEngine.inject_fault(kind, 0)`: the next expert copy fails with the typed error);
  without it, or when the step made no copy, the step raises the error class itself with
  evidence `{"injected": true, ...}` and, as a real device error has, the step's `failed_step`
  (its requests and tokens). For `device_lost` the fake sysfs tree the monitor watches
  (`fake_sysfs`) then reads vendor 0xffff, so the health classifier decides DeviceLost from
  PCI config space; for `kernel_fault` the device keeps answering 0x10de, so it decides
  KernelFault.
- `oom`: at the copy backend too (without it, the step raises DeviceOutOfMemory before it
  runs); the supervisor fails the requests the failed step carried (`EngineCore` names them
  in the error's `failed_step` evidence) and the engine keeps serving the others.
- `hang`: the step blocks forever; the progress watchdog (`--hang-timeout`) fires EngineHang.
- `replay_growth` / `link_degraded`: the monitor's fault injector (`health.inject`) rewrites
  its readings of the fake sysfs tree from then on: the AER correctable total grows on every
  sample, or the link reads Gen1 at half its width. Not fatal: the device is judged degraded,
  and the adaptive guard (`guard.live`) shrinks the prefill chunk and turns pacing on.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrs.errors import ConfigError, DeviceError, DeviceLost, DeviceOutOfMemory, KernelFault

logger = logging.getLogger(__name__)

STEP_KINDS = ("device_lost", "kernel_fault", "oom", "hang")
MONITOR_KINDS = ("replay_growth", "link_degraded")
KINDS = STEP_KINDS + MONITOR_KINDS
AFTER_KINDS = (*MONITOR_KINDS, "device_lost")  # device_lost@after=Ts: lost while idle
FAKE_BDF = "0000:01:00.0"
NVIDIA_VENDOR = 0x10DE
VENDOR_GONE = 0xFFFF
_SPEC_RE = re.compile(r"^\s*([a-z_]+)\s*@\s*step\s*=\s*(\d+)(?:\s*,\s*running\s*=\s*(\d+))?\s*$")
_AFTER_RE = re.compile(r"^\s*([a-z_]+)\s*@\s*after\s*=\s*(\d+(?:\.\d*)?|\.\d+)\s*s?\s*$")


@dataclass(frozen=True)
class FaultSpec:
    """`step` (1-based) or, for the monitor kinds, `after_s` says when the fault fires."""

    kind: str
    step: int = 0
    after_s: float | None = None
    #: `KIND@step=N,running=R`: N counts the steps from the first one at which the engine
    #: holds >= R requests (a drill with many clients fires once they are all in flight).
    running: int = 0

    @property
    def monitor(self) -> bool:
        """A link-stress fault the device monitor sees (not one a step raises)."""
        return self.kind in MONITOR_KINDS

    def __str__(self) -> str:
        if self.after_s is not None:
            return f"{self.kind}@after={self.after_s:g}s"
        return f"{self.kind}@step={self.step}" + (f",running={self.running}" if self.running else "")


def parse_fault_spec(text: str) -> FaultSpec:
    """"device_lost@step=40" → FaultSpec("device_lost", 40); "replay_growth@after=1s" →
    FaultSpec("replay_growth", after_s=1.0); ConfigError when malformed."""
    m = _SPEC_RE.match(text)
    if m is not None and m.group(1) in KINDS and int(m.group(2)) >= 1:
        return FaultSpec(m.group(1), int(m.group(2)), running=int(m.group(3) or 0))
    m = _AFTER_RE.match(text)
    if m is not None and m.group(1) in AFTER_KINDS:
        return FaultSpec(m.group(1), after_s=float(m.group(2)))
    raise ConfigError(f"fault_inject: expected KIND@step=N with KIND one of {', '.join(KINDS)} "
                      f"and N >= 1 (optionally ,running=R), or KIND@after=Ts with KIND one of "
                      f"{', '.join(AFTER_KINDS)}; got {text!r}")


def make_fake_sysfs(root: Path, bdf: str = FAKE_BDF) -> Path:
    """A minimal sysfs tree with one healthy NVIDIA GPU at `bdf` (config space vendor 0x10de)."""
    dev = root / "devices" / "pci0000:00" / bdf
    dev.mkdir(parents=True, exist_ok=True)
    config = bytearray(64)
    config[0:2] = NVIDIA_VENDOR.to_bytes(2, "little")
    config[9:12] = (0x030000).to_bytes(3, "little")
    (dev / "config").write_bytes(bytes(config))
    (dev / "vendor").write_text(f"0x{NVIDIA_VENDOR:04x}\n")
    (dev / "class").write_text("0x030000\n")
    # A healthy Gen4 x16 link and zero AER totals, for the link-stress kinds to rewrite.
    for name, value in (("current_link_speed", "16.0 GT/s PCIe"),
                        ("max_link_speed", "16.0 GT/s PCIe"),
                        ("current_link_width", "16"), ("max_link_width", "16"),
                        ("aer_dev_correctable", "RxErr 0\nTOTAL_ERR_COR 0"),
                        ("aer_dev_nonfatal", "TLP 0\nTOTAL_ERR_NONFATAL 0"),
                        ("aer_dev_fatal", "DLP 0\nTOTAL_ERR_FATAL 0")):
        (dev / name).write_text(value + "\n")
    link = root / "bus" / "pci" / "devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(dev)
    return root


def set_fake_vendor(root: Path, vendor: int, bdf: str = FAKE_BDF) -> None:
    """What the hardware does when it leaves the bus: config space reads all ones."""
    path = root / "bus" / "pci" / "devices" / bdf / "config"
    config = bytearray(path.read_bytes())
    config[0:2] = vendor.to_bytes(2, "little")
    path.write_bytes(bytes(config))


def copy_engine(engine: Any) -> Any:
    """The offload strategy's TransferEngine (`EngineCore.transfer_engine()`), or None
    (resident strategy, an engine without one)."""
    get = getattr(engine, "transfer_engine", None)
    eng = get() if callable(get) else None
    return eng if eng is not None and hasattr(eng, "inject_fault") else None


class StepFaults:
    """Fires one `FaultSpec` around the engine's steps; `sysfs_root` is the fake tree."""

    def __init__(self, spec: FaultSpec, sysfs_root: Path | None = None) -> None:
        self.spec = spec
        self.sysfs_root = sysfs_root
        self.fired = False
        self._armed_copy = False
        self._fired_at = 0
        self._counted = 0  # steps since the engine first held `spec.running` requests
        self._block = threading.Event()
        self._monitor: Any = None
        self._timer: threading.Timer | None = None

    def attach_monitor(self, monitor: Any) -> None:
        """The device monitor (its `inject(kind)`) the link-stress kinds go to; with
        `after_s` the timer starts now."""
        self._monitor = monitor
        if self.spec.after_s is not None:
            self._timer = threading.Timer(self.spec.after_s, self._fire_monitor)
            self._timer.daemon = True
            self._timer.start()

    def _fire_monitor(self) -> None:
        if self.fired or self._monitor is None:
            return
        self.fired = True
        logger.warning("fault injection: %s (%s)", self.spec.kind, self.spec)
        if self.spec.kind == "device_lost":  # off the bus between steps: the monitor sees it
            if self.sysfs_root is not None:
                set_fake_vendor(self.sysfs_root, VENDOR_GONE)
            return
        self._monitor.inject(self.spec.kind)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def evidence(self, **extra: Any) -> dict[str, Any]:
        return {"injected": True, "fault_inject": str(self.spec), **extra}

    def before_step(self, step: int, engine: Any) -> None:
        if self.fired or self.spec.after_s is not None:
            return
        if self._counted or not self.spec.running or _num_requests(engine) >= self.spec.running:
            self._counted += 1
        if self._counted < self.spec.step:
            return
        if self.spec.monitor:
            self._fire_monitor()
            return
        self.fired = True
        self._fired_at = step
        kind = self.spec.kind
        logger.warning("fault injection: %s at step %d", kind, step)
        if kind == "hang":
            self._block.wait()  # never set: the watchdog ends the process
            return
        if kind == "device_lost" and self.sysfs_root is not None:
            set_fake_vendor(self.sysfs_root, VENDOR_GONE)
        copier = copy_engine(engine)
        if copier is not None:  # the step's next expert copy fails, raised from its wait
            copier.inject_fault(kind, 0)
            self._armed_copy = True
        elif kind == "oom":
            raise DeviceOutOfMemory(f"device out of memory (injected at step {step})",
                                    evidence=self.evidence(step=step))

    def after_step(self, step: int, engine: Any = None, stats: Any = None) -> None:
        """The step ran without a copy failing (no copy, or no offload): raise the class, with
        the `failed_step` evidence `EngineCore.step` gives a real device error (the step's
        requests from `engine.step_request_ids()`, its tokens from `stats`)."""
        if not self.fired or step != self._fired_at or self.spec.kind not in ("device_lost",
                                                                               "kernel_fault"):
            return
        cls: type[DeviceError] = DeviceLost if self.spec.kind == "device_lost" else KernelFault
        evidence = self.evidence(step=step, layer="step", copy_backend_armed=self._armed_copy)
        failed = failed_step(engine, stats)
        if failed is not None:
            evidence["failed_step"] = failed
        raise cls(f"{self.spec.kind} (injected at step {step})", evidence=evidence)


def failed_step(engine: Any, stats: Any) -> dict[str, Any] | None:
    """What a step carried, as `EngineCore.step` names it when a device error stops it: the
    engine's step number and requests, the step's prefill and decode tokens; None when the
    engine cannot say (no `step_request_ids`, or no stats)."""
    ids_of = getattr(engine, "step_request_ids", None)
    ids = ids_of() if callable(ids_of) else None
    if ids is None or stats is None:
        return None
    return {"step": stats.step, "request_ids": list(ids), "prefill_tokens": stats.prefill_tokens,
            "decode_tokens": stats.decode_tokens}


def _num_requests(engine: Any) -> int:
    """Requests the engine holds; engines that cannot say count as full."""
    count = getattr(engine, "num_requests", None)
    return int(count()) if callable(count) else 1 << 30


__all__ = ["AFTER_KINDS", "FAKE_BDF", "KINDS", "MONITOR_KINDS", "STEP_KINDS", "FaultSpec", "StepFaults", "copy_engine",
           "failed_step", "make_fake_sysfs", "parse_fault_spec", "set_fake_vendor"]
