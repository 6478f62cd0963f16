"""tbmq_connection.systopics: which run publishes $SYS, and the sums it publishes (no Kafka, no clock)."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection.systopics import is_publisher, live_runs, sys_messages

pytestmark = pytest.mark.unit


def hb(svc: str, at: int, *, stopped=False, clients=0, rx=0, tx=0, dropped=0, started=0) -> pb.ConnectorHeartbeat:
    return pb.ConnectorHeartbeat(service_id=svc, sent_at_ms=at, stopped=stopped, stats=pb.ConnectorStats(
        clients_connected=clients, messages_received=rx, messages_sent=tx, messages_dropped=dropped,
        connections=clients, started_at_ms=started))


def test_live_runs_and_the_publisher():
    beats = {"connector-1": hb("connector-1", 1_000, stopped=True), "connector-2": hb("connector-2", 9_000),
             "connector-3": hb("connector-3", 9_500), "connector-0": hb("connector-0", 1_000)}
    live = live_runs(beats, now_ms=10_000, stale_ms=5_000)
    assert sorted(h.service_id for h in live) == ["connector-2", "connector-3"]  # stopped / stale left out
    assert is_publisher("connector-2", live) and not is_publisher("connector-3", live)
    assert is_publisher("connector-1", live)  # a restarted run whose heartbeat has not come back yet
    assert is_publisher("x", [])


def test_sums_over_the_live_runs():
    live = [hb("a", 0, clients=3, rx=10, tx=20, dropped=1, started=1_000),
            hb("b", 0, clients=2, rx=5, tx=7, started=4_000)]
    got = dict(sys_messages(live, subscriptions=12, retained=4, version="tbmq-py 0.1.0", now_ms=61_000))
    assert got["$SYS/broker/clients/connected"] == b"5"
    assert got["$SYS/broker/messages/received"] == b"15" and got["$SYS/broker/messages/sent"] == b"27"
    assert got["$SYS/broker/publish/messages/dropped"] == b"1"
    assert got["$SYS/broker/subscriptions/count"] == b"12" and got["$SYS/broker/retained messages/count"] == b"4"
    assert got["$SYS/broker/connectors/count"] == b"2" and got["$SYS/broker/uptime"] == b"60 seconds"
    assert got["$SYS/broker/version"] == b"tbmq-py 0.1.0"
