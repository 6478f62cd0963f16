"""Connector settings: environment variables parsed once (tbmq_platform.settings)."""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass

from tbmq_auth import DEFAULT_PROVIDERS, HTTP, JWT, JwtVerifier, PendingKeys, anonymous_default, parse_providers
from tbmq_platform.settings import (
    APP_DELIVERY_GRPC_TARGET,
    PRODUCER_LINGER_MS,
    CommonSettings,
    boolean,
    choice,
    csv,
    device_persistence_targets_env,
    env,
    fetch_window_env,
    integer,
    number,
    port,
    port_or_off,
    targets,
    trace_spans_env,
)

from .grpc_clients import ACK_BATCH_MAX, ACK_DELAY_S, ACK_MAX_CALLS, PUBREC_DELAY_S
from .jwks import is_http_url
from .proxy import Sources, parse_sources
from .tls import CERT_BEGIN, CRL_BEGIN

MAX_VBI = 268_435_455
TLS_PORT, WSS_PORT = 8883, 8084
WITH_CERTIFICATE = -1  # the TLS listeners' default: on at their standard port when a certificate is configured


LISTENER_NAMES = ("mqtt", "mqtts", "ws", "wss")


def parse_listener_names(raw: str) -> tuple[str, ...]:
    """A comma list of listener names (mqtt, mqtts, ws, wss); empty = none."""
    names = tuple(dict.fromkeys(n.lower() for n in csv(raw)))
    bad = [n for n in names if n not in LISTENER_NAMES]
    if bad:
        raise ValueError(f"{raw!r}: a comma list of {', '.join(LISTENER_NAMES)}")
    return names


def check_crl_file(path: str) -> None:
    """MQTT_TLS_CRL_FILE must hold revocation lists only: OpenSSL loads CRLs and certificates from the same
    kind of file, so a certificate put there by mistake would become a trusted CA. Raises ValueError."""
    with open(path, encoding="ascii", errors="replace") as f:
        text = f.read()
    if CERT_BEGIN in text or CRL_BEGIN not in text:
        raise ValueError(f"{path}: expected PEM certificate revocation lists ({CRL_BEGIN}) and no certificate")


