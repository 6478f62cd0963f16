"""DevicePersistence.Clear, the one gRPC call of the registry: idempotent, so a retried batch may repeat it.

`clear(client_id, retry_for_s)` retries with exponential backoff for at most `retry_for_s` seconds (0 = one
attempt) and raises ClearFailed when device-persistence does not answer. After a failure, calls made within
the backoff window fail at once without a network attempt (unless they are allowed to retry), so a dead
device-persistence does not stall every removal.
"""

from __future__ import annotations

import logging
import time

import grpc
from tbmq.v1 import services_pb2, services_pb2_grpc
from tbmq_platform.backoff import PEER_CHANNEL_OPTIONS, Backoff, retry_after
from tbmq_platform.grpc_tls import PLAINTEXT, GrpcTls
from tbmq_platform.tracing import grpc_metadata

log = logging.getLogger(__name__)


class ClearFailed(RuntimeError):
    pass


class DeviceClearer:
    def __init__(self, target: str, *, call_timeout_s: float = 2.0, tls: GrpcTls = PLAINTEXT) -> None:
        self.target = target
        self.tls = tls
        self.call_timeout_s = call_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: services_pb2_grpc.DevicePersistenceStub | None = None
        self._down_until = 0.0
        self._backoff = Backoff(max_s=5.0)  # while device-persistence fails, calls without a retry budget fail fast
        self.calls = 0

    def _ensure(self) -> services_pb2_grpc.DevicePersistenceStub:
        if self._stub is None:
            self._channel = self.tls.channel(self.target, options=PEER_CHANNEL_OPTIONS)
            self._stub = services_pb2_grpc.DevicePersistenceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def clear(self, client_id: str, retry_for_s: float = 0.0) -> int:
        deadline = time.monotonic() + retry_for_s
        retry = Backoff(0.05, 1.0)  # between the attempts of this call, within retry_for_s
        last: Exception | None = None
        if retry_for_s <= 0 and time.monotonic() < self._down_until:
            raise ClearFailed(f"device-persistence {self.target} unavailable (backing off)")
        while True:
            try:
                self.calls += 1
                resp = await self._ensure().Clear(services_pb2.ClearRequest(client_id=client_id),
                                                  timeout=min(self.call_timeout_s, max(0.2, retry_for_s)),
                                                  metadata=grpc_metadata())
                self._down_until = 0.0
                self._backoff.reset()
                return resp.removed
            except grpc.aio.AioRpcError as exc:
                last = exc
                log.warning("DevicePersistence.Clear(%s) at %s failed: %s", client_id, self.target, exc.code())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._down_until = time.monotonic() + self._backoff.next()
                raise ClearFailed(f"device-persistence {self.target}: {last}")
            await retry_after(min(retry.next(), remaining))
