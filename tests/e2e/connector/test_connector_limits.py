"""Issue 14, deliverable 6: the connector's limits with real clients (paho-mqtt 3.1.1 and 5.0, mosquitto_sub,
mosquitto_pub): topic length and levels, subscriptions per client, user properties, the retained quota,
connections per connector, the PUBLISH rate per client and per connector. Each reaction is the one MQTT gives
it; the other clients carry on."""

from __future__ import annotations

import subprocess

import pytest
from mqtt_clients import BOUND, Client, payloads, routed, run
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.services import readyz
from tbmq_mqtt import ReasonCode as RC

pytestmark = pytest.mark.e2e

ENV = {"MQTT_MAX_TOPIC_BYTES": "64", "MQTT_MAX_TOPIC_LEVELS": "4", "MQTT_MAX_SUBSCRIPTIONS_PER_CLIENT": "2",
       "MQTT_MAX_USER_PROPERTIES": "2", "MQTT_MAX_RETAINED_MESSAGES": "1", "MQTT_MAX_CONNECTIONS": "8",
       "MQTT_MAX_PUBLISH_RATE": "20"}


@pytest.fixture(scope="module")
async def lim(tmp_path_factory):
    # a Kafka of its own: the retained quota counts every retained message of the cluster, and the session's
    # shared Kafka holds other modules' ones
    s = Suite(services=["session-registry", "router", "connector"], ports="free", log_format="json",
              id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-limits"), redis_url="redis://127.0.0.1:1/0",
              topic_profile="single-node", service_env={"connector": ENV})
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


def codes(rcs) -> list[int]:
    return [getattr(rc, "value", rc) for rc in rcs]


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_topic_subscription_and_property_limits(lim, unique, v5):
    u = unique("l")
    c = Client(u, v5=v5)
    await run(c.connect, lim.mqtt_ports[0])
    fail = RC.TOPIC_FILTER_INVALID if v5 else 0x80
    quota = RC.QUOTA_EXCEEDED if v5 else 0x80
    got = await run(c.subscribe, [(f"{u}/a", 1), (f"{u}/a/b/c/d", 1), (f"{u}/b", 1), (f"{u}/c", 1)])
    assert codes(got) == [1, fail, 1, quota]  # 5 levels; the third subscription of the client
    # a PUBLISH on a topic over the limits: v5 PUBACK 0x90, 3.1.1 acknowledged and dropped
    info = await run(c.publish, f"{u}/" + "x" * 70, b"long", 1, check=False)
    assert await run(c.wait, lambda: info.mid in c.pubacks)
    assert c.pubacks[info.mid].value == (RC.TOPIC_NAME_INVALID if v5 else 0)
    if v5:
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("a", "1"), ("b", "2"), ("c", "3")]
        info = await run(c.publish, f"{u}/a", b"props", 1, properties=props, check=False)
        assert await run(c.wait, lambda: info.mid in c.pubacks)
        assert c.pubacks[info.mid].value == RC.QUOTA_EXCEEDED
    # the connection carries on: a message within the limits arrives
    await routed(c, c, f"{u}/a", 1)
    assert not [m for m in c.messages_on(f"{u}/a") if m.payload == b"props"]
    await run(c.close)


