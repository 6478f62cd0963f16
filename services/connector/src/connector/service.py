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
Liveness (docs/connector.md, "Heartbeat"): each run of the connector has an incarnation id and sends a
ConnectorHeartbeat (tbmq.connector.heartbeat, key = service id) every CONNECTOR_HEARTBEAT_INTERVAL_MS, the
first before the MQTT listener opens; a graceful stop sends one with `stopped` after its connections were
closed and their DISCONNECTION_REQUESTs and Wills acknowledged by Kafka, so the registry ends what is left at
once. A run that goes silent is declared dead by the session registry, which ends its sessions and publishes
its clients' Wills; a run declared dead that is still alive learns it from the registry (a CONNECT answered
CONNECTOR_FENCED, or a DisconnectCommand CONNECTOR_FENCED) and stops itself (exit code 1, to be restarted as a
new run), closing its connections without Wills and without DISCONNECTION_REQUESTs: the registry ended those
sessions and owns their Wills.
Retained at SUBSCRIBE: `retained_caught_up` (the retained view's barrier) before the retained messages are
sent, so a retained PUBLISH acknowledged (on any connector) before the SUBSCRIBE arrived is among them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry import trace
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.backoff import Backoff
from tbmq_platform.coalesce import AdaptiveFetch, AdaptiveLinger, adaptive_fetch
from tbmq_platform.compacted import Barrier, CompactedViews
from tbmq_platform.kafka import (IDLE_FETCH_WAIT_MS, DirectSend, ensure_topics, make_consumer, make_producer,
                                 topic_partitions)
from tbmq_platform.lifecycle import Service
from tbmq_platform.marks import MarkWriter
from tbmq_auth import HTTP, AuthRequest, AuthResult, AuthTables, Authorizer, HttpAnswer, HttpCheck
from tbmq_auth.failures import BAN_LIFTED, BANNED, BANNED_SHARED, LoginLedger, ban_record, failure_record
from tbmq_auth.http import ERROR, AnswerCache
from tbmq_auth.passwords import VerifiedPasswords, verify_password
from tbmq_platform.topics import (
    CLIENT_SESSION,
    CLIENT_SUBSCRIPTIONS,
    CONNECTOR_HEARTBEAT,
    MSG_ALL,
    MSG_RETAINED,
    SECURITY_BLOCKED,
    SECURITY_CREDENTIALS,
    SECURITY_LOGIN_BANS,
    SECURITY_TOKENS_REVOKED,
    disconnect_topic,
    downlink_basic_topic,
    response_topic,
    service_topics,
    static_topics,
)
from tbmq_platform.tracing import kafka_headers, span_from_kafka, spans_on
from tbmq_connection import ConnectionMachine, MachineConfig
from tbmq_connection import systopics
from tbmq_connection.limits import Admission, PublishRate
from tbmq_connection.convert import publish_msg
from tbmq_mqtt import ReasonCode
from tbmq_routing import RetainedStore, subscribed_to
from tbmq_routing.wills import publish_records

from .connection import Connection
from .grpc_clients import AppDeliveryChannels, AppStream, DevicePersistenceClient
from .http_auth import HttpAuthClient
from .jwks import KeySetSource
from .sessions import SessionEvents
from .settings import ConnectorSettings, Listener
from .proxy import ProxyHeaderError, read_header, trusted
from .tls import ListenerTls, ca_names, file_stamps, revoked_certificates
from .websocket import WebSocketAdapter
from .wills import Wills

log = logging.getLogger("connector")
try:
    VERSION = importlib.metadata.version("connector")
except importlib.metadata.PackageNotFoundError:  # not installed (run from a source tree)
    VERSION = "dev"
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


def _peer_of(sock: socket.socket) -> tuple[str, str]:
    """(host, "host:port") of an accepted socket's peer; ("", "?") once it is gone."""
    try:
        host, port = sock.getpeername()[:2]
        return host, f"{host}:{port}"
    except OSError:
        return "", "?"


class ConnectorService(Service):
    name = "connector"

    def __init__(self, settings: ConnectorSettings) -> None:
        super().__init__(settings)
        self.settings: ConnectorSettings = settings
        self.service_id = settings.instance_id
        self.incarnation = uuid.uuid4().hex         # this run of the connector (fencing, heartbeats)
        self.fenced = False                         # the registry declared this run dead: stopping
        self.retained = RetainedStore()
        self._subs_raw: dict[str, bytes] = {}
        self._subs_n: dict[str, int] = {}  # subscriptions per client, and their total ($SYS)
        self.subscription_count = 0
        self.heartbeats: dict[str, pb.ConnectorHeartbeat] = {}  # every connector run's latest ($SYS)
        self.started_at_ms = int(time.time() * 1000)
        self.wills = Wills(self._publish_will)
        # credentials and blocked clients (tbmq.security.*), followed as tables: a change applies to the
        # next CONNECT, PUBLISH and SUBSCRIBE (docs/security.md)
        self.auth_tables = AuthTables()
        # passwords verified recently, so a reconnect storm is not verified again (MQTT_PASSWORD_CACHE_S)
        self.passwords = VerifiedPasswords(settings.password_cache_s, settings.password_cache_max)
        self._passwords_lock = threading.Lock()  # _verify_password runs on the password-check threads too
        self.authorizer = Authorizer(self.auth_tables, providers=settings.auth_providers,
                                     allow_anonymous=settings.allow_anonymous, tokens=settings.token_verifier(),
                                     verify=self._verify_password)
        self.http_answers = AnswerCache(settings.http_auth_cache_s, settings.http_auth_cache_max)
        self.http_auth = HttpAuthClient(settings.http_auth_url, settings.http_auth_timeout_s,
                                        settings.http_auth_authorization, settings.http_auth_ca_file) \
            if HTTP in settings.auth_providers else None
        # Kafka clients need the running loop: made in start()
        self.producer = None
        self.direct: DirectSend | None = None
        self.marks: MarkWriter | None = None
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
        self.admission = Admission(settings.max_connections, settings.connect_rate_per_ip,
                                   settings.connect_burst_per_ip)
        self._password_pool: concurrent.futures.ThreadPoolExecutor | None = None  # _decide
        self._password_checks = 0  # CONNECTs verifying a password or waiting for a thread
        # this connector's failed logins and every connector's (tbmq.security.login.bans): _apply_login_record
        self.logins = LoginLedger(settings.login_failures_per_ip, settings.login_failures_window_s,
                                  settings.login_ban_s, self.service_id)
        self.adaptive_fetch: AdaptiveFetch | None = None
        self.linger: AdaptiveLinger | None = None
        self.urgent = contextlib.nullcontext  # start(): the linger's urgent() when it has one
        self._servers: list[asyncio.base_events.Server] = []
        self._proxy_listeners: list[socket.socket] = []  # MQTT_PROXY_PROTOCOL listeners (_listen_proxied)
        self._proxy_pending = 0  # their accepted sockets not yet handed to a Connection (header, TLS handshake)
        self.bound: dict[str, int] = {}  # listener name (mqtt, mqtts, ws, wss) -> bound port
        self._bg: set[asyncio.Task] = set()
        self.mqtt_port = settings.mqtt_port
        # Per-message spans (mqtt.publish, mqtt.deliver*) cost more than the rest of the hot path: they are
        # created only when exported (OTLP endpoint set) or asked for. Without them every produced record
        # still carries a traceparent (a fresh one per PUBLISH: `tbmq_platform.tracing.fresh_trace_headers`).
        self.spans = spans_on(settings)
        self.machine_config = MachineConfig(
            service_id=self.service_id, receive_maximum=settings.receive_maximum,
            topic_alias_maximum=settings.topic_alias_maximum, max_packet_size=settings.max_packet_size,
            max_inflight=settings.max_inflight, max_queued=settings.max_queued,
            server_keep_alive_max=settings.server_keep_alive_max,
            connect_timeout_ms=int(settings.connect_timeout_s * 1000),
            page_messages=settings.stored_page_messages, page_bytes=settings.stored_page_bytes,
            first_page_messages=settings.stored_first_page_messages,
            response_information=settings.response_information,
            max_topic_bytes=settings.max_topic_bytes, max_topic_levels=settings.max_topic_levels,
            max_subscriptions=settings.max_subscriptions, max_user_properties=settings.max_user_properties,
            max_queued_bytes=settings.max_queued_bytes, max_publish_rate=settings.max_publish_rate,
            max_publish_bytes_rate=settings.max_publish_bytes_rate)
        # every connection's PUBLISHes spend it too (MQTT_MAX_TOTAL_PUBLISH_RATE / _BYTES_RATE; the machine
        # ignores it when both are unlimited)
        self.total_rate = PublishRate(settings.max_total_publish_rate, settings.max_total_publish_bytes_rate)
        self.retained_bytes = 0  # payload + topic bytes of the retained messages held (MQTT_MAX_RETAINED_BYTES)
        self._topics = {
            "response": response_topic(self.service_id),
            "disconnect": disconnect_topic(self.service_id),
            "basic": downlink_basic_topic(self.service_id),
        }

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.settings
        bootstrap = s.bootstrap
        await ensure_topics(bootstrap, static_topics(), layout=s.topic_layout)
        self.producer = make_producer(bootstrap, client_id=self.service_id,
                                      max_request_size=max(1 << 20, s.max_packet_size + 65536))
        await self.producer.start()
        self.direct = DirectSend(self.producer)  # a PUBLISH's records (produce_publish)
        if s.producer_linger_ms > 0:
            self.linger = AdaptiveLinger(self.producer, busy_ms=s.producer_linger_ms)  # quiet: its 1 ms
        # the records a CONNACK or SUBACK waits for do not wait out the PUBLISHes' busy window
        self.urgent = self.linger.urgent if self.linger is not None else contextlib.nullcontext
        self.marks = MarkWriter(self.producer, self.service_id, urgent=self.urgent)
        # this run is known (alive) before its .<svc> topics are made again: the registry deletes the topics of
        # a service whose latest run is dead, never those of a service that came back; and before any CONNECT
        await self._heartbeat()
        # from now on: rebuilding the views below may take longer than the registry's timeout
        self.spawn(self._heartbeat_loop(), "heartbeat")
        await ensure_topics(bootstrap, service_topics(self.service_id), layout=s.topic_layout)
        self.sessions = SessionEvents(self.producer, self.incarnation, self.urgent)
        # the three compacted views on one consumer (tbmq_platform.compacted)
        self.views = CompactedViews(bootstrap, client_id=f"{self.service_id}-views")
        self.retained_view = self.views.view(MSG_RETAINED, self._apply_retained)
        self.views.view(CONNECTOR_HEARTBEAT, self._apply_heartbeat)  # every run's counters: $SYS
        self.subs_view = self.views.view(CLIENT_SUBSCRIPTIONS, self._apply_subscriptions)
        self.session_view = self.views.view(CLIENT_SESSION, self.wills.on_session_record)
        self.views.view(SECURITY_CREDENTIALS, self._apply_credential)
        self.views.view(SECURITY_BLOCKED, self._apply_blocked)
        self.views.view(SECURITY_TOKENS_REVOKED, self._apply_revoked_token)
        # every connector's, its own too; older than a failure's window and a ban's length (and a minute for
        # the hosts' clocks) no longer matter, so a flood of failed logins is not read again at each start
        horizon_s = max(s.login_failures_window_s, s.login_ban_s) + 60
        self.views.view(SECURITY_LOGIN_BANS, self._apply_login_record, since_ms=int((time.time() - horizon_s) * 1000))
        # Responses and disconnect commands are written in the registry's transactions: never act on an
        # aborted one. Woken by data: an idle fetch long-polls (tbmq_platform.kafka.IDLE_FETCH_WAIT_MS).
        self.control = make_consumer(bootstrap, group_id=None, client_id=f"{self.service_id}-control",
                                     read_committed=True, long_poll=True)
        self.data = make_consumer(bootstrap, group_id=None, client_id=f"{self.service_id}-downlink",
                                  max_poll_records=5000, long_poll=True)
        await self.control.start()
        await assign_at_end(self.control, [self._topics["response"], self._topics["disconnect"]])
        await self.data.start()
        await assign_at_end(self.data, [self._topics["basic"]])
        await self.views.start()
        self.logins.live = True  # what is read now was written since this run started
        self.retained_barrier = self.views.barrier([MSG_RETAINED])
        self.device = DevicePersistenceClient(s.device_persistence_grpc_targets, s.grpc_timeout_s,
                                              ack_delay_s=s.ack_delay_ms / 1000,
                                              pubrec_delay_s=s.pubrec_delay_ms / 1000, ack_batch_max=s.ack_batch_max,
                                              ack_max_calls=s.ack_max_calls, tls=s.grpc_tls)
        self.device.start_forwarding(self.service_id, on_batch=self._on_forwards,
                                     on_open=self._on_forward_link, on_close=self._on_forward_link)
        self.apps = AppDeliveryChannels(s.app_delivery_grpc_targets, s.grpc_tls)
        self.spawn(self._control_loop(), "control consumer")
        self.spawn(self._data_loop(), "downlink consumer")
        ssl_ctx = s.server_ssl_context() if any(li.tls for li in s.listeners()) else None
        for li in s.listeners():
            await self._listen(li, ssl_ctx)
        if ssl_ctx is not None and s.tls_reload_interval_s > 0:
            self.spawn(self._tls_reload_loop(ListenerTls(ssl_ctx), file_stamps(s.tls_files())), "TLS reload")
        if self.authorizer.tokens is not None and s.jwt_jwks:
            self.spawn(self._jwks_loop(KeySetSource(s.jwt_jwks, s.jwt_jwks_ca_file)), "JWKS refresh")
        self.mqtt_port = self.bound.get("mqtt", 0)
        self._register_metrics()
        if s.sys_interval_s > 0:
            self.spawn(self._sys_loop(), "$SYS")
        log.info("connector %s: listening on %s (%d retained, %d subscription sets, %d credentials, "
                 "authentication %s, anonymous %s)", self.service_id,
                 ", ".join(f"{li.name} {li.host}:{self.bound[li.name]}" for li in s.listeners()),
                 len(self.retained), len(self._subs_raw), len(self.auth_tables.credentials),
                 ",".join(s.auth_providers), "allowed" if self.authorizer.allow_anonymous else "refused")

    async def _tls_reload_loop(self, tls: ListenerTls, seen: tuple) -> None:
        """Every MQTT_TLS_RELOAD_INTERVAL_S: when a TLS file changed (a renewed certificate, a CA added or
        removed, a new CRL), the whole set is loaded into a new context (a half-written or mismatched pair is
        refused there and tried again at the next check), which then serves every new TLS / WSS handshake in
        place of the old one; open connections keep what they negotiated, except those whose client
        certificate the new revocation lists name or a CA gone from the CA file issued: they are closed
        (`_close_revoked`)."""
        s = self.settings
        trusted = self._trusted_issuers()
        while True:
            await asyncio.sleep(s.tls_reload_interval_s)
            now = file_stamps(s.tls_files())
            if now == seen:
                continue
            try:
                fresh = s.server_ssl_context()
                revoked = revoked_certificates(Path(s.tls_crl_file).read_bytes()) if s.tls_crl_file else set()
                issuers = self._trusted_issuers()
            except (OSError, ValueError) as exc:
                self.stats["tls_reload_failures"] += 1
                log.warning("the TLS files changed but do not load (%s): the listeners keep the current "
                            "certificate, CAs and CRLs; checked again in %gs", exc, s.tls_reload_interval_s)
                continue
            tls.current = fresh
            seen = now
            self.stats["tls_reloads"] += 1
            log.info("TLS files reloaded (%s) for new connections", ", ".join(s.tls_files()))
            self._close_revoked(revoked, trusted - issuers)
            trusted = issuers

    async def _jwks_loop(self, source: KeySetSource) -> None:
        """MQTT_AUTH_JWT_JWKS while the connector runs (connector.jwks): a new set replaces the `jwt` provider's
        keys for the next CONNECT, and closes the connections whose token a key gone from it verified
        (`_close_retired_keys`); one that does not load keeps the current keys. Until a URL's first set is
        loaded, it is tried again with back-off."""
        s = self.settings
        retry = Backoff(min(1.0, s.jwt_jwks_refresh_s), s.jwt_jwks_refresh_s)
        loaded = not source.url  # a file was loaded at start-up
        while True:
            await asyncio.sleep(s.jwt_jwks_refresh_s if loaded else retry.current)
            try:
                document = await asyncio.to_thread(source.fetch)
                if document is None:
                    continue
                verifier = s.jwks_verifier(document)
            except (OSError, ValueError) as exc:
                self.stats["jwks_failures"] += 1
                delay = s.jwt_jwks_refresh_s if loaded else retry.next()
                log.warning("the JWK Set at %s does not load (%s): %s; tried again in %gs", source.source, exc,
                            "the provider keeps its keys" if loaded else "tokens get 0x88 until it does", delay)
                continue
            self.authorizer.tokens = verifier
            source.loaded()
            self.stats["jwks_loads"] += 1
            log.info("JWK Set loaded from %s: key ids %s", source.source, sorted(map(str, verifier.keys)))
            loaded = True
            retry.reset()
            self._close_retired_keys(verifier.thumbprints)

    def _close_retired_keys(self, thumbprints: frozenset[str]) -> None:
        """Close every connection whose token a JWK Set key no longer in the set verified (by the key's RFC 7638
        thumbprint, so a key removed, or replaced under the same kid, or the one key of a set without kids
        replaced): a retired or compromised key stops its tokens at once, not at their exp
        (ConnectionMachine.revoke: v5 DISCONNECT 0x98 "token key retired"; 3.x the socket closed; the Will
        sent)."""
        for conn in list(self.connections):
            identity = conn.m.identity if conn.m is not None else None
            if identity is not None and identity.key_thumbprint is not None \
                    and identity.key_thumbprint not in thumbprints:
                self.stats["connections_key_retired"] += 1
                conn.revoke("token key retired")

    def _trusted_issuers(self) -> set[bytes]:
        """The subject names of MQTT_TLS_CA_FILE's CAs (empty without the file)."""
        ca_file = self.settings.tls_ca_file
        return ca_names(Path(ca_file).read_bytes()) if ca_file else set()

    def _close_revoked(self, revoked: set, removed_issuers: set[bytes]) -> None:
        """Close every open connection whose verified client certificate is in `revoked` or was issued by a CA
        of `removed_issuers` (ConnectionMachine.revoke: v5 DISCONNECT 0x98 with the reason; 3.x the socket
        closed; the Will sent)."""
        if not (revoked or removed_issuers):
            return
        for conn in list(self.connections):
            key = conn.cert_key
            if key is None:
                continue
            if key in revoked:
                self.stats["connections_certificate_revoked"] += 1
                conn.revoke("certificate revoked")
            elif key[0] in removed_issuers:
                self.stats["connections_ca_removed"] += 1
                conn.revoke("certificate authority no longer trusted")

    def _register_metrics(self) -> None:
        """GET /metrics (tbmq_platform.metrics): read from the counters at scrape time (nothing per message)."""
        m, st = self.metrics, self.stats
        m.gauge("connections", "open MQTT connections", lambda: len(self.connections))
        m.gauge("clients", "connected clients (CONNACK sent)", lambda: len(self.by_client))
        m.counters_by("messages_received", "PUBLISH packets received from clients", st, "qos",
                      {"0": "msgs_in_qos0", "1": "msgs_in_qos1", "2": "msgs_in_qos2"})
        m.counters_by("messages_sent", "PUBLISH packets sent to clients", st, "qos",
                      {"0": "msgs_out_qos0", "1": "msgs_out_qos1", "2": "msgs_out_qos2"})
        m.counter("messages_dropped", "messages not delivered to a client, by reason",
                  lambda: {(k.removeprefix("dropped_"),): v for k, v in st.items() if k.startswith("dropped_")},
                  ("reason",))
        m.counter("wills_sent", "Will messages published", lambda: st["wills_sent"])
        m.counters_by("connections_refused", "TCP connections closed before CONNECT, by limit", st, "reason",
                      {"max_connections": "refused_max_connections", "connect_rate": "refused_connect_rate",
                       "proxy_header": "refused_proxy_header", "proxy_source": "refused_proxy_source"})
        m.counters_by("connections_revoked", "connections closed because their access was taken away, by reason",
                      st, "reason", {"blocked": "revoked_blocked", "credential_deleted": "revoked_credential_deleted",
                                     "certificate_revoked": "connections_certificate_revoked",
                                     "ca_removed": "connections_ca_removed", "key_retired": "connections_key_retired",
                                     "token_expired": "token_expired", "token_revoked": "connections_token_revoked"})
        m.counter("login_failures", "CONNECTs refused for bad credentials (0x86), what MQTT_LOGIN_FAILURES_PER_IP "
                  "counts", lambda: st["login_failures"])
        m.counter("login_bans", "addresses this connector banned for going over MQTT_LOGIN_FAILURES_PER_IP",
                  lambda: st["login_bans"])
        m.counter("login_bans_shared", "addresses banned here for failed logins on other connectors "
                  "(tbmq.security.login.bans)",
                  lambda: st["login_bans_shared"])
        m.counter("login_failures_shared", "failed logins on other connectors spent from the address's budget here",
                  lambda: st["login_failures_shared"])
        m.counter("login_bans_lifted", "bans an administrator lifted early (DELETE /api/v1/login-bans/<address>)",
                  lambda: st["login_bans_lifted"])
        m.counter("connects_banned", "CONNECTs refused with 0x8A Banned: their address was banned",
                  lambda: st["connect_refused_banned"])
        m.counter("connects_busy", "CONNECTs refused with 0x89 Server busy: MQTT_PASSWORD_CHECKS_MAX passwords were "
                  "being verified", lambda: st["connect_refused_busy"])
        m.gauge("password_checks", "CONNECTs verifying a password or waiting for a thread (MQTT_PASSWORD_CHECKS_MAX)",
                lambda: self._password_checks)
        m.counter("password_cache_hits", "passwords found verified in the last MQTT_PASSWORD_CACHE_S: no check run",
                  lambda: st["password_cache_hits"])
        m.counter("password_verifications", "passwords verified with argon2id", lambda: st["password_verifications"])
        m.gauge("password_cache_entries", "passwords kept as verified (MQTT_PASSWORD_CACHE_MAX)",
                lambda: len(self.passwords))
        m.counter("publish_throttled", "times a client was paused for going over MQTT_MAX_PUBLISH_RATE / _BYTES_RATE",
                  lambda: st["publish_throttled"])
        m.counter("publish_throttled_connector", "times a client was paused for the connector going over "
                  "MQTT_MAX_TOTAL_PUBLISH_RATE / _BYTES_RATE", lambda: st["publish_throttled_connector"])
        m.counter("auth_http_requests", "CONNECTs the http provider asked its service about",
                  lambda: st["http_auth_requests"])
        m.counter("auth_http_errors", "of those, no usable answer (CONNACK 0x88)", lambda: st["http_auth_errors"])
        m.counter("auth_http_cached", "CONNECTs the http provider answered from MQTT_AUTH_HTTP_CACHE_S's kept answers",
                  lambda: st["http_auth_cached"])
        m.counter("reloads", "TLS files and JWK Sets read again while running, by what and result",
                  lambda: {("tls", "loaded"): st["tls_reloads"], ("tls", "failed"): st["tls_reload_failures"],
                           ("jwks", "loaded"): st["jwks_loads"], ("jwks", "failed"): st["jwks_failures"]},
                  ("what", "result"))
        m.gauge("retained_messages", "retained messages this connector holds", lambda: len(self.retained))
        m.gauge("pending_wills", "delayed Wills waiting", lambda: len(self.wills.pending))
        m.gauge("outbound_queued_messages", "messages queued for clients and not yet sent or acknowledged",
                lambda: sum(len(c.m.out) for c in self.connections if c.m is not None))
        m.lag("consumer_lag", lambda: [("downlink", self.data)] if self.data is not None else [])
        if self.device is not None:
            latency = m.histogram("grpc_call", "unary gRPC calls to device-persistence", ("method",))
            self.device.observe = lambda method, secs: latency.labels(method).observe(secs)

    async def _listen(self, li: Listener, ssl_ctx) -> None:
        """One listener: TCP or TLS; WebSocket ones put `websocket.WebSocketAdapter` in front of the same
        Connection. With MQTT_PROXY_PROTOCOL on for it, `_listen_proxied` instead."""
        s = self.settings

        def factory(peer=None):
            if li.websocket:
                return WebSocketAdapter(lambda: Connection(self, peer), s.mqtt_ws_path, s.connect_timeout_s)
            return Connection(self, peer)
        tls = {"ssl": ssl_ctx, "ssl_handshake_timeout": s.connect_timeout_s} if li.tls else {}
        if li.name in s.proxy_protocol:
            await self._listen_proxied(li, factory, tls)
            return
        server = await asyncio.get_running_loop().create_server(factory, li.host, li.port, backlog=4096,
                                                                reuse_address=True, **tls)
        self._servers.append(server)
        self.bound[li.name] = server.sockets[0].getsockname()[1]

    async def _listen_proxied(self, li: Listener, factory, tls: dict) -> None:
        """A listener behind a load balancer that speaks the PROXY protocol (connector.proxy): each accepted
        socket's header is read first (exactly, so the TLS handshake or MQTT starts on the next byte), then the
        socket is handed to asyncio (`connect_accepted_socket`, TLS included) with the header's address as the
        connection's peer. A connection without a valid header within MQTT_CONNECT_TIMEOUT_S is closed."""
        family = socket.AF_INET6 if ":" in li.host else socket.AF_INET
        lsock = socket.create_server((li.host.strip("[]"), li.port), family=family, backlog=4096)
        lsock.setblocking(False)
        self._proxy_listeners.append(lsock)
        self.bound[li.name] = lsock.getsockname()[1]
        if not self.settings.proxy_protocol_from:
            log.warning("%s listener: MQTT_PROXY_PROTOCOL without MQTT_PROXY_PROTOCOL_FROM takes the PROXY header "
                        "of any peer: a client that reaches %s:%d past the load balancer can claim any address "
                        "(set the balancers' addresses, or keep the port reachable from them only)",
                        li.name, li.host, self.bound[li.name])
        self.spawn(self._accept_proxied(lsock, li, factory, tls), f"{li.name} listener (PROXY protocol)")

    async def _accept_proxied(self, lsock: socket.socket, li: Listener, factory, tls: dict) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(lsock)
            except OSError as exc:  # out of file descriptors and the like: the listener goes on
                if lsock.fileno() == -1:  # closed: the connector is stopping
                    return
                log.warning("%s listener: accept failed (%s)", li.name, exc)
                await asyncio.sleep(0.1)  # back-off before accepting again (not a synchronisation)
                continue
            sock.setblocking(False)
            if len(self.connections) + self._proxy_pending >= self.settings.max_connections:
                # sockets still waiting for their header count against MQTT_MAX_CONNECTIONS too
                self.stats["refused_max_connections"] += 1
                sock.close()
                continue
            self._proxy_pending += 1
            self.spawn_bg(self._proxied(loop, sock, li, factory, tls))

    async def _proxied(self, loop, sock: socket.socket, li: Listener, factory, tls: dict) -> None:
        try:
            await self._proxied_one(loop, sock, li, factory, tls)
        finally:
            self._proxy_pending -= 1

    async def _proxied_one(self, loop, sock: socket.socket, li: Listener, factory, tls: dict) -> None:
        host, source = _peer_of(sock)
        if not trusted(host, self.settings.proxy_protocol_from):
            self.stats["refused_proxy_source"] += 1
            log.warning("%s listener: connection from %s closed: not a load balancer of MQTT_PROXY_PROTOCOL_FROM",
                        li.name, source)
            sock.close()
            return
        try:
            peer = await read_header(loop, sock, self.settings.connect_timeout_s)
        except (ProxyHeaderError, TimeoutError, OSError) as exc:
            self.stats["refused_proxy_header"] += 1
            log.info("%s listener: connection from %s closed: %s", li.name, source, exc or "timeout")
            sock.close()
            return
        try:
            await loop.connect_accepted_socket(lambda: factory(peer), sock, **tls)
        except Exception as exc:  # a failed TLS handshake (the client's): that connection only
            log.info("%s listener: connection from %s failed: %r", li.name, peer or source, exc)
            sock.close()

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for lsock in self._proxy_listeners:
            lsock.close()
        for conn in list(self.connections):
            if self.fenced:   # the registry ended these sessions and owns their Wills
                conn.take_over(pb.DisconnectCommand(client_id=conn.client_id, session_id=conn.session_id,
                                                    reason=pb.DISCONNECT_REASON_CONNECTOR_FENCED))
            else:
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
        if self.producer is not None and self._servers and not self.fenced:
            try:   # after the DISCONNECTION_REQUESTs and Wills (flushed): no false "dead", no timeout wait
                await asyncio.wait_for(self._heartbeat(stopped=True), 10)
            except Exception:
                log.exception("stopped heartbeat not sent (the registry declares this run dead after its timeout)")
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
        if self.http_auth is not None:
            await self.http_auth.close()
        if self.linger is not None:
            self.linger.close()
        if self.producer is not None:
            await self.producer.stop()
        if self._password_pool is not None:
            self._password_pool.shutdown(wait=False, cancel_futures=True)
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
                "credentials": len(self.auth_tables.credentials), "blocked_rules": len(self.auth_tables.blocked),
                **{k: v for k, v in self.stats.items()},
                **(self.device.acks.stats if self.device is not None else {}),
                "forward_streams_open": self.device.open_links() if self.device is not None else 0,
                "mark_rounds": self.marks.rounds if self.marks is not None else 0,
                **(self.adaptive_fetch.health() if self.adaptive_fetch is not None else {}),
                **(self.linger.health() if self.linger is not None else {})}

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
    def new_machine(self, address: str, peer_ip: str = "", cert_names: tuple[str, ...] = ()) -> ConnectionMachine:
        return ConnectionMachine(self.machine_config, stats=self.stats, retained=self.retained.match_filter,
                                 retained_room=self.retained_room, total_rate=self.total_rate,
                                 address=address, auth=self.authorizer, peer_ip=peer_ip, cert_names=cert_names)

    async def authenticate(self, request: AuthRequest) -> AuthResult:
        """The CONNECT's identity; an argon2 verification (186 ms of CPU on a 2-core host) runs in a worker thread
        (_decide), not on the event loop (the tables are only read there: dict lookups and a blocked table that
        is replaced, never mutated). Reaching the `http` provider, the decision waits for the operator's
        service's answer (connector.http_auth), then is taken again with it. An address past
        MQTT_LOGIN_FAILURES_PER_IP is refused before any of that (0x8A Banned: tbmq_auth.failures), so guessing
        passwords costs the connector no argon2 work beyond that rate."""
        if self.logins and self.logins.ban_left(request.ip, time.monotonic()):
            self.stats["connect_refused_banned"] += 1
            return AuthResult(ReasonCode.BANNED, "too many failed logins from this address")
        now = int(time.time() * 1000)
        result = await self._decide(request, now, None)
        if isinstance(result, HttpCheck):
            answer = await self._ask_http(result.body, request.client_id)
            result = await self._decide(request, now, answer)
        if result.reason_code == ReasonCode.BAD_USER_NAME_OR_PASSWORD:
            self.stats["login_failures"] += 1
            if self.logins:
                # every connector (this one too) spends it from the address's one budget: _apply_login_record
                record = failure_record(int(time.time() * 1000), self.service_id)
                self.spawn_bg(self.producer.send(SECURITY_LOGIN_BANS, record, key=request.ip.encode()))
                self._login_events(request.ip, self.logins.failed(request.ip, time.monotonic()))
        return result

    def _apply_login_record(self, key: bytes | None, value: bytes | None) -> None:
        """A record of tbmq.security.login.bans, every connector's, this one's too (tbmq_auth.failures.LoginLedger:
        failed logins spent from the address's one budget across the connectors, bans, bans lifted)."""
        if key is None or not value or not self.logins:
            return
        address = key.decode()
        try:
            events = self.logins.record(address, value, time.monotonic(), int(time.time() * 1000))
        except ValueError as exc:
            log.warning("tbmq.security.login.bans: %s: ignored", exc)
            return
        self._login_events(address, events)

    def _login_events(self, address: str, events: tuple[str, ...]) -> None:
        """Counted (the event names are the counters'), and a ban this connector started written to
        tbmq.security.login.bans, which the admin API lists and every connector (this one after a restart
        too) applies."""
        s = self.settings
        for event in events:
            self.stats[event] += 1
            if event == BANNED:
                log.warning("address %s banned for %gs: %d failed logins within %gs", address, s.login_ban_s,
                            s.login_failures_per_ip, s.login_failures_window_s)
                until_ms = int(time.time() * 1000 + s.login_ban_s * 1000)
                self.spawn_bg(self.producer.send(SECURITY_LOGIN_BANS, ban_record(until_ms, self.service_id),
                                                 key=address.encode()))
            elif event == BANNED_SHARED:
                log.info("address %s banned: failed logins on other connectors", address)
            elif event == BAN_LIFTED:
                log.info("address %s: its ban lifted by an administrator", address)

    async def _ask_http(self, body: dict, client_id: str) -> HttpAnswer:
        """The `http` provider's answer to `body`: a kept one (MQTT_AUTH_HTTP_CACHE_S, tbmq_auth.http.AnswerCache)
        or the service's."""
        cache = self.http_answers
        key = cache.key(body) if cache else b""
        answer = cache.get(key, time.monotonic()) if cache else None
        if answer is not None:
            self.stats["http_auth_cached"] += 1
            return answer
        self.stats["http_auth_requests"] += 1
        answer = await self.http_auth.ask(body)
        if answer.result == ERROR:
            self.stats["http_auth_errors"] += 1
            log.warning("client %r: %s (CONNACK 0x88)", client_id, answer.reason)
        elif cache:
            cache.put(key, answer, time.monotonic())
        return answer

    async def _decide(self, request: AuthRequest, now: int, answer: HttpAnswer | None) -> AuthResult | HttpCheck:
        """The authorizer's decision; one that verifies a password (a known user name with a password) runs on
        MQTT_PASSWORD_CHECK_THREADS threads, with at most MQTT_PASSWORD_CHECKS_MAX CONNECTs verified or waiting
        at once: past that, 0x89 Server busy without a check, so a flood of them costs bounded CPU and memory
        and the message path keeps the other cores."""
        cred = self.auth_tables.credentials.get(request.username) if request.password is not None else None
        if cred is None or cred.password_hash is None or self._password_kept(cred.password_hash, request.password):
            return self.authorizer.authenticate(request, now, answer)  # no argon2 check: on the event loop
        if self._password_checks >= self.settings.password_checks_max:
            self.stats["connect_refused_busy"] += 1
            return AuthResult(ReasonCode.SERVER_BUSY, "too many password checks at once")
        if self._password_pool is None:
            self._password_pool = concurrent.futures.ThreadPoolExecutor(
                self.settings.password_check_threads or os.cpu_count() or 1, thread_name_prefix="password-check")
        self._password_checks += 1
        try:  # a connection closed meanwhile cancels its check if it has not started
            return await asyncio.get_running_loop().run_in_executor(
                self._password_pool, self.authorizer.authenticate, request, now, answer)
        finally:
            self._password_checks -= 1

    def _password_kept(self, stored_hash: str, password: bytes) -> bool:
        with self._passwords_lock:
            return self.passwords.known(stored_hash, password, time.monotonic())

    def _verify_password(self, stored_hash: str, password: bytes) -> bool:
        """The authorizer's password check: answered from the passwords verified in the last
        MQTT_PASSWORD_CACHE_S (on the event loop: _decide), else argon2id (on a password-check thread), a
        success kept."""
        if self._password_kept(stored_hash, password):
            self.stats["password_cache_hits"] += 1
            return True
        ok = verify_password(stored_hash, password)
        with self._passwords_lock:
            self.stats["password_verifications"] += 1
            if ok:
                self.passwords.verified(stored_hash, password, time.monotonic())
        return ok

    def admit(self, ip: str) -> str | None:
        return self.admission.admit(len(self.connections), ip, time.monotonic())

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
        resp = await self.sessions.connect(session, self.settings.session_event_timeout_s)
        if resp.failure == pb.SESSION_FAILURE_CONNECTOR_FENCED:
            self._on_fenced(f"CONNECT of {session.client_id!r} refused")
        elif resp.mark_routing:
            # the registry replaced or resumed a session the routers know: a PUBLISH sent after CONNACK is
            # routed with the new session and subscriptions (tbmq_platform.marks); a failure fails the CONNECT
            await self.marks.mark()
        return resp

    def _on_fenced(self, why: str) -> None:
        """The registry declared this run dead (it was paused or cut off longer than TBMQ_CONNECTOR_TIMEOUT_MS):
        its sessions are ended and their Wills published, so it must not serve on. Stop (exit code 1)."""
        if self.fenced:
            return
        self.fenced = True
        log.error("connector %s run %s was declared dead by the session registry (%s): stopping; restart it",
                  self.service_id, self.incarnation, why)
        fut = self.failed()
        if not fut.done():
            fut.set_exception(RuntimeError("connector run declared dead by the session registry (fenced)"))

    def report_disconnect(self, session: pb.SessionInfo, graceful: bool, session_expiry: int | None,
                          awaiting_pubrel=()) -> None:
        self.spawn_bg(self._report_disconnect(session, graceful, session_expiry, awaiting_pubrel))

    async def _report_disconnect(self, session: pb.SessionInfo, graceful: bool, session_expiry: int | None,
                                 awaiting_pubrel) -> None:
        """The session's end told to the registry once the acknowledgements this connector holds are in
        Redis: they wait up to DEVICE_ACK_BATCH_DELAY_MS to be batched, and a client reconnecting on another
        connector meanwhile would be fetched what it had acknowledged here (a duplicate)."""
        if self.device is not None:
            await self.device.settle_acks()
        await self.sessions.disconnect(session, graceful=graceful, session_expiry=session_expiry,
                                       awaiting_pubrel=awaiting_pubrel)

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
        # msg.topic == topic and msg.retain == retain (tbmq_connection.convert.publish_msg); the retained copy
        # (an empty payload deletes it [MQTT-3.3.1-6/-7]): tbmq_routing.wills.publish_records, also the registry's
        records = publish_records(msg, MSG_ALL, MSG_RETAINED)
        if self.linger is not None:
            self.linger.sending(time.monotonic())
        direct = self.direct
        t, key, value = records[0]
        fut = await direct(t, value, key, headers)
        fut2 = None
        if len(records) > 1:
            t, key, value = records[1]
            fut2 = await direct(t, value, key, headers)
        return fut, fut2

    async def produce_subscriptions(self, client_id: str, subs, client_type: int) -> None:
        """Write the client's whole set, wait for Kafka's acknowledgement, then for a round of subscription
        marks on tbmq.msg.all (tbmq_platform.marks): a PUBLISH sent after the SUBACK / UNSUBACK is routed
        with the new set on every router instance."""
        cs = pb.ClientSubscriptions(client_id=client_id, subscriptions=list(subs), client_type=client_type)
        with self.urgent():
            fut = await self.producer.send(CLIENT_SUBSCRIPTIONS, cs.SerializeToString(),
                                           key=client_id.encode("utf-8"), headers=kafka_headers())
        await fut
        await self.marks.mark()

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

    async def _heartbeat(self, stopped: bool = False) -> None:
        st = self.stats
        stats = pb.ConnectorStats(
            clients_connected=len(self.by_client), connections=len(self.connections),
            messages_received=st["msgs_in_qos0"] + st["msgs_in_qos1"] + st["msgs_in_qos2"],
            messages_sent=st["msgs_out_qos0"] + st["msgs_out_qos1"] + st["msgs_out_qos2"],
            messages_dropped=sum(v for k, v in st.items() if k.startswith("dropped_")),
            started_at_ms=self.started_at_ms)
        hb = pb.ConnectorHeartbeat(service_id=self.service_id, incarnation=self.incarnation,
                                   sent_at_ms=int(time.time() * 1000), stopped=stopped, stats=stats)
        fut = await self.producer.send(CONNECTOR_HEARTBEAT, hb.SerializeToString(),
                                       key=self.service_id.encode("utf-8"))
        await fut

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.wait_for(self._heartbeat(), interval * 2)
            except Exception as exc:   # Kafka unreachable: the registry may declare this run dead
                self.stats["heartbeats_failed"] += 1
                log.warning("heartbeat not sent: %r", exc)

    async def _sys_loop(self) -> None:
        """$SYS/broker/... every MQTT_SYS_INTERVAL_S, by the live run with the smallest service id
        (tbmq_connection.systopics)."""
        interval = self.settings.sys_interval_s
        stale_ms = max(3 * self.settings.heartbeat_interval_ms, int(2000 * interval))
        while True:
            await asyncio.sleep(interval)  # the period
            now = int(time.time() * 1000)
            live = systopics.live_runs(self.heartbeats, now, stale_ms)
            if not systopics.is_publisher(self.service_id, live):
                continue
            try:
                for topic, payload in systopics.sys_messages(
                        live, subscriptions=self.subscription_count, retained=len(self.retained),
                        version=f"tbmq-py {VERSION}", now_ms=now):
                    msg = pb.PublishMsg(publisher_id=systopics.PUBLISHER_ID, topic=topic, payload=payload, qos=0,
                                        retain=True, created_at_ms=now, publisher_service_id=self.service_id)
                    await self.produce_publish(msg, topic, True)
                self.stats["sys_rounds"] += 1
            except Exception as exc:  # Kafka unreachable: the next round tries again
                log.warning("$SYS round not published: %r", exc)

    # ------------------------------------------------------------------------------------ views
    def _apply_heartbeat(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        if value:
            self.heartbeats[key.decode("utf-8")] = pb.ConnectorHeartbeat.FromString(value)
        else:
            self.heartbeats.pop(key.decode("utf-8"), None)

    def _apply_retained(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        topic = key.decode("utf-8")
        old = self.retained.get(topic)
        if old is not None:
            self.retained_bytes -= len(old.payload) + len(topic)
        msg = pb.PublishMsg.FromString(value) if value else None
        if msg is None or not msg.payload:
            self.retained.delete(topic)
        else:
            self.retained.set(topic, msg)
            self.retained_bytes += len(msg.payload) + len(topic)

    def retained_room(self, topic: str, size: int) -> bool:
        """May a retained message of `size` payload bytes be stored on `topic` (a new topic within
        MQTT_MAX_RETAINED_MESSAGES, the bytes within MQTT_MAX_RETAINED_BYTES; replacing one frees its bytes)."""
        s = self.settings
        old = self.retained.get(topic)
        if old is None and len(self.retained) >= s.max_retained_messages:
            return False
        freed = len(old.payload) + len(topic) if old is not None else 0
        return self.retained_bytes - freed + size + len(topic) <= s.max_retained_bytes

    def _apply_credential(self, key: bytes | None, value: bytes | None) -> None:
        """A credential written (or deleted): the table, then every connection authenticated with it re-checks
        its subscriptions, or is closed when the credential was deleted (ConnectionMachine.revoke). One pass over
        the connections per change: changes are an operator's, rare."""
        if key is None:
            return
        self.auth_tables.apply_credential(key, value)
        name = key.decode()
        gone = name not in self.auth_tables.credentials  # deleted (or unreadable): nothing authenticates them now
        for conn in list(self.connections):
            if conn.credential == name:
                if gone:
                    self.stats["revoked_credential_deleted"] += 1
                    conn.revoke("credential deleted")
                else:
                    conn.acl_changed()

    def _apply_blocked(self, key: bytes | None, value: bytes | None) -> None:
        """A blocked rule written (or deleted): the table, then every connection a rule now in force matches is
        closed (ConnectionMachine.revoke: v5 DISCONNECT 0x98 Administrative action; 3.x: the socket closed). Its
        reconnect is refused at CONNECT (0x8A Banned; 3.x: 5) while the rule lasts."""
        if key is None:
            return
        self.auth_tables.apply_blocked(key, value)
        rule = self.auth_tables.blocked.get(key.decode()) if value is not None else None
        if rule is None:
            return
        now = int(time.time() * 1000)
        for conn in list(self.connections):
            m = conn.m
            # a CONNECT waiting for its CONNACK too: the machine closes it right after its CONNACK
            if m is not None and m.client_id is not None and rule.matches(m.client_id, m.username, m.peer_ip, now):
                self.stats["revoked_blocked"] += 1
                conn.revoke("blocked by an administrator")

    def _apply_revoked_token(self, key: bytes | None, value: bytes | None) -> None:
        """A token revoked (tbmq.security.tokens.revoked, `tbmq tokens revoke`; or withdrawn): the table, then
        every connection that token opened is closed (ConnectionMachine.revoke: v5 DISCONNECT 0x98 "token
        revoked"; 3.x the socket closed; the Will sent). Its reconnect is refused at CONNECT (0x86) until the
        token's exp."""
        if key is None or not self.auth_tables.apply_revoked_token(key, value, int(time.time() * 1000)):
            return
        jti = key.decode()
        for conn in list(self.connections):
            identity = conn.m.identity if conn.m is not None else None
            if identity is not None and identity.token_id == jti:
                self.stats["connections_token_revoked"] += 1
                conn.revoke("token revoked")

    def _apply_subscriptions(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        client_id = key.decode("utf-8")
        self.subscription_count -= self._subs_n.pop(client_id, 0)
        if value:
            self._subs_raw[client_id] = value
            n = self._subs_n[client_id] = len(pb.ClientSubscriptions.FromString(value).subscriptions)
            self.subscription_count += n
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
        if cmd.reason == pb.DISCONNECT_REASON_CONNECTOR_FENCED and cmd.connector_incarnation == self.incarnation:
            self._on_fenced(f"connection of {cmd.client_id!r} closed")
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
        # one copy per origin and connection: a router's replay is dropped (tbmq_routing.origins.OriginMarks)
        origin = (dl.origin_partition, record.partition, dl.origin_offset, record.offset) \
            if dl.HasField("origin_offset") else None
        if self.spans:
            with span_from_kafka(tracer, "mqtt.deliver", record.headers):
                self._deliver_basic(dl, origin)
        else:
            self._deliver_basic(dl, origin)

    def _deliver_basic(self, dl, origin: tuple[int, int, int, int] | None) -> None:
        by_client = self.by_client
        msg = dl.msg
        for r in dl.recipients:
            conn = by_client.get(r.client_id)
            if conn is None:
                self.stats["dropped_not_connected"] += 1
            elif subscribed_to(conn.subs, msg.topic):
                conn.deliver(msg, r.qos, r.retain, r.subscription_ids, origin)
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
