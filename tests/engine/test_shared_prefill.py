"""Requests that share a prompt (n > 1) prefill it once: the others wait for its pages in the
prefix cache and compute only what the cache cannot hold (the last, partial page).

Expected counts are the arithmetic of pages: a 50-token prompt with 8-token pages has 6 full
pages a later request can take (it must compute at least one token), so it computes 50 - 48."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrs.engine.core import EngineCore
from ftrs.engine.protocol import GenerateRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

PAGE = 8
PROMPT = list(range(10, 60))  # 50 tokens: 6 full pages + 2
OTHER = list(range(300, 340))
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["llama"])


def drain(eng: EngineCore) -> tuple[int, int, dict[str, list[int]]]:
    """Step until idle: (prefill tokens, prefix-hit tokens, tokens per request)."""
    prefill = hit = 0
    out: dict[str, list[int]] = {}
    while eng.has_work():
        events, st = eng.step()
        prefill += st.prefill_tokens
        hit += st.prefix_hit_tokens
        for ev in events:
            out.setdefault(ev.request_id, []).extend(ev.new_token_ids)
    return prefill, hit, out


@pytest.mark.parametrize("budget", [512, 16])
def test_three_requests_with_one_prompt_prefill_it_once(model: str, budget: int) -> None:
    solo = LLM(model, kv_tokens=2048, page_size=PAGE).generate([PROMPT], GREEDY)[0].token_ids
    eng = LLM(model, kv_tokens=2048, page_size=PAGE, max_prefill_length=budget).engine
    for i in range(3):
        eng.add_request(GenerateRequest(f"r{i}", PROMPT, GREEDY))
    prefill, hit, out = drain(eng)
    assert prefill == 50 + 2 + 2  # without sharing: 150
    assert hit == 2 * 48
    assert all(toks == solo for toks in out.values())  # the cached pages hold the same KV
    assert eng.scheduler.kv_usage() == 0.0


def test_requests_behind_a_waiting_one_go_ahead(model: str) -> None:
    eng = LLM(model, kv_tokens=2048, page_size=PAGE, max_prefill_length=32).engine
    for rid, prompt in (("a", PROMPT), ("a2", PROMPT), ("b", OTHER)):
        eng.add_request(GenerateRequest(rid, prompt, GREEDY))
    eng.step()  # a: 32 of 50 tokens (4 full pages published after it)
    eng.step()  # a: the last 18; a2 still waits for pages 5-6; b takes the 14 tokens left
    running = {s.request_id for s in eng.scheduler.running}
    waiting = [s.request_id for s in eng.scheduler.waiting]
    assert running == {"a", "b"} and waiting == ["a2"]
    prefill, hit, _ = drain(eng)
    assert hit == 48  # a2 took all six shareable pages
    assert prefill == (40 - 14) + 2  # the rest of b, and a2's last two tokens


def test_different_prompts_do_not_wait(model: str) -> None:
    eng = LLM(model, kv_tokens=2048, page_size=PAGE).engine
    eng.add_request(GenerateRequest("a", PROMPT, GREEDY))
    eng.add_request(GenerateRequest("b", OTHER, GREEDY))
    _, st = eng.step()
    assert st.prefill_tokens == 90 and st.num_waiting == 0


def test_shared_prompts_under_a_tight_kv_budget_keep_their_results(model: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = LLM(model, kv_tokens=2048, page_size=PAGE).generate([PROMPT], params)[0].token_ids
    llm = LLM(model, kv_tokens=12 * PAGE, page_size=PAGE)  # 8 pages each: not 3 x 8 at once
    outs = llm.generate([PROMPT, PROMPT, OTHER, PROMPT], params)
    assert [c.token_ids for i, c in enumerate(outs) if i != 2] == [solo] * 3
    assert all(c.finish_reason == "length" for c in outs)
    assert llm.engine.scheduler.kv_usage() == 0.0
