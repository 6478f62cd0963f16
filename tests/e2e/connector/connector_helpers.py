"""Helpers of the connector's end-to-end tests: Kafka tails, a fake session registry, fake device-persistence
and app-delivery gRPC servers, raw MQTT sockets (the `tbmq` command line is tests/e2e/tbmq_command.py, the paho client
wrapper tests/e2e/mqtt_clients.py).

Imported by the test modules of this folder (pytest puts the folder on sys.path).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import threading
import time
import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from kafka_views import partitions_of
from mqtt_clients import BOUND
from session_registry.logic import Rules, is_persistent
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.kafka import make_producer
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_platform.topics import SESSION_EVENT_REQUEST, response_topic
from waits import wait_until


RULES = Rules()  # the registry's defaults

# modules whose suite runs device-persistence are skipped (with this reason) while it has no entry point
needs_device_persistence = pytest.mark.skipif(
    importlib.util.find_spec("device_persistence.__main__") is None,
    reason="device-persistence has no entry point yet (services/device-persistence)")


@contextlib.asynccontextmanager
async def two_connector_suite(kafka, run_dir, services, **kw):
    """The launcher's Suite with `services` and TWO connectors on free ports, started, stopped on exit."""
    s = Suite(services=list(services), connectors=2, ports="free", log_format="json", id_tag=new_tag(),
              run_dir=run_dir, kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers, **kw)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def assign_at_end(consumer: AIOKafkaConsumer, topics) -> None:
    tps = []
    for topic in topics:
        parts = await partitions_of(consumer, topic)
        tps.extend(TopicPartition(topic, p) for p in sorted(parts))
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)


class Tail:
    """Records appended to Kafka topics after `start()`."""

    def __init__(self, bootstrap: str, *topics: str) -> None:
        self.topics = topics
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                         group_id=None, client_id=f"tail-{uuid.uuid4().hex[:6]}")
        self.records: list = []

    async def __aenter__(self) -> "Tail":
        await self.consumer.start()
        await assign_at_end(self.consumer, self.topics)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.consumer.stop()

    async def wait_for(self, pred: Callable, timeout: float = BOUND):
        """The first record (seen before or read now) for which `pred(record)` holds (`waits.wait_until`:
        one fetch of up to 200 ms per check)."""
        for r in self.records:
            if pred(r):
                return r

        async def read_and_find():
            found = None
            for r in await self._read():
                if found is None and pred(r):
                    found = r
            return found

        return await wait_until(read_and_find, timeout,
                                lambda: f"a matching record on {self.topics} ({len(self.records)} seen)", step=0)

    async def wait_for_count(self, pred: Callable, n: int, timeout: float = BOUND) -> None:
        """Until `n` records (seen before or read now) satisfy `pred(record)`."""
        async def enough() -> bool:
            await self._read()
            return sum(1 for r in self.records if pred(r)) >= n

        await wait_until(enough, timeout, lambda: f"{n} matching records on {self.topics} "
                                                  f"({sum(1 for r in self.records if pred(r))} so far)", step=0)

    async def _read(self) -> list:
        """One fetch of up to 200 ms; its records are kept in `records` and returned."""
        batches = await self.consumer.getmany(timeout_ms=200)
        got = [r for recs in batches.values() for r in recs]
        self.records.extend(got)
        return got


