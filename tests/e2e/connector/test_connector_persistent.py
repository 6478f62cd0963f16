"""Persistent sessions end to end: two connectors + router + session-registry + device-persistence (+ Redis).

The session registry clears a DEVICE session's stored messages through device-persistence on connect
(a persistent one, or any earlier DEVICE session: takeover included), so these tests need that service; the module is skipped (with this reason) while
services/device-persistence has no runnable entry point.
"""

from __future__ import annotations

import importlib.util

import pytest
from connector_helpers import Tail, connector_health, raw_socket
from mqtt_clients import BOUND, Client, payloads, real, routed, run, wait_until, watcher_and_prober
from suites import module_suite
from tbmq_platform.topics import CLIENT_SESSION

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("device_persistence.__main__") is None,
                       reason="device-persistence has no entry point yet (services/device-persistence)"),
]


# The connectors hold acknowledgements of stored messages for up to DEVICE_ACK_BATCH_DELAY_MS before they
# send them in one batch (100 ms by default); 2 s here makes every test of the module a case where they are
# still held when a session ends or reconnects, not only the tests that race them.
ACK_DELAY_MS = 2000


@pytest.fixture(scope="module")
async def pq(kafka, tmp_path_factory):
    async with module_suite(kafka, tmp_path_factory, "suite-persist", connectors=2,
                            services=["session-registry", "device-persistence", "router", "connector"],
                            env={"DEVICE_ACK_BATCH_DELAY_MS": str(ACK_DELAY_MS)}) as s:
        yield s


@pytest.mark.parametrize("v5", [False, True], ids=["3.1.1", "5.0"])
@pytest.mark.parametrize("how", ["reconnect", "takeover"])
async def test_acknowledged_messages_are_not_fetched_again_on_the_other_connector(pq, unique, v5, how):
    """A persistent session acknowledges stored messages on one connector, then connects on the other: it gets
    none of them again. The first connector still holds the PUBACKs for its batch (ACK_DELAY_MS).
    - reconnect: the client disconnects first; the first connector reports the session's end, and detaches it,
      only once they are in Redis, and the second connector's fetch finds them removed;
    - takeover: the client connects on the other while still connected on the first. The registry answers the
      new connection without waiting for the old one, and a taken-over session reports no end: the first
      connector detaches it only once its acknowledgements are applied, and device-persistence asks a
      connector the client is still attached to for them (its Forward stream's settle) before the new
      connection's first fetch reads."""
    u = unique("qr" if how == "reconnect" else "tko")
    topic = f"{u}/t"
    pub = Client(u + "p")
    await run(pub.connect, pq.mqtt_ports[0])
    kw = dict(v5=v5, session_expiry=600 if v5 else None)
    c = Client(u, clean=v5, **kw)  # 5.0: a clean start with an expiry interval; 3.1.1: clean session 0
    await run(c.connect, pq.mqtt_ports[0])
    await run(c.subscribe, topic, 1)
    await routed(pub, c, topic, 1)
    sent = [b"m%d" % i for i in range(5)]
    for p in sent:
        await run(pub.publish, topic, p, 1)
    assert await run(c.wait, lambda: payloads(c, topic) == sent), payloads(c, topic)
    await run(c.flush)  # the client acknowledged them: its PUBACKs read by the connector before it moves
    if how == "reconnect":
        await run(c.close, wait=True)
    again = Client(u, clean=False, **kw)
    flags, _, _ = await run(again.connect, pq.mqtt_ports[1])
    assert flags.session_present
    if how == "takeover":
        assert await run(c.wait, lambda: c.disconnected is not None)
        c.stop_loop()
    await run(pub.publish, topic, b"after", 1)
    assert await run(again.wait, lambda: b"after" in payloads(again, topic)), payloads(again, topic)
    assert payloads(again, topic) == [b"after"]
    for x in (again, pub):
        await run(x.close)


async def test_takeover_on_another_connector(pq, unique):
    u = unique("tk")
    first = Client(u)
    await run(first.connect, pq.mqtt_ports[0])
    second = Client(u)
    await run(second.connect, pq.mqtt_ports[1])
    assert await run(first.wait, lambda: first.disconnected is not None)
    assert int(first.disconnected.value) == 0x8E  # Session taken over
    first.stop_loop()
    # the new connection works
    pub = Client(u + "p")
    await run(pub.connect, pq.mqtt_ports[0])
    await run(second.subscribe, f"{u}/t", 1)
    await routed(pub, second, f"{u}/t", 1)
    # and a 3.1.1 takeover is a plain close
    a = Client(u + "x", v5=False)
    await run(a.connect, pq.mqtt_ports[1])
    b = Client(u + "x", v5=False)
    await run(b.connect, pq.mqtt_ports[0])
    assert await run(a.wait, lambda: a.disconnected is not None)
    a.stop_loop()
    for c in (second, pub, b):
        await run(c.close)


