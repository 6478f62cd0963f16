"""Routing table of the router, verified on the output topics of a real Kafka with TWO router instances."""

from __future__ import annotations

import time

import pytest

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics

from router_harness import TopicReader, downlinks, hexid, sub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def by_payload(dls: list[pb.BasicDownlink]) -> dict[bytes, pb.BasicDownlink]:
    return {d.msg.payload: d for d in dls}  # de-duplicates at-least-once redeliveries


def recipients(d: pb.BasicDownlink) -> dict[str, tuple[int, bool, list[int]]]:
    return {r.client_id: (r.qos, r.retain, sorted(r.subscription_ids)) for r in d.recipients}


async def test_routing_table_two_routers(kafka, writer, start_routers):
    P = hexid()
    cA, cB = f"connA{P}", f"connB{P}"
    w = writer
    # --- state, written BEFORE the routers start (they rebuild it before routing) -----------------
    # live, overlapping subscriptions (max QoS, all ids), QoS min, two connectors
    await w.session(f"dev1{P}", service_id=cA)
    await w.subscriptions(f"dev1{P}", sub(f"{P}/live/+", 1, subscription_id=5), sub(f"{P}/live/#", 2, subscription_id=6))
    await w.session(f"dev2{P}", service_id=cB)
    await w.subscriptions(f"dev2{P}", sub(f"{P}/live/#", 0))
    # persistent DEVICE, offline
    await w.session(f"pdev{P}", connected=False, persistent=True)
    await w.subscriptions(f"pdev{P}", sub(f"{P}/pers", 1, subscription_id=11))
    # persistent APPLICATION (its topic does not exist: the router creates it)
    await w.session(f"app{P}", service_id=cA, app=True, persistent=True)
    await w.subscriptions(f"app{P}", sub(f"{P}/app/#", 2), app=True)
    # shared DEVICE group, members on both connectors
    for m, c in (("s1", cA), ("s2", cB)):
        await w.session(f"{m}{P}", service_id=c)
        await w.subscriptions(f"{m}{P}", sub(f"{P}/shared", 1, share_name="g"))
    # shared APPLICATION
    await w.session(f"sa{P}", service_id=cA, app=True, persistent=True)
    await w.subscriptions(f"sa{P}", sub(f"{P}/sapp/+", 1, share_name="ga"), app=True)
    # no-local
    await w.session(f"nl{P}", service_id=cA)
    await w.subscriptions(f"nl{P}", sub(f"{P}/nl", 1, no_local=True))
    # retain-as-published
    await w.session(f"rap1{P}", service_id=cA)
    await w.subscriptions(f"rap1{P}", sub(f"{P}/rap", 1, retain_as_published=True))
    await w.session(f"rap0{P}", service_id=cA)
    await w.subscriptions(f"rap0{P}", sub(f"{P}/rap", 1))
    # $ topics: a first-level wildcard does not match them
    await w.session(f"dw{P}", service_id=cA)
    await w.subscriptions(f"dw{P}", sub(f"+/{P}/dollar", 1))
    await w.session(f"dx{P}", service_id=cA)
    await w.subscriptions(f"dx{P}", sub(f"$SYS/{P}/dollar", 1))
    # expiry
    await w.session(f"ex{P}", service_id=cB)
    await w.subscriptions(f"ex{P}", sub(f"{P}/exp", 1))

    suite = await start_routers(2)
    assert len(suite.instances_of("router")) == 2

    # --- publishes ---------------------------------------------------------------------------------
    now = int(time.time() * 1000)
    trace_id = hexid() + hexid() + "abcdefghijkl"[:12]
    trace_id = (trace_id.encode().hex())[:32]
    traceparent = f"00-{trace_id}-b7ad6b7169203331-01".encode()
    await w.publish(f"{P}/live/x", b"live", qos=1, headers=[("traceparent", traceparent)])
    await w.publish(f"{P}/pers", b"pers", qos=2)
    await w.publish(f"{P}/app/1", b"app", qos=2)
    for i in range(4):
        await w.publish(f"{P}/shared", b"shared%d" % i, qos=1)
    await w.publish(f"{P}/sapp/z", b"sapp", qos=2)
    await w.publish(f"{P}/nl", b"nl-own", publisher=f"nl{P}")
    await w.publish(f"{P}/nl", b"nl-other", publisher="someone")
    await w.publish(f"{P}/rap", b"rap", retain=True)
    await w.publish(f"$SYS/{P}/dollar", b"dollar")
    await w.publish(f"{P}/exp", b"expired", created_at_ms=now - 10_000, message_expiry_interval=1)
    await w.publish(f"{P}/exp", b"fresh", created_at_ms=now, message_expiry_interval=3600)

    # --- connector A / B downlinks -----------------------------------------------------------------
    ra = TopicReader(kafka.bootstrap_servers, topics.downlink_basic_topic(cA))
    rb = TopicReader(kafka.bootstrap_servers, topics.downlink_basic_topic(cB))
    need_a = {b"live", b"nl-other", b"rap", b"dollar"}
    need_b = {b"live", b"fresh"}
    shared = {b"shared%d" % i for i in range(4)}

    def got(reader_need):
        def done(records):
            payloads = {d.msg.payload for d in downlinks(records)}
            return reader_need <= payloads
        return done

    await ra.poll_until(got(need_a))
    await rb.poll_until(got(need_b))
    deadline = time.monotonic() + 30
    while not shared <= {d.msg.payload for d in downlinks(ra.records) + downlinks(rb.records)}:
        assert time.monotonic() < deadline, "shared messages not all routed"
        await ra.poll_until(lambda r: True)
        await rb.poll_until(lambda r: True)
    a = by_payload(downlinks(ra.records))
    b = by_payload(downlinks(rb.records))

    # live: one record per connector; merged ids, max QoS capped by publish QoS
    assert recipients(a[b"live"]) == {f"dev1{P}": (1, False, [5, 6])}
    assert recipients(b[b"live"]) == {f"dev2{P}": (0, False, [])}
    assert a[b"live"].msg.topic == f"{P}/live/x"
    # no-local: the publisher's own message was not sent back; the other one was
    assert b"nl-own" not in a and recipients(a[b"nl-other"]) == {f"nl{P}": (1, False, [])}
    # retain as published
    assert recipients(a[b"rap"]) == {f"rap1{P}": (1, True, []), f"rap0{P}": (1, False, [])}
    # $ topic: only the explicit $SYS subscription
    assert recipients(a[b"dollar"]) == {f"dx{P}": (1, False, [])}
    # expiry: the expired message was dropped, the fresh one delivered
    assert b"expired" not in b and recipients(b[b"fresh"]) == {f"ex{P}": (1, False, [])}
    # shared DEVICE: each message to exactly one member, both members used (round robin)
    owners = {}
    for payload in shared:
        holders = [(c, d) for c, d in ((cA, a.get(payload)), (cB, b.get(payload))) if d is not None]
        assert len(holders) == 1, payload
        (c, d), = holders
        assert list(recipients(d)) == [f"s1{P}" if c == cA else f"s2{P}"]
        owners[payload] = c
    assert set(owners.values()) == {cA, cB}

    # --- persisted DEVICE --------------------------------------------------------------------------
    rp = TopicReader(kafka.bootstrap_servers, topics.MSG_PERSISTED)
    recs = await rp.poll_until(lambda rs: any(r.key == f"pdev{P}".encode() for r in rs))
    pm = [pb.PersistedMsg.FromString(r.value) for r in recs if r.key == f"pdev{P}".encode()][0]
    assert (pm.client_id, pm.msg.payload, pm.msg.qos, list(pm.msg.subscription_ids)) == (f"pdev{P}", b"pers", 1, [11])

    # --- APPLICATION topic (created by the router) -------------------------------------------------
    rapp = TopicReader(kafka.bootstrap_servers, topics.app_topic(f"app{P}").name)
    recs = await rapp.poll_until(lambda rs: len(rs) >= 1)
    m = pb.PublishMsg.FromString(recs[0].value)
    assert (m.payload, m.qos, recs[0].key) == (b"app", 2, f"{P}/app/1".encode())

    # --- shared APPLICATION topic (created by the router) ------------------------------------------
    spec = topics.shared_app_topic(f"{P}/sapp/+")
    assert spec.name == f"tbmq.msg.app.shared.{P}.sapp._slw"
    rs = TopicReader(kafka.bootstrap_servers, spec.name)
    recs = await rs.poll_until(lambda rs: len(rs) >= 1)
    m = pb.PublishMsg.FromString(recs[0].value)
    assert (m.payload, m.qos) == (b"sapp", 1)

    # --- trace context continued into the produced records (same trace id) --------------------------
    for reader in (ra, rb):
        rec = next(r for r in reader.records if pb.BasicDownlink.FromString(r.value).msg.payload == b"live")
        assert dict(rec.headers)["traceparent"].split(b"-")[1] == trace_id.encode()

    for r in (ra, rb, rp, rapp, rs):
        await r.stop()
