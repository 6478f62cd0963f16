"""The connector against real Kafka, with a fake session registry and no router: what it produces for
PUBLISH / SUBSCRIBE / CONNECT / Will, what it does with what it consumes (downlinks, disconnect commands,
registry answers), and bad input. Real MQTT clients (paho-mqtt) talk to two real connector processes.
"""

from __future__ import annotations

import socket
import time

import paho.mqtt.client as mqtt
import pytest
from connector_helpers import FakeAppDelivery, FakeDevicePersistence, FakeRegistry, Tail, raw_socket, recv_until_closed
from mqtt_clients import BOUND, Client, run, wait_until
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from tbmq.v1 import messages_pb2 as pb
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_platform.kafka import make_producer
from tbmq_platform.topics import (
    CLIENT_SUBSCRIPTIONS,
    MSG_ALL,
    MSG_RETAINED,
    SESSION_EVENT_REQUEST,
    disconnect_topic,
    downlink_basic_topic,
)

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def registry(kafka):
    reg = FakeRegistry(kafka.bootstrap_servers).start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def device_store(registry):
    dp = FakeDevicePersistence(registry).start()
    try:
        yield dp
    finally:
        dp.stop()


@pytest.fixture(scope="module")
def app_delivery(registry):
    ad = FakeAppDelivery(registry).start()
    try:
        yield ad
    finally:
        ad.stop()


@pytest.fixture(scope="module")
async def connectors(kafka, tmp_path_factory, registry, device_store, app_delivery):
    s = Suite(services=["connector"], connectors=2, ports="free", log_format="json", id_tag=new_tag(),
              run_dir=tmp_path_factory.mktemp("connectors"), redis_url="redis://127.0.0.1:1/0",
              kafka=kafka.bootstrap_servers if not hasattr(kafka, "start") else kafka,
              service_env={"connector": {"SESSION_EVENT_TIMEOUT_S": "3", "MQTT_CONNECT_TIMEOUT_S": "2",
                                         "MQTT_MAX_PACKET_SIZE": "65536",
                                         "DEVICE_PERSISTENCE_GRPC_TARGET": f"127.0.0.1:{device_store.port}",
                                         "APP_DELIVERY_GRPC_TARGETS": f"127.0.0.1:{app_delivery.port}"}})
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def producer(kafka):
    p = make_producer(kafka.bootstrap_servers, client_id="test")
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def test_publish_qos1_is_acked_after_kafka_with_all_properties(connectors, registry, kafka, unique):
    port = connectors.mqtt_ports[0]
    cid = unique("pub")
    c = Client(cid, v5=True)
    async with Tail(kafka.bootstrap_servers, MSG_ALL) as tail:
        await run(c.connect, port)
        props = PahoProperties(PacketTypes.PUBLISH)
        props.UserProperty = [("k", "v")]
        props.ContentType = "text/plain"
        props.ResponseTopic = "reply/here"
        props.CorrelationData = b"corr"
        props.MessageExpiryInterval = 30
        props.PayloadFormatIndicator = 1
        topic = f"t/{cid}"
        await run(c.publish, topic, b"hello", 1, False, props)
        rec = await tail.wait_for(lambda r: r.key == topic.encode())
        msg = pb.PublishMsg.FromString(rec.value)
        assert msg.publisher_id == cid and msg.topic == topic and msg.payload == b"hello" and msg.qos == 1
        assert [(u.key, u.value) for u in msg.user_properties] == [("k", "v")]
        assert msg.content_type == "text/plain" and msg.response_topic == "reply/here"
        assert msg.correlation_data == b"corr" and msg.message_expiry_interval == 30
        assert msg.payload_format_indicator == 1 and msg.publisher_mqtt_version == 5
        assert msg.publisher_service_id == connectors.connector_ids[0]
        assert abs(msg.created_at_ms - time.time() * 1000) < 60_000
        assert any(k == "traceparent" for k, _ in rec.headers)
    await run(c.close)


