"""A known workload for the Spark tests, produced straight to the topics with the real payload types.

Every record carries an explicit Kafka timestamp, and every PublishMsg a created_at_ms, inside known
minutes, so the expected count of every window is exact.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics as T
from tbmq_platform.kafka import ensure_topics, make_producer

MINUTE_MS = 60_000


@dataclass
class Workload:
    """What was produced, by window start (ms) → expected values."""
    window_ms: int
    expected: dict[int, dict[tuple[str, str], int]] = field(default_factory=dict)

    def add(self, t_ms: int, metric: str, dim: str, value: int) -> None:
        ws = t_ms - t_ms % self.window_ms
        w = self.expected.setdefault(ws, {})
        w[(metric, dim)] = w.get((metric, dim), 0) + value


def publish(client: str, topic: str, payload: bytes, qos: int, created_at_ms: int, retain: bool = False):
    return pb.PublishMsg(publisher_id=client, topic=topic, payload=payload, qos=qos, retain=retain,
                         created_at_ms=created_at_ms, publisher_mqtt_version=5,
                         publisher_service_id="connector-1")


def session(client: str, *, connected: bool, persistent: bool, session_id: str, t_ms: int):
    return pb.SessionInfo(client_id=client, service_id="connector-1", session_id=session_id,
                          connected=connected, persistent=persistent, clean_start=not persistent,
                          mqtt_version=5, connected_at_ms=t_ms if connected else 0,
                          disconnected_at_ms=0 if connected else t_ms)


def subscriptions(client: str, filters: list[str]):
    return pb.ClientSubscriptions(
        client_id=client, subscriptions=[pb.TopicSubscription(topic_filter=f, qos=1) for f in filters])


async def create_topics(bootstrap: str, extra: list[str] = ()) -> None:
    specs = list(T.static_topics()) + T.service_topics("connector-1")
    specs += [T.app_topic(c) for c in extra]
    await ensure_topics(bootstrap, specs)


async def produce(bootstrap: str, records: list[tuple[str, bytes | None, bytes | None, int]]) -> None:
    """records: (kafka topic, key, value or None for a tombstone, timestamp ms)."""
    p = make_producer(bootstrap, client_id="spark-test-workload")
    await p.start()
    try:
        futs = [await p.send(topic, key=key, value=value, timestamp_ms=ts) for topic, key, value, ts in records]
        await asyncio.gather(*futs)
    finally:
        await p.stop()


async def partitions(bootstrap: str, names: list[str]) -> dict[str, list[int]]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        desc = await admin.describe_topics(names) if names else []
    finally:
        await admin.close()
    return {d["topic"]: sorted(p["partition"] for p in d["partitions"]) for d in desc}


async def end_offsets(bootstrap: str, *, pattern: str | None = None, topics: list[str] | None = None) -> str:
    """Spark `startingOffsets` JSON: the current end of every partition of the matching topics, so a job
    started from it sees only what the test produces afterwards (the broker is shared by the whole run).

    A topic of the pattern can be deleted between the listing and the ListOffsets (app-delivery deletes the
    tbmq.msg.app.* topic of an APPLICATION client other tests removed): aiokafka then retries it as stale
    metadata until its request timeout. Such an attempt fails after 10 s and the topics are listed again
    (a deleted topic is gone from the new listing; Spark, subscribed by pattern, would not read it)."""
    import json

    from aiokafka.errors import KafkaError
    from waits import wait_until

    errors: list[BaseException] = []

    async def attempt():
        try:
            return await _end_offsets_once(bootstrap, pattern, topics)
        except KafkaError as e:
            errors.append(e)
            return None

    ends = await wait_until(attempt, 90, lambda: f"the end offsets of {pattern or topics} "
                                                 f"({len(errors)} attempts failed, the last: {errors[-1]!r})"
                            if errors else f"the end offsets of {pattern or topics}")
    out: dict[str, dict[str, int]] = {}
    for tp, off in ends.items():
        out.setdefault(tp.topic, {})[str(tp.partition)] = off
    return json.dumps(out)


async def _end_offsets_once(bootstrap: str, pattern: str | None, topics: list[str] | None) -> dict:
    """One listing and one ListOffsets (10 s at most) of the matching topics' partitions: {tp: end offset}
    (an `_Ends`, truthy even when empty)."""
    import re

    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, request_timeout_ms=10_000)
    await c.start()
    try:
        names = await c.topics()
        rx = re.compile(pattern) if pattern else None
        chosen = sorted(n for n in names if (rx.fullmatch(n) if rx else n in (topics or [])))
        parts = await partitions(bootstrap, chosen)
        tps = [TopicPartition(t, p) for t in chosen for p in parts.get(t, ())]
        if not tps:
            return _Ends()
        # assigned first, so one metadata update covers every topic: end_offsets alone learns an unknown topic
        # per retry (100 ms backoff each), which outlasted the request timeout with the hundred-odd topics the
        # integration suite leaves behind
        c.assign(tps)
        return _Ends(await c.end_offsets(tps))
    finally:
        await c.stop()


class _Ends(dict):
    """The end offsets found: truthy even when no topic matched (wait_until stops at a truthy answer)."""

    def __bool__(self) -> bool:
        return True


async def read_all(bootstrap: str, topic: str, start: dict[int, int] | None = None) -> list:
    """Every record of `topic` from `start` (partition → offset; default: beginning) to its current end."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await c.start()
    out = []
    try:
        tps = [TopicPartition(topic, p) for p in (await partitions(bootstrap, [topic])).get(topic, [])]
        c.assign(tps)
        ends = await c.end_offsets(tps)
        for tp in tps:
            c.seek(tp, (start or {}).get(tp.partition, 0))
        remaining = {tp for tp in tps if ends[tp] > (start or {}).get(tp.partition, 0)}
        while remaining:
            batch = await c.getmany(timeout_ms=1000)
            for tp, recs in batch.items():
                out.extend(recs)
                if recs and recs[-1].offset + 1 >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await c.stop()
    return out
