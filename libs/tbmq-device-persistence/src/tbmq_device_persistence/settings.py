"""device-persistence settings: environment variables parsed once (tbmq_platform.settings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tbmq_platform.settings import (
    DEVICE_PERSISTENCE_GROUP,
    DEVICE_PERSISTENCE_GRPC_PORT,
    CommonSettings,
    auto_offset_reset_env,
    boolean,
    env,
    fetch_window_env,
    group_session_env,
    host_ports,
    integer,
    load,
    load_or_exit,
    nonempty,
    number,
    port,
    trace_spans_env,
)

from .store import MAX_HANDED_OUT_LIMIT, MAX_MESSAGES_LIMIT, StoreConfig

LIMIT_VAR = "MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_MESSAGES_LIMIT"
TTL_VAR = "MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_MESSAGES_TTL"
BYTES_LIMIT_VAR = "MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_BYTES_LIMIT"


@dataclass(frozen=True)
class DevicePersistenceSettings(CommonSettings):
    service_name: str = "device-persistence"
    health_port: int = env("HEALTH_PORT", 8087, parse=port, doc="health/readiness HTTP port (0 = any)")

    grpc_port: int = env("DEVICE_PERSISTENCE_GRPC_PORT", DEVICE_PERSISTENCE_GRPC_PORT, parse=port,
                         fallback="GRPC_PORT",
                         doc="gRPC port of the DevicePersistence service (0 = any free port); when unset, "
                             "the launcher's GRPC_PORT is used")
    grpc_host: str = env("DEVICE_PERSISTENCE_GRPC_HOST", "0.0.0.0", fallback="GRPC_HOST",
                         doc="gRPC bind address; when unset, GRPC_HOST (the launcher: 127.0.0.1)")
    redis_url: str = env("REDIS_URL", "redis://localhost:6380/0", parse=nonempty,
                         doc="standalone Redis, redis://[:password@]host:port/db (ignored when "
                             "REDIS_CLUSTER_NODES is set)")
    redis_password: str = env("REDIS_PASSWORD", "",
                              doc="Redis password (AUTH; requirepass); wins over one in REDIS_URL; also used "
                                  "for every REDIS_CLUSTER_NODES node")
    redis_cluster_nodes: tuple[str, ...] = env("REDIS_CLUSTER_NODES", (), parse=host_ports,
                                               doc="comma list of host:port; set = Redis Cluster mode")
    redis_key_prefix: str = env("DEVICE_PERSISTENCE_REDIS_KEY_PREFIX", "",
                                doc="prefix of every Redis key (no braces)")
    redis_socket_timeout_ms: int = env("REDIS_SOCKET_TIMEOUT_MS", 10_000, parse=integer(100, 600_000),
                                       doc="a Redis call without an answer for this long fails (and is "
                                           "retried) instead of hanging; connects time out at half of it")
    messages_limit: int = env(LIMIT_VAR, MAX_MESSAGES_LIMIT, parse=integer(1, MAX_MESSAGES_LIMIT),
                              doc=f"stored messages kept per client (oldest trimmed), 1..{MAX_MESSAGES_LIMIT}")
    bytes_limit: int = env(BYTES_LIMIT_VAR, 256 * 1024 * 1024, parse=integer(1024),
                           doc="stored bytes kept per client (oldest trimmed), at least 1024")
    handed_out_limit: int = env("DEVICE_PERSISTENCE_HANDED_OUT_LIMIT", 20000,
                                parse=integer(1, MAX_HANDED_OUT_LIMIT),
                                doc="packet ids in use per client (handed out, unacknowledged); at this "
                                    "many a live client stops getting forwards and pages again")
    messages_ttl_s: int = env(TTL_VAR, 604800, parse=integer(1),
                              doc="TTL (s) of a stored message without an MQTT 5 message expiry")
    group_id: str = env("DEVICE_PERSISTENCE_GROUP_ID", DEVICE_PERSISTENCE_GROUP, parse=nonempty,
                        doc="consumer group of tbmq.msg.persisted")
    session_timeout_s: float = group_session_env("DEVICE_PERSISTENCE_SESSION_TIMEOUT_S", 10.0, "tbmq.msg.persisted")
    auto_offset_reset: str = auto_offset_reset_env("DEVICE_PERSISTENCE_AUTO_OFFSET_RESET", "tbmq.msg.persisted")
    save_attempts: int = env("DEVICE_PERSISTENCE_SAVE_ATTEMPTS", 5, parse=integer(1, 1000),
                             doc="attempts of a batch's save that Redis refuses for a client's data (a key of "
                                 "another type, an error inside a script) before each client is saved apart "
                                 "and the copies still refused go to tbmq.msg.persisted.dead; errors of Redis "
                                 "itself (down, OOM, LOADING, ...) are retried without end")
    max_poll_records: int = env("DEVICE_PERSISTENCE_MAX_POLL_RECORDS", 2000, parse=integer(1, 100_000),
                                doc="records per batch (getmany): one save_many + one commit per batch")
    commit_interval_ms: float = env("DEVICE_PERSISTENCE_COMMIT_INTERVAL_MS", 100.0, parse=number(0),
                                    doc="saved batches' offsets are committed together at most this often "
                                        "(0 = after every batch); always before a rebalance and at stop")
    fetch_window_ms: float = fetch_window_env("DEVICE_PERSISTENCE_FETCH_WINDOW_MS", "tbmq.msg.persisted")
    forward_queue_bytes: int = env("DEVICE_PERSISTENCE_FORWARD_QUEUE_BYTES", 16 * 1024 * 1024,
                                   parse=integer(1024),
                                   doc="bytes of forwards waiting per connector stream; more ends that "
                                       "stream (the connector reopens it and re-fetches; the messages "
                                       "are in Redis)")
    forward_flush_s: float = env("DEVICE_PERSISTENCE_FORWARD_FLUSH_S", 5.0, parse=number(0),
                                 doc="before partitions are revoked, streams get this long to send what "
                                     "they have queued; a stream that does not is ended")
    shutdown_grace_s: float = env("DEVICE_PERSISTENCE_SHUTDOWN_GRACE_S", 5.0, parse=number(0),
                                  doc="gRPC calls in progress get this long to finish at shutdown")
    trace_spans: bool = trace_spans_env("DEVICE_PERSISTENCE_TRACE_SPANS", "the per-batch span (device-persistence.save)")
    held: bool = env("DEVICE_PERSISTENCE_HELD", True, parse=boolean,
                     doc="held forwards (docs/device-persistence.md, 'Held forwards'): a live client's QoS 1 copies that come over a Persist "
                         "stream are forwarded from memory and written to Redis only when not acknowledged in "
                         "DEVICE_PERSISTENCE_HELD_MS")
    held_ms: int = env("DEVICE_PERSISTENCE_HELD_MS", 500, parse=integer(150, 60_000),
                       doc="a held copy not acknowledged this long is written to Redis (the connector sends its "
                           "acknowledgements every 100 ms)")
    held_block: int = env("DEVICE_PERSISTENCE_HELD_BLOCK", 1000, parse=integer(1, MAX_HANDED_OUT_LIMIT),
                          doc="serials and packet ids reserved in Redis per held client at a time (one Redis call "
                              "per block); DEVICE_PERSISTENCE_HANDED_OUT_LIMIT when that is smaller")
    held_client_bytes: int = env("DEVICE_PERSISTENCE_HELD_CLIENT_BYTES", 1024 * 1024, parse=integer(1024),
                                 doc="bytes of copies held per client; beyond it the client's copies are saved "
                                     "as without holding; the stored bytes limit when that is smaller")
    held_total_bytes: int = env("DEVICE_PERSISTENCE_HELD_TOTAL_BYTES", 64 * 1024 * 1024, parse=integer(1024),
                                doc="bytes of copies held by this instance in all")

    def validate(self) -> list[str]:
        problems = super().validate()
        try:
            self.store_config()
        except ValueError as exc:
            return [*problems, str(exc)]
        return problems

    def store_config(self) -> StoreConfig:
        return StoreConfig(redis_url=self.redis_url, cluster_nodes=self.redis_cluster_nodes,
                           redis_password=self.redis_password or None,
                           messages_limit=self.messages_limit, messages_ttl_s=self.messages_ttl_s,
                           bytes_limit=self.bytes_limit, handed_out_limit=self.handed_out_limit,
                           key_prefix=self.redis_key_prefix,
                           socket_timeout_s=self.redis_socket_timeout_ms / 1000,
                           connect_timeout_s=self.redis_socket_timeout_ms / 2000)


def load_settings(environ: Mapping[str, str] | None = None, **overrides) -> DevicePersistenceSettings:
    return load(DevicePersistenceSettings, environ, **overrides)


def load_settings_or_exit(environ: Mapping[str, str] | None = None) -> DevicePersistenceSettings:
    return load_or_exit(DevicePersistenceSettings, environ)