async def test_qos2_exactly_once_and_many_in_flight(connectors, registry, kafka, unique):
    port = connectors.mqtt_ports[1]
    cid = unique("q2")
    c = Client(cid, v5=False)
    topic = f"q2/{cid}"
    async with Tail(kafka.bootstrap_servers, MSG_ALL) as tail:
        await run(c.connect, port)
        infos = [c.publish(topic, str(i).encode(), qos=2, wait=False) for i in range(200)]
        for info in infos:
            await run(info.wait_for_publish, BOUND)
            assert info.is_published()
        # a marker after every PUBCOMP: a second record of any of them would come before it (same key)
        await run(c.publish, topic, b"marker", 1)
        await tail.wait_for(lambda r: r.key == topic.encode() and pb.PublishMsg.FromString(r.value).payload == b"marker")
        payloads = [pb.PublishMsg.FromString(r.value).payload for r in tail.records if r.key == topic.encode()]
        # one record per PUBLISH; per partition order = publish order
        assert payloads == [str(i).encode() for i in range(200)] + [b"marker"]
    await run(c.close)


async def test_qos2_duplicate_before_pubrel_is_not_reproduced(connectors, registry, kafka, unique):
    """A raw client re-sends the same QoS 2 PUBLISH (DUP=1) before PUBREL: one record only."""
    from tbmq_mqtt import Connect, MqttDecoder, PubAck, PubComp, PubRec, PubRel, Publish, Role, encode

    port = connectors.mqtt_ports[0]
    cid = unique("dup")
    topic = f"dup/{cid}"
    async with Tail(kafka.bootstrap_servers, MSG_ALL) as tail:
        def scenario():
            s = raw_socket(port)
            dec = MqttDecoder(4, role=Role.CLIENT)
            s.sendall(encode(Connect(protocol_level=4, client_id=cid, clean_start=True, keep_alive=30), 4))
            got = []

            def read_until(pred):
                while not any(pred(p) for p in got):
                    got.extend(dec.feed(s.recv(4096)))
                return next(p for p in got if pred(p))

            read_until(lambda p: p.__class__.__name__ == "ConnAck")
            pub = Publish(topic=topic, payload=b"once", qos=2, packet_id=7)
            s.sendall(encode(pub, 4))
            read_until(lambda p: isinstance(p, PubRec) and p.packet_id == 7)
            got.clear()
            pub.dup = True
            s.sendall(encode(pub, 4))
            read_until(lambda p: isinstance(p, PubRec) and p.packet_id == 7)
            s.sendall(encode(PubRel(7), 4))
            read_until(lambda p: isinstance(p, PubComp) and p.packet_id == 7)
            # a marker on the same connection and topic: produced after a second record would have been
            s.sendall(encode(Publish(topic=topic, payload=b"marker", qos=1, packet_id=8), 4))
            read_until(lambda p: isinstance(p, PubAck) and p.packet_id == 8)
            s.close()
        await run(scenario)
        await tail.wait_for(lambda r: r.key == topic.encode() and pb.PublishMsg.FromString(r.value).payload == b"marker")
        assert [pb.PublishMsg.FromString(r.value).payload for r in tail.records
                if r.key == topic.encode()] == [b"once", b"marker"]


