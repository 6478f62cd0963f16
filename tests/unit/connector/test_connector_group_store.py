"""Shared DEVICE group stores handed to a persistent member: the pure pieces (GroupStores, the local packet id
-> (store id, store packet id) mapping through the window) and a Connection driven with a fake service and
transport (no Kafka, no gRPC): fetch + hold, serial dedupe, QoS capping, PUBACK/PUBREC/PUBCOMP acknowledging the
group store entry, detach on unsubscribe and on the end of the connection."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from connector.connection import CONNECTED, Connection
from connector.convert import topic_subscription
from connector.flow import DEVICE, GROUP, GroupRef, GroupStores, OutboundWindow, OutMsg, upstream_ack
from connector.settings import ConnectorSettings
from tbmq.v1 import messages_pb2 as pb
from tbmq_mqtt import PubAck, PubComp, PubRec, Unsubscribe
from tbmq_platform.settings import load
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
    take ids of the live allocator and their acks map back to (store id, store packet id)."""
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
    assert upstream_ack(own, "member") == ("member", 1)
    assert upstream_ack(own2, "member") == ("member", 2)
    assert w.on_puback(g1.packet_id) is g1 and upstream_ack(g1, "member") == (STORE, 1)
    assert w.on_pubrec(g2.packet_id) is g2 and upstream_ack(g2, "member") == (STORE, 2)
    assert w.on_pubcomp(g2.packet_id) is g2
    assert upstream_ack(OutMsg(qos=1), "member") is None  # live: nothing upstream


# ------------------------------------------------------------------------------------------ a Connection
class FakeDevice:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.answers: dict[str, asyncio.Future] = {}

    async def fetch(self, client_id, service_id, session_id, *, resync=False):
        self.calls.append(("fetch", client_id, session_id))
        if resync:
            self.calls.append(("resync", client_id, session_id))
        fut = self.answers.setdefault(client_id, asyncio.get_running_loop().create_future())
        answer = await fut
        del self.answers[client_id]  # the next fetch waits for its own answer
        return answer

    def answer(self, client_id, messages) -> None:
        fut = self.answers.setdefault(client_id, asyncio.get_running_loop().create_future())
        fut.set_result(list(messages))

    def acknowledge(self, client_id, packet_id):
        self.calls.append(("ack", client_id, packet_id))

    def mark_pubrec(self, client_id, packet_id):
        self.calls.append(("pubrec", client_id, packet_id))

    def detach(self, client_id, session_id):
        self.calls.append(("detach", client_id, session_id))

    def of(self, kind):
        return [c[1:] for c in self.calls if c[0] == kind]


class FakeService:
    def __init__(self) -> None:
        self.settings = load(ConnectorSettings, {})
        self.service_id = "c-1"
        self.device = FakeDevice()
        self.connections: set = set()
        self.by_session: dict = {}
        self.by_client: dict = {}
        self.by_store: dict = {}
        self.stats: Counter = Counter()
        self.bg: list = []

    def spawn_bg(self, coro) -> None:
        self.bg.append(asyncio.get_running_loop().create_task(coro))


class FakeTransport:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def member(*, qos: int = 1, sub_id: int = 0, level: int = 4) -> tuple[FakeService, Connection]:
    svc = FakeService()
    conn = Connection(svc)
    conn.transport = FakeTransport()
    conn.level = level
    conn.v5 = level == 5
    conn.client_id = "member"
    conn.session_id = "sess-1"
    conn.state = CONNECTED
    conn.device = True
    conn.subs = {("g", "jobs/#"): topic_subscription("g", "jobs/#", qos, subscription_id=sub_id)}
    return svc, conn


def stored(serial: int, pid: int, payload: bytes, qos: int = 1, *, pubrel: bool = False) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(
        client_id=STORE, packet_id=pid, serial=serial,
        packet_type=pb.DEVICE_PACKET_TYPE_PUBREL if pubrel else pb.DEVICE_PACKET_TYPE_PUBLISH,
        msg=pb.PublishMsg(topic="jobs/1", qos=qos, payload=payload, created_at_ms=1))


def inflight(conn: Connection) -> dict[int, OutMsg]:
    return dict(conn.out.inflight)