class FakeRegistry:
    """Answers CONNECTION_REQUESTs like the session registry would (success, session present when the
    client id was seen before and clean start is false; the interval and persistence by the registry's own
    rules, session_registry.logic); `mode[client_id]` overrides: "silent" (no answer), "quota", or a client
    type "APPLICATION". Records every request."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.requests: list[pb.SessionEventRequest] = []
        self.sessions: dict[str, pb.SessionInfo] = {}
        self.mode: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-registry")
        self._task = None

    def start(self) -> "FakeRegistry":
        """Runs on its own thread and loop, so blocking client calls in the tests cannot starve it."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        from tbmq_platform.kafka import ensure_topics
        from tbmq_platform.topics import static_topics

        await ensure_topics(self.bootstrap, static_topics())
        self.consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False,
                                         group_id=None, client_id="fake-registry")
        self.producer = make_producer(self.bootstrap, client_id="fake-registry")
        await self.consumer.start()
        await self.producer.start()
        await assign_at_end(self.consumer, [SESSION_EVENT_REQUEST])
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()
        await self.producer.stop()

    async def _run(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100)
            for _, recs in batches.items():
                for r in recs:
                    req = pb.SessionEventRequest.FromString(r.value)
                    self.requests.append(req)
                    await self._handle(req)

    async def _handle(self, req: pb.SessionEventRequest) -> None:
        info = req.session
        cid = info.client_id
        if req.type == pb.SESSION_EVENT_DISCONNECTION_REQUEST:
            cur = self.sessions.get(cid)
            if cur is not None and cur.session_id == info.session_id:
                cur.connected = False
            return
        if req.type != pb.SESSION_EVENT_CONNECTION_REQUEST:
            return
        mode = self.mode.get(cid, "")
        if mode == "silent":
            return
        resp = pb.SessionEventResponse(request_id=req.request_id, client_id=cid)
        if mode == "quota":
            resp.success = False
            resp.failure = pb.SESSION_FAILURE_QUOTA_EXCEEDED
        else:
            prior = self.sessions.get(cid)
            if prior is not None and prior.connected:
                cmd = pb.DisconnectCommand(client_id=cid, session_id=prior.session_id,
                                           new_session_clean_start=info.clean_start,
                                           reason=pb.DISCONNECT_REASON_SESSION_TAKEN_OVER)
                await self.producer.send_and_wait("tbmq.client.disconnect." + prior.service_id,
                                                  cmd.SerializeToString(), key=cid.encode())
            resp.success = True
            resp.session_present = prior is not None and not info.clean_start
            resp.client_type = pb.CLIENT_TYPE_APPLICATION if mode == "APPLICATION" else pb.CLIENT_TYPE_DEVICE
            resp.session_expiry_interval = RULES.effective_expiry(info.mqtt_version, info.clean_start,
                                                                  info.session_expiry_interval)
            resp.persistent = is_persistent(resp.session_expiry_interval, resp.session_present)
            stored = pb.SessionInfo()
            stored.CopyFrom(info)
            stored.connected = True
            self.sessions[cid] = stored
        await self.producer.send_and_wait(response_topic(info.service_id), resp.SerializeToString(),
                                          key=cid.encode())


# ------------------------------------------------------------------------------------------ connector state
async def connector_health(suite, instance: int = 1) -> dict:
    """GET /readyz of a connector instance as JSON: its counters (`pending_wills`, `wills_sent`, ...)."""
    from tbmq_launcher.services import readyz
    h = await readyz(suite.health_port("connector", instance))
    h.setdefault("wills_sent", 0)  # a counter appears with its first increment
    return h


async def disconnect_reported(tail: "Tail", client_id: str) -> pb.SessionEventRequest:
    """Wait until a connector produced the DISCONNECTION_REQUEST of `client_id` (on `tail`, a Tail of
    tbmq.client.session.event.request): the connector has finished with the connection's end (its Will
    decided and, without a delay, counted in `wills_sent`)."""
    rec = await tail.wait_for(lambda r: (d := pb.SessionEventRequest.FromString(r.value)).session.client_id ==
                              client_id and d.type == pb.SESSION_EVENT_DISCONNECTION_REQUEST)
    return pb.SessionEventRequest.FromString(rec.value)


# ------------------------------------------------------------------------------------------ raw sockets
def raw_socket(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
    return s


def recv_until_closed(s: socket.socket, timeout: float = BOUND) -> bytes:
    """Everything the server sends until it closes the connection (AssertionError if it does not)."""
    s.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return data
        except socket.timeout:
            break
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"connection not closed within {timeout}s (got {data!r})")


