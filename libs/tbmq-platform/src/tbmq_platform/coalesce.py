"""Adaptive fetch window: records coalesce into batches under load, latency stays low when quiet.

Every hop of the message path pays per exchange (a fetch, a Redis pipeline, a produce request, a commit),
not per record. A fixed Kafka fetch window cannot serve both ends: `fetch.min.bytes` = 1 with a long
`fetch.max.wait.ms` answers a quiet consumer at once (one record per fetch, one exchange per record under
load); a large min-bytes with a few ms of wait coalesces under load but adds those ms to every message
when quiet, and polls the broker every few ms while idle.

`FetchWindow` (pure: fed the records of each poll and the time, no I/O) picks the window of the NEXT fetch
from the arrival rate it observes:

- quiet (fewer than `enter_records` would arrive within `max_wait_s`): long poll — min bytes 1, wait
  `idle_wait_ms`: the broker answers as soon as one record is there, and an idle consumer costs one
  fetch per `idle_wait_ms`;
- busy: min bytes `busy_min_bytes`, wait `max_wait_s`: the broker holds the fetch until the window is
  over (or that much data is there, e.g. a backlog), so one fetch carries what arrived in `max_wait_s`
  and the consumer's per-exchange work is paid once per window. At most `max_wait_s` is added per hop.

It leaves the busy mode when fewer than `leave_records` arrive per window (hysteresis). The rate is an
exponentially weighted average with time constant `tau_s` (roughly: the records of the last `tau_s`
divided by `tau_s`), so one burst does not flip the mode.

`AdaptiveLinger` applies the same decision to a producer's linger (busy: batches wait the window, so a
produce request carries the records of the window; quiet: the short linger of `make_producer`).

`AdaptiveFetch` applies the window to an aiokafka consumer (the fetcher reads `_fetch_min_bytes` and
`_fetch_max_wait_ms` when it builds each fetch request: an internal of aiokafka 0.14, checked by
`check_fetcher` at start-up so an upgrade that moves them fails loudly instead of silently not adapting).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiokafka

from .kafka import CHECKED_AIOKAFKA, IDLE_FETCH_WAIT_MS
from .settings import LINGER_ENTER_RATE, LINGER_LEAVE_RATE


@dataclass(frozen=True, slots=True)
class Window:
    min_bytes: int
    max_wait_ms: int
    busy: bool


class FetchWindow:
    def __init__(self, *, max_wait_s: float, idle_wait_ms: int = IDLE_FETCH_WAIT_MS,
                 busy_min_bytes: int = 1 << 20,
                 enter_records: float = 3.0, leave_records: float = 1.0, tau_s: float = 0.05) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be > 0")
        if leave_records > enter_records:
            raise ValueError("leave_records must be <= enter_records")
        self.max_wait_s = max_wait_s
        self.enter_records = enter_records
        self.leave_records = leave_records
        self.tau_s = tau_s
        self.idle = Window(1, idle_wait_ms, False)
        self.busy_window = Window(busy_min_bytes, max(1, round(max_wait_s * 1000)), True)
        self.rate = 0.0                   # records per second (EWMA)
        self.window = self.idle
        self._last: float | None = None
        self.switches = 0

    def observe(self, records: int, now: float) -> Window:
        """A poll returned `records` at monotonic time `now`: the window of the next fetch."""
        last, self._last = self._last, now
        if last is None or self.max_wait_s <= 0:
            return self.window
        elapsed = now - last
        if elapsed <= 0:
            return self.window
        alpha = 1.0 - math.exp(-elapsed / self.tau_s)
        self.rate += alpha * (records / elapsed - self.rate)
        per_window = self.rate * self.max_wait_s
        if not self.window.busy and per_window >= self.enter_records:
            self.window = self.busy_window
            self.switches += 1
        elif self.window.busy and per_window < self.leave_records:
            self.window = self.idle
            self.switches += 1
        return self.window


def check_fetcher(consumer) -> None:
    """The aiokafka internals AdaptiveFetch writes exist (call once the consumer is started)."""
    fetcher = getattr(consumer, "_fetcher", None)
    if not aiokafka.__version__.startswith(CHECKED_AIOKAFKA) or fetcher is None or not all(
            isinstance(getattr(fetcher, a, None), int) for a in ("_fetch_min_bytes", "_fetch_max_wait_ms")):
        raise RuntimeError(f"aiokafka {aiokafka.__version__}: the adaptive fetch window needs Fetcher."
                           f"_fetch_min_bytes/_fetch_max_wait_ms as in {CHECKED_AIOKAFKA} (requirements.lock)")


class AdaptiveFetch:
    """A started aiokafka consumer's fetch window, adapted after every poll (`polled(records, now)`)."""

    def __init__(self, consumer, window: FetchWindow) -> None:
        check_fetcher(consumer)
        self._fetcher = consumer._fetcher
        self.window = window
        self._apply(window.window)

    def polled(self, records: int, now: float) -> None:
        w = self.window.observe(records, now)
        if w.max_wait_ms != self._fetcher._fetch_max_wait_ms or w.min_bytes != self._fetcher._fetch_min_bytes:
            self._apply(w)

    def polled_batches(self, batches: Mapping | None) -> None:
        """`polled` with what a getmany returned (partition -> records), at the current time."""
        self.polled(sum(map(len, batches.values())) if batches else 0, time.monotonic())

    def health(self) -> dict:
        """For /readyz: the mode of the next fetch, the observed rate, how often the mode changed."""
        w = self.window
        return {"fetch_busy": w.window.busy, "fetch_rate": round(w.rate, 1), "fetch_switches": w.switches}

    def _apply(self, w: Window) -> None:
        self._fetcher._fetch_min_bytes = w.min_bytes
        self._fetcher._fetch_max_wait_ms = w.max_wait_ms


