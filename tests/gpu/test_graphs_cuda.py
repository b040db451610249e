"""Decode CUDA graphs on a real device: captured at startup, replayed by decode steps, and the
same greedy tokens and logits (fp32, within rounding) as the eager steps of `--no-cuda-graphs`.

The CPU tests (tests/engine/test_graphs.py) check the static buffers and the padding through
the eager stand-in; these check that the capture itself works (side-stream warm-up, one pool
for every bucket, the Triton kernels inside the graph) and that a replay reads the step's rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.test_graphs import GREEDY, PROMPTS, attach, run
from engine.test_graphs_offload import make as make_fused
from ftrs.engine.graphs import CudaGraphs
from ftrs.llm import LLM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make(path: Path, graphs: bool, kv: str = "auto") -> LLM:
    pytest.importorskip("triton")
    return LLM(str(path), device="cuda", dtype="float32", kernels="triton", kv_tokens=2048,
               max_running_requests=8, cuda_graphs=graphs, kv_cache_dtype=kv)


# llama again over an int8 KV cache: the quantized write and the kernel's scaled loads in a graph
@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("mixtral", "auto"), ("llama", "int8")])
def test_graph_replays_give_the_eager_steps(tiny_models: dict[str, Path], arch: str,
                                            kv: str) -> None:
    llm = make(tiny_models[arch], graphs=False, kv=kv)
    assert llm.engine.rt.graphs is None
    eager_tokens, eager_steps = run(llm)
    llm.close()
    llm = make(tiny_models[arch], graphs=True, kv=kv)
    graphs = llm.engine.rt.graphs
    moe = llm.engine.rt.decoder.moe
    if graphs is None and moe is not None:
        pytest.skip(f"graphs off for {arch}: {moe.graph_support().why}")
    assert isinstance(graphs, CudaGraphs)
    assert graphs.buckets == (1, 2, 4, 8)
    tokens, steps = run(llm)
    replays = graphs.replays
    llm.close()
    assert replays == GREEDY.max_tokens - 1  # every decode step of the 4 prompts replayed
    assert tokens == eager_tokens
    assert len(steps) == len(eager_steps) and len(PROMPTS) == steps[-1].shape[0]
    for a, b in zip(eager_steps, steps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_offload_split_graphs_give_the_eager_steps(tiny_models: dict[str, Path]) -> None:
    """Offload in "layer" mode (a quarter of the experts in slots, real copies): captured
    segments around the host steps give the eager offload's tokens and logits."""
    llm = make_fused(tiny_models["mixtral"], "offload", device="cuda")
    eager_tokens, eager_steps = run(llm)
    llm.close()
    llm = make_fused(tiny_models["mixtral"], "offload", device="cuda")
    graphs = attach(llm, (1, 2, 4, 8), cls=CudaGraphs)
    assert len(graphs.static[8].segments) == len(llm.engine.spec.moe_layers) + 1
    tokens, steps = run(llm)
    llm.close()
    assert graphs.replays == GREEDY.max_tokens - 1
    assert tokens == eager_tokens
    for a, b in zip(eager_steps, steps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("link", ["slow", "by-tokens", "cpu-mode"])
def test_hybrid_split_graphs_give_the_eager_steps(tiny_models: dict[str, Path],
                                                  link: str) -> None:
    """Hybrid in "layer" mode with a real link: the host step's CPU share and fetches around
    captured segments give the eager hybrid's tokens and logits (split injected both runs;
    "cpu-mode": both held in the all-CPU layer mode, an empty slot table in every replay)."""
    from engine.test_graphs_offload import hold_mode, split_by

    def inject(moe: object) -> None:
        if link == "cpu-mode":
            hold_mode(moe, "cpu")
        else:
            split_by(moe, link)

    llm = make_fused(tiny_models["mixtral"], "hybrid", device="cuda")
    inject(llm.engine.rt.decoder.moe)
    eager_tokens, eager_steps = run(llm)
    llm.close()
    llm = make_fused(tiny_models["mixtral"], "hybrid", device="cuda")
    moe = llm.engine.rt.decoder.moe
    inject(moe)
    graphs = attach(llm, (1, 2, 4, 8), cls=CudaGraphs)
    tokens, steps = run(llm)
    s = moe.stats()
    llm.close()
    assert graphs.replays == GREEDY.max_tokens - 1
    assert s["cpu_computed"] > 0
    if link == "cpu-mode":
        assert s["layers_split"] == 0 and s["device_computed"] == s["fetched"] == 0
    assert tokens == eager_tokens
    for a, b in zip(eager_steps, steps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
