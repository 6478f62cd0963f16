"""Shared DEVICE group stores handed to a persistent member: the pure pieces (GroupStores, the local packet id
-> (store id, store packet id) mapping through the window) and a Connection driven with a fake service and
transport (connector_fakes: no Kafka, no gRPC): fetch + hold, serial dedupe, QoS capping, PUBACK/PUBREC/PUBCOMP acknowledging the
group store entry, detach on unsubscribe and on the end of the connection."""

from __future__ import annotations

import pytest
from connector.connection import Connection
from connector_fakes import FakePort, connected, until
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection.convert import topic_subscription
from tbmq_connection.flow import DEVICE, GROUP, GroupRef, GroupStores, OutboundWindow, OutMsg, upstream_ack
from tbmq_mqtt import Connect, PubAck, PubComp, PubRec, PubRel, Subscribe, Subscription, Unsubscribe
from tbmq_routing import shared_store_id

pytestmark = pytest.mark.unit

STORE = shared_store_id("g", "jobs/#")


# ------------------------------------------------------------------------------------------ pure pieces
def test_group_stores_attach_hold_dedupe_detach():
    g = GroupStores()
    assert g.begin(STORE, ("g", "jobs/#")) and STORE in g and g.fetching(STORE)
    assert not g.begin(STORE, ("g", "jobs/#"))  # already attached: no second fetch
    assert g.hold(STORE, "f1") and g.hold(STORE, "f2")
    assert g.fetched(STORE) == ["f1", "f2"] and not g.fetching(STORE)
    assert not g.hold(STORE, "f3")  # fetch done: delivered at once
    assert g.accept(STORE, 5) and not g.accept(STORE, 5) and not g.accept(STORE, 3) and g.accept(STORE, 6)
    assert g.attached() == [STORE] and g.key(STORE) == ("g", "jobs/#")
    assert g.detach(STORE) and not g.detach(STORE) and STORE not in g
    # attached again in the same connection: fetch again, but what was delivered is not sent twice
    assert g.begin(STORE, ("g", "jobs/#"))
    g.fetched(STORE)
    assert not g.accept(STORE, 6) and g.accept(STORE, 7)


def test_group_messages_get_live_ids_and_map_back_to_the_store():
    """The group store's packet ids (1, 2) collide with the member's own stored ids (1, 2): group messages
    take ids of the live allocator and their acks map back to (store id, store packet id, serial)."""
    w = OutboundWindow(window=10, max_queued=10)
    w.offer(OutMsg(qos=1, kind=DEVICE, fixed_id=1, ref=10), force=True)
    w.offer(OutMsg(qos=1, kind=GROUP, ref=GroupRef(STORE, 1, 100)), force=True)
    w.offer(OutMsg(qos=2, kind=GROUP, ref=GroupRef(STORE, 2, 101)), force=True)
    w.offer(OutMsg(qos=1, kind=DEVICE, fixed_id=2, ref=11), force=True)
    sent = w.ready()
    assert [m.kind for m in sent] == [DEVICE, GROUP, GROUP, DEVICE]  # order kept
    ids = [m.packet_id for m in sent]
    assert ids[0] == 1 and ids[3] == 2 and len(set(ids)) == 4 and not {ids[1], ids[2]} & {1, 2}
    own, g1, g2, own2 = sent
    assert upstream_ack(own, "member") == ("member", 1, 10)
    assert upstream_ack(own2, "member") == ("member", 2, 11)
    assert w.on_puback(g1.packet_id) is g1 and upstream_ack(g1, "member") == (STORE, 1, 100)
    assert w.on_pubrec(g2.packet_id) is g2 and upstream_ack(g2, "member") == (STORE, 2, 101)
    assert w.on_pubcomp(g2.packet_id) is g2
    assert upstream_ack(OutMsg(qos=1), "member") is None  # live: nothing upstream


