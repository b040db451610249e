"""Engine behaviour: batching, chunked prefill, preemption and prefix caching change no result."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrs.engine.protocol import GenerateRequest
from ftrs.errors import ContextLengthExceeded, InvalidRequest
from ftrs.llm import LLM
from ftrs.sampling import SamplingParams

PROMPTS = [[5, 9, 100, 200, 300, 400, 17, 33, 64, 128, 256, 7, 8, 9, 10, 11, 12, 13],
           [40, 41, 42], list(range(100, 140)), [7] * 25]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_path(tiny_models: dict[str, Path]) -> str:
    return str(tiny_models["qwen3_moe"])


def alone(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [llm.generate([p], params)[0].token_ids for p in PROMPTS]


def test_batching_and_chunking_change_no_greedy_result(moe_path: str) -> None:
    ref = alone(LLM(moe_path, kv_tokens=2048), GREEDY)
    for opts in ({"kv_tokens": 2048}, {"kv_tokens": 2048, "max_prefill_length": 5},
                 {"kv_tokens": 2048, "max_prefill_length": 1, "page_size": 4}):
        batched = [c.token_ids for c in LLM(moe_path, **opts).generate(PROMPTS, GREEDY)]
        assert batched == ref, opts


def test_preemption_when_kv_runs_out_keeps_results(moe_path: str) -> None:
    ref = alone(LLM(moe_path, kv_tokens=2048), GREEDY)
    llm = LLM(moe_path, kv_tokens=96, page_size=8)  # 12 pages: the four cannot all run at once
    outs = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outs] == ref
    assert all(c.finish_reason == "length" for c in outs)
    assert llm.engine.scheduler.kv_usage() == 0.0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(moe_path: str) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    llm = LLM(moe_path, kv_tokens=2048)
    solo = alone(llm, params)
    batch = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert batch == solo
    other = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.9, seed=99,
                                                      ignore_eos=True))[0].token_ids
    assert other != solo[0]


def test_prefix_cache_hit_on_a_repeated_prompt(moe_path: str) -> None:
    llm = LLM(moe_path, kv_tokens=2048, page_size=8)
    prompt = list(range(10, 60))
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # whole pages only, and one token is always computed
    assert second.token_ids == first.token_ids


def test_abort_frees_kv_pages(moe_path: str) -> None:
    llm = LLM(moe_path, kv_tokens=512, page_size=8)
    eng = llm.engine
    eng.add_request(GenerateRequest("a", list(range(30)), GREEDY))
    eng.step()
    assert eng.scheduler.kv_usage() > 0
    eng.abort("a")
    assert eng.scheduler.kv_usage() == 0.0 and not eng.has_work()


def test_stop_conditions(moe_path: str) -> None:
    llm = LLM(moe_path, kv_tokens=2048)
    free = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    stop_tok = free[5]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0,
                                                    stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == free[: free.index(stop_tok) + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_bad_requests_raise_typed_errors(moe_path: str) -> None:
    llm = LLM(moe_path, kv_tokens=256, max_model_len=128)
    with pytest.raises(ContextLengthExceeded):
        llm.generate([list(range(120))], SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequest, match="temperature"):
        llm.generate([[1, 2]], SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.generate([[1, 10_000]], SamplingParams())
    with pytest.raises(InvalidRequest, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=0))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].finish_reason is not None


def test_torch_threads_is_a_flag_applied_at_load(moe_path: str) -> None:
    import argparse

    import torch

    from ftrs.config import EngineConfig, add_engine_arguments, engine_config_from_args
    from ftrs.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--torch-threads", "1"]))
    assert config.torch_threads == 1
    with pytest.raises(ConfigError, match="torch_threads"):
        EngineConfig(torch_threads=0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLM(moe_path, kv_tokens=64, torch_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
