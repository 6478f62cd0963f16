"""The device-persistence service as a subprocess (tbmq-launcher Suite) with REAL Kafka and REAL Redis,
standalone and cluster: PersistedMsg records in, a gRPC client playing the connector, forwards read from
the fake connector's DevicePersistence.Forward stream (forward_harness.ForwardClient)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
import uuid

import grpc
import pytest
from forward_harness import BOUND, ForwardClient, wait_until
from waits import poll
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.services import readyz
from tbmq_platform.kafka import make_producer
from tbmq_platform.topics import MSG_PERSISTED

from tbmq_device_persistence.store import DeviceMsgStore, StoreConfig, script_source
from reply_cutter import ReplyCutter

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def dp_suite(kafka, tmp_path_factory, *, cluster: bool = False, env=None, redis_url: str | None = None) -> Suite:
    return Suite(services=["device-persistence"], connectors=0, ports="free", log_format="json",
                 id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("dp-suite"),
                 redis_cluster=cluster, redis_url=redis_url, start_timeout=60, stop_timeout=15,
                 service_env={"device-persistence": env or {}},
                 kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers)


@contextlib.asynccontextmanager
async def handles(suite: Suite, store_url: str | None = None):
    """`suite` started, and Handles to talk to it (its own store on `store_url`, default the suite's
    Redis); both stopped after."""
    await suite.start()
    h = Handles(suite, store_url)
    try:
        await h.start()
        yield h
    finally:
        await h.stop()
        await suite.stop()


def own_suite(kafka, tmp_path_factory, name: str, env: dict):
    """handles() of a device-persistence with `env`, in its own consumer group (the module's `dp` suites on
    the same Kafka must not take partitions from it)."""
    return handles(dp_suite(kafka, tmp_path_factory,
                            env={**env, "DEVICE_PERSISTENCE_GROUP_ID": f"dp-{name}-{new_tag()}"}))


@pytest.fixture(scope="module", params=["standalone", "cluster"])
async def dp(request, kafka, tmp_path_factory):
    """device-persistence alone (plus Kafka and its own Redis) and handles to talk to it."""
    async with handles(dp_suite(kafka, tmp_path_factory, cluster=request.param == "cluster")) as h:
        yield h


class Handles:
    def __init__(self, suite: Suite, store_url: str | None = None) -> None:
        self.suite = suite
        self.store = DeviceMsgStore(StoreConfig(redis_url=store_url or suite.redis_url,
                                                cluster_nodes=tuple(suite.redis_cluster_nodes or ())))
        self.producer = make_producer(suite.bootstrap_servers, client_id="dp-test", linger_ms=1)
        self._channel = None
        self.stub = None

    async def start(self) -> None:
        await self.store.start()
        await self.producer.start()
        self._channel = grpc.aio.insecure_channel(self.suite.grpc_target("device-persistence"))
        self.stub = sgrpc.DevicePersistenceStub(self._channel)

    async def stop(self) -> None:
        await self._channel.close()
        await self.producer.stop()
        await self.store.close()

    async def publish(self, client_id: str, seqs, *, flush: bool = True) -> None:
        futures = []
        for s in seqs:
            value = pb.PersistedMsg(client_id=client_id, msg=pb.PublishMsg(
                topic=f"t/{client_id}", payload=b"%d" % s, qos=1, publisher_id="pub")).SerializeToString()
            futures.append(await self.producer.send(MSG_PERSISTED, value=value, key=client_id.encode(),
                                                    headers=[("traceparent", TRACEPARENT)]))
        if flush:
            await asyncio.gather(*futures)

    async def stored(self, client_id: str) -> list[int]:
        """Sequence numbers stored for the client, in serial order (reads without attaching)."""
        return [int(d.msg.payload) for d in await self.store.fetch_undelivered(client_id)]

    async def hand_out(self, *client_ids: str) -> None:
        """Hand every stored message of the clients out (packet ids given, as a connection's fetch does)."""
        for cid in client_ids:
            await self.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id="test-conn",
                                                                         session_id="s"))

    async def wait_stored(self, client_id: str, pred, timeout: float = BOUND) -> list[int]:
        got: list[int] = []

        async def holds() -> bool:
            got[:] = await self.stored(client_id)
            return pred(got)

        if not await poll(holds, timeout, step=0.1):
            raise AssertionError(f"stored for {client_id}: {len(got)} messages, condition not met")
        return got

    async def fake_connector(self) -> str:
        return f"fake-conn-{uuid.uuid4().hex[:8]}"

    def forward(self, service_id: str, *, read: bool = True, on_settle=None) -> ForwardClient:
        return ForwardClient(self.stub, service_id, read=read, on_settle=on_settle)

    async def details(self) -> dict:
        return await readyz(self.suite.health_port("device-persistence"))


def seqs(dms) -> list[int]:
    return [int(d.msg.payload) for d in dms]


async def test_a_takeovers_first_fetch_reads_after_the_acknowledgements_the_old_connector_holds(dp):
    """A client live on connector A connects on B (a takeover: the registry answers B without waiting for A,
    whose PUBACKs of the client wait to be batched). B's first fetch asks A's stream for the acknowledgements
    A holds and reads only once A answered: B is handed out again only what the client did not acknowledge.
    A fetch by the connector the client is attached to, and a resync, ask nothing."""
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    conn_a, conn_b = await dp.fake_connector(), await dp.fake_connector()
    held: list[tuple[str, int]] = []  # acknowledged by the client on A, still batched there

    async def send_held(link: ForwardClient) -> None:
        if held:
            assert (await link.acknowledge(acks=held)).acknowledged == len(held)
            held.clear()

    async with dp.forward(conn_a, on_settle=send_held) as down_a, dp.forward(conn_b) as down_b:
        await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn_a,
                                                                   session_id="s1"))
        assert down_a.settles == 0  # attached to no connector before
        await dp.publish(cid, range(5))  # live on A: forwarded there
        fwd = await down_a.wait_count(5)
        held.extend((cid, d.packet_id) for d in fwd[:3])  # the client acknowledged 0, 1, 2 on A
        again = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn_a,
                                                                           session_id="s1"))
        assert down_a.settles == 0 and seqs(again.messages) == [0, 1, 2, 3, 4]  # its own connector: as it is

        parts = dp.stub.FetchUndeliveredParts(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn_b,
                                                                          session_id="s2"))
        taken = [m for part in [p async for p in parts] for m in part.messages]
        assert down_a.settles == 1 and not held
        assert seqs(taken) == [3, 4] and all(d.redelivery for d in taken)
        resync = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
            client_id=cid, service_id=conn_b, session_id="s2", resync=True))
        assert seqs(resync.messages) == [3, 4] and down_a.settles == 1 and down_b.settles == 0
    await dp.stub.Clear(spb.ClearRequest(client_id=cid))


