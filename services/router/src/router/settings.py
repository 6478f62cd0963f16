"""Settings of the router (environment variables, parsed once)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from tbmq_platform.settings import (ROUTER_GROUP, CommonSettings, auto_offset_reset_env, choice,
                                   device_persistence_targets_env, env, fetch_window_env, group_session_env, integer,
                                   nonempty, number, port, trace_spans_env)


def _default_data_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "tbmq-router")


@dataclass(frozen=True)
class RouterSettings(CommonSettings):
    service_name: str = "router"
    health_port: int = env("HEALTH_PORT", 8082, parse=port, doc="health/readiness HTTP port (0 = any)")

    group_id: str = env("ROUTER_GROUP_ID", ROUTER_GROUP, parse=nonempty,
                        doc="Faust app id = Kafka consumer group of tbmq.msg.all (change only for tests/"
                            "benchmarks: every router instance of a cluster must use the same one)")
    data_dir: str = env("ROUTER_DATA_DIR", "", doc="Faust data directory (default <tmp>/tbmq-router/"
                                                   "<service id>); nothing durable is kept there")
    max_inflight: int = env("ROUTER_MAX_INFLIGHT", 5000, parse=integer(1),
                            doc="tbmq.msg.all records routed but not yet acknowledged by Kafka; the agent "
                                "waits at this level before taking the next batch")
    max_poll_records: int = env("ROUTER_MAX_POLL_RECORDS", 2000, parse=integer(1),
                                doc="tbmq.msg.all records fetched per poll, at most: the largest batch "
                                    "the agent routes at once")
    queued_batches: int = env("ROUTER_QUEUED_BATCHES", 4, parse=integer(1),
                              doc="fetched batches waiting for the agent, at most")
    commit_interval_s: float = env("ROUTER_COMMIT_INTERVAL_S", 1.0, parse=number(0.05),
                                   doc="how often acknowledged offsets are committed (s)")
    linger_ms: int = env("ROUTER_PRODUCER_LINGER_MS", 1, parse=integer(0),
                         doc="producer linger (ms): how long records wait to be batched per partition "
                             "(more batch while a request is in flight)")
    # 0: the connector's producer holds the window of tbmq.msg.all (tbmq_platform.settings.PRODUCER_LINGER_MS)
    fetch_window_ms: float = fetch_window_env("ROUTER_FETCH_WINDOW_MS", "tbmq.msg.all")
    consumer_in_loop: bool = env(
        "ROUTER_CONSUMER_IN_LOOP", True,
        doc="run Faust's Kafka consumer on the worker's event loop instead of a thread of its own "
            "(no cross-thread hand-over per poll; docs/router.md, Batches)")
    session_timeout_s: float = group_session_env("ROUTER_SESSION_TIMEOUT_S", 10.0, "tbmq.msg.all", most_s=90.0,
                                                 why_most="Faust's broker_request_timeout")
    trace_spans: bool = trace_spans_env("ROUTER_TRACE_SPANS", "a routing span per message")
    rebuild_timeout_s: float = env("ROUTER_REBUILD_TIMEOUT_S", 120.0, parse=number(1),
                                   doc="start-up fails if the state topics are not read within this time")
    auto_offset_reset: str = auto_offset_reset_env("ROUTER_AUTO_OFFSET_RESET", "tbmq.msg.all")

    persist_via: str = env(
        "ROUTER_PERSIST_VIA", "grpc", parse=choice("grpc", "local", "kafka"),
        doc="how the stored copies for persistent DEVICE clients reach device-persistence: grpc = its Persist "
            "streams (each batch answered once saved in Redis; docs/router.md), local = this process runs a "
            "device-persistence instance itself (its DEVICE_PERSISTENCE_* settings, its gRPC API for the "
            "connectors and the session registry) and saves the copies of the clients it is the target of "
            "without a stream, the others' over Persist streams, kafka = through tbmq.msg.persisted (one more "
            "Kafka hop per message)")
    device_persistence_grpc_targets: tuple[str, ...] = device_persistence_targets_env(
        "with ROUTER_PERSIST_VIA=grpc or local, a client's stored copies go to one of them, picked by its id")
    local_target: str = env(
        "ROUTER_LOCAL_TARGET", "",
        doc="with ROUTER_PERSIST_VIA=local: this process's own device-persistence instance as it is named in "
            "DEVICE_PERSISTENCE_GRPC_TARGETS (empty = the list's only entry)")

    def validate(self):
        yield from super().validate()
        if self.persist_via == "local" and self.own_target is None:
            yield (f"ROUTER_LOCAL_TARGET={self.local_target!r}: with ROUTER_PERSIST_VIA=local it must be one of "
                   f"DEVICE_PERSISTENCE_GRPC_TARGETS ({','.join(self.device_persistence_grpc_targets)})"
                   if self.local_target else
                   "ROUTER_LOCAL_TARGET: with ROUTER_PERSIST_VIA=local and more than one of "
                   "DEVICE_PERSISTENCE_GRPC_TARGETS, name the one this process is")

    @property
    def faust_data_dir(self) -> str:
        return self.data_dir or os.path.join(_default_data_dir(), self.instance_id)

    @property
    def own_target(self) -> str | None:
        """With ROUTER_PERSIST_VIA=local, the entry of DEVICE_PERSISTENCE_GRPC_TARGETS this process serves."""
        targets = self.device_persistence_grpc_targets
        if self.local_target:
            return self.local_target if self.local_target in targets else None
        return targets[0] if len(targets) == 1 else None
