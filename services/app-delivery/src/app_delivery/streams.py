"""One AppDelivery.Deliver stream: the Kafka consumers of one connected APPLICATION client.

A `StreamSession` owns
* a `ClientSource`: the client's own topic tbmq.msg.app.<client> (1 partition), manually assigned,
  offsets committed in group `app-delivery.<client id>`;
* one `SharedSource` per share name of its shared subscriptions: a member of consumer group
  `app-delivery.shared.<share name>` subscribed to tbmq.msg.app.shared.<filter> of each of its filters,
  so the members of a share name split the partitions;
* the window: at most `receive_maximum` records streamed and not acknowledged, over all sources.

Records go down in offset order per partition, in batches: per polled partition, as few AppRecordBatch
messages as the free window slots and APP_DELIVERY_BATCH_MAX_BYTES allow (tracking.BatchLimit), one write
lock per batch; a stream whose AppOpen did not ask for batches gets the same records one AppRecord each.
The window is taken and the records counted outstanding with nothing awaited in between, so no more than
the window is ever unacknowledged. Acks come up as AppAck or AppAckBatch; both apply alike.

Offsets: see tracking.py (acknowledged prefix; DUP mark reserved in the commit metadata before streaming;
the origins taken, so that a router's replay is not streamed twice).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata
from opentelemetry import trace
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq_platform import topics
from tbmq_platform.coalesce import AdaptiveFetch, adaptive_fetch
from tbmq_platform.kafka import ensure_topics, make_consumer
from tbmq_platform.tracing import context_from_kafka, spans_on
from tbmq_routing import expiry
from tbmq_routing.naming import app_client_group, app_shared_group

from .settings import AppDeliverySettings
from .tracking import (NO_MARK, AckTracker, BatchLimit, PartOrigins, SharedFilters, decode_mark, decode_origins,
                       encode_mark, exact_mark, is_redelivery, needs_reservation, record_size, reservation_mark)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("app_delivery")

RefKey = tuple[str, int, int]


class StreamClosed(Exception):
    pass


class OffsetsReset(Exception):
    """Someone else (the session registry's clean start) moved the client's committed offset."""


@dataclass
class PartState:
    """What a source knows about one partition it owns."""

    tp: TopicPartition
    prev_mark: int                  # DUP mark found at assignment: offsets <= it are redeliveries
    reserved: int                   # DUP mark committed so far (>= prev_mark)
    committed: int | None           # offset last committed (by us) or found at assignment
    tracker: AckTracker = field(default_factory=AckTracker)
    origins: PartOrigins = field(default_factory=PartOrigins)  # one copy per tbmq.msg.all record
    # (offset, DUP mark, metadata) of a commit sent whose answer was not seen yet: a commit cancelled
    # (the stream closing) may still have reached Kafka, and then `committed`/`reserved` are behind it
    in_flight: tuple[int, int, str] | None = None

    def point(self) -> int | None:
        p = self.tracker.commit_point()
        return self.committed if p is None else p

    def commit_target(self, batch: tuple[int, int] | None, exact: bool, ahead: int) -> tuple[int, int] | None:
        """(offset, DUP mark) to commit, or None when neither moved: the acknowledged prefix; with `batch` =
        (first, last) offsets about to be streamed, the mark reserved `ahead` past `last`
        (tracking.reservation_mark); with `exact` (the pump no longer streams this partition), the exact mark
        written back (tracking.exact_mark)."""
        point, mark = self.tracker.commit_point(), self.reserved
        if batch is not None:
            mark = reservation_mark(mark, batch[1], ahead)
            if point is None:
                point = batch[0]
        elif exact:
            mark = exact_mark(self.prev_mark, self.tracker.last_seen)
        if point is None:
            point = self.committed
        if point is None or (self.in_flight is None and point == self.committed and mark == self.reserved):
            return None
        return point, mark

    def sending(self, point: int, mark: int, metadata: str) -> None:
        """A commit of (point, mark) is about to be sent with `metadata`."""
        self.in_flight = (point, mark, metadata)

    def sent(self) -> None:
        """Kafka acknowledged the commit in flight."""
        if self.in_flight is not None:
            self.committed, self.reserved = self.in_flight[0], self.in_flight[1]
            self.in_flight = None

    def moved_by_others(self, offset: int, metadata: str | None) -> bool:
        """Kafka holds `offset` (with `metadata`) for this partition: did someone else (the registry's clean
        start) move it past what we committed? A commit of ours that reached Kafka after its sender was
        cancelled is not someone else's: it is taken as acknowledged."""
        if self.in_flight is not None and (offset, metadata or "") == (self.in_flight[0], self.in_flight[2]):
            self.sent()
            return False
        return self.committed is None or offset > self.committed


def now_ms() -> int:
    return int(time.time() * 1000)


class Source:
    """A Kafka consumer feeding one stream. Subclasses own their partitions' PartStates."""

    kind = "source"

    def __init__(self, session: "StreamSession") -> None:
        self.session = session
        self.s: AppDeliverySettings = session.settings
        self.consumer = None
        self.parts: dict[TopicPartition, PartState] = {}
        self.topics: set[str] = set()
        self.commit_lock = asyncio.Lock()  # the pump's reservations and the periodic commits
        self.adaptive: AdaptiveFetch | None = None

    def _adapt_fetches(self) -> None:
        """With APP_DELIVERY_FETCH_WINDOW_MS set, fetches under load wait up to it so that one poll (one batch
        down) carries what arrived meanwhile; when quiet they return at the first record
        (tbmq_platform.coalesce). At 0 (the default) every fetch returns at the first record: the router
        writes a client's copies once per routed batch, so a fetch already carries a batch (docs/app-delivery.md,
        "Fetch window"). Either way an idle consumer long-polls (make_consumer's `long_poll`)."""
        if self.consumer is not None:
            self.adaptive = adaptive_fetch(self.consumer, self.s.fetch_window_ms)

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            try:
                await consumer.stop()
            except Exception:
                log.exception("%s of %s: consumer did not stop cleanly", self.kind, self.session.client_id)

    def on_ack(self, key: RefKey) -> bool:
        part = self.parts.get(TopicPartition(key[0], key[1]))
        return part is not None and part.tracker.ack(key[2])

    # -- record handling --------------------------------------------------------------------------
    def prepare(self, record, msg: pb.PublishMsg) -> bool:
        """Parse the receiver copy to stream into `msg` (empty); False when the record is skipped (counts
        as acknowledged)."""
        try:
            msg.MergeFromString(record.value or b"")
        except Exception:
            log.error("%s: unreadable record at %s/%d@%d skipped", self.session.client_id, record.topic,
                      record.partition, record.offset)
            return False
        if msg.HasField("message_expiry_interval"):
            # dropped here when expired (tbmq_routing.expiry); the interval is left as received: the connector
            # forwards what remains when it sends (subtracting the wait here too would count it twice)
            if msg.created_at_ms <= 0:
                msg.created_at_ms = record.timestamp
            if expiry.expired(msg.created_at_ms, msg.message_expiry_interval, now_ms()):
                self.session.expired += 1
                return False
        return self.filter(record, msg)

    def filter(self, record, msg: pb.PublishMsg) -> bool:
        return True

    async def pump(self) -> None:
        """Stream records in order, within the window, until cancelled."""
        while True:
            consumer = self.consumer
            if consumer is None:
                return
            batches = await consumer.getmany(timeout_ms=1000, max_records=self.s.max_poll_records)
            if self.adaptive is not None:
                self.adaptive.polled_batches(batches)
            for tp, records in batches.items():
                part = self.parts.get(tp)
                if part is None or not records:
                    continue  # revoked since the fetch
                seen = part.tracker.last_seen
                if seen is not None and records[0].offset <= seen:
                    # fetched again after a rebalance that gave the partition back
                    records = [r for r in records if r.offset > seen]
                    if not records:
                        continue
                if needs_reservation(records[-1].offset, part.reserved):
                    if not await self.reserve(part, records[0].offset, records[-1].offset):
                        continue
                await self._stream(tp, part, records)

    async def _stream(self, tp: TopicPartition, part: PartState, records: list) -> None:
        """Stream the (reserved) records of one partition in order, as few batches as the window and the
        byte bound allow. Between `acquire` returning the free slots and `send` counting the batch
        outstanding nothing is awaited, so the window is never exceeded."""
        session = self.session
        topic, partition = tp.topic, tp.partition
        max_bytes = self.s.batch_max_bytes
        tracker = part.tracker
        spans = session.spans
        i, n = 0, len(records)
        while i < n:
            room = await session.acquire()
            if self.parts.get(tp) is not part:
                return  # revoked (shared) while waiting: the new owner streams the rest
            limit = BatchLimit(room, max_bytes)
            down = spb.AppDownstream()
            out = down.batch.records
            keys: list[RefKey] = []
            traced = [] if spans else None
            mark = part.prev_mark
            while i < n:
                record = records[i]
                size = record_size(record.value, topic)
                if not limit.fits(size):
                    break
                i += 1
                offset = record.offset
                rec = out.add()
                msg = rec.msg
                if not self.prepare(record, msg):
                    del out[-1]
                    tracker.skipped(offset)
                    continue
                if msg.HasField("origin_offset") and not part.origins.first(offset, msg.origin_partition,
                                                                            msg.origin_offset):
                    del out[-1]  # a router's replay of a copy already taken
                    tracker.skipped(offset)
                    session.replayed += 1
                    continue
                limit.take(size)
                ref = rec.ref
                ref.topic, ref.partition, ref.offset = topic, partition, offset
                if is_redelivery(offset, mark):
                    rec.redelivery = True
                tracker.sent(offset)
                keys.append((topic, partition, offset))
                if traced is not None:
                    traced.append(tracer.start_span(
                        "app-delivery deliver", context=context_from_kafka(record.headers),
                        kind=trace.SpanKind.CONSUMER,
                        attributes={"client_id": session.client_id, "topic": topic, "offset": offset}))
            if not keys:
                continue
            try:
                await session.send(down, keys)
            finally:
                for span in traced or ():
                    span.end()

    async def reserve(self, part: PartState, first: int, last: int) -> bool:
        """Commit the DUP mark `last` before streaming up to it. False: the partition is no longer ours."""
        raise NotImplementedError

    async def commit(self, final: bool = False) -> None:
        raise NotImplementedError


class ClientSource(Source):
    kind = "client topic"

    def __init__(self, session: "StreamSession") -> None:
        super().__init__(session)
        self.topic = topics.app_topic_name(session.client_id)
        self.group = app_client_group(session.client_id)
        self.topics = {self.topic}
        self.tp = TopicPartition(self.topic, 0)

    async def start(self) -> None:
        s = self.s
        # The registry creates it on connect; creating it here too is idempotent and spares a race.
        await ensure_topics(s.bootstrap, [topics.app_topic(self.session.client_id)], layout=s.topic_layout)
        self.consumer = make_consumer(s.bootstrap, group_id=self.group,
                                      client_id=f"{s.instance_id}-{self.session.client_id}",
                                      auto_offset_reset="earliest", max_poll_records=s.max_poll_records,
                                      long_poll=True)
        await self.consumer.start()
        self._adapt_fetches()
        self.consumer.assign([self.tp])
        found = await self._fetch_committed()
        if found is not None:
            self.consumer.seek(self.tp, found.offset)
            mark = decode_mark(found.metadata)
            self.parts[self.tp] = PartState(self.tp, mark, mark, found.offset,
                                            origins=PartOrigins(decode_origins(found.metadata)))
        else:
            await self.consumer.seek_to_beginning(self.tp)
            self.parts[self.tp] = PartState(self.tp, NO_MARK, NO_MARK, None)
        part = self.parts[self.tp]
        log.info("%s: streaming %s from %s (DUP up to %d)", self.session.client_id, self.topic,
                 part.committed if part.committed is not None else "the beginning", part.prev_mark)

    async def _fetch_committed(self) -> OffsetAndMetadata | None:
        assert self.consumer is not None
        found = await self.consumer._coordinator.fetch_committed_offsets([self.tp])
        return found.get(self.tp)

    async def _commit(self, part: PartState, batch: tuple[int, int] | None = None, final: bool = False) -> None:
        """Commit the acknowledged prefix; `batch` = (first, last) offsets about to be streamed: the DUP mark
        is reserved up to APP_DELIVERY_MAX_POLL_RECORDS past `last` (tracking.reservation_mark); `final`
        (the pump has stopped): the exact mark is written back (tracking.exact_mark). Computed under the lock
        so that a mark never goes backwards while the pump runs."""
        async with self.commit_lock:
            target = part.commit_target(batch, final, self.s.max_poll_records)
            if target is None:
                return
            point, mark = target
            current = await self._fetch_committed()
            if current is not None and part.moved_by_others(current.offset, current.metadata):
                raise OffsetsReset(f"committed offset of {self.group} moved to {current.offset} by someone "
                                   f"else (ours {part.committed}); not committing {point}")
            metadata = encode_mark(mark, part.origins.at(point))
            part.sending(point, mark, metadata)
            await self.consumer.commit({part.tp: OffsetAndMetadata(point, metadata)})
            part.sent()

    async def reserve(self, part: PartState, first: int, last: int) -> bool:
        await self._commit(part, (first, last))
        return True

    async def commit(self, final: bool = False) -> None:
        part = self.parts.get(self.tp)
        if part is not None and self.consumer is not None:
            await self._commit(part, final=final)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, source: "SharedSource") -> None:
        self.source = source

    async def on_partitions_revoked(self, revoked) -> None:
        await self.source.revoked(list(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        await self.source.assigned(list(assigned))


class SharedSource(Source):
    kind = "shared subscription"

    def __init__(self, session: "StreamSession", share_name: str,
                 filters: list[tuple[str, int | None]]) -> None:
        super().__init__(session)
        self.share_name = share_name
        self.group = app_shared_group(share_name)
        by_topic: dict[str, list[tuple[str, int | None]]] = {}
        for topic_filter, qos in filters:
            by_topic.setdefault(topics.shared_app_topic_name(topic_filter), []).append((topic_filter, qos))
        self.filters = {t: SharedFilters(session.client_id, fs) for t, fs in by_topic.items()}
        self.topics = set(self.filters)
        self._limbo: dict[TopicPartition, PartState] = {}
        self.assignments = 0

    async def start(self) -> None:
        s = self.s
        specs = {}
        for fs in self.filters.values():
            for f in fs.filters:
                spec = topics.shared_app_topic(f)
                specs[spec.name] = spec
        await ensure_topics(s.bootstrap, specs.values(), layout=s.topic_layout)
        self.consumer = make_consumer(
            s.bootstrap, group_id=self.group, client_id=f"{s.instance_id}-{self.session.client_id}",
            auto_offset_reset="earliest", max_poll_records=s.max_poll_records, long_poll=True,
            session_timeout_ms=s.shared_session_timeout_ms, heartbeat_interval_ms=s.shared_heartbeat_ms)
        await self.consumer.start()
        self._adapt_fetches()
        self.consumer.subscribe(topics=sorted(self.topics), listener=_Listener(self))
        log.info("%s: joined %s on %s", self.session.client_id, self.group, ", ".join(sorted(self.topics)))

    def filter(self, record, msg: pb.PublishMsg) -> bool:
        qos = self.filters[record.topic].delivery_qos(msg.topic, msg.qos)
        if qos is None:
            return False  # another filter's copy on a colliding Kafka topic name
        msg.qos = qos
        return True

    # -- rebalance --------------------------------------------------------------------------------
    async def revoked(self, tps: list[TopicPartition]) -> None:
        """Stop streaming them and commit their acknowledged prefixes (eager protocol: every rebalance
        revokes everything; what comes back unchanged is resumed from `_limbo` without redelivery)."""
        gone = [self.parts.pop(tp) for tp in tps if tp in self.parts]
        if not gone:
            return
        try:
            # exact marks: the pump streams nothing more of a partition once it is out of `parts`
            await self._commit_parts(gone, exact=True)
        except (CommitFailedError, KafkaError) as exc:
            log.warning("%s: commit on revocation of %s failed (%r): their unacknowledged records will be "
                        "redelivered", self.session.client_id, [str(p.tp) for p in gone], exc)
            return
        for part in gone:
            self._limbo[part.tp] = part

    async def assigned(self, tps: list[TopicPartition]) -> None:
        self.assignments += 1
        consumer = self.consumer
        limbo, self._limbo = self._limbo, {}
        if consumer is None or not tps:
            return
        found = await consumer._coordinator.fetch_committed_offsets(tps)
        for tp in tps:
            c = found.get(tp)
            mark = decode_mark(c.metadata) if c is not None else NO_MARK
            old = limbo.get(tp)
            if old is not None and c is not None and c.offset == old.committed and old.tracker.last_seen is not None:
                # nobody moved it since we let it go: keep streaming after what we already sent
                if mark > old.reserved:  # another member streamed it meanwhile
                    old.prev_mark = old.reserved = mark
                old.origins.merge(decode_origins(c.metadata))
                self.parts[tp] = old
                consumer.seek(tp, old.tracker.last_seen + 1)
                continue
            if c is not None:
                consumer.seek(tp, c.offset)
                self.parts[tp] = PartState(tp, mark, mark, c.offset, origins=PartOrigins(decode_origins(c.metadata)))
            else:
                self.parts[tp] = PartState(tp, NO_MARK, NO_MARK, None)
        log.info("%s: %s assigned %s", self.session.client_id, self.group,
                 ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(tps)))

    # -- commits ----------------------------------------------------------------------------------
    async def _commit_parts(self, parts: list[PartState],
                            reserve: dict[TopicPartition, tuple[int, int]] | None = None,
                            exact: bool = False) -> None:
        """Commit the acknowledged prefixes of `parts`; `reserve`: tp -> (first, last) offsets of a batch
        about to be streamed, whose DUP mark is reserved ahead (tracking.reservation_mark); `exact`: parts
        the pump no longer streams (revoked, or the stream ended) get their exact mark back
        (tracking.exact_mark). Computed under the lock so that a mark never goes backwards while streamed."""
        reserve = reserve or {}
        async with self.commit_lock:
            offsets = {}
            for part in parts:
                target = part.commit_target(reserve.get(part.tp), exact, self.s.max_poll_records)
                if target is not None:
                    offsets[part.tp] = (part, *target)
            if not offsets or self.consumer is None:
                return
            metadata = {tp: encode_mark(mark, part.origins.at(point)) for tp, (part, point, mark) in offsets.items()}
            for tp, (part, point, mark) in offsets.items():
                part.sending(point, mark, metadata[tp])
            await self.consumer.commit({tp: OffsetAndMetadata(point, metadata[tp])
                                        for tp, (part, point, mark) in offsets.items()})
            for part, _point, _mark in offsets.values():
                part.sent()

    async def reserve(self, part: PartState, first: int, last: int) -> bool:
        try:
            await self._commit_parts([part], {part.tp: (first, last)})
            return self.parts.get(part.tp) is part
        except (CommitFailedError, KafkaError, IllegalStateError) as exc:
            log.info("%s: reservation on %s/%d failed (%r); partition being rebalanced",
                     self.session.client_id, part.tp.topic, part.tp.partition, exc)
            if self.parts.get(part.tp) is part and self.consumer is not None:
                try:
                    self.consumer.seek(part.tp, first)  # read the batch again if we keep it
                except IllegalStateError:
                    pass
            return False

    async def commit(self, final: bool = False) -> None:
        try:
            await self._commit_parts(list(self.parts.values()), exact=final)
        except (CommitFailedError, KafkaError) as exc:
            log.info("%s: commit of %s failed (%r); a rebalance will retry it", self.session.client_id,
                     self.group, exc)


class StreamSession:
    """One Deliver stream. `run()` returns when the stream is over (closed by either side)."""

    def __init__(self, settings: AppDeliverySettings, opening: spb.AppOpen, context,
                 on_closed: Callable[["StreamSession"], None] | None = None) -> None:
        self.settings = settings
        self.opening = opening
        self.client_id = opening.client_id
        self.session_id = opening.session_id
        self.context = context
        rm = opening.receive_maximum or settings.max_outstanding
        self.window = max(1, min(rm, settings.max_outstanding))
        self.batches = opening.batches   # the connector takes AppRecordBatch
        # a span per record costs more than streaming it: only when spans are exported or asked for
        self.spans = spans_on(settings)
        self.outstanding: dict[RefKey, int] = {}
        self._window_open = asyncio.Event()
        self._window_open.set()
        self._write_lock = asyncio.Lock()
        self.sources: list[Source] = [ClientSource(self)]
        by_share: dict[str, list[tuple[str, int | None]]] = {}
        for sub in opening.shared:
            by_share.setdefault(sub.share_name, []).append(
                (sub.topic_filter, sub.qos if sub.HasField("qos") else None))
        for share_name, filters in by_share.items():
            self.sources.append(SharedSource(self, share_name, filters))
        self._by_topic: dict[str, list[Source]] = {}
        for src in self.sources:
            for t in src.topics:
                self._by_topic.setdefault(t, []).append(src)
        self._tasks: list[asyncio.Task] = []
        self._closed = asyncio.Event()
        self._close_task: asyncio.Task | None = None
        self.close_reason = ""
        self.on_closed = on_closed
        self.sent = 0
        self.acked = 0
        self.expired = 0
        self.replayed = 0  # copies a router's replay wrote again, not streamed (tbmq_routing.origins)

    # -- window and writes --------------------------------------------------------------------------
    async def acquire(self) -> int:
        """Wait for a free window slot; the number of free slots (valid until the next await)."""
        while len(self.outstanding) >= self.window:
            self._window_open.clear()
            await self._window_open.wait()
        if self._closed.is_set():
            raise StreamClosed()
        return self.window - len(self.outstanding)

    async def send(self, down: spb.AppDownstream, keys: list[RefKey]) -> None:
        """Stream the records of `down.batch` (keys: their refs, taken within what `acquire` returned):
        counted outstanding at once, then written under the lock as one message (batch stream) or one
        message per record (a connector that did not ask for batches)."""
        outstanding = self.outstanding
        for key in keys:
            outstanding[key] = outstanding.get(key, 0) + 1
        async with self._write_lock:
            if self.batches:
                await self.context.write(down)
            else:
                for rec in down.batch.records:
                    await self.context.write(spb.AppDownstream(record=rec))
        self.sent += len(keys)

    def on_ack(self, ref: spb.AppRecordRef) -> None:
        self.on_acks((ref,))

    def on_acks(self, refs) -> None:
        """Acknowledgements (AppAck or AppAckBatch: they apply alike); unknown or repeated refs are ignored."""
        outstanding, by_topic = self.outstanding, self._by_topic
        freed = False
        for ref in refs:
            topic = ref.topic
            key = (topic, ref.partition, ref.offset)
            for src in by_topic.get(topic, ()):
                src.on_ack(key)  # every source holding it (two share names on one filter share a ref)
            if outstanding.pop(key, None) is not None:
                freed = True
        self.acked += len(refs)
        if freed and len(outstanding) < self.window:
            self._window_open.set()

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        for src in self.sources:
            await src.start()

    async def run(self) -> None:
        self._tasks = [asyncio.create_task(self._reader(), name=f"acks {self.client_id}"),
                       asyncio.create_task(self._committer(), name=f"commits {self.client_id}")]
        for src in self.sources:
            self._tasks.append(asyncio.create_task(self._guard(src.pump(), f"{src.kind}"),
                                                   name=f"pump {self.client_id} {src.kind}"))
        await self._closed.wait()

    async def _guard(self, coro, what: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except StreamClosed:
            pass
        except OffsetsReset as exc:
            log.info("%s: %s", self.client_id, exc)
            self.request_close("offsets reset (clean start)")
        except Exception as exc:
            if not self._closed.is_set():
                log.warning("%s: %s failed: %r", self.client_id, what, exc,
                            exc_info=not isinstance(exc, (grpc.RpcError, KafkaError, asyncio.InvalidStateError)))
            self.request_close(f"{what} failed")

    async def _reader(self) -> None:
        try:
            while True:
                up = await self.context.read()
                if up is grpc.aio.EOF:
                    self.request_close("stream ended by the connector")
                    return
                kind = up.WhichOneof("kind")
                if kind == "acks":
                    self.on_acks(up.acks.refs)
                elif kind == "ack":
                    self.on_ack(up.ack.ref)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.request_close(f"stream broken ({type(exc).__name__})")

    async def _committer(self) -> None:
        interval = self.settings.commit_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            await self._guard(self._commit_all(), "commit")

    async def _commit_all(self, final: bool = False) -> None:
        for src in self.sources:
            await src.commit(final)

    def request_close(self, reason: str) -> asyncio.Task:
        if self._close_task is None:
            self.close_reason = reason
            self._close_task = asyncio.get_running_loop().create_task(self._close(), name=f"close {self.client_id}")
        return self._close_task

    async def close(self, reason: str) -> None:
        await asyncio.shield(self.request_close(reason))

    async def _close(self) -> None:
        self._closed.set()
        self._window_open.set()
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._commit_all(final=True)
        except OffsetsReset as exc:
            log.info("%s: %s", self.client_id, exc)
        except Exception:
            log.exception("%s: final commit failed; unacknowledged records will be redelivered", self.client_id)
        for src in self.sources:
            await src.stop()
        log.info("%s: stream closed (%s): %d sent, %d acked, %d outstanding, %d expired dropped, %d replayed "
                 "copies skipped", self.client_id, self.close_reason, self.sent, self.acked, len(self.outstanding),
                 self.expired, self.replayed)
        if self.on_closed is not None:
            self.on_closed(self)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()
