"""Kafka source/sink helpers: topic patterns built from the catalogue (tbmq_platform.topics)."""

from __future__ import annotations

import re

from tbmq_platform import topics as T

# Outgoing copies: one BasicDownlink per connector (counts its recipients), PersistedMsg, device-persistence's
# per-second tallies of the copies it got over Persist streams (PersistTally), and the APPLICATION topics
# (tbmq.msg.app.<client> and tbmq.msg.app.shared.<filter>).
# Anchored: Spark's Kafka source keeps a topic when the pattern is found in its name (find, not a full match),
# so an unanchored alternative `tbmq\.msg\.persisted` would also take tbmq.msg.persisted.dead.
MESSAGE_TOPICS_PATTERN = "^(?:" + "|".join([
    re.escape(T.MSG_ALL),
    re.escape(T.DOWNLINK_BASIC_PREFIX) + ".+",
    re.escape(T.MSG_PERSISTED),
    re.escape(T.MSG_PERSISTED_TALLY),
    re.escape(T.MSG_APP_PREFIX) + ".+",
]) + ")$"
ENTITY_TOPICS = [T.CLIENT_SESSION, T.CLIENT_SUBSCRIPTIONS]


def read_stream(spark, bootstrap: str, *, pattern: str | None = None, topics: list[str] | None = None,
                starting_offsets: str = "earliest", max_offsets_per_trigger: int | None = None):
    r = (spark.readStream.format("kafka")
         .option("kafka.bootstrap.servers", bootstrap)
         .option("startingOffsets", starting_offsets)
         .option("failOnDataLoss", "false")          # retention may delete what was never read
         # the session registry writes in Kafka transactions: an aborted (retried) batch is no event
         .option("kafka.isolation.level", "read_committed")
         .option("kafka.metadata.max.age.ms", "30000"))  # new tbmq.msg.app.* topics are found within 30 s
    if pattern:
        r = r.option("subscribePattern", pattern)
    else:
        r = r.option("subscribe", ",".join(topics or []))
    if max_offsets_per_trigger:
        r = r.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    return r.load()


def read_batch(spark, bootstrap: str, topics: list[str]):
    """Everything the topics hold now (earliest → latest)."""
    return (spark.read.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", ",".join(topics))
            .option("startingOffsets", "earliest")
            .option("endingOffsets", "latest")
            .option("failOnDataLoss", "false")
            .option("kafka.isolation.level", "read_committed")
            .load())


def write_records(df, bootstrap: str, topic: str) -> None:
    """Batch write of a (key binary, value binary) DataFrame; Spark's producer uses acks=all."""
    (df.write.format("kafka")
     .option("kafka.bootstrap.servers", bootstrap)
     .option("kafka.acks", "all")
     .option("topic", topic)
     .save())
