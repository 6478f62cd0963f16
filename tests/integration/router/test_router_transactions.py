"""The router reads tbmq.msg.all read_committed (router.app._ReadCommitted): the session registry publishes
Wills there inside its transactions, and a record of an aborted transaction must not be routed. Real Kafka,
a real router instance, a real transactional producer."""

from __future__ import annotations

import pytest

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.kafka import make_producer

from router_harness import TopicReader, downlinks, hexid, sub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def publish_msg(topic: str, payload: bytes) -> bytes:
    return pb.PublishMsg(publisher_id="registry-will", topic=topic, payload=payload, qos=1,
                         publisher_mqtt_version=5).SerializeToString()


async def test_an_aborted_transactions_record_is_not_routed(kafka, writer, start_routers):
    P = hexid()
    conn, client, topic = f"conn{P}", f"dev{P}", f"{P}/will"
    await writer.session(client, service_id=conn)
    await writer.subscriptions(client, sub(topic, 1))
    await start_routers(1)

    tx = make_producer(kafka.bootstrap_servers, client_id=f"it-tx-{P}", transactional_id=f"it-tx-{P}")
    await tx.start()
    try:
        await tx.begin_transaction()
        await (await tx.send(topics.MSG_ALL, publish_msg(topic, b"aborted"), key=topic.encode()))  # in the log
        await tx.abort_transaction()
        async with tx.transaction():
            await tx.send(topics.MSG_ALL, publish_msg(topic, b"committed"), key=topic.encode())
    finally:
        await tx.stop()
    await writer.publish(topic, b"plain")  # a connector's record (no transaction), after both

    reader = TopicReader(kafka.bootstrap_servers, topics.downlink_basic_topic(conn))
    try:
        # same key, same partition: once the later records are routed, the aborted one (before them) had
        # its turn
        records = await reader.poll_until(
            lambda rs: {b"committed", b"plain"} <= {d.msg.payload for d in downlinks(rs)})
    finally:
        await reader.stop()
    payloads = [d.msg.payload for d in downlinks(records)]
    assert b"aborted" not in payloads, payloads
    assert payloads.index(b"committed") < payloads.index(b"plain")
