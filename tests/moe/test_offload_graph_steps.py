"""Offload's "layer" mode for decode CUDA graphs (`OffloadStrategy.host_step`/`device_step`) on
the CPU, under Triton's interpreter, with a simulated link.

Oracles: `resident` on the fused kernel (every expert in place, no lookup), and offload's own
eager `forward`, for the real rows; the rows of the batch themselves for which experts may be
fetched (the distinct experts of the real rows, never a padding row's). Padding rows join the
experts' matmuls when a real row shares their expert, so the kernel's row blocks hold other
rows than in the unpadded call: real rows agree within fp32 rounding (the graph tests'
tolerance for MoE models, 1e-5), not bit for bit. Hybrid's host step: when its time to the end
of the wait is a sample of the link (a serial simulated link of 20 ms a copy, a CPU share held
longer than that or not), and which layer mode it runs once its own timings are in.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.kernels import select_kernels, triton_runs_on
from ftrs.layers.moe import route
from ftrs.models.load import LoadedModel, load_model
from ftrs.moe.base import GraphSupport, MoEStrategy, create_strategy, import_strategy

pytest.importorskip("triton")
CPU = torch.device("cpu")
LINK = "simulated:1:300"  # 1 GB/s, 300 us per copy
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def loaded(tiny_models: dict[str, Path]) -> LoadedModel:
    if not triton_runs_on(CPU):
        pytest.skip("the fused kernel needs TRITON_INTERPRET=1 on the CPU")
    return load_model(str(tiny_models["mixtral"]), CPU, torch.float32, progress=False)


def strategy(name: str, loaded: LoadedModel, kernels: str | None = "triton",
             **options: Any) -> MoEStrategy:
    import_strategy(name)
    assert loaded.experts is not None
    config = EngineConfig(model=str(loaded.path), moe_strategy=name, **options)
    routers = {la: loaded.dense[f"{la}.router"] for la in loaded.spec.moe_layers}
    return create_strategy(name, experts=loaded.experts, device=CPU, config=config,
                           routers=routers,
                           kernels=None if kernels is None else select_kernels(kernels, CPU))


def layers(loaded: LoadedModel, rows: int, bucket: int, seed: int
           ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(layer, x, ids, weights) per MoE layer of one decode step in a bucket of `bucket` rows:
    `rows` real rows routed by the model's routers; the padding rows all on the experts no real
    row chose (what the padding's token 0 routes to is arbitrary: this makes it visible)."""
    s = loaded.spec
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in s.moe_layers:
        x = torch.randn(bucket, s.hidden_size, generator=g)
        router = loaded.dense[f"{layer}.router"]
        assert isinstance(router, torch.Tensor)
        ids, w = route(x, router, s.top_k, s.norm_topk_prob)
        unused = [e for e in range(s.num_experts) if e not in set(ids[:rows].flatten().tolist())]
        if rows < bucket and len(unused) >= s.top_k:
            ids[rows:] = torch.tensor(unused[: s.top_k])
        out.append((layer, x, ids, w))
    return out


def graph_step(moe: Any, step: list[Any], rows: int) -> list[torch.Tensor]:
    """One decode step as a replay runs it: per layer the host step, then the device step."""
    moe.begin_forward(rows)
    out = []
    for layer, x, ids, w in step:
        moe.host_step(layer, ids, w, rows, x)
        out.append(moe.device_step(layer, x, ids, w).clone())
    moe.end_forward()
    return out


def test_offload_and_hybrid_declare_layer_mode_only_on_the_fused_kernel(loaded: LoadedModel) -> None:
    fused = strategy("offload", loaded, moe_cache_rate=0.5, copy_backend=LINK)
    loop = strategy("offload", loaded, kernels="torch", moe_cache_rate=0.5, copy_backend=LINK)
    hybrid = strategy("hybrid", loaded, moe_cache_rate=0.5, copy_backend=LINK)
    hybrid_loop = strategy("hybrid", loaded, kernels="torch", moe_cache_rate=0.5,
                           copy_backend=LINK)
    try:
        assert fused.graph_support() == GraphSupport("layer")
        off = loop.graph_support()
        assert off.mode == "off" and "per-expert loop" in off.why
        assert hybrid.graph_support() == GraphSupport("layer")  # its host step: moe.hybrid_graph
        off = hybrid_loop.graph_support()
        assert off.mode == "off" and "fused kernel" in off.why
    finally:
        for m in (fused, loop, hybrid, hybrid_loop):
            m.close()


