"""Helpers of the connector's end-to-end tests: Kafka tails, a fake session registry, MQTT client helpers.

Imported by the test modules of this folder (pytest puts the folder on sys.path).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Callable

import paho.mqtt.client as mqtt
from aiokafka import AIOKafkaConsumer, TopicPartition
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.packettypes import PacketTypes
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.kafka import make_producer
from tbmq_platform.topics import SESSION_EVENT_REQUEST, response_topic

BOUND = 20.0  # every wait in these tests is bounded by this many seconds


async def assign_at_end(consumer: AIOKafkaConsumer, topics) -> None:
    tps = []
    for topic in topics:
        parts = None
        for _ in range(100):
            parts = consumer.partitions_for_topic(topic)
            if parts:
                break
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
        assert parts, f"topic {topic} does not exist"
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
        deadline = time.monotonic() + timeout
        for r in self.records:
            if pred(r):
                return r
        while time.monotonic() < deadline:
            batches = await self.consumer.getmany(timeout_ms=200)
            for _, recs in batches.items():
                for r in recs:
                    self.records.append(r)
                    if pred(r):
                        return r
        raise AssertionError(f"no matching record on {self.topics} within {timeout}s "
                             f"({len(self.records)} seen)")

    async def drain(self, seconds: float) -> list:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batches = await self.consumer.getmany(timeout_ms=100)
            for _, recs in batches.items():
                self.records.extend(recs)
        return self.records


class FakeRegistry:
    """Answers CONNECTION_REQUESTs like the session registry would (success, session present when the
    client id was seen before and clean start is false); `mode[client_id]` overrides: "silent" (no answer),
    "quota", or a client type "APPLICATION". Records every request."""

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
            resp.session_expiry_interval = info.session_expiry_interval
            stored = pb.SessionInfo()
            stored.CopyFrom(info)
            stored.connected = True
            self.sessions[cid] = stored
        await self.producer.send_and_wait(response_topic(info.service_id), resp.SerializeToString(),
                                          key=cid.encode())


# ------------------------------------------------------------------------------------------ paho helpers
class Client:
    """A paho-mqtt client run on its own network thread, with received messages collected."""

    def __init__(self, client_id: str, *, v5: bool = True, clean: bool = True, session_expiry: int | None = None):
        self.v5 = v5
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        kw = {} if v5 else {"clean_session": clean}
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto, **kw)
        self.clean = clean
        self.session_expiry = session_expiry
        self.messages: list[mqtt.MQTTMessage] = []
        self.cond = threading.Condition()
        self.connack = None
        self.disconnected = None
        self.suback = None
        self.c.on_message = self._on_message
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_subscribe = self._on_subscribe

    def _on_message(self, client, userdata, msg):
        with self.cond:
            self.messages.append(msg)
            self.cond.notify_all()

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.connack = (flags, reason_code, properties)
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.disconnected = reason_code
            self.cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties):
        with self.cond:
            self.suback = (mid, reason_codes)
            self.cond.notify_all()

    def wait(self, pred: Callable[[], bool], timeout: float = BOUND) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def connect(self, port: int, *, keepalive: int = 60, will=None, expect_ok: bool = True, **props):
        if will is not None:
            self.c.will_set(*will[:4], properties=will[4] if len(will) > 4 else None)
        kw = {}
        if self.v5:
            p = PahoProperties(PacketTypes.CONNECT)
            if self.session_expiry is not None:
                p.SessionExpiryInterval = self.session_expiry
            for k, v in props.items():
                setattr(p, k, v)
            kw = {"clean_start": self.clean, "properties": p}
        self.c.connect("127.0.0.1", port, keepalive=keepalive, **kw)
        self.c.loop_start()
        assert self.wait(lambda: self.connack is not None or self.disconnected is not None), "no CONNACK"
        if expect_ok:
            assert self.connack is not None and not self.connack[1].is_failure, f"CONNACK {self.connack}"
        return self.connack

    def subscribe(self, *args, **kw):
        self.suback = None
        res, mid = self.c.subscribe(*args, **kw)
        assert self.wait(lambda: self.suback is not None and self.suback[0] == mid), "no SUBACK"
        return self.suback[1]

    def publish(self, topic, payload=b"", qos=0, retain=False, properties=None, wait=True):
        info = self.c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if wait and qos:
            info.wait_for_publish(BOUND)
            assert info.is_published()
        return info

    def messages_on(self, topic: str) -> list:
        with self.cond:
            return [m for m in self.messages if m.topic == topic]

    def close(self):
        try:
            self.c.disconnect()
        except Exception:
            pass
        self.c.loop_stop()


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
    FetchUndelivered returns; every call is recorded in `calls` as (method, client_id, value)."""

    def __init__(self, registry: FakeRegistry) -> None:
        self._loop = registry._loop
        self.stored: dict[str, list] = {}
        self.calls: list[tuple] = []
        self.port = 0
        self._server = None

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

            async def Clear(self, request, context):
                fake.calls.append(("clear", request.client_id, None))
                return spb.ClearResponse(removed=0)

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
