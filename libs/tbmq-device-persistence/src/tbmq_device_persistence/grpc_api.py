"""The DevicePersistence gRPC API (grpc.aio) over a DeviceMsgStore and the forward streams.

Every unary call, and FetchUndeliveredParts, continues the trace carried in its metadata
(tbmq_platform.tracing.context_from_grpc). Bad arguments are INVALID_ARGUMENT; a Redis failure is UNAVAILABLE
(the caller may retry: every call is idempotent except FetchUndelivered(Parts), whose repetition just
re-attaches and re-reads).

FetchUndeliveredParts (server stream): FetchUndelivered's page, one answer per part as the store reads it
(DeviceMsgStore.fetch_undelivered_parts), so the connector delivers a part while the next is read. A Redis
failure between parts ends the stream UNAVAILABLE: what was sent is still the session's (attached), and the
connector fetches the rest after its last serial.

Persist (bidi, one per router): batches of stored copies, each answered once saved (service.persist).

Forward (bidi, one per connector): registered in the ForwardRegistry by the service id of its first
message; everything going down (ready, forward batches, ack replies, settle requests) is written by ONE
writer from the stream's byte-bounded queue. Acknowledgements coming up are applied in order with
store.apply_acks (exactly what AcknowledgeMany does) and answered with ForwardDown.acked (same seq), so the
connector knows they are in Redis.

Takeover: a session's first fetch of a client still attached to another connector asks that connector
(ForwardDown.settle on its stream here) for the acknowledgements it still batches, and reads only once it
answered ForwardUp.settled (or SETTLE_WAIT_S passed): the new connection is not sent again what the client
acknowledged on the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from redis.exceptions import RedisError
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_platform.grpc_tls import PLAINTEXT, GrpcTls
from tbmq_platform.tracing import context_from_grpc

from .forward import EndReason, ForwardRegistry, ForwardStream
from .store import MAX_PACKET_ID, Attachment, DeviceMsgStore

log = logging.getLogger(__name__)
tracer = trace.get_tracer("device_persistence.grpc")

# how long a takeover's first fetch waits for the old connector's acknowledgements (`_settle_elsewhere`):
# they take one ack call (a few ms); a connector older than ForwardDown.settle never answers
SETTLE_WAIT_S = 1.0
# how long an ended Forward stream waits for its ack reader to end after cancelling it, before it writes the
# stream's held tails to Redis anyway (the reader ends at once unless grpc.aio holds it: then it is logged)
READER_END_S = 5.0


class BadRequest(ValueError):
    pass


@contextlib.asynccontextmanager
async def _serving(servicer, name: str, request, context: grpc.aio.ServicerContext):
    """One call of `name`: a span from the caller's metadata; BadRequest -> INVALID_ARGUMENT, Redis errors ->
    UNAVAILABLE."""
    servicer.calls[name] += 1
    ctx = context_from_grpc(context.invocation_metadata())
    client_id = getattr(request, "client_id", "")
    with tracer.start_as_current_span(f"DevicePersistence/{name}", context=ctx, kind=SpanKind.SERVER,
                                      attributes={"mqtt.client_id": client_id}) as span:
        try:
            yield
        except BadRequest as exc:
            span.set_attribute("error", str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (RedisError, OSError) as exc:
            servicer.calls[f"{name}_failed"] += 1
            log.warning("%s(%r) failed: %r", name, client_id, exc)
            span.record_exception(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Redis: {exc}")


def _rpc(method):
    """A unary method served under `_serving`."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        async with _serving(self, name, request, context):
            return await method(self, request)

    return wrapper


