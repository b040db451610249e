"""Fixtures for the guard tests: a minimal fake sysfs tree (GPU behind a root port)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

GPU = "0000:04:00.0"
PORT = "0000:00:03.0"


class FakeEngine:
    """What the adaptive guard uses of `EngineCore`: the step budget and the copy engine."""

    def __init__(self, budget: int, copier: Any = None, config: Any = None) -> None:
        self.budget = budget
        self.copier = copier
        if config is not None:
            self.config = config

    def set_step_budget(self, tokens: int) -> None:
        self.budget = tokens

    def transfer_engine(self) -> Any:
        return self.copier


def add_function(root: Path, parent: Path, bdf: str, vendor: int, klass: int) -> Path:
    path = parent / bdf
    path.mkdir(parents=True)
    config = bytearray(64)
    config[0:2] = vendor.to_bytes(2, "little")
    (path / "config").write_bytes(bytes(config))
    (path / "vendor").write_text(f"0x{vendor:04x}\n")
    (path / "class").write_text(f"0x{klass:06x}\n")
    link = root / "bus" / "pci" / "devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(path, link.parent))
    return path


def set_link(path: Path, gen_speed: str, width: int, max_speed: str, max_width: int) -> None:
    (path / "current_link_speed").write_text(gen_speed + "\n")
    (path / "max_link_speed").write_text(max_speed + "\n")
    (path / "current_link_width").write_text(f"{width}\n")
    (path / "max_link_width").write_text(f"{max_width}\n")


def set_aer(path: Path, correctable: int = 0) -> None:
    (path / "aer_dev_correctable").write_text(f"RxErr {correctable}\nTOTAL_ERR_COR {correctable}\n")
    (path / "aer_dev_nonfatal").write_text("TLP 0\nTOTAL_ERR_NONFATAL 0\n")
    (path / "aer_dev_fatal").write_text("DLP 0\nTOTAL_ERR_FATAL 0\n")


@pytest.fixture
def gpu_sysfs(tmp_path: Path) -> Path:
    """A Gen3 x16 GPU at GPU behind PORT; returns the root."""
    root = tmp_path / "sys"
    port = add_function(root, root / "devices" / "pci0000:00", PORT, 0x8086, 0x060400)
    gpu = add_function(root, port, GPU, 0x10DE, 0x030000)
    for p in (port, gpu):
        set_link(p, "8.0 GT/s PCIe", 16, "8.0 GT/s PCIe", 16)
        set_aer(p)
    return root


@pytest.fixture
def empty_sysfs(tmp_path: Path) -> Path:
    """A host with no NVIDIA device on the bus."""
    root = tmp_path / "nogpu"
    add_function(root, root / "devices" / "pci0000:00", "0000:00:1f.0", 0x8086, 0x060100)
    return root