async def test_subscribe_writes_whole_set_and_downlink_is_delivered(connectors, registry, kafka, unique, producer):
    port = connectors.mqtt_ports[0]
    cid = unique("sub")
    c = Client(cid, v5=True)
    async with Tail(kafka.bootstrap_servers, CLIENT_SUBSCRIPTIONS) as tail:
        await run(c.connect, port)
        sp = PahoProperties(PacketTypes.SUBSCRIBE)
        sp.SubscriptionIdentifier = 42
        codes = await run(c.subscribe, [("a/+/c", mqtt.SubscribeOptions(qos=1, noLocal=True)),
                                        ("$share/g1/s/#", mqtt.SubscribeOptions(qos=2))], properties=sp)
        assert [int(rc.value) for rc in codes] == [1, 2]
        rec = await tail.wait_for(lambda r: r.key == cid.encode())
        cs = pb.ClientSubscriptions.FromString(rec.value)
        got = {(t.share_name, t.topic_filter): t for t in cs.subscriptions}
        assert set(got) == {("", "a/+/c"), ("g1", "s/#")}
        assert got[("", "a/+/c")].no_local and got[("", "a/+/c")].subscription_id == 42
        assert got[("g1", "s/#")].qos == 2
        # second SUBSCRIBE: the WHOLE set again
        await run(c.subscribe, "x/y", 0)
        rec = await tail.wait_for(lambda r: r.key == cid.encode() and len(pb.ClientSubscriptions.FromString(r.value).subscriptions) == 3)
        # UNSUBSCRIBE
        await run(c.c.unsubscribe, "x/y")
        await tail.wait_for(lambda r: r.key == cid.encode() and r.offset > rec.offset)
    # a downlink for this client (what the router would send)
    msg = pb.PublishMsg(publisher_id="someone", topic="a/b/c", payload=b"down", qos=1, created_at_ms=int(time.time() * 1000),
                        message_expiry_interval=100)
    msg.user_properties.add(key="u", value="1")
    dl = pb.BasicDownlink(msg=msg, recipients=[pb.Recipient(client_id=cid, qos=1, retain=False, subscription_ids=[42])])
    await producer.send_and_wait(downlink_basic_topic(connectors.connector_ids[0]), dl.SerializeToString(), key=b"a/b/c")
    assert await run(c.wait, lambda: len(c.messages_on("a/b/c")) == 1)
    m = c.messages_on("a/b/c")[0]
    assert m.payload == b"down" and m.qos == 1
    assert m.properties.SubscriptionIdentifier == [42]
    assert 90 <= m.properties.MessageExpiryInterval <= 100
    assert m.properties.UserProperty == [("u", "1")]
    # an expired message is not delivered
    old = pb.PublishMsg(topic="a/b/c", payload=b"expired", qos=0, created_at_ms=int(time.time() * 1000) - 10_000,
                        message_expiry_interval=5)
    dl = pb.BasicDownlink(msg=old, recipients=[pb.Recipient(client_id=cid, qos=0)])
    await producer.send_and_wait(downlink_basic_topic(connectors.connector_ids[0]), dl.SerializeToString(), key=b"a/b/c")
    fresh = pb.PublishMsg(topic="a/b/c", payload=b"fresh", qos=0, created_at_ms=int(time.time() * 1000))
    dl = pb.BasicDownlink(msg=fresh, recipients=[pb.Recipient(client_id=cid, qos=0)])
    await producer.send_and_wait(downlink_basic_topic(connectors.connector_ids[0]), dl.SerializeToString(), key=b"a/b/c")
    assert await run(c.wait, lambda: any(m.payload == b"fresh" for m in c.messages_on("a/b/c")))
    assert not any(m.payload == b"expired" for m in c.messages_on("a/b/c"))
    await run(c.close)


async def test_expiry_checked_again_behind_the_in_flight_window(connectors, registry, kafka, unique, producer):
    """paho 5.0 with Receive Maximum 1 holds its PUBACK (manual ack) while three QoS 1 messages wait behind the
    one in flight: when it acknowledges, the one that expired meanwhile is not sent [MQTT-3.3.2-5] and the next
    carries the interval left then, not when it was queued [MQTT-3.3.2-6]."""
    cid = unique("expq")
    c = Client(cid, v5=True)
    c.c.manual_ack_set(True)
    await run(c.connect, connectors.mqtt_ports[0], ReceiveMaximum=1)
    await run(c.subscribe, "exp/#", 1)
    topic = downlink_basic_topic(connectors.connector_ids[0])

    async def down(payload: bytes, waited_ms: int = 0, interval: int | None = None) -> None:
        msg = pb.PublishMsg(topic="exp/q", payload=payload, qos=1, created_at_ms=int(time.time() * 1000) - waited_ms)
        if interval is not None:
            msg.message_expiry_interval = interval
        dl = pb.BasicDownlink(msg=msg, recipients=[pb.Recipient(client_id=cid, qos=1)])
        await producer.send_and_wait(topic, dl.SerializeToString(), key=b"exp/q")

    await down(b"hold")
    assert await run(c.wait, lambda: len(c.messages_on("exp/q")) == 1)
    await down(b"short", 59_700, 60)   # 0.3 s of life left
    await down(b"long", 10_500, 100)   # 89.5 s left when queued: 90 s if it were computed then
    await down(b"marker")
    held_from = time.monotonic()
    # the time held behind the window is what the test is about: "short" outlives it, "long" loses a second
    await wait_until(lambda: time.monotonic() - held_from >= 0.8, BOUND, "0.8 s held behind the window")
    assert len(c.messages_on("exp/q")) == 1  # Receive Maximum 1: nothing else was sent meanwhile
    hold = c.messages_on("exp/q")[0]
    c.c.ack(hold.mid, 1)
    assert await run(c.wait, lambda: len(c.messages_on("exp/q")) == 2)
    second = c.messages_on("exp/q")[1]
    assert second.payload == b"long" and second.properties.MessageExpiryInterval == 89
    c.c.ack(second.mid, 1)
    assert await run(c.wait, lambda: len(c.messages_on("exp/q")) == 3)
    assert [m.payload for m in c.messages_on("exp/q")] == [b"hold", b"long", b"marker"]
    c.c.ack(c.messages_on("exp/q")[2].mid, 1)
    await run(c.close)


