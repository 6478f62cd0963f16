"""Forward streams: the stored messages of attached clients, pushed to their connector over gRPC.

Every connector keeps one `DevicePersistence.Forward` stream open to every device-persistence instance,
registered here by the connector's service id (the service id of the attachments in Redis). After a
batch is saved, the consumer loop hands each service id's stored messages to that service's stream as
ONE `ForwardDown.batch` and goes on at once: nothing on the hot path waits for a connector.

Guarantee: forwards are an optimisation, never the only copy. A message is forwarded only after it is
saved in Redis, and stays there until the connector's acknowledgement removes it. So a forward that is
not delivered — no stream for that service id (counted: `forward_no_stream`), a stream ended because
its queue would exceed `max_bytes` (`forward_overflows`), replaced by a newer stream of the same service
id, or cut by a crash — costs latency, never a message: the connector re-fetches (FetchUndelivered)
every attached client when a stream opens and when one ends, and a client gets the rest on its next
connect in any case.

A stream's queue is bounded in BYTES (the serialized size of what waits); an item that would overflow
it ends the stream instead of growing memory or slowing the consumer loop. One item larger than the
bound is accepted when the queue is empty, so a single large batch never wedges a stream.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter, deque
from collections.abc import Iterable

from tbmq.v1 import services_pb2 as spb

__all__ = ["ByteQueue", "EndReason", "ForwardRegistry", "ForwardStream"]


class EndReason(enum.Enum):
    """Why the device-persistence side ended a forward stream."""

    REPLACED = "replaced"        # a newer stream of the same service id was registered
    OVERFLOW = "overflow"        # the queue would have exceeded its byte bound: the connector is behind
    CLIENT_GONE = "client_gone"  # the connector closed its side, or the call failed
    SHUTDOWN = "shutdown"        # this instance is stopping
    FLUSH_TIMEOUT = "flush_timeout"  # the queue did not drain before a rebalance


class ByteQueue:
    """A FIFO for one consumer, bounded by the total size (bytes) of what waits. Pure asyncio, no I/O.

    `put` never waits: it returns False (and adds nothing) when the item would take the queue above
    `max_bytes`; an item is always accepted into an empty queue. `force=True` skips the bound (small
    control replies). `get` waits for an item; after `close()` it returns what is left, then None.
    """

    __slots__ = ("max_bytes", "_items", "_bytes", "_waiter", "_closed", "_drained")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self._items: deque = deque()
        self._bytes = 0
        self._waiter: asyncio.Future | None = None
        self._closed = False
        self._drained: list[asyncio.Future] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item, size: int, *, force: bool = False) -> bool:
        if self._closed:
            return False
        if not force and self._items and self._bytes + size > self.max_bytes:
            return False
        self._items.append((item, size))
        self._bytes += size
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        return True

    async def get(self):
        """The oldest item; None once closed and empty."""
        while not self._items:
            self._wake_drained()
            if self._closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, size = self._items.popleft()
        self._bytes -= size
        return item

    async def drained(self) -> None:
        """Wait until the consumer has taken everything and come back for more (so it finished handling
        the last item), or the queue is closed."""
        if not self._items and not self._closed and self._waiter is not None:
            return  # the consumer is already waiting in get(): everything was handled
        if self._closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._drained.append(fut)
        await fut

    def _wake_drained(self) -> None:
        waiting, self._drained = self._drained, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        self._closed = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._wake_drained()

    def clear(self) -> int:
        """Drop what waits; returns how many items were dropped."""
        n = len(self._items)
        self._items.clear()
        self._bytes = 0
        self._wake_drained()
        return n


class ForwardStream:
    """The device-persistence side of one connector's Forward stream: its byte-bounded outbound queue
    (ready, forward batches, ack replies, settle requests), the settle requests waiting for their answer,
    and why it ended."""

    __slots__ = ("service_id", "queue", "reason", "_settles", "_settle_seq")

    def __init__(self, service_id: str, max_bytes: int) -> None:
        self.service_id = service_id
        self.queue = ByteQueue(max_bytes)
        self.reason: EndReason | None = None
        self._settles: dict[int, asyncio.Future] = {}
        self._settle_seq = 0

    async def settle(self, timeout: float) -> bool:
        """Asks the connector to send the acknowledgements it holds now (ForwardDown.settle) and waits at
        most `timeout` for its answer: True once they are applied, False when it did not answer in time or
        the stream ended (an older connector ignores the request: the wait is its cost)."""
        if self.ended:
            return False
        self._settle_seq += 1
        seq = self._settle_seq
        fut = asyncio.get_running_loop().create_future()
        self._settles[seq] = fut
        self.reply(spb.ForwardDown(settle=spb.ForwardSettle(seq=seq)))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            self._settles.pop(seq, None)

    def settled(self, seq: int) -> None:
        """The connector's answer to settle request `seq` (every ack it held then is applied)."""
        fut = self._settles.get(seq)
        if fut is not None and not fut.done():
            fut.set_result(True)

    @property
    def ended(self) -> bool:
        return self.reason is not None

    def end(self, reason: EndReason) -> None:
        """Ends the stream: what waits is dropped (those messages are in Redis), the writer stops."""
        if self.reason is None:
            self.reason = reason
        self.queue.clear()
        self.queue.close()
        for fut in self._settles.values():
            if not fut.done():
                fut.set_result(False)

    def reply(self, down: spb.ForwardDown) -> None:
        """A small control message (ready, ack reply): never refused for size."""
        self.queue.put(down, down.ByteSize(), force=True)


