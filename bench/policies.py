"""Cache policies on real routing traces: hit rates of lru, lfru and belady (the MIN bound).

The demo model (SmolLM2-135M upcycled to 8 experts, top-2, 30 layers) serves real chat prompts
one request after another (batch 1, greedy, `--max-tokens` each) with the resident strategy; a
`RoutingRecorder` keeps the distinct experts of every MoE layer of every forward. That trace —
one entry per layer-step, as the offload strategy would look it up — is replayed by
`ftrs._core.simulate_cache` at 25%, 50% and 75% of all experts. Routing does not depend on the
strategy (offload equals resident bit for bit), so the trace is the one offload would see.

Two traces are reported: `all` (prefill and decode forwards) and `decode` (single-token
forwards only, the steady state of a stream). `belady` is Belady's MIN on the same trace: no
online policy can beat it; `*_vs_belady` is the fraction of the bound each policy reaches.

`engine` then serves the same chats again through the offload strategy itself, once per online
policy (`--engine-rate` of all experts, prefetch on as `serve` runs it, the `host` copy
backend: the bytes are what counts here, not the link's speed), each from an empty cache, and
reports the transfer engine's own counters: the lookup hit rate (prefetched experts that were
ready count as hits), the bytes copied, misses, prefetches issued and prefetches later used,
per token, all forwards and decode forwards alone.
Routing does not depend on the strategy, so every policy serves the same lookups.

The prefix cache is off for the whole run (recording and every replay): each prompt is
prefilled in full every time, so the trace and each policy's `engine` run cover the same work,
the whole prompt of every chat plus its decode (`workload.tokens`: prompt tokens + the
`max_tokens - 1` decode forwards of each chat; `engine.<policy>.all.tokens` equals it). With it
on, a replay would prefill only the tail of each prompt that the recording (or an earlier
policy's replay) had not already cached, and the policies would start from different states.

    python bench/policies.py            # 8 prompts x 64 tokens
    python bench/policies.py --quick    # 3 prompts x 16 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from ftrs import _core
from ftrs.llm import LLM
from ftrs.moe.offload import OffloadStrategy

POLICIES = ("lru", "lfru", "lrfu", "belady")
ONLINE = POLICIES[:-1]
RATES = (0.25, 0.5, 0.75)



def hit_rates(trace: list[list[tuple[int, int]]], total: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rate in RATES:
        cap = max(1, round(rate * total))
        row: dict[str, Any] = {"slots": cap}
        for policy in POLICIES:
            hits, misses = _core.simulate_cache(trace, cap, policy)
            row[policy] = round(hits / (hits + misses), 4)
        for policy in ONLINE:
            row[f"{policy}_vs_belady"] = round(row[policy] / row["belady"], 4) if row["belady"] else None
        out[f"{int(rate * 100)}%"] = row
    return out


def engine_run(common: Any, llm: LLM, chats: list[str], policy: str, rate: float,
                max_tokens: int) -> dict[str, Any]:
    """The chats through an offload strategy with `policy`; its counters, all and decode."""
    parts = llm.engine.moe_parts()
    cfg = dataclasses.replace(llm.config, moe_strategy="offload", moe_cache_rate=rate,
                              moe_cache_size=None, copy_backend="host", moe_cache_policy=policy)
    strat = OffloadStrategy(experts=parts.experts, device=parts.device, config=cfg,
                            routers=parts.routers, kernels=parts.kernels)
    common.use_strategy(llm, strat)
    keys = ("hits", "misses", "bytes_h2d", "prefetch_issued", "prefetch_used")
    tot = {"all": dict.fromkeys(keys, 0), "decode": dict.fromkeys(keys, 0)}
    tokens = {"all": 0, "decode": 0}
    for text in chats:
        prev = strat.stats()
        for st in common.run_steps(llm, [llm.tokenizer.encode(text)], max_tokens):
            delta = common.counter_delta(st.experts, prev)
            prev = st.experts
            parts_of = ("all", "decode") if st.kind == "decode" else ("all",)
            for part in parts_of:
                tokens[part] += st.decode_tokens + st.prefill_tokens
                for k in keys:
                    tot[part][k] += delta[k]
    strat.close()
    out: dict[str, Any] = {"slots": strat.num_slots}
    for part, c in tot.items():
        looked = c["hits"] + c["misses"]
        out[part] = {"hit_rate": round(c["hits"] / looked, 4) if looked else None,
                     "mb_per_token": round(c["bytes_h2d"] / tokens[part] / 1e6, 2),
                     "tokens": tokens[part],
                     "misses_per_token": round(c["misses"] / tokens[part], 2),
                     "prefetches_per_token": round(c["prefetch_issued"] / tokens[part], 2),
                     "prefetches_used_per_token": round(c["prefetch_used"] / tokens[part], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--prompts", type=int, default=None, help="chats (default 8; --quick 3)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens per chat (default 64; --quick 16)")
    ap.add_argument("--quick", action="store_true",
                    help="3 prompts x 16 tokens, unless --prompts or --max-tokens says otherwise")
    ap.add_argument("--engine-rate", type=float, default=0.5,
                    help="expert cache of the engine runs, a fraction of all experts")
    ap.add_argument("--no-engine", action="store_true", help="replay the trace only")
    args = ap.parse_args()
    if args.prompts is None:
        args.prompts = 3 if args.quick else 8
    if args.max_tokens is None:
        args.max_tokens = 16 if args.quick else 64
    import _common as common

    t0 = time.perf_counter()
    # the prefix cache off: every run below prefills each prompt in full
    llm = LLM(args.model or common.demo_path(), kv_tokens=8192, device="cpu", prefix_cache=False)
    moe = llm.engine.moe_strategy()
    assert moe is not None, "the model has no routed experts"
    parts = llm.engine.moe_parts()
    rec = common.RoutingRecorder(moe)
    common.use_strategy(llm, rec)
    chats = [llm.chat_prompt([{"role": "user", "content": p}])
             for p in (common.PROMPTS * 4)[: args.prompts]]
    prompt_tokens = sum(len(llm.tokenizer.encode(text)) for text in chats)
    for text in chats:  # one request after another: the expert cache lives across requests
        common.run_steps(llm, [llm.tokenizer.encode(text)], args.max_tokens)
    record_s = time.perf_counter() - t0
    engine = {} if args.no_engine else {
        policy: engine_run(common, llm, chats, policy, args.engine_rate, args.max_tokens)
        for policy in ONLINE}
    common.use_strategy(llm, moe)

    all_steps = [[(layer, e) for e in experts] for _, layer, experts in rec.steps]
    decode_steps = [[(layer, e) for e in experts] for f, layer, experts in rec.steps
                    if rec.forwards[f].num_tokens == 1]
    total = parts.experts.num_experts_total
    print(json.dumps({
        "bench": "policies",
        "model": args.model or "demo",
        "num_moe_layers": len(parts.spec.moe_layers),
        "experts_per_layer": parts.spec.num_experts,
        "top_k": parts.spec.top_k,
        "experts_total": total,
        "workload": {"prompts": len(chats), "max_tokens": args.max_tokens, "batch": 1,
                     "prefix_cache": False, "prompt_tokens": prompt_tokens,
                     "tokens": sum(f.num_tokens for f in rec.forwards),
                     "forwards": len(rec.forwards),
                     "prefill_forwards": sum(f.num_tokens > 1 for f in rec.forwards),
                     "layer_steps_all": len(all_steps), "layer_steps_decode": len(decode_steps),
                     "record_s": round(record_s, 1)},
        "hit_rate": {"all": hit_rates(all_steps, total), "decode": hit_rates(decode_steps, total)},
        "engine": {"cache_rate": args.engine_rate, "prefetch": llm.config.moe_prefetch,
                   "copy_backend": "host", **engine},
    }, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
