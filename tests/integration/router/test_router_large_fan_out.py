"""A fan-out too large for one Kafka record (issue 15, deliverable 3): 25,000 live subscribers of one topic on
one connector are ~1.3 MB of recipients, over the producer's 1 MB max.request.size. The router splits them
over several BasicDownlink records; every subscriber is in exactly one, and the router goes on routing (it
used to raise inside its pipeline: the batch never acknowledged, the partition's commits frozen)."""

from __future__ import annotations

import asyncio

import pytest
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics

from router_harness import TopicReader, downlinks, health, hexid, sub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

N = 25_000


async def test_a_fan_out_over_the_record_limit_reaches_every_subscriber_once(kafka, writer, start_routers):
    P = hexid()
    conn = f"connBig{P}"
    topic = f"{P}/big"
    sends = []
    for i in range(N):  # written without waiting for each acknowledgement, then all awaited
        cid = f"{P}-subscriber-{i:06d}"
        info = pb.SessionInfo(client_id=cid, service_id=conn, connected=True, client_type=pb.CLIENT_TYPE_DEVICE)
        cs = pb.ClientSubscriptions(client_id=cid, subscriptions=[sub(topic, 1)], client_type=pb.CLIENT_TYPE_DEVICE)
        sends.append(await writer.producer.send(topics.CLIENT_SESSION, info.SerializeToString(), key=cid.encode()))
        sends.append(await writer.producer.send(topics.CLIENT_SUBSCRIPTIONS, cs.SerializeToString(),
                                                key=cid.encode()))
    await asyncio.gather(*sends)
    await writer.session(f"{P}-small", service_id=conn)
    await writer.subscriptions(f"{P}-small", sub(f"{P}/small", 1))

    suite = await start_routers(1)
    await writer.publish(topic, b"b" * 1000)
    await writer.publish(f"{P}/small", b"after the big one")  # routed only if the router did not stall

    reader = TopicReader(kafka.bootstrap_servers, topics.downlink_basic_topic(conn))
    try:
        def complete(records) -> bool:  # the downlink's partitions are read at their own pace (one may still
            # be finding its leader): wait for the small message and for every recipient of the big one
            found = downlinks(records)
            return any(d.msg.payload == b"after the big one" for d in found) \
                and sum(len(d.recipients) for d in found if d.msg.topic == topic) >= N

        records = await reader.poll_until(complete, 120)
        big = [d for d in downlinks(records) if d.msg.topic == topic]
        assert len(big) > 1  # split
        assert all(len(r.value) < 1_000_000 for r in records)
        got = [r.client_id for d in big for r in d.recipients]
        assert len(got) == N and len(set(got)) == N  # every subscriber exactly once
        assert all(d.msg.payload == b"b" * 1000 for d in big)
        h = await health(suite.health_port("router", 1))
        assert h["ready"] is True and "not_ready" not in h
    finally:
        await reader.stop()