class ForwardRegistry:
    """The open forward streams of this instance, by connector service id (one each: the newest wins)."""

    def __init__(self, max_bytes: int, instance_id: str = "") -> None:
        self.max_bytes = max_bytes
        self.instance_id = instance_id
        self._streams: dict[str, ForwardStream] = {}
        self._closed = False
        self.stats: Counter = Counter()

    def __len__(self) -> int:
        return len(self._streams)

    def get(self, service_id: str) -> ForwardStream | None:
        return self._streams.get(service_id)

    def register(self, service_id: str) -> ForwardStream | None:
        """A new stream for `service_id`, with `ready` queued first; an older one of that service id is
        ended (REPLACED). None once the registry is closed (shutting down)."""
        if self._closed:
            return None
        old = self._streams.get(service_id)
        if old is not None:
            old.end(EndReason.REPLACED)
            self.stats["forward_streams_replaced"] += 1
        stream = ForwardStream(service_id, self.max_bytes)
        stream.reply(spb.ForwardDown(ready=spb.ForwardReady(instance_id=self.instance_id)))
        self._streams[service_id] = stream
        self.stats["forward_streams_opened"] += 1
        return stream

    def unregister(self, stream: ForwardStream, reason: EndReason) -> None:
        stream.end(reason)
        if self._streams.get(stream.service_id) is stream:
            del self._streams[stream.service_id]

    def forward(self, by_service: dict[str, spb.ForwardBatch]) -> None:
        """Queue each service's batch (group_by_service) on its stream; never waits."""
        stats = self.stats
        for service_id, batch in by_service.items():
            n = len(batch.messages)
            stats["forward_paused"] += len(batch.paused)
            stream = self._streams.get(service_id)
            if stream is None:
                stats["forward_no_stream"] += n  # stays in Redis: fetched on (re)connect
                continue
            down = spb.ForwardDown(batch=batch)
            if stream.queue.put(down, down.ByteSize()):
                stats["forwarded"] += n
                stats["forward_batches"] += 1
            else:
                stats["forward_overflows"] += 1
                stats["forward_dropped"] += n
                self.unregister(stream, EndReason.OVERFLOW)

    async def flush(self, timeout: float) -> None:
        """Wait until every stream has handed what it had queued to gRPC; a stream that does not within
        `timeout` is ended (FLUSH_TIMEOUT). Before partitions move to another instance, so that this
        instance's forwards are out before the next owner's."""
        streams = list(self._streams.values())
        if not streams:
            return
        tasks = {asyncio.ensure_future(s.queue.drained()): s for s in streams}
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
            self.stats["forward_flush_timeouts"] += 1
            self.unregister(tasks[task], EndReason.FLUSH_TIMEOUT)

    def close(self) -> None:
        """Shutting down: end every stream, refuse new ones."""
        self._closed = True
        for stream in list(self._streams.values()):
            self.unregister(stream, EndReason.SHUTDOWN)

    def queued_bytes(self) -> int:
        return sum(s.queue.bytes for s in self._streams.values())


def group_by_service(results: Iterable) -> dict[str, spb.ForwardBatch]:
    """SaveResults (save_many_attached) -> service id of the connection each client is live on -> one
    ForwardBatch: the messages handed out to it (SaveResult.forwards) in save order, and the clients whose
    forwards stopped at the handed-out limit (`paused`: their connection pages again)."""
    out: dict[str, spb.ForwardBatch] = {}
    for res in results:
        forwards = res.forwards
        if not forwards and not res.paused:
            continue
        batch = out.get(res.attached.service_id)
        if batch is None:
            batch = out[res.attached.service_id] = spb.ForwardBatch()
        batch.messages.extend(forwards)
        if res.paused:
            batch.paused.append(res.messages[0].client_id)
    return out