def _rpc_stream(method):
    """A server-streaming method (an async generator) served under `_serving`: an error before or between
    its answers ends the stream with that status."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        async with _serving(self, name, request, context):
            async with contextlib.aclosing(method(self, request)) as answers:
                async for answer in answers:
                    yield answer

    return wrapper


def _service_id(service_id: str) -> str:
    if not service_id or "|" in service_id:
        raise BadRequest("service_id must be non-empty and must not contain '|'")
    return service_id


def _fetch_args(request: spb.FetchUndeliveredRequest) -> dict:
    """The store's fetch arguments of a FetchUndelivered(Parts) request, checked."""
    _service_id(request.service_id)
    if not request.session_id:
        raise BadRequest("session_id must be non-empty")
    return {"attach": Attachment(request.service_id, request.session_id), "check": request.resync,
            "after": request.after_serial, "max_messages": request.max_messages, "max_bytes": request.max_bytes}


def _packet_id(request) -> int:
    if not 1 <= request.packet_id <= MAX_PACKET_ID:
        raise BadRequest(f"packet_id must be 1..{MAX_PACKET_ID}, got {request.packet_id}")
    return request.packet_id


class DevicePersistenceServicer(sgrpc.DevicePersistenceServicer):
    def __init__(self, store: DeviceMsgStore, registry: ForwardRegistry | None = None, persist=None,
                 holding=None) -> None:
        self.store = store
        # async (records: list[bytes]) -> an awaitable of the stored count, done once durable (the service's
        # persist_start: it returns once the batch is saved and forwarded)
        self._persist = persist
        self.holding = holding  # holding.Holding (held forwards) or None
        self.registry = registry if registry is not None else ForwardRegistry(16 * 1024 * 1024)
        self.calls: Counter = Counter()
        self.persist_streams = 0  # Persist streams open (/readyz `persist_streams`)

    async def _settle_elsewhere(self, request: spb.FetchUndeliveredRequest) -> None:
        """A session's first fetch (not a resync) of a client still attached to ANOTHER connector (a takeover:
        the registry answered the new connection without waiting for the old one) first asks that
        connector's stream here to send the acknowledgements it holds, and waits for them (at most
        SETTLE_WAIT_S), so the page does not hand out again what the client acknowledged there."""
        if request.resync:
            return
        previous = await self.store.attachment(request.client_id)
        if previous is None or previous.service_id == request.service_id:
            return
        stream = self.registry.get(previous.service_id)
        if stream is None:  # no stream from it here: it crashed, or it is not a connector of this deployment
            return
        self.calls["settle_requests"] += 1
        if not await stream.settle(SETTLE_WAIT_S):
            self.calls["settle_timeouts"] += 1
            log.warning("connector %s did not settle its acknowledgements within %.1fs for %r taken over by %s",
                        previous.service_id, SETTLE_WAIT_S, request.client_id, request.service_id)

    async def _leave_held(self, client_id: str, what: str) -> None:
        """A session event of a client in held mode: its held tail written to Redis before the event is served."""
        if self.holding is not None:
            await self.holding.leave(client_id, what)

    async def _apply_acks(self, acks, pubrecs) -> tuple[int, int]:
        if self.holding is not None:
            return await self.holding.apply_acks(acks, pubrecs)
        return await self.store.apply_acks(acks, pubrecs)

    @_rpc
    async def FetchUndelivered(self, request: spb.FetchUndeliveredRequest):
        fetch = _fetch_args(request)
        await self._settle_elsewhere(request)
        await self._leave_held(request.client_id, "fetch")
        response = await self.store.fetch_undelivered_response(request.client_id, **fetch)
        trace.get_current_span().set_attribute("tbmq.messages", len(response.messages))
        return response

    @_rpc_stream
    async def FetchUndeliveredParts(self, request: spb.FetchUndeliveredRequest):
        """FetchUndelivered's page, one answer per part as the store reads it (services.proto)."""
        n = 0
        fetch = _fetch_args(request)
        await self._settle_elsewhere(request)
        await self._leave_held(request.client_id, "fetch")
        async with contextlib.aclosing(self.store.fetch_undelivered_parts(request.client_id, **fetch)) as parts:
            async for wire, more, not_attached in parts:
                if not_attached:
                    yield spb.FetchUndeliveredResponse(not_attached=True)
                    break
                part = spb.FetchUndeliveredResponse.FromString(wire)
                part.more = more
                n += len(part.messages)
                yield part
        trace.get_current_span().set_attribute("tbmq.messages", n)

    @_rpc
    async def Detach(self, request: spb.DetachRequest):
        await self._leave_held(request.client_id, "detach")
        return spb.DetachResponse(detached=await self.store.detach(request.client_id, request.session_id))

    @_rpc
    async def Acknowledge(self, request: spb.PacketRequest):
        acknowledged, _ = await self._apply_acks([(request.client_id, _packet_id(request), request.serial)], [])
        return spb.PacketResponse(found=acknowledged > 0)

    @_rpc
    async def MarkPubrec(self, request: spb.PacketRequest):
        return spb.PacketResponse(
            found=await self.store.mark_pubrec(request.client_id, _packet_id(request), request.serial))

    @_rpc
    async def AcknowledgeMany(self, request: spb.PacketBatchRequest):
        try:
            acknowledged, marked = await self._apply_acks(
                [(a.client_id, a.packet_id, a.serial) for a in request.acks],
                [(p.client_id, p.packet_id, p.serial) for p in request.pubrecs])
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        self.calls["acks"] += len(request.acks)
        self.calls["pubrecs"] += len(request.pubrecs)
        return spb.PacketBatchResponse(acknowledged=acknowledged, marked=marked)

    @_rpc
    async def Clear(self, request: spb.ClearRequest):
        await self._leave_held(request.client_id, "clear")
        return spb.ClearResponse(removed=await self.store.clear(request.client_id))

    async def Forward(self, request_iterator, context: grpc.aio.ServicerContext):
        """One connector's forward stream: see the module docstring."""
        self.calls["Forward"] += 1
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        try:
            if not first.HasField("open"):
                raise BadRequest("the first message of a Forward stream must be `open`")
            service_id = _service_id(first.open.service_id)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stream = self.registry.register(service_id)
        if stream is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        log.info("forward stream of %s open", service_id)
        reader = asyncio.get_running_loop().create_task(self._read_acks(requests, stream))
        reason = EndReason.CLIENT_GONE
        try:
            queue = stream.queue
            while True:
                down = await queue.get()
                if down is None:
                    break
                await context.write(down)
        finally:
            if stream.reason is not None:
                reason = stream.reason
            self.registry.unregister(stream, reason)
            reader.cancel()
            try:
                await self._reader_ended(service_id, reader)
            finally:  # cancelled meanwhile (the server stopping) too
                log.info("forward stream of %s ended: %s", service_id, reason.value)
                if self.holding is not None:  # what was forwarded on it may be lost: the tails go to Redis, where
                    await self.holding.leave_service(service_id)  # the connector's resync after it reopens reads them
        if reason is EndReason.OVERFLOW:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"forward queue above {self.registry.max_bytes} bytes: reopen and re-fetch")
        if reason is not EndReason.CLIENT_GONE:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"forward stream ended: {reason.value}")

    async def Persist(self, request_iterator, context: grpc.aio.ServicerContext):
        """One router's stored copies (the service's `persist`): each batch saved and forwarded in order, then
        answered with its seq. A batch is never answered before it is in Redis; the router sends what is
        unanswered again on its next stream (saved once: the origin check)."""
        self.calls["Persist"] += 1
        if self._persist is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this instance takes no Persist streams")
        self.persist_streams += 1
        answers: asyncio.Queue = asyncio.Queue()  # (seq, awaitable of the stored count), in batch order
        writer = asyncio.get_running_loop().create_task(self._answer(answers, context), name="persist answers")
        try:
            async for batch in request_iterator:
                try:
                    done = await self._persist(batch.records)  # saved and forwarded; the next batch may start
                except RuntimeError as exc:  # stopping while Redis is unavailable
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                answers.put_nowait((batch.seq, done))
                if writer.done():
                    break  # the stream is over (the writer could not write)
        finally:  # the call is over: what is not answered yet is sent again by the router on its next stream
            self.persist_streams -= 1
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    @staticmethod
    async def _answer(answers: asyncio.Queue, context: grpc.aio.ServicerContext) -> None:
        """A Persist stream's answers, in batch order, each once its batch is durable (`persist_start`)."""
        while True:
            seq, done = await answers.get()
            await context.write(spb.PersistAnswer(seq=seq, saved=await done))

    @staticmethod
    async def _reader_ended(service_id: str, reader: asyncio.Task) -> None:
        """A cancelled ack reader awaited, at most READER_END_S: the stream's end (its held tails written to
        Redis) must not wait on a read grpc.aio does not give up. One that outlives it is logged with its stack."""
        done, _ = await asyncio.wait({reader}, timeout=READER_END_S)
        if done:
            if not reader.cancelled() and reader.exception() is not None:
                log.warning("the ack reader of %s's forward stream failed: %r", service_id, reader.exception())
            return
        stack = "".join(f"\n  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in reader.get_stack())
        log.warning("the ack reader of %s's forward stream is still running %.0fs after its cancel; the stream "
                    "ends without it. Its stack:%s", service_id, READER_END_S, stack)

    async def _read_acks(self, requests, stream: ForwardStream) -> None:
        """Applies the acknowledgements coming up the stream, in order; ends the stream when the
        connector's side closes."""
        try:
            async for up in requests:
                kind = up.WhichOneof("kind")
                if kind == "acks":
                    stream.reply(spb.ForwardDown(acked=await self._apply(up.acks)))
                elif kind == "settled":  # the acks before it on this stream are applied: read in order
                    stream.settled(up.settled.seq)
            log.debug("forward stream of %s: the connector closed its side", stream.service_id)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("forward stream of %s: reading ended: %r", stream.service_id, exc)
        finally:
            if not stream.ended:
                self.registry.unregister(stream, EndReason.CLIENT_GONE)

    async def _apply(self, acks: spb.ForwardAcks) -> spb.ForwardAcked:
        batch = acks.batch
        self.calls["forward_ack_batches"] += 1
        try:
            acknowledged, marked = await self._apply_acks(
                [(a.client_id, a.packet_id, a.serial) for a in batch.acks],
                [(p.client_id, p.packet_id, p.serial) for p in batch.pubrecs])
        except ValueError as exc:
            return spb.ForwardAcked(seq=acks.seq, status=spb.FORWARD_ACK_STATUS_INVALID_ARGUMENT,
                                    detail=str(exc))
        except (RedisError, OSError) as exc:
            self.calls["forward_ack_batches_failed"] += 1
            log.warning("applying %d acks / %d PUBRECs from a forward stream failed: %r", len(batch.acks),
                        len(batch.pubrecs), exc)
            return spb.ForwardAcked(seq=acks.seq, status=spb.FORWARD_ACK_STATUS_UNAVAILABLE,
                                    detail=f"Redis: {exc}")
        self.calls["acks"] += len(batch.acks)
        self.calls["pubrecs"] += len(batch.pubrecs)
        return spb.ForwardAcked(seq=acks.seq, status=spb.FORWARD_ACK_STATUS_APPLIED,
                                acknowledged=acknowledged, marked=marked)


async def start_server(servicer: DevicePersistenceServicer, host: str, port: int,
                       tls: GrpcTls = PLAINTEXT) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server, mutual TLS when `tls` is on; returns it and the bound port (port 0 = any free
    port)."""
    server = grpc.aio.server(interceptors=tls.server_interceptors(), options=[
        ("grpc.max_send_message_length", -1),  # a fetch of 65535 stored messages can be large
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.so_reuseport", 0),  # a second instance on the same port must fail, not share it
        # grpc core CANCELS calls queued beyond 1000 (soft) / 3000 (hard) not yet matched to a handler;
        # a connector acknowledging a 10,000-message backlog in the background easily has more.
        ("grpc.server.max_pending_requests", 100_000),
        ("grpc.server.max_pending_requests_hard_limit", 200_000),
    ])
    sgrpc.add_DevicePersistenceServicer_to_server(servicer, server)
    bound = tls.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port}")
    await server.start()
    return server, bound