async def test_receive_maximum_limits_in_flight(connectors, registry, kafka, unique, producer):
    """A raw v5 client with Receive Maximum 2 that does not acknowledge gets exactly 2 QoS 1 messages;
    acknowledging one releases the next."""
    from tbmq_mqtt import MQTT_5, Connect, MqttDecoder, Properties, PubAck, Publish, Role, Subscribe, Subscription, encode

    port = connectors.mqtt_ports[0]
    cid = unique("rm")

    def connect():
        s = raw_socket(port)
        s.sendall(encode(Connect(protocol_level=5, client_id=cid, keep_alive=30,
                                 properties=Properties(receive_maximum=2)), 5))
        dec = MqttDecoder(5, role=Role.CLIENT)
        got = []
        while not got:
            got.extend(dec.feed(s.recv(4096)))
        assert got[0].reason_code == 0
        # subscribed: the connector delivers a live downlink only while a subscription matches its topic
        s.sendall(encode(Subscribe(1, [Subscription("rm/t", qos=1)]), 5))
        got = []
        while not got:
            got.extend(dec.feed(s.recv(4096)))
        assert got[0].reason_codes == [1]
        return s, dec
    s, dec = await run(connect)
    for i in range(5):
        msg = pb.PublishMsg(topic="rm/t", payload=str(i).encode(), qos=1, created_at_ms=int(time.time() * 1000))
        dl = pb.BasicDownlink(msg=msg, recipients=[pb.Recipient(client_id=cid, qos=1)])
        await producer.send(downlink_basic_topic(connectors.connector_ids[0]), dl.SerializeToString(), key=b"rm/t")
    await producer.flush()

    def read_for(seconds):
        s.settimeout(0.2)
        out = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            out.extend(dec.feed(data))
        return [p for p in out if isinstance(p, Publish)]
    first = await run(read_for, 3)
    assert [p.payload for p in first] == [b"0", b"1"]
    s.sendall(encode(PubAck(first[0].packet_id), MQTT_5))
    nxt = await run(read_for, 2)
    assert [p.payload for p in nxt] == [b"2"]
    s.close()


async def test_retained_set_delivered_on_subscribe_and_cleared(connectors, registry, kafka, unique):
    cid = unique("ret")
    topic = f"ret/{cid}/x"
    pub = Client(cid + "p", v5=True)
    async with Tail(kafka.bootstrap_servers, MSG_RETAINED) as tail:
        await run(pub.connect, connectors.mqtt_ports[0])
        await run(pub.publish, topic, b"kept", 1, True)
        await tail.wait_for(lambda r: r.key == topic.encode() and r.value)
        # a subscriber on the OTHER connector sees it (it follows tbmq.msg.retained)
        sub = Client(cid + "s", v5=True)
        await run(sub.connect, connectors.mqtt_ports[1])

        async def retained_on_subscribe() -> bool:  # the other connector's view may lag a little: again
            await run(sub.subscribe, f"ret/{cid}/+", 1)
            return await run(sub.wait, lambda: len(sub.messages_on(topic)) > 0, 1.0)

        await wait_until(retained_on_subscribe, BOUND, "the retained message on subscribe", step=0)
        m = sub.messages_on(topic)[0]
        assert m.retain and m.payload == b"kept"
        # retain handling 2: not sent
        n = len(sub.messages_on(topic))
        await run(sub.subscribe, f"ret/{cid}/#", options=mqtt.SubscribeOptions(qos=1, retainHandling=2))
        # marker: a further SUBSCRIBE on the same connection (retain handling 0) gets the retained message;
        # the connector handles a connection's SUBSCRIBEs in order, so one for the first would come before it
        await run(sub.subscribe, topic, options=mqtt.SubscribeOptions(qos=1, retainHandling=0))
        assert await run(sub.wait, lambda: len(sub.messages_on(topic)) >= n + 1)
        assert len(sub.messages_on(topic)) == n + 1
        # clear
        await run(pub.publish, topic, b"", 1, True)
        await tail.wait_for(lambda r: r.key == topic.encode() and r.value is None)
    await run(pub.close)
    await run(sub.close)


