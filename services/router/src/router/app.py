"""The Faust application: the routing agent, the state views, the health endpoint.

Start-up order (a Faust ``Worker`` starts its services in order, then the app):
1. ``RouterRuntime``: health endpoint (not ready), input/state topics ensured, both compacted views
   (tbmq.client.subscriptions -> trie, tbmq.client.session -> session views) read to their end, then
   ``gc.freeze()``. Only then does the Faust app (consumer, agent) start: nothing is routed before the
   state is rebuilt.
2. The Faust app joins consumer group ``router`` on tbmq.msg.all; /readyz turns 200 once it is started.

Batches: Faust's consumer normally hands every record to the agent as one event (a task pair, a lock,
an Event object and a queue round trip per record: most of the router's CPU). ``BatchConsumer``
keeps Faust's fetcher, rebalancing, flow control and commit bookkeeping, but delivers the records of
tbmq.msg.all fetched by one poll as ONE ``RecordBatch`` into the agent's stream; the agent routes the
whole batch and produces its records through the aiokafka producer, except the stored copies for
persistent DEVICE clients, which go to device-persistence over Persist streams (``router.persist``;
``ROUTER_PERSIST_VIA=kafka``: through tbmq.msg.persisted like the rest).

One process fewer (``ROUTER_PERSIST_VIA=local``): the runtime also runs a device-persistence instance
(``tbmq_device_persistence``, on this loop, started before the state views and stopped after the app has
drained), and the copies of the clients it is the target of go to its ``persist`` directly
(``router.persist.LocalPersist``). Its gRPC API serves the connectors and the session registry as a
standalone instance's would; its metrics join the router's on the health port.

Commit semantics: nothing is acked by the stream (``noack``); every record produced for a batch is
sent without waiting, and a done-callback acks every offset of the batch only when Kafka acknowledged
ALL of them (idempotent producer, acks=all), and device-persistence answered every Persist batch holding
one of its copies (saved in Redis). Faust commits, per partition, only the highest offset below
which every offset was acked. A failed send stops the process (exit 70) without acking: the records
are routed again by whoever owns the partition next (at-least-once). See docs/router.md.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import logging
import os
import signal
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from functools import partial

import aiokafka
import faust
from faust.tables.manager import TableManager
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types.tuples import ack_lock
from google.protobuf.message import DecodeError
from mode import Service
from mode.utils.futures import maybe_async, notify
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from tbmq_platform import topics
from tbmq_platform.coalesce import AdaptiveFetch, adaptive_fetch
from tbmq_platform.compacted import Barrier, CompactedViews
from tbmq_platform.marks import is_mark
from tbmq_platform.health import HealthServer
from tbmq_platform.metrics import Metrics
from tbmq_platform.kafka import DirectSend, ensure_topics, repair_sequence_gaps
from tbmq_platform.retention import RetentionWatch
from tbmq_platform.tracing import kafka_headers, span_from_kafka, spans_on, trace_headers

from tbmq_device_persistence.service import DevicePersistenceService
from tbmq_device_persistence.settings import DevicePersistenceSettings

from .convert import OutRecord
from .persist import PersistLink
from .settings import RouterSettings
from .state import RoutingState

log = logging.getLogger("router")
tracer = trace.get_tracer("router")

EXIT_SEND_FAILED = 70
BARRIER_WARN_S = 10.0  # a batch waiting this long for the state views is logged (and waits on)


# ------------------------------------------------------------------------------ Faust internals
FAUST_CHECKED = "0.15.3"
# What BatchConsumer and RouterRuntime use of Faust beyond its public API (docs/router.md, Batches):
# methods of its aiokafka Consumer, and attributes its instances set in __init__ / on start.
_FAUST_METHODS = ("_wait_next_records", "_drain_messages", "_add_gap", "_to_message", "wait_first",
                  "perform_seek", "commit", "track_message", "_new_consumer_thread")
# ... and of mode's ServiceThread, which InLoopConsumerThread runs without a thread:
_THREAD_METHODS = ("Worker", "_serve", "_gather_remaining_tasks", "call_thread", "cast_thread",
                   "on_thread_stop", "start", "_create_worker_consumer")
# ... and of mode's Worker, whose shutdown RouterWorker (__main__) shortens:
_WORKER_METHODS = ("_sentinel_task", "_shutdown_loop")
# ... and of Faust's TableManager, whose start RouterTableManager shortens:
_TABLE_MANAGER_METHODS = ("on_start", "_update_channels", "recovery")
_FAUST_ATTRIBUTES = ("_read_offset", "_unacked_messages", "_committed_offset", "_acked_index", "_acked",
                     "_n_acked", "_commit_every", "_buffered_partitions", "_waiting_for_ack", "suspend_flow",
                     "_thread")


def check_faust_internals(consumer=None) -> None:
    """Start-up check: the pinned Faust (requirements.lock) has the internals the batch path relies on.
    An upgrade that changes them stops the router with a message instead of routing wrongly."""
    problems = []
    if faust.__version__ != FAUST_CHECKED:
        problems.append(f"faust-streaming {faust.__version__} (the batch consumer is checked against "
                        f"{FAUST_CHECKED})")
    problems += [f"Consumer.{m} is missing" for m in _FAUST_METHODS if not hasattr(faust_aiokafka.Consumer, m)]
    problems += [f"AIOKafkaConsumerThread.{m} is missing" for m in _THREAD_METHODS
                 if not hasattr(faust_aiokafka.AIOKafkaConsumerThread, m)]
    problems += [f"Worker.{m} is missing" for m in _WORKER_METHODS if not hasattr(faust.Worker, m)]
    problems += [f"TableManager.{m} is missing" for m in _TABLE_MANAGER_METHODS if not hasattr(TableManager, m)]
    if consumer is not None:
        problems += [f"consumer.{a} is missing" for a in _FAUST_ATTRIBUTES if not hasattr(consumer, a)]
    if problems:
        raise RuntimeError("router: Faust internals changed: " + "; ".join(problems))


# ------------------------------------------------------------------------------ the consumer on the main loop
class _InLoopWorker:
    """Stands in for mode's WorkerThread: runs the service's ``_serve()`` as a task of the loop it was
    started from instead of a thread with a loop of its own."""

    def __init__(self, service: "InLoopConsumerThread") -> None:
        self.service = service
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.service._serve(), name="kafka consumer")

    def stop(self) -> None:  # mode calls it (synchronously) after the service stopped: the task has ended
        pass


class _ReadCommitted:
    """tbmq.msg.all is read read_committed. The session registry publishes Wills there inside its
    transactions (with the session change that decided them): a Will whose transaction aborted must not be
    routed, and when the registry redoes the work it must not be routed twice. Faust reads read_committed
    only under exactly_once processing (which also makes its producer transactional), so the consumer it
    builds is switched before it starts: aiokafka reads ``AIOKafkaConsumer._isolation_level`` in
    ``start()`` to build its fetcher (aiokafka 0.14, requirements.lock; checked here). Records of the
    connectors (no transactions) are not held: for them the last stable offset is the high watermark."""

    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        if getattr(consumer, "_isolation_level", None) not in ("read_uncommitted", "read_committed"):
            raise RuntimeError(f"router: aiokafka {aiokafka.__version__}: AIOKafkaConsumer._isolation_level "
                               "is not where the router sets read_committed (checked against 0.14)")
        consumer._isolation_level = "read_committed"
        return consumer


class ThreadConsumerThread(_ReadCommitted, faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's own consumer thread (``ROUTER_CONSUMER_IN_LOOP=false``), read_committed."""


