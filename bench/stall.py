"""A long prompt beside running streams: how long the streams wait, and what it costs the prompt.

`--streams` requests decode (greedy, EOS ignored); once they are decoding, a prompt of
`--prompt` tokens of real text (this repository's docs and sources) arrives. For each value of
`decode_stall_target` in `--targets` (0: no bound but the step budget, `--budget`) one engine
serves the same requests, the engines taking turns for `--rounds` rounds so the host's load
drifts over all of them alike. Each engine first serves one 128-token prompt (a server has
served before), and keeps what its steps cost from round to round, as a server does; each
round's prompt has a first token of its own, so no round finds it in the prefix cache.

Per target, medians over the rounds:
- `gap_max_s`, `gap_p90_s`: the longest and the 90th-percentile step that carried the streams'
  decodes between the prompt's arrival and its first token; each such step is one
  inter-token gap of every stream;
- `prompt_ttft_s`: the prompt's arrival to its first token; `prefill_tok_per_s`, its tokens
  over that time; `ttft_vs_unbounded`, that time over target 0's, paired by round (what the
  bound costs the prompt);
- `chunks`: the prompt's chunks, `stream_tokens`: tokens the streams made meanwhile.

    .venv/bin/python bench/stall.py
    .venv/bin/python bench/stall.py --model ~/.cache/ftrs/models/smollm2-135m-instruct-moe8x2.Q4_K_M.gguf
    .venv/bin/python bench/stall.py --strategy offload --link 2 --prompt 1024 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import _common as common
from ftrs.engine.protocol import GenerateRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

STREAM_PROMPTS = ["Tell me a long story about a lighthouse keeper.",
                  "Explain how a compiler works, step by step.",
                  "Describe the water cycle in detail.",
                  "Write a letter to a friend about a journey."]


def note(msg: str) -> None:
    print(f"[stall] {msg}", file=sys.stderr, flush=True)


def one_round(llm: LLM, streams: list[list[int]], prompt: list[int], tag: str) -> dict[str, Any]:
    eng = llm.engine
    params = SamplingParams(max_tokens=2048, temperature=0, ignore_eos=True)  # aborted sooner
    ids = [f"{tag}-s{i}" for i in range(len(streams))]
    for rid, ids_ in zip(ids, streams, strict=True):
        eng.add_request(GenerateRequest(rid, ids_, params))
    started: set[str] = set()
    while len(started) < len(ids):  # every stream prefilled and decoding
        events, _ = eng.step()
        started |= {e.request_id for e in events if e.new_token_ids}
    long_id = f"{tag}-long"
    t0 = time.perf_counter()
    eng.add_request(GenerateRequest(long_id, prompt, SamplingParams(max_tokens=1, temperature=0)))
    gaps: list[float] = []
    chunks = stream_tokens = 0
    done = False
    while not done:
        events, st = eng.step()
        if st.decode_tokens:
            gaps.append(st.duration_s)
        chunks += st.prefill_tokens > 0
        for e in events:
            if e.request_id == long_id:
                done = True
            else:
                stream_tokens += len(e.new_token_ids)
    ttft = time.perf_counter() - t0
    for rid in ids:
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    gaps.sort()
    return {"gap_max_s": gaps[-1] if gaps else 0.0,
            "gap_p90_s": gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
            "prompt_ttft_s": ttft, "prefill_tok_per_s": len(prompt) / ttft,
            "chunks": chunks, "stream_tokens": stream_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo MoE)")
    ap.add_argument("--targets", default="0,1.0,0.5", help="decode_stall_target values, s")
    ap.add_argument("--budget", type=int, default=8192, help="max_prefill_length (the step budget)")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens of the long prompt")
    ap.add_argument("--streams", type=int, default=2, help="requests decoding beside it (1-4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch and kernel threads")
    ap.add_argument("--strategy", choices=["resident", "offload"], default="resident")
    ap.add_argument("--link", type=float, default=2.0, help="offload: simulated link, GB/s")
    ap.add_argument("--cache-rate", type=float, default=0.5, help="offload: expert cache share")
    args = ap.parse_args()
    if not 1 <= args.streams <= len(STREAM_PROMPTS):
        ap.error(f"--streams: 1 to {len(STREAM_PROMPTS)}")
    targets = [float(t) for t in args.targets.split(",")]
    if 0.0 not in targets:
        targets.insert(0, 0.0)
    common.use_threads(args.threads)
    model = args.model or common.demo_path()
    opts: dict[str, Any] = {"max_prefill_length": args.budget,
                            "kv_tokens": args.prompt + 4096, "moe_strategy": args.strategy}
    if args.strategy == "offload":
        opts |= {"copy_backend": f"simulated:{args.link}", "moe_cache_rate": args.cache_rate}
    engines = {t: LLM(model, decode_stall_target=t, **opts) for t in targets}
    first = engines[targets[0]]
    prompt = common.corpus_ids(first, args.prompt)
    streams = [first.tokenizer.encode(p) for p in STREAM_PROMPTS[:args.streams]]
    note(f"model {model}, {args.strategy}, prompt {len(prompt)} tokens, {args.streams} streams, "
         f"budget {args.budget}, targets {targets}, {args.threads} thread(s)")
    rows: dict[float, list[dict[str, Any]]] = {t: [] for t in targets}
    for t in targets:  # a served chat of 128 tokens first: a server has served before
        engines[t].generate([prompt[-128:]], SamplingParams(max_tokens=2, temperature=0))
    for r in range(args.rounds):
        fresh = [prompt[0] + r + 1, *prompt[1:]]  # a first page of its own: no prefix cache hit
        for t in targets:
            rows[t].append(one_round(engines[t], streams, fresh, f"r{r}-t{t}"))
            note(f"round {r} target {t}: {rows[t][-1]}")
    out: dict[str, Any] = {"model": model, "strategy": args.strategy, "prompt_tokens": len(prompt),
                           "streams": args.streams, "budget": args.budget,
                           "threads": args.threads, "rounds": args.rounds, "targets": {}}
    for t in targets:
        med = {k: statistics.median(row[k] for row in rows[t]) for k in rows[t][0]}
        med["ttft_vs_unbounded"] = statistics.median(
            a["prompt_ttft_s"] / b["prompt_ttft_s"] for a, b in zip(rows[t], rows[0.0], strict=True))
        out["targets"][str(t)] = med
    print(json.dumps(out, indent=1), flush=True)
    for llm in engines.values():
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
