"""Offload with quantized experts equals resident with quantized experts, bit for bit.

The tiny qwen3moe GGUF keeps its experts as K-quant blocks whose type differs between layers
(down: Q6_K in layer 0, Q4_K in layer 2), so a device slot holds different formats over time.
The link carries the file's bytes: a miss moves one quantized expert block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.llm import LLM
from ftrs.moe import resident
from ftrs.sampling import SamplingParams
from quant_models import QWEN3MOE_TYPES, build

IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]
PROMPTS = [IDS, IDS[:5], IDS[3:17]]


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3_moe", QWEN3MOE_TYPES, tmp_path_factory.mktemp("q"))[0]


def _run(path: Path, **options: Any) -> tuple[torch.Tensor, list[list[int]], LLM]:
    llm = LLM(str(path), kv_tokens=2048, dtype="float32", device="cpu", max_prefill_length=7,
              **options)
    prefill = llm.logits(IDS)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    return prefill, [o.token_ids for o in outs], llm


@pytest.mark.parametrize("slots,prefetch", [(4, False), (5, True), (8, True)])
def test_quantized_offload_equals_resident(gguf_model: Path, slots: int, prefetch: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    layer_calls = []  # resident runs each layer's experts in one kernel call; offload does not
    real = resident.routed_experts_ffn
    monkeypatch.setattr(resident, "routed_experts_ffn",
                        lambda *a: layer_calls.append(1) or real(*a))
    ref_logits, ref_tokens, ref = _run(gguf_model, moe_strategy="resident")
    ref.close()
    assert layer_calls, "resident took the per-expert path: this test would compare it to itself"
    logits, tokens, llm = _run(gguf_model, moe_strategy="offload", moe_cache_size=slots,
                               moe_prefetch=prefetch)
    try:
        assert torch.equal(logits, ref_logits)
        assert tokens == ref_tokens
        moe = llm.engine.rt.moe
        assert moe is not None
        experts = moe.experts  # type: ignore[attr-defined]
        # one slot is the largest quantized expert: (Q4_K + Q5_K + Q6_K) blocks, aligned; a
        # layer whose down is Q4_K has smaller blocks, and a miss there moves only those
        assert experts.quantized
        assert experts.expert_bytes == sum(-(-256 * b // 256) * 256 for b in (144, 176, 210))
        small = sum(-(-256 * b // 256) * 256 for b in (144, 176, 144))
        assert min(experts.block_bytes(la) for la in experts.layer_index) == small
        s = moe.stats()
        assert s["expert_bytes"] == experts.expert_bytes
        landed = s["demand_fetches"] + s["prefetch_issued"] - s["prefetch_cancelled"]
        issued = s["demand_fetches"] + s["prefetch_issued"]
        assert 0 < landed * small <= s["bytes_h2d"] <= issued * s["expert_bytes"]
    finally:
        llm.close()


def test_pool_holds_each_layers_experts_at_their_file_size(gguf_model: Path) -> None:
    import gguf

    llm = LLM(str(gguf_model), kv_tokens=256, dtype="float32", device="cpu",
              moe_strategy="resident")
    try:
        pool = llm.engine.expert_pool_bytes()
        n = llm.engine.rt.spec.num_experts
    finally:
        llm.close()
    # the oracle: the file's own per-expert tensor sizes, each rounded up to the 256-byte
    # alignment, per layer: no layer pays for another layer's larger type
    want = sum(-(-int(t.n_bytes) // n // 256) * 256 * n
               for t in gguf.GGUFReader(str(gguf_model)).tensors if t.name.endswith("_exps.weight"))
    assert pool == want
