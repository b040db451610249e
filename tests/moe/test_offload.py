"""The offload strategy against `resident` on tiny checkpoints (fp32, CPU, host/simulated links).

The oracle is exact: offload must produce the SAME logits as resident, bit for bit, in prefill
(one forward over a 20-token prompt) and in decode (every step of a chunked-prefill, batched
greedy generation), for every cache capacity from `top_k` slots to all experts, with and without
prefetch. Beside the logits, the Rust counters must add up (see `check_counters`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from ftrs.errors import (
    ConfigError,
    DeviceError,
    DeviceLost,
    DeviceOutOfMemory,
    KernelFault,
)
from ftrs.llm import LLM
from ftrs.moe import offload as offload_mod
from ftrs.moe import rank as rank_mod
from ftrs.moe.offload import OffloadStrategy
from ftrs.sampling import SamplingParams

MOE_ARCHS = ("mixtral", "qwen3_moe")
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]
PROMPTS = [IDS, IDS[:5], IDS[3:17]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
PREFILL_BUDGET = 7  # tokens per step: forces chunked prefill mixed with decode
CAPACITIES = ("top_k", "top_k+1", "half", "all")


class Run(NamedTuple):
    prefill: torch.Tensor  # (len(IDS), vocab) fp32: one forward over the whole prompt
    steps: list[torch.Tensor]  # logits of every engine step of the greedy generation
    tokens: list[list[int]]  # generated ids per prompt


def make(path: Path, **options: Any) -> LLM:
    return LLM(str(path), kv_tokens=2048, dtype="float32", device="cpu",
               max_prefill_length=PREFILL_BUDGET, **options)


def run(llm: LLM) -> Run:
    """Prefill logits, then a batched greedy generation recording every step's logits."""
    prefill = llm.logits(IDS)
    steps: list[torch.Tensor] = []
    decoder = llm.engine.rt.decoder
    plain = decoder.logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = plain(hidden)
        steps.append(out.detach().clone().cpu())
        return out

    decoder.logits = recording  # type: ignore[method-assign]
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        del decoder.logits
    return Run(prefill, steps, [o.token_ids for o in outs])


def assert_same(got: Run, ref: Run) -> None:
    assert torch.equal(got.prefill, ref.prefill)
    assert len(got.steps) == len(ref.steps)
    for i, (a, b) in enumerate(zip(got.steps, ref.steps, strict=True)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item()}"
    assert got.tokens == ref.tokens


def strategy(llm: LLM) -> OffloadStrategy:
    moe = llm.engine.rt.moe
    assert isinstance(moe, OffloadStrategy)
    return moe


