"""The int8 KV cache (`--kv-cache-dtype int8`) beside the plain one on the demo MoE: bytes,
what the model predicts, decode speed. One process, one run, both caches side by side.

The model: the demo's Q4_K_M GGUF (`ftrs models demo --quant q4_k_m`, built once if
missing), `resident`; on the CPU (default) in fp32 activations, so the plain cache is fp32;
with `--device cuda` in bf16 (the plain cache bf16) through the Triton kernels, CUDA graphs on
(scripts/gpu-check.sh runs it so).

- `kv_bytes_per_token`: `EngineCore.kv_cache_bytes()` over the cache's slots (every layer's
  keys and values, int8's scales included); `tokens_per_gib`: what one GiB holds.
- Prediction: `--text-tokens` tokens of this repository's own text (README, docs, sources)
  through `LLM.logits` in prefill chunks of `--chunk` tokens, so each chunk reads the rows the
  earlier ones wrote: `nll` (mean next-token negative log-likelihood, nats) and `ppl` of each
  cache; `kl_mean` / `kl_max` (nats): KL(plain || int8) of the next-token distributions, per
  position; `top1_agree`: share of positions where both pick the same next token.
- Decode tok/s at each context length of `--contexts` (a prompt of that many corpus tokens,
  then `--tokens` greedy tokens, EOS ignored; only the steps without a prefill token timed),
  the two caches taking turns for `--rounds` rounds, median; `int8_vs_auto`: the ratio paired
  by round, median. On the CPU both caches' decode rows go through the Rust decode attention
  (`kernels/cpu.decode_attention_cpu`: int8 codes widened as loaded, each row's scale applied
  to its dot products and weights).

    .venv/bin/python bench/kv_cache.py
    .venv/bin/python bench/kv_cache.py --rounds 2 --contexts 128 --text-tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import _common as common
from ftrs.llm import LLM

CACHES = ("auto", "int8")


def note(msg: str) -> None:
    print(f"[kv_cache] {msg}", file=sys.stderr, flush=True)


def prediction(logits: dict[str, torch.Tensor], ids: list[int]) -> dict[str, Any]:
    target = torch.tensor(ids[1:])
    out: dict[str, Any] = {}
    for kv, lg in logits.items():
        nll = torch.nn.functional.cross_entropy(lg[:-1].double(), target).item()
        out[f"nll_{kv}"], out[f"ppl_{kv}"] = round(nll, 5), round(float(torch.exp(torch.tensor(nll))), 4)
    lp, lq = (torch.log_softmax(logits[k].double(), -1) for k in CACHES)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    out |= {"kl_mean": float(f"{kl.mean().item():.3g}"), "kl_max": float(f"{kl.max().item():.3g}"),
            "top1_agree": round((lp.argmax(-1) == lq.argmax(-1)).double().mean().item(), 4),
            "positions": len(ids)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="128,1024", help="decode context lengths")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--text-tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the prediction run")
    ap.add_argument("--threads", type=int, default=1, help="torch's and the kernels' threads")
    ap.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from ftrs.models.demo import ensure_demo_quant

    common.use_threads(args.threads)
    path = ensure_demo_quant("q4_k_m")
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_tokens = max(contexts) + args.tokens + 64
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    out: dict[str, Any] = {"model": path.name, "device": args.device, "dtype": dtype,
                           "threads": args.threads}

    logits, sizes = {}, {}
    for kv in CACHES:  # prediction: one engine at a time, chunked prefill
        llm = LLM(str(path), device=args.device, dtype=dtype, kv_tokens=args.text_tokens + 64,
                  kv_cache_dtype=kv, max_prefill_length=args.chunk, page_size=16)
        try:
            ids = common.corpus_ids(llm, args.text_tokens)
            logits[kv] = llm.logits(ids)
            slots = llm.engine.kv_slots()
            sizes[kv] = llm.engine.kv_cache_bytes() / slots
        finally:
            llm.close()
        note(f"{kv}: prediction done")
    out["kv_bytes_per_token"] = {kv: round(b, 1) for kv, b in sizes.items()}
    out["tokens_per_gib"] = {kv: int(2**30 // b) for kv, b in sizes.items()}
    out["int8_bytes_vs_auto"] = round(sizes["int8"] / sizes["auto"], 4)
    out["prediction"] = prediction(logits, ids)

    llms = {kv: LLM(str(path), device=args.device, dtype=dtype, kv_tokens=kv_tokens,
                    kv_cache_dtype=kv) for kv in CACHES}
    try:
        prompts = {c: common.corpus_ids(llms["auto"], c) for c in contexts}
        for llm in llms.values():  # warm-up
            common.run_steps(llm, [prompts[contexts[0]]], 4)
        runs: dict[int, dict[str, list[float]]] = {c: {kv: [] for kv in CACHES} for c in contexts}
        for r in range(args.rounds):
            for c in contexts:
                for kv, llm in llms.items():
                    first = [101 + r, *prompts[c][1:]]  # a prompt the prefix cache has not seen
                    steps = common.run_steps(llm, [first], args.tokens)
                    runs[c][kv].append(common.decode_summary(steps)["tok_per_s"])
            note(f"round {r + 1}/{args.rounds} done")
        out["decode_tok_per_s"] = {
            str(c): {kv: round(statistics.median(v), 2) for kv, v in runs[c].items()}
            | {"int8_vs_auto": round(statistics.median(
                a / b for a, b in zip(runs[c]["int8"], runs[c]["auto"])), 3)}
            for c in contexts}
    finally:
        for llm in llms.values():
            llm.close()
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
