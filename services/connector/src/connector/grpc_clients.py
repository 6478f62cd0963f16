"""gRPC clients: device-persistence (unary calls) and app-delivery (one bidi stream per APPLICATION client)."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable

import grpc
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_platform.tracing import grpc_metadata

log = logging.getLogger(__name__)

# A reconnecting device may have up to 65535 stored messages of up to the maximum packet size each: far
# more than gRPC's default 4 MB per message, which would fail the fetch and strand the backlog.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 1024 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def pick_target(targets: tuple[str, ...], client_id: str) -> str:
    """A client id is pinned to one app-delivery instance by a stable hash (CRC-32 of its UTF-8)."""
    return targets[zlib.crc32(client_id.encode("utf-8")) % len(targets)]


class DevicePersistenceClient:
    def __init__(self, target: str, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = sgrpc.DevicePersistenceStub(self._channel)
        self._bg: set[asyncio.Task] = set()

    async def close(self) -> None:
        if self._bg:
            await asyncio.wait(self._bg, timeout=5)
        await self._channel.close()

    async def fetch(self, client_id: str, service_id: str, session_id: str):
        resp = await self._stub.FetchUndelivered(
            spb.FetchUndeliveredRequest(client_id=client_id, service_id=service_id, session_id=session_id),
            timeout=self.timeout, metadata=grpc_metadata())
        return list(resp.messages)

    def _background(self, what: str, coro) -> None:
        async def run():
            try:
                await coro
            except grpc.aio.AioRpcError as exc:
                log.warning("device-persistence %s failed: %s", what, exc.code().name)
            except Exception:
                log.exception("device-persistence %s failed", what)
        task = asyncio.get_running_loop().create_task(run())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def acknowledge(self, client_id: str, packet_id: int) -> None:
        self._background("Acknowledge", self._stub.Acknowledge(
            spb.PacketRequest(client_id=client_id, packet_id=packet_id), timeout=self.timeout,
            metadata=grpc_metadata()))

    def mark_pubrec(self, client_id: str, packet_id: int) -> None:
        self._background("MarkPubrec", self._stub.MarkPubrec(
            spb.PacketRequest(client_id=client_id, packet_id=packet_id), timeout=self.timeout,
            metadata=grpc_metadata()))

    def detach(self, client_id: str, session_id: str) -> None:
        self._background("Detach", self._stub.Detach(
            spb.DetachRequest(client_id=client_id, session_id=session_id), timeout=self.timeout,
            metadata=grpc_metadata()))


class AppDeliveryChannels:
    """One gRPC channel per app-delivery target, shared by all the streams pinned to it."""

    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets = targets
        self._stubs: dict[str, sgrpc.AppDeliveryStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub_for(self, client_id: str) -> tuple[str, sgrpc.AppDeliveryStub]:
        target = pick_target(self.targets, client_id)
        stub = self._stubs.get(target)
        if stub is None:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[target] = sgrpc.AppDeliveryStub(channel)
        return target, stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class AppStream:
    """The AppDelivery.Deliver stream of one connected APPLICATION client, reopened with backoff.

    `on_record(AppRecord)` is called for every record, in order. `ack(ref)` sends AppAck up; acks made
    while the stream is down are dropped: app-delivery redelivers what was not acknowledged on the
    stream it reopens, and the connection answers those from its in-flight map.
    """

    def __init__(self, channels: AppDeliveryChannels, open_msg: spb.AppOpen,
                 on_record: Callable[[spb.AppRecord], None]) -> None:
        self.target, self._stub = channels.stub_for(open_msg.client_id)
        self.open_msg = open_msg
        self._on_record = on_record
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self.connected = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"app {self.open_msg.client_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def ack(self, ref) -> None:
        if self._queue is not None:
            self._queue.put_nowait(spb.AppUpstream(ack=spb.AppAck(ref=ref)))

    async def _requests(self, queue: asyncio.Queue):
        while True:
            item = await queue.get()
            yield item

    async def _run(self) -> None:
        backoff = 0.5
        client_id = self.open_msg.client_id
        while True:
            queue: asyncio.Queue = asyncio.Queue()
            queue.put_nowait(spb.AppUpstream(open=self.open_msg))
            self._queue = queue
            call = self._stub.Deliver(self._requests(queue), metadata=grpc_metadata())
            try:
                async for down in call:
                    if not self.connected:
                        self.connected = True
                        backoff = 0.5
                    if down.HasField("record"):
                        self._on_record(down.record)
                log.info("app-delivery stream of %s ended by %s; reopening", client_id, self.target)
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("app-delivery stream of %s at %s failed: %s; retrying in %.1fs",
                            client_id, self.target, exc.code().name, backoff)
            finally:
                self._queue = None
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
