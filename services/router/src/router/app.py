"""The Faust application: the routing agent, the state views, the health endpoint.

Start-up order (a Faust ``Worker`` starts its services in order, then the app):
1. ``RouterRuntime``: health endpoint (not ready), input/state topics ensured, both compacted views
   (tbmq.client.subscriptions -> trie, tbmq.client.session -> session views) read to their end, then
   ``gc.freeze()``. Only then does the Faust app (consumer, agent) start: nothing is routed before the
   state is rebuilt.
2. The Faust app joins consumer group ``router`` on tbmq.msg.all; /readyz turns 200 once it is started.

Commit semantics: the agent iterates with ``stream.noack()``; every record produced for an event is
sent without waiting, and a done-callback acks the event only when Kafka acknowledged ALL of them
(idempotent producer, acks=all). Faust commits, per partition, only the highest offset below which
every event was acked. A failed send stops the process (exit 70) without acking: the record is
routed again by whoever owns the partition next (at-least-once). See docs/router.md.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Mapping

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from google.protobuf.message import DecodeError
from mode import Service
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from tbmq_platform import topics
from tbmq_platform.compacted import CompactedTopicView
from tbmq_platform.health import HealthServer
from tbmq_platform.kafka import ensure_topics
from tbmq_platform.tracing import kafka_headers, span_from_kafka

from .convert import OutRecord
from .settings import Settings
from .state import RoutingState

log = logging.getLogger("router")
tracer = trace.get_tracer("router")

EXIT_SEND_FAILED = 70


# ------------------------------------------------------------------------------ idempotent producer
class IdempotentProducer(faust_aiokafka.Producer):
    """Faust's aiokafka producer with enable_idempotence=True and acks=all (Faust only turns
    idempotence on for exactly-once transactions)."""

    def _settings_extra(self):
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class IdempotentTransport(faust_aiokafka.Transport):
    Producer = IdempotentProducer


class RouterApp(faust.App):
    def _new_transport(self):
        return IdempotentTransport(self.conf.broker_consumer, self)

    def _new_producer_transport(self):
        return IdempotentTransport(self.conf.broker_producer, self)


# ------------------------------------------------------------------------------ sending
class _Pending:
    """One tbmq.msg.all event waiting for the acknowledgement of every record produced for it."""

    __slots__ = ("event", "left", "pipeline")

    def __init__(self, event, left: int, pipeline: "Pipeline"):
        self.event, self.left, self.pipeline = event, left, pipeline

    def done(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return self.pipeline.failed(asyncio.CancelledError("send cancelled"))
        exc = fut.exception()
        if exc is not None:
            return self.pipeline.failed(exc)
        self.left -= 1
        if self.left == 0:
            self.pipeline.acked(self.event)


class Pipeline:
    """Sends the records of successive events without waiting, acks each event once all its
    records are acknowledged, and keeps at most ``max_inflight`` events unacknowledged."""

    def __init__(self, send, ensure, max_inflight: int, on_failure):
        self._send = send  # async (topic, key, value, headers) -> Future[RecordMetadata]
        self._ensure = ensure  # async (specs) -> None: creates missing topics
        self.max_inflight = max_inflight
        self._on_failure = on_failure
        self.known_topics: set[str] = set()
        self.inflight = 0
        self.acked_events = 0
        self.produced = 0
        self._room = asyncio.Event()
        self._room.set()
        self._empty = asyncio.Event()
        self._empty.set()
        self.failure: BaseException | None = None

    async def submit(self, event, records: list[OutRecord], headers) -> None:
        if self.failure is not None:
            raise RuntimeError("router pipeline failed") from self.failure
        missing = [r.spec for r in records if r.spec is not None and r.topic not in self.known_topics]
        if missing:
            unique = {s.name: s for s in missing}
            await self._ensure(list(unique.values()))
            self.known_topics.update(unique)
        if not records:
            self.acked(event, counted=False)
            return
        pending = _Pending(event, len(records), self)
        self.inflight += 1
        self._empty.clear()
        if self.inflight >= self.max_inflight:
            self._room.clear()
        for r in records:
            fut = await self._send(r.topic, r.key, r.value, headers)
            fut.add_done_callback(pending.done)
        self.produced += len(records)
        if not self._room.is_set():
            await self._room.wait()

    def acked(self, event, counted: bool = True) -> None:
        event.ack()
        self.acked_events += 1
        if counted:
            self.inflight -= 1
            if self.inflight < self.max_inflight:
                self._room.set()
            if self.inflight == 0:
                self._empty.set()

    def failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            self._on_failure(exc)

    async def drain(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def _header_pairs(headers) -> list:
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


# ------------------------------------------------------------------------------ runtime
class RouterRuntime(Service):
    """State views + health endpoint; started by the Worker BEFORE the Faust app."""

    def __init__(self, settings: Settings, app: faust.App, state: RoutingState | None = None, **kw):
        super().__init__(**kw)
        self.settings = settings
        self.app = app
        self.routing = state or RoutingState()
        self.health = HealthServer(settings.health_host, settings.health_port, settings.service_name,
                                   self.health_details)
        self.views: list[CompactedTopicView] = []
        self.pipeline: Pipeline | None = None
        self.exit_code = 0
        # spans cost ~5x the routing itself: only create them when they are exported
        self.spans = bool(settings.otlp_endpoint) or settings.trace_spans
        self.rebuilt_in: float | None = None

    def health_details(self) -> dict:
        d = {"instance": self.settings.instance_id, **self.routing.stats()}
        if self.pipeline is not None:
            d.update(inflight=self.pipeline.inflight, acked_events=self.pipeline.acked_events,
                     produced=self.pipeline.produced)
        if self.rebuilt_in is not None:
            d["rebuilt_in_s"] = round(self.rebuilt_in, 3)
        return d

    async def on_start(self) -> None:
        s = self.settings
        await self.health.start()
        t0 = time.monotonic()
        await ensure_topics(s.bootstrap, [topics.spec(n) for n in (
            topics.MSG_ALL, topics.MSG_PERSISTED, topics.CLIENT_SESSION, topics.CLIENT_SUBSCRIPTIONS)])
        self.views = [
            CompactedTopicView(s.bootstrap, topics.CLIENT_SUBSCRIPTIONS, self.routing.apply_subscriptions,
                               client_id=f"{s.instance_id}-subscriptions"),
            CompactedTopicView(s.bootstrap, topics.CLIENT_SESSION, self.routing.apply_session,
                               client_id=f"{s.instance_id}-sessions"),
        ]
        await asyncio.wait_for(asyncio.gather(*(v.start() for v in self.views)), s.rebuild_timeout_s)
        self.rebuilt_in = time.monotonic() - t0
        gc.collect()
        gc.freeze()  # the rebuilt trie is long-lived: keep it out of the GC's generations
        log.info("state rebuilt in %.2fs: %s", self.rebuilt_in, self.routing.stats())

    async def on_stop(self) -> None:
        self.health.ready = False
        for v in self.views:
            await v.stop()
        await self.health.stop()

    # -- sending ---------------------------------------------------------------------------------
    def make_pipeline(self) -> Pipeline:
        app = self.app

        async def send(topic: str, key: bytes, value: bytes, headers):
            return await app.producer.send(topic, key, value, None, None, headers)

        async def ensure(specs):
            await ensure_topics(self.settings.bootstrap, specs)

        self.pipeline = Pipeline(send, ensure, self.settings.max_inflight, self.on_send_failure)
        return self.pipeline

    def on_send_failure(self, exc: BaseException) -> None:
        # Nothing after the failed event may be committed on its partition, and the event must be
        # routed again: stop hard, without acking; the next owner of the partition re-reads it.
        log.critical("a routed record was not acknowledged by Kafka (%r): exiting without commit", exc)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(EXIT_SEND_FAILED)

    async def handle(self, event) -> None:
        """Route one tbmq.msg.all event (called by the agent, in partition order)."""
        pipeline = self.pipeline or self.make_pipeline()
        headers = _header_pairs(event.headers)
        if not self.spans:
            # No span would be exported: skip the span and forward the publisher's trace context
            # as is, so every produced record still belongs to the publish's trace.
            return await self._route(event, pipeline, [(k, v) for k, v in headers if k in _TRACE_KEYS])
        with span_from_kafka(tracer, "router route", headers, kind=SpanKind.CONSUMER) as span:
            span.set_attribute("messaging.destination.name", topics.MSG_ALL)
            await self._route(event, pipeline, None, span)

    async def _route(self, event, pipeline: Pipeline, out_headers, span=None) -> None:
        try:
            routed = self.routing.route(event.key, event.value)
        except DecodeError:
            log.warning("undecodable record at %s offset %s skipped", event.message.tp, event.message.offset)
            self.routing.counters["undecodable"] += 1
            pipeline.acked(event, counted=False)
            return
        if span is not None:
            span.set_attribute("tbmq.records", len(routed.records))
            if routed.expired:
                span.set_attribute("tbmq.expired", True)
            out_headers = kafka_headers() if routed.records else None
        await pipeline.submit(event, routed.records, out_headers)


_TRACE_KEYS = ("traceparent", "tracestate")


# ------------------------------------------------------------------------------ app
def create_app(settings: Settings, state: RoutingState | None = None) -> tuple[faust.App, RouterRuntime]:
    app = RouterApp(
        settings.group_id,
        broker=[f"kafka://{hp}" for hp in settings.kafka_bootstrap_servers],
        datadir=settings.faust_data_dir,
        web_enabled=False,
        producer_acks=-1,
        producer_linger_ms=settings.linger_ms,
        consumer_auto_offset_reset=settings.auto_offset_reset,
        broker_commit_interval=settings.commit_interval_s,
        stream_wait_empty=True,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 3),
        topic_disable_leader=True,
        key_serializer="raw",
        value_serializer="raw",
    )
    runtime = RouterRuntime(settings, app, state)
    source = app.topic(topics.MSG_ALL, key_type=bytes, value_type=bytes,
                       key_serializer="raw", value_serializer="raw")

    @app.agent(source, name="router.route")
    async def route(stream):
        async for event in stream.noack().events():
            await runtime.handle(event)

    async def drain_before_shutdown(app=None, **kwargs):
        if runtime.pipeline is not None:
            await runtime.pipeline.drain(10.0)

    app.on_before_shutdown.connect(drain_before_shutdown)
    runtime.agent = route
    return app, runtime