async def test_the_connectors_forward_link_answers_a_settle_with_the_acknowledgements_it_holds(dp):
    """The connector's side of the takeover settle (connector.grpc_clients, the real DevicePersistenceClient on
    its Forward stream): acknowledgements it holds for a 30 s batch delay go up when device-persistence asks
    (another connector's first fetch of the client), and `settled` comes only once they are applied, so that
    fetch hands out only what was not acknowledged."""
    from connector.grpc_clients import DevicePersistenceClient

    cid = f"dev-{uuid.uuid4().hex[:10]}"
    conn_a, conn_b = await dp.fake_connector(), await dp.fake_connector()
    forwarded: list = []
    opened = asyncio.Event()
    client = DevicePersistenceClient(dp.suite.grpc_target("device-persistence"), 10.0, ack_delay_s=30.0)
    client.start_forwarding(conn_a, on_batch=lambda batch: forwarded.extend(batch.messages),
                            on_open=lambda link: opened.set(), on_close=lambda link: None)
    try:
        await asyncio.wait_for(opened.wait(), BOUND)
        async for _ in client.fetch(cid, conn_a, "s1"):  # attaches the client to A: live
            pass
        await dp.publish(cid, range(3))
        await wait_until(lambda: len(forwarded) == 3, BOUND, lambda: f"3 forwards to A (have {len(forwarded)})")
        for d in forwarded[:2]:
            client.acknowledge(cid, d.packet_id, d.serial)
        assert len(client.acks) == 2  # held: the batch would leave in 30 s
        parts = dp.stub.FetchUndeliveredParts(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn_b,
                                                                          session_id="s2"))
        taken = [m for part in [p async for p in parts] for m in part.messages]
        assert seqs(taken) == [2]
        assert len(client.acks) == 0
        assert (await dp.details())["grpc_calls"].get("settle_timeouts", 0) == 0
    finally:
        await client.close()
    await dp.stub.Clear(spb.ClearRequest(client_id=cid))


async def test_fetch_attach_forward_ack_pubrec_clear(dp):
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    conn_a, conn_b = await dp.fake_connector(), await dp.fake_connector()
    await dp.publish(cid, range(50))
    await dp.wait_stored(cid, lambda got: len(got) == 50)

    async with dp.forward(conn_a) as down_a, dp.forward(conn_b) as down_b:
        assert down_a.ready.instance_id == dp.suite.instance("device-persistence").service_id
        resp = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
            client_id=cid, service_id=conn_a, session_id="s1"))
        assert seqs(resp.messages) == list(range(50))
        assert [d.serial for d in resp.messages] == list(range(1, 51))
        assert [d.packet_id for d in resp.messages] == list(range(1, 51))
        assert all(d.client_id == cid and d.msg.topic == f"t/{cid}" for d in resp.messages)

        await dp.publish(cid, range(50, 70))  # attached: forwarded on connector A's stream
        fwd = await down_a.wait_count(20)
        assert seqs(fwd) == list(range(50, 70))
        assert [d.serial for d in fwd] == list(range(51, 71))
        assert [d.packet_id for d in fwd] == list(range(51, 71))
        assert all(d.client_id == cid for d in fwd)
        assert down_b.messages == []

        for pid in range(1, 11):
            assert (await dp.stub.Acknowledge(spb.PacketRequest(client_id=cid, packet_id=pid))).found
        assert not (await dp.stub.Acknowledge(spb.PacketRequest(client_id=cid, packet_id=1))).found
        # with a serial, only the message of that serial: id 12 holds serial 12, so these leave it alone
        assert not (await dp.stub.Acknowledge(spb.PacketRequest(client_id=cid, packet_id=12, serial=13))).found
        assert not (await dp.stub.MarkPubrec(spb.PacketRequest(client_id=cid, packet_id=12, serial=13))).found
        assert (await dp.stub.MarkPubrec(spb.PacketRequest(client_id=cid, packet_id=11, serial=11))).found

        # reconnect on connector B before A's Detach arrives
        resp = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
            client_id=cid, service_id=conn_b, session_id="s2"))
        assert seqs(resp.messages) == list(range(10, 70))
        assert resp.messages[0].packet_type == pb.DEVICE_PACKET_TYPE_PUBREL
        assert resp.messages[1].packet_type == pb.DEVICE_PACKET_TYPE_PUBLISH
        # a re-sync of A's old session reads nothing: the client is attached to B's session now
        resync = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
            client_id=cid, service_id=conn_a, session_id="s1", resync=True))
        assert resync.not_attached and not resync.messages
        assert (await dp.store.attachment(cid)).session_id == "s2"
        resync = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
            client_id=cid, service_id=conn_b, session_id="s2", resync=True))
        assert not resync.not_attached and seqs(resync.messages) == list(range(10, 70))
        assert not (await dp.stub.Detach(spb.DetachRequest(client_id=cid, session_id="s1"))).detached
        await dp.publish(cid, [70])
        assert seqs(await down_b.wait_count(1)) == [70]
        assert (await dp.stub.Detach(spb.DetachRequest(client_id=cid, session_id="s2"))).detached

        await dp.publish(cid, [71])  # detached: stored only
        await dp.wait_stored(cid, lambda got: got[-1:] == [71])
        assert len(down_a.messages) == 20 and len(down_b.messages) == 1

    assert (await dp.stub.Clear(spb.ClearRequest(client_id=cid))).removed == 62
    assert (await dp.stub.Clear(spb.ClearRequest(client_id=cid))).removed == 0
    assert await dp.stored(cid) == []


async def test_fetch_in_parts_answers_the_page_as_it_is_read(dp):
    """FetchUndeliveredParts answers FetchUndelivered's page in parts of at most the store's script call (500
    messages), `more` on every part but the last, whose `more` is the page's; the same messages, serials and
    packet ids as the whole page; a re-sync of a session the client is no longer attached to is one
    not_attached part."""
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    conn = await dp.fake_connector()
    await dp.publish(cid, range(1200))
    await dp.wait_stored(cid, lambda got: len(got) == 1200)

    def req(session: str = "s1", **kw) -> spb.FetchUndeliveredRequest:
        return spb.FetchUndeliveredRequest(client_id=cid, service_id=conn, session_id=session, **kw)

    async def parts(request) -> list[spb.FetchUndeliveredResponse]:
        return [p async for p in dp.stub.FetchUndeliveredParts(request)]

    page = await parts(req(max_messages=1100))  # attaches s1
    assert [(len(p.messages), p.more) for p in page] == [(500, True), (500, True), (100, True)]
    got = [m for p in page for m in p.messages]
    assert seqs(got) == list(range(1100))
    assert [d.serial for d in got] == list(range(1, 1101))
    assert [d.packet_id for d in got] == list(range(1, 1101))
    assert not any(d.redelivery for d in got)
    rest = await parts(req(resync=True, after_serial=1100))
    assert [(len(p.messages), p.more) for p in rest] == [(100, False)]
    assert seqs(rest[0].messages) == list(range(1100, 1200))

    whole = await dp.stub.FetchUndelivered(req(resync=True))  # re-sent: same packet ids, redelivery set
    again = [m for p in await parts(req(resync=True)) for m in p.messages]
    assert len(again) == 1200 and list(whole.messages) == again and all(d.redelivery for d in again)

    await dp.stub.FetchUndelivered(req("s2", max_messages=1))  # a newer session attaches
    stale = await parts(req(resync=True))
    assert len(stale) == 1 and stale[0].not_attached and not stale[0].messages
    assert (await dp.stub.Clear(spb.ClearRequest(client_id=cid))).removed == 1200


