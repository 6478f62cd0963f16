"""The app-delivery service: gRPC AppDelivery server + the tbmq.sys.app.removed consumer.

The server (the streams) starts without waiting for the removal consumer to join its group: removals are
not on the delivery path, and after a kill -9 that join waits out the dead member's session (docs/app-delivery.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from aiokafka.errors import GroupIdNotFound, NonEmptyGroup
from aiokafka.protocol.admin import DeleteGroupsRequest
from opentelemetry import trace
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_platform import topics
from tbmq_platform.kafka import IDLE_FETCH_WAIT_MS, delete_topics, ensure_topics, make_admin, make_consumer
from tbmq_platform.lifecycle import Service
from tbmq_platform.tracing import context_from_grpc, span_from_kafka
from tbmq_routing.naming import app_client_group

from .settings import AppDeliverySettings
from .streams import StreamSession

log = logging.getLogger(__name__)
tracer = trace.get_tracer("app_delivery")


class AppDeliveryService(Service, sgrpc.AppDeliveryServicer):
    name = "app-delivery"

    def __init__(self, settings: AppDeliverySettings):
        super().__init__(settings)
        self.s = settings
        self.server: grpc.aio.Server | None = None
        self.grpc_port: int | None = None
        self.streams: dict[str, StreamSession] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closing: set[asyncio.Task] = set()
        self._stopping = False
        self.removed_consumer = None
        self._removed_task: asyncio.Task | None = None
        self.removal_joined = False  # the removal consumer joined its group (/readyz)
        self.removed_count = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.s
        await ensure_topics(s.bootstrap, [topics.spec(topics.SYS_APP_REMOVED)], layout=s.topic_layout)
        self.removed_consumer = make_consumer(s.bootstrap, topics.SYS_APP_REMOVED, group_id=s.removed_group,
                                              client_id=f"{s.instance_id}-removed", max_poll_records=100,
                                              long_poll=True)
        # joined in the background: after a kill -9 the group waits out the dead member's session (10 s)
        # before it assigns the partition again, and the streams (the delivery path) must not wait for that
        self._removed_task = self.spawn(self._removed_loop(), "app.removed")
        self.server = grpc.aio.server(interceptors=s.grpc_tls.server_interceptors(),
                                      options=[("grpc.so_reuseport", 0)])
        sgrpc.add_AppDeliveryServicer_to_server(self, self.server)
        self.grpc_port = s.grpc_tls.add_port(self.server, f"{s.grpc_host}:{s.grpc_port}")
        if not self.grpc_port:
            raise RuntimeError(f"cannot listen on {s.grpc_host}:{s.grpc_port}")
        await self.server.start()
        log.info("AppDelivery gRPC on %s:%d (%s)", s.grpc_host, self.grpc_port,
                 "mutual TLS" if s.grpc_tls.enabled else "plaintext")
        m = self.metrics  # GET /metrics (tbmq_platform.metrics), read at scrape time
        m.gauge("app_streams", "APPLICATION clients streamed by this instance", lambda: len(self.streams))
        m.counter("app_topics_removed", "APPLICATION topics deleted after their session ended",
                  lambda: self.removed_count)
        m.lag("consumer_lag", lambda: [(src.group, src.consumer) for st in list(self.streams.values())
                                       for src in st.sources if src.consumer is not None])

    async def stop(self) -> None:
        self._stopping = True
        sessions = list(self.streams.values())
        if sessions:
            log.info("closing %d streams", len(sessions))
            await asyncio.wait([asyncio.ensure_future(x.close("server shutting down")) for x in sessions],
                               timeout=self.s.shutdown_grace_s + 10)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=10)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self._removed_task is not None:  # it may still be joining its group: not stopped under it
            self._removed_task.cancel()
            await asyncio.gather(self._removed_task, return_exceptions=True)
        if self.removed_consumer is not None:
            with contextlib.suppress(Exception):
                await self.removed_consumer.stop()

    def health_details(self) -> dict:
        return {"grpc_port": self.grpc_port, "streams": len(self.streams), "removed": self.removed_count,
                "removal_joined": self.removal_joined}

    # -- gRPC ---------------------------------------------------------------------------------------
    async def Deliver(self, request_iterator, context):  # noqa: N802 (gRPC name)
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("open") or not first.open.client_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be AppOpen with a client id")
        opening = first.open
        if self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "app-delivery is shutting down")
        cid = opening.client_id
        with tracer.start_as_current_span("app-delivery Deliver", context=context_from_grpc(context.invocation_metadata()),
                                          kind=trace.SpanKind.SERVER,
                                          attributes={"client_id": cid, "session_id": opening.session_id}):
            session = StreamSession(self.s, opening, context, on_closed=self._on_closed)
            lock = self._locks.setdefault(cid, asyncio.Lock())
            async with lock:
                old = self.streams.get(cid)
                if old is not None:
                    log.info("%s: new stream (session %s) takes over session %s", cid, opening.session_id,
                             old.session_id)
                    await old.close("taken over by a new stream")
                self.streams[cid] = session
                try:
                    await session.start()
                except Exception as exc:
                    log.warning("%s: stream not started: %r", cid, exc)
                    await self._finish(session, "start failed")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot start consumers: {exc!r}")
            log.info("%s: stream open (session %s, receive maximum %d, %d shared)", cid, opening.session_id,
                     session.window, len(opening.shared))
            try:
                await session.run()
            finally:
                await self._finish(session, "stream cancelled")

    async def _finish(self, session: StreamSession, reason: str) -> None:
        task = session.request_close(reason)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    def _on_closed(self, session: StreamSession) -> None:
        if self.streams.get(session.client_id) is session:
            del self.streams[session.client_id]
            lock = self._locks.get(session.client_id)
            if lock is not None and not lock.locked():
                del self._locks[session.client_id]

    # -- tbmq.sys.app.removed -----------------------------------------------------------------------
    async def _removed_loop(self) -> None:
        """Joins the removal group (start() waits for the assignment), then deletes each removed
        APPLICATION client's topic and group, committing after each batch."""
        consumer = self.removed_consumer
        await consumer.start()
        self.removal_joined = True
        while not self._stopping:
            batches = await consumer.getmany(timeout_ms=IDLE_FETCH_WAIT_MS, max_records=100)
            for _tp, records in batches.items():
                for record in records:
                    await self._handle_removed(record)
            if batches:
                await consumer.commit()

    async def _handle_removed(self, record) -> None:
        try:
            event = pb.ApplicationRemovedEvent.FromString(record.value or b"")
        except Exception:
            log.error("unreadable ApplicationRemovedEvent at offset %d skipped", record.offset)
            return
        cid = event.client_id or (record.key or b"").decode("utf-8", "replace")
        if not cid:
            return
        name = topics.app_topic_name(cid)
        with span_from_kafka(tracer, "app-delivery remove", record.headers, client_id=cid, topic=name):
            if event.topic and event.topic != name:
                log.warning("ApplicationRemovedEvent of %s names %s; deleting %s", cid, event.topic, name)
            if cid in self.streams:
                log.warning("%s: removal skipped: its stream is open here", cid)
                return
            for attempt in range(5):
                try:
                    await delete_topics(self.s.bootstrap, [name])
                    await self._delete_group(app_client_group(cid))
                    break
                except Exception as exc:
                    log.warning("%s: removal attempt %d failed: %r", cid, attempt + 1, exc)
                    await asyncio.sleep(1 + attempt)
            else:
                log.error("%s: topic %s / group not removed", cid, name)
                return
            self.removed_count += 1
            log.info("%s: removed topic %s and group %s", cid, name, app_client_group(cid))

    async def _delete_group(self, group: str) -> None:
        admin = make_admin(self.s.bootstrap, request_timeout_ms=10000)
        await admin.start()
        try:
            coordinator = await admin.find_coordinator(group)
            response = await admin._send_request(DeleteGroupsRequest([group]), coordinator)
            for name, code in response.results:
                if code not in (0, GroupIdNotFound.errno):
                    if code == NonEmptyGroup.errno:
                        log.warning("group %s still has members: not deleted", name)
                    else:
                        raise RuntimeError(f"deleting group {name} failed with Kafka error {code}")
        finally:
            await admin.close()
