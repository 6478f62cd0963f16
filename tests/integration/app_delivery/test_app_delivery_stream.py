"""app-delivery against a real Kafka, with a fake connector: order, flow control, acknowledged prefix,
redelivery with DUP, takeover, expiry. Every test runs twice: as a current connector (batches down,
AppAckBatch up) and as an older one (one AppRecord / AppAck per message)."""

from __future__ import annotations

import asyncio
import time

import pytest
from app_delivery_harness import committed_up_to, payload_ints, publish_msg
from tbmq_routing.expiry import forwarded_interval
from waits import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(params=["batches", "single records"])
def connector(request, connector):
    connector.batches = request.param == "batches"
    return connector


def cid(unique) -> str:
    return unique("c").replace("-", "")[:60]  # [A-Za-z0-9]+: plain topic name


async def test_in_order_partial_ack_reopen_redelivers_with_dup(ad_suite, connector, producer, unique):
    client = cid(unique)
    await producer.to_client(client, [publish_msg(i) for i in range(20)])
    st = connector.open(client, receive_maximum=100)
    got = await st.take(20)
    assert payload_ints(got) == list(range(20))
    assert [r.ref.offset for r in got] == list(range(20))
    assert not any(r.redelivery for r in got)
    st.ack_many(got[:10])
    st.ack(got[15])  # out of order: the commit must stay at 10
    await st.half_close()

    st2 = connector.open(client, receive_maximum=100)
    again = await st2.take(10)
    assert payload_ints(again) == list(range(10, 20))
    assert all(r.redelivery for r in again), "records streamed before must carry DUP"
    st2.ack_many(again)
    await producer.to_client(client, [publish_msg(i) for i in range(20, 25)])
    fresh = await st2.take(5)
    assert payload_ints(fresh) == list(range(20, 25))
    assert not any(r.redelivery for r in fresh)
    st2.ack_many(fresh)
    # acks in flight when the stream drops are lost: wait until app-delivery has them (committed past 24)
    await wait_until(committed_up_to(ad_suite, client, 25), 20, "offset 25 committed (every ack arrived)")
    await st2.cancel()  # an abrupt end keeps the acknowledged prefix

    st3 = connector.open(client, receive_maximum=100)
    # everything was acknowledged: the first record of the new stream is the next one produced (a
    # redelivered record would come before it)
    await producer.to_client(client, [publish_msg(25)])
    last = await st3.take(1)
    assert payload_ints(last) == [25] and not last[0].redelivery


async def test_a_routers_replay_is_streamed_once_within_a_stream_and_across_streams(ad_suite, connector, producer,
                                                                                  unique):
    """A router that crashed writes the copies of its uncommitted tbmq.msg.all records again: each copy
    names its origin, and app-delivery streams one per origin (tbmq_routing.origins), in one stream and in
    the next one (the origins below the committed offset ride in its metadata)."""
    client = cid(unique)

    def copy(i: int) -> object:  # message i, routed from tbmq.msg.all partition 4 at offset 100 + i
        return publish_msg(i, qos=2, origin_partition=4, origin_offset=100 + i)

    # 0..9, the replay of 5..9, then 10
    await producer.to_client(client, [copy(i) for i in range(10)] + [copy(i) for i in range(5, 10)] + [copy(10)])
    st = connector.open(client, receive_maximum=100)
    got = await st.take(11)
    assert payload_ints(got) == list(range(11)), "a replayed copy was streamed again"
    st.ack_many(got)
    await wait_until(committed_up_to(ad_suite, client, 16), 20, "offset 16 committed (every ack arrived)")
    await st.cancel()

    # another replay, of copies taken by the stream before: the next stream skips them and starts at 11
    await producer.to_client(client, [copy(i) for i in range(7, 11)] + [copy(11)])
    st2 = connector.open(client, receive_maximum=100)
    nxt = await st2.take(1)
    assert payload_ints(nxt) == [11] and not nxt[0].redelivery


async def test_receive_maximum_limits_outstanding(connector, producer, unique):
    client = cid(unique)
    await producer.to_client(client, [publish_msg(i) for i in range(30)])
    st = connector.open(client, receive_maximum=5)
    first = await st.take(5)
    assert payload_ints(first) == [0, 1, 2, 3, 4]
    await st.nothing_for(1.0, "no more than receive_maximum outstanding")
    st.ack(first[3])  # any ack frees one slot
    st.ack(first[0])
    more = await st.take(2)
    assert payload_ints(more) == [5, 6]
    await st.nothing_for(0.5, "no more than the window outstanding")
    st.ack_many(first + more)
    rest = await st.take(5)
    assert payload_ints(rest) == [7, 8, 9, 10, 11]
    await st.cancel()


