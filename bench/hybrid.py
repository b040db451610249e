"""Hybrid against offload and "all experts on the CPU" over simulated links, one run.

One process loads the model once (default: the demo MoE as Q4_K_M when it has been built, else
the fp32 demo); the strategies are swapped on the same weights. At each `--links` speed
(`simulated:GBPS`, `--cache-rate` of all experts as device slots, lru, prefetch on):
- `all_cpu`: every routed expert computed on the CPU from the host pool (the `resident`
  strategy on a CPU device, which views the pool in place);
- `offload`: misses fetched over the link into the slot cache, computed on the device;
- `hybrid`: misses split between the link and the CPU by its measured cost model.
Each is a fresh strategy (empty cache) on a short prompt, then `--tokens` greedy tokens at
batch 1 (`--slow-tokens` below 0.5 GB/s, where offload needs seconds per token); only pure
decode steps are timed. The three run back to back per link, `--rounds` times in turn (each
round starting one strategy later, so none always follows the same one), so they share the
host's load; each figure is the median over the rounds (a shared host's speed drifts by tens of
percent within a minute). `hybrid_vs_best_other` is the ratio of those medians;
`hybrid_vs_best_other_paired` the median over rounds of hybrid over the better of the other two
in the same round, which cancels the drift between rounds.

On a CPU-only host the "device" is the CPU: a hit is no faster than computing the same expert
from the pool, so hybrid's cost model sends every miss to the CPU, and each MoE layer runs
resident's code over the pool plus three counters: hybrid is all_cpu within the host's noise.
The output says which device it ran on.

`--device cuda` runs the same sweep on a GPU over its real link: the `cuda` copy backend paced
to each `--links` speed by the transfer engine's token bucket (`--pcie-pacing`; 0 = unpaced,
the link's own rate), the dense part on the GPU, every strategy built with the engine's kernels
(the fused Triton MoE) and run with its decode CUDA graphs, as `serve` runs them. There
`all_cpu` is hybrid with the link priced out and prefetch off, held in its "cpu" layer mode
(eager layers and a graph's host steps alike): no lookup, no fetch, every routed expert on the
CPU kernels in one call a layer, everything else on the GPU, as llama.cpp's `-ot exps=CPU` runs
a model. A GPU row carries `split_layer_share` (the share of layer calls hybrid ran split) and
`layer_ms` (its per-bucket estimate of each mode's time). `--model shaped` benches
`bench/shaped.py`'s demo-shaped Q4_K_M checkpoint of a random initialisation (hosts without
the demo: an offline GPU machine).

Before the sweep, `layer_overhead` times the MoE layers alone: hybrid (CPU device, cache 0.5)
against resident on the same decode-shaped inputs (one token, each layer's own routing), one
pass of every MoE layer with the per-step calls (`begin_forward`, `end_forward`, `stats`)
each, the two strategies alternating pass by pass; it prints the median of the per-pair ratios.

    python bench/hybrid.py                 # links 0.1 0.5 2 8 GB/s, cache 0.5
    python bench/hybrid.py --model demo    # the fp32 demo
    python bench/hybrid.py --links         # the MoE-layer overhead alone
    python bench/hybrid.py --device cuda --model shaped --links 0.1 0.5 2 8 0
    python bench/hybrid.py --links --profile 0.5   # where the host's time goes
    python bench/hybrid.py --device cuda --model shaped --cpu-expert-threads 4   # fewer cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import _common as common
from ftrs import _core
from ftrs.config import ftrs_home
from ftrs.layers.moe import route_by
from ftrs.llm import LLM
from ftrs.moe.base import MoEStrategy
from ftrs.moe.hybrid import CostModel, HybridStrategy, LayerModes
from ftrs.moe.offload import OffloadStrategy

Q4_DEMO = "smollm2-135m-instruct-moe8x2.Q4_K_M.gguf"


def default_model() -> str:
    q4 = ftrs_home() / "models" / Q4_DEMO
    return str(q4) if q4.is_file() else common.demo_path()


def make(llm: LLM, name: str, link: float, rate: float) -> MoEStrategy:
    parts, resident = llm.engine.moe_parts(), llm.engine.moe_strategy()
    assert resident is not None
    on_gpu = parts.device.type == "cuda"
    if name == "all_cpu" and not on_gpu:
        return resident  # the resident strategy the LLM was built with
    link_cfg = ({"copy_backend": "cuda", "pcie_pacing": link or None} if on_gpu
                else {"copy_backend": f"simulated:{link:g}"})
    cfg = dataclasses.replace(llm.config, moe_strategy=name if name == "offload" else "hybrid",
                              moe_cache_rate=rate, cpu_expert_threads=int(_core.quant_threads()),
                              moe_cache_size=None, moe_prefetch=name != "all_cpu", **link_cfg)
    cls = OffloadStrategy if name == "offload" else HybridStrategy
    strat = cls(experts=parts.experts, device=parts.device, config=cfg, routers=parts.routers,
                kernels=parts.kernels)  # the engine's (on a GPU: the fused Triton MoE)
    if name == "all_cpu":  # the link priced out: every miss to the CPU, no slot ever filled
        assert isinstance(strat, HybridStrategy)
        strat.cost = CostModel(link_bytes_per_s=1.0, link_latency_s=1.0,
                               cpu_s_per_token=1e-9, learn=False)
        strat.modes = LayerModes(explore_share=0, learn=False)  # every layer call: "cpu"
        strat.modes.seconds = {("cpu", 1 << b): 0.0 for b in range(16)}
        strat.modes.seconds |= {("split", 1 << b): 1.0 for b in range(16)}
    return strat


def decode(llm: LLM, strat: MoEStrategy, prompt: list[int], tokens: int) -> dict[str, Any]:
    resident = llm.engine.moe_strategy()
    assert resident is not None
    common.use_strategy(llm, strat)
    try:
        steps = common.run_steps(llm, [prompt], tokens)
    finally:
        common.use_strategy(llm, resident)
        if strat is not resident:
            strat.close()
    dec = [s for s in steps if s.kind == "decode"]
    out: dict[str, Any] = {"tok_per_s": round(common.decode_summary(steps)["tok_per_s"], 3),
                           "decode_tokens": sum(s.decode_tokens for s in dec)}
    if dec and dec[-1].experts:
        c = common.counter_delta(dec[-1].experts, steps[steps.index(dec[0]) - 1].experts)
        n = max(out["decode_tokens"], 1)
        out["mb_per_token"] = round(c.get("bytes_h2d", 0) / n / 1e6, 2)
        if "cpu_computed" in c:
            out |= {f"{k}_per_token": round(c[k] / n, 2)
                    for k in ("device_computed", "fetched", "cpu_computed")}
            if c.get("fill_issued"):  # the CPU's experts copied in on the idle link
                out |= {f"{k}_per_token": round(c[k] / n, 2) for k in ("fill_issued", "fill_used")}
        if c.get("layers_split", 0) + c.get("layers_all_cpu", 0):  # a GPU's layer modes
            out["split_layer_share"] = round(
                c["layers_split"] / (c["layers_split"] + c["layers_all_cpu"]), 3)
            out["layer_ms"] = {k: round(v * 1e3, 3)
                               for k, v in dec[-1].experts["split_layer_seconds"].items()}
    return out


def profile(llm: LLM, link: float, rate: float, prompt: list[int], tokens: int,
            top: int) -> str:
    """cProfile of the decode of offload, hybrid held on its split, and all_cpu at `link`:
    where the host's time goes. Each strategy decodes once unprofiled (warm-up: graphs captured,
    kernels compiled, the cache filled), then once under the profiler; `top` functions by own
    time and, of ftrs's own, by cumulative time."""
    import cProfile
    import io
    import pstats

    resident = llm.engine.moe_strategy()
    assert resident is not None
    out = io.StringIO()
    for name in ("offload", "hybrid", "all_cpu"):
        strat = make(llm, name, link, rate)
        if name == "hybrid":
            assert isinstance(strat, HybridStrategy)
            strat.modes = LayerModes(explore_share=0, learn=False)  # every layer call: split
            strat.modes.seconds = {(m, 1 << b): t for b in range(16)
                                   for m, t in (("split", 0.0), ("cpu", 1.0))}
        common.use_strategy(llm, strat)
        prof = cProfile.Profile()
        try:
            common.run_steps(llm, [prompt], tokens)
            prof.enable()
            steps = common.run_steps(llm, [prompt], tokens)
            prof.disable()
        finally:
            common.use_strategy(llm, resident)
            if strat is not resident:
                strat.close()
        label = "hybrid (split only)" if name == "hybrid" else name
        print(f"== profile {label} at {link:g} GB/s: "
              f"{common.decode_summary(steps)['tok_per_s']:.2f} tok/s", file=out)
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("ftrs", top)
    return out.getvalue()


