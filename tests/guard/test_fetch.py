"""The fetch-volume model against hand-computed volumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrs.guard.fetch import FetchModel, expert_block_bytes, fetch_model_from_spec
from ftrs.models.arch import arch_from_config

DEMO_CFG = {"model_type": "mixtral", "vocab_size": 49152, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "num_local_experts": 8, "num_experts_per_tok": 2}


def test_demo_shapes_bf16() -> None:
    spec = arch_from_config(DEMO_CFG)
    fm = fetch_model_from_spec(spec, "bfloat16")
    assert expert_block_bytes(spec, "bfloat16") == 3 * 576 * 1536 * 2  # already 256-aligned
    assert fm.total_expert_bytes == 30 * 8 * 3 * 576 * 1536 * 2
    assert fm.decode_bytes_per_token(0.5) == pytest.approx(30 * 2 * 0.5 * 3 * 576 * 1536 * 2)
    assert fm.distinct_experts(1) == pytest.approx(2.0)
    assert fm.distinct_experts(2) == pytest.approx(8 * (1 - 0.75**2))
    assert fm.prefill_chunk_bytes(8192) == pytest.approx(fm.total_expert_bytes)


def test_measured_counts_interpolate_and_never_exceed_experts() -> None:
    fm = FetchModel("m", 100, 2, 8, 2).with_measured([(16, 4.0), (64, 6.0)])
    assert fm.distinct_experts(1) == 2.0
    assert fm.distinct_experts(40) == pytest.approx(5.0)
    assert fm.distinct_experts(64) == pytest.approx(max(6.0, 8 * (1 - 0.75**64)))
    assert fm.distinct_experts(10**6) <= 8.0
    assert fm.largest_chunk_within(fm.prefill_chunk_bytes(40), 8192) >= 40


def test_measured_chunks_run_in_one_forward_whatever_the_step_budget(
        tiny_models: dict[str, Path]) -> None:
    """`measure_distinct_experts` counts the experts of one forward of each chunk: an engine
    whose step budget is below the chunk gives what one with room for it gives, and keeps its
    budget."""
    from ftrs.guard.fetch import measure_distinct_experts
    from ftrs.llm import LLM

    def measure(budget: int) -> tuple[list[tuple[int, float]], int]:
        llm = LLM(str(tiny_models["mixtral"]), kv_tokens=256, dtype="float32",
                  moe_strategy="offload", moe_prefetch=False, max_prefill_length=budget)
        try:
            return measure_distinct_experts(llm, [1, 24, 64]), llm.engine.step_budget()
        finally:
            llm.close()

    narrow, kept = measure(4)
    wide, _ = measure(128)
    assert kept == 4 and narrow == wide and [c for c, _ in narrow] == [1, 24, 64]
