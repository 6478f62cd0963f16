"""app-delivery crash (SIGKILL) mid-stream, backlog drain rate, tbmq.sys.app.removed."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from app_delivery.tracking import decode_mark
from app_delivery_harness import committed_up_to, payload_ints, publish_msg
from kafka_views import committed, committed_metadata
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_routing.naming import app_client_group
from waits import wait_until

REMOVED_GROUP = "app-delivery"  # APP_DELIVERY_REMOVED_GROUP, its default

pytestmark = pytest.mark.integration


def cid(unique) -> str:
    return unique("c").replace("-", "")[:60]


async def test_sigkill_mid_stream_loses_nothing_and_flags_dup(ad_suite, connector, producer, unique):
    client = cid(unique)
    n = 3000
    await producer.to_client(client, [publish_msg(i) for i in range(n)])
    st = connector.open(client, receive_maximum=500)  # > the ~215 left unacknowledged below
    acked: set[int] = set()
    seen_before: set[int] = set()
    # ack everything but every 7th record, until ~1500 records were streamed
    while len(seen_before) < 1500:
        for r in await st.take(1):
            i = int(r.msg.payload)
            seen_before.add(i)
            if i % 7:
                st.ack(r)
                acked.add(i)
    await ad_suite.kill_service("app-delivery")
    await asyncio.wait_for(st.ended.wait(), 10)
    await ad_suite.start_service("app-delivery")
    from app_delivery_harness import FakeConnector
    c2 = FakeConnector(ad_suite.grpc_target("app-delivery"))
    try:
        st2 = c2.open(client, receive_maximum=200, auto_ack=True)
        # everything not acknowledged comes again; at least every unacked one
        await wait_until(lambda: set(payload_ints(st2.all)) | acked >= set(range(n)), timeout=60,
                       what="all records delivered after the restart")
        after = st2.all
        offsets = [r.ref.offset for r in after]
        assert offsets == sorted(offsets), "redelivered in order"
        for r in after:
            i = int(r.msg.payload)
            if i in seen_before:
                assert r.redelivery, f"record {i} was streamed before the crash but comes without DUP"
        assert not (set(payload_ints(after)) & {i for i in acked if i < min(payload_ints(after))})
    finally:
        await c2.close()


async def test_a_restart_streams_at_once_while_its_removal_group_waits_out_a_dead_member(ad_suite, producer,
                                                                                          unique):
    """After a kill -9 the tbmq.sys.app.removed group waits for the dead member's session before it assigns
    the partition again; app-delivery's streams (the delivery path) do not wait for that group. A static
    member with a 60 s session stands in for the dead one here: the restarted instance is ready and streams
    while its removal consumer has still not joined, and joins once that member is taken out."""
    from app_delivery_harness import FakeConnector
    from tbmq_launcher.services import readyz
    from tbmq_platform.kafka import make_consumer, remove_static_members

    bootstrap = ad_suite.bootstrap_servers
    ghost = make_consumer(bootstrap, topics.SYS_APP_REMOVED, group_id=REMOVED_GROUP, client_id="ghost-1",
                          group_instance_id="ghost-1", session_timeout_ms=60000, heartbeat_interval_ms=3000,
                          rebalance_timeout_ms=70000, request_timeout_ms=80000)
    await ghost.start()  # returns once it joined: the group now has two members
    await ghost.stop()   # a static member: no LeaveGroup, it holds its place for 60 s
    await ad_suite.kill_service("app-delivery")
    await ad_suite.start_service("app-delivery")
    port = ad_suite.health_port("app-delivery")
    c = FakeConnector(ad_suite.grpc_target("app-delivery"))
    try:
        client = cid(unique)
        await producer.to_client(client, [publish_msg(i) for i in range(3)])
        st = c.open(client, receive_maximum=10, auto_ack=True)
        await wait_until(lambda: len(st.all) >= 3, 20, "the three records streamed after the restart")
        assert payload_ints(st.all) == [0, 1, 2]
        assert (await readyz(port))["removal_joined"] is False, "the ghost's session cannot have ended yet"
        assert await remove_static_members(bootstrap, REMOVED_GROUP, ["ghost-1"]) == ["ghost-1"]

        async def joined() -> bool:
            return (await readyz(port))["removal_joined"]

        await wait_until(joined, 30, "the removal consumer joined once the ghost was taken out")
    finally:
        await c.close()


async def _committed_mark(bootstrap: str, group: str) -> int | None:
    """The DUP mark in `group`'s committed metadata (None: nothing committed)."""
    om = next(iter((await committed_metadata(bootstrap, group)).values()), None)
    return None if om is None else decode_mark(om.metadata)