@dataclass(frozen=True)
class ConnectorSettings(CommonSettings):
    service_name: str = "connector"
    health_port: int = env("HEALTH_PORT", 8081, parse=port, doc="health/readiness HTTP port (0 = any)")
    service_id_from_hostname: bool = env(
        "TBMQ_SERVICE_ID_FROM_HOSTNAME", False, parse=boolean,
        doc="use the host name as TBMQ_SERVICE_ID (compose scaling); wins over TBMQ_SERVICE_ID")

    # the four listeners (docs/connector.md, "Listeners"): 0 or empty = off
    mqtt_port: int = env("MQTT_PORT", 1883, parse=port_or_off, doc="MQTT/TCP listener port (0 or empty = off)")
    mqtt_bind_host: str = env("MQTT_BIND_HOST", "0.0.0.0",
                              doc="bind address of the MQTT/TCP listener, and of every listener without its own")
    mqtt_tls_port: int = env("MQTT_TLS_PORT", WITH_CERTIFICATE, parse=port_or_off,
                             doc="MQTT over TLS listener port (0 or empty = off; unset: 8883 when MQTT_TLS_CERT_FILE "
                                 "is set, else off; set, it needs MQTT_TLS_CERT_FILE and MQTT_TLS_KEY_FILE)")
    mqtt_tls_bind_host: str = env("MQTT_TLS_BIND_HOST", "", doc="bind address of the TLS listener (empty = MQTT_BIND_HOST)")
    mqtt_ws_port: int = env("MQTT_WS_PORT", 8083, parse=port_or_off,
                            doc="MQTT over WebSocket listener port (path MQTT_WS_PATH, subprotocol mqtt; 0 or empty = off)")
    mqtt_ws_bind_host: str = env("MQTT_WS_BIND_HOST", "", doc="bind address of the WebSocket listener (empty = MQTT_BIND_HOST)")
    mqtt_wss_port: int = env("MQTT_WSS_PORT", WITH_CERTIFICATE, parse=port_or_off,
                             doc="MQTT over WebSocket over TLS listener port (0 or empty = off; unset: 8084 when "
                                 "MQTT_TLS_CERT_FILE is set, else off; set, it needs the certificate too)")
    mqtt_wss_bind_host: str = env("MQTT_WSS_BIND_HOST", "", doc="bind address of the WSS listener (empty = MQTT_BIND_HOST)")
    mqtt_ws_path: str = env("MQTT_WS_PATH", "/mqtt", doc="HTTP path of the WebSocket upgrade (WS and WSS)")
    proxy_protocol: tuple[str, ...] = env(
        "MQTT_PROXY_PROTOCOL", (), parse=parse_listener_names,
        doc="listeners (comma list of mqtt, mqtts, ws, wss) whose connections start with a PROXY protocol header "
            "(v1 or v2, from a load balancer): its client address is the connection's; one without the header "
            "is closed (empty = none)")
    proxy_protocol_from: Sources = env(
        "MQTT_PROXY_PROTOCOL_FROM", (), parse=parse_sources,
        doc="addresses or networks (comma list) of the load balancers allowed to connect to the listeners in "
            "MQTT_PROXY_PROTOCOL; a connection from anywhere else is closed before its header is read "
            "(empty = any: then only the balancer must be able to reach those listeners)")
    tls_cert_file: str = env("MQTT_TLS_CERT_FILE", "", doc="server certificate chain (PEM) of the TLS and WSS listeners")
    tls_key_file: str = env("MQTT_TLS_KEY_FILE", "", doc="private key (PEM) of MQTT_TLS_CERT_FILE")
    tls_ca_file: str = env("MQTT_TLS_CA_FILE", "", doc="CA certificates (PEM) that client certificates are verified against")
    tls_client_auth: str = env(
        "MQTT_TLS_CLIENT_AUTH", "none", parse=choice("none", "optional", "required"),
        doc="client certificates on TLS/WSS: none (not asked), optional (verified when sent), required (a client "
            "without one signed by MQTT_TLS_CA_FILE is refused at the handshake)")
    tls_crl_file: str = env(
        "MQTT_TLS_CRL_FILE", "",
        doc="certificate revocation lists (PEM) of the CAs in MQTT_TLS_CA_FILE: a client certificate they list is "
            "refused at the handshake; set, every CA that signs client certificates needs its CRL in the file "
            "(empty = no revocation check)")
    tls_reload_interval_s: float = env(
        "MQTT_TLS_RELOAD_INTERVAL_S", 60.0, parse=number(0),
        doc="how often the TLS files are checked; when one changed (a renewed certificate, a CA added or removed, a "
            "new CRL) the whole set replaces the TLS and WSS listeners' for new connections, open ones keep theirs "
            "(0 = never: a restart loads them)")
    # authentication (docs/security.md)
    auth_providers: tuple[str, ...] = env(
        "MQTT_AUTH_PROVIDERS", DEFAULT_PROVIDERS, parse=parse_providers,
        doc="authentication providers, tried in this order: password, x509, jwt, http, anonymous (comma list)")
    jwt_secret: str = env(
        "MQTT_AUTH_JWT_SECRET", "",
        doc="provider jwt: the HMAC secret (HS256/384/512, at least 32 bytes) tokens are signed with; or "
            "MQTT_AUTH_JWT_PUBLIC_KEY_FILE or MQTT_AUTH_JWT_JWKS: one of the three")
    jwt_public_key_file: str = env(
        "MQTT_AUTH_JWT_PUBLIC_KEY_FILE", "",
        doc="provider jwt: the PEM public key (RSA, EC or Ed25519/Ed448) tokens are verified with; its kind "
            "decides the algorithms accepted")
    jwt_jwks: str = env(
        "MQTT_AUTH_JWT_JWKS", "",
        doc="provider jwt: a JWK Set (RFC 7517) of the keys tokens are verified with, a token's kid picking one: "
            "a file, or an http(s) URL (the issuer's JWKS endpoint); read again every "
            "MQTT_AUTH_JWT_JWKS_REFRESH_S, so keys rotate without a restart")
    jwt_jwks_ca_file: str = env("MQTT_AUTH_JWT_JWKS_CA_FILE", "",
                                doc="provider jwt: the CA (PEM) of an https MQTT_AUTH_JWT_JWKS endpoint's "
                                    "certificate; empty = the system's")
    jwt_jwks_refresh_s: float = env(
        "MQTT_AUTH_JWT_JWKS_REFRESH_S", 60.0, parse=number(0.1),
        doc="provider jwt: how often MQTT_AUTH_JWT_JWKS is read again (a file: when it changed; a URL: fetched); "
            "a set that does not load keeps the current one")
    http_auth_url: str = env(
        "MQTT_AUTH_HTTP_URL", "",
        doc="provider http: the operator's authentication service, an http(s) URL each CONNECT's client id, user "
            "name, password, address and certificate names are POSTed to as JSON (tbmq_auth.http)")
    http_auth_timeout_s: float = env("MQTT_AUTH_HTTP_TIMEOUT_S", 5.0, parse=number(0.1),
                                     doc="provider http: how long a question may take; then CONNACK 0x88")
    http_auth_authorization: str = env(
        "MQTT_AUTH_HTTP_AUTHORIZATION", "",
        doc="provider http: the Authorization header the connector sends (e.g. 'Bearer <secret>', so the service "
            "knows the caller); empty = none")
    http_auth_ca_file: str = env("MQTT_AUTH_HTTP_CA_FILE", "",
                                 doc="provider http: the CA (PEM) of an https service's certificate; empty = the "
                                     "system's")
    http_auth_cache_s: float = env(
        "MQTT_AUTH_HTTP_CACHE_S", 0.0, parse=number(0),
        doc="provider http: how long an allow / deny / ignore answer is kept for the same question (client id, "
            "user name, password, address, certificate names; kept by its SHA-256), so reconnects do not ask "
            "again; a changed decision applies after at most this long; 0 = every CONNECT asks")
    http_auth_cache_max: int = env("MQTT_AUTH_HTTP_CACHE_MAX", 100_000, parse=integer(1),
                                   doc="provider http: answers kept at most (the oldest dropped first)")
    jwt_audience: str = env("MQTT_AUTH_JWT_AUDIENCE", "",
                            doc="provider jwt: the aud claim a token must carry (empty = not checked)")
    jwt_issuer: str = env("MQTT_AUTH_JWT_ISSUER", "",
                          doc="provider jwt: the iss claim a token must carry (empty = not checked)")
    allow_anonymous_setting: bool | None = env(
        "MQTT_ALLOW_ANONYMOUS", None, parse=boolean,
        doc="accept clients no credential identifies (with full rights); unset: true only when every MQTT "
            "listener binds a loopback address")
    max_packet_size: int = env(
        "MQTT_MAX_PACKET_SIZE", 262144, parse=integer(64, MAX_VBI + 5),
        doc="largest packet accepted from a client, in bytes (advertised in v5 CONNACK)")
    receive_maximum: int = env(
        "MQTT_RECEIVE_MAXIMUM", 1024, parse=integer(1, 65535),
        doc="QoS 1/2 PUBLISHes a client may have unacknowledged towards the connector (v5 CONNACK)")
    server_keep_alive_max: int = env(
        "MQTT_SERVER_KEEP_ALIVE_MAX", 600, parse=integer(0, 65535),
        doc="largest keep alive granted to a v5 client (Server Keep Alive); 0 = whatever the client asks")
    topic_alias_maximum: int = env(
        "MQTT_TOPIC_ALIAS_MAXIMUM", 10, parse=integer(0, 65535),
        doc="inbound topic aliases per v5 connection (0 = none)")
    response_information: str = env(
        "MQTT_RESPONSE_INFORMATION", "",
        doc="v5 CONNACK Response Information sent to a client that asks for it (Request Response "
            "Information = 1), e.g. a topic prefix for its responses; empty = never sent")
    max_inflight: int = env(
        "MQTT_MAX_INFLIGHT", 1000, parse=integer(1, 65535),
        doc="outbound QoS 1/2 messages in flight per client, capped by the client's Receive Maximum")
    max_queued: int = env(
        "MQTT_MAX_QUEUED", 1000, parse=integer(1, 10_000_000),
        doc="outbound QoS 1/2 messages queued per client beyond the in-flight window; more -> dropped")
    max_queued_bytes: int = env(
        "MQTT_MAX_QUEUED_BYTES", 8 * 1024 * 1024, parse=integer(1024),
        doc="outbound bytes (payload + topic) queued per client beyond the in-flight window; more -> dropped "
            "(live deliveries; stored DEVICE messages come in pages instead)")
    max_topic_bytes: int = env(
        "MQTT_MAX_TOPIC_BYTES", 4096, parse=integer(16, 65535),
        doc="longest topic name or filter accepted (UTF-8 bytes): a longer PUBLISH is refused (v5 PUBACK/PUBREC "
            "0x90), a longer filter gets SUBACK 0x8F / 0x80, a longer Will topic CONNACK 0x90")
    max_topic_levels: int = env(
        "MQTT_MAX_TOPIC_LEVELS", 128, parse=integer(1, 65535),
        doc="most levels of a topic name or filter accepted (same reactions as MQTT_MAX_TOPIC_BYTES)")
    max_subscriptions: int = env(
        "MQTT_MAX_SUBSCRIPTIONS_PER_CLIENT", 1000, parse=integer(1),
        doc="subscriptions one client may hold; more get SUBACK 0x97 (Quota exceeded) / 0x80")
    max_user_properties: int = env(
        "MQTT_MAX_USER_PROPERTIES", 64, parse=integer(0, 65535),
        doc="user properties of a v5 PUBLISH or Will; more: PUBACK/PUBREC 0x97 (the PUBLISH is dropped), "
            "CONNACK 0x97 (the Will)")
    max_publish_rate: float = env(
        "MQTT_MAX_PUBLISH_RATE", 0.0, parse=number(0),
        doc="PUBLISH packets a second one client may send, with a burst of one second's worth (0 = unlimited); "
            "beyond, the connector stops reading from it until it is back within the rate (nothing is dropped)")
    max_publish_bytes_rate: float = env(
        "MQTT_MAX_PUBLISH_BYTES_RATE", 0.0, parse=number(0),
        doc="PUBLISH payload bytes a second one client may send (0 = unlimited); as MQTT_MAX_PUBLISH_RATE")
    max_total_publish_rate: float = env(
        "MQTT_MAX_TOTAL_PUBLISH_RATE", 0.0, parse=number(0),
        doc="PUBLISH packets a second all clients of this connector may send together, with a burst of one "
            "second's worth (0 = unlimited); beyond, the connector stops reading from each client that publishes "
            "until the total is back within the rate (nothing is dropped). The cluster's total is this times "
            "the connectors")
    max_total_publish_bytes_rate: float = env(
        "MQTT_MAX_TOTAL_PUBLISH_BYTES_RATE", 0.0, parse=number(0),
        doc="PUBLISH payload bytes a second all clients of this connector may send together (0 = unlimited); "
            "as MQTT_MAX_TOTAL_PUBLISH_RATE")
    max_retained_messages: int = env(
        "MQTT_MAX_RETAINED_MESSAGES", 500_000, parse=integer(1),
        doc="retained messages in the cluster (every connector holds them all); a new one beyond is refused "
            "(v5 PUBACK/PUBREC 0x97); replacing or clearing one always works")
    max_retained_bytes: int = env(
        "MQTT_MAX_RETAINED_BYTES", 128 * 1024 * 1024, parse=integer(1024),
        doc="payload + topic bytes of all retained messages (as MQTT_MAX_RETAINED_MESSAGES)")
    connect_timeout_s: float = env("MQTT_CONNECT_TIMEOUT_S", 10.0, parse=number(0.1),
                                   doc="seconds a new TCP connection has to send CONNECT")
    session_event_timeout_s: float = env(
        "SESSION_EVENT_TIMEOUT_S", 10.0, parse=number(0.1),
        doc="seconds to wait for the session registry's answer (then CONNACK Server unavailable)")
    write_buffer_high: int = env(
        "MQTT_WRITE_BUFFER_HIGH", 256 * 1024, parse=integer(1024),
        doc="per-connection socket write buffer above which QoS 0 deliveries are dropped")
    write_buffer_limit: int = env(
        "MQTT_WRITE_BUFFER_LIMIT", 8 * 1024 * 1024, parse=integer(1024),
        doc="per-connection socket write buffer above which the client is disconnected")
    write_stall_timeout_s: float = env(
        "MQTT_WRITE_STALL_TIMEOUT_S", 60.0, parse=number(0.1),
        doc="seconds a client may keep its socket write buffer above the high-water mark before it is "
            "disconnected")
    inbound_queue_max: int = env(
        "MQTT_INBOUND_QUEUE_MAX", 1000, parse=integer(1),
        doc="decoded packets waiting per connection before reading from its socket pauses")
    inbound_buffer_bytes: int = env(
        "MQTT_INBOUND_BUFFER_BYTES", 1024 * 1024, parse=integer(1024),
        doc="bytes received and not yet processed per connection before reading from its socket pauses "
            "(what one connection can hold: this, plus one read and one partial packet)")
    max_connections: int = env(
        "MQTT_MAX_CONNECTIONS", 100_000, parse=integer(1),
        doc="open connections per connector; a connection over it is closed at once, before CONNECT")
    connect_rate_per_ip: float = env(
        "MQTT_CONNECT_RATE_PER_IP", 200.0, parse=number(0),
        doc="new connections per second from one IP address (token bucket, burst MQTT_CONNECT_BURST_PER_IP); "
            "more are closed at once, before CONNECT; 0 = no limit")
    connect_burst_per_ip: int = env(
        "MQTT_CONNECT_BURST_PER_IP", 1000, parse=integer(1),
        doc="connections one IP address may open at once before MQTT_CONNECT_RATE_PER_IP applies")
    login_failures_per_ip: int = env(
        "MQTT_LOGIN_FAILURES_PER_IP", 20, parse=integer(0),
        doc="failed logins (CONNACK 0x86: a bad password, token or certificate) one IP address may have in "
            "MQTT_LOGIN_FAILURES_WINDOW_S (a token bucket refilled over the window); the one that uses it up "
            "bans the address for MQTT_LOGIN_BAN_S: its CONNECTs get 0x8A Banned (3.x: 5); 0 = no limit")
    login_failures_window_s: float = env(
        "MQTT_LOGIN_FAILURES_WINDOW_S", 60.0, parse=number(1),
        doc="the window MQTT_LOGIN_FAILURES_PER_IP counts over")
    login_ban_s: float = env(
        "MQTT_LOGIN_BAN_S", 60.0, parse=number(1),
        doc="how long an address past MQTT_LOGIN_FAILURES_PER_IP is refused")
    password_check_threads: int = env(
        "MQTT_PASSWORD_CHECK_THREADS", 0, parse=integer(0, 256),
        doc="password checks at once (argon2id, its 4 lanes in parallel: 186 ms of CPU a check on the 2-core "
            "development host): at most that many checks' CPU a flood of CONNECTs with a known user name takes "
            "from the message path; 0 = the host's cores")
    password_checks_max: int = env(
        "MQTT_PASSWORD_CHECKS_MAX", 256, parse=integer(1),
        doc="CONNECTs whose password is being verified or waits for a thread, at most; one more gets CONNACK "
            "0x89 Server busy (3.x: 3, Server unavailable) at once, its password unchecked")
    password_cache_s: float = env(
        "MQTT_PASSWORD_CACHE_S", 3600.0, parse=number(0),
        doc="a password verified is kept this long (a keyed BLAKE2b of it and its stored hash, successes only): a "
            "reconnect with the same password within it is not verified again, so a fleet reconnecting after an "
            "outage costs one check per device; a changed or deleted credential is never answered from it; "
            "0 = every CONNECT is verified")
    password_cache_max: int = env(
        "MQTT_PASSWORD_CACHE_MAX", 100_000, parse=integer(1),
        doc="passwords kept at most (MQTT_PASSWORD_CACHE_S; about 250 bytes each, the one verified longest ago "
            "dropped first)")
    device_persistence_grpc_targets: tuple[str, ...] = device_persistence_targets_env(
        "one forward stream to each instance; a client's stored messages are on the one its id picks")
    app_delivery_grpc_targets: tuple[str, ...] = env(
        "APP_DELIVERY_GRPC_TARGETS", (APP_DELIVERY_GRPC_TARGET,), parse=targets,
        doc="app-delivery gRPC addresses (comma list); a client id is pinned to one by hash")
    stored_page_messages: int = env(
        "CONNECTOR_STORED_PAGE_MESSAGES", 2500, parse=integer(1, 65_534),
        fallback="DEVICE_PERSISTENCE_PAGE_MESSAGES",
        doc="stored messages of a persistent DEVICE client fetched per page (FetchUndelivered) and held per "
            "connection at most; the next page is fetched once a quarter of them is free (acknowledged); when "
            "unset, DEVICE_PERSISTENCE_PAGE_MESSAGES (the name before 2026-11-25)")
    stored_first_page_messages: int = env(
        "CONNECTOR_STORED_FIRST_PAGE_MESSAGES", 250, parse=integer(1, 65_534),
        doc="the first page of a connection asks at most this many stored messages (at most a page): the first "
            "message reaches the client sooner, and the rest of the page is asked for as soon as it arrives")
    stored_page_bytes: int = env(
        "CONNECTOR_STORED_PAGE_BYTES", 1024 * 1024, parse=integer(1024),
        fallback="DEVICE_PERSISTENCE_PAGE_BYTES",
        doc="the same bound in payload bytes (one larger message still comes alone); when unset, "
            "DEVICE_PERSISTENCE_PAGE_BYTES (the name before 2026-11-25)")
    grpc_timeout_s: float = env("GRPC_TIMEOUT_S", 10.0, parse=number(0.1),
                                doc="deadline of unary gRPC calls to device-persistence")
    ack_delay_ms: float = env(
        "DEVICE_ACK_BATCH_DELAY_MS", ACK_DELAY_S * 1000, parse=number(0),
        doc="PUBACK/PUBCOMP of stored DEVICE messages wait at most this long to be sent to "
            "device-persistence together (one batch up a forward stream, or one AcknowledgeMany call)")
    pubrec_delay_ms: float = env(
        "DEVICE_PUBREC_BATCH_DELAY_MS", PUBREC_DELAY_S * 1000, parse=number(0),
        doc="the same for a PUBREC of a stored QoS 2 message, whose mark gates the client's PUBREL (the "
            "batch leaves at the sooner of the two; at most DEVICE_ACK_BATCH_DELAY_MS)")
    ack_batch_max: int = env(
        "DEVICE_ACK_BATCH_MAX", ACK_BATCH_MAX, parse=integer(1, 100_000),
        doc="acknowledgements per batch, at most (a full batch goes at once)")
    ack_max_calls: int = env(
        "DEVICE_ACK_MAX_CALLS", ACK_MAX_CALLS, parse=integer(1, 1000),
        doc="acknowledgement batches in flight at once (of them at most one with PUBRECs, which keep their "
            "order); more acknowledgements wait for the next one")
    fetch_window_ms: float = fetch_window_env("CONNECTOR_FETCH_WINDOW_MS", "tbmq.msg.downlink.basic.<svc>")
    producer_linger_ms: float = env(
        "CONNECTOR_PRODUCER_LINGER_MS", PRODUCER_LINGER_MS, parse=number(0),
        doc="adaptive linger of the PUBLISHes produced to tbmq.msg.all (ms): from 300 PUBLISHes a second (down "
            "to 100) a batch waits up to this long so one produce request carries the PUBLISHes of the window; "
            "slower, 1 ms (0 = always 1 ms); the window of tbmq.msg.all, which the router fetches at once "
            "(ROUTER_FETCH_WINDOW_MS 0); tbmq_platform.coalesce.AdaptiveLinger")
    delivery_slice: int = env(
        "CONNECTOR_DELIVERY_SLICE", 256, parse=integer(1),
        doc="downlink records delivered before the event loop serves the connections again (a large "
            "poll does not hold PUBACKs back)")
    retained_wait_ms: float = env(
        "CONNECTOR_RETAINED_WAIT_MS", 5000.0, parse=number(0),
        doc="at SUBSCRIBE, how long the retained view may take to reach tbmq.msg.retained's end before the "
            "retained messages are sent (then logged, and sent from what it holds); 0 = do not wait")
    heartbeat_interval_ms: int = env(
        "CONNECTOR_HEARTBEAT_INTERVAL_MS", 3000, parse=integer(50),
        doc="period of this connector's heartbeat on tbmq.connector.heartbeat; the session registry declares a "
            "connector dead after TBMQ_CONNECTOR_TIMEOUT_MS without one (keep this a third of it at most)")
    sys_interval_s: float = env(
        "MQTT_SYS_INTERVAL_S", 10.0, parse=number(0),
        doc="period of the $SYS/broker/... statistics (retained, cluster-wide; published by one connector: "
            "tbmq_connection.systopics); 0 = none")
    trace_spans: bool = trace_spans_env("CONNECTOR_TRACE_SPANS", "the per-message spans (mqtt.publish, mqtt.deliver*)")

    @property
    def instance_id(self) -> str:
        if self.service_id_from_hostname:
            return socket.gethostname()
        return self.service_id or "connector-1"

    @property
    def allow_anonymous(self) -> bool:
        """MQTT_ALLOW_ANONYMOUS, or when unset: every listener that is on binds loopback."""
        if self.allow_anonymous_setting is not None:
            return self.allow_anonymous_setting
        return anonymous_default(li.host for li in self.listeners())

    def listeners(self) -> list[Listener]:
        """The listeners that are on, in a fixed order (mqtt, mqtts, ws, wss)."""
        out = []
        auto = TLS_PORT if self.tls_cert_file else 0, WSS_PORT if self.tls_cert_file else 0
        tls_port = auto[0] if self.mqtt_tls_port == WITH_CERTIFICATE else self.mqtt_tls_port
        wss_port = auto[1] if self.mqtt_wss_port == WITH_CERTIFICATE else self.mqtt_wss_port
        for name, p, host, tls, ws in (
                ("mqtt", self.mqtt_port, "", False, False),
                ("mqtts", tls_port, self.mqtt_tls_bind_host, True, False),
                ("ws", self.mqtt_ws_port, self.mqtt_ws_bind_host, False, True),
                ("wss", wss_port, self.mqtt_wss_bind_host, True, True)):
            if p:
                out.append(Listener(name, host or self.mqtt_bind_host, p, tls, ws))
        return out

    def server_ssl_context(self) -> ssl.SSLContext:
        """The TLS/WSS listeners' context: TLS 1.2+, the server certificate, and client certificates verified
        against MQTT_TLS_CA_FILE as MQTT_TLS_CLIENT_AUTH says, and against MQTT_TLS_CRL_FILE's revocation lists
        when it is set (the client's own certificate; OpenSSL's X509_V_FLAG_CRL_CHECK). Raises
        OSError/ssl.SSLError/ValueError on a bad file."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        if self.tls_ca_file:
            ctx.load_verify_locations(cafile=self.tls_ca_file)
        if self.tls_crl_file:
            check_crl_file(self.tls_crl_file)
            ctx.load_verify_locations(cafile=self.tls_crl_file)
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        ctx.verify_mode = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
                           "required": ssl.CERT_REQUIRED}[self.tls_client_auth]
        return ctx

    def tls_files(self) -> tuple[str, ...]:
        """The files server_ssl_context reads."""
        return tuple(f for f in (self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_crl_file) if f)

    def _listener_problems(self) -> list[str]:
        problems = []
        on = self.listeners()
        if not on:
            problems.append("every MQTT listener is off (MQTT_PORT, MQTT_TLS_PORT, MQTT_WS_PORT, MQTT_WSS_PORT): "
                            "turn at least one on")
        seen: dict[tuple[str, int], str] = {}
        for li in on:
            if (li.host, li.port) in seen:
                problems.append(f"{li.variable} and {seen[(li.host, li.port)]} both bind {li.host}:{li.port}")
            seen[(li.host, li.port)] = li.variable
        off = [n for n in self.proxy_protocol if n not in {li.name for li in on}]
        if off:
            problems.append(f"MQTT_PROXY_PROTOCOL names listeners that are off: {', '.join(off)}")
        if not self.mqtt_ws_path.startswith("/"):
            problems.append(f"MQTT_WS_PATH={self.mqtt_ws_path!r} must start with /")
        tls_on = [li for li in on if li.tls]
        if not tls_on:
            return problems
        who = " and ".join(f"{li.variable}={li.port}" for li in tls_on)
        files_ok = True
        for var, path in (("MQTT_TLS_CERT_FILE", self.tls_cert_file), ("MQTT_TLS_KEY_FILE", self.tls_key_file)):
            if not path:
                problems.append(f"{who} needs {var} (a TLS listener needs a certificate and its key; "
                                f"or set the port to 0: off)")
                files_ok = False
            elif not os.path.isfile(path):
                problems.append(f"{var}={path!r}: no such file")
                files_ok = False
        if self.tls_client_auth != "none" and not self.tls_ca_file:
            problems.append(f"MQTT_TLS_CLIENT_AUTH={self.tls_client_auth} needs MQTT_TLS_CA_FILE (the CA that signs "
                            "client certificates)")
            files_ok = False
        elif self.tls_ca_file and not os.path.isfile(self.tls_ca_file):
            problems.append(f"MQTT_TLS_CA_FILE={self.tls_ca_file!r}: no such file")
            files_ok = False
        if self.tls_crl_file and self.tls_client_auth == "none":
            problems.append("MQTT_TLS_CRL_FILE is set but MQTT_TLS_CLIENT_AUTH=none asks for no client certificate "
                            "to check: set it to optional or required, or unset the CRL file")
        elif self.tls_crl_file and not os.path.isfile(self.tls_crl_file):
            problems.append(f"MQTT_TLS_CRL_FILE={self.tls_crl_file!r}: no such file")
            files_ok = False
        if files_ok:
            try:
                self.server_ssl_context()
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                problems.append(f"MQTT_TLS_CERT_FILE/MQTT_TLS_KEY_FILE/MQTT_TLS_CA_FILE/MQTT_TLS_CRL_FILE cannot be "
                                f"loaded: {exc}")
        return problems

    @property
    def jwks_url(self) -> bool:
        return is_http_url(self.jwt_jwks)

    def jwks_verifier(self, document: bytes) -> JwtVerifier:
        return JwtVerifier(jwks=document, audience=self.jwt_audience, issuer=self.jwt_issuer)

    def token_verifier(self) -> JwtVerifier | PendingKeys | None:
        """The `jwt` provider's verifier at start-up (None when the provider is off; PendingKeys for a JWKS URL,
        fetched once the connector runs). Raises OSError / ValueError."""
        if JWT not in self.auth_providers:
            return None
        if self.jwt_jwks:
            if self.jwks_url:
                return PendingKeys()
            with open(self.jwt_jwks, "rb") as f:
                return self.jwks_verifier(f.read())
        if self.jwt_public_key_file:
            with open(self.jwt_public_key_file, "rb") as f:
                pem = f.read()
            return JwtVerifier(public_key_pem=pem, audience=self.jwt_audience, issuer=self.jwt_issuer)
        return JwtVerifier(secret=self.jwt_secret.encode(), audience=self.jwt_audience, issuer=self.jwt_issuer)

    def _http_auth_problems(self) -> list[str]:
        if HTTP not in self.auth_providers:
            return [f"{v} is set but MQTT_AUTH_PROVIDERS has no http" for v, on in (
                ("MQTT_AUTH_HTTP_URL", self.http_auth_url),
                ("MQTT_AUTH_HTTP_AUTHORIZATION", self.http_auth_authorization),
                ("MQTT_AUTH_HTTP_CA_FILE", self.http_auth_ca_file),
                ("MQTT_AUTH_HTTP_CACHE_S", self.http_auth_cache_s)) if on]
        problems = []
        if not is_http_url(self.http_auth_url):
            problems.append("MQTT_AUTH_PROVIDERS has http: MQTT_AUTH_HTTP_URL must be an http(s) URL"
                            + (f" (not {self.http_auth_url!r})" if self.http_auth_url else ""))
        return problems + _ca_file_problems("MQTT_AUTH_HTTP_CA_FILE", self.http_auth_ca_file)

    def _jwt_problems(self) -> list[str]:
        keys = [v for v, on in (("MQTT_AUTH_JWT_SECRET", self.jwt_secret),
                                ("MQTT_AUTH_JWT_PUBLIC_KEY_FILE", self.jwt_public_key_file),
                                ("MQTT_AUTH_JWT_JWKS", self.jwt_jwks)) if on]
        if JWT not in self.auth_providers:
            return [f"{v} is set but MQTT_AUTH_PROVIDERS has no jwt" for v in keys
                    + (["MQTT_AUTH_JWT_JWKS_CA_FILE"] if self.jwt_jwks_ca_file else [])]
        problems = _ca_file_problems("MQTT_AUTH_JWT_JWKS_CA_FILE", self.jwt_jwks_ca_file)
        if self.jwt_jwks_ca_file and not self.jwks_url:
            problems.append("MQTT_AUTH_JWT_JWKS_CA_FILE is set but MQTT_AUTH_JWT_JWKS is not an http(s) URL")
        if len(keys) != 1:
            return problems + ["MQTT_AUTH_PROVIDERS has jwt: set one of MQTT_AUTH_JWT_SECRET, "
                               "MQTT_AUTH_JWT_PUBLIC_KEY_FILE and MQTT_AUTH_JWT_JWKS"
                               + (f" (not {len(keys)})" if keys else "")]
        try:
            self.token_verifier()
        except (OSError, ValueError) as exc:
            problems.append(f"{keys[0]}: {exc}")
        return problems

    def validate(self) -> list[str]:
        problems = super().validate()
        problems.extend(self._listener_problems())
        problems.extend(self._jwt_problems())
        problems.extend(self._http_auth_problems())
        if self.write_buffer_limit < self.write_buffer_high:
            problems.append("MQTT_WRITE_BUFFER_LIMIT must be >= MQTT_WRITE_BUFFER_HIGH")
        return problems


@dataclass(frozen=True)
class Listener:
    """One MQTT listener that is on: `name` mqtt (TCP), mqtts (TLS), ws (WebSocket) or wss (WebSocket over
    TLS)."""

    name: str
    host: str
    port: int
    tls: bool
    websocket: bool

    @property
    def variable(self) -> str:
        """The port's setting."""
        return {"mqtt": "MQTT_PORT", "mqtts": "MQTT_TLS_PORT", "ws": "MQTT_WS_PORT", "wss": "MQTT_WSS_PORT"}[self.name]


def _ca_file_problems(name: str, path: str) -> list[str]:
    """A CA file (PEM) an https client verifies its server with: loadable, or why not (empty path: the
    system's CAs)."""
    if not path:
        return []
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ValueError) as exc:
        return [f"{name}={path!r}: {exc}"]
    return []


__all__ = ["ConnectorSettings", "Listener"]
