"""Progress watchdog: work is pending and the engine showed no progress for `hang_timeout_s`
(`last_step_finished_at`: the last step's end, or a layer computed inside a long step).

The stall is measured from the later of the last finished step and the moment work became
pending, so an engine that sat idle for an hour is not called hung the instant a request
arrives. Both callables must use the watchdog's clock (time.monotonic by default).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ftrs.errors import EngineHang
from ftrs.health.classify import make_hang


class Watchdog:
    def __init__(
        self, has_pending_work: Callable[[], bool], last_step_finished_at: Callable[[], float],
        hang_timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be positive, got {hang_timeout_s}")
        self.has_pending_work = has_pending_work
        self.last_step_finished_at = last_step_finished_at
        self.hang_timeout_s = hang_timeout_s
        self._clock = clock
        self._pending_since: float | None = None

    def check(self) -> EngineHang | None:
        """An EngineHang when stalled past the timeout, else None. Call it periodically."""
        now = self._clock()
        if not self.has_pending_work():
            self._pending_since = None
            return None
        if self._pending_since is None:
            self._pending_since = now
        progress = max(self.last_step_finished_at(), self._pending_since)
        stalled = now - progress
        if stalled <= self.hang_timeout_s:
            return None
        return make_hang(stalled, self.hang_timeout_s)

    def check_or_raise(self) -> None:
        hang = self.check()
        if hang is not None:
            raise hang