async def test_the_dup_mark_is_reserved_ahead_and_an_ended_stream_writes_the_exact_mark(ad_suite, connector,
                                                                                       producer, unique):
    """One offset commit reserves the DUP mark APP_DELIVERY_MAX_POLL_RECORDS (500) past a polled batch, so the
    next polls are streamed without one; a stream that ends writes back the mark of what it streamed, so
    the next stream sends newer records with DUP=0 (docs/app-delivery.md, "DUP")."""
    client = cid(unique)
    group = app_client_group(client)
    await producer.to_client(client, [publish_msg(i) for i in range(5)])
    st = connector.open(client, receive_maximum=100)
    first = await st.take(5)
    st.ack_many(first)
    assert await _committed_mark(ad_suite.bootstrap_servers, group) == 4 + 500  # committed before streaming
    for k in range(3):  # three more polls, one record each, under the reserved mark
        await producer.to_client(client, [publish_msg(5 + k)])
        more = await st.take(1)
        assert payload_ints(more) == [5 + k] and not more[0].redelivery
        st.ack_many(more)
    await wait_until(committed_up_to(ad_suite, client, 8), 20, "offset 8 committed (every ack arrived)")
    assert await _committed_mark(ad_suite.bootstrap_servers, group) == 504, "a poll under the mark reserved again"
    await st.half_close()

    async def exact_mark_written() -> bool:
        return await _committed_mark(ad_suite.bootstrap_servers, group) == 7

    await wait_until(exact_mark_written, 20, "the ended stream wrote back the exact mark (7)")
    st2 = connector.open(client, receive_maximum=100)
    await producer.to_client(client, [publish_msg(8)])
    nxt = await st2.take(1)
    assert payload_ints(nxt) == [8] and not nxt[0].redelivery, "a record never streamed came with DUP"
    await st2.cancel()


@pytest.mark.slow
async def test_backlog_of_50000_drains_in_order(ad_suite, connector, producer, unique):
    import psutil

    client = cid(unique)
    n = int(os.environ.get("APP_DELIVERY_DRAIN_N", "50000"))
    await producer.to_client(client, [publish_msg(i) for i in range(n)])
    proc = psutil.Process(ad_suite.instance("app-delivery").pid)
    cpu0 = proc.cpu_times()
    t0 = time.monotonic()
    st = connector.open(client, receive_maximum=1000, auto_ack=True)
    await wait_until(lambda: len(st.all) >= n, timeout=240, step=0.05, what=lambda: f"{n} records (got {len(st.all)})")
    dt = time.monotonic() - t0
    assert payload_ints(st.all) == list(range(n))
    rate = n / dt
    cpu1 = proc.cpu_times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(f"\nAPP-DELIVERY DRAIN: {n} records in {dt:.2f}s = {rate:,.0f} msg/s (receive_maximum 1000); "
          f"app-delivery CPU {cpu:.2f}s = {cpu / n * 1e6:.0f} us/record")
    await st.half_close()
    # everything acknowledged was committed: the new stream's first record is the next one produced (a
    # redelivered record would come before it)
    st2 = connector.open(client, receive_maximum=1000)
    await producer.to_client(client, [publish_msg(n)])
    nxt = await st2.take(1)
    assert payload_ints(nxt) == [n] and not nxt[0].redelivery
    await st2.cancel()


def removal_handled(suite, md):
    """A predicate for `waits.wait_until`: app-delivery committed its tbmq.sys.app.removed group past the
    record `md` (RecordMetadata): it handled the event (it commits after handling each poll's records)."""
    async def done() -> bool:
        tp = TopicPartition(md.topic, md.partition)
        return (await committed(suite.bootstrap_servers, REMOVED_GROUP)).get(tp, -1) > md.offset
    return done


async def _groups(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {g[0] if isinstance(g, tuple) else g.group_id for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()


async def _topics(bootstrap: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def test_app_removed_deletes_topic_and_group(ad_suite, connector, producer, unique):
    bootstrap = ad_suite.bootstrap_servers
    client = cid(unique)
    await producer.to_client(client, [publish_msg(i) for i in range(3)])
    st = connector.open(client, receive_maximum=10, auto_ack=True)
    await st.take(3)
    await wait_until(committed_up_to(ad_suite, client, 3), 20, "the three acks committed")
    # while the stream is open, a removal is skipped
    ev = pb.ApplicationRemovedEvent(client_id=client, topic=topics.app_topic_name(client),
                                    removed_at_ms=int(time.time() * 1000))
    md = await producer.p.send_and_wait(topics.SYS_APP_REMOVED, ev.SerializeToString(), key=client.encode())
    await wait_until(removal_handled(ad_suite, md), 30, "the removal event handled")
    assert topics.app_topic_name(client) in await _topics(bootstrap)
    await st.half_close()
    assert app_client_group(client) in await _groups(bootstrap)
    await producer.p.send_and_wait(topics.SYS_APP_REMOVED, ev.SerializeToString(), key=client.encode())

    async def gone():
        return topics.app_topic_name(client) not in await _topics(bootstrap) and \
            app_client_group(client) not in await _groups(bootstrap)

    await wait_until(gone, timeout=30, step=0.5, what="topic and group deleted")
    # idempotent: the same event again does no harm
    md = await producer.p.send_and_wait(topics.SYS_APP_REMOVED, ev.SerializeToString(), key=client.encode())
    await wait_until(removal_handled(ad_suite, md), 30, "the repeated removal event handled")
    assert ad_suite.instance("app-delivery").running
