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


def test_a_transfer_pass_is_timed_on_one_warm_engine_and_moves_one_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`transfer_pass_s`: one engine for every pass (the passes alternate between the pool's
    two layers, each evicting the other's blocks), the first two untimed; over a simulated
    link of 1 GB/s and no latency a pass of 4 x 1 MiB moves one layer and takes at least what
    the link model says (the oracle: bytes / rate); `measure_transfer_gbps` stays under the
    link's rate."""
    from ftrs import _core
    from ftrs.guard import link

    made: list[str] = []
    engine_cls = _core.TransferEngine

    def counting(*a: object, **kw: object) -> object:
        made.append(str(kw.get("backend")))
        return engine_cls(*a, **kw)

    monkeypatch.setattr(_core, "TransferEngine", counting)
    layout = _core.ExpertLayout(2, 4, [1 << 20])
    pool = _core.ExpertPool(layout, "float32")
    dst = torch.zeros(4 * layout.expert_bytes, dtype=torch.uint8)
    seconds, moved, name = link.transfer_pass_s(pool, dst, "simulated:1:0", reps=3)
    assert made == ["simulated:1:0"]  # one engine, five passes
    assert moved == 4 << 20 and name == "simulated:1:0"
    assert seconds >= (4 << 20) / 1e9  # the link model's time, at least (no upper bound: a
    # loaded host only adds to it)
    gbps, _ = link.measure_transfer_gbps("simulated:4", block_bytes=1 << 20, blocks=8)
    assert 0 < gbps <= 4.0 + 1e-9
    with pytest.raises(ValueError, match="two layers"):
        link.transfer_pass_s(_core.ExpertPool(_core.ExpertLayout(1, 4, [1 << 20]), "float32"),
                             dst, "host")


def test_the_measured_transfer_reads_a_written_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """`measure_transfer_gbps` streams memory that holds data: a fresh pool's untouched pages
    all read as the kernel's one zero page, cached, and overstate the host backend's rate."""
    import numpy as np

    from ftrs.guard import link

    seen: list[np.ndarray] = []
    timed = link.transfer_pass_s

    def inspecting(pool: object, dst: object, backend: str, reps: int = 1) -> object:
        seen.append(np.frombuffer(memoryview(pool), dtype=np.uint8).copy())  # type: ignore[arg-type]
        return timed(pool, dst, backend, reps)  # type: ignore[arg-type]

    monkeypatch.setattr(link, "transfer_pass_s", inspecting)
    gbps, name = link.measure_transfer_gbps("host", block_bytes=64 << 10, blocks=4)
    assert name == "host" and gbps > 0
    assert len(seen) == 1 and seen[0].size >= 2 * 4 * (64 << 10)
    blocks = seen[0][: 2 * 4 * (64 << 10)].reshape(8, -1)
    assert (blocks != 0).all(axis=1).all(), "a block of the measured pool was never written"
