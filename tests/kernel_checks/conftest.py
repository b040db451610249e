"""Kernel tests run under Triton's interpreter on the CPU, or compiled on a GPU.

Triton fixes compile-or-interpret when it is first imported (its own `tl.*` helpers are
decorated then), so `tests/conftest.py` sets `TRITON_INTERPRET=1` before anything imports
it when no GPU is visible. `TRITON_INTERPRET=0 pytest tests/kernel_checks` on a machine with CUDA
runs the compiled kernels on the GPU (scripts/gpu-check.sh does; it is also the default there).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if INTERPRET:
    import triton.language.standard as _std
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(_std.zeros, InterpretedFunction):
        raise pytest.UsageError(
            "triton was imported before TRITON_INTERPRET=1 was set: run the kernel tests with "
            "TRITON_INTERPRET=1 in the environment")
    for _name in sorted(m for m in sys.modules if m.startswith("ftrs.kernels.")):  # _triton first
        importlib.reload(sys.modules[_name])  # decorated before the knob was set


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