async def test_retained_quota_and_connections_per_connector(lim, unique):
    u = unique("r")
    c = Client(u)  # v5
    await run(c.connect, lim.mqtt_ports[0])
    first = await run(c.publish, f"{u}/r1", b"kept", 1, retain=True, check=False)
    assert await run(c.wait, lambda: first.mid in c.pubacks) and c.pubacks[first.mid].value == 0
    # the connector's retained view holds it once a SUBSCRIBE gets it back (the retained barrier)
    reader = Client(f"{u}-reader", v5=False)
    await run(reader.connect, lim.mqtt_ports[0])
    await run(reader.subscribe, f"{u}/r1", 0)
    assert await run(reader.wait, lambda: reader.messages_on(f"{u}/r1"))
    await run(reader.close)
    second = await run(c.publish, f"{u}/r2", b"over", 1, retain=True, check=False)  # a second retained topic
    assert await run(c.wait, lambda: second.mid in c.pubacks)
    assert c.pubacks[second.mid].value == RC.QUOTA_EXCEEDED
    clear = await run(c.publish, f"{u}/r1", b"", 1, retain=True, check=False)  # clearing always works
    assert await run(c.wait, lambda: clear.mid in c.pubacks) and c.pubacks[clear.mid].value == 0
    # connections: the connector holds at most 8; the ninth is closed before CONNECT (mosquitto_sub fails)
    others = [Client(f"{u}-{i}", v5=False) for i in range(7)]
    for o in others:
        await run(o.connect, lim.mqtt_ports[0])
    refused = await run(subprocess.run, ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(lim.mqtt_ports[0]),
                                         "-t", f"{u}/x", "-C", "1", "-W", "5"],
                        capture_output=True, text=True, timeout=BOUND)
    assert refused.returncode != 0
    await run(others[0].close)
    again = Client(f"{u}-again", v5=False)
    await run(again.connect, lim.mqtt_ports[0])  # room again once one left
    for x in (*others[1:], again, c):
        await run(x.close)


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_a_client_over_its_publish_rate_is_slowed_down_and_loses_nothing(lim, unique, v5):
    """MQTT_MAX_PUBLISH_RATE=20: 60 QoS 0 PUBLISHes sent at once all arrive, in order, but spread over about
    two seconds (40 beyond the burst at 20 a second; at once they arrive within milliseconds): the connector
    stopped reading from the client instead of dropping anything, and counted it."""
    u = unique("rate")
    sub, pub = Client(u + "-s", v5=v5), Client(u + "-p", v5=v5)
    for c in (sub, pub):
        await run(c.connect, lim.mqtt_ports[0])
    topic = f"{u}/t"
    await run(sub.subscribe, f"{u}/#", 0)
    await routed(pub, sub, f"{u}/probe", 0)  # the subscription is live (probes, within the burst)
    before = (await readyz(lim.instance("connector").health_port)).get("publish_throttled", 0)
    sent = [str(i).encode() for i in range(60)]
    for p in sent:
        await run(pub.publish, topic, p, 0)
    assert await run(sub.wait, lambda: len(payloads(sub, topic)) >= 60, BOUND)
    got = sub.messages_on(topic)
    assert [m.payload for m in got] == sent
    assert got[-1].timestamp - got[0].timestamp >= 1.0
    after = (await readyz(lim.instance("connector").health_port)).get("publish_throttled", 0)
    assert after - before >= 1
    for c in (sub, pub):
        await run(c.close)


@pytest.fixture(scope="module")
async def total(tmp_path_factory):
    """A connector whose clients may publish 40 PUBLISHes a second together (none has a rate of its own)."""
    s = Suite(services=["session-registry", "router", "connector"], ports="free", log_format="json",
              id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-total-rate"),
              redis_url="redis://127.0.0.1:1/0", topic_profile="single-node",
              service_env={"connector": {"MQTT_MAX_TOTAL_PUBLISH_RATE": "40"}})
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def test_clients_over_the_connectors_publish_rate_are_slowed_down_and_lose_nothing(total, unique):
    """MQTT_MAX_TOTAL_PUBLISH_RATE=40: paho 3.1.1, paho 5.0 and mosquitto_pub each send 40 QoS 0 PUBLISHes at
    once. Each alone is within the connector's burst; together they are 80 over it, so the 120 arrive over
    about two seconds (at once they arrive within milliseconds), every publisher's in its order, nothing
    dropped; the pauses are counted as the connector's rate, not a client's."""
    u = unique("total")
    port = total.mqtt_ports[0]
    health = total.instance("connector").health_port
    sub = Client(u + "-s", v5=True)
    pubs = [Client(u + "-p3", v5=False), Client(u + "-p5", v5=True)]
    for c in (sub, *pubs):
        await run(c.connect, port)
    await run(sub.subscribe, f"{u}/#", 0)
    await routed(pubs[0], sub, f"{u}/probe", 0)  # the subscription is live
    before = await readyz(health)
    sent = {f"{u}/{i}": [f"{i}-{n}".encode() for n in range(40)] for i in range(3)}
    lines = b"".join(p + b"\n" for p in sent[f"{u}/2"])
    mosquitto = subprocess.Popen(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-i", u + "-pm", "-q", "0",
                                  "-t", f"{u}/2", "-l"], stdin=subprocess.PIPE)
    for i, pub in enumerate(pubs):
        for p in sent[f"{u}/{i}"]:
            await run(pub.publish, f"{u}/{i}", p, 0)
    mosquitto.stdin.write(lines)
    mosquitto.stdin.close()
    assert await run(sub.wait, lambda: all(len(payloads(sub, t)) >= 40 for t in sent), BOUND)
    assert await run(mosquitto.wait, BOUND) == 0
    arrivals = []
    for t, expected in sent.items():
        got = sub.messages_on(t)
        assert [m.payload for m in got] == expected, t
        arrivals += [m.timestamp for m in got]
    assert max(arrivals) - min(arrivals) >= 1.0
    after = await readyz(health)
    assert after.get("publish_throttled_connector", 0) - before.get("publish_throttled_connector", 0) >= 1
    assert after.get("publish_throttled", 0) == before.get("publish_throttled", 0)
    for c in (sub, *pubs):
        await run(c.close)
