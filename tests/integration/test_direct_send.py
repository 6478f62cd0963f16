"""tbmq_platform.kafka.DirectSend on the real Kafka of the test session: what it hands to the producer's
accumulator lands where and as aiokafka's own `send` puts it (same partition per key, value, key, headers,
order per key), a metadata update with more partitions moves keys as `send` does, and the records it
cannot take itself (unknown topic, no key, near the size limit, a transactional producer outside a
transaction) get `send`'s behaviour, its errors included."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.admin import NewPartitions
from aiokafka.errors import IllegalOperation, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from tbmq_platform import topics as catalogue
from tbmq_platform.kafka import DirectSend, ensure_topics, make_admin, make_consumer, make_producer
from waits import wait_until

pytestmark = pytest.mark.integration

HEADERS = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]


async def _topic(kafka, unique, partitions: int) -> str:
    topic = unique("ds")
    spec = catalogue.TopicSpec(topic, "k", "bytes", partitions, "test", "test")
    assert await ensure_topics(kafka.bootstrap_servers, [spec]) == [topic]
    return topic


async def _consume(kafka, unique, topic: str, count: int) -> list:
    consumer = make_consumer(kafka.bootstrap_servers, topic, group_id=unique("g"), client_id=unique("c"))
    await consumer.start()
    got: list = []
    try:
        async with asyncio.timeout(30):
            while len(got) < count:
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    got.extend(records)
    finally:
        await consumer.stop()
    return got


async def test_direct_records_land_as_sends_do(kafka, unique):
    producer = make_producer(kafka.bootstrap_servers, client_id=unique("p"))
    await producer.start()
    direct = DirectSend(producer)
    topic = await _topic(kafka, unique, 5)  # created after the producer's first metadata
    keys = [f"client-{i}".encode() for i in range(20)]
    try:
        # the first record: the metadata does not list the topic yet, `send` waits for it
        assert direct.partitions(topic) is None
        first = await (await direct(topic, b"v-first", keys[0], HEADERS))
        assert direct.partitions(topic) is not None
        futures = [(k, i, await direct(topic, f"v{i}".encode(), k, HEADERS)) for i in range(3) for k in keys]
        sent = [(k, (await producer.send(topic, b"by-send", key=k, headers=HEADERS))) for k in keys]
        metas = [(k, i, await f) for k, i, f in futures]
        by_send = {k: (await f).partition for k, f in sent}
    finally:
        await producer.stop()
    default = DefaultPartitioner()
    assert first.partition == default(keys[0], list(range(5)), [])
    for k, _i, meta in metas:
        assert meta.partition == by_send[k] == default(k, list(range(5)), [])
    assert len({m.partition for _k, _i, m in metas}) > 1  # the keys spread over the partitions

    got = await _consume(kafka, unique, topic, 1 + 3 * len(keys) + len(keys))
    direct_values = [(r.key, r.value) for r in got if r.value.startswith(b"v") and r.value != b"v-first"]
    for k in keys:  # per key, in the order handed over
        assert [v for key, v in direct_values if key == k] == [b"v0", b"v1", b"v2"]
    assert all(list(r.headers) == [("traceparent", HEADERS[0][1])] for r in got)


async def test_more_partitions_move_keys_as_send_moves_them(kafka, unique):
    topic = await _topic(kafka, unique, 2)
    producer = make_producer(kafka.bootstrap_servers, client_id=unique("p"))
    await producer.start()
    direct = DirectSend(producer)
    keys = [f"k{i}".encode() for i in range(30)]
    admin = make_admin(kafka.bootstrap_servers)
    await admin.start()
    try:
        before = [await (await direct(topic, b"x", k)) for k in keys]
        assert {m.partition for m in before} == {0, 1}
        await admin.create_partitions({topic: NewPartitions(total_count=6)})

        async def six_listed() -> bool:  # as the producer's periodic refresh would, once the broker lists them
            await producer.client.force_metadata_update()
            return len(producer.client.cluster.partitions_for_topic(topic) or ()) == 6
        # the broker's metadata cache may answer the first refresh before it has the new partitions
        await wait_until(six_listed, 30, "the producer's metadata listing the 6 partitions")
        after = [await (await direct(topic, b"x", k)) for k in keys]
        by_send = [await (await producer.send(topic, b"x", key=k)) for k in keys]
    finally:
        await admin.close()
        await producer.stop()
    default = DefaultPartitioner()
    assert [m.partition for m in after] == [m.partition for m in by_send] == \
        [default(k, list(range(6)), []) for k in keys]
    assert max(m.partition for m in after) >= 2


async def test_what_direct_send_leaves_to_send_gets_sends_behaviour(kafka, unique):
    topic = await _topic(kafka, unique, 3)
    producer = make_producer(kafka.bootstrap_servers, client_id=unique("p"), max_request_size=4096)
    await producer.start()
    direct = DirectSend(producer)
    try:
        await (await direct(topic, b"warm", b"k"))  # the metadata now lists the topic
        assert (await (await direct(topic, b"no key", None))).partition in {0, 1, 2}
        assert (await (await direct(topic, b"y" * 3500, b"k"))).offset >= 0  # under the bound: direct
        with pytest.raises(MessageSizeTooLargeError):
            await direct(topic, b"y" * 4096, b"k")  # near the limit: `send` measures it and refuses
    finally:
        await producer.stop()

    txn = make_producer(kafka.bootstrap_servers, client_id=unique("t"), transactional_id=unique("tx"))
    await txn.start()
    direct = DirectSend(txn)
    try:
        with pytest.raises(IllegalOperation):
            await direct(topic, b"outside", b"k")
        async with txn.transaction():
            fut = await direct(topic, b"inside", b"k")
        assert (await fut).partition == DefaultPartitioner()(b"k", [0, 1, 2], [])
    finally:
        await txn.stop()
