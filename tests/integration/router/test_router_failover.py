"""Restart and failover of router instances on a real Kafka."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tbmq_platform import topics

from router_harness import TopicReader, downlinks, health, hexid, sub
from waits import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


async def test_restarted_router_rebuilds_state_before_routing(kafka, writer, start_routers):
    P = hexid()
    conn = f"conn{P}"
    suite = await start_routers(1)
    # written while the router is down: the message waits in tbmq.msg.all, and the subscription and
    # session it needs are only in the compacted topics
    assert await suite.stop_service("router", 1, signal.SIGTERM) == 0  # graceful exit
    await writer.session(f"late{P}", service_id=conn)
    await writer.subscriptions(f"late{P}", sub(f"{P}/late", 1, subscription_id=3))
    await writer.publish(f"{P}/late", b"waiting")
    await suite.start_service("router", 1)
    reader = TopicReader(kafka.bootstrap_servers, topics.downlink_basic_topic(conn))
    recs = await reader.poll_until(lambda rs: len(rs) >= 1)
    d = downlinks(recs)[0]
    assert d.msg.payload == b"waiting"
    assert [(r.client_id, list(r.subscription_ids)) for r in d.recipients] == [(f"late{P}", [3])]
    await reader.stop()


@pytest.mark.slow
async def test_sigkill_one_of_two_routers_loses_nothing(kafka, writer, start_routers):
    P = hexid()
    conn = f"conn{P}"
    await writer.session(f"k{P}", service_id=conn)
    await writer.subscriptions(f"k{P}", sub(f"{P}/kill/#", 0))
    suite = await start_routers(2)
    reader = TopicReader(kafka.bootstrap_servers, topics.downlink_basic_topic(conn))
    n = 3000
    expected = {b"%d" % i for i in range(n)}

    async def produce():
        for i in range(n):
            # 64 MQTT topics spread the keys over the partitions of tbmq.msg.all (both routers work)
            await writer.publish(f"{P}/kill/{i % 64}", b"%d" % i, qos=0, wait=(i % 50 == 0))
            if i % 50 == 0:
                await asyncio.sleep(0.01)  # pacing: the stream is still flowing when router 1 dies

    producing = asyncio.create_task(produce())
    # kill router 1 once part of the stream has been routed
    await reader.poll_until(lambda rs: len(rs) >= n // 4, timeout=60)
    # both instances have been routing (the partitions are split between them)
    for i in (1, 2):
        port = suite.health_port("router", i)

        async def routed_some(port=port) -> bool:
            return (await health(port)).get("routed", 0) > 0

        await wait_until(routed_some, 10, f"router {i} routing")
    code = await suite.kill_service("router", 1)
    assert code == -signal.SIGKILL
    await producing
    payloads: list[bytes] = []

    def all_there(records):
        payloads[:] = [d.msg.payload for d in downlinks(records)]
        return expected <= set(payloads)

    await reader.poll_until(all_there, timeout=120)
    duplicates = len(payloads) - len(set(payloads))
    print(f"\n{n} messages, {duplicates} routed twice after SIGKILL (at-least-once)")
    await reader.stop()
