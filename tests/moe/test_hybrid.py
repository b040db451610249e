"""The hybrid strategy: bit-identical to `resident`, and split as its cost model says.

Oracles: `resident`'s logits (exact: hybrid adds every expert's contribution in the same
ascending order, from the same kernels, on a CPU device); for the split, the arithmetic of the
injected estimates (link: latency + bytes / rate, plus device compute; CPU: tokens x rate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.errors import ConfigError
from ftrs.llm import LLM
from ftrs.moe.hybrid import CostModel, HybridStrategy, LayerModes, bucket
from ftrs.sampling import SamplingParams

MOE_ARCHS = ("mixtral", "qwen3_moe")
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]
PROMPTS = [IDS, IDS[:5], IDS[3:17]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
EB = 1 << 20  # bytes of one expert in the split tests


def make(path: Path, **options: Any) -> LLM:
    return LLM(str(path), kv_tokens=2048, dtype="float32", device="cpu", max_prefill_length=7,
               **options)


def run(llm: LLM, before: Any = None) -> tuple[torch.Tensor, list[list[int]]]:
    if before is not None:
        before(llm)
    prefill = llm.logits(IDS)
    outs = llm.generate(PROMPTS, GREEDY)
    return prefill, [o.token_ids for o in outs]


def hybrid(llm: LLM) -> HybridStrategy:
    moe = llm.engine.rt.moe
    assert isinstance(moe, HybridStrategy)
    return moe


def split_only() -> LayerModes:
    """A GPU's layer modes held on "split" (the cost model alone decides)."""
    m = LayerModes(explore_share=0, learn=False)
    m.seconds = {(mode, 1 << b): t for b in range(8) for mode, t in (("split", 0.0), ("cpu", 1.0))}
    return m


def fast_link(llm: LLM) -> None:
    """A link that costs nothing and a device that computes for free: every miss is fetched."""
    hybrid(llm).cost = CostModel(1e15, 0.0, cpu_s_per_token=1.0, learn=False)
    hybrid(llm).modes = split_only()


def slow_link(llm: LLM) -> None:
    hybrid(llm).cost = CostModel(1.0, 1.0, cpu_s_per_token=1e-9, learn=False)


def alternating(llm: LLM) -> None:
    """Single-token experts on the CPU, wider ones on the link (estimates frozen)."""
    hybrid(llm).cost = CostModel(1e12, 2.5e-6, cpu_s_per_token=2e-6, learn=False)


