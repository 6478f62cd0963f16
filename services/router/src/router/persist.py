"""The router's stored copies for persistent DEVICE clients, sent to device-persistence over
`DevicePersistence.Persist` streams (ROUTER_PERSIST_VIA=grpc, the default) instead of through
tbmq.msg.persisted: one Kafka produce, one fetch and a commit fewer per batch (docs/performance.md, "The
thirteenth round").

One long-lived stream per device-persistence target; a client's copies always go to the same target
(`tbmq_platform.peers.pick_target` of the client id), so they are saved in routing order. The copies routed
in one event-loop iteration leave as ONE PersistBatch per target; each record's future resolves when
device-persistence answers the batch, i.e. once it is saved in Redis. The router's Pipeline acks a
tbmq.msg.all record only when every copy of it is acknowledged, so an offset is committed only after the
save (the guarantee tbmq.msg.persisted's produce acknowledgement gave before).

A router that runs device-persistence itself (ROUTER_PERSIST_VIA=local) hands its own instance's copies to it
directly (LocalPersist): same batches, same futures, one process and one gRPC exchange fewer per batch.

Guarantee: a batch is answered, or sent again. A stream that fails or ends is reopened with back-off
(`tbmq_platform.backoff`) and every unanswered batch is sent again first, in its order: device-persistence
stores a copy it saved before once (its origin check, save_messages.lua), and forwards a batch found saved
before again, so nothing is stranded. Futures never fail: while device-persistence is away, unanswered
batches hold the router's commits and, at ROUTER_MAX_INFLIGHT, its routing (where tbmq.msg.persisted used to
buffer them); a router that crashes meanwhile routes again from its last commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_platform.backoff import PEER_CHANNEL_OPTIONS, Backoff, end_attempt, retry_after
from tbmq_platform.grpc_tls import PLAINTEXT, GrpcTls
from tbmq_platform.peers import pick_target

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (("grpc.max_send_message_length", 64 * 1024 * 1024), *PEER_CHANNEL_OPTIONS)


class _Done:
    """An awaitable that is already done: the Pipeline awaits `send`, and a copy needs no await to queue."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # pragma: no cover - makes __await__ a generator


