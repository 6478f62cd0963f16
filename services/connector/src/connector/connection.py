"""One MQTT network connection: a thin asyncio.Protocol around `tbmq_connection.ConnectionMachine`.

Bytes in -> codec (tbmq_mqtt.MqttDecoder) -> machine -> effects, run here through the service's narrow
interface (`port.ConnectionPort`). The session rules live in the machine; this module only does I/O:

* Decoded packets go to a per-connection queue, worked through in order: at once, in `data_received`
  (`_work`), while their effects need no awaiting (PUBACK, PINGREQ, ...); from the first that does, by a task
  (`_run`) that lives only until the queue is empty, so an idle connection holds no task (a task waiting on
  its future with its coroutine: about 0.9 KB, measured with tracemalloc).
  Reading from the socket pauses while that queue is long, so a fast sender is slowed by TCP, not buffered.
* Effects that need an answer from Kafka or the registry before the next packet (RequestSession,
  LoadSubscriptions, ProduceSubscriptions, ...: `_AWAITERS`) are awaited by that task. The hand-over of a
  ProducePublish to the producer is one of them, but it is started at once (`tbmq_platform.eager`) and almost
  always finishes without waiting (aiokafka appends to the open batch), so a PUBLISH needs no task; only one
  that waits (metadata, a full batch) leaves its rest to the task. A PUBLISH never waits for Kafka's
  acknowledgement: its delivery futures report to the machine (`produced`), which sends PUBACK/PUBREC in
  packet order once Kafka acknowledged (nothing acknowledged is lost).
* Everything else (deliveries, forwards, timers, the transport's back-pressure) feeds the machine and runs
  its effects at once (`_drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from functools import partial

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import (
    CLOSED,
    CONNECTED,
    AckApp,
    AckStored,
    Authenticate,
    CancelTimer,
    CatchUpRetained,
    Close,
    CloseAppStream,
    ConnectionMachine,
    DetachStore,
    FetchStored,
    Finished,
    LoadSubscriptions,
    Online,
    OpenAppStream,
    ProducePublish,
    ProduceSubscriptions,
    PubrecStored,
    ReportDisconnect,
    RequestSession,
    ScheduleWill,
    Send,
    SessionStarted,
    StartTimer,
    Throttle,
    WaitRetained,
)
from tbmq_auth import AuthResult
from tbmq_mqtt import MqttDecoder, MqttProtocolError, PubAck, ReasonCode
from tbmq_platform.backoff import Backoff, retry_after
from tbmq_platform import eager
from tbmq_platform.tracing import fresh_trace_headers

from .port import ConnectionPort
from .tls import certificate_key

log = logging.getLogger("connector.connection")
tracer = trace.get_tracer("connector")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _qos0_done(stats, fut: asyncio.Future) -> None:
    """Done-callback of QoS 0 produce futures: a record Kafka did not take is lost (QoS 0 allows it), but never
    silently: counted (`dropped_qos0_not_stored`, tbmq_messages_dropped_total) and logged."""
    exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
    if exc is not None:
        stats["dropped_qos0_not_stored"] += 1
        n = stats["dropped_qos0_not_stored"]
        if n in (1, 10, 100, 1000) or n % 10000 == 0:
            log.warning("a QoS 0 PUBLISH was not stored by Kafka (%r): dropped (%d so far)", exc, n)


def certificate_names(cert) -> tuple[str, ...]:
    """A verified client certificate's (ssl getpeercert()) subject CN(s), then its subjectAltName values;
    () without one (no TLS, no certificate, or not verified: MQTT_TLS_CLIENT_AUTH=none)."""
    if not cert:
        return ()
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    names += [v for _kind, v in cert.get("subjectAltName", ())]
    return tuple(dict.fromkeys(names))


class _Handing:
    """A PUBLISH's hand-over to the producer that started eagerly and waits (`_drain_until_awaited`): its rest,
    for the task, in the effect's place."""

    __slots__ = ("effect", "rest")

    def __init__(self, effect: ProducePublish, rest: eager.Suspended) -> None:
        self.effect = effect
        self.rest = rest


class _AclChanged:
    """Queued with the packets (so it is handled between two of them, never during a SUBSCRIBE)."""


ACL_CHANGED = _AclChanged()


