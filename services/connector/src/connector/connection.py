"""One MQTT network connection: an asyncio.Protocol driving the sans-io codec.

Bytes are decoded in `data_received`; decoded packets go to a per-connection queue that one task works
through in order (`_run`). Reading from the socket pauses while that queue is long, so a fast sender is
slowed by TCP, not buffered. PUBLISH handling never waits for Kafka: the record is handed to the producer
and its delivery future is queued; PUBACK/PUBREC go out in packet order as the futures complete
(`_flush_acks`). Outbound deliveries go through `flow.OutboundWindow`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq_mqtt import (
    MQTT_5,
    ConnAck,
    Connect,
    Disconnect,
    MqttDecoder,
    MqttProtocolError,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    REASON_CODES_BY_PACKET,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    encode,
)
from tbmq_platform.tracing import fresh_trace_headers
from tbmq_routing import InvalidSharedSubscription, InvalidTopicFilter, parse_subscription_filter, shared_store_id

from .connect import ConnectRefused, plan_connect, will_delay_seconds
from .convert import outbound_publish, publish_msg, topic_subscription
from .flow import (
    APP,
    DEVICE,
    GROUP,
    LIVE,
    AliasError,
    GroupRef,
    GroupStores,
    InboundAliases,
    InboundQos,
    OutboundWindow,
    OutMsg,
    upstream_ack,
)
from .sessions import confirmed_awaiting_pubrel

if TYPE_CHECKING:
    from .service import ConnectorService

log = logging.getLogger("connector.connection")
tracer = trace.get_tracer("connector")

# states
NEW, CONNECTING, CONNECTED, CLOSED = range(4)

_V3_FAILURE = {pb.SESSION_FAILURE_QUOTA_EXCEEDED: 0x97, pb.SESSION_FAILURE_SERVER_UNAVAILABLE: 0x88,
               pb.SESSION_FAILURE_CLIENT_ID_NOT_VALID: 0x85, pb.SESSION_FAILURE_UNSPECIFIED_ERROR: 0x80}
_TAKEOVER_REASON = {pb.DISCONNECT_REASON_SESSION_TAKEN_OVER: 0x8E, pb.DISCONNECT_REASON_ADMINISTRATIVE: 0x98,
                    pb.DISCONNECT_REASON_SERVER_SHUTTING_DOWN: 0x8B}
_CONNACK_PROPS_BASE = dict(retain_available=True, wildcard_subscription_available=True,
                           subscription_identifier_available=True, shared_subscription_available=True)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _swallow(fut: asyncio.Future) -> None:
    """Done-callback of QoS 0 produce futures: retrieve the exception so it is not reported as lost."""
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("QoS 0 produce failed: %s", fut.exception())


class Connection(asyncio.Protocol):
    def __init__(self, service: ConnectorService) -> None:
        self.svc = service
        s = service.settings
        self.s = s
        self.transport: asyncio.Transport | None = None
        self.address = ""
        self.state = NEW
        self.state_before_close = NEW
        self.level = 4
        self.v5 = False
        self.decoder = MqttDecoder(max_packet_size=s.max_packet_size)
        self.inq: deque = deque()
        self._wake: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self.last_rx = 0.0
        self.keep_alive = 0
        # session
        self.client_id = ""
        self.session_id = ""
        self.session: pb.SessionInfo | None = None
        self.client_type = pb.CLIENT_TYPE_DEVICE
        self.persistent = False          # the registry's answer: messages kept for the client (fetch / stream)
        self.session_expiry = 0          # the registry's interval: how long the session outlives the connection
        self.connect_expiry = 0          # the CONNECT's interval as sent (v5 DISCONNECT may not raise it from 0)
        self.will = None
        self.will_delay = 0
        self.subs: dict[tuple[str, str], pb.TopicSubscription] = {}
        # flow
        self.inbound = InboundQos(s.receive_maximum)
        self.acks: deque = deque()
        self.aliases = InboundAliases(s.topic_alias_maximum)
        self.out = OutboundWindow(min(s.max_inflight, 65535), s.max_queued)
        self.client_max_packet = None
        # end of connection
        self.graceful = False            # DISCONNECT 0x00 received: no Will
        self.disconnect_expiry: int | None = None
        self.taken_over: pb.DisconnectCommand | None = None
        self.request_sent = False        # CONNECTION_REQUEST produced: a DISCONNECTION_REQUEST is owed
        self.close_reason = ""
        # persistent DEVICE / APPLICATION
        self.device = False
        self.fetching = False
        self.refetch = False             # a re-sync came while fetching: fetch again after
        self.held_persisted: list[pb.DevicePublishMsg] = []
        self.max_serial = -1
        self.groups = GroupStores()      # shared DEVICE group stores attached by this (persistent) member
        self.app_stream = None
        self.app_refs: dict[tuple, int] = {}
        self._pump_held = False          # delivering a batch of records: the socket is written once after it
        self.dropped = 0

    # ---------------------------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        transport.set_write_buffer_limits(high=self.s.write_buffer_high)  # type: ignore[attr-defined]
        loop = self._loop = asyncio.get_running_loop()
        self.last_rx = loop.time()
        self._timer = loop.call_later(self.s.connect_timeout_s, self._connect_timeout)
        self.svc.connections.add(self)
        self._task = loop.create_task(self._run())

    def data_received(self, data: bytes) -> None:
        if self.state == CLOSED:
            return
        if self.keep_alive:
            self.last_rx = self._loop.time()
        try:
            packets = self.decoder.feed(data)
        except MqttProtocolError as exc:
            self._protocol_error(exc.reason_code, exc.message, connect=exc.packet_type == 1,
                                 level=exc.protocol_level)
            return
        if packets:
            self.inq.extend(packets)
            if len(self.inq) >= self.s.inbound_queue_max and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()
            w = self._wake
            if w is not None and not w.done():
                w.set_result(None)

    def eof_received(self) -> bool:
        return False  # close

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._stall_timer is None and self.state != CLOSED:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self.s.write_stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self.state == CONNECTED:
            self._pump()

    def _write_stalled(self) -> None:
        self._stall_timer = None
        if self._writing_paused and self.state != CLOSED:
            self.abort(f"client has not read for {self.s.write_stall_timeout_s:.0f}s "
                       f"({self.transport.get_write_buffer_size()} bytes waiting)")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state == CLOSED:
            self._finish()
            return
        if not self.close_reason:
            self.close_reason = "connection lost" + (f" ({exc})" if exc else "")
        self.state_before_close = self.state
        self.state = CLOSED
        self._finish()

    # ---------------------------------------------------------------------------------- writing
    def write(self, packet) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(encode(packet, self.level))

    def write_bytes(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(data)
        if t.get_write_buffer_size() > self.s.write_buffer_limit:
            self.abort(f"write buffer above {self.s.write_buffer_limit} bytes (client not reading)")

    # ---------------------------------------------------------------------------------- closing
    def close(self, reason: str, *, disconnect_rc: int | None = None, log_level: int = logging.INFO) -> None:
        """Close this connection (once): optional v5 DISCONNECT first, then one log line."""
        if self.state == CLOSED:
            return
        self.state_before_close = self.state
        self.state = CLOSED
        self.close_reason = reason
        log.log(log_level, "client %r (%s): %s; closing", self.client_id, self.address, reason)
        t = self.transport
        if t is not None and not t.is_closing():
            if disconnect_rc is not None and self.v5 and self.state_before_close == CONNECTED:
                if disconnect_rc not in REASON_CODES_BY_PACKET[14]:
                    disconnect_rc = 0x80
                try:
                    t.write(encode(Disconnect(disconnect_rc), MQTT_5))
                except Exception:
                    pass
            t.close()
        self._finish()

    def abort(self, reason: str) -> None:
        if self.state == CLOSED:
            return
        self.state_before_close = self.state
        self.state = CLOSED
        self.close_reason = reason
        log.warning("client %r (%s): %s; closing", self.client_id, self.address, reason)
        if self.transport is not None:
            self.transport.abort()
        self._finish()

    def _protocol_error(self, rc: int, message: str, *, connect: bool = False, level: int | None = None) -> None:
        if self.state == CLOSED:
            return
        if connect or self.state == NEW:
            # a bad CONNECT: v5 CONNACK with the reason code; 3.x only for version and client id problems
            lvl = level if level is not None else 4
            t = self.transport
            if t is not None and not t.is_closing():
                try:
                    if lvl == MQTT_5:
                        code = rc if rc in REASON_CODES_BY_PACKET[2] else 0x80
                        t.write(encode(ConnAck(False, code), MQTT_5))
                    elif rc in (0x84, 0x85):
                        t.write(encode(ConnAck(False, rc), 4))
                except Exception:
                    pass
            self.close(f"bad CONNECT: {message} [0x{rc:02X}]", log_level=logging.WARNING)
            return
        self.close(f"protocol error: {message} [0x{rc:02X}]", disconnect_rc=rc, log_level=logging.WARNING)

    def _connect_timeout(self) -> None:
        self._timer = None
        if self.state == NEW:
            self.close(f"no CONNECT within {self.s.connect_timeout_s:g}s", log_level=logging.WARNING)

    def _keep_alive_check(self) -> None:
        self._timer = None
        if self.state == CLOSED or not self.keep_alive:
            return
        loop = asyncio.get_running_loop()
        deadline = self.last_rx + self.keep_alive * 1.5
        now = loop.time()
        if now >= deadline:
            self.close(f"keep alive {self.keep_alive}s expired", disconnect_rc=0x8D)
        else:
            self._timer = loop.call_at(deadline, self._keep_alive_check)

    def shutdown(self) -> None:
        """Server shutting down: v5 DISCONNECT 0x8B."""
        self.close("server shutting down", disconnect_rc=0x8B)

    def _finish(self) -> None:
        """Everything that follows the end of the connection, exactly once."""
        if getattr(self, "_finished", False):
            return
        self._finished = True
        svc = self.svc
        svc.connections.discard(self)
        for timer in (self._timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self.session_id:
            if svc.by_session.get(self.session_id) is self:
                del svc.by_session[self.session_id]
        if self.client_id and svc.by_client.get(self.client_id) is self:
            del svc.by_client[self.client_id]
        if self.app_stream is not None:
            svc.spawn_bg(self.app_stream.stop())
            self.app_stream = None
        if self.device and svc.device is not None:
            svc.device.detach(self.client_id, self.session_id)
        for store_id in self.groups.attached():
            self._detach_group(store_id)
        prior = self.state_before_close
        if not self.request_sent:
            return
        # the Will: not after DISCONNECT 0x00 [MQTT-3.1.2-10]; v5 0x04 and every other end send it
        if self.will is not None and not self.graceful and prior == CONNECTED:
            delay = will_delay_seconds(self.level, self.will_delay, self.session_expiry)
            if self.taken_over is not None:
                if delay and not self.taken_over.new_session_clean_start:
                    delay = -1  # the session continues on the new connection before the delay passed
                else:
                    delay = 0
            if delay >= 0:
                svc.wills.schedule(self.client_id, self.session_id, self.will, self.level, delay)
        if self.taken_over is not None:
            return  # the registry already moved the session on: nothing to report
        if prior == CONNECTED or prior == CONNECTING:
            svc.spawn_bg(svc.sessions.disconnect(self.session, graceful=self.graceful,
                                                 session_expiry=self.disconnect_expiry,
                                                 awaiting_pubrel=confirmed_awaiting_pubrel(
                                                     self.inbound.awaiting_pubrel, self.acks)))

    # ---------------------------------------------------------------------------------- packet loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        inq = self.inq
        try:
            while self.state != CLOSED:
                if not inq:
                    self._wake = loop.create_future()
                    await self._wake
                    self._wake = None
                    continue
                packet = inq.popleft()
                if self._reading_paused and len(inq) < self.s.inbound_queue_max // 2:
                    self._reading_paused = False
                    self.transport.resume_reading()
                cls = packet.__class__
                if cls is Publish:
                    await self._on_publish(packet)
                elif cls is PubAck:
                    self._on_acks(packet, inq)
                elif cls is PubRec:
                    self._on_pubrec(packet)
                elif cls is PubRel:
                    self._on_pubrel(packet)
                elif cls is PubComp:
                    self._on_pubcomp(packet)
                elif cls is PingReq:
                    self.write(PingResp())
                elif cls is Subscribe:
                    await self._on_subscribe(packet)
                elif cls is Unsubscribe:
                    await self._on_unsubscribe(packet)
                elif cls is Disconnect:
                    self._on_disconnect(packet)
                elif cls is Connect:
                    await self._on_connect(packet)
                else:  # AUTH: enhanced authentication is not supported
                    self._protocol_error(0x82, f"{cls.__name__} not supported")
        except asyncio.CancelledError:
            pass
        except MqttProtocolError as exc:
            self._protocol_error(exc.reason_code, exc.message)
        except Exception:
            log.exception("client %r (%s): internal error", self.client_id, self.address)
            self.close("internal error", disconnect_rc=0x80, log_level=logging.ERROR)

    # ---------------------------------------------------------------------------------- CONNECT
    async def _on_connect(self, c: Connect) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.level = c.protocol_level
        self.v5 = c.protocol_level == MQTT_5
        s = self.s
        try:
            plan = plan_connect(c, server_keep_alive_max=s.server_keep_alive_max)
        except ConnectRefused as exc:
            self._protocol_error(exc.reason_code, exc.message, connect=True, level=c.protocol_level)
            return
        if c.properties.authentication_method is not None:
            self._protocol_error(0x8C, "enhanced authentication is not supported", connect=True,
                                 level=c.protocol_level)
            return
        self.state = CONNECTING
        self.client_id = plan.client_id
        self.session_id = str(uuid.uuid4())
        self.keep_alive = plan.keep_alive
        self.client_max_packet = plan.maximum_packet_size
        self.out.window = max(1, min(plan.receive_maximum, s.max_inflight))
        self.will = c.will
        self.will_delay = plan.will_delay
        loop = asyncio.get_running_loop()
        if self.keep_alive:
            self.last_rx = loop.time()
            self._timer = loop.call_at(self.last_rx + self.keep_alive * 1.5, self._keep_alive_check)
        svc = self.svc
        self.session = pb.SessionInfo(
            client_id=self.client_id, service_id=svc.service_id, session_id=self.session_id,
            client_type=pb.CLIENT_TYPE_DEVICE, connected=True, clean_start=plan.clean_start,
            session_expiry_interval=plan.requested_session_expiry, mqtt_version=self.level,
            keep_alive=plan.keep_alive,
            connected_at_ms=_now_ms(), client_address=self.address, username=c.username or "")
        svc.by_session[self.session_id] = self
        self.request_sent = True
        try:
            resp = await svc.sessions.connect(self.session, s.session_event_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._refuse(0x88, f"no answer from the session registry within {s.session_event_timeout_s:g}s")
            return
        except Exception as exc:  # Kafka unavailable
            self._refuse(0x88, f"session request failed: {exc!r}")
            return
        if self.state == CLOSED:
            return  # went away (or taken over) while waiting; _finish reported the disconnect
        if not resp.success:
            self.request_sent = False  # the registry did not create a session
            self._refuse(_V3_FAILURE.get(resp.failure, 0x80), f"session registry refused: "
                         f"{pb.SessionFailure.Name(resp.failure)}")
            return
        # the registry decides what the session is (session_registry.logic): a resumed session is persistent
        # for this connection whatever its new interval [MQTT-3.1.2-4, -5, -23]
        self.client_type = resp.client_type
        self.session_expiry = resp.session_expiry_interval if self.v5 else 0
        self.connect_expiry = plan.requested_session_expiry
        self.persistent = resp.persistent
        self.session.client_type = resp.client_type
        self.session.session_expiry_interval = self.session_expiry
        self.session.persistent = self.persistent
        self.inbound.awaiting_pubrel.update(resp.awaiting_pubrel)  # a resumed session's QoS 2 state
        svc.wills.on_connected(self.client_id, plan.clean_start)
        if resp.session_present:
            try:
                self.subs = await svc.subscriptions_of(self.client_id)
            except (asyncio.TimeoutError, TimeoutError):
                log.warning("client %r: subscriptions view did not catch up; starting empty", self.client_id)
            if self.state == CLOSED:
                return
        props = None
        if self.v5:
            kw = dict(_CONNACK_PROPS_BASE, receive_maximum=s.receive_maximum,
                      maximum_packet_size=s.max_packet_size, topic_alias_maximum=s.topic_alias_maximum or None)
            if plan.assigned_client_id:
                kw["assigned_client_identifier"] = self.client_id
            if plan.server_keep_alive is not None:
                kw["server_keep_alive"] = plan.server_keep_alive
            if self.session_expiry != plan.requested_session_expiry:
                kw["session_expiry_interval"] = self.session_expiry
            props = Properties(**kw)
        self.write(ConnAck(bool(resp.session_present), 0, props) if props else
                   ConnAck(bool(resp.session_present), 0))
        self.state = CONNECTED
        svc.by_client[self.client_id] = self
        if self.persistent and self.client_type == pb.CLIENT_TYPE_DEVICE and svc.device is not None:
            self.device = True
            self.fetching = True
            svc.spawn_bg(self._fetch_stored())
            self._attach_groups()
        elif self.persistent and self.client_type == pb.CLIENT_TYPE_APPLICATION:
            self._open_app_stream()

    def _refuse(self, rc: int, reason: str) -> None:
        if self.state == CLOSED:
            return
        try:
            self.write(ConnAck(False, rc))
        except Exception:
            pass
        self.close(reason + f" [CONNACK 0x{rc:02X}]", log_level=logging.WARNING)

    # ---------------------------------------------------------------------------------- PUBLISH in
    async def _on_publish(self, p: Publish) -> None:
        if self.state != CONNECTED:
            raise MqttProtocolError(0x82, "PUBLISH before CONNACK")
        topic = p.topic
        if self.v5:
            props = p.properties
            if props.topic_alias is not None or not topic:
                try:
                    topic = self.aliases.resolve(topic, props.topic_alias)
                except AliasError as exc:
                    raise MqttProtocolError(exc.reason_code, exc.message) from None
        qos = p.qos
        pid = p.packet_id
        if qos == 2 and pid in self.inbound.awaiting_pubrel:
            # [MQTT-4.3.3-10]: a re-sent PUBLISH before PUBREL is not forwarded again; answer PUBREC
            self._queue_ack(2, pid, None, None)
            return
        if qos and self.inbound.over_quota():
            if self.v5:
                raise MqttProtocolError(0x93, f"more than {self.inbound.receive_maximum} QoS 1/2 "
                                              "PUBLISHes unacknowledged")
        svc = self.svc
        msg = publish_msg(p, topic, publisher_id=self.client_id, service_id=svc.service_id,
                          mqtt_version=self.level, now_ms=_now_ms())
        try:
            if svc.spans:
                with tracer.start_as_current_span("mqtt.publish", kind=SpanKind.SERVER) as span:
                    if span.is_recording():
                        span.set_attribute("messaging.destination.name", topic)
                        span.set_attribute("mqtt.qos", qos)
                        span.set_attribute("mqtt.client_id", self.client_id)
                    fut, fut_retained = await svc.produce_publish(msg, topic, p.retain)
            else:
                fut, fut_retained = await svc.produce_publish(msg, topic, p.retain, fresh_trace_headers())
        except Exception as exc:
            if qos == 0:
                return
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
            fut_retained = None
        svc.stats["msgs_in"] += 1
        if qos == 0:
            fut.add_done_callback(_swallow)
            if fut_retained is not None:
                fut_retained.add_done_callback(_swallow)
            return
        if qos == 2:
            self.inbound.awaiting_pubrel.add(pid)
        self._queue_ack(qos, pid, fut, fut_retained)

    def _queue_ack(self, qos: int, pid: int, fut, fut2) -> None:
        self.inbound.pending_acks += 1
        entry = [qos, pid, fut, fut2]
        self.acks.append(entry)
        if len(self.acks) == 1:
            self._flush_acks()
        if fut is not None and not fut.done():
            fut.add_done_callback(self._flush_acks)
        if fut2 is not None and not fut2.done():
            fut2.add_done_callback(self._flush_acks)

    def _flush_acks(self, _=None) -> None:
        acks = self.acks
        out = []
        while acks:
            qos, pid, fut, fut2 = acks[0]
            if (fut is not None and not fut.done()) or (fut2 is not None and not fut2.done()):
                break
            acks.popleft()
            self.inbound.pending_acks -= 1
            exc = None
            for f in (fut, fut2):
                if f is not None and exc is None:
                    exc = f.exception() if not f.cancelled() else asyncio.CancelledError()
            if self.state == CLOSED:
                continue
            if exc is not None:
                if not self.v5:
                    self.close(f"Kafka did not accept a QoS {qos} PUBLISH: {exc!r}", log_level=logging.ERROR)
                    return
                log.error("client %r: Kafka did not accept a QoS %d PUBLISH: %r", self.client_id, qos, exc)
                self.inbound.awaiting_pubrel.discard(pid)
                out.append(encode(PubAck(pid, 0x80) if qos == 1 else PubRec(pid, 0x80), MQTT_5))
            elif qos == 1:
                out.append(encode(PubAck(pid), self.level))
            else:
                out.append(encode(PubRec(pid), self.level))
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _on_pubrel(self, p: PubRel) -> None:
        # An unknown id (e.g. the PUBLISH arrived on an earlier connection) is completed all the same.
        self.inbound.awaiting_pubrel.discard(p.packet_id)
        self.write(PubComp(p.packet_id))

    # ---------------------------------------------------------------------------------- acks from client
    def _on_acks(self, first: PubAck, inq) -> None:
        """A PUBACK and every PUBACK queued right behind it (a client acknowledging a burst sends them in
        one segment): the window is refilled once after the last, in one write, instead of once per
        acknowledgement."""
        self._pump_held = True
        try:
            self._on_puback(first)
            while inq and inq[0].__class__ is PubAck and self.state != CLOSED:
                self._on_puback(inq.popleft())
        finally:
            self._pump_held = False
        if self._reading_paused and len(inq) < self.s.inbound_queue_max // 2:
            self._reading_paused = False
            self.transport.resume_reading()
        self._pump()

    def _on_puback(self, p: PubAck) -> None:
        msg = self.out.on_puback(p.packet_id)
        if msg is not None:
            self._delivered(msg)
            if not self._pump_held:
                self._pump()

    def _on_pubrec(self, p: PubRec) -> None:
        failed = p.reason_code >= 0x80
        msg = self.out.on_pubrec(p.packet_id, failed)
        if msg is None:
            # not ours (or a repeat): PUBREL all the same so the client can finish [MQTT-4.3.3]
            if not failed:
                self.write(PubRel(p.packet_id, 0x92 if self.v5 else 0))
            return
        if failed:
            self._delivered(msg)
            self._pump()
            return
        self.write(PubRel(p.packet_id))
        if self.svc.device is not None:
            up = upstream_ack(msg, self.client_id)  # own store, or the group store (local id mapped back)
            if up is not None:
                self.svc.device.mark_pubrec(*up)

    def _on_pubcomp(self, p: PubComp) -> None:
        msg = self.out.on_pubcomp(p.packet_id)
        if msg is not None:
            self._delivered(msg)
            self._pump()

    def _delivered(self, msg: OutMsg) -> None:
        """The client acknowledged (or the message was discarded for it): tell its source."""
        if msg.kind == DEVICE or msg.kind == GROUP:
            if self.svc.device is not None:
                self.svc.device.acknowledge(*upstream_ack(msg, self.client_id))
        elif msg.kind == APP:
            key = (msg.ref.topic, msg.ref.partition, msg.ref.offset)
            self.app_refs.pop(key, None)
            if self.app_stream is not None:
                self.app_stream.ack(msg.ref)

    # ---------------------------------------------------------------------------------- outbound
    def deliver(self, msg: pb.PublishMsg, qos: int, retain: bool, subscription_ids, *, kind: int = LIVE,
                fixed_id: int | None = None, ref=None, dup: bool = False, pubrel_only: bool = False) -> None:
        if self.state != CONNECTED:
            return
        if pubrel_only:
            self.out.offer(OutMsg(2, kind, None, fixed_id, True, ref), force=True)
            self._pump()
            return
        pkt = outbound_publish(msg, qos, retain, subscription_ids, _now_ms(), v5=self.v5, dup=dup)
        if pkt is None:  # expired [MQTT-3.3.2-5]
            if kind != LIVE:
                self._delivered(OutMsg(qos, kind, None, fixed_id, False, ref, packet_id=fixed_id or 0))
            return
        if qos == 0:
            if self._writing_paused:
                self.dropped += 1
                self.svc.stats["dropped_qos0_slow"] += 1
                return
            data = encode(pkt, self.level)
            if self.client_max_packet is not None and len(data) > self.client_max_packet:
                self.svc.stats["dropped_too_large"] += 1
                return
            self.write_bytes(data)
            self.svc.stats["msgs_out"] += 1
            return
        out = OutMsg(qos, kind, pkt, fixed_id, False, ref)
        if not self.out.offer(out, force=kind != LIVE):
            self.svc.stats["dropped_queue_full"] += 1
            if self.out.dropped in (1, 100, 10000) or self.out.dropped % 100000 == 0:
                log.warning("client %r: outbound queue full (%d), %d messages dropped so far",
                            self.client_id, self.out.max_queued, self.out.dropped)
            return
        if not self._pump_held:
            self._pump()

    def _pump(self) -> None:
        level = self.level
        limit = self.client_max_packet
        while not self._writing_paused and self.state == CONNECTED:
            ready = self.out.ready()
            if not ready:
                return
            chunks = []
            freed = False
            for m in ready:
                if m.pubrel_only:
                    chunks.append(encode(PubRel(m.packet_id), level))
                    continue
                pkt = m.publish
                pkt.packet_id = m.packet_id
                data = encode(pkt, level)
                if limit is not None and len(data) > limit:
                    # [MQTT-3.1.2-25]: not sent; treated as delivered for this client
                    self.svc.stats["dropped_too_large"] += 1
                    self.out.inflight.pop(m.packet_id, None)
                    self._delivered(m)
                    freed = True
                    continue
                chunks.append(data)
            if chunks:
                self.svc.stats["msgs_out"] += len(chunks)
                self.write_bytes(b"".join(chunks))
            if not freed:
                return

    # ---------------------------------------------------------------------------------- persistent DEVICE
    # Forwards of this client's stored messages come down the service's forward streams (one per
    # device-persistence instance, grpc_clients.ForwardLink). Ordering / no-stranding argument:
    #  - the first FetchUndelivered ATTACHES the session atomically with its read: a message saved before it
    #    is in the answer, one saved after it is forwarded to this connector's service id;
    #  - an instance forwards only on a stream registered there, so whenever a stream opens (ready received:
    #    it is registered BEFORE the re-sync fetch starts) or ends, `resync` fetches again (read only, while
    #    still attached): every message saved after the registration comes down that stream, every message
    #    saved before it is in the re-sync's answer;
    #  - forwards arriving while a fetch runs are held and delivered after its answer, and anything at or
    #    below the highest serial delivered is skipped, so overlaps are delivered once, in serial order.
    async def _fetch(self, store_id: str, *, resync: bool = False) -> list | None:
        """FetchUndelivered(store_id) for this session (the member's own id, or a group store id): the stored
        messages, [] when it failed for good, None when the connection ended meanwhile.

        Retried while the connection lives when device-persistence is unavailable (restarting after a crash,
        or slow): FetchUndelivered is also what ATTACHES this session, so giving up would leave a connected
        client with neither its stored messages nor any new one (device-persistence keeps forwarding them to
        the previous attachment) until it happens to reconnect. Safe to retry. A `resync` only reads (and
        reads nothing when another session attached since)."""
        svc = self.svc
        backoff = 0.5
        while True:
            try:
                stored = await svc.device.fetch(store_id, svc.service_id, self.session_id, resync=resync)
                break
            except grpc.aio.AioRpcError as exc:
                if self.state != CONNECTED:
                    return None
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("client %r: FetchUndelivered(%r) failed (%s); stored messages come on the next "
                                "connect", self.client_id, store_id, exc.code().name)
                    stored = []
                    break
                log.warning("client %r: FetchUndelivered(%r) failed (%s); retrying in %.1fs",
                            self.client_id, store_id, exc.code().name, backoff)
            except Exception as exc:
                log.warning("client %r: FetchUndelivered(%r) failed (%r); stored messages come on the next "
                            "connect", self.client_id, store_id, exc)
                stored = []
                break
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            if self.state != CONNECTED:
                return None
        if self.state != CONNECTED:
            return None
        return stored

    async def _fetch_stored(self, *, resync: bool = False) -> None:
        while True:
            stored = await self._fetch(self.client_id, resync=resync)
            if stored is None:
                return
            # A backlog is queued one window at a time, each written in one go, yielding to the loop
            # in between (the client's PUBACKs of the first window are handled while the rest is
            # converted). Forwards arriving meanwhile are still held: they follow the answer, in order.
            step = max(self.out.window, 64)
            for i in range(0, len(stored), step):
                if i:
                    await asyncio.sleep(0)
                    if self.state != CONNECTED:
                        return
                self._deliver_batch(stored[i:i + step], dup=True)
            again = self.refetch
            self.refetch = False
            self.fetching = again  # still holding when another fetch follows
            held, self.held_persisted = self.held_persisted, []
            self._deliver_batch(held, dup=False)
            if not again or self.state != CONNECTED:
                return
            resync = True

    def resync(self) -> None:
        """A forward stream opened or ended: fetch this session's stores again (own, and every group store
        it attached) and deliver what was not delivered yet."""
        if not self.device or self.state != CONNECTED or self.svc.device is None:
            return
        svc = self.svc
        if self.fetching:
            self.refetch = True
        else:
            self.fetching = True
            svc.stats["resyncs"] += 1
            svc.spawn_bg(self._fetch_stored(resync=True))
        for store_id in self.groups.attached():
            if self.groups.refetch(store_id):
                svc.stats["resyncs"] += 1
                svc.spawn_bg(self._fetch_group(store_id, resync=True))

    def on_persisted(self, dm: pb.DevicePublishMsg) -> None:
        if not self.device or self.state != CONNECTED:
            return
        if self.fetching:
            self.held_persisted.append(dm)
            return
        self._deliver_device(dm, dup=False)

    def _deliver_batch(self, messages, *, dup: bool) -> None:
        """_deliver_device for each, then one write of what fits the window."""
        if not messages:
            return
        self._pump_held = True
        try:
            for dm in messages:
                self._deliver_device(dm, dup=dup)
        finally:
            self._pump_held = False
        self._pump()

    def _deliver_device(self, dm: pb.DevicePublishMsg, *, dup: bool) -> None:
        if dm.serial <= self.max_serial:
            return
        self.max_serial = dm.serial
        m = dm.msg
        self.deliver(m, m.qos, m.retain, m.subscription_ids, kind=DEVICE, fixed_id=dm.packet_id,
                     ref=dm.serial, dup=dup, pubrel_only=dm.packet_type == pb.DEVICE_PACKET_TYPE_PUBREL)

    # ---------------------------------------------------------------------------------- shared DEVICE groups
    # While no member of a shared DEVICE group is connected, the router persists the group's copies under the
    # group store id ss_<share>_<filter> (tbmq_routing.shared_store_id). A persistent DEVICE member hands that
    # store over when it has the shared subscription (session restored on CONNACK, or SUBSCRIBE): one
    # FetchUndelivered(store id) per group, which also attaches the store to this session, so copies the router
    # still stores there (its session view lags) are forwarded here as DevicePublishMsg{client_id = store id}
    # (the service dispatches them through `by_store`). The messages go out with ids of the live allocator
    # (kind GROUP, ref = GroupRef): the store's packet ids are another id space. A newer attachment (another
    # member, on any connector) wins: this one then just gets no more forwards.
    def _attach_groups(self) -> None:
        """Attach (and fetch) the group store of every shared subscription not attached yet. Only for a
        persistent DEVICE session: a non-persistent one could not keep the messages."""
        if not self.device or self.state != CONNECTED or self.svc.device is None:
            return
        for share_name, topic_filter in list(self.subs):
            if not share_name:
                continue
            store_id = shared_store_id(share_name, topic_filter)
            if self.groups.begin(store_id, (share_name, topic_filter)):
                self.svc.by_store[store_id] = self
                self.svc.stats["group_fetches"] += 1
                self.svc.spawn_bg(self._fetch_group(store_id))

    def _detach_group(self, store_id: str) -> None:
        if not self.groups.detach(store_id):
            return
        svc = self.svc
        if svc.by_store.get(store_id) is self:
            del svc.by_store[store_id]
        if svc.device is not None:
            svc.device.detach(store_id, self.session_id)  # a no-op if another session attached since

    async def _fetch_group(self, store_id: str, *, resync: bool = False) -> None:
        while True:
            stored = await self._fetch(store_id, resync=resync)
            if stored is None or not self.groups.fetching(store_id):
                # connection gone, or unsubscribed meanwhile: the Detach sent then may have run before this
                # fetch attached; detach again (a no-op when another session attached since). The messages
                # stay stored.
                if self.svc.device is not None:
                    self.svc.device.detach(store_id, self.session_id)
                return
            held = self.groups.fetched(store_id)
            if stored and not resync:
                log.info("client %r: %d stored messages of shared group store %r", self.client_id, len(stored),
                         store_id)
            for dm in stored:
                self._deliver_group(dm, dup=True)
            for dm in held:
                self._deliver_group(dm, dup=False)
            if not self.groups.again(store_id) or self.state != CONNECTED:
                return
            resync = True

    def on_group_persisted(self, dm: pb.DevicePublishMsg) -> None:
        """A forward of a group store this connection attached."""
        if self.state != CONNECTED or dm.client_id not in self.groups:
            return  # still in Redis: the next member's fetch gets it
        if self.groups.hold(dm.client_id, dm):
            return
        self._deliver_group(dm, dup=False)

    def _deliver_group(self, dm: pb.DevicePublishMsg, *, dup: bool) -> None:
        store_id = dm.client_id
        key = self.groups.key(store_id)
        sub = self.subs.get(key) if key is not None else None
        if sub is None or self.state != CONNECTED:
            return  # no longer subscribed: stays in the store
        if not self.groups.accept(store_id, dm.serial):
            return  # already delivered (a forward of a message that was also in the fetch answer)
        svc = self.svc
        svc.stats["group_delivered"] += 1
        ref = GroupRef(store_id, dm.packet_id, dm.serial)
        if dm.packet_type == pb.DEVICE_PACKET_TYPE_PUBREL:
            # a member's PUBREC was received on an earlier connection: the group got the message (QoS 2,
            # exactly once); another member has no use for a PUBREL of an id it never saw. Done.
            svc.device.acknowledge(store_id, dm.packet_id)
            return
        m = dm.msg
        qos = min(m.qos, sub.qos)
        retain = m.retain and sub.retain_as_published
        ids = (sub.subscription_id,) if sub.subscription_id else ()
        if qos == 0:
            # the group's copy is QoS > 0 but this member was granted QoS 0: sent once, done for the store
            self.deliver(m, 0, retain, ids)
            svc.device.acknowledge(store_id, dm.packet_id)
            return
        self.deliver(m, qos, retain, ids, kind=GROUP, ref=ref, dup=dup)

    # ---------------------------------------------------------------------------------- APPLICATION
    def _open_app_stream(self) -> None:
        from .grpc_clients import AppStream

        # qos: the member's granted QoS; app-delivery caps the group's copy at it [MQTT-3.8.4-8]
        shared = [spb.AppSharedSubscription(share_name=t.share_name, topic_filter=t.topic_filter, qos=t.qos)
                  for t in self.subs.values() if t.share_name]
        opening = spb.AppOpen(client_id=self.client_id, session_id=self.session_id,
                              receive_maximum=self.out.window, shared=shared)
        self.app_stream = AppStream(self.svc.apps, opening, self._on_app_record, on_records=self._on_app_records)
        self.app_stream.start()

    def _restart_app_stream(self) -> None:
        if self.app_stream is not None:
            self.svc.spawn_bg(self.app_stream.stop())
            self.app_stream = None
        self._open_app_stream()

    def _on_app_records(self, records) -> None:
        """Records from app-delivery (a batch, or one): each handled as `_on_app_record`, in order; what
        they add to the client's window is written in one go after the last."""
        self._pump_held = True
        try:
            for rec in records:
                self._on_app_record(rec)
        finally:
            self._pump_held = False
        self._pump()

    def _on_app_record(self, rec: spb.AppRecord) -> None:
        if self.state != CONNECTED:
            return
        key = (rec.ref.topic, rec.ref.partition, rec.ref.offset)
        if key in self.app_refs:
            return  # still in flight with the client from before the stream reopened
        m = rec.msg
        if m.qos == 0:
            self.deliver(m, 0, m.retain, m.subscription_ids)
            if self.app_stream is not None:
                self.app_stream.ack(rec.ref)
            return
        self.app_refs[key] = 1
        self.deliver(m, m.qos, m.retain, m.subscription_ids, kind=APP, ref=rec.ref, dup=rec.redelivery)

    # ---------------------------------------------------------------------------------- SUBSCRIBE
    async def _on_subscribe(self, p: Subscribe) -> None:
        if self.state != CONNECTED:
            raise MqttProtocolError(0x82, "SUBSCRIBE before CONNACK")
        sub_id = 0
        if self.v5 and p.properties.subscription_identifiers:
            sub_id = p.properties.subscription_identifiers[0]
        fail = 0x8F if self.v5 else 0x80
        codes: list[int] = []
        new_set = dict(self.subs)
        retained: list[tuple[str, int, int, bool]] = []
        for s in p.subscriptions:
            try:
                pf = parse_subscription_filter(s.filter, no_local=s.no_local and self.v5, allow_shared=True)
            except InvalidSharedSubscription as exc:
                if exc.protocol_error:
                    raise MqttProtocolError(0x82, str(exc)) from None
                codes.append(fail)
                continue
            except InvalidTopicFilter:
                codes.append(fail)
                continue
            qos = min(s.qos, 2)
            key = (pf.share_name, pf.filter)
            existed = key in new_set
            new_set[key] = topic_subscription(
                pf.share_name, pf.filter, qos, no_local=s.no_local if self.v5 else False,
                retain_as_published=s.retain_as_published if self.v5 else False,
                retain_handling=s.retain_handling if self.v5 else 0, subscription_id=sub_id)
            codes.append(qos)
            rh = s.retain_handling if self.v5 else 0
            if not pf.share_name and (rh == 0 or (rh == 1 and not existed)):
                retained.append((pf.filter, qos, sub_id, existed))
        retained_ready = self.svc.retained_caught_up() if retained else None  # asked now, awaited before SUBACK
        if new_set != self.subs:
            try:
                await self.svc.produce_subscriptions(self.client_id, new_set.values(), self.client_type)
            except Exception as exc:
                log.error("client %r: subscriptions not written to Kafka: %r", self.client_id, exc)
                codes = [0x80] * len(codes)
                self.write(SubAck(p.packet_id, codes))
                return
            old_shared = {k for k in self.subs if k[0]}
            self.subs = new_set
            if self.app_stream is not None and {k for k in new_set if k[0]} != old_shared:
                self._restart_app_stream()
        if retained_ready is not None:
            await retained_ready  # bounded; SUBACK and the retained messages then go out together, as before
        if self.state == CLOSED:
            return
        self.write(SubAck(p.packet_id, codes))
        self._attach_groups()  # a new shared subscription of a persistent DEVICE member: its group's store
        # retained messages [MQTT-3.3.1-9] (retain=1), per Retain Handling; not for shared subscriptions
        ids = ()
        for topic_filter, qos, sid, _existed in retained:
            ids = (sid,) if sid else ()
            for m in self.svc.retained.match_filter(topic_filter):
                self.deliver(m, min(m.qos, qos), True, ids)

    async def _on_unsubscribe(self, p: Unsubscribe) -> None:
        if self.state != CONNECTED:
            raise MqttProtocolError(0x82, "UNSUBSCRIBE before CONNACK")
        codes = []
        new_set = dict(self.subs)
        for f in p.filters:
            try:
                pf = parse_subscription_filter(f, allow_shared=True)
            except InvalidTopicFilter:
                codes.append(0x8F)
                continue
            key = (pf.share_name, pf.filter)
            if new_set.pop(key, None) is None:
                codes.append(0x11)
            else:
                codes.append(0)
        if new_set != self.subs:
            try:
                await self.svc.produce_subscriptions(self.client_id, new_set.values(), self.client_type)
            except Exception as exc:
                log.error("client %r: subscriptions not written to Kafka: %r", self.client_id, exc)
                codes = [0x80] * len(codes)
                self.write(UnsubAck(p.packet_id, codes if self.v5 else []))
                return
            old_shared = {k for k in self.subs if k[0]}
            self.subs = new_set
            if self.app_stream is not None and {k for k in new_set if k[0]} != old_shared:
                self._restart_app_stream()
            for key in old_shared - {k for k in new_set if k[0]}:
                self._detach_group(shared_store_id(*key))  # no longer a member of that group
        self.write(UnsubAck(p.packet_id, codes if self.v5 else []))

    # ---------------------------------------------------------------------------------- DISCONNECT
    def _on_disconnect(self, p: Disconnect) -> None:
        if self.v5:
            new_expiry = p.properties.session_expiry_interval
            if new_expiry is not None:
                if self.connect_expiry == 0 and new_expiry > 0:
                    # [MQTT-3.14.2-2]: from 0 in CONNECT to non-zero is a Protocol Error
                    self._protocol_error(ReasonCode.PROTOCOL_ERROR,
                                         "DISCONNECT sets a Session Expiry Interval after 0")
                    return
                # the registry caps it (its one setting); uncapped here it only bounds the Will Delay, and a
                # session the registry ends sooner sends its Will then (wills.on_session_record)
                self.disconnect_expiry = new_expiry
                self.session_expiry = new_expiry
        # 0x00: normal, no Will; 0x04 (Disconnect with Will Message) and error codes: the Will goes out
        self.graceful = not self.v5 or p.reason_code == 0
        self.close(f"DISCONNECT 0x{p.reason_code:02X}" if self.v5 else "DISCONNECT", log_level=logging.DEBUG)

    # ---------------------------------------------------------------------------------- takeover
    def take_over(self, cmd: pb.DisconnectCommand) -> None:
        """The registry gave the session to a newer connection: close without a DISCONNECTION_REQUEST."""
        self.taken_over = cmd
        rc = _TAKEOVER_REASON.get(cmd.reason, 0x8E)
        self.close(f"session taken over (reason 0x{rc:02X})", disconnect_rc=rc)