async def test_acknowledgements_up_the_forward_stream(dp):
    """Acknowledgement batches sent up a Forward stream are applied like AcknowledgeMany and answered
    with the same seq; a bad packet id is refused (nothing applied) and the stream goes on."""
    a, b = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
    await dp.publish(a, range(5))
    await dp.publish(b, range(3))
    await dp.wait_stored(a, lambda got: len(got) == 5)
    await dp.wait_stored(b, lambda got: len(got) == 3)
    await dp.hand_out(a, b)
    async with dp.forward(await dp.fake_connector()) as fwd:
        acked = await fwd.acknowledge(acks=[(a, 1), (b, 1), (a, 2), (a, 4), (b, 9)], pubrecs=[(a, 3), (a, 4)])
        assert acked.status == spb.FORWARD_ACK_STATUS_APPLIED
        assert (acked.acknowledged, acked.marked) == (4, 2)
        assert await dp.stored(a) == [2, 4] and await dp.stored(b) == [1, 2]
        bad = await fwd.acknowledge(acks=[(b, 2)], pubrecs=[(b, 0)])
        assert bad.status == spb.FORWARD_ACK_STATUS_INVALID_ARGUMENT and bad.detail
        assert await dp.stored(b) == [1, 2]  # nothing applied
        again = await fwd.acknowledge(acks=[(b, 2), (b, 3), (a, 1)])
        assert again.status == spb.FORWARD_ACK_STATUS_APPLIED and again.acknowledged == 2
        assert await dp.stored(b) == []
    await dp.stub.Clear(spb.ClearRequest(client_id=a))


async def test_a_newer_stream_of_the_same_service_replaces_the_older(dp):
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    conn = await dp.fake_connector()
    async with dp.forward(conn) as old:
        await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn, session_id="s"))
        await dp.publish(cid, [0])
        await old.wait_count(1)
        async with dp.forward(conn) as new:
            assert await old.wait_ended() == grpc.StatusCode.UNAVAILABLE
            await dp.publish(cid, [1, 2])
            assert seqs(await new.wait_count(2)) == [1, 2]
        assert seqs(old.messages) == [0]
    with pytest.raises(grpc.aio.AioRpcError) as e:  # the first message must be `open`
        call = dp.stub.Forward()
        await call.write(spb.ForwardUp(acks=spb.ForwardAcks(seq=1)))
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await dp.stub.Clear(spb.ClearRequest(client_id=cid))


async def test_acknowledge_many(dp):
    """One AcknowledgeMany for several clients: PUBRECs applied before the acknowledgements."""
    a, b = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
    await dp.publish(a, range(5))
    await dp.publish(b, range(3))
    await dp.wait_stored(a, lambda got: len(got) == 5)
    await dp.wait_stored(b, lambda got: len(got) == 3)
    await dp.hand_out(a, b)
    PR = spb.PacketRequest
    resp = await dp.stub.AcknowledgeMany(spb.PacketBatchRequest(
        acks=[PR(client_id=a, packet_id=1), PR(client_id=b, packet_id=1), PR(client_id=a, packet_id=2),
              PR(client_id=a, packet_id=4), PR(client_id=b, packet_id=9)],
        pubrecs=[PR(client_id=a, packet_id=3), PR(client_id=a, packet_id=4)]))
    assert (resp.acknowledged, resp.marked) == (4, 2)  # a: 1, 2, 4 (marked, then removed); b: 1
    assert await dp.stored(a) == [2, 4]  # payloads = seq: packet ids 3 (PUBREL owed) and 5 are left
    assert await dp.stored(b) == [1, 2]
    fetched = await dp.store.fetch_undelivered(a)
    assert [(d.packet_id, d.packet_type) for d in fetched] == [
        (3, pb.DEVICE_PACKET_TYPE_PUBREL), (5, pb.DEVICE_PACKET_TYPE_PUBLISH)]
    assert (await dp.stub.AcknowledgeMany(spb.PacketBatchRequest())).acknowledged == 0
    await dp.stub.Clear(spb.ClearRequest(client_id=a))
    await dp.stub.Clear(spb.ClearRequest(client_id=b))


