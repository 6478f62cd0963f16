"""The DevicePersistence gRPC API (grpc.aio) over a DeviceMsgStore.

Every call continues the trace carried in its metadata (tbmq_platform.tracing.context_from_grpc).
Bad arguments are INVALID_ARGUMENT; a Redis failure is UNAVAILABLE (the caller may retry: every call is
idempotent except FetchUndelivered, whose repetition just re-attaches and re-reads).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from redis.exceptions import RedisError
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_platform.tracing import context_from_grpc

from .store import MAX_PACKET_ID, Attachment, DeviceMsgStore

log = logging.getLogger(__name__)
tracer = trace.get_tracer("device_persistence.grpc")


class BadRequest(ValueError):
    pass


def _rpc(method):
    """Span from the caller's metadata; BadRequest -> INVALID_ARGUMENT, Redis errors -> UNAVAILABLE."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        self.calls[name] += 1
        ctx = context_from_grpc(context.invocation_metadata())
        client_id = getattr(request, "client_id", "")
        with tracer.start_as_current_span(f"DevicePersistence/{name}", context=ctx, kind=SpanKind.SERVER,
                                          attributes={"mqtt.client_id": client_id}) as span:
            try:
                return await method(self, request)
            except BadRequest as exc:
                span.set_attribute("error", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except (RedisError, OSError) as exc:
                self.calls[f"{name}_failed"] += 1
                log.warning("%s(%r) failed: %r", name, client_id, exc)
                span.record_exception(exc)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"Redis: {exc}")

    return wrapper


def _packet_id(request) -> int:
    if not 1 <= request.packet_id <= MAX_PACKET_ID:
        raise BadRequest(f"packet_id must be 1..{MAX_PACKET_ID}, got {request.packet_id}")
    return request.packet_id


class DevicePersistenceServicer(sgrpc.DevicePersistenceServicer):
    def __init__(self, store: DeviceMsgStore) -> None:
        self.store = store
        self.calls: Counter = Counter()

    @_rpc
    async def FetchUndelivered(self, request: spb.FetchUndeliveredRequest):
        if not request.service_id or "|" in request.service_id:
            raise BadRequest("service_id must be non-empty and must not contain '|'")
        if not request.session_id:
            raise BadRequest("session_id must be non-empty")
        messages = await self.store.fetch_undelivered(
            request.client_id, attach=Attachment(request.service_id, request.session_id))
        trace.get_current_span().set_attribute("tbmq.messages", len(messages))
        return spb.FetchUndeliveredResponse(messages=messages)

    @_rpc
    async def Detach(self, request: spb.DetachRequest):
        return spb.DetachResponse(detached=await self.store.detach(request.client_id, request.session_id))

    @_rpc
    async def Acknowledge(self, request: spb.PacketRequest):
        return spb.PacketResponse(found=await self.store.acknowledge(request.client_id, _packet_id(request)))

    @_rpc
    async def MarkPubrec(self, request: spb.PacketRequest):
        return spb.PacketResponse(found=await self.store.mark_pubrec(request.client_id, _packet_id(request)))

    @_rpc
    async def AcknowledgeMany(self, request: spb.PacketBatchRequest):
        try:
            acknowledged, marked = await self.store.apply_acks(
                [(a.client_id, a.packet_id) for a in request.acks],
                [(p.client_id, p.packet_id) for p in request.pubrecs])
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.calls["acks"] += len(request.acks)
        self.calls["pubrecs"] += len(request.pubrecs)
        return spb.PacketBatchResponse(acknowledged=acknowledged, marked=marked)

    @_rpc
    async def Clear(self, request: spb.ClearRequest):
        return spb.ClearResponse(removed=await self.store.clear(request.client_id))


async def start_server(servicer: DevicePersistenceServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server; returns it and the bound port (port 0 = any free port)."""
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", -1),  # a fetch of 65535 stored messages can be large
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.so_reuseport", 0),  # a second instance on the same port must fail, not share it
        # grpc core CANCELS calls queued beyond 1000 (soft) / 3000 (hard) not yet matched to a handler;
        # a connector acknowledging a 10,000-message backlog in the background easily has more.
        ("grpc.server.max_pending_requests", 100_000),
        ("grpc.server.max_pending_requests_hard_limit", 200_000),
    ])
    sgrpc.add_DevicePersistenceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port}")
    await server.start()
    return server, bound
