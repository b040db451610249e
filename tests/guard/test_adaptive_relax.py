"""The adaptive guard's relax rule (guard.adaptive, rules 3 and 4) on hand-made sample
sequences with hand-set timestamps: no sleeping, no monitor thread.

Expected ceilings follow rule 1: level n runs max(floor, startup >> n).
"""

from __future__ import annotations

import argparse
import logging

import pytest

from ftrs.config import EngineConfig, add_engine_arguments, engine_config_from_args
from ftrs.errors import ConfigError
from ftrs.guard.adaptive import AdaptiveGuard, top_level
from ftrs.guard.live import LiveGuard
from ftrs.health.state import DeviceState

from .conftest import FakeEngine

R = 600.0  # the relax period of these tests (s)


def sample(aer: int = 0, *, gen: int = 3, width: int = 16, state: str = "ok") -> DeviceState:
    return DeviceState(up=True, state=state, link_gen_current=gen, link_gen_max=3,
                       link_width_current=width, link_width_max=16, aer_correctable=aer)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def quiet_until(guard: AdaptiveGuard, start: float, end: float, every: float = 30.0,
                aer: int = 0) -> list[float]:
    """Feed quiet samples at start, start+every, ... <= end; the times at which it relaxed."""
    relaxed = []
    t = start
    while t <= end:
        event = guard.observe(sample(aer), now=t)
        if event is not None:
            assert event.kind == "relax"
            relaxed.append(t)
        t += every
    return relaxed


def test_top_level_is_the_first_at_the_floor() -> None:
    assert top_level(2048, 256) == 3  # 1024, 512, 256
    assert top_level(1000, 256) == 2  # 500, 256 (250 lifted to the floor)
    assert top_level(256, 256) == 1  # no room to halve: pacing alone is the level


def test_tighten_then_quiet_relaxes_one_level_per_period_back_to_startup() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R)
    assert guard.observe(sample(0), now=0.0) is None
    guard.observe(sample(3), now=10.0)  # AER rose: level 1
    event = guard.observe(sample(9), now=20.0)  # rose again: level 2
    assert event is not None and event.kind == "tighten" and event.level == 2
    assert (guard.level, guard.cap_tokens, guard.pacing_gbps) == (2, 512, 6.0)

    # Quiet from t=20 on: the first step back comes R after the last tightening, not before.
    assert guard.observe(sample(9), now=20.0 + R - 1) is None
    event = guard.observe(sample(9), now=20.0 + R)
    assert event is not None and event.kind == "relax" and event.level == 1
    assert (guard.level, guard.cap_tokens) == (1, 1024)  # doubled back toward 2048
    assert guard.pacing_gbps == 6.0  # pacing stays on until fully relaxed
    assert "link quiet for 600 s" in event.reason

    # The timer restarted at the step: the next one needs a full quiet period again.
    assert guard.observe(sample(9), now=20.0 + 2 * R - 1) is None
    event = guard.observe(sample(9), now=20.0 + 2 * R)
    assert event is not None and event.level == 0
    assert (guard.level, guard.cap_tokens, guard.pacing_gbps) == (0, 2048, None)

    # Fully relaxed: more quiet changes nothing, and never goes above the startup ceiling.
    assert quiet_until(guard, 20.0 + 2 * R + 30, 20.0 + 6 * R, aer=9) == []
    assert guard.cap_tokens == 2048
    assert [e.kind for e in guard.events] == ["tighten", "tighten", "relax", "relax"]
    assert [e.cap_tokens for e in guard.events] == [1024, 512, 1024, 2048]
    stats = guard.stats()
    assert stats["adaptive_guard_level"] == 0
    assert stats["adaptive_guard_tighten_total"] == 2 and stats["adaptive_guard_relax_total"] == 2
    assert "pcie_pacing_gbps" not in stats