@pytest.mark.parametrize("cache,prefetch", [({"moe_cache_rate": 0.25}, True),
                                           ({"moe_cache_rate": 0.5}, False),
                                           ({"moe_cache_size": 3}, False)])
def test_layer_mode_steps_equal_resident_and_eager_offload_and_fetch_only_real_rows(
        loaded: LoadedModel, cache: dict[str, Any], prefetch: bool) -> None:
    s = loaded.spec
    rows, bucket = 3, 4
    steps = [layers(loaded, rows, bucket, seed) for seed in range(3)]
    resident = strategy("resident", loaded)
    eager = strategy("offload", loaded, moe_prefetch=prefetch, copy_backend=LINK, **cache)
    moe: Any = strategy("offload", loaded, moe_prefetch=prefetch, copy_backend=LINK, **cache)
    demanded: list[tuple[int, list[int]]] = []
    lookup = moe._lookup

    def recording(li: int, wave: list[int], pre: list[tuple[int, int]]) -> Any:
        demanded.append((li, list(wave)))
        return lookup(li, wave, pre)

    moe._lookup = recording
    tables = {la: moe._graph.tables[la].data_ptr() for la in s.moe_layers}
    waves = 0
    try:
        for step in steps:
            demanded.clear()
            got = graph_step(moe, step, rows)
            eager.begin_forward(rows)
            for (layer, x, ids, w), out in zip(step, got, strict=True):
                want = resident.forward(layer, x[:rows], ids[:rows], w[:rows])
                torch.testing.assert_close(out[:rows], want, **TOL)
                mine = eager.forward(layer, x[:rows], ids[:rows], w[:rows])
                torch.testing.assert_close(out[:rows], mine, **TOL)
            eager.end_forward()
            # the engine was asked for the real rows' distinct experts, nothing else
            for layer, _, ids, _ in step:
                li = loaded.experts.layer_index[layer]  # type: ignore[union-attr]
                asked = sorted(e for i, wave in demanded if i == li for e in wave)
                assert asked == sorted(set(ids[:rows].flatten().tolist()))
                assert not set(asked) & set(ids[rows:].flatten().tolist())
                waves += sum(i == li for i, _ in demanded) > 1
        # the static tables never moved
        assert {la: moe._graph.tables[la].data_ptr() for la in s.moe_layers} == tables
    finally:
        for m in (resident, eager, moe):
            m.close()
    if "moe_cache_size" in cache:  # 3 slots for up to 6 distinct experts: waves
        assert moe.num_slots < rows * s.top_k
        assert waves > 0


def test_a_table_names_only_the_slots_of_the_last_wave_and_padding_is_not_computed(
        loaded: LoadedModel) -> None:
    s = loaded.spec
    rows, bucket = 1, 4
    step = layers(loaded, rows, bucket, seed=7)
    moe: Any = strategy("offload", loaded, moe_cache_rate=0.5, moe_prefetch=False,
                        copy_backend=LINK)
    try:
        out = graph_step(moe, step, rows)
        for (layer, _, ids, _), o in zip(step, out, strict=True):
            table = moe._graph.tables[layer].tolist()
            named = sorted(e for e, slot in enumerate(table) if slot >= 0)
            assert named == sorted(set(ids[:rows].flatten().tolist()))
            assert len({table[e] for e in named}) == len(named)  # one slot each
            # the padding rows' experts had no slot: nothing was computed for them
            assert torch.equal(o[rows:], torch.zeros_like(o[rows:]))
    finally:
        moe.close()
    assert len(named) == s.top_k