async def settle(svc: FakeService) -> None:
    for _ in range(5):
        await asyncio.sleep(0)
    if svc.bg:
        await asyncio.wait(svc.bg, timeout=2)


async def test_member_fetches_the_group_store_and_acks_map_back():
    svc, conn = member()
    conn._attach_groups()
    await asyncio.sleep(0)
    assert svc.by_store == {STORE: conn} and svc.device.of("fetch") == [(STORE, "sess-1")]
    # a forward arriving during the fetch is held; it is also in the answer (serial 2): sent once
    conn.on_group_persisted(stored(2, 2, b"b"))
    conn.on_group_persisted(stored(3, 3, b"c"))
    assert not conn.out.inflight
    svc.device.answer(STORE, [stored(1, 1, b"a"), stored(2, 2, b"b")])
    await settle(svc)
    msgs = sorted(inflight(conn).values(), key=lambda m: m.ref.serial)
    assert [m.publish.payload for m in msgs] == [b"a", b"b", b"c"]
    assert [m.publish.dup for m in msgs] == [True, True, False]  # fetched ones may have been sent before
    assert all(m.kind == GROUP and m.fixed_id is None for m in msgs)
    # local ids come from the live allocator (not the store's 1, 2, 3)
    assert not {m.packet_id for m in msgs} & {1, 2, 3}
    # the member's PUBACK of the local id acknowledges the group store entry
    conn._on_puback(PubAck(msgs[1].packet_id))
    await asyncio.sleep(0)
    assert svc.device.of("ack") == [(STORE, 2)]
    # a later forward is delivered at once (no hold), an old serial is skipped
    conn.on_group_persisted(stored(2, 2, b"b"))
    conn.on_group_persisted(stored(4, 4, b"d"))
    assert sorted(m.ref.serial for m in conn.out.inflight.values()) == [1, 3, 4]
    # the end of the connection detaches the group store (and the member's own store)
    conn.close("test")
    assert svc.by_store == {}
    assert ("detach", STORE, "sess-1") in svc.device.calls and ("detach", "member", "sess-1") in svc.device.calls


async def test_qos_capping_qos2_flow_and_pubrel_owed_entries():
    svc, conn = member(qos=2)
    conn._attach_groups()
    svc.device.answer(STORE, [stored(1, 7, b"q2", qos=2), stored(2, 8, b"done", qos=2, pubrel=True)])
    await settle(svc)
    (m,) = conn.out.inflight.values()
    assert m.qos == 2 and m.publish.qos == 2 and m.ref == GroupRef(STORE, 7, 1)
    # PUBREL owed from an earlier member: the group already got it exactly once -> acknowledged, nothing sent
    assert svc.device.of("ack") == [(STORE, 8)]
    conn._on_pubrec(PubRec(m.packet_id))
    assert svc.device.of("pubrec") == [(STORE, 7)]
    conn._on_pubcomp(PubComp(m.packet_id))
    assert svc.device.of("ack") == [(STORE, 8), (STORE, 7)]
    assert not conn.out.inflight

    # a member granted QoS 0: sent at QoS 0 once and acknowledged for the store at once
    svc, conn = member(qos=0)
    conn._attach_groups()
    svc.device.answer(STORE, [stored(1, 1, b"x", qos=1)])
    await settle(svc)
    assert not conn.out.inflight and svc.device.of("ack") == [(STORE, 1)]
    assert conn.transport.data  # the QoS 0 PUBLISH went out


async def test_group_store_only_for_persistent_device_members_and_detached_on_unsubscribe():
    svc, conn = member()
    conn.device = False  # non-persistent session: cannot keep the messages
    conn._attach_groups()
    assert svc.device.calls == [] and svc.by_store == {}

    svc, conn = member()
    conn.subs[("", "plain/#")] = topic_subscription("", "plain/#", 1)
    conn._attach_groups()
    conn._attach_groups()  # e.g. a second SUBSCRIBE: no second fetch
    await asyncio.sleep(0)
    assert svc.device.of("fetch") == [(STORE, "sess-1")]
    svc.device.answer(STORE, [])
    await settle(svc)

    async def produce_subscriptions(*_a):
        return None
    svc.produce_subscriptions = produce_subscriptions
    await conn._on_unsubscribe(Unsubscribe(packet_id=5, filters=["$share/g/jobs/#"]))
    assert svc.device.of("detach") == [(STORE, "sess-1")] and svc.by_store == {}
    conn.on_group_persisted(stored(1, 1, b"late"))  # no longer a member: stays in the store
    assert not conn.out.inflight


