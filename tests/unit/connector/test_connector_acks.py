"""AckBatcher: PUBACK/PUBCOMP/PUBREC of stored DEVICE messages coalesced into AcknowledgeMany calls,
retried with backoff on failure, never dropped silently; the trace header made without a span."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
from tbmq_platform.tracing import fresh_trace_headers
from connector.grpc_clients import AckBatcher
from waits import wait_until

pytestmark = pytest.mark.unit


class FakeCall:
    """Stands in for stub.AcknowledgeMany: records requests; fails the first `fail` calls; with a `gate`,
    every call stays in flight until the test sets it."""

    def __init__(self, fail: int = 0, code=grpc.StatusCode.UNAVAILABLE, gate: asyncio.Event | None = None) -> None:
        self.requests = []
        self.fail = fail
        self.code = code
        self.gate = gate
        self.attempts = 0

    async def __call__(self, request, timeout=None, metadata=None):
        self.attempts += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail > 0:
            self.fail -= 1
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom")
        self.requests.append(request)
        return None

    def acks(self):
        return [(a.client_id, a.packet_id) for r in self.requests for a in r.acks]

    def pubrecs(self):
        return [(a.client_id, a.packet_id) for r in self.requests for a in r.pubrecs]


async def test_acks_are_coalesced_within_the_delay():
    call = FakeCall()
    b = AckBatcher(call, 1.0, delay_s=0.02)
    for pid in range(1, 51):
        b.acknowledge(f"c{pid % 3}", pid)
    b.mark_pubrec("c0", 99)
    assert call.attempts == 0  # nothing sent before the delay
    await wait_until(lambda: call.requests, 2.0, "the coalesced call")
    assert len(call.requests) == 1
    assert sorted(call.acks()) == sorted((f"c{p % 3}", p) for p in range(1, 51))
    assert call.pubrecs() == [("c0", 99)]
    assert len(b) == 0
    await b.close()


async def test_each_ack_and_mark_carries_its_message_serial():
    """The serial of the acknowledged message goes with its packet id (device-persistence applies it only to
    that message: a retried ack of an earlier connection cannot remove a newer message given the same id);
    0 when the caller has none. A retried call sends the same serials."""
    call = FakeCall(fail=1)
    b = AckBatcher(call, 1.0, delay_s=0.01)
    b.acknowledge("c", 7, 1042)
    b.acknowledge("c", 8)
    b.mark_pubrec("d", 9, 77)
    await wait_until(lambda: call.requests, 5.0, "the retried call")
    (request,) = call.requests
    assert call.attempts == 2
    assert [(a.client_id, a.packet_id, a.serial) for a in request.acks] == [("c", 7, 1042), ("c", 8, 0)]
    assert [(p.client_id, p.packet_id, p.serial) for p in request.pubrecs] == [("d", 9, 77)]
    await b.close()


async def test_a_pubrec_brings_the_batch_forward():
    """Removals wait the long delay; a PUBREC (its mark gates the client's PUBREL) sends them all sooner."""
    call = FakeCall()
    b = AckBatcher(call, 1.0, delay_s=30.0, pubrec_delay_s=0.01)
    loop = asyncio.get_running_loop()
    b.acknowledge("c", 1)
    assert b._timer.when() - loop.time() > 29  # acks alone: the long delay
    marked = []
    b.mark_pubrec("c", 2, done=lambda: marked.append(2))
    assert b._timer.when() - loop.time() <= 0.01
    await wait_until(lambda: marked, 2.0, "the batch carrying the PUBREC")
    assert call.acks() == [("c", 1)] and call.pubrecs() == [("c", 2)]  # one call, both in it
    assert len(call.requests) == 1
    b.mark_pubrec("c", 3)  # a PUBREC alone: the short delay from the start
    assert b._timer.when() - loop.time() <= 0.01
    await b.close()


def test_the_pubrec_delay_is_never_longer_than_the_ack_delay():
    b = AckBatcher(FakeCall(), 1.0, delay_s=0.001, pubrec_delay_s=0.5)
    assert b.pubrec_delay_s == 0.001


async def test_a_full_batch_goes_at_once_and_calls_are_bounded():
    gate = asyncio.Event()
    call = FakeCall(gate=gate)
    b = AckBatcher(call, 1.0, delay_s=10, max_batch=10, max_calls=2)
    for pid in range(1, 46):
        b.acknowledge("c", pid)
    await wait_until(lambda: call.attempts >= 2, 2.0, "two calls in flight")
    for _ in range(10):
        await asyncio.sleep(0)  # yield: a third call would start now if the bound did not hold
    assert call.attempts == 2  # two full batches in flight, the rest waits for one to finish
    gate.set()
    assert await b.drain(2.0)
    assert call.acks() == [("c", p) for p in range(1, 46)]
    assert all(len(r.acks) <= 10 for r in call.requests)
    await b.close()


async def test_failed_calls_are_retried_with_backoff_not_dropped():
    call = FakeCall(fail=3)
    b = AckBatcher(call, 1.0, delay_s=0.001)
    b.acknowledge("c", 1)
    marked = []
    b.mark_pubrec("c", 2, done=lambda: marked.append(call.attempts))
    await wait_until(lambda: b.stats["ack_call_failures"] >= 1, 2.0, "the first failed call")
    assert marked == []  # the PUBREL waits for a mark that is applied, not for a failed call
    b.acknowledge("c", 3)  # made while backing off: joins the retry
    assert await b.drain(5.0)
    assert call.attempts >= 4
    assert sorted(call.acks()) == [("c", 1), ("c", 3)]
    assert call.pubrecs() == [("c", 2)]
    assert marked == [call.attempts]  # once, after the call that applied it
    assert b.stats["ack_call_failures"] == 3
    assert not b._backoff.active  # reset by the success
    await b.close()


class MarkingCall(FakeCall):
    """Records, per attempt, the PUBRECs it carried and how many calls carrying PUBRECs were in flight; the
    first `fail_marks` attempts that carry PUBRECs fail (device-persistence answered while Redis restarted)."""

    def __init__(self, fail_marks: int, gate: asyncio.Event) -> None:
        super().__init__(gate=gate)
        self.fail_marks = fail_marks
        self.marking_in_flight = 0
        self.most_marking_in_flight = 0
        self.carried: list[list[int]] = []

    async def __call__(self, request, timeout=None, metadata=None):
        pids = [p.packet_id for p in request.pubrecs]
        self.carried.append(pids)
        self.attempts += 1
        self.marking_in_flight += bool(pids)
        self.most_marking_in_flight = max(self.most_marking_in_flight, self.marking_in_flight)
        try:
            await self.gate.wait()
            if pids and self.fail_marks > 0:
                self.fail_marks -= 1
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="Redis restarting")
            self.requests.append(request)
        finally:
            self.marking_in_flight -= bool(pids)


