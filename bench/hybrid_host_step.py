"""The host work of hybrid's decode-graph split against its "cpu" layer mode, on the CPU.

On a GPU each decode MoE layer's host step (`moe.hybrid_graph.host_step`, between the captured
segments) runs either the split (the next layer's prefetch ranked, the slot lookup, the CPU
share, the slot table) or every routed expert on the CPU in one kernel call; the layer modes
pick whichever the wall clock finds cheaper. This bench times the two host steps alone on this
machine's CPU, over `bench/shaped.py`'s demo-shaped Q4_K_M, with the device priced as a GPU
(the cost model's `device_is_cpu` off, prefetch forced on) and a simulated link: what a split
layer's host work costs beside the CPU experts it saves. It cannot show a GPU's read-backs
and launches, only the host's share; the fused kernel runs under Triton's interpreter, so the
captured device step is not called (nothing here waits for it).

Four host-step variants per layer, interleaved step by step over the same routed inputs
(one decode token, each layer's own router): `cpu` (the layer mode "cpu"), `split` (the split,
its CPU share in one call: a GPU's path), `split_by_expert` (the same split, its CPU share
expert by expert: a CPU device's path) and `split_no_fill` (the split without the fill of its
CPU share on the idle link, `HybridStrategy.fill`: the cache then holds only what the router's
prefetch guessed). Prints, per variant, the median host-step time per layer and its ratio to
`cpu`, the experts computed on the device, fetched and on the CPU, and the fills started and
later hit. The steps are `--steps` routed tokens replayed `--rounds` times after a warm-up of
five (with `--fresh`, every round routes new tokens instead, so no step repeats one the cache
has seen; replaying favours a warm cache); the "device" hits are free here (the captured
kernel is not run), as they nearly are on a GPU, so the split's host time falls with its hit
rate. Each layer's input is random, independent from token to token unless `--correlation R`
makes it R times the previous token's plus fresh noise (unit variance either way): consecutive
tokens then share experts, as text's do, and recency has something to find.

    python bench/hybrid_host_step.py [--link 0.1] [--layers 30] [--steps 40] [--rounds 3]
                                     [--fresh] [--correlation 0.9] [--policy lru]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernel's views on the CPU

import torch

from ftrs.config import EngineConfig
from ftrs.kernels import select_kernels, triton_runs_on
from ftrs.layers.moe import route
from ftrs.models.load import load_model
from ftrs.moe.base import create_strategy, import_strategy
from ftrs.moe.hybrid import CostModel, HybridStrategy, LayerModes
from shaped import make_shaped_q4_k_m

CPU = torch.device("cpu")


def make(path: Path, loaded: Any, mode: str, link: float, one_call: bool,
         policy: str) -> HybridStrategy:
    """A hybrid strategy held on `mode`, the device priced as a GPU (module doc)."""
    import_strategy("hybrid")
    cfg = EngineConfig(model=str(path), moe_strategy="hybrid", moe_cache_rate=0.5,
                       moe_prefetch=True, copy_backend=f"simulated:{link:g}",
                       moe_cache_policy=policy)
    routers = {la: loaded.dense[f"{la}.router"] for la in loaded.spec.moe_layers}
    h = create_strategy("hybrid", experts=loaded.experts, device=CPU, config=cfg,
                        routers=routers, kernels=select_kernels("triton", CPU))
    assert isinstance(h, HybridStrategy)
    h.prefetch = mode == "split"  # a CPU device turns it off; a GPU's split prefetches
    h.one_call_share = one_call
    h.cost = CostModel(link * 1e9, 10e-6, cpu_s_per_token=h.experts.expert_bytes / 8e9)
    h.modes = LayerModes(explore_share=0, learn=False)
    h.modes.seconds = {(m, 1 << b): float(m != mode) for b in range(16) for m in ("split", "cpu")}
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--link", type=float, default=0.1, help="simulated link, GB/s")
    ap.add_argument("--layers", type=int, default=30, help="layers of the shaped model")
    ap.add_argument("--steps", type=int, default=40, help="decode steps of routed inputs")
    ap.add_argument("--rounds", type=int, default=3, help="passes over those steps")
    ap.add_argument("--fresh", action="store_true",
                    help="route new tokens in every round instead of replaying the steps")
    ap.add_argument("--correlation", type=float, default=0.0,
                    help="each layer's input is this much the previous token's (0: independent)")
    ap.add_argument("--policy", default=EngineConfig.moe_cache_policy,
                    help="the expert cache's eviction policy (default: the engine's)")
    args = ap.parse_args()
    if not triton_runs_on(CPU):
        raise SystemExit("hybrid_host_step: needs Triton's interpreter (TRITON_INTERPRET=1)")
    path = make_shaped_q4_k_m(Path(tempfile.mkdtemp()) / "shaped-q4_k_m.gguf", args.layers)
    loaded = load_model(str(path), CPU, torch.float32, progress=False)
    spec = loaded.spec
    if not 0.0 <= args.correlation < 1.0:
        raise SystemExit("hybrid_host_step: --correlation must be in [0, 1)")
    gen = torch.Generator().manual_seed(0)
    keep, new = args.correlation, (1.0 - args.correlation ** 2) ** 0.5  # unit variance
    prev: dict[int, torch.Tensor] = {}
    steps = []
    warm = min(5, args.steps - 1)
    n_steps = warm + (args.steps - warm) * args.rounds if args.fresh else args.steps
    for _ in range(n_steps):
        step = []
        for layer in spec.moe_layers:
            x = new * torch.randn(1, spec.hidden_size, generator=gen)
            if layer in prev:
                x += keep * prev[layer]
            prev[layer] = x
            router = loaded.dense[f"{layer}.router"]
            assert isinstance(router, torch.Tensor)
            ids, w = route(x, router, spec.top_k, spec.norm_topk_prob)
            step.append((layer, x, ids, w))
        steps.append(step)
    variants = {"cpu": make(path, loaded, "cpu", args.link, True, args.policy),
                "split": make(path, loaded, "split", args.link, True, args.policy),
                "split_by_expert": make(path, loaded, "split", args.link, False, args.policy),
                "split_no_fill": make(path, loaded, "split", args.link, True, args.policy)}
    variants["split_no_fill"].fill = lambda li, experts: None  # type: ignore[method-assign]

    def run(h: HybridStrategy, step: list[Any]) -> float:
        h.begin_forward(1)
        t0 = time.perf_counter()
        for layer, x, ids, w in step:
            h.host_step(layer, ids, w, 1, x)
        took = time.perf_counter() - t0
        h.end_forward()
        return took / len(step)

    rounds = [steps[warm:]] * args.rounds
    if args.fresh:
        per = args.steps - warm
        rounds = [steps[warm + r * per:warm + (r + 1) * per] for r in range(args.rounds)]
    times: dict[str, list[float]] = {k: [] for k in variants}
    t_start = time.perf_counter()
    try:
        for step in steps[:warm]:  # caches filled, the estimates' first calls
            for h in variants.values():
                run(h, step)
        for round_steps in rounds:
            for step in round_steps:
                for name, h in variants.items():
                    times[name].append(run(h, step))
        base = statistics.median(times["cpu"])
        out: dict[str, Any] = {"link_gbps": args.link, "layers": len(spec.moe_layers),
                               "fresh_tokens": args.fresh, "correlation": args.correlation,
                               "policy": args.policy,
                               "wall_s": round(time.perf_counter() - t_start, 1)}
        for name, h in variants.items():
            s = h.stats()
            med = statistics.median(times[name])
            out[name] = {"us_per_layer": round(med * 1e6, 1),
                         "over_cpu": round(med / base, 3),
                         "quartiles_us": [round(q * 1e6, 1)
                                          for q in statistics.quantiles(times[name], n=4)],
                         "device_fetched_cpu": [s["device_computed"], s["fetched"],
                                                s["cpu_computed"]],
                         "fills_issued_used": [s["fill_issued"], s["fill_used"]]}
    finally:
        for h in variants.values():
            h.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
