"""tbmq_platform.compacted on the real Kafka broker: several compacted topics followed on one consumer, rebuilt
from the beginning, read-your-writes with `wait_caught_up`, read_committed (aborted transactions never
applied, their markers do not stall a wait), and a wait that is not queued behind the view's parked fetch."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition
from tbmq_platform import topics as catalogue
from tbmq_platform.compacted import CompactedTopicView, CompactedViews
from tbmq_platform.kafka import ensure_topics, make_consumer, make_producer
from waits import poll

pytestmark = pytest.mark.integration


async def _topics(kafka, unique, n: int, partitions: int = 2) -> list[str]:
    names = [unique(f"cv{i}") for i in range(n)]
    await ensure_topics(kafka.bootstrap_servers,
                        [catalogue.TopicSpec(t, "k", "bytes", partitions, "test", "test") for t in names])
    return names


async def _producer(kafka, unique, transactional: bool = False):
    p = make_producer(kafka.bootstrap_servers, client_id=unique("p"),
                      transactional_id=unique("tx") if transactional else None)
    await p.start()
    return p


async def test_views_on_one_consumer_rebuild_then_follow_each_topic(kafka, unique):
    a, b = await _topics(kafka, unique, 2)
    p = await _producer(kafka, unique)
    try:
        for i in range(20):
            await p.send_and_wait(a, key=b"k%d" % (i % 5), value=b"a%d" % i)
        await p.send_and_wait(b, key=b"x", value=b"b0")
        await p.send_and_wait(b, key=b"x", value=None)  # a tombstone
        await p.send_and_wait(b, key=b"y", value=b"b1")
        table_a: dict = {}
        table_b: dict = {}
        views = CompactedViews(kafka.bootstrap_servers, client_id=unique("views"))
        va = views.view(a, lambda k, v: table_a.__setitem__(k, v))
        vb = views.view(b, lambda k, v: table_b.__setitem__(k, v) if v is not None else table_b.pop(k, None))
        await views.start()
        try:
            # start() returned: every record written before it is applied, per topic
            assert table_a == {b"k%d" % k: b"a%d" % (15 + k) for k in range(5)}
            assert table_b == {b"y": b"b1"}
            assert (va.records, vb.records) == (20, 3)
            with pytest.raises(RuntimeError):
                await va.start()  # its CompactedViews starts it
            # read-your-writes: a record acknowledged before wait_caught_up is applied when it returns
            for i in range(10):
                await p.send_and_wait(b, key=b"z", value=b"new%d" % i)
                await vb.wait_caught_up(timeout=10)
                assert table_b[b"z"] == b"new%d" % i
            await p.send_and_wait(a, key=b"k0", value=b"last")
            await views.wait_caught_up(timeout=10)
            assert table_a[b"k0"] == b"last"
        finally:
            await views.stop()
    finally:
        await p.stop()


async def test_a_view_since_a_time_skips_older_records_then_follows(kafka, unique):
    """`since_ms`: each partition is read from its first record timestamped at or after it (a partition with
    none from its end), start() still returns caught up, and later records are followed."""
    (t,) = await _topics(kafka, unique, 1, partitions=2)
    p = await _producer(kafka, unique)
    now = int(time.time() * 1000)
    try:
        for i in range(3):
            await p.send_and_wait(t, key=b"old0-%d" % i, value=b"o", partition=0, timestamp_ms=now - 600_000 + i)
            await p.send_and_wait(t, key=b"old1-%d" % i, value=b"o", partition=1, timestamp_ms=now - 600_000 + i)
        await p.send_and_wait(t, key=b"new0", value=b"n", partition=0, timestamp_ms=now - 1_000)
        seen: list = []
        views = CompactedViews(kafka.bootstrap_servers, client_id=unique("views"))
        v = views.view(t, lambda k, val: seen.append(k), since_ms=now - 300_000)
        await views.start()
        try:
            assert seen == [b"new0"] and v.records == 1
            await p.send_and_wait(t, key=b"later1", value=b"l", partition=1)
            await views.wait_caught_up(timeout=10)
            assert seen == [b"new0", b"later1"]
        finally:
            await views.stop()
        everything: list = []
        whole = CompactedTopicView(kafka.bootstrap_servers, t, lambda k, val: everything.append(k),
                                   client_id=unique("whole"))
        await whole.start()  # without since_ms: from the beginning
        await whole.stop()
        assert len(everything) == 8
    finally:
        await p.stop()


async def _lso(kafka, unique, tp: TopicPartition) -> int:
    c = make_consumer(kafka.bootstrap_servers, group_id=None, client_id=unique("lso"), read_committed=True)
    await c.start()
    try:
        return (await c.end_offsets([tp]))[tp]
    finally:
        await c.stop()


async def test_read_committed_view_skips_aborted_and_is_not_stalled_by_markers(kafka, unique):
    (t,) = await _topics(kafka, unique, 1, partitions=1)
    tp = TopicPartition(t, 0)
    applied: list = []
    view = CompactedTopicView(kafka.bootstrap_servers, t, lambda k, v: applied.append((k, v)),
                              client_id=unique("view"))
    await view.start()
    tx = await _producer(kafka, unique, transactional=True)
    try:
        # a transaction becomes visible to read_committed readers when its markers are written, a moment
        # after commit_transaction() returns: until then the wait's end (the last stable offset) is before it
        await tx.begin_transaction()
        await tx.send(t, key=b"k", value=b"committed")
        await tx.commit_transaction()
        async with asyncio.timeout(10):
            while not applied:
                await view.wait_caught_up(timeout=10)
        assert applied == [(b"k", b"committed")]
        # after the position: only an aborted transaction and its marker. No record reaches the view, yet a
        # wait must see the position pass them (no poll returns anything to wake it)
        await tx.begin_transaction()
        aborted = await (await tx.send(t, key=b"k", value=b"aborted"))
        await tx.abort_transaction()
        async with asyncio.timeout(10):
            while await _lso(kafka, unique, tp) < aborted.offset + 2:  # record + abort marker
                pass
        await view.wait_caught_up(timeout=10)
        assert applied == [(b"k", b"committed")]
        assert view.records == 1
    finally:
        await tx.stop()
        await view.stop()


async def test_wait_caught_up_is_not_queued_behind_the_parked_long_poll(kafka, unique):
    """The view's idle fetch parks at the broker for `idle_wait_ms` (here longer than the waits' bound);
    Kafka answers one request per connection at a time, so end offsets asked on that connection would wait
    for it. Each wait below must complete within its bound while the fetch is parked."""
    (t,) = await _topics(kafka, unique, 1, partitions=1)
    table: dict = {}
    view = CompactedTopicView(kafka.bootstrap_servers, t, lambda k, v: table.__setitem__(k, v),
                              client_id=unique("view"), idle_wait_ms=30_000)
    await view.start()
    p = await _producer(kafka, unique)
    try:
        for _ in range(3):
            await view.wait_caught_up(timeout=10)  # nothing new: only the end-offset round trip
        await p.send_and_wait(t, key=b"k", value=b"v")  # answers the parked fetch; a new one parks
        await view.wait_caught_up(timeout=10)
        assert table == {b"k": b"v"}
        await view.wait_caught_up(timeout=10)
    finally:
        await p.stop()
        await view.stop()


async def test_barrier_waits_for_records_appended_after_an_open_transaction(kafka, unique):
    """The barrier's mark is the high watermark: a plain record appended (and acknowledged) after an open
    transaction's first record is above the last stable offset until that transaction ends, so a wait on
    the LSO (wait_caught_up) returns without it; the barrier does not, and returns once it is applied."""
    (t,) = await _topics(kafka, unique, 1, partitions=1)
    applied: list = []
    views = CompactedViews(kafka.bootstrap_servers, client_id=unique("views"), idle_wait_ms=30_000)
    views.view(t, lambda k, v: applied.append((k, v)))
    await views.start()
    barrier = views.barrier([t])
    tx = await _producer(kafka, unique, transactional=True)
    p = await _producer(kafka, unique)
    try:
        await tx.begin_transaction()
        await (await tx.send(t, key=b"tx", value=b"in-tx"))
        await p.send_and_wait(t, key=b"plain", value=b"after")  # acknowledged: the "subscription record"
        await views.wait_caught_up(timeout=10)  # the LSO: before the transaction
        assert applied == []
        with pytest.raises(TimeoutError):  # bounded negative: it must not pass the open transaction
            await barrier.wait(timeout=1.0)
        assert applied == []
        await tx.commit_transaction()
        await barrier.wait(timeout=10)
        assert applied == [(b"tx", b"in-tx"), (b"plain", b"after")]
    finally:
        await tx.stop()
        await p.stop()
        await views.stop()


async def test_barrier_coalesces_and_never_answers_with_an_earlier_request(kafka, unique):
    (t,) = await _topics(kafka, unique, 1, partitions=2)
    table: dict = {}
    views = CompactedViews(kafka.bootstrap_servers, client_id=unique("views"), idle_wait_ms=30_000)
    views.view(t, lambda k, v: table.__setitem__(k, v))
    await views.start()
    barrier = views.barrier([t])
    p = await _producer(kafka, unique)
    try:
        # calls made before the request is sent share it; calls made once it is on its way share the next
        # one, sent when it returns
        first = [barrier.ends() for _ in range(20)]
        assert all(f is first[0] for f in first)
        assert await poll(lambda: barrier.requests == 1, 10)  # its task ran: the request is on its way
        second = [barrier.ends() for _ in range(20)]
        assert all(f is second[0] for f in second) and second[0] is not first[0]
        await asyncio.gather(first[0], second[0])
        assert barrier.requests == 2
        # read-your-writes through the barrier, with waits overlapping: every record acknowledged before a
        # wait was called is applied when that wait returns
        async def one(i: int) -> None:
            await p.send_and_wait(t, key=b"k%d" % i, value=b"v%d" % i)
            await barrier.wait(timeout=10)
            assert table[b"k%d" % i] == b"v%d" % i

        before = barrier.requests
        await asyncio.gather(*(one(i) for i in range(50)))
        assert barrier.requests - before <= 50
        # a caller that gives up does not cancel the answer others share
        shared = barrier.ends()
        with pytest.raises(TimeoutError):
            await barrier.wait(shared, timeout=0)
        await barrier.wait(shared, timeout=10)
    finally:
        await p.stop()
        await views.stop()


async def test_a_failing_fetch_is_retried_and_a_stalled_or_dead_follower_is_a_readiness_problem(kafka, unique):
    from tbmq_platform import compacted

    (a,) = await _topics(kafka, unique, 1)
    p = await _producer(kafka, unique)
    table: dict = {}
    views = CompactedViews(kafka.bootstrap_servers, client_id=unique("views"))
    va = views.view(a, lambda k, v: table.__setitem__(k, v))
    await views.start()
    try:
        assert views.problem() is None and va.problem() is None
        # fault injection: the consumer's next two fetches fail as a Kafka error would
        real_getmany, fails = views._consumer.getmany, [RuntimeError("fetch failed 1"), RuntimeError("fetch failed 2")]

        async def failing_getmany(*args, **kw):
            if fails:
                raise fails.pop(0)
            return await real_getmany(*args, **kw)

        views._consumer.getmany = failing_getmany
        await p.send_and_wait(a, key=b"k", value=b"wakes the parked fetch")
        assert await poll(lambda: views.follow_errors == 2, 20)  # the next two fetches failed
        await p.send_and_wait(a, key=b"k", value=b"after the failures")
        await va.wait_caught_up(timeout=20)  # the follower went on
        assert table[b"k"] == b"after the failures" and views.follow_errors == 2
        assert views.problem() is None  # a successful fetch since: healthy
        # failing for FOLLOW_UNHEALTHY_S in a row is a problem (the time is passed in, not waited for)
        views._failing_since = 100.0
        views._last_error = RuntimeError("broker gone")
        assert "failing for" in views.problem(now=100.0 + compacted.FOLLOW_UNHEALTHY_S)
        assert views.problem(now=100.0 + compacted.FOLLOW_UNHEALTHY_S - 1) is None
        views._failing_since = None
        # a follower task that ended is a problem at once
        views._task.cancel()
        await asyncio.gather(views._task, return_exceptions=True)
        assert "stopped" in views.problem()
    finally:
        await views.stop()
        await p.stop()