async def test_pubrec_marks_are_applied_in_order_one_call_at_a_time_also_across_a_failure():
    """A later PUBREC's mark must never be applied while an earlier one's waits for a retry: a session resumed
    meanwhile would get PUBREL for the later message before the PUBLISH of the earlier one [MQTT-4.6.0-4]
    (tests/e2e/durability/test_supervision.py, the Redis restart with QoS 2, caught it). Removals still go
    in parallel calls."""
    gate = asyncio.Event()
    call = MarkingCall(fail_marks=1, gate=gate)
    b = AckBatcher(call, 1.0, delay_s=0.001, pubrec_delay_s=0.001, max_batch=2, max_calls=4)
    marked: list[int] = []
    for pid in (1, 2):
        b.mark_pubrec("c", pid, done=lambda pid=pid: marked.append(pid))
    await wait_until(lambda: call.attempts == 1, 2.0, "the first call carrying PUBRECs")
    for pid in (3, 4, 5):
        b.mark_pubrec("c", pid, done=lambda pid=pid: marked.append(pid))
    b.acknowledge("c", 10)
    await wait_until(lambda: call.attempts == 2, 2.0, "a call with the removal")
    for _ in range(10):
        await asyncio.sleep(0)  # a second call with PUBRECs would start now if they were not held
    assert call.carried == [[1, 2], []]  # 3, 4, 5 wait behind the call carrying 1 and 2
    gate.set()  # the first call fails (Redis restarting), then every call goes through
    assert await b.drain(5.0)
    assert call.most_marking_in_flight == 1
    assert call.pubrecs() == [("c", p) for p in (1, 2, 3, 4, 5)]  # applied in PUBREC order
    assert [pids for pids in call.carried if pids] == [[1, 2], [1, 2], [3, 4], [5]]
    assert marked == [1, 2, 3, 4, 5]
    assert call.acks() == [("c", 10)]
    await b.close()


async def test_settle_also_waits_for_the_pubrecs_held_behind_the_call_in_flight():
    gate = asyncio.Event()
    call = MarkingCall(fail_marks=0, gate=gate)
    b = AckBatcher(call, 1.0, delay_s=5.0, pubrec_delay_s=0.001, max_batch=10)
    b.mark_pubrec("c", 1)
    await wait_until(lambda: call.attempts == 1, 2.0, "the call carrying the first PUBREC")
    b.mark_pubrec("c", 2)  # held: the call carrying 1 is in flight
    settling = asyncio.ensure_future(b.settle(2.0))  # e.g. before the fetch of a reconnecting client
    for _ in range(10):
        await asyncio.sleep(0)
    assert not settling.done() and call.carried == [[1]]
    gate.set()
    await settling
    assert call.pubrecs() == [("c", 1), ("c", 2)]  # both applied before the fetch goes out
    await b.close()


