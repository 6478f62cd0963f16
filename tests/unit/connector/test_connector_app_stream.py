"""AppStream: the connector's AppDelivery.Deliver stream of an APPLICATION client, against an in-process
grpc.aio AppDelivery server. Every attempt (failed, ended by the server, stopped, reopened) must release
what it holds: no task left pending, no "Task was destroyed but it is pending" / "aclose(): asynchronous
generator is already running" from a request iterator left blocked on its queue."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging

import grpc
import pytest
from waits import poll, wait_until
from connector.grpc_clients import AppDeliveryChannels, AppStream
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb
from tbmq.v1 import services_pb2_grpc as sgrpc

pytestmark = pytest.mark.unit

BAD_LOG_LINES = ("Task was destroyed but it is pending", "asynchronous generator is already running",
                 "_consume_request_iterator", "request_iterator raised exception")


def _record(offset: int) -> spb.AppRecord:
    return spb.AppRecord(ref=spb.AppRecordRef(topic="tbmq.msg.app.c", partition=0, offset=offset),
                         msg=pb.PublishMsg(topic="t", qos=1, payload=b"x"))


class Server:
    """AppDelivery that sends `per_stream` records on each stream, then fails it (mode "fail"), ends it
    (mode "end") or keeps it open recording acks (mode "hold"). `batches`: as a current app-delivery, one
    AppRecordBatch to a stream that asked for it; else one AppRecord per message (an older one)."""

    def __init__(self, mode: str, per_stream: int = 2, batches: bool = False) -> None:
        self.mode = mode
        self.per_stream = per_stream
        self.batches = batches
        self.opens: list[spb.AppOpen] = []
        self.acks: list[int] = []
        self.ack_messages: list[tuple[str, int]] = []   # (kind, refs) of each upstream ack message
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> "Server":
        fake = self

        class Servicer(sgrpc.AppDeliveryServicer):
            async def Deliver(self, request_iterator, context):
                first = await request_iterator.__anext__()
                fake.opens.append(first.open)
                if fake.batches and first.open.batches:
                    yield spb.AppDownstream(batch=spb.AppRecordBatch(
                        records=[_record(i) for i in range(fake.per_stream)]))
                else:
                    for i in range(fake.per_stream):
                        yield spb.AppDownstream(record=_record(i))
                if fake.mode == "fail":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
                if fake.mode == "end":
                    return
                async for up in request_iterator:
                    if up.HasField("ack"):
                        fake.acks.append(up.ack.ref.offset)
                        fake.ack_messages.append(("ack", 1))
                    elif up.HasField("acks"):
                        fake.acks.extend(r.offset for r in up.acks.refs)
                        fake.ack_messages.append(("acks", len(up.acks.refs)))

        self.server = grpc.aio.server()
        sgrpc.add_AppDeliveryServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(0)


_wait = functools.partial(wait_until, timeout=10.0, what="condition", step=0.005)  # tests/waits.py


def _server_side(task: asyncio.Task) -> bool:
    """The in-process server's own tasks (it keeps one waiting for the next call, and one per call, named
    HandleExceptions[<method>], that can outlive the client's stop by a moment on a slow host): not the
    client's."""
    return any(s in repr(task) for s in ("AioServer", "_handle_rpc", "_handle_stream_stream_rpc",
                                         "HandleExceptions[", "_handle_exceptions"))


def _client_side(task: asyncio.Task) -> bool:
    """Tasks of the code under test (AppStream and grpc's client call machinery). The test session shares
    one event loop with session-wide fixtures (a Kafka consumer's fetcher, for one), whose tasks come and go
    on their own and say nothing about AppStream."""
    text = repr(task)
    return "grpc" in text or "connector" in text


def _pending_since(before: set) -> set:
    gc.collect()
    left = {t for t in asyncio.all_tasks()
            if t not in before and not t.done() and not _server_side(t) and _client_side(t)}
    left.discard(asyncio.current_task())
    return left


async def _settle(before: set) -> set:
    """The client-side tasks created since `before` still pending once they had five seconds to end (a leaked
    one never does; an ending one takes milliseconds, more on a loaded host)."""
    await poll(lambda: not _pending_since(before), 5.0, step=0.01)
    return _pending_since(before)


def _assert_clean_logs(caplog) -> None:
    gc.collect()
    bad = [r.getMessage() for r in caplog.records if any(s in r.getMessage() for s in BAD_LOG_LINES)]
    assert not bad, bad


def _stream(channels, on_record, client_id: str = "c") -> AppStream:
    return AppStream(channels, spb.AppOpen(client_id=client_id, session_id="s", receive_maximum=10), on_record,
                     backoff_s=0.001, max_backoff_s=0.001)


@pytest.mark.parametrize("mode", ["fail", "end"])
async def test_stream_failing_and_reopening_many_times_leaves_nothing_behind(mode, caplog):
    caplog.set_level(logging.DEBUG)
    server = await Server(mode).start()
    channels = AppDeliveryChannels((f"127.0.0.1:{server.port}",))
    before = set(asyncio.all_tasks())
    got: list[int] = []
    stream = _stream(channels, lambda rec: (got.append(rec.ref.offset), stream.ack(rec.ref)))
    try:
        stream.start()
        await _wait(lambda: len(server.opens) >= 40)
        await stream.stop()
        assert not await _settle(before)
    finally:
        await stream.stop()
        await channels.close()
        await server.stop()
    assert len(got) >= 39 * 2  # every reopened stream delivered its records
    assert all(o.client_id == "c" and o.receive_maximum == 10 for o in server.opens)
    _assert_clean_logs(caplog)