async def test_persistent_session_subscriptions_survive_reconnect_elsewhere(pq, unique):
    u = unique("ps")
    pub = Client(u + "p")
    await run(pub.connect, pq.mqtt_ports[0])
    c = Client(u, v5=False, clean=False)
    await run(c.connect, pq.mqtt_ports[0])
    await run(c.subscribe, f"{u}/a", 0)
    await routed(pub, c, f"{u}/a")
    await run(c.close)
    c2 = Client(u, v5=False, clean=False)
    flags, rc, _ = await run(c2.connect, pq.mqtt_ports[1])
    assert flags.session_present
    await run(c2.subscribe, f"{u}/b", 0)  # the whole set written must still contain u/a
    await routed(pub, c2, f"{u}/b")
    await routed(pub, c2, f"{u}/a")
    await run(c2.close)
    c3 = Client(u, v5=False, clean=True)
    flags, rc, _ = await run(c3.connect, pq.mqtt_ports[1])
    assert not flags.session_present
    await run(c3.close)
    await run(pub.close)


@pytest.mark.parametrize("v5", [False, True], ids=["3.1.1", "5.0"])
async def test_persistent_reconnects_restore_the_set_just_written_and_deliver_the_queue_in_order(pq, unique, v5):
    """Reconnect after reconnect, alternating connectors: each CONNACK says session present, the session
    has the subscription added just before it (the connector reads its subscription view up to the end
    before CONNACK, on a connection of its own), and what was queued while offline arrives after CONNACK
    in publish order, before anything published later."""
    u = unique("rc")
    pub = Client(u + "p")
    await run(pub.connect, pq.mqtt_ports[0])
    kw = dict(v5=v5, session_expiry=600 if v5 else None)
    c = Client(u, clean=True if v5 else False, **kw)
    await run(c.connect, pq.mqtt_ports[0])
    await run(c.subscribe, f"{u}/r0", 1)
    await routed(pub, c, f"{u}/r0", 1)
    for i in range(1, 9):
        new = f"{u}/r{i}"
        await run(c.subscribe, new, 1)
        await routed(pub, c, new, 1)  # the router knows it (it learns subscriptions asynchronously)
        await run(c.close, wait=True)
        await run(pub.publish, f"{u}/r0", b"q%d-0" % i, 1)  # queued while offline: the oldest subscription
        await run(pub.publish, new, b"q%d-1" % i, 1)       # and the newest
        await run(pub.publish, f"{u}/r0", b"q%d-2" % i, 1)
        c = Client(u, clean=False, **kw)
        flags, rc, _ = await run(c.connect, pq.mqtt_ports[i % 2])
        assert flags.session_present
        await run(pub.publish, new, b"live%d" % i, 1)  # reaches the set the connector restored

        expected = {f"{u}/r0": [b"q%d-0" % i, b"q%d-2" % i], new: [b"q%d-1" % i, b"live%d" % i]}

        def got(topic: str, c=c) -> list[bytes]:
            return [m.payload for m in real(c.messages_on(topic))]

        assert await run(c.wait, lambda: {t: got(t) for t in expected} == expected), {t: got(t) for t in expected}
    await run(c.close)
    await run(pub.close)


async def test_offline_qos1_messages_delivered_on_reconnect_with_dup(pq, unique):
    u = unique("off")
    pub = Client(u + "p")
    await run(pub.connect, pq.mqtt_ports[0])
    c = Client(u, v5=True, clean=True, session_expiry=300)
    await run(c.connect, pq.mqtt_ports[0])
    await run(c.subscribe, f"{u}/t", 1)
    await routed(pub, c, f"{u}/t", 1)
    await run(c.close)
    for i in range(5):
        await run(pub.publish, f"{u}/t", b"off%d" % i, 1)
    c2 = Client(u, v5=True, clean=False, session_expiry=300)
    flags, rc, _ = await run(c2.connect, pq.mqtt_ports[1])
    assert flags.session_present
    assert await run(c2.wait, lambda: [p for p in payloads(c2, f"{u}/t")] == [b"off%d" % i for i in range(5)])
    await run(c2.close)
    await run(pub.close)


