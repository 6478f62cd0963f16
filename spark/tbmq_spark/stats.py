"""Streaming statistics job: per-window usage statistics of the whole cluster from its Kafka topics.

    messages   tbmq.msg.all ──────────────────────────────┐ incoming_msgs / incoming_bytes (total, qos=, segment=)
               tbmq.msg.downlink.basic.* / persisted / app.* ─┤ outgoing_msgs / outgoing_bytes (total, path=, qos=)
    entities   tbmq.client.session ──▶ transformWithState ──┤ connects, disconnects (counters),
               tbmq.client.subscriptions  (last state per    │ sessions_connected, sessions_persistent, sessions,
                                           client → deltas)  │ subscriptions, subscribed_clients (gauges)
                                                             ▼
                 window(event_time, 1 minute) + watermark, append mode (each window emitted once, final)
                                                             ▼
                 foreachBatch: gauges = running sum of their deltas; Parquet <output>/stats/batch_id=<n>
                 (overwritten on replay) and one UsageStats per window to tbmq.sys.historical.data
                 (key = window start ms as a decimal string)

Event time: created_at_ms of tbmq.msg.all records (Kafka timestamp when 0); the Kafka record timestamp
(when the router / the registry wrote it) for every other topic.

Exactly-once: the checkpoint holds the Kafka offsets, the window aggregation state and the projection state
of every client; a restarted query continues where the last committed batch ended. A batch that was
running when the job died is replayed with the same input, so its Parquet directory is rewritten with the
same rows; its Kafka records may be written twice (same key, same value: readers keep the last per key).
Gauge totals after each batch are kept in <checkpoint>/gauges/<batch>.json (replay-safe the same way).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tbmq_platform import topics as T

from . import SOURCE, fsutil
from .decode import (ENTITY_SCHEMA, KIND_SESSION, METRIC_SCHEMA, decode_entity_batches,
                     decode_message_batches)
from .kafka_io import ENTITY_TOPICS, MESSAGE_TOPICS_PATTERN, read_stream, write_records

# how often run_stats looks at its stop event between awaitTermination calls
STOP_POLL_S = 0.5

log = logging.getLogger(__name__)

COUNTERS_ALWAYS = ("incoming_msgs", "incoming_bytes", "outgoing_msgs", "outgoing_bytes", "connects",
                   "disconnects")
GAUGES = ("sessions_connected", "sessions_persistent", "sessions", "subscriptions", "subscribed_clients")

STATS_SCHEMA = ("window_start timestamp, window_end timestamp, metric string, dimension string, "
                "value long, kind string")


@dataclass(frozen=True)
class StatsConfig:
    bootstrap: str
    output: str                         # Parquet root; stats go to <output>/stats
    checkpoint: str | None = None       # default <output>/_checkpoints/stats
    window: str = "1 minute"
    watermark: str = "1 minute"         # how late an event may be and still count
    trigger: str = "processingTime=10 seconds"   # or "availableNow" or "once"
    starting_offsets: str = "earliest"           # of the message topics ("earliest", "latest" or JSON)
    entity_starting_offsets: str | None = None   # of the session/subscription topics (default: the same)
    max_offsets_per_trigger: int | None = None
    publish: bool = True                # write UsageStats to tbmq.sys.historical.data

    @property
    def stats_path(self) -> str:
        return os.path.join(self.output, "stats")

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint or os.path.join(self.output, "_checkpoints", "stats")


# ------------------------------------------------------------------------------------------------------
# Projection of sessions and subscriptions: last state per client → metric deltas
# ------------------------------------------------------------------------------------------------------

def _processor_class():
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor
    from pyspark.sql.types import BooleanType, IntegerType, StringType, StructField, StructType

    state_schema = StructType([
        StructField("present", BooleanType()), StructField("connected", BooleanType()),
        StructField("persistent", BooleanType()), StructField("session_id", StringType()),
        StructField("n_subs", IntegerType())])

    class ProjectionDeltas(StatefulProcessor):
        """Keyed by entity ('session:<client>' / 'subscriptions:<client>'): keeps the client's last state
        and turns each new record into the change it makes to the counters and gauges."""

        def init(self, handle) -> None:
            self.state = handle.getValueState("last", state_schema)

        def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
            df = pd.concat(list(rows), ignore_index=True).sort_values(["part", "offset"])
            if self.state.exists():
                present, connected, persistent, session_id, n_subs = self.state.get()
            else:
                present, connected, persistent, session_id, n_subs = False, False, False, "", 0
            out_t, out_m, out_v = [], [], []

            def emit(t, metric, v):
                if v:
                    out_t.append(t)
                    out_m.append(metric)
                    out_v.append(int(v))

            for r in df.itertuples(index=False):
                if r.decode_error:
                    emit(r.event_time, "decode_errors", 1)
                    continue
                t = r.event_time
                if r.kind == KIND_SESSION:
                    now_present = not r.tombstone
                    now_connected = bool(r.connected) and now_present
                    now_persistent = bool(r.persistent) and now_present
                    now_sid = r.session_id if now_present else ""
                    if now_connected and (not connected or now_sid != session_id):
                        emit(t, "connects", 1)
                    if connected and (not now_connected or now_sid != session_id):
                        emit(t, "disconnects", 1)
                    emit(t, "sessions_connected", int(now_connected) - int(connected))
                    emit(t, "sessions_persistent", int(now_persistent) - int(persistent))
                    emit(t, "sessions", int(now_present) - int(present))
                    present, connected, persistent, session_id = now_present, now_connected, now_persistent, now_sid
                else:
                    now_subs = 0 if r.tombstone else int(r.n_subs)
                    emit(t, "subscriptions", now_subs - n_subs)
                    emit(t, "subscribed_clients", int(now_subs > 0) - int(n_subs > 0))
                    present, n_subs = now_subs > 0, now_subs
            if present or connected or persistent or n_subs:
                self.state.update((present, connected, persistent, session_id, n_subs))
            else:
                self.state.clear()       # removed session / empty subscription set: no state kept
            yield pd.DataFrame({"event_time": pd.Series(out_t, dtype="datetime64[us, UTC]"),
                                "metric": pd.Series(out_m, dtype=object),
                                "dimension": pd.Series([""] * len(out_m), dtype=object),
                                "value": pd.Series(out_v, dtype="int64")})

        def close(self) -> None:
            pass

    return ProjectionDeltas


# ------------------------------------------------------------------------------------------------------
# The query
# ------------------------------------------------------------------------------------------------------

def build_aggregation(spark, cfg: StatsConfig):
    from pyspark.sql import functions as F

    msgs = read_stream(spark, cfg.bootstrap, pattern=MESSAGE_TOPICS_PATTERN,
                       starting_offsets=cfg.starting_offsets,
                       max_offsets_per_trigger=cfg.max_offsets_per_trigger)
    msg_metrics = (msgs.select("topic", "value", "timestamp")
                   .mapInArrow(decode_message_batches, METRIC_SCHEMA)
                   .withWatermark("event_time", cfg.watermark))

    ents = read_stream(spark, cfg.bootstrap, topics=ENTITY_TOPICS,
                       starting_offsets=cfg.entity_starting_offsets or cfg.starting_offsets,
                       max_offsets_per_trigger=cfg.max_offsets_per_trigger)
    entity_rows = (ents.select("topic", "key", "value", "timestamp", "partition", "offset")
                   .mapInArrow(decode_entity_batches, ENTITY_SCHEMA)
                   .withWatermark("event_time", cfg.watermark))
    deltas = (entity_rows.groupBy("entity")
              .transformWithStateInPandas(
                  statefulProcessor=_processor_class()(),
                  outputStructType=METRIC_SCHEMA,
                  outputMode="Append",
                  timeMode="EventTime",
                  eventTimeColumnName="event_time"))

    return (msg_metrics.unionByName(deltas)
            .groupBy(F.window("event_time", cfg.window).alias("w"), "metric", "dimension")
            .agg(F.sum("value").alias("value"))
            .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                    "metric", "dimension", "value"))


def _gauge_dir(cfg: StatsConfig) -> str:
    return cfg.checkpoint_path.rstrip("/") + "/gauges"


def _previous_gauges(spark, cfg: StatsConfig, batch_id: int) -> dict[str, int]:
    """Gauge totals after the newest batch before `batch_id` (a replayed batch sees what it saw first)."""
    best = -1
    for name in fsutil.list_names(spark, _gauge_dir(cfg)):
        stem = name[:-5] if name.endswith(".json") else ""
        if stem.isdigit() and best < int(stem) < batch_id:
            best = int(stem)
    if best < 0:
        return {g: 0 for g in GAUGES}
    return json.loads(fsutil.read_text(spark, f"{_gauge_dir(cfg)}/{best}.json"))


def finalize_windows(rows: list[tuple], gauges: dict[str, int]) -> tuple[list[tuple], dict[str, int]]:
    """Aggregated (window_start, window_end, metric, dimension, value) rows of closed windows →
    STATS_SCHEMA rows: gauges as running totals, totals of the main counters always present (0)."""
    by_window: dict[tuple, dict[tuple[str, str], int]] = {}
    for ws, we, metric, dim, value in rows:
        by_window.setdefault((ws, we), {})[(metric, dim)] = int(value)
    totals = dict(gauges)
    out = []
    for (ws, we) in sorted(by_window):
        vals = by_window[(ws, we)]
        for c in COUNTERS_ALWAYS:
            vals.setdefault((c, ""), 0)
        for g in GAUGES:
            totals[g] = totals.get(g, 0) + vals.pop((g, ""), 0)
        for (metric, dim), v in sorted(vals.items()):
            out.append((ws, we, metric, dim, v, "counter"))
        for g in GAUGES:
            out.append((ws, we, g, "", totals[g], "gauge"))
    return out, totals


def usage_stats_records(rows: list[tuple]) -> list[tuple[bytes, bytes]]:
    """One (key, UsageStats) per window: key = window start in Unix ms as a decimal string."""
    from tbmq.v1 import messages_pb2 as pb

    msgs: dict[int, pb.UsageStats] = {}
    for ws, we, metric, dim, value, _kind in rows:
        start = int(ws.timestamp() * 1000)
        m = msgs.get(start)
        if m is None:
            m = msgs[start] = pb.UsageStats(source=SOURCE, window_start_ms=start,
                                            window_end_ms=int(we.timestamp() * 1000))
        m.stats.add(key=metric, dimension=dim, value=int(value))
    return [(str(k).encode(), m.SerializeToString()) for k, m in sorted(msgs.items())]


def make_batch_writer(cfg: StatsConfig):
    def write_batch(df, batch_id: int) -> None:
        spark = df.sparkSession
        rows = [tuple(r) for r in df.collect()]
        gauges = _previous_gauges(spark, cfg, batch_id)
        out, totals = finalize_windows(rows, gauges)
        if out:
            (spark.createDataFrame(out, STATS_SCHEMA).coalesce(1).write.mode("overwrite")
             .parquet(os.path.join(cfg.stats_path, f"batch_id={batch_id}")))
            if cfg.publish:
                recs = usage_stats_records(out)
                write_records(spark.createDataFrame(recs, "key binary, value binary"), cfg.bootstrap,
                              T.SYS_HISTORICAL_DATA)
            log.info("stats batch %d: %d windows", batch_id, len({r[0] for r in out}))
        fsutil.write_text(spark, f"{_gauge_dir(cfg)}/{batch_id}.json", json.dumps(totals))
        if batch_id % 100 == 0:          # keep the last ~100 files
            fsutil.delete_older(spark, _gauge_dir(cfg), batch_id - 100)

    return write_batch


def _apply_trigger(writer, trigger: str):
    if trigger in ("availableNow", "available-now"):
        return writer.trigger(availableNow=True)
    if trigger == "once":
        return writer.trigger(once=True)
    if trigger.startswith("processingTime="):
        return writer.trigger(processingTime=trigger.split("=", 1)[1])
    raise ValueError(f"unknown trigger {trigger!r} (availableNow, once, processingTime=<interval>)")


def start_stats(spark, cfg: StatsConfig):
    """Start the streaming query; returns the StreamingQuery (call awaitTermination/stop on it)."""
    agg = build_aggregation(spark, cfg)
    writer = (agg.writeStream.outputMode("append")
              .option("checkpointLocation", cfg.checkpoint_path)
              .queryName("tbmq-stats")
              .foreachBatch(make_batch_writer(cfg)))
    return _apply_trigger(writer, cfg.trigger).start()


# a failed query is restarted at most this often per run_stats call (each restart needs another topic deleted
# under a planned batch)
MAX_RESTARTS = 10


def run_stats(spark, cfg: StatsConfig, timeout_s: float | None = None, on_started=None,
              stop: threading.Event | None = None) -> int:
    """Run until the query ends (availableNow/once), `timeout_s` passes, or `stop` is set (the CLI sets it on
    SIGTERM/SIGINT); forever otherwise. `on_started(query)` is called once the query is active (the CLI's
    readiness signal; again for a restarted query). Returns how often the query was restarted.

    Deleted topics (docs/spark.md): the message pattern includes tbmq.msg.app.*, which app-delivery deletes
    when an APPLICATION session ends. A query that fails while its planned, uncommitted batch names a topic
    that no longer exists is restarted, at most MAX_RESTARTS times, after that batch is dropped
    (`uncommitted_batch`, `deleted_topics`); any other failure raises.

    The wait is a loop of short awaitTermination calls, never one call interrupted by a signal: an exception
    raised inside a py4j call (KeyboardInterrupt from a signal handler) breaks the gateway connection, and the
    JVM then answers nothing, so the query could not be stopped cleanly."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restarts = 0
    while True:
        if stop is not None and stop.is_set():
            return restarts
        q = start_stats(spark, cfg)
        raised = None
        try:
            if on_started is not None:
                on_started(q)
            while not (stop is not None and stop.is_set()):
                step = STOP_POLL_S if deadline is None else min(STOP_POLL_S, deadline - time.monotonic())
                try:
                    if step <= 0 or q.awaitTermination(step):
                        break
                except Exception as exc:  # the query ended with an error (StreamingQueryException)
                    raised = exc
                    break
        finally:
            if q.isActive:
                q.stop()
        failure = q.exception() or raised
        if failure is None:
            return restarts
        base = cfg.checkpoint_path.rstrip("/")
        batch = uncommitted_batch(fsutil.list_names(spark, f"{base}/offsets"),
                                  fsutil.list_names(spark, f"{base}/commits"))
        gone = set()
        if batch is not None and restarts < MAX_RESTARTS:
            gone = deleted_topics(fsutil.read_text(spark, f"{base}/offsets/{batch}"), _existing_topics(cfg.bootstrap))
        if not gone:
            raise RuntimeError(f"stats query failed: {failure}")
        restarts += 1
        fsutil.delete(spark, f"{base}/offsets/{batch}")
        fsutil.delete(spark, f"{base}/offsets/.{batch}.crc")
        log.warning("stats query failed with batch %d planned over deleted topics %s (%s); batch dropped, "
                    "restarting from the checkpoint (%d of at most %d)", batch, sorted(gone),
                    str(failure).splitlines()[0][:300], restarts, MAX_RESTARTS)