async def test_stream_stopped_and_reopened_many_times_leaves_nothing_behind(caplog):
    """As after a SUBSCRIBE that changes the shared subscriptions: stop the stream, open a new one."""
    caplog.set_level(logging.DEBUG)
    server = await Server("hold").start()
    channels = AppDeliveryChannels((f"127.0.0.1:{server.port}",))
    before = set(asyncio.all_tasks())
    try:
        for i in range(30):
            stream = _stream(channels, lambda rec: None)
            stream.start()
            await _wait(lambda: stream.connected)
            stream.ack(_record(100 + i).ref)
            await _wait(lambda: 100 + i in server.acks)
            await stream.stop()
        assert not await _settle(before)
    finally:
        await channels.close()
        await server.stop()
    assert len(server.opens) == 30
    assert server.acks == list(range(100, 130))
    _assert_clean_logs(caplog)


async def test_stream_retrying_against_a_down_server_leaves_nothing_behind(caplog):
    """app-delivery down: every attempt fails to connect; then it comes back and the stream reopens."""
    caplog.set_level(logging.DEBUG)
    server = await Server("hold").start()
    port = server.port
    await server.stop()
    channels = AppDeliveryChannels((f"127.0.0.1:{port}",))
    before = set(asyncio.all_tasks())
    stream = _stream(channels, lambda rec: None)
    attempts = []
    try:
        stream.start()
        await _wait(lambda: (attempts.append(1) or True) and
                    sum("failed" in r.getMessage() for r in caplog.records) >= 20)
        await stream.stop()
        assert not await _settle(before)
    finally:
        await stream.stop()
        await channels.close()
    _assert_clean_logs(caplog)


async def test_stream_stopped_at_any_point_against_a_down_server_stops():
    """stop() lands wherever the retry loop is: in a call's preparation too, where grpc.aio swallows the
    cancellation and the call then fails UNAVAILABLE (tbmq_platform.backoff.retry_after). Before that was
    handled, about one stop in a hundred waited forever while the loop retried."""
    server = await Server("hold").start()
    port = server.port
    await server.stop()
    channels = AppDeliveryChannels((f"127.0.0.1:{port}",))
    try:
        for i in range(200):
            stream = _stream(channels, lambda rec: None)
            stream.start()
            for _ in range(i % 50):
                await asyncio.sleep(0)  # a yield to the loop (not a wait): stop() lands at another point
            stopping = asyncio.get_running_loop().create_task(stream.stop())
            assert await poll(stopping.done, 5.0, step=0.005), f"stop #{i} did not end"
    finally:
        await channels.close()


async def test_ack_while_down_is_dropped_and_stop_is_idempotent(caplog):
    server = await Server("hold").start()
    channels = AppDeliveryChannels((f"127.0.0.1:{server.port}",))
    stream = _stream(channels, lambda rec: None)
    stream.ack(_record(1).ref)  # not started: dropped
    await stream.stop()
    await stream.stop()
    await channels.close()
    await server.stop()
    _assert_clean_logs(caplog)


async def test_batches_are_asked_for_and_acks_coalesced_into_one_message(caplog):
    """A current app-delivery: records of a batch reach on_records in order, and the acks made while they
    are handled go up as one AppAckBatch."""
    server = await Server("hold", per_stream=50, batches=True).start()
    channels = AppDeliveryChannels((f"127.0.0.1:{server.port}",))
    calls: list[list[int]] = []

    def on_records(records) -> None:
        calls.append([r.ref.offset for r in records])
        for r in records:
            stream.ack(r.ref)

    stream = AppStream(channels, spb.AppOpen(client_id="c", session_id="s", receive_maximum=100), None,
                       on_records=on_records, backoff_s=0.001, max_backoff_s=0.001)
    try:
        stream.start()
        await _wait(lambda: len(server.acks) >= 50)
    finally:
        await stream.stop()
        await channels.close()
        await server.stop()
    assert server.opens[0].batches
    assert calls == [list(range(50))]
    assert server.acks == list(range(50))
    assert server.ack_messages == [("acks", 50)]
    _assert_clean_logs(caplog)


async def test_older_server_gets_single_records_handled_and_single_acks(caplog):
    server = await Server("hold", per_stream=5, batches=False).start()
    channels = AppDeliveryChannels((f"127.0.0.1:{server.port}",))
    got: list[int] = []
    stream = _stream(channels, lambda rec: (got.append(rec.ref.offset), stream.ack(rec.ref)))
    try:
        stream.start()
        await _wait(lambda: len(server.acks) >= 5)
    finally:
        await stream.stop()
        await channels.close()
        await server.stop()
    assert got == list(range(5))
    assert server.ack_messages == [("ack", 1)] * 5
    _assert_clean_logs(caplog)
