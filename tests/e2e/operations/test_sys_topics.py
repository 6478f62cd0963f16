"""Issue 16, deliverable 4: $SYS topics as Mosquitto publishes them, cluster-wide (summed over every live
connector), retained, every MQTT_SYS_INTERVAL_S; `#` does not match them [MQTT-4.7.2-1]. paho-mqtt 3.1.1 and 5.0
clients on two connectors."""

from __future__ import annotations

import pytest
from mqtt_clients import Client, routed, run, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def latest(client: Client, topic: str) -> int | None:
    vals = [m.payload for m in client.messages_on(topic)]
    return int(vals[-1]) if vals else None


async def test_sys_topics_sum_every_connector_and_follow_the_traffic(make_suite, unique):
    # a Kafka of its own (as in test_metrics.py: no other suite's router in its group)
    suite = await make_suite(services=["session-registry", "router", "connector"], connectors=2, kafka=None,
                             redis_url="redis://127.0.0.1:1/0", topic_profile="single-node",
                             service_env={"connector": {"MQTT_SYS_INTERVAL_S": "0.5"}})
    one, two = suite.mqtt_ports
    u = unique("sys")
    everything = Client(u + "-all", v5=False)
    await run(everything.connect, one)
    await run(everything.subscribe, "#", 0)
    clients = [Client(f"{u}-c{i}", v5=bool(i % 2)) for i in range(3)]
    for i, c in enumerate(clients):
        await run(c.connect, (one, two)[i % 2])  # on both connectors
    sysw = Client(u + "-sys")
    await run(sysw.connect, two)
    await run(sysw.subscribe, "$SYS/broker/#", 0)
    await wait_until(lambda: (latest(sysw, "$SYS/broker/clients/connected") or 0) >= 5, 60,
                     "$SYS clients/connected counting the clients of both connectors")
    assert latest(sysw, "$SYS/broker/connectors/count") >= 2
    assert (latest(sysw, "$SYS/broker/subscriptions/count") or 0) >= 2
    assert any(m.payload.startswith(b"tbmq-py ") for m in sysw.messages_on("$SYS/broker/version"))
    before = latest(sysw, "$SYS/broker/messages/received") or 0
    await routed(clients[0], everything, f"{u}/t", 1)
    for i in range(10):
        await run(clients[1].publish, f"{u}/t", b"%d" % i, 1)
    await wait_until(lambda: (latest(sysw, "$SYS/broker/messages/received") or 0) >= before + 10, 60,
                     "$SYS messages/received to count the 10 PUBLISHes")
    # retained: a new subscriber gets the latest figures at once, on the other connector
    late = Client(u + "-late", v5=False)
    await run(late.connect, one)
    await run(late.subscribe, "$SYS/broker/clients/connected", 0)
    assert await run(late.wait, lambda: any(m.retain for m in late.messages_on("$SYS/broker/clients/connected")))
    # a "#" subscription never got a $SYS message [MQTT-4.7.2-1] (its own PUBLISHes came after many rounds)
    assert not [m for m in everything.messages if m.topic.startswith("$SYS")]
    for c in (*clients, sysw, late, everything):
        await run(c.close)
