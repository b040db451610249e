from __future__ import annotations

import pytest

from ftrs.errors import EngineHang
from ftrs.health.watchdog import Watchdog


class FakeEngine:
    def __init__(self) -> None:
        self.now = 1000.0
        self.pending = False
        self.last_step = 0.0

    def clock(self) -> float:
        return self.now

    def watchdog(self, timeout: float = 10.0) -> Watchdog:
        return Watchdog(lambda: self.pending, lambda: self.last_step, timeout, clock=self.clock)


def test_stalled_engine_with_pending_work_is_a_hang() -> None:
    eng = FakeEngine()
    dog = eng.watchdog()
    eng.pending, eng.last_step = True, eng.now
    assert dog.check() is None
    eng.now += 9.0
    assert dog.check() is None
    eng.now += 2.0
    hang = dog.check()
    assert isinstance(hang, EngineHang)
    assert hang.evidence["stalled_s"] == pytest.approx(11.0)
    assert hang.evidence["decided_by"] == ["watchdog"]
    with pytest.raises(EngineHang):
        dog.check_or_raise()


def test_idle_engine_is_never_a_hang() -> None:
    eng = FakeEngine()
    dog = eng.watchdog()
    for _ in range(5):
        eng.now += 3600.0
        assert dog.check() is None
    dog.check_or_raise()


def test_work_arriving_after_a_long_idle_gets_a_full_timeout() -> None:
    eng = FakeEngine()
    dog = eng.watchdog()
    eng.now += 3600.0  # idle for an hour since the last step
    eng.pending = True
    assert dog.check() is None
    eng.now += 5.0
    assert dog.check() is None
    eng.now += 6.0
    assert isinstance(dog.check(), EngineHang)


def test_steps_finishing_keep_it_quiet() -> None:
    eng = FakeEngine()
    dog = eng.watchdog()
    eng.pending = True
    for _ in range(10):
        eng.now += 5.0
        eng.last_step = eng.now - 1.0
        assert dog.check() is None


def test_non_positive_timeout_is_rejected() -> None:
    with pytest.raises(ValueError):
        FakeEngine().watchdog(timeout=0)