def test_from_the_floor_each_level_takes_its_own_quiet_period() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R)
    guard.observe(sample(0), now=0.0)
    for n in range(1, 7):  # past the top: stays at level 3 (256 tokens)
        guard.observe(sample(n), now=float(n))
    assert (guard.level, guard.cap_tokens, guard.tighten_count) == (3, 256, 6)
    relaxed = quiet_until(guard, 10.0, 10.0 + 5 * R, every=10.0, aer=6)
    # The last tightening was at t=6; samples come every 10 s, so each step lands on the first
    # sample a full period after the one before.
    assert relaxed == [10.0 + R, 10.0 + 2 * R, 10.0 + 3 * R]
    assert [e.cap_tokens for e in guard.events if e.kind == "relax"] == [512, 1024, 2048]


def test_error_during_relax_retightens_and_resets_the_timer() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R)
    guard.observe(sample(0), now=0.0)
    guard.observe(sample(1), now=10.0)
    guard.observe(sample(2), now=20.0)  # level 2
    assert quiet_until(guard, 50.0, 50.0 + R, aer=2) == [20.0 + R]  # on the 30 s sample grid
    assert guard.level == 1 and guard.cap_tokens == 1024

    event = guard.observe(sample(5), now=900.0)  # a new error half-way through the next period
    assert event is not None and event.kind == "tighten"
    assert (guard.level, guard.cap_tokens, guard.pacing_gbps) == (2, 512, 6.0)
    # The quiet period counts from 900 now: nothing just after 620 + R (when the old one would
    # have ended), the step comes at 900 + R.
    assert guard.observe(sample(5), now=620.0 + R + 1) is None
    assert guard.observe(sample(5), now=900.0 + R - 1) is None
    event = guard.observe(sample(5), now=900.0 + R)
    assert event is not None and event.kind == "relax" and guard.level == 1


def test_a_sample_that_is_not_quiet_resets_the_timer_without_tightening() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R)
    guard.observe(sample(0), now=0.0)
    guard.observe(sample(1), now=0.0)  # level 1
    # A degraded device (no counter rise, no new drop) is not quiet: the timer restarts at 500.
    assert guard.observe(sample(1, state="degraded"), now=500.0) is None
    assert guard.level == 1 and guard.tighten_count == 1
    assert guard.observe(sample(1), now=R) is None
    assert guard.observe(sample(1), now=500.0 + R - 1) is None
    assert guard.observe(sample(1), now=500.0 + R) is not None
    assert guard.level == 0


def test_a_link_that_stays_down_shifted_never_relaxes() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R)
    assert guard.observe(sample(0, width=8), now=0.0) is not None  # below max on the first sample
    for t in range(30, 3000, 30):
        assert guard.observe(sample(0, width=8), now=float(t)) is None
    assert guard.level == 1
    # Back at x16 at t=3000: the quiet period starts from the last x8 sample (t=2970).
    assert guard.observe(sample(0), now=3000.0) is None
    assert guard.observe(sample(0), now=2970.0 + R - 1) is None
    assert guard.observe(sample(0), now=2970.0 + R) is not None
    assert (guard.level, guard.cap_tokens, guard.pacing_gbps) == (0, 2048, None)


def test_an_idle_speed_drop_on_an_ok_device_counts_as_quiet() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R)
    guard.observe(sample(0), now=0.0)
    guard.observe(sample(1), now=0.0)
    assert guard.observe(sample(1, gen=1), now=R / 2) is None  # idle: power saving
    assert guard.observe(sample(1, gen=1), now=R) is not None
    assert guard.level == 0


def test_relax_restores_the_users_pacing_only_at_level_zero() -> None:
    guard = AdaptiveGuard(2048, floor=256, pacing_gbps=10.0, relax_after_s=R)
    guard.observe(sample(0), now=0.0)
    guard.observe(sample(1), now=0.0)
    guard.observe(sample(2), now=0.0)
    assert guard.pacing_gbps == 6.0  # the lower of the user's 10 and half of Gen3 x16
    guard.observe(sample(2), now=R)
    assert guard.level == 1 and guard.pacing_gbps == 6.0
    guard.observe(sample(2), now=2 * R)
    assert guard.level == 0 and guard.pacing_gbps == 10.0


def test_relax_after_zero_never_relaxes() -> None:
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=0.0)
    guard.observe(sample(0), now=0.0)
    guard.observe(sample(1), now=0.0)
    assert quiet_until(guard, 30.0, 100 * R, every=R, aer=1) == []
    assert guard.level == 1 and guard.cap_tokens == 1024


