"""Pinned copy bandwidth through ftrs beside torch, both directions, against the link's bound.

For each size: H2D through a warm transfer engine's `cuda` backend (blocks of `--block-mib`), one
bare driver copy (`_core.cuda_measure_h2d`) and torch's `copy_` from its own pinned buffer;
D2H through `_core.cuda_measure_d2h` into a pool pinned with `cuMemHostRegister` and torch's
`copy_` into pinned memory (guard.link.compare_h2d / compare_d2h; each figure the median of
`--reps` copies after a warm-up). `ratio` = ftrs / torch. The link (guard.link.probe_link,
read right after the copies, while it is trained up) gives the nominal bound of DESIGN.md.

`miss latency`: what one demand miss costs through a warm engine (4 slots, 8 experts of
`--miss-kib` each, looked up one at a time in turn so every lookup misses): microseconds from
`lookup` to the end of `wait`, then `release` (without a fence, and with one recorded on torch's
stream), beside one bare driver copy of the same bytes (`_core.cuda_measure_h2d`, issue to
event synchronised); medians of `--miss-reps`. Their difference is the engine's own overhead
per miss (a queue, a worker wake-up, a completion wake-up).

    python bench/gpu_check.py                  # 1..256 MiB, a table
    python bench/gpu_check.py --json           # the same figures as one JSON object

Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from ftrs.guard.link import CopyComparison, compare_d2h, compare_h2d, cuda_usable, probe_link


def row(c: CopyComparison, nominal: float | None) -> dict[str, Any]:
    return {"size_mib": round(c.nbytes / 2**20, 2), "ftrs_gbps": round(c.ftrs_gbps, 2),
            "driver_gbps": round(c.driver_gbps, 2), "torch_gbps": round(c.torch_gbps, 2),
            "ratio": round(c.ratio, 3),
            "vs_nominal": round(c.ftrs_gbps / nominal, 3) if nominal else None}


def table(title: str, rows: list[dict[str, Any]], ftrs: str) -> str:
    cols = [("size_mib", "MiB"), ("ftrs_gbps", ftrs), ("driver_gbps", "driver GB/s"),
            ("torch_gbps", "torch GB/s"), ("ratio", "ftrs/torch"), ("vs_nominal", "/nominal")]
    lines = [title, "  ".join(f"{h:>13}" for _, h in cols)]
    lines += ["  ".join(f"{'-' if r[k] is None else r[k]:>13}" for k, _ in cols) for r in rows]
    return "\n".join(lines)


def miss_latency(kib: int, reps: int) -> dict[str, Any]:
    """Median microseconds of one demand miss through a warm engine, beside one driver copy."""
    import torch

    from ftrs import _core

    dev = torch.cuda.current_device()
    experts, slots = 8, 4
    pool = _core.ExpertPool(_core.ExpertLayout(1, experts, [kib << 10]), "float32")
    if not pool.pin(dev):
        raise SystemExit("gpu_check: cannot pin the pool")
    eb = int(pool.layout.expert_bytes)
    dst = torch.empty(slots * eb, dtype=torch.uint8, device=dev)
    engine = _core.TransferEngine(pool, slots, dst, backend=f"cuda:{dev}")
    stream = torch.cuda.current_stream().cuda_stream
    out: dict[str, Any] = {"kib": kib}
    try:
        for fence in (False, True):
            times = []
            for i in range(reps + experts):  # the first pass over the experts is a warm-up
                t0 = time.perf_counter()
                _, ticket = engine.lookup(0, [i % experts])
                engine.wait(ticket)
                t1 = time.perf_counter()
                engine.release(stream if fence else None)
                if i >= experts:
                    times.append((t1 - t0, time.perf_counter() - t1))
            key = "fenced" if fence else "engine"
            out[f"{key}_us"] = round(statistics.median(a for a, _ in times) * 1e6, 1)
            out[f"{key}_release_us"] = round(statistics.median(b for _, b in times) * 1e6, 1)
        misses = int(engine.stats().get("misses", 0))
    finally:
        engine.cancel_prefetches()
    driver = _core.cuda_measure_h2d(dst.data_ptr(), pool.address, eb, reps, dev)
    out["driver_us"] = round(driver * 1e6, 1)
    out["overhead_us"] = round(out["engine_us"] - out["driver_us"], 1)
    out["misses_counted"] = misses
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-mib", type=int, default=4, help="transfer engine block size (H2D)")
    ap.add_argument("--json", action="store_true", help="print one JSON object, no table")
    ap.add_argument("--miss-kib", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--miss-reps", type=int, default=64)
    args = ap.parse_args()
    if not cuda_usable():
        print("gpu_check: no CUDA device (torch or the CUDA driver sees no GPU): nothing measured")
        return
    import torch

    h2d = [compare_h2d(mib << 20, args.reps, args.block_mib << 20) for mib in args.sizes_mib]
    d2h = [compare_d2h(mib << 20, args.reps) for mib in args.sizes_mib]
    link = probe_link(under_load=True)  # right after the traffic: the link is trained up
    misses = [miss_latency(kib, args.miss_reps) for kib in args.miss_kib]
    nominal = link.nominal_gbps
    out = {
        "bench": "gpu_check",
        "device": torch.cuda.get_device_name(),
        "link": link.describe(),
        "link_source": link.link_source,
        "nominal_gbps": nominal,
        "nominal_max_gbps": link.nominal_max_gbps,
        "block_mib": args.block_mib,
        "reps": args.reps,
        "h2d": [row(c, nominal) for c in h2d],
        "d2h": [row(c, nominal) for c in d2h],
        "miss_latency": misses,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    bound = f"{nominal:g} GB/s" if nominal else "unknown"
    print(f"device {out['device']}; link {out['link']} ({link.link_source}); "
          f"nominal bound {bound}, at max {link.nominal_max_gbps or 'unknown'}")
    print(table("H2D pinned host -> device (ftrs: transfer engine, cuda backend)", out["h2d"],
                "engine GB/s"))
    print(table("D2H device -> pinned host (ftrs: driver copy into a pinned pool)", out["d2h"],
                "ftrs GB/s"))
    cols = list(misses[0])
    print("miss latency: one demand miss through a warm engine vs one driver copy (us, median)")
    print("  ".join(f"{c:>15}" for c in cols))
    for m in misses:
        print("  ".join(f"{m[c]:>15}" for c in cols))


if __name__ == "__main__":
    main()
