"""The session registry's I/O: consume session event requests, apply `logic.decide`, and write the results
with one Kafka transaction per (batch, request partition).

Exactly-once: every request partition has its own transactional producer, transactional id
`<prefix>-p<partition>` (stable, shared by all instances). The partition's session records, responses,
subscription clears, disconnect commands and app-removed events are sent in a transaction together with
the consumed offsets (send_offsets_to_transaction, group `session-registry`). aiokafka 0.14 speaks
TxnOffsetCommit v0 (no consumer-group generation, KIP-447 is not available), so fencing comes from the
transactional id: whoever owns partition p after a rebalance or a restart initialises producer
`<prefix>-p<p>`, which aborts the previous owner's open transaction and fences it (ProducerFenced) should it
still be alive. Revocation waits for the in-flight batch to finish; assignment initialises the producers
of the new partitions and then waits for the session view to catch up before any request is processed.

Dead connectors (docs/session-registry.md, "Dead connectors"): every instance follows tbmq.connector.heartbeat
(session_registry.liveness) and, for the request partitions it owns, writes one CONNECTOR_GONE_REQUEST per
session still connected on a dead connector run, and one WILL_DUE_REQUEST per delayed Will that is due, into
the request topic (like the expiry scan), so the partition's owner applies them in its transaction: a dead
connector's Wills are published exactly once, in the transaction that ends the session. The owner of request
partition 0 deletes the per-connector topics of a connector dead for TBMQ_CONNECTOR_TOPICS_RETENTION_MS.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError, ProducerFenced
from opentelemetry import trace
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.compacted import CompactedTopicView
from tbmq_platform.kafka import (
    IDLE_FETCH_WAIT_MS,
    KeyPartitioner,
    delete_topics,
    ensure_topics,
    make_consumer,
    make_producer,
)
from tbmq_platform.lifecycle import Service
from tbmq_platform.retention import RetentionWatch
from tbmq_platform.tracing import kafka_headers, span_from_kafka
from tbmq_routing.naming import app_client_group
from tbmq_routing.wills import publish_records

from . import logic
from .device import ClearFailed, DeviceClearer
from .liveness import Liveness
from .settings import SessionRegistrySettings
from .state import Batch, SessionStore

log = logging.getLogger(__name__)
tracer = trace.get_tracer("session_registry")

REQUESTS = topics.SESSION_EVENT_REQUEST
SEND_TIMEOUT_S = 10.0
DEFERRED_CLEAR_MAX_S = 600.0   # a deferred Clear is retried this long, then left to the session's removal
_TYPE_NAMES = {v: k.removeprefix("SESSION_EVENT_") for k, v in pb.SessionEventType.items()}
_ROUTINE = {"connected", "disconnected", "removed", "duplicate", "stale", "ignored"}
GONE = pb.SESSION_EVENT_CONNECTOR_GONE_REQUEST
WILL_DUE = pb.SESSION_EVENT_WILL_DUE_REQUEST
CLEAR = pb.SESSION_EVENT_CLEAR_SESSION_REQUEST
TAKEN_OVER_WILL = pb.SESSION_EVENT_TAKEN_OVER_WILL_REQUEST


def now_ms() -> int:
    return int(time.time() * 1000)


_KEYS = KeyPartitioner()


def partition_of(client_id: str, partitions: int) -> int:
    """The request partition of a client id: Kafka's default key partitioner on the key bytes."""
    return _KEYS(client_id.encode("utf-8"), list(range(partitions)), [])


async def _each_logged(*steps) -> None:
    """Run each (coroutine function, what) of a periodic round; a failure is logged, the next step runs."""
    for step, what in steps:
        try:
            await step()
        except Exception:
            log.exception("%s failed", what)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, registry: "SessionRegistry") -> None:
        self.registry = registry

    async def on_partitions_revoked(self, revoked):
        await self.registry._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned):
        await self.registry._on_assigned(assigned)


