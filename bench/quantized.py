"""The demo MoE in F32, Q8_0 and Q4_K_M through ftrs: decode tokens/s, pool bytes, link bytes.

One process, one run. The three checkpoints are the same upcycled SmolLM2-135M (8 experts,
top-2): the fp32 safetensors demo and `ftrs models demo --quant q8_0` / `--quant q4_k_m`
(built once if missing). Each is loaded with the `resident` strategy on the CPU, fp32
activations, greedy, EOS ignored.

- Decode tok/s at batch 1 and 8: the engine is stepped by hand and only steps that carry no
  prefill token are timed (the first token of each sequence comes out of the prefill step and
  is not counted): tokens = decode tokens of those steps, seconds = their summed durations.
  Batch 8 = 8 chat prompts cut to the shortest one's length. After one warm-up run per format
  and batch, the formats take turns (round-robin, `--rounds` rounds); each figure is the
  median over the rounds, since a shared host's speed drifts by tens of percent in a minute.
  `ratios`: a format's tok/s over F32's in the same round, median over the rounds.
- `pool_bytes`: the host expert pool (`EngineCore.expert_pool_bytes()`), alignment included.
- `file_expert_bytes`: the routed experts' bytes in the file: the GGUF's `*_exps` tensors
  (`gguf.GGUFReader`, `n_bytes`), or the safetensors header's `.experts.` tensors.
- `--threads N` (default 1): torch's intra-op threads and the quantized kernels' threads, and
  llama.cpp's, so every engine decodes on the same number of cores (on a host shared with other
  jobs, 1 is faster than 2 for every format: a second thread mostly waits for its core).
- `--quant-torch-threads K` (default N): torch's threads while Q8_0 and Q4_K_M decode. Their
  matmuls run on the kernels' N threads; torch is left the norms, rotary and attention of one
  token, where a second OpenMP thread costs more than it brings (and competes for the cores
  with the kernels' workers). F32 keeps N: its matmuls are torch's.
- `llama_cpp` (when `llama-cpp-python` is installed, the `bench` extra): llama.cpp's decode
  tok/s at batch 1 on the same Q4_K_M file, same chat prompt, same token count, same threads,
  timed in every round right after ftrs's batch-1 runs (median over the rounds), and
  `ftrs_vs_llama_cpp`: ftrs's Q4_K_M batch-1 figure over llama.cpp's in the same round, median
  over the rounds.
- `prefill` (`--prefill-tokens N`, default 512; 0: none): the Q4_K_M file's prompt throughput,
  N tokens of the repository's own text from an empty context (each round a first token the
  prefix cache has not seen), the summed durations of the steps carrying them; and
  llama.cpp's on the same tokens (`Llama.eval` after `reset`), right after it in every round;
  `ftrs_vs_llama_cpp` paired by round, median.
- `pcie_mb_per_token`: offload decode with `--cache-rate` of the experts as slots, lru,
  prefetch on, over the simulated link `simulated:--link` (GB/s): bytes the transfer engine
  moved (`bytes_h2d`, prefetches included) during the decode steps, per decode token; one
  short batch-1 run per format, each on a fresh engine.

    .venv/bin/python bench/quantized.py               # 24 decode tokens, 2 rounds
    .venv/bin/python bench/quantized.py --tokens 12 --rounds 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch

import _common as common
from ftrs.llm import LLM
from generate import chat_prompts

FORMATS = ("F32", "Q8_0", "Q4_K_M")


def model_path(fmt: str) -> Path:
    from ftrs.models.demo import ensure_demo, ensure_demo_quant

    return ensure_demo() if fmt == "F32" else ensure_demo_quant(fmt.lower())


def file_expert_bytes(path: Path) -> int:
    """Bytes of the routed experts as the checkpoint file stores them."""
    if path.is_file():
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors
                   if t.name.endswith("_exps.weight"))
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                     if k != "__metadata__" and ".experts." in k)
    return total


def note(msg: str) -> None:
    print(f"[quantized] {msg}", file=sys.stderr, flush=True)


def decode_tok_s(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    return common.decode_summary(common.run_steps(llm, prompts, tokens))["tok_per_s"]


_FIRST = itertools.count(101)  # first tokens no earlier prompt of the bench started with


def prefill_tok_s(llm: LLM, ids: list[int]) -> float:
    """Prompt tokens a second of `ids` in one step from an empty context (a first token the
    prefix cache has not seen, each call), summed over the steps that carry prefill tokens."""
    prompt = [next(_FIRST), *ids[1:]]
    steps = [s for s in common.run_steps(llm, [prompt], 1) if s.kind in ("prefill", "mixed")]
    return len(ids) / sum(s.duration_s for s in steps)


def link_bytes(path: Path, tokens: int, rate: float, link: float) -> dict[str, Any]:
    llm = LLM(str(path), device="cpu", dtype="float32", moe_strategy="offload",
              moe_cache_rate=rate, copy_backend=f"simulated:{link:g}", kv_tokens=1024)
    try:
        prompt = llm.tokenizer.encode("The capital of France is")
        steps = common.run_steps(llm, [prompt], tokens)
        dec = [s for s in steps if s.kind == "decode"]
        before = steps[steps.index(dec[0]) - 1].experts
        c = common.counter_delta(dec[-1].experts, before)
        n = sum(s.decode_tokens for s in dec)
        block = int(dec[-1].experts["expert_bytes"])
        return {"pcie_mb_per_token": round(c["bytes_h2d"] / n / 1e6, 3),
                "expert_block_bytes": block,
                "experts_moved_per_token": round(c["bytes_h2d"] / block / n, 2),
                "misses_per_token": round(c["misses"] / n, 2),
                "offload_decode_tok_per_s": round(common.decode_summary(steps)["tok_per_s"], 3),
                "offload_decode_tokens": n}
    finally:
        llm.close()


class LlamaCpp:
    """llama.cpp on the same file, timed in every round beside ftrs (same host load)."""

    def __init__(self, path: Path, prompt: str, threads: int) -> None:
        from llama_cpp import Llama

        self.prompt = prompt
        self.llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.llm(prompt, max_tokens=2)  # warm-up
        self.made = 0

    def prefill_tok_s(self, ids: list[int]) -> float:
        """Prompt tokens a second of one prompt evaluated from an empty context."""
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t)

    def decode_tok_s(self, tokens: int) -> float:
        """Decode-only estimate: a full run minus a prefill-plus-one-token run, both after an
        untimed one, so both find the prompt in llama.cpp's context as the other left it (a
        prefill measurement in between leaves another prompt there)."""
        self.llm(self.prompt, max_tokens=1)
        t0 = time.perf_counter()
        self.llm(self.prompt, max_tokens=1)
        t1 = time.perf_counter()
        # EOS ruled out, as ftrs ignores it: both engines make `tokens` tokens
        out = self.llm(self.prompt, max_tokens=tokens, logit_bias={self.llm.token_eos(): -1e9})
        t2 = time.perf_counter()
        assert isinstance(out, dict)
        self.made = out["usage"]["completion_tokens"]
        return (self.made - 1) / ((t2 - t1) - (t1 - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per sequence")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--link", type=float, default=2.0, help="simulated link, GB/s")
    ap.add_argument("--cache-rate", type=float, default=0.5)
    ap.add_argument("--link-tokens", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="prompt tokens of the prefill comparison (0: none)")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of torch, of the quantized kernels and of llama.cpp")
    ap.add_argument("--quant-torch-threads", type=int, default=None,
                    help="torch's threads while a quantized format decodes (default --threads)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from ftrs import _core

    common.use_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    quant_torch = args.quant_torch_threads or args.threads
    torch_threads = {f: args.threads if f == "F32" else quant_torch for f in FORMATS}
    paths = {f: model_path(f) for f in FORMATS}
    rows: dict[str, dict[str, Any]] = {f: {"file": paths[f].name} for f in FORMATS}

    for f in FORMATS:  # one offload engine at a time, before the three resident ones load
        rows[f]["file_expert_bytes"] = file_expert_bytes(paths[f])
        rows[f] |= link_bytes(paths[f], args.link_tokens, args.cache_rate, args.link)
        note(f"{f}: offload over simulated:{args.link:g} done")

    llms = {f: LLM(str(paths[f]), device="cpu", dtype="float32", moe_strategy="resident",
                   kv_tokens=4096) for f in FORMATS}
    for f, llm in llms.items():
        pool = llm.engine.expert_pool_bytes()
        rows[f] |= {"pool_bytes": pool,
                    "pool_vs_file": round(pool / rows[f]["file_expert_bytes"], 4)}
    prompts = {b: chat_prompts(llms["F32"], b) for b in batches}
    chat = llms["F32"].chat_prompt([{"role": "user", "content": common.PROMPTS[0]}])
    for f, llm in llms.items():
        torch.set_num_threads(torch_threads[f])
        for b in batches:
            common.run_steps(llm, prompts[b], 3, prefix="warm")  # first-touch costs
    try:
        peer: LlamaCpp | None = LlamaCpp(paths["Q4_K_M"], chat, args.threads)
    except ImportError:
        peer = None
    peer_runs: list[float] = []
    prefill_runs: list[float] = []
    peer_prefill: list[float] = []
    long_prompt = common.corpus_ids(llms["Q4_K_M"], args.prefill_tokens)[:args.prefill_tokens]
    runs: dict[tuple[str, int], list[float]] = {(f, b): [] for f in FORMATS for b in batches}
    for r in range(args.rounds):
        for b in batches:
            for f, llm in llms.items():
                torch.set_num_threads(torch_threads[f])
                runs[f, b].append(decode_tok_s(llm, prompts[b], args.tokens))
                note(f"round {r + 1}, batch {b}, {f}: {runs[f, b][-1]:.2f} tok/s")
            if b == 1 and peer is not None:
                peer_runs.append(peer.decode_tok_s(args.tokens))
                note(f"round {r + 1}, batch 1, llama.cpp: {peer_runs[-1]:.2f} tok/s")
        if args.prefill_tokens:  # the Q4_K_M file's prompt throughput, then llama.cpp's
            torch.set_num_threads(torch_threads["Q4_K_M"])
            prefill_runs.append(prefill_tok_s(llms["Q4_K_M"], long_prompt))
            note(f"round {r + 1}, prefill {len(long_prompt)}, Q4_K_M: {prefill_runs[-1]:.1f} tok/s")
            if peer is not None:
                peer_prefill.append(peer.prefill_tok_s(long_prompt))
                note(f"round {r + 1}, prefill, llama.cpp: {peer_prefill[-1]:.1f} tok/s")
    for f, llm in llms.items():
        for b in batches:
            rows[f][f"decode_b{b}_tok_per_s"] = round(statistics.median(runs[f, b]), 3)
            rows[f][f"decode_b{b}_runs"] = [round(x, 3) for x in runs[f, b]]
        llm.close()

    ratios = {}  # paired: each round's ratio (same host load), then the median over rounds
    for b in batches:
        for f in ("Q4_K_M", "Q8_0"):
            ratios[f"{f}_vs_F32_decode_b{b}"] = round(statistics.median(
                q / x for q, x in zip(runs[f, b], runs["F32", b])), 3)
    report: dict[str, Any] = {
        "bench": "quantized", "device": "cpu", "activations": "float32",
        "strategy": "resident", "torch_threads": torch_threads,
        "kernel_threads": _core.quant_threads(),
        "decode_tokens_per_sequence": args.tokens - 1, "rounds": args.rounds,
        "prompt_tokens": {b: len(prompts[b][0]) for b in batches},
        "decode_timing": "summed durations of steps without prefill tokens",
        "link": f"simulated:{args.link:g}", "cache_rate": args.cache_rate,
        "ratios": ratios, "formats": rows,
        "llama_cpp": "llama-cpp-python not installed"}
    if peer is not None and peer_runs:
        report["llama_cpp"] = {"llama_cpp_batch1_tok_per_s": round(statistics.median(peer_runs), 3),
                               "llama_cpp_batch1_runs": [round(x, 3) for x in peer_runs],
                               "llama_cpp_tokens": peer.made}
        report["ftrs_vs_llama_cpp"] = round(statistics.median(  # paired by round, like `ratios`
            q / p for q, p in zip(runs["Q4_K_M", 1], peer_runs)), 3)
    if prefill_runs:
        report["prefill"] = {"prompt_tokens": len(long_prompt),
                             "Q4_K_M_tok_per_s": round(statistics.median(prefill_runs), 1),
                             "Q4_K_M_runs": [round(x, 1) for x in prefill_runs]}
        if peer_prefill:
            report["prefill"] |= {
                "llama_cpp_tok_per_s": round(statistics.median(peer_prefill), 1),
                "llama_cpp_runs": [round(x, 1) for x in peer_prefill],
                "ftrs_vs_llama_cpp": round(statistics.median(
                    q / p for q, p in zip(prefill_runs, peer_prefill)), 3)}
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
