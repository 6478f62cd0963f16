"""The connector service: MQTT listener + its Kafka and gRPC side.

Downlinks: `tbmq.msg.downlink.basic.<svc>` (Kafka, live recipients), the device-persistence Forward
streams (stored messages of persistent DEVICE clients attached here; one stream per device-persistence
instance, grpc_clients.ForwardLink) and the app-delivery streams (persistent APPLICATION clients). When a
forward stream opens (registered on that instance) or ends, every persistent DEVICE connection re-syncs
(Connection.resync: fetch again, deliver what it has not delivered yet), so a forward lost with a stream
is never stranded for the rest of the connection.

The service is each connection's `port.ConnectionPort` (the narrow interface connection.py runs its
machine's effects through): connection.py never imports this module.

After UNSUBACK (docs/connector.md, "Subscriptions take effect at SUBACK"): a live downlink is delivered to a
connection only while one of its current subscriptions matches the message's topic, so a copy the router
routed before the unsubscribe and still in flight on tbmq.msg.downlink.basic.<svc> is dropped once UNSUBACK
is sent ([MQTT-3.10.4-2]: no new messages for the removed filters).
Retained at SUBSCRIBE: `retained_caught_up` (the retained view's barrier) before the retained messages are
sent, so a retained PUBLISH acknowledged (on any connector) before the SUBSCRIBE arrived is among them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry import trace
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.coalesce import AdaptiveFetch, adaptive_fetch
from tbmq_platform.compacted import Barrier, CompactedViews
from tbmq_platform.kafka import IDLE_FETCH_WAIT_MS, ensure_topics, make_consumer, make_producer, topic_partitions
from tbmq_platform.lifecycle import Service
from tbmq_platform.topics import (
    CLIENT_SESSION,
    CLIENT_SUBSCRIPTIONS,
    MSG_ALL,
    MSG_RETAINED,
    disconnect_topic,
    downlink_basic_topic,
    response_topic,
    service_topics,
    static_topics,
)
from tbmq_platform.tracing import kafka_headers, span_from_kafka
from tbmq_connection import ConnectionMachine, MachineConfig
from tbmq_connection.convert import publish_msg
from tbmq_routing import RetainedStore, subscribed_to

from .connection import Connection
from .grpc_clients import AppDeliveryChannels, AppStream, DevicePersistenceClient
from .sessions import SessionEvents
from .settings import ConnectorSettings, Listener
from .websocket import WebSocketAdapter
from .wills import Wills

log = logging.getLogger("connector")
tracer = trace.get_tracer("connector")


async def assign_at_end(consumer: AIOKafkaConsumer, topics: Iterable[str]) -> list[TopicPartition]:
    """Assign every partition of `topics` and position at their ends (resolved now, so nothing produced
    after this returns is missed)."""
    tps: list[TopicPartition] = []
    for topic in topics:
        tps.extend(await topic_partitions(consumer, topic))
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)
    return tps


class ConnectorService(Service):
    name = "connector"

    def __init__(self, settings: ConnectorSettings) -> None:
        super().__init__(settings)
        self.settings: ConnectorSettings = settings
        self.service_id = settings.instance_id
        self.retained = RetainedStore()
        self._subs_raw: dict[str, bytes] = {}
        self.wills = Wills(self._publish_will)
        # Kafka clients need the running loop: made in start()
        self.producer = None
        self.sessions: SessionEvents | None = None
        self.views: CompactedViews | None = None
        self.retained_view = self.subs_view = self.session_view = None
        self.retained_barrier: Barrier | None = None
        self.control = self.data = None
        self.device: DevicePersistenceClient | None = None
        self.apps: AppDeliveryChannels | None = None
        self.connections: set[Connection] = set()
        self.by_session: dict[str, Connection] = {}
        self.by_client: dict[str, Connection] = {}
        # shared DEVICE group store id (ss_<share>_<filter>) -> the local member that attached it last
        self.by_store: dict[str, Connection] = {}
        self.stats: Counter = Counter()
        self.adaptive_fetch: AdaptiveFetch | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self.bound: dict[str, int] = {}  # listener name (mqtt, mqtts, ws, wss) -> bound port
        self._bg: set[asyncio.Task] = set()
        self.mqtt_port = settings.mqtt_port
        # Per-message spans (mqtt.publish, mqtt.deliver*) cost more than the rest of the hot path: they are
        # created only when exported (OTLP endpoint set) or asked for. Without them every produced record
        # still carries a traceparent (a fresh one per PUBLISH: `tbmq_platform.tracing.fresh_trace_headers`).
        self.spans = bool(settings.otlp_endpoint) or settings.trace_spans
        self.machine_config = MachineConfig(
            service_id=self.service_id, receive_maximum=settings.receive_maximum,
            topic_alias_maximum=settings.topic_alias_maximum, max_packet_size=settings.max_packet_size,
            max_inflight=settings.max_inflight, max_queued=settings.max_queued,
            server_keep_alive_max=settings.server_keep_alive_max,
            connect_timeout_ms=int(settings.connect_timeout_s * 1000),
            page_messages=settings.stored_page_messages, page_bytes=settings.stored_page_bytes,
            response_information=settings.response_information)
        self._topics = {
            "response": response_topic(self.service_id),
            "disconnect": disconnect_topic(self.service_id),
            "basic": downlink_basic_topic(self.service_id),
        }

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.settings
        bootstrap = s.bootstrap
        await ensure_topics(bootstrap, [*static_topics(), *service_topics(self.service_id)],
                            layout=s.topic_layout)
        self.producer = make_producer(bootstrap, client_id=self.service_id,
                                      max_request_size=max(1 << 20, s.max_packet_size + 65536))
        self.sessions = SessionEvents(self.producer)
        # the three compacted views on one consumer (tbmq_platform.compacted)
        self.views = CompactedViews(bootstrap, client_id=f"{self.service_id}-views")
        self.retained_view = self.views.view(MSG_RETAINED, self._apply_retained)
        self.subs_view = self.views.view(CLIENT_SUBSCRIPTIONS, self._apply_subscriptions)
        self.session_view = self.views.view(CLIENT_SESSION, self.wills.on_session_record)
        # Responses and disconnect commands are written in the registry's transactions: never act on an
        # aborted one. Woken by data: an idle fetch long-polls (tbmq_platform.kafka.IDLE_FETCH_WAIT_MS).
        self.control = make_consumer(bootstrap, group_id=None, client_id=f"{self.service_id}-control",
                                     read_committed=True, long_poll=True)
        self.data = make_consumer(bootstrap, group_id=None, client_id=f"{self.service_id}-downlink",
                                  max_poll_records=5000, long_poll=True)
        await self.producer.start()
        await self.control.start()
        await assign_at_end(self.control, [self._topics["response"], self._topics["disconnect"]])
        await self.data.start()
        await assign_at_end(self.data, [self._topics["basic"]])
        await self.views.start()
        self.retained_barrier = self.views.barrier([MSG_RETAINED])
        self.device = DevicePersistenceClient(s.device_persistence_grpc_targets, s.grpc_timeout_s,
                                              ack_delay_s=s.ack_delay_ms / 1000, ack_batch_max=s.ack_batch_max,
                                              ack_max_calls=s.ack_max_calls)
        self.device.start_forwarding(self.service_id, on_batch=self._on_forwards,
                                     on_open=self._on_forward_link, on_close=self._on_forward_link)
        self.apps = AppDeliveryChannels(s.app_delivery_grpc_targets)
        self.spawn(self._control_loop(), "control consumer")
        self.spawn(self._data_loop(), "downlink consumer")
        ssl_ctx = s.server_ssl_context() if any(li.tls for li in s.listeners()) else None
        for li in s.listeners():
            await self._listen(li, ssl_ctx)
        self.mqtt_port = self.bound.get("mqtt", 0)
        log.info("connector %s: listening on %s (%d retained, %d subscription sets)", self.service_id,
                 ", ".join(f"{li.name} {li.host}:{self.bound[li.name]}" for li in s.listeners()),
                 len(self.retained), len(self._subs_raw))

    async def _listen(self, li: Listener, ssl_ctx) -> None:
        """One listener: TCP or TLS; WebSocket ones put `websocket.WebSocketAdapter` in front of the same
        Connection."""
        s = self.settings
        if li.websocket:
            def factory():
                return WebSocketAdapter(lambda: Connection(self), s.mqtt_ws_path, s.connect_timeout_s)
        else:
            def factory():
                return Connection(self)
        tls = {"ssl": ssl_ctx, "ssl_handshake_timeout": s.connect_timeout_s} if li.tls else {}
        server = await asyncio.get_running_loop().create_server(factory, li.host, li.port, backlog=4096,
                                                                reuse_address=True, **tls)
        self._servers.append(server)
        self.bound[li.name] = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()
        self.wills.stop(send=True)
        await asyncio.sleep(0)
        if self._bg:
            await asyncio.wait(self._bg, timeout=10)
        if self.producer is not None:
            try:
                await asyncio.wait_for(self.producer.flush(), 10)
            except Exception:
                log.exception("producer flush failed")
        await self.cancel_tasks()
        for part in (self.control, self.data, self.views):
            if part is None:
                continue
            try:
                await part.stop()
            except Exception:
                log.exception("stop failed")
        if self.device is not None:
            await self.device.close()
        if self.apps is not None:
            await self.apps.close()
        if self.producer is not None:
            await self.producer.stop()
        for server in self._servers:
            await server.wait_closed()

    def readiness_checks(self) -> dict:
        # the retained, subscription and session views: a connector on a frozen table must not look ready
        return {"views": self.views.problem}

    def health_details(self) -> dict:
        return {"service_id": self.service_id, "mqtt_port": self.mqtt_port,
                **{f"{name}_port": p for name, p in self.bound.items() if name != "mqtt"},
                "connections": len(self.connections), "clients": len(self.by_client),
                "group_stores": len(self.by_store),
                "retained": len(self.retained), "pending_wills": len(self.wills.pending),
                **{k: v for k, v in self.stats.items()},
                **(self.device.acks.stats if self.device is not None else {}),
                "forward_streams_open": self.device.open_links() if self.device is not None else 0,
                **(self.adaptive_fetch.health() if self.adaptive_fetch is not None else {})}

    def spawn_bg(self, coro) -> None:
        """A short background job (a produce, a gRPC call): tracked so shutdown can wait for it."""
        task = asyncio.get_running_loop().create_task(self._guard(coro))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    @staticmethod
    async def _guard(coro) -> None:
        try:
            result = await coro
            if isinstance(result, asyncio.Future):
                await result
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("background job failed")

    # ------------------------------------------------------------------------------------ the connections' port
    def new_machine(self, address: str) -> ConnectionMachine:
        return ConnectionMachine(self.machine_config, stats=self.stats, retained=self.retained.match_filter,
                                 address=address)

    def connection_opened(self, conn: Connection) -> None:
        self.connections.add(conn)

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        session_id, client_id = conn.session_id, conn.client_id
        if session_id and self.by_session.get(session_id) is conn:
            del self.by_session[session_id]
        if client_id and self.by_client.get(client_id) is conn:
            del self.by_client[client_id]

    def route_session(self, session_id: str, conn: Connection) -> None:
        self.by_session[session_id] = conn

    def route_client(self, client_id: str, conn: Connection) -> None:
        self.by_client[client_id] = conn

    def route_store(self, store_id: str, conn: Connection) -> None:
        self.by_store[store_id] = conn

    def unroute_store(self, store_id: str, conn: Connection) -> None:
        if self.by_store.get(store_id) is conn:
            del self.by_store[store_id]

    async def request_session(self, session: pb.SessionInfo) -> pb.SessionEventResponse:
        return await self.sessions.connect(session, self.settings.session_event_timeout_s)

    def report_disconnect(self, session: pb.SessionInfo, graceful: bool, session_expiry: int | None,
                          awaiting_pubrel=()) -> None:
        self.spawn_bg(self.sessions.disconnect(session, graceful=graceful, session_expiry=session_expiry,
                                               awaiting_pubrel=awaiting_pubrel))

    def session_started(self, client_id: str, clean_start: bool) -> None:
        self.wills.on_connected(client_id, clean_start)

    def schedule_will(self, client_id: str, session_id: str, will, level: int, delay: int) -> None:
        self.wills.schedule(client_id, session_id, will, level, delay)

    def open_app_stream(self, opening, on_record, on_records) -> AppStream:
        stream = AppStream(self.apps, opening, on_record, on_records=on_records)
        stream.start()
        return stream

    # ------------------------------------------------------------------------------------ producing
    async def produce_publish(self, msg: pb.PublishMsg, topic: str, retain: bool, headers=None):
        """Hand a PUBLISH to Kafka: (delivery future on tbmq.msg.all, delivery future on tbmq.msg.retained
        or None). Never waits for the acknowledgement. `headers` default: the current trace context."""
        if headers is None:
            headers = kafka_headers()
        key = topic.encode("utf-8")
        value = msg.SerializeToString()
        fut = await self.producer.send(MSG_ALL, value, key=key, headers=headers)
        fut2 = None
        if retain:
            # the connector owns retained storage: an empty payload deletes it [MQTT-3.3.1-6/-7]
            fut2 = await self.producer.send(MSG_RETAINED, value if msg.payload else None, key=key,
                                            headers=headers)
        return fut, fut2

    async def produce_subscriptions(self, client_id: str, subs, client_type: int) -> None:
        """Write the client's whole set and wait for Kafka's acknowledgement."""
        cs = pb.ClientSubscriptions(client_id=client_id, subscriptions=list(subs), client_type=client_type)
        fut = await self.producer.send(CLIENT_SUBSCRIPTIONS, cs.SerializeToString(),
                                       key=client_id.encode("utf-8"), headers=kafka_headers())
        await fut

    def _publish_will(self, client_id: str, will, level: int) -> None:
        msg = publish_msg(will, will.topic, publisher_id=client_id, service_id=self.service_id,
                          mqtt_version=level, now_ms=int(time.time() * 1000))
        self.stats["wills_sent"] += 1
        log.info("publishing the will of %r on %r", client_id, will.topic)

        async def go():
            with tracer.start_as_current_span("mqtt.will"):
                fut, fut2 = await self.produce_publish(msg, will.topic, will.retain)
            await fut
            if fut2 is not None:
                await fut2
        self.spawn_bg(go())

    # ------------------------------------------------------------------------------------ views
    def _apply_retained(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        topic = key.decode("utf-8")
        if not value:
            self.retained.delete(topic)
            return
        msg = pb.PublishMsg.FromString(value)
        if not msg.payload:
            self.retained.delete(topic)
        else:
            self.retained.set(topic, msg)

    def _apply_subscriptions(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        client_id = key.decode("utf-8")
        if value:
            self._subs_raw[client_id] = value
        else:
            self._subs_raw.pop(client_id, None)

    def retained_caught_up(self) -> asyncio.Future | None:
        """Called when a SUBSCRIBE that receives retained messages arrives: a future done once the retained
        view holds every retained PUBLISH acknowledged before now (its ListOffsets is sent after this call,
        so after the SUBSCRIBE arrived), at most CONNECTOR_RETAINED_WAIT_MS later: on timeout it is logged
        and done, and the retained messages come from what the view holds. None when the wait is off."""
        wait_s = self.settings.retained_wait_ms / 1000
        if wait_s <= 0 or self.retained_barrier is None:
            return None
        return asyncio.ensure_future(self._retained_wait(self.retained_barrier.ends(), wait_s))

    async def _retained_wait(self, ends: asyncio.Future, wait_s: float) -> None:
        try:
            await self.retained_barrier.wait(ends, timeout=wait_s)
        except Exception as exc:
            self.stats["retained_wait_timeouts"] += 1
            log.warning("retained view not caught up within %.1fs (%r): retained messages sent from what it "
                        "holds", wait_s, exc)

    async def subscriptions_of(self, client_id: str) -> dict[tuple[str, str], pb.TopicSubscription]:
        """The client's stored set, after catching up with everything written so far (by any connector)."""
        await self.subs_view.wait_caught_up(timeout=10)
        raw = self._subs_raw.get(client_id)
        if not raw:
            return {}
        cs = pb.ClientSubscriptions.FromString(raw)
        return {(t.share_name, t.topic_filter): t for t in cs.subscriptions}

    # ------------------------------------------------------------------------------------ consumers
    async def _control_loop(self) -> None:
        rtopic = self._topics["response"]
        while True:
            batches = await self.control.getmany(timeout_ms=IDLE_FETCH_WAIT_MS, max_records=1000)
            for tp, records in batches.items():
                for r in records:
                    try:
                        if tp.topic == rtopic:
                            self.sessions.on_response(r.value)
                        else:
                            self._on_disconnect_command(r.value)
                    except Exception:
                        log.exception("bad record on %s at offset %d", tp.topic, r.offset)

    def _on_disconnect_command(self, value: bytes) -> None:
        cmd = pb.DisconnectCommand.FromString(value)
        conn = self.by_session.get(cmd.session_id)
        if conn is None:
            log.debug("disconnect command for %r session %s: not here", cmd.client_id, cmd.session_id)
            return
        conn.take_over(cmd)

    async def _data_loop(self) -> None:
        adaptive = self.adaptive_fetch = adaptive_fetch(self.data, self.settings.fetch_window_ms)
        slice_n = self.settings.delivery_slice
        while True:
            batches = await self.data.getmany(timeout_ms=IDLE_FETCH_WAIT_MS)
            if adaptive is not None:
                adaptive.polled_batches(batches)
            done = 0
            for tp, records in batches.items():
                for r in records:
                    try:
                        self._on_basic(r)
                    except Exception:
                        log.exception("bad record on %s at offset %d", tp.topic, r.offset)
                    done += 1
                    if done % slice_n == 0:
                        # a large poll (a backlog, a burst) must not hold the loop: PUBACKs and client
                        # packets are served between slices
                        await asyncio.sleep(0)

    def _on_basic(self, record) -> None:
        dl = pb.BasicDownlink.FromString(record.value)
        if self.spans:
            with span_from_kafka(tracer, "mqtt.deliver", record.headers):
                self._deliver_basic(dl)
        else:
            self._deliver_basic(dl)

    def _deliver_basic(self, dl) -> None:
        by_client = self.by_client
        msg = dl.msg
        for r in dl.recipients:
            conn = by_client.get(r.client_id)
            if conn is None:
                self.stats["dropped_not_connected"] += 1
            elif subscribed_to(conn.subs, msg.topic):
                conn.deliver(msg, r.qos, r.retain, r.subscription_ids)
            else:  # routed before an UNSUBSCRIBE whose UNSUBACK is sent [MQTT-3.10.4-2]
                self.stats["dropped_unsubscribed"] += 1

    # ------------------------------------------------------------------------------------ forward streams
    def _on_forward_link(self, link) -> None:
        """A forward stream opened (registered on its instance) or ended: every persistent DEVICE connection
        fetches again what it may have missed (Connection.resync)."""
        self.stats["forward_resync_rounds"] += 1
        for conn in list(self.connections):
            conn.resync()

    def _on_forwards(self, batch) -> None:
        for dm in batch.messages:
            try:
                self._on_persisted(dm)
            except Exception:
                log.exception("bad forward of %r", dm.client_id)
        for store_id in batch.paused:  # forwards stopped at the store's handed-out limit: page again
            conn = self.by_store.get(store_id) or self.by_client.get(store_id)
            if conn is not None:
                conn.on_store_paused(store_id)

    def _on_persisted(self, dm: pb.DevicePublishMsg) -> None:
        # a shared DEVICE group store's forward goes to the local member that attached that store
        conn = self.by_store.get(dm.client_id)
        if conn is not None:
            handle = conn.on_group_persisted
        else:
            conn = self.by_client.get(dm.client_id)
            if conn is None:
                self.stats["forwards_not_connected"] += 1
                return  # still stored in Redis: delivered on the next connect
            handle = conn.on_persisted
        if self.spans:
            with tracer.start_as_current_span("mqtt.deliver.persisted"):
                handle(dm)
        else:
            handle(dm)


__all__ = ["ConnectorService", "assign_at_end"]
