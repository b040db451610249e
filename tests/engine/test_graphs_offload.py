"""Offload in "layer" mode through the decode graph machinery on the CPU: the eager stand-in
(`EagerGraphs`) runs each bucket's segments, the host steps between them, the padding and the
copy-out as a CUDA graph replay would, with the fused kernels under Triton's interpreter and a
simulated link into a cache of a quarter of the experts.

Oracles: the eager engine (no graphs) with the same strategy and cache, and with `resident`
(every expert in place), for the greedy tokens and every step's logits, within the graph tests'
tolerance for MoE models (1e-5: the padding rows join the experts' matmuls, so the kernel's row
blocks differ from the unpadded step's); the transfer engine's own count of demanded experts,
which the eager run (no padding rows) sets: the padding rows fetch nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.test_graphs import GREEDY, attach, run
from ftrs.config import EngineConfig
from ftrs.kernels import select_kernels, triton_runs_on
from ftrs.llm import LLM
from ftrs.moe.base import GraphSupport, create_strategy

pytest.importorskip("triton")


def make(path: Path, strategy: str, device: str = "cpu") -> LLM:
    """An engine whose MoE layers run `strategy` on the fused kernel (the runtime does not pass
    kernels to strategies yet: the strategy is swapped in, as benches do). Offload: a quarter
    of the experts, a simulated link on the CPU, real copies on CUDA."""
    dev = torch.device(device)
    if not triton_runs_on(dev):
        pytest.skip(f"the fused kernel cannot run on {device} (on the CPU: TRITON_INTERPRET=1)")
    options: dict[str, Any] = {}
    if strategy == "offload":
        options = {"moe_cache_rate": 0.25, "moe_prefetch": True,
                   "copy_backend": "simulated:1:300" if dev.type == "cpu" else "cuda"}
    llm = LLM(str(path), device=device, dtype="float32", kv_tokens=256,
              max_running_requests=16, moe_strategy=strategy, **options)
    parts = llm.engine.moe_parts()
    config = EngineConfig(model=str(path), moe_strategy=strategy, **options)
    fused = create_strategy(strategy, experts=parts.experts, device=parts.device, config=config,
                            routers=parts.routers, kernels=select_kernels("triton", dev))
    old = llm.engine.use_moe_strategy(fused)
    assert old is not None
    old.close()
    return llm


def test_offload_through_split_graphs_equals_eager_offload_and_resident(
        tiny_models: dict[str, Path]) -> None:
    path = tiny_models["mixtral"]
    results = {}
    for strategy in ("resident", "offload"):
        llm = make(path, strategy)
        results[strategy] = run(llm)
        if strategy == "offload":
            eager_lookups = llm.engine.rt.decoder.moe.engine.stats()["lookups"]  # type: ignore
        llm.close()
    llm = make(path, "offload")
    moe: Any = llm.engine.rt.decoder.moe
    assert moe.graph_support() == GraphSupport("layer")
    graphs = attach(llm, (8,))  # four prompts: four padding rows per step
    tables = [t.data_ptr() for t in moe._graph.tables.values()]
    before = moe.engine.stats()["lookups"]  # the warm-up's host steps had no real row
    tokens, steps = run(llm)
    lookups = moe.engine.stats()["lookups"] - before
    after = [t.data_ptr() for t in moe._graph.tables.values()]
    llm.close()
    assert graphs.replays == GREEDY.max_tokens - 1  # every decode step went through the bucket
    assert after == tables
    assert lookups == eager_lookups  # the same demanded experts as without padding rows
    for strategy in ("offload", "resident"):
        want_tokens, want_steps = results[strategy]
        assert tokens == want_tokens
        for a, b in zip(want_steps, steps, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
