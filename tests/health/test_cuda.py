from __future__ import annotations

import pytest

from ftrs.health.cuda import CudaResult, parse_cuda_error, probe_cuda_event
from ftrs.health.result import Status

from .fakes import FIELD_REPORT_CUDA_ERROR


def test_field_report_error_is_719() -> None:
    info = parse_cuda_error(RuntimeError("CUDA error: unspecified launch failure\nSearch for "
                                         "`cudaErrorLaunchFailure' in https://docs.nvidia.com"))
    assert info.is_cuda and not info.is_oom
    assert (info.code, info.name) == (719, "cudaErrorLaunchFailure")
    assert info.text == "RuntimeError: CUDA error: unspecified launch failure"
    assert parse_cuda_error(FIELD_REPORT_CUDA_ERROR).code == 719


@pytest.mark.parametrize(("error", "code", "oom"), [
    (719, 719, False),
    (2, 2, True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", 2, True),
    ("CUDA error: an illegal memory access was encountered", 700, False),
    ("cudaErrorIllegalAddress", 700, False),
    ("Triton Error [CUDA]: unspecified launch failure", 719, False),
    ("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)", None, True),
    ("CUDA driver error: error code 999", 999, False),
])
def test_error_spellings(error: str | int, code: int | None, oom: bool) -> None:
    info = parse_cuda_error(error)
    assert info.is_cuda and info.code == code and info.is_oom == oom


def test_non_cuda_errors_are_not_cuda() -> None:
    info = parse_cuda_error(KeyError("layers.3.mlp"))
    assert not info.is_cuda and info.code is None


class _Event:
    def __init__(self, result: bool | Exception) -> None:
        self.result = result

    def query(self) -> bool:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_event_query_ok_not_ready_and_error() -> None:
    done = probe_cuda_event(_Event(True))
    pending = probe_cuda_event(_Event(False))
    assert isinstance(done, CudaResult) and done.status is Status.OK and done.ready is True
    assert isinstance(pending, CudaResult) and pending.ready is False
    failed = probe_cuda_event(_Event(RuntimeError("CUDA error: unspecified launch failure")))
    assert failed.status is Status.ERROR and failed.evidence["cuda_error_code"] == 719


def test_no_event_is_not_applicable() -> None:
    r = probe_cuda_event(None)
    assert r.status is Status.NOT_APPLICABLE and r.reason
