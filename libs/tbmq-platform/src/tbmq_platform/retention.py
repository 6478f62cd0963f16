"""Retention watch: a warning before Kafka's retention deletes records a consumer group has not consumed yet,
and an alarm when it already has.

A PUBLISH is acknowledged once it is on tbmq.msg.all; the router consumes it later. Should the router stay
behind (stopped, crash-looping, too slow) for longer than the topic's retention.ms, Kafka deletes acknowledged
messages that were never routed, and nothing else would say so. The same holds for device-persistence on
tbmq.msg.persisted and for an APPLICATION client's topic while the client is offline. Each service that
consumes such a topic runs a `RetentionWatch` over its own consumer group.

Every `interval_s` it asks Kafka (one ListOffsets for the earliest and end offsets, one ListOffsets by
timestamp, one OffsetFetch for the group's committed offsets, one DescribeConfigs for the topics' real
retention.ms) and decides per partition, with `assess`:

* ``near``: unconsumed records older than ``warn_fraction`` × retention.ms exist (the first record at or after
  ``now - warn_fraction × retention.ms`` lies beyond the committed offset) — a WARNING log line when the
  partition enters the state, and the gauge ``retention_near_partitions``;
* ``lost``: the committed offset is below the log start offset — retention (or a deletion) removed
  ``earliest - committed`` records the group never consumed: an ERROR log line and the counter
  ``retention_lost_records``.

Not watched: retention.bytes (the Kafka client used here cannot read a partition's size on disk; a log that
hits its byte limit shows up as ``lost`` after the fact), and a group with no committed offset at all (its
consumers start from the log start; there is nothing to compare with).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from .kafka import client_config, make_admin

log = logging.getLogger(__name__)

OK, NEAR, LOST = "ok", "near", "lost"


@dataclass(frozen=True, slots=True)
class Finding:
    tp: TopicPartition
    state: str                 # OK, NEAR or LOST
    unconsumed: int            # end - committed (records the group has not consumed)
    lost: int = 0              # records deleted before the group consumed them (LOST)


def assess(tp: TopicPartition, *, committed: int | None, earliest: int, end: int,
           first_at_threshold: int | None) -> Finding:
    """The state of one partition. `first_at_threshold`: the first offset whose timestamp is at or after
    ``now - warn_fraction × retention.ms`` (None: every record is older than that)."""
    if committed is None or committed >= end:
        return Finding(tp, OK, 0)
    if committed < earliest:
        return Finding(tp, LOST, end - committed, earliest - committed)
    threshold = end if first_at_threshold is None else first_at_threshold
    if committed < threshold:
        return Finding(tp, NEAR, end - committed)
    return Finding(tp, OK, end - committed)


class RetentionWatch:
    """Watches `group`'s committed offsets on `topics` (a callable: the set may change, e.g. APPLICATION
    topics) against the topics' retention.ms. `stats` holds ``retention_near_partitions`` (gauge) and
    ``retention_lost_records`` (counter)."""

    def __init__(self, bootstrap: str, group: str | Callable[[str], str], topics: Callable[[], Iterable[str]],
                 *, interval_s: float = 60.0, warn_fraction: float = 0.8,
                 clock: Callable[[], float] = time.time, client_id: str = "retention-watch") -> None:
        self.bootstrap = bootstrap
        self._group = group
        self._topics = topics
        self.interval_s = interval_s
        self.warn_fraction = warn_fraction
        self._clock = clock
        self._client_id = client_id
        self._states: dict[TopicPartition, str] = {}
        self._lost_seen: dict[TopicPartition, int] = {}
        self.stats = {"retention_near_partitions": 0, "retention_lost_records": 0}
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    async def started(cls, settings, group: str | Callable[[str], str], topics: Callable[[], Iterable[str]],
                      ) -> "RetentionWatch | None":
        """A watch running in the background with the service's common settings
        (TBMQ_RETENTION_WATCH_INTERVAL_S, TBMQ_RETENTION_WARN_FRACTION); None when the interval is 0."""
        if settings.retention_watch_interval_s <= 0:
            return None
        watch = cls(settings.bootstrap, group, topics, interval_s=settings.retention_watch_interval_s,
                    warn_fraction=settings.retention_warn_fraction,
                    client_id=f"{settings.instance_id}-retention")
        await watch.start()
        watch._task = asyncio.get_running_loop().create_task(watch.run(), name="retention watch")
        return watch

    async def close(self) -> None:
        """Stop the background checks (started()) and the clients."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.stop()

    def group_of(self, topic: str) -> str:
        return self._group(topic) if callable(self._group) else self._group

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap,
                                          **client_config(client_id=self._client_id, enable_auto_commit=False))
        await self._consumer.start()
        self._admin = make_admin(self.bootstrap, client_id=self._client_id)
        await self._admin.start()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
        if self._admin is not None:
            await self._admin.close()

    async def run(self) -> None:
        """Check every `interval_s` until cancelled; a failed check is logged and retried next time."""
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("retention check failed: %r", exc)
            await asyncio.sleep(self.interval_s)

    async def check(self) -> list[Finding]:
        consumer, admin = self._consumer, self._admin
        assert consumer is not None and admin is not None, "start() first"
        topics = sorted(set(self._topics()))
        if not topics:
            return []
        existing = set(await admin.list_topics())
        topics = [t for t in topics if t in existing]
        retention = await self._retention_ms(topics)
        parts: list[TopicPartition] = []
        for t in topics:
            for p in sorted(consumer.partitions_for_topic(t) or await self._partitions(t)):
                parts.append(TopicPartition(t, p))
        if not parts:
            return []
        earliest = await consumer.beginning_offsets(parts)
        end = await consumer.end_offsets(parts)
        now_ms = int(self._clock() * 1000)
        at = await consumer.offsets_for_times(
            {tp: max(0, now_ms - int(self.warn_fraction * retention[tp.topic]))
             for tp in parts if retention.get(tp.topic)})
        committed = await self._committed(parts)
        findings = []
        for tp in parts:
            if not retention.get(tp.topic):
                continue  # retention.ms -1 (keep for ever) or a compacted topic
            hit = at.get(tp)
            f = assess(tp, committed=committed.get(tp), earliest=earliest[tp], end=end[tp],
                       first_at_threshold=None if hit is None else hit.offset)
            findings.append(f)
            self._report(f, retention[tp.topic])
        self.stats["retention_near_partitions"] = sum(1 for f in findings if f.state != OK)
        return findings

    def _report(self, f: Finding, retention_ms: int) -> None:
        before = self._states.get(f.tp, OK)
        self._states[f.tp] = f.state
        if f.state == LOST:
            # count each deleted record once, however many checks see the same gap
            seen = self._lost_seen.get(f.tp, 0)
            if f.lost > seen:
                self.stats["retention_lost_records"] += f.lost - seen
                self._lost_seen[f.tp] = f.lost
                log.error("%s: %d records were deleted (retention %.1f h) before consumer group %s consumed "
                          "them; %d unconsumed records remain", f.tp, f.lost - seen, retention_ms / 3.6e6,
                          self.group_of(f.tp.topic), f.unconsumed)
        else:
            self._lost_seen.pop(f.tp, None)
            if f.state == NEAR and before != NEAR:
                log.warning("%s: consumer group %s has %d unconsumed records older than %.0f%% of the "
                            "topic's retention (%.1f h); Kafka deletes them at %.1f h",
                            f.tp, self.group_of(f.tp.topic), f.unconsumed, self.warn_fraction * 100,
                            self.warn_fraction * retention_ms / 3.6e6, retention_ms / 3.6e6)
            elif f.state == OK and before != OK:
                log.info("%s: consumer group %s is clear of the retention limit again", f.tp,
                         self.group_of(f.tp.topic))

    async def _partitions(self, topic: str) -> set[int]:
        consumer = self._consumer
        await consumer._client.force_metadata_update()
        return consumer.partitions_for_topic(topic) or set()

    async def _committed(self, parts: list[TopicPartition]) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        by_group: dict[str, list[TopicPartition]] = {}
        for tp in parts:
            by_group.setdefault(self.group_of(tp.topic), []).append(tp)
        for group, tps in by_group.items():
            offsets = await self._admin.list_consumer_group_offsets(group, partitions=tps)
            for tp, meta in offsets.items():
                if meta is not None and meta.offset >= 0:
                    out[tp] = meta.offset
        return out

    async def _retention_ms(self, topics: list[str]) -> dict[str, int]:
        """retention.ms as the broker has it (an operator may have changed it); 0 when the topic keeps its
        records for ever or is compacted only."""
        res = await self._admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t, configs={"retention.ms": None, "cleanup.policy": None})
             for t in topics])
        out: dict[str, int] = {}
        for response in res:
            for resource in response.resources:
                name = resource[3]
                cfg = {entry[0]: entry[1] for entry in resource[4]}
                ms = int(cfg.get("retention.ms") or -1)
                out[name] = ms if ms > 0 and "delete" in (cfg.get("cleanup.policy") or "delete") else 0
        return out


__all__ = ["LOST", "NEAR", "OK", "Finding", "RetentionWatch", "assess"]
