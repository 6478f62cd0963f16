"""One MQTT connection's session logic as a sans-io state machine (in the manner of h11 and mqttproto).

No I/O, no clock, no event loop: the machine is fed decoded packets (tbmq_mqtt) and events — Kafka's answer
for a produced PUBLISH, the session registry's answer, deliveries (live, persisted DEVICE, APPLICATION
records), fetched stored messages, timers, transport back-pressure, a takeover command, the end of the
transport — each with the time `now` in epoch milliseconds, and appends the effects that follow
(`tbmq_connection.effects`) to `self.effects`, in the order they must run. Every input method returns that
list; the runner pops and runs the effects (the connector's asyncio adapter, `connector.connection`).

Guarantees kept here (each where the code enforces it):

* Nothing acknowledged is lost: PUBACK / PUBREC of an inbound PUBLISH is sent only after Kafka acknowledged
  its record(s) (`produced`), and in packet order; a failed record gets PUBACK/PUBREC 0x80 (v5) or closes
  the connection (3.x, which has no failure ack).
* Exactly-once receive [MQTT-4.3.3-10]: a QoS 2 PUBLISH whose id awaits PUBREL is answered, not produced again.
* Outbound: at most the client's Receive Maximum in flight (`flow.OutboundWindow`); stored DEVICE messages
  keep the store's packet ids; upstream acknowledgements (device-persistence, app-delivery) only after the
  client's PUBACK / PUBCOMP.
* Exactly-once delivery of a stored QoS 2 message across a crash of this connector: its PUBREL goes out only
  once device-persistence has recorded the client's PUBREC (`PubrecStored` → `pubrec_stored`). Before that
  the store still owes the PUBLISH, and the client, still awaiting PUBREL, answers its redelivery (same
  packet id) with PUBREC instead of taking it as a new message [MQTT-4.3.3].
* Keep alive [MQTT-3.1.2-22]: closed (v5: DISCONNECT 0x8D) when nothing arrived for 1.5 × the keep alive.
* Authorization (with a `tbmq_auth.Authorizer`): nothing is asked of the registry before the CONNECT is
  authenticated (`Authenticate` → `authenticated`); a PUBLISH, a Will or a SUBSCRIBE is checked against the
  credential as it is at that moment, and a changed credential removes the subscriptions it no longer
  allows (`acl_changed`).
* Will: not after DISCONNECT 0x00 [MQTT-3.1.2-10]; delayed by the v5 Will Delay Interval [MQTT-3.1.3-9] but
  not past the end of the session [MQTT-3.1.2-8].
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq_mqtt import (
    EMPTY_PROPERTIES,
    MQTT_3_1_1,
    MQTT_5,
    REASON_CODES_BY_PACKET,
    ConnAck,
    Connect,
    Disconnect,
    MqttProtocolError,
    PacketType,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    encode,
    server_error_response,
)
from tbmq_auth import AuthRequest, AuthResult, Authorizer, Identity
from tbmq_routing import InvalidSharedSubscription, InvalidTopicFilter, parse_subscription_filter, shared_store_id
from tbmq_routing.expiry import deadline_ms, interval_at
from tbmq_routing.origins import OriginMarks
from tbmq_routing.wills import will_delay_seconds

from .connect import ConnectRefused, plan_connect
from .limits import PublishRate, topic_problem
from .convert import outbound_publish, publish_msg, topic_subscription
from .effects import (
    AckApp,
    AckStored,
    Authenticate,
    CancelTimer,
    CatchUpRetained,
    Close,
    CloseAppStream,
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
from .flow import APP, DEVICE, GROUP, LIVE, AliasError, GroupRef, GroupStores, InboundAliases, InboundQos, \
    OutboundAliases, OutboundWindow, OutMsg, upstream_ack

log = logging.getLogger("connector.connection")

# states
NEW, CONNECTING, CONNECTED, CLOSED = range(4)

# timer names (StartTimer / timer_fired)
CONNECT_TIMEOUT = "connect"
KEEP_ALIVE = "keep_alive"
TOKEN_EXPIRY = "token_expiry"  # a `jwt` token or an `http` answer expires: the connection ends

RC = ReasonCode
_MSGS_IN = ("msgs_in_qos0", "msgs_in_qos1", "msgs_in_qos2")  # stats keys (Prometheus tbmq_messages_received)
_SESSION_FAILURE = {pb.SESSION_FAILURE_QUOTA_EXCEEDED: RC.QUOTA_EXCEEDED,
                    pb.SESSION_FAILURE_SERVER_UNAVAILABLE: RC.SERVER_UNAVAILABLE,
                    pb.SESSION_FAILURE_CONNECTOR_FENCED: RC.SERVER_UNAVAILABLE,
                    pb.SESSION_FAILURE_CLIENT_ID_NOT_VALID: RC.CLIENT_IDENTIFIER_NOT_VALID,
                    pb.SESSION_FAILURE_UNSPECIFIED_ERROR: RC.UNSPECIFIED_ERROR}
_TAKEOVER_REASON = {pb.DISCONNECT_REASON_SESSION_TAKEN_OVER: RC.SESSION_TAKEN_OVER,
                    pb.DISCONNECT_REASON_ADMINISTRATIVE: RC.ADMINISTRATIVE_ACTION,
                    pb.DISCONNECT_REASON_SERVER_SHUTTING_DOWN: RC.SERVER_SHUTTING_DOWN,
                    pb.DISCONNECT_REASON_CONNECTOR_FENCED: RC.ADMINISTRATIVE_ACTION}
_TAKEOVER_TEXT = {RC.SESSION_TAKEN_OVER: "session taken over by a newer connection",
                  RC.ADMINISTRATIVE_ACTION: "disconnected by an administrator",
                  RC.SERVER_SHUTTING_DOWN: "server shutting down"}
_CONNACK_PROPS_BASE = dict(retain_available=True, wildcard_subscription_available=True,
                           subscription_identifier_available=True, shared_subscription_available=True)
_DISCONNECT_CODES = REASON_CODES_BY_PACKET[PacketType.DISCONNECT]


def _no_retained(_topic_filter: str) -> Iterable:
    return ()


def _always(_topic: str, _size: int) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class MachineConfig:
    """The connector's limits, as a connection applies them (built once from its settings)."""

    service_id: str
    receive_maximum: int = 1024          # ours: QoS 1/2 PUBLISHes a client may have unacknowledged (v5 CONNACK)
    topic_alias_maximum: int = 10        # ours: inbound topic aliases (v5 CONNACK; 0 = none)
    max_packet_size: int = 262144        # ours (v5 CONNACK)
    max_inflight: int = 1000             # outbound window cap (and the client's Receive Maximum)
    max_queued: int = 1000               # outbound queue behind the window
    server_keep_alive_max: int = 600     # largest keep alive granted to a v5 client (0 = as asked)
    connect_timeout_ms: int = 10_000     # a new connection has this long to send CONNECT
    device_persistence: bool = True      # persistent DEVICE sessions are served (stores fetched, acks sent)
    page_messages: int = 2500            # own stored messages held per connection (a page; the next page is
    page_bytes: int = 1024 * 1024        # ... fetched once a quarter of these is free: `page_room`)
    first_page_messages: int = 250       # the first page of a connection asks at most this many: its first
    #                                      message goes out sooner, and the next page is asked for at once
    response_information: str = ""       # v5 CONNACK Response Information when the client asks ("" = never)
    # limits one client cannot push the connector past (tbmq_connection.limits; docs/security.md)
    max_topic_bytes: int = 4096          # topic names and filters, UTF-8 bytes
    max_topic_levels: int = 128
    max_subscriptions: int = 1000        # per client
    max_user_properties: int = 64        # per PUBLISH (v5) and per Will
    max_queued_bytes: int = 8 * 1024 * 1024  # outbound queue per client (besides max_queued messages)
    max_publish_rate: float = 0          # PUBLISH packets a second per client (0 = unlimited): Throttle beyond
    max_publish_bytes_rate: float = 0    # PUBLISH payload bytes a second per client (0 = unlimited)

    def page_room(self, held_messages: int, held_bytes: int) -> bool:
        """Is there room for the next page of a store? Once what is held (queued or in flight, unacknowledged)
        leaves a quarter of a page free, in messages and in bytes: the next page is then fetched while the
        rest is delivered, so the client is not left waiting for a round trip between pages, and each page
        still carries at least a quarter of one (the fetch asks for all the room there is when it starts)."""
        return (held_messages <= self.page_messages - max(self.page_messages // 4, 1)
                and held_bytes <= self.page_bytes - max(self.page_bytes // 4, 1))


class ConnectionMachine:
    """The state of one MQTT connection, from the first byte to the end of the transport."""

    # slots, not a __dict__: 67 attributes cost about 1 KB less per connection (a connector holds 100,000)
    __slots__ = ("_acl", "_connect_request", "_finished", "_plan", "_pump_held", "_refusal_reasons", "_retained_ok",
                 "_revoke_at_connack", "_session_present", "_subscribing", "_written", "acks", "address", "aliases",
                 "app_open", "app_refs", "auth", "cert_names", "cfg", "client_id", "client_max_packet",
                 "client_type", "close_reason", "connect_expiry", "device", "disconnect_expiry", "effects",
                 "fetching", "graceful", "groups", "held_persisted", "identity", "inbound", "keep_alive", "last_rx",
                 "level", "max_serial", "origins", "out", "out_aliases", "paging", "peer_ip", "persistent",
                 "problem_info", "publish_rate", "pubrel_waiting", "refetch", "request_sent", "retained",
                 "retained_room", "session", "session_expiry", "session_id", "state", "state_before_close", "stats",
                 "stored_bytes", "stored_sizes", "subs", "taken_over", "throttled_until", "total_rate", "username",
                 "v5", "will", "will_delay", "writing_paused")

    def __init__(self, config: MachineConfig, *, stats: Counter | None = None,
                 retained: Callable[[str], Iterable] | None = None, address: str = "",
                 retained_room: Callable[[str, int], bool] | None = None,
                 auth: Authorizer | None = None, peer_ip: str = "", cert_names: tuple[str, ...] = (),
                 total_rate: PublishRate | None = None) -> None:
        self.cfg = config
        # authentication / authorization (tbmq_auth; None: everyone may do everything)
        self.auth = auth
        self.peer_ip = peer_ip
        self.cert_names = cert_names     # the verified client certificate's CN and SANs
        self.identity: Identity | None = None
        self._acl = False                # a credential's or a token's patterns apply (not anonymous)
        self.stats = stats if stats is not None else Counter()
        self.throttled_until = 0  # epoch ms: the runner reads nothing of the client before (Throttle)
        # None when both rates are unlimited (PublishRate is falsy then): nothing to count per PUBLISH
        self.publish_rate = PublishRate(config.max_publish_rate, config.max_publish_bytes_rate) or None
        # the connector's budget, shared by all its connections (MQTT_MAX_TOTAL_PUBLISH_RATE / _BYTES_RATE)
        self.total_rate = total_rate or None
        self.retained = retained or _no_retained   # topic filter -> retained PublishMsgs matching it (pure read)
        # (topic, payload bytes) -> may a retained message be stored (MQTT_MAX_RETAINED_MESSAGES / _BYTES)
        self.retained_room = retained_room or _always
        self.address = address
        self.effects: list = []  # a list, not a deque: 56 bytes empty against 760, per connection
        self.state = NEW
        self.state_before_close = NEW
        self._revoke_at_connack: tuple | None = None  # revoke() while CONNECTING: (why, rc), applied after CONNACK
        self.level = MQTT_3_1_1
        self.v5 = False
        self.last_rx = 0
        self.keep_alive = 0
        # session
        self.client_id = ""
        self.username: str | None = None
        self.session_id = ""
        self.session: pb.SessionInfo | None = None
        self.client_type = pb.CLIENT_TYPE_DEVICE
        self.persistent = False          # the registry's answer: messages kept for the client (fetch / stream)
        self.session_expiry = 0          # the registry's interval: how long the session outlives the connection
        self.connect_expiry = 0          # the CONNECT's interval as sent (v5 DISCONNECT may not raise it from 0)
        self.will = None
        self._refusal_reasons: dict[int, str] = {}  # packet id -> why its PUBLISH was refused (Reason String)
        self._connect_request: pb.SessionInfo | None = None  # the CONNECTION_REQUEST (with the Will), once built
        self.will_delay = 0
        self.subs: dict[tuple[str, str], pb.TopicSubscription] = {}
        self._plan = None                # the CONNECT's plan while the registry answers
        self._session_present = False
        self._subscribing = None         # a SUBSCRIBE / UNSUBSCRIBE waiting for Kafka's acknowledgement
        self._written = True             # ... its subscription set is acknowledged (or unchanged)
        self._retained_ok = True         # ... the retained view caught up (or no retained messages asked)
        # flow
        self.inbound = InboundQos(config.receive_maximum)
        self.acks: list[ProducePublish] = []
        self.aliases = InboundAliases(config.topic_alias_maximum)
        self.out = OutboundWindow(min(config.max_inflight, 65535), config.max_queued, config.max_queued_bytes)
        self.origins = OriginMarks()     # live deliveries: one copy per tbmq.msg.all record
        self.client_max_packet = None
        self.out_aliases: OutboundAliases | None = None   # v5 client with Topic Alias Maximum > 0
        self.problem_info = True         # v5 Request Problem Information (0: Reason Strings only on CONNACK/DISCONNECT)
        self.writing_paused = False
        self._pump_held = False          # delivering a batch: the window is written once after it
        # end of connection
        self.graceful = False            # DISCONNECT 0x00 received: no Will
        self.disconnect_expiry: int | None = None
        self.taken_over: pb.DisconnectCommand | None = None
        self.request_sent = False        # CONNECTION_REQUEST made: a DISCONNECTION_REQUEST is owed
        self.close_reason = ""
        self._finished = False
        # persistent DEVICE / APPLICATION
        self.device = False
        self.fetching = False
        self.refetch = False             # a re-sync came while fetching: fetch again after
        self.held_persisted: list[pb.DevicePublishMsg] = []
        self.max_serial = -1
        self.paging = False              # the own store holds more for this session: next page when there is room
        self.stored_sizes: dict[int, int] = {}  # serial -> payload bytes of own-store messages held (queued/in flight)
        self.stored_bytes = 0
        # PUBREC'd QoS 2 ids in PUBREC order -> whether their PUBREL may go (a stored message's once the store
        # has the mark); PUBRELs leave in that order [MQTT-4.6.0-3]
        self.pubrel_waiting: dict[int, bool] = {}
        self.groups = GroupStores()      # shared DEVICE group stores attached by this (persistent) member
        self.app_open = False
        self.app_refs: dict[tuple, int] = {}

    # ====================================================================================== inputs
    def start(self, now: int) -> list:
        """The transport is up: CONNECT is due within the connect timeout."""
        self.last_rx = now
        self.effects.append(StartTimer(CONNECT_TIMEOUT, now + self.cfg.connect_timeout_ms))
        return self.effects

    def bytes_received(self, now: int) -> None:
        """Anything arrived (even part of a packet): the keep alive counts from here."""
        self.last_rx = now

    def packet(self, p, now: int) -> list:
        """One decoded packet from the client."""
        if self.state == CLOSED:
            return self.effects
        try:
            cls = p.__class__
            if cls is Publish:
                self._on_publish(p, now)
            elif cls is PubAck:
                self._on_puback(p, now)
            elif cls is PubRec:
                self._on_pubrec(p, now)
            elif cls is PubRel:
                self._on_pubrel(p)
            elif cls is PubComp:
                self._on_pubcomp(p, now)
            elif cls is PingReq:
                self._send(encode(PingResp(), self.level))
            elif cls is Subscribe:
                self._on_subscribe(p, now)
            elif cls is Unsubscribe:
                self._on_unsubscribe(p, now)
            elif cls is Disconnect:
                self._on_disconnect(p)
            elif cls is Connect:
                self._on_connect(p, now)
            else:  # AUTH: enhanced authentication is not supported
                self._protocol_error(RC.PROTOCOL_ERROR, f"{cls.__name__} not supported")
        except MqttProtocolError as exc:
            self._protocol_error(exc.reason_code, exc.message)
        return self.effects

    def pubacks(self, acks: list, now: int) -> list:
        """A run of PUBACKs (a client acknowledging a burst sends them in one segment): the window is refilled
        once after the last, in one write."""
        self._pump_held = True
        try:
            for p in acks:
                if self.state == CLOSED:
                    break
                self._on_puback(p, now)
        finally:
            self._pump_held = False
        self._pump(now)
        return self.effects

    def decode_error(self, exc: MqttProtocolError, now: int) -> list:
        """The codec rejected the bytes: close with its reason code (CONNACK for a bad CONNECT)."""
        self._protocol_error(exc.reason_code, exc.message, connect=exc.packet_type == PacketType.CONNECT,
                             level=exc.protocol_level)
        return self.effects

    def timer_fired(self, name: str, now: int) -> list:
        if name == CONNECT_TIMEOUT:
            if self.state == NEW:
                self._close(f"no CONNECT within {self.cfg.connect_timeout_ms / 1000:g}s", log_level=logging.WARNING)
        elif name == TOKEN_EXPIRY and self.identity is not None and self.identity.expires_at_ms is not None:
            if now >= self.identity.expires_at_ms:
                self.stats["token_expired"] += 1
                self.revoke("token expired", now, rc=RC.NOT_AUTHORIZED)
            else:  # fired early (a clock step): again at the expiry
                self.effects.append(StartTimer(TOKEN_EXPIRY, self.identity.expires_at_ms))
        elif name == KEEP_ALIVE and self.state != CLOSED and self.keep_alive:
            # while throttled we are the ones not reading: the keep alive counts from the throttle's end
            deadline = max(self.last_rx, self.throttled_until) + self.keep_alive * 1500
            if now >= deadline:
                # [MQTT-3.1.2-22]: nothing for 1.5 x the keep alive
                self._close(f"keep alive {self.keep_alive}s expired", rc=RC.KEEP_ALIVE_TIMEOUT)
            else:
                self.effects.append(StartTimer(KEEP_ALIVE, deadline))
        return self.effects

    def session_answer(self, resp: pb.SessionEventResponse, now: int) -> list:
        """The registry's answer to RequestSession."""
        if self.state != CONNECTING:
            return self.effects  # went away (or taken over) while waiting; the end was reported
        plan = self._plan
        if not resp.success:
            self.request_sent = False  # the registry did not create a session
            self._refuse(_SESSION_FAILURE.get(resp.failure, RC.UNSPECIFIED_ERROR),
                         f"session registry refused: {pb.SessionFailure.Name(resp.failure)}")
            return self.effects
        # the registry decides what the session is (session_registry.logic): a resumed session is persistent
        # for this connection whatever its new interval [MQTT-3.1.2-4, -5, -23]
        self.client_type = resp.client_type
        self.session_expiry = resp.session_expiry_interval if self.v5 else 0
        self.connect_expiry = plan.requested_session_expiry
        self.persistent = resp.persistent
        self.session.client_type = resp.client_type
        self.session.session_expiry_interval = self.session_expiry
        self.session.persistent = self.persistent
        # a resumed session's inbound QoS 2 state: a re-sent PUBLISH with one of these ids is answered PUBREC
        # and not produced again [MQTT-4.3.3-10]
        self.inbound.awaiting_pubrel.update(resp.awaiting_pubrel)
        self._session_present = bool(resp.session_present)
        self.effects.append(SessionStarted(self.client_id, plan.clean_start))
        if resp.session_present:
            self.effects.append(LoadSubscriptions(self.client_id))
        else:
            self._accept()
        return self.effects

    def session_failed(self, reason: str, now: int) -> list:
        """No answer from the registry (timeout, Kafka unavailable): CONNACK Server unavailable."""
        if self.state == CONNECTING:
            self._refuse(RC.SERVER_UNAVAILABLE, reason)
        return self.effects

    def subscriptions_loaded(self, subs: dict | None, now: int) -> list:
        """The stored subscription set of a present session (None: not available, start empty)."""
        if self.state != CONNECTING:
            return self.effects
        if subs:
            self.subs = dict(subs)
        self._accept()
        if self.subs and self._acl:
            self.acl_changed(now)  # the resumed set, against the rules as they are now
        return self.effects

    def produced(self, eff: ProducePublish, error: BaseException | None, now: int) -> list:
        """Kafka answered one record of a QoS 1/2 PUBLISH (`error` None: acknowledged)."""
        eff.pending -= 1
        if error is not None and eff.error is None:
            eff.error = error
        if eff.pending <= 0 and self.acks and self.acks[0] is eff:
            self._flush_acks()
        return self.effects

    def produce_failed(self, eff: ProducePublish, error: BaseException, now: int) -> list:
        """The PUBLISH could not even be handed to the producer."""
        if eff.qos:
            eff.pending = 0
            if eff.error is None:
                eff.error = error
            if self.acks and self.acks[0] is eff:
                self._flush_acks()
        return self.effects

    def subscriptions_written(self, error: BaseException | None, now: int) -> list:
        """Kafka answered the ProduceSubscriptions of the SUBSCRIBE / UNSUBSCRIBE being handled."""
        pending = self._subscribing
        if pending is None or self._written:
            return self.effects
        unsubscribe, packet_id, new_set, codes, retained = pending
        self._written = True
        if error is not None:
            self._subscribing = None
            log.error("client %r: subscriptions not written to Kafka: %r", self.client_id, error)
            if self.state != CLOSED and packet_id is not None:
                codes = [RC.UNSPECIFIED_ERROR] * len(codes)
                ack = UnsubAck(packet_id, codes if self.v5 else []) if unsubscribe else SubAck(packet_id, codes)
                self._send(self._with_reason(ack, "the subscriptions were not stored")
                           if self.v5 and self.problem_info else encode(ack, self.level))
            return self.effects
        old_shared = {k for k in self.subs if k[0]}
        self.subs = new_set
        if self.app_open and {k for k in new_set if k[0]} != old_shared:
            self._restart_app_stream()
        if unsubscribe:
            self._subscribing = None
            for key in old_shared - {k for k in new_set if k[0]}:
                self._detach_group(shared_store_id(*key))  # no longer a member of that group
            if self.state != CLOSED and packet_id is not None:  # None: revoked by an ACL change
                self._send(encode(UnsubAck(packet_id, codes if self.v5 else []), self.level))
        else:
            self._suback_when_ready(now)
        return self.effects

    def acl_changed(self, now: int) -> list:
        """The connection's credential changed or was deleted (fed in packet order, between packets): the
        subscriptions its subscribe patterns no longer cover are removed, as by an UNSUBSCRIBE the client did
        not send (the set is written, no UNSUBACK). PUBLISH / SUBSCRIBE need nothing: they read the rules
        each time."""
        if self.state != CONNECTED or not self._acl or self._subscribing is not None:
            return self.effects
        allowed = self.auth.may_subscribe
        keep = {k: v for k, v in self.subs.items() if allowed(self.identity, self.client_id, k[1])}
        if len(keep) == len(self.subs):
            return self.effects
        self.stats["subscriptions_revoked"] += len(self.subs) - len(keep)
        log.info("client %r: %d subscription(s) no longer authorized, removed: %s", self.client_id,
                 len(self.subs) - len(keep), sorted(k[1] for k in self.subs if k not in keep))
        self._subscribing = (True, None, keep, [], None)
        self._written = False
        self._retained_ok = True
        self.effects.append(ProduceSubscriptions(self.client_id, list(keep.values()), self.client_type))
        return self.effects

    def retained_ready(self, now: int) -> list:
        """The retained view caught up (`WaitRetained`): the SUBACK and its retained messages go out (once the
        subscription set is written too)."""
        if self._subscribing is not None and not self._retained_ok:
            self._retained_ok = True
            self._suback_when_ready(now)
        return self.effects

    @property
    def awaiting_retained(self) -> bool:
        """A SUBSCRIBE waits for the retained view (the runner's `WaitRetained` has something to wait for)."""
        return self._subscribing is not None and not self._retained_ok

    # ------------------------------------------------------------------------------------ deliveries
    def deliver(self, msg: pb.PublishMsg, qos: int, retain: bool, subscription_ids, now: int, *,
                kind: int = LIVE, fixed_id: int | None = None, ref=None, dup: bool = False,
                pubrel_only: bool = False, origin: tuple[int, int, int, int] | None = None) -> list:
        """One message for the client (a live delivery unless `kind` says otherwise).

        `origin` (live deliveries): (origin partition, downlink partition, origin offset, downlink offset)
        of the BasicDownlink that brought it; a copy a router's replay brought again is dropped
        (tbmq_routing.origins.OriginMarks)."""
        if self.state != CONNECTED:
            return self.effects
        if origin is not None and not self.origins.first(*origin):
            self.stats["dropped_replayed"] += 1
            return self.effects
        if pubrel_only:
            self.out.offer(OutMsg(2, kind, None, fixed_id, True, ref), force=True)
            self._pump(now)
            return self.effects
        pkt = outbound_publish(msg, qos, retain, subscription_ids, now, v5=self.v5, dup=dup)
        if pkt is None:  # expired [MQTT-3.3.2-5]
            self.stats["dropped_expired"] += 1
            if kind != LIVE:
                self._delivered(OutMsg(qos, kind, None, fixed_id, False, ref, packet_id=fixed_id or 0))
            return self.effects
        stats = self.stats
        if qos == 0:
            if self.writing_paused:
                stats["dropped_qos0_slow"] += 1
                return self.effects
            if self.out_aliases is not None:
                data = self._encode_aliased(pkt)
            else:
                data = encode(pkt, self.level)
                if self.client_max_packet is not None and len(data) > self.client_max_packet:
                    data = None
            if data is None:
                stats["dropped_too_large"] += 1  # [MQTT-3.1.2-25]
                return self.effects
            self.effects.append(Send(data))
            stats["msgs_out_qos0"] += 1
            return self.effects
        out = OutMsg(qos, kind, pkt, fixed_id, False, ref)
        if msg.HasField("message_expiry_interval"):  # checked again when it leaves the queue (_pump)
            out.expires_at = deadline_ms(msg.created_at_ms, msg.message_expiry_interval, now)
        if not self.out.offer(out, force=kind != LIVE):
            stats["dropped_queue_full"] += 1
            if self.out.dropped in (1, 100, 10000) or self.out.dropped % 100000 == 0:
                log.warning("client %r: outbound queue full (%d), %d messages dropped so far",
                            self.client_id, self.out.max_queued, self.out.dropped)
            return self.effects
        if not self._pump_held:
            self._pump(now)
        return self.effects

    def pubrec_stored(self, packet_id: int, now: int) -> list:
        """device-persistence recorded the client's PUBREC of stored message `packet_id` (`PubrecStored`):
        the PUBREL it waited for goes out, after those of earlier PUBRECs (nothing if the id no longer waits)."""
        if packet_id in self.pubrel_waiting:
            self.pubrel_waiting[packet_id] = True
            self._release_pubrels()
        return self.effects

    def _release_pubrels(self) -> None:
        """Send the PUBRELs that may go, in PUBREC order, up to the first still waiting for its mark."""
        waiting = self.pubrel_waiting
        out = []
        for pid, ready in waiting.items():
            if not ready:
                break
            out.append(pid)
        for pid in out:
            del waiting[pid]
        if out and self.state == CONNECTED:
            level = self.level
            self._send(b"".join(encode(PubRel(pid), level) for pid in out))

    def persisted(self, dm: pb.DevicePublishMsg, now: int) -> list:
        """A forward of this client's own store (persistent DEVICE)."""
        if not self.device or self.state != CONNECTED:
            return self.effects
        if self.fetching:
            self.held_persisted.append(dm)  # delivered after the fetch's answer, in order
            return self.effects
        self._deliver_forwards(self._deliver_device, (dm,), self.paging, now)
        return self.effects

    def group_persisted(self, dm: pb.DevicePublishMsg, now: int) -> list:
        """A forward of a shared group store this connection attached."""
        if self.state != CONNECTED or dm.client_id not in self.groups:
            return self.effects  # still in Redis: the next member's fetch gets it
        if not self.groups.hold(dm.client_id, dm):
            self._deliver_forwards(self._deliver_group, (dm,), self.groups.behind(dm.client_id), now)
        return self.effects

    def fetch_wanted(self, fetch: FetchStored) -> bool:
        """Is the answer of `fetch` still of use (connected, and for a group store: still attached)?"""
        if self.state != CONNECTED:
            return False
        return self.groups.fetching(fetch.store_id) if fetch.group else True

    def stored(self, fetch: FetchStored, messages, now: int) -> list:
        """(Part of) the answer of `fetch`, in store order, one write; a message handed out before
        (`redelivery`) goes as a re-send (DUP=1), one fetched for the first time with DUP=0 [MQTT-3.3.1-1]."""
        if not messages or not self.fetch_wanted(fetch):
            return self.effects
        self._deliver_all(self._deliver_group if fetch.group else self._deliver_device, messages, False, now)
        return self.effects

    def fetch_finished(self, fetch: FetchStored, now: int, more: bool = False) -> list:
        """Every part of `fetch`'s answer was given: what was held meanwhile follows; a re-sync that came
        meanwhile fetches again. `more`: the store holds more after this page (own store: the next page is
        fetched once what is held drained below the low-water mark)."""
        if self.state != CONNECTED:
            return self.effects
        store_id = fetch.store_id
        if fetch.group:
            if not self.groups.fetching(store_id):
                return self.fetch_abandoned(fetch, now)
            if more:
                self.groups.set_more(store_id)
            self._deliver_forwards(self._deliver_group, self.groups.fetched(store_id),
                                   self.groups.behind(store_id), now)
            if self.groups.again(store_id) and self.state == CONNECTED:
                self.effects.append(self._group_page(store_id, resync=True))
            else:
                self._next_group_page(store_id)
            return self.effects
        again = self.refetch
        self.refetch = False
        self.fetching = again  # still holding when another fetch follows
        if more:
            self.paging = True
        held, self.held_persisted = self.held_persisted, []
        self._deliver_forwards(self._deliver_device, held, self.paging, now)
        if again and self.state == CONNECTED:
            self.paging = False  # answered again by this fetch (store_paused during it sets it again)
            self.effects.append(self._page(resync=True))
        else:
            self._next_page()
        return self.effects

    def store_paused(self, store_id: str, now: int) -> list:
        """device-persistence stopped forwarding the new messages of `store_id` (this client's own store or a
        group store it attached: its handed-out, unacknowledged messages reached the store's limit): they
        wait in the store, fetched in pages when there is room."""
        if not self.device or self.state != CONNECTED:
            return self.effects
        if store_id == self.client_id:
            self.paging = True
            self._next_page()
        elif store_id in self.groups:
            self.groups.set_more(store_id)
            self._next_group_page(store_id)
        return self.effects

    def _group_page(self, store_id: str, *, resync: bool) -> FetchStored:
        """The next page of a group store, like `_page`: after the last serial delivered, sized to the room."""
        cfg = self.cfg
        n, b = self.groups.room(store_id)
        return FetchStored(store_id, resync=resync, group=True, after=self.groups.last_serial(store_id),
                           max_messages=max(cfg.page_messages - n, 1), max_bytes=max(cfg.page_bytes - b, 1))

    def _next_group_page(self, store_id: str) -> None:
        """`_next_page` for a group store."""
        if self.state != CONNECTED or not self.cfg.device_persistence:
            return
        cfg = self.cfg
        if self.groups.page_due(store_id, cfg.page_room):
            self.stats["stored_pages"] += 1
            self.effects.append(self._group_page(store_id, resync=True))

    def _page(self, *, resync: bool, first: bool = False) -> FetchStored:
        """The next page of the own store: after the last serial delivered, sized to the room left so that
        what is held stays within one page (messages and bytes). The `first` page of a connection is at most
        `first_page_messages`: the time to its first message grows with the page (device-persistence reads
        and sends the whole page first), and the rest of the room is asked for as soon as it arrives
        (`page_room`), while it is delivered."""
        cfg = self.cfg
        room = max(cfg.page_messages - len(self.stored_sizes), 1)
        return FetchStored(self.client_id, resync=resync, after=max(self.max_serial, 0),
                           max_messages=min(room, cfg.first_page_messages) if first else room,
                           max_bytes=max(cfg.page_bytes - self.stored_bytes, 1))

    def _next_page(self) -> None:
        """Fetch the next page when the store has more and what is held leaves room for it
        (`MachineConfig.page_room`)."""
        if not self.paging or self.fetching or self.state != CONNECTED or not self.cfg.device_persistence:
            return
        if not self.cfg.page_room(len(self.stored_sizes), self.stored_bytes):
            return
        self.paging = False
        self.fetching = True
        self.stats["stored_pages"] += 1
        self.effects.append(self._page(resync=True))

    def fetch_abandoned(self, fetch: FetchStored, now: int) -> list:
        """`fetch`'s answer is of no use (connection gone, or the group store was detached meanwhile): a group
        store is detached again (the Detach made then may have run before this fetch attached; a no-op when
        another session attached since). The messages stay stored."""
        if fetch.group and self.cfg.device_persistence:
            self.effects.append(DetachStore(fetch.store_id))
        return self.effects

    def resync(self, now: int) -> list:
        """A forward stream opened or ended: fetch this session's stores again (own, and every group store it
        attached) and deliver what was not delivered yet."""
        if not self.device or self.state != CONNECTED or not self.cfg.device_persistence:
            return self.effects
        if self.fetching:
            self.refetch = True
        else:
            self.fetching = True
            self.paging = False  # answered again by this fetch (store_paused during it sets it again)
            self.stats["resyncs"] += 1
            self.effects.append(self._page(resync=True))
        for store_id in self.groups.attached():
            if self.groups.refetch(store_id):
                self.stats["resyncs"] += 1
                self.effects.append(self._group_page(store_id, resync=True))
        return self.effects

    def app_records(self, records, now: int) -> list:
        """Records from app-delivery (persistent APPLICATION), in order; one write after the last."""
        self._pump_held = True
        try:
            for rec in records:
                self._on_app_record(rec, now)
        finally:
            self._pump_held = False
        self._pump(now)
        return self.effects

    # ------------------------------------------------------------------------------------ transport
    def transport_paused(self, now: int) -> list:
        """The client is not reading (write buffer above its high-water mark): QoS 0 is dropped, the window
        waits."""
        self.writing_paused = True
        return self.effects

    def transport_resumed(self, now: int) -> list:
        self.writing_paused = False
        if self.state == CONNECTED:
            self._pump(now)
        return self.effects

    def take_over(self, cmd: pb.DisconnectCommand, now: int) -> list:
        """The registry gave the session to a newer connection: close without a DISCONNECTION_REQUEST."""
        self.taken_over = cmd
        rc = _TAKEOVER_REASON.get(cmd.reason, RC.SESSION_TAKEN_OVER)
        if cmd.reason == pb.DISCONNECT_REASON_CONNECTOR_FENCED:
            self._close("connector declared dead by the session registry", rc=rc,
                        reason_string="connector declared dead", log_level=logging.WARNING)
            return self.effects
        self._close(f"session taken over ({rc.name})", rc=rc, reason_string=_TAKEOVER_TEXT[rc])
        return self.effects

    def revoke(self, why: str, now: int, rc: int = RC.ADMINISTRATIVE_ACTION) -> list:
        """An operator took the client's right to be connected away (a blocked rule that matches it, its
        credential deleted; or, with `rc` 0x87 Not authorized, its token expired): v5 DISCONNECT `rc` (0x98
        Administrative action) with `why` as the Reason String; 3.x: the network connection is closed. As
        after any close by the server, the Will is published.

        A CONNECT still waiting for its CONNACK (authentication or the session registry's answer in flight:
        the rule came after its check) is answered first and closed right after: closing it there would leave
        the client with no CONNACK at all, and the registry with a session it just handed over."""
        if self.state == CLOSED:
            return self.effects
        if self.state == CONNECTING:
            self._revoke_at_connack = (why, rc)
            return self.effects
        self.stats["connections_revoked"] += 1
        self._close(f"access revoked: {why}", rc=rc, reason_string=why, log_level=logging.WARNING)
        return self.effects

    def shutdown(self, now: int) -> list:
        """The server is shutting down: v5 DISCONNECT 0x8B."""
        self._close("server shutting down", rc=RC.SERVER_SHUTTING_DOWN)
        return self.effects

    def abort(self, reason: str, now: int) -> list:
        """Drop the connection at once (a client that does not read)."""
        self._close(reason, log_level=logging.WARNING, abort=True)
        return self.effects

    def close(self, reason: str, now: int) -> list:
        """Close from the server side, without a reason code."""
        self._close(reason)
        return self.effects

    def internal_error(self, now: int) -> list:
        self._close("internal error", rc=RC.UNSPECIFIED_ERROR, log_level=logging.ERROR)
        return self.effects

    def connection_lost(self, reason: str, now: int) -> list:
        """The transport ended (the peer closed it, or our Close took effect)."""
        if self.state != CLOSED:
            if not self.close_reason:
                self.close_reason = reason
            self.state_before_close = self.state
            self.state = CLOSED
        self._finish()
        return self.effects

    # ====================================================================================== CONNECT
    def _on_connect(self, c: Connect, now: int) -> None:
        self.effects.append(CancelTimer(CONNECT_TIMEOUT))
        self.level = c.protocol_level
        self.v5 = c.protocol_level == MQTT_5
        cfg = self.cfg
        try:
            plan = plan_connect(c, server_keep_alive_max=cfg.server_keep_alive_max,
                                max_topic_bytes=cfg.max_topic_bytes, max_topic_levels=cfg.max_topic_levels,
                                max_user_properties=cfg.max_user_properties)
        except ConnectRefused as exc:
            self._protocol_error(exc.reason_code, exc.message, connect=True, level=c.protocol_level)
            return
        if c.properties.authentication_method is not None:
            self._protocol_error(RC.BAD_AUTHENTICATION_METHOD, "enhanced authentication is not supported",
                                 connect=True, level=c.protocol_level)
            return
        self.state = CONNECTING
        self._plan = plan
        self.client_id = plan.client_id
        self.username = c.username  # what blocked rules match (tbmq_auth.BlockedRule.matches), at CONNECT and after
        self.session_id = str(uuid.uuid4())
        self.keep_alive = plan.keep_alive
        self.client_max_packet = plan.maximum_packet_size
        self.problem_info = plan.request_problem_information
        if self.v5 and plan.topic_alias_maximum:
            self.out_aliases = OutboundAliases(plan.topic_alias_maximum)
        self.out.window = max(1, min(plan.receive_maximum, cfg.max_inflight))
        self.will = c.will
        self.will_delay = plan.will_delay
        if self.keep_alive:
            self.last_rx = now
            self.effects.append(StartTimer(KEEP_ALIVE, now + self.keep_alive * 1500))
        self.session = pb.SessionInfo(
            client_id=self.client_id, service_id=cfg.service_id, session_id=self.session_id,
            client_type=pb.CLIENT_TYPE_DEVICE, connected=True, clean_start=plan.clean_start,
            session_expiry_interval=plan.requested_session_expiry, mqtt_version=self.level,
            keep_alive=plan.keep_alive, connected_at_ms=now, client_address=self.address,
            username=c.username or "")
        request = self.session
        if c.will is not None:
            # the registry keeps the Will with the connected session and publishes it should this connector
            # die [MQTT-3.1.2-8]; the DISCONNECTION_REQUEST (self.session) does not carry it
            request = pb.SessionInfo()
            request.CopyFrom(self.session)
            request.will.CopyFrom(publish_msg(c.will, c.will.topic, publisher_id=self.client_id,
                                              service_id=cfg.service_id, mqtt_version=self.level, now_ms=now))
            request.will_delay = plan.will_delay
        self._connect_request = request  # sent once authenticated (at once without authentication)
        if self.auth is not None:
            self.effects.append(Authenticate(AuthRequest(
                client_id=self.client_id, username=c.username, password=c.password, ip=self.peer_ip,
                cert_names=self.cert_names, will_topic=c.will.topic if c.will is not None else None)))
            return
        self.request_sent = True
        self.effects.append(RequestSession(request))

    def authenticated(self, result: AuthResult, now: int) -> list:
        """The answer of `Authenticate`: CONNACK refusal (0x86 / 0x87 / 0x8A; 3.x 4 / 5), or on to the
        session registry."""
        if self.state != CONNECTING or self.request_sent:
            return self.effects
        if not result.ok:
            self.stats["connect_refused_auth"] += 1
            self._refuse(result.reason_code, result.reason)
            return self.effects
        self.identity = result.identity
        self._acl = result.identity is not None and result.identity.restricted
        if result.identity is not None and result.identity.expires_at_ms is not None:
            self.effects.append(StartTimer(TOKEN_EXPIRY, result.identity.expires_at_ms))
        self.request_sent = True
        self.effects.append(RequestSession(self._connect_request))
        return self.effects

    def _accept(self) -> None:
        """CONNACK success, then the persistent session's stored messages / stream."""
        plan = self._plan
        self._plan = None
        cfg = self.cfg
        present = self._session_present
        if self.v5:
            kw = dict(_CONNACK_PROPS_BASE, receive_maximum=cfg.receive_maximum,
                      maximum_packet_size=cfg.max_packet_size, topic_alias_maximum=cfg.topic_alias_maximum or None)
            if plan.assigned_client_id:
                kw["assigned_client_identifier"] = self.client_id
            if plan.server_keep_alive is not None:
                kw["server_keep_alive"] = plan.server_keep_alive
            if self.session_expiry != plan.requested_session_expiry:
                kw["session_expiry_interval"] = self.session_expiry
            if plan.request_response_information and cfg.response_information:
                kw["response_information"] = cfg.response_information  # only when asked [MQTT-3.1.2-28]
            self._send(encode(ConnAck(present, RC.SUCCESS, Properties(**kw)), MQTT_5))
        else:
            self._send(encode(ConnAck(present, RC.SUCCESS), self.level))
        self.state = CONNECTED
        self.effects.append(Online(self.client_id))
        if self._revoke_at_connack is not None:  # revoked while the CONNECT was in flight (revoke)
            why, rc = self._revoke_at_connack
            self.revoke(why, 0, rc)
            return
        if self.persistent and self.client_type == pb.CLIENT_TYPE_DEVICE and cfg.device_persistence:
            self.device = True
            self.fetching = True
            self.effects.append(self._page(resync=False, first=True))
            self._attach_groups()
        elif self.persistent and self.client_type == pb.CLIENT_TYPE_APPLICATION:
            self._open_app_stream()

    def _refuse(self, rc: int, reason: str) -> None:
        if self.state == CLOSED:
            return
        if self.v5:
            self._send(self._with_reason(ConnAck(False, rc), reason))
        else:
            self._send(encode(ConnAck(False, rc), self.level))
        self._close(reason + f" [CONNACK {_rc_name(rc)}]", log_level=logging.WARNING)

    # ====================================================================================== PUBLISH in
    def _throttle(self, wait_ms: int, now: int, counter: str) -> None:
        """Over a PUBLISH budget (the client's or the connector's): nothing more is read from the client for
        `wait_ms` (Throttle); a packet already read is never refused."""
        if wait_ms:
            self.stats[counter] += 1
            self.throttled_until = max(self.throttled_until, now + wait_ms)
            self.effects.append(Throttle(now + wait_ms))

    def _on_publish(self, p: Publish, now: int) -> None:
        if self.state != CONNECTED:
            raise MqttProtocolError(RC.PROTOCOL_ERROR, "PUBLISH before CONNACK")
        # every PUBLISH read counts, refused ones too: each cost its processing
        if self.publish_rate is not None:
            self._throttle(self.publish_rate.take(now, len(p.payload)), now, "publish_throttled")
        if self.total_rate is not None:
            self._throttle(self.total_rate.take(now, len(p.payload)), now, "publish_throttled_connector")
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
            self._queue_ack(ProducePublish(None, topic, False, 2, pid))
            return
        if self._acl and not self.auth.may_publish(self.identity, self.client_id, topic):
            self.stats["publish_denied"] += 1
            self._publish_refused(topic, qos, pid, RC.NOT_AUTHORIZED, "not authorized")
            return
        cfg = self.cfg
        why = topic_problem(topic, cfg.max_topic_bytes, cfg.max_topic_levels)
        if why is not None:
            self.stats["publish_refused_topic_limit"] += 1
            self._publish_refused(topic, qos, pid, RC.TOPIC_NAME_INVALID, f"topic {why}")
            return
        if self.v5 and len(p.properties.user_properties) > cfg.max_user_properties:
            self.stats["publish_refused_user_properties"] += 1
            self._publish_refused(topic, qos, pid, RC.QUOTA_EXCEEDED,
                                  f"more than {cfg.max_user_properties} user properties")
            return
        if p.retain and p.payload and not self.retained_room(topic, len(p.payload)):
            self.stats["publish_refused_retained_quota"] += 1
            self._publish_refused(topic, qos, pid, RC.QUOTA_EXCEEDED, "retained messages quota reached")
            return
        if qos and self.v5 and self.inbound.over_quota():
            # more than our Receive Maximum unacknowledged: DISCONNECT 0x93 (MQTT 5 section 3.3.4)
            raise MqttProtocolError(RC.RECEIVE_MAXIMUM_EXCEEDED,
                                    f"more than {self.inbound.receive_maximum} QoS 1/2 PUBLISHes unacknowledged")
        msg = publish_msg(p, topic, publisher_id=self.client_id, service_id=self.cfg.service_id,
                          mqtt_version=self.level, now_ms=now)
        self.stats[_MSGS_IN[qos]] += 1
        eff = ProducePublish(msg, topic, p.retain, qos, pid)
        if qos:
            eff.pending = 2 if p.retain else 1  # tbmq.msg.all, and tbmq.msg.retained
            if qos == 2:
                self.inbound.awaiting_pubrel.add(pid)
            self._queue_ack(eff)
        self.effects.append(eff)

    def _publish_refused(self, topic: str, qos: int, pid: int | None, code: int, why: str) -> None:
        """Not authorized, or over a limit: nothing produced. v5: PUBACK / PUBREC with `code` (QoS 0: dropped).
        3.1.1 has no way to tell the client, and lets the server acknowledge as usual or close [MQTT-3.3.5-2]:
        acknowledged (PUBACK, or PUBREC then PUBCOMP), as Mosquitto does, and logged."""
        log.info("client %r: PUBLISH to %r refused (%s; QoS %d): dropped", self.client_id, topic[:200], why, qos)
        if not qos:
            return
        if qos == 2 and not self.v5:
            self.inbound.awaiting_pubrel.add(pid)
        eff = ProducePublish(None, topic, False, qos, pid, denied=code if self.v5 else 0)
        if self.v5:
            self._refusal_reasons[pid] = why
        self._queue_ack(eff)

    def _queue_ack(self, eff: ProducePublish) -> None:
        self.inbound.pending_acks += 1
        self.acks.append(eff)
        if len(self.acks) == 1 and eff.pending <= 0:
            self._flush_acks()

    def _flush_acks(self) -> None:
        """PUBACK / PUBREC for every PUBLISH at the head whose records Kafka acknowledged, in packet order."""
        acks = self.acks
        out = []
        level = self.level
        while acks:
            e = acks[0]
            if e.pending > 0:
                break
            acks.pop(0)
            self.inbound.pending_acks -= 1
            if self.state == CLOSED:
                continue
            qos = e.qos
            pid = e.packet_id
            if e.error is not None:
                if not self.v5:
                    # 3.x has no failure acknowledgement: the client must not think it was accepted
                    self._close(f"Kafka did not accept a QoS {qos} PUBLISH: {e.error!r}", log_level=logging.ERROR)
                    return
                log.error("client %r: Kafka did not accept a QoS %d PUBLISH: %r", self.client_id, qos, e.error)
                self.inbound.awaiting_pubrel.discard(pid)
                ack = PubAck(pid, RC.UNSPECIFIED_ERROR) if qos == 1 else PubRec(pid, RC.UNSPECIFIED_ERROR)
                out.append(self._with_reason(ack, "the message was not stored") if self.problem_info
                           else encode(ack, MQTT_5))
            elif e.denied:
                ack = PubAck(pid, e.denied) if qos == 1 else PubRec(pid, e.denied)
                why = self._refusal_reasons.pop(pid, "refused")
                out.append(self._with_reason(ack, why) if self.problem_info else encode(ack, MQTT_5))
            elif qos == 1:
                out.append(encode(PubAck(pid), level))
            else:
                out.append(encode(PubRec(pid), level))
        if out:
            self.effects.append(Send(b"".join(out) if len(out) > 1 else out[0]))

    def _on_pubrel(self, p: PubRel) -> None:
        # An unknown id (e.g. the PUBLISH arrived on an earlier connection) is completed all the same.
        self.inbound.awaiting_pubrel.discard(p.packet_id)
        self._send(encode(PubComp(p.packet_id), self.level))

    # ====================================================================================== acks from the client
    def _on_puback(self, p: PubAck, now: int) -> None:
        msg = self.out.on_puback(p.packet_id)
        if msg is not None:
            self._delivered(msg)
            if not self._pump_held:
                self._pump(now)

    def _on_pubrec(self, p: PubRec, now: int) -> None:
        failed = p.reason_code >= RC.UNSPECIFIED_ERROR
        msg = self.out.on_pubrec(p.packet_id, failed)
        if msg is None:
            if p.packet_id in self.pubrel_waiting:
                return  # a repeat while the mark is on its way: the PUBREL follows it
            # not ours (or a repeat): PUBREL all the same so the client can finish [MQTT-4.3.3]
            if not failed:
                self._send(encode(PubRel(p.packet_id, RC.PACKET_IDENTIFIER_NOT_FOUND if self.v5 else RC.SUCCESS),
                                  self.level))
            return
        if failed:
            self._delivered(msg)
            self._pump(now)
            return
        if self.cfg.device_persistence:
            up = upstream_ack(msg, self.client_id)  # own store, or the group store (local id mapped back)
            if up is not None:
                # PUBREL once the mark is stored (pubrec_stored): see the module docstring
                self.pubrel_waiting[p.packet_id] = False
                self.effects.append(PubrecStored(*up, p.packet_id))
                return
        if self.pubrel_waiting:  # behind earlier PUBRECs' PUBRELs
            self.pubrel_waiting[p.packet_id] = True
            self._release_pubrels()
        else:
            self._send(encode(PubRel(p.packet_id), self.level))

    def _on_pubcomp(self, p: PubComp, now: int) -> None:
        if self.pubrel_waiting.pop(p.packet_id, None) is not None:  # completed early: no PUBREL for a reused id
            self._release_pubrels()
        msg = self.out.on_pubcomp(p.packet_id)
        if msg is not None:
            self._delivered(msg)
            self._pump(now)

    def _delivered(self, msg: OutMsg) -> None:
        """The client acknowledged (or the message was discarded for it): tell its source."""
        kind = msg.kind
        if kind == DEVICE or kind == GROUP:
            if self.cfg.device_persistence:
                self.effects.append(AckStored(*upstream_ack(msg, self.client_id)))
            if kind == DEVICE:
                size = self.stored_sizes.pop(msg.ref, None)
                if size is not None:
                    self.stored_bytes -= size
                    self._next_page()
            elif self.groups.release(msg.ref.store_id, msg.ref.serial):
                self._next_group_page(msg.ref.store_id)
        elif kind == APP:
            ref = msg.ref
            self.app_refs.pop((ref.topic, ref.partition, ref.offset), None)
            if self.app_open:
                self.effects.append(AckApp(ref))

    # ====================================================================================== outbound
    def _send(self, data: bytes) -> None:
        self.effects.append(Send(data))

    def _pump(self, now: int) -> None:
        """Move what the window allows into flight and send it, in one write. A message with a Message Expiry
        Interval that waited behind the window goes out with the interval left now [MQTT-3.3.2-6], or not at
        all once it expired [MQTT-3.3.2-5] (counted as delivered for this client, like one too large)."""
        level = self.level
        limit = self.client_max_packet
        aliases = self.out_aliases
        out = self.out
        while not self.writing_paused and self.state == CONNECTED:
            ready = out.ready()
            if not ready:
                return
            chunks = []
            freed = False
            qos2 = pubrels = 0
            for m in ready:
                if m.pubrel_only:
                    chunks.append(encode(PubRel(m.packet_id), level))
                    pubrels += 1
                    continue
                pkt = m.publish
                if m.expires_at:
                    left = interval_at(m.expires_at, now)
                    if left is None:  # expired while queued: onward delivery never started [MQTT-3.3.2-5]
                        self.stats["dropped_expired"] += 1
                        out.inflight.pop(m.packet_id, None)
                        self._delivered(m)
                        freed = True
                        continue
                    if pkt.properties.message_expiry_interval is not None:  # MQTT 5 [MQTT-3.3.2-6]
                        pkt.properties.message_expiry_interval = left
                pkt.packet_id = m.packet_id
                if aliases is not None:
                    data = self._encode_aliased(pkt)
                else:
                    data = encode(pkt, level)
                    if limit is not None and len(data) > limit:
                        data = None
                if data is None:
                    # [MQTT-3.1.2-25]: not sent; treated as delivered for this client
                    self.stats["dropped_too_large"] += 1
                    out.inflight.pop(m.packet_id, None)
                    self._delivered(m)
                    freed = True
                    continue
                qos2 += pkt.qos == 2
                chunks.append(data)
            if chunks:
                self.stats["msgs_out_qos1"] += len(chunks) - qos2 - pubrels
                self.stats["msgs_out_qos2"] += qos2
                self.effects.append(Send(b"".join(chunks) if len(chunks) > 1 else chunks[0]))
            if not freed:
                return

    def _encode_aliased(self, pkt: Publish) -> bytes | None:
        """A PUBLISH to a client that accepts topic aliases: its topic's alias (LRU), the topic name sent only
        when the alias is new; None when too large for the client (its alias assignment is then undone)."""
        topic = pkt.topic
        alias, known = self.out_aliases.assign(topic)
        props = pkt.properties
        props = Properties(topic_alias=alias) if props is EMPTY_PROPERTIES else dataclasses.replace(props, topic_alias=alias)
        data = encode(Publish(topic="" if known else topic, payload=pkt.payload, qos=pkt.qos, retain=pkt.retain,
                              dup=pkt.dup, packet_id=pkt.packet_id, properties=props), MQTT_5)
        if self.client_max_packet is not None and len(data) > self.client_max_packet:
            if not known:
                self.out_aliases.forget(topic)
            return None
        return data

    def _with_reason(self, packet, reason: str) -> bytes:
        """`packet` (v5) encoded with `reason` as its Reason String, unless that makes it larger than the
        client's Maximum Packet Size (then without) [MQTT-3.1.2-24]."""
        data = encode(dataclasses.replace(packet, properties=Properties(reason_string=reason)), MQTT_5)
        if self.client_max_packet is not None and len(data) > self.client_max_packet:
            return encode(packet, MQTT_5)
        return data

    # ------------------------------------------------------------------------------------ persistent DEVICE
    def _deliver_forwards(self, deliver_one, forwards, behind: bool, now: int) -> None:
        """Forwards of a store (saved while this connection was live on it), unless the store holds more
        before them (`behind`: more than the last page, or it stopped forwarding, store_paused). Delivered
        then, they would raise the highest serial delivered past that backlog, and the next page (after
        that serial) would skip it until the client's next connect. They stay stored and come in a later
        page, in order (a DUP=1 re-send)."""
        if behind:
            self.stats["forwards_behind_backlog"] += len(forwards)
        else:
            self._deliver_all(deliver_one, forwards, False, now)

    def _deliver_all(self, deliver_one, messages, dup: bool, now: int) -> None:
        """`deliver_one` for each of `messages`, then one write of what fits the window."""
        if not messages:
            return
        self._pump_held = True
        try:
            for dm in messages:
                deliver_one(dm, dup, now)
        finally:
            self._pump_held = False
        self._pump(now)

    def _deliver_device(self, dm: pb.DevicePublishMsg, dup: bool, now: int) -> None:
        if dm.serial <= self.max_serial:
            return  # delivered already (a forward that was also in a fetch's answer)
        self.max_serial = dm.serial
        m = dm.msg
        pubrel = dm.packet_type == pb.DEVICE_PACKET_TYPE_PUBREL
        if pubrel or m.qos:  # held until acknowledged (_delivered): what is held bounds the next page
            size = 0 if pubrel else len(m.payload)
            self.stored_sizes[dm.serial] = size
            self.stored_bytes += size
        self.deliver(m, m.qos, m.retain, m.subscription_ids if self.v5 else (), now, kind=DEVICE,
                     fixed_id=dm.packet_id, ref=dm.serial, dup=dup or dm.redelivery, pubrel_only=pubrel)

    # Shared DEVICE groups: while no member of a shared DEVICE group is connected, the router persists the
    # group's copies under the group store id ss_<share>_<filter> (tbmq_routing.shared_store_id). A persistent
    # DEVICE member fetches (and so attaches) that store when it has the shared subscription; forwards of it
    # come to `group_persisted`. Its messages go out with ids of the live allocator (kind GROUP, ref =
    # GroupRef): the store's packet ids are another id space.
    def _attach_groups(self) -> None:
        """Attach (and fetch) the group store of every shared subscription not attached yet. Only for a
        persistent DEVICE session: a non-persistent one could not keep the messages."""
        if not self.device or self.state != CONNECTED or not self.cfg.device_persistence:
            return
        for share_name, topic_filter in list(self.subs):
            if not share_name:
                continue
            store_id = shared_store_id(share_name, topic_filter)
            if self.groups.begin(store_id, (share_name, topic_filter)):
                self.stats["group_fetches"] += 1
                self.effects.append(self._group_page(store_id, resync=False))

    def _detach_group(self, store_id: str) -> None:
        if self.groups.detach(store_id) and self.cfg.device_persistence:
            self.effects.append(DetachStore(store_id))

    def _deliver_group(self, dm: pb.DevicePublishMsg, dup: bool, now: int) -> None:
        store_id = dm.client_id
        key = self.groups.key(store_id)
        sub = self.subs.get(key) if key is not None else None
        if sub is None or self.state != CONNECTED:
            return  # no longer subscribed: stays in the store
        if not self.groups.accept(store_id, dm.serial):
            return  # already delivered (a forward of a message that was also in the fetch answer)
        self.stats["group_delivered"] += 1
        if dm.packet_type == pb.DEVICE_PACKET_TYPE_PUBREL:
            # a member's PUBREC was received on an earlier connection: the group got the message (QoS 2,
            # exactly once); another member has no use for a PUBREL of an id it never saw. Done.
            self.effects.append(AckStored(store_id, dm.packet_id, dm.serial))
            return
        m = dm.msg
        qos = min(m.qos, sub.qos)
        retain = m.retain and sub.retain_as_published
        ids = (sub.subscription_id,) if sub.subscription_id else ()
        if qos == 0:
            # the group's copy is QoS > 0 but this member was granted QoS 0: sent once, done for the store
            self.deliver(m, 0, retain, ids, now)
            self.effects.append(AckStored(store_id, dm.packet_id, dm.serial))
            return
        self.groups.holding(store_id, dm.serial, len(m.payload))  # until acknowledged: bounds the next page
        self.deliver(m, qos, retain, ids, now, kind=GROUP, ref=GroupRef(store_id, dm.packet_id, dm.serial),
                     dup=dup or dm.redelivery)

    # ------------------------------------------------------------------------------------ APPLICATION
    def _open_app_stream(self) -> None:
        # qos: the member's granted QoS; app-delivery caps the group's copy at it [MQTT-3.8.4-8]
        shared = [spb.AppSharedSubscription(share_name=t.share_name, topic_filter=t.topic_filter, qos=t.qos)
                  for t in self.subs.values() if t.share_name]
        opening = spb.AppOpen(client_id=self.client_id, session_id=self.session_id,
                              receive_maximum=self.out.window, shared=shared)
        self.app_open = True
        self.effects.append(OpenAppStream(opening))

    def _restart_app_stream(self) -> None:
        if self.app_open:
            self.effects.append(CloseAppStream())
        self._open_app_stream()

    def _on_app_record(self, rec: spb.AppRecord, now: int) -> None:
        if self.state != CONNECTED:
            return
        key = (rec.ref.topic, rec.ref.partition, rec.ref.offset)
        if key in self.app_refs:
            return  # still in flight with the client from before the stream reopened
        m = rec.msg
        if m.qos == 0:
            self.deliver(m, 0, m.retain, m.subscription_ids, now)
            if self.app_open:
                self.effects.append(AckApp(rec.ref))
            return
        self.app_refs[key] = 1
        self.deliver(m, m.qos, m.retain, m.subscription_ids, now, kind=APP, ref=rec.ref, dup=rec.redelivery)

    # ====================================================================================== SUBSCRIBE
    def _on_subscribe(self, p: Subscribe, now: int) -> None:
        if self.state != CONNECTED:
            raise MqttProtocolError(RC.PROTOCOL_ERROR, "SUBSCRIBE before CONNACK")
        v5 = self.v5
        sub_id = 0
        if v5 and p.properties.subscription_identifiers:
            sub_id = p.properties.subscription_identifiers[0]
        fail = RC.TOPIC_FILTER_INVALID if v5 else RC.UNSPECIFIED_ERROR
        codes: list[int] = []
        new_set = dict(self.subs)
        retained: list[tuple[str, int, int]] = []
        for s in p.subscriptions:
            try:
                pf = parse_subscription_filter(s.filter, no_local=s.no_local and v5, allow_shared=True)
            except InvalidSharedSubscription as exc:
                if exc.protocol_error:
                    raise MqttProtocolError(RC.PROTOCOL_ERROR, str(exc)) from None
                codes.append(fail)
                continue
            except InvalidTopicFilter:
                codes.append(fail)
                continue
            if self._acl and not self.auth.may_subscribe(self.identity, self.client_id, pf.filter):
                self.stats["subscribe_denied"] += 1
                log.info("client %r: SUBSCRIBE to %r not authorized", self.client_id, s.filter)
                codes.append(RC.NOT_AUTHORIZED if v5 else RC.UNSPECIFIED_ERROR)
                continue
            why = topic_problem(pf.filter, self.cfg.max_topic_bytes, self.cfg.max_topic_levels)
            if why is not None:
                self.stats["subscribe_refused_topic_limit"] += 1
                log.info("client %r: SUBSCRIBE to a filter %s refused", self.client_id, why)
                codes.append(fail)
                continue
            qos = min(s.qos, 2)
            key = (pf.share_name, pf.filter)
            existed = key in new_set
            if not existed and len(new_set) >= self.cfg.max_subscriptions:
                self.stats["subscribe_refused_quota"] += 1
                log.info("client %r: more than %d subscriptions: %r refused", self.client_id,
                         self.cfg.max_subscriptions, s.filter[:200])
                codes.append(RC.QUOTA_EXCEEDED if v5 else RC.UNSPECIFIED_ERROR)
                continue
            rh = s.retain_handling if v5 else 0
            new_set[key] = topic_subscription(
                pf.share_name, pf.filter, qos, no_local=s.no_local if v5 else False,
                retain_as_published=s.retain_as_published if v5 else False, retain_handling=rh,
                subscription_id=sub_id)
            codes.append(qos)
            if not pf.share_name and (rh == 0 or (rh == 1 and not existed)):
                retained.append((pf.filter, qos, sub_id))
        # SUBACK once the set is in Kafka (routers apply it from there) and, when retained messages are due, the
        # retained view holds every retained PUBLISH acknowledged before this SUBSCRIBE (the catch-up is asked
        # now, while the set is written) [MQTT-3.3.1-9]
        self._subscribing = (False, p.packet_id, new_set, codes, retained)
        self._written = new_set == self.subs
        self._retained_ok = not retained
        if retained:
            self.effects.append(CatchUpRetained())
        if not self._written:
            self.effects.append(ProduceSubscriptions(self.client_id, list(new_set.values()), self.client_type))
        if retained:
            self.effects.append(WaitRetained())
        self._suback_when_ready(now)

    def _suback_when_ready(self, now: int) -> None:
        if self._subscribing is None or not self._written or not self._retained_ok:
            return
        _unsubscribe, packet_id, _new_set, codes, retained = self._subscribing
        self._subscribing = None
        if self.state != CLOSED:
            self._subscribed(packet_id, codes, retained, now)

    def _subscribed(self, packet_id: int, codes: list[int], retained, now: int) -> None:
        self._send(encode(SubAck(packet_id, codes), self.level))
        self._attach_groups()  # a new shared subscription of a persistent DEVICE member: its group's store
        # retained messages [MQTT-3.3.1-9] (retain=1), per Retain Handling; not for shared subscriptions
        for topic_filter, qos, sid in retained:
            ids = (sid,) if sid else ()
            for m in self.retained(topic_filter):
                self.deliver(m, min(m.qos, qos), True, ids, now)

    def _on_unsubscribe(self, p: Unsubscribe, now: int) -> None:
        if self.state != CONNECTED:
            raise MqttProtocolError(RC.PROTOCOL_ERROR, "UNSUBSCRIBE before CONNACK")
        codes = []
        new_set = dict(self.subs)
        for f in p.filters:
            try:
                pf = parse_subscription_filter(f, allow_shared=True)
            except InvalidTopicFilter:
                codes.append(RC.TOPIC_FILTER_INVALID)
                continue
            if new_set.pop((pf.share_name, pf.filter), None) is None:
                codes.append(RC.NO_SUBSCRIPTION_EXISTED)
            else:
                codes.append(RC.SUCCESS)
        if new_set != self.subs:
            self._subscribing = (True, p.packet_id, new_set, codes, None)
            self._written = False
            self._retained_ok = True
            self.effects.append(ProduceSubscriptions(self.client_id, list(new_set.values()), self.client_type))
            return
        self._send(encode(UnsubAck(p.packet_id, codes if self.v5 else []), self.level))

    # ====================================================================================== DISCONNECT
    def _on_disconnect(self, p: Disconnect) -> None:
        if self.v5:
            new_expiry = p.properties.session_expiry_interval
            if new_expiry is not None:
                if self.connect_expiry == 0 and new_expiry > 0:
                    # from 0 in CONNECT to non-zero is a Protocol Error (section 3.14.2.2.2; no statement id)
                    self._protocol_error(RC.PROTOCOL_ERROR, "DISCONNECT sets a Session Expiry Interval after 0")
                    return
                # the registry caps it (its one setting); uncapped here it only bounds the Will Delay, and a
                # session the registry ends sooner sends its Will then (wills.on_session_record)
                self.disconnect_expiry = new_expiry
                self.session_expiry = new_expiry
        # 0x00: normal, no Will [MQTT-3.1.2-10]; 0x04 (Disconnect with Will Message) and error codes: the Will
        # goes out
        self.graceful = not self.v5 or p.reason_code == RC.NORMAL_DISCONNECTION
        self._close(f"DISCONNECT {_rc_name(p.reason_code)}" if self.v5 else "DISCONNECT", log_level=logging.DEBUG)

    # ====================================================================================== closing
    def _protocol_error(self, rc: int, message: str, *, connect: bool = False, level: int | None = None) -> None:
        if self.state == CLOSED:
            return
        if connect or self.state == NEW:
            # a bad CONNECT: v5 CONNACK with the reason code; 3.x only for version and client id problems
            # (tbmq_mqtt.server_error_response [MQTT-3.2.2-8])
            err = MqttProtocolError(rc, message, packet_type=PacketType.CONNECT,
                                    protocol_level=level if level is not None else MQTT_3_1_1)
            data = server_error_response(err)
            if data is not None:
                self._send(data)
            self._close(f"bad CONNECT: {message} [{_rc_name(rc)}]", log_level=logging.WARNING)
            return
        self._close(f"protocol error: {message} [{_rc_name(rc)}]", rc=rc, log_level=logging.WARNING,
                    reason_string=message)

    def _close(self, reason: str, *, rc: int | None = None, log_level: int = logging.INFO,
               abort: bool = False, reason_string: str | None = None) -> None:
        """Close this connection (once): a v5 DISCONNECT first when connected and `rc` is given, with
        `reason_string` (default: `reason`) as its Reason String."""
        if self.state == CLOSED:
            return
        self.state_before_close = self.state
        self.state = CLOSED
        self.close_reason = reason
        if rc is not None and self.v5 and self.state_before_close == CONNECTED and not abort:
            if rc not in _DISCONNECT_CODES:
                rc = RC.UNSPECIFIED_ERROR
            self._send(self._with_reason(Disconnect(rc), reason_string or reason))
        self.effects.append(Close(reason, log_level, abort))
        self._finish()

    def _confirmed_awaiting_pubrel(self) -> tuple[int, ...]:
        """The inbound QoS 2 ids to report when the connection ends: awaiting PUBREL and their PUBLISH
        acknowledged by Kafka. An id whose produce is pending or failed is left out: the client re-sends it and
        it is produced again (at worst a duplicate, never a loss)."""
        unsure = {e.packet_id for e in self.acks if e.qos == 2 and (e.pending > 0 or e.error is not None)}
        return tuple(sorted(pid for pid in self.inbound.awaiting_pubrel if pid not in unsure))

    def _finish(self) -> None:
        """Everything that follows the end of the connection, exactly once."""
        if self._finished:
            return
        self._finished = True
        effects = self.effects
        if self.app_open:
            self.app_open = False
            effects.append(CloseAppStream())
        if self.device and self.cfg.device_persistence:
            effects.append(DetachStore(self.client_id))
        for store_id in self.groups.attached():
            self._detach_group(store_id)
        prior = self.state_before_close
        if self.request_sent:
            # the Will: not after DISCONNECT 0x00 [MQTT-3.1.2-10]; v5 0x04 and every other end send it
            # none when this run was fenced: the registry ended the session and owns its Will
            fenced = self.taken_over is not None and self.taken_over.reason == pb.DISCONNECT_REASON_CONNECTOR_FENCED
            if self.will is not None and not self.graceful and prior == CONNECTED and not fenced:
                delay = will_delay_seconds(self.level, self.will_delay, self.session_expiry)
                if self.taken_over is not None:
                    if delay and not self.taken_over.new_session_clean_start:
                        delay = -1  # the session continues on the new connection before the delay passed
                    else:
                        delay = 0
                if delay >= 0:
                    effects.append(ScheduleWill(self.client_id, self.session_id, self.will, self.level, delay))
            # taken over (or fenced): the registry already moved the session on, nothing to report; an
            # administrator's disconnect (admin service) is reported like any close by the server (the registry
            # answers "stale" when it had ended the session itself: a forced CLEAR_SESSION_REQUEST)
            moved_on = self.taken_over is not None and self.taken_over.reason != pb.DISCONNECT_REASON_ADMINISTRATIVE
            if not moved_on and prior in (CONNECTED, CONNECTING):
                effects.append(ReportDisconnect(self.session, self.graceful, self.disconnect_expiry,
                                                self._confirmed_awaiting_pubrel()))
        effects.append(Finished())


def _rc_name(rc: int) -> str:
    try:
        return ReasonCode(rc).name
    except ValueError:
        return f"reason code {rc}"


__all__ = ["CLOSED", "CONNECTED", "CONNECTING", "CONNECT_TIMEOUT", "ConnectionMachine", "KEEP_ALIVE",
           "MachineConfig", "NEW", "TOKEN_EXPIRY"]
