"""Settings from environment variables, parsed once into a frozen dataclass.

A service declares its settings as a frozen dataclass whose fields carry `env(...)` metadata, and calls
`load(ServiceSettings)` once at start-up. Every bad variable is collected, and start-up stops with one
message naming all of them (`SettingsError`; `exit_on_error` turns it into exit code 2).

    @dataclass(frozen=True)
    class Settings(CommonSettings):
        mqtt_port: int = env("MQTT_PORT", 1883, parse=port)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .topics import PRODUCTION, PROFILES, TopicLayout

T = TypeVar("T")


class SettingsError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid settings: " + "; ".join(problems))


def env(name: str, default: Any, *, parse: Callable[[str], Any] | None = None, doc: str = "",
        fallback: str | None = None) -> Any:
    """A dataclass field read from environment variable `name` (or, when unset, from `fallback`)."""
    return dataclasses.field(default=default, metadata={"env": name, "parse": parse, "doc": doc,
                                                        "fallback": fallback})


# --- parsers: each raises ValueError with a short reason --------------------------------------------

def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise ValueError(f"not an integer: {raw!r}") from None
        if lo is not None and value < lo:
            raise ValueError(f"{value} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise ValueError(f"{value} is above the maximum {hi}")
        return value
    return parse


def number(lo: float | None = None, hi: float | None = None) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"not a number: {raw!r}") from None
        if lo is not None and value < lo:
            raise ValueError(f"{value} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise ValueError(f"{value} is above the maximum {hi}")
        return value
    return parse


port = integer(0, 65535)


def port_or_off(raw: str) -> int:
    """A listener's port: 0 or empty = off."""
    return port(raw) if raw.strip() else 0


