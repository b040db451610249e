"""Turn a failure plus probe results into one typed DeviceError (DESIGN.md "Errors").

Order of the rules, first match wins:

1. Loss: a probe that does not go through CUDA says `lost` (PCI config vendor 0xffff or the
   device directory gone, NVML GPU_IS_LOST or Xid 79 event, kernel log Xid 79, a fresh child
   process failing) → DeviceLost, whatever the original error was (a hang included).
2. Out of memory → DeviceOutOfMemory.
3. Any other CUDA error → KernelFault: the device still answers, so suspect the engine.
4. An EngineHang (from the watchdog) without loss evidence stays an EngineHang.
5. No error, but a link below max, AER errors in the log, or AER / replay counters rising
   since `baseline` → DeviceUnhealthy.
6. Otherwise None: not a device matter (a Python bug stays what it is).

`.evidence` always names what decided (`decided_by`) and carries a `hint` for the user.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ftrs.errors import (
    DeviceError,
    DeviceLost,
    DeviceOutOfMemory,
    DeviceUnhealthy,
    EngineHang,
    KernelFault,
)
from ftrs.health.child import ChildResult
from ftrs.health.cuda import parse_cuda_error
from ftrs.health.kmsg import KernelLogResult
from ftrs.health.nvml import NvmlResult
from ftrs.health.result import ProbeResult, Status
from ftrs.health.sysfs import PciResult

HINT_LOST = ("The GPU fell off the PCIe bus. This is a hardware/host fault, not an ftrs bug: "
             "check the PCIe slot or riser seating, the power delivery to the card and its "
             "cooling; a cold power cycle is usually needed to bring it back. Reducing "
             "--max-prefill-length lowers the sustained load. Run `ftrs doctor` for a link check.")
HINT_FAULT = ("The device still answers, so this is most likely a bug in ftrs or one of its "
              "kernels, not hardware. Please report it with this crash report.")
HINT_UNCHECKED = ("No probe could check the device (no sysfs, NVML or kernel log access), so "
                  "device loss cannot be ruled out. Run `ftrs doctor` on the host.")
HINT_OOM = ("The device ran out of memory for this request. Lower --max-prefill-length or the "
            "number of running requests, or leave more device memory free.")
HINT_UNHEALTHY = ("The device answers but its PCIe link is degraded or logging errors. Check the "
                  "slot or riser and the power delivery; expect lower transfer bandwidth.")
HINT_HANG = ("Work was pending and the engine made no progress in time while the device still "
             "answers: most likely a stuck transfer or an engine deadlock. Please report it.")


@dataclass(frozen=True)
class Probes:
    """The probe results one classification looks at; absent probes are None."""

    pci: ProbeResult | None = None
    nvml: ProbeResult | None = None
    kernel_log: ProbeResult | None = None
    child: ProbeResult | None = None
    cuda: ProbeResult | None = None

    def present(self) -> list[ProbeResult]:
        found = (getattr(self, f.name) for f in dataclasses.fields(self))
        return [p for p in found if p is not None]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name).to_dict() for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


def _bdf(probes: Probes) -> str | None:
    for p in (probes.pci, probes.nvml, probes.kernel_log):
        bdf = getattr(p, "bdf", None)
        if bdf:
            return str(bdf)
    return None


def _loss_evidence(probes: Probes) -> tuple[list[str], dict[str, Any], list[str]]:
    """(decided_by, evidence, reasons) from every non-CUDA probe that says lost."""
    decided: list[str] = []
    evidence: dict[str, Any] = {}
    reasons: list[str] = []
    pci, nvml, klog, child = probes.pci, probes.nvml, probes.kernel_log, probes.child
    if isinstance(pci, PciResult) and pci.status is Status.LOST:
        if pci.vendor is not None:
            decided.append(f"pci_config_vendor=0x{pci.vendor:04x}")
            evidence["pci_vendor"] = f"0x{pci.vendor:04x}"
        else:
            decided.append("pci_device_dir=missing")
            evidence["pci_device_dir"] = "missing"
        reasons.append(pci.reason)
    if isinstance(nvml, NvmlResult) and nvml.status is Status.LOST:
        if nvml.evidence.get("nvml") == "GPU_IS_LOST":
            decided.append("nvml=GPU_IS_LOST")
            evidence["nvml"] = "GPU_IS_LOST"
        else:
            decided.append("nvml_xid=79")
            evidence["xid"] = 79
        reasons.append(nvml.reason)
    if isinstance(klog, KernelLogResult) and klog.status is Status.LOST:
        decided.append("kernel_log_xid=79")
        evidence["xid"] = 79
        evidence["kernel_log_line"] = klog.evidence.get("kernel_log_line", "")
        reasons.append(klog.reason)
    if isinstance(child, ChildResult) and child.status is Status.LOST:
        decided.append(f"child_probe={child.outcome}")
        evidence["child_probe"] = {"outcome": child.outcome, "exit_code": child.exit_code,
                                   "stderr_tail": child.stderr_tail[-500:]}
        reasons.append(child.reason)
    return decided, evidence, reasons


def _unhealthy_evidence(probes: Probes, baseline: Probes | None) -> tuple[list[str], dict[str, Any]]:
    decided: list[str] = []
    evidence: dict[str, Any] = {}
    for p in (probes.pci, probes.nvml, probes.kernel_log):
        if p is not None and p.status is Status.DEGRADED:
            decided.append(f"{p.probe}_degraded")
            evidence[f"{p.probe}_reason"] = p.reason
    pci = probes.pci
    if isinstance(pci, PciResult) and pci.link is not None:
        evidence["link"] = dataclasses.asdict(pci.link)
    before = baseline.pci if baseline is not None else None
    if isinstance(pci, PciResult) and isinstance(before, PciResult):
        rises = pci.aer.rise_since(before.aer) if pci.aer else {}
        if pci.upstream and pci.upstream.aer and before.upstream:
            up = pci.upstream.aer.rise_since(before.upstream.aer)
            rises.update({f"upstream_{k}": v for k, v in up.items()})
        if rises:
            decided.append("aer_counters_rising")
            evidence["aer_rise"] = rises
    nv, nv_before = probes.nvml, baseline.nvml if baseline is not None else None
    if (isinstance(nv, NvmlResult) and isinstance(nv_before, NvmlResult)
            and nv.pcie_replay is not None and nv_before.pcie_replay is not None
            and nv.pcie_replay > nv_before.pcie_replay):
        decided.append("pcie_replay_rising")
        evidence["pcie_replay_rise"] = nv.pcie_replay - nv_before.pcie_replay
    return decided, evidence


def classify(
    error: BaseException | str | int | None, probes: Probes, *, baseline: Probes | None = None,
) -> DeviceError | None:
    """Classify `error` (exception, CUDA error text or cudaError_t code, or None when nothing
    failed) with `probes` taken after it; `baseline` is an earlier sample for counter rises."""
    bdf = _bdf(probes)
    base: dict[str, Any] = {"bdf": bdf} if bdf else {}
    cuda = parse_cuda_error(error) if error is not None and not isinstance(
        error, DeviceError) else None
    if cuda is not None and cuda.is_cuda:
        base.update(cuda_error_code=cuda.code, cuda_error=cuda.name, cuda_message=cuda.text)
    decided, evidence, reasons = _loss_evidence(probes)
    if decided:
        what = f"GPU {bdf or '?'} is lost: {reasons[0]}"
        if error is not None:
            what += f" (the engine saw: {_describe(error)})"
        return DeviceLost(what, evidence={**base, **evidence, "decided_by": decided,
                                          "hint": HINT_LOST})
    if isinstance(error, DeviceError):
        answered = _answered(probes)
        hint = error.evidence.get("hint") or class_hint(error, answered)
        decided = error.evidence.get("decided_by") or [  # the engine's own typed error
            f"engine_error={type(error).__name__}", *(f"{p}=ok" for p in answered)]
        return type(error)(error.message, evidence={**error.evidence, **base,
                           "device_answers": answered, "decided_by": decided, "hint": hint})
    if cuda is not None and cuda.is_oom:
        return DeviceOutOfMemory(f"device out of memory: {cuda.text}",
                                 evidence={**base, "decided_by": ["cuda_out_of_memory"],
                                           "hint": HINT_OOM})
    if cuda is not None and cuda.is_cuda:
        answered = _answered(probes)
        code = f"CUDA error {cuda.code}" if cuda.code is not None else "CUDA error"
        if answered:
            msg = f"{code} ({cuda.text}) while the device still answers: an engine fault"
        else:
            msg = f"{code} ({cuda.text}); device loss could not be checked"
        return KernelFault(msg, evidence={**base, "decided_by": ["cuda_error", *(
            f"{p}=ok" for p in answered)], "device_answers": answered,
            "hint": HINT_FAULT if answered else HINT_UNCHECKED})
    if error is not None:
        return None
    decided, evidence = _unhealthy_evidence(probes, baseline)
    if decided:
        return DeviceUnhealthy(f"GPU {bdf or '?'} is degraded: " + ", ".join(decided),
                               evidence={**base, **evidence, "decided_by": decided,
                                         "hint": HINT_UNHEALTHY})
    return None


def class_hint(error: DeviceError, answered: list[str]) -> str:
    """The hint for a device error of `error`'s class that no probe found lost. A kernel
    fault or a hang that no probe saw answering may still be a loss: say it was not checked."""
    if isinstance(error, DeviceLost):
        return HINT_LOST
    if isinstance(error, DeviceOutOfMemory):
        return HINT_OOM
    if isinstance(error, DeviceUnhealthy):
        return HINT_UNHEALTHY
    if not answered:
        return HINT_UNCHECKED
    return HINT_HANG if isinstance(error, EngineHang) else HINT_FAULT


def _answered(probes: Probes) -> list[str]:
    """Names of non-CUDA probes that saw the device alive (ok or merely degraded)."""
    alive = (Status.OK, Status.DEGRADED)
    return [p.probe for p in (probes.pci, probes.nvml, probes.child)
            if p is not None and p.status in alive]


def _describe(error: BaseException | str | int) -> str:
    if isinstance(error, DeviceError):
        return f"{type(error).__name__}: {error.message}"
    info = parse_cuda_error(error)
    return info.text or str(error)


def make_hang(stalled_s: float, timeout_s: float, **evidence: Any) -> EngineHang:
    """The watchdog's error before classification adds probe evidence."""
    return EngineHang(f"work pending and no engine progress (a step or a layer) for {stalled_s:.1f} s "
                      f"(hang timeout {timeout_s:g} s)",
                      evidence={"stalled_s": round(stalled_s, 3), "hang_timeout_s": timeout_s,
                                "decided_by": ["watchdog"], **evidence})


#: What `/health` shows of a failure's evidence: what decided it, where, and what to do.
HEALTH_EVIDENCE = ("decided_by", "bdf", "xid", "hint")


def evidence_summary(err: Exception) -> dict[str, Any]:
    """The short evidence `/health` shows beside a failure's class and message: `decided_by`,
    the device's PCI address (`bdf`), the Xid when known and the `hint`; never the rest (a
    traceback, probe dumps, the crash report's path), and strings with absolute paths cut."""
    from ftrs.server.errors import scrub_paths

    def clean(v: Any) -> Any:
        if isinstance(v, str):
            return scrub_paths(v)[:500]
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v[:16]]
        return v if isinstance(v, (int, float, bool)) or v is None else clean(str(v))

    evidence = getattr(err, "evidence", None) or {}
    return {k: clean(evidence[k]) for k in HEALTH_EVIDENCE if k in evidence}
