"""The device-persistence service: the stored copies the routers routed -> Redis (lua/) -> forward streams
of the attached connectors, plus the DevicePersistence gRPC API.

The copies come over each router's `DevicePersistence.Persist` stream (the default, `ROUTER_PERSIST_VIA=grpc`;
`persist`: each batch saved, forwarded and answered in order, under the batch lock below, and the router
commits the tbmq.msg.all offsets a batch covers only after its answer), or through tbmq.msg.persisted
(`ROUTER_PERSIST_VIA=kafka`), consumed as follows.

Pipelined batches (consumer group `device-persistence`, key = client id so one client's records are in
one partition, in order):

  1. getmany (up to DEVICE_PERSISTENCE_MAX_POLL_RECORDS records), grouped per client in record order;
  2. save_many_attached: one save_messages.lua call per client, pipelined; each call also reads the
     client's attachment atomically with the save, and carries the records' partition and offsets, so
     a record is stored once however often it is saved;
  3. the stored messages of attached clients are queued, one batch per connector service id, on that
     connector's Forward stream (forward.ForwardRegistry) — nothing is awaited: the next getmany
     starts at once;
  4. the batch's offsets join the pending commit. At most one commit is in flight, started off the hot
     loop every DEVICE_PERSISTENCE_COMMIT_INTERVAL_MS (or when a poll brings nothing); before partitions
     are revoked and at stop the batch in progress finishes, the forward queues are flushed (so this
     instance's forwards go out before the next owner's) and the in-flight and pending commits are done.

Guarantee: an offset is committed (a Persist batch answered) only when every record below it is SAVED in Redis
(step 2 returned), or, for a client whose keys Redis refuses for their data (`store.refused_for_data`, after
DEVICE_PERSISTENCE_SAVE_ATTEMPTS attempts), written to tbmq.msg.persisted.dead and acknowledged by Kafka
(`_save_apart`; docs/device-persistence.md, "Dead letters").
A crash before the commit replays those records, and a save retried after a Redis error repeats one: the
client's state in Redis keeps the last offset applied, so neither stores a message twice (no duplicate,
never a loss).
Forwards never hold a commit back and never block the loop: Redis holds every message until the
connector acknowledges it, and a forward that is not delivered (no stream, stream overflowing, crash)
is fetched by the connector when its stream (re)opens or ends, or by the client's next connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from google.protobuf.message import DecodeError
from opentelemetry import trace
from redis.exceptions import RedisError
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.backoff import Backoff
from tbmq_platform.coalesce import AdaptiveFetch, adaptive_fetch
from tbmq_platform.kafka import IDLE_FETCH_WAIT_MS, ensure_topics, make_consumer, make_producer
from tbmq_platform.retention import RetentionWatch
from tbmq_platform.lifecycle import Service
from tbmq_platform.topics import (DEAD_LETTER_ERROR_HEADER, DEAD_LETTER_INSTANCE_HEADER, MSG_PERSISTED,
                                  MSG_PERSISTED_DEAD, MSG_PERSISTED_TALLY, spec)
from tbmq_platform.tracing import spans_on

from .forward import ForwardRegistry, group_by_service
from .grpc_api import DevicePersistenceServicer, start_server
from .held import HeldBatch
from .holding import Holding
from .settings import DevicePersistenceSettings
from .store import DeviceMsgStore, SaveResult, Source, refused_for_data
from .tally import Tallies

log = logging.getLogger(__name__)
tracer = trace.get_tracer("device_persistence")

TALLY_FLUSH_S = 5.0  # the tallies of the seconds ended are written together this often (one produce request)
TALLY_DELAY_S = 0.05  # ... this long after a multiple of TALLY_FLUSH_S (the last batches of a second answered)
TALLY_STOP_TIMEOUT_S = 5.0


def _collect(pm, groups: dict, origins: dict) -> bool:
    """Adds one PersistedMsg to its client's batch (and its tbmq.msg.all origin); True when it starts it."""
    cid = pm.client_id
    msgs = groups.get(cid)
    new = msgs is None
    if new:
        msgs = groups[cid] = []
        origins[cid] = []
    origins[cid].append((pm.origin_partition, pm.origin_offset) if pm.HasField("origin_offset") else None)
    msgs.append(pm.msg)
    return new