class Connection(asyncio.Protocol):
    def __init__(self, port: ConnectionPort, peer: tuple[str, int] | None = None) -> None:
        self.port = port
        self._proxied_peer = peer  # the client's address from a PROXY protocol header (connector.proxy)
        self.s = port.settings
        self.m: ConnectionMachine | None = None
        self.transport: asyncio.Transport | None = None
        self.address = ""
        self.cert_key = None  # (issuer, serial) of a verified client certificate (tls.certificate_key)
        self.decoder = MqttDecoder(max_packet_size=self.s.max_packet_size)
        self.inq: list = []  # a list, not a deque: 56 bytes empty against 760 (short: MQTT_INBOUND_QUEUE_MAX)
        self._inq_bytes = 0  # bytes received since the inbound queue was last empty (MQTT_INBOUND_BUFFER_BYTES)
        self._task: asyncio.Task | None = None  # working through the queue (`_run`); None while idle
        self._reading_paused = False
        self._throttle_until = 0  # epoch ms: no packet is read or handled before (Throttle: the PUBLISH rate)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._stall_timer: asyncio.TimerHandle | None = None
        self._app_stream = None
        self._retained_ready: asyncio.Future | None = None
        self._finished = False

    # the machine's view, for the service and tests
    @property
    def state(self) -> int:
        return self.m.state if self.m is not None else CLOSED

    @property
    def client_id(self) -> str:
        return self.m.client_id if self.m is not None else ""

    @property
    def session_id(self) -> str:
        return self.m.session_id if self.m is not None else ""

    @property
    def username(self) -> str | None:
        """The CONNECT's user name (None: none given, or no CONNECT yet)."""
        return self.m.username if self.m is not None else None

    @property
    def credential(self) -> str | None:
        """The name of the credential the client authenticated with (None: anonymous or not yet)."""
        m = self.m
        return m.identity.credential if m is not None and m.identity is not None else None

    def acl_changed(self) -> None:
        """Its credential changed: re-check its subscriptions (ConnectionMachine.acl_changed) in packet order."""
        if self.m is None or self.m.state == CLOSED:
            return
        self.inq.append(ACL_CHANGED)
        if self._task is None:
            self._work()

    @property
    def subs(self) -> dict:
        """The client's current subscriptions ((share name, filter) -> TopicSubscription)."""
        return self.m.subs if self.m is not None else {}

    # ---------------------------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = self._proxied_peer or transport.get_extra_info("peername")
        self.address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        refused = self.port.admit(peer[0] if isinstance(peer, tuple) and peer else str(peer))
        if refused is not None:  # over MQTT_MAX_CONNECTIONS or the address's connect rate: closed before CONNECT
            self.port.stats[f"refused_{refused}"] += 1
            transport.abort()
            return
        transport.set_write_buffer_limits(high=self.s.write_buffer_high)  # type: ignore[attr-defined]
        peercert = transport.get_extra_info("peercert")  # {} / None: no verified client certificate
        if peercert:  # what a revocation list names it by (a CRL reload closes it when listed)
            self.cert_key = certificate_key(transport.get_extra_info("ssl_object").getpeercert(True))
        self.m = self.port.new_machine(self.address, peer[0] if isinstance(peer, tuple) and peer else "",
                                       certificate_names(peercert))
        self.port.connection_opened(self)
        self.m.start(_now_ms())
        self._drain()

    def data_received(self, data: bytes) -> None:
        m = self.m
        if m is None or m.state == CLOSED:  # None: refused at connection_made
            return
        if m.keep_alive:
            m.bytes_received(_now_ms())
        try:
            packets = self.decoder.feed(data)
        except MqttProtocolError as exc:
            m.decode_error(exc, _now_ms())
            self._drain()
            return
        self._inq_bytes += len(data)
        if packets:
            self.inq.extend(packets)
            if (len(self.inq) >= self.s.inbound_queue_max or self._inq_bytes >= self.s.inbound_buffer_bytes) \
                    and not self._reading_paused:
                # bounded in packets and in bytes: what a client can make this connection hold
                self._reading_paused = True
                self.transport.pause_reading()
            if self._task is None:
                self._work()

    def eof_received(self) -> bool:
        return False  # close

    def pause_writing(self) -> None:
        m = self.m
        m.transport_paused(_now_ms())
        if self._stall_timer is None and m.state != CLOSED:
            self._stall_timer = asyncio.get_running_loop().call_later(
                self.s.write_stall_timeout_s, self._write_stalled)
        self._drain()

    def resume_writing(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self.m.transport_resumed(_now_ms())
        self._drain()

    def _write_stalled(self) -> None:
        self._stall_timer = None
        m = self.m
        if m.writing_paused and m.state != CLOSED:
            m.abort(f"client has not read for {self.s.write_stall_timeout_s:.0f}s "
                    f"({self.transport.get_write_buffer_size()} bytes waiting)", _now_ms())
            self._drain()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.m is None:
            return
        self.m.connection_lost("connection lost" + (f" ({exc})" if exc else ""), _now_ms())
        self._drain()

    # ---------------------------------------------------------------------------------- inputs from the service
    def deliver(self, msg: pb.PublishMsg, qos: int, retain: bool, subscription_ids,
                origin: tuple[int, int, int, int] | None = None) -> None:
        """A live delivery (tbmq.msg.downlink.basic), with the record's origin (ConnectionMachine.deliver)."""
        self.m.deliver(msg, qos, retain, subscription_ids, _now_ms(), origin=origin)
        self._drain()

    def on_persisted(self, dm: pb.DevicePublishMsg) -> None:
        self.m.persisted(dm, _now_ms())
        self._drain()

    def on_store_paused(self, store_id: str) -> None:
        self.m.store_paused(store_id, _now_ms())
        self._drain()

    def on_group_persisted(self, dm: pb.DevicePublishMsg) -> None:
        self.m.group_persisted(dm, _now_ms())
        self._drain()

    def resync(self) -> None:
        self.m.resync(_now_ms())
        self._drain()

    def take_over(self, cmd: pb.DisconnectCommand) -> None:
        self.m.take_over(cmd, _now_ms())
        self._drain()

    def revoke(self, why: str) -> None:
        """Closed by an operator's rule (ConnectionMachine.revoke)."""
        if self.m is None:
            return
        self.m.revoke(why, _now_ms())
        self._drain()

    def shutdown(self) -> None:
        self.m.shutdown(_now_ms())
        self._drain()

    def close(self, reason: str) -> None:
        """Close from the server side (no reason code)."""
        self.m.close(reason, _now_ms())
        self._drain()

    def _on_app_records(self, records) -> None:
        self.m.app_records(records, _now_ms())
        self._drain()

    def _on_app_record(self, rec) -> None:
        self._on_app_records((rec,))

    def _timer_fired(self, name: str) -> None:
        self._timers.pop(name, None)
        self.m.timer_fired(name, _now_ms())
        self._drain()

    # ---------------------------------------------------------------------------------- packet loop
    def _work(self) -> None:
        """Handle the queued packets now, in order, while their effects need no awaiting; the first whose effects
        do (or a throttle) leaves the rest to a task (`_run`). Called only while no task works."""
        m = self.m
        inq = self.inq
        pending: list | None = None
        try:
            while inq and m.state != CLOSED:
                if self._throttle_until:
                    break
                self._feed()
                pending = self._drain_until_awaited()
                if pending is not None:
                    break
            else:
                return
        except Exception:
            log.exception("client %r (%s): internal error", m.client_id, self.address)
            m.internal_error(_now_ms())
            self._drain()
            return
        self._task = asyncio.get_running_loop().create_task(self._run(pending or []))

    def _drain_until_awaited(self) -> list | None:
        """Run the machine's effects now, in order, up to the first that must be awaited; that one and the rest
        are returned for the task (None: all done). A PUBLISH's hand-over to the producer runs here too, eagerly
        (tbmq_platform.eager): aiokafka's `send` appends to the open batch without waiting, so the hot path needs
        no task; only a hand-over that does wait (metadata, a full batch) leaves its rest (`_Handing`) to the
        task. The effects returned are taken out of the machine's list, so that nothing else (a delivery's
        `_drain`) runs one of them before the task does, out of packet order."""
        m = self.m
        effects = m.effects
        port = self.port
        hand_now = not port.spans  # a span must wrap the awaited send (`_produce`)
        while effects:
            e = effects[0]
            cls = e.__class__
            if cls is ProducePublish and hand_now:
                effects.pop(0)
                try:
                    handed = eager.start(port.produce_publish(e.msg, e.topic, e.retain, fresh_trace_headers()))
                except Exception as exc:
                    m.produce_failed(e, exc, _now_ms())
                    continue
                if handed.__class__ is eager.Suspended:
                    pending = [_Handing(e, handed), *effects]
                    effects.clear()
                    return pending
                self._produce_handed(e, *handed)
            elif cls in _AWAITERS:
                pending = effects.copy()
                effects.clear()
                return pending
            else:
                effects.pop(0)
                _HANDLERS[cls](self, e)
        return None

    def _feed(self) -> None:
        """The next packet (a run of PUBACKs together) into the machine; reading resumes once the queue is short."""
        inq = self.inq
        m = self.m
        packet = inq.pop(0)
        if packet.__class__ is PubAck:
            run = [packet]
            while inq and inq[0].__class__ is PubAck:
                run.append(inq.pop(0))
            m.pubacks(run, _now_ms())
        elif packet is ACL_CHANGED:
            m.acl_changed(_now_ms())
        else:
            m.packet(packet, _now_ms())
        if not inq:
            self._inq_bytes = 0
        if self._reading_paused and len(inq) < self.s.inbound_queue_max // 2 \
                and self._inq_bytes < self.s.inbound_buffer_bytes:
            self._reading_paused = False
            self.transport.resume_reading()

    async def _run(self, pending: list) -> None:
        """The effects `_work` left (`pending`: one of them needs awaiting), then the queue, until it is empty."""
        inq = self.inq
        m = self.m
        port = self.port
        effects = pending
        try:
            while True:
                while effects:  # _drain_awaiting, with the PUBLISH hand-over inline (the hot path)
                    e = effects.pop(0)
                    cls = e.__class__
                    if cls is ProducePublish:
                        if port.spans:
                            await self._produce(e)
                            continue
                        await self._hand_over(e, port.produce_publish(e.msg, e.topic, e.retain,
                                                                      fresh_trace_headers()))
                    elif cls is Send:
                        self._send(e)
                    else:
                        effects.insert(0, e)
                        await self._drain_awaiting(effects)
                effects = m.effects  # what the next packets leave, or what arrived meanwhile
                if effects:
                    continue
                if not inq or m.state == CLOSED:
                    return
                if self._throttle_until:
                    await self._throttled()
                    continue  # closed meanwhile, or its queue emptied: checked again
                self._feed()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("client %r (%s): internal error", m.client_id, self.address)
            m.internal_error(_now_ms())
            self._drain()
        finally:
            self._task = None

    async def _throttled(self) -> None:
        """Over the PUBLISH rate (Throttle): stop reading from the client until the time the machine gave; the
        packet loop resumes reading once its queue is short again, as after a full queue."""
        delay = (self._throttle_until - _now_ms()) / 1000
        self._throttle_until = 0
        if delay > 0:
            if not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()
            await asyncio.sleep(delay)  # the client's own pace, decided by the machine (not a synchronisation)

    def _throttle(self, e: Throttle) -> None:
        self._throttle_until = max(self._throttle_until, e.until_ms)

    async def _drain_awaiting(self, effects: list | None = None) -> None:
        """Run the effects of a packet (the machine's list unless given), awaiting those the machine waits on
        before the next packet."""
        if effects is None:
            effects = self.m.effects
        while effects:
            e = effects.pop(0)
            cls = e.__class__
            awaiter = _AWAITERS.get(cls)
            if awaiter is not None:
                await awaiter(self, e)
            else:
                _HANDLERS[cls](self, e)

    def _drain(self) -> None:
        """Run the machine's effects now (an effect that needs awaiting runs as a task: the machine emits
        those only from packets, which `_run` drains itself)."""
        effects = self.m.effects
        while effects:
            e = effects.pop(0)
            cls = e.__class__
            if cls is Send:  # the hot path, inline
                t = self.transport
                if t is not None and not t.is_closing():
                    t.write(e.data)
                    if t.get_write_buffer_size() > self.s.write_buffer_limit:
                        self._send_over_limit()
                continue
            handler = _HANDLERS.get(cls)
            if handler is not None:
                handler(self, e)
            else:
                self.port.spawn_bg(self._await_one(e))

    async def _await_one(self, e) -> None:
        self.m.effects.insert(0, e)
        await self._drain_awaiting()

    # ---------------------------------------------------------------------------------- awaited effects
    async def _produce(self, e: ProducePublish) -> None:
        port = self.port
        m = self.m
        try:
            if port.spans:
                with tracer.start_as_current_span("mqtt.publish", kind=SpanKind.SERVER) as span:
                    if span.is_recording():
                        span.set_attribute("messaging.destination.name", e.topic)
                        span.set_attribute("mqtt.qos", e.qos)
                        span.set_attribute("mqtt.client_id", m.client_id)
                    fut, fut2 = await port.produce_publish(e.msg, e.topic, e.retain)
            else:
                fut, fut2 = await port.produce_publish(e.msg, e.topic, e.retain, fresh_trace_headers())
        except Exception as exc:
            m.produce_failed(e, exc, _now_ms())
            self._drain()
            return
        self._produce_handed(e, fut, fut2)

    async def _hand_over(self, e: ProducePublish, handing) -> None:
        """Await a hand-over to the producer (`produce_publish`, or the rest of one started eagerly): its
        acknowledgements then report to the machine, a failure at once (its effects: the caller's loop runs them
        next)."""
        try:
            fut, fut2 = await handing
        except Exception as exc:
            self.m.produce_failed(e, exc, _now_ms())
            return
        self._produce_handed(e, fut, fut2)

    async def _hand_rest(self, h: _Handing) -> None:
        """The rest of a hand-over that `_drain_until_awaited` started and that had to wait."""
        await self._hand_over(h.effect, h.rest)

    def _produce_handed(self, e: ProducePublish, fut: asyncio.Future, fut2: asyncio.Future | None) -> None:
        """The producer took the record(s): their acknowledgements report to the machine (QoS 1/2)."""
        if e.qos == 0:
            done0 = partial(_qos0_done, self.port.stats)
            fut.add_done_callback(done0)
            if fut2 is not None:
                fut2.add_done_callback(done0)
            return
        done = partial(self._produced, e)
        fut.add_done_callback(done)
        if fut2 is not None:
            fut2.add_done_callback(done)

    def _produced(self, e: ProducePublish, fut: asyncio.Future) -> None:
        exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        self.m.produced(e, exc, _now_ms())
        self._drain()

    async def _authenticate(self, e: Authenticate) -> None:
        try:
            result = await self.port.authenticate(e.request)
        except Exception:
            log.exception("client %r: authentication failed", e.request.client_id)
            result = AuthResult(ReasonCode.SERVER_UNAVAILABLE, "authentication failed")
        self.m.authenticated(result, _now_ms())

    async def _request_session(self, e: RequestSession) -> None:
        m = self.m
        self.port.route_session(e.session.session_id, self)
        timeout = self.s.session_event_timeout_s
        try:
            resp = await self.port.request_session(e.session)
        except (asyncio.TimeoutError, TimeoutError):
            m.session_failed(f"no answer from the session registry within {timeout:g}s", _now_ms())
            return
        except Exception as exc:  # Kafka unavailable
            m.session_failed(f"session request failed: {exc!r}", _now_ms())
            return
        m.session_answer(resp, _now_ms())

    async def _load_subscriptions(self, e: LoadSubscriptions) -> None:
        try:
            subs = await self.port.subscriptions_of(e.client_id)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("client %r: subscriptions view did not catch up; starting empty", e.client_id)
            subs = None
        self.m.subscriptions_loaded(subs, _now_ms())

    async def _produce_subscriptions(self, e: ProduceSubscriptions) -> None:
        error = None
        try:
            await self.port.produce_subscriptions(e.client_id, e.subscriptions, e.client_type)
        except Exception as exc:
            error = exc
        self.m.subscriptions_written(error, _now_ms())

    def _catch_up_retained(self, e: CatchUpRetained) -> None:
        self._retained_ready = self.port.retained_caught_up()  # asked now, awaited before SUBACK

    async def _wait_retained(self, e: WaitRetained) -> None:
        ready, self._retained_ready = self._retained_ready, None
        if ready is not None and self.m.awaiting_retained:
            await ready  # bounded by CONNECTOR_RETAINED_WAIT_MS (the service logs a timeout)
        self.m.retained_ready(_now_ms())

    # ---------------------------------------------------------------------------------- immediate effects
    def _send(self, e: Send) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(e.data)
        if t.get_write_buffer_size() > self.s.write_buffer_limit:
            self._send_over_limit()

    def _send_over_limit(self) -> None:
        self.m.abort(f"write buffer above {self.s.write_buffer_limit} bytes (client not reading)", _now_ms())

    def _close(self, e: Close) -> None:
        log.log(e.log_level, "client %r (%s): %s; closing", self.m.client_id, self.address, e.reason)
        t = self.transport
        if t is None:
            return
        if e.abort:
            t.abort()
        elif not t.is_closing():
            t.close()

    def _start_timer(self, e: StartTimer) -> None:
        old = self._timers.pop(e.name, None)
        if old is not None:
            old.cancel()
        if self._finished:
            return
        delay = max(0.0, (e.at_ms - _now_ms()) / 1000)
        self._timers[e.name] = asyncio.get_running_loop().call_later(delay, self._timer_fired, e.name)

    def _cancel_timer(self, e: CancelTimer) -> None:
        old = self._timers.pop(e.name, None)
        if old is not None:
            old.cancel()

    def _ack_stored(self, e: AckStored) -> None:
        if self.port.device is not None:
            self.port.device.acknowledge(e.store_id, e.packet_id, e.serial)

    def _pubrec_stored(self, e: PubrecStored) -> None:
        if self.port.device is not None:
            self.port.device.mark_pubrec(e.store_id, e.packet_id, e.serial,
                                         done=lambda pid=e.client_packet_id: self._pubrec_marked(pid))
        else:
            self._pubrec_marked(e.client_packet_id)

    def _pubrec_marked(self, packet_id: int) -> None:
        """device-persistence applied the PUBREC's mark: the machine sends the PUBREL it held."""
        self.m.pubrec_stored(packet_id, _now_ms())
        self._drain()

    def _ack_app(self, e: AckApp) -> None:
        if self._app_stream is not None:
            self._app_stream.ack(e.ref)

    def _session_started(self, e: SessionStarted) -> None:
        self.port.session_started(e.client_id, e.clean_start)

    def _online(self, e: Online) -> None:
        self.port.route_client(e.client_id, self)

    def _fetch_stored(self, e: FetchStored) -> None:
        if self.port.device is None:
            return
        if e.group and not e.resync:
            self.port.route_store(e.store_id, self)
        self.port.spawn_bg(self._fetch_and_feed(e))

    def _detach_store(self, e: DetachStore) -> None:
        self.port.unroute_store(e.store_id, self)
        if self.port.device is not None:
            self.port.device.detach(e.store_id, self.m.session_id)  # a no-op if another session attached since

    def _open_app_stream(self, e: OpenAppStream) -> None:
        self._app_stream = self.port.open_app_stream(e.opening, self._on_app_record, self._on_app_records)

    def _close_app_stream(self, e: CloseAppStream) -> None:
        if self._app_stream is not None:
            self.port.spawn_bg(self._app_stream.stop())
            self._app_stream = None

    def _schedule_will(self, e: ScheduleWill) -> None:
        self.port.schedule_will(e.client_id, e.session_id, e.will, e.level, e.delay)

    def _report_disconnect(self, e: ReportDisconnect) -> None:
        self.port.report_disconnect(e.session, e.graceful, e.session_expiry, e.awaiting_pubrel)

    def _finish(self, e: Finished) -> None:
        """Everything the transport side holds for this connection, dropped once."""
        if self._finished:
            return
        self._finished = True
        self.port.connection_closed(self)
        for timer in (*self._timers.values(), self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._timers.clear()
        self._stall_timer = None
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    # ---------------------------------------------------------------------------------- stored messages
    # Forwards of a persistent DEVICE session's stores come down the service's forward streams (one per
    # device-persistence instance, grpc_clients.ForwardLink). Ordering / no-stranding argument:
    #  - the first FetchUndelivered ATTACHES the session atomically with its read: a message saved before it
    #    is in the answer, one saved after it is forwarded to this connector's service id;
    #  - an instance forwards only on a stream registered there, so whenever a stream opens (ready received:
    #    it is registered BEFORE the re-sync fetch starts) or ends, the machine fetches again (read only,
    #    while still attached): every message saved after the registration comes down that stream, every
    #    message saved before it is in the re-sync's answer;
    #  - forwards arriving while a fetch runs are held (by the machine) and delivered after its answer, and
    #    anything at or below the highest serial delivered is skipped, so overlaps are delivered once, in
    #    serial order.
    async def _fetch_and_feed(self, e: FetchStored) -> None:
        m = self.m
        parts = 0
        more = False
        count = 0
        async with contextlib.aclosing(self._fetch(e)) as answer:
            async for stored, more in answer:
                parts += 1
                if not m.fetch_wanted(e):
                    break
                count += len(stored)
                # Each part is given as it comes (device-persistence reads the next one meanwhile), one window
                # at a time, each written in one go, yielding to the loop in between (the client's PUBACKs of
                # the first window are handled while the rest is converted). Forwards arriving meanwhile are
                # still held: they follow the answer, in order.
                step = max(m.out.window, 64)
                for i in range(0, len(stored), step):
                    if i:
                        await asyncio.sleep(0)
                    if m.state != CONNECTED:
                        return
                    m.stored(e, stored[i:i + step], _now_ms())
                    self._drain()
        if not parts or not m.fetch_wanted(e):
            m.fetch_abandoned(e, _now_ms())
            self._drain()
            return
        if count and e.group and not e.resync:
            log.info("client %r: %d stored messages of shared group store %r", m.client_id, count, e.store_id)
        m.fetch_finished(e, _now_ms(), more=more)
        self._drain()

    async def _fetch(self, e: FetchStored) -> AsyncIterator[tuple[list, bool]]:
        """FetchUndeliveredParts(store id) for this session (`DevicePersistenceClient.fetch`): one page of
        the stored messages, in parts as device-persistence reads them, (messages, more) each; ([], False)
        when it failed for good; nothing when the connection ended meanwhile.

        Retried while the connection lives when device-persistence is unavailable (restarting after a crash,
        or slow) before its first part: the fetch is also what ATTACHES this session, so giving up
        would leave a connected client with neither its stored messages nor any new one (device-persistence
        keeps forwarding them to the previous attachment) until it happens to reconnect. Safe to retry. A
        re-sync only reads (and reads nothing when another session attached since). A failure after some
        parts ends the page there with `more`: the next page is fetched after the last serial delivered
        (the session is attached by then)."""
        m = self.m
        device = self.port.device
        backoff = Backoff()
        while True:
            got = False
            try:
                async with contextlib.aclosing(device.fetch(
                        e.store_id, m.cfg.service_id, m.session_id, resync=e.resync, after=e.after,
                        max_messages=e.max_messages, max_bytes=e.max_bytes)) as parts:
                    async for part in parts:
                        if m.state != CONNECTED:
                            return
                        got = True
                        yield part
                return
            except grpc.aio.AioRpcError as exc:
                if m.state != CONNECTED:
                    return
                if got:
                    log.warning("client %r: fetching store %r failed midway (%s); the rest of the page is "
                                "fetched next", m.client_id, e.store_id, exc.code().name)
                    yield [], True
                    return
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("client %r: fetching store %r failed (%s); stored messages come on the next "
                                "connect", m.client_id, e.store_id, exc.code().name)
                    yield [], False
                    return
                delay = backoff.next()
                log.warning("client %r: fetching store %r failed (%s); retrying in %.1fs",
                            m.client_id, e.store_id, exc.code().name, delay)
            except Exception as exc:
                log.warning("client %r: fetching store %r failed (%r); stored messages come on the next "
                            "connect", m.client_id, e.store_id, exc)
                if m.state == CONNECTED:
                    yield [], got
                return
            await retry_after(delay)  # the retry's back-off (not a synchronisation)
            if m.state != CONNECTED:
                return


# the effects a packet's handling must await before the next packet, run by `_drain_awaiting` (the rest:
# _HANDLERS); `_work` hands a packet to the task when its effects hold one of them
_AWAITERS = {
    ProducePublish: Connection._produce,
    _Handing: Connection._hand_rest,
    RequestSession: Connection._request_session,
    Authenticate: Connection._authenticate,
    LoadSubscriptions: Connection._load_subscriptions,
    ProduceSubscriptions: Connection._produce_subscriptions,
    WaitRetained: Connection._wait_retained,
}

_HANDLERS = {
    Send: Connection._send,
    CatchUpRetained: Connection._catch_up_retained,
    AckStored: Connection._ack_stored,
    AckApp: Connection._ack_app,
    PubrecStored: Connection._pubrec_stored,
    StartTimer: Connection._start_timer,
    CancelTimer: Connection._cancel_timer,
    Close: Connection._close,
    SessionStarted: Connection._session_started,
    Online: Connection._online,
    FetchStored: Connection._fetch_stored,
    DetachStore: Connection._detach_store,
    OpenAppStream: Connection._open_app_stream,
    CloseAppStream: Connection._close_app_stream,
    ScheduleWill: Connection._schedule_will,
    ReportDisconnect: Connection._report_disconnect,
    Finished: Connection._finish,
    Throttle: Connection._throttle,
}

__all__ = ["Connection"]
