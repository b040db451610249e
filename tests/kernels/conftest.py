"""Kernel tests run under Triton's interpreter on the CPU, or compiled on a GPU.

Triton reads `TRITON_INTERPRET` when a kernel is decorated, so it is set here, before any
kernel module is imported (and a kernel module imported earlier in compiled mode is reloaded).
`TRITON_INTERPRET=0 pytest tests/kernels` on a machine with CUDA runs the compiled kernels on
the GPU instead (scripts/gpu-check.sh does).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ["TRITON_INTERPRET"] not in ("0", "")

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if INTERPRET:
    for name in sorted(m for m in sys.modules if m.startswith("ftrs.kernels.")):  # _triton first
        importlib.reload(sys.modules[name])


def kernel_device() -> str:
    """Where the kernels under test run: the CPU when interpreted, else the GPU."""
    if INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("compiled kernels need CUDA (TRITON_INTERPRET=0 without a GPU)")
    return "cuda"


@pytest.fixture
def device() -> str:
    return kernel_device()
