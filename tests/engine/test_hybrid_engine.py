"""The engine on a Gated DeltaNet hybrid (tiny qwen3_5_moe): the linear attention state travels
with its sequence through batching, chunked prefill, preemption and slot reuse, and offloaded
experts change nothing. Expected outputs are each prompt run alone on a fresh engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

PROMPTS = [[5, 9, 100, 200, 300, 400, 17, 33, 64, 128, 256, 7, 8, 9, 10, 11, 12, 13],
           [42], list(range(100, 133)), [7] * 21, [300, 301, 302]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(hybrid_models: dict[str, Path]) -> str:
    return str(hybrid_models["qwen3_5_moe"])


@pytest.fixture(scope="module")
def alone(path: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:  # a fresh engine per prompt: no state slot was ever used before
        llm = LLM(path, kv_tokens=1024)
        out.append(llm.generate([p], GREEDY)[0].token_ids)
        llm.close()
    return out


def _slots_all_free(llm: LLM) -> bool:
    states = llm.engine.scheduler.states
    return states is not None and states.num_free == states.num_slots


@pytest.mark.parametrize("opts", [
    {},  # all prompts in one step, then decodes together
    {"max_prefill_length": 5},  # chunked prefills beside decodes of shorter prompts
    {"max_prefill_length": 3, "page_size": 4, "max_running_requests": 2},  # slots reused
])
def test_batching_and_chunking_change_no_greedy_result(path: str, alone: list[list[int]],
                                                       opts: dict[str, int]) -> None:
    llm = LLM(path, kv_tokens=1024, **opts)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == alone
    assert llm.engine.scheduler.radix is None  # prefix cache off for linear attention
    assert _slots_all_free(llm)


def test_preemption_recomputes_state_and_keeps_results(path: str, alone: list[list[int]]) -> None:
    llm = LLM(path, kv_tokens=96, page_size=8)  # 12 pages: not all five fit at once
    seqs = []
    add = llm.engine.scheduler.add
    llm.engine.scheduler.add = lambda s: (seqs.append(s), add(s))[1]  # type: ignore[method-assign]
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == alone
    assert sum(s.num_preemptions for s in seqs) > 0
    assert _slots_all_free(llm) and llm.engine.scheduler.kv_usage() == 0.0


def test_a_reused_slot_starts_from_zero(path: str, alone: list[list[int]]) -> None:
    llm = LLM(path, kv_tokens=1024, max_running_requests=1)  # every prompt gets slot 0
    for p, ref in zip(PROMPTS, alone):
        assert llm.generate([p], GREEDY)[0].token_ids == ref
    assert llm.engine.rt.kv.state is not None
    assert llm.engine.rt.kv.state.recurrent.shape[1] == 1


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offloaded_experts_equal_resident_bit_for_bit(path: str, strategy: str) -> None:
    def run(**opts: object) -> tuple[torch.Tensor, list[list[int]]]:
        llm = LLM(path, kv_tokens=1024, max_prefill_length=7, **opts)
        try:
            logits = llm.logits(PROMPTS[2])
            return logits, [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.close()

    ref = run(moe_strategy="resident")
    got = run(moe_strategy=strategy, moe_cache_rate=0.25, moe_prefetch=True)
    assert torch.equal(got[0], ref[0])
    assert got[1] == ref[1]
