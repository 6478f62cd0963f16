"""End to end with paho-mqtt through the whole suite (connectors, router, session-registry, app-delivery,
device-persistence): APPLICATION subscribers get every QoS 1 message, in order, across their absence."""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid

import pytest
from tbmq_routing.naming import app_shared_group as shared_group
from kafka_views import SessionTable, stable_with
from mqtt_clients import Client, fast_publish, has_real, mosquitto_drain, poll, real, routed, run, wait_until
from tbmq_launcher.launcher import Suite, new_tag

pytestmark = [pytest.mark.e2e]

APP_PATTERN = "app[A-Za-z0-9]*"

# v5 clients with 100 QoS 1 messages in flight and 30 s bounds on their connect/subscribe waits
Mqtt = functools.partial(Client, max_inflight=100, timeout=30.0)
# probes at QoS 1 for up to 60 s, 1 s each; a PUBACK missing after 10 s only means "next probe"
app_routed = functools.partial(routed, qos=1, timeout=60.0, probe_wait=1.0, puback_timeout=10.0,
                               puback_required=False)


@pytest.fixture(scope="module")
async def ad_e2e(kafka, tmp_path_factory):
    s = Suite(connectors=2, ports="free", log_format="json", id_tag=new_tag(),
              run_dir=tmp_path_factory.mktemp("suite-app-delivery"),
              kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
              service_env={"session-registry": {"TBMQ_APPLICATION_CLIENT_ID_PATTERNS": APP_PATTERN}},
              start_timeout=90.0, stop_timeout=15.0)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


def app_id() -> str:
    return "app" + uuid.uuid4().hex[:12]


async def subscriber_gone_offline(suite: Suite, root: str, tag: str) -> tuple[str, Client]:
    """A persistent APPLICATION subscriber to `<root>/#` on connector 1, known to the router (probes from a
    publisher on connector 2, 1000 in flight), then disconnected: its client id and the connected publisher."""
    ports = suite.mqtt_ports
    cid = app_id()
    sub = Mqtt(cid, clean=False, session_expiry=3600)
    await run(sub.connect, ports[0])
    await run(sub.subscribe, f"{root}/#", 1)
    pub = Mqtt(f"pub{tag}", max_inflight=1000)
    await run(pub.connect, ports[1])
    await app_routed(pub, sub, f"{root}/probe")
    table = await SessionTable(suite.bootstrap_servers).start()
    try:
        sub.close()
        await wait_until(lambda: table.offline(cid), 30, "the registry to mark the session offline")
    finally:
        await table.stop()
    return cid, pub


async def test_200_publishers_fan_in_to_one_application_subscriber(ad_e2e):
    ports = ad_e2e.mqtt_ports
    tag = uuid.uuid4().hex[:8]
    sub = Mqtt(app_id(), clean=False, session_expiry=3600)
    await run(sub.connect, ports[0])
    await run(sub.subscribe, f"fan/{tag}/#", 1)
    probe = Mqtt(f"probe{tag}")
    await run(probe.connect, ports[1])
    await app_routed(probe, sub, f"fan/{tag}/probe")
    probe.close()

    n_pubs, per_pub = 200, 10
    pubs = [Mqtt(f"pub{tag}n{i}") for i in range(n_pubs)]
    for i in range(0, n_pubs, 20):
        await asyncio.gather(*(run(p.connect, ports[(i + j) % 2]) for j, p in enumerate(pubs[i:i + 20])))

    def publish_all(p: Client, i: int):
        infos = [p.publish(f"fan/{tag}/{i}", f"{i}:{k}".encode(), 1, wait=False) for k in range(per_pub)]
        for info in infos:
            info.wait_for_publish(60)
            assert info.is_published()

    try:
        await asyncio.gather(*(run(publish_all, p, i) for i, p in enumerate(pubs)))
        total = n_pubs * per_pub
        assert await run(sub.wait, lambda: has_real(sub.messages, total), 120), \
            f"{len(real(sub.snapshot()))} of {total} arrived"
        got = real(sub.snapshot())
        assert {m.payload for m in got} == {f"{i}:{k}".encode() for i in range(n_pubs) for k in range(per_pub)}
        for i in range(n_pubs):  # per publisher (one MQTT topic each), in publish order
            seq = [int(m.payload.split(b":")[1]) for m in got if m.topic == f"fan/{tag}/{i}"]
            assert sorted(set(seq)) == list(range(per_pub))
            firsts = list(dict.fromkeys(seq))
            assert firsts == list(range(per_pub)), f"publisher {i} out of order: {seq}"
        assert all(m.qos == 1 for m in got)
    finally:
        for p in pubs:
            p.close()
        sub.close()