async def test_bad_requests(dp):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dp.stub.Acknowledge(spb.PacketRequest(client_id="x", packet_id=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dp.stub.AcknowledgeMany(spb.PacketBatchRequest(
            acks=[spb.PacketRequest(client_id="x", packet_id=1)],
            pubrecs=[spb.PacketRequest(client_id="x", packet_id=0)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dp.stub.MarkPubrec(spb.PacketRequest(client_id="x", packet_id=65536))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id="x", service_id="a|b", session_id="s"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id="x", service_id="a"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_forward_without_a_stream_does_not_stall(dp):
    """A client attached to a connector that has no stream here: its messages stay in Redis (counted)
    and the other clients' batches go on."""
    gone, alive = f"dev-{uuid.uuid4().hex[:8]}", f"dev-{uuid.uuid4().hex[:8]}"
    conn = await dp.fake_connector()
    before = (await dp.details()).get("forward_no_stream", 0)
    await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
        client_id=gone, service_id=f"no-such-connector-{uuid.uuid4().hex[:6]}", session_id="s"))
    await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=alive, service_id=conn, session_id="s"))
    async with dp.forward(conn) as down:
        await dp.publish(gone, range(5))
        await dp.publish(alive, range(5))
        await dp.wait_stored(gone, lambda got: got == list(range(5)), timeout=15)
        assert seqs(await down.wait_count(5, timeout=15)) == list(range(5))
    assert (await dp.details())["forward_no_stream"] >= before + 5
    for c in (gone, alive):
        await dp.stub.Clear(spb.ClearRequest(client_id=c))


async def test_reconnecting_client_gets_everything_once_in_order(dp):
    """A producer publishes continuously while the client (fake connector) detaches and reattaches,
    alternating between two connectors. Like the real connector, it delivers the fetch answer, then
    the forwards that arrived meanwhile and later, dropping any serial it already passed, and
    acknowledges each delivered message before it detaches. Every message must be delivered exactly
    once, in order."""
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    conns = [await dp.fake_connector(), await dp.fake_connector()]
    total = 3000
    delivered: list[int] = []
    sessions = 0
    produced = asyncio.Event()

    async def producer():
        seq = 0
        while seq < total:
            n = min(random.randint(1, 30), total - seq)
            await dp.publish(cid, range(seq, seq + n), flush=False)
            seq += n
            await asyncio.sleep(random.random() * 0.01)  # pacing: batches of random size and spacing
        await dp.producer.flush()
        produced.set()

    async with dp.forward(conns[0]) as down_0, dp.forward(conns[1]) as down_1:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(down):
            while True:
                queue.put_nowait(await down.queue.get())

        pump_tasks = [asyncio.create_task(pump(d)) for d in (down_0, down_1)]
        prod_task = asyncio.create_task(producer())
        try:
            deadline = time.monotonic() + 120
            # at least 3 sessions whatever the speed (a fast store may deliver everything in fewer)
            while len(delivered) < total or sessions < 3:
                assert time.monotonic() < deadline, f"{len(delivered)} of {total} delivered"
                sessions += 1
                session_id = f"s{sessions}"
                max_serial = 0
                acks = []

                def deliver(dm: pb.DevicePublishMsg) -> None:
                    nonlocal max_serial
                    if dm.serial <= max_serial:
                        return
                    max_serial = dm.serial
                    delivered.append(int(dm.msg.payload))
                    acks.append(asyncio.ensure_future(dp.stub.Acknowledge(  # in the background
                        spb.PacketRequest(client_id=cid, packet_id=dm.packet_id))))

                resp = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
                    client_id=cid, service_id=conns[sessions % 2], session_id=session_id))
                for dm in resp.messages:
                    deliver(dm)
                online_until = time.monotonic() + random.uniform(0.05, 0.6)
                while time.monotonic() < online_until and len(delivered) < total:
                    try:
                        dm = await asyncio.wait_for(queue.get(), 0.05)
                    except asyncio.TimeoutError:
                        continue
                    deliver(dm)
                results = await asyncio.gather(*acks)  # all acknowledged before the connection closes
                assert all(r.found for r in results)
                await dp.stub.Detach(spb.DetachRequest(client_id=cid, session_id=session_id))
                # offline: whatever arrives now is for a closed connection (dropped; still in Redis)
                offline_until = time.monotonic() + random.uniform(0.0, 0.3)
                while time.monotonic() < offline_until:
                    try:
                        await asyncio.wait_for(queue.get(), 0.05)
                    except asyncio.TimeoutError:
                        pass
            await asyncio.wait_for(produced.wait(), BOUND)
        finally:
            for t in pump_tasks:
                t.cancel()
            await asyncio.gather(*pump_tasks, prod_task, return_exceptions=True)

    assert sessions >= 3
    assert delivered == list(range(total)), (
        f"{len(delivered)} delivered, {len(set(delivered))} distinct; first gap at "
        f"{next((i for i, s in enumerate(delivered) if s != i), None)}")
    assert await dp.stored(cid) == []


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_restart_mid_stream_loses_nothing(dp, how):
    """Offsets are committed only after the save: a graceful restart stores every message exactly
    once; a crash (SIGKILL) may store some twice (replayed batch) but loses none, and keeps order."""
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    total = 4000

    async def producer():
        for start in range(0, total, 100):
            await dp.publish(cid, range(start, start + 100))
            await asyncio.sleep(0.02)  # pacing: the stream is still flowing at the restart

    prod = asyncio.create_task(producer())
    await dp.wait_stored(cid, lambda got: len(got) >= 500)
    if how == "sigterm":
        await dp.suite.restart_service("device-persistence")
    else:
        await dp.suite.kill_service("device-persistence")
        await dp.suite.start_service("device-persistence")
    await prod
    got = await dp.wait_stored(cid, lambda got: set(got) == set(range(total)), timeout=60)
    if how == "sigterm":
        assert got == list(range(total))
    else:
        first_seen = list(dict.fromkeys(got))
        assert first_seen == list(range(total))
        assert len(got) - total < 2000  # at most a batch or so replayed
    assert (await dp.stub.Clear(spb.ClearRequest(client_id=cid))).removed == len(got)


async def test_thousands_of_concurrent_calls(dp):
    """grpc core cancels calls queued beyond its pending-request limits (1000/3000 by default); the
    server raises them, so a burst of background acknowledgements is answered, not CANCELLED."""
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    calls = [dp.stub.Acknowledge(spb.PacketRequest(client_id=cid, packet_id=i % 65535 + 1)) for i in range(6000)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, f"{len(errors)} failed, e.g. {errors[0]!r}"


async def test_a_stream_that_does_not_keep_up_is_ended_and_nothing_is_lost(kafka, tmp_path_factory):
    """DEVICE_PERSISTENCE_FORWARD_QUEUE_BYTES bounds what waits per stream: a connector that does not read
    gets its stream ended (RESOURCE_EXHAUSTED) instead of growing the queue or slowing the consumer loop;
    every message is still stored (and committed), and the connector can reopen at once."""
    async with own_suite(kafka, tmp_path_factory, "overflow", {"DEVICE_PERSISTENCE_FORWARD_QUEUE_BYTES": "4096"}) as h:
        cid, other = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
        conn = await h.fake_connector()
        total = 0
        async with h.forward(conn, read=False) as stuck:
            await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn,
                                                                      session_id="s"))
            payload = b"x" * 16384
            details: dict = {}

            async def handled() -> bool:  # every batch so far forwarded, or the queue overflowed
                details.update(await h.details())
                return (details.get("forward_overflows", 0) > 0
                        or details.get("forwarded", 0) + details.get("forward_dropped", 0) >= total)

            # batches of 20 x 16 KiB until the transport's windows are full and the queue overflows
            # (bounded: 8000 messages = 128 MiB). Each batch is produced once the last one was handled:
            # this instance's group reads tbmq.msg.persisted from the start (the earlier tests' records first),
            # and a batch still unread when the check runs proves nothing
            while details.get("forward_overflows", 0) == 0:
                assert total < 8000, f"the forward queue never overflowed: {details}"
                futures = []
                for i in range(total, total + 20):
                    value = pb.PersistedMsg(client_id=cid, msg=pb.PublishMsg(
                        topic="t", payload=b"%d:" % i + payload, qos=1)).SerializeToString()
                    futures.append(await h.producer.send(MSG_PERSISTED, value=value, key=cid.encode()))
                await asyncio.gather(*futures)
                total += 20
                await wait_until(handled, BOUND, lambda: f"the batch up to {total} forwarded: {details}")
            assert await stuck.wait_ended() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stored: list[int] = []

        async def all_stored() -> bool:
            stored[:] = [int(d.msg.payload.split(b":")[0]) for d in await h.store.fetch_undelivered(cid)]
            return len(stored) >= total

        await wait_until(all_stored, BOUND, step=0.1)
        assert stored == list(range(total))
        details = await h.details()
        assert details["forward_overflows"] >= 1
        # the loop was not held up: another client's messages are stored too, and a new stream works
        async with h.forward(conn) as fresh:
            await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=other, service_id=conn,
                                                                      session_id="s2"))
            await h.publish(other, range(3))
            assert seqs(await fresh.wait_count(3)) == [0, 1, 2]


