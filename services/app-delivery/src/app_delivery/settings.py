"""app-delivery settings: environment variables parsed once (tbmq_platform.settings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tbmq_platform.settings import (APP_DELIVERY_GRPC_PORT, CommonSettings, env, fetch_window_env, integer, load,
                                    load_or_exit, number, port, trace_spans_env)


@dataclass(frozen=True)
class AppDeliverySettings(CommonSettings):
    service_name: str = "app-delivery"
    health_port: int = env("HEALTH_PORT", 8085, parse=port, doc="health/readiness HTTP port (0 = any)")

    grpc_port: int = env("APP_DELIVERY_GRPC_PORT", APP_DELIVERY_GRPC_PORT, parse=port, fallback="GRPC_PORT",
                         doc="gRPC port of the AppDelivery service (0 = any free port); when unset, the "
                             "launcher's GRPC_PORT is used")
    grpc_host: str = env("APP_DELIVERY_GRPC_HOST", "0.0.0.0", fallback="GRPC_HOST",
                         doc="gRPC bind address; when unset, GRPC_HOST (the launcher: 127.0.0.1)")
    commit_interval_ms: int = env("APP_DELIVERY_COMMIT_INTERVAL_MS", 500, parse=integer(10, 60_000),
                                  doc="how often a stream commits its acknowledged prefix")
    max_poll_records: int = env("APP_DELIVERY_MAX_POLL_RECORDS", 500, parse=integer(1, 100_000),
                                doc="records fetched per poll; also how far past a polled batch the DUP mark "
                                    "is reserved (docs/app-delivery.md)")
    max_outstanding: int = env("APP_DELIVERY_MAX_OUTSTANDING", 65535, parse=integer(1, 1_000_000),
                               doc="unacknowledged records per stream when AppOpen.receive_maximum is 0; "
                                   "also the upper cap of receive_maximum")
    batch_max_bytes: int = env("APP_DELIVERY_BATCH_MAX_BYTES", 1 << 20, parse=integer(1024, 64 << 20),
                               doc="bytes of records per AppRecordBatch message, about (a larger single "
                                   "record goes alone); records per batch are bounded by the free window")
    fetch_window_ms: float = fetch_window_env("APP_DELIVERY_FETCH_WINDOW_MS",
                                              "the per-client consumers (tbmq.msg.app.*)")
    trace_spans: bool = trace_spans_env("APP_DELIVERY_TRACE_SPANS", "the per-record span (app-delivery deliver)")
    shared_session_timeout_ms: int = env(
        "APP_DELIVERY_SHARED_SESSION_TIMEOUT_MS", 10000, parse=integer(6000, 300_000),
        doc="Kafka session timeout of shared-subscription group members (how long a crashed instance "
            "keeps its partitions)")
    shared_heartbeat_ms: int = env("APP_DELIVERY_SHARED_HEARTBEAT_MS", 1000, parse=integer(100, 100_000),
                                   doc="heartbeat interval of shared-subscription group members")
    removed_group: str = env("APP_DELIVERY_REMOVED_GROUP", "app-delivery",
                             doc="consumer group of tbmq.sys.app.removed")
    shutdown_grace_s: float = env("APP_DELIVERY_SHUTDOWN_GRACE_S", 5.0, parse=number(0),
                                  doc="seconds given to open streams to finish at shutdown")

    def validate(self) -> list[str]:
        problems = super().validate()
        if self.shared_heartbeat_ms * 3 > self.shared_session_timeout_ms:
            problems.append("APP_DELIVERY_SHARED_HEARTBEAT_MS must be at most a third of "
                            "APP_DELIVERY_SHARED_SESSION_TIMEOUT_MS")
        return problems


def load_settings(environ: Mapping[str, str] | None = None, **overrides) -> AppDeliverySettings:
    return load(AppDeliverySettings, environ, **overrides)


def load_settings_or_exit(environ: Mapping[str, str] | None = None) -> AppDeliverySettings:
    return load_or_exit(AppDeliverySettings, environ)