def test_offload_host_step_ranks_the_next_layer_on_the_host_from_the_real_rows(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetch a host step issues is the next layer's experts ranked on the host
    (`rank_on_host`) from the real rows only; torch's device routing is never called (it
    raises here), and padding rows, routed elsewhere, add nothing."""
    import ftrs.moe.rank as rank_mod
    from ftrs.moe.rank import rank_on_host

    s = loaded.spec
    rows, bucket = 2, 4
    step = layers(loaded, rows, bucket, seed=11)
    moe: Any = strategy("offload", loaded, moe_cache_rate=0.75, moe_prefetch=True,
                        copy_backend=LINK)

    def no_device_routing(*_: Any) -> Any:
        raise AssertionError("the host step routed on the device")

    monkeypatch.setattr(rank_mod, "route", no_device_routing)
    issued: list[list[tuple[int, int]]] = []
    lookup = moe._lookup

    def recording(li: int, wave: list[int], pre: list[tuple[int, int]]) -> Any:
        issued.append(list(pre))
        return lookup(li, wave, pre)

    moe._lookup = recording
    try:
        assert moe.num_slots > moe.working_set  # the premise: room to prefetch
        graph_step(moe, step, rows)
        spare = moe.num_slots - moe.working_set
        for (layer, x, _, _), pre in zip(step[:-1], issued, strict=False):
            nxt = moe.next_moe[layer]
            router = loaded.dense[f"{nxt}.router"]
            assert isinstance(router, torch.Tensor)
            want = rank_on_host(x[:rows], router.numpy(), s.top_k)[:spare]
            li = loaded.experts.layer_index[nxt]  # type: ignore[union-attr]
            assert pre == [(li, e) for e in want]
    finally:
        moe.close()
    assert sum(map(bool, issued)) > 0  # predictions were made


@pytest.mark.parametrize("case", ["no-cpu-share", "short-cpu-share", "long-cpu-share"])
def test_hybrid_host_step_samples_the_link_only_when_its_wait_measured_the_copies(
        loaded: LoadedModel, case: str) -> None:
    """The copies run from the lookup on, beside the CPU share: the time to the end of the
    wait is the link's only when the wait blocked (or no CPU share sat in between); a CPU share
    that outlasts the copies makes it a bound, not a sample (`hybrid_graph`). A serial link of
    20 ms a copy; a CPU share held 0.3 s outlasts any layer's copies (at most 6)."""
    import time

    from ftrs.moe import hybrid_graph
    from ftrs.moe.hybrid import CostModel, LayerModes

    rows, bucket = 3, 4
    moe: Any = strategy("hybrid", loaded, moe_cache_rate=0.5, moe_prefetch=False,
                        copy_backend="simulated:1:20000")
    # single-token experts to the CPU, wider ones to the link; no CPU share: all to the link
    moe.cost = (CostModel(1e15, 0.0, cpu_s_per_token=1.0, learn=False) if case == "no-cpu-share"
                else CostModel(1e12, 2.5e-6, cpu_s_per_token=2e-6, learn=False))
    moe.modes = LayerModes(explore_share=0, learn=False)  # every call: the split
    moe.modes.seconds = {(m, 1 << b): t for b in range(8)
                         for m, t in (("split", 0.0), ("cpu", 1.0))}
    splits: list[tuple[list[int], list[int]]] = []
    split, observe = moe.cost.split, moe.cost.observe_link
    samples: list[int] = []

    def recording_split(*a: Any, **kw: Any) -> Any:
        splits.append(split(*a, **kw))
        return splits[-1]

    def recording_observe(nbytes: int, copies: int, seconds: float) -> None:
        samples.append(copies)
        observe(nbytes, copies, seconds)

    moe.cost.split, moe.cost.observe_link = recording_split, recording_observe
    cpu_rows = hybrid_graph._cpu_rows

    def slow_cpu_rows(*a: Any) -> None:
        time.sleep(0.3)
        cpu_rows(*a)

    if case == "long-cpu-share":
        hybrid_graph._cpu_rows = slow_cpu_rows  # type: ignore[assignment]
    try:
        graph_step(moe, layers(loaded, rows, bucket, seed=0), rows)
    finally:
        hybrid_graph._cpu_rows = cpu_rows  # type: ignore[assignment]
        moe.close()
    fetching = [(cpu, fetch) for cpu, fetch in splits if fetch]
    assert fetching  # the premise: the layers fetch
    if case == "no-cpu-share":
        assert all(not cpu for cpu, _ in splits)
        want = [len(f) for _, f in fetching]
    else:
        assert any(cpu for cpu, _ in fetching)  # the premise: a CPU share beside the copies
        want = ([len(f) for _, f in fetching] if case == "short-cpu-share"
                else [len(f) for cpu, f in fetching if not cpu])
    assert samples == want