def check_producer(producer) -> None:
    """The aiokafka internals AdaptiveLinger writes exist: MessageAccumulator._linger_time (in seconds, read
    when a partition's next batch is opened), its batches per partition (`_batches`: deques of MessageBatch,
    each with its own `_linger_time` and `record_count`) and the sender's wake-up (`_waiter_future`)."""
    acc = getattr(producer, "_message_accumulator", None)
    if not aiokafka.__version__.startswith(CHECKED_AIOKAFKA) or acc is None or not isinstance(
            getattr(acc, "_linger_time", None), (int, float)) or not isinstance(
            getattr(acc, "_batches", None), Mapping) or not hasattr(acc, "_waiter_future"):
        raise RuntimeError(f"aiokafka {aiokafka.__version__}: the adaptive linger needs MessageAccumulator."
                           f"_linger_time, _batches and _waiter_future as in {CHECKED_AIOKAFKA} (requirements.lock)")


class AdaptiveLinger:
    """A producer's linger adapted to the rate it is handed records at, with FetchWindow's rate and
    hysteresis: quiet, a record waits at most the producer's own linger for company (make_producer's 1 ms:
    the latency floor is untouched); busy (from `enter_rate` records a second, until under `leave_rate`,
    whatever `busy_ms` is: the window's length does not move the rates it is paid at), a batch lingers
    `busy_ms`, so one produce
    request carries what arrived in that window and its fixed cost (aiokafka's sender task and response
    handling, Kafka's request handling and request metrics) is paid once per window instead of once per
    one to three records. Call `sending(now)` before each `send` of the records the rate is about.

    The rate is observed at most once per `observe_every_s` (1 ms): records handed over meanwhile are
    counted into the next observation, so at load the EWMA costs once per millisecond, not once per
    record (the same rate: an observation of n records over t is the n single ones summed, to first order
    in t / tau). The mode can so switch up to that much later.

    The busy mode lapses with time, not only with the next record: while busy, a timer observes again
    every `busy_ms` (what arrived meanwhile, often nothing), so once the load stops the producer is back to
    its short linger within a few windows. Without it the last mode stayed until the next counted record,
    and every other record of the producer (a connector's session requests, subscription marks,
    subscriptions: the CONNACK and SUBACK path) lingered the whole window after a burst had ended: a
    persistent reconnect after a backlog was stored took 55 ms to its CONNACK instead of 20
    (docs/performance.md, "The forty-fourth round"). `clock` and `call_later` are injectable (tests);
    by default the monotonic clock and the running event loop's `call_later`."""

    def __init__(self, producer, *, busy_ms: float, observe_every_s: float = 0.001,
                 enter_rate: float = LINGER_ENTER_RATE, leave_rate: float = LINGER_LEAVE_RATE,
                 clock: Callable[[], float] = time.monotonic,
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        check_producer(producer)
        self._acc = producer._message_accumulator
        busy_s = busy_ms / 1000
        self.window = FetchWindow(max_wait_s=busy_s, enter_records=enter_rate * busy_s,
                                  leave_records=leave_rate * busy_s)
        self._busy_s, self._quiet_s = busy_ms / 1000, self._acc._linger_time
        self._every = observe_every_s
        self._next = -math.inf  # monotonic time of the next observation
        self._pending = 0       # records handed over since the last observation
        self._clock = clock
        self._call_later = call_later
        self._timer = None      # the lapse check, armed while busy

    def sending(self, now: float, records: int = 1) -> None:
        pending = self._pending + records
        if now < self._next:
            self._pending = pending
            return
        self._pending = 0
        self._observe(pending, now)

    def _observe(self, records: int, now: float) -> None:
        self._next = now + self._every
        busy = self.window.observe(records, now).busy
        linger = self._busy_s if busy else self._quiet_s
        if linger != self._acc._linger_time:
            self._acc._linger_time = linger
        if busy and self._timer is None and self._busy_s > 0:
            later = self._call_later or asyncio.get_running_loop().call_later
            self._timer = later(self._busy_s, self._lapse)

    def _lapse(self) -> None:
        """A busy window went by: observe what arrived in it (class docstring)."""
        self._timer = None
        pending, self._pending = self._pending, 0
        self._observe(pending, self._clock())

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """Around the `send`s of records someone waits on (a session request, a subscription set, marks):
        they do not wait out the busy window. A batch they open gets the short linger, and a lingering
        batch of PUBLISHes they joined leaves after the short linger too (the sender is woken to see it).
        Records other tasks send meanwhile, if a send waits (metadata, a full batch), get the same."""
        acc = self._acc
        quiet = self._quiet_s
        before = {tp: (q[-1], q[-1].record_count) for tp, q in acc._batches.items() if q}
        acc._linger_time = quiet
        try:
            yield
        finally:
            acc._linger_time = self._busy_s if self.window.window.busy else quiet
            hurried = False
            for tp, (batch, count) in before.items():
                if batch._linger_time > quiet and batch in acc._batches.get(tp, ()) \
                        and batch.record_count > count:
                    batch._linger_time = quiet
                    hurried = True
            if hurried and not acc._waiter_future.done():
                acc._waiter_future.set_result(None)

    def close(self) -> None:
        """Cancel the lapse check (the producer is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def health(self) -> dict:
        """For /readyz: whether batches linger long now, the observed rate, how often the mode changed."""
        w = self.window
        return {"linger_busy": w.window.busy, "send_rate": round(w.rate, 1), "linger_switches": w.switches}


def adaptive_fetch(consumer, window_ms: float) -> AdaptiveFetch | None:
    """The adaptive fetch window of a started consumer (a service's `<PREFIX>_FETCH_WINDOW_MS`), or None
    when the setting is 0 (fetches always return at once)."""
    if window_ms <= 0:
        return None
    return AdaptiveFetch(consumer, FetchWindow(max_wait_s=window_ms / 1000))


__all__ = ["AdaptiveFetch", "AdaptiveLinger", "FetchWindow", "Window", "adaptive_fetch", "check_fetcher",
           "check_producer"]
