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

    python bench/generate.py           # 32 tokens, 2 repetitions
    python bench/generate.py --quick   # 12 tokens, 1 repetition
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from ftrs.llm import LLM
from ftrs.sampling import SamplingParams


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quick", action="store_true", help="12 tokens, 1 repetition")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.reps = 12, 1
    from transformers import AutoModelForCausalLM

    import _common as common

    path = args.model or common.demo_path()
    llm = LLM(path, device=args.device, dtype="float32", kv_tokens=8192)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    chats = [llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content": p}]))
             for p in common.PROMPTS]
    cut = min(len(c) for c in chats)
    n = args.max_tokens
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        prompts = [c[:cut] for c in (chats * b)[:b]] if b > 1 else [chats[0]]
        ours, theirs = [], []
        for _ in range(args.reps):
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
    print(json.dumps({"bench": "generate", "model": args.model or "demo", "device": args.device,
                      "dtype": "float32", "torch_threads": torch.get_num_threads(),
                      "moe_strategy": llm.config.moe_strategy, "rows": rows}, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
