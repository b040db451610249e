"""Host copy bandwidth: ftrs's host backend (`_core.host_copy`) beside `torch.Tensor.copy_` and
`numpy.copyto` on the same buffers, interleaved in one run (DESIGN.md "Performance method").

Two cases per size:
- `cold` (what the engine does): each copy takes the next block of a source pool far larger
  than the last-level cache into the next block of a destination pool, so bytes come from and
  go to DRAM, as expert copies from the host pool into the slot buffer do;
- `hot`: the same two buffers every time, so they stay in cache and the per-call cost of each
  method (thread wake-ups, dispatch) shows.

One sample is a burst of back-to-back copies of at least `--burst-mib` MiB (the experts of a
layer arrive as a burst too); the three methods take turns sample by sample, after a warm-up
round, so background load hits all alike. Figures are the median GB/s over `--reps` samples.

Prints one JSON object with `ratio_vs_torch` / `ratio_vs_numpy` per size and case: the median
over rounds of ftrs's speed over the reference's in the same round (target >= 0.9).
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

POOL_BYTES = 512 << 20
"""Source pool of the cold case (16x the 32 MiB L3 of a common server part, more than most)."""


def measure(n: int, reps: int, threads: int, burst_bytes: int, hot: bool) -> dict[str, object]:
    """GB/s of the three copies of `n`-byte blocks, each a median over `reps` bursts."""
    blocks = 1 if hot else max(4, POOL_BYTES // n)
    src = torch.randint(0, 256, (blocks, n), dtype=torch.uint8)
    dst = torch.zeros((1 if hot else max(4, blocks // 2), n), dtype=torch.uint8)
    burst = max(1, burst_bytes // n)
    pairs = [(dst[i % dst.shape[0]], src[i % blocks]) for i in range(max(blocks, burst))]
    addrs = [(d.data_ptr(), s.data_ptr()) for d, s in pairs]
    np_pairs = [(d.numpy(), s.numpy()) for d, s in pairs]
    cursor = 0

    def run(copy_one: Callable[[int], object]) -> float:
        nonlocal cursor
        start = cursor
        cursor += burst
        t0 = time.perf_counter()
        for i in range(start, start + burst):
            copy_one(i % len(pairs))
        return time.perf_counter() - t0

    methods: dict[str, Callable[[int], object]] = {
        "ftrs": lambda i: _core.host_copy(addrs[i][0], addrs[i][1], n, threads),
        "torch": lambda i: pairs[i][0].copy_(pairs[i][1]),
        "numpy": lambda i: np.copyto(*np_pairs[i]),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for round_ in range(reps + 1):
        # Rotate who goes first, so none always follows the same neighbour.
        for name in order[round_ % 3 :] + order[: round_ % 3]:
            t = run(methods[name])
            if round_ > 0:
                times[name].append(t)
    d, s = pairs[cursor % len(pairs)]
    d.zero_()
    _core.host_copy(d.data_ptr(), s.data_ptr(), n, threads)
    assert torch.equal(d, s), "host_copy produced different bytes"
    g = {k: n * burst / statistics.median(v) / 1e9 for k, v in times.items()}

    def paired(ref: str) -> float:
        # Median over rounds of the per-round speed ratio: the two figures of one round share
        # the machine's state, so this is steadier than a ratio of two medians.
        return statistics.median(r / f for f, r in zip(times["ftrs"], times[ref], strict=True))

    return {
        "case": "hot" if hot else "cold",
        "size_mib": round(n / (1 << 20), 3),
        "copies_per_sample": burst,
        "ftrs_host_copy_gbps": round(g["ftrs"], 2),
        "torch_copy_gbps": round(g["torch"], 2),
        "numpy_copyto_gbps": round(g["numpy"], 2),
        "ratio_vs_torch": round(paired("torch"), 3),
        "ratio_vs_numpy": round(paired("numpy"), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--burst-mib", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=0, help="host_copy threads (0 = all cores)")
    ap.add_argument("--case", choices=["cold", "hot", "both"], default="both")
    args = ap.parse_args()

    cases = [False, True] if args.case == "both" else [args.case == "hot"]
    burst = int(args.burst_mib * (1 << 20))
    results = [
        measure(int(mib * (1 << 20)), args.reps, args.threads, burst, hot)
        for hot in cases
        for mib in args.sizes_mib
    ]
    out = {
        "bench": "host_copy",
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "target_ratio": 0.9,
        "results": results,
        "min_ratio_vs_torch": {
            case: min(r["ratio_vs_torch"] for r in results if r["case"] == case)  # type: ignore[type-var]
            for case in {str(r["case"]) for r in results}
        },
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
