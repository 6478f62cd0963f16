"""gRPC clients: device-persistence (one Forward stream per instance, a stream per fetched page, unary calls)
and app-delivery (one bidi stream per APPLICATION client).

device-persistence: `ForwardLink` keeps the `DevicePersistence.Forward` stream to one target open
(reopened with backoff). Down it come the stored messages of the clients attached to this connector
(`on_batch`); up it go the acknowledgements (`AckBatcher`, each batch answered with `acked` once it is
in Redis). When the stream is not open, acknowledgements go through the unary `AcknowledgeMany` (both
are idempotent). `on_open` (ready received: the stream is registered on that instance) and `on_close`
tell the service to re-sync its persistent DEVICE connections (connection.py). A page of stored messages
comes down its own short stream (`fetch`: FetchUndeliveredParts, a part per Redis script call).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc
from tbmq_platform.backoff import (PEER_CHANNEL_OPTIONS, PEER_RETRY_INITIAL_S, PEER_RETRY_MAX_S, Backoff, end_attempt,
                                   retry_after)
from tbmq_platform.grpc_tls import PLAINTEXT, GrpcTls
from tbmq_platform.metrics import grpc_client_interceptors
from tbmq_platform.peers import pick_target
from tbmq_platform.tracing import grpc_metadata

log = logging.getLogger(__name__)

# A reconnecting device may have up to 65535 stored messages of up to the maximum packet size each: far
# more than gRPC's default 4 MB per message, which would fail the fetch and strand the backlog.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 1024 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    *PEER_CHANNEL_OPTIONS,
)


async def write_loop(call, queue: asyncio.Queue) -> None:
    """Sends the queue up a bidi call, in order, until cancelled or the call can take no more (one writer
    task per stream attempt: ForwardLink; AppStream's own `_write_loop` also coalesces its acks)."""
    try:
        while True:
            await call.write(await queue.get())
    except asyncio.CancelledError:
        raise
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
        pass  # the call is over: the read side reports how, and the attempt ends


# The acknowledgement batching's defaults, written once: AckBatcher, DevicePersistenceClient and the
# settings (DEVICE_ACK_BATCH_DELAY_MS, DEVICE_PUBREC_BATCH_DELAY_MS, DEVICE_ACK_BATCH_MAX, DEVICE_ACK_MAX_CALLS).
ACK_DELAY_S = 0.100  # a removal gates nothing a client sees; each batch costs a round trip and a Redis call
PUBREC_DELAY_S = 0.010
ACK_BATCH_MAX = 2000
ACK_MAX_CALLS = 4


class AckRejected(Exception):
    """device-persistence refused an acknowledgement batch as invalid (a bad packet id): not retried."""


class StreamDown(Exception):
    """The forward stream is not open, or ended before answering."""


class AckBatcher:
    """Coalesces the PUBACK/PUBCOMP (acknowledge) and PUBREC (mark_pubrec) of stored DEVICE messages of
    every connection into batches: `call(PacketBatchRequest, timeout)` sends one (up a forward stream,
    or as a `DevicePersistence.AcknowledgeMany` call) and returns once it is applied.

    `mark_pubrec`'s `done` is called once the batch carrying the mark was applied (the connection sends
    PUBREL then); a batch device-persistence refuses as invalid calls it too (the flow must finish; the
    message is redelivered on the next connect).

    A call goes out `delay_s` after the first ack waiting — `pubrec_delay_s` after the first PUBREC when
    that is sooner: a PUBREC's mark gates the client's PUBREL, a removal gates nothing the client sees — or
    at once when `max_batch` are waiting; at most `max_calls` calls are in flight (more acks wait and join
    the next call, so batches grow with the load), and of them at most ONE carries PUBRECs: the marks are
    applied in the order the client sent its PUBRECs, also when a call fails and is retried. Otherwise a later
    call could be applied while an earlier one waits for its retry (device-persistence answered the first
    while Redis restarted, the second once it was back), and a session resumed meanwhile (on any connector)
    would get PUBREL for a later message before the PUBLISH of an earlier one: its QoS 2 messages released
    out of the order of their PUBRECs [MQTT-4.6.0-4] (a client that delivers at PUBREL, as paho does, hands
    them to the application out of order). Every call is one gRPC message up and one down, each a
    wake-up of gRPC's poller thread on both sides: the longer removal delay is what keeps their number per
    message small at load (docs/performance.md, "The twelfth round").
    A call that fails is logged and its acks are put back and retried with backoff (tbmq_platform.backoff:
    0.1 s ... 1 s): an ack
    that never arrives only means a redelivery with DUP on the next connect, never a loss, but none is
    dropped while the connector runs. Only INVALID_ARGUMENT (a bug: the ids come from the store) drops a
    batch, logged as an error.
    """

    def __init__(self, call: Callable, timeout: float, *, delay_s: float = ACK_DELAY_S,
                 pubrec_delay_s: float = PUBREC_DELAY_S, max_batch: int = ACK_BATCH_MAX,
                 max_calls: int = ACK_MAX_CALLS) -> None:
        self._call = call
        self.timeout = timeout
        self.delay_s = delay_s
        self.pubrec_delay_s = min(pubrec_delay_s, delay_s)
        self.max_batch = max_batch
        self.max_calls = max_calls
        self._acks: list[tuple[str, int, int]] = []  # (store id, packet id, serial)
        self._pubrecs: list[tuple[str, int, int, Callable[[], None] | None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task] = set()
        self._marking: asyncio.Task | None = None  # the call in flight that carries PUBRECs
        self._backoff = Backoff()    # active while device-persistence fails: the delay before the next call
        self._closed = False
        self.stats = {"ack_calls": 0, "acks_sent": 0, "pubrecs_sent": 0, "ack_call_failures": 0}

    def __len__(self) -> int:
        return len(self._acks) + len(self._pubrecs)

    def acknowledge(self, client_id: str, packet_id: int, serial: int = 0) -> None:
        self._acks.append((client_id, packet_id, serial))
        self._arm()

    def mark_pubrec(self, client_id: str, packet_id: int, serial: int = 0,
                    done: Callable[[], None] | None = None) -> None:
        self._pubrecs.append((client_id, packet_id, serial, done))
        self._arm()

    def _arm(self) -> None:
        if self._closed:
            return
        if self._timer is not None:
            if self._backoff.active:
                return
            if len(self._acks) + len(self._pubrecs) >= self.max_batch:
                self._timer.cancel()
                self._timer = None
                self._flush()
            elif self._pubrecs:  # only a PUBREC can bring forward a timer armed for removals
                loop = asyncio.get_running_loop()
                if self._timer.when() > loop.time() + self.pubrec_delay_s:
                    self._timer.cancel()
                    self._timer = loop.call_later(self.pubrec_delay_s, self._on_timer)
            return
        if len(self._calls) >= self.max_calls:
            return  # a finishing call flushes what waits
        loop = asyncio.get_running_loop()
        delay = self.pubrec_delay_s if self._pubrecs else self.delay_s
        if len(self._acks) + len(self._pubrecs) >= self.max_batch and not self._backoff.active:
            self._flush()
        else:
            self._timer = loop.call_later(self._backoff.current or delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._flush()

    def _send_now(self) -> None:
        """What waits goes now, not when the armed timer fires."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._flush()

    def _flush(self) -> None:
        """Send what waits, in calls of at most max_batch, while fewer than max_calls are in flight (the
        rest goes when a call finishes); PUBRECs only while no other call carries some (they keep their order)."""
        n = self.max_batch
        while (self._acks or (self._pubrecs and self._marking is None)) and len(self._calls) < self.max_calls:
            acks, self._acks = self._acks[:n], self._acks[n:]
            pubrecs = []
            if self._marking is None:
                room = n - len(acks)
                pubrecs, self._pubrecs = self._pubrecs[:room], self._pubrecs[room:]
            task = asyncio.get_running_loop().create_task(self._send(acks, pubrecs))
            self._calls.add(task)
            if pubrecs:
                self._marking = task
            task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        if task is self._marking:
            self._marking = None
        if (self._acks or self._pubrecs) and self._timer is None:
            if self._closed:
                return
            self._arm()

    async def _send(self, acks: list[tuple[str, int, int]],
                    pubrecs: list[tuple[str, int, int, Callable | None]]) -> None:
        request = spb.PacketBatchRequest()
        add = request.acks.add  # built in place (a message built apart is copied into the list: twice the cost)
        for c, p, s in acks:
            add(client_id=c, packet_id=p, serial=s)
        add = request.pubrecs.add
        for c, p, s, _ in pubrecs:
            add(client_id=c, packet_id=p, serial=s)
        self.stats["ack_calls"] += 1
        try:
            await self._call(request, timeout=self.timeout)
        except asyncio.CancelledError:
            self._requeue(acks, pubrecs)
            raise
        except Exception as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            self.stats["ack_call_failures"] += 1
            if code == grpc.StatusCode.INVALID_ARGUMENT or isinstance(exc, AckRejected):
                log.error("device-persistence refused %d acks / %d PUBRECs: %s (dropped; the messages are "
                          "redelivered on the next connect)", len(acks), len(pubrecs),
                          exc.details() if code is not None else exc)
                self._marked(pubrecs)
                return
            delay = self._backoff.next()
            log.warning("device-persistence AcknowledgeMany (%d acks, %d PUBRECs) failed: %s; retrying in %.1fs",
                        len(acks), len(pubrecs), code.name if code is not None else repr(exc), delay)
            self._requeue(acks, pubrecs)
            return
        self._backoff.reset()
        self.stats["acks_sent"] += len(acks)
        self.stats["pubrecs_sent"] += len(pubrecs)
        self._marked(pubrecs)

    @staticmethod
    def _marked(pubrecs) -> None:
        for *_, done in pubrecs:
            if done is not None:
                try:
                    done()
                except Exception:
                    log.exception("a PUBREC's completion failed")

    def _requeue(self, acks, pubrecs) -> None:
        self._acks[:0] = acks
        self._pubrecs[:0] = pubrecs

    async def settle(self, timeout: float) -> None:
        """Send what waits now and wait (at most `timeout`) for the calls covering it, i.e. every ack made
        before this call (not those made meanwhile). Returns at once while backing off after a failure."""
        if self._backoff.active:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._send_now()
        held = len(self._pubrecs)  # PUBRECs behind the call that carries earlier ones: they go once it is done
        waiting = set(self._calls)
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)
        left = deadline - loop.time()
        if held and self._pubrecs and self._marking is None and not self._backoff.active and left > 0:
            self._send_now()
            if self._marking is not None:
                await asyncio.wait({self._marking}, timeout=left)
        if (self._acks or self._pubrecs) and self._timer is None and not self._calls:
            self._arm()

    async def drain(self, timeout: float) -> bool:
        """Send everything waiting now and wait (at most `timeout`) until no call is in flight and nothing
        waits. True when everything was sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._acks or self._pubrecs or self._calls:
            if self._acks or self._pubrecs:
                if self._timer is not None and not self._backoff.active:
                    self._send_now()
                elif self._timer is None:
                    self._flush()
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._calls:
                await asyncio.wait(set(self._calls), timeout=left)
            else:
                await asyncio.sleep(min(left, 0.05))  # backing off: the timer sends them
        return True

    async def close(self, timeout: float = 5.0) -> None:
        sent = await self.drain(timeout)
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        if not sent or self._acks or self._pubrecs:
            log.warning("device-persistence: %d acks and %d PUBRECs not sent at shutdown (those messages are "
                        "redelivered with DUP on the next connect)", len(self._acks), len(self._pubrecs))


class ForwardLink:
    """The connector's end of the Forward stream to ONE device-persistence target, reopened with backoff
    (`backoff_s` ... `max_backoff_s`, reset once a stream is ready).

    `on_batch(batch)` gets every forwarded ForwardBatch, in order; `on_open(link)` is called once the
    instance answered `ready` (the stream is registered: every message it saves for this connector from
    now on comes down this stream), `on_close(link)` when a stream that was open ends (what it had
    queued may be lost: the messages are in Redis). `acknowledge_many` sends a batch up and waits for its
    `acked` answer (raises StreamDown when the stream is not open or ends first, AckRejected when the
    batch is invalid). A `settle` request (a client attached here connected elsewhere: device-persistence
    reads its stored messages once it has what this connector acknowledged) calls `on_settle(answer)`, which
    sends every ack held now and, once they are applied, calls `answer()`: `settled` with the request's seq,
    on the stream that asked (a stream reopened meanwhile has its own requests).

    Each attempt drives its call directly (one writer task per attempt, no request iterator): when an
    attempt ends its writer is cancelled and awaited and the call cancelled, so nothing outlives it.
    """

    def __init__(self, target: str, stub: sgrpc.DevicePersistenceStub, service_id: str, *,
                 on_batch: Callable, on_open: Callable, on_close: Callable, on_settle: Callable,
                 backoff_s: float = PEER_RETRY_INITIAL_S, max_backoff_s: float = PEER_RETRY_MAX_S) -> None:
        self.target = target
        self._stub = stub
        self.service_id = service_id
        self._on_batch = on_batch
        self._on_open = on_open
        self._on_close = on_close
        self._on_settle = on_settle
        self._backoff = Backoff(backoff_s, max_backoff_s)
        self._queue: asyncio.Queue | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._seq = itertools.count(1)
        self._task: asyncio.Task | None = None
        self._stopped = False
        self.open = False
        self.stats = {"opened": 0, "batches": 0, "messages": 0}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"forward {self.target}")

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def acknowledge_many(self, request: spb.PacketBatchRequest, timeout: float) -> spb.ForwardAcked:
        queue = self._queue
        if not self.open or queue is None:
            raise StreamDown(self.target)
        seq = next(self._seq)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[seq] = fut
        queue.put_nowait(spb.ForwardUp(acks=spb.ForwardAcks(seq=seq, batch=request)))
        try:
            acked = await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.pop(seq, None)
        if acked.status == spb.FORWARD_ACK_STATUS_INVALID_ARGUMENT:
            raise AckRejected(acked.detail)
        if acked.status != spb.FORWARD_ACK_STATUS_APPLIED:
            raise StreamDown(f"{self.target}: {spb.ForwardAckStatus.Name(acked.status)} {acked.detail}")
        return acked

    async def _run(self) -> None:
        backoff = self._backoff
        loop = asyncio.get_running_loop()
        while True:
            queue: asyncio.Queue = asyncio.Queue()
            queue.put_nowait(spb.ForwardUp(open=spb.ForwardOpen(service_id=self.service_id)))
            self._queue = queue
            call = self._stub.Forward(metadata=grpc_metadata())
            writer = loop.create_task(write_loop(call, queue), name=f"forward {self.target} writer")
            try:
                async for down in call:
                    kind = down.WhichOneof("kind")
                    if kind == "batch":
                        self.stats["batches"] += 1
                        self.stats["messages"] += len(down.batch.messages)
                        self._on_batch(down.batch)
                    elif kind == "acked":
                        fut = self._waiting.get(down.acked.seq)
                        if fut is not None and not fut.done():
                            fut.set_result(down.acked)
                    elif kind == "settle":
                        self._on_settle(functools.partial(
                            queue.put_nowait, spb.ForwardUp(settled=spb.ForwardSettle(seq=down.settle.seq))))
                    elif kind == "ready":
                        self.open = True
                        self.stats["opened"] += 1
                        backoff.reset()
                        log.info("forward stream to %s open (%s)", self.target, down.ready.instance_id)
                        self._on_open(self)
                log.info("forward stream to %s ended by the server; reopening", self.target)
            except grpc.aio.AioRpcError as exc:
                log.warning("forward stream to %s failed: %s; reopening in %.1fs", self.target,
                            exc.code().name, backoff.next())
            finally:
                was_open, self.open = self.open, False
                self._queue = None
                waiting, self._waiting = self._waiting, {}
                for fut in waiting.values():
                    if not fut.done():
                        fut.set_exception(StreamDown(self.target))
                await end_attempt(call, writer)
                if was_open and not self._stopped:
                    self._on_close(self)
            await retry_after(backoff.current or backoff.next())


def split_by_owner(request: spb.PacketBatchRequest, targets: int) -> dict[int, spb.PacketBatchRequest]:
    """An acknowledgement batch split by the index of each client's owner among `targets` device-persistence
    instances (tbmq_platform.peers.pick_target), each client's items in their order."""
    owners = range(targets)
    parts: dict[int, spb.PacketBatchRequest] = {}
    for field in ("acks", "pubrecs"):
        for item in getattr(request, field):
            i = pick_target(owners, item.client_id)
            part = parts.get(i)
            if part is None:
                part = parts[i] = spb.PacketBatchRequest()
            getattr(part, field).append(item)
    return parts


class DevicePersistenceClient:
    """Every device-persistence target: a ForwardLink each (started by `start_forwarding`), unary calls
    (fetch, detach, AcknowledgeMany when no stream is open) on a target whose stream is open, else on
    the targets in turn (each instance serves every client: the state is in Redis). A client's fetches,
    detaches and acknowledgements go to its owner (`pick_target` of its client id: the instance the routers send
    its copies to) while that link is open: the owner holds the copies it forwarded from memory (held forwards,
    docs/device-persistence.md), and spills them before a fetch or detach is served."""

    def __init__(self, targets: tuple[str, ...] | str, timeout: float, *, ack_delay_s: float = ACK_DELAY_S,
                 pubrec_delay_s: float = PUBREC_DELAY_S, ack_batch_max: int = ACK_BATCH_MAX,
                 ack_max_calls: int = ACK_MAX_CALLS, tls: GrpcTls = PLAINTEXT) -> None:
        self.targets = (targets,) if isinstance(targets, str) else tuple(targets)
        self.timeout = timeout
        self.observe = None  # (method, seconds) per call (a fetch: to its end): tbmq_grpc_call_seconds
        self._channels = [tls.channel(t, options=CHANNEL_OPTIONS,
                                      interceptors=grpc_client_interceptors(lambda: self.observe))
                          for t in self.targets]
        self._stubs = [sgrpc.DevicePersistenceStub(c) for c in self._channels]
        self._turn = itertools.count()
        self._parts = True  # FetchUndeliveredParts until a device-persistence answers UNIMPLEMENTED
        self.links: list[ForwardLink] = []
        self._bg: set[asyncio.Task] = set()
        self.acks = AckBatcher(self._acknowledge_many, timeout, delay_s=ack_delay_s, pubrec_delay_s=pubrec_delay_s,
                               max_batch=ack_batch_max, max_calls=ack_max_calls)

    def start_forwarding(self, service_id: str, *, on_batch: Callable, on_open: Callable,
                         on_close: Callable) -> None:
        """Open (and keep open) the Forward stream to every target."""
        for target, stub in zip(self.targets, self._stubs):
            link = ForwardLink(target, stub, service_id, on_batch=on_batch, on_open=on_open, on_close=on_close,
                               on_settle=self._settle_for)
            self.links.append(link)
            link.start()

    def open_links(self) -> int:
        return sum(1 for link in self.links if link.open)

    async def close(self) -> None:
        await self.acks.close()
        for link in self.links:
            await link.stop()
        if self._bg:
            await asyncio.wait(self._bg, timeout=5)
        for channel in self._channels:
            await channel.close()

    def _stub(self, client_id: str | None = None) -> sgrpc.DevicePersistenceStub:
        """The client's owner while its link is open (or before the links are started), else the first target
        whose link is open, else the targets in turn."""
        if client_id is not None and len(self._stubs) > 1:
            i = pick_target(range(len(self._stubs)), client_id)
            if not self.links or self.links[i].open:
                return self._stubs[i]
        for link, stub in zip(self.links, self._stubs):
            if link.open:
                return stub
        return self._stubs[next(self._turn) % len(self._stubs)]

    async def _acknowledge_many(self, request: spb.PacketBatchRequest, timeout: float) -> None:
        """Each client's part up its owner's open forward stream (with one target: the batch whole), else up
        another open one, else the unary AcknowledgeMany."""
        if len(self.links) < 2:
            await self._acknowledge_part(request, timeout, 0)
            return
        parts = split_by_owner(request, len(self.links))
        await asyncio.gather(*(self._acknowledge_part(part, timeout, i) for i, part in parts.items()))

    async def _acknowledge_part(self, request: spb.PacketBatchRequest, timeout: float, owner: int) -> None:
        links = self.links[owner:] + self.links[:owner]
        for link in links:
            if link.open:
                try:
                    await link.acknowledge_many(request, timeout)
                    return
                except StreamDown:
                    break  # ended meanwhile (or Redis failed there): the unary call decides
        await self._stub().AcknowledgeMany(request, timeout=timeout, metadata=grpc_metadata())

    async def fetch(self, client_id: str, service_id: str, session_id: str, *, resync: bool = False,
                    after: int = 0, max_messages: int = 0, max_bytes: int = 0) -> AsyncIterator[tuple[list, bool]]:
        """One page of the client's stored messages (serials after `after`, at most `max_messages` /
        `max_bytes`, 0 = no bound), in parts as device-persistence reads them (FetchUndeliveredParts):
        (messages, more) per part, `more` on the last part = more remain after the page. The first fetch of
        a connection attaches the client; a `resync` (every later page too) only reads, and answers one
        part ([], False) when the client is attached elsewhere now. An AioRpcError after some parts means
        the rest of the page was not read (the caller fetches after the last serial it got).
        A device-persistence without FetchUndeliveredParts (older) answers the page in one part
        (FetchUndelivered)."""
        if not resync:
            # acknowledgements still waiting here (e.g. of this client's previous connection) go first, so
            # the fetch does not return (and redeliver) what was already acknowledged
            await self.settle_acks()
        request = spb.FetchUndeliveredRequest(client_id=client_id, service_id=service_id, session_id=session_id,
                                              resync=resync, after_serial=after, max_messages=max_messages,
                                              max_bytes=max_bytes)
        stub = self._stub(client_id)
        if self._parts:
            call = stub.FetchUndeliveredParts(request, timeout=self.timeout, metadata=grpc_metadata())
            got = False
            try:
                async for part in call:
                    got = True
                    yield list(part.messages), part.more
                return
            except grpc.aio.AioRpcError as exc:
                if got or exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._parts = False
                log.warning("device-persistence has no FetchUndeliveredParts (older version): pages come whole")
            finally:
                call.cancel()  # a no-op once the stream ended; stops it when the caller stopped reading
        resp = await stub.FetchUndelivered(request, timeout=self.timeout, metadata=grpc_metadata())
        yield list(resp.messages), resp.more

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

    def acknowledge(self, client_id: str, packet_id: int, serial: int = 0) -> None:
        """PUBACK/PUBCOMP of a stored message (`serial`: the message's, 0 = whatever holds the id): batched
        (AckBatcher)."""
        self.acks.acknowledge(client_id, packet_id, serial)

    def mark_pubrec(self, client_id: str, packet_id: int, serial: int = 0,
                    done: Callable[[], None] | None = None) -> None:
        """PUBREC of a stored message: batched (AckBatcher); `done()` once it is applied."""
        self.acks.mark_pubrec(client_id, packet_id, serial, done)

    async def settle_acks(self) -> None:
        """The acknowledgements and PUBREC marks made so far sent now and applied (waited for at most
        `timeout`, 2 s at most; at once while device-persistence fails): before a session's first fetch, so
        the fetch does not return (and redeliver) what was already acknowledged, before a session's end is
        reported, so a reconnect on another connector does not either, and when device-persistence asks
        (a session taken over on another connector: ForwardLink's `settle`; docs/connector.md)."""
        await self.acks.settle(min(self.timeout, 2.0))

    def _settle_for(self, answer: Callable[[], None]) -> None:
        """A Forward stream's settle request: the acks held now sent and applied, then `answer()`."""
        async def settle() -> None:
            await self.settle_acks()
            answer()
        self._background("settle", settle())

    def detach(self, client_id: str, session_id: str) -> None:
        """No more forwards to the session (a no-op when another session attached since), once the
        acknowledgements held here are applied: a takeover's first fetch asks the connector the client is
        still attached to for them (ForwardLink's `settle`), so one attached nowhere must hold none."""
        self._background("Detach", self._detach(client_id, session_id))

    async def _detach(self, client_id: str, session_id: str) -> None:
        await self.settle_acks()
        await self._stub(client_id).Detach(spb.DetachRequest(client_id=client_id, session_id=session_id),
                                  timeout=self.timeout, metadata=grpc_metadata())


class AppDeliveryChannels:
    """One gRPC channel per app-delivery target, shared by all the streams pinned to it."""

    def __init__(self, targets: tuple[str, ...], tls: GrpcTls = PLAINTEXT) -> None:
        self.targets = targets
        self.tls = tls
        self._stubs: dict[str, sgrpc.AppDeliveryStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub_for(self, client_id: str) -> tuple[str, sgrpc.AppDeliveryStub]:
        target = pick_target(self.targets, client_id)
        stub = self._stubs.get(target)
        if stub is None:
            channel = self.tls.channel(target, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[target] = sgrpc.AppDeliveryStub(channel)
        return target, stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class AppStream:
    """The AppDelivery.Deliver stream of one connected APPLICATION client, reopened with backoff.

    `on_records(records)` is called for every record, in order: with the records of each AppRecordBatch,
    or with a single AppRecord (default: `on_record` for each). `ack(ref)` sends the acknowledgement up;
    acks made while the stream is down are dropped: app-delivery redelivers what was not acknowledged on
    the stream it reopens, and the connection answers those from its in-flight map.

    Batches are negotiated (services.proto): AppOpen.batches is set, so a current app-delivery sends
    AppRecordBatch. Acks are coalesced: the writer task takes every ack waiting in its queue (at most
    ACK_BATCH_MAX per message) and sends them as one AppAckBatch, once a batch came down on this attempt
    (a server that sends batches takes them); before that (an older app-delivery) one AppAck each.

    Each attempt drives its call directly (`call.write` from one writer task per attempt, no request
    iterator): when an attempt ends — failure, end by the server, `stop()` — its writer task is cancelled
    and awaited and the call cancelled, so nothing of it outlives the attempt.
    """

    ACK_BATCH_MAX = 1000

    def __init__(self, channels: AppDeliveryChannels, open_msg: spb.AppOpen,
                 on_record: Callable[[spb.AppRecord], None], *, on_records: Callable[..., None] | None = None,
                 backoff_s: float = 0.5, max_backoff_s: float = 5.0) -> None:
        self.target, self._stub = channels.stub_for(open_msg.client_id)
        open_msg.batches = True
        self.open_msg = open_msg
        self._on_record = on_record
        self._on_records = on_records or self._each
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        # The acks of the current attempt. Bounded by the window: each is the ack of a record app-delivery
        # streamed and counts unacknowledged (at most receive_maximum on this attempt), or of one still in
        # flight with the client from an earlier attempt (at most the connection's receive maximum).
        self._queue: asyncio.Queue | None = None
        self._batched = False      # a batch came down on this attempt: acks go up as AppAckBatch
        self._task: asyncio.Task | None = None
        self.connected = False

    def _each(self, records) -> None:
        for rec in records:
            self._on_record(rec)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"app {self.open_msg.client_id}")

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def ack(self, ref) -> None:
        if self._queue is not None:
            self._queue.put_nowait(ref)

    async def _write_loop(self, call, queue: asyncio.Queue) -> None:
        """Sends the AppOpen, then the acks in order (every ack waiting as one message) until cancelled or
        the call can take no more."""
        try:
            await call.write(spb.AppUpstream(open=self.open_msg))
            while True:
                ref = await queue.get()
                if not self._batched:
                    await call.write(spb.AppUpstream(ack=spb.AppAck(ref=ref)))
                    continue
                refs = [ref]
                while len(refs) < self.ACK_BATCH_MAX and not queue.empty():
                    refs.append(queue.get_nowait())
                await call.write(spb.AppUpstream(acks=spb.AppAckBatch(refs=refs)))
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call is over: the read side reports how, and the attempt ends

    async def _run(self) -> None:
        backoff = Backoff(self._backoff_s, self._max_backoff_s)
        client_id = self.open_msg.client_id
        loop = asyncio.get_running_loop()
        on_records = self._on_records
        while True:
            queue: asyncio.Queue = asyncio.Queue()
            self._queue = queue
            self._batched = False
            call = self._stub.Deliver(metadata=grpc_metadata())
            writer = loop.create_task(self._write_loop(call, queue), name=f"app {client_id} writer")
            try:
                async for down in call:
                    if not self.connected:
                        self.connected = True
                        backoff.reset()
                    kind = down.WhichOneof("kind")
                    if kind == "batch":
                        self._batched = True
                        on_records(down.batch.records)
                    elif kind == "record":
                        on_records((down.record,))
                log.info("app-delivery stream of %s ended by %s; reopening", client_id, self.target)
            except grpc.aio.AioRpcError as exc:
                log.warning("app-delivery stream of %s at %s failed: %s; retrying in %.1fs",
                            client_id, self.target, exc.code().name, backoff.next())
            finally:
                self._queue = None
                self.connected = False
                await end_attempt(call, writer)
            await retry_after(backoff.current or backoff.next())
