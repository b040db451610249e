"""N-gram speculative decoding on a real device: the Triton paged kernel takes a draft as one
causal span, decode steps without drafts still replay their CUDA graph, and the greedy tokens
(fp32) equal decoding one token at a time (tests/engine/test_speculative.py on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.test_speculative import GREEDY, PROMPTS, flat
from ftrs.llm import LLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make(path: Path, k: int, kv: str = "auto") -> LLM:
    pytest.importorskip("triton")
    llm = LLM(str(path), device="cuda", dtype="float32", kernels="triton", kv_tokens=2048,
              max_running_requests=8, speculative_ngram=k, kv_cache_dtype=kv)
    if k:
        llm.engine.set_speculative_ngram(k, step_cost=flat)  # every lookup drafts
    return llm


@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("mixtral", "auto"), ("llama", "int8")])
def test_drafts_change_no_greedy_token_on_the_device(tiny_models: dict[str, Path], arch: str,
                                                     kv: str) -> None:
    llm = make(tiny_models[arch], 0, kv)
    ref = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    llm.close()
    llm = make(tiny_models[arch], 8, kv)
    out = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    stats = llm.engine.speculative_stats()
    llm.close()
    assert out == ref
    assert stats["accepted_tokens"] > 0