def quiesce(moe: OffloadStrategy, timeout_s: float = 10.0) -> dict[str, Any]:
    """Counters once no copy is queued or in flight (stray prefetches land in microseconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = moe.stats()
        if s["queue_depth"] == 0 and s["inflight_bytes"] == 0:
            return s
        assert time.monotonic() < deadline, f"transfers never drained: {s}"
        time.sleep(0.001)


def check_counters(s: dict[str, Any]) -> None:
    """Relations the transfer engine guarantees at rest, with no failed copy
    (crates/ftrs-core/src/transfer.rs: every landed, non-cancelled copy adds `expert_bytes`)."""
    assert s["hits"] + s["misses"] == s["lookups"]
    assert sum(s["layer_hits"]) == s["hits"]
    assert sum(s["layer_misses"]) == s["misses"]
    assert s["demand_fetches"] <= s["misses"]  # the rest waited on an in-flight prefetch
    assert s["prefetch_cancelled"] <= s["prefetch_wasted"]
    assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetch_issued"]
    # every landed transfer moved a whole expert; a cancelled prefetch may have moved part of
    # one (its chunks in flight when it was cancelled crossed the link)
    landed = s["demand_fetches"] + s["prefetch_issued"] - s["prefetch_cancelled"]
    issued = s["demand_fetches"] + s["prefetch_issued"]
    assert landed * s["expert_bytes"] <= s["bytes_h2d"] <= issued * s["expert_bytes"]
    assert s["prefetch_predicted_hits"] <= min(s["prefetch_predicted"], s["prefetch_needed"])


def slots_for(label: str, top_k: int, total: int) -> int:
    return {"top_k": top_k, "top_k+1": top_k + 1, "half": total // 2, "all": total}[label]


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> dict[str, Run]:
    return {arch: run(make(tiny_models[arch], moe_strategy="resident")) for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def shape(tiny_models: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """(top_k, experts of all MoE layers) per architecture."""
    out = {}
    for arch in MOE_ARCHS:
        llm = make(tiny_models[arch], moe_strategy="offload", moe_cache_size=None)
        moe = strategy(llm)
        out[arch] = (moe.spec.top_k, moe.experts.num_experts_total)
        llm.close()
    return out


# --- bit-for-bit equality ---------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, "chunked", False],
                         ids=["prefetch", "prefetch-chunked", "no-prefetch"])
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_offload_equals_resident_bit_for_bit(tiny_models: dict[str, Path],
                                             reference: dict[str, Run],
                                             shape: dict[str, tuple[int, int]],
                                             arch: str, capacity: str, prefetch: bool | str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    top_k, total = shape[arch]
    slots = slots_for(capacity, top_k, total)
    if prefetch == "chunked":  # decode prefetches in 3 chunks of (a tiny model's) experts
        monkeypatch.setattr("ftrs.moe.offload.CHUNK_ALIGN", 64)
        monkeypatch.setattr("ftrs.moe.offload.MIN_CHUNK_BYTES", 64)
        monkeypatch.setattr("ftrs.moe.offload.NARROW_PREFETCH_CHUNKS", 3)
    llm = make(tiny_models[arch], moe_strategy="offload", moe_cache_size=slots,
               moe_prefetch=bool(prefetch))
    moe = strategy(llm)
    assert moe.num_slots == slots
    if prefetch == "chunked":
        assert 0 < 2 * moe.narrow_chunk < moe.experts.expert_bytes <= 3 * moe.narrow_chunk

    prefill = llm.logits(IDS)
    first = quiesce(moe)  # counters of exactly one forward, from an empty cache
    distinct = first["distinct_experts"]
    assert first["lookups"] == sum(distinct)  # a chunk looks up each distinct expert once
    if capacity in ("top_k", "top_k+1"):
        assert max(distinct) > slots  # the wave path is exercised
    if not prefetch:
        # from an empty cache with no lookahead every expert is a demand miss, waves included
        assert first["layer_misses"] == distinct
        assert first["demand_fetches"] == sum(distinct)
    if max(distinct) > slots:
        assert max(first["layer_misses"]) > slots  # a layer fetched more than fits: waves
    check_counters(first)

    got = run(llm)
    assert torch.equal(prefill, got.prefill)
    assert_same(got, reference[arch])

    s = quiesce(moe)
    check_counters(s)
    assert len(moe.engine.resident()) <= slots
    if not prefetch:
        assert s["prefetch_issued"] == s["prefetch_predicted"] == 0
    elif slots > len(moe.spec.moe_layers) * top_k:  # room beyond one token's working set
        assert s["prefetch_predicted"] > 0  # layer l+1's router ran on layer l's hidden state
    else:
        assert s["prefetch_issued"] == 0  # no room: a prefetch would evict what is needed next
    if capacity == "all":
        # a cache that holds every expert fetches each one once, whatever else happens
        assert s["bytes_h2d"] <= total * s["expert_bytes"]
    llm.close()


@pytest.mark.parametrize("options", [
    {"copy_backend": "simulated:20"},
    {"copy_backend": "simulated:4:30"},
    {"copy_backend": "host", "pcie_pacing": 2.0},
    {"copy_backend": "simulated:8", "moe_cache_policy": "lfru"},
    {"moe_cache_policy": "lfru", "moe_cache_rate": 0.5},
    {"moe_cache_policy": "lrfu", "moe_cache_rate": 0.5},
    {"moe_cache_policy": "lru", "moe_cache_rate": 0.5},
], ids=["sim20", "sim4-lat30", "paced2", "sim8-lfru", "lfru-half", "lrfu-half", "lru-half"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_links_and_policies_give_the_same_logits(tiny_models: dict[str, Path],
                                                 reference: dict[str, Run], arch: str,
                                                 options: dict[str, Any]) -> None:
    size = {} if "moe_cache_rate" in options else {"moe_cache_size": 4}  # = qwen3_moe top_k
    llm = make(tiny_models[arch], moe_strategy="offload", **size, **options)
    moe = strategy(llm)
    if options.get("copy_backend", "host").startswith("simulated"):
        assert moe.backend == options["copy_backend"]
    assert_same(run(llm), reference[arch])
    s = quiesce(moe)
    check_counters(s)
    assert s["bytes_h2d"] > 0
    llm.close()


def test_full_cache_fetches_each_expert_once(tiny_models: dict[str, Path],
                                             shape: dict[str, tuple[int, int]]) -> None:
    _, total = shape["mixtral"]
    llm = make(tiny_models["mixtral"], moe_strategy="offload", moe_cache_size=total,
               moe_prefetch=False)
    moe = strategy(llm)
    a = llm.logits(IDS)
    first = quiesce(moe)
    b = llm.logits(IDS)
    second = quiesce(moe)
    assert torch.equal(a, b)
    assert second["misses"] == first["misses"] == sum(first["distinct_experts"])
    assert second["hits"] == sum(second["distinct_experts"])
    assert second["bytes_h2d"] == first["bytes_h2d"]


class SlowLink:
    """A stand-in for the transfer engine whose `wait` takes `wait_s` of a fake clock, so a
    test can make every forward link-bound (or not) without timing anything."""

    def __init__(self, engine: Any, clock: list[float], wait_s: float) -> None:
        self._engine, self._clock, self.wait_s = engine, clock, wait_s

    def wait(self, ticket: Any) -> None:
        self._engine.wait(ticket)
        self._clock[0] += self.wait_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def decode_prefetches(moe: OffloadStrategy, llm: LLM) -> tuple[int, int]:
    """(prefetches issued by narrow forwards, forwards gated) over one batch-1 greedy run."""
    issued = 0
    forward = moe.forward

    def counting(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        nonlocal issued
        before = moe.pred_issued
        out = forward(layer, x, ids, w)
        if x.shape[0] == 1:
            issued += moe.pred_issued - before
        return out

    moe.forward = counting  # type: ignore[method-assign]
    try:
        llm.generate([IDS[:3]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    finally:
        del moe.forward
    return issued, moe.gated_forwards


@pytest.mark.parametrize("link_bound", [True, False], ids=["link-bound", "compute-bound"])
def test_prefetch_is_skipped_on_link_bound_decode_and_results_do_not_change(
        tiny_models: dict[str, Path], shape: dict[str, tuple[int, int]],
        reference: dict[str, Run], link_bound: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ftrs.moe.offload.PRECISE", 1.01)  # no prediction is precise enough
    _, total = shape["mixtral"]
    llm = make(tiny_models["mixtral"], moe_strategy="offload", moe_cache_size=total)
    moe = strategy(llm)
    clock = [0.0]
    moe.clock = lambda: clock[0]
    moe.engine = SlowLink(moe.engine, clock, wait_s=1.0 if link_bound else 0.0)
    issued, gated = decode_prefetches(moe, llm)
    if link_bound:
        # the fake clock moves only in `wait`, so every forward is link-bound: each of the 9
        # decode forwards follows a link-bound narrow one (the 3-token prefill is narrow too)
        assert (gated, issued) == (9, 0)
    else:
        assert gated == 0 and issued > 0
    # the last forward (one decode token, one wave per MoE layer) waited once per MoE layer
    waited = len(moe.spec.moe_layers) * (1.0 if link_bound else 0.0)
    assert moe.stats()["transfer_wait_s"] == pytest.approx(waited)
    moe.engine = moe.engine._engine
    assert_same(run(llm), reference["mixtral"])  # the gate changes transfers, never results
    llm.close()


class LimitLog:
    """A stand-in for the transfer engine that records the prefetch limit and chunk size set."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.limits, self.chunks = engine, [], []

    def set_max_inflight_prefetches(self, n: int) -> None:
        self.limits.append(n)
        self._engine.set_max_inflight_prefetches(n)

    def set_prefetch_chunk_bytes(self, n: int) -> None:
        self.chunks.append(n)
        self._engine.set_prefetch_chunk_bytes(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_narrow_forwards_keep_one_prefetch_chunk_in_flight_wide_ones_no_limit(
        tiny_models: dict[str, Path], reference: dict[str, Run]) -> None:
    llm = make(tiny_models["mixtral"], moe_strategy="offload", moe_cache_size=None)
    moe = strategy(llm)
    moe.engine = log = LimitLog(moe.engine)
    assert_same(run(llm), reference["mixtral"])  # the limit changes transfers, never results
    # the run prefills (wide) then decodes (narrow), maybe more than once: the limit is set on
    # each change of width, to no limit for wide forwards and one for narrow ones
    narrow = offload_mod.NARROW_PREFETCHES_IN_FLIGHT
    assert narrow > 0
    assert log.limits[:2] == [0, narrow]
    assert set(log.limits) == {0, narrow}
    assert all(a != b for a, b in zip(log.limits, log.limits[1:]))
    # with it the chunk size: whole experts for wide forwards, chunks for narrow ones
    assert moe.narrow_chunk > 0
    assert log.chunks == [0 if n == 0 else moe.narrow_chunk for n in log.limits]
    moe.engine = log._engine
    llm.close()


class ReadyLog:
    """A stand-in for the transfer engine that records what `ready` answers."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.answers = engine, []

    def ready(self, slots: list[int]) -> list[bool]:
        got = self._engine.ready(slots)
        self.answers.append(got)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_landed_experts_run_while_the_rest_are_on_the_link_and_results_do_not_change(
        tiny_models: dict[str, Path], shape: dict[str, tuple[int, int]],
        reference: dict[str, Run], arch: str) -> None:
    # a slow link (a tiny expert takes ~1 ms): a layer's misses are still on it when the
    # forward asks, its hits are not. qwen3_moe routes 4 experts per token, so the order in
    # which their outputs are added shows in the last bits: it must stay ascending.
    top_k, total = shape[arch]
    llm = make(tiny_models[arch], moe_strategy="offload", moe_cache_size=max(total // 2, top_k),
               copy_backend="simulated:0.01", moe_prefetch=False)
    moe = strategy(llm)
    moe.engine = log = ReadyLog(moe.engine)
    assert_same(run(llm), reference[arch])
    assert any(not any(a) for a in log.answers)  # all on the link
    assert any(any(a) and not all(a) for a in log.answers)  # a hit computed before a miss landed
    moe.engine = log._engine
    llm.close()


def test_dense_arch_ignores_offload(tiny_models: dict[str, Path]) -> None:
    # llama has no routed experts: moe_strategy="offload" is accepted and has nothing to do
    llm = make(tiny_models["llama"], moe_strategy="offload", moe_cache_size=2)
    assert llm.engine.rt.moe is None
    ref = make(tiny_models["llama"])
    assert torch.equal(llm.logits(IDS), ref.logits(IDS))
    assert llm.generate([IDS], GREEDY)[0].token_ids == ref.generate([IDS], GREEDY)[0].token_ids


# --- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "cls"), [
    ("device_lost", DeviceLost), ("kernel_fault", KernelFault), ("oom", DeviceOutOfMemory)])
@pytest.mark.parametrize("after", [0, 5])
def test_injected_fault_reaches_generate(tiny_models: dict[str, Path], kind: str,
                                         cls: type[DeviceError], after: int) -> None:
    llm = make(tiny_models["mixtral"], moe_strategy="offload", moe_cache_size=3)
    strategy(llm).engine.inject_fault(kind, after_copies=after)
    with pytest.raises(cls) as info:
        llm.generate([IDS], GREEDY)
    assert info.value.evidence["injected"] is True
    assert info.value.evidence["kind"] == kind


def test_failed_forward_releases_its_slots(tiny_models: dict[str, Path]) -> None:
    llm = make(tiny_models["mixtral"], moe_strategy="offload", moe_cache_size=3)
    moe = strategy(llm)
    moe.engine.inject_fault("kernel_fault")
    with pytest.raises(KernelFault):
        llm.logits(IDS)
    # every slot must be evictable again: a lookup of `num_slots` new experts must fit
    _, ticket = moe.engine.lookup(2, list(range(moe.num_slots)), [])
    moe.engine.wait(ticket)
    moe.engine.release()


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"moe_cache_size": 1},  # below top_k = 2
    {"moe_cache_rate": 0.01},  # ceil(0.01 * 24) = 1 slot, below top_k
    {"moe_cache_size": 0},
    {"moe_cache_rate": 1.5},
    {"moe_cache_policy": "belady"},  # offline only
    {"moe_cache_policy": "fifo"},
    {"copy_backend": "simulated:0"},
    {"copy_backend": "pcie9"},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_bad_cache_options_raise_config_error(tiny_models: dict[str, Path],
                                              options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        make(tiny_models["mixtral"], moe_strategy="offload", **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_backend_on_cpu_is_a_config_error(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="cuda"):
        make(tiny_models["mixtral"], moe_strategy="offload", copy_backend="cuda")


def test_cache_larger_than_model_is_clamped(tiny_models: dict[str, Path],
                                            shape: dict[str, tuple[int, int]]) -> None:
    llm = make(tiny_models["qwen3_moe"], moe_strategy="offload", moe_cache_size=1000)
    assert strategy(llm).num_slots == shape["qwen3_moe"][1]
    rate = make(tiny_models["qwen3_moe"], moe_strategy="offload", moe_cache_rate=0.25)
    assert strategy(rate).num_slots == shape["qwen3_moe"][1] // 4


@pytest.mark.parametrize("rows,experts,top_k", [(1, 8, 2), (3, 8, 2), (4, 64, 4), (8, 64, 8),
                                               (5, 128, 8)])
def test_host_ranking_of_the_next_layer_equals_the_device_path(rows: int, experts: int,
                                                               top_k: int) -> None:
    """`rank_on_host` (hybrid's graph host step predicts with it, from rows already on the
    host) against torch's `route` and the ranking `_predict` makes on the device: the same
    experts in the same order (random fp32 inputs, so no two scores tie), in plain Python (up
    to `RANK_PY_LOGITS` logits: the first three shapes) and in numpy (the last two)."""
    assert 4 * 64 <= rank_mod.RANK_PY_LOGITS < 8 * 64  # the premise of the shapes
    from ftrs.layers.moe import route

    g = torch.Generator().manual_seed(rows * experts + top_k)
    for _ in range(20):
        x = torch.randn(rows, 48, generator=g)
        router = torch.randn(experts, 48, generator=g)
        ids, w = route(x, router, top_k, False)
        score: dict[int, float] = {}
        for e, v in zip(ids.flatten().tolist(), w.flatten().tolist()):
            score[e] = score.get(e, 0.0) + v
        want = sorted(score, key=lambda e: -score[e])
        assert rank_mod.rank_on_host(x, router.numpy(), top_k) == want


@pytest.mark.parametrize("name", ["hybrid", "offload"])
def test_host_rows_predict_the_same_prefetch_as_the_device_rows(tiny_models: dict[str, Path],
                                                                name: str) -> None:
    """`_predict` given the rows on the host (hybrid's graph host step), or told to copy them
    there (`on_host=True`: offload's graph host step, a GPU's decode-sized eager layers), issues
    the same prefetch list as ranking them where they are (prefetch forced on: hybrid on a CPU
    device turns it off)."""
    llm = LLM(str(tiny_models["mixtral"]), device="cpu", dtype="float32", moe_strategy=name,
              moe_cache_rate=0.75)
    try:
        moe: Any = llm.engine.rt.decoder.moe
        moe.prefetch = True
        spec = moe.spec
        g = torch.Generator().manual_seed(0)
        lists = 0
        for layer in spec.moe_layers[:-1]:
            for rows in (1, 4):
                x = torch.randn(rows, spec.hidden_size, generator=g)
                device = moe._predict(layer, x)
                assert moe._predict(layer, x, on_host=False) == device
                assert moe._predict(layer, x, x_host=x.clone()) == device
                assert moe._predict(layer, x, on_host=True) == device
                lists += bool(device)
        assert lists > 0  # the premise: predictions were made
    finally:
        llm.close()
