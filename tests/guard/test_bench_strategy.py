"""`ftrs bench strategy` picks the fastest row of its own measured table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftrs.errors import ConfigError
from ftrs.guard.bench_strategy import BenchRow, Candidate, run_strategy_bench
from ftrs.guard.profile import load_profile, resolve_auto_strategy
from ftrs.models.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("mixtral", tmp_path_factory.mktemp("tiny") / "mixtral", seed=0)


def test_real_bench_at_two_link_speeds(tiny_moe: Path, tmp_path: Path) -> None:
    picks = {}
    tables = {}
    for backend in ("simulated:0.005", "simulated:200"):
        b = run_strategy_bench(str(tiny_moe), prompt_tokens=32, decode_tokens=4,
                               cache_rates=(0.25, 1.0), copy_backend=backend, device="cpu",
                               home=tmp_path, strategies=("offload",))
        ok = [r for r in b.rows if r.error is None]
        assert len(ok) == 3
        assert b.pick == min(ok, key=lambda r: r.total_s)  # the argmin of its own table
        assert [r.label for r in b.rows] == ["resident", "offload@0.25", "offload@1"]
        assert all(r.bytes_h2d > 0 for r in ok if r.strategy == "offload")
        prof = load_profile(b.key, tmp_path)
        assert prof is not None and prof["pick"]["label"] == b.pick.label
        picks[backend], tables[backend] = b.pick.label, [r.label for r in
                                                        sorted(ok, key=lambda r: r.total_s)]
    if tables["simulated:0.005"][0] != tables["simulated:200"][0]:
        assert picks["simulated:0.005"] != picks["simulated:200"]


def test_pick_follows_the_measurements(tmp_path: Path) -> None:
    """A fake runner standing for two links: a slow one where moving experts dominates, a fast
    one where a small cache is cheaper; the picks differ because the tables do."""

    def runner(seconds: dict[str, float]):  # type: ignore[no-untyped-def]
        def run(c: Candidate) -> BenchRow:
            t = seconds[c.label]
            return BenchRow(c.label, c.strategy, c.cache_rate, t / 2, t / 2, t)
        return run

    slow = {"resident": 1.0, "offload@0.25": 9.0, "offload@1": 3.0}
    fast = {"resident": 1.0, "offload@0.25": 0.4, "offload@1": 0.7}
    a = run_strategy_bench("m", cache_rates=(0.25, 1.0), copy_backend="simulated:1",
                           home=tmp_path, runner=runner(slow))
    b = run_strategy_bench("m", cache_rates=(0.25, 1.0), copy_backend="simulated:100",
                           home=tmp_path, runner=runner(fast))
    assert (a.pick.label, b.pick.label) == ("resident", "offload@0.25")
    assert a.profile_path != b.profile_path  # keyed by link
    choice = resolve_auto_strategy(b.key, total_expert_bytes=10, device_budget_bytes=1,
                                   home=tmp_path)
    assert (choice.strategy, choice.cache_rate) == ("offload", 0.25)
    assert str(b.profile_path) in choice.message


def test_failed_candidate_is_a_row_not_the_pick(tmp_path: Path) -> None:
    def run(c: Candidate) -> BenchRow:
        if c.strategy == "resident":
            raise RuntimeError("out of memory")
        return BenchRow(c.label, c.strategy, c.cache_rate, 1.0, 1.0, 2.0 + (c.cache_rate or 0))

    b = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:1", home=tmp_path,
                           runner=run, write=False)
    assert b.rows[0].error == "RuntimeError: out of memory" and b.pick.label == "offload@0.5"


def test_auto_without_profile_says_what_it_assumed(tmp_path: Path) -> None:
    key = {"device": "d", "host": "h", "model": "m", "link": "l"}
    fits = resolve_auto_strategy(key, total_expert_bytes=10, device_budget_bytes=100,
                                 home=tmp_path)
    assert fits.strategy == "resident" and "no profile" in fits.message
    big = resolve_auto_strategy(key, total_expert_bytes=1000, device_budget_bytes=100,
                                home=tmp_path)
    assert big.strategy == "offload" and "assumed offload" in big.message


def test_slow_link_gguf_picks_hybrid_and_auto_serves_it(tmp_path: Path) -> None:
    """A tiny quantized GGUF, measured for real without the resident candidate (a model that
    does not fit the device) on a 1 MB/s simulated link: offload waits tens of ms per missed
    expert, hybrid computes every miss from the host pool, so hybrid is the pick. Serving
    `--moe-strategy auto` on that file and link then runs the pick; on the CPU device hybrid
    moves nothing over the link, and the guard says so instead of advising on it."""
    import socket

    from ftrs.config import EngineConfig
    from ftrs.guard.bench_strategy import CPU_DEVICE_NOTE, device_name, link_id, model_id
    from ftrs.guard.profile import profile_key
    from ftrs.guard.startup import apply_link_guard

    quant_models = pytest.importorskip("quant_models")
    gguf = quant_models.build("qwen3_moe", quant_models.QWEN3MOE_TYPES, tmp_path)[0]
    backend = "simulated:0.001"
    b = run_strategy_bench(str(gguf), prompt_tokens=8, decode_tokens=3, cache_rates=(0.5,),
                           copy_backend=backend, device="cpu", home=tmp_path, resident=False)
    rows = {r.label: r for r in b.rows}
    assert set(rows) == {"offload@0.5", "hybrid@0.5"} and not any(r.error for r in b.rows)
    assert rows["offload@0.5"].bytes_h2d > 0 and rows["hybrid@0.5"].bytes_h2d == 0
    assert b.pick.label == "hybrid@0.5"
    assert CPU_DEVICE_NOTE in b.notes  # the table says the device is the CPU
    assert b.key == profile_key(device=device_name("cpu"), host=socket.gethostname(),
                                model=model_id(str(gguf)), link=link_id(backend))
    config = EngineConfig(model=str(gguf), device="cpu", moe_strategy="auto",
                          copy_backend=backend)
    served, decision = apply_link_guard(config, explicit_max_prefill=False, home=tmp_path,
                                        measure=False)
    assert (served.moe_strategy, served.moe_cache_rate) == ("hybrid", 0.5)
    assert decision is not None and decision.numbers["strategy"] == "hybrid"
    assert decision.cap_tokens is None and decision.warnings == ()
    assert "hybrid on the CPU device" in decision.reasons[0]


def test_the_written_profile_names_its_own_path(tmp_path: Path) -> None:
    def run(c: Candidate) -> BenchRow:
        return BenchRow(c.label, c.strategy, c.cache_rate, 1.0, 1.0, 2.0 + (c.cache_rate or 0))

    b = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:1", home=tmp_path,
                           runner=run)
    assert b.profile_path is not None
    assert json.loads(b.profile_path.read_text())["profile_path"] == str(b.profile_path)
    unwritten = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:1",
                                   home=tmp_path, runner=run, write=False)
    assert "profile_path" not in unwritten.to_dict()  # no empty path


def test_rounds_rotate_the_order_and_keep_each_candidates_median_run(tmp_path: Path) -> None:
    """With --rounds 3 no candidate always runs first (a cold host's first run is slower: the
    fake charges the first run of each round double), and each keeps its median run, so one
    unlucky run does not decide the pick."""
    order: list[str] = []
    base = {"resident": 1.0, "offload@0.5": 1.1, "hybrid@0.5": 1.2}

    def run(c: Candidate) -> BenchRow:
        first = len(order) % 3 == 0
        order.append(c.label)
        t = base[c.label] * (2.0 if first else 1.0)
        return BenchRow(c.label, c.strategy, c.cache_rate, t / 2, t / 2, t)

    b = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:1", home=tmp_path,
                           runner=run, write=False, rounds=3)
    assert [order[i] for i in (0, 3, 6)] == ["resident", "offload@0.5", "hybrid@0.5"]
    assert sorted(order) == sorted(list(base) * 3)
    assert {r.label: r.total_s for r in b.rows} == base  # the medians: no doubled run
    assert b.pick.label == "resident" and b.workload["rounds"] == 3
    one = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:1",
                             home=tmp_path, runner=run, write=False)
    assert one.rows[0].total_s == 2.0  # one round: resident first and charged for it
    with pytest.raises(ConfigError, match="--rounds"):
        run_strategy_bench("m", cache_rates=(0.5,), runner=run, write=False, rounds=0)


def test_a_candidate_that_fails_in_any_round_is_a_failed_row(tmp_path: Path) -> None:
    calls: list[str] = []

    def run(c: Candidate) -> BenchRow:
        calls.append(c.label)
        if c.strategy == "offload" and calls.count(c.label) == 2:
            raise RuntimeError("device fault")
        return BenchRow(c.label, c.strategy, c.cache_rate, 1.0, 1.0, 2.0)

    b = run_strategy_bench("m", cache_rates=(0.5,), copy_backend="simulated:1", home=tmp_path,
                           runner=run, write=False, strategies=("offload", "hybrid"), rounds=3)
    assert calls.count("offload@0.5") == 2  # not run again once it failed
    assert b.failed == {"offload@0.5": "RuntimeError: device fault"}
    assert b.pick.label in ("resident", "hybrid@0.5")