async def test_window_of_one_streams_one_record_at_a_time(connector, producer, unique):
    client = cid(unique)
    await producer.to_client(client, [publish_msg(i) for i in range(4)])
    st = connector.open(client, receive_maximum=1)
    for i in range(4):
        got = await st.take(1)
        assert payload_ints(got) == [i]
        await st.nothing_for(0.3, "a window of 1: nothing more before the ack")
        st.ack_many(got)
    assert st.sizes == [1, 1, 1, 1]
    assert st.kinds == ({"batch"} if connector.batches else {"record"})
    await st.cancel()


async def test_window_smaller_than_a_poll_is_never_exceeded(connector, producer, unique):
    client = cid(unique)
    await producer.to_client(client, [publish_msg(i) for i in range(300)])  # one poll (max 500)
    st = connector.open(client, receive_maximum=64)
    first = await st.take(64)
    assert payload_ints(first) == list(range(64))
    await st.nothing_for(1.0, "no more than the window outstanding")
    st.ack_many(first[:10])
    more = await st.take(10)
    assert payload_ints(more) == list(range(64, 74))
    await st.nothing_for(0.5, "no more than the window outstanding")
    st.auto_ack = True
    st.ack_many(first[10:] + more)
    rest = await st.take(300 - 74)
    assert payload_ints(rest) == list(range(74, 300))
    assert max(st.sizes) <= 64
    if connector.batches:
        assert st.kinds == {"batch"} and st.sizes[0] > 1, "the backlog goes down in batches"
    else:
        assert st.kinds == {"record"} and set(st.sizes) == {1}
    await st.cancel()


async def test_takeover_closes_the_first_stream_after_committing(ad_suite, connector, producer, unique):
    client = cid(unique)
    await producer.to_client(client, [publish_msg(i) for i in range(10)])
    st = connector.open(client, receive_maximum=100, session_id="one")
    got = await st.take(10)
    for r in got[:4]:
        st.ack(r)
    await wait_until(committed_up_to(ad_suite, client, 4), 20, "the acks committed before the takeover")
    st2 = connector.open(client, receive_maximum=100, session_id="two")
    await asyncio.wait_for(st.ended.wait(), 10)
    again = await st2.take(6)
    assert payload_ints(again) == list(range(4, 10))
    assert all(r.redelivery for r in again)
    await st2.cancel()


async def test_expired_messages_are_dropped_and_the_interval_is_left_to_the_connector(connector, producer, unique):
    """An expired record is dropped (and counts as done); a live one is streamed as received: the connector
    subtracts the wait when it sends (tbmq_routing.expiry), so app-delivery must not subtract it too."""
    client = cid(unique)
    now = int(time.time() * 1000)
    await producer.to_client(client, [
        publish_msg(0, message_expiry_interval=5, created_at_ms=now - 10_000),   # expired
        publish_msg(1, message_expiry_interval=100, created_at_ms=now - 30_500),  # 69.5 s left
        publish_msg(2),
    ])
    st = connector.open(client, receive_maximum=10)
    got = await st.take(2)
    assert payload_ints(got) == [1, 2]
    assert got[0].msg.message_expiry_interval == 100 and got[0].msg.created_at_ms == now - 30_500
    assert forwarded_interval(got[0].msg.created_at_ms, got[0].msg.message_expiry_interval, now) == 70
    assert not got[1].msg.HasField("message_expiry_interval")
    for r in got:
        st.ack(r)
    await st.half_close()
    st2 = connector.open(client, receive_maximum=10)
    # the expired record counts as done (the commit passed it): the new stream's first record is the next
    # one produced, nothing before it
    await producer.to_client(client, [publish_msg(3)])
    nxt = await st2.take(1)
    assert payload_ints(nxt) == [3] and not nxt[0].redelivery
    await st2.cancel()


async def test_non_alphanumeric_client_id_uses_the_hashed_topic(connector, producer, unique):
    client = unique("client-with/odd:chars")
    await producer.to_client(client, [publish_msg(i) for i in range(3)])
    st = connector.open(client, receive_maximum=10, auto_ack=True)
    got = await st.take(3)
    assert payload_ints(got) == [0, 1, 2]
    assert got[0].ref.topic.startswith("tbmq.msg.app.h-") and len(got[0].ref.topic) == len("tbmq.msg.app.h-") + 64
    await st.cancel()
