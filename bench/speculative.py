"""N-gram speculative decoding (`--speculative-ngram K`) beside plain decoding, on one engine.

One request at a time (a single stream: the user this engine is for), greedy (or sampled at
`--temperature` with a seed per prompt), EOS ignored, `--tokens` tokens each. For every setting the same engine decodes the same prompts with drafts
off (K = 0) and with each K of `--ks`, taking turns for `--rounds` rounds, so the host's load
drifts over all of them alike. What decode steps cost (the table drafts are sized by,
`engine/spec.py`) is kept across the K switches, as a server keeps it, and learned again at
each switch of MoE strategy (resident, offload): the first drafting runs after one pay for it.

- Workloads: `repeat`, prompts that end inside a passage they already contain (a source file
  of this repository, then its first lines again): the model copies, the case drafts are for
  (code edits, quoting, fixed JSON keys); `chat`, short open questions through the chat
  template: little to look up, the case where drafts must not cost much.
- Settings: `resident` (every expert in memory) and `offload` (a device expert cache of
  `--cache-rate` of the experts behind a simulated link of `--link` GB/s on the CPU, the real
  link with `--device cuda`; prefetch on): on the CPU the demo is compute-bound (each extra row
  costs its FLOPs), behind a slow link the experts' copy time dominates and a step's rows
  share the experts they route to.
- `--device cuda` runs the model in bf16 through the Triton kernels, decode steps without a
  draft as CUDA graphs (scripts/gpu-check.sh runs it so); `same_tokens` may then be false
  where a batch of rows rounds differently from one row (bf16), which is no error.
- Per setting, workload and K: `tok_per_s`, decode tokens (after the first) over the seconds
  of the steps without a prefill token; `vs_off`, that rate over K = 0's, paired by round,
  median; `accepted_ratio`, accepted over computed draft tokens; `tokens_per_step`, tokens a
  decode step produced; `same_tokens`, whether every request's tokens equal K = 0's (they must:
  a draft token is kept only when it is the token the one-token step draws at its place, with
  the same seed).

    .venv/bin/python bench/speculative.py
    .venv/bin/python bench/speculative.py --rounds 1 --tokens 32 --ks 4
    .venv/bin/python bench/speculative.py --temperature 0.7 --settings resident
    .venv/bin/python bench/speculative.py --device cuda --rounds 1 --tokens 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import _common as common
from ftrs.engine.protocol import GenerateRequest
from ftrs.llm import LLM
from ftrs.moe.base import MoEStrategy
from ftrs.moe.offload import OffloadStrategy
from ftrs.sampling import SamplingParams


def note(msg: str) -> None:
    print(f"[speculative] {msg}", file=sys.stderr, flush=True)


def workloads(llm: LLM, n: int) -> dict[str, list[list[int]]]:
    """`n` prompts of each workload."""
    corpus = common.corpus_ids(llm, 400 * n)
    repeat = []
    for i in range(n):
        passage = corpus[400 * i: 400 * i + 320]
        repeat.append(passage + passage[:24])  # the passage again: its next lines follow
    chat = [llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content": p}]))
            for p in common.PROMPTS[:n]]
    return {"repeat": repeat, "chat": chat}


def decode(llm: LLM, prompt: list[int], tokens: int, temperature: float = 0.0,
           seed: int = 0) -> dict[str, Any]:
    """One request alone: its tokens, and the decode steps' seconds and tokens."""
    eng = llm.engine
    rid = f"spec-{time.monotonic_ns()}"
    eng.add_request(GenerateRequest(rid, prompt, SamplingParams(
        max_tokens=tokens, temperature=temperature, seed=seed, ignore_eos=True)))
    out: list[int] = []
    secs = 0.0
    dec_tokens = steps = drafted = accepted = 0
    while eng.has_work():
        events, st = eng.step()
        new = sum(len(e.new_token_ids) for e in events if e.request_id == rid)
        out += [t for e in events if e.request_id == rid for t in e.new_token_ids]
        if st.kind == "decode":
            secs += st.duration_s
            dec_tokens += new
            steps += 1
            drafted += st.draft_tokens
            accepted += st.accepted_tokens
    return {"tokens": out, "secs": secs, "decode_tokens": dec_tokens, "steps": steps,
            "drafted": drafted, "accepted": accepted}