async def test_a_live_client_that_does_not_acknowledge_is_paused_then_pages(kafka, tmp_path_factory):
    """DEVICE_PERSISTENCE_HANDED_OUT_LIMIT: a live client's forwards stop once that many are handed out and
    unacknowledged; the ForwardBatch names it in `paused`; after its acknowledgements it pages (resync,
    after the last serial) up to the end, and is live again."""
    async with own_suite(kafka, tmp_path_factory, "paused", {"DEVICE_PERSISTENCE_HANDED_OUT_LIMIT": "10"}) as h:
        cid = f"dev-{uuid.uuid4().hex[:10]}"
        conn = await h.fake_connector()

        def page(after: int) -> spb.FetchUndeliveredRequest:
            return spb.FetchUndeliveredRequest(client_id=cid, service_id=conn, session_id="s", resync=True,
                                               after_serial=after, max_messages=100)

        async with h.forward(conn) as fwd:
            first = await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(
                client_id=cid, service_id=conn, session_id="s", max_messages=100))
            assert not first.messages and not first.more  # nothing stored: live
            await h.publish(cid, range(15))
            await h.wait_stored(cid, lambda got: len(got) == 15)
            await wait_until(lambda: fwd.paused == [cid], BOUND, "the client paused")
            assert seqs(fwd.messages) == list(range(10))
            stuck = await h.stub.FetchUndelivered(page(10))
            assert not stuck.messages and stuck.more  # no packet id free until acknowledgements
            acked = await fwd.acknowledge(acks=[(cid, d.packet_id) for d in fwd.messages])
            assert acked.acknowledged == 10
            rest = await h.stub.FetchUndelivered(page(10))
            assert seqs(rest.messages) == list(range(10, 15)) and not rest.more  # caught up: live again
            await h.publish(cid, [15])
            assert seqs(await fwd.wait_count(11))[-1] == 15


SAVE_SHA = hashlib.sha1(script_source("save_messages").encode()).hexdigest().encode()


@contextlib.asynccontextmanager
async def behind_a_cutter(kafka, redis_standalone, tmp_path_factory, group: str):
    """The service talking to Redis through a ReplyCutter, a fake connector, and one client live on its
    Forward stream: yields (cutter, handles, client id, the stream)."""
    cutter = await ReplyCutter(redis_standalone.port).start()
    suite = dp_suite(kafka, tmp_path_factory, redis_url=cutter.url,
                     env={"DEVICE_PERSISTENCE_GROUP_ID": f"{group}-{new_tag()}"})
    try:
        async with handles(suite, store_url=redis_standalone.url) as h:
            cid, conn = f"dev-{uuid.uuid4().hex[:10]}", await h.fake_connector()
            async with h.forward(conn) as down:
                page = await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn,
                                                                                 session_id="s"))
                assert not page.messages and not page.more  # live from now on
                yield cutter, h, cid, down
    finally:
        await cutter.close()


async def test_a_batch_saved_by_an_attempt_whose_reply_was_lost_is_still_forwarded_in_order(
        kafka, redis_standalone, tmp_path_factory):
    """Redis runs a save, then its reply is lost with the connection (what a Redis restart does to a call in
    flight). The retry (redis-py's, or the service's) finds the batch applied and stores nothing; the lost
    attempt had handed the live client's messages packet ids. They must still be forwarded, before what is
    saved after them: the connection takes forwards in serial order only, so without that they would wait
    in Redis until the client's next connect (the bench's "restart Redis" fault found 4 such messages)."""
    async with behind_a_cutter(kafka, redis_standalone, tmp_path_factory, "dp-lost-reply") as (cutter, h, cid, down):
        await h.publish(cid, range(3))
        assert seqs(await down.wait_count(3)) == [0, 1, 2]

        cutter.arm(SAVE_SHA, cid.encode())  # this client's save (the topic holds other tests' records)
        await h.publish(cid, range(3, 6))
        await asyncio.wait_for(cutter.cut.wait(), BOUND)
        await h.publish(cid, range(6, 8))

        got = await down.wait_count(8)
        assert seqs(got) == list(range(8))
        assert [d.serial for d in got] == list(range(1, 9))
        assert all(d.packet_id for d in got)
        assert await h.stored(cid) == list(range(8))  # stored once each
        assert (await h.details()).get("forwarded_again", 0) >= 1


async def test_a_persist_batch_whose_stream_ends_while_redis_runs_its_save_is_still_forwarded(
        kafka, redis_standalone, tmp_path_factory):
    """A router dies (its Persist stream ends) while Redis runs the save of its last batch, and Redis answers
    only after that. The save must still be forwarded: the router's replay brings the batch again with newer
    copies, finds it applied (the origin check) and forwards only the newer ones, and a connection takes
    forwards in serial order only, so a save cut off with its stream would leave a live client's messages
    handed out in Redis, and skipped, until its next connect. (The e2e crash test of the router,
    test_durability_device_qos2_fan_in_wide_windows[router-1], lost 32 of 450 messages this way once.)"""
    async with behind_a_cutter(kafka, redis_standalone, tmp_path_factory, "dp-held-reply") as (cutter, h, cid, down):
        copies = [persisted(cid, i, (0, 10 + i)) for i in range(6)]
        call = h.stub.Persist()
        try:
            await call.write(spb.PersistBatch(seq=1, records=copies[:3]))
            assert (await call.read()).seq == 1
            assert seqs(await down.wait_count(3)) == [0, 1, 2]
            cutter.arm(SAVE_SHA, cid.encode(), hold=True)
            await call.write(spb.PersistBatch(seq=2, records=copies[3:5]))
            await asyncio.wait_for(cutter.held.wait(), BOUND)  # Redis ran the save, its reply waits
        finally:
            call.cancel()  # the router is gone
        await wait_until(lambda: _details_show(h, persist_streams=0), BOUND, "the Persist stream ended")
        cutter.release()

        replay = h.stub.Persist()  # the next router routes from its last commit: the batch and a newer copy
        try:
            await replay.write(spb.PersistBatch(seq=1, records=copies[3:]))
            answer = await replay.read()
            assert (answer.seq, answer.saved) == (1, 1)
        finally:
            replay.cancel()
        await wait_until(lambda: taken(down.messages) == list(range(6)), BOUND,
                         lambda: f"every copy forwarded, in order (have {seqs(down.messages)})")
        assert await h.stored(cid) == list(range(6))  # stored once each
        assert await _details_show(h, persisting=0)


async def _details_show(h, **want) -> bool:
    details = await h.details()
    return all(details.get(k) == v for k, v in want.items())


def persisted(cid: str, seq: int, origin: tuple[int, int]) -> bytes:
    """A router's stored copy: PersistedMsg with its tbmq.msg.all origin (partition, offset)."""
    return pb.PersistedMsg(client_id=cid, msg=pb.PublishMsg(topic=f"t/{cid}", payload=b"%d" % seq, qos=1,
                                                            publisher_id="pub"),
                           origin_partition=origin[0], origin_offset=origin[1]).SerializeToString()


def taken(dms) -> list[int]:
    """What a connection takes of its forwards: serials above the highest it had, in arrival order."""
    out, top = [], 0
    for d in dms:
        if d.serial > top:
            top = d.serial
            out.append(int(d.msg.payload))
    return out


