"""Every kernel compiles for NVIDIA GPUs, checked on the CPU: Triton lowers to PTX in process
and assembles it with its own ptxas, no device needed (`compile_all.py`, in a subprocess,
since the interpreter knob is set for the other tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_all.py")


def _compile(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_the_bf16_kernels_compile_for_sm90() -> None:
    out = _compile("--quick", "90")
    assert out.count(": ok") >= 5
    assert "sm_90 paged_attention int8-KV bf16: ok" in out


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_sm80_sm86_and_sm90() -> None:
    out = _compile("80", "86", "90")
    from ftrs.kernels.moe import QTYPES

    assert all(f"moe down {t} " in out for t in QTYPES)
    assert "gpt_oss" in out