class InLoopConsumerThread(_ReadCommitted, faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's aiokafka consumer, run on the worker's own event loop.

    Faust runs its consumer in a thread with an event loop of its own and hands every call across
    (``call_thread``: a method queue, a future, two cross-thread wake-ups per poll); with the router's
    fetch loop that hand-over cost more than routing the records of a live poll. Here the service is the
    same, but ``thread_loop`` is the worker's loop, ``_serve()`` runs as a task (``_InLoopWorker``) and
    ``call_thread`` / ``cast_thread`` simply await the call. mode's thread sweep of "every task of the
    thread's loop" at shutdown is skipped: that loop is the worker's."""

    Worker = _InLoopWorker  # type: ignore[assignment]

    async def call_thread(self, fun, *args, **kwargs):
        return await maybe_async(fun(*args, **kwargs))  # as mode's method queue: sync or async

    async def cast_thread(self, fun, *args, **kwargs):
        await maybe_async(fun(*args, **kwargs))

    async def _gather_remaining_tasks(self) -> None:
        return None


# ------------------------------------------------------------------------------ batch consumption
class RecordBatch:
    """The tbmq.msg.all records of one poll (``records``: partition -> aiokafka ConsumerRecords in
    offset order), delivered to the agent as one stream value.

    While the agent works on it, it stands in Faust's set of unacknowledged messages (``acked``,
    ``refcount``, weak-referenceable), so a rebalance or shutdown waits for it like for an event."""

    __slots__ = ("records", "generation_id", "acked", "refcount", "barrier", "queued", "__weakref__")

    def __init__(self, records: dict, generation_id: int):
        self.records = records
        self.generation_id = generation_id
        self.acked = False
        self.refcount = 1
        self.barrier = None  # the state views' end offsets read after this batch arrived (RouterRuntime.deliver)
        self.queued = False  # in BatchConsumer's per-partition order (track_batch)

    def __len__(self) -> int:
        return sum(len(v) for v in self.records.values())

    def __repr__(self) -> str:
        return f"<RecordBatch {len(self)} records of {sorted(tp.partition for tp in self.records)}>"


class BatchConsumer(faust_aiokafka.Consumer):
    adaptive_fetch: AdaptiveFetch | None = None

    def _new_consumer_thread(self):
        if getattr(self.app, "consumer_in_loop", False):
            return InLoopConsumerThread(self, loop=self.loop, thread_loop=self.loop, beacon=self.beacon)
        return ThreadConsumerThread(self, loop=self.loop, beacon=self.beacon)

    """Faust's aiokafka consumer, delivering the records of ``batch_topic`` in batches.

    ``_drain_messages`` (Faust's fetch loop) is the same as Faust's, but per POLL rather than per
    record: flow control, generation check, read offsets, gap tracking and ``broker_commit_every``
    are applied as Faust does, then the records of ``batch_topic`` go to ``deliver_batch`` (the
    runtime puts them into the agent's stream) in one call. Records of any other topic (none: the
    router subscribes to tbmq.msg.all only) take Faust's per-event path.

    ``ack_batch`` is ``Consumer.ack`` for every offset of a batch at once.
    """

    @property
    def batch_topic(self) -> str | None:
        return getattr(self.app, "batch_topic", None)

    _in_order: dict | None = None  # TP -> deque of its tracked batches, in delivery order

    def track_batch(self, batch: RecordBatch) -> None:
        self._unacked_messages.add(batch)
        if self._in_order is None:
            self._in_order = defaultdict(deque)
        batch.queued = True
        for tp in batch.records:
            self._in_order[tp].append(batch)

    def ack_batch(self, batch: RecordBatch) -> int:
        """The batch is done (every copy acknowledged). Its offsets go to Faust's acked offsets only once every
        earlier batch of the same partition is done too: batches complete out of order (one without copies at
        once, one waiting for device-persistence later), and Faust's commit (``Consumer._new_offset``, faust
        0.15.3) takes the first run of acked offsets without checking that it starts at the committed offset
        when none is known or it is 0, nor when the run starts one past it: it would commit past a record whose
        copies are not acknowledged yet, and a crash then would lose them (docs/router.md, Commit
        semantics). Returns how many offsets were handed to Faust."""
        with ack_lock:
            if batch.acked:
                return 0
            batch.acked = True
            self._unacked_messages.discard(batch)
            n = 0
            if self.app.topics.acks_enabled_for(self.batch_topic):
                for tp in batch.records:
                    if not batch.queued:  # not tracked: acked by itself
                        n += self._ack_offsets(tp, batch.records[tp])
                        continue
                    queue = self._in_order[tp]
                    while queue and queue[0].acked:
                        n += self._ack_offsets(tp, queue.popleft().records[tp])
                self._n_acked += n
            notify(self._waiting_for_ack)
            return n

    def _ack_offsets(self, tp, recs) -> int:
        committed = self._committed_offset[tp]
        index = self._acked_index[tp]
        add, append = index.add, self._acked[tp].append
        n = 0
        for rec in recs:
            off = rec.offset
            if (committed is None or off >= committed) and off not in index:
                add(off)
                append(off)
                n += 1
        return n

    async def _drain_messages(self, fetcher) -> None:  # pragma: no cover - needs a broker
        deliver = getattr(self.app, "deliver_batch", None)  # RouterApp: RouterRuntime.deliver
        if deliver is None:
            return await super()._drain_messages(fetcher)
        check_faust_internals(self)
        batch_topic = self.batch_topic
        callback = self.callback
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        set_flag, unset_flag = self.diag.set_flag, self.diag.unset_flag
        acks_enabled_for = self.app.topics.acks_enabled_for
        suspend_flow = self.suspend_flow
        adaptive = None
        window_ms = getattr(self.app, "fetch_window_ms", 0.0)
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag("FETCHING")
                try:
                    records, active = await self._wait_next_records(1.0)
                    if adaptive is None and window_ms > 0:
                        # the aiokafka consumer of Faust's consumer thread exists once it has started
                        adaptive = self.adaptive_fetch = adaptive_fetch(self._thread._ensure_consumer(), window_ms)
                    if adaptive is not None:
                        adaptive.polled_batches(records)
                    await self.sleep(0)
                    if not records or self.should_stop:
                        continue
                    if not self.flow_active:
                        # fetched while a rebalance started: drop, read again from the committed offsets
                        try:
                            await self.perform_seek()
                        except Exception as exc:
                            self.log.warning("exception performing seek when flow not active %r", exc)
                        continue
                    generation_id = self.app.consumer_generation_id
                    buffered = self._buffered_partitions
                    batch: dict = {}
                    for tp, recs in records.items():
                        if active is not None and tp not in active and tp not in buffered:
                            continue
                        r_offset = get_read_offset(tp)
                        if tp.topic != batch_topic:
                            for rec in recs:  # Faust's per-event path
                                if r_offset is None or rec.offset >= r_offset:
                                    await self.wait_first(callback(self._to_message(tp, rec)), suspend_flow.wait())
                                    set_read_offset(tp, rec.offset)
                            continue
                        first = recs[0].offset
                        if recs[-1].offset - first == len(recs) - 1 and (r_offset is None or first == r_offset + 1):
                            keep = recs  # contiguous and following the last delivered record
                        else:
                            # re-delivered records or offset gaps (control records, compaction):
                            # per record, as Faust does
                            keep = []
                            acks = acks_enabled_for(tp.topic)
                            for rec in recs:
                                off = rec.offset
                                if r_offset is None or off >= r_offset:
                                    if r_offset and off - r_offset > 1 and acks:
                                        await self._add_gap(tp, r_offset + 1, off)
                                    keep.append(rec)
                                    r_offset = off
                        if keep:
                            batch[tp] = keep
                    if batch:
                        if self._commit_every is not None and self._n_acked >= self._commit_every:
                            self._n_acked = 0
                            await self.commit()
                        await self.wait_first(deliver(RecordBatch(batch, generation_id)), suspend_flow.wait())
                        for tp, keep in batch.items():
                            set_read_offset(tp, keep[-1].offset)
                finally:
                    unset_flag("FETCHING")
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise


# ------------------------------------------------------------------------------ idempotent producer
class IdempotentProducer(faust_aiokafka.Producer):
    """Faust's aiokafka producer with enable_idempotence=True and acks=all (Faust only turns
    idempotence on for exactly-once transactions); a failed batch does not stop it for good."""

    def _settings_extra(self):
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    def _new_producer(self, transactional_id=None):
        """Faust's producer, which takes a new producer id after a failed batch (repair_sequence_gaps)."""
        return repair_sequence_gaps(super()._new_producer(transactional_id))

    def aiokafka_producer(self):
        """The started ``AIOKafkaProducer`` (the router sends through it directly)."""
        return self._ensure_producer()


