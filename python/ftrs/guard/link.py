"""Link probe: PCIe generation and width (current vs max) and measured copy bandwidth.

The link comes from the health probes: sysfs (`health.sysfs.probe_pci`, any root) first, NVML
(`health.nvml.NvmlProbe`) for what sysfs does not say. Bandwidth is measured through the Rust
copy engine: one warm `TransferEngine` over a small two-layer expert pool streams a layer's
blocks into a destination buffer, pass after pass (the `cuda` backend into device memory when
CUDA is usable, else the `host` backend, or whatever backend spec the caller names, e.g.
`simulated:12`), and the raw
`_core.host_copy` gives the host's memcpy bandwidth. D2H goes through the Rust driver layer
too (`_core.cuda_measure_d2h`) into an `ExpertPool` pinned with `cuMemHostRegister`.

`compare_h2d` / `compare_d2h` put those figures beside torch's pinned `copy_` of the same
bytes, for bench/gpu_check.py.

Nominal practical bandwidth per generation at x16 (DESIGN.md): Gen3 12 GB/s, Gen4 25, Gen5 50;
Gen1 3 and Gen2 6 by the same halving; it scales linearly with the lane count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ftrs.errors import DeviceError
from ftrs.health.nvml import NvmlApi, NvmlProbe, NvmlResult
from ftrs.health.sysfs import PciResult, discover_nvidia_gpus, probe_pci

if TYPE_CHECKING:
    from ftrs import _core

logger = logging.getLogger(__name__)

#: Practical pinned H2D GB/s of a x16 link, by PCIe generation.
NOMINAL_GBPS_X16 = {1: 3.0, 2: 6.0, 3: 12.0, 4: 25.0, 5: 50.0, 6: 100.0}


def nominal_gbps(gen: int | None, width: int | None) -> float | None:
    """Practical GB/s of a Gen`gen` x`width` link; None when either is unknown."""
    if gen is None or width is None or gen not in NOMINAL_GBPS_X16 or width <= 0:
        return None
    return NOMINAL_GBPS_X16[gen] * width / 16


@dataclass(frozen=True)
class LinkState:
    """What the guard knows about the path between host memory and the device."""

    #: "cuda" when a GPU is present, else "cpu".
    device: str
    bdf: str | None = None
    gen_current: int | None = None
    gen_max: int | None = None
    width_current: int | None = None
    width_max: int | None = None
    #: Where the link figures came from: "sysfs", "nvml", or "none".
    link_source: str = "none"
    measured_h2d_gbps: float | None = None
    measured_d2h_gbps: float | None = None
    #: Backend that `measured_h2d_gbps` went through (cuda, host, simulated:...).
    measured_backend: str | None = None
    host_copy_gbps: float | None = None
    device_name: str | None = None
    #: `gen_current` was read while the link carried traffic. NVIDIA GPUs drop the link speed
    #: when idle, so an idle reading below max is power saving, not a down-shift.
    speed_under_load: bool = True

    @property
    def below_max(self) -> bool:
        """The link trained below what both ends support: width always, speed under load."""
        pairs = [(self.width_current, self.width_max)]
        if self.speed_under_load:
            pairs.append((self.gen_current, self.gen_max))
        return any(c is not None and m is not None and c < m for c, m in pairs)

    @property
    def gen_effective(self) -> int | None:
        """The generation traffic will run at: the current one under load, else the max."""
        if self.speed_under_load or self.gen_max is None:
            return self.gen_current
        return self.gen_max

    @property
    def nominal_gbps(self) -> float | None:
        return nominal_gbps(self.gen_effective, self.width_current)

    @property
    def nominal_max_gbps(self) -> float | None:
        return nominal_gbps(self.gen_max, self.width_max)

    def effective_gbps(self) -> tuple[float | None, str]:
        """(GB/s, source): the measured H2D figure over a real link, else the nominal one."""
        if self.measured_h2d_gbps is not None and self.measured_backend not in (None, "host"):
            return self.measured_h2d_gbps, f"measured ({self.measured_backend})"
        if self.nominal_gbps is not None:
            return self.nominal_gbps, f"nominal Gen{self.gen_effective} x{self.width_current}"
        if self.measured_h2d_gbps is not None:
            return self.measured_h2d_gbps, f"measured ({self.measured_backend})"
        return None, "unknown"

    def describe(self) -> str:
        if self.gen_current is None and self.width_current is None:
            return "no PCIe link (no GPU)" if self.device == "cpu" else "PCIe link unknown"
        return (f"Gen{self.gen_current} x{self.width_current} "
                f"(max Gen{self.gen_max} x{self.width_max})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.device != "cuda":  # no link was read: nothing was or was not under load
            d["speed_under_load"] = None
        gbps, source = self.effective_gbps()
        d |= {"below_max": self.below_max, "nominal_gbps": self.nominal_gbps,
              "nominal_max_gbps": self.nominal_max_gbps, "effective_gbps": gbps,
              "effective_source": source}
        return d


def cuda_index(device: str) -> int | None:
    """N of a `cuda:N` device or backend string; None for any other (`cuda`, `auto`, `cpu`)."""
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def cuda_pci_address(index: int) -> str | None:
    """The PCI address of CUDA device `index` as torch numbers it (`CUDA_VISIBLE_DEVICES`
    applied); None when it cannot be told."""
    try:
        import torch

        p: Any = torch.cuda.get_device_properties(index)  # the stubs lack the pci_* fields
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # no such device, or no CUDA: the caller probes the first GPU instead
        logger.debug("no PCI address for cuda:%d", index, exc_info=True)
        return None


def probe_link(bdf: str | None = None, *, sysfs_root: str | Path = "/sys",
               nvml: NvmlApi | None = None, use_nvml: bool = True,
               under_load: bool = True) -> LinkState:
    """Link figures of `bdf` (default: the first NVIDIA GPU under `sysfs_root`).

    `under_load`: the link carries traffic now (see `LinkState.speed_under_load`)."""
    if bdf is None:
        gpus = discover_nvidia_gpus(sysfs_root)
        bdf = gpus[0] if gpus else None
    if bdf is None:
        return LinkState(device="cpu")
    fields: dict[str, Any] = {}
    source = "none"
    pci = probe_pci(bdf, root=sysfs_root, was_present=False)
    if isinstance(pci, PciResult) and pci.link is not None:
        link = pci.link
        fields = {"gen_current": link.current_gen, "gen_max": link.max_gen,
                  "width_current": link.current_width, "width_max": link.max_width}
        source = "sysfs"
    if use_nvml and (not fields or None in fields.values()):
        probe = NvmlProbe(bdf, nvml=nvml)
        try:
            res = probe.sample()
        finally:
            probe.close()
        if isinstance(res, NvmlResult):
            nv = {"gen_current": res.link_gen_current, "gen_max": res.link_gen_max,
                  "width_current": res.link_width_current, "width_max": res.link_width_max}
            for k, v in nv.items():
                if fields.get(k) is None and v is not None:
                    fields[k] = v
                    source = "sysfs+nvml" if source == "sysfs" else "nvml"
    return LinkState(device="cuda", bdf=bdf, link_source=source, speed_under_load=under_load,
                     **fields)


def measure_host_copy_gbps(nbytes: int = 64 << 20, reps: int = 5, threads: int = 0) -> float:
    """Median GB/s of `_core.host_copy` between two host buffers (after one warm-up copy)."""
    import statistics

    import torch

    from ftrs import _core

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        _core.host_copy(dst.data_ptr(), src.data_ptr(), nbytes, threads)
        if i:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def cuda_usable() -> bool:
    """True when the driver and torch both see a GPU."""
    from ftrs import _core

    try:
        import torch

        return _core.cuda_available() and torch.cuda.is_available()
    except Exception:  # a broken driver must not break the probe
        logger.debug("CUDA check failed", exc_info=True)
        return False


def default_backend() -> str:
    """`cuda` when the driver and torch both see a GPU, else `host`."""
    return "cuda" if cuda_usable() else "host"


def pinned_pool(nbytes: int, device: int = 0) -> _core.ExpertPool:
    """A host buffer of at least `nbytes`, page-locked through the pool's `cuMemHostRegister`
    path in CUDA device `device`'s context; `DeviceError` when the driver cannot pin it."""
    from ftrs import _core

    pool = _core.ExpertPool(_core.ExpertLayout(1, 1, [-(-nbytes // 4) * 4]), "float32")
    if not pool.pin(device):
        raise DeviceError(f"cannot pin {nbytes} bytes of host memory: no CUDA driver")
    return pool


def _median_s(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls after one untimed warm-up call."""
    import statistics

    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transfer_pass_s(pool: _core.ExpertPool, dst: Any, backend: str,
                    reps: int = 1) -> tuple[float, int, str]:
    """(median seconds, bytes, backend name) of a warm `TransferEngine` streaming every block of
    one layer of a two-layer `pool` into `dst` (a uint8 tensor with one slot per block of a
    layer), over `reps` timed passes. One engine serves every pass, as one serves a model:
    passes alternate layers, so each evicts the other's blocks and copies a whole layer; the
    first two (one per layer) are untimed: they fault the pages in and start the engine's
    worker, stream and events. (A fresh engine per pass timed those starts into every pass: an
    H200 run measured 1 MiB at 11 GB/s that way, where one miss of 1 MiB through a warm engine
    took 43 us, 24 GB/s.)"""
    from ftrs import _core

    if pool.layout.num_layers < 2:
        raise ValueError("transfer_pass_s: the pool needs two layers (the passes alternate)")
    blocks = pool.layout.num_experts
    engine = _core.TransferEngine(pool, blocks, dst, backend=backend)
    passes: list[tuple[float, int]] = []
    try:
        for i in range(reps + 2):
            before = int(engine.stats()["bytes_h2d"])
            t0 = time.perf_counter()
            _, ticket = engine.lookup(i % 2, list(range(blocks)))
            engine.wait(ticket)
            elapsed = time.perf_counter() - t0
            engine.release()
            moved = int(engine.stats()["bytes_h2d"]) - before
            if i >= 2:
                passes.append((elapsed, moved or blocks * int(pool.layout.expert_bytes)))
        name = str(engine.backend_name)
    finally:
        engine.close()
    elapsed, moved = sorted(passes)[len(passes) // 2]
    return elapsed, moved, name


def measure_transfer_gbps(backend: str | None = None, block_bytes: int = 4 << 20,
                          blocks: int = 16) -> tuple[float, str]:
    """GB/s of the transfer engine streaming `blocks` expert blocks, the median of three passes;
    (GB/s, backend). `cuda` copies into torch's current device, `cuda:N` into device N. Every
    block is written first: a fresh pool's pages are unmapped, and reading them reads the
    kernel's one zero page from the CPU's cache (the host backend measured 18 GB/s that way on
    a host whose copies of written memory run at 4-6)."""
    import numpy as np
    import torch

    from ftrs import _core

    backend = backend or default_backend()
    if backend == "cuda":
        backend = f"cuda:{torch.cuda.current_device()}"
    on_cuda = backend.split(":")[0] == "cuda"
    device = backend if on_cuda else "cpu"
    layout = _core.ExpertLayout(2, blocks, [block_bytes])  # two layers: see transfer_pass_s
    pool = _core.ExpertPool(layout, "float32")
    block = np.full(block_bytes, 0x5A, dtype=np.uint8)
    for layer in range(2):
        for expert in range(blocks):
            pool.write(layer, expert, 0, block)
    if on_cuda:
        pool.pin(cuda_index(backend) or 0)
    buf = torch.zeros(blocks * layout.expert_bytes, dtype=torch.uint8, device=device)
    elapsed, moved, name = transfer_pass_s(pool, buf, backend, reps=3)
    return moved / max(elapsed, 1e-9) / 1e9, name


def measure_d2h_gbps(nbytes: int = 64 << 20, reps: int = 3,
                     device: int | None = None) -> float | None:
    """Device → pinned host GB/s through `_core.cuda_measure_d2h` from CUDA device `device`
    (default: torch's current one); None without CUDA."""
    if not cuda_usable():
        return None
    try:
        import torch

        from ftrs import _core

        dev = torch.cuda.current_device() if device is None else device
        src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()  # the Rust copy runs on its own stream
        dst = pinned_pool(nbytes, dev)
        secs = _core.cuda_measure_d2h(src.data_ptr(), dst.address, nbytes, reps, dev)
        return nbytes / secs / 1e9
    except Exception:  # a GPU that misbehaves here is reported elsewhere; not fatal
        logger.warning("D2H bandwidth measurement failed", exc_info=True)
        return None


class CopyComparison(NamedTuple):
    """One copy size in one direction through ftrs beside torch, all on pinned host memory."""

    direction: str  # "h2d" or "d2h"
    nbytes: int
    #: h2d: the transfer engine's `cuda` backend (blocks of `block_bytes`); d2h: the driver copy.
    ftrs_gbps: float
    #: One bare driver copy of all `nbytes` (`_core.cuda_measure_h2d` / `cuda_measure_d2h`).
    driver_gbps: float
    #: `Tensor.copy_(non_blocking=True)` plus `torch.cuda.synchronize()`, torch's pinned buffer.
    torch_gbps: float

    @property
    def ratio(self) -> float:
        """ftrs / torch."""
        return self.ftrs_gbps / self.torch_gbps


def _require_cuda() -> None:
    if not cuda_usable():
        raise DeviceError("no CUDA device: the CUDA driver or torch sees no GPU")


def compare_h2d(nbytes: int, reps: int = 5, block_bytes: int = 4 << 20) -> CopyComparison:
    """Pinned host → device GB/s of `nbytes` (rounded down to whole blocks of `block_bytes`)
    through the transfer engine and the bare driver copy, beside torch's `copy_` of the same
    bytes from its own pinned buffer; each the median of `reps` after a warm-up."""
    import torch

    from ftrs import _core

    _require_cuda()
    dev = torch.cuda.current_device()
    block = min(block_bytes, nbytes)
    blocks = max(1, nbytes // block)
    # two layers: the engine's passes alternate between them (transfer_pass_s)
    pool = _core.ExpertPool(_core.ExpertLayout(2, blocks, [block]), "float32")
    if not pool.pin(dev):
        raise DeviceError("cannot pin the expert pool: no CUDA driver")
    host = torch.frombuffer(pool, dtype=torch.uint8)
    host.copy_(torch.randint(0, 256, (host.numel(),), dtype=torch.uint8))
    n = blocks * int(pool.layout.expert_bytes)  # one layer: blocks x aligned block size
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    engine_s, moved, _ = transfer_pass_s(pool, dst, f"cuda:{dev}", reps)
    driver_s = _core.cuda_measure_h2d(dst.data_ptr(), pool.address, n, reps, dev)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    src.copy_(host)

    def torch_copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    torch_s = _median_s(torch_copy, reps)
    return CopyComparison("h2d", n, moved / engine_s / 1e9, n / driver_s / 1e9, n / torch_s / 1e9)


def compare_d2h(nbytes: int, reps: int = 5) -> CopyComparison:
    """Device → pinned host GB/s of `nbytes` through `_core.cuda_measure_d2h` (into a pinned
    `ExpertPool`) beside torch's `copy_` into its own pinned buffer; medians of `reps`."""
    import torch

    from ftrs import _core

    _require_cuda()
    dev = torch.cuda.current_device()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()  # the Rust copy runs on its own stream
    pool = pinned_pool(nbytes, dev)
    driver_s = _core.cuda_measure_d2h(src.data_ptr(), pool.address, nbytes, reps, dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def torch_copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    torch_s = _median_s(torch_copy, reps)
    gbps = nbytes / driver_s / 1e9
    return CopyComparison("d2h", nbytes, gbps, gbps, nbytes / torch_s / 1e9)


def measure_link(state: LinkState, backend: str | None = None, *,
                 sysfs_root: str | Path = "/sys") -> LinkState:
    """`state` with measured bandwidth filled in (H2D through the engine, host copy, D2H).

    Over a real link (`cuda`), the link is probed again right after the transfer, while it is
    still trained up, and that reading counts as one under load."""
    from dataclasses import replace

    h2d, used = measure_transfer_gbps(backend)
    over_cuda = used.split(":")[0] == "cuda"
    if over_cuda and state.bdf is not None:
        state = probe_link(state.bdf, sysfs_root=sysfs_root, under_load=True)
    d2h = measure_d2h_gbps(device=cuda_index(used) or 0) if over_cuda else None
    return replace(state, measured_h2d_gbps=round(h2d, 3), measured_backend=used,
                   host_copy_gbps=round(measure_host_copy_gbps(), 3),
                   measured_d2h_gbps=None if d2h is None else round(d2h, 3))
