"""Structured output: the grammar engines' per-token mask cost, and decode tok/s with a schema.

Two sections, one JSON report:

`engines`: on the demo tokenizer (49152 tokens), for one JSON schema, each grammar engine
installed (llguidance, the one ftrs uses; xgrammar when importable) builds its tokenizer view,
compiles the schema, then walks a valid document token by token: mask, then consume. Printed:
build and compile times, the per-token mask time (min, median, mean, max; the first mask, which
warms the lexer, is the max; on a shared host the min is the cost, the median adds waiting), and for llguidance the batched fill of 8 matchers through its
parallel executor (what the engine calls once per step) and the cost of turning those 8
bitmasks into a bool mask and applying it to (8, vocab) logits.

`decode`: the demo model, greedy, exactly `--max-tokens` tokens per request, batch 1 and 8,
unconstrained and with a JSON schema that cannot complete before then (so both arms decode the
same number of tokens), alternating within one process (`--reps` rounds, medians; the first
round runs the unconstrained arm first, the second the constrained one, and so on, so neither
is always second: `runs.first` names each round's first arm). tok/s is over the pure decode
steps (`StepStats`, forward + masks + sampling). `ratio` = constrained /
unconstrained (target >= 0.9). `mask_fill_ms` is the time the mask worker spent per step
(`EngineCore.grammar_stats`), `mask_wait_ms` the time a step waited for it after its forward
(near 0 when the fill finished under the forward).

    python bench/structured.py           # 16 tokens, 3 rounds
    python bench/structured.py --quick   # 12 tokens, 1 round (--max-tokens, --reps given win)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import _common as common
from ftrs.engine import grammar
from ftrs.engine.protocol import GenerateRequest, StepStats
from ftrs.llm import LLM
from ftrs.models.tokenizer import Tokenizer
from ftrs.sampling import SamplingParams, StructuredSpec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
    },
    "required": ["id", "name", "email", "active", "role", "scores", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"id": 4217, "name": "Ada Lovelace", "email": "ada@engines.org", "active": True,
            "role": "editor", "scores": [9.5, 7.25, 10, 8.75],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "10115"}}
# decode: an array that must hold 64 items cannot close within --max-tokens tokens
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 64, "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "qty": {"type": "integer"}},
        "required": ["name", "qty"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}
ARMS = ("unconstrained", "json_schema")  # decode's two arms, in its first round's order
PROMPT = ("List the items of a small grocery order as JSON: an object with an array `items` of "
          "objects with `name` and `qty`.")


def stats_us(times: list[float]) -> dict[str, float]:
    return {"min_us": round(1e6 * min(times), 1),
            "median_us": round(1e6 * statistics.median(times), 1),
            "mean_us": round(1e6 * statistics.fmean(times), 1),
            "max_us": round(1e6 * max(times), 1)}


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def bench_llguidance(tok: Tokenizer, vocab: int, ids: list[int]) -> dict[str, Any]:
    import llguidance

    lltok, build_s = timed(lambda: grammar.ll_tokenizer(tok, vocab))
    text = grammar.grammar_text(StructuredSpec("json_schema", json.dumps(SCHEMA)))
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(lltok, text, log_level=0))
    words = (vocab + 31) // 32
    bits = np.zeros((1, words), dtype=np.int32)
    masks, consumes = [], []
    for t in ids:
        _, dt = timed(lambda: matcher.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4))
        masks.append(dt)
        ok, dt = timed(matcher.consume_token, t)
        consumes.append(dt)
        assert ok, matcher.get_error()
    assert matcher.is_stopped()
    # the engine's per-step call: 8 matchers at different points of the document, one fill
    filler = grammar.MaskFiller(vocab, torch.device("cpu"))
    base = llguidance.LLMatcher(lltok, text, log_level=0)
    batch = []
    for i in range(8):
        m = base.deep_copy()
        m.consume_tokens(ids[: (i * len(ids)) // 9])
        batch.append(m)
    filler.fill(batch)  # warm every lexer state once
    fills, applies = [], []
    logits = torch.randn(8, vocab)
    for _ in range(20):
        allowed, dt = timed(lambda: filler.fill(batch))
        fills.append(dt)
        _, dt = timed(logits.masked_fill, ~allowed, -float("inf"))
        applies.append(dt)
    filler.close()
    return {"engine": "llguidance", "version": llguidance.__version__,
            "tokenizer_build_s": round(build_s, 3), "compile_ms": round(1e3 * compile_s, 2),
            "tokens": len(ids), "mask": stats_us(masks), "consume": stats_us(consumes),
            "batch8_fill_unpack": stats_us(fills), "batch8_apply": stats_us(applies)}


def bench_xgrammar(tok: Tokenizer, vocab: int, ids: list[int]) -> dict[str, Any]:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return {"engine": "xgrammar", "skipped": f"not importable ({e})"}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tk)
    info, build_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids)))
    compiler = xgr.GrammarCompiler(info)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")))
    matcher = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, vocab)
    masks, consumes = [], []
    for t in ids:
        _, dt = timed(lambda: matcher.fill_next_token_bitmask(bits))
        masks.append(dt)
        ok, dt = timed(matcher.accept_token, t)
        consumes.append(dt)
        assert ok, t
    return {"engine": "xgrammar", "tokenizer_build_s": round(build_s, 3),
            "compile_ms": round(1e3 * compile_s, 2), "tokens": len(ids),
            "mask": stats_us(masks), "consume": stats_us(consumes)}


def engines(llm: LLM) -> list[dict[str, Any]]:
    tok = llm.tokenizer
    vocab = llm.engine.vocab_size
    ids = tok.encode(json.dumps(DOCUMENT, separators=(", ", ": ")))
    return [bench_llguidance(tok, vocab, ids), bench_xgrammar(tok, vocab, ids)]


def run(llm: LLM, prompts: list[list[int]], n: int, spec: StructuredSpec | None,
        tag: str) -> list[StepStats]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, structured=spec)
    eng = llm.engine
    for i, ids in enumerate(prompts):
        eng.add_request(GenerateRequest(f"{tag}-{time.monotonic_ns()}-{i}", ids, params))
    out: list[StepStats] = []
    while eng.has_work():
        _, st = eng.step()
        out.append(st)
    return out


def decode(llm: LLM, batches: list[int], n: int, reps: int) -> list[dict[str, Any]]:
    spec = StructuredSpec("json_schema", json.dumps(LONG_SCHEMA))
    prompt = llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content": PROMPT}]))
    eng = llm.engine
    rows = []
    for b in batches:
        prompts = [prompt] * b
        run(llm, prompts, 3, None, "warm")
        run(llm, prompts, 3, spec, "warm")
        free, con, fill, wait = [], [], [], []
        first: list[str] = []
        for r in range(reps):  # each round starts with the other arm: no fixed order
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            first.append(order[0])
            for arm in order:
                if arm == "unconstrained":
                    steps = run(llm, prompts, n, None, "free")
                    free.append(common.decode_summary(steps)["tok_per_s"])
                    continue
                before = eng.grammar_stats()
                steps = run(llm, prompts, n, spec, "json")
                after = eng.grammar_stats()
                con.append(common.decode_summary(steps)["tok_per_s"])
                fills = after["fills"] - before["fills"]
                fill.append((after["fill_s"] - before["fill_s"]) / fills)
                wait.append((after["wait_s"] - before["wait_s"]) / fills)
        rows.append({
            "batch": b, "unconstrained_tok_per_s": round(statistics.median(free), 2),
            "json_schema_tok_per_s": round(statistics.median(con), 2),
            "ratio": round(statistics.median(c / f for c, f in zip(con, free)), 3),
            "mask_fill_ms": round(1e3 * statistics.median(fill), 3),
            "mask_wait_ms": round(1e3 * statistics.median(wait), 3),
            "runs": {"unconstrained": [round(x, 2) for x in free],
                     "json_schema": [round(x, 2) for x in con], "first": first}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens per request (default 16; --quick 12)")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 3; --quick 1)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quick", action="store_true",
                    help="12 tokens, 1 round, unless --max-tokens or --reps says otherwise")
    ap.add_argument("--no-decode", action="store_true", help="only the engines section")
    args = ap.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 12 if args.quick else 16
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    path = args.model or common.demo_path()
    llm = LLM(path, device=args.device, dtype="float32", kv_tokens=8192)
    report: dict[str, Any] = {"bench": "structured", "model": args.model or "demo",
                              "device": args.device, "vocab": llm.engine.vocab_size,
                              "torch_threads": torch.get_num_threads(),
                              "engines": engines(llm)}
    if not args.no_decode:
        batches = [int(x) for x in args.batches.split(",")]
        report |= {"max_tokens": args.max_tokens, "reps": args.reps}
        report["decode"] = decode(llm, batches, args.max_tokens, args.reps)
    print(json.dumps(report, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