@pytest.mark.parametrize("v5", [True, False], ids=["mqtt5", "mqtt311"])
async def test_session_resume_delivers_queued_qos1_and_qos2_then_ends(pq, unique, v5):
    """Issue 13 (MQTT-3.1.2-4, -5, -23). 5.0: clean start 1 with Session Expiry Interval 600, subscribe at
    QoS 2, disconnect; a QoS 1 and a QoS 2 message are published; reconnect (on the other connector) with clean
    start 0 and NO interval: session present, both delivered at their QoS, new ones too while connected; the
    new interval (0) ends the session when that connection closes. 3.1.1: the same with clean session 0, and
    a clean session 1 connection ends it."""
    u = unique("rs")
    topic = f"{u}/t"
    pub = Client(u + "p")
    await run(pub.connect, pq.mqtt_ports[0])
    first = Client(u, v5=v5, clean=v5, session_expiry=600 if v5 else None)
    flags, _, _ = await run(first.connect, pq.mqtt_ports[0])
    assert not flags.session_present
    await run(first.subscribe, topic, 2)
    await routed(pub, first, topic, 1)
    await run(first.close, wait=True)
    await run(pub.publish, topic, b"q1", 1)
    await run(pub.publish, topic, b"q2", 2)

    back = Client(u, v5=v5, clean=False)  # 5.0: no Session Expiry Interval at all
    flags, _, _ = await run(back.connect, pq.mqtt_ports[1])
    assert flags.session_present
    assert await run(back.wait, lambda: len(real(back.messages_on(topic))) >= 2), payloads(back, topic)
    assert [(m.payload, m.qos) for m in real(back.messages_on(topic))] == [(b"q1", 1), (b"q2", 2)]
    await run(pub.publish, topic, b"live", 2)  # while connected the session still queues for it
    assert await run(back.wait, lambda: b"live" in payloads(back, topic)), payloads(back, topic)
    assert [m.qos for m in real(back.messages_on(topic))] == [1, 2, 2]

    async with Tail(pq.bootstrap_servers, CLIENT_SESSION) as sessions:
        if not v5:
            await run(back.close, wait=True)
            back = Client(u, v5=False, clean=True)
            flags, _, _ = await run(back.connect, pq.mqtt_ports[1])
            assert not flags.session_present
        await run(back.close, wait=True)
        # the registry removes the session (a null record) once this connection is closed
        await sessions.wait_for(lambda r: r.key == u.encode() and r.value is None)
    again = Client(u, v5=v5, clean=False, session_expiry=600 if v5 else None)
    flags, _, _ = await run(again.connect, pq.mqtt_ports[0])
    assert not flags.session_present
    for c in (again, pub):
        await run(c.close)


def will_held_or_sent(suite, before: dict):
    """A predicate for `wait_until`: connector 1 took a new Will (pending or sent since `before`, its health
    counters): its health then."""
    async def taken():
        h = await connector_health(suite, 1)
        return (h["pending_wills"] > before["pending_wills"] or h["wills_sent"] > before["wills_sent"]) and h
    return taken


async def test_will_delay_and_cancel_by_reconnect_on_other_connector(pq, unique):
    from tbmq_mqtt import Connect, Properties, Will, encode

    u = unique("wd")
    watcher, prober = await watcher_and_prober(u, pq.mqtt_ports, 1)

    # Will Delay 4 s with a session that outlives it: held (pending on its connector, not sent), then
    # published once the delay passed (the exact timing: tests/unit/connector/test_connector_wills.py)
    before = await connector_health(pq, 1)
    s = await run(raw_socket, pq.mqtt_ports[0])
    s.sendall(encode(Connect(protocol_level=5, client_id=u + "b", keep_alive=30,
                             properties=Properties(session_expiry_interval=60),
                             will=Will(topic=f"{u}/b", payload=b"late", qos=1,
                                       properties=Properties(will_delay_interval=4))), 5))
    await run(s.recv, 64)
    s.close()
    held = await wait_until(will_held_or_sent(pq, before), BOUND, "the connector to take the Will")
    assert held["wills_sent"] == before["wills_sent"], "a delayed Will is not sent at once"
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/b") == [b"late"])

    # Will Delay 60 s, reconnect on the OTHER connector within it: the Will is cancelled, never sent
    before = await connector_health(pq, 1)
    s = await run(raw_socket, pq.mqtt_ports[0])
    s.sendall(encode(Connect(protocol_level=5, client_id=u + "c", keep_alive=30,
                             properties=Properties(session_expiry_interval=120),
                             will=Will(topic=f"{u}/c", payload=b"never", qos=1,
                                       properties=Properties(will_delay_interval=60))), 5))
    await run(s.recv, 64)
    s.close()
    await wait_until(will_held_or_sent(pq, before), BOUND, "the connector to hold the Will")
    back = Client(u + "c", clean=False, session_expiry=60)
    await run(back.connect, pq.mqtt_ports[1])

    async def cancelled():  # no longer pending on connector 1, and not because it was sent
        h = await connector_health(pq, 1)
        return h["pending_wills"] == before["pending_wills"] and h

    after = await wait_until(cancelled, BOUND, "the pending Will cancelled by the reconnect")
    assert after["wills_sent"] == before["wills_sent"]
    await run(prober.publish, f"{u}/marker", b"m", 1)
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/marker") == [b"m"])
    assert payloads(watcher, f"{u}/c") == []
    await run(back.close)
    await run(watcher.close)
    await run(prober.close)


