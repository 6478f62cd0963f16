"""Persistent DEVICE sessions end to end through the suite (session-registry, device-persistence, router,
two connectors; real Kafka and Redis) with paho-mqtt subscribers, MQTT 3.1.1 (clean_session=False) and
5.0 (clean_start=False, Session Expiry Interval > 0):

  subscribe QoS 1, go offline, 10,000 QoS 1 messages published, reconnect (on the other connector):
  every message arrives, in order (a sequence number in the payload), and the store ends empty (the
  PUBACKs reached device-persistence).

Every blocking paho wait runs in a thread (asyncio.to_thread): the launcher pumps the services' output
on the test's event loop, which must never block.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

from device_persistence.store import DeviceMsgStore, StoreConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

TOTAL = 10_000
SERVICES = ["session-registry", "device-persistence", "router", "connector"]


@pytest.fixture(scope="module")
async def stack(kafka, tmp_path_factory):
    s = Suite(services=SERVICES, connectors=2, ports="free", log_format="json", id_tag=new_tag(),
              run_dir=tmp_path_factory.mktemp("suite-dp-e2e"), start_timeout=90, stop_timeout=15,
              kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


class Sub:
    """A paho client collecting received messages (payload = decimal sequence number)."""

    def __init__(self, client_id: str, v5: bool, clean: bool) -> None:
        self.v5, self.clean = v5, clean
        kw = {} if v5 else {"clean_session": clean}
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311, **kw)
        self.cond = threading.Condition()
        self.seqs: list[int] = []
        self.dups = 0
        self.connack = None
        self.suback = None
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_subscribe = self._on_subscribe

    def _on_connect(self, client, userdata, flags, rc, props):
        with self.cond:
            self.connack = (flags, rc)
            self.cond.notify_all()

    def _on_message(self, client, userdata, msg):
        with self.cond:
            self.seqs.append(int(msg.payload))
            self.dups += msg.dup
            self.cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, rcs, props):
        with self.cond:
            self.suback = rcs
            self.cond.notify_all()

    def wait(self, pred, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def connect(self, port: int):
        kw = {}
        if self.v5:
            p = Properties(PacketTypes.CONNECT)
            p.SessionExpiryInterval = 3600
            kw = {"clean_start": self.clean, "properties": p}
        self.c.connect("127.0.0.1", port, keepalive=60, **kw)
        self.c.loop_start()
        assert self.wait(lambda: self.connack is not None, 30), "no CONNACK"
        assert not self.connack[1].is_failure, self.connack
        return self.connack[0]

    def subscribe(self, topic: str) -> None:
        self.c.subscribe(topic, qos=1)
        assert self.wait(lambda: self.suback is not None, 30), "no SUBACK"
        assert [rc.value for rc in self.suback] == [1], self.suback

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def publish_all(port: int, topic: str, seqs, client_id: str) -> None:
    """QoS 1 publishes from one clean 3.1.1 client, waiting for every PUBACK."""
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
    pub.max_inflight_messages_set(200)
    pub.max_queued_messages_set(0)
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    try:
        infos = [pub.publish(topic, b"%d" % s, qos=1) for s in seqs]
        deadline = time.monotonic() + 180
        for info in infos:
            info.wait_for_publish(max(0.1, deadline - time.monotonic()))
        assert all(i.is_published() for i in infos), "not every PUBLISH was acknowledged"
    finally:
        pub.disconnect()
        pub.loop_stop()


async def stored_count(stack: Suite, client_id: str) -> int:
    store = DeviceMsgStore(StoreConfig(redis_url=stack.redis_url,
                                       cluster_nodes=tuple(stack.redis_cluster_nodes or ())))
    await store.start()
    try:
        return len(await store.fetch_undelivered(client_id))
    finally:
        await store.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("v5", [False, True], ids=["mqtt311", "mqtt5"])
async def test_offline_10000_then_reconnect_all_in_order(stack, v5):
    u = f"dp-e2e-{'v5' if v5 else 'v311'}-{uuid.uuid4().hex[:6]}"
    topic = f"{u}/data"
    port_a, port_b = stack.mqtt_ports

    sub = Sub(u, v5, clean=False)
    await asyncio.to_thread(sub.connect, port_a)
    await asyncio.to_thread(sub.subscribe, topic)
    # the subscription reached the router: a probe is delivered live
    await asyncio.to_thread(publish_all, port_b, topic, [-1], u + "-probe")
    assert await asyncio.to_thread(sub.wait, lambda: -1 in sub.seqs, 30), "probe not routed"
    await asyncio.to_thread(sub.close)
    await asyncio.sleep(1.0)  # the registry records the disconnect

    await asyncio.to_thread(publish_all, port_a, topic, range(TOTAL), u + "-pub")

    # all stored (the router's copies went through tbmq.msg.persisted into Redis)
    deadline = time.monotonic() + 120
    while (n := await stored_count(stack, u)) < TOTAL:
        assert time.monotonic() < deadline, f"only {n} of {TOTAL} stored"
        await asyncio.sleep(0.5)

    back = Sub(u, v5, clean=False)
    flags = await asyncio.to_thread(back.connect, port_b)
    assert (flags.session_present if v5 else flags.session_present), flags
    got_all = await asyncio.to_thread(back.wait, lambda: len(back.seqs) >= TOTAL, 180)
    assert got_all, f"{len(back.seqs)} of {TOTAL} received"
    assert back.seqs == list(range(TOTAL)), (
        f"first difference at {next((i for i, s in enumerate(back.seqs) if s != i), None)}")

    deadline = time.monotonic() + 60  # PUBACKs reached the store
    while (n := await stored_count(stack, u)) > 0:
        assert time.monotonic() < deadline, f"{n} still stored after every PUBACK"
        await asyncio.sleep(0.5)
    await asyncio.to_thread(back.close)


@pytest.mark.timeout(600)
async def test_messages_published_while_reconnecting_arrive_in_order(stack):
    """2,000 messages stored while offline, then 3,000 more published while the client reconnects:
    every message arrives, in order; QoS 1 duplicates are tolerated only as repeats."""
    u = f"dp-e2e-race-{uuid.uuid4().hex[:6]}"
    topic = f"{u}/data"
    port_a, port_b = stack.mqtt_ports
    sub = Sub(u, True, clean=False)
    await asyncio.to_thread(sub.connect, port_a)
    await asyncio.to_thread(sub.subscribe, topic)
    await asyncio.to_thread(publish_all, port_b, topic, [-1], u + "-probe")
    assert await asyncio.to_thread(sub.wait, lambda: -1 in sub.seqs, 30), "probe not routed"
    await asyncio.to_thread(sub.close)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(publish_all, port_a, topic, range(2000), u + "-pub1")

    live = asyncio.create_task(asyncio.to_thread(publish_all, port_a, topic, range(2000, 5000), u + "-pub2"))
    await asyncio.sleep(0.2)
    back = Sub(u, True, clean=False)
    await asyncio.to_thread(back.connect, port_b)
    await live
    got_all = await asyncio.to_thread(back.wait, lambda: len(set(back.seqs)) >= 5000, 180)
    assert got_all, f"{len(set(back.seqs))} of 5000 distinct received"
    assert list(dict.fromkeys(back.seqs)) == list(range(5000))
    assert len(back.seqs) - 5000 <= back.dups
    await asyncio.to_thread(back.close)
