"""Test helpers for the session registry against a real Kafka: a fake connector (produces session requests,
reads its response and disconnect topics), a topic watcher, and a fake DevicePersistence gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from aiokafka import TopicPartition
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2, services_pb2_grpc
from tbmq_platform import topics
from tbmq_platform.kafka import KeyPartitioner, ensure_topics, make_consumer, make_producer
from kafka_views import partitions_of
from waits import wait_until

SERVICE_ENV_BASE = {
    "TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS": "300",
    "DEVICE_PERSISTENCE_CLEAR_TIMEOUT_MS": "1500",
    "TBMQ_APPLICATION_CLIENT_ID_PATTERNS": r"app-.*",
    "TBMQ_APPLICATION_USERNAME_PATTERNS": r"appuser",
    "LOG_LEVEL": os.environ.get("SR_TEST_LOG_LEVEL", "INFO"),
}


async def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05, what: str = ""):
    """`waits.wait_until` with this harness's default bound (15 s): the truthy value `check` returned."""
    return await wait_until(check, timeout, what or "condition", step=interval)


class TopicWatch:
    """Every record of a topic from the moment of start() on (read_committed), in order."""

    def __init__(self, bootstrap: str, topic: str, *, from_beginning: bool = False):
        self.bootstrap, self.topic, self.from_beginning = bootstrap, topic, from_beginning
        self.records: list = []
        self._consumer = None
        self._task: asyncio.Task | None = None

    async def start(self) -> "TopicWatch":
        await ensure_topics(self.bootstrap, topics.static_topics())
        self._consumer = make_consumer(self.bootstrap, group_id=None, client_id=f"watch-{uuid.uuid4().hex[:6]}",
                                       read_committed=True)
        await self._consumer.start()
        parts = await partitions_of(self._consumer, self.topic)
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        if self.from_beginning:
            await self._consumer.seek_to_beginning(*tps)
        else:
            await self._consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the position now, so nothing produced after start() is missed
                await self._consumer.position(tp)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self):
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            for recs in batches.values():
                self.records.extend(recs)

    def of_key(self, key: str) -> list:
        k = key.encode()
        return [r for r in self.records if r.key == k]

    async def stop(self):
        if self._task:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._consumer:
            await self._consumer.stop()


_PARTITIONER = KeyPartitioner()


class FakeConnector:
    """Speaks the connector's side of the session protocol over Kafka."""

    def __init__(self, bootstrap: str, service_id: str):
        self.bootstrap = bootstrap
        self.service_id = service_id
        self.incarnation = ""      # the run its requests and heartbeats name (set a new one to "restart")
        self.producer = make_producer(bootstrap, client_id=f"fake-{service_id}")
        self.responses: list[pb.SessionEventResponse] = []
        self.disconnects: list[pb.DisconnectCommand] = []
        self._watches: list[TopicWatch] = []

    async def start(self) -> "FakeConnector":
        await ensure_topics(self.bootstrap, topics.service_topics(self.service_id))
        await self.producer.start()
        self.resp_watch = await TopicWatch(self.bootstrap, topics.response_topic(self.service_id),
                                           from_beginning=True).start()
        self.disc_watch = await TopicWatch(self.bootstrap, topics.disconnect_topic(self.service_id),
                                           from_beginning=True).start()
        return self

    async def stop(self):
        await self.resp_watch.stop()
        await self.disc_watch.stop()
        await self.producer.stop()

    def all_responses(self) -> list[pb.SessionEventResponse]:
        return [pb.SessionEventResponse.FromString(r.value) for r in self.resp_watch.records]

    def all_disconnects(self) -> list[pb.DisconnectCommand]:
        return [pb.DisconnectCommand.FromString(r.value) for r in self.disc_watch.records]

    def response(self, request_id: str) -> pb.SessionEventResponse | None:
        for r in self.all_responses():
            if r.request_id == request_id:
                return r
        return None

    async def request_partition(self, client_id: str) -> tuple[int, int]:
        """(the partition of tbmq.client.session.event.request a client's requests go to, the partition
        count): the registry answers the requests of one partition in order."""
        n = len(await self.producer.partitions_for(topics.SESSION_EVENT_REQUEST))
        return _PARTITIONER.hash(client_id.encode()) % n, n

    async def heartbeat(self, *, stopped: bool = False) -> None:
        """A ConnectorHeartbeat of this run (tbmq.connector.heartbeat)."""
        hb = pb.ConnectorHeartbeat(service_id=self.service_id, incarnation=self.incarnation,
                                   sent_at_ms=int(time.time() * 1000), stopped=stopped)
        await self.producer.send_and_wait(topics.CONNECTOR_HEARTBEAT, hb.SerializeToString(),
                                          key=self.service_id.encode())

    async def send(self, req: pb.SessionEventRequest) -> None:
        await self.producer.send_and_wait(topics.SESSION_EVENT_REQUEST, req.SerializeToString(),
                                          key=req.session.client_id.encode())

    def connect_request(self, client_id: str, *, session_id: str | None = None, clean_start: bool = False,
                        sei: int = 0, version: int = 5, username: str = "", keep_alive: int = 30,
                        request_id: str | None = None, will: pb.PublishMsg | None = None,
                        will_delay: int = 0) -> pb.SessionEventRequest:
        req = pb.SessionEventRequest(
            request_id=request_id or uuid.uuid4().hex, type=pb.SESSION_EVENT_CONNECTION_REQUEST,
            request_time_ms=int(time.time() * 1000),
            session=pb.SessionInfo(client_id=client_id, service_id=self.service_id,
                                   session_id=session_id or uuid.uuid4().hex, clean_start=clean_start,
                                   session_expiry_interval=sei, mqtt_version=version, keep_alive=keep_alive,
                                   username=username, client_address="127.0.0.1:40000",
                                   connector_incarnation=self.incarnation))
        if will is not None:
            req.session.will.CopyFrom(will)
            req.session.will_delay = will_delay
        return req

    async def connect(self, client_id: str, timeout: float = 20.0, **kw) -> tuple[pb.SessionEventResponse, str]:
        """CONNECTION_REQUEST and its answer; returns (response, session id)."""
        req = self.connect_request(client_id, **kw)
        await self.send(req)
        resp = await eventually(lambda: self.response(req.request_id), timeout,
                                what=f"response to {client_id} {req.request_id}")
        return resp, req.session.session_id

    async def disconnect(self, client_id: str, session_id: str, *, sei: int | None = None) -> str:
        req = pb.SessionEventRequest(
            request_id=uuid.uuid4().hex, type=pb.SESSION_EVENT_DISCONNECTION_REQUEST,
            request_time_ms=int(time.time() * 1000), graceful=True,
            session=pb.SessionInfo(client_id=client_id, service_id=self.service_id, session_id=session_id))
        if sei is not None:
            req.disconnect_session_expiry_interval = sei
        await self.send(req)
        return req.request_id


class FakeDevicePersistence(services_pb2_grpc.DevicePersistenceServicer):
    """Records Clear calls; `fail = True` answers UNAVAILABLE."""

    def __init__(self):
        self.cleared: list[str] = []
        self.fail = False
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def Clear(self, request, context):
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake: down")
        self.cleared.append(request.client_id)
        return services_pb2.ClearResponse(removed=0)

    async def start(self) -> "FakeDevicePersistence":
        self.server = grpc.aio.server()
        services_pb2_grpc.add_DevicePersistenceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self):
        if self.server is not None:
            await self.server.stop(0)
