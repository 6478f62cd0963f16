"""The device-persistence service: tbmq.msg.persisted -> Redis (lua/) -> forwards to attached connectors,
plus the DevicePersistence gRPC API.

One batch at a time (consumer group `device-persistence`, key = client id so one client's records are in
one partition, in order):

  1. getmany (up to DEVICE_PERSISTENCE_MAX_POLL_RECORDS records), grouped per client in record order;
  2. save_many_attached: one save_messages.lua call per client, pipelined; each call also reads the
     client's attachment atomically with the save;
  3. every stored message of an attached client is produced as a DevicePublishMsg (key = client id,
     the source record's trace headers) to tbmq.msg.downlink.persisted.<attached service id>; the
     batch waits for those acks (at most DEVICE_PERSISTENCE_FORWARD_TIMEOUT_S);
  4. the batch's offsets are committed.

Offsets are committed only after the save (step 2) succeeded: a crash before the commit replays the batch
(stored again: QoS 1 duplicates, never a loss). Forwards are an optimisation (Redis holds every message;
the connector fetches them on the next connect), so a forward that fails or times out is logged and the
batch is committed anyway; in the normal case the commit also follows the forwards' acks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError, UnknownTopicOrPartitionError
from google.protobuf.message import DecodeError
from opentelemetry import trace
from redis.exceptions import RedisError
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.kafka import ensure_topics, make_consumer, make_producer
from tbmq_platform.lifecycle import Service
from tbmq_platform.topics import MSG_PERSISTED, downlink_persisted_topic, spec

from .grpc_api import DevicePersistenceServicer, start_server
from .settings import Settings
from .store import DeviceMsgStore

log = logging.getLogger(__name__)
tracer = trace.get_tracer("device_persistence")

_TRACE_HEADERS = ("traceparent", "tracestate")


class _Revoke(ConsumerRebalanceListener):
    """Before partitions are taken away, the batch in progress finishes and commits."""

    def __init__(self, service: DevicePersistenceService) -> None:
        self.service = service

    async def on_partitions_revoked(self, revoked) -> None:
        async with self.service._batch_lock:
            await self.service._commit_pending()

    async def on_partitions_assigned(self, assigned) -> None:
        log.info("assigned %d partition(s) of %s", len(assigned), MSG_PERSISTED)


class DevicePersistenceService(Service):
    name = "device-persistence"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.s = settings
        self.store = DeviceMsgStore(settings.store_config())
        self.servicer = DevicePersistenceServicer(self.store)
        self.grpc_server = None
        self.grpc_port: int | None = None
        self.producer = None
        self.consumer = None
        self.stats: Counter = Counter()
        self._batch_lock = asyncio.Lock()
        self._stopping = False
        self._loop_task: asyncio.Task | None = None
        self._missing_topics: dict[str, float] = {}  # forward topic -> skip it until (monotonic)
        self._pending_offsets: dict = {}  # saved (durable) but not yet committed: tp -> next offset
        self._last_commit = 0.0

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.s
        await self.store.start()  # connects, loads the scripts (a Lua error fails start-up)
        await self.store.ping()
        await ensure_topics(s.bootstrap, [spec(MSG_PERSISTED)], profile=s.topic_profile)
        self.producer = make_producer(s.bootstrap, client_id=s.instance_id)
        await self.producer.start()
        self.consumer = make_consumer(s.bootstrap, group_id=s.group_id, client_id=s.instance_id,
                                      max_poll_records=s.max_poll_records,
                                      fetch_max_wait_ms=s.fetch_max_wait_ms, fetch_min_bytes=s.fetch_min_bytes)
        self.consumer.subscribe([MSG_PERSISTED], listener=_Revoke(self))
        await self.consumer.start()
        self.grpc_server, self.grpc_port = await start_server(self.servicer, s.grpc_host, s.grpc_port)
        log.info("DevicePersistence gRPC on %s:%d; Redis %s; limit %d, TTL %ds", s.grpc_host, self.grpc_port,
                 ",".join(s.redis_cluster_nodes) or s.redis_url, s.messages_limit, s.messages_ttl_s)
        self._loop_task = self.spawn(self._consume(), "persisted consumer")

    async def stop(self) -> None:
        # 1. stop accepting gRPC calls; those in progress get the grace period
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.s.shutdown_grace_s)
        # 2. the batch in progress finishes (save, forwards, commit); no new one starts
        self._stopping = True
        if self._loop_task is not None and not self._loop_task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._loop_task), 20)
            except (asyncio.TimeoutError, Exception):
                log.warning("consumer loop did not end cleanly; uncommitted records will be replayed")
        # 3. leave the group, flush, close
        if self.consumer is not None:
            await self.consumer.stop()
        if self.producer is not None:
            await self.producer.stop()
        await self.store.close()
        log.info("stopped: %s", dict(self.stats))

    def health_details(self) -> dict:
        return {"grpc_port": self.grpc_port, **self.stats, "store": vars(self.store.stats),
                "grpc_calls": dict(self.servicer.calls)}

    # ------------------------------------------------------------------------------------ consumer
    async def _consume(self) -> None:
        consumer = self.consumer
        interval = self.s.commit_interval_ms / 1000
        try:
            while not self._stopping:
                batches = await consumer.getmany(timeout_ms=min(200, max(1, int(interval * 1000) or 200)),
                                                 max_records=self.s.max_poll_records)
                async with self._batch_lock:
                    if batches:
                        assigned = consumer.assignment()
                        batches = {tp: recs for tp, recs in batches.items() if tp in assigned and recs}
                        if batches:
                            await self._process(batches)
                    if self._pending_offsets and (
                            not batches or time.monotonic() - self._last_commit >= interval):
                        await self._commit_pending()
        finally:
            if self._pending_offsets and not self._batch_lock.locked():
                async with self._batch_lock:
                    await self._commit_pending()

    async def _process(self, batches) -> None:
        t0 = time.monotonic()
        groups: dict[str, list[pb.PublishMsg]] = {}
        headers: dict[str, list] = {}
        records = 0
        for tp, recs in batches.items():
            for r in recs:
                records += 1
                try:
                    pm = pb.PersistedMsg.FromString(r.value or b"")
                except DecodeError:
                    self.stats["bad_records"] += 1
                    log.error("undecodable PersistedMsg at %s[%d]@%d: skipped", tp.topic, tp.partition, r.offset)
                    continue
                cid = pm.client_id
                groups.setdefault(cid, []).append(pm.msg)
                headers.setdefault(cid, []).append(
                    [(k, v) for k, v in (r.headers or ()) if k in _TRACE_HEADERS])
        with tracer.start_as_current_span("device-persistence.save", attributes={
                "messaging.batch.message_count": records, "tbmq.clients": len(groups)}):
            results = await self._save(groups)
            if results is None:
                return  # stopping while Redis is down: nothing committed, the batch is replayed
            await self._forward(results, headers)
        # durable (saved): committed with the next ones (DEVICE_PERSISTENCE_COMMIT_INTERVAL_MS), before a
        # rebalance and at stop
        for tp, recs in batches.items():
            self._pending_offsets[tp] = recs[-1].offset + 1
        self.stats["batches"] += 1
        self.stats["records"] += records
        log.debug("batch of %d records, %d clients in %.1f ms", records, len(groups),
                  (time.monotonic() - t0) * 1000)

    async def _save(self, groups):
        delay = 0.1
        while True:
            try:
                results = await self.store.save_many_attached(groups)
                self.stats["saved"] += sum(len(r.messages) for r in results.values())
                return results
            except (RedisError, OSError) as exc:
                # Nothing is committed; a retry may store some clients' messages twice (QoS 1 allows it).
                self.stats["save_failures"] += 1
                if self._stopping:
                    log.warning("save failed while stopping (%r): batch left uncommitted", exc)
                    return None
                log.warning("saving a batch in Redis failed (%r); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _forward(self, results, headers) -> None:
        by_topic: dict[str, list[tuple[bytes, bytes, list]]] = {}
        now = time.monotonic()
        for cid, res in results.items():
            if res.attached is None or not res.messages:
                continue
            topic = downlink_persisted_topic(res.attached.service_id)
            if self._missing_topics.get(topic, 0) > now:
                self.stats["forward_skipped"] += len(res.messages)  # connector gone: stays in Redis
                continue
            key = cid.encode("utf-8")
            hdrs = headers[cid]
            out = by_topic.setdefault(topic, [])
            for dm, i in zip(res.messages, res.indexes):
                out.append((key, dm.SerializeToString(), hdrs[i]))
        if not by_topic:
            return
        producer = self.producer

        async def send_all(topic: str, items) -> int:
            if producer.client.cluster.partitions_for_topic(topic) is None:
                try:  # connectors create their topics before accepting clients: missing = gone
                    await asyncio.wait_for(producer.partitions_for(topic), 3)
                except (asyncio.TimeoutError, UnknownTopicOrPartitionError):
                    raise UnknownTopicOrPartitionError(f"forward topic {topic} does not exist") from None
            # sequential send() per topic keeps one client's forwards in order (idempotent producer)
            futures = [await producer.send(topic, value=v, key=k, headers=h) for k, v, h in items]
            await asyncio.gather(*futures)
            return len(items)

        tasks = [asyncio.ensure_future(send_all(t, items)) for t, items in by_topic.items()]
        done, pending = await asyncio.wait(tasks, timeout=self.s.forward_timeout_s)
        for task in pending:
            task.cancel()
        topic_of = dict(zip(tasks, by_topic))
        for task in done:
            exc = task.exception()
            if exc is not None:
                self.stats["forward_failures"] += 1
                if isinstance(exc, UnknownTopicOrPartitionError):
                    # a connector that is gone (its topics deleted): do not stall every batch on it
                    self._missing_topics[topic_of[task]] = time.monotonic() + 60
                log.warning("forwarding to %s failed: %r (the messages stay in Redis)", topic_of[task], exc)
            else:
                self.stats["forwarded"] += task.result()
        if pending:
            self.stats["forward_timeouts"] += len(pending)
            log.warning("forwards to %s not acknowledged within %.1fs (the messages stay in Redis)",
                        ", ".join(topic_of[t] for t in pending), self.s.forward_timeout_s)
            await asyncio.gather(*pending, return_exceptions=True)

    async def _commit_pending(self) -> None:
        offsets, self._pending_offsets = self._pending_offsets, {}
        self._last_commit = time.monotonic()
        if offsets:
            await self._commit(offsets)

    async def _commit(self, offsets) -> None:
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            # A rebalance took the partitions: their new owner replays from the last commit (QoS 1
            # duplicates of what this batch stored, never a loss).
            self.stats["commit_failures"] += 1
            log.warning("commit failed (%r): the batch will be replayed by the partitions' new owner", exc)