def layer_overhead(llm: LLM, passes: int, seed: int = 0) -> dict[str, Any]:
    """Seconds of one pass over every MoE layer, resident against hybrid, alternating (module
    docstring); the median of the per-pair ratios hybrid / resident."""
    parts, resident = llm.engine.moe_parts(), llm.engine.moe_strategy()
    assert resident is not None and parts.device.type == "cpu"
    spec = parts.spec
    gen = torch.Generator().manual_seed(seed)
    inputs = {}
    for layer in spec.moe_layers:
        x = torch.randn((1, spec.hidden_size), generator=gen)  # (1, hidden): one decode token
        ids, w = route_by(spec, parts.routers[layer], x)
        inputs[layer] = (x, ids, w)
    hybrid = make(llm, "hybrid", 8.0, 0.5)

    def one_pass(strat: MoEStrategy) -> float:
        t0 = time.perf_counter()
        strat.begin_forward(1)
        for layer, (x, ids, w) in inputs.items():
            strat.forward(layer, x, ids, w)
        strat.end_forward()
        strat.stats()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"resident": [], "hybrid": []}
    try:
        for strat in (resident, hybrid, resident, hybrid):  # warm-up
            one_pass(strat)
        for i in range(passes):
            order = [("resident", resident), ("hybrid", hybrid)]
            for name, strat in order if i % 2 == 0 else order[::-1]:
                times[name].append(one_pass(strat))
    finally:
        hybrid.close()
    ratios = [h / r for h, r in zip(times["hybrid"], times["resident"])]
    n = len(spec.moe_layers)
    return {"passes": passes, "moe_layers": n,
            "resident_us_per_layer": round(statistics.median(times["resident"]) / n * 1e6, 1),
            "hybrid_us_per_layer": round(statistics.median(times["hybrid"]) / n * 1e6, 1),
            "hybrid_over_resident": round(statistics.median(ratios), 4),
            "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)]}


def median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over the rounds; tokens/s of each round beside it."""
    out = {k: round(statistics.median(r[k] for r in runs), 3) if isinstance(v, (int, float))
           else runs[-1][k] for k, v in runs[0].items()}  # dicts: the last round's
    out["tok_per_s_each"] = [r["tok_per_s"] for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the Q4_K_M demo, else the fp32 demo")
    ap.add_argument("--links", type=float, nargs="*", default=[0.1, 0.5, 2.0, 8.0])
    ap.add_argument("--cache-rate", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--slow-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layer-passes", type=int, default=60,
                    help="passes of the MoE-layer overhead bench (0: skip it; CPU device only)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the real link paced to each --links speed (0: unpaced)")
    ap.add_argument("--shaped-layers", type=int, default=30, help="layers of --model shaped")
    ap.add_argument("--cpu-expert-threads", type=int, default=None, metavar="N",
                    help="the CPU kernels' threads for every strategy (default: physical cores "
                         "minus one): a host of fewer cores on the same machine")
    ap.add_argument("--profile", type=float, default=None, metavar="GBPS",
                    help="after the sweep, cProfile offload's, hybrid's (split only) and all_cpu's "
                         "decode at this link")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if args.cpu_expert_threads is not None:  # the kernels' pool, for every strategy's calls
        if args.cpu_expert_threads < 1:
            raise SystemExit("hybrid: --cpu-expert-threads must be at least 1")
        _core.quant_set_threads(args.cpu_expert_threads)
    if gpu and not torch.cuda.is_available():
        raise SystemExit("hybrid: --device cuda needs a CUDA device; none is usable here")
    if args.model == "shaped":
        from shaped import make_shaped_q4_k_m

        model = str(make_shaped_q4_k_m(Path(tempfile.mkdtemp()) / "shaped-q4_k_m.gguf",
                                       args.shaped_layers))
    else:
        model = default_model() if args.model in (None, "demo-q4") else (
            common.demo_path() if args.model == "demo" else args.model)
    if gpu:  # the LLM's own strategy only holds the place: each run builds its own
        llm = LLM(model, device="cuda", moe_strategy="offload", moe_cache_rate=0.05,
                  moe_prefetch=False, kv_tokens=4096)
    else:
        llm = LLM(model, device="cpu", dtype="float32", moe_strategy="resident", kv_tokens=4096)
    parts = llm.engine.moe_parts()
    prompt = llm.tokenizer.encode("The capital of France is")
    rows = []
    t0 = time.perf_counter()
    overhead = (layer_overhead(llm, args.layer_passes)
                if args.layer_passes > 0 and not gpu else None)
    for link in args.links:
        n = args.slow_tokens if 0 < link < 0.5 else args.tokens
        row: dict[str, Any] = {"link_gbps": link}
        runs: dict[str, list[dict[str, Any]]] = {"all_cpu": [], "offload": [], "hybrid": []}
        names = list(runs)
        for r in range(args.rounds):  # each round starts one strategy later: no fixed order
            for name in names[r % 3:] + names[:r % 3]:
                got = decode(llm, make(llm, name, link, args.cache_rate), prompt, n)
                if name == "all_cpu":  # its layer modes are injected, not measured
                    got.pop("layer_ms", None)
                    got.pop("split_layer_share", None)
                runs[name].append(got)
        for name, each in runs.items():
            row[name] = median(each)
        best = max(row["offload"]["tok_per_s"], row["all_cpu"]["tok_per_s"])
        row["hybrid_vs_offload"] = round(row["hybrid"]["tok_per_s"]
                                         / row["offload"]["tok_per_s"], 2)
        row["hybrid_vs_best_other"] = round(row["hybrid"]["tok_per_s"] / best, 3)
        row["hybrid_vs_best_other_paired"] = round(statistics.median(
            h["tok_per_s"] / max(a["tok_per_s"], o["tok_per_s"])
            for h, a, o in zip(runs["hybrid"], runs["all_cpu"], runs["offload"], strict=True)), 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress: a row per link
    prof = (profile(llm, args.profile, args.cache_rate, prompt, args.tokens, 25)
            if args.profile is not None else None)
    llm.close()
    print(json.dumps({
        "model": Path(model).name, "device": str(parts.device),
        "note": ("the 'device' is the CPU on this host: device slots live in host memory and "
                 "a hit computes on the same cores as a CPU expert") if parts.device.type == "cpu"
                else (f"device is a GPU ({torch.cuda.get_device_name()}); links are the cuda "
                      "backend paced to each speed (0: unpaced); all_cpu is hybrid with the "
                      "link priced out"),
        "expert_bytes": parts.experts.expert_bytes, "cache_rate": args.cache_rate,
        "cpu_expert_threads": int(_core.quant_threads()),
        "batch": 1, "wall_s": round(time.perf_counter() - t0, 1),
        "moe_layer_overhead": overhead, "rows": rows}, indent=1))
    if prof:
        print(prof)


if __name__ == "__main__":
    main()