async def test_registry_silent_gives_server_unavailable(connectors, registry, unique):
    cid = unique("silent")
    registry.mode[cid] = "silent"
    c = Client(cid, v5=True)
    await run(c.connect, connectors.mqtt_ports[0], expect_ok=False)
    assert c.connack is not None and int(c.connack[1].value) == 0x88
    await run(c.close)
    c3 = Client(cid, v5=False)
    await run(c3.connect, connectors.mqtt_ports[0], expect_ok=False)
    assert c3.connack is not None and c3.connack[1].getName() == "Server unavailable"  # 3.1.1 return code 3
    await run(c3.close)


async def test_quota_exceeded(connectors, registry, unique):
    cid = unique("quota")
    registry.mode[cid] = "quota"
    c = Client(cid, v5=True)
    await run(c.connect, connectors.mqtt_ports[0], expect_ok=False)
    assert int(c.connack[1].value) == 0x97
    await run(c.close)


async def test_takeover_command_disconnects_with_0x8e(connectors, registry, kafka, unique):
    cid = unique("take")
    old = Client(cid, v5=True)
    await run(old.connect, connectors.mqtt_ports[0])
    new = Client(cid, v5=True)
    async with Tail(kafka.bootstrap_servers, SESSION_EVENT_REQUEST) as tail:
        await run(new.connect, connectors.mqtt_ports[1])
        assert await run(old.wait, lambda: old.disconnected is not None)
        assert int(old.disconnected.value) == 0x8E
        # marker: a client connected and closed on the old connection's connector after it: its
        # DISCONNECTION_REQUEST is produced after one of the old connection would have been
        marker = Client(cid + "m", v5=True)
        await run(marker.connect, connectors.mqtt_ports[0])
        await run(marker.close)
        await tail.wait_for(lambda r: (d := pb.SessionEventRequest.FromString(r.value)).session.client_id == cid + "m"
                            and d.type == pb.SESSION_EVENT_DISCONNECTION_REQUEST)
        # the taken-over connection reports no DISCONNECTION_REQUEST
        old_sid = [r for r in registry.requests if r.session.client_id == cid][0].session.session_id
        disc = [pb.SessionEventRequest.FromString(r.value) for r in tail.records]
        assert not [d for d in disc if d.type == pb.SESSION_EVENT_DISCONNECTION_REQUEST
                    and d.session.session_id == old_sid]
    old.stop_loop()
    await run(new.close)