@pytest.mark.parametrize("split", [None, fast_link, slow_link, alternating],
                         ids=["measured", "fast-link", "slow-link", "by-tokens"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_hybrid_equals_resident_bit_for_bit(tiny_models: dict[str, Path], arch: str,
                                            split: Any) -> None:
    ref = make(tiny_models[arch], moe_strategy="resident")
    want = run(ref)
    ref.close()
    llm = make(tiny_models[arch], moe_strategy="hybrid", moe_cache_rate=0.5,
               cpu_expert_threads=1)
    try:
        got = run(llm, split)
        s = hybrid(llm).stats()
    finally:
        llm.close()
    assert torch.equal(got[0], want[0])
    assert got[1] == want[1]
    if split is None:  # a CPU device: every expert from the host pool, in place
        assert s["fetched"] == 0 and s["device_computed"] == 0 and s["bytes_h2d"] == 0
        assert s["cpu_computed"] > 0 and s["split_cpu_s_per_token"]  # sampled timings
    if split is fast_link:
        assert s["cpu_computed"] == 0 and s["fetched"] > 0 and s["device_computed"] > 0
    if split is slow_link:
        assert s["fetched"] == 0 and s["cpu_computed"] > 0 and s["demand_fetches"] == 0
    if split is alternating:
        assert s["fetched"] > 0 and s["cpu_computed"] > 0


def test_quantized_hybrid_equals_resident(tmp_path: Path) -> None:
    quant_models = pytest.importorskip("quant_models")
    path = quant_models.build("qwen3_moe", quant_models.QWEN3MOE_TYPES, tmp_path)[0]
    ref = make(path, moe_strategy="resident")
    want = run(ref)
    ref.close()
    for split in (fast_link, alternating, slow_link):
        llm = make(path, moe_strategy="hybrid", moe_cache_size=5)
        try:
            got = run(llm, split)
            s = hybrid(llm).stats()
        finally:
            llm.close()
        assert torch.equal(got[0], want[0]), split.__name__
        assert got[1] == want[1], split.__name__
        assert s["fetched"] + s["cpu_computed"] > 0


@pytest.mark.parametrize("strategy", ["resident", "offload"])
def test_cpu_expert_threads_reach_the_kernels_under_every_strategy(
        tiny_models: dict[str, Path], strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrs import _core

    set_to: list[int] = []
    monkeypatch.setattr(_core, "quant_set_threads", set_to.append)  # process-wide: not for real
    llm = LLM(str(tiny_models["qwen3_moe"]), device="cpu", dtype="float32", kv_tokens=256,
              moe_strategy=strategy, cpu_expert_threads=3)
    llm.close()
    assert set_to == [3]


def test_cpu_expert_threads_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="cpu_expert_threads"):
        EngineConfig(cpu_expert_threads=0)
    with pytest.raises(ConfigError, match="unknown strategy"):
        EngineConfig(moe_strategy="hybird")


# --- the split ----------------------------------------------------------------------------------


def test_slow_link_sends_misses_to_the_cpu() -> None:
    # link: 1 MiB at 0.1 GB/s = 10.5 ms per expert; CPU: 1 ms per token
    cm = CostModel(0.1e9, 0.0, cpu_s_per_token=1e-3)
    cpu, fetch = cm.split([(1, 1), (4, 2), (6, 1)], EB, "f", room=8)
    assert (cpu, fetch) == ([1, 4, 6], [])


def test_fast_link_takes_the_misses() -> None:
    # link: 1 MiB at 50 GB/s = 21 us per expert, device compute free; CPU: 1 ms per token
    cm = CostModel(50e9, 0.0, cpu_s_per_token=1e-3)
    cpu, fetch = cm.split([(1, 1), (4, 2), (6, 1)], EB, "f", room=8)
    assert (cpu, fetch) == ([], [1, 4, 6])


def test_one_call_timing_feeds_its_bucket_only_when_the_experts_share_one() -> None:
    cm = CostModel(1e9, 0.0, cpu_s_per_token=1e-3)
    cm.observe_cpu_layer("Q4_K", [1, 1], 4e-4)  # a decode token's two experts: 2e-4 s a row
    cm.observe_cpu_layer("Q4_K", [1, 3], 1.0)  # buckets 1 and 2: not attributable
    cm.observe_cpu_layer("Q4_K", [4, 6], 1e-3)  # bucket 4: 1e-4 s a row
    assert cm.cpu == {("Q4_K", 1): 2e-4, ("Q4_K", 4): 1e-4}


def test_fetches_never_exceed_the_free_slots() -> None:
    cm = CostModel(50e9, 0.0, cpu_s_per_token=1e-3)
    cpu, fetch = cm.split([(1, 1), (4, 3), (6, 2)], EB, "f", room=1)
    assert (cpu, fetch) == ([1, 6], [4])  # the widest goes to the link


def test_prefill_chunk_hot_expert_to_link_cold_ones_to_cpu() -> None:
    """Device is the CPU (costs add): link = 1 ms + CPU compute, CPU = tokens x 0.1 ms.
    Cold (1 token): CPU 0.1 ms < link 1.1 ms. Hot (64 tokens, own bucket rate 0.01 ms/token):
    CPU 0.64 ms < link 1 ms + 0.64 ms: on a CPU device the CPU still wins, as it must."""
    cm = CostModel(1e15, 1e-3, cpu_s_per_token=1e-4, device_is_cpu=True)
    misses = [(0, 1), (3, 64), (5, 1), (7, 2)]
    assert cm.split(misses, EB, "f", room=8) == ([0, 3, 5, 7], [])
    # With a GPU device (overlap, device compute 1 us/token) the hot expert is cheaper on the
    # link: CPU 6.4 ms (0.1 ms x 64) vs link 1 ms + 64 us; the cold ones (0.1-0.2 ms each, 0.4 ms
    # together) run beside it.
    cm = CostModel(1e15, 1e-3, cpu_s_per_token=1e-4, device_s_per_token=1e-6)
    assert cm.split(misses, EB, "f", room=8) == ([0, 5, 7], [3])


def test_overlap_balances_the_two_sides() -> None:
    """Four one-token misses, 1 ms each on either side, running at the same time: two and two
    (2 ms) beats four on one side (4 ms); ties go to the CPU."""
    cm = CostModel(EB / 1e-3, 0.0, cpu_s_per_token=1e-3)
    cpu, fetch = cm.split([(e, 1) for e in range(4)], EB, "f", room=8)
    assert (len(cpu), len(fetch)) == (2, 2)


def test_decode_and_prefill_get_their_own_rates() -> None:
    cm = CostModel(1e9, 0.0, cpu_s_per_token=1.0, alpha=0.5)
    cm.observe_cpu("q", 1, 2e-3)  # decode: 2 ms for one token
    cm.observe_cpu("q", 64, 6.4e-3)  # prefill: 0.1 ms per token
    assert cm.cpu_rate("q", 1) == pytest.approx(2e-3)
    assert cm.cpu_rate("q", 100) == pytest.approx(1e-4)  # bucket 64
    assert cm.cpu_rate("q", 8) == pytest.approx(2e-3)  # nearest measured bucket below
    assert cm.cpu_rate("other", 1) == 1.0  # never measured: the seed
    cm.observe_cpu("q", 1, 4e-3)
    assert cm.cpu_rate("q", 1) == pytest.approx(0.5 * 2e-3 + 0.5 * 4e-3)
    # the link: 1 MB in 2 ms with 0.5 ms latency per copy -> 1e6 / 1.5e-3 bytes/s
    link = CostModel(1e9, 0.5e-3, cpu_s_per_token=1.0, alpha=1.0)
    link.observe_link(1_000_000, 1, 2e-3)
    assert link.link_bytes_per_s == pytest.approx(1e6 / 1.5e-3)
    assert [bucket(t) for t in (1, 2, 3, 4, 63, 64, 65)] == [1, 2, 2, 4, 32, 64, 64]


# --- a GPU's choice per layer call: the split, or every expert on the CPU -----------------------


def test_layer_modes_try_each_then_keep_the_cheaper_and_explore() -> None:
    m = LayerModes(alpha=1.0, explore_share=0.25, max_gap=0, warmup=1)
    assert m.choose(1) == "split"  # never measured: tried first...
    m.observe("split", 1, 90.0)  # a cold call: not kept
    assert m.choose(1) == "split"
    m.observe("split", 1, 5.0)
    assert m.choose(1) == "cpu"  # ...then the other
    m.observe("cpu", 1, 70.0)
    assert m.choose(1) == "cpu"
    m.observe("cpu", 1, 2.0)
    # the split costs 3.0 more; each call earns 0.25 x 2.0 = 0.5: every 6th call explores
    picks = [m.choose(1) for _ in range(12)]
    assert picks == ["cpu"] * 5 + ["split"] + ["cpu"] * 5 + ["split"]
    assert m.choose(64) == "split"  # a prefill bucket has its own estimates
    m.observe("cpu", 1, 8.0)  # the CPU got busy: the split is cheaper now
    assert m.choose(1) == "split"
    s = m.snapshot()
    assert s["layer_seconds"] == {"cpu/1": 8.0, "split/1": 5.0}
    assert s["layers_explored"] == 2


def test_layer_modes_explore_within_their_share_however_dear_the_other_mode() -> None:
    """The extra seconds spent exploring stay within `explore_share` of the time the cheaper
    mode would have taken, plus the forced runs of `max_gap`."""
    for dear in (2.5e-3, 5e-2, 10.0):
        m = LayerModes(alpha=1.0, explore_share=1 / 32, max_gap=256, warmup=0)
        m.seconds = {("cpu", 1): 1e-3, ("split", 1): dear}
        picks = [m.choose(1) for _ in range(2048)]
        explored = picks.count("split")
        forced = 2048 // 256
        assert explored >= forced  # never starved: at least once per max_gap calls
        assert explored * (dear - 1e-3) <= 2048 * 1e-3 / 32 + forced * (dear - 1e-3)
        if dear == 2.5e-3:  # cheap to explore: the budget, not the gap, sets the pace
            assert explored > 2 * forced


def test_layer_modes_average_and_can_be_frozen() -> None:
    m = LayerModes(alpha=0.5, warmup=0)
    m.observe("cpu", 3, 4e-3)
    m.observe("cpu", 2, 2e-3)  # bucket 2 both
    assert m.seconds[("cpu", 2)] == pytest.approx(3e-3)
    frozen = LayerModes(learn=False)
    frozen.seconds = {("split", 1): 1.0, ("cpu", 1): 2.0}
    frozen.observe("split", 1, 10.0)
    assert frozen.seconds[("split", 1)] == 1.0


@pytest.mark.parametrize("mode", ["cpu", "split"])
@pytest.mark.parametrize("weights", ["fp32", "quantized"])
def test_the_layer_mode_decides_where_every_expert_runs(tiny_models: dict[str, Path],
                                                        tmp_path: Path, mode: str,
                                                        weights: str) -> None:
    """The general (GPU) path on the CPU: `device_is_cpu` off, a free link, frozen modes. "cpu":
    every routed expert from the host pool, nothing looked up or fetched (quantized: the
    layer's one kernel call, as resident makes it); "split": every miss fetched. Both equal
    resident bit for bit (same code on the same bytes)."""
    if weights == "fp32":
        path = tiny_models["mixtral"]
    else:
        quant_models = pytest.importorskip("quant_models")
        path = quant_models.build("qwen3_moe", quant_models.QWEN3MOE_TYPES, tmp_path)[0]
    want = run(make(path, moe_strategy="resident"))
    llm = make(path, moe_strategy="hybrid", moe_cache_rate=0.5)

    def force(llm: LLM) -> None:
        moe = hybrid(llm)
        moe.cost = CostModel(1e15, 0.0, cpu_s_per_token=1.0, learn=False)  # device_is_cpu off
        if mode == "split":
            moe.modes = split_only()
        else:
            moe.modes = LayerModes(explore_share=0, learn=False)
            moe.modes.seconds = {(m, 1 << b): t for b in range(8)
                                 for m, t in (("cpu", 0.0), ("split", 1.0))}

    got = run(llm, force)
    s = hybrid(llm).stats()
    llm.close()
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    if mode == "cpu":
        assert s["layers_all_cpu"] > 0 and s["layers_split"] == 0
        assert s["cpu_computed"] > 0 and s["fetched"] == 0 and s["bytes_h2d"] == 0
        assert s["device_computed"] == 0
    else:
        assert s["layers_split"] > 0 and s["layers_all_cpu"] == 0
        assert s["fetched"] > 0 and s["cpu_computed"] == 0


def test_cpu_experts_are_filled_on_the_idle_link_and_later_steps_hit_them(
        tiny_models: dict[str, Path]) -> None:
    """The general (GPU) path on the CPU with a link the split never uses (every miss to the
    CPU) and the router's prefetch off: the experts computed on the CPU are copied in by the
    fill while the link idles, so later steps compute them from the slots (hits) without a
    single demand fetch, and the logits still equal resident's bit for bit. With speculative
    copies off (`prefetch`, as for the bench's all-CPU), nothing is filled."""
    path = tiny_models["mixtral"]
    want = run(make(path, moe_strategy="resident"))
    stats = {}
    for fill in (True, False):
        llm = make(path, moe_strategy="hybrid", moe_cache_rate=0.5)

        def force(llm: LLM, fill: bool = fill) -> None:
            moe = hybrid(llm)
            moe.cost = CostModel(1.0, 1.0, cpu_s_per_token=1e-9, learn=False)  # the CPU's
            moe.modes = split_only()
            moe.prefetch = fill  # a CPU device turns it off; a GPU's is on
            moe._predict = lambda *_, **__: []  # no router prefetch: hits come from fills

        got = run(llm, force)
        stats[fill] = hybrid(llm).stats()
        llm.close()
        assert torch.equal(got[0], want[0]) and got[1] == want[1]
    s = stats[True]
    assert s["fetched"] == 0 and s["demand_fetches"] == 0 and s["prefetch_issued"] == 0
    assert s["fill_issued"] > 0 and s["bytes_h2d"] > 0
    assert s["device_computed"] > 0 and s["fill_used"] > 0
    off = stats[False]
    assert off["fill_requested"] == off["bytes_h2d"] == off["device_computed"] == 0


def test_bench_strategy_measures_hybrid_and_can_pick_it(tmp_path: Path) -> None:
    from ftrs.guard.bench_strategy import BenchRow, Candidate, run_strategy_bench
    from ftrs.guard.profile import resolve_auto_strategy

    seconds = {"resident": 5.0, "offload@0.5": 4.0, "hybrid@0.5": 2.0}

    def run(c: Candidate) -> BenchRow:
        t = seconds[c.label]
        return BenchRow(c.label, c.strategy, c.cache_rate, t / 2, t / 2, t)

    b = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:0.1",
                           home=tmp_path, runner=run)
    assert [r.label for r in b.rows] == ["resident", "offload@0.5", "hybrid@0.5"]
    assert b.pick.label == "hybrid@0.5"
    choice = resolve_auto_strategy(b.key, total_expert_bytes=10, device_budget_bytes=1,
                                   home=tmp_path)
    assert (choice.strategy, choice.cache_rate) == ("hybrid", 0.5)
    EngineConfig(moe_strategy=choice.strategy, moe_cache_rate=choice.cache_rate)  # accepted


@pytest.mark.parametrize("py_rows", [64, 0], ids=["python-bookkeeping", "torch-bookkeeping"])
def test_cpu_share_sums_each_tokens_cpu_experts_at_its_lowest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, py_rows: int) -> None:
    """`hybrid_share.cpu_share` (a GPU's split, in one kernel call) on a Q8_0 layer: only the share's experts,
    each token's summed in ascending id, bit for bit the per-expert contributions added in that
    order (the kernels' own rounding, `_cpu_parts`); each token's place is that of its lowest
    CPU expert; tokens without one are left out. Both bookkeeping paths (plain Python up to
    `SHARE_PY_ROWS` rows, torch above)."""
    from ftrs.layers.moe import accumulate, plan_experts
    from ftrs.moe import hybrid_share

    quant_models = pytest.importorskip("quant_models")
    path = quant_models.build("qwen3_moe", {"experts": "Q8_0"}, tmp_path)[0]
    monkeypatch.setattr(hybrid_share, "SHARE_PY_ROWS", py_rows)
    llm = make(path, moe_strategy="hybrid")
    try:
        moe = hybrid(llm)
        spec = moe.spec
        layer = spec.moe_layers[0]
        g = torch.Generator().manual_seed(1)
        rows = 6
        x = torch.randn(rows, spec.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k]
                           for _ in range(rows)])
        w = torch.rand(rows, spec.top_k, generator=g)
        routed = sorted(set(ids.flatten().tolist()))
        for share in (routed, routed[::2], routed[1:2]):
            got = moe.cpu_share(layer, x, ids, w, share)
            assert got is not None
            parts = moe._cpu_parts(layer, x, plan_experts(ids, w, spec.num_experts), share)
            want = torch.zeros_like(x)
            for e in share:
                accumulate(want, parts[e])
            mine = [[e for e in row if e in share] for row in ids.tolist()]
            assert got.tokens == [t for t in range(rows) if mine[t]]
            assert got.lowest == [min(mine[t]) for t in got.tokens]
            assert [ids[t, j].item() for t, j in zip(got.tokens, got.places)] == got.lowest
            assert torch.equal(got.sums, want[got.tokens])
            assert not want[[t for t in range(rows) if not mine[t]]].any()
    finally:
        llm.close()


