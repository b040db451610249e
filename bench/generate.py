"""ftrs `LLM` vs transformers `generate` on the demo model: decode tokens/s, batch 1 and 8.

Same checkpoint, same device (CPU unless `--device`), fp32, greedy, EOS ignored, exactly
`--max-tokens` new tokens per sequence. Batch-8 prompts are 8 chat prompts cut to the length
of the shortest, so neither side pads. The two engines alternate within one process.

What is timed is decode alone:
- ftrs: the engine is stepped by hand; the durations of steps that carry no prefill token are
  summed (each step: forward, logits, sampling), tokens = decode tokens of those steps.
- transformers: a logits processor stamps the clock at every generation step; decode time is
  the last stamp minus the first (the first comes right after the prefill forward), tokens =
  (max_tokens - 1) x batch.
`ratio` = ftrs tok/s / transformers tok/s (median over `--reps`). `greedy_equal` counts the
sequences whose tokens agree between the two up to (not including) ftrs' first EOS: transformers'
`min_new_tokens` (needed for a fixed length) masks EOS, while ftrs' `ignore_eos` only keeps
going after it, so the two legitimately part ways after an EOS.

`--baseline DIR` (a checkout of an earlier commit, e.g. a `git worktree`, with the compiled
extension beside its sources) also measures that code against this one, side by side: each
repetition runs one process of each, alternating, so both see the same host; `speedup` is the
median over repetitions of this code's tok/s over the baseline's in the same repetition, per
batch (`speedup_of_medians`, the ratio of the two medians, can differ from it). The profile
line says which share of a batch-1 decode step's CPU time is inside matrix products (aten::mm,
addmm, bmm; GEMVs at batch 1) and which share is everything else (dispatch, small ops, Python
around them).

The bound: batch-1 decode reads every dense weight once per token (the tied embedding as the LM
head) and `top_k` experts in each MoE layer, so tok/s cannot exceed the host's memory read rate
over those bytes. `memory_bound` gives the bytes per token (from the checkpoint's safetensors
headers), the read rate measured in this run (`F.linear` of one row over 1 GiB of weights, the
same GEMV the decode does, at torch's thread count, best of 3, before and after the rest), and
`bound_tok_per_s` = rate / bytes; each measured tok/s is also given as a share of that bound.

    python bench/generate.py           # 32 tokens, 2 repetitions
    python bench/generate.py --quick   # 12 tokens, 1 repetition
    python bench/generate.py --baseline /tmp/ftrs-base --no-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import _common as common
from ftrs.engine.protocol import GenerateRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

# transformers probes for a `kernels` package, and this folder's kernels.py is not it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class StepClock:
    """A transformers logits processor that only records when each generation step happened."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def run_hf(model: Any, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    from transformers import LogitsProcessorList

    clock = StepClock()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=2,
                             logits_processor=LogitsProcessorList([clock]))
    secs = clock.stamps[-1] - clock.stamps[0]
    return (n - 1) * len(prompts) / secs, out[:, ids.shape[1]:].tolist()


def same_until_eos(ours: list[int], theirs: list[int], eos: int = 2) -> bool:
    cut = ours.index(eos) if eos in ours else len(ours)  # transformers masked that EOS
    return ours[:cut] == theirs[:cut]


def chat_prompts(llm: LLM, batch: int) -> list[list[int]]:
    chats = [llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content": p}]))
             for p in common.PROMPTS]
    cut = min(len(c) for c in chats)
    return [c[:cut] for c in (chats * batch)[:batch]] if batch > 1 else [chats[0]]


def worker(path: str, device: str, batches: list[int], n: int, threads: int | None) -> None:
    """One process's figures (this checkout's or a baseline's ftrs, as PYTHONPATH says)."""
    if threads:  # set here, not through the config: a baseline may predate --torch-threads
        torch.set_num_threads(threads)
    llm = LLM(path, device=device, dtype="float32", kv_tokens=8192)
    out = {}
    for b in batches:
        common.run_steps(llm, chat_prompts(llm, b), 3, prefix="warm")  # first-touch costs
        out[b] = common.decode_summary(
            common.run_steps(llm, chat_prompts(llm, b), n, prefix=f"gen-b{b}"))["tok_per_s"]
    print(json.dumps(out))
    llm.close()


