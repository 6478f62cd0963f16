"""Batch archive job: the event log to Parquet, and an event-sourcing consistency check.

1. Archive (incremental, exactly once): tbmq.msg.all → <output>/archive/messages/date=YYYY-MM-DD/, and
   tbmq.client.session + tbmq.client.subscriptions + tbmq.client.session.event.request →
   <output>/archive/state_events/topic=<topic>/date=YYYY-MM-DD/. Each is a Structured Streaming query with
   trigger availableNow and Spark's Parquet file sink: a run reads what was added since the last run (the
   offsets are in <output>/_checkpoints/archive-*), so the archive keeps history that compaction and
   retention later remove from Kafka.
2. Rebuild: the session and subscription projections (last value per client id; a null value - and for
   subscriptions an empty set - removes the client) computed from the archived history, compared with the
   compacted topics' current state read separately from Kafka. Every difference is reported:
   only_in_history (the compacted topic lost a live client), only_in_compacted (the history lacks it),
   value_differs (both have the client with different last states).
   Written to <output>/archive/rebuild_report.json; the CLI exits 1 when there is a difference.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tbmq_platform import topics as T

from .decode import (MESSAGE_ARCHIVE_SCHEMA, STATE_ARCHIVE_SCHEMA, decode_message_archive,
                     decode_state_archive, entity_row)
from .kafka_io import read_batch, read_stream

STATE_TOPICS = [T.CLIENT_SESSION, T.CLIENT_SUBSCRIPTIONS, T.SESSION_EVENT_REQUEST]
PROJECTIONS = {T.CLIENT_SESSION: "sessions", T.CLIENT_SUBSCRIPTIONS: "subscriptions"}


@dataclass(frozen=True)
class ArchiveConfig:
    bootstrap: str
    output: str

    @property
    def archive_path(self) -> str:
        return os.path.join(self.output, "archive")

    @property
    def messages_path(self) -> str:
        return os.path.join(self.archive_path, "messages")

    @property
    def state_path(self) -> str:
        return os.path.join(self.archive_path, "state_events")

    @property
    def report_path(self) -> str:
        return os.path.join(self.archive_path, "rebuild_report.json")

    def checkpoint(self, name: str) -> str:
        return os.path.join(self.output, "_checkpoints", f"archive-{name}")


@dataclass
class RebuildReport:
    counts: dict = field(default_factory=dict)      # projection -> {"history": n, "compacted": n}
    differences: list = field(default_factory=list)  # {"projection", "client_id", "kind", "history", "compacted"}

    @property
    def consistent(self) -> bool:
        return not self.differences

    def to_dict(self) -> dict:
        return {"consistent": self.consistent, "counts": self.counts, "differences": self.differences}

    def text(self) -> str:
        lines = [f"rebuild check: {'CONSISTENT' if self.consistent else 'DIFFERENCES FOUND'}"]
        for name, c in sorted(self.counts.items()):
            lines.append(f"  {name}: {c['history']} from history, {c['compacted']} in compacted topic")
        for d in self.differences:
            lines.append(f"  {d['projection']} {d['client_id']!r}: {d['kind']} "
                         f"(history={d['history']}, compacted={d['compacted']})")
        return "\n".join(lines)


def archive_event_log(spark, cfg: ArchiveConfig) -> None:
    """Append everything new in the topics to the Parquet archive (two availableNow queries)."""
    msgs = (read_stream(spark, cfg.bootstrap, topics=[T.MSG_ALL])
            .select("topic", "partition", "offset", "timestamp", "key", "value")
            .mapInArrow(decode_message_archive, MESSAGE_ARCHIVE_SCHEMA))
    states = (read_stream(spark, cfg.bootstrap, topics=STATE_TOPICS)
              .select("topic", "partition", "offset", "timestamp", "key", "value")
              .mapInArrow(decode_state_archive, STATE_ARCHIVE_SCHEMA))
    queries = [
        msgs.writeStream.format("parquet").partitionBy("date").option("path", cfg.messages_path)
        .option("checkpointLocation", cfg.checkpoint("messages")).queryName("tbmq-archive-messages")
        .trigger(availableNow=True).start(),
        states.writeStream.format("parquet").partitionBy("topic", "date").option("path", cfg.state_path)
        .option("checkpointLocation", cfg.checkpoint("state")).queryName("tbmq-archive-state")
        .trigger(availableNow=True).start(),
    ]
    for q in queries:
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"archive query {q.name} failed: {q.exception()}")


def _last_per_client(df):
    """(topic, client_id, tombstone, value, n_subs) rows → the live projection: last record per client
    (Kafka order: a client id's records share one partition, so the highest offset is the last)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy("topic", "client_id").orderBy(F.col("part").desc(), F.col("offset").desc())
    last = df.withColumn("_rn", F.row_number().over(w)).where("_rn = 1").drop("_rn")
    removed = F.col("tombstone") | ((F.col("topic") == T.CLIENT_SUBSCRIPTIONS) & (F.col("n_subs") == 0))
    return last.where(~removed).select("topic", "client_id", "value")


def _summary(topic: str, value: bytes | None):
    if value is None:
        return None
    r = entity_row(topic, None, bytes(value))
    if topic == T.CLIENT_SESSION:
        return {"connected": r["connected"], "persistent": r["persistent"], "session_id": r["session_id"]}
    return {"subscriptions": r["n_subs"]}


def rebuild_check(spark, cfg: ArchiveConfig) -> RebuildReport:
    from pyspark.sql import functions as F

    if os.path.isdir(cfg.state_path):
        raw = spark.read.parquet(cfg.state_path)
    else:  # nothing archived yet
        raw = spark.createDataFrame([], STATE_ARCHIVE_SCHEMA)
    hist = (raw
            .where(F.col("topic").isin(list(PROJECTIONS)))
            .select("topic", "client_id", "part", "offset", "tombstone", "value", "n_subs"))
    kafka = read_batch(spark, cfg.bootstrap, list(PROJECTIONS))
    # the current state of the compacted topics, decoded on its own (independent of the archive)
    current = (kafka.select("topic", "partition", "offset", "timestamp", "key", "value")
               .mapInArrow(decode_state_archive, STATE_ARCHIVE_SCHEMA)
               .select("topic", "client_id", "part", "offset", "tombstone", "value", "n_subs"))
    h = _last_per_client(hist).withColumnRenamed("value", "h_value")
    c = _last_per_client(current).withColumnRenamed("value", "c_value")
    joined = h.join(c, ["topic", "client_id"], "full_outer")
    counts = {name: {"history": 0, "compacted": 0} for name in PROJECTIONS.values()}
    report = RebuildReport(counts=counts)
    for r in joined.collect():
        name = PROJECTIONS[r.topic]
        hv = bytes(r.h_value) if r.h_value is not None else None
        cv = bytes(r.c_value) if r.c_value is not None else None
        counts[name]["history"] += hv is not None
        counts[name]["compacted"] += cv is not None
        kind = None
        if hv is not None and cv is None:
            kind = "only_in_history"
        elif hv is None and cv is not None:
            kind = "only_in_compacted"
        elif hv != cv:
            kind = "value_differs"
        if kind:
            report.differences.append({"projection": name, "client_id": r.client_id, "kind": kind,
                                       "history": _summary(r.topic, hv), "compacted": _summary(r.topic, cv)})
    report.differences.sort(key=lambda d: (d["projection"], d["client_id"]))
    os.makedirs(cfg.archive_path, exist_ok=True)
    with open(cfg.report_path, "w") as f:
        json.dump(report.to_dict(), f, indent=2)
    return report


def run_archive(spark, cfg: ArchiveConfig, *, ingest: bool = True, check: bool = True) -> RebuildReport | None:
    if ingest:
        archive_event_log(spark, cfg)
    return rebuild_check(spark, cfg) if check else None