# ------------------------------------------------------------------------------------------ a Connection
async def member(*, qos: int = 1, sub_id: int = 0, level: int = 5, plain: bool = False,
                 persistent: bool = True) -> tuple[FakePort, Connection]:
    """A persistent DEVICE member connected through the adapter (FakePort: no Kafka, no gRPC) whose stored
    session has the shared subscription: its own store and the group store are fetched at CONNACK. The own
    store's fetch is answered empty here."""
    subs = {("g", "jobs/#"): topic_subscription("g", "jobs/#", qos, subscription_id=sub_id)}
    if plain:
        subs[("", "plain/#")] = topic_subscription("", "plain/#", 1)
    resp = pb.SessionEventResponse(success=True, session_present=True, session_expiry_interval=60,
                                   persistent=persistent, client_type=pb.CLIENT_TYPE_DEVICE)
    port = FakePort(resp, subs=subs)
    conn, transport, (connack, *_) = await connected(
        port, Connect(protocol_level=level, client_id="member", clean_start=False, keep_alive=0))
    assert connack.session_present
    conn.transport = transport
    if persistent:
        await until(lambda: ("member", conn.session_id) in port.device.of("fetch"))
        port.device.answer("member", [])
        await until(lambda: not conn.m.fetching)
    return port, conn


def stored(serial: int, pid: int, payload: bytes, qos: int = 1, *, pubrel: bool = False,
           redelivery: bool = False) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(
        client_id=STORE, packet_id=pid, serial=serial, redelivery=redelivery,
        packet_type=pb.DEVICE_PACKET_TYPE_PUBREL if pubrel else pb.DEVICE_PACKET_TYPE_PUBLISH,
        msg=pb.PublishMsg(topic="jobs/1", qos=qos, payload=payload, created_at_ms=1))


def inflight(conn: Connection) -> dict[int, OutMsg]:
    return dict(conn.m.out.inflight)


def client_sends(conn: Connection, packet) -> None:
    """A packet from the client, straight into the machine (what the adapter's packet loop does)."""
    conn.m.packet(packet, 0)
    conn._drain()


async def test_member_fetches_the_group_store_and_acks_map_back():
    svc, conn = await member()
    await until(lambda: (STORE, conn.session_id) in svc.device.of("fetch"))
    assert svc.by_store == {STORE: conn}
    # a forward arriving during the fetch is held; it is also in the answer (serial 2): sent once
    conn.on_group_persisted(stored(2, 2, b"b"))
    conn.on_group_persisted(stored(3, 3, b"c"))
    assert not conn.m.out.inflight
    svc.device.answer(STORE, [stored(1, 1, b"a", redelivery=True), stored(2, 2, b"b")])
    await until(lambda: len(inflight(conn)) == 3)
    msgs = sorted(inflight(conn).values(), key=lambda m: m.ref.serial)
    assert [m.publish.payload for m in msgs] == [b"a", b"b", b"c"]
    assert [m.publish.dup for m in msgs] == [True, False, False]  # "a" was handed out before: maybe sent
    assert all(m.kind == GROUP and m.fixed_id is None for m in msgs)
    # local ids come from the live allocator (not the store's 1, 2, 3)
    assert not {m.packet_id for m in msgs} & {1, 2, 3}
    # the member's PUBACK of the local id acknowledges the group store entry
    client_sends(conn, PubAck(msgs[1].packet_id))
    assert svc.device.of("ack") == [(STORE, 2)]
    # a later forward is delivered at once (no hold), an old serial is skipped
    conn.on_group_persisted(stored(2, 2, b"b"))
    conn.on_group_persisted(stored(4, 4, b"d"))
    assert sorted(m.ref.serial for m in conn.m.out.inflight.values()) == [1, 3, 4]
    # the end of the connection detaches the group store (and the member's own store)
    conn.close("test")
    assert svc.by_store == {}
    sid = conn.session_id
    assert ("detach", STORE, sid) in svc.device.calls and ("detach", "member", sid) in svc.device.calls


