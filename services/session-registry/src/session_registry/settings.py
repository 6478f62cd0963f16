"""Settings of the session registry (environment variables, parsed once)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tbmq_platform.settings import (DEVICE_PERSISTENCE_GRPC_TARGET, SESSION_REGISTRY_GROUP, CommonSettings, env,
                                   group_session_env, integer, nonempty, port)

NEVER_EXPIRES = 0xFFFFFFFF


def _regex(raw: str) -> str:
    raw = raw.strip()
    if raw:
        try:
            re.compile(raw)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
    return raw


@dataclass(frozen=True)
class SessionRegistrySettings(CommonSettings):
    service_name: str = "session-registry"
    health_port: int = env("HEALTH_PORT", 8086, parse=port, doc="health/readiness HTTP port (0 = any)")

    session_expiry_max: int = env(
        "MQTT_CLIENT_SESSION_EXPIRY_MAX_EXPIRY_INTERVAL", 604800, parse=integer(0, NEVER_EXPIRES),
        doc="cap (s) on the Session Expiry Interval; also the expiry of 3.x clean-session=false sessions; "
            "4294967295 lets 0xFFFFFFFF (never) through; 0 makes every session end at disconnect")
    application_client_id_pattern: str = env(
        "TBMQ_APPLICATION_CLIENT_ID_PATTERNS", "", parse=_regex,
        doc="regex (full match) on the client id that makes a client APPLICATION; empty = none")
    application_username_pattern: str = env(
        "TBMQ_APPLICATION_USERNAME_PATTERNS", "", parse=_regex,
        doc="regex (full match) on the username that makes a client APPLICATION; empty = none")
    sessions_limit: int = env("MQTT_SESSIONS_LIMIT", 0, parse=integer(0),
                              doc="maximum number of sessions (0 = unlimited)")
    application_clients_limit: int = env("MQTT_APPLICATION_CLIENTS_LIMIT", 0, parse=integer(0),
                                         doc="maximum number of APPLICATION sessions (0 = unlimited)")
    device_persistence_target: str = env("DEVICE_PERSISTENCE_GRPC_TARGET", DEVICE_PERSISTENCE_GRPC_TARGET,
                                         parse=nonempty,
                                         doc="gRPC address of device-persistence (DevicePersistence.Clear)")
    device_clear_timeout_ms: int = env(
        "DEVICE_PERSISTENCE_CLEAR_TIMEOUT_MS", 5000, parse=integer(100),
        doc="how long a CONNECT retries DevicePersistence.Clear before it is answered SERVER_UNAVAILABLE")
    expiry_check_interval_ms: int = env("TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS", 5000, parse=integer(50),
                                        doc="period of the session expiry scan")
    request_max_age_ms: int = env(
        "TBMQ_SESSION_REQUEST_MAX_AGE_MS", 120000, parse=integer(0),
        doc="a CONNECTION_REQUEST older than this is answered SERVER_UNAVAILABLE unprocessed (0 = no limit)")
    batch_max_records: int = env("TBMQ_SESSION_REGISTRY_BATCH_MAX_RECORDS", 500, parse=integer(1),
                                 doc="requests per poll (each partition's share is one transaction)")
    transactional_id_prefix: str = env(
        "TBMQ_SESSION_REGISTRY_TRANSACTIONAL_ID_PREFIX", "session-registry", parse=nonempty,
        doc="transactional ids are <prefix>-p<request partition>: stable per partition, shared by instances")
    connector_timeout_ms: int = env(
        "TBMQ_CONNECTOR_TIMEOUT_MS", 15000, parse=integer(100),
        doc="a connector silent (no heartbeat on tbmq.connector.heartbeat) this long is declared dead: its "
            "sessions end as on a lost connection and its clients' Wills are published; keep it well above "
            "the connectors' CONNECTOR_HEARTBEAT_INTERVAL_MS (3 x at least)")
    connector_topics_retention_ms: int = env(
        "TBMQ_CONNECTOR_TOPICS_RETENTION_MS", 3_600_000, parse=integer(0),
        doc="the per-connector topics (tbmq.client.session.event.response/.client.disconnect/"
            ".msg.downlink.basic.<svc>) of a connector dead this long are deleted (0 = never)")
    group_id: str = env("TBMQ_SESSION_REGISTRY_GROUP_ID", SESSION_REGISTRY_GROUP, parse=nonempty,
                        doc="consumer group of tbmq.client.session.event.request")
    # the CONNECTs on a dead instance's partitions wait this long (a restart with its id: not at all)
    session_timeout_s: float = group_session_env("TBMQ_SESSION_REGISTRY_SESSION_TIMEOUT_S", 6.0,
                                                 "tbmq.client.session.event.request")
