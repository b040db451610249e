"""What CUDA itself says: parse CUDA error text, and query the last recorded event.

Neither is evidence that the device is lost (DESIGN.md "Errors"): the same "unspecified launch
failure" (719) comes from a kernel bug and from a GPU that left the bus. The classifier pairs
what is parsed here with probes that do not go through CUDA.

`probe_cuda_event` is non-blocking (`Event.query()`), so the monitor may call it from its own
thread while the engine is stuck in a synchronize. torch is imported only when needed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ftrs.health.result import ProbeResult, Status, not_applicable

logger = logging.getLogger(__name__)

#: cudaError_t codes by the message CUDA prints for them (cudaGetErrorString).
CUDA_ERRORS: dict[str, tuple[int, str]] = {
    "out of memory": (2, "cudaErrorMemoryAllocation"),
    "initialization error": (3, "cudaErrorInitializationError"),
    "cuda-capable device(s) is/are busy or unavailable": (46, "cudaErrorDevicesUnavailable"),
    "no cuda-capable device is detected": (100, "cudaErrorNoDevice"),
    "uncorrectable ecc error encountered": (214, "cudaErrorECCUncorrectable"),
    "an illegal memory access was encountered": (700, "cudaErrorIllegalAddress"),
    "too many resources requested for launch": (701, "cudaErrorLaunchOutOfResources"),
    "the launch timed out and was terminated": (702, "cudaErrorLaunchTimeout"),
    "device-side assert triggered": (710, "cudaErrorAssert"),
    "an illegal instruction was encountered": (715, "cudaErrorIllegalInstruction"),
    "misaligned address": (716, "cudaErrorMisalignedAddress"),
    "unspecified launch failure": (719, "cudaErrorLaunchFailure"),
    "unknown error": (999, "cudaErrorUnknown"),
}
_BY_CODE = {code: (text, name) for text, (code, name) in CUDA_ERRORS.items()}
_BY_NAME = {name.lower(): (code, text) for text, (code, name) in CUDA_ERRORS.items()}
_CUDA_MARKERS = ("cuda error", "cuda driver error", "cudaerror", "cublas_status", "cudnn_status",
                 "triton error [cuda]", "acceleratorerror", "cuda_error_")
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "cublas_status_alloc_failed",
                "cuda_error_out_of_memory", "cudaerrormemoryallocation")
CUDA_OOM = 2


class CudaErrorInfo(NamedTuple):
    """A CUDA error as far as text and type tell. `code` None when not recognised."""

    is_cuda: bool
    is_oom: bool
    code: int | None
    name: str
    text: str


def parse_cuda_error(error: BaseException | str | int) -> CudaErrorInfo:
    """Read the CUDA error code out of an exception, its message, or a bare cudaError_t."""
    if isinstance(error, int):
        text, name = _BY_CODE.get(error, ("", ""))
        return CudaErrorInfo(True, error == CUDA_OOM, error, name, text)
    if isinstance(error, BaseException):
        text = f"{type(error).__name__}: {error}"
    else:
        text = error
    low = text.lower()
    is_oom = any(m in low for m in _OOM_MARKERS)
    is_cuda = is_oom or any(m in low for m in _CUDA_MARKERS)
    code: int | None = None
    name = ""
    m = re.search(r"(cudaerror\w+)", low)
    if m and m.group(1) in _BY_NAME:
        code = _BY_NAME[m.group(1)][0]
    if code is None:
        for message, (c, _n) in CUDA_ERRORS.items():
            if message in low:
                code = c
                break
    if code is None:
        m = re.search(r"(?:error code|cuda error|cudaerror)[ :=#]*(\d{1,4})\b", low)
        if m:
            code = int(m.group(1))
    if code is not None:
        name = _BY_CODE.get(code, ("", ""))[1]
        is_cuda = True
        is_oom = is_oom or code == CUDA_OOM
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    return CudaErrorInfo(is_cuda, is_oom, code, name, first_line)


class EventLike(Protocol):
    """`torch.cuda.Event`: `query()` is True when done, False when pending, raises on error."""

    def query(self) -> bool: ...


@dataclass(frozen=True, kw_only=True)
class CudaResult(ProbeResult):
    """`ready` is None when the query raised or did not run."""

    ready: bool | None = None
    error_code: int | None = None


def cuda_available() -> tuple[bool, str]:
    """(True, "") when torch is importable and sees a CUDA device; else (False, why)."""
    try:
        import torch  # lazily: the health package must import without torch
    except ImportError as e:
        return False, f"torch not installed: {e}"
    try:
        if torch.cuda.is_available():
            return True, ""
        return False, "torch sees no CUDA device"
    except Exception as e:
        return False, f"torch.cuda.is_available() failed: {e}"


def probe_cuda_event(event: EventLike | Any | None) -> ProbeResult:
    """Non-blocking query of the last event the engine recorded."""
    if event is None:
        return not_applicable("cuda", "no CUDA event recorded (CPU device or engine not started)")
    try:
        ready = bool(event.query())
    except Exception as e:
        info = parse_cuda_error(e)
        return CudaResult(probe="cuda", status=Status.ERROR, reason=info.text,
                          error_code=info.code,
                          evidence={"cuda_error_code": info.code, "cuda_error": info.name,
                                    "message": info.text})
    return CudaResult(probe="cuda", status=Status.OK, ready=ready,
                      evidence={"event": "complete" if ready else "not_ready"})