async def test_qos_capping_qos2_flow_and_pubrel_owed_entries():
    svc, conn = await member(qos=2)
    svc.device.answer(STORE, [stored(1, 7, b"q2", qos=2), stored(2, 8, b"done", qos=2, pubrel=True)])
    await until(lambda: len(inflight(conn)) == 1)
    (m,) = conn.m.out.inflight.values()
    assert m.qos == 2 and m.publish.qos == 2 and m.ref == GroupRef(STORE, 7, 1)
    # PUBREL owed from an earlier member: the group already got it exactly once -> acknowledged, nothing sent
    assert svc.device.of("ack") == [(STORE, 8)]
    conn.transport.data = b""
    client_sends(conn, PubRec(m.packet_id))
    assert svc.device.of("pubrec") == [(STORE, 7)]
    assert conn.transport.data == b""  # PUBREL only once the group store has the mark
    svc.device.apply_marks()
    assert conn.transport.packets(5) == [PubRel(m.packet_id)]
    client_sends(conn, PubComp(m.packet_id))
    assert svc.device.of("ack") == [(STORE, 8), (STORE, 7)]
    assert not conn.m.out.inflight
    # each went with its message's serial: the store applies it to that message only
    assert svc.device.serials == {("ack", STORE, 8): 2, ("pubrec", STORE, 7): 1, ("ack", STORE, 7): 1}

    # a member granted QoS 0: sent at QoS 0 once and acknowledged for the store at once
    svc, conn = await member(qos=0)
    conn.transport.data = b""
    svc.device.answer(STORE, [stored(1, 1, b"x", qos=1)])
    await until(lambda: svc.device.of("ack") == [(STORE, 1)])
    assert not conn.m.out.inflight
    assert conn.transport.data  # the QoS 0 PUBLISH went out


async def test_group_store_only_for_persistent_device_members_and_detached_on_unsubscribe():
    svc, conn = await member(persistent=False)  # non-persistent session: cannot keep the messages
    assert svc.device.calls == [] and svc.by_store == {}

    svc, conn = await member(plain=True)
    await until(lambda: (STORE, conn.session_id) in svc.device.of("fetch"))
    client_sends(conn, Subscribe(packet_id=4, subscriptions=[Subscription("$share/g/jobs/#", qos=1)]))
    assert [c for c in svc.device.of("fetch") if c[0] == STORE] == [(STORE, conn.session_id)]  # no second fetch
    svc.device.answer(STORE, [])
    await until(lambda: not conn.m.groups.fetching(STORE))
    conn.m.packet(Unsubscribe(packet_id=5, filters=["$share/g/jobs/#"]), 0)
    await conn._drain_awaiting()
    assert svc.device.of("detach") == [(STORE, conn.session_id)] and svc.by_store == {}
    conn.on_group_persisted(stored(1, 1, b"late"))  # no longer a member: stays in the store
    assert not conn.m.out.inflight


async def test_unsubscribed_or_gone_during_the_fetch_detaches_again():
    """The Detach sent at UNSUBSCRIBE may run before the fetch attached: a second Detach follows the fetch."""
    svc, conn = await member()
    await until(lambda: (STORE, conn.session_id) in svc.device.of("fetch"))
    conn.m.packet(Unsubscribe(packet_id=5, filters=["$share/g/jobs/#"]), 0)
    await conn._drain_awaiting()
    svc.device.answer(STORE, [stored(1, 1, b"a")])
    await until(lambda: len(svc.device.of("detach")) == 2)
    assert svc.device.of("detach") == [(STORE, conn.session_id), (STORE, conn.session_id)]
    assert not conn.m.out.inflight  # nothing delivered: it stays in the store for the group


