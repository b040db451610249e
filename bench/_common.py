"""Shared pieces of the MoE benches (offload.py, policies.py, generate.py).

Imported by the scripts beside it (`import _common as common`).

- `RoutingRecorder`: a MoE strategy that records the router's choice, then delegates.
- `run_steps`: drive an `LLM`'s engine step by step and keep every `StepStats`, so decode
  steps are timed apart from prefill steps.
- `corpus_ids`: real text for long prefills (the repository's own docs and sources).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ftrs.engine.protocol import GenerateRequest, StepStats
from ftrs.llm import LLM
from ftrs.moe.base import MoEStrategy
from ftrs.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "def fibonacci(n):",
    "Explain photosynthesis briefly.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
]


@dataclass
class Forward:
    """Router choices of one forward pass: per MoE layer, ids (tokens, k) int64 on the CPU."""

    num_tokens: int
    ids: dict[int, torch.Tensor] = field(default_factory=dict)


class RoutingRecorder(MoEStrategy):
    """Wraps a strategy; records each forward's routing (`forwards`) when `keep_ids`, else only
    the distinct experts per layer (`steps`: one sorted list per MoE layer and forward)."""

    name = "recorder"

    def __init__(self, inner: MoEStrategy, keep_ids: bool = False) -> None:
        self.inner = inner
        self.keep_ids = keep_ids
        self.forwards: list[Forward] = []
        self.steps: list[tuple[int, int, list[int]]] = []  # (forward, layer, distinct experts)

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        fwd = self.forwards[-1]
        if self.keep_ids:
            fwd.ids[layer] = ids.detach().cpu().clone()
        self.steps.append((len(self.forwards) - 1, layer, torch.unique(ids).tolist()))
        return self.inner.forward(layer, x, ids, weights)

    def begin_forward(self, num_tokens: int) -> None:
        self.forwards.append(Forward(num_tokens))
        self.inner.begin_forward(num_tokens)

    def end_forward(self) -> None:
        self.inner.end_forward()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def use_threads(n: int) -> None:
    """Run torch's CPU ops and the Rust kernels' pool on `n` threads each."""
    from ftrs import _core

    torch.set_num_threads(n)
    _core.quant_set_threads(n)


def use_strategy(llm: LLM, strategy: MoEStrategy) -> None:
    """Make `strategy` the one the decoder calls (the old one is not closed)."""
    llm.engine.use_moe_strategy(strategy)


def run_steps(llm: LLM, prompts: list[list[int]], max_tokens: int,
              prefix: str = "bench") -> list[StepStats]:
    """Greedy, EOS ignored: every request yields exactly `max_tokens`. Returns every step's stats."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    eng = llm.engine
    for i, ids in enumerate(prompts):
        eng.add_request(GenerateRequest(f"{prefix}-{time.monotonic_ns()}-{i}", ids, params))
    out: list[StepStats] = []
    while eng.has_work():
        _, st = eng.step()
        out.append(st)
    return out


def decode_summary(steps: list[StepStats]) -> dict[str, float]:
    """Seconds and tokens of the pure decode steps (no prefill token in the batch)."""
    dec = [s for s in steps if s.kind == "decode"]
    secs = sum(s.duration_s for s in dec)
    toks = sum(s.decode_tokens for s in dec)
    return {"decode_s": secs, "decode_tokens": toks, "decode_steps": len(dec),
            "tok_per_s": toks / secs if secs else float("nan")}


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """Scalar counters of `stats()` after minus before (lists and gauges left out)."""
    gauges = {"queue_depth", "inflight_bytes", "slots", "expert_bytes", "fill_queued"}
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, int) and k not in gauges}


def corpus_ids(llm: LLM, n: int) -> list[int]:
    """`n` token ids of real text: README, docs and Python sources of this repository, repeated
    if short. Code-heavy, deterministic, and present in every checkout."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "python" / "ftrs").rglob("*.py"))]
    ids: list[int] = []
    for f in files:
        if f.is_file():
            ids += llm.tokenizer.encode(f.read_text(errors="replace"))
        if len(ids) >= n:
            break
    while len(ids) < n:
        ids += ids
    return ids[:n]


def demo_path() -> str:
    from ftrs.models.demo import ensure_demo

    return str(ensure_demo())