async def test_will_on_ungraceful_close_not_on_disconnect(connectors, registry, kafka, unique):
    cid = unique("will")
    async with Tail(kafka.bootstrap_servers, MSG_ALL) as tail:
        s = await run(raw_socket, connectors.mqtt_ports[0])
        from tbmq_mqtt import Connect, Disconnect, Will, encode
        will = Will(topic=f"will/{cid}", payload=b"gone", qos=1)
        s.sendall(encode(Connect(protocol_level=4, client_id=cid, keep_alive=30, will=will), 4))
        assert (await run(s.recv, 4))[:2] == b"\x20\x02"
        s.close()  # no DISCONNECT
        rec = await tail.wait_for(lambda r: r.key == f"will/{cid}".encode())
        assert pb.PublishMsg.FromString(rec.value).payload == b"gone"
        # graceful: no will
        s = await run(raw_socket, connectors.mqtt_ports[0])
        will2 = Will(topic=f"will2/{cid}", payload=b"no", qos=0)
        s.sendall(encode(Connect(protocol_level=4, client_id=cid + "b", keep_alive=30, will=will2), 4))
        assert (await run(s.recv, 4))[:2] == b"\x20\x02"
        s.sendall(encode(Disconnect(), 4))
        s.close()
        # marker: a third connection on the same connector, closed without DISCONNECT, with a Will on the same
        # topic: produced after a Will of the graceful one would have been
        s = await run(raw_socket, connectors.mqtt_ports[0])
        will3 = Will(topic=f"will2/{cid}", payload=b"marker", qos=0)
        s.sendall(encode(Connect(protocol_level=4, client_id=cid + "c", keep_alive=30, will=will3), 4))
        assert (await run(s.recv, 4))[:2] == b"\x20\x02"
        s.close()
        await tail.wait_for(lambda r: r.key == f"will2/{cid}".encode())
        assert [pb.PublishMsg.FromString(r.value).payload for r in tail.records
                if r.key == f"will2/{cid}".encode()] == [b"marker"]


async def test_keep_alive_expiry_closes_and_sends_will(connectors, registry, kafka, unique):
    cid = unique("ka")
    from tbmq_mqtt import Connect, Will, encode
    async with Tail(kafka.bootstrap_servers, MSG_ALL) as tail:
        s = await run(raw_socket, connectors.mqtt_ports[1])
        s.sendall(encode(Connect(protocol_level=4, client_id=cid, keep_alive=1,
                                 will=Will(topic=f"ka/{cid}", payload=b"x")), 4))
        t0 = time.monotonic()
        data = await run(recv_until_closed, s, 10)  # closed by the server (it fails if not)
        assert data[:2] == b"\x20\x02"
        assert time.monotonic() - t0 >= 1.2  # not before 1.5 x keep alive [MQTT-3.1.2-22]
        await tail.wait_for(lambda r: r.key == f"ka/{cid}".encode())


async def test_bad_input_affects_only_its_connection(connectors, registry, kafka, unique):
    port = connectors.mqtt_ports[0]
    good = Client(unique("good"), v5=True)
    await run(good.connect, port)
    topic = "bad/input/probe"
    await run(good.subscribe, topic, 0)

    # garbage
    s = await run(raw_socket, port)
    s.sendall(b"\xff\xff\xff\xff garbage")
    await run(recv_until_closed, s)
    # 268 MB remaining length: rejected from the header
    s = await run(raw_socket, port)
    s.sendall(b"\x10\xff\xff\xff\x7f")
    await run(recv_until_closed, s)
    # CONNECT then a v5 packet too large: DISCONNECT 0x95
    from tbmq_mqtt import Connect, MqttDecoder, Role, encode
    s = await run(raw_socket, port)
    s.sendall(encode(Connect(protocol_level=5, client_id=unique("big"), keep_alive=30), 5))
    dec = MqttDecoder(5, role=Role.CLIENT)
    got = []
    while not got:
        got.extend(dec.feed(await run(s.recv, 4096)))
    assert got[0].__class__.__name__ == "ConnAck"
    s.sendall(b"\x30\xff\xff\x7f")  # PUBLISH of ~2 MB declared, max is 64 KiB
    data = await run(recv_until_closed, s)
    packets = dec.feed(data)
    assert packets[-1].__class__.__name__ == "Disconnect" and packets[-1].reason_code == 0x95
    # slow loris: no CONNECT within the connect timeout (2 s here)
    s = await run(raw_socket, port)
    s.sendall(b"\x10")
    await run(recv_until_closed, s, 10)  # closed by the server (it fails if not)
    # the good client is unaffected
    msg = pb.PublishMsg(topic=topic, payload=b"still here", qos=0, created_at_ms=int(time.time() * 1000))
    dl = pb.BasicDownlink(msg=msg, recipients=[pb.Recipient(client_id=good.c._client_id.decode(), qos=0)])
    p = make_producer(kafka.bootstrap_servers, client_id="t")
    await p.start()
    await p.send_and_wait(downlink_basic_topic(connectors.connector_ids[0]), dl.SerializeToString(), key=topic.encode())
    await p.stop()
    assert await run(good.wait, lambda: len(good.messages_on(topic)) == 1)
    await run(good.close)
    for proc in connectors.instances_of("connector"):
        assert proc.running