async def test_application_session_resumed_without_interval_gets_its_backlog_then_ends(ad_e2e):
    """Issue 13 for an APPLICATION client (MQTT-3.1.2-4, -5, -23): clean start 0 with no Session Expiry
    Interval resumes the session: its Kafka backlog (QoS 1 and 2) is streamed; the interval 0 then ends the
    session with the connection."""
    ports = ad_e2e.mqtt_ports
    tag = uuid.uuid4().hex[:8]
    topic = f"rs/{tag}/t"
    cid = app_id()
    sub = Mqtt(cid, clean=True, session_expiry=600)
    await run(sub.connect, ports[0])
    await run(sub.subscribe, topic, 2)
    pub = Mqtt(f"pub{tag}")
    await run(pub.connect, ports[1])
    await app_routed(pub, sub, topic)
    await run(sub.close, wait=True)
    await run(pub.publish, topic, b"q1", 1)
    await run(pub.publish, topic, b"q2", 2)

    back = Mqtt(cid, clean=False)
    flags, _, _ = await run(back.connect, ports[1])
    assert flags.session_present
    assert await run(back.wait, lambda: has_real(back.messages, 2)), [m.payload for m in back.snapshot()]
    assert [(m.payload, m.qos) for m in real(back.snapshot())] == [(b"q1", 1), (b"q2", 2)]
    await run(back.close, wait=True)
    again = Mqtt(cid, clean=False, session_expiry=600)
    flags, _, _ = await run(again.connect, ports[0])
    assert not flags.session_present
    for c in (again, pub):
        await run(c.close)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_offline_backlog_of_50000_arrives_in_order(ad_e2e):
    n = int(os.environ.get("APP_DELIVERY_E2E_BACKLOG", "50000"))
    ports = ad_e2e.mqtt_ports
    tag = uuid.uuid4().hex[:8]
    cid, pub = await subscriber_gone_offline(ad_e2e, f"bl/{tag}", tag)
    pub.close()
    t0 = time.monotonic()
    # a raw asyncio publisher (fast_publish) and mosquitto_sub: paho takes ~20 s to send 50,000 and ~10 s to
    # read them, the suite a few seconds
    await fast_publish(ports[1], f"bl/{tag}/data", range(n), f"pub{tag}b")
    pub_s = time.monotonic() - t0

    t1 = time.monotonic()
    got = await mosquitto_drain(ports[0], cid, f"bl/{tag}/#", n)  # the session's own filter: no second one
    drain_s = time.monotonic() - t1
    assert {t for t, _ in got} == {f"bl/{tag}/data"}
    assert [int(p) for _, p in got] == list(range(n)), "every message, once, in order"
    print(f"\nAPP-DELIVERY E2E: published {n} in {pub_s:.1f}s ({n / pub_s:,.0f}/s); reconnect → all received "
          f"in {drain_s:.1f}s ({n / drain_s:,.0f}/s)")


