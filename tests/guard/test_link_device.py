"""`cuda:N` at startup: the link probe reads that GPU's link, not the first GPU's."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.guard.link import cuda_index
from ftrs.guard.startup import current_link

from .conftest import GPU, PORT, add_function, set_aer, set_link

SECOND = "0000:81:00.0"
SECOND_PORT = "0000:80:01.0"


def two_gpus(tmp_path: Path) -> Path:
    """GPU at Gen3 x16 behind PORT, SECOND at Gen4 x8 (of x16) behind SECOND_PORT."""
    root = tmp_path / "sys"
    port = add_function(root, root / "devices" / "pci0000:00", PORT, 0x8086, 0x060400)
    port2 = add_function(root, root / "devices" / "pci0000:80", SECOND_PORT, 0x8086, 0x060400)
    first = add_function(root, port, GPU, 0x10DE, 0x030000)
    second = add_function(root, port2, SECOND, 0x10DE, 0x030000)
    for p in (port, first):
        set_link(p, "8.0 GT/s PCIe", 16, "8.0 GT/s PCIe", 16)
    for p in (port2, second):
        set_link(p, "16.0 GT/s PCIe", 8, "16.0 GT/s PCIe", 16)
    for p in (port, first, port2, second):
        set_aer(p)
    return root


def test_cuda_index_reads_only_cuda_n() -> None:
    assert [cuda_index(d) for d in ("cuda:3", "cuda:0", "cuda", "auto", "cpu", "cuda:x")] == [
        3, 0, None, None, None, None]


def test_the_startup_probe_reads_the_link_of_the_configured_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = two_gpus(tmp_path)
    # torch numbers the GPU at bus 0x81 as cuda:1 (no real device is asked)
    props = {1: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x81, pci_device_id=0)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])

    def link(device: str) -> tuple[str | None, int | None, int | None]:
        state = current_link(EngineConfig(model="m", device=device), sysfs_root=root,
                             measure=False)
        return state.bdf, state.gen_current, state.width_current

    assert link("cuda:1") == (SECOND, 4, 8)
    assert link("auto") == (GPU, 3, 16)
    assert link("cuda:5") == (GPU, 3, 16)  # a device torch cannot describe: the first GPU
