"""The offload strategy over the `cuda` copy backend against `resident`, both on the GPU (fp32).

The oracle of tests/moe/test_offload.py, on a real device: offload through the Rust cuda
backend (pinned pool → device slots on the engine's own stream) must give the SAME logits as
resident, bit for bit, in prefill and in every step of a chunked, batched greedy generation,
for caches of top_k slots (waves), half and all experts, with prefetch on and off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.llm import LLM
from moe.test_offload import (
    IDS,
    MOE_ARCHS,
    PREFILL_BUDGET,
    Run,
    assert_same,
    check_counters,
    quiesce,
    run,
    slots_for,
    strategy,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make_cuda(path: Path, **options: Any) -> LLM:
    return LLM(str(path), kv_tokens=2048, dtype="float32", device="cuda",
               max_prefill_length=PREFILL_BUDGET, **options)


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[str, Run]:
    out = {}
    for arch in MOE_ARCHS:
        llm = make_cuda(tiny_models[arch], moe_strategy="resident")
        out[arch] = run(llm)
        llm.close()
    return out


@pytest.fixture(scope="module")
def shape(tiny_models: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """(top_k, experts of all MoE layers) per architecture."""
    out = {}
    for arch in MOE_ARCHS:
        llm = make_cuda(tiny_models[arch], moe_strategy="offload", moe_cache_size=None,
                        copy_backend="cuda")
        moe = strategy(llm)
        out[arch] = (moe.spec.top_k, moe.experts.num_experts_total)
        llm.close()
    return out


@pytest.mark.parametrize("prefetch", [True, "chunked", False],
                         ids=["prefetch", "prefetch-chunked", "no-prefetch"])
@pytest.mark.parametrize("capacity", ["top_k", "half", "all"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cuda_offload_equals_resident_bit_for_bit(tiny_models: dict[str, Path],
                                                  reference: dict[str, Run],
                                                  shape: dict[str, tuple[int, int]],
                                                  arch: str, capacity: str,
                                                  prefetch: bool | str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    top_k, total = shape[arch]
    slots = slots_for(capacity, top_k, total)
    if prefetch == "chunked":  # decode prefetches as 3 async copies per (tiny) expert
        monkeypatch.setattr("ftrs.moe.offload.CHUNK_ALIGN", 64)
        monkeypatch.setattr("ftrs.moe.offload.MIN_CHUNK_BYTES", 64)
        monkeypatch.setattr("ftrs.moe.offload.NARROW_PREFETCH_CHUNKS", 3)
    llm = make_cuda(tiny_models[arch], moe_strategy="offload", moe_cache_size=slots,
                    moe_prefetch=bool(prefetch), copy_backend="cuda")
    moe = strategy(llm)
    assert moe.num_slots == slots
    assert moe.backend == "cuda:0"  # the strategy names the model's device...
    assert moe.engine.backend_name == "cuda"  # ...and the engine calls ordinal 0 plain "cuda"
    assert moe.buffer.is_cuda and moe.experts.pool.pinned

    prefill = llm.logits(IDS)
    first = quiesce(moe)  # one forward from an empty cache
    check_counters(first)
    assert first["bytes_h2d"] > 0
    if capacity == "top_k":
        assert max(first["distinct_experts"]) > slots  # the wave path is exercised

    got = run(llm)
    assert got.prefill.dtype == torch.float32
    assert torch.equal(prefill, got.prefill)
    assert_same(got, reference[arch])

    s = quiesce(moe)
    check_counters(s)
    if capacity == "all":
        assert s["bytes_h2d"] <= total * s["expert_bytes"]
    llm.close()