def test_the_injected_clock_drives_observe_without_now() -> None:
    clock = Clock()
    guard = AdaptiveGuard(2048, floor=256, relax_after_s=R, clock=clock)
    guard.observe(sample(0))
    guard.observe(sample(1))
    clock.t = R - 1
    assert guard.observe(sample(1)) is None
    clock.t = R
    assert guard.observe(sample(1)) is not None and guard.level == 0


def test_each_relax_step_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    guard = AdaptiveGuard(1024, floor=256, relax_after_s=R)
    guard.observe(sample(0), now=0.0)
    guard.observe(sample(1), now=0.0)
    guard.observe(sample(2), now=0.0)
    with caplog.at_level(logging.INFO, logger="ftrs.guard.adaptive"):
        guard.observe(sample(2), now=R)
        guard.observe(sample(2), now=2 * R)
    lines = [r.getMessage() for r in caplog.records if "relaxed one level" in r.getMessage()]
    assert len(lines) == 2
    assert "to 1 of 2: prefill chunk 256 -> 512 tokens" in lines[0]
    assert "to 0 of 2: prefill chunk 512 -> 1024 tokens" in lines[1] and "pacing off" in lines[1]


# ------------------------------------------------------------------------- in the engine process


class FakeCopier:
    def __init__(self) -> None:
        self.rates: list[float] = []

    def set_pacing(self, bytes_per_s: float) -> None:
        self.rates.append(bytes_per_s)


def test_live_guard_applies_each_relax_step_between_steps() -> None:
    copier = FakeCopier()
    engine = FakeEngine(2048, copier)
    live = LiveGuard(engine, 2048, floor=256, relax_after_s=R)
    live.on_sample(sample(0), now=0.0)
    live.on_sample(sample(1), now=0.0)
    live.on_sample(sample(2), now=0.0)
    live.before_step()
    assert engine.budget == 512 and copier.rates == [6.0e9]
    assert live.stats()["level"] == 2 and live.stats()["max_level"] == 3

    live.on_sample(sample(2), now=R)
    assert engine.budget == 512  # the monitor thread never touches the engine
    live.before_step()
    stats = live.stats()
    assert engine.budget == 1024 and copier.rates == [6.0e9]  # still paced
    assert stats["level"] == 1 and stats["relax_count"] == 1 and stats["event_count"] == 2
    assert stats["pacing"] == "on" and stats["pcie_pacing_bytes_per_second"] == 6.0e9
    assert stats["events"][-1]["kind"] == "relax" and stats["events"][-1]["cap_tokens"] == 1024

    live.on_sample(sample(2), now=2 * R)
    live.before_step()
    stats = live.stats()
    assert engine.budget == 2048 and copier.rates == [6.0e9, 0.0]  # pacing off
    assert stats["prefill_cap_tokens"] == 2048 == stats["startup_cap_tokens"]
    assert stats["level"] == 0 and stats["relax_count"] == 2
    assert stats["pacing"] == "off" and stats["pcie_pacing_bytes_per_second"] == 0.0
    assert stats["relax_after_s"] == R


def test_live_guard_takes_the_relax_period_from_the_engine_config() -> None:
    engine = FakeEngine(1024, config=EngineConfig(guard_relax_after=45.0))
    live = LiveGuard(engine, 1024, floor=256)
    assert live.guard.relax_after_s == 45.0
    live.on_sample(sample(0), now=0.0)
    live.on_sample(sample(1), now=0.0)
    live.on_sample(sample(1), now=45.0)
    live.before_step()
    assert engine.budget == 1024 and live.stats()["pacing"] == "off"


def test_guard_options_are_engine_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(
        ["--guard-relax-after", "60", "--guard-loss-max-age-days", "7"]))
    assert config.guard_relax_after == 60.0 and config.guard_loss_max_age_days == 7.0
    default = engine_config_from_args(parser.parse_args([]))
    assert default.guard_relax_after == 600.0 and default.guard_loss_max_age_days == 30.0
    with pytest.raises(ConfigError):
        EngineConfig(guard_relax_after=-1.0)
    with pytest.raises(ConfigError):
        EngineConfig(guard_loss_max_age_days=0.0)