async def test_invalid_argument_is_not_retried():
    call = FakeCall(fail=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    b = AckBatcher(call, 1.0, delay_s=0.001)
    b.acknowledge("c", 1)
    marked = []
    b.mark_pubrec("c", 2, done=lambda: marked.append(2))
    assert await b.drain(1.0)
    assert call.attempts == 1 and call.acks() == []
    assert marked == [2]  # dropped, but the client's QoS 2 flow still finishes (PUBREL)
    await b.close()


async def test_settle_waits_only_for_what_was_waiting():
    gate = asyncio.Event()
    call = FakeCall(gate=gate)
    b = AckBatcher(call, 1.0, delay_s=5.0)
    b.acknowledge("c", 1)
    settling = asyncio.ensure_future(b.settle(1.0))  # does not wait for the 5 s delay
    await wait_until(lambda: call.attempts == 1, 2.0, "the call settle started")
    assert not settling.done()  # waits for the call in flight
    gate.set()
    await settling
    assert call.acks() == [("c", 1)]
    await b.close()


async def test_close_sends_what_waits():
    call = FakeCall()
    b = AckBatcher(call, 1.0, delay_s=5.0)
    b.acknowledge("c", 7)
    await b.close()
    assert call.acks() == [("c", 7)]
    b.acknowledge("c", 8)  # after close: not sent (the connector is stopping)
    assert b._timer is None  # nothing armed to send it
    for _ in range(10):
        await asyncio.sleep(0)
    assert call.attempts == 1


def test_fresh_trace_headers_are_w3c_traceparents():
    (k, v), = fresh_trace_headers()
    assert k == "traceparent"
    assert re.fullmatch(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-01", v)
    assert fresh_trace_headers() != fresh_trace_headers()


# ------------------------------------------------------------------------------------------ routing
class FakeLink:
    """Stands in for a ForwardLink: open or not; answers acknowledge_many or raises."""

    def __init__(self, open_: bool, raises: Exception | None = None) -> None:
        self.open = open_
        self.raises = raises
        self.requests = []

    async def acknowledge_many(self, request, timeout):
        if self.raises is not None:
            raise self.raises
        self.requests.append(request)


class FakeStub:
    def __init__(self) -> None:
        self.AcknowledgeMany = FakeCall()

    async def close(self) -> None:
        pass


async def test_acks_go_up_an_open_forward_stream_else_through_acknowledge_many():
    from connector.grpc_clients import AckRejected, DevicePersistenceClient, StreamDown
    from tbmq.v1 import services_pb2 as spb

    client = DevicePersistenceClient(("a:1", "b:2"), 1.0)
    try:
        stubs = [FakeStub(), FakeStub()]
        client._stubs = stubs
        req = spb.PacketBatchRequest(acks=[spb.PacketRequest(client_id="c", packet_id=1)])
        down, up = FakeLink(False), FakeLink(True)
        client.links = [down, up]
        await client._acknowledge_many(req, 1.0)           # the open stream (the second target)
        assert up.requests == [req] and not stubs[0].AcknowledgeMany.requests
        up.raises = StreamDown("b:2")                       # ended meanwhile: unary, on a target in turn
        up.open = False
        await client._acknowledge_many(req, 1.0)
        assert len(stubs[0].AcknowledgeMany.requests) + len(stubs[1].AcknowledgeMany.requests) == 1
        up.open, up.raises = True, AckRejected("bad packet id")   # refused: not retried elsewhere
        with pytest.raises(AckRejected):
            await client._acknowledge_many(req, 1.0)
        assert len(stubs[0].AcknowledgeMany.requests) + len(stubs[1].AcknowledgeMany.requests) == 1
    finally:
        client.links = []
        await client.close()


async def test_a_refused_stream_batch_is_dropped_not_retried():
    from connector.grpc_clients import AckRejected

    calls = []

    async def refuse(request, timeout=None):
        calls.append(request)
        raise AckRejected("packet id must be 1..65535")

    b = AckBatcher(refuse, 1.0, delay_s=0.001)
    b.acknowledge("c", 1)
    await b.drain(2.0)
    assert len(calls) == 1 and len(b) == 0 and b.stats["ack_call_failures"] == 1
    await b.close()


def test_an_acknowledgement_batch_is_split_by_each_clients_owner_in_order():
    """With several device-persistence instances, each client's acknowledgements go to its owner (the instance the
    routers send its copies to, tbmq_platform.peers.pick_target), which holds what it forwarded from memory."""
    from tbmq.v1 import services_pb2 as spb
    from tbmq_platform.peers import pick_target

    from connector.grpc_clients import split_by_owner

    clients = [f"dev-{i}" for i in range(40)]
    request = spb.PacketBatchRequest()
    for n, cid in enumerate(clients * 2):
        request.acks.add(client_id=cid, packet_id=n + 1, serial=n + 100)
    request.pubrecs.add(client_id=clients[3], packet_id=7, serial=9)
    parts = split_by_owner(request, 3)
    assert sorted(parts) == [0, 1, 2]  # 40 clients reach every one of three owners
    for i, part in parts.items():
        assert all(pick_target(range(3), a.client_id) == i for a in [*part.acks, *part.pubrecs])
        mine = [(a.client_id, a.packet_id, a.serial) for a in request.acks if pick_target(range(3), a.client_id) == i]
        assert [(a.client_id, a.packet_id, a.serial) for a in part.acks] == mine  # in the batch's order
    assert sum(len(p.acks) for p in parts.values()) == 80
    assert [p.client_id for p in parts[pick_target(range(3), clients[3])].pubrecs] == [clients[3]]
    assert list(split_by_owner(request, 1)) == [0]
