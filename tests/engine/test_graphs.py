"""Decode CUDA graphs (engine/graphs.py) on the CPU: buckets, why they are off, the static
buffers and their padding through the eager stand-in (`EagerGraphs`, the code path the CUDA
graphs capture), and the order of segments and host steps when a strategy splits the graph.

Oracles: the unpadded run of the same static path (padding must not change a real row, bit for
bit: the dense decoder's ops are row-wise; four real rows against buckets of 8 and 16, row
counts at which the CPU's GEMMs give a row the same bits; at 3 against 4 rows they do not, a
property of the BLAS kernels chosen, not of the padding); the plain eager decoder (within fp32
rounding: its decode attention spans the longest context, the static path the full block
table, masked); the page arithmetic of the KV layout (slot = page * page_size + offset).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.config import EngineConfig, add_engine_arguments, engine_config_from_args
from ftrs.engine.graphs import (
    NOT_CUDA,
    DecodeGraphs,
    DecodeRows,
    EagerGraphs,
    StaticDecode,
    build_graphs,
    graph_buckets,
    pick_bucket,
    why_off,
)
from ftrs.llm import LLM
from ftrs.models.decoder import KVCache
from ftrs.moe.base import GraphSupport, MoEStrategy
from ftrs.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 3], [7, 2], [4, 4, 4, 8, 9], [11]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 16


def test_buckets_are_capped_by_the_running_requests() -> None:
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32)
    assert graph_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert graph_buckets(12) == (1, 2, 4, 8, 12)
    assert graph_buckets(1) == (1,)


def test_a_step_takes_the_smallest_bucket_that_holds_it() -> None:
    buckets = (1, 2, 4, 8)
    assert [pick_bucket(n, buckets) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert pick_bucket(9, buckets) is None  # past the largest: eager
    assert pick_bucket(0, buckets) is None


class _Declares(MoEStrategy):
    """A strategy that only declares its graph support."""

    name = "fake"

    def __init__(self, support: GraphSupport) -> None:
        self.support = support

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not called")

    def graph_support(self) -> GraphSupport:
        return self.support


def _llm(path: Path, **options: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_tokens=256,
               max_running_requests=16, **options)


def test_why_graphs_are_off(tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["llama"])
    spec = llm.engine.spec
    llm.close()
    cuda = torch.device("cuda", 0)  # a device object needs no GPU
    on = EngineConfig(kernels="triton")
    assert why_off(on, cuda, "triton", spec, None) is None
    assert why_off(EngineConfig(cuda_graphs=False), cuda, "triton", spec, None) == "--no-cuda-graphs"
    assert "not CUDA" in str(why_off(on, torch.device("cpu"), "triton", spec, None))
    assert "torch reference kernels" in str(why_off(EngineConfig(), cuda, "torch", spec, None))
    sliding = dataclasses.replace(spec, layer_types=("sliding_attention",) * spec.num_layers,
                                  sliding_window=8)
    assert "sliding-window" in str(why_off(on, cuda, "triton", sliding, None))
    sinks = dataclasses.replace(spec, attention_sinks=True)
    assert "sinks" in str(why_off(on, cuda, "triton", sinks, None))
    from ftrs.models.mla import MlaSpec

    mla = dataclasses.replace(spec, mla=MlaSpec(0, 16, 12, 8, 10, 0.2))
    assert "latent attention (MLA)" in str(why_off(on, cuda, "triton", mla, None))
    off = _Declares(GraphSupport("off", "slots are looked up on the host"))
    assert why_off(on, cuda, "triton", spec, off) == "slots are looked up on the host"
    for mode in ("step", "layer"):
        assert why_off(on, cuda, "triton", spec, _Declares(GraphSupport(mode))) is None


def test_off_on_the_cpu_and_with_the_flag_says_why_once(
        tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    for options, why in (({}, NOT_CUDA), ({"cuda_graphs": False}, "--no-cuda-graphs")):
        caplog.clear()  # (the CPU's reason at DEBUG: test_graphs_off_on_a_cpu_is_not_news)
        with caplog.at_level(logging.DEBUG, logger="ftrs.engine.graphs"):
            llm = _llm(tiny_models["llama"], **options)
        lines = [r.getMessage() for r in caplog.records if "cuda graphs" in r.getMessage()]
        assert lines == [f"cuda graphs: off: {why}"]
        rt = llm.engine.rt
        assert rt.graphs is None
        assert rt.kv.k.shape[1] == rt.num_pages * PAGE  # no scratch page without graphs
        llm.close()


def test_the_flag_is_derived_from_the_config_field() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).cuda_graphs is True
    assert engine_config_from_args(parser.parse_args(["--no-cuda-graphs"])).cuda_graphs is False


def test_fill_copies_the_rows_and_pads_the_rest_onto_the_scratch_page() -> None:
    st = StaticDecode.allocate(4, max_pages=3, page_size=4, scratch_page=9,
                               device=torch.device("cpu"))
    rows = DecodeRows(torch.tensor([11, 12]), torch.tensor([5, 0]), torch.tensor([29, 12]),
                      [[6, 7], [3]], [6, 1])
    st.fill(rows)
    assert st.input_ids.tolist() == [11, 12, 0, 0]
    assert st.positions.tolist() == [5, 0, 0, 0]
    assert st.slot_mapping.tolist() == [29, 12, 36, 36]  # 9 * 4: the scratch page's first slot
    assert st.block_table[:, 0].tolist() == [6, 3, 9, 9]
    assert st.block_table[0, 1].item() == 7
    assert st.ctx_len.tolist() == [6, 1, 1, 1]
    # a smaller step next: the row it leaves becomes padding again
    st.fill(DecodeRows(torch.tensor([13]), torch.tensor([6]), torch.tensor([30]), [[6, 7]], [7]))
    assert st.input_ids.tolist() == [13, 0, 0, 0]
    assert st.slot_mapping.tolist() == [30, 36, 36, 36]
    assert st.block_table[:, 0].tolist() == [6, 9, 9, 9]
    assert st.ctx_len.tolist() == [7, 1, 1, 1]
    with pytest.raises(ValueError, match="exceeds"):
        st.fill(DecodeRows(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
                           [[1, 2, 3, 4]], [13]))


def test_static_meta_reads_each_context_through_the_block_table() -> None:
    st = StaticDecode.allocate(2, max_pages=3, page_size=4, scratch_page=9,
                               device=torch.device("cpu"))
    st.fill(DecodeRows(torch.tensor([1]), torch.tensor([5]), torch.tensor([29]), [[6, 7]], [6]))
    meta = st.meta()
    assert meta.decode_only and meta.decode_gather.shape == (2, 12)
    assert meta.decode_mask is not None
    real = meta.decode_mask.view(2, 12)
    assert real.sum(dim=1).tolist() == [6, 1]
    # position j of row 0 lives at page [6, 7][j // 4], offset j % 4
    assert meta.decode_gather[0, :6].tolist() == [24, 25, 26, 27, 28, 29]
    assert meta.decode_gather[1, 0].item() == 36  # the padding row: the scratch slot alone


def attach(llm: LLM, buckets: tuple[int, ...], cls: type[DecodeGraphs] = EagerGraphs
           ) -> DecodeGraphs:
    """Give `llm` decode graphs as `Runtime` does on a GPU: a KV cache with one scratch page
    past the pool, the buckets captured before the first step."""
    rt = llm.engine.rt
    rt.kv = KVCache.allocate(rt.spec, (rt.num_pages + 1) * PAGE, rt.dtype, rt.device,
                             kv_cache_dtype=rt.config.kv_cache_dtype)
    graphs = cls(rt.decoder, rt.kv, buckets, PAGE, rt.num_pages, scratch_page=rt.num_pages)
    graphs.capture()
    rt.graphs = graphs
    return graphs


def run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of `PROMPTS` and the logits of every step."""
    decoder = llm.engine.rt.decoder
    plain, steps = decoder.logits, []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        steps.append(plain(hidden))
        return steps[-1]

    decoder.logits = recording  # type: ignore[method-assign]
    out = llm.generate(PROMPTS, GREEDY)
    return [c.token_ids for c in out], steps