async def test_disconnect_command_for_unknown_session_is_ignored(connectors, registry, producer, unique):
    cid = unique("known")
    known = Client(cid, v5=True)
    await run(known.connect, connectors.mqtt_ports[0])
    sid = [r for r in registry.requests if r.session.client_id == cid][-1].session.session_id
    topic = disconnect_topic(connectors.connector_ids[0])
    cmd = pb.DisconnectCommand(client_id="nobody", session_id="no-such-session")
    await producer.send_and_wait(topic, cmd.SerializeToString(), key=b"nobody")
    # marker: a command for a connected client, behind it on the same topic; once it took effect, the
    # unknown one was handled (ignored) before
    cmd = pb.DisconnectCommand(client_id=cid, session_id=sid)
    await producer.send_and_wait(topic, cmd.SerializeToString(), key=cid.encode())
    assert await run(known.wait, lambda: known.disconnected is not None)
    assert all(p.running for p in connectors.instances_of("connector"))
    known.stop_loop()


@pytest.mark.parametrize("level", [4, 5])
async def test_invalid_filters_fail_per_filter_and_no_local_on_shared_is_a_protocol_error(
        connectors, registry, unique, level):
    from tbmq_mqtt import Connect, MqttDecoder, Role, SubAck, Subscribe, Subscription, encode

    def scenario():
        s = raw_socket(connectors.mqtt_ports[1])
        dec = MqttDecoder(level, role=Role.CLIENT)
        s.sendall(encode(Connect(protocol_level=level, client_id=unique("filt"), keep_alive=30), level))
        got = []
        while not got:
            got.extend(dec.feed(s.recv(4096)))
        s.sendall(encode(Subscribe(1, [Subscription("ok/+", 1), Subscription("bad/#/x", 0),
                                       Subscription("bad+", 2), Subscription("$share/g/ok/#", 2)]), level))
        got = []
        while not any(isinstance(p, SubAck) for p in got):
            got.extend(dec.feed(s.recv(4096)))
        codes = got[-1].reason_codes
        if level == 5:
            s.sendall(encode(Subscribe(2, [Subscription("$share/g/x", 1, no_local=True)]), level))
            rest = MqttDecoder(5, role=Role.CLIENT).feed(recv_until_closed(s))
            return codes, rest
        s.close()
        return codes, None
    codes, rest = await run(scenario)
    fail = 0x8F if level == 5 else 0x80
    assert codes == [1, fail, fail, 2]
    if level == 5:
        assert rest[-1].__class__.__name__ == "Disconnect" and rest[-1].reason_code == 0x82


