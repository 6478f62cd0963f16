"""Follow compacted topics as tables: read them from the beginning (or from a time: `view(since_ms=)`), report ready at
their end, keep following.

Every instance of every service that needs the session map, the subscription set or the retained
messages reads the whole compacted topic itself (no consumer group: each instance gets every partition).

Guarantees:
- `wait_caught_up()` returns once every record that existed (was committed, for a read_committed view)
  when it was called has been applied. That is how a service knows its state is rebuilt before it
  serves, and how a service that just wrote a record (or read a response written in the same Kafka
  transaction as one) waits until its own view contains it.
- A read_committed view (the default) never applies a record of an aborted transaction.
- The follower never stops by itself: a failed fetch is retried with back-off; `problem()` reports a
  follower that ended or has failed for FOLLOW_UNHEALTHY_S, and every service puts it in its readiness.
- `barrier(topics).wait()` (the subscription barrier, docs/router.md) returns once every record APPENDED to
  `topics` before the call (up to the high watermark, whatever its transaction state: a record appended
  after an open transaction's first record is below the last stable offset only once that transaction
  ends) has been applied, or passed when its transaction aborted. Any record whose producer was
  acknowledged before the call is below that mark (acks=all: the leader acknowledges only what is below
  the high watermark). Callers ask it AFTER they hold something that was itself acknowledged later (a
  fetched tbmq.msg.all record), so the view then reflects every write that happened before that.
  Coalesced: at most one ListOffsets per barrier in flight; a call made while one is in flight is answered
  by the next one (sent when the current one returns), never by one sent before the call.

Cost (docs/performance.md, "Idle: one consumer for the views, long-polls"): `CompactedViews` follows every
compacted topic of a process on ONE consumer (one fetch per broker for all of them, instead of one per
topic) whose fetch long-polls for `idle_wait_ms` (it returns as soon as a record is there, so a long
wait adds no latency; it only sets how often an idle view asks). The end offsets `wait_caught_up` needs
are asked on a second, never-assigned consumer: Kafka answers a connection's requests one at a time,
so a ListOffsets sent on the fetching consumer's connection would wait behind its parked long-poll
(up to `idle_wait_ms`; this was the ~450 ms persistent-reconnect CONNACK of issue 13).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition

from .inflight import AfterCall
from .kafka import IDLE_FETCH_WAIT_MS, make_consumer, topic_partitions

log = logging.getLogger(__name__)

Apply = Callable[[bytes, bytes | None], None]

# A follower whose fetches fail retries with this back-off (doubling up to FOLLOW_RETRY_MAX_S); once it has
# failed for FOLLOW_UNHEALTHY_S in a row, `problem()` says so and the service's /readyz answers 503.
FOLLOW_RETRY_S = 0.1
FOLLOW_RETRY_MAX_S = 5.0
FOLLOW_UNHEALTHY_S = 10.0

# While a wait_caught_up is pending, positions are re-read this often besides after every applied poll: a
# fetch that only moved the position (a transaction marker, an aborted transaction's records) returns no
# records, so it wakes nobody. Never ticks when nobody waits.
RECHECK_S = 0.02


class CompactedViews:
    """Several compacted topics of one process followed on one consumer (see the module docstring).

    ``view(topic, apply)`` before ``start()``; ``start()`` returns once every view has caught up."""

    # read_committed by default: the session-registry writes sessions and subscription clears in Kafka
    # transactions, and a view must never apply a record of a transaction that was aborted.
    def __init__(self, bootstrap: str, *, client_id: str, read_committed: bool = True,
                 idle_wait_ms: int = IDLE_FETCH_WAIT_MS) -> None:
        self._bootstrap = bootstrap
        self._client_id = client_id
        self._read_committed = read_committed
        self._idle_wait_ms = idle_wait_ms
        self.views: dict[str, CompactedTopicView] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._offsets: AIOKafkaConsumer | None = None
        self._watermarks: AIOKafkaConsumer | None = None  # read_uncommitted: ListOffsets = high watermark
        self._partitions: dict[str, list[TopicPartition]] = {}
        self._progress = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self.started = False
        self.follow_errors = 0  # failed fetches (each retried)
        self._failing_since: float | None = None  # monotonic time of the first failure of the current run
        self._last_error: BaseException | None = None

    def view(self, topic: str, apply: Apply, since_ms: int | None = None) -> "CompactedTopicView":
        """Follow `topic`, calling `apply(key, value)` for each record in order (value None: a tombstone). With
        `since_ms` (Unix ms), from each partition's first record timestamped at or after it instead of from the
        beginning: a topic whose older records no longer matter (tbmq.security.login.bans) is not read whole
        at every start."""
        if self.started:
            raise RuntimeError("CompactedViews: views are added before start()")
        if topic in self.views:
            raise ValueError(f"{topic} is already followed")
        v = self.views[topic] = CompactedTopicView._of(self, topic, apply)
        v.since_ms = since_ms
        return v

    async def start(self) -> None:
        self.started = True
        self._consumer = make_consumer(self._bootstrap, group_id=None, client_id=self._client_id,
                                       read_committed=self._read_committed, long_poll=True,
                                       fetch_max_wait_ms=self._idle_wait_ms,
                                       consumer_timeout_ms=self._idle_wait_ms)
        # the same isolation: a read_committed view's end is the last stable offset
        self._offsets = make_consumer(self._bootstrap, group_id=None, client_id=f"{self._client_id}-offsets",
                                      read_committed=self._read_committed)
        # barriers need the high watermark (read_uncommitted ListOffsets); the same consumer when the views
        # are read_uncommitted anyway
        self._watermarks = self._offsets if not self._read_committed else make_consumer(
            self._bootstrap, group_id=None, client_id=f"{self._client_id}-hw", read_committed=False)
        await self._consumer.start()
        await self._offsets.start()
        if self._watermarks is not self._offsets:
            await self._watermarks.start()
        tps: list[TopicPartition] = []
        for topic in self.views:
            self._partitions[topic] = await topic_partitions(self._consumer, topic)
            tps.extend(self._partitions[topic])
            await topic_partitions(self._offsets, topic)  # its metadata knows the topic's leaders
            if self._watermarks is not self._offsets:
                await topic_partitions(self._watermarks, topic)
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        for v in self.views.values():
            if v.since_ms is not None:
                parts = self._partitions[v.topic]
                found = await self._offsets.offsets_for_times({tp: v.since_ms for tp in parts})
                for tp in parts:  # None: no record that recent, so from the end
                    if found.get(tp) is None:
                        await self._consumer.seek_to_end(tp)
                    else:
                        self._consumer.seek(tp, found[tp].offset)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"follow {','.join(self.views)}")
        await self.wait_caught_up()
        for v in self.views.values():
            log.info("%s: %d records applied", v.topic, v.records)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for c in {id(c): c for c in (self._consumer, self._offsets, self._watermarks)}.values():
            if c is not None:
                await c.stop()

    def problem(self, now: float | None = None) -> str | None:
        """Why these views cannot be trusted to be current (for readiness), or None: the follower task ended,
        or its fetches have failed for FOLLOW_UNHEALTHY_S in a row."""
        if self._task is None:
            return "not started" if not self.started else None
        if self._task.done():
            exc = None if self._task.cancelled() else self._task.exception()
            return f"follower of {', '.join(self.views)} stopped: {exc!r}"
        if self._failing_since is not None:
            failing = (time.monotonic() if now is None else now) - self._failing_since
            if failing >= FOLLOW_UNHEALTHY_S:
                return f"follower of {', '.join(self.views)} failing for {failing:.0f}s: {self._last_error!r}"
        return None

    def partitions(self, topics: Iterable[str] | None = None) -> list[TopicPartition]:
        return [tp for t in (self.views if topics is None else topics) for tp in self._partitions[t]]

    async def end_offsets(self, topics: Iterable[str] | None = None, *,
                          high_watermark: bool = False) -> dict[TopicPartition, int]:
        """The end offsets of `topics` (default: every view), asked now on the offsets connection: the last
        stable offsets for a read_committed view (what it can apply today), or with `high_watermark` the
        offset after the last appended record whatever its transaction state."""
        return await (self._watermarks if high_watermark else self._offsets).end_offsets(self.partitions(topics))

    async def wait_caught_up(self, topics: Iterable[str] | None = None, timeout: float = 60.0) -> None:
        """Wait until everything written to `topics` (default: every view) before this call is applied."""
        async with asyncio.timeout(timeout):
            await self.wait_applied(await self.end_offsets(topics))

    def barrier(self, topics: Iterable[str] | None = None) -> "Barrier":
        """A coalescing high-watermark barrier on `topics` (module docstring)."""
        return Barrier(self, self.partitions(topics))

    async def wait_applied(self, ends: Mapping[TopicPartition, int], timeout: float | None = None) -> None:
        """Wait until the view's position on every partition of `ends` is at least its offset: every record
        below it applied (or skipped: a transaction marker, an aborted record)."""
        async with asyncio.timeout(timeout):
            consumer = self._consumer

            async def done() -> bool:
                # positions move only when a poll's records are applied (the drain and the apply loop of
                # _run run without an await in between), or past records no view applies (markers)
                for tp, end in ends.items():
                    if await consumer.position(tp) < end:
                        return False
                return True

            if await done():  # the usual case: nothing new on these topics
                return
            async with self._progress:  # checked under the lock: a notify between check and wait is not lost
                while not await done():
                    try:
                        async with asyncio.timeout(RECHECK_S):
                            await self._progress.wait()
                    except TimeoutError:
                        pass

    async def _run(self) -> None:
        consumer = self._consumer
        views = self.views
        retry = FOLLOW_RETRY_S
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=self._idle_wait_ms, max_records=5000)
            except Exception as exc:  # Kafka unreachable, a broker restart: retry, never stop following
                self.follow_errors += 1
                self._last_error = exc
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                log.warning("%s: fetch failed (%r); retrying in %.1fs", ", ".join(views), exc, retry)
                await asyncio.sleep(retry)  # back-off
                retry = min(FOLLOW_RETRY_MAX_S, retry * 2)
                continue
            retry = FOLLOW_RETRY_S
            self._failing_since = None
            if not batches:
                continue
            for tp, records in batches.items():
                view = views[tp.topic]
                apply = view.apply
                for record in records:
                    try:
                        apply(record.key, record.value)
                    except Exception:  # a bad record must not stop the view; it is logged and skipped
                        log.exception("%s: cannot apply record at offset %d", tp.topic, record.offset)
                    view.records += 1
            async with self._progress:
                self._progress.notify_all()


class Barrier:
    """`CompactedViews.barrier(topics)`: "everything appended to these topics before now is applied", with
    the end offsets read by at most one ListOffsets in flight at a time (module docstring).

    ``ends()`` is synchronous, so a caller fixes the moment it stands for without yielding: the answer is
    that of a request sent after the call (`tbmq_platform.inflight.AfterCall`: a call made while one is in
    flight joins the next one). ``wait(ends)`` then waits for the view to apply up to them. One failed
    request fails the calls it answers; the next call sends a new one."""

    def __init__(self, views: CompactedViews, partitions: list[TopicPartition]) -> None:
        self._views = views
        self._after = AfterCall(lambda: views._watermarks.end_offsets(partitions))

    @property
    def requests(self) -> int:
        """ListOffsets sent (for /readyz and the tests)."""
        return self._after.requests

    def ends(self) -> asyncio.Future:
        """A future of the high watermarks read by a request sent after this call."""
        return self._after.after()

    async def wait(self, ends: asyncio.Future | None = None, timeout: float | None = None) -> None:
        """Wait until the view applied everything appended before `ends` was asked (default: now)."""
        async with asyncio.timeout(timeout):
            # shielded: a caller that gives up must not cancel the answer other callers share
            offsets = await asyncio.shield(self.ends() if ends is None else ends)
            await self._views.wait_applied(offsets)


class CompactedTopicView:
    """One followed compacted topic. Made by `CompactedViews.view()` (several topics on one consumer), or
    standalone, ``CompactedTopicView(bootstrap, topic, apply, client_id=...)``, with its own start/stop."""

    def __init__(self, bootstrap: str, topic: str, apply: Apply, *, client_id: str, read_committed: bool = True,
                 idle_wait_ms: int = IDLE_FETCH_WAIT_MS) -> None:
        views = CompactedViews(bootstrap, client_id=client_id, read_committed=read_committed,
                               idle_wait_ms=idle_wait_ms)
        self._init(topic, apply, views, own=True)
        views.views[topic] = self

    @classmethod
    def _of(cls, views: CompactedViews, topic: str, apply: Apply) -> "CompactedTopicView":
        view = cls.__new__(cls)
        view._init(topic, apply, views, own=False)
        return view

    def _init(self, topic: str, apply: Apply, views: CompactedViews, *, own: bool) -> None:
        self.topic = topic
        self.apply = apply
        self._views = views
        self._own = own
        self.records = 0
        self.since_ms: int | None = None

    async def start(self) -> None:
        if not self._own:
            raise RuntimeError(f"{self.topic}: started by its CompactedViews")
        await self._views.start()

    async def stop(self) -> None:
        if self._own:
            await self._views.stop()

    async def wait_caught_up(self, timeout: float = 60.0) -> None:
        """Wait until everything written to the topic before this call has been applied."""
        await self._views.wait_caught_up([self.topic], timeout)

    def problem(self) -> str | None:
        """Its follower's problem (CompactedViews.problem), or None."""
        return self._views.problem()


__all__ = ["Barrier", "CompactedTopicView", "CompactedViews"]