async def test_persist_stream_saves_forwards_and_answers_each_batch_in_order(dp):
    """A router's Persist stream (ROUTER_PERSIST_VIA=grpc): each batch is answered with its seq and how many
    copies were stored, once they are in Redis; a live client's copies are forwarded in order, an offline
    client's kept. The same batches sent again on a new stream (a router reopening it, or routing again after
    a crash) are answered too and store nothing twice; what they add is stored and forwarded in order."""
    a, b = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
    conn = await dp.fake_connector()
    first = [[persisted(a, 0, (0, 10)), persisted(b, 0, (0, 11)), persisted(a, 1, (0, 12))],
             [persisted(a, 2, (1, 5)), persisted(b, 1, (1, 6))]]
    async with dp.forward(conn) as down:
        page = await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=a, service_id=conn,
                                                                         session_id="s"))
        assert not page.messages and not page.more  # a is live; b never connected
        call = dp.stub.Persist()
        try:
            for seq, records in enumerate(first, 1):
                await call.write(spb.PersistBatch(seq=seq, records=records))
            assert [(x.seq, x.saved) for x in [await call.read() for _ in first]] == [(1, 3), (2, 2)]
        finally:
            call.cancel()
        assert await dp.stored(a) == [0, 1, 2] and await dp.stored(b) == [0, 1]
        assert seqs(await down.wait_count(3)) == [0, 1, 2]

        again = dp.stub.Persist()
        try:
            await again.write(spb.PersistBatch(seq=1, records=first[0]))
            await again.write(spb.PersistBatch(seq=2, records=first[1] + [persisted(a, 3, (1, 7))]))
            assert [(x.seq, x.saved) for x in [await again.read() for _ in range(2)]] == [(1, 0), (2, 1)]
        finally:
            again.cancel()
        assert await dp.stored(a) == [0, 1, 2, 3] and await dp.stored(b) == [0, 1]
        await wait_until(lambda: taken(down.messages) == [0, 1, 2, 3], BOUND,
                         lambda: f"a's forwards in order (have {seqs(down.messages)})")
    assert (await dp.details()).get("persist_batches", 0) >= 4
    await dp.stub.Clear(spb.ClearRequest(client_id=a))
    await dp.stub.Clear(spb.ClearRequest(client_id=b))


async def _answers(call, n: int) -> list[tuple[int, int]]:
    return [(x.seq, x.saved) for x in [await call.read() for _ in range(n)]]


async def test_a_client_whose_keys_redis_refuses_is_dead_lettered_and_the_others_are_saved(dp, capsys):
    """A client whose Redis keys Redis refuses (here: its messages key holds a string, WRONGTYPE) does not stop
    the batch: after DEVICE_PERSISTENCE_SAVE_ATTEMPTS refused attempts each client is saved apart, the other
    clients' copies are stored and forwarded, the refused ones go to tbmq.msg.persisted.dead in order with
    Redis's answer, and only then is the batch answered. Once the keys are mended, `tbmq dead-letters replay`
    stores them; `--after-offset` with the offset it printed replays nothing again, and a replay run again
    stores nothing twice (each letter's place in the dead-letter topic is its origin)."""
    from tbmq_platform.cli import dead_letters, parser, read_records
    from tbmq_platform.topics import DEAD_LETTER_ERROR_HEADER, MSG_PERSISTED_DEAD

    a, bad, b = (f"dev-{uuid.uuid4().hex[:10]}" for _ in range(3))
    await dp.store.redis.set(dp.store.keys(bad).messages, b"not a sorted set")
    before = (await dp.details()).get("dead_lettered", 0)
    conn = await dp.fake_connector()
    records = [persisted(a, 0, (0, 20)), persisted(bad, 0, (0, 21)), persisted(b, 0, (0, 22)),
               persisted(bad, 1, (0, 23)), persisted(a, 1, (0, 24))]
    async with dp.forward(conn) as down:
        await dp.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=a, service_id=conn, session_id="s"))
        call = dp.stub.Persist()
        try:
            await call.write(spb.PersistBatch(seq=1, records=records))
            # answered once saved; its count leaves out the copies an earlier refused attempt had stored
            assert [seq for seq, _ in await asyncio.wait_for(_answers(call, 1), BOUND)] == [1]
        finally:
            call.cancel()
        assert await dp.stored(a) == [0, 1] and await dp.stored(b) == [0]
        assert seqs(await down.wait_count(2)) == [0, 1]  # a is live: forwarded
    details = await dp.details()
    assert details["dead_lettered"] - before == 2
    assert details["save_failures"] >= 5  # DEVICE_PERSISTENCE_SAVE_ATTEMPTS' default

    dead = [r for r in await read_records(dp.suite.bootstrap_servers, MSG_PERSISTED_DEAD) if r.key == bad.encode()]
    assert [int(pb.PersistedMsg.FromString(r.value).msg.payload) for r in dead] == [0, 1]
    assert all(b"WRONGTYPE" in dict(r.headers)[DEAD_LETTER_ERROR_HEADER] for r in dead)
    assert [pb.PersistedMsg.FromString(r.value).origin_offset for r in dead] == [21, 23]

    capsys.readouterr()
    await dead_letters(parser().parse_args(["dead-letters", "list", "--client-id", bad,
                                            "--bootstrap-servers", dp.suite.bootstrap_servers]))
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["client_id"], x["origin"]) for x in listed] == [(bad, "0:21"), (bad, "0:23")]
    assert "WRONGTYPE" in listed[0]["error"] and "payload" not in listed[0]

    # a newer copy is stored as soon as the keys are mended; the replayed older ones come after it
    await dp.store.redis.delete(dp.store.keys(bad).messages)
    await dp.publish(bad, [7])
    await dp.wait_stored(bad, lambda got: got == [7])
    await dead_letters(parser().parse_args(["dead-letters", "replay", "--client-id", bad,
                                            "--bootstrap-servers", dp.suite.bootstrap_servers]))
    replay = json.loads(capsys.readouterr().out)
    assert replay["replayed"] == 2 and replay["last_offset"] == dead[-1].offset
    await dp.wait_stored(bad, lambda got: got == [7, 0, 1])
    await dead_letters(parser().parse_args(["dead-letters", "replay", "--client-id", bad, "--after-offset",
                                            str(replay["last_offset"]), "--bootstrap-servers",
                                            dp.suite.bootstrap_servers]))
    assert json.loads(capsys.readouterr().out)["replayed"] == 0
    await dead_letters(parser().parse_args(["dead-letters", "replay", "--client-id", bad,
                                            "--bootstrap-servers", dp.suite.bootstrap_servers]))
    assert json.loads(capsys.readouterr().out)["replayed"] == 2  # written again, by mistake
    await dp.publish(bad, [8])  # behind them on the client's partition: once it is stored, they were handled
    await dp.wait_stored(bad, lambda got: got == [7, 0, 1, 8])
    for cid in (a, bad, b):
        await dp.stub.Clear(spb.ClearRequest(client_id=cid))


