"""MLA decode: ftrs's absorbed attention over a latent-only KV cache against transformers'
DeepSeek-V2 forward (the reference: the same latent cache, expanded through kv_b into every
head's keys and values at each step), side by side in one run, at several context lengths.

    .venv/bin/python bench/mla.py [--contexts 256 1024 4096] [--steps 8] [--layers 2]

The checkpoint is written here by transformers with DeepSeek-V2-Lite's attention shapes (hidden
2048, 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, no q_lora), random weights,
`--layers` layers (the first dense, the rest MoE with four small experts: the attention is
what is timed), fp32 on the CPU. Per context: one prompt of that many tokens, then `--steps`
greedy decode tokens; `ms_per_token` is the median of the decode steps (ftrs: the engine's own
step timings; transformers: its forward with its cache, one token at a time). Also the KV bytes
a token takes per layer: ftrs's cache (one latent row, keys and values), and what the heads'
expanded keys and values would take (an engine that caches them, as for GQA models). Printed as
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import run_steps
from ftrs.llm import LLM
from ftrs.models.tiny import tiny_tokenizer

# transformers probes for a `kernels` package, and this folder's kernels.py is not it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

LITE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 2048, "intermediate_size": 1024,
    "moe_intermediate_size": 128, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "topk_method": "greedy", "max_position_embeddings": 16384, "rms_norm_eps": 1e-6}


def build(root: Path, layers: int) -> Path:
    import transformers

    cfg = transformers.DeepseekV2Config(**(LITE | {"num_hidden_layers": layers}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(root))
    tiny_tokenizer(LITE["vocab_size"]).save(root)
    return root


def hf_ms_per_token(path: Path, prompt: list[int], steps: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, experts_implementation="eager").eval()
    times = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
    return 1e3 * statistics.median(times)


def ftrs_ms_per_token(path: Path, prompt: list[int], steps: int) -> tuple[float, int]:
    llm = LLM(str(path), kv_tokens=len(prompt) + steps + 64, dtype="float32")
    try:
        stats = run_steps(llm, [prompt], steps + 1)
        eng = llm.engine  # a token's keys and values (MLA: one latent row) in one layer
        per_layer = eng.kv_cache_bytes() // eng.kv_slots() // len(eng.spec.kv_layers)
        dec = [s.duration_s for s in stats if s.kind == "decode"]
        return 1e3 * statistics.median(dec), per_layer
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2,
                    help="decoder layers, at least 2 (the first is dense, as in V2-Lite)")
    args = ap.parse_args()
    if args.layers < 2:
        ap.error(f"--layers: at least 2 (the first layer is dense), got {args.layers}")
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "layers": args.layers,
                              "contexts": {}}
    heads, qk, v = LITE["num_attention_heads"], 128 + 64, LITE["v_head_dim"]
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp), args.layers)
        for ctx in args.contexts:
            prompt = [(i * 37 + 11) % 509 + 3 for i in range(ctx)]
            ours, kv_bytes = ftrs_ms_per_token(path, prompt, args.steps)
            ref = hf_ms_per_token(path, prompt, args.steps)
            result["contexts"][str(ctx)] = {
                "ftrs_ms_per_token": round(ours, 2), "transformers_ms_per_token": round(ref, 2),
                "transformers_over_ftrs": round(ref / ours, 2)}
        result["kv_bytes_per_token_per_layer"] = {
            "ftrs_latent": kv_bytes, "expanded_heads": heads * (qk + v) * 4,
            "expanded_over_latent": round(heads * (qk + v) * 4 / kv_bytes, 2)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