class _Revoke(ConsumerRebalanceListener):
    """Before partitions are taken away, the batch in progress finishes, the forward streams send what
    they queued, and everything saved is committed."""

    def __init__(self, service: DevicePersistenceService) -> None:
        self.service = service

    async def on_partitions_revoked(self, revoked) -> None:
        service = self.service
        async with service._batch_lock:
            await service.forwards.flush(service.s.forward_flush_s)
            await service._commit_pending()

    async def on_partitions_assigned(self, assigned) -> None:
        log.info("assigned %d partition(s) of %s", len(assigned), MSG_PERSISTED)


class DevicePersistenceService(Service):
    name = "device-persistence"

    def __init__(self, settings: DevicePersistenceSettings) -> None:
        super().__init__(settings)
        self.s = settings
        # the per-batch save span only when exported or asked for (tbmq_platform.tracing.spans_on)
        self.spans = spans_on(settings)
        self.store = DeviceMsgStore(settings.store_config())
        self.forwards = ForwardRegistry(settings.forward_queue_bytes, settings.instance_id)
        self._batch_lock = asyncio.Lock()
        # held forwards (docs/device-persistence.md, "Held forwards"): None = every copy saved in Redis first
        self.holding = Holding(self.store, self.forwards, self._batch_lock, hold_ms=settings.held_ms,
                               block=min(settings.held_block, settings.handed_out_limit),
                               client_bytes=min(settings.held_client_bytes, settings.bytes_limit),
                               total_bytes=settings.held_total_bytes,
                               handed_out_limit=settings.handed_out_limit) if settings.held else None
        self.servicer = DevicePersistenceServicer(self.store, self.forwards, persist=self.persist_start,
                                                  holding=self.holding)
        self.grpc_server = None
        self.grpc_port: int | None = None
        self.consumer = None
        self.stats: Counter = Counter()
        self.adaptive_fetch: AdaptiveFetch | None = None
        self._persisting: set[asyncio.Task] = set()  # Persist batches being saved (`persist`)
        self._stopping = False
        self._loop_task: asyncio.Task | None = None
        self._polling = False  # the consumer loop waits in getmany (no batch in progress)
        self._pending_offsets: dict = {}  # saved (durable) but not yet committed: tp -> next offset
        self._commit_task: asyncio.Task | None = None  # the one commit in flight, off the hot loop
        self._last_commit = 0.0
        self.retention: RetentionWatch | None = None
        self._producer = None  # dead letters and tallies; started when the first is written
        self.tallies = Tallies()  # the Persist streams' copies per second, for the Spark statistics (tally.py)
        self._tally_task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.s
        await self.store.start()  # connects, loads the scripts (a Lua error fails start-up)
        await self.store.ping()
        await ensure_topics(s.bootstrap, [spec(MSG_PERSISTED), spec(MSG_PERSISTED_DEAD), spec(MSG_PERSISTED_TALLY)],
                            layout=s.topic_layout)
        self.consumer = make_consumer(s.bootstrap, group_id=s.group_id, client_id=s.instance_id,
                                      max_poll_records=s.max_poll_records, long_poll=True,
                                      auto_offset_reset=s.auto_offset_reset, group_instance_id=s.group_instance_id,
                                      session_timeout_ms=int(s.session_timeout_s * 1000))
        self.consumer.subscribe([MSG_PERSISTED], listener=_Revoke(self))
        await self.consumer.start()
        self.grpc_server, self.grpc_port = await start_server(self.servicer, s.grpc_host, s.grpc_port, s.grpc_tls)
        log.info("DevicePersistence gRPC on %s:%d (%s); Redis %s; limit %d, TTL %ds", s.grpc_host, self.grpc_port,
                 "mutual TLS" if s.grpc_tls.enabled else "plaintext",
                 ",".join(s.redis_cluster_nodes) or s.redis_url, s.messages_limit, s.messages_ttl_s)
        if self.holding is not None:
            self.holding.start()
        self._loop_task = self.spawn(self._consume(), "persisted consumer")
        # routed messages not yet saved for their clients, against tbmq.msg.persisted's retention
        self.retention = await RetentionWatch.started(s, s.group_id, lambda: [MSG_PERSISTED])
        self._register_metrics()

    def _register_metrics(self) -> None:
        """GET /metrics (tbmq_platform.metrics): read from the counters above at scrape time."""
        m, st, fw, store = self.metrics, self.stats, self.forwards.stats, self.store.stats
        m.counter("stored_messages", "messages saved to Redis for persistent DEVICE clients", lambda: st["saved"])
        m.counter("stored_trimmed", "stored messages dropped (oldest first) to keep a client's limit",
                  lambda: store.trimmed)
        m.counter("stored_replayed", "tbmq.msg.persisted records not stored again: saved before (a replay after "
                  "a crash or a retried save)", lambda: store.replayed)
        m.counter("stored_routed_again", "tbmq.msg.persisted records not stored again: their tbmq.msg.all origin "
                  "was stored before (the router routed it again after a crash)", lambda: store.routed_again)
        m.counter("persisted_records", "tbmq.msg.persisted records consumed", lambda: st["records"])
        m.counter("persist_batches", "batches of the routers' Persist streams saved and answered",
                  lambda: st["persist_batches"])
        m.counter("persist_records", "stored copies received on the routers' Persist streams",
                  lambda: st["persist_records"])
        m.counter("forwarded_messages", "stored messages forwarded to connectors on Forward streams",
                  lambda: fw["forwarded"])
        m.counters_by("forward_dropped", "forwards not sent (the messages stay in Redis)", fw, "reason",
                      {"stream_overflow": "forward_dropped", "no_stream": "forward_no_stream"})
        m.counters_by("failures", "failed operations (retried)", st, "what",
                      {"save": "save_failures", "commit": "commit_failures", "bad_record": "bad_records"})
        m.counter("dead_lettered", "stored copies Redis refused for the client's data, sent to "
                  "tbmq.msg.persisted.dead", lambda: st["dead_lettered"])
        if self.holding is not None:
            hs, table = self.holding.stats, self.holding.table
            m.counter("held_messages", "QoS 1 copies of live clients forwarded from memory (held forwards), not "
                      "saved in Redis first", lambda: hs["held"])
            m.counter("held_released", "held copies acknowledged in time: never written to Redis",
                      lambda: hs["released"])
            m.counters_by("held_spilled", "held copies written to Redis", hs, "reason",
                          {r: f"spilled_{r}" for r in ("deadline", "refused", "fetch", "detach", "clear",
                                                       "stream_ended", "stop")})
            m.gauge("held_clients", "clients in held mode", lambda: len(table))
            m.gauge("held_bytes", "bytes of copies held", lambda: table.bytes)
        m.gauge("forward_streams", "open Forward streams (one per connector)", lambda: len(self.forwards))
        m.gauge("forward_queued_bytes", "bytes queued on Forward streams", self.forwards.queued_bytes)
        m.lag("consumer_lag", lambda: [(self.s.group_id, self.consumer)] if self.consumer is not None else [])
        redis_latency = m.histogram("redis_call", "Redis script calls (one call or pipelined batch)", ("script",))
        self.store.observe = lambda name, secs: redis_latency.labels(name).observe(secs)

    async def stop(self) -> None:
        # 1. end the forward streams (connectors reopen on another instance or after the restart) and stop
        #    accepting gRPC calls; those in progress get the grace period
        self.forwards.close()
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.s.shutdown_grace_s)
        # 2. the batch in progress finishes (save, commit); no new one starts; so do the Persist batches
        #    being saved, whose streams the server's stop may have ended
        self._stopping = True
        if self._persisting:
            _, pending = await asyncio.wait(set(self._persisting), timeout=20)
            if pending:
                log.warning("%d Persist batch(es) still saving at stop; their routers send them again",
                            len(pending))
        if self._loop_task is not None and not self._loop_task.done():
            if self._polling:  # between batches, in a long poll: nothing to finish (pending offsets are
                self._loop_task.cancel()  # committed by the loop's finally)
            done, _ = await asyncio.wait({self._loop_task}, timeout=20)
            if not done or (not self._loop_task.cancelled() and self._loop_task.exception() is not None):
                log.warning("consumer loop did not end cleanly; uncommitted records will be replayed")
        # 3. the held copies written to Redis (their batches answered where a stream is still there to take it)
        if self.holding is not None:
            await self.holding.stop()
        # 4. leave the group, close
        if self.retention is not None:
            await self.retention.close()
        if self.consumer is not None:
            await self.consumer.stop()
        if self._tally_task is not None:
            self._tally_task.cancel()
        if self.tallies:  # the last seconds' tallies, best effort
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TALLY_STOP_TIMEOUT_S):
                    await self._send_tallies(self.tallies.take_all())
        if self._producer is not None:
            await self._producer.stop()
        await self.store.close()
        log.info("stopped: %s", {**self.stats, **(self.holding.health() if self.holding is not None else {})})

    def health_details(self) -> dict:
        return {"grpc_port": self.grpc_port, **self.stats, **self.forwards.stats,
                **(self.holding.health() if self.holding is not None else {}),
                "forward_streams": len(self.forwards), "forward_queued_bytes": self.forwards.queued_bytes(),
                "persist_streams": self.servicer.persist_streams, "persisting": len(self._persisting),
                "store": vars(self.store.stats), "grpc_calls": dict(self.servicer.calls),
                **(self.retention.stats if self.retention is not None else {}),
                **(self.adaptive_fetch.health() if self.adaptive_fetch is not None else {})}

    # ------------------------------------------------------------------------------------ consumer
    async def _consume(self) -> None:
        consumer = self.consumer
        interval = self.s.commit_interval_ms / 1000
        adaptive = self.adaptive_fetch = adaptive_fetch(consumer, self.s.fetch_window_ms)
        try:
            while not self._stopping:
                # wakes for the next commit only when offsets are pending: an idle loop does not tick
                wait_ms = min(200, max(1, int(interval * 1000) or 200)) if self._pending_offsets else IDLE_FETCH_WAIT_MS
                self._polling = True
                try:
                    batches = await consumer.getmany(timeout_ms=wait_ms, max_records=self.s.max_poll_records)
                finally:
                    self._polling = False
                if adaptive is not None:
                    adaptive.polled_batches(batches)
                async with self._batch_lock:
                    if batches:
                        assigned = consumer.assignment()
                        batches = {tp: recs for tp, recs in batches.items() if tp in assigned and recs}
                        if batches:
                            await self._process(batches)
                    if self._pending_offsets and (
                            not batches or time.monotonic() - self._last_commit >= interval):
                        self._start_commit()
        finally:
            if not self._batch_lock.locked():
                async with self._batch_lock:
                    await self._commit_pending()

    async def _process(self, batches) -> None:
        t0 = time.monotonic()
        groups: dict[str, list[pb.PublishMsg]] = {}
        sources: dict[str, Source | None] = {}  # each client's records applied once (save_messages.lua)
        origins: dict[str, list[tuple[int, int] | None]] = {}  # and each tbmq.msg.all record once
        records = 0
        for tp, recs in batches.items():
            for r in recs:
                records += 1
                pm = self._decode(r.value, tp, r.offset)
                if pm is None:
                    continue
                cid = pm.client_id
                if _collect(pm, groups, origins):
                    sources[cid] = Source(tp.partition, [])
                src = sources[cid]
                if src is not None:
                    if src.partition == tp.partition:
                        src.offsets.append(r.offset)
                    else:  # the key moved partition (the topic was resized): this batch is not deduplicated
                        sources[cid] = None
        if self.holding is not None:  # copies of a held client through tbmq.msg.persisted: behind its tail
            await self.holding.spill([cid for cid in groups if cid in self.holding.table], "refused")
        results = await self._save_and_forward(
            records, groups, {c: s for c, s in sources.items() if s is not None}, origins)
        if results is None:
            return  # stopping while Redis is down: nothing committed, the batch is replayed
        # durable (saved): committed with the next ones (DEVICE_PERSISTENCE_COMMIT_INTERVAL_MS), before a
        # rebalance and at stop
        for tp, recs in batches.items():
            self._pending_offsets[tp] = recs[-1].offset + 1
        self.stats["batches"] += 1
        self.stats["records"] += records
        log.debug("batch of %d records, %d clients in %.1f ms", records, len(groups),
                  (time.monotonic() - t0) * 1000)

    async def persist(self, records) -> int:
        """One batch of a router's Persist stream (its stored copies, PersistedMsg, in routing order), returned once
        it is durable: `persist_start`, then its answer awaited."""
        return await (await self.persist_start(records))

    async def persist_start(self, records):
        """One batch of a router's Persist stream: saved, then queued on the forward streams, like a
        tbmq.msg.persisted batch and under the same lock (one save at a time, so a client's messages are saved, and
        forwarded, in one order whichever stream brought them). The origin check stores a copy sent again (a stream
        reopened, a router's replay) once. Returns once the batch is saved and forwarded (the next batch may start):
        an awaitable of how many were stored or held, done once the batch is durable (held copies acknowledged or
        written to Redis; at once without held ones). Retries while Redis is down; raises when stopping meanwhile."""
        groups: dict[str, list[pb.PublishMsg]] = {}
        origins: dict[str, list[tuple[int, int] | None]] = {}
        for value in records:
            pm = self._decode(value)
            if pm is not None:
                _collect(pm, groups, origins)
        # The save and its forward run to their end even when the stream that brought the batch ends
        # meanwhile (its router crashed or reopened it: grpc.aio cancels the handler). Cancelled while
        # waiting for Redis's reply, a save that Redis ran would leave a live client's messages handed out
        # and never forwarded; the router's replay finds them applied (the origin check) together with newer
        # copies, which are forwarded, and the connection, taking forwards in serial order, would skip them
        # until the client's next connect (test_a_persist_batch_whose_stream_ends_while_redis_runs_its_save_
        # is_still_forwarded; the e2e crash test of the router lost 32 of 450 this way).
        task = asyncio.get_running_loop().create_task(self._persist_locked(records, groups, origins),
                                                      name="persist batch")
        self._persisting.add(task)
        task.add_done_callback(self._persisted)
        stored, held = await asyncio.shield(task)
        answer = asyncio.get_running_loop().create_future()  # a future, not a coroutine: one never awaited is fine
        if held is None:
            answer.set_result(stored)
        else:  # once its held copies are acknowledged or written to Redis
            held.token.add_done_callback(lambda _: answer.done() or answer.set_result(stored))
        return answer

    def _persisted(self, task: asyncio.Task) -> None:
        self._persisting.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a batch whose stream ended is sent again by its router

    async def _persist_locked(self, records, groups, origins) -> tuple[int, HeldBatch | None]:
        batch = None
        held = 0
        copies = dict(groups)  # every client's copies, held or saved (the tallies count them all)
        async with self._batch_lock:
            if self.holding is not None:
                batch = HeldBatch(asyncio.get_running_loop().create_future())
                held, refused = self.holding.admit(groups, origins, batch)
                if refused:  # their tails first: their copies are saved behind them
                    await self.holding.spill(refused, "refused")
            results = await self._save_and_forward(len(records), groups, {}, origins)
            if results is None:
                raise RuntimeError("stopping while Redis is unavailable: the batch is not answered")
            if self.holding is not None:
                self.holding.saved(results)
        self.stats["persist_records"] += len(records)
        self.stats["persist_batches"] += 1
        self._tally(copies)
        stored = held + sum(len(r.messages) for r in results.values())
        if batch is not None and not self.holding.table.seal(batch):
            return stored, batch
        return stored, None

    def _decode(self, value: bytes | None, tp=None, offset: int = 0):
        """A PersistedMsg, or None (counted, logged with where it came from: a tbmq.msg.persisted record at
        `tp`/`offset`, else a Persist stream) when it does not decode."""
        try:
            return pb.PersistedMsg.FromString(value or b"")
        except DecodeError:
            self.stats["bad_records"] += 1
            if tp is None:
                log.error("undecodable PersistedMsg on a Persist stream: skipped")
            else:
                log.error("undecodable PersistedMsg at %s[%d]@%d: skipped", tp.topic, tp.partition, offset)
            return None

    async def _save_and_forward(self, records: int, groups, sources, origins):
        """One batch of either input (the caller holds the batch lock): saved (`_save`), then its stored messages
        queued on the connectors' Forward streams, not awaited (forward.py). None when stopping while Redis is
        down (nothing saved for sure)."""
        span = (tracer.start_as_current_span("device-persistence.save", attributes={
                    "messaging.batch.message_count": records, "tbmq.clients": len(groups)})
                if self.spans else contextlib.nullcontext())
        with span:
            results = await self._save(groups, sources, origins)
            if results is not None:
                self.forwards.forward(group_by_service(results.values()))
            return results

    async def _save(self, groups, sources, origins=None):
        """The batch saved, retried until it is (None when stopping first). After DEVICE_PERSISTENCE_SAVE_ATTEMPTS
        attempts refused for the data (`refused_for_data`) each client is saved apart and the copies Redis still
        refuses are dead-lettered (`_save_apart`)."""
        backoff = Backoff()
        refusals = 0
        lettered: set[str] = set()  # clients whose copies went to the dead letters (not sent again on a retry)
        while True:
            try:
                if refusals >= self.s.save_attempts:
                    results = await self._save_apart(groups, sources, origins or {}, lettered)
                else:
                    results = await self.store.save_many_attached(groups, sources=sources, origins=origins)
                self.stats["saved"] += sum(len(r.messages) for r in results.values())
                await self._forward_lost_replies(results)
                return results
            except (RedisError, OSError, KafkaError) as exc:
                # Nothing is committed; a retry stores nothing twice (the batch's source offsets and origins).
                self.stats["save_failures"] += 1
                if self._stopping:
                    log.warning("save failed while stopping (%r): batch left uncommitted", exc)
                    return None
                if refused_for_data(exc):
                    refusals += 1
                delay = backoff.next()
                log.warning("saving a batch in Redis failed (%r); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)

    async def _save_apart(self, groups, sources, origins, lettered: set[str]):
        """Each client of a batch Redis keeps refusing saved on its own call. A client whose own save is still
        refused for its data has its copies sent to tbmq.msg.persisted.dead (`_dead_letter`) and the batch goes
        on: one client's broken keys do not stop every other client's saves. When no client of a batch of
        several can be saved, the cause is Redis or the scripts, not one client's data: the error is raised and
        the batch retried like any failed save (nothing dead-lettered)."""
        todo = [cid for cid in groups if cid not in lettered]
        outcomes = await asyncio.gather(*(self.store.save_many_attached(
            {cid: groups[cid]}, sources={cid: sources[cid]} if cid in sources else None,
            origins={cid: origins[cid]} if cid in origins else None) for cid in todo), return_exceptions=True)
        results: dict[str, SaveResult] = {cid: SaveResult([]) for cid in lettered}
        refused: dict[str, BaseException] = {}
        for cid, outcome in zip(todo, outcomes):
            if isinstance(outcome, dict):
                results.update(outcome)
            elif refused_for_data(outcome):
                refused[cid] = outcome
            else:
                raise outcome
        if refused and len(refused) == len(todo) and len(groups) > 1:
            raise next(iter(refused.values()))
        for cid, exc in refused.items():
            await self._dead_letter(cid, groups[cid], origins.get(cid), exc)
            lettered.add(cid)
            results[cid] = SaveResult([])
        return results

    async def _dead_letter(self, client_id: str, msgs, origins, exc: BaseException) -> None:
        """A client's copies Redis refused, to tbmq.msg.persisted.dead in order (key = client id, the copies as
        routed, with their origins; header tbmq-error = Redis's answer), acknowledged by Kafka before the batch
        goes on: nothing is lost, and `tbmq dead-letters replay` stores them once the client's keys are mended."""
        producer = await self._kafka_producer()
        error = str(exc).encode("utf-8", "replace")[:1000]
        headers = [(DEAD_LETTER_ERROR_HEADER, error), (DEAD_LETTER_INSTANCE_HEADER, self.s.instance_id.encode())]
        sends = []
        for i, msg in enumerate(msgs):
            pm = pb.PersistedMsg(client_id=client_id, msg=msg)
            origin = origins[i] if origins else None
            if origin is not None:
                pm.origin_partition, pm.origin_offset = origin
            sends.append(await producer.send(MSG_PERSISTED_DEAD, value=pm.SerializeToString(),
                                             key=client_id.encode("utf-8"), headers=headers))
        await asyncio.gather(*sends)
        self.stats["dead_lettered"] += len(msgs)
        log.error("Redis refused the stored copies of client %r (%s): %d message(s) sent to %s; "
                  "`tbmq dead-letters replay --client-id` stores them once the client's keys are mended",
                  client_id, error.decode("utf-8", "replace"), len(msgs), MSG_PERSISTED_DEAD)

    async def _kafka_producer(self):
        """The service's producer (dead letters, tallies), started at its first use: an instance that writes
        neither never connects one."""
        if self._producer is None:
            producer = make_producer(self.s.bootstrap, client_id=f"{self.s.instance_id}-producer")
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer
        return self._producer

    def _tally(self, groups) -> None:
        """The copies of an answered Persist batch counted in this second (tally.py); the writer runs while
        tallies are pending, so an idle instance has no timer."""
        self.tallies.add(int(time.time()), [m for msgs in groups.values() for m in msgs])
        if self._tally_task is None or self._tally_task.done():
            self._tally_task = self.spawn(self._write_tallies(), "persist tallies")

    async def _write_tallies(self) -> None:
        """The tallies of the seconds ended written to tbmq.msg.persisted.tally every TALLY_FLUSH_S (a record per
        second, one request: a write costs wake-ups in this process and in Kafka, so not one a second); failures
        are logged and the tallies kept for the next attempt (never raises: statistics never stop the service)."""
        backoff = Backoff()
        while self.tallies:
            await asyncio.sleep(TALLY_FLUSH_S - time.time() % TALLY_FLUSH_S + TALLY_DELAY_S)
            done = self.tallies.take_done(time.time())
            if done and not await self._send_tallies(done):
                self.tallies.put_back(done)
                await asyncio.sleep(backoff.next())
            else:
                backoff.reset()

    async def _send_tallies(self, tallies) -> bool:
        try:
            producer = await self._kafka_producer()
            key = self.s.instance_id.encode()
            await asyncio.gather(*[await producer.send(MSG_PERSISTED_TALLY, t.SerializeToString(), key=key,
                                                       timestamp_ms=t.second_ms) for t in tallies])
            self.stats["tallies_written"] += len(tallies)
            return True
        except Exception as exc:  # KafkaError, OSError, a producer that would not start
            self.stats["tally_failures"] += 1
            log.warning("writing %d persist tallies to %s failed (%r); kept for the next attempt",
                        len(tallies), MSG_PERSISTED_TALLY, exc)
            return False

    async def _forward_lost_replies(self, results) -> None:
        """A client whose whole batch the save found applied before, and stored none of it now: either a
        replay (after a crash of this service or of the router), or the retry of a save whose reply was lost
        (Redis went away after running it; redis-py retries a command or pipeline on a connection error, and
        so does `_save`). In the second case the lost attempt handed the messages packet ids if the client was
        live, and nothing forwarded them: the connection takes forwards in serial order only, so the next
        forward would raise its highest serial past them and they would wait for its next connect. They are
        read back (the client's last ones: one instance saves a client's batches one at a time) and forwarded
        ahead of anything newer. In a replay they were forwarded or fetched before: the connection ignores
        them (serials it has had), at the cost of one read.
        """
        for cid, r in results.items():
            # a client's batch is one script call, applied wholly or not at all
            if not r.applied_before or r.messages or r.attached is None:
                continue
            lost = [m for m in await self.store.peek_last(cid, r.applied_before) if m.packet_id]
            if lost:
                r.again = lost
                self.stats["forwarded_again"] += len(lost)
                log.info("client %r: %d message(s) of a batch applied before forwarded again", cid, len(lost))

    def _start_commit(self) -> None:
        """Commit the pending (saved) offsets in the background, unless a commit is in flight (then they
        wait for the next one): the loop goes on fetching meanwhile."""
        if self._commit_task is not None and not self._commit_task.done():
            return
        offsets, self._pending_offsets = self._pending_offsets, {}
        self._last_commit = time.monotonic()
        self._commit_task = asyncio.get_running_loop().create_task(self._commit(offsets), name="commit")

    async def _commit_pending(self) -> None:
        """The commit in flight finishes, then everything saved and not yet committed is committed (before
        a rebalance and at stop; the caller holds the batch lock, so nothing new is saved meanwhile)."""
        task, self._commit_task = self._commit_task, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        offsets, self._pending_offsets = self._pending_offsets, {}
        self._last_commit = time.monotonic()
        if offsets:
            await self._commit(offsets)

    async def _commit(self, offsets) -> None:
        try:
            await self.consumer.commit(offsets)
            self.stats["commits"] += 1
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            # A rebalance took the partitions: their new owner replays from the last commit (QoS 1
            # duplicates of what these batches stored, never a loss).
            self.stats["commit_failures"] += 1
            log.warning("commit failed (%r): the batches will be replayed by the partitions' new owner", exc)
