"""Offload on the demo model over simulated links, beside the bounds of DESIGN.md, one run.

One process loads the demo model once; strategies are swapped on the same weights:
- `resident` gives t_compute: seconds per decode token (batch 1) and the compute time of the
  prefill chunk, measured right before EACH offload run (a shared host's load drifts; each
  row's bound uses its own neighbour, printed as `t_compute_s_per_token`).
- `offload` (`--cache-rate` of all experts, the default policy, lrfu) over `simulated:GBPS` at each `--links` speed,
  with prefetch and without. Each starts from an empty expert cache.

Decode (batch 1, greedy, one chat prompt, `--max-tokens` tokens; only steps with no prefill
token are timed and counted), `--decode-reps` times, each offload run right after a resident
one whose speed is its t_compute; every figure is the median over the reps, and
`achieved_vs_bound_each` lists each rep's: tokens/s, bytes moved per token, hit rate, prefetch precision
(prefetched experts later demanded / prefetches issued, from the Rust counters) and the
predictor's precision/recall (layer l+1's router on layer l's hidden state vs the experts
layer l+1 then used), and the bound of DESIGN.md:
    M = missed lookups per token x expert_bytes
    with prefetch:    tok/s <= 1 / max(t_compute, M / link)
    without prefetch: tok/s <= 1 / (t_compute + M / link)
`bound_all_bytes` is the same with M = every byte moved per token (prefetches included), the
bound the link really imposes when prefetches are wasted. `link_bound` says M / link > t_compute.
The bound without prefetch is serial; a forward computes a layer's experts already in their
slots while its missing ones are on the link, so that row may pass it by that overlap.

Prefill (one chunk of `--chunk` tokens of real text, forward only, empty cache), `--prefill-reps`
times, each offload forward right after a resident one (a shared host's speed drifts by tens of
percent within a minute; the pair shares it):
    overlap_efficiency = max(t_compute, bytes_moved / link) / t_offload   (1.0 = perfect overlap)
printed per rep and as the median, with `transfer_wait_s`: how long the forward waited for
transfers, the part of the link time the overlap did not hide. What the efficiency loses beyond
that wait is CPU the copies took from compute: the simulated link really copies the bytes with
host `memcpy` (so results stay bit-exact), which a DMA engine does not.

Chunk bytes vs chunk size: one resident forward over `--route-tokens` tokens records the
router's choice; for each chunk size C the distinct experts per layer are averaged over every
C-token slice, times layers x expert_bytes, beside the uniform formula E(1 - (1 - k/E)^C).
Routing is causal, so a slice routes as it would in a chunked prefill (up to float reordering).

`--copy-backend cuda` runs on the GPU over the real link instead: the one "link speed" is the
transfer engine's measured H2D GB/s (guard.link.measure_transfer_gbps), the bound's `link`.
`--copy-backend host` does the same on the CPU with the host memcpy as the link.

    python bench/offload.py            # links 0.1,0.5,2 GB/s, 32 decode tokens, chunk 512, 4096 routed
    python bench/offload.py --quick    # 12 decode tokens, chunk 128, 512 routed tokens
    python bench/offload.py --quick --copy-backend cuda    # on a GPU, over its PCIe link
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from types import ModuleType
from typing import Any

import torch

from ftrs.guard.link import cuda_usable, measure_transfer_gbps
from ftrs.llm import LLM
from ftrs.moe.base import MoEStrategy
from ftrs.moe.offload import OffloadStrategy

CHUNK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)



@torch.inference_mode()
def forward_only(llm: LLM, ids: list[int]) -> float:
    """One prefill forward over `ids` (no logits); returns its seconds."""
    t0 = time.perf_counter()
    llm.engine.forward_once(ids)  # returns when the device is done
    return time.perf_counter() - t0


def decode_run(common: ModuleType, llm: LLM, prompt: list[int], tokens: int) -> dict[str, Any]:
    steps = common.run_steps(llm, [prompt], tokens)
    dec = [i for i, s in enumerate(steps) if s.kind == "decode"]
    out = dict(common.decode_summary(steps))
    if dec and steps[dec[-1]].experts:
        before = steps[dec[0] - 1].experts
        out["counters"] = common.counter_delta(steps[dec[-1]].experts, before)
    return out


def offload(llm: LLM, link: float, rate: float, prefetch: bool,
            backend: str = "simulated") -> OffloadStrategy:
    parts = llm.engine.moe_parts()
    spec = f"simulated:{link:g}" if backend == "simulated" else backend
    cfg = dataclasses.replace(llm.config, moe_strategy="offload", moe_cache_rate=rate,
                              moe_cache_size=None, copy_backend=spec, moe_prefetch=prefetch)
    return OffloadStrategy(experts=parts.experts, device=parts.device, config=cfg,
                           routers=parts.routers, kernels=parts.kernels)


def prefill_run(common: ModuleType, llm: LLM, chunk: list[int], link: float, args: argparse.Namespace,
                prefetch: bool, t_first: float) -> dict[str, Any]:
    """`args.prefill_reps` pairs of (resident, offload from an empty cache) forwards of `chunk`.

    `t_first` is a resident time measured just before (the first pair's resident half)."""
    resident = llm.engine.moe_strategy()
    assert resident is not None
    reps: list[dict[str, float]] = []
    for i in range(args.prefill_reps):
        common.use_strategy(llm, resident)
        t_chunk = t_first if i == 0 else forward_only(llm, chunk)
        strat = offload(llm, link, args.cache_rate, prefetch, args.copy_backend)
        try:
            common.use_strategy(llm, strat)
            before = strat.stats()
            t_off = forward_only(llm, chunk)
            after = strat.stats()
        finally:
            strat.close()
            common.use_strategy(llm, resident)
        moved = after["bytes_h2d"] - before["bytes_h2d"]
        t_link = moved / (link * 1e9)
        reps.append({"t_compute_s": t_chunk, "t_offload_s": t_off, "t_transfer_s": t_link,
                     "bytes_moved": moved, "transfer_wait_s": after["transfer_wait_s"],
                     "overlap_efficiency": max(t_chunk, t_link) / t_off})

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in reps), 3)

    return {"link_gbps": link, "prefetch": prefetch, "chunk_tokens": len(chunk),
            "reps": len(reps), "t_compute_s": med("t_compute_s"),
            "t_offload_s": med("t_offload_s"), "bytes_moved": int(med("bytes_moved")),
            "t_transfer_s": med("t_transfer_s"), "transfer_wait_s": med("transfer_wait_s"),
            "overlap_efficiency": med("overlap_efficiency"),
            "overlap_efficiency_each": [round(r["overlap_efficiency"], 3) for r in reps]}