def boolean(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {raw!r} (use true/false)")


def choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in options:
            raise ValueError(f"{raw!r} is not one of {', '.join(options)}")
        return raw
    return parse


def csv(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def host_ports(raw: str) -> tuple[str, ...]:
    items = csv(raw)
    for item in items:
        host, sep, p = item.rpartition(":")
        if not sep or not host or not p.isdigit() or not 0 < int(p) < 65536:
            raise ValueError(f"{item!r} is not host:port")
    return items


def targets(raw: str) -> tuple[str, ...]:
    """A comma list of gRPC targets (host:port), at least one."""
    items = host_ports(raw)
    if not items:
        raise ValueError("must name at least one host:port")
    return items


def fraction(raw: str) -> float:
    value = number(0)(raw)
    if not 0 < value <= 1:
        raise ValueError(f"{value} is not in (0, 1]")
    return value


def nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw.strip()


# The window of tbmq.msg.all is paid once, at the producer: the connector's producer lingers up to
# PRODUCER_LINGER_MS under load (tbmq_platform.coalesce.AdaptiveLinger), so one produce request carries the
# window's PUBLISHes, and the router's fetch returns at the first record (ROUTER_FETCH_WINDOW_MS 0). The
# router's window held every fetch of such a batch for another window: up to 10 ms more latency and a
# purgatory expiry per fetch, and no fewer requests from one connector. With the router answering at once,
# 20 ms of linger costs what 10 + 10 did in latency, with half the requests and batches on every hop after
# it: at 1,000 msg/s p2p 515 -> 400 us of CPU per message for the stack, p50 / p99 15.3 / 25.3 -> 16.0 /
# 27.2 ms (docs/performance.md, "The twenty-seventh round"). Many connectors feeding one router: a router
# window coalesces their batches again (ROUTER_FETCH_WINDOW_MS, docs/router.md).
PRODUCER_LINGER_MS = 20.0
# The rates the adaptive linger enters and leaves its busy mode at (records per second), whatever its window:
# those of the 10 ms window's 3 and 1 records, so traffic under 300 PUBLISHes a second never lingers long
# (the latency floor: issue 12 goal 3).
LINGER_ENTER_RATE = 300.0
LINGER_LEAVE_RATE = 100.0


def fetch_window_env(name: str, topic: str) -> Any:
    """The `<PREFIX>_FETCH_WINDOW_MS` setting of a consumer on the message path (tbmq_platform.coalesce).
    0 by default for every consumer: each topic on the path is written once per batch of its producer (the
    connector's linger paces tbmq.msg.all, the router's batches its outputs), so a window at the consumer is a
    second one in series: fetches expire empty and every message waits up to the window more
    (docs/performance.md, the twenty-seventh, thirty-ninth and forty-first rounds). Several producers feeding
    one consumer: a window coalesces their batches again."""
    return env(name, 0.0, parse=number(0),
               doc=f"adaptive fetch window of {topic} (ms): under load a fetch waits up to this long so the "
                   "records of the window are handled as one batch; when quiet it returns at the first "
                   "record (0 = always at once); tbmq_platform.coalesce")


def auto_offset_reset_env(name: str, topic: str) -> Any:
    """The `<PREFIX>_AUTO_OFFSET_RESET` setting of a consumer group that must not lose a record: where the group
    starts on `topic` when it has no committed offsets (a new group id, or offsets Kafka expired after the group
    stayed empty for `offsets.retention.minutes`, 7 days by default). `earliest`, the default, reads what the
    topic still holds, so nothing written before the group first committed is lost; the records its earlier
    members had already handled are handled again (docs/operations.md, "A consumer group without offsets").
    `latest` skips them, and with them whatever was written while no member ran."""
    return env(name, "earliest", parse=choice("earliest", "latest"),
               doc=f"where the consumer group starts on {topic} without committed offsets: earliest (nothing "
                   "lost; what the topic still holds is handled again) or latest (skipped)")


# Kafka's default group.min.session.timeout.ms: a shorter group session is refused at the join
MIN_GROUP_SESSION_S = 6.0


def group_session_env(name: str, default: float, topic: str, *, most_s: float = 30.0, why_most: str = "") -> Any:
    """The `<PREFIX>_SESSION_TIMEOUT_S` setting of a consumer group on `topic`: an instance silent this long
    loses its partitions to the others. Bounded at start-up, with the other settings: below Kafka's
    group.min.session.timeout.ms (6 s) the group join fails; above `most_s` (30: aiokafka's JoinGroup waits up
    to the session and must stay under its 40 s request timeout) the client fails later, at run time."""
    return env(name, default, parse=number(MIN_GROUP_SESSION_S, most_s),
               doc=f"consumer group session (s) on {topic}: an instance silent this long loses its partitions to "
                   "the others (a restart with the same TBMQ_SERVICE_ID gets them back at once: "
                   f"TBMQ_KAFKA_STATIC_MEMBERSHIP); {MIN_GROUP_SESSION_S:g}..{most_s:g} (Kafka's "
                   f"group.min.session.timeout.ms; {why_most or 'under the consumer request timeout, 40 s'})")


def trace_spans_env(name: str, spans: str) -> Any:
    """The `<PREFIX>_TRACE_SPANS` setting of a service whose `spans` are made only when exported or asked for
    (tbmq_platform.tracing.spans_on)."""
    return env(name, False, parse=boolean,
               doc=f"create {spans} even without an OTLP endpoint (on whenever OTEL_EXPORTER_OTLP_ENDPOINT is set)")


# The default ports of the gRPC listeners (instance i > 1 under the launcher: + 100 * (i - 1)). Below the
# kernel's ephemeral range (Linux 32768-60999, IANA 49152-65535): a port in it can be the local port of any
# outgoing connection on the host (a Kafka or Redis client, an MQTT client of a test or a fleet simulator),
# and while that connection is open or in TIME_WAIT a listener cannot bind the port, SO_REUSEADDR or not,
# so the service fails to start ("address already in use"): 50061/50062, the defaults until 2026-12-01, did
# after a burst of client connections on the host (docs/architecture.md, the default ports).
DEVICE_PERSISTENCE_GRPC_PORT = 9061
APP_DELIVERY_GRPC_PORT = 9062
# the addresses the callers reach them at by default (one instance on this host)
DEVICE_PERSISTENCE_GRPC_TARGET = f"localhost:{DEVICE_PERSISTENCE_GRPC_PORT}"
APP_DELIVERY_GRPC_TARGET = f"localhost:{APP_DELIVERY_GRPC_PORT}"

# The default consumer groups of the services that join theirs as static members (TBMQ_KAFKA_STATIC_MEMBERSHIP;
# ROUTER_GROUP_ID, DEVICE_PERSISTENCE_GROUP_ID, TBMQ_SESSION_REGISTRY_GROUP_ID): also known to the launcher,
# which takes a stopped suite's members out of them, and to admin's ADMIN_STATIC_GROUPS
ROUTER_GROUP = "router"
DEVICE_PERSISTENCE_GROUP = "device-persistence"
SESSION_REGISTRY_GROUP = "session-registry"


def device_persistence_targets_env(use: str) -> Any:
    """`DEVICE_PERSISTENCE_GRPC_TARGETS`, read by every service that reaches device-persistence (the connector
    and the router). A client id picks one instance by its place in this list (tbmq_platform.peers.pick_target),
    so the list must be the same, in the same order, in every one of them. `use` says what this service does
    with it."""
    return env("DEVICE_PERSISTENCE_GRPC_TARGETS", (DEVICE_PERSISTENCE_GRPC_TARGET,), parse=targets,
               fallback="DEVICE_PERSISTENCE_GRPC_TARGET",
               doc=f"device-persistence gRPC addresses (comma list, at least one; the same list in the same "
                   f"order in every connector and router): {use}; when unset, DEVICE_PERSISTENCE_GRPC_TARGET")


# --- loading --------------------------------------------------------------------------------------

S = TypeVar("S")


def load(cls: type[S], environ: Mapping[str, str] | None = None, **overrides: Any) -> S:
    """Build `cls` from the environment; raise SettingsError naming every bad variable."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    problems: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        name = f.metadata.get("env")
        if name is not None and name not in environ:
            name = f.metadata.get("fallback")
        if name is None or name not in environ:
            continue
        raw = environ[name]
        parse = f.metadata.get("parse") or _default_parser(f)
        try:
            values[f.name] = parse(raw)
        except ValueError as exc:
            problems.append(f"{name}={raw!r}: {exc}")
    if problems:
        raise SettingsError(problems)
    obj = cls(**values)
    check = getattr(obj, "validate", None)
    if check is not None:
        more = list(check())
        if more:
            raise SettingsError(more)
    return obj


def _default_parser(f: dataclasses.Field) -> Callable[[str], Any]:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    if kind == "int":
        return integer()
    if kind == "bool":
        return boolean
    if kind == "float":
        return number()
    return str


def load_or_exit(cls: type[S], environ: Mapping[str, str] | None = None) -> S:
    """`load`, but a bad setting prints one message naming every bad variable and exits with code 2."""
    try:
        return load(cls, environ)
    except SettingsError as exc:
        print(f"{cls.__module__.split('.')[0]}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def load_all_or_exit(classes: Sequence[type], environ: Mapping[str, str] | None = None) -> tuple:
    """`load_or_exit` of every settings class one process reads (a router that runs device-persistence too):
    one message naming every bad variable of all of them (each once), exit code 2."""
    loaded, problems = [], []
    for cls in classes:
        try:
            loaded.append(load(cls, environ))
        except SettingsError as exc:
            problems.extend(p for p in exc.problems if p not in problems)
    if problems:
        print(f"{classes[0].__module__.split('.')[0]}: {SettingsError(problems)}", file=sys.stderr)
        raise SystemExit(2)
    return tuple(loaded)


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """(variable, default, doc) of every setting: for READMEs and --help."""
    return [(f.metadata["env"], f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(cls) if "env" in f.metadata]


@dataclasses.dataclass(frozen=True)
class CommonSettings:
    """What every service reads. Subclasses add their own fields (all with defaults)."""

    service_name: str = "tbmq"  # fixed per service by the subclass; not read from the environment
    service_id: str = env("TBMQ_SERVICE_ID", "", doc="unique id of this instance (default <service>-1)")
    kafka_bootstrap_servers: tuple[str, ...] = env("KAFKA_BOOTSTRAP_SERVERS", ("localhost:9092",),
                                                   parse=host_ports, doc="Kafka bootstrap servers")
    kafka_security_protocol: str = env("KAFKA_SECURITY_PROTOCOL", "PLAINTEXT",
                                       parse=choice("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
                                       doc="how every Kafka client connects: PLAINTEXT, SSL, SASL_PLAINTEXT or "
                                           "SASL_SSL (tbmq_platform.kafka.KafkaSecurity)")
    kafka_sasl_mechanism: str = env("KAFKA_SASL_MECHANISM", "PLAIN",
                                    parse=choice("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
                                    doc="SASL mechanism (SASL_PLAINTEXT, SASL_SSL)")
    kafka_sasl_username: str = env("KAFKA_SASL_USERNAME", "", doc="SASL user name (SASL_* protocols)")
    kafka_sasl_password: str = env("KAFKA_SASL_PASSWORD", "", doc="SASL password (SASL_* protocols)")
    kafka_ssl_cafile: str = env("KAFKA_SSL_CAFILE", "",
                                doc="CA (PEM) of the brokers' certificates (SSL, SASL_SSL); empty = the system's")
    grpc_tls_cert_file: str = env("GRPC_TLS_CERT_FILE", "",
                                  doc="this instance's certificate (PEM, serverAuth and clientAuth) on the gRPC "
                                      "surfaces between services; with GRPC_TLS_KEY_FILE and GRPC_TLS_CA_FILE: "
                                      "mutual TLS (tbmq_platform.grpc_tls); empty = plaintext")
    grpc_tls_key_file: str = env("GRPC_TLS_KEY_FILE", "", doc="its private key (PEM)")
    grpc_tls_ca_file: str = env("GRPC_TLS_CA_FILE", "",
                                doc="the CA(s) (PEM) every gRPC peer's certificate must chain to")
    grpc_tls_server_name: str = env("GRPC_TLS_SERVER_NAME", "",
                                    doc="the name checked in gRPC servers' certificates instead of the target's "
                                        "host (empty = the host)")
    grpc_tls_peer_names: tuple[str, ...] = env(
        "GRPC_TLS_PEER_NAMES", (), parse=csv,
        doc="a gRPC server's callers: shell patterns (comma list, e.g. connector-*,router-*) one name of a "
            "caller's certificate (CN or DNS subjectAltName) must match; other calls end with PERMISSION_DENIED "
            "(empty = any certificate of GRPC_TLS_CA_FILE)")
    health_port: int = env("HEALTH_PORT", 0, parse=port, doc="health/readiness HTTP port (0 = any)")
    health_host: str = env("HEALTH_HOST", "127.0.0.1",
                           doc="health endpoint bind address (loopback: the launcher and compose probe it locally)")
    log_format: str = env("LOG_FORMAT", "console", parse=choice("console", "json"))
    log_level: str = env("LOG_LEVEL", "INFO", parse=choice("DEBUG", "INFO", "WARNING", "ERROR"))
    otlp_endpoint: str = env("OTEL_EXPORTER_OTLP_ENDPOINT", "", doc="OTLP/gRPC endpoint; empty = off")
    topic_profile: str = env("TBMQ_TOPIC_PROFILE", PRODUCTION, parse=choice(*PROFILES),
                             doc="partition counts of the topics this service creates: production (TBMQ's) "
                                 "or single-node (one per message topic; make run); see docs/topics.md")
    topic_replication_factor: int = env("TBMQ_TOPIC_REPLICATION_FACTOR", 1, parse=integer(1, 32),
                                        doc="replication factor of the topics this service creates (production: "
                                            "3; docs/architecture.md, Storage trade-offs)")
    topic_min_insync_replicas: int = env("TBMQ_TOPIC_MIN_INSYNC_REPLICAS", 1, parse=integer(1, 32),
                                         doc="min.insync.replicas of the topics this service creates: an "
                                             "acknowledged record is on at least this many brokers (production: 2)")
    kafka_static_membership: bool = env(
        "TBMQ_KAFKA_STATIC_MEMBERSHIP", True, parse=boolean,
        doc="the message-path consumer groups (router, device-persistence, session-registry) join with "
            "group.instance.id = "
            "TBMQ_SERVICE_ID: a restarted instance gets its partitions back at once instead of after its dead "
            "predecessor's session timeout; a stopped one keeps them until that timeout (ids must be unique)")
    retention_watch_interval_s: float = env("TBMQ_RETENTION_WATCH_INTERVAL_S", 60.0, parse=number(0),
                                            doc="how often a consumer of the message topics compares its "
                                                "backlog with the topic's retention.ms (0 = off; "
                                                "tbmq_platform.retention)")
    retention_warn_fraction: float = env("TBMQ_RETENTION_WARN_FRACTION", 0.8, parse=fraction,
                                         doc="warn when unconsumed records are older than this fraction of "
                                             "the topic's retention.ms")

    @property
    def instance_id(self) -> str:
        return self.service_id or f"{self.service_name}-1"

    @property
    def group_instance_id(self) -> str | None:
        """Kafka static membership (KIP-345) of this instance's message-path consumer (the router's,
        device-persistence's, the session registry's request consumer), or None."""
        return self.instance_id if self.kafka_static_membership else None

    @property
    def bootstrap(self) -> str:
        return ",".join(self.kafka_bootstrap_servers)

    @property
    def topic_layout(self) -> TopicLayout:
        return TopicLayout(self.topic_profile, self.topic_replication_factor, self.topic_min_insync_replicas)

    @property
    def grpc_tls(self):
        from .grpc_tls import GrpcTls

        return GrpcTls(self.grpc_tls_cert_file, self.grpc_tls_key_file, self.grpc_tls_ca_file,
                       self.grpc_tls_server_name, self.grpc_tls_peer_names)

    @property
    def kafka_security(self):
        from .kafka import KafkaSecurity

        return KafkaSecurity(self.kafka_security_protocol, self.kafka_sasl_mechanism, self.kafka_sasl_username,
                             self.kafka_sasl_password, self.kafka_ssl_cafile)

    def validate(self) -> list[str]:
        """Cross-field checks of the common settings; a subclass's `validate` extends this list."""
        problems = self.topic_layout.problems() + self.grpc_tls.problems()
        sec = self.kafka_security_protocol
        if sec.startswith("SASL_") and not (self.kafka_sasl_username and self.kafka_sasl_password):
            problems.append(f"KAFKA_SECURITY_PROTOCOL={sec} needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD")
        if self.kafka_ssl_cafile:
            if not sec.endswith("SSL"):
                problems.append(f"KAFKA_SSL_CAFILE is used by SSL and SASL_SSL only (KAFKA_SECURITY_PROTOCOL={sec})")
            elif not os.path.isfile(self.kafka_ssl_cafile):
                problems.append(f"KAFKA_SSL_CAFILE={self.kafka_ssl_cafile!r}: no such file")
        return problems
