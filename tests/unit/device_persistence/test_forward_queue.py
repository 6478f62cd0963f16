"""forward.py, pure parts: the byte-bounded queue of a forward stream and the registry by service id."""

from __future__ import annotations

import asyncio

import pytest
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb

from tbmq_device_persistence.forward import ByteQueue, EndReason, ForwardRegistry, group_by_service
from tbmq_device_persistence.store import Attachment, SaveResult

pytestmark = pytest.mark.unit


def dm(client_id: str, serial: int, size: int = 10) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(client_id=client_id, packet_id=serial, serial=serial,
                               msg=pb.PublishMsg(topic="t", payload=b"x" * size, qos=1))


async def test_byte_queue_is_bounded_in_bytes_not_items():
    q = ByteQueue(100)
    assert q.put("a", 60)
    assert not q.put("b", 50)              # 110 > 100: refused, nothing added
    assert q.put("c", 40)                  # exactly 100
    assert (len(q), q.bytes) == (2, 100)
    assert await q.get() == "a"
    assert q.bytes == 40
    assert q.put("d", 60)
    assert [await q.get(), await q.get()] == ["c", "d"]
    assert q.bytes == 0


async def test_byte_queue_takes_one_oversized_item_when_empty_and_forced_items_always():
    q = ByteQueue(10)
    assert q.put("big", 1000)              # never wedged by one batch larger than the bound
    assert not q.put("small", 1)
    assert q.put("reply", 5, force=True)
    assert [await q.get(), await q.get()] == ["big", "reply"]


async def test_byte_queue_get_waits_and_close_ends_it():
    q = ByteQueue(10)
    waiter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    q.put("x", 1)
    assert await waiter == "x"
    q.put("y", 1)
    q.close()
    assert not q.put("z", 1)               # closed: refused
    assert await q.get() == "y"            # what was left, then None
    assert await q.get() is None


async def test_byte_queue_drained_waits_until_the_consumer_came_back():
    q = ByteQueue(100)
    q.put("a", 1)
    q.put("b", 1)
    drained = asyncio.ensure_future(q.drained())
    await asyncio.sleep(0)
    assert await q.get() == "a"
    assert await q.get() == "b"            # taken, but maybe not handled yet
    await asyncio.sleep(0)
    assert not drained.done()
    nxt = asyncio.ensure_future(q.get())   # the consumer is back for more: everything handled
    await asyncio.wait_for(drained, 1)
    await q.drained()                      # already drained: returns at once
    q.close()
    assert await nxt is None


async def test_registry_newer_stream_replaces_older_and_overflow_ends_the_stream():
    reg = ForwardRegistry(max_bytes=200, instance_id="dp-1")
    first = reg.register("c1")
    assert (await first.queue.get()).ready.instance_id == "dp-1"
    second = reg.register("c1")
    assert first.reason is EndReason.REPLACED and await first.queue.get() is None
    assert reg.get("c1") is second and len(reg) == 1
    await second.queue.get()               # its ready

    reg.forward({"c1": fb(dm("a", 1), dm("a", 2)), "gone": fb(dm("b", 1))})
    assert reg.stats["forwarded"] == 2 and reg.stats["forward_no_stream"] == 1
    batch = await second.queue.get()
    assert [m.serial for m in batch.batch.messages] == [1, 2]   # one message per batch, not per record

    reg.forward({"c1": fb(dm("a", 3, size=150))})                # fits (alone)
    reg.forward({"c1": fb(dm("a", 4, size=150))})                # would exceed 200 bytes: stream ended
    assert second.reason is EndReason.OVERFLOW and reg.get("c1") is None
    assert reg.stats["forward_overflows"] == 1 and reg.stats["forward_dropped"] == 1
    assert await second.queue.get() is None                    # what waited is dropped (it is in Redis)
    reg.unregister(second, EndReason.CLIENT_GONE)              # the handler's own cleanup: a no-op now
    assert second.reason is EndReason.OVERFLOW

    third = reg.register("c1")
    reg.close()
    assert third.reason is EndReason.SHUTDOWN and reg.register("c1") is None


async def test_flush_ends_streams_that_do_not_drain():
    reg = ForwardRegistry(max_bytes=1000)
    moving, stuck = reg.register("moving"), reg.register("stuck")
    reg.forward({"moving": fb(dm("a", 1)), "stuck": fb(dm("b", 1))})

    async def consume():
        while await moving.queue.get() is not None:
            pass

    consumer = asyncio.ensure_future(consume())
    await reg.flush(0.2)
    assert moving.reason is None and reg.get("moving") is moving
    assert stuck.reason is EndReason.FLUSH_TIMEOUT and reg.get("stuck") is None
    reg.close()
    await consumer


def fb(*messages) -> spb.ForwardBatch:
    return spb.ForwardBatch(messages=messages)


def test_group_by_service_keeps_save_order():
    results = [
        SaveResult([dm("a", 1), dm("a", 2)], Attachment("c1", "s"), forwarded=2),
        SaveResult([dm("b", 7)], None),                             # not live: nothing to forward
        SaveResult([], Attachment("c2", "s")),
        SaveResult([dm("c", 3), dm("c", 4)], Attachment("c1", "s2"), forwarded=1, paused=True),  # 4 waits
    ]
    out = group_by_service(results)
    assert list(out) == ["c1"]
    assert [(m.client_id, m.serial) for m in out["c1"].messages] == [("a", 1), ("a", 2), ("c", 3)]
    assert list(out["c1"].paused) == ["c"]
