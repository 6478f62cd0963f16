"""tbmq_platform.marks on the real Kafka broker: a round of subscription marks lands on every partition of the
topic after the change acknowledged before it, the calls made while a round is on its way share the next one,
and the router's reading of a record (tbmq_platform.marks.is_mark) tells a mark from a PUBLISH."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics as catalogue
from tbmq_platform.kafka import ensure_topics, make_consumer, make_producer
from tbmq_platform.marks import MarkWriter, is_mark
from waits import poll

pytestmark = pytest.mark.integration


async def _read_all(kafka, topic: str, partitions: int) -> dict[int, list]:
    """Every record of `topic`, per partition, up to its end."""
    c = make_consumer(kafka.bootstrap_servers, group_id=None, client_id="marks-reader")
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        ends = await c.end_offsets(tps)
        out: dict[int, list] = {p: [] for p in range(partitions)}
        async def behind() -> bool:
            return any([await c.position(tp) < ends[tp] for tp in tps])

        while await behind():
            for tp, recs in (await c.getmany(timeout_ms=1000)).items():
                out[tp.partition].extend(recs)
        return out
    finally:
        await c.stop()


async def test_a_round_marks_every_partition_after_what_was_acknowledged_before_it(kafka, unique):
    topic = unique("all")
    await ensure_topics(kafka.bootstrap_servers, [catalogue.TopicSpec(topic, "k", "bytes", 3, "test", "test")])
    p = make_producer(kafka.bootstrap_servers, client_id=unique("p"))
    await p.start()
    writer = MarkWriter(p, "conn-7", topic)
    try:
        publish = pb.PublishMsg(topic="a/b", qos=1, payload=b"x").SerializeToString()
        for part in range(3):  # a PUBLISH acknowledged on each partition before the mark
            await p.send_and_wait(topic, publish, key=b"a/b", partition=part)
        await writer.mark()
        assert writer.rounds == 1
        got = await _read_all(kafka, topic, 3)
        for part in range(3):
            assert [is_mark(r.value) for r in got[part]] == [False, True], part
            mark = got[part][1]
            assert mark.key == b"conn-7" and mark.value is None

        # 20 calls at once share one round; calls made once it is on its way share the next one
        first = [asyncio.ensure_future(writer.mark()) for _ in range(20)]
        assert await poll(lambda: writer.rounds == 2, 10)  # the round's task ran: its marks are on their way
        second = [asyncio.ensure_future(writer.mark()) for _ in range(20)]
        await asyncio.gather(*first, *second)
        assert writer.rounds == 3
        got = await _read_all(kafka, topic, 3)
        assert all(sum(is_mark(r.value) for r in got[part]) == 3 for part in range(3))
    finally:
        await p.stop()