def side_by_side(path: str, device: str, baseline: str, batches: list[int], n: int,
                 reps: int, threads: int | None) -> list[dict[str, Any]]:
    here = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict[str, float]]] = {"current": [], "baseline": []}
    for _ in range(reps):
        for side, root in (("baseline", Path(baseline)), ("current", here)):
            env = dict(os.environ, PYTHONPATH=f"{root / 'python'}")
            cmd = [sys.executable, __file__, "--worker", "--model", path, "--device", device,
                   "--batches", ",".join(map(str, batches)), "--max-tokens", str(n)]
            if threads:
                cmd += ["--torch-threads", str(threads)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(res.stdout.strip().splitlines()[-1]))
    rows = []
    for b in batches:
        cur = [r[str(b)] for r in runs["current"]]
        base = [r[str(b)] for r in runs["baseline"]]
        rows.append({"batch": b, "current_tok_per_s": round(statistics.median(cur), 3),
                     "baseline_tok_per_s": round(statistics.median(base), 3),
                     "speedup": round(statistics.median(c / x for c, x in zip(cur, base)), 3),
                     "speedup_of_medians": round(statistics.median(cur) / statistics.median(base),
                                                 3),
                     "current_runs": [round(x, 3) for x in cur],
                     "baseline_runs": [round(x, 3) for x in base]})
    return rows