# ------------------------------------------------------------------------------------------ re-sync
def test_group_stores_refetch_while_fetching_repeats_after():
    g = GroupStores()
    assert not g.refetch(STORE)                      # not attached: nothing to fetch
    g.begin(STORE, ("g", "jobs/#"))
    assert not g.refetch(STORE)                      # its first fetch runs: repeated after it
    assert g.hold(STORE, "f1")
    assert g.fetched(STORE) == ["f1"] and g.fetching(STORE)   # still holding for the next fetch
    assert g.hold(STORE, "f2")
    assert g.again(STORE) and not g.again(STORE)
    assert g.fetched(STORE) == ["f2"] and not g.fetching(STORE)
    assert g.refetch(STORE) and g.fetching(STORE)    # idle: a re-sync fetch starts now
    assert g.fetched(STORE) == [] and not g.again(STORE)
    g.refetch(STORE)
    g.refetch(STORE)                                 # a second re-sync while fetching: one more fetch
    assert g.detach(STORE) and not g.again(STORE)    # detached: no more fetches


def own(serial: int, payload: bytes, redelivery: bool = False) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(client_id="member", packet_id=serial, serial=serial, redelivery=redelivery,
                               msg=pb.PublishMsg(topic="me/1", qos=1, payload=payload, created_at_ms=1))


async def test_resync_fetches_again_and_delivers_only_what_was_not_delivered():
    """A forward stream opens (or ends) while the connection's first fetch runs: the connection fetches
    again after it (read only: `resync`), holding forwards meanwhile; what it already delivered (by serial)
    is not sent twice, what was saved while no stream forwarded it is delivered, in serial order."""
    port = FakePort(pb.SessionEventResponse(success=True, session_present=True, session_expiry_interval=60,
                                            persistent=True, client_type=pb.CLIENT_TYPE_DEVICE))
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="member", clean_start=False,
                                                       keep_alive=0))
    svc = port
    await until(lambda: svc.device.of("fetch") == [("member", conn.session_id)])
    conn.resync()                                    # registered on a device-persistence instance now
    assert svc.device.of("resync") == []             # not concurrently: after the running fetch
    conn.on_persisted(own(3, b"c"))                  # held
    # "a" was handed out to an earlier connection, "b" is fetched for the first time (as the store marks them)
    svc.device.answer("member", [own(1, b"a", True), own(2, b"b")])
    await until(lambda: svc.device.of("resync") == [("member", conn.session_id)])
    assert sorted(m.ref for m in conn.m.out.inflight.values()) == [1, 2, 3]
    assert conn.m.fetching                             # still holding during the re-sync fetch
    conn.on_persisted(own(4, b"d"))                  # forwarded on the new stream: held
    # handed out since: 2 (first fetch), 3 and 4 (forwarded); 5 was saved while no stream forwarded it
    svc.device.answer("member", [own(2, b"b", True), own(3, b"c", True), own(4, b"d", True), own(5, b"e")])
    await until(lambda: not conn.m.fetching)
    msgs = sorted(conn.m.out.inflight.values(), key=lambda m: m.ref)
    assert [(m.ref, m.publish.payload, m.publish.dup) for m in msgs] == [
        (1, b"a", True), (2, b"b", False), (3, b"c", False), (4, b"d", True), (5, b"e", False)]
    conn.on_persisted(own(6, b"f"))                  # after the re-sync: delivered at once
    assert max(m.ref for m in conn.m.out.inflight.values()) == 6
    # idle: a re-sync starts a fetch at once
    conn.resync()
    assert conn.m.fetching and svc.stats["resyncs"] == 1
    svc.device.answer("member", [own(5, b"e"), own(6, b"f")])
    await until(lambda: not conn.m.fetching)
    assert len(conn.m.out.inflight) == 6


async def test_resync_refetches_the_attached_group_stores():
    svc, conn = await member()
    svc.device.answer(STORE, [stored(1, 1, b"a")])
    await until(lambda: not conn.m.groups.fetching(STORE))
    conn.resync()
    await until(lambda: (STORE, conn.session_id) in svc.device.of("resync"))
    conn.on_group_persisted(stored(3, 3, b"c"))      # held during the re-sync fetch
    svc.device.answer(STORE, [stored(1, 1, b"a"), stored(2, 2, b"b")])
    await until(lambda: not conn.m.groups.fetching(STORE))
    assert sorted(m.ref.serial for m in conn.m.out.inflight.values()) == [1, 2, 3]
