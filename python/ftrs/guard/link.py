"""Link probe: PCIe generation and width (current vs max) and measured copy bandwidth.

The link comes from the health probes: sysfs (`health.sysfs.probe_pci`, any root) first, NVML
(`health.nvml.NvmlProbe`) for what sysfs does not say. Bandwidth is measured through the Rust
copy engine: a `TransferEngine` over a small expert pool streams every block once into a
destination buffer (the `cuda` backend into device memory when CUDA is usable, else the `host`
backend, or whatever backend spec the caller names, e.g. `simulated:12`), and the raw
`_core.host_copy` gives the host's memcpy bandwidth. D2H is measured with torch on pinned
memory (the transfer engine only moves host → device).

Nominal practical bandwidth per generation at x16 (DESIGN.md): Gen3 12 GB/s, Gen4 25, Gen5 50;
Gen1 3 and Gen2 6 by the same halving; it scales linearly with the lane count.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftrs.health.nvml import NvmlApi, NvmlProbe, NvmlResult
from ftrs.health.sysfs import PciResult, discover_nvidia_gpus, probe_pci

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
        gbps, source = self.effective_gbps()
        d |= {"below_max": self.below_max, "nominal_gbps": self.nominal_gbps,
              "nominal_max_gbps": self.nominal_max_gbps, "effective_gbps": gbps,
              "effective_source": source}
        return d


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


def default_backend() -> str:
    """`cuda` when the driver and torch both see a GPU, else `host`."""
    from ftrs import _core

    try:
        import torch

        if _core.cuda_available() and torch.cuda.is_available():
            return "cuda"
    except Exception:  # a broken driver must not break the probe
        logger.debug("CUDA check failed", exc_info=True)
    return "host"


def measure_transfer_gbps(backend: str | None = None, block_bytes: int = 4 << 20,
                          blocks: int = 16) -> tuple[float, str]:
    """GB/s of the transfer engine streaming `blocks` expert blocks once; (GB/s, backend)."""
    import torch

    from ftrs import _core

    backend = backend or default_backend()
    device = "cuda" if backend == "cuda" else "cpu"
    layout = _core.ExpertLayout(1, blocks, [block_bytes])
    pool = _core.ExpertPool(layout, "float32")
    if backend == "cuda":
        pool.pin()
    buf = torch.zeros(blocks * layout.expert_bytes, dtype=torch.uint8, device=device)
    elapsed, moved, name = 0.0, 0, backend
    for _ in range(2):  # the first pass faults the pages in; the second is timed
        engine = _core.TransferEngine(pool, blocks, buf.data_ptr(), buf.numel(), backend=backend)
        try:
            t0 = time.perf_counter()
            _, ticket = engine.lookup(0, list(range(blocks)))
            engine.wait(ticket)
            elapsed = time.perf_counter() - t0
            engine.release()
        finally:
            engine.cancel_prefetches()
        moved = int(engine.stats()["bytes_h2d"]) or blocks * int(layout.expert_bytes)
        name = str(engine.backend_name)
        del engine
    return moved / max(elapsed, 1e-9) / 1e9, name


def measure_d2h_gbps(nbytes: int = 64 << 20) -> float | None:
    """Device → pinned host GB/s with torch; None without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return nbytes / (time.perf_counter() - t0) / 1e9
    except Exception:  # a GPU that misbehaves here is reported elsewhere; not fatal
        logger.warning("D2H bandwidth measurement failed", exc_info=True)
        return None


def measure_link(state: LinkState, backend: str | None = None, *,
                 sysfs_root: str | Path = "/sys") -> LinkState:
    """`state` with measured bandwidth filled in (H2D through the engine, host copy, D2H).

    Over a real link (`cuda`), the link is probed again right after the transfer, while it is
    still trained up, and that reading counts as one under load."""
    from dataclasses import replace

    h2d, used = measure_transfer_gbps(backend)
    if used == "cuda" and state.bdf is not None:
        state = probe_link(state.bdf, sysfs_root=sysfs_root, under_load=True)
    return replace(state, measured_h2d_gbps=round(h2d, 3), measured_backend=used,
                   host_copy_gbps=round(measure_host_copy_gbps(), 3),
                   measured_d2h_gbps=measure_d2h_gbps() if used == "cuda" else None)