def test_one_call_shares_leave_one_mixed_share_in_sixteen_to_timing_each_expert(
        tmp_path: Path) -> None:
    """A GPU's split runs its CPU share in one kernel call (`hybrid_share.one_call`), except
    one in `CPU_SAMPLE_EVERY` of the shares whose experts fall in several buckets of tokens:
    one call's time cannot be split between buckets, so that share goes expert by expert and
    each expert's time feeds its bucket's rate. Eager layer calls on a Q8_0 GGUF with the split
    held on every miss to the CPU (`one_call_share` on, as on a GPU), 8 rows each."""
    from ftrs.moe.hybrid import CPU_SAMPLE_EVERY

    quant_models = pytest.importorskip("quant_models")
    path = quant_models.build("qwen3_moe", {"experts": "Q8_0"}, tmp_path)[0]
    llm = make(path, moe_strategy="hybrid")
    try:
        moe = hybrid(llm)
        spec = moe.spec
        layer = spec.moe_layers[0]
        moe.one_call_share = True
        assert all(moe.one_call(layer, [1, 1, 1]) for _ in range(2 * CPU_SAMPLE_EVERY))
        moe.cost = CostModel(1.0, 1.0, cpu_s_per_token=1e-9)  # the link priced out
        moe.modes = LayerModes(explore_share=0, learn=False)
        moe.modes.seconds = {(m, 1 << b): t for b in range(8)
                             for m, t in (("split", 0.0), ("cpu", 1.0))}
        timed: list[int] = []  # per-expert tokens of each expert timed alone
        observe = moe.cost.observe_cpu

        def recording(fmt: str, tokens: int, seconds: float) -> None:
            timed.append(tokens)
            observe(fmt, tokens, seconds)

        moe.cost.observe_cpu = recording  # type: ignore[method-assign]
        by_expert: list[int] = []  # layer calls that went expert by expert
        cpu_parts = moe._cpu_parts

        def counting(*a: Any) -> Any:
            by_expert.append(1)
            return cpu_parts(*a)

        moe._cpu_parts = counting  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(2)
        mixed = 0
        for _ in range(3 * CPU_SAMPLE_EVERY):
            x = torch.randn(8, spec.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k]
                               for _ in range(8)])
            w = torch.rand(8, spec.top_k, generator=g)
            counts = torch.bincount(ids.flatten(), minlength=spec.num_experts)
            mixed += len({1 << (int(c).bit_length() - 1) for c in counts if c}) > 1
            moe.forward(layer, x, ids, w)
        sampled = mixed // CPU_SAMPLE_EVERY
        assert sampled >= 2  # the premise: 8 rows over few experts mix buckets
        assert moe._mixed_shares == mixed
        assert len(by_expert) == sampled  # every other share in one call
        # the sampled shares' experts, each timed alone, buckets above one row among them
        assert len(timed) >= sampled and max(timed) > 1
        assert {b for _, b in moe.cost.cpu} - {1}
    finally:
        llm.close()
