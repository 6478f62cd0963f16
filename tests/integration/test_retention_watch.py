"""tbmq_platform.retention.RetentionWatch on the real Kafka broker: a group behind by more than the warning
fraction of the topic's retention.ms is reported (clock moved ahead, no waiting), records deleted before the
group consumed them are counted once, and a group that caught up is clear again."""

from __future__ import annotations

import time

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from tbmq_platform import topics as catalogue
from tbmq_platform.kafka import ensure_topics, make_consumer, make_producer
from tbmq_platform.retention import LOST, NEAR, OK, RetentionWatch

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


async def test_watch_reports_near_then_lost_then_clear(kafka, unique):
    bs = kafka.bootstrap_servers
    topic, group = unique("rw"), unique("rw-group")
    await ensure_topics(bs, [catalogue.TopicSpec(topic, "k", "bytes", 1, "test", "test", retention_ms=HOUR_MS)])
    tp = TopicPartition(topic, 0)
    p = make_producer(bs, client_id=unique("p"))
    await p.start()
    try:
        for i in range(10):
            await p.send_and_wait(topic, key=b"k", value=b"v%d" % i)
    finally:
        await p.stop()
    c = make_consumer(bs, group_id=group, client_id=unique("c"))
    await c.start()
    try:
        c.assign([tp])
        await c.commit({tp: 2})  # consumed 2 of 10
        clock = {"now": time.time()}
        watch = RetentionWatch(bs, group, lambda: [topic], warn_fraction=0.8, clock=lambda: clock["now"])
        await watch.start()
        try:
            # fresh records, retention 1 h: nothing to say
            [f] = await watch.check()
            assert (f.state, f.unconsumed) == (OK, 8)
            assert watch.stats["retention_near_partitions"] == 0
            # 50 minutes later (> 0.8 h): the 8 unconsumed records are near deletion
            clock["now"] += 50 * 60
            [f] = await watch.check()
            assert (f.state, f.unconsumed) == (NEAR, 8)
            assert watch.stats["retention_near_partitions"] == 1
            # the log start moves past the committed offset (what retention does): 3 records lost, once
            admin = AIOKafkaAdminClient(bootstrap_servers=bs)
            await admin.start()
            try:
                await admin.delete_records({tp: RecordsToDelete(before_offset=5)})
            finally:
                await admin.close()
            [f] = await watch.check()
            assert (f.state, f.lost, f.unconsumed) == (LOST, 3, 8)
            [f] = await watch.check()
            assert f.state == LOST and watch.stats["retention_lost_records"] == 3
            # the group catches up: clear
            await c.commit({tp: 10})
            [f] = await watch.check()
            assert (f.state, f.unconsumed) == (OK, 0)
            assert watch.stats["retention_near_partitions"] == 0
        finally:
            await watch.stop()
    finally:
        await c.stop()