def uncommitted_batch(offset_names: list[str], commit_names: list[str]) -> int | None:
    """The batch a checkpoint planned and did not commit (the newest `offsets/<n>` without `commits/<n>`),
    or None. File names as listed (`.<n>.crc` and other names are ignored)."""
    planned = [int(n) for n in offset_names if n.isdigit()]
    if not planned:
        return None
    last = max(planned)
    return None if str(last) in commit_names else last


def deleted_topics(offsets_entry: str, existing: set[str]) -> set[str]:
    """The topics a logged batch (an `offsets/<n>` file: a version line, the batch's metadata, then one line
    per source, JSON {topic: {partition: offset}} or "-") reads that are not in `existing`.

    Why a batch naming one is dropped before the restart: Spark logs a batch's end offsets before it plans
    and runs it, and a restarted query runs a logged, uncommitted batch again as it was logged. With a
    deleted topic in it, that batch can never run: an availableNow run fails its check
    (LOST_TOPIC_PARTITIONS_IN_END_OFFSET_WITH_TRIGGER_AVAILABLENOW, SPARK-41387, "restart your query"), a task
    reading the topic waits 60 s for a partition that is gone and fails. Planned again from the last
    committed batch's end, it lists the topics as they are, and what was left unread of the deleted one is
    skipped (failOnDataLoss=false, a warning). Its outputs are idempotent per batch id (the Parquet
    directory is overwritten; a UsageStats record may be written again, same key and value)."""
    named: set[str] = set()
    for line in offsets_entry.splitlines()[2:]:
        line = line.strip()
        if line.startswith("{"):
            named |= set(json.loads(line))
    return named - existing


def _existing_topics(bootstrap: str) -> set[str]:
    """The cluster's topic names (metadata request of a short-lived consumer)."""
    import asyncio

    from tbmq_platform.kafka import make_consumer

    async def names() -> set[str]:
        c = make_consumer(bootstrap, group_id=None, client_id="tbmq-spark-stats-topics")
        await c.start()
        try:
            return set(await c.topics())
        finally:
            await c.stop()

    return asyncio.run(names())
