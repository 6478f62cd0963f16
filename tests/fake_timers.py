"""The tests' injected timers: `call_later` on a clock the test moves (no real time, no sleeps).

`tests/` is on sys.path (tests/conftest.py lives here), so any test or helper imports it as `fake_timers`;
give code under test `call_later=timers.call_later` and a clock reading `timers.now`."""

from __future__ import annotations

import heapq
import itertools


class FakeTimers:
    """`call_later` on a clock the test advances (`advance(seconds)` runs what falls due, in order)."""

    class Handle:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list = []
        self._seq = itertools.count()

    def call_later(self, delay: float, fn, *args) -> "FakeTimers.Handle":
        h = FakeTimers.Handle()
        heapq.heappush(self._due, (self.now + delay, next(self._seq), h, fn, args))
        return h

    def pending(self) -> int:
        """Timers set and neither run nor cancelled."""
        return sum(1 for _, _, h, _, _ in self._due if not h.cancelled)

    def advance(self, seconds: float) -> None:
        until = self.now + seconds
        while self._due and self._due[0][0] <= until:
            at, _, h, fn, args = heapq.heappop(self._due)
            self.now = at
            if not h.cancelled:
                fn(*args)
        self.now = until
