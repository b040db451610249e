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
    if strategy in ("offload", "hybrid"):
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


def split_by(moe: Any, link: str) -> None:
    """Hybrid's split injected (`device_is_cpu` off, as on a GPU): "slow" sends every miss to
    the CPU, "fast" to the link, "by-tokens" single-token experts to the CPU and wider ones to
    the link; eager layers held on the split (`LayerModes`), as graphs always are."""
    from ftrs.moe.hybrid import CostModel, LayerModes

    moe.cost = {"slow": CostModel(1.0, 1.0, cpu_s_per_token=1e-9, learn=False),
                "fast": CostModel(1e15, 0.0, cpu_s_per_token=1.0, learn=False),
                "by-tokens": CostModel(1e12, 2.5e-6, cpu_s_per_token=2e-6, learn=False)}[link]
    moe.modes = LayerModes(explore_share=0, learn=False)
    moe.modes.seconds = {(m, 1 << b): t for b in range(8) for m, t in (("split", 0.0), ("cpu", 1.0))}


@pytest.mark.parametrize("link", ["slow", "fast", "by-tokens"])
def test_hybrid_through_split_graphs_equals_eager_hybrid_and_resident(
        tiny_models: dict[str, Path], link: str) -> None:
    """Hybrid in "layer" mode: the split and the CPU share in the host step, the CPU experts'
    rows written into the pair buffer the captured kernel fills for the device's."""
    path = tiny_models["mixtral"]
    want = run(make(path, "resident"))
    eager_llm = make(path, "hybrid")
    split_by(eager_llm.engine.rt.decoder.moe, link)
    eager = run(eager_llm)
    eager_llm.close()
    llm = make(path, "hybrid")
    moe: Any = llm.engine.rt.decoder.moe
    split_by(moe, link)
    assert moe.graph_support() == GraphSupport("layer")
    graphs = attach(llm, (8,))
    before = moe.stats()
    tokens, steps = run(llm)
    after = moe.stats()
    llm.close()
    assert graphs.replays == GREEDY.max_tokens - 1
    cpu, fetched, hits = (after[k] - before[k] for k in ("cpu_computed", "fetched",
                                                          "device_computed"))
    if link == "slow":  # (no prefetch on a CPU device: nothing is ever in a slot)
        assert cpu > 0 and fetched == 0 and hits == 0
    elif link == "fast":  # the CPU takes only what the free slots cannot hold
        assert fetched > 0  # computed on the device, in the graph
    else:
        assert cpu > 0 and fetched > 0
    for want_tokens, want_steps in (eager, want):
        assert tokens == want_tokens
        for a, b in zip(want_steps, steps, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def hold_mode(moe: Any, mode: str) -> None:
    """Every miss to the CPU (`split_by` "slow"), the layer modes held on `mode`."""
    from ftrs.moe.hybrid import LayerModes

    split_by(moe, "slow")
    if mode == "cpu":
        moe.modes = LayerModes(explore_share=0, learn=False)
        moe.modes.seconds = {(m, 1 << b): t for b in range(8)
                             for m, t in (("split", 1.0), ("cpu", 0.0))}


@pytest.mark.parametrize("mode", ["split", "cpu"])
def test_hybrid_graph_host_step_runs_an_all_cpu_layer_in_one_kernel_call(
        tmp_path: Path, mode: str) -> None:
    """Every routed expert on the CPU, a Q8_0 GGUF, by the split (every miss priced onto the
    CPU) or by the "cpu" layer mode (no lookup, no prefetch, an empty slot table): the host step
    computes each layer's experts in the Rust kernels' one call and puts each token's sum into
    its first pair row; the graph gives eager hybrid's logits bit for bit (eager held on the
    same mode), and resident's tokens."""
    from quant_models import build

    path = build("qwen3_moe", {"experts": "Q8_0"}, tmp_path)[0]
    calls: list[int] = []

    def counted(moe: Any) -> None:
        """`moe.cpu_share` (the host step's one kernel call) counted into `calls`."""
        one_call = moe.cpu_share

        def counting(*a: Any) -> Any:
            calls.append(1)
            got = one_call(*a)
            assert got is not None  # the call applied: not expert by expert
            return got

        moe.cpu_share = counting

    want = run(make(path, "resident"))
    eager_llm = make(path, "hybrid")
    hold_mode(eager_llm.engine.rt.decoder.moe, mode)
    counted(eager_llm.engine.rt.decoder.moe)
    eager = run(eager_llm)
    eager_llm.close()
    assert calls == []  # the eager layers make their own calls
    llm = make(path, "hybrid")
    moe: Any = llm.engine.rt.decoder.moe
    hold_mode(moe, mode)
    counted(moe)
    assert moe.graph_support() == GraphSupport("layer")
    graphs = attach(llm, (8,))
    before, lookups = moe.stats(), moe.engine.stats()["lookups"]
    tokens, steps = run(llm)
    after, lookups = moe.stats(), moe.engine.stats()["lookups"] - lookups
    llm.close()
    assert graphs.replays == GREEDY.max_tokens - 1
    layer_calls = graphs.replays * len(moe.spec.moe_layers)
    assert len(calls) == layer_calls
    held = {"split": "layers_split", "cpu": "layers_all_cpu"}[mode]
    assert after[held] - before[held] >= layer_calls  # (the prefill's eager calls add theirs)
    if mode == "cpu":  # the engine never asked: not even for a hit
        assert lookups == 0
        assert after["device_computed"] == before["device_computed"]
    assert after["cpu_computed"] - before["cpu_computed"] >= layer_calls
    # no expert on the device: the same kernel calls as eager, the same sums, bit for bit
    assert tokens == eager[0] and tokens == want[0]
    assert all(torch.equal(a, b) for a, b in zip(eager[1], steps, strict=True))
    # resident computes the experts in the fused Triton kernel (fp32 dequantized weights),
    # the Rust kernels with Q8 activations: measured 3e-4 apart on logits of magnitude 5.6
    for a, b in zip(want[1], steps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_hybrid_split_cpu_share_in_one_call_equals_expert_by_expert(
        tmp_path: Path, graphs: bool) -> None:
    """A GPU's split computes its CPU share in one kernel call (`moe.hybrid_share.cpu_share`),
    each token's CPU experts summed where its lowest one's part goes. Here on the CPU stand-in
    (`one_call_share` on), a Q8_0 GGUF, four prompts, the split by tokens (single-token experts
    on the CPU, wider ones fetched), so layers have a CPU share beside device experts, eager
    and through the graph machinery. Oracle: the same split expert by expert (`one_call_share`
    off, the CPU device's own path): the same tokens, logits within 1e-4 (a token's CPU
    experts are summed before they join its device experts' parts, not interleaved by id: fp32
    sums in another order, through every layer; measured up to 1.6e-5 apart), and resident's
    tokens."""
    from quant_models import build

    path = build("qwen3_moe", {"experts": "Q8_0"}, tmp_path)[0]
    want_tokens, _ = run(make(path, "resident"))

    def hybrid_run(one_call: bool) -> tuple[Any, list[tuple[int, int]], dict[str, Any]]:
        llm = make(path, "hybrid")
        moe: Any = llm.engine.rt.decoder.moe
        split_by(moe, "by-tokens")
        moe.one_call_share = one_call
        shares: list[tuple[int, int]] = []  # (experts in the call, experts the rows route to)
        share = moe.cpu_share

        def recording(layer: int, x_h: torch.Tensor, ids_h: torch.Tensor, w_h: torch.Tensor,
                      experts: list[int]) -> Any:
            shares.append((len(experts), int(torch.unique(ids_h).numel())))
            got = share(layer, x_h, ids_h, w_h, experts)
            assert got is not None
            return got

        moe.cpu_share = recording
        if graphs:
            attach(llm, (8,))
        got = run(llm)
        stats = moe.stats()
        llm.close()
        return got, shares, stats

    (ref_tokens, ref_steps), ref_shares, _ = hybrid_run(False)
    (tokens, steps), shares, stats = hybrid_run(True)
    assert all(n == routed for n, routed in ref_shares)  # only whole layers in one call
    assert any(n < routed for n, routed in shares)  # the premise: partial shares in one call
    assert stats["fetched"] > 0 and stats["cpu_computed"] > 0
    assert tokens == ref_tokens == want_tokens
    for a, b in zip(ref_steps, steps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