def decode_figures(d: dict[str, Any], t_compute: float, link: float, eb: int,
                   prefetch: bool) -> dict[str, Any]:
    c, n = d["counters"], d["decode_tokens"]
    missed_bytes = c["misses"] * eb / n  # M of DESIGN.md, measured
    moved_bytes = c["bytes_h2d"] / n
    bw = link * 1e9
    if prefetch:
        bound = 1 / max(t_compute, missed_bytes / bw)
        bound_all = 1 / max(t_compute, moved_bytes / bw)
    else:
        bound = 1 / (t_compute + missed_bytes / bw)
        bound_all = 1 / (t_compute + moved_bytes / bw)
    pred, pred_hits, needed = (c["prefetch_predicted"], c["prefetch_predicted_hits"],
                               c["prefetch_needed"])
    return {
        "tok_per_s": round(d["tok_per_s"], 3),
        "decode_tokens": n,
        "bytes_per_token": round(moved_bytes),
        "missed_bytes_per_token": round(missed_bytes),
        "hit_rate": round(c["hits"] / c["lookups"], 4) if c["lookups"] else None,
        "prefetch_issued": c["prefetch_issued"],
        "prefetch_precision": (round(c["prefetch_used"] / c["prefetch_issued"], 4)
                               if c["prefetch_issued"] else None),
        "predictor_precision": round(pred_hits / pred, 4) if pred else None,
        "predictor_recall": round(pred_hits / needed, 4) if needed and prefetch else None,
        "link_bound": missed_bytes / bw > t_compute,
        "bound_tok_per_s": round(bound, 3),
        "achieved_vs_bound": round(d["tok_per_s"] / bound, 3),
        "bound_all_bytes_tok_per_s": round(bound_all, 3),
        "achieved_vs_bound_all_bytes": round(d["tok_per_s"] / bound_all, 3),
    }


