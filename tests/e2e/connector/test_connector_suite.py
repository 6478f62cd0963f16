"""End to end through the real suite: two connectors + Kafka + router + session-registry, with MQTT
clients nobody here wrote (paho-mqtt 3.1.1 and 5.0, amqtt, mosquitto_pub/mosquitto_sub).

The router learns subscriptions asynchronously (tbmq.client.subscriptions), so after a SUBSCRIBE the
tests wait with `routed()` — probe messages published until one arrives — never with a bare sleep.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import paho.mqtt.client as mqtt
import pytest
from connector_helpers import Tail, connector_health, disconnect_reported, raw_socket, recv_until_closed
from mqtt_clients import BOUND, Client, payloads, poll, real, routed, run, wait_until, watcher_and_prober
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_platform.topics import SESSION_EVENT_REQUEST

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
async def mq(kafka, tmp_path_factory):
    s = Suite(services=["session-registry", "router", "connector"], connectors=2, ports="free",
              log_format="json", id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-connector"),
              redis_url="redis://127.0.0.1:1/0",
              kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
              service_env={"connector": {"MQTT_CONNECT_TIMEOUT_S": "2", "MQTT_RESPONSE_INFORMATION": "resp/"}})
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("versions", [(False, False), (True, True), (False, True)], ids=["311", "5", "311to5"])
async def test_round_trip_across_connectors(mq, unique, qos, versions):
    pub = Client(unique("pub"), v5=versions[0])
    sub = Client(unique("sub"), v5=versions[1])
    topic = f"rt/{unique('t')}"
    await run(pub.connect, mq.mqtt_ports[0])
    await run(sub.connect, mq.mqtt_ports[1])
    await run(sub.subscribe, topic, qos)
    await routed(pub, sub, topic, qos)
    for i in range(20):
        await run(pub.publish, topic, b"m%d" % i, qos)
    assert await run(sub.wait, lambda: len(payloads(sub, topic)) >= 20)
    assert payloads(sub, topic) == [b"m%d" % i for i in range(20)]  # ordered, once each
    assert {m.qos for m in sub.messages_on(topic)} == {qos}
    await run(pub.close)
    await run(sub.close)


async def test_wildcards_and_dollar_topics(mq, unique):
    u = unique("w")
    pub = Client(u + "p")
    sub = Client(u + "s")
    await run(pub.connect, mq.mqtt_ports[0])
    await run(sub.connect, mq.mqtt_ports[1])
    await run(sub.subscribe, [("#", 0), (f"+/{u}/+", 0)])
    await routed(pub, sub, f"{u}/x")
    await run(pub.publish, f"$dollar{u}/{u}/y", b"hidden", 0)   # not matched by '#' nor '+/...' [MQTT-4.7.2-1]
    await run(pub.publish, f"a/{u}/b", b"both", 0)           # '#' and '+/u/+': one copy (same client)
    await run(pub.publish, f"{u}/after", b"marker", 0)
    assert await run(sub.wait, lambda: payloads(sub, f"{u}/after") == [b"marker"])
    assert await run(sub.wait, lambda: payloads(sub, f"a/{u}/b") == [b"both"])
    # '$' topics are matched by a filter that names the first level
    await run(sub.subscribe, f"$dollar{u}/#", 0)
    await routed(pub, sub, f"$dollar{u}/{u}/z")
    assert payloads(sub, f"$dollar{u}/{u}/y") == []
    await run(pub.close)
    await run(sub.close)


async def test_overlapping_subscriptions_311_one_copy_at_max_qos(mq, unique):
    u = unique("o")
    pub = Client(u + "p", v5=False)
    sub = Client(u + "s", v5=False)
    await run(pub.connect, mq.mqtt_ports[0])
    await run(sub.connect, mq.mqtt_ports[1])
    await run(sub.subscribe, [(f"{u}/+", 1), (f"{u}/#", 2)])
    await routed(pub, sub, f"{u}/x", 2)
    await run(pub.publish, f"{u}/x", b"one", 2)
    assert await run(sub.wait, lambda: payloads(sub, f"{u}/x") == [b"one"])
    # marker: a second message on the same topic arrives after any second copy of the first
    await run(pub.publish, f"{u}/x", b"two", 2)
    assert await run(sub.wait, lambda: b"two" in payloads(sub, f"{u}/x"))
    msgs = [m for m in sub.messages_on(f"{u}/x") if m.payload == b"one"]
    assert len(msgs) == 1 and msgs[0].qos == 2
    await run(pub.close)
    await run(sub.close)


async def test_overlapping_subscriptions_v5_all_subscription_ids(mq, unique):
    u = unique("i")
    pub = Client(u + "p")
    sub = Client(u + "s")
    await run(pub.connect, mq.mqtt_ports[0])
    await run(sub.connect, mq.mqtt_ports[1])
    for sid, f in ((11, f"{u}/+"), (22, f"{u}/#")):
        p = PahoProperties(PacketTypes.SUBSCRIBE)
        p.SubscriptionIdentifier = sid
        await run(sub.subscribe, f, 1, properties=p)
    await routed(pub, sub, f"{u}/x", 1)
    await run(pub.publish, f"{u}/x", b"ids", 1)
    assert await run(sub.wait, lambda: payloads(sub, f"{u}/x") == [b"ids"])
    m = [m for m in sub.messages_on(f"{u}/x") if m.payload == b"ids"][0]
    assert sorted(m.properties.SubscriptionIdentifier) == [11, 22]
    await run(pub.close)
    await run(sub.close)


async def test_no_local(mq, unique):
    u = unique("nl")
    c = Client(u)
    other = Client(u + "o")
    await run(c.connect, mq.mqtt_ports[0])
    await run(other.connect, mq.mqtt_ports[1])
    await run(c.subscribe, f"{u}/t", options=mqtt.SubscribeOptions(qos=1, noLocal=True))
    await run(other.subscribe, f"{u}/t", 1)
    await routed(c, other, f"{u}/t", 1)
    await routed(other, c, f"{u}/t", 1)
    n = len(c.messages_on(f"{u}/t"))  # other's probes
    await run(c.publish, f"{u}/t", b"mine", 1)
    assert await run(other.wait, lambda: b"mine" in payloads(other, f"{u}/t"))
    # marker: other's message on the same topic, after c's: c gets it, and would have got its own before
    await run(other.publish, f"{u}/t", b"theirs", 1)
    assert await run(c.wait, lambda: b"theirs" in payloads(c, f"{u}/t"))
    assert b"mine" not in payloads(c, f"{u}/t") and len(c.messages_on(f"{u}/t")) == n + 1
    await run(c.close)
    await run(other.close)


async def test_retained_set_and_clear(mq, unique):
    u = unique("r")
    pub = Client(u + "p")
    await run(pub.connect, mq.mqtt_ports[0])
    await run(pub.publish, f"{u}/state", b"on", 1, True)
    # a new subscriber (other connector) gets it with retain=1; retry: its retained view may lag a little
    async def retained_to_new_subscriber():
        sub = Client(unique("rs"), v5=False)
        await run(sub.connect, mq.mqtt_ports[1])
        await run(sub.subscribe, f"{u}/+", 1)
        got = await run(sub.wait, lambda: len(sub.messages_on(f"{u}/state")) > 0, 1.0)
        await run(sub.close)
        return got and sub.messages_on(f"{u}/state")[0]

    got = await wait_until(retained_to_new_subscriber, BOUND, "the retained message on subscribe", step=0)
    assert got.retain and got.payload == b"on"
    # live subscribers get retained publishes with retain=0 (Retain As Published not set) [MQTT-3.3.1-12]
    await run(pub.publish, f"{u}/state", b"", 1, True)  # clear
    await run(pub.publish, f"{u}/later", b"m", 1, True)  # marker: retained after the clear (one partition)

    async def fresh_subscriber():
        """A new subscriber on the other connector: what it got on subscribe, once its view has the marker."""
        sub = Client(unique("rc"))
        await run(sub.connect, mq.mqtt_ports[1])
        await run(sub.subscribe, f"{u}/+", 1)
        got = await run(sub.wait, lambda: len(sub.messages_on(f"{u}/later")) > 0, 1.0)
        await run(sub.close)
        return got and sub.snapshot()

    seen = await wait_until(fresh_subscriber, BOUND, "the marker retained on the other connector", step=0)
    assert [m.topic for m in seen if m.topic == f"{u}/state"] == []  # cleared
    await run(pub.publish, f"{u}/later", b"", 1, True)
    await run(pub.close)


async def test_will_on_ungraceful_close(mq, unique):
    u = unique("will")
    watcher, prober = await watcher_and_prober(u, mq.mqtt_ports, 1)

    from tbmq_mqtt import Connect, Will, encode
    # 3.1.1, no delay: published at once on a dropped connection
    s = await run(raw_socket, mq.mqtt_ports[0])
    s.sendall(encode(Connect(protocol_level=4, client_id=u + "a", keep_alive=30,
                             will=Will(topic=f"{u}/a", payload=b"dead", qos=1)), 4))
    assert (await run(s.recv, 4))[:2] == b"\x20\x02"
    s.close()
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/a") == [b"dead"])

    # v5 DISCONNECT 0x04: Disconnect with Will Message
    c = Client(u + "d")
    await run(c.connect, mq.mqtt_ports[0], will=(f"{u}/d", b"asked", 1, False))
    c.c.disconnect(reasoncode=mqtt.ReasonCode(PacketTypes.DISCONNECT, identifier=4))
    c.stop_loop()
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/d") == [b"asked"])
    # normal DISCONNECT: none
    sent = (await connector_health(mq, 1))["wills_sent"]
    async with Tail(mq.bootstrap_servers, SESSION_EVENT_REQUEST) as tail:
        c = Client(u + "e")
        await run(c.connect, mq.mqtt_ports[0], will=(f"{u}/e", b"no", 1, False))
        await run(c.close)
        await disconnect_reported(tail, u + "e")  # the connector is done with the connection's end
    assert (await connector_health(mq, 1))["wills_sent"] == sent
    await run(prober.publish, f"{u}/marker2", b"m", 1)
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/marker2") == [b"m"])
    assert payloads(watcher, f"{u}/e") == []
    await run(watcher.close)
    await run(prober.close)


async def test_keep_alive_expiry(mq, unique):
    u = unique("ka")
    watcher, prober = await watcher_and_prober(u, mq.mqtt_ports, 0)
    from tbmq_mqtt import Connect, Will, encode
    s = await run(raw_socket, mq.mqtt_ports[0])
    s.sendall(encode(Connect(protocol_level=4, client_id=u, keep_alive=1,
                             will=Will(topic=f"{u}/gone", payload=b"ka")), 4))
    t0 = time.monotonic()
    await run(recv_until_closed, s, 10)  # closed by the server (it fails if not)
    assert time.monotonic() - t0 >= 1.2  # not before 1.5 x keep alive [MQTT-3.1.2-22] (minus the send time)
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/gone") == [b"ka"])
    await run(watcher.close)
    await run(prober.close)


async def test_v5_outbound_topic_aliases(mq, unique):
    """A paho 5.0 subscriber with Topic Alias Maximum 2: the connector sends a topic's name once with an alias,
    then the alias alone (paho hands the aliased PUBLISH over with an empty topic and the TopicAlias property)."""
    u = unique("ta")
    pub = Client(u + "p")
    sub = Client(u + "s")
    await run(pub.connect, mq.mqtt_ports[0])
    await run(sub.connect, mq.mqtt_ports[1], TopicAliasMaximum=2)
    await run(sub.subscribe, f"{u}/#", 1)
    # routed, with a new topic per probe (each arrives with its name, whatever alias it takes)
    for i in range(100):
        await run(pub.publish, f"{u}/probe{i}", b"probe", 1)
        if await run(sub.wait, lambda: any(m.payload == b"probe" for m in sub.snapshot()), 0.5):
            break
    for i in range(3):
        await run(pub.publish, f"{u}/a", b"m%d" % i, 1)
    assert await run(sub.wait, lambda: len([m for m in sub.snapshot() if m.payload.startswith(b"m")]) == 3)
    first, *rest = [m for m in sub.snapshot() if m.payload.startswith(b"m")]
    alias = first.properties.TopicAlias
    assert first.topic == f"{u}/a" and 1 <= alias <= 2                  # [MQTT-3.3.2-11]
    assert [(m.topic, m.properties.TopicAlias, m.payload) for m in rest] == [("", alias, b"m1"), ("", alias, b"m2")]
    await run(pub.close)
    await run(sub.close)


async def test_v5_reason_string_on_disconnect(mq, unique):
    """A session taken over by a newer connection (other connector): DISCONNECT 0x8E with a Reason String, sent
    also to a client that set Request Problem Information 0 (DISCONNECT may always carry one)."""
    u = unique("rs")
    old = Client(u)
    await run(old.connect, mq.mqtt_ports[0], RequestProblemInformation=0)
    new = Client(u)
    await run(new.connect, mq.mqtt_ports[1])
    assert await run(old.wait, lambda: old.disconnected is not None)
    assert old.disconnected.value == 0x8E
    assert old.disconnect_properties.ReasonString == "session taken over by a newer connection"
    await run(new.close)
    old.stop_loop()


async def test_v5_response_information_when_requested(mq, unique):
    u = unique("ri")
    c = Client(u)
    _flags, rc, props = await run(c.connect, mq.mqtt_ports[0], RequestResponseInformation=1)
    assert props.ResponseInformation == "resp/"             # MQTT_RESPONSE_INFORMATION of this suite
    await run(c.close)
    c = Client(u + "n")
    _flags, rc, props = await run(c.connect, mq.mqtt_ports[0])
    assert not hasattr(props, "ResponseInformation")        # not asked: not sent [MQTT-3.1.2-28]
    await run(c.close)


async def test_unsubscribe(mq, unique):
    u = unique("un")
    pub = Client(u + "p")
    sub = Client(u + "s")
    ctl = Client(u + "c")
    for c, port in ((pub, 0), (sub, 1), (ctl, 1)):
        await run(c.connect, mq.mqtt_ports[port])
    await run(sub.subscribe, f"{u}/t", 1)
    await run(sub.subscribe, f"{u}/m", 1)
    await run(ctl.subscribe, f"{u}/t", 1)
    await routed(pub, sub, f"{u}/t", 1)
    await routed(pub, sub, f"{u}/m", 1)
    await routed(pub, ctl, f"{u}/t", 1)
    await run(sub.c.unsubscribe, f"{u}/t")
    # until the router has the change, `sub` may still get copies. Each probe on u/t is followed by a
    # marker on u/m, which sub keeps: in order (one partition), so once sub has the marker it has the
    # probe too unless unsubscribed. Wait for a probe that reaches ctl but not sub; then nothing more may.
    marks = iter(range(10_000))

    async def probe_missed_by_sub() -> bool:
        i = next(marks)
        p, m = f"after-{i}".encode(), f"mark-{i}".encode()
        await run(pub.publish, f"{u}/t", p, 1)
        await run(pub.publish, f"{u}/m", m, 1)
        assert await run(ctl.wait, lambda: any(x.payload == p for x in ctl.messages_on(f"{u}/t")))
        assert await run(sub.wait, lambda: any(x.payload == m for x in sub.messages_on(f"{u}/m")))
        return not any(x.payload == p for x in sub.messages_on(f"{u}/t"))

    await wait_until(probe_missed_by_sub, BOUND, "the unsubscribe effective", step=0)
    n = len(sub.messages_on(f"{u}/t"))
    await run(pub.publish, f"{u}/t", b"final", 1)
    await run(pub.publish, f"{u}/m", b"final-mark", 1)
    assert await run(ctl.wait, lambda: any(m.payload == b"final" for m in ctl.messages_on(f"{u}/t")))
    assert await run(sub.wait, lambda: any(m.payload == b"final-mark" for m in sub.messages_on(f"{u}/m")))
    assert len(sub.messages_on(f"{u}/t")) == n
    for c in (pub, sub, ctl):
        await run(c.close)


async def test_amqtt_client_round_trip(mq, unique):
    from amqtt.client import MQTTClient

    u = unique("am")
    sub = MQTTClient(client_id=u + "s")
    pub = MQTTClient(client_id=u + "p")
    await sub.connect(f"mqtt://127.0.0.1:{mq.mqtt_ports[1]}/")
    await pub.connect(f"mqtt://127.0.0.1:{mq.mqtt_ports[0]}/")
    try:
        await sub.subscribe([(f"{u}/t", 1)])
        async def delivered():  # publish until the router knows the subscription
            await pub.publish(f"{u}/t", b"hello-amqtt", qos=1)
            try:
                return await sub.deliver_message(timeout_duration=0.7)
            except asyncio.TimeoutError:
                return None

        got = await wait_until(delivered, BOUND, "the amqtt subscription routed", step=0)
        assert got.data == b"hello-amqtt" and got.topic == f"{u}/t"
        # QoS 2 from amqtt
        await pub.publish(f"{u}/t", b"q2", qos=2)
        msg = await sub.deliver_message(timeout_duration=BOUND)
        while msg.data != b"q2":
            msg = await sub.deliver_message(timeout_duration=BOUND)
        assert msg.qos == 1  # min(publish 2, subscription 1)
    finally:
        await sub.disconnect()
        await pub.disconnect()


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto-clients not installed")
@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
async def test_mosquitto_clients(mq, unique, version):
    u = unique("mo")
    topic = f"{u}/t"
    sub = subprocess.Popen(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(mq.mqtt_ports[1]), "-V", version,
                            "-t", topic, "-q", "2", "-C", "1", "-i", u + "s", "-W", str(int(BOUND) + 10),
                            "-F", "%t|%p|%q"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        attempts = iter(range(1, 10_000))

        async def received() -> bool:  # publish until mosquitto_sub got one (-C 1) and exited
            await run(subprocess.run, ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(mq.mqtt_ports[0]),
                                       "-V", version, "-t", topic, "-m", "from-mosquitto", "-q", "2",
                                       "-i", f"{u}p{next(attempts)}"], check=True, timeout=BOUND)
            return bool(await poll(lambda: sub.poll() is not None, 0.3))

        await wait_until(received, BOUND, "mosquitto_sub to receive", step=0)
        out, err = await run(sub.communicate, timeout=BOUND)
        assert sub.returncode == 0, err
        assert out.strip() == f"{topic}|from-mosquitto|2"
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()


async def test_bad_input_does_not_affect_others(mq, unique):
    u = unique("bad")
    pub = Client(u + "p")
    sub = Client(u + "s", v5=False)
    await run(pub.connect, mq.mqtt_ports[0])
    await run(sub.connect, mq.mqtt_ports[0])
    await run(sub.subscribe, f"{u}/t", 1)
    await routed(pub, sub, f"{u}/t", 1)
    # garbage, a 268 MB remaining length, a half packet then silence, a client that never reads
    bad = []
    for data in (b"\x00\x01garbage", b"\x10\xff\xff\xff\x7f", b"\x10\x10\x00\x04MQ"):
        s = await run(raw_socket, mq.mqtt_ports[0])
        s.sendall(data)
        bad.append(s)
    for s in bad:
        await run(recv_until_closed, s, 10)
    # a subscriber that never reads its socket while many messages are routed to it
    from tbmq_mqtt import Connect, Subscribe, Subscription, encode
    lazy = socket.create_connection(("127.0.0.1", mq.mqtt_ports[0]))
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lazy.sendall(encode(Connect(protocol_level=4, client_id=u + "lazy", keep_alive=0), 4))
    lazy.sendall(encode(Subscribe(1, [Subscription(f"{u}/t", 0)]), 4))
    await routed(pub, sub, f"{u}/t", 1)  # lazy's subscription was written before this one's probe
    big = b"x" * 60000
    for i in range(100):
        await run(pub.publish, f"{u}/t", big, 0, wait=False)
    await run(pub.publish, f"{u}/t", b"last", 1)
    assert await run(sub.wait, lambda: any(m.payload == b"last" for m in sub.messages_on(f"{u}/t")))
    lazy.close()
    for proc in mq.instances_of("connector"):
        assert proc.running
    await run(pub.close)
    await run(sub.close)


async def test_response_topic_must_be_a_topic_name(mq, unique):
    """MQTT 5.0 [MQTT-3.3.2-14], paho-mqtt 5.0 next to working clients: a PUBLISH whose Response Topic has a
    wildcard gets DISCONNECT 0x82 (Protocol Error) and is not forwarded; a CONNECT whose Will carries one
    gets CONNACK 0x82; a valid Response Topic is forwarded unaltered with its Correlation Data
    [MQTT-3.3.2-15] [MQTT-3.3.2-16]."""
    from tbmq_mqtt import ReasonCode
    u = unique("rtopic")
    watcher, prober = await watcher_and_prober(u, mq.mqtt_ports, 1)
    req = f"{u}/req"
    ok = PahoProperties(PacketTypes.PUBLISH)
    ok.ResponseTopic, ok.CorrelationData = f"{u}/reply/1", b"corr-1"
    await run(prober.publish, req, b"ok", 1, properties=ok)
    assert await run(watcher.wait, lambda: payloads(watcher, req) == [b"ok"])
    got = real(watcher.messages_on(req))[0].properties
    assert (got.ResponseTopic, got.CorrelationData) == (f"{u}/reply/1", b"corr-1")

    bad = Client(u + "bad")
    await run(bad.connect, mq.mqtt_ports[0])
    wild = PahoProperties(PacketTypes.PUBLISH)
    wild.ResponseTopic = f"{u}/reply/+"
    await run(bad.publish, req, b"bad", 0, properties=wild)
    assert await run(bad.wait, lambda: bad.disconnected is not None), "no DISCONNECT"
    assert bad.disconnected.value == ReasonCode.PROTOCOL_ERROR
    await run(bad.close)
    # published after the refusal, on the same connector and topic: it arrives, the refused one never did
    await run(prober.publish, req, b"after", 1)
    assert await run(watcher.wait, lambda: b"after" in payloads(watcher, req))
    assert payloads(watcher, req) == [b"ok", b"after"]

    will_props = PahoProperties(PacketTypes.WILLMESSAGE)
    will_props.ResponseTopic = f"{u}/reply/#"
    refused = Client(u + "will")
    connack = await run(refused.connect, mq.mqtt_ports[1], will=(f"{u}/will", b"w", 1, False, will_props),
                        expect_ok=False)
    assert connack is not None and connack[1].value == ReasonCode.PROTOCOL_ERROR, connack
    await run(refused.close)
    for proc in mq.instances_of("connector"):
        assert proc.running
    await run(watcher.close)
    await run(prober.close)


@pytest.mark.parametrize("v5", [True, False])
async def test_a_client_id_naming_a_shared_groups_store_is_refused(mq, unique, v5):
    """Issue 14, names that cannot collide: a shared DEVICE group's messages are stored under
    "$share/<share>/<filter>"; a client connecting with that id would read and acknowledge the group's
    backlog. CONNACK Client Identifier not valid (v5 0x85, 3.1.1 return code 2 [MQTT-3.1.3-8])."""
    u = unique("res")
    c = Client(f"$share/{u}/t", v5=v5)
    flags, rc, _ = await run(c.connect, mq.mqtt_ports[0], expect_ok=False)
    assert rc.is_failure and rc.value == 0x85  # paho reports 3.1.1 return code 2 as this same reason code
    await run(c.close)
    ok = Client(f"ss_{u}_t", v5=v5)  # TBMQ's store id form is an ordinary client id here
    await run(ok.connect, mq.mqtt_ports[0])
    await run(ok.close)