class IdempotentTransport(faust_aiokafka.Transport):
    Consumer = BatchConsumer
    Producer = IdempotentProducer


class RouterTableManager(TableManager):
    """Faust's table manager without the second it sleeps before starting its recovery, there so that tables
    defined while the app starts are registered first. The router defines no table, and every start of a
    router (a restart after a crash included: its partitions wait for it) took that second longer."""

    async def on_start(self) -> None:
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()


class RouterApp(faust.App):
    batch_topic: str | None = None  # records of this topic are delivered in batches...
    deliver_batch = None  # ...to this coroutine function (RecordBatch) -> None
    fetch_window_ms: float = 0.0  # adaptive fetch window of the batch consumer (0 = off)
    consumer_in_loop: bool = False  # Faust's consumer on the worker's loop (InLoopConsumerThread)

    def _new_transport(self):
        return IdempotentTransport(self.conf.broker_consumer, self)

    def _new_producer_transport(self):
        return IdempotentTransport(self.conf.broker_producer, self)


# ------------------------------------------------------------------------------ sending
class _Pending:
    """Events (one, or a batch) waiting for the acknowledgement of every record produced for them."""

    __slots__ = ("ack", "events", "left", "pipeline")

    def __init__(self, ack, events: int, left: int, pipeline: "Pipeline"):
        self.ack, self.events, self.left, self.pipeline = ack, events, left, pipeline

    def done(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return self.pipeline.failed(asyncio.CancelledError("send cancelled"))
        exc = fut.exception()
        if exc is not None:
            return self.pipeline.failed(exc)
        self.left -= 1
        if self.left == 0:
            self.pipeline.completed(self)


class Pipeline:
    """Sends the records of successive events (or batches of events) without waiting, acks them once
    all their records are acknowledged, and keeps at most ``max_inflight`` events unacknowledged.

    ``send(topic, key, value, headers)``: awaitable -> Future of the record's acknowledgement.
    """

    def __init__(self, send, ensure, max_inflight: int, on_failure):
        self._send = send
        self._ensure = ensure  # async (specs) -> None: creates missing topics
        self.max_inflight = max_inflight
        self._on_failure = on_failure
        self.known_topics: set[str] = set()
        self.inflight = 0
        self.acked_events = 0
        self.produced = 0
        self._room = asyncio.Event()
        self._room.set()
        self._empty = asyncio.Event()
        self._empty.set()
        self.failure: BaseException | None = None

    async def submit(self, event, records: list[OutRecord], headers) -> None:
        """One event: acked (``event.ack()``) once every record of ``records`` is acknowledged."""
        await self.submit_batch(event.ack, 1, records, headers)

    async def submit_batch(self, ack, events: int, records: list[OutRecord], headers) -> None:
        """``events`` events whose records are ``records`` (all with ``headers``); ``ack()`` is
        called once every one of them is acknowledged."""
        await self._submit(ack, events, records, headers, False)

    async def submit_pairs(self, ack, events: int, pairs: list) -> None:
        """Like ``submit_batch`` with ``pairs`` = [(OutRecord, headers), ...]."""
        await self._submit(ack, events, pairs, None, True)

    async def _submit(self, ack, events: int, items: list, headers, paired: bool) -> None:
        if self.failure is not None:
            raise RuntimeError("router pipeline failed") from self.failure
        known = self.known_topics
        missing = None
        for it in items:
            r = it[0] if paired else it
            if r.spec is not None and r.topic not in known:
                if missing is None:
                    missing = {}
                missing[r.topic] = r.spec
        if missing:
            await self._ensure(list(missing.values()))
            known.update(missing)
        if not items:
            ack()
            self.acked_events += events
            return
        pending = _Pending(ack, events, len(items), self)
        self.inflight += events
        self._empty.clear()
        if self.inflight >= self.max_inflight:
            self._room.clear()
        send, done = self._send, pending.done
        try:
            if paired:
                for r, h in items:
                    (await send(r.topic, r.key, r.value, h)).add_done_callback(done)
            else:
                for r in items:
                    (await send(r.topic, r.key, r.value, headers)).add_done_callback(done)
        except Exception as exc:  # refused before it was queued (e.g. a record over max.request.size)
            self.failed(exc)      # the same end as a refused acknowledgement: never a silent stall
            raise
        self.produced += len(items)
        if not self._room.is_set():
            await self._room.wait()

    def completed(self, pending: _Pending) -> None:
        pending.ack()
        self.acked_events += pending.events
        self.inflight -= pending.events
        if self.inflight < self.max_inflight:
            self._room.set()
        if self.inflight == 0:
            self._empty.set()

    def acked(self, event, counted: bool = True) -> None:
        """Ack an event at once (``counted``: it was counted in flight)."""
        event.ack()
        self.acked_events += 1
        if counted:
            self.inflight -= 1
            if self.inflight < self.max_inflight:
                self._room.set()
            if self.inflight == 0:
                self._empty.set()

    def failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            self._on_failure(exc)

    async def drain(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


def _header_pairs(headers) -> list:
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


def in_arrival_order(records: Mapping) -> Iterable:
    """The records of a poll (partition -> records in offset order) as one sequence in the order Kafka
    received them: merged by record timestamp (the producer's create time), each partition's records
    kept in offset order, ties in partition order.

    MQTT orders messages per topic only, and tbmq.msg.all is keyed by topic (one partition each), so any
    order across partitions is correct; but a poll under load holds several partitions, and routing them
    partition after partition would let one publisher's message on topic b overtake its earlier message
    on topic a that it had already seen acknowledged. Merging keeps what users see on a single broker."""
    if len(records) == 1:
        return next(iter(records.values()))
    return heapq.merge(*records.values(), key=_timestamp)


def _timestamp(rec) -> int:
    return rec.timestamp


def has_mark(records: dict) -> bool:
    """Whether a batch's records (partition -> records) hold a subscription mark (tbmq_platform.marks)."""
    for recs in records.values():
        for rec in recs:
            if is_mark(rec.value):
                return True
    return False


# ------------------------------------------------------------------------------ runtime
class RouterRuntime(Service):
    """State views + health endpoint; started by the Worker BEFORE the Faust app."""

    def __init__(self, settings: RouterSettings, app: faust.App, state: RoutingState | None = None,
                 device_persistence: DevicePersistenceSettings | None = None, **kw):
        super().__init__(**kw)
        self.settings = settings
        # ROUTER_PERSIST_VIA=local: the device-persistence instance this process runs
        self.device_persistence = (DevicePersistenceService(device_persistence)
                                   if device_persistence is not None else None)
        self._dp_watch: asyncio.Task | None = None
        self.app = app
        self.routing = state or RoutingState()
        self.metrics = Metrics()
        self.health = HealthServer(settings.health_host, settings.health_port, settings.service_name,
                                   self.health_details, self.metrics, instance=settings.instance_id)
        self.views: CompactedViews | None = None
        self.barrier: Barrier | None = None
        self.barrier_stalls = 0
        self._barrier_generation: int | None = None  # the assignment whose first batch waited for the barrier
        self.marked_batches = 0  # batches that waited for the barrier (a mark, or a new assignment)
        self.retention: RetentionWatch | None = None
        self.pipeline: Pipeline | None = None
        self.persist: PersistLink | None = None
        self.exit_code = 0
        # spans cost ~5x the routing itself: only create them when they are exported
        self.spans = spans_on(settings)
        self.rebuilt_in: float | None = None
        self.batches = 0
        self.stale_batches = 0
        self._inbox: asyncio.Queue | None = None
        self._inbox_set: asyncio.Event | None = None

    def health_details(self) -> dict:
        d = {"instance": self.settings.instance_id, **self.routing.stats()}
        if self.pipeline is not None:
            d.update(inflight=self.pipeline.inflight, acked_events=self.pipeline.acked_events,
                     produced=self.pipeline.produced)
        d.update(batches=self.batches, stale_batches=self.stale_batches)
        if self.barrier is not None:
            d.update(barrier_requests=self.barrier.requests, barrier_stalls=self.barrier_stalls,
                     marked_batches=self.marked_batches)
        adaptive = getattr(getattr(self.app, "_consumer", None), "adaptive_fetch", None)
        if adaptive is not None:
            d.update(adaptive.health())
        if self.rebuilt_in is not None:
            d["rebuilt_in_s"] = round(self.rebuilt_in, 3)
        if self.retention is not None:
            d.update(self.retention.stats)
        if self.persist is not None:
            d.update(self.persist.stats())
        if self.device_persistence is not None:
            d["device_persistence"] = self.device_persistence.health_details()
        return d

    async def on_start(self) -> None:
        s = self.settings
        await self.health.start()
        t0 = time.monotonic()
        if self.device_persistence is not None:
            await self._start_device_persistence()
        await ensure_topics(s.bootstrap, [topics.spec(n) for n in (
            topics.MSG_ALL, topics.MSG_PERSISTED, topics.CLIENT_SESSION, topics.CLIENT_SUBSCRIPTIONS)],
            layout=s.topic_layout)
        # both views on one consumer (tbmq_platform.compacted)
        self.views = CompactedViews(s.bootstrap, client_id=f"{s.instance_id}-views")
        self.views.view(topics.CLIENT_SUBSCRIPTIONS, self.routing.apply_subscriptions)
        self.views.view(topics.CLIENT_SESSION, self.routing.apply_session)
        await asyncio.wait_for(self.views.start(), s.rebuild_timeout_s)
        self.barrier = self.views.barrier()  # both views: see handle_batch
        self.health.check("state views", self.views.problem)  # routing on a frozen table is not ready
        self._register_metrics()
        # acknowledged messages the router has not routed yet, against tbmq.msg.all's retention
        self.retention = await RetentionWatch.started(s, s.group_id, lambda: [topics.MSG_ALL])
        self.rebuilt_in = time.monotonic() - t0
        gc.collect()
        gc.freeze()  # the rebuilt trie is long-lived: keep it out of the GC's generations
        log.info("state rebuilt in %.2fs: %s", self.rebuilt_in, self.routing.stats())

    def _register_metrics(self) -> None:
        """GET /metrics (tbmq_platform.metrics): the routing counters, read at scrape time."""
        m, c = self.metrics, self.routing.counters
        m.gauge("subscriptions", "subscriptions in the router's trie", lambda: len(self.routing.trie))
        m.gauge("sessions", "sessions the router knows", lambda: len(self.routing.sessions))
        m.counter("routed_messages", "tbmq.msg.all records routed", lambda: c["routed"])
        m.counter("routed_records", "records produced for routed messages", lambda: c["records"])
        m.counters_by("router_dropped", "messages or copies not routed, by reason", c, "reason",
                      {"expired": "expired", "no_subscriber": "empty", "undecodable": "undecodable",
                       "copy_dropped": "dropped_copies"})
        m.counter("subscription_marks", "subscription marks read on tbmq.msg.all (tbmq_platform.marks)",
                  lambda: c["marks"])
        m.gauge("router_inflight", "routed messages waiting for Kafka's (or device-persistence's) acknowledgement",
                lambda: self.pipeline.inflight if self.pipeline is not None else 0)
        m.gauge("router_persist_unanswered", "Persist batches sent to device-persistence and not answered yet",
                lambda: self.persist.stats()["persist_unanswered"] if self.persist is not None else 0)

        def consumers():
            # Faust's consumer -> its (in-loop) consumer thread -> the aiokafka consumer; none before start
            thread = getattr(getattr(self.app, "_consumer", None) or self.app.consumer, "_thread", None)
            consumer = getattr(thread, "_consumer", None)
            return [(self.settings.group_id, consumer)] if consumer is not None else []

        m.lag("consumer_lag", consumers)

    async def _start_device_persistence(self) -> None:
        """The instance of ROUTER_PERSIST_VIA=local, started first: its gRPC API is up (the connectors attach
        their clients there) before anything is routed. Its metrics are the router's. A background task of it
        that fails stops the whole process, as it stops a standalone instance (exit code 1)."""
        dp = self.device_persistence
        dp.metrics = self.metrics
        await dp.start()
        self._dp_watch = asyncio.ensure_future(self._watch_device_persistence(dp.failed()))

    async def _watch_device_persistence(self, failed: asyncio.Future) -> None:
        try:
            await failed
        except Exception as exc:
            log.critical("device-persistence failed in this process (%r): stopping", exc)
            self.exit_code = 1
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's graceful stop: drain, commit, stop both

    async def on_stop(self) -> None:
        self.health.ready = False
        if self.persist is not None:  # after the pipeline's drain (on_before_shutdown); unanswered = not committed
            await self.persist.close()
        if self.device_persistence is not None:  # after the copies it was handed: its stop finishes their saves
            if self._dp_watch is not None:
                self._dp_watch.cancel()
            try:
                await self.device_persistence.stop()
            finally:
                await self.device_persistence.cancel_tasks()
        if self.retention is not None:
            await self.retention.close()
        if self.views is not None:
            await self.views.stop()
        await self.health.stop()

    # -- batch delivery (BatchConsumer -> agent) --------------------------------------------------
    def attach(self, queue: asyncio.Queue) -> None:
        """Called by the agent: the queue its stream reads (batches are put there)."""
        self._inbox = queue
        if self._inbox_set is not None:
            self._inbox_set.set()

    async def deliver(self, batch: RecordBatch) -> None:
        """BatchConsumer -> the agent's stream (waits while Faust's flow control is suspended, i.e.
        during a rebalance, and while the stream's queue is full).

        First, before anything yields, for a batch that holds a subscription mark or is the first of a new
        assignment (tbmq_platform.marks): the barrier request it waits for in `handle_batch` (sent after now,
        i.e. after the batch's records were received; shared with the batches that arrive before it is
        sent). Fetching goes on meanwhile: only routing waits for it. Any other batch is routed at once."""
        if self.barrier is not None and (batch.generation_id != self._barrier_generation
                                         or has_mark(batch.records)):
            self._barrier_generation = batch.generation_id
            batch.barrier = self.barrier.ends()
            self.marked_batches += 1
        await self.app.flow_control.acquire()
        if self._inbox is None:
            if self._inbox_set is None:
                self._inbox_set = asyncio.Event()
            await self._inbox_set.wait()
        await self._inbox.put(batch)

    # -- sending ---------------------------------------------------------------------------------
    def make_pipeline(self) -> Pipeline:
        app = self.app
        producer = app.producer.aiokafka_producer()
        direct = DirectSend(producer)  # Kafka's default key partitioning, without send's per-record work
        if self.settings.persist_via in ("grpc", "local"):  # the stored copies over Persist streams, or to this
            dp = self.device_persistence                 # process's own instance (router.persist)
            local = (self.settings.own_target, dp.persist) if dp is not None else None
            self.persist = PersistLink(self.settings.device_persistence_grpc_targets, self.settings.grpc_tls, local)
            persist, persisted = self.persist.send, topics.MSG_PERSISTED

            def send(topic: str, key: bytes, value: bytes, headers):
                if topic == persisted:
                    return persist(key, value)
                return direct(topic, value, key, headers)
        else:
            def send(topic: str, key: bytes, value: bytes, headers):
                return direct(topic, value, key, headers)

        async def ensure(specs):
            await ensure_topics(self.settings.bootstrap, specs, layout=self.settings.topic_layout)

        self.pipeline = Pipeline(send, ensure, self.settings.max_inflight, self.on_send_failure)
        return self.pipeline

    def on_send_failure(self, exc: BaseException) -> None:
        # Nothing after the failed event may be committed on its partition, and the event must be
        # routed again: stop hard, without acking; the next owner of the partition re-reads it.
        log.critical("a routed record was not acknowledged by Kafka (%r): exiting without commit", exc)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:
                pass
        os._exit(EXIT_SEND_FAILED)

    async def handle_batch(self, batch: RecordBatch) -> None:
        """Route a batch of tbmq.msg.all records (called by the agent, in partition order) and ack
        all of them once every record produced for them is acknowledged.

        The subscription barrier (issue 13; docs/router.md, "Routing after SUBACK"): a batch that holds a
        subscription mark, or is the first of an assignment, is routed only once the state views applied
        every record appended to tbmq.client.subscriptions and tbmq.client.session before the batch arrived
        (later batches wait behind it: the agent routes them in order). A connector sends SUBACK (UNSUBACK,
        and CONNACK over a known session) after Kafka acknowledged the change and then a round of marks on
        every partition of tbmq.msg.all; a PUBLISH sent after it is appended after the mark of its
        partition: it is routed with the change, on every router instance (tbmq_platform.marks)."""
        if batch.barrier is not None:
            await self._barrier(batch)
        app = self.app
        if batch.generation_id != app.consumer_generation_id or not app.flow_control.is_active():
            # fetched before a rebalance: not routed, not acked; Faust reads from the committed offsets
            batch.acked = True
            self.stale_batches += 1
            return
        consumer = app.consumer
        consumer.track_batch(batch)
        pipeline = self.pipeline or self.make_pipeline()
        self.batches += 1
        route = self.routing.route
        now_ms = int(time.time() * 1000)
        spans = self.spans
        inbound = app.monitor.stream_inbound_time if app.monitor is not None else {}
        now = time.monotonic()
        out: list = []
        append = out.append
        n = 0
        for tp, recs in batch.records.items():
            inbound[tp] = now  # Faust's "stream is processing this partition" check
            n += len(recs)
        for rec in in_arrival_order(batch.records):
            hdrs = rec.headers
            if spans:
                self._route_with_span(rec, route, now_ms, append)
                continue
            try:
                records = route(rec.key, rec.value, now_ms, (rec.partition, rec.offset)).records
            except DecodeError:
                self._undecodable(rec.partition, rec.offset)
                continue
            if records:
                # no span would be exported: forward the publisher's trace context as is
                h = trace_headers(hdrs) if hdrs else None
                for r in records:
                    append((r, h))
        await pipeline.submit_pairs(partial(consumer.ack_batch, batch), n, out)

    async def _barrier(self, batch: RecordBatch) -> None:
        ends = batch.barrier
        batch.barrier = None
        while True:
            try:
                await self.barrier.wait(ends, timeout=BARRIER_WARN_S)
                return
            except Exception as exc:  # Kafka unreachable, or a view that does not follow: never route without it
                self.barrier_stalls += 1
                log.warning("batch of %d records: state views not caught up after %.0fs (%r); waiting on",
                            len(batch), BARRIER_WARN_S, exc)
                ends = self.barrier.ends()  # a later request also stands for "after the batch arrived"

    def _route_with_span(self, rec, route, now_ms: int, append) -> None:
        with span_from_kafka(tracer, "router route", _header_pairs(rec.headers), kind=SpanKind.CONSUMER) as span:
            span.set_attribute("messaging.destination.name", topics.MSG_ALL)
            try:
                routed = route(rec.key, rec.value, now_ms, (rec.partition, rec.offset))
            except DecodeError:
                self._undecodable(rec.partition, rec.offset)
                return
            span.set_attribute("tbmq.records", len(routed.records))
            if routed.expired:
                span.set_attribute("tbmq.expired", True)
            if routed.records:
                h = kafka_headers()
                for r in routed.records:
                    append((r, h))

    def _undecodable(self, where, offset) -> None:
        log.warning("undecodable record at %s offset %s skipped", where, offset)
        self.routing.counters["undecodable"] += 1

    async def handle(self, event) -> None:
        """Route one tbmq.msg.all event delivered by Faust's per-event path (tests; never in a
        running router, whose consumer delivers batches)."""
        pipeline = self.pipeline or self.make_pipeline()
        headers = _header_pairs(event.headers)
        if not self.spans:
            # No span would be exported: skip the span and forward the publisher's trace context
            # as is, so every produced record still belongs to the publish's trace.
            return await self._route(event, pipeline, trace_headers(headers))
        with span_from_kafka(tracer, "router route", headers, kind=SpanKind.CONSUMER) as span:
            span.set_attribute("messaging.destination.name", topics.MSG_ALL)
            await self._route(event, pipeline, None, span)

    async def _route(self, event, pipeline: Pipeline, out_headers, span=None) -> None:
        try:
            routed = self.routing.route(event.key, event.value, None,
                                        (event.message.partition, event.message.offset))
        except DecodeError:
            self._undecodable(event.message.tp, event.message.offset)
            pipeline.acked(event, counted=False)
            return
        if span is not None:
            span.set_attribute("tbmq.records", len(routed.records))
            if routed.expired:
                span.set_attribute("tbmq.expired", True)
            out_headers = kafka_headers() if routed.records else None
        await pipeline.submit(event, routed.records, out_headers)


# ------------------------------------------------------------------------------ app
def faust_credentials(security) -> dict:
    """Faust's `broker_credentials` for the Kafka security settings (tbmq_platform.kafka.KafkaSecurity):
    {} for PLAINTEXT."""
    if security.sasl:
        return {"broker_credentials": faust.SASLCredentials(
            username=security.username, password=security.password, mechanism=security.sasl_mechanism,
            ssl_context=security.ssl_context())}
    if security.tls:
        return {"broker_credentials": faust.SSLCredentials(security.ssl_context())}
    return {}


def create_app(settings: RouterSettings, state: RoutingState | None = None,
               device_persistence: DevicePersistenceSettings | None = None) -> tuple[faust.App, RouterRuntime]:
    check_faust_internals()
    app = RouterApp(
        settings.group_id,
        broker=[f"kafka://{hp}" for hp in settings.kafka_bootstrap_servers],
        **faust_credentials(settings.kafka_security),
        datadir=settings.faust_data_dir,
        web_enabled=False,
        producer_acks=-1,
        producer_linger_ms=settings.linger_ms,
        consumer_auto_offset_reset=settings.auto_offset_reset,
        broker_commit_interval=settings.commit_interval_s,
        broker_max_poll_records=settings.max_poll_records,
        stream_wait_empty=True,
        broker_session_timeout=settings.session_timeout_s,
        consumer_group_instance_id=settings.group_instance_id,  # static membership: fast restarts
        broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 3),
        topic_disable_leader=True,
        TableManager=RouterTableManager,
        key_serializer="raw",
        value_serializer="raw",
    )
    runtime = RouterRuntime(settings, app, state, device_persistence)
    # maxsize: values waiting in the agent's stream, i.e. batches (BatchConsumer) or single events
    source = app.topic(topics.MSG_ALL, key_type=bytes, value_type=bytes,
                       key_serializer="raw", value_serializer="raw", maxsize=settings.queued_batches)

    @app.agent(source, name="router.route")
    async def route(stream):
        stream = stream.noack()  # acked by the pipeline once everything produced is acknowledged
        runtime.attach(stream.channel.queue)
        async for value in stream:
            if type(value) is RecordBatch:  # the records of one poll (BatchConsumer)
                await runtime.handle_batch(value)
            else:  # an event of Faust's per-event path (agent.test_context())
                await runtime.handle(stream.current_event)

    async def drain_before_shutdown(app=None, **kwargs):
        if runtime.pipeline is not None:
            await runtime.pipeline.drain(10.0)

    app.on_before_shutdown.connect(drain_before_shutdown)
    app.batch_topic = topics.MSG_ALL
    app.fetch_window_ms = settings.fetch_window_ms
    app.consumer_in_loop = settings.consumer_in_loop
    app.deliver_batch = runtime.deliver
    runtime.agent = route
    return app, runtime