async def test_unsubscribed_or_gone_during_the_fetch_detaches_again():
    """The Detach sent at UNSUBSCRIBE may run before the fetch attached: a second Detach follows the fetch."""
    svc, conn = member()
    conn._attach_groups()
    await asyncio.sleep(0)

    async def produce_subscriptions(*_a):
        return None
    svc.produce_subscriptions = produce_subscriptions
    await conn._on_unsubscribe(Unsubscribe(packet_id=5, filters=["$share/g/jobs/#"]))
    svc.device.answer(STORE, [stored(1, 1, b"a")])
    await settle(svc)
    assert svc.device.of("detach") == [(STORE, "sess-1"), (STORE, "sess-1")]
    assert not conn.out.inflight  # nothing delivered: it stays in the store for the group


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


def own(serial: int, payload: bytes) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(client_id="member", packet_id=serial, serial=serial,
                               msg=pb.PublishMsg(topic="me/1", qos=1, payload=payload, created_at_ms=1))


async def until(pred) -> None:
    """Bounded: lets the event loop run the fake's tasks until `pred()` holds."""
    for _ in range(200):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def test_resync_fetches_again_and_delivers_only_what_was_not_delivered():
    """A forward stream opens (or ends) while the connection's first fetch runs: the connection fetches
    again after it (read only: `resync`), holding forwards meanwhile; what it already delivered (by serial)
    is not sent twice, what was saved while no stream forwarded it is delivered, in serial order."""
    svc, conn = member()
    conn.subs = {}
    conn.fetching = True
    svc.spawn_bg(conn._fetch_stored())
    await until(lambda: svc.device.of("fetch") == [("member", "sess-1")])
    conn.resync()                                    # registered on a device-persistence instance now
    assert svc.device.of("resync") == []             # not concurrently: after the running fetch
    conn.on_persisted(own(3, b"c"))                  # held
    svc.device.answer("member", [own(1, b"a"), own(2, b"b")])
    await until(lambda: svc.device.of("resync") == [("member", "sess-1")])
    assert sorted(m.ref for m in conn.out.inflight.values()) == [1, 2, 3]
    assert conn.fetching                             # still holding during the re-sync fetch
    conn.on_persisted(own(4, b"d"))                  # forwarded on the new stream: held
    svc.device.answer("member", [own(2, b"b"), own(3, b"c"), own(4, b"d"), own(5, b"e")])
    await until(lambda: not conn.fetching)
    msgs = sorted(conn.out.inflight.values(), key=lambda m: m.ref)
    assert [(m.ref, m.publish.payload, m.publish.dup) for m in msgs] == [
        (1, b"a", True), (2, b"b", True), (3, b"c", False), (4, b"d", True), (5, b"e", True)]
    conn.on_persisted(own(6, b"f"))                  # after the re-sync: delivered at once
    assert max(m.ref for m in conn.out.inflight.values()) == 6
    # idle: a re-sync starts a fetch at once
    conn.resync()
    assert conn.fetching and svc.stats["resyncs"] == 1
    svc.device.answer("member", [own(5, b"e"), own(6, b"f")])
    await until(lambda: not conn.fetching)
    assert len(conn.out.inflight) == 6


async def test_resync_refetches_the_attached_group_stores():
    svc, conn = member()
    conn._attach_groups()
    svc.device.answer(STORE, [stored(1, 1, b"a")])
    await until(lambda: not conn.groups.fetching(STORE))
    conn.resync()
    await until(lambda: (STORE, "sess-1") in svc.device.of("resync"))
    conn.on_group_persisted(stored(3, 3, b"c"))      # held during the re-sync fetch
    svc.device.answer(STORE, [stored(1, 1, b"a"), stored(2, 2, b"b")])
    await until(lambda: not conn.groups.fetching(STORE))
    assert sorted(m.ref.serial for m in conn.out.inflight.values()) == [1, 2, 3]
