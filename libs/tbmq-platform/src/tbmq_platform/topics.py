"""The one catalogue of Kafka topics. Every topic name in the suite comes from here.

docs/topics.md is generated from this module (`python -m tbmq_platform.topics > docs/topics.md`) and a
unit test fails when it is stale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Kafka-safe per-client and per-filter names are routing knowledge: one implementation, in tbmq_routing.
from tbmq_routing.naming import APP_TOPIC_PREFIX, SHARED_APP_TOPIC_PREFIX, app_topic_name, shared_app_topic_name

DAY_MS = 24 * 3600 * 1000

# Partition profiles (TBMQ_TOPIC_PROFILE, read by every service and the launcher): "production" keeps TBMQ's
# counts, sized for many router / device-persistence / session-registry instances; "single-node" gives the
# per-message topics one partition each, for one instance of each service on one host (`make run`, the tests,
# the benchmark). Every partition costs a fetch slot per poll, a record batch per produce request and a
# share of each batch's records: spread over 16 partitions, a live rate of 1,000 msg/s arrives as one-record
# batches. Topics exist with whatever count they were created with; the profile only matters at creation.
PRODUCTION = "production"
SINGLE_NODE = "single-node"
PROFILES = (PRODUCTION, SINGLE_NODE)
GB = 1024 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TopicLayout:
    """How the suite creates its topics: the partition profile and the replication (every service reads the
    same settings: TBMQ_TOPIC_PROFILE, TBMQ_TOPIC_REPLICATION_FACTOR, TBMQ_TOPIC_MIN_INSYNC_REPLICAS).

    Producers use acks=all, so a record acknowledged to a client is on `min_insync_replicas` brokers at least;
    with a replication factor of 3 and min.insync.replicas 2 (compose.yaml's production profile) one broker
    can be lost without losing an acknowledged message and without stopping writes. The single-broker default
    (1 / 1) loses what the broker's disk loses (docs/architecture.md, "Storage trade-offs")."""

    profile: str = PRODUCTION
    replication_factor: int = 1
    min_insync_replicas: int = 1

    def problems(self) -> list[str]:
        """What is wrong with this layout, for the settings check ([] = fine)."""
        out = []
        if self.profile not in PROFILES:
            out.append(f"TBMQ_TOPIC_PROFILE={self.profile!r}: not one of {', '.join(PROFILES)}")
        if self.min_insync_replicas > self.replication_factor:
            out.append(f"TBMQ_TOPIC_MIN_INSYNC_REPLICAS={self.min_insync_replicas}: above "
                       f"TBMQ_TOPIC_REPLICATION_FACTOR={self.replication_factor} (no write could succeed)")
        return out

MSG_ALL = "tbmq.msg.all"
MSG_PERSISTED = "tbmq.msg.persisted"
MSG_PERSISTED_DEAD = "tbmq.msg.persisted.dead"
# headers of a tbmq.msg.persisted.dead record: what Redis answered, and the device-persistence instance
DEAD_LETTER_ERROR_HEADER = "tbmq-error"
DEAD_LETTER_INSTANCE_HEADER = "tbmq-instance"
# A dead letter written back by `tbmq dead-letters replay` carries as origin (PersistedMsg.origin_partition /
# origin_offset) this + its tbmq.msg.persisted.dead partition, and its offset there: device-persistence stores
# a client's copy once per origin (lua/save_messages.lua), so a replay run again stores nothing twice, and the
# pseudo-partition is never compared with the tbmq.msg.all partitions of the client's routed copies.
DEAD_LETTER_ORIGIN_PARTITION = 1 << 31
MSG_PERSISTED_TALLY = "tbmq.msg.persisted.tally"
MSG_APP_PREFIX = APP_TOPIC_PREFIX
MSG_APP_SHARED_PREFIX = SHARED_APP_TOPIC_PREFIX
MSG_RETAINED = "tbmq.msg.retained"
CLIENT_SESSION = "tbmq.client.session"
CLIENT_SUBSCRIPTIONS = "tbmq.client.subscriptions"
SESSION_EVENT_REQUEST = "tbmq.client.session.event.request"
SESSION_EVENT_RESPONSE_PREFIX = "tbmq.client.session.event.response."
CLIENT_DISCONNECT_PREFIX = "tbmq.client.disconnect."
DOWNLINK_BASIC_PREFIX = "tbmq.msg.downlink.basic."
CONNECTOR_HEARTBEAT = "tbmq.connector.heartbeat"
SECURITY_CREDENTIALS = "tbmq.security.credentials"
SECURITY_BLOCKED = "tbmq.security.blocked"
SECURITY_LOGIN_BANS = "tbmq.security.login.bans"
SECURITY_TOKENS_REVOKED = "tbmq.security.tokens.revoked"
ADMIN_TOKENS_REVOKED = "tbmq.admin.tokens.revoked"
SYS_APP_REMOVED = "tbmq.sys.app.removed"
SYS_HISTORICAL_DATA = "tbmq.sys.historical.data"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str  # may hold a placeholder such as <svc> in the catalogue listing
    key: str
    payload: str  # message of proto/tbmq/v1/messages.proto
    partitions: int
    producers: str
    consumers: str
    compact: bool = False
    retention_ms: int | None = 7 * DAY_MS
    retention_bytes: int | None = GB
    single_node_partitions: int | None = None  # partitions in the single-node profile (None: as production)

    def partitions_in(self, profile: str) -> int:
        """The partition count of this topic in `profile` (PRODUCTION or SINGLE_NODE)."""
        if profile == SINGLE_NODE and self.single_node_partitions is not None:
            return self.single_node_partitions
        if profile not in PROFILES:
            raise ValueError(f"unknown topic profile {profile!r}; known: {', '.join(PROFILES)}")
        return self.partitions

    def configs(self, layout: TopicLayout | None = None) -> dict[str, str]:
        """Topic-level Kafka configs for creation (min.insync.replicas from `layout`)."""
        cfg = {"segment.bytes": str(26214400)}
        if layout is not None:
            cfg["min.insync.replicas"] = str(layout.min_insync_replicas)
        if self.compact:
            cfg["cleanup.policy"] = "compact"
        else:
            cfg["cleanup.policy"] = "delete"
            if self.retention_ms is not None:
                cfg["retention.ms"] = str(self.retention_ms)
            if self.retention_bytes is not None:
                cfg["retention.bytes"] = str(self.retention_bytes)
        return cfg


def _compacted(name: str, key: str, payload: str, producers: str, consumers: str, partitions: int = 1) -> TopicSpec:
    return TopicSpec(name, key, payload, partitions, producers, consumers, compact=True,
                     retention_ms=None, retention_bytes=None)


CATALOGUE: tuple[TopicSpec, ...] = (
    TopicSpec(MSG_ALL, "MQTT topic (a mark: its connector's id)",
              "PublishMsg; null: a subscription mark on every partition (tbmq_platform.marks)", 16,
              "connector (after PUBLISH; marks after SUBSCRIBE / UNSUBSCRIBE and a CONNECT over a known session)",
              "router",
              retention_bytes=2 * GB, single_node_partitions=1),
    TopicSpec(MSG_PERSISTED, "subscriber client id", "PersistedMsg", 12,
              "router, only with ROUTER_PERSIST_VIA=kafka (by default the copies go over device-persistence's "
              "gRPC Persist streams)", "device-persistence", single_node_partitions=1),
    TopicSpec(MSG_PERSISTED_DEAD, "subscriber client id",
              "PersistedMsg; header `tbmq-error`: what Redis answered", 1,
              "device-persistence (stored copies Redis refused for the client's data, e.g. a key of another type)",
              "`tbmq dead-letters list / replay` (replay: into tbmq.msg.persisted, its place here as origin)",
              retention_ms=30 * DAY_MS),
    TopicSpec(MSG_PERSISTED_TALLY, "device-persistence instance id",
              "PersistTally: the stored copies received on Persist streams in one second", 1,
              "device-persistence (ROUTER_PERSIST_VIA=grpc; a record per second that had copies)",
              "spark stats job (outgoing path=persisted)"),
    TopicSpec(MSG_APP_PREFIX + "<client>", "MQTT topic", "PublishMsg (receiver copy)", 1, "router",
              "app-delivery (group app-delivery.c.<client>)"),
    TopicSpec(MSG_APP_SHARED_PREFIX + "<filter>", "MQTT topic", "PublishMsg (receiver copy)", 4, "router",
              "app-delivery (group app-delivery.s.<share name>)"),
    _compacted(MSG_RETAINED, "MQTT topic", "PublishMsg (null value = delete)", "connector, admin (delete)",
               "connector (every instance, from the beginning), admin"),
    _compacted(CLIENT_SESSION, "client id", "SessionInfo (null value = removed)", "session-registry",
               "every service (from the beginning), admin"),
    _compacted(CLIENT_SUBSCRIPTIONS, "client id", "ClientSubscriptions (whole set)",
               "connector, session-registry", "router, connector (from the beginning), admin"),
    _compacted(SECURITY_CREDENTIALS, "credential name (username)",
               "JSON tbmq_auth.Credential: argon2id hash, client-id pattern, cert CN, pub/sub filters "
               "(null value = deleted)", "`tbmq credentials`", "connector (every instance, from the beginning)"),
    _compacted(SECURITY_BLOCKED, "<kind>:<value>", "JSON tbmq_auth.BlockedRule (null value = deleted)",
               "`tbmq blocked`", "connector (every instance, from the beginning)"),
    _compacted(SECURITY_TOKENS_REVOKED, "an MQTT token's id (its jti claim)",
               "the token's expiry (exp), Unix seconds, decimal text (null value = the revocation withdrawn)",
               "`tbmq tokens revoke`", "connector (every instance, from the beginning)"),
    TopicSpec(SECURITY_LOGIN_BANS, "client address (IP)",
              "JSON, a ban {\"until_ms\": the ban's end, Unix ms (0: lifted), \"by\": the banning connector's id, or "
              "who lifted it} or a failed login {\"failed_ms\": when, Unix ms, \"by\": the connector's id}", 1,
              "connector (every failed login, and an address past MQTT_LOGIN_FAILURES_PER_IP), admin and "
              "`tbmq login-bans lift` (until_ms 0)",
              "connector (every instance, from the records of the last window or ban length, whichever is longer, "
              "plus a minute), admin (from the beginning)",
              retention_ms=DAY_MS),
    TopicSpec(ADMIN_TOKENS_REVOKED, "token id (jti)", "the token's expiry, Unix seconds (decimal text)", 1,
              "admin (POST /api/v1/auth/logout)", "admin (every instance, from the beginning)"),
    TopicSpec(SESSION_EVENT_REQUEST, "client id", "SessionEventRequest", 24,
              "connector, session-registry (its scans), admin (clear)", "session-registry", single_node_partitions=1),
    TopicSpec(SESSION_EVENT_RESPONSE_PREFIX + "<svc>", "client id", "SessionEventResponse", 1,
              "session-registry", "connector <svc>"),
    TopicSpec(CLIENT_DISCONNECT_PREFIX + "<svc>", "client id", "DisconnectCommand", 1,
              "session-registry, admin (disconnect)", "connector <svc>"),
    TopicSpec(DOWNLINK_BASIC_PREFIX + "<svc>", "MQTT topic", "BasicDownlink", 12, "router",
              "connector <svc>", single_node_partitions=1),
    _compacted(CONNECTOR_HEARTBEAT, "service id", "ConnectorHeartbeat (last one per connector)", "connector",
               "session-registry (every instance, from the beginning)"),
    TopicSpec(SYS_APP_REMOVED, "client id", "ApplicationRemovedEvent", 1, "session-registry",
              "app-delivery (deletes the topic)"),
    TopicSpec(SYS_HISTORICAL_DATA, "window start", "UsageStats", 1, "spark stats job", "admin (GET /api/v1/stats)"),
)

_BY_NAME = {spec.name: spec for spec in CATALOGUE}


def spec(name: str) -> TopicSpec:
    """The catalogue entry of a topic name or template (e.g. 'tbmq.msg.downlink.basic.<svc>')."""
    return _BY_NAME[name]


def static_topics() -> list[TopicSpec]:
    """Topics that exist once per cluster (no placeholder in the name)."""
    return [s for s in CATALOGUE if "<" not in s.name]


def response_topic(service_id: str) -> str:
    return SESSION_EVENT_RESPONSE_PREFIX + service_id


def disconnect_topic(service_id: str) -> str:
    return CLIENT_DISCONNECT_PREFIX + service_id


def downlink_basic_topic(service_id: str) -> str:
    return DOWNLINK_BASIC_PREFIX + service_id


def service_topics(service_id: str) -> list[TopicSpec]:
    """The per-connector topics of one connector instance."""
    out = []
    for s in CATALOGUE:
        if s.name.endswith("<svc>"):
            out.append(replace(s, name=s.name.replace("<svc>", service_id)))
    return out


def app_topic(client_id: str) -> TopicSpec:
    return replace(spec(MSG_APP_PREFIX + "<client>"), name=app_topic_name(client_id))


def shared_app_topic(topic_filter: str) -> TopicSpec:
    return replace(spec(MSG_APP_SHARED_PREFIX + "<filter>"), name=shared_app_topic_name(topic_filter))


def render_markdown() -> str:
    """docs/topics.md."""
    lines = [
        "# Kafka topics",
        "",
        "Generated from `libs/tbmq-platform/src/tbmq_platform/topics.py` by "
        "`python -m tbmq_platform.topics > docs/topics.md`; do not edit by hand.",
        "Payloads are messages of `proto/tbmq/v1/messages.proto` unless they say JSON. `<svc>` is a connector's service id;",
        "`<client>` is the client id, or `h-` + its SHA-256 hex when it is not `[A-Za-z0-9]+`; `<filter>` maps",
        "`/`→`.`, `+`→`_slw`, `#`→`_mlw` (`h-` + SHA-256 hex when the filter has other characters). Both are",
        "injective: two client ids (filters) never share a topic. A shared DEVICE group's store id (the key in",
        "tbmq.msg.persisted) is `$share/<share name>/<filter>`; client ids starting with `$share/` are refused.",
        "All topics are created idempotently at start-up (`ensure_topics`); producers are idempotent "
        "with acks=all.",
        "Partitions: `production / single-node`, the two profiles of `TBMQ_TOPIC_PROFILE` (services default to",
        "production; `make run`, the tests and the benchmark use single-node); the count is fixed when a topic",
        "is created.",
        "",
        "| topic | key | payload | partitions | retention | producers | consumers |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in CATALOGUE:
        if s.compact:
            retention = "compacted"
        else:
            retention = f"{s.retention_ms // DAY_MS} d, {s.retention_bytes // GB} GiB"
        parts = f"{s.partitions_in(PRODUCTION)} / {s.partitions_in(SINGLE_NODE)}"
        lines.append(f"| `{s.name}` | {s.key} | {s.payload} | {parts} | {retention} | "
                     f"{s.producers} | {s.consumers} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
