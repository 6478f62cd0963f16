"""Connector settings: environment variables parsed once (tbmq_platform.settings)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from tbmq_platform.settings import CommonSettings, boolean, env, fetch_window_env, host_ports, integer, number, port

MAX_VBI = 268_435_455


@dataclass(frozen=True)
class ConnectorSettings(CommonSettings):
    service_name: str = "connector"
    health_port: int = env("HEALTH_PORT", 8081, parse=port, doc="health/readiness HTTP port (0 = any)")
    service_id_from_hostname: bool = env(
        "TBMQ_SERVICE_ID_FROM_HOSTNAME", False, parse=boolean,
        doc="use the host name as TBMQ_SERVICE_ID (compose scaling); wins over TBMQ_SERVICE_ID")

    mqtt_port: int = env("MQTT_PORT", 1883, parse=port, doc="MQTT TCP listener port (0 = any free port)")
    mqtt_bind_host: str = env("MQTT_BIND_HOST", "0.0.0.0", doc="MQTT listener bind address")
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
    device_persistence_grpc_targets: tuple[str, ...] = env(
        "DEVICE_PERSISTENCE_GRPC_TARGETS", ("localhost:50061",), parse=host_ports,
        fallback="DEVICE_PERSISTENCE_GRPC_TARGET",
        doc="device-persistence gRPC addresses (comma list; one forward stream to each instance); when "
            "unset, DEVICE_PERSISTENCE_GRPC_TARGET")
    app_delivery_grpc_targets: tuple[str, ...] = env(
        "APP_DELIVERY_GRPC_TARGETS", ("localhost:50062",), parse=host_ports,
        doc="app-delivery gRPC addresses (comma list); a client id is pinned to one by hash")
    grpc_timeout_s: float = env("GRPC_TIMEOUT_S", 10.0, parse=number(0.1),
                                doc="deadline of unary gRPC calls to device-persistence")
    ack_delay_ms: float = env(
        "DEVICE_ACK_BATCH_DELAY_MS", 10.0, parse=number(0),
        doc="PUBACK/PUBCOMP/PUBREC of stored DEVICE messages wait at most this long to be sent to "
            "device-persistence together (one batch up a forward stream, or one AcknowledgeMany call)")
    ack_batch_max: int = env(
        "DEVICE_ACK_BATCH_MAX", 2000, parse=integer(1, 100_000),
        doc="acknowledgements per batch, at most (a full batch goes at once)")
    ack_max_calls: int = env(
        "DEVICE_ACK_MAX_CALLS", 4, parse=integer(1, 1000),
        doc="acknowledgement batches in flight at once; more acknowledgements wait for the next one")
    fetch_window_ms: float = fetch_window_env("CONNECTOR_FETCH_WINDOW_MS", "tbmq.msg.downlink.basic.<svc>")
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
    trace_spans: bool = env(
        "CONNECTOR_TRACE_SPANS", False, parse=boolean,
        doc="create the per-message spans (mqtt.publish, mqtt.deliver*) even without an OTLP endpoint")

    @property
    def instance_id(self) -> str:
        if self.service_id_from_hostname:
            return socket.gethostname()
        return self.service_id or "connector-1"

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.write_buffer_limit < self.write_buffer_high:
            problems.append("MQTT_WRITE_BUFFER_LIMIT must be >= MQTT_WRITE_BUFFER_HIGH")
        if not self.app_delivery_grpc_targets:
            problems.append("APP_DELIVERY_GRPC_TARGETS must name at least one target")
        if not self.device_persistence_grpc_targets:
            problems.append("DEVICE_PERSISTENCE_GRPC_TARGETS must name at least one target")
        return problems


__all__ = ["ConnectorSettings"]
