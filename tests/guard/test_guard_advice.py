"""The startup guard's advice is true of the engine it guards: the expert cache's share is the
rule's hit-rate bound (a full cache is never told to grow), hybrid on a CPU device hears nothing
about a link it does not use, and a loss's reason says which chunk was halved."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from ftrs.cli import main
from ftrs.config import EngineConfig
from ftrs.errors import ConfigError
from ftrs.guard.policy import GuardDecision, decide_prefill_cap
from ftrs.guard.startup import apply_link_guard, cache_hit_bound

from .test_auto_everywhere import write_hybrid_profile
from .test_policy import DEMO, GEN3_X16, lost_report, reports

# tiny qwen3_moe: 2 MoE layers x 8 experts of 36 KiB; 100 kB/s gives a 0.5 s window 50 kB,
# less than even a 256-token chunk moves from an empty cache (every expert, 590 kB)
SLOW = "simulated:0.0001"


def guard(model: Path, home: Path,
          **options: Any) -> tuple[EngineConfig, GuardDecision | None]:
    config = EngineConfig(model=str(model), device="cpu", copy_backend=SLOW, **options)
    return apply_link_guard(config, explicit_max_prefill=False, home=home, measure=False)


def test_a_full_cache_moves_nothing_and_is_not_told_to_grow(tiny_models: dict[str, Path],
                                                            tmp_path: Path) -> None:
    _, d = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="offload", moe_cache_rate=1.0)
    assert d is not None and d.cap_tokens is None
    assert not any("--moe-cache-rate" in w for w in d.warnings), d.warnings
    assert d.numbers["hit_rate"] == 1.0 and d.numbers["chunk_bytes_at_requested"] == 0


def test_a_half_cache_halves_the_bytes_and_may_still_grow(tiny_models: dict[str, Path],
                                                          tmp_path: Path) -> None:
    _, none = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="offload",
                    moe_cache_size=1)  # 1 of 16 slots: H = 1/16
    _, half = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="offload",
                    moe_cache_rate=0.5)
    assert none is not None and half is not None
    assert none.numbers["hit_rate"] == 1 / 16
    full = none.numbers["chunk_bytes_at_requested"] / (1 - 1 / 16)
    assert math.isclose(half.numbers["chunk_bytes_at_requested"], full * 0.5)
    # still over the window: a larger cache rate is true advice below 1.0
    assert any("use a larger --moe-cache-rate" in w for w in half.warnings), half.warnings


def test_a_cache_sized_at_load_is_not_told_to_grow(tiny_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """No --moe-cache-rate or --moe-cache-size: the engine sizes the cache from free memory
    (it may hold every expert), so the guard says it counted no hits and does not advise a
    larger cache rate."""
    _, d = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="offload")
    assert d is not None and d.numbers["hits_unknown"] is True
    [w] = [w for w in d.warnings if "no chunk size fixes this link" in w]
    assert "a larger --moe-cache-rate" not in w, w
    assert " with no cache hits counted (" in w, w
    assert w.endswith("no chunk size fixes this link; the cache is sized from free memory at "
                      "load, so its hits are not counted here: give --moe-cache-rate or "
                      "--moe-cache-size to count them, or use the resident strategy or a faster "
                      "link"), w
    _, given = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="offload",
                     moe_cache_size=1)
    assert given is not None and given.numbers["hits_unknown"] is False


def test_the_hit_bound_is_the_cache_share() -> None:
    base = EngineConfig(moe_strategy="offload")
    assert cache_hit_bound(base, DEMO) == 0.0  # sized from free memory: nothing known
    assert cache_hit_bound(EngineConfig(moe_cache_rate=0.25), DEMO) == 0.25
    assert cache_hit_bound(EngineConfig(moe_cache_size=60), DEMO) == 0.25  # of 240
    assert cache_hit_bound(EngineConfig(moe_cache_size=1000), DEMO) == 1.0


def test_hybrid_on_a_cpu_device_says_nothing_of_a_link(tiny_models: dict[str, Path],
                                                       tmp_path: Path) -> None:
    _, d = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="hybrid", moe_cache_rate=0.5)
    assert d is not None and d.cap_tokens is None and d.warnings == ()
    assert "hybrid on the CPU device" in d.reasons[0]


def test_auto_picking_hybrid_on_the_cpu_is_not_told_to_go_resident(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = tiny_models["qwen3_moe"]
    write_hybrid_profile(model, tmp_path, SLOW)
    served, d = guard(model, tmp_path, moe_strategy="auto")
    assert served.moe_strategy == "hybrid" and d is not None
    assert d.warnings == () and not any("resident" in r for r in d.reasons)


def test_offload_on_the_cpu_still_hears_about_its_link(tiny_models: dict[str, Path],
                                                       tmp_path: Path) -> None:
    _, d = guard(tiny_models["qwen3_moe"], tmp_path, moe_strategy="offload")
    assert d is not None and any("no chunk size fixes this link" in w for w in d.warnings)


def test_a_loss_reason_names_the_chunk_it_halved(tmp_path: Path) -> None:
    lost_report(tmp_path, 4096)
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert d.cap_tokens == 2048
    assert any("half the 4096-token chunk of the loss: 8192 -> 2048" in r for r in d.reasons), \
        d.reasons
    assert not any("halved 1 time(s)" in r for r in d.reasons)
    lost_report(tmp_path, 4096)  # a second loss at that size: a quarter of it
    d = decide_prefill_cap(GEN3_X16, DEMO, requested=8192, crash_reports=reports(tmp_path))
    assert any("a quarter of the 4096-token chunk of the losses: 8192 -> 1024" in r
               for r in d.reasons), d.reasons


@pytest.mark.parametrize("window", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_bad_link_guard_window_is_a_config_error(window: float, tiny_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    config = EngineConfig(model=str(tiny_models["qwen3_moe"]), device="cpu",
                          moe_strategy="offload")
    with pytest.raises(ConfigError, match="--link-guard-window: must be a finite number of seconds > 0"):
        apply_link_guard(config, explicit_max_prefill=False, window_s=window, home=tmp_path,
                         measure=False)


@pytest.mark.parametrize(("flags", "says"), [
    (("--link-guard-window", "-1"), "--link-guard-window: must be a finite number of seconds > 0"),
    (("--link-guard-window", "nan"), "--link-guard-window: must be a finite number of seconds > 0"),
    (("--guard-loss-max-age-days", "-5"), "--guard-loss-max-age-days: must be > 0, got -5"),
    (("--guard-loss-max-age-days", "0"), "--guard-loss-max-age-days: must be > 0, got 0"),
    (("--guard-loss-max-age-days", "nan"), "--guard-loss-max-age-days: must be > 0, got nan"),
])
def test_doctor_refuses_what_serve_refuses(flags: tuple[str, ...], says: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FTRS_HOME", str(tmp_path))
    assert main(["doctor", "--no-measure", *flags]) == ConfigError.exit_code
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err  # refused before any report


def test_serve_refuses_a_nan_loss_age() -> None:
    with pytest.raises(ConfigError, match="guard_loss_max_age_days: must be > 0, got nan"):
        EngineConfig(guard_loss_max_age_days=float("nan"))