def bytes_per_decode_token(path: str) -> dict[str, float]:
    """Weight bytes a batch-1 decode token reads: dense tensors once, top_k experts per MoE layer."""
    from safetensors import safe_open

    config = json.loads((Path(path) / "config.json").read_text())
    top_k = int(config.get("num_experts_per_tok", 0))
    dense = 0
    experts: dict[tuple[str, str], int] = {}  # (layer, expert) -> bytes
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                nbytes = n * {"F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 1)
                m = re.search(r"layers\.(\d+)\..*experts\.(\d+)\.", name)
                if m:
                    key = (m.group(1), m.group(2))
                    experts[key] = experts.get(key, 0) + nbytes
                else:
                    dense += nbytes  # embeddings count once: tied, they are the LM head
    per_layer: dict[str, list[int]] = {}
    for (layer, _), b in experts.items():
        per_layer.setdefault(layer, []).append(b)
    routed = sum(top_k * statistics.mean(bs) for bs in per_layer.values())
    return {"dense_mb": round(dense / 1e6, 1), "routed_mb": round(routed / 1e6, 1),
            "gb_per_token": round((dense + routed) / 1e9, 4)}


def read_gb_per_s(total_bytes: int = 1 << 30, reps: int = 3) -> float:
    """The host's weight read rate as the decode sees it: one-row F.linear over many matrices."""
    rows, cols = 1536, 576
    ws = [torch.randn(rows, cols) for _ in range(total_bytes // (rows * cols * 4))]
    x = torch.randn(1, cols)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in ws:
            torch.nn.functional.linear(x, w)
        best = max(best, len(ws) * rows * cols * 4 / (time.perf_counter() - t0) / 1e9)
    return best


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def decode_profile(llm: LLM, n: int = 6) -> dict[str, Any]:
    """Share of a batch-1 decode step's CPU time spent in matrix products (self time)."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    prompt = chat_prompts(llm, 1)[0]
    params = SamplingParams(max_tokens=n + 4, temperature=0, ignore_eos=True)
    eng.add_request(GenerateRequest(f"prof-{time.monotonic_ns()}", prompt, params))
    for _ in range(3):
        eng.step()  # prefill and two warm decodes
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        wall = time.perf_counter() - t0
    while eng.has_work():
        eng.step()
    avg = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in avg)
    mm = sum(e.self_cpu_time_total for e in avg if e.key in MATMUL_OPS)
    return {"decode_step_ms": round(1e3 * wall / n, 2),
            "matmul_share": round(mm / total, 3) if total else None,
            "outside_matmul_share": round(1 - mm / total, 3) if total else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quick", action="store_true", help="12 tokens, 1 repetition")
    ap.add_argument("--baseline", default=None,
                    help="checkout of an earlier commit to measure side by side")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's CPU threads in every process (default: torch's own)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.reps = 12, 1
    path = args.model or common.demo_path()
    n = args.max_tokens
    batches = [int(x) for x in args.batches.split(",")]
    if args.worker:
        worker(path, args.device, batches, n, args.torch_threads)
        return
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    report: dict[str, Any] = {"bench": "generate", "model": args.model or "demo",
                              "device": args.device, "dtype": "float32",
                              "torch_threads": torch.get_num_threads()}
    measure_bound = args.device == "cpu" and 1 in batches
    rates = [read_gb_per_s()] if measure_bound else []
    if args.baseline:
        report["vs_baseline"] = side_by_side(path, args.device, args.baseline, batches, n,
                                             args.reps, args.torch_threads)
    llm = LLM(path, device=args.device, dtype="float32", kv_tokens=8192)
    report["moe_strategy"] = llm.config.moe_strategy
    report["profile_batch1"] = decode_profile(llm)
    if not args.no_transformers:
        report["rows"] = vs_transformers(llm, path, args.device, batches, n, args.reps)
    if measure_bound:
        rates.append(read_gb_per_s())
        report["memory_bound"] = memory_bound(path, max(rates), report)
    print(json.dumps(report, indent=2))
    llm.close()


def memory_bound(path: str, gb_per_s: float, report: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 tok/s the host's read rate allows, and each measured batch-1 figure's share of it."""
    need = bytes_per_decode_token(path)
    bound = gb_per_s / need["gb_per_token"]
    shares: dict[str, float] = {}
    for row in report.get("vs_baseline", []):
        if row["batch"] == 1:
            shares["current"] = round(row["current_tok_per_s"] / bound, 3)
            shares["baseline"] = round(row["baseline_tok_per_s"] / bound, 3)
            shares["baseline_max_speedup"] = round(bound / row["baseline_tok_per_s"], 3)
    for row in report.get("rows", []):
        if row["batch"] == 1:
            shares["ftrs"] = round(row["ftrs_decode_tok_per_s"] / bound, 3)
            shares["transformers"] = round(row["transformers_decode_tok_per_s"] / bound, 3)
    return {**need, "read_gb_per_s": round(gb_per_s, 2), "bound_tok_per_s": round(bound, 2),
            "share_of_bound": shares}


def vs_transformers(llm: LLM, path: str, device: str, batches: list[int], n: int,
                    reps: int) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = hf.to(device).eval()
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    rows = []
    for b in batches:
        prompts = chat_prompts(llm, b)
        ours, theirs = [], []
        for _ in range(reps):
            steps = common.run_steps(llm, prompts, n, prefix=f"gen-b{b}")
            ours.append(common.decode_summary(steps)["tok_per_s"])
            tps, hf_tokens = run_hf(hf, prompts, n)
            theirs.append(tps)
        ftrs_tokens = [c.token_ids for c in llm.generate(prompts, greedy)]  # untimed
        o, t = statistics.median(ours), statistics.median(theirs)
        rows.append({"batch": b, "prompt_tokens": len(prompts[0]), "new_tokens": n,
                     "ftrs_decode_tok_per_s": round(o, 3),
                     "transformers_decode_tok_per_s": round(t, 3),
                     "ratio": round(o / t, 3),
                     "ftrs_runs": [round(x, 3) for x in ours],
                     "transformers_runs": [round(x, 3) for x in theirs],
                     "greedy_equal": f"{sum(map(same_until_eos, ftrs_tokens, hf_tokens))}/{b}"})
    return rows


if __name__ == "__main__":
    main()