async def test_app_delivery_sigkill_mid_stream_loses_nothing(ad_e2e):
    """The subscriber drains a backlog; app-delivery is SIGKILLed half-way and restarted: every message
    still arrives (the connector reopens its stream; redeliveries carry DUP)."""
    n = 6000
    ports = ad_e2e.mqtt_ports
    tag = uuid.uuid4().hex[:8]
    cid, pub = await subscriber_gone_offline(ad_e2e, f"kill/{tag}", tag)

    def publish_all():
        infos = [pub.publish(f"kill/{tag}/data", str(i).encode(), 1, wait=False) for i in range(n)]
        for info in infos:
            info.wait_for_publish(120)
            assert info.is_published()

    await run(publish_all)
    pub.close()
    back = Mqtt(cid, clean=False, session_expiry=3600)
    await run(back.connect, ports[0])
    assert await run(back.wait, lambda: has_real(back.messages, n // 3), 120), "drain started"
    await ad_e2e.kill_service("app-delivery")
    await ad_e2e.start_service("app-delivery")
    try:
        ok = await run(back.wait, lambda: has_real(back.messages, n)
                       and {int(m.payload) for m in real(back.messages)} >= set(range(n)), 180)
        got = [int(m.payload) for m in real(back.snapshot())]
        assert ok, f"{len(set(got))} of {n} arrived"
        assert list(dict.fromkeys(got)) == list(range(n)), "first arrivals in order"
        seen: set[int] = set()
        for m in real(back.snapshot()):  # a message seen before must come again with DUP=1
            i = int(m.payload)
            if i in seen:
                assert m.dup, f"message {i} redelivered without DUP"
            seen.add(i)
    finally:
        back.close()


async def test_shared_application_group_of_3_splits_and_survives_a_member_leaving(ad_e2e):
    ports = ad_e2e.mqtt_ports
    tag = uuid.uuid4().hex[:8]
    share = f"g{tag}"
    members = [Mqtt(app_id(), clean=False, session_expiry=3600) for _ in range(3)]
    for i, m in enumerate(members):
        await run(m.connect, ports[i % 2])
        await run(m.subscribe, f"$share/{share}/sh/{tag}/#", 1)
    pub = Mqtt(f"pub{tag}", max_inflight=500)
    await run(pub.connect, ports[1])
    # the three members' app-delivery consumers joined the share's group and the rebalance is done
    await wait_until(lambda: stable_with(ad_e2e.bootstrap_servers, shared_group(share), 3), 60,
                     "the share's consumer group Stable with 3 members", step=0.2)
    # the router knows the group once one member gets a probe
    probes = iter(range(10_000))

    async def probe_arrived() -> bool:
        info = pub.publish(f"sh/{tag}/probe", f"probe-{next(probes)}".encode(), 1, wait=False)
        await run(info.wait_for_publish, 10)
        return await poll(lambda: any(any(x.payload.startswith(b"probe-") for x in m.snapshot())
                                      for m in members), 0.5)

    await wait_until(probe_arrived, 60, "the shared subscription routed", step=0)

    def publish(lo: int, hi: int):
        infos = [pub.publish(f"sh/{tag}/{k % 16}", str(k).encode(), 1, wait=False) for k in range(lo, hi)]
        for info in infos:
            info.wait_for_publish(60)
            assert info.is_published()

    def received(ms) -> set[int]:
        return {int(x.payload) for m in ms for x in real(m.snapshot())}

    try:
        await run(publish, 0, 1500)
        await wait_until(lambda: received(members) >= set(range(1500)), 60, step=0.5)
        assert received(members) >= set(range(1500)), f"{len(received(members))} of 1500"
        counts = [len(real(m.snapshot())) for m in members]
        assert sum(1 for c in counts if c > 0) >= 2, f"the load is split: {counts}"
        members[0].close()  # one member leaves (its session stays: persistent APPLICATION)
        await wait_until(lambda: stable_with(ad_e2e.bootstrap_servers, shared_group(share), 2), 60,
                         "the share's group rebalanced to the 2 members left", step=0.2)
        await run(publish, 1500, 3000)
        rest = members[1:]
        await wait_until(lambda: received(rest) >= set(range(1500, 3000)), 90, step=0.5)
        assert received(rest) >= set(range(1500, 3000)), f"{len(received(rest) & set(range(1500, 3000)))} of 1500"
    finally:
        for m in members:
            m.close()
        pub.close()