@pytest.mark.parametrize("dear", ["split", "cpu"])
def test_hybrid_host_step_runs_the_mode_its_own_timings_find_cheaper(
        loaded: LoadedModel, dear: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer modes learned from the host steps' own wall clock (nothing injected but the
    split, and 30 ms added to one mode's work): each mode runs twice (a warm-up call, then a
    kept one), then only the cheaper; at 1/32 of a layer's time the exploration budget never
    covers 30 ms within these calls."""
    import time

    from ftrs.moe import hybrid_graph
    from ftrs.moe.hybrid import CostModel

    moe: Any = strategy("hybrid", loaded, moe_cache_rate=0.5, moe_prefetch=False,
                        copy_backend=LINK)
    moe.cost = CostModel(1e15, 0.0, cpu_s_per_token=1.0, learn=False)  # split: all fetched
    if dear == "split":
        lookup = moe._lookup

        def slow_lookup(*a: Any) -> Any:
            time.sleep(0.03)
            return lookup(*a)

        moe._lookup = slow_lookup
    else:
        cpu_rows = hybrid_graph._cpu_rows

        def slow_cpu_rows(*a: Any) -> None:
            time.sleep(0.03)
            cpu_rows(*a)

        monkeypatch.setattr(hybrid_graph, "_cpu_rows", slow_cpu_rows)
    try:
        for seed in range(8):
            graph_step(moe, layers(loaded, 1, 1, seed), 1)
        chosen = dict(moe.modes.chosen)
        stats = moe.stats()
    finally:
        moe.close()
    calls = 8 * len(loaded.spec.moe_layers)
    cheap = "cpu" if dear == "split" else "split"
    assert chosen == {dear: 2, cheap: calls - 2}
    assert stats["layers_explored"] == 0
    if dear == "split":  # the CPU mode computed every expert after the first two calls
        assert stats["fetched"] + stats["device_computed"] <= 2 * loaded.spec.top_k


@pytest.mark.parametrize("mode", ["split", "cpu"])
def test_hybrid_host_step_fills_what_the_cpu_computed_and_the_next_step_hits_it(
        loaded: LoadedModel, mode: str) -> None:
    """Hybrid's host step with the link priced out of the split (every miss to the CPU) and no
    router prefetch: the CPU's experts (the split's share, or the whole layer in the "cpu"
    mode) are queued as fills and land while the link idles; the same step again, split,
    finds them in the slots (device hits, no demand fetch) and gives the same rows."""
    from ftrs.moe.hybrid import CostModel, LayerModes

    rows = 2
    step = layers(loaded, rows, rows, seed=3)
    moe: Any = strategy("hybrid", loaded, moe_cache_rate=1.0, moe_prefetch=True,
                        copy_backend="host")
    moe.cost = CostModel(1.0, 1.0, cpu_s_per_token=1e-9, learn=False)  # device_is_cpu off
    moe.prefetch = True  # a CPU device turns speculative copies off; a GPU's are on
    moe._predict = lambda *_, **__: []  # hits can only come from fills

    def held(on: str) -> LayerModes:
        m = LayerModes(explore_share=0, learn=False)
        m.seconds = {(k, 1 << b): float(k != on) for b in range(8) for k in ("split", "cpu")}
        return m

    try:
        moe.modes = held(mode)
        first = graph_step(moe, step, rows)
        for _ in range(1000):  # the fills land on the worker thread
            s = moe.engine.stats()
            if s["fill_queued"] == s["queue_depth"] == s["inflight_bytes"] == 0:
                break
            time.sleep(0.001)
        moe.modes = held("split")
        before = moe.stats()
        again = graph_step(moe, step, rows)
        after = moe.stats()
    finally:
        moe.close()
    needed = sum(len(set(ids[:rows].flatten().tolist())) for _, _, ids, _ in step)
    assert before["fill_requested"] == before["fill_issued"] == needed
    assert after["device_computed"] - before["device_computed"] == needed  # every one a hit
    assert after["cpu_computed"] == before["cpu_computed"]
    assert after["demand_fetches"] == 0 and after["fill_used"] == needed
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a[:rows], b[:rows], **TOL)