class SessionRegistry(Service):
    name = "session-registry"

    def __init__(self, settings: SessionRegistrySettings) -> None:
        super().__init__(settings)
        self.s = settings
        self.rules = logic.Rules.from_settings(settings)
        self.store = SessionStore()
        self.device = DeviceClearer(settings.device_persistence_target, tls=settings.grpc_tls)
        self.view: CompactedTopicView | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.meta: AIOKafkaConsumer | None = None          # end offsets of APPLICATION topics
        self.plain: AIOKafkaProducer | None = None         # the expiry scan's CLEAR_SESSION_REQUESTs
        self.producers: dict[int, AIOKafkaProducer] = {}
        self.owned: set[int] = set()
        self._lock = asyncio.Lock()
        self._generation = 0
        self._stopping = False
        self._svc_topics: set[str] = set()
        self._app_topics: set[str] = set()
        # (client id, request type) -> (session id, monotonic time) of a request a scan sent, not sent again
        # for the same session before it is due again (resend_after)
        self._asked: dict[tuple[str, int], tuple[str, float]] = {}
        self.liveness = Liveness(settings.connector_timeout_ms)
        self.heartbeats: CompactedTopicView | None = None
        self._liveness_wake = asyncio.Event()
        # client id -> monotonic time of the first failure of a deferrable Clear (logic.Outcome
        # .device_clear_deferrable) that still has to be done; retried by the expiry loop under self._lock
        self._deferred_clears: dict[str, float] = {}
        self.stats = {"requests": 0, "transactions": 0, "aborted": 0, "connectors_declared_dead": 0,
                      "wills_published": 0, "connector_topics_deleted": 0, "session_scans": 0}
        self.retention: RetentionWatch | None = None
        self._app_groups: dict[str, str] = {}

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.s
        await ensure_topics(s.bootstrap, [topics.spec(n) for n in (
            REQUESTS, topics.CLIENT_SESSION, topics.CLIENT_SUBSCRIPTIONS, topics.SYS_APP_REMOVED,
            topics.CONNECTOR_HEARTBEAT, topics.MSG_ALL, topics.MSG_RETAINED)],
            layout=s.topic_layout)
        self.view = CompactedTopicView(s.bootstrap, topics.CLIENT_SESSION, self.store.apply_record,
                                       client_id=f"{s.instance_id}-sessions", read_committed=True)
        await self.view.start()
        log.info("session state rebuilt: %d sessions (%d APPLICATION)", self.store.sessions,
                 self.store.applications)
        self.heartbeats = CompactedTopicView(s.bootstrap, topics.CONNECTOR_HEARTBEAT, self._on_heartbeat,
                                             client_id=f"{s.instance_id}-heartbeats")
        await self.heartbeats.start()
        self.meta = make_consumer(s.bootstrap, group_id=None, client_id=f"{s.instance_id}-meta")
        await self.meta.start()
        self.plain = make_producer(s.bootstrap, client_id=f"{s.instance_id}-scan")
        await self.plain.start()
        self.consumer = make_consumer(s.bootstrap, group_id=s.group_id, client_id=s.instance_id,
                                      read_committed=True, max_poll_records=s.batch_max_records,
                                      session_timeout_ms=int(s.session_timeout_s * 1000),
                                      heartbeat_interval_ms=2000, long_poll=True,
                                      # static membership: a restart (same TBMQ_SERVICE_ID) gets its partitions
                                      # back at once; a dynamic member waited out the dead one's session
                                      group_instance_id=s.group_instance_id,
                                      # a batch whose transaction failed is fetched again after a seek, and a
                                      # seek waits for the parked fetch: that wait stays aiokafka's 500 ms
                                      fetch_max_wait_ms=500)
        await self.consumer.start()
        self.consumer.subscribe([REQUESTS], listener=_Listener(self))
        self.spawn(self._consume(), "consume session requests")
        self.spawn(self._expiry_loop(), "session expiry scan")
        self.spawn(self._liveness_loop(), "dead connector scan")
        # the backlog of every APPLICATION session (offline ones too: that is where retention bites) against
        # its topic's retention; each registry instance watches them all
        self.retention = await RetentionWatch.started(s, self._app_group_of, self._watched_app_topics)
        self._register_metrics()

    def _register_metrics(self) -> None:
        """GET /metrics (tbmq_platform.metrics): read from the counters at scrape time."""
        m, st = self.metrics, self.stats
        m.gauge("sessions", "sessions the registry holds", lambda: self.store.sessions)
        m.gauge("application_sessions", "sessions of APPLICATION clients", lambda: self.store.applications)
        m.counter("session_requests", "session event requests consumed", lambda: st["requests"])
        m.counter("registry_transactions", "Kafka transactions committed", lambda: st["transactions"])
        m.counter("registry_transactions_aborted", "Kafka transactions aborted (the batch is retried)",
                  lambda: st["aborted"])
        m.gauge("owned_request_partitions", "request partitions this instance owns", lambda: len(self.owned))
        m.lag("consumer_lag", lambda: [(self.s.group_id, self.consumer)] if self.consumer is not None else [])

    async def stop(self) -> None:
        self._stopping = True
        async with self._lock:  # the in-flight batch finishes (and commits) first
            pass
        await self.cancel_tasks()
        if self.retention is not None:
            await self.retention.close()
        if self.consumer is not None:
            await self.consumer.stop()
        await asyncio.gather(*(p.stop() for p in self.producers.values()), return_exceptions=True)
        self.producers.clear()
        for c in (self.plain, self.meta, self.view, self.heartbeats):
            if c is not None:
                await c.stop()
        await self.device.close()

    def readiness_checks(self) -> dict:
        # every decision reads the session map: a view that stopped following would decide on stale sessions
        return {"session view": self.view.problem}

    def health_details(self) -> dict:
        return {"partitions": sorted(self.owned), "sessions": self.store.sessions,
                "applications": self.store.applications, **self.stats,
                **(self.retention.stats if self.retention is not None else {})}

    def _watched_app_topics(self) -> list[str]:
        """APPLICATION topics of every APPLICATION session (for the retention watch); remembers the group
        of each."""
        self._app_groups = {topics.app_topic_name(cid): app_client_group(cid)
                            for cid, sess in self.store.items() if sess.client_type == pb.CLIENT_TYPE_APPLICATION}
        return list(self._app_groups)

    def _app_group_of(self, topic: str) -> str:
        return self._app_groups[topic]

    def _fatal(self, exc: BaseException) -> None:
        log.error("fatal: %s", exc, exc_info=exc)
        fut = self.failed()
        if not fut.done():
            fut.set_exception(exc)

    # -- rebalancing --------------------------------------------------------------------------------
    async def _on_revoked(self, revoked) -> None:
        self._generation += 1
        async with self._lock:       # wait for the in-flight transactions to end
            self.owned = set()
            # aiokafka rebalances eagerly (everything is revoked): a deferred Clear must not outlive our
            # ownership, another instance may meanwhile start a persistent DEVICE session of that client
            if self._deferred_clears:
                log.info("dropping %d deferred Clears at revocation", len(self._deferred_clears))
            self._deferred_clears.clear()
        log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))

    async def _on_assigned(self, assigned) -> None:
        try:
            async with self._lock:
                parts = {tp.partition for tp in assigned if tp.topic == REQUESTS}
                for p in [p for p in self.producers if p not in parts]:
                    producer = self.producers.pop(p)
                    await producer.stop()
                # initialising producer <prefix>-p<n> aborts a previous owner's open transaction
                await asyncio.gather(*(self._producer(p) for p in parts if p not in self.producers))
                await self.view.wait_caught_up()
                self.store.drop_overlay()
                self.owned = parts
                self._generation += 1
                self.consumer.resume(*[tp for tp in assigned if tp.topic == REQUESTS])
            log.info("partitions assigned: %s", sorted(parts))
        except Exception as exc:  # without producers or state this instance must not serve
            self._fatal(exc)
            raise

    async def _producer(self, partition: int) -> AIOKafkaProducer:
        producer = make_producer(self.s.bootstrap, client_id=f"{self.s.instance_id}-p{partition}",
                                 transactional_id=f"{self.s.transactional_id_prefix}-p{partition}")
        await producer.start()
        self.producers[partition] = producer
        return producer

    # -- consuming ----------------------------------------------------------------------------------
    async def _consume(self) -> None:
        assert self.consumer is not None
        while not self._stopping:
            batches = await self.consumer.getmany(timeout_ms=IDLE_FETCH_WAIT_MS, max_records=self.s.batch_max_records)
            if not batches:
                continue
            generation = self._generation
            async with self._lock:
                if self._stopping:
                    for tp, records in batches.items():
                        self._rewind(tp, records[0].offset)
                    return
                if generation != self._generation:
                    # a rebalance happened since the fetch: start again from what is committed
                    await self._reset_to_committed(list(batches))
                    continue
                for tp, records in batches.items():
                    if tp.partition not in self.owned:
                        self._rewind(tp, records[0].offset)
                await asyncio.gather(*(self._process(tp, records) for tp, records in batches.items()
                                       if tp.partition in self.owned))

    async def _reset_to_committed(self, tps) -> None:
        assigned = self.consumer.assignment()
        for tp in tps:
            if tp in assigned:
                committed = await self.consumer.committed(tp)
                if committed is None:
                    await self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, committed)

    def _rewind(self, tp: TopicPartition, offset: int, pause: bool = False) -> None:
        """Fetch from `offset` again (nothing of the batch is committed); a no-op when tp was revoked."""
        try:
            self.consumer.seek(tp, offset)
            if pause:
                self.consumer.pause(tp)
        except Exception:
            log.debug("cannot rewind %s", tp, exc_info=True)

    async def _process(self, tp: TopicPartition, records) -> None:
        producer = self.producers.get(tp.partition)
        if producer is None:
            try:
                producer = await self._producer(tp.partition)
            except Exception:
                log.exception("cannot start the producer of partition %d", tp.partition)
                self._rewind(tp, records[0].offset)
                await asyncio.sleep(0.5)
                return
        batch = Batch(self.store)
        sends: list[tuple[str, bytes, bytes | None, list]] = []
        offsets: list[tuple[TopicPartition, int, str]] = []
        try:
            for record in records:
                await self._handle(record, batch, sends, offsets)
        except Exception:
            log.exception("partition %d: batch at offset %d failed before its transaction; retrying",
                          tp.partition, records[0].offset)
            self._rewind(tp, records[0].offset)
            await asyncio.sleep(0.5)
            return
        try:
            # APPLICATION backlogs skipped: aiokafka allows one consumer group per transaction, so each
            # reset is a transaction of its own before the batch's (idempotent: a retry resets again)
            for app_tp, offset, group in offsets:
                await producer.begin_transaction()
                await producer.send_offsets_to_transaction({app_tp: offset}, group)
                await producer.commit_transaction()
            await self._known_leaders(producer, {topic for topic, *_ in sends})
            await producer.begin_transaction()
            futures = [await producer.send(topic, value, key=key, headers=headers)
                       for topic, key, value, headers in sends]
            # bounded: a producer whose metadata lacks a leader would otherwise sit out request_timeout_ms
            await asyncio.wait_for(asyncio.gather(*futures), SEND_TIMEOUT_S)
            await producer.send_offsets_to_transaction({tp: records[-1].offset + 1}, self.s.group_id)
            await producer.commit_transaction()
        except ProducerFenced:
            log.warning("partition %d: producer fenced (another instance owns it now)", tp.partition)
            self.stats["aborted"] += 1
            await self._drop_producer(tp.partition)
            # until the group hands the partition out again, it is not ours: paused, not re-fenced
            self.owned.discard(tp.partition)
            self._rewind(tp, records[0].offset, pause=True)
            return
        except Exception:
            log.exception("partition %d: transaction of offsets %d..%d failed; retrying", tp.partition,
                          records[0].offset, records[-1].offset)
            self.stats["aborted"] += 1
            try:
                await asyncio.wait_for(producer.abort_transaction(), 5)
            except Exception:
                log.debug("abort failed", exc_info=True)
            # a fresh producer (new epoch, sequence numbers from 0): aiokafka's idempotence state of a
            # failed batch is not reliable (OutOfOrderSequenceNumber forever after a NotLeader, say)
            await self._drop_producer(tp.partition)
            self._rewind(tp, records[0].offset)
            await asyncio.sleep(0.5)
            return
        batch.commit_to_store()
        self.stats["transactions"] += 1
        self.stats["requests"] += len(records)

    @staticmethod
    async def _known_leaders(producer: AIOKafkaProducer, names: set[str], timeout_s: float = 5.0) -> None:
        """Make sure the producer's metadata has a leader for every output partition (our outputs are
        single-partition topics, except none): a brand-new topic or a fresh cluster may not have one yet."""
        client = producer.client
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [n for n in names
                       if client.cluster.leader_for_partition(TopicPartition(n, 0)) in (None, -1)]
            if not missing or time.monotonic() > deadline:
                return
            for n in missing:
                client.add_topic(n)
            await client.force_metadata_update()
            await asyncio.sleep(0.05)

    async def _drop_producer(self, partition: int) -> None:
        producer = self.producers.pop(partition, None)
        if producer is not None:
            try:
                await asyncio.wait_for(producer.stop(), 5)
            except Exception:  # the next owner of the transactional id aborts whatever is left
                log.debug("stopping producer %d", partition, exc_info=True)

    async def _handle(self, record, batch: Batch, sends: list, offsets: list) -> None:
        try:
            req = pb.SessionEventRequest.FromString(record.value or b"")
        except Exception:
            log.error("unreadable session request at %s/%d offset %d: skipped", record.topic, record.partition,
                      record.offset)
            return
        cid = req.session.client_id or (record.key or b"").decode("utf-8", "replace")
        if not req.session.client_id:
            req.session.client_id = cid
        kind = _TYPE_NAMES.get(req.type, str(req.type))
        with span_from_kafka(tracer, f"session-registry {kind}", record.headers, client_id=cid,
                             request_id=req.request_id):
            stored = batch.get(cid)
            fenced = (req.type == pb.SESSION_EVENT_CONNECTION_REQUEST
                      and self.liveness.fenced(req.session.service_id, req.session.connector_incarnation))
            out = logic.decide(stored, req, self.rules, now_ms(), batch.counts(), fenced=fenced)
            out = await self._side_effects(out)
            headers = kafka_headers()
            if out.write_session:
                batch.put(cid, out.session)
                sends.append((topics.CLIENT_SESSION, cid.encode(),
                              None if out.session is None else out.session.SerializeToString(), headers))
            if out.clear_subscriptions is not None:
                sends.append((topics.CLIENT_SUBSCRIPTIONS, cid.encode(),
                              out.clear_subscriptions.SerializeToString(), headers))
            if out.app_removed is not None:
                sends.append((topics.SYS_APP_REMOVED, cid.encode(), out.app_removed.SerializeToString(), headers))
            if out.disconnect is not None:
                svc, cmd = out.disconnect
                name = topics.disconnect_topic(svc)
                if cmd.reason == pb.DISCONNECT_REASON_CONNECTOR_FENCED:
                    send = await self._topic_known(name)   # a dead run: never re-create its deleted topics
                else:
                    await self._ensure_service_topics(svc)
                    send = True
                if send:
                    sends.append((name, cid.encode(), cmd.SerializeToString(), headers))
            if out.response is not None:
                await self._ensure_service_topics(out.response_service_id)
                sends.append((topics.response_topic(out.response_service_id), cid.encode(),
                              out.response.SerializeToString(), headers))
            if out.publish is not None:
                # a dead connector's Will, in this transaction: published exactly once [MQTT-3.1.2-8]
                sends.extend((topic, key, value, headers) for topic, key, value
                             in publish_records(out.publish, topics.MSG_ALL, topics.MSG_RETAINED))
                self.stats["wills_published"] += 1
                log.info("publishing the Will of %r on %r (its connector %s died)", cid, out.publish.topic,
                         stored.service_id if stored is not None else "?")
            if out.reset_app_offsets:
                reset = await self._app_end_offset(out.reset_app_offsets)
                if reset is not None:
                    offsets.append((*reset, app_client_group(out.reset_app_offsets)))
            level = logging.DEBUG if out.kind in _ROUTINE and not out.notes else logging.INFO
            log.log(level, "%s %s (%s) -> %s%s", kind, cid, req.request_id, out.kind,
                    f" [{'; '.join(out.notes)}]" if out.notes else "")

    async def _side_effects(self, out: logic.Outcome) -> logic.Outcome:
        if not out.has_side_effects:
            return out
        try:
            if out.device_clear and out.device_clear_deferrable:
                await self._clear_best_effort(out.device_clear)
            elif out.device_clear:
                budget = self.s.device_clear_timeout_ms / 1000 if out.retry_side_effects else 0.0
                await self.device.clear(out.device_clear, retry_for_s=budget)
                self._deferred_clears.pop(out.device_clear, None)
            if out.ensure_app_topic:
                await self._ensure_app_topic(out.ensure_app_topic)
            return out
        except (ClearFailed, KafkaError, OSError, RuntimeError) as exc:
            log.warning("side effect of %s failed (%s): %s", out.kind, exc,
                        out.fallback.kind if out.fallback else "nothing done")
            return out.fallback or logic.Outcome("deferred")

    async def _clear_best_effort(self, client_id: str) -> None:
        """A Clear the answer does not wait for (the new session never reads the device store): one attempt
        now (none while device-persistence is known down), else remembered for `retry_deferred_clears`.
        Everything runs under self._lock, serialised with the client's requests: a later connect that makes
        a persistent DEVICE session clears blocking first (and drops the entry), so a retry can never
        remove that session's messages."""
        try:
            await self.device.clear(client_id, retry_for_s=0.0)
            self._deferred_clears.pop(client_id, None)
        except Exception as exc:  # best effort: nothing here may fail the connect
            self._deferred_clears.setdefault(client_id, time.monotonic())
            log.warning("Clear of %s deferred (answering without it: the new session does not read the device "
                        "store): %s", client_id, exc)

    async def retry_deferred_clears(self) -> int:
        """Retry the deferred Clears (expiry loop); stops at the first failure (still down). Returns how many
        succeeded."""
        if not self._deferred_clears or self.consumer is None:
            return 0
        done = 0
        async with self._lock:
            parts = self.consumer.partitions_for_topic(REQUESTS)
            t = time.monotonic()
            for cid, since in list(self._deferred_clears.items()):
                if not parts or partition_of(cid, len(parts)) not in self.owned:
                    self._deferred_clears.pop(cid, None)
                    continue
                if t - since > DEFERRED_CLEAR_MAX_S:
                    self._deferred_clears.pop(cid, None)
                    log.warning("deferred Clear of %s given up after %.0f s (the next persistent DEVICE connect "
                                "or the session's removal clears it)", cid, t - since)
                    continue
                try:
                    await self.device.clear(cid, retry_for_s=0.0)
                except Exception:  # still down (ClearFailed): the next round tries again
                    break
                self._deferred_clears.pop(cid, None)
                done += 1
        if done:
            log.info("deferred Clears done: %d (%d left)", done, len(self._deferred_clears))
        return done

    async def _ensure_service_topics(self, service_id: str) -> None:
        if service_id and service_id not in self._svc_topics:
            specs = topics.service_topics(service_id)
            await ensure_topics(self.s.bootstrap, specs, layout=self.s.topic_layout)
            await self._wait_for_topics([topics.response_topic(service_id), topics.disconnect_topic(service_id)])
            self._svc_topics.add(service_id)

    async def _wait_for_topics(self, names: list[str], timeout_s: float = 10.0) -> None:
        """Until the cluster metadata has a leader for every partition of the topics (just created ones
        need a moment; producing earlier fails the transaction with NotLeaderForPartition)."""
        assert self.meta is not None
        client = self.meta._client
        deadline = time.monotonic() + timeout_s
        while True:
            cluster = client.cluster
            ok = True
            for name in names:
                parts = cluster.partitions_for_topic(name)
                if not parts or any(cluster.leader_for_partition(TopicPartition(name, p)) in (None, -1)
                                    for p in parts):
                    ok = False
                    break
            if ok or time.monotonic() > deadline:
                return
            await client.force_metadata_update()
            await asyncio.sleep(0.05)

    async def _ensure_app_topic(self, client_id: str) -> None:
        name = topics.app_topic_name(client_id)
        if name not in self._app_topics:
            await ensure_topics(self.s.bootstrap, [topics.app_topic(client_id)], layout=self.s.topic_layout)
            await self._wait_for_topics([name])
            self._app_topics.add(name)

    async def _topic_known(self, name: str) -> bool:
        """Whether the topic exists (the cluster metadata, refreshed once when it is not there)."""
        assert self.meta is not None
        if self.meta.partitions_for_topic(name):
            return True
        await self.meta._client.force_metadata_update()
        return bool(self.meta.partitions_for_topic(name))

    async def _app_end_offset(self, client_id: str) -> tuple[TopicPartition, int] | None:
        """The end of a client's APPLICATION topic (None when the topic does not exist)."""
        assert self.meta is not None
        name = topics.app_topic_name(client_id)
        if not await self._topic_known(name):
            return None
        tp = TopicPartition(name, 0)
        ends = await self.meta.end_offsets([tp])
        return tp, ends[tp]

    # -- expiry -------------------------------------------------------------------------------------
    async def _expiry_loop(self) -> None:
        interval = self.s.expiry_check_interval_ms / 1000
        while not self._stopping:
            await asyncio.sleep(interval)
            await _each_logged((self.scan_sessions, "session scan"), (self.retry_deferred_clears, "deferred Clears"))

    async def scan_sessions(self) -> int:
        """One pass over the sessions of the partitions this instance owns (every
        TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS, and at once when a connector run is declared dead): a
        CONNECTOR_GONE_REQUEST for each still connected on a dead run, a CLEAR_SESSION_REQUEST for each that
        is over, a WILL_DUE_REQUEST for each delayed Will that is due, a TAKEN_OVER_WILL_REQUEST for each
        taken over connection's Will whose fate is known. Through the request topic, so each is serialised
        with the client's own events."""
        def select(s: pb.SessionInfo, now: int) -> tuple[int, bool] | None:
            if s.connected and self.liveness.gone(s.service_id, s.connector_incarnation, now):
                return GONE, False
            if s.HasField("taken_over_will"):
                t = s.taken_over_will
                fate = self.liveness.taken_over_will_fate(t.service_id, t.connector_incarnation,
                                                          t.taken_over_at_ms, now)
                if fate is not None:
                    return TAKEN_OVER_WILL, fate
            if s.connected:
                return None
            if logic.needs_cleanup(s, now):
                return CLEAR, False   # publishes a pending Will too: the session ends first [MQTT-3.1.2-8]
            return (WILL_DUE, False) if logic.will_due(s, now) else None
        sent = await self._scan(select, max(10.0, 3 * self.s.expiry_check_interval_ms / 1000))
        self.stats["session_scans"] += 1     # a pass done (tests wait for one after a declaration)
        return sent

    async def _scan(self, select, resend_after: float) -> int:
        """Send `select(session, now)`'s request ((type, publish_will), or None) for every stored session of
        the owned partitions; the same request for the same session is sent again only after `resend_after` s."""
        assert self.consumer is not None and self.plain is not None
        owned = set(self.owned)
        parts = self.consumer.partitions_for_topic(REQUESTS)
        if not owned or not parts:
            return 0
        n_parts = len(parts)
        now = now_ms()
        t = time.monotonic()
        futures = []
        for cid, s in self.store.items():
            chosen = select(s, now)
            if chosen is None or partition_of(cid, n_parts) not in owned:
                continue
            kind, publish_will = chosen
            asked = self._asked.get((cid, kind))
            if asked is not None and asked[0] == s.session_id and t - asked[1] < resend_after:
                continue
            self._asked[(cid, kind)] = (s.session_id, t)
            what = _TYPE_NAMES.get(kind, "scan").lower()
            req = logic.scan_request(kind, s, f"{what}-{uuid.uuid4().hex}", now)
            req.publish_will = publish_will
            with tracer.start_as_current_span(f"session-registry scan {what}", attributes={"client_id": cid}):
                futures.append(await self.plain.send(REQUESTS, req.SerializeToString(), key=cid.encode(),
                                                     headers=kafka_headers()))
        if futures:
            await asyncio.gather(*futures)
            log.info("session scan: %d requests sent", len(futures))
        for key in [k for k, (_, at) in self._asked.items() if t - at > resend_after]:
            del self._asked[key]
        return len(futures)

    # -- dead connectors ----------------------------------------------------------------------------
    def _on_heartbeat(self, key: bytes | None, value: bytes | None) -> None:
        """CompactedTopicView callback of tbmq.connector.heartbeat."""
        if not value:
            return
        try:
            hb = pb.ConnectorHeartbeat.FromString(value)
        except Exception:
            log.error("unreadable connector heartbeat of %r: skipped", key)
            return
        if self._declared(self.liveness.observe(hb, now_ms()), "stopped or replaced", logging.INFO):
            self._liveness_wake.set()       # no timeout to wait for: its sessions are ended now

    def _declared(self, runs: list[tuple[str, str]], why: str, level: int = logging.WARNING) -> bool:
        for svc, inc in runs:
            self.stats["connectors_declared_dead"] += 1
            log.log(level, "connector %s (run %s) declared dead (%s): what is left of its sessions ends, with "
                    "their Wills", svc, inc or "?", why)
        return bool(runs)

    async def _liveness_loop(self) -> None:
        """Sweep for silent runs (cheap) every max(50 ms, min(1 s, TBMQ_CONNECTOR_TIMEOUT_MS / 10)); the
        session scan runs at once after a declaration, otherwise at its own pace (_expiry_loop)."""
        period = max(0.05, min(1.0, self.s.connector_timeout_ms / 10000))
        while not self._stopping:
            woken = False
            try:
                await asyncio.wait_for(self._liveness_wake.wait(), period)
                woken = True
            except asyncio.TimeoutError:
                pass
            self._liveness_wake.clear()
            await self._confirm_channel()
            declared = await self._sweep()
            steps = [(self.delete_dead_connector_topics, "deleting dead connectors' topics")]
            if woken or declared:
                steps.insert(0, (self.scan_sessions, "session scan after a connector was declared dead"))
            await _each_logged(*steps)

    async def _confirm_channel(self) -> None:
        """While no heartbeat arrives, confirm now and then that tbmq.connector.heartbeat can be read up to
        its end (one ListOffsets request): silence counts only from the end of the latest gap in these
        confirmations (liveness.Liveness.confirm), so a Kafka outage is not taken for dead connectors."""
        if not self.liveness.needs_confirmation(now_ms()):
            return
        try:
            await self.heartbeats.wait_caught_up(timeout=self.liveness.gap_ms / 1000)
        except Exception as exc:
            log.debug("connector heartbeats not readable up to date: %r", exc)
            return
        self.liveness.confirm(now_ms())

    async def _sweep(self) -> bool:
        """Declare the silent runs dead, only once the heartbeat view has read everything sent so far: a
        registry that fell behind (a busy loop, a slow fetch) must not take its own lag for dead connectors,
        and one that cannot reach Kafka declares nobody."""
        if not self.liveness.silent(now_ms()):
            return False
        try:
            await self.heartbeats.wait_caught_up(timeout=max(1.0, self.s.connector_timeout_ms / 1000))
        except Exception as exc:
            log.warning("connectors look silent but the heartbeats cannot be read up to date (%r): nobody is "
                        "declared dead now", exc)
            return False
        self.liveness.confirm(now_ms())  # after an outage: the silence is counted again from now
        return self._declared(self.liveness.sweep(now_ms()), "silent longer than TBMQ_CONNECTOR_TIMEOUT_MS")

    async def delete_dead_connector_topics(self) -> list[str]:
        """The owner of request partition 0 deletes the per-connector topics of every connector dead for
        TBMQ_CONNECTOR_TOPICS_RETENTION_MS (nothing reads them any more; a connector that comes back under
        the same service id creates them again at start-up)."""
        retention = self.s.connector_topics_retention_ms
        if not retention or 0 not in self.owned or not self.liveness.dead_services(now_ms(), retention):
            return []
        # a run that started again meanwhile is alive in the view once it caught up (its first heartbeat goes
        # before it makes its topics again)
        await self.heartbeats.wait_caught_up(timeout=10)
        done = []
        for svc in self.liveness.dead_services(now_ms(), retention):
            names = [t.name for t in topics.service_topics(svc)]
            await delete_topics(self.s.bootstrap, names)
            self.liveness.forget(svc)
            self._svc_topics.discard(svc)
            self.stats["connector_topics_deleted"] += len(names)
            log.info("connector %s dead for %d ms: deleted %s", svc, retention, ", ".join(names))
            done.append(svc)
        return done
