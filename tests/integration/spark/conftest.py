"""Fixtures of the Spark tests: one local[2] SparkSession for the whole test run, and one known workload
run through the statistics job (twice: the restart must continue, not double count), shared by the stats,
archive and report tests.

The broker is the suite-wide `kafka` fixture, shared with other tests: the workload lives in minutes a day
in the past (no other test writes there) and the stats job starts from the topics' end offsets taken just
before the workload is produced.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

SPARK_DIR = Path(__file__).resolve().parents[3] / "spark"
if str(SPARK_DIR) not in sys.path:
    sys.path.insert(0, str(SPARK_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spark_workload import (MINUTE_MS, Workload, create_topics, end_offsets, produce, publish,  # noqa: E402
                            session, subscriptions)
from tbmq.v1 import messages_pb2 as pb  # noqa: E402
from tbmq_platform import topics as T  # noqa: E402

SVC = "connector-1"
PUBLISHER = f"pub-{uuid.uuid4().hex[:8]}"   # this run's publisher id (the archive holds earlier runs too)


@pytest.fixture(scope="session")
def spark():
    """The run's local[2] session (tests/e2e/spark shares it: get_session returns the active one)."""
    from pyspark.sql import SparkSession
    from tbmq_spark.session import get_session, stop_session

    t0 = time.monotonic()
    mine = SparkSession.getActiveSession() is None
    s = get_session("tbmq-spark-tests", "local[2]")
    print(f"\nspark session ready in {time.monotonic() - t0:.1f}s")
    yield s
    if mine:
        stop_session(s)


@dataclass
class StatsRun:
    bootstrap: str
    output: str
    base_ms: int                      # start of the workload's first minute
    phase1: Workload                  # expected windows after the first run
    phase2: Workload                  # expected windows emitted by the second run
    gauges: dict[int, dict[str, int]]  # window start -> expected gauge values
    historical_start: dict[int, int]  # tbmq.sys.historical.data offsets before the runs
    batches_after_phase1: set[int]
    publisher: str = PUBLISHER
    mark_key: bytes = b"conn-marks-test"  # the key of the workload's subscription mark


def _msg(t: int, topic: str, size: int, qos: int, wl: Workload, retain: bool = False):
    wl.add(t, "incoming_msgs", "", 1)
    wl.add(t, "incoming_msgs", f"qos={qos}", 1)
    wl.add(t, "incoming_msgs", f"segment={topic.split('/')[0]}", 1)
    for dim in ("", f"qos={qos}", f"segment={topic.split('/')[0]}"):
        wl.add(t, "incoming_bytes", dim, size)
    if retain:
        wl.add(t, "incoming_retained_msgs", "", 1)
    v = publish(PUBLISHER, topic, bytes([65 + qos]) * size, qos, t, retain).SerializeToString()
    return (T.MSG_ALL, topic.encode(), v, t)


