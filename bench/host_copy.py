"""Host copy bandwidth: ftrs's host backend (`_core.host_copy`) beside `torch.Tensor.copy_` and
`numpy.copyto` on the same buffers, interleaved in one run (DESIGN.md "Performance method").

Prints one JSON object: per size, GB/s of each method (median of `--reps` rounds after a warm-up
round) and `ratio_vs_torch` / `ratio_vs_numpy` = ftrs / reference (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from ftrs import _core


def measure(n: int, reps: int, threads: int) -> dict[str, float]:
    """GB/s of the three copies of `n` bytes between the same two buffers.

    The methods run interleaved (one of each per round, after a warm-up round) so background
    load hits all three alike; each figure is the median over `reps` rounds.
    """
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), dst.numpy()
    methods: dict[str, Callable[[], object]] = {
        "ftrs": lambda: _core.host_copy(dst.data_ptr(), src.data_ptr(), n, threads),
        "torch": lambda: dst.copy_(src),
        "numpy": lambda: np.copyto(dst_np, src_np),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    for round_ in range(reps + 1):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            if round_ > 0:
                times[name].append(time.perf_counter() - t0)
        if round_ == 0:
            dst.zero_()
            _core.host_copy(dst.data_ptr(), src.data_ptr(), n, threads)
            assert torch.equal(dst, src), "host_copy produced different bytes"
    g = {k: n / statistics.median(v) / 1e9 for k, v in times.items()}
    return {
        "size_mib": n >> 20,
        "ftrs_host_copy_gbps": round(g["ftrs"], 2),
        "torch_copy_gbps": round(g["torch"], 2),
        "numpy_copyto_gbps": round(g["numpy"], 2),
        "ratio_vs_torch": round(g["ftrs"] / g["torch"], 3),
        "ratio_vs_numpy": round(g["ftrs"] / g["numpy"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="host_copy threads (0 = all cores)")
    args = ap.parse_args()

    results = [measure(mib << 20, args.reps, args.threads) for mib in args.sizes_mib]
    out = {
        "bench": "host_copy",
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "target_ratio": 0.9,
        "results": results,
        "min_ratio_vs_torch": min(r["ratio_vs_torch"] for r in results),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