class RawClient:
    """A raw-socket MQTT client (blocking; call through `run`): it can stop a QoS 2 exchange half-way."""

    def __init__(self, port: int, level: int) -> None:
        from tbmq_mqtt import MqttDecoder, Role

        self.level = level
        self.s = raw_socket(port)
        self.dec = MqttDecoder(level, role=Role.CLIENT)
        self.got: list = []

    def send(self, packet) -> None:
        from tbmq_mqtt import encode

        self.s.sendall(encode(packet, self.level))

    def expect(self, cls, packet_id: int | None = None):
        """The next packet of class `cls` (and id), reading until it comes (bounded by the socket timeout)."""
        while True:
            for i, p in enumerate(self.got):
                if isinstance(p, cls) and (packet_id is None or p.packet_id == packet_id):
                    del self.got[: i + 1]
                    return p
            data = self.s.recv(4096)
            assert data, f"closed while waiting for {cls.__name__} {packet_id}"
            self.got.extend(self.dec.feed(data))


@pytest.mark.parametrize("v5", [True, False], ids=["mqtt5", "mqtt311"])
async def test_qos2_publish_resent_after_reconnect_before_pubrel_is_delivered_once(pq, unique, v5):
    """Issue 13 item 3 (MQTT-4.3.3-10, MQTT-4.4.0-1): a client sends a QoS 2 PUBLISH, gets PUBREC and drops the
    connection before PUBREL; it reconnects (persistent session, the OTHER connector) and re-sends the PUBLISH
    with DUP=1: PUBREC again, no second delivery; PUBREL gets PUBCOMP."""
    from tbmq.v1 import messages_pb2 as pb
    from tbmq_mqtt import ConnAck, Connect, Properties, PubAck, PubComp, Publish, PubRec, PubRel

    u = unique("q2")
    topic = f"{u}/t"
    level = 5 if v5 else 4
    sub = Client(u + "s", v5=v5)
    await run(sub.connect, pq.mqtt_ports[1])
    await run(sub.subscribe, topic, 2)
    props = Properties(session_expiry_interval=600) if v5 else Properties()
    publish = Publish(topic=topic, payload=b"once", qos=2, packet_id=7)

    async with Tail(pq.bootstrap_servers, CLIENT_SESSION) as sessions:
        first = await run(RawClient, pq.mqtt_ports[0], level)
        first.send(Connect(protocol_level=level, client_id=u, clean_start=v5, keep_alive=30, properties=props))
        assert (await run(first.expect, ConnAck)).reason_code == 0
        first.send(publish)
        await run(first.expect, PubRec, 7)
        first.s.close()  # before PUBREL
        # the registry recorded the end of that connection (the reconnect must not overtake it)
        await sessions.wait_for(lambda r: r.key == u.encode() and r.value is not None
                                and not pb.SessionInfo.FromString(r.value).connected)

    back = await run(RawClient, pq.mqtt_ports[1], level)
    back.send(Connect(protocol_level=level, client_id=u, clean_start=False, keep_alive=30, properties=props))
    connack = await run(back.expect, ConnAck)
    assert connack.session_present and connack.reason_code == 0
    publish.dup = True
    back.send(publish)
    await run(back.expect, PubRec, 7)
    back.send(PubRel(7))
    await run(back.expect, PubComp, 7)
    # a marker behind it on the same topic (one partition, in order): once it arrived, a duplicate would have too
    back.send(Publish(topic=topic, payload=b"marker", qos=1, packet_id=8))
    await run(back.expect, PubAck, 8)
    assert await run(sub.wait, lambda: b"marker" in payloads(sub, topic)), payloads(sub, topic)
    assert payloads(sub, topic) == [b"once", b"marker"]
    back.s.close()
    await run(sub.close)