@pytest.fixture(scope="session")
async def stats_run(kafka, spark, tmp_path_factory) -> StatsRun:
    from tbmq_spark.kafka_io import ENTITY_TOPICS, MESSAGE_TOPICS_PATTERN
    from tbmq_spark.stats import StatsConfig, run_stats

    bootstrap = kafka.bootstrap_servers
    await create_topics(bootstrap, extra=["appclient1"])
    app_topic = T.app_topic_name("appclient1")
    start_msgs = await end_offsets(bootstrap, pattern=MESSAGE_TOPICS_PATTERN)
    start_ents = await end_offsets(bootstrap, topics=ENTITY_TOPICS)
    hist_start = {int(p): o for p, o in
                  json.loads(await end_offsets(bootstrap, topics=[T.SYS_HISTORICAL_DATA]))
                  .get(T.SYS_HISTORICAL_DATA, {}).items()}

    now = int(time.time() * 1000)
    base = (now - 24 * 3600 * 1000) // MINUTE_MS * MINUTE_MS   # a day ago, minute aligned
    m0, m1, m2, m3 = (base + i * MINUTE_MS for i in range(4))
    p1 = Workload(MINUTE_MS)
    recs = []
    # minute 0: 12 publishes of known sizes/QoS on two top-level segments, 3 connects (1 persistent),
    # subscriptions for two clients, outgoing copies on all three paths
    sizes = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120]
    for i, size in enumerate(sizes):
        recs.append(_msg(m0 + 1000 * i, "sensors/t" if i % 2 == 0 else "alarms/x", size, i % 3, p1,
                         retain=(i == 0)))
    for i, (cid, persistent) in enumerate([("dev1", True), ("dev2", False), ("dev3", False)]):
        t = m0 + 30_000 + i
        recs.append((T.CLIENT_SESSION, cid.encode(), session(cid, connected=True, persistent=persistent,
                                                             session_id=f"{cid}-s1", t_ms=t).SerializeToString(), t))
        p1.add(t, "connects", "", 1)
    # a connector's subscription mark (tbmq_platform.marks): no message, counted nowhere, never archived
    recs.append((T.MSG_ALL, StatsRun.mark_key, None, m0 + 30_500))
    recs.append((T.CLIENT_SUBSCRIPTIONS, b"dev1",
                 subscriptions("dev1", ["sensors/#", "alarms/+"]).SerializeToString(), m0 + 31_000))
    recs.append((T.CLIENT_SUBSCRIPTIONS, b"dev2", subscriptions("dev2", ["sensors/t"]).SerializeToString(),
                 m0 + 31_001))
    down = pb.BasicDownlink(msg=publish("pub-1", "sensors/t", b"x" * 10, 1, m0),
                            recipients=[pb.Recipient(client_id="dev2", qos=1), pb.Recipient(client_id="dev3", qos=0)])
    recs.append((T.downlink_basic_topic(SVC), b"sensors/t", down.SerializeToString(), m0 + 40_000))
    recs.append((T.MSG_PERSISTED, b"dev1", pb.PersistedMsg(
        client_id="dev1", msg=publish("pub-1", "sensors/t", b"y" * 7, 1, m0)).SerializeToString(), m0 + 40_001))
    recs.append((app_topic, b"alarms/x", publish("pub-1", "alarms/x", b"z" * 5, 2, m0).SerializeToString(),
                 m0 + 40_002))
    # device-persistence's tally of 3 copies it got over Persist streams in one second (ROUTER_PERSIST_VIA=grpc)
    recs.append((T.MSG_PERSISTED_TALLY, b"device-persistence-1", pb.PersistTally(
        second_ms=m0 + 41_000, copies=3, payload_bytes=11, copies_by_qos=[1, 2, 0]).SerializeToString(),
        m0 + 42_050))
    for dim, v in (("", 4 + 3), ("path=basic", 2), ("path=persisted", 1 + 3), ("path=app", 1), ("qos=1", 2 + 2),
                   ("qos=0", 1 + 1), ("qos=2", 1)):
        p1.add(m0 + 40_000, "outgoing_msgs", dim, v)
    for dim, v in (("", 20 + 7 + 5 + 11), ("path=basic", 20), ("path=persisted", 7 + 11), ("path=app", 5)):
        p1.add(m0 + 40_000, "outgoing_bytes", dim, v)
    # minute 1: 5 more publishes; dev2 disconnects, dev3's session is removed (tombstone), dev1 takes over
    # its own session on a new connection (a disconnect + a connect, still one connected session)
    for i in range(5):
        recs.append(_msg(m1 + 2000 * i, "sensors/t", 8, 1, p1))
    t = m1 + 20_000
    recs.append((T.CLIENT_SESSION, b"dev2", session("dev2", connected=False, persistent=False,
                                                    session_id="dev2-s1", t_ms=t).SerializeToString(), t))
    p1.add(t, "disconnects", "", 1)
    recs.append((T.CLIENT_SESSION, b"dev3", None, t + 1))
    p1.add(t, "disconnects", "", 1)
    recs.append((T.CLIENT_SESSION, b"dev1", session("dev1", connected=True, persistent=True,
                                                    session_id="dev1-s2", t_ms=t + 2).SerializeToString(), t + 2))
    p1.add(t, "disconnects", "", 1)
    p1.add(t, "connects", "", 1)
    recs.append((T.CLIENT_SUBSCRIPTIONS, b"dev2", None, t + 3))
    # minute 2: a tick that moves the watermark past minute 1 (it counts in minute 2)
    recs.append(_msg(m2, "tick", 1, 0, p2_tick := Workload(MINUTE_MS)))
    await produce(bootstrap, recs)

    output = str(tmp_path_factory.mktemp("spark-stats"))
    cfg = StatsConfig(bootstrap=bootstrap, output=output, window="1 minute", watermark="0 seconds",
                      trigger="availableNow", starting_offsets=start_msgs)
    # two sources with different start offsets: the entity stream gets its own
    cfg_ents = start_ents
    run_stats(spark, _with_entity_offsets(cfg, cfg_ents))
    from tbmq_spark.report import load_stats
    import pyarrow.dataset as ds

    batches1 = set(ds.dataset(cfg.stats_path, format="parquet", partitioning="hive")
                   .to_table(columns=["batch_id"]).column("batch_id").to_pylist())

    # phase 2 (after a "restart": same checkpoint, new query): more in minute 2, a tick in minute 4
    p2 = p2_tick
    recs2 = [_msg(m2 + 5000 + 1000 * i, "alarms/y", 33, 2, p2) for i in range(3)]
    t = m2 + 9000
    recs2.append((T.CLIENT_SESSION, b"dev4", session("dev4", connected=True, persistent=True,
                                                     session_id="dev4-s1", t_ms=t).SerializeToString(), t))
    p2.add(t, "connects", "", 1)
    recs2.append(_msg(m3 + MINUTE_MS, "tick", 1, 0, Workload(MINUTE_MS)))
    await produce(bootstrap, recs2)
    run_stats(spark, _with_entity_offsets(cfg, cfg_ents))

    gauges = {
        m0: {"sessions_connected": 3, "sessions_persistent": 1, "sessions": 3, "subscriptions": 3,
             "subscribed_clients": 2},
        m1: {"sessions_connected": 1, "sessions_persistent": 1, "sessions": 2, "subscriptions": 2,
             "subscribed_clients": 1},
        m2: {"sessions_connected": 2, "sessions_persistent": 2, "sessions": 3, "subscriptions": 2,
             "subscribed_clients": 1},
    }
    return StatsRun(bootstrap, output, base, p1, p2, gauges, hist_start, batches1)


def _with_entity_offsets(cfg, ents_offsets: str):
    from dataclasses import replace

    return replace(cfg, entity_starting_offsets=ents_offsets)