async def test_persistent_device_stored_then_live_messages(connectors, registry, device_store, unique, producer):
    """FetchUndelivered after CONNACK: stored PUBLISH (DUP=1) and PUBREL in order, then live ones from
    the connector's Forward stream (duplicates by serial skipped); PUBACK/PUBCOMP -> acknowledge and
    PUBREC -> mark (batched, up the Forward stream) + PUBREL, connection end -> Detach."""
    from tbmq_mqtt import (MQTT_5, Connect, MqttDecoder, Properties, PubAck, PubComp, Publish, PubRec,
                           PubRel, Role, encode)

    cid = unique("dev")
    now = int(time.time() * 1000)
    device_store.stored[cid] = [
        pb.DevicePublishMsg(client_id=cid, packet_id=1, serial=10, redelivery=True, msg=pb.PublishMsg(
            topic="d/1", payload=b"stored", qos=1, created_at_ms=now)),  # handed out before: DUP=1
        pb.DevicePublishMsg(client_id=cid, packet_id=2, serial=11, packet_type=pb.DEVICE_PACKET_TYPE_PUBREL,
                            msg=pb.PublishMsg(topic="d/2", qos=2, created_at_ms=now)),
    ]
    s = await run(raw_socket, connectors.mqtt_ports[0])
    dec = MqttDecoder(5, role=Role.CLIENT)
    got: list = []

    def read_until(pred):
        s.settimeout(BOUND)
        while not any(pred(p) for p in got):
            got.extend(dec.feed(s.recv(65536)))
        return next(p for p in got if pred(p))

    s.sendall(encode(Connect(protocol_level=5, client_id=cid, clean_start=False, keep_alive=30,
                             properties=Properties(session_expiry_interval=60)), 5))
    await run(read_until, lambda p: p.__class__.__name__ == "ConnAck")
    first = await run(read_until, lambda p: isinstance(p, Publish))
    assert first.packet_id == 1 and first.dup and first.payload == b"stored"
    await run(read_until, lambda p: isinstance(p, PubRel) and p.packet_id == 2)
    s.sendall(encode(PubAck(1), MQTT_5) + encode(PubComp(2), MQTT_5))
    # live: one duplicate (serial 11) and one new (serial 12, QoS 2), in one forward batch
    service_id = connectors.connector_ids[0]
    await wait_until(lambda: service_id in device_store.streams, BOUND)
    device_store.forward(service_id, [
        pb.DevicePublishMsg(client_id=cid, packet_id=pid, serial=serial, msg=pb.PublishMsg(
            topic="d/live", payload=b"live%d" % serial, qos=2, created_at_ms=now))
        for serial, pid in ((11, 2), (12, 3))])
    live = await run(read_until, lambda p: isinstance(p, Publish) and p.topic == "d/live")
    assert live.packet_id == 3 and live.payload == b"live12" and not live.dup and live.qos == 2
    s.sendall(encode(PubRec(3), MQTT_5))
    await run(read_until, lambda p: isinstance(p, PubRel) and p.packet_id == 3)
    s.sendall(encode(PubComp(3), MQTT_5))
    want = {("ack", cid, 1), ("ack", cid, 2), ("pubrec", cid, 3), ("ack", cid, 3)}
    await wait_until(lambda: want <= set(device_store.calls), BOUND)
    assert want <= set(device_store.calls)
    assert [c for c in device_store.calls if c[1] == cid][0][0] == "fetch"
    assert len([p for p in got if isinstance(p, Publish) and p.topic == "d/live"]) == 1
    s.close()
    await wait_until(lambda: any(c[0] == "detach" and c[1] == cid for c in device_store.calls), BOUND)
    assert any(c[0] == "detach" and c[1] == cid for c in device_store.calls)


async def test_persistent_application_stream(connectors, registry, app_delivery, unique):
    """A persistent APPLICATION client gets its AppDelivery stream: records in order with connector
    packet ids, DUP=1 for redeliveries, AppAck(ref) on PUBACK; AppOpen carries its shared subscriptions."""
    from tbmq.v1 import services_pb2 as spb

    cid = unique("app")
    registry.mode[cid] = "APPLICATION"
    now = int(time.time() * 1000)
    app_delivery.records[cid] = [
        spb.AppRecord(ref=spb.AppRecordRef(topic="tbmq.msg.app.x", partition=0, offset=i),
                      msg=pb.PublishMsg(topic="app/t", payload=b"a%d" % i, qos=1, created_at_ms=now),
                      redelivery=(i == 0))
        for i in range(3)]
    c = Client(cid, v5=True, clean=True, session_expiry=120)
    await run(c.connect, connectors.mqtt_ports[1], ReceiveMaximum=7)
    assert await run(c.wait, lambda: len(c.messages_on("app/t")) == 3)
    msgs = c.messages_on("app/t")
    assert [m.payload for m in msgs] == [b"a0", b"a1", b"a2"] and [m.dup for m in msgs] == [True, False, False]
    await wait_until(lambda: len([a for a in app_delivery.acks if a[0] == cid]) >= 3, BOUND)
    assert sorted(a[1] for a in app_delivery.acks if a[0] == cid) == [0, 1, 2]
    opened = [o for o in app_delivery.opens if o.client_id == cid][0]
    assert opened.receive_maximum == 7 and opened.session_id
    # a shared subscription reopens the stream with it
    await run(c.subscribe, "$share/grp/app/#", 1)
    await wait_until(lambda: len([o for o in app_delivery.opens if o.client_id == cid]) >= 2, BOUND)
    last = [o for o in app_delivery.opens if o.client_id == cid][-1]
    assert [(s.share_name, s.topic_filter) for s in last.shared] == [("grp", "app/#")]
    await run(c.close)
