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


class PersistStream:
    """The Persist stream to ONE device-persistence target (see the module docstring)."""

    def __init__(self, target: str, tls: GrpcTls = PLAINTEXT) -> None:
        self.target = target
        self._channel = tls.channel(target, options=CHANNEL_OPTIONS)
        self._stub = sgrpc.DevicePersistenceStub(self._channel)
        self._records: list[bytes] | None = None  # this loop iteration's batch
        self._future: asyncio.Future | None = None
        self._seq = 0
        self._unanswered: dict[int, tuple[list[bytes], asyncio.Future]] = {}  # in seq order
        self._outbox: asyncio.Queue = asyncio.Queue()  # seqs to write on the open stream
        self._task: asyncio.Task | None = None
        self.stats = {"batches": 0, "records": 0, "answered": 0, "opened": 0, "sent_again": 0}

    @property
    def unanswered(self) -> int:
        return len(self._unanswered)

    def add(self, value: bytes) -> asyncio.Future:
        if self._records is None:
            loop = asyncio.get_running_loop()
            self._records, self._future = [], loop.create_future()
            loop.call_soon(self._flush)
            if self._task is None:
                self._task = loop.create_task(self._run(), name=f"persist {self.target}")
        self._records.append(value)
        return self._future

    def _flush(self) -> None:
        records, fut = self._records, self._future
        self._records = self._future = None
        self._seq += 1
        self._unanswered[self._seq] = (records, fut)
        self._outbox.put_nowait(self._seq)
        self.stats["batches"] += 1
        self.stats["records"] += len(records)

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


class PersistLink:
    """Every device-persistence target; `send(key, value)` (key = the client id's UTF-8, value = a serialized
    PersistedMsg) -> an awaitable of the copy's future, done once it is saved."""

    def __init__(self, targets: tuple[str, ...], tls: GrpcTls = PLAINTEXT) -> None:
        if not targets:
            raise ValueError("no device-persistence target")
        self.streams = [PersistStream(t, tls) for t in targets]

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