class _Target:
    """One device-persistence target: the copies added in one event-loop iteration become ONE batch with one
    future, handed to `_batch(records, future)` once the iteration's callbacks have run."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._records: list[bytes] | None = None  # this loop iteration's batch
        self._future: asyncio.Future | None = None
        self.stats = {"batches": 0, "records": 0, "answered": 0, "opened": 0, "sent_again": 0}

    def add(self, value: bytes) -> asyncio.Future:
        if self._records is None:
            loop = asyncio.get_running_loop()
            self._records, self._future = [], loop.create_future()
            loop.call_soon(self._flush)
        self._records.append(value)
        return self._future

    def _flush(self) -> None:
        records, fut = self._records, self._future
        self._records = self._future = None
        self.stats["batches"] += 1
        self.stats["records"] += len(records)
        self._batch(records, fut)

    def _batch(self, records: list[bytes], fut: asyncio.Future) -> None:
        raise NotImplementedError


class PersistStream(_Target):
    """The Persist stream to ONE device-persistence target (see the module docstring)."""

    def __init__(self, target: str, tls: GrpcTls = PLAINTEXT) -> None:
        super().__init__(target)
        self._channel = tls.channel(target, options=CHANNEL_OPTIONS)
        self._stub = sgrpc.DevicePersistenceStub(self._channel)
        self._seq = 0
        self._unanswered: dict[int, tuple[list[bytes], asyncio.Future]] = {}  # in seq order
        self._outbox: asyncio.Queue = asyncio.Queue()  # seqs to write on the open stream
        self._task: asyncio.Task | None = None

    @property
    def unanswered(self) -> int:
        return len(self._unanswered)

    def _batch(self, records: list[bytes], fut: asyncio.Future) -> None:
        self._seq += 1
        self._unanswered[self._seq] = (records, fut)
        self._outbox.put_nowait(self._seq)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"persist {self.target}")

    async def _run(self) -> None:
        backoff = Backoff()
        loop = asyncio.get_running_loop()
        while True:
            call = self._stub.Persist()
            # everything unanswered goes first, in order; what waited in the outbox is among it
            while not self._outbox.empty():
                self._outbox.get_nowait()
            again = list(self._unanswered)
            if self.stats["opened"]:
                self.stats["sent_again"] += len(again)
            self.stats["opened"] += 1
            writer = loop.create_task(self._write(call, again), name=f"persist {self.target} writer")
            try:
                while True:
                    answer = await call.read()
                    if answer is grpc.aio.EOF:
                        break
                    backoff.reset()
                    item = self._unanswered.pop(answer.seq, None)
                    if item is not None and not item[1].done():
                        self.stats["answered"] += 1
                        item[1].set_result(None)
                log.warning("Persist stream to %s ended by the server; reopening (%d batches unanswered)",
                            self.target, len(self._unanswered))
            except grpc.aio.AioRpcError as exc:
                log.warning("Persist stream to %s failed: %s; reopening (%d batches unanswered)", self.target,
                            exc.code().name, len(self._unanswered))
            finally:
                await end_attempt(call, writer)
            await retry_after(backoff.next())

    async def _write(self, call, again: list[int]) -> None:
        try:
            for seq in again:
                await self._write_one(call, seq)
            while True:
                await self._write_one(call, await self._outbox.get())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call is over: the read side reopens it

    async def _write_one(self, call, seq: int) -> None:
        item = self._unanswered.get(seq)
        if item is not None:
            await call.write(spb.PersistBatch(seq=seq, records=item[0]))

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._channel.close()


class LocalPersist(_Target):
    """The target this process is itself (ROUTER_PERSIST_VIA=local: the router runs a device-persistence
    instance, tbmq_device_persistence): the copies of one event-loop iteration go to its `persist` as ONE batch,
    as a PersistStream's would, with no stream, no serialization of the batch and no answer to read. Its
    futures resolve when `persist` returns, i.e. once the batch is saved in Redis (and its forwards queued).

    Order: each batch's `persist` is called in flush order, and device-persistence saves them one at a time
    under its batch lock, which it takes in call order. Futures never fail: `persist` retries while Redis is
    down and raises only when device-persistence stops meanwhile, i.e. when this process stops; the batch then
    stays unanswered, its offsets uncommitted, and the next owner of its tbmq.msg.all partitions routes it
    again (the origin check stores it once)."""

    def __init__(self, target: str, persist: Callable[[list[bytes]], Awaitable[int]]) -> None:
        super().__init__(target)
        self._persist = persist
        self._saving: set[asyncio.Task] = set()

    @property
    def unanswered(self) -> int:
        return len(self._saving)

    def _batch(self, records: list[bytes], fut: asyncio.Future) -> None:
        task = asyncio.get_running_loop().create_task(self._save(records, fut), name="persist local")
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)

    async def _save(self, records: list[bytes], fut: asyncio.Future) -> None:
        try:
            await self._persist(records)
        except RuntimeError as exc:  # device-persistence stopping while Redis is unavailable
            log.warning("a batch of %d stored copies was not saved (%s): left uncommitted", len(records), exc)
            return
        self.stats["answered"] += 1
        if not fut.done():
            fut.set_result(None)

    async def close(self) -> None:
        tasks = list(self._saving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PersistLink:
    """Every device-persistence target; `send(key, value)` (key = the client id's UTF-8, value = a serialized
    PersistedMsg) -> an awaitable of the copy's future, done once it is saved. `local` = (this process's own
    target, its device-persistence's `persist`): that target's copies go to it directly (LocalPersist)."""

    def __init__(self, targets: tuple[str, ...], tls: GrpcTls = PLAINTEXT,
                 local: tuple[str, Callable[[list[bytes]], Awaitable[int]]] | None = None) -> None:
        if not targets:
            raise ValueError("no device-persistence target")
        if local is not None and local[0] not in targets:
            raise ValueError(f"the local target {local[0]!r} is not one of {targets}")
        self.streams: list[_Target] = [
            LocalPersist(t, local[1]) if local is not None and t == local[0] else PersistStream(t, tls)
            for t in targets]

    def send(self, key: bytes, value: bytes) -> _Done:
        return _Done(pick_target(self.streams, key).add(value))

    def stats(self) -> dict:
        out = {"persist_unanswered": sum(s.unanswered for s in self.streams)}
        for k in ("batches", "records", "answered", "opened", "sent_again"):
            out[f"persist_{k}"] = sum(s.stats[k] for s in self.streams)
        return out

    async def close(self) -> None:
        for s in self.streams:
            await s.close()