async def test_a_batch_whose_every_client_is_refused_waits_and_nothing_is_dead_lettered(dp):
    """When Redis refuses every client of a batch of several, the cause is not one client's data: the batch is
    retried like any failed save, unanswered and not dead-lettered, until Redis takes it."""
    x, y = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
    for cid in (x, y):
        await dp.store.redis.set(dp.store.keys(cid).messages, b"not a sorted set")
    before = await dp.details()
    call = dp.stub.Persist()
    try:
        await call.write(spb.PersistBatch(seq=1, records=[persisted(x, 0, (0, 30)), persisted(y, 0, (0, 31))]))
        answer = asyncio.ensure_future(_answers(call, 1))
        # past the attempts (5), and at least twice through the clients saved apart

        async def refused_apart() -> bool:
            return (await dp.details()).get("save_failures", 0) - before.get("save_failures", 0) >= 7
        assert await poll(refused_apart, BOUND), "the refused batch was not retried"
        assert not answer.done()
        assert (await dp.details()).get("dead_lettered", 0) == before.get("dead_lettered", 0)
        for cid in (x, y):
            await dp.store.redis.delete(dp.store.keys(cid).messages)
        assert await asyncio.wait_for(answer, BOUND) == [(1, 2)]
    finally:
        call.cancel()
    assert await dp.stored(x) == [0] and await dp.stored(y) == [0]
    for cid in (x, y):
        await dp.stub.Clear(spb.ClearRequest(client_id=cid))


async def test_tbmq_msg_persisted_records_of_a_refused_client_are_dead_lettered_and_committed_past(dp):
    """The same on the Kafka input (ROUTER_PERSIST_VIA=kafka): the refused client's records go to the dead
    letters, the others are stored, and the consumer goes on (a later record of a good client is stored)."""
    from tbmq_platform.cli import read_records
    from tbmq_platform.topics import MSG_PERSISTED_DEAD

    good, bad = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
    await dp.store.redis.set(dp.store.keys(bad).messages, b"not a sorted set")
    await dp.publish(bad, [0, 1], flush=False)
    await dp.publish(good, [0])
    await dp.wait_stored(good, lambda got: got == [0])
    await dp.publish(good, [1])
    await dp.wait_stored(good, lambda got: got == [0, 1])
    dead = [r for r in await read_records(dp.suite.bootstrap_servers, MSG_PERSISTED_DEAD) if r.key == bad.encode()]
    assert [int(pb.PersistedMsg.FromString(r.value).msg.payload) for r in dead] == [0, 1]
    await dp.store.redis.delete(dp.store.keys(bad).messages)
    for cid in (good, bad):
        await dp.stub.Clear(spb.ClearRequest(client_id=cid))


@pytest.mark.parametrize("reset", ["earliest", "latest"])
async def test_a_group_without_offsets_starts_where_auto_offset_reset_says(kafka, tmp_path_factory, reset):
    """DEVICE_PERSISTENCE_AUTO_OFFSET_RESET (docs/operations.md, "A consumer group without offsets"): a new group
    on tbmq.msg.persisted stores a copy written before it started with `earliest` (the default: nothing lost)
    and skips it with `latest`, storing only what comes after its start."""
    from tbmq_platform.kafka import ensure_topics
    from tbmq_platform.topics import spec

    cid = f"dev-{uuid.uuid4().hex[:10]}"
    await ensure_topics(kafka.bootstrap_servers, [spec(MSG_PERSISTED)])
    producer = make_producer(kafka.bootstrap_servers, client_id="dp-test-before", linger_ms=1)
    await producer.start()
    try:  # the copy written before the group exists
        await producer.send_and_wait(MSG_PERSISTED, key=cid.encode(), value=pb.PersistedMsg(
            client_id=cid, msg=pb.PublishMsg(topic=f"t/{cid}", payload=b"0", qos=1)).SerializeToString())
    finally:
        await producer.stop()
    env = {} if reset == "earliest" else {"DEVICE_PERSISTENCE_AUTO_OFFSET_RESET": reset}
    async with own_suite(kafka, tmp_path_factory, f"reset-{reset}", env) as h:
        sent = [0]
        stored: list[int] = []

        async def a_later_copy_stored() -> bool:  # one more copy per look: the first written after the start
            stored[:] = await h.stored(cid)
            if any(seq > 0 for seq in stored):
                return True
            sent.append(sent[-1] + 1)
            await h.publish(cid, [sent[-1]])
            return False

        await wait_until(a_later_copy_stored, BOUND, "a copy written after the start stored", step=0.2)
        stored[:] = await h.wait_stored(cid, lambda got: got and got[-1] == sent[-1])
        if reset == "earliest":
            assert stored == sent  # the copy written before the start too, then every later one, in order
        else:
            assert stored[0] > 0 and stored == sent[sent.index(stored[0]):]  # 0 skipped, none after it
        await h.stub.Clear(spb.ClearRequest(client_id=cid))


async def test_the_copies_of_persist_streams_are_tallied_per_second_for_the_statistics(kafka, tmp_path_factory):
    """Each second that had Persist-stream copies gets one PersistTally on tbmq.msg.persisted.tally (key = the
    instance), written once the second is over: together they count every copy answered, with its QoS and
    payload bytes (the Spark statistics' outgoing path=persisted, tests/unit/spark/test_decode_tally.py). An
    instance of its own: the module's `dp` instances tally the other tests' copies, and write them up to
    TALLY_FLUSH_S later, so their tallies could land after any starting offset taken here."""
    from tbmq_platform.cli import read_records
    from tbmq_platform.topics import MSG_PERSISTED_TALLY

    async with own_suite(kafka, tmp_path_factory, "tally", {}) as dp:
        key = dp.suite.service_id("device-persistence").encode()
        c = f"dev-{uuid.uuid4().hex[:10]}"
        batches = [[pb.PersistedMsg(client_id=c, msg=pb.PublishMsg(topic="t", payload=b"x" * (i + j),
                                                                   qos=(i + j) % 3),
                                    origin_partition=0, origin_offset=1000 + 10 * i + j).SerializeToString()
                    for j in range(3)] for i in range(4)]
        sent = [pb.PersistedMsg.FromString(v).msg for b in batches for v in b]
        call = dp.stub.Persist()
        try:
            for seq, records in enumerate(batches, 1):
                await call.write(spb.PersistBatch(seq=seq, records=records))
            assert [x.seq for x in [await call.read() for _ in batches]] == [1, 2, 3, 4]
        finally:
            call.cancel()
        answered_ms = time.time() * 1000
        got: list = []

        async def tallied() -> bool:
            got[:] = [pb.PersistTally.FromString(r.value)
                      for r in await read_records(dp.suite.bootstrap_servers, MSG_PERSISTED_TALLY) if r.key == key]
            return sum(t.copies for t in got) >= len(sent)

        assert await poll(tallied, BOUND), f"tallies: {got}"
        assert sum(t.copies for t in got) == len(sent)
        assert sum(t.payload_bytes for t in got) == sum(len(m.payload) for m in sent)
        assert [sum(t.copies_by_qos[q] for t in got if len(t.copies_by_qos) > q) for q in range(3)] == [
            sum(m.qos == q for m in sent) for q in range(3)]
        assert all(t.second_ms % 1000 == 0 and t.second_ms <= answered_ms for t in got)
        await dp.stub.Clear(spb.ClearRequest(client_id=c))


