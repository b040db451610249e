"""Which family of the Rust CPU kernels is fastest on this host, measured (`ftrs doctor`).

`kernel="auto"` runs the best family the CPU has (AVX-512 where there is VNNI, else AVX2), and
each family's kernels were chosen and tuned on the hosts the project measured; on another
microarchitecture (an AVX-512 part that lowers its clock under 512-bit work, say) another
family may be faster. `kernel_timings` times one matmul per common block type of K-quant files
at two batch sizes in each SIMD family, the families taking turns, best of `reps`, one thread;
`recommend_kernels` names the family with the least time over all of them, and keeps `auto`
unless another family is faster by more than `margin`. The setting is `--cpu-kernels`
(`EngineConfig.cpu_kernels`): the engine does not switch by itself, so one host gives the same
bits run after run.
"""

from __future__ import annotations

import time
from typing import Any

#: the block types of common GGUF files' experts and projections (Q4_K_M, Q5_K_M, Q6_K, Q8_0)
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
ROWS = COLS = 2048
BATCHES = (1, 8)


def kernel_timings(types: tuple[str, ...] = TYPES, rows: int = ROWS, cols: int = COLS,
                   batches: tuple[int, ...] = BATCHES, reps: int = 5
                   ) -> dict[str, dict[str, dict[str, float]]]:
    """µs a call, {type: {"n1": {family: µs}, ...}}, for the SIMD families this CPU runs
    (portable alone where it has none)."""
    import numpy as np

    from ftrs import _core
    from ftrs.quant.fixtures import random_blocks

    families = [k for k in _core.quant_kernels() if k != "portable"] or ["portable"]
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for t in types:
        w = random_blocks(t, rows, cols, rng).reshape(-1).copy()
        for n in batches:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            o = np.empty((n, rows), np.float32)
            best = dict.fromkeys(families, float("inf"))
            for fam in families:  # first touch and the pool's wake-up, untimed
                _core.quant_matmul(t, w, x, o, rows, cols, 1, fam)
            for _ in range(reps):
                for fam in families:  # in turns: a drifting host load reaches them alike
                    t0 = time.perf_counter()
                    _core.quant_matmul(t, w, x, o, rows, cols, 1, fam)
                    best[fam] = min(best[fam], time.perf_counter() - t0)
            out.setdefault(t, {})[f"n{n}"] = {f: round(s * 1e6, 1) for f, s in best.items()}
    return out


def recommend_kernels(timings: dict[str, dict[str, dict[str, float]]], auto: str,
                      margin: float = 0.03) -> dict[str, Any]:
    """The `--cpu-kernels` setting from `timings` (`kernel_timings`): the family with the least
    summed time, or `auto` (which runs `auto`'s family) when that one is within `margin` of it."""
    totals: dict[str, float] = {}
    for per_batch in timings.values():
        for row in per_batch.values():
            for fam, us in row.items():
                totals[fam] = totals.get(fam, 0.0) + us
    fastest = min(totals, key=lambda f: totals[f])
    keep = auto in totals and totals[auto] <= totals[fastest] * (1 + margin)
    return {"totals_us": {f: round(v, 1) for f, v in totals.items()}, "fastest": fastest,
            "auto": auto, "setting": "auto" if keep else fastest}