def offload(llm: LLM, link: float, rate: float) -> OffloadStrategy:
    parts = llm.engine.moe_parts()
    backend = "cuda" if parts.device.type == "cuda" else f"simulated:{link:g}"
    cfg = dataclasses.replace(llm.config, moe_strategy="offload", moe_cache_rate=rate,
                              moe_cache_size=None, copy_backend=backend, moe_prefetch=True)
    return OffloadStrategy(experts=parts.experts, device=parts.device, config=cfg,
                           routers=parts.routers, kernels=parts.kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo MoE)")
    ap.add_argument("--ks", default="4,8", help="draft lengths to compare with 0")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--link", type=float, default=1.0, help="offload: simulated link, GB/s")
    ap.add_argument("--cache-rate", type=float, default=0.25, help="offload: expert cache share")
    ap.add_argument("--settings", default="resident,offload")
    ap.add_argument("--threads", type=int, default=1, help="torch's and the kernels' threads")
    ap.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above: sampled, prompt i seeded with i")
    args = ap.parse_args()
    t_start = time.perf_counter()
    common.use_threads(args.threads)
    ks = [0] + [int(k) for k in args.ks.split(",")]
    settings = args.settings.split(",")
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    llm = LLM(args.model or common.demo_path(), device=args.device, dtype=dtype, kv_tokens=4096)
    out: dict[str, Any] = {"model": args.model or "demo", "device": args.device, "dtype": dtype,
                           "threads": args.threads, "tokens": args.tokens, "ks": ks,
                           "temperature": args.temperature}
    try:
        resident: MoEStrategy | None = llm.engine.moe_strategy()
        assert resident is not None, "the model has no routed experts"
        prompts = workloads(llm, args.prompts)
        decode(llm, prompts["chat"][0], 8)  # warm-up
        # runs[setting][workload][k]: one entry per round, the prompts' runs of that round
        runs: dict[str, dict[str, dict[int, list[list[dict[str, Any]]]]]] = {
            s: {w: {k: [] for k in ks} for w in prompts} for s in settings}
        for r in range(args.rounds):
            for setting in settings:
                strat = offload(llm, args.link, args.cache_rate) if setting == "offload" else None
                if strat is not None:
                    llm.engine.use_moe_strategy(strat)
                for w, ps in prompts.items():
                    for k in ks:
                        llm.engine.set_speculative_ngram(k)
                        runs[setting][w][k].append([decode(llm, p, args.tokens,
                                                           args.temperature, seed)
                                                    for seed, p in enumerate(ps)])
                if strat is not None:
                    llm.engine.use_moe_strategy(resident)
                    strat.close()
            note(f"round {r + 1}/{args.rounds} done")
        out["results"] = {s: {w: summary(runs[s][w], ks) for w in prompts} for s in settings}
        if "offload" in settings:
            out["offload"] = {"link_gb_s": args.link if args.device == "cpu" else "cuda",
                              "cache_rate": args.cache_rate}
    finally:
        llm.close()
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out, indent=2))


def summary(by_k: dict[int, list[list[dict[str, Any]]]], ks: list[int]) -> dict[str, Any]:
    def rate(rnd: list[dict[str, Any]]) -> float:
        return sum(x["decode_tokens"] for x in rnd) / sum(x["secs"] for x in rnd)

    res: dict[str, Any] = {}
    base = by_k[0]
    for k in ks:
        rounds = by_k[k]
        runs = [x for rnd in rounds for x in rnd]
        entry: dict[str, Any] = {"tok_per_s": round(statistics.median(rate(r) for r in rounds), 2)}
        if k:
            drafted = sum(x["drafted"] for x in runs)
            entry |= {
                "vs_off": round(statistics.median(rate(a) / rate(b) for a, b in zip(rounds, base)), 3),
                "accepted_ratio": round(sum(x["accepted"] for x in runs) / drafted, 3) if drafted else 0.0,
                "tokens_per_step": round(sum(x["decode_tokens"] for x in runs)
                                         / sum(x["steps"] for x in runs), 3),
                "same_tokens": all(a["tokens"] == b["tokens"] for ra, rb in zip(rounds, base)
                                   for a, b in zip(ra, rb))}
        res[f"k{k}"] = entry
    return res


if __name__ == "__main__":
    main()
