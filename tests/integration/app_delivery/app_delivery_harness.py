"""Helpers of app-delivery's integration tests: a fake connector (the gRPC client of AppDelivery.Deliver),
a producer of receiver copies, and the app-delivery subprocess started by the launcher."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_platform import topics
from tbmq_platform.kafka import ensure_topics, make_producer
from kafka_views import committed
from waits import quiet_for

NO_REDIS = "redis://127.0.0.1:1/0"  # app-delivery does not use Redis; keeps the Suite from starting one


def app_delivery_suite(kafka, run_dir, env: dict | None = None, instances: int = 1) -> Suite:
    return Suite(services=["app-delivery"], instances={"app-delivery": instances}, ports="free",
                 log_format="json", id_tag=new_tag(), run_dir=run_dir, redis_url=NO_REDIS,
                 kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers,
                 service_env={"app-delivery": {"APP_DELIVERY_COMMIT_INTERVAL_MS": "200", **(env or {})}},
                 start_timeout=60.0, stop_timeout=15.0)


def publish_msg(i: int, topic: str = "t/x", qos: int = 1, **kw) -> pb.PublishMsg:
    return pb.PublishMsg(publisher_id="pub", topic=topic, payload=str(i).encode(), qos=qos,
                         created_at_ms=kw.pop("created_at_ms", int(time.time() * 1000)),
                         publisher_mqtt_version=5, **kw)


class Producer:
    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.p = make_producer(bootstrap, client_id="test-producer", linger_ms=20)

    async def __aenter__(self) -> "Producer":
        await self.p.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.p.stop()

    async def to_client(self, client_id: str, msgs) -> None:
        await ensure_topics(self.bootstrap, [topics.app_topic(client_id)])
        name = topics.app_topic_name(client_id)
        futs = [await self.p.send(name, m.SerializeToString(), key=m.topic.encode()) for m in msgs]
        await asyncio.gather(*futs)

    async def to_shared(self, topic_filter: str, msgs, partition_of=None) -> None:
        await ensure_topics(self.bootstrap, [topics.shared_app_topic(topic_filter)])
        name = topics.shared_app_topic_name(topic_filter)
        futs = []
        for i, m in enumerate(msgs):
            part = partition_of(i) if partition_of else None
            futs.append(await self.p.send(name, m.SerializeToString(), key=m.topic.encode(), partition=part))
        await asyncio.gather(*futs)


class FakeStream:
    """One Deliver stream, as the connector holds it: a current connector (`opening.batches`: records come
    in AppRecordBatch messages, auto-acks go up as one AppAckBatch per batch) or an older one (one AppRecord
    per message, one AppAck per record)."""

    def __init__(self, stub: sgrpc.AppDeliveryStub, opening: spb.AppOpen, auto_ack=False) -> None:
        """auto_ack: True, or a predicate of the AppRecord: acknowledge on receipt."""
        self.opening = opening
        self.auto_ack = auto_ack
        self.up: asyncio.Queue = asyncio.Queue()
        self.up.put_nowait(spb.AppUpstream(open=opening))
        self.records: asyncio.Queue = asyncio.Queue()
        self.all: list[spb.AppRecord] = []
        self.sizes: list[int] = []           # records per downstream message
        self.kinds: set[str] = set()         # downstream message kinds seen ("record", "batch")
        self.ended = asyncio.Event()
        self.error: BaseException | None = None
        self.call = stub.Deliver(self._requests())
        self.task = asyncio.create_task(self._read())

    async def _requests(self):
        while True:
            item = await self.up.get()
            if item is None:
                return
            yield item

    async def _read(self) -> None:
        try:
            async for down in self.call:
                kind = down.WhichOneof("kind")
                self.kinds.add(kind)
                recs = list(down.batch.records) if kind == "batch" else [down.record]
                self.sizes.append(len(recs))
                self.all.extend(recs)
                for rec in recs:
                    self.records.put_nowait(rec)
                self.ack_many([r for r in recs if self.auto_ack is True
                               or (callable(self.auto_ack) and self.auto_ack(r))])
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        except asyncio.CancelledError:
            pass
        finally:
            self.ended.set()

    def ack(self, rec_or_ref) -> None:
        """One AppAck (a batch stream may send those too)."""
        ref = rec_or_ref.ref if isinstance(rec_or_ref, spb.AppRecord) else rec_or_ref
        self.up.put_nowait(spb.AppUpstream(ack=spb.AppAck(ref=ref)))

    def ack_many(self, recs) -> None:
        """One AppAckBatch on a batch stream; one AppAck each on a stream of single records."""
        if not recs:
            return
        if not self.opening.batches:
            for r in recs:
                self.ack(r)
            return
        self.up.put_nowait(spb.AppUpstream(acks=spb.AppAckBatch(refs=[r.ref for r in recs])))

    async def take(self, n: int, timeout: float = 30.0) -> list[spb.AppRecord]:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"got {len(out)} of {n} records in {timeout}s")
            out.append(await asyncio.wait_for(self.records.get(), left))
        return out

    async def nothing_for(self, seconds: float, what: str = "a record arrived") -> None:
        """The negative check no marker can close (a full window: app-delivery sends nothing more until an
        ack): `waits.quiet_for`, failing with `what` when a record arrives within `seconds`."""
        await quiet_for(seconds, lambda: not self.records.empty(), what)

    async def half_close(self) -> None:
        """End the upstream (the connector closing the stream politely) and wait for the server's end."""
        self.up.put_nowait(None)
        await asyncio.wait_for(self.ended.wait(), 20)

    async def cancel(self) -> None:
        """The connector dropping the stream (client disconnect, connector crash)."""
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class FakeConnector:
    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = sgrpc.AppDeliveryStub(self.channel)
        self.streams: list[FakeStream] = []
        self.batches = True   # streams open as a current connector's (AppOpen.batches)

    def open(self, client_id: str, receive_maximum: int = 100, shared=(), auto_ack=False,
             session_id: str = "s", batches: bool | None = None) -> FakeStream:
        opening = spb.AppOpen(client_id=client_id, session_id=session_id, receive_maximum=receive_maximum,
                              batches=self.batches if batches is None else batches,
                              shared=[spb.AppSharedSubscription(share_name=s[0], topic_filter=s[1],
                                                                **({"qos": s[2]} if len(s) > 2 else {}))
                                      for s in shared])
        st = FakeStream(self.stub, opening, auto_ack)
        self.streams.append(st)
        return st

    async def close(self) -> None:
        for st in self.streams:
            if not st.ended.is_set():
                st.call.cancel()
        await self.channel.close()


def payload_ints(records) -> list[int]:
    return [int(r.msg.payload) for r in records]


def app_group(client_id: str) -> str:
    """The consumer group app-delivery commits a client's offsets in (app_delivery.streams.client_group)."""
    from tbmq_routing.naming import app_client_group
    return app_client_group(client_id)


def committed_up_to(suite: Suite, client_id: str, offset: int):
    """A predicate for `waits.wait_until`: app-delivery committed the client's offsets up to `offset` (the
    system's own acknowledgement that the acks before it arrived; tbmq.msg.app.<client> has one partition)."""
    async def done() -> bool:
        return sum((await committed(suite.bootstrap_servers, app_group(client_id))).values()) >= offset
    return done
