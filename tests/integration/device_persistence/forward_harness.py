"""A fake connector's end of `DevicePersistence.Forward` (what connector.grpc_clients.ForwardLink does), for the
tests that talk to a real device-persistence service (their bounded wait: tests/waits.py)."""

from __future__ import annotations

import asyncio
import itertools

import grpc
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from waits import wait_until

BOUND = 30.0


class ForwardClient:
    """One Forward stream: `open` with `service_id`, waits for `ready`; keeps every forwarded message
    (`messages`, in arrival order; `batches` = how many ForwardBatch; `paused` = the client ids the batches
    named as paused, in order), answers acknowledgement batches by
    seq. `read=False` never reads what comes down (a connector that does not keep up). A settle request
    (another connection of a client attached here is fetching) runs `on_settle()` when given (what the
    connector sends of the acks it holds) and answers `settled`; `settles` counts them. After the stream
    ended, `code` is its status (None = ended cleanly)."""

    def __init__(self, stub, service_id: str, *, read: bool = True, on_settle=None) -> None:
        self.stub = stub
        self.service_id = service_id
        self.read = read
        self.on_settle = on_settle
        self.settles = 0
        self._settling: set[asyncio.Task] = set()
        self._writing = asyncio.Lock()  # one write at a time: the test's acknowledge and a settle's answer
        self.call = None
        self.messages: list[pb.DevicePublishMsg] = []
        self.batches = 0
        self.paused: list[str] = []
        self.ready: spb.ForwardReady | None = None
        self.ended = asyncio.Event()
        self.code: grpc.StatusCode | None = None
        self._acked: dict[int, asyncio.Future] = {}
        self._seq = itertools.count(1)
        self._task: asyncio.Task | None = None
        self.queue: asyncio.Queue = asyncio.Queue()  # every forwarded message, for consumers that wait

    async def __aenter__(self) -> ForwardClient:
        self.call = self.stub.Forward()
        await self.call.write(spb.ForwardUp(open=spb.ForwardOpen(service_id=self.service_id)))
        first = await asyncio.wait_for(self.call.read(), BOUND)
        assert first.WhichOneof("kind") == "ready", first
        self.ready = first.ready
        if self.read:
            self._task = asyncio.create_task(self._reader())
        return self

    async def __aexit__(self, *exc) -> None:
        self.call.cancel()
        for task in self._settling:
            task.cancel()
        await asyncio.gather(*self._settling, *([self._task] if self._task else []), return_exceptions=True)

    async def _reader(self) -> None:
        try:
            while True:
                down = await self.call.read()
                if down is grpc.aio.EOF:
                    break
                kind = down.WhichOneof("kind")
                if kind == "batch":
                    self.batches += 1
                    for dm in down.batch.messages:
                        self.messages.append(dm)
                        self.queue.put_nowait(dm)
                    self.paused.extend(down.batch.paused)
                elif kind == "acked":
                    fut = self._acked.pop(down.acked.seq, None)
                    if fut is not None and not fut.done():
                        fut.set_result(down.acked)
                elif kind == "settle":
                    self.settles += 1
                    task = asyncio.create_task(self._settle(down.settle.seq))  # its acks are answered here
                    self._settling.add(task)
                    task.add_done_callback(self._settling.discard)
        except grpc.aio.AioRpcError as exc:
            self.code = exc.code()
        finally:
            self.ended.set()

    async def _settle(self, seq: int) -> None:
        if self.on_settle is not None:
            await self.on_settle(self)
        async with self._writing:
            await self.call.write(spb.ForwardUp(settled=spb.ForwardSettle(seq=seq)))

    async def wait_ended(self, timeout: float = BOUND) -> grpc.StatusCode | None:
        if self._task is None:  # not reading: the status comes with the next read
            try:
                while await asyncio.wait_for(self.call.read(), timeout) is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as exc:
                self.code = exc.code()
            self.ended.set()
        await asyncio.wait_for(self.ended.wait(), timeout)
        return self.code

    async def acknowledge(self, acks=(), pubrecs=()) -> spb.ForwardAcked:
        """Sends (client id, packet id[, serial]) acknowledgements / PUBRECs up; waits for their answer."""
        PR = spb.PacketRequest
        seq = next(self._seq)
        fut = asyncio.get_running_loop().create_future()
        self._acked[seq] = fut
        async with self._writing:
            await self.call.write(spb.ForwardUp(acks=spb.ForwardAcks(seq=seq, batch=spb.PacketBatchRequest(
                acks=[PR(client_id=a[0], packet_id=a[1], serial=a[2] if len(a) > 2 else 0) for a in acks],
                pubrecs=[PR(client_id=c, packet_id=p) for c, p in pubrecs]))))
        return await asyncio.wait_for(fut, BOUND)

    async def wait_count(self, n: int, timeout: float = BOUND) -> list[pb.DevicePublishMsg]:
        await wait_until(lambda: len(self.messages) >= n or self.ended.is_set(), timeout,
                         f"{n} forwards on {self.service_id} (have {len(self.messages)})")
        assert len(self.messages) >= n, f"stream ended ({self.code}) after {len(self.messages)} forwards"
        return self.messages

