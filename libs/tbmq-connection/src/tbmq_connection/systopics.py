"""`$SYS` topics (issue 16): cluster-wide broker statistics, published as Mosquitto publishes them. Pure.

Every connector run puts its counters in its heartbeat (`ConnectorHeartbeat.stats`, tbmq.connector.heartbeat,
compacted, followed by every connector). Every `MQTT_SYS_INTERVAL_S` the live run with the smallest service id
(`is_publisher`; a run that is not stopped and whose last heartbeat is younger than the staleness bound) sums
the live runs' counters and publishes one retained QoS 0 message per topic (`sys_messages`) through the normal
path (tbmq.msg.all + tbmq.msg.retained), so a subscriber of `$SYS/#` gets the latest figures at once and then
every interval, on any connector. Two runs that both believe they are the publisher for a moment only write the
same retained topics twice. Counters are per run since it started (as Mosquitto's reset with a restart); who
may read `$SYS` is the ACL's business (a subscribe pattern must name `$SYS`: `#` never matches it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tbmq.v1 import messages_pb2 as pb

SYS = "$SYS/broker/"
PUBLISHER_ID = "$SYS"


def live_runs(heartbeats: Mapping[str, pb.ConnectorHeartbeat], now_ms: int,
              stale_ms: int) -> list[pb.ConnectorHeartbeat]:
    """The connector runs that count: not stopped, heard from within `stale_ms`."""
    return [hb for hb in heartbeats.values() if not hb.stopped and now_ms - hb.sent_at_ms <= stale_ms]


def is_publisher(me: str, live: Iterable[pb.ConnectorHeartbeat]) -> bool:
    """This run publishes when its service id is the smallest of the live ones (itself included, whether or not
    its own latest heartbeat has come back through Kafka yet)."""
    return me <= min((hb.service_id for hb in live), default=me)


def sys_messages(live: Iterable[pb.ConnectorHeartbeat], *, subscriptions: int, retained: int, version: str,
                 now_ms: int) -> list[tuple[str, bytes]]:
    """(topic, payload) of every `$SYS` topic from the live runs' counters and this connector's cluster-wide
    tables (subscriptions and retained messages: every connector follows all of them)."""
    runs = list(live)

    def total(field: str) -> int:
        return sum(getattr(hb.stats, field) for hb in runs)

    started = min((hb.stats.started_at_ms for hb in runs if hb.stats.started_at_ms), default=now_ms)
    values = {
        "clients/connected": total("clients_connected"),
        "connections/count": total("connections"),
        "messages/received": total("messages_received"),
        "messages/sent": total("messages_sent"),
        "publish/messages/dropped": total("messages_dropped"),
        "subscriptions/count": subscriptions,
        "retained messages/count": retained,
        "connectors/count": len(runs),
        "uptime": f"{max(0, now_ms - started) // 1000} seconds",
        "version": version,
    }
    return [(SYS + k, str(v).encode()) for k, v in values.items()]


__all__ = ["PUBLISHER_ID", "SYS", "is_publisher", "live_runs", "sys_messages"]