# llama again over an int8 KV cache: padding rows quantize into the scratch page alone
@pytest.mark.parametrize("arch,kv_dtype", [("llama", "auto"), ("qwen3", "auto"),
                                           ("llama", "int8")])
def test_padding_rows_write_only_the_scratch_page(tiny_models: dict[str, Path],
                                                  arch: str, kv_dtype: str) -> None:
    # A CPU GEMM blocks its work by the row count, so the real rows of a padded batch equal the
    # unpadded ones up to rounding (measured: 1.3e-6 on these logits), not bit for bit. What
    # padding must never do is write anywhere but the scratch page: that part is exact.
    results = {}
    for buckets in ((4,), (8,), (16,)):  # four real rows: unpadded, then padded by 4 and 12
        llm = _llm(tiny_models[arch], kv_cache_dtype=kv_dtype)
        graphs = attach(llm, buckets)
        results[buckets] = run(llm)
        assert graphs.replays == GREEDY.max_tokens - 1  # every decode step took the bucket
        kv = llm.engine.rt.kv
        results[buckets] += ((kv.k[:, :-PAGE].clone(), kv.v[:, :-PAGE].clone(),
                              kv.k[:, -PAGE:].clone()),)
        llm.close()
    tokens, steps, (k, v, _) = results[(4,)]

    def written(cache: torch.Tensor) -> torch.Tensor:  # (layers, slots): which slots hold KV
        return cache.flatten(2).abs().sum(-1) > 0

    for buckets in ((8,), (16,)):
        t, s, (k2, v2, scratch) = results[buckets]
        assert t == tokens
        for a, b in zip(steps, s, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # the real sequences' KV is the unpadded run's, in the same slots and no others
        assert torch.equal(written(k), written(k2)) and torch.equal(written(v), written(v2))
        if kv_dtype == "int8":  # the same codes, but where a rounding difference crosses a half step
            assert k.dtype == torch.int8
            assert (k.int() - k2.int()).abs().max() <= 1 and (v.int() - v2.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5)
        assert scratch.abs().sum() > 0
    # and the static path is the eager decoder, up to the span its attention sums over
    llm = _llm(tiny_models[arch], kv_cache_dtype=kv_dtype)
    eager_tokens, eager_steps = run(llm)
    llm.close()
    assert eager_tokens == tokens
    for a, b in zip(eager_steps, steps, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Recording(MoEStrategy):
    """Wraps the resident strategy; declares `mode`, and records every host step."""

    def __init__(self, inner: MoEStrategy, mode: str) -> None:
        self.inner, self.mode, self.name = inner, mode, inner.name
        self.host: list[tuple[int, int, list[list[int]]]] = []  # (layer, rows, routing of rows)
        self.events: list[str] = []

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(layer, x, ids, weights)

    def graph_support(self) -> GraphSupport:
        return GraphSupport(self.mode)

    def host_step(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, rows: int,
                  x: torch.Tensor) -> None:
        assert x.shape[0] == ids.shape[0]  # the layer's input, every row of the bucket
        self.host.append((layer, rows, ids[:rows].tolist()))
        self.events.append(f"host {layer}")


def _with_strategy(llm: LLM, mode: str) -> _Recording:
    rt = llm.engine.rt
    assert rt.decoder.moe is not None
    rec = _Recording(rt.decoder.moe, mode)
    rt.decoder.moe = rt.moe = rec
    return rec


def test_a_layer_mode_strategy_gets_a_host_step_per_moe_layer_with_the_real_rows(
        tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["mixtral"])
    rec = _with_strategy(llm, "layer")
    moe_layers = list(llm.engine.spec.moe_layers)
    graphs = attach(llm, (4,))
    rec.host.clear()  # warm-up and capture ran host steps over no real row
    tokens, steps = run(llm)
    llm.close()
    assert graphs.replays == GREEDY.max_tokens - 1
    per_step = [rec.host[i:i + len(moe_layers)] for i in range(0, len(rec.host), len(moe_layers))]
    assert len(per_step) == GREEDY.max_tokens - 1
    for step in per_step:
        assert [layer for layer, _, _ in step] == moe_layers  # ascending, once each
        assert all(rows == len(PROMPTS) and len(r) == len(PROMPTS) for _, rows, r in step)
    # the routing a host step sees is the eager decoder's for the same tokens
    llm = _llm(tiny_models["mixtral"])
    eager = _with_strategy(llm, "off")
    seen: list[list[list[int]]] = []
    inner = eager.forward

    def routed(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] == len(PROMPTS):  # a decode step (the prefill has more rows)
            seen.append(ids.tolist())
        return inner(layer, x, ids, w)

    eager.forward = routed  # type: ignore[method-assign]
    eager_tokens, eager_steps = run(llm)
    llm.close()
    assert eager_tokens == tokens
    assert [r for _, _, r in rec.host] == seen
    for a, b in zip(eager_steps, steps, strict=True):  # the per-expert GEMMs see other rows
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Segments(DecodeGraphs):
    """The capture and replay sequencing of `CudaGraphs`, with segments that only log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []
        self._count = 0

    def _begin_segment(self) -> int:
        self._count += 1
        self.events.append(f"begin {self._count - 1}")
        return self._count - 1

    def _end_segment(self, seg: Any) -> None:
        self.events.append(f"end {seg}")

    def _replay_segment(self, seg: Any) -> None:
        self.events.append(f"replay {seg}")


def test_a_split_graph_is_cut_at_each_moe_layer_and_replayed_around_its_host_steps(
        tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["mixtral"])
    rec = _with_strategy(llm, "layer")
    moe_layers = list(llm.engine.spec.moe_layers)
    assert len(moe_layers) >= 2
    graphs = attach(llm, (2, 4), cls=_Segments)
    assert isinstance(graphs, _Segments)
    cuts = len(moe_layers)
    # largest bucket first; each bucket: one segment more than its MoE layers, back to back
    expected = []
    for first in (0, cuts + 1):
        for i in range(cuts + 1):
            expected += [f"begin {first + i}", f"end {first + i}"]
    assert graphs.events == expected
    assert [c.layer for c in graphs.static[4].splits] == moe_layers
    graphs.events.clear()
    rec.events = graphs.events  # one log for both
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2, temperature=0.0,
                                                                       ignore_eos=True))
    llm.close()
    step = ["replay 0"]
    for i, layer in enumerate(moe_layers):
        step += [f"host {layer}", f"replay {i + 1}"]
    assert graphs.events == step  # one decode step, in the bucket of 4 (captured first)


def test_whole_step_mode_has_one_segment_and_no_host_step(tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["mixtral"])
    rec = _with_strategy(llm, "step")
    graphs = attach(llm, (4,), cls=_Segments)
    assert isinstance(graphs, _Segments)
    assert graphs.events == ["begin 0", "end 0"]
    assert graphs.static[4].splits == []
    llm.close()
    assert rec.host == []


def test_a_replaced_strategy_gets_graphs_of_its_own(tiny_models: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import ftrs.engine.runtime as runtime

    llm = _llm(tiny_models["mixtral"])
    first = _with_strategy(llm, "step")
    rt = llm.engine.rt
    graphs = attach(llm, (2,))
    assert graphs.moe is first
    # as on a GPU: graphs were possible at startup, and capture builds them
    monkeypatch.setattr(rt, "has_scratch_page", True)
    monkeypatch.setattr(runtime, "why_off", lambda *a: None)

    def build(why: str | None, decoder: Any, kv: KVCache, running: int, page: int, length: int,
              scratch_page: int) -> EagerGraphs | None:
        if why is not None:
            return None
        graphs = EagerGraphs(decoder, kv, (2,), page, -(-length // page), scratch_page)
        graphs.capture()
        return graphs

    monkeypatch.setattr(runtime, "build_graphs", build)
    second = _Recording(first.inner, "step")
    assert llm.engine.use_moe_strategy(second) is first
    assert rt.graphs is not None and rt.graphs is not graphs
    assert rt.graphs.moe is second  # not the strategy the old graphs captured
    monkeypatch.setattr(runtime, "why_off", lambda *a: "off for the test")
    assert llm.engine.use_moe_strategy(first) is second
    assert rt.graphs is None and rt.graphs_off == "off for the test"
    llm.close()


class _CannotCapture(EagerGraphs):
    def _capture(self, st: StaticDecode) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_is_timed_in_the_log_and_a_failed_one_turns_graphs_off(
        tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    llm = _llm(tiny_models["llama"])
    rt = llm.engine.rt
    rt.kv = kv = KVCache.allocate(rt.spec, (rt.num_pages + 1) * PAGE, rt.dtype, rt.device)
    args = (rt.decoder, kv, 6, PAGE, rt.num_pages * PAGE, rt.num_pages)
    with caplog.at_level(logging.INFO, logger="ftrs.engine.graphs"):
        graphs = build_graphs(None, *args, kind=EagerGraphs)
        failed = build_graphs(None, *args, kind=_CannotCapture)
        off = build_graphs("a reason", *args, kind=EagerGraphs)
    llm.close()
    assert isinstance(graphs, EagerGraphs) and graphs.buckets == (1, 2, 4, 6)
    assert failed is None and off is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("cuda graphs: captured decode buckets 1,2,4,6 (1 segment each, "
                               "step) in ") and lines[0].endswith(" s")
    assert lines[1] == ("cuda graphs: off: capture failed (RuntimeError: operation not permitted "
                        "when stream is capturing); decode runs eagerly")
    assert lines[2] == "cuda graphs: off: a reason"


def test_resident_is_one_graph_only_on_the_fused_kernel(tiny_models: dict[str, Path]) -> None:
    pytest.importorskip("triton")
    from ftrs.kernels import select_kernels, triton_runs_on
    from ftrs.models.load import load_model
    from ftrs.moe.base import create_strategy, import_strategy

    cpu = torch.device("cpu")
    if not triton_runs_on(cpu):
        pytest.skip("the fused kernel needs TRITON_INTERPRET=1 on the CPU")
    loaded = load_model(str(tiny_models["mixtral"]), cpu, torch.float32, progress=False)
    routers = {la: loaded.dense[f"{la}.router"] for la in loaded.spec.moe_layers}
    import_strategy("resident")

    def resident(kernels: Any) -> MoEStrategy:
        return create_strategy("resident", experts=loaded.experts, device=cpu,
                               config=EngineConfig(), routers=routers, kernels=kernels)

    assert resident(select_kernels("triton", cpu)).graph_support() == GraphSupport("step")
    loop = resident(None).graph_support()
    assert loop.mode == "off" and "reads the routing on the host" in loop.why


def test_graphs_off_on_a_cpu_is_not_news(caplog: pytest.LogCaptureFixture) -> None:
    """`ftrs generate` on a CPU printed "cuda graphs: off" on every run; a reason the user
    chose or can act on (--no-cuda-graphs, the model's layers) is still said."""
    caplog.set_level(logging.INFO, logger="ftrs.engine.graphs")
    off_args: Any = (None, None, 1, 16, 64, 0)
    assert build_graphs(NOT_CUDA, *off_args) is None
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert build_graphs("--no-cuda-graphs", *off_args) is None
    assert [r.getMessage() for r in caplog.records] == ["cuda graphs: off: --no-cuda-graphs"]