# ------------------------------------------------------------------------------------ held forwards

HELD = {"DEVICE_PERSISTENCE_HELD": "true", "DEVICE_PERSISTENCE_HELD_MS": "500"}


async def _live_and_held(h, conn: str, down, cid: str, call) -> None:
    """`cid` attached to `conn`, one copy saved, forwarded and acknowledged: its store is empty, and the
    acknowledgement makes it enter held mode (reserve_held.lua)."""
    page = await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id=conn, session_id="s"))
    assert not page.messages
    await call.write(spb.PersistBatch(seq=1, records=[persisted(cid, 0, (0, 10))]))
    assert (await call.read()).seq == 1  # saved in Redis first: not held yet
    (first,) = await down.wait_count(1)
    await down.acknowledge([(cid, first.packet_id, first.serial)])
    await wait_until(lambda: _details_show(h, held_clients=1), BOUND, "the client entered held mode")


@contextlib.asynccontextmanager
async def _held_client(kafka, tmp_path_factory, name: str):
    """A device-persistence with held forwards, a fake connector's Forward stream, a router's Persist stream, and a
    client live on that connector in held mode (`_live_and_held`): (handles, forward stream, Persist call, client)."""
    cid = f"dev-{uuid.uuid4().hex[:10]}"
    async with own_suite(kafka, tmp_path_factory, name, HELD) as h:
        conn = await h.fake_connector()
        async with h.forward(conn) as down:
            call = h.stub.Persist()
            try:
                await _live_and_held(h, conn, down, cid, call)
                yield h, down, call, cid
            finally:
                call.cancel()


async def test_held_copies_are_forwarded_at_once_and_answered_on_their_acknowledgement_without_redis(
        kafka, tmp_path_factory):
    """DEVICE_PERSISTENCE_HELD: a live client's QoS 1 copies are forwarded with the next serials and packet ids and
    kept in memory only; the Persist batch is answered once the client acknowledged them, and nothing of them is
    ever stored in Redis. Its origin marks are written first: the same batch sent again (a router's replay) is
    answered with nothing stored and nothing forwarded again."""
    async with _held_client(kafka, tmp_path_factory, "held") as (h, down, call, cid):
        records = [persisted(cid, 1, (0, 11)), persisted(cid, 2, (0, 12))]
        await call.write(spb.PersistBatch(seq=2, records=records))
        got = (await down.wait_count(3))[1:]
        assert seqs(got) == [1, 2] and [d.serial for d in got] == [got[0].serial, got[0].serial + 1]
        assert got[0].serial > down.messages[0].serial and all(d.packet_id for d in got)
        assert await h.stored(cid) == []  # held: in memory and on the connection only
        answer = asyncio.ensure_future(call.read())
        offline = f"dev-{uuid.uuid4().hex[:10]}"  # a batch after it, saved in Redis as today
        await call.write(spb.PersistBatch(seq=3, records=[persisted(offline, 0, (0, 13))]))
        await h.wait_stored(offline, lambda got: got == [0])
        assert not answer.done()  # answers go in order: batch 2's waits for its acknowledgements
        await down.acknowledge([(cid, d.packet_id, d.serial) for d in got])
        assert (await asyncio.wait_for(answer, BOUND)).seq == 2
        assert (await asyncio.wait_for(call.read(), BOUND)).seq == 3
        assert await h.stored(cid) == []
        details = await h.details()
        assert details.get("held_held") == 2 and details.get("held_released") == 2
        again = h.stub.Persist()
        try:
            await again.write(spb.PersistBatch(seq=1, records=records))
            answer = await asyncio.wait_for(again.read(), BOUND)
            assert (answer.seq, answer.saved) == (1, 0)
        finally:
            again.cancel()
        assert await h.stored(cid) == [] and seqs(down.messages) == [0, 1, 2]


async def test_a_held_copy_not_acknowledged_in_time_is_written_to_redis_and_the_next_session_gets_it(
        kafka, tmp_path_factory):
    """A held copy whose acknowledgement does not come within DEVICE_PERSISTENCE_HELD_MS is written to Redis as a
    handed-out message, with the serial and packet id it went out with: its batch is answered then, and the next
    session's first page has it."""
    async with _held_client(kafka, tmp_path_factory, "held-late") as (h, down, call, cid):
        await call.write(spb.PersistBatch(seq=2, records=[persisted(cid, 1, (0, 11)), persisted(cid, 2, (0, 12))]))
        one, two = (await down.wait_count(3))[1:]
        await down.acknowledge([(cid, one.packet_id, one.serial)])  # the second never
        assert (await asyncio.wait_for(call.read(), BOUND)).seq == 2  # answered by the spill
        assert await h.stored(cid) == [2]
        assert (await h.details()).get("held_spilled_deadline") == 1
        page = await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=cid, service_id="other-conn",
                                                                         session_id="s2"))
        assert [(d.serial, d.packet_id, int(d.msg.payload)) for d in page.messages] == [
            (two.serial, two.packet_id, 2)]


async def test_a_session_event_and_a_streams_end_write_the_held_tail_first(kafka, tmp_path_factory):
    """With a hold far longer than the test, a held client's next fetch (a reconnect) finds its unacknowledged
    copies in Redis, and so does a client whose connector's Forward stream ended: neither waits for the deadline."""
    a, b = f"dev-{uuid.uuid4().hex[:10]}", f"dev-{uuid.uuid4().hex[:10]}"
    async with own_suite(kafka, tmp_path_factory, "held-events", {**HELD, "DEVICE_PERSISTENCE_HELD_MS": "60000"}) as h:
        conn_a, conn_b = await h.fake_connector(), await h.fake_connector()
        async with h.forward(conn_a) as down_a:
            call = h.stub.Persist()
            try:
                await _live_and_held(h, conn_a, down_a, a, call)
                await call.write(spb.PersistBatch(seq=2, records=[persisted(a, 1, (0, 11))]))
                (held_a,) = (await down_a.wait_count(2))[1:]
                page = await h.stub.FetchUndelivered(spb.FetchUndeliveredRequest(client_id=a, service_id=conn_a,
                                                                                 session_id="s2"))
                assert [(d.serial, int(d.msg.payload)) for d in page.messages] == [(held_a.serial, 1)]
                assert (await asyncio.wait_for(call.read(), BOUND)).seq == 2
            finally:
                call.cancel()
        async with h.forward(conn_b) as down_b:
            call = h.stub.Persist()
            try:
                await _live_and_held(h, conn_b, down_b, b, call)
                await call.write(spb.PersistBatch(seq=2, records=[persisted(b, 1, (1, 20))]))
                await down_b.wait_count(2)
                answer = asyncio.ensure_future(call.read())
            except BaseException:
                call.cancel()
                raise
        try:  # the stream of conn_b ended
            assert (await asyncio.wait_for(answer, BOUND)).seq == 2
        finally:
            call.cancel()
        assert await h.stored(b) == [1]