# ------------------------------------------------------------------------------------------ fake device-persistence
class FakeDevicePersistence:
    """A DevicePersistence gRPC server (on the FakeRegistry's loop): `stored[client_id]` is what
    FetchUndelivered returns; every call is recorded in `calls` as (method, client_id, value), the
    acknowledgements that come up a Forward stream like those of AcknowledgeMany. `streams` holds the
    open Forward streams by service id; `forward(service_id, messages)` sends a batch down one."""

    def __init__(self, registry: FakeRegistry) -> None:
        self._loop = registry._loop
        self.stored: dict[str, list] = {}
        self.calls: list[tuple] = []
        self.streams: dict[str, asyncio.Queue] = {}
        self.port = 0
        self._server = None

    def forward(self, service_id: str, messages) -> None:
        from tbmq.v1 import services_pb2 as spb

        down = spb.ForwardDown(batch=spb.ForwardBatch(messages=list(messages)))
        self._loop.call_soon_threadsafe(self.streams[service_id].put_nowait, down)

    def start(self) -> "FakeDevicePersistence":
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(30)

    async def _start(self) -> None:
        import grpc
        from tbmq.v1 import services_pb2 as spb
        from tbmq.v1 import services_pb2_grpc as sgrpc

        fake = self

        class Servicer(sgrpc.DevicePersistenceServicer):
            async def FetchUndelivered(self, request, context):
                fake.calls.append(("fetch", request.client_id, request.session_id))
                return spb.FetchUndeliveredResponse(messages=fake.stored.get(request.client_id, []))

            async def Detach(self, request, context):
                fake.calls.append(("detach", request.client_id, request.session_id))
                return spb.DetachResponse(detached=True)

            async def Acknowledge(self, request, context):
                fake.calls.append(("ack", request.client_id, request.packet_id))
                return spb.PacketResponse(found=True)

            async def MarkPubrec(self, request, context):
                fake.calls.append(("pubrec", request.client_id, request.packet_id))
                return spb.PacketResponse(found=True)

            async def AcknowledgeMany(self, request, context):
                # what the connector sends (batched): recorded as the unary calls would be
                for p in request.pubrecs:
                    fake.calls.append(("pubrec", p.client_id, p.packet_id))
                for a in request.acks:
                    fake.calls.append(("ack", a.client_id, a.packet_id))
                return spb.PacketBatchResponse(acknowledged=len(request.acks), marked=len(request.pubrecs))

            async def Clear(self, request, context):
                fake.calls.append(("clear", request.client_id, None))
                return spb.ClearResponse(removed=0)

            async def Forward(self, request_iterator, context):
                requests = request_iterator.__aiter__()
                first = await requests.__anext__()
                service_id = first.open.service_id
                queue: asyncio.Queue = asyncio.Queue()
                fake.streams[service_id] = queue
                queue.put_nowait(spb.ForwardDown(ready=spb.ForwardReady(instance_id="fake")))

                async def read_acks():
                    async for up in requests:
                        b = up.acks.batch
                        for p in b.pubrecs:
                            fake.calls.append(("pubrec", p.client_id, p.packet_id))
                        for a in b.acks:
                            fake.calls.append(("ack", a.client_id, a.packet_id))
                        queue.put_nowait(spb.ForwardDown(acked=spb.ForwardAcked(
                            seq=up.acks.seq, acknowledged=len(b.acks), marked=len(b.pubrecs))))

                reader = asyncio.ensure_future(read_acks())
                try:
                    while True:
                        await context.write(await queue.get())
                finally:
                    reader.cancel()
                    if fake.streams.get(service_id) is queue:
                        del fake.streams[service_id]

        self._server = grpc.aio.server()
        sgrpc.add_DevicePersistenceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()


class FakeAppDelivery:
    """An AppDelivery gRPC server: on AppOpen it sends `records[client_id]` and records the acks."""

    def __init__(self, registry: FakeRegistry) -> None:
        self._loop = registry._loop
        self.records: dict[str, list] = {}
        self.opens: list = []
        self.acks: list = []
        self.port = 0
        self._server = None

    def start(self) -> "FakeAppDelivery":
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(30)

    async def _start(self) -> None:
        import grpc
        from tbmq.v1 import services_pb2 as spb
        from tbmq.v1 import services_pb2_grpc as sgrpc

        fake = self

        class Servicer(sgrpc.AppDeliveryServicer):
            async def Deliver(self, request_iterator, context):
                first = await request_iterator.__anext__()
                fake.opens.append(first.open)
                for rec in fake.records.get(first.open.client_id, []):
                    yield spb.AppDownstream(record=rec)
                async for up in request_iterator:
                    if up.HasField("ack"):
                        fake.acks.append((first.open.client_id, up.ack.ref.offset))

        self._server = grpc.aio.server()
        sgrpc.add_AppDeliveryServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