def median_row(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every numeric figure over `reps`; `link_bound` if any rep was."""
    out: dict[str, Any] = {}
    for key, first in reps[0].items():
        values = [r[key] for r in reps]
        if isinstance(first, bool):
            out[key] = any(values)
        elif isinstance(first, (int, float)) and all(v is not None for v in values):
            out[key] = round(statistics.median(values), 4)
        else:
            out[key] = first if len(set(map(str, values))) == 1 else values
    out["achieved_vs_bound_each"] = [r["achieved_vs_bound"] for r in reps]
    return out


def chunk_bytes(common: ModuleType, llm: LLM, corpus: list[int], eb: int) -> dict[str, Any]:
    moe, spec = llm.engine.moe_strategy(), llm.engine.moe_parts().spec
    assert moe is not None
    rec = common.RoutingRecorder(moe, keep_ids=True)
    common.use_strategy(llm, rec)
    try:
        secs = forward_only(llm, corpus)
    finally:
        common.use_strategy(llm, rec.inner)
    ids = rec.forwards[-1].ids  # layer -> (N, k)
    e, k, layers, n = spec.num_experts, spec.top_k, len(ids), len(corpus)
    rows = []
    for c in (s for s in CHUNK_SIZES if s <= n):
        per_chunk = [sum(torch.unique(t[i:i + c]).numel() for t in ids.values()) / layers
                     for i in range(0, n - c + 1, c)]
        distinct = statistics.fmean(per_chunk)
        uniform = e * (1 - (1 - k / e) ** c)
        rows.append({"chunk_tokens": c, "chunks_averaged": len(per_chunk),
                     "distinct_per_layer": round(distinct, 3),
                     "uniform_distinct_per_layer": round(uniform, 3),
                     "bytes": round(distinct * layers * eb),
                     "uniform_bytes": round(uniform * layers * eb),
                     "bytes_per_token": round(distinct * layers * eb / c)})
    return {"routed_tokens": n, "forward_s": round(secs, 1), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--links", default="0.1,0.5,2", help="simulated link speeds, GB/s (the demo decodes a token in ~0.07 s on a 2-core CPU: "
                         "these links make it link-bound)")
    ap.add_argument("--cache-rate", type=float, default=0.5,
                    help="fraction of all experts in the cache; prefetch needs room beyond one "
                         "token's working set (MoE layers x top_k), which 0.25 of the demo is not")
    ap.add_argument("--max-tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    ap.add_argument("--decode-reps", type=int, default=3,
                    help="resident/offload decode pairs per link and prefetch setting")
    ap.add_argument("--prefill-reps", type=int, default=3,
                    help="resident/offload prefill pairs per link and prefetch setting")
    ap.add_argument("--route-tokens", type=int, default=4096, help="tokens routed for chunk bytes")
    ap.add_argument("--copy-backend", choices=["simulated", "host", "cuda"], default="simulated",
                    help="simulated: every --links speed on the CPU; cuda: the GPU over its real "
                         "link; host: the CPU with memcpy as the link (both measured once)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.chunk, args.route_tokens = 12, 128, 512
    import _common as common

    device = "cuda" if args.copy_backend == "cuda" else "cpu"
    if device == "cuda" and not cuda_usable():
        raise SystemExit("offload: --copy-backend cuda needs a CUDA device; none is usable here")
    if args.copy_backend == "simulated":
        links = [float(x) for x in args.links.split(",")]
    else:  # the real link, measured through the same transfer engine
        links = [round(measure_transfer_gbps(args.copy_backend)[0], 3)]

    llm = LLM(args.model or common.demo_path(), device=device, dtype="float32",
              kv_tokens=max(4096, args.route_tokens + 256),
              max_prefill_length=max(args.chunk, args.route_tokens, 8192))
    resident: MoEStrategy | None = llm.engine.moe_strategy()
    assert resident is not None, "the model has no experts"
    experts = llm.engine.moe_parts().experts
    eb = experts.expert_bytes
    chat = llm.chat_prompt([{"role": "user", "content": common.PROMPTS[0]}])
    prompt = llm.tokenizer.encode(chat)
    corpus = common.corpus_ids(llm, max(args.chunk, args.route_tokens))
    chunk = corpus[: args.chunk]

    forward_only(llm, chunk[:16])  # warm-up
    decode: list[dict[str, Any]] = []
    prefill: list[dict[str, Any]] = []
    res_tps: list[float] = []
    res_chunk: list[float] = []
    for link in links:
        for prefetch in (True, False):
            # resident right before each offload run: the load of a shared host drifts
            common.use_strategy(llm, resident)
            t_chunk = forward_only(llm, chunk)
            res_chunk.append(t_chunk)
            prefill.append(prefill_run(common, llm, chunk, link, args, prefetch, t_chunk))
            reps = []
            for _ in range(args.decode_reps):
                common.use_strategy(llm, resident)
                t_compute = 1 / decode_run(common, llm, prompt, args.max_tokens)["tok_per_s"]
                res_tps.append(1 / t_compute)
                strat = offload(llm, link, args.cache_rate, prefetch, args.copy_backend)
                common.use_strategy(llm, strat)
                d = decode_run(common, llm, prompt, args.max_tokens)
                reps.append({"t_compute_s_per_token": round(t_compute, 4),
                             **decode_figures(d, t_compute, link, eb, prefetch)})
                strat.close()
                common.use_strategy(llm, resident)
                del strat
            decode.append({"link_gbps": link, "prefetch": prefetch, "reps": len(reps),
                           **median_row(reps)})

    print(json.dumps({
        "bench": "offload",
        "model": args.model or "demo",
        "device": device,
        "copy_backend": args.copy_backend,
        "links_gbps": links,
        "expert_bytes": eb,
        "experts_total": experts.num_experts_total,
        "cache_rate": args.cache_rate,
        "policy": llm.config.moe_cache_policy,
        "torch_threads": torch.get_num_threads(),
        "resident": {"decode_tok_per_s": [round(x, 3) for x in res_tps],
                     "chunk_compute_s": [round(t, 3) for t in res_chunk]},
        "decode": decode,
        "prefill": prefill,
        "chunk_bytes": chunk_bytes(common, llm, corpus[: args.route_tokens], eb),
    }, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
