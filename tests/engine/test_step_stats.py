"""What `StepStats` carries from the engine to /metrics: the experts a prefill step fetched
(`engine.fetch`) and the scheduler's preemptions."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftrs.engine.fetch import h2d_bytes
from ftrs.engine.protocol import GenerateRequest, StepStats
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams
from ftrs.server.metrics import ServerMetrics

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _samples(m: ServerMetrics) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(m.render().decode())
            for s in fam.samples if not s.labels}


def _run(llm: LLM, prompts: list[list[int]],
         params: SamplingParams = GREEDY) -> list[tuple[float | None, StepStats]]:
    """Step the engine until it is done: each step's stats, with the bytes counter before it."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(GenerateRequest(f"r{i}", p, params))
    steps = []
    while llm.engine.has_work():
        before = h2d_bytes(llm.engine.expert_stats())
        _, stats = llm.engine.step()
        steps.append((before, stats))
    return steps


def test_a_prefill_step_reports_the_expert_bytes_it_fetched(tiny_models: dict[str, Path]) -> None:
    # 5 of 24 experts on the device, 7 prompt tokens a step: every chunk fetches experts
    llm = LLM(str(tiny_models["mixtral"]), kv_tokens=256, dtype="float32", max_prefill_length=7,
              moe_strategy="offload", moe_cache_size=5, moe_prefetch=False)
    steps = _run(llm, [list(range(3, 40)), [7, 8, 9, 10, 11]])
    m = ServerMetrics()
    for _, stats in steps:
        m.observe_step(stats)
    prefills = [(before, s) for before, s in steps if s.prefill_tokens > 0]
    assert len(prefills) >= 6  # 42 prompt tokens, 7 a step
    for before, s in prefills:
        assert before is not None
        after = h2d_bytes(s.experts)
        assert after is not None and s.experts["prefill_fetch_bytes"] == after - before
    assert all("prefill_fetch_bytes" not in s.experts for _, s in steps if not s.prefill_tokens)
    fetched = sum(s.experts["prefill_fetch_bytes"] for _, s in prefills)
    assert fetched > 0 and fetched % llm.engine.expert_stats()["expert_bytes"] == 0
    got = _samples(m)
    assert got["ftrs_prefill_chunk_fetch_bytes_count"] == len(prefills)
    assert got["ftrs_prefill_chunk_fetch_bytes_sum"] == fetched
    llm.close()


def test_a_resident_engine_fetches_nothing_and_reports_no_fetch(
        tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["mixtral"]), kv_tokens=256, dtype="float32")
    steps = _run(llm, [list(range(3, 20))])
    assert steps and all("prefill_fetch_bytes" not in s.experts for _, s in steps)
    llm.close()


def test_preemptions_reach_the_step_stats_and_the_counter(
        tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    # 12 pages of 8 tokens: the four cannot all run at once (tests/engine/test_engine.py)
    llm = LLM(str(tiny_models["qwen3_moe"]), kv_tokens=96, page_size=8)
    prompts = [[5, 9, 100, 200, 300, 400, 17, 33, 64, 128, 256, 7, 8, 9, 10, 11, 12, 13],
               [40, 41, 42], list(range(100, 140)), [7] * 25]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="ftrs.scheduler.scheduler"):
        steps = _run(llm, prompts, params)
    logged = sum("preempting" in r.getMessage() for r in caplog.records)
    totals = [s.preemptions for _, s in steps]
    assert logged > 0 and totals[-1] == logged
    assert totals == sorted(totals)  # cumulative
    m = ServerMetrics()
    for _, stats in steps:
        m.observe_step(stats)
    assert _samples(m)["ftrs_preemptions_total"] == logged
    llm.close()


def test_cached_tokens_count_prompt_tokens_only_after_a_preemption(
        tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """A preempted request's pages go back to the prefix cache, generated tokens included; its
    re-admission matches them. The prefix-hit counter counts that (prefill the cache saved, prompt
    tokens only: never more than the prompts have); usage's `cached_tokens` is what the prompt
    found cached at its first admission, kept across preemptions: nothing, for these four
    prompts that share no page."""
    llm = LLM(str(tiny_models["qwen3_moe"]), kv_tokens=96, page_size=8)
    prompts = [[5, 9, 100, 200, 300, 400, 17, 33, 64, 128, 256, 7, 8, 9, 10, 11, 12, 13],
               [40, 41, 42], list(range(100, 140)), [7] * 25]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.engine.add_request(GenerateRequest(f"r{i}", p, params))
    cached: dict[str, int] = {}
    hits = 0
    with caplog.at_level(logging.INFO, logger="ftrs.scheduler.scheduler"):
        while llm.engine.has_work():
            events, stats = llm.engine.step()
            hits += stats.prefix_hit_tokens
            for e in events:
                cached[e.request_id] = max(cached.get(e.request_id, 0), e.num_cached_tokens)
    preempted = {r.getMessage().split()[1] for r in caplog.records
                 if "preempting" in r.getMessage()}
    assert preempted  # the case under test happened
    sizes = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    assert cached == {rid: 0 for rid in sizes}, cached
    assert 0 < hits <= sum(sizes[rid] for rid in preempted)  # its pages came back
    llm.close()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_prefix_cache_is_a_setting(tiny_models: dict[str, Path], prefix_cache: bool) -> None:
    """`prefix_cache=False` (`--no-prefix-cache`) prefills a prompt served before in full: a
    benchmark that replays the same prompts under several settings starts each from the same
    state. On (the default), the second run of a 40-token prompt reuses its first 32."""
    llm = LLM(str(tiny_models["qwen3_moe"]), kv_tokens=256, page_size=8, prefix_cache=prefix_cache)
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.token_ids == first.token_ids
    assert second.num_cached_tokens == (32 if prefix_cache else 0)
    llm.close()
