"""reserve_held.lua, spill_held.lua and held_marks.lua (held forwards, tbmq_device_persistence.held) against real Redis, standalone and
cluster: a block reserved only for a live client with an empty store, a spill stored as handed-out messages that the
next session gets and the PUBACKs remove, and origin marks a router's replay is checked against."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb

from redis_clock import redis_ms
from tbmq_device_persistence.store import Attachment

pytestmark = pytest.mark.asyncio(loop_scope="session")

SVC = Attachment("svc", "s1")
OTHER = Attachment("svc-2", "s2")


def msg(seq: int) -> pb.PublishMsg:
    return pb.PublishMsg(topic=f"t/{seq}", payload=b"%d" % seq, qos=1)


def held(client_id: str, serial: int, pid: int, seq: int) -> pb.DevicePublishMsg:
    return pb.DevicePublishMsg(client_id=client_id, serial=serial, packet_id=pid, msg=msg(seq),
                               packet_type=pb.DEVICE_PACKET_TYPE_PUBLISH)


async def live_and_empty(store, client_id: str, n: int = 2) -> list[pb.DevicePublishMsg]:
    """The client attached to SVC, `n` messages forwarded to it and acknowledged: live, nothing stored."""
    await store.fetch_undelivered(client_id, attach=SVC)
    res = (await store.save_many_attached({client_id: [msg(i) for i in range(n)]}))[client_id]
    assert res.attached == SVC and res.forwarded == n
    await store.apply_acks([(client_id, d.packet_id, d.serial) for d in res.messages])
    return res.messages


async def test_a_block_is_reserved_only_for_a_live_client_with_an_empty_store(store_factory, client_id):
    store = await store_factory()
    sent = await live_and_empty(store, client_id)
    other, stored = client_id + "-elsewhere", client_id + "-stored"
    await live_and_empty(store, other)
    await store.fetch_undelivered(stored, attach=SVC)
    await store.save_many_attached({stored: [msg(1)]})  # forwarded, not acknowledged: stored
    got = await store.reserve_held({client_id: SVC, other: OTHER, stored: SVC, client_id + "-nobody": SVC}, 100)
    assert got == {client_id: (sent[-1].serial, sent[-1].packet_id, sent[-1].serial + 100), other: None,
                   stored: None, client_id + "-nobody": None}
    # Redis's cursor is past the block: what it hands out next comes after every held serial and packet id
    res = (await store.save_many_attached({client_id: [msg(9)]}))[client_id]
    assert [(d.serial, d.packet_id) for d in res.messages] == [(sent[-1].serial + 101, sent[-1].packet_id + 101)]
    assert await store.reserve_held({client_id: SVC}, 100) == {client_id: None}  # it stores one now


async def test_the_packet_ids_of_a_block_wrap_to_1(store_factory, client_id):
    store = await store_factory()
    await live_and_empty(store, client_id, n=1)  # pid 1
    first = await store.reserve_held({client_id: SVC}, 65534)  # ids 2 .. 65535
    assert first[client_id][1:] == (1, first[client_id][0] + 65534)
    assert await store.reserve_held({client_id: SVC}, 3) == {client_id: (first[client_id][2], 65535,
                                                                            first[client_id][2] + 3)}
    res = (await store.save_many_attached({client_id: [msg(1)]}))[client_id]
    assert res.messages[0].packet_id == 4  # 1, 2, 3 reserved: never 0


async def test_a_spill_is_stored_as_handed_out_and_the_next_session_gets_it(store_factory, client_id):
    store = await store_factory()
    await live_and_empty(store, client_id)
    serial, pid, end = (await store.reserve_held({client_id: SVC}, 10))[client_id]
    tail = [held(client_id, serial + 2, pid + 2, 2), held(client_id, serial + 3, pid + 3, 3)]  # +1 acknowledged
    assert await store.spill_held({client_id: ({0: 42}, tail)}) == 2
    assert await store.spill_held({client_id: ({0: 42}, tail)}) == 0  # a retry stores nothing twice
    assert await store.count(client_id) == 2
    page = await store.fetch_undelivered(client_id, attach=OTHER)  # a takeover's first page
    assert [(d.serial, d.packet_id, d.msg.payload) for d in page] == [(serial + 2, pid + 2, b"2"),
                                                                         (serial + 3, pid + 3, b"3")]
    # the PUBACKs of the old connection (packet id and serial) remove them: the store is empty again
    assert await store.apply_acks([(client_id, pid + 2, serial + 2), (client_id, pid + 3, serial + 3)]) == (2, 0)
    assert await store.count(client_id) == 0
    assert (await store.reserve_held({client_id: OTHER}, 10))[client_id] == (end, pid + 10, end + 10)


async def test_a_new_message_is_saved_behind_a_spilled_tail_with_a_free_packet_id(store_factory, client_id):
    store = await store_factory()
    await live_and_empty(store, client_id)
    serial, pid, end = (await store.reserve_held({client_id: SVC}, 5))[client_id]
    await store.spill_held({client_id: ({}, [held(client_id, serial + 1, pid + 1, 1)])})
    res = (await store.save_many_attached({client_id: [msg(2)]}))[client_id]
    assert res.attached == SVC and [(d.serial, d.packet_id) for d in res.messages] == [(end + 1, pid + 6)]
    page = await store.fetch_undelivered(client_id, attach=SVC)
    assert [d.serial for d in page] == [serial + 1, end + 1]


async def test_origin_marks_drop_a_replay_at_or_below_them_and_only_rise(store_factory, client_id):
    store = await store_factory()
    await live_and_empty(store, client_id)
    await store.reserve_held({client_id: SVC}, 5)
    assert await store.spill_held({client_id: ({3: 100, 4: 7}, [])}) == 0  # the marks of acknowledged copies
    assert await store.spill_held({client_id: ({3: 90}, [])}) == 0  # lower: the mark stays at 100
    res = (await store.save_many_attached({client_id: [msg(1), msg(2), msg(3)]},
                                          origins={client_id: [(3, 100), (3, 101), (4, 7)]}))[client_id]
    assert [d.msg.payload for d in res.messages] == [b"2"]  # a router's replay of what was acknowledged: dropped
    assert res.applied_before == 2
    gone = client_id + "-gone"
    assert await store.spill_held({gone: ({3: 1}, [])}) == 0
    assert await store.count(gone) == 0 and not await store.redis.exists(store.keys(gone).state)


async def test_held_marks_raise_the_marks_that_drop_a_replay_and_never_make_a_state(store_factory, client_id):
    """held_marks.lua, the marks of acknowledged held copies (written once per acknowledgement batch)."""
    store = await store_factory()
    await live_and_empty(store, client_id)
    await store.reserve_held({client_id: SVC}, 5)
    gone = client_id + "-gone"
    assert await store.held_marks({client_id: {3: 100, 4: 7}, gone: {3: 1}}) == 1  # the gone one: not written
    assert not await store.redis.exists(store.keys(gone).state)
    assert await store.held_marks({client_id: {3: 90, 4: 7}}) == 0  # lower or equal: nothing moves
    assert await store.held_marks({client_id: {4: 8}}) == 1
    res = (await store.save_many_attached({client_id: [msg(1), msg(2), msg(3), msg(4)]},
                                          origins={client_id: [(3, 100), (3, 101), (4, 8), (4, 9)]}))[client_id]
    assert [d.msg.payload for d in res.messages] == [b"2", b"4"]  # a router's replay of what was acknowledged
    assert res.applied_before == 2
    k = store.keys(client_id)
    for bad in (b"", b"3:", b"3:1,", b"3:1x4:2", b"3:14:", b"-3:1"):
        with pytest.raises(Exception, match="held_marks: bad"):
            await store._call("held_marks", [k.state], [1000, bad])
    with pytest.raises(Exception, match="held_marks: one key"):
        await store._call("held_marks", [k.state], [1000, b"3:200", b"4:200"])
    for ttl in (0, b"01", b"x", 10 ** 15):
        with pytest.raises(Exception, match="held_marks: the TTL"):
            await store._call("held_marks", [k.state], [ttl, b"3:200"])
    assert await store.held_marks({client_id: {3: 150}}) == 1  # the refused calls wrote nothing (not 200)


async def test_held_marks_move_the_deadline_a_held_client_gets_back_when_not_live(store_factory, client_id):
    """A held client is saved nothing: its marks move state.exp as a save would, so once it is not live (its state
    has no TTL while it is) the state outlives its last message, held or saved, by the TTL and the slack."""
    store = await store_factory()
    await live_and_empty(store, client_id)
    await store.reserve_held({client_id: SVC}, 5)
    k, r = store.keys(client_id), store.redis
    ttl_ms = store.config.messages_ttl_s * 1000
    now_ms = await redis_ms(r)
    await r.hset(k.state, "exp", now_ms + 2000)  # saved last a TTL ago
    assert await store.held_marks({client_id: {0: 5}}) == 1
    exp = int(await r.hget(k.state, "exp"))
    assert exp >= now_ms + ttl_ms and await r.pttl(k.state) == -1  # live: no TTL
    # a deadline far enough ahead is left alone (written at most once per slack, not once per call)
    await r.hset(k.state, "exp", exp + 10_000_000)
    assert await store.held_marks({client_id: {0: 6}}) == 1
    assert int(await r.hget(k.state, "exp")) == exp + 10_000_000
    res = (await store.save_many_attached({client_id: [msg(1), msg(2)]}, origins={client_id: [(0, 6), (0, 7)]}))
    assert [d.msg.payload for d in res[client_id].messages] == [b"2"] and res[client_id].attached == SVC
    assert await store.detach(client_id, SVC.session_id)
    assert abs(await redis_ms(r) + await r.pttl(k.state) - (exp + 10_000_000)) < 2000


async def test_bad_arguments_are_refused_before_anything_is_written(store_factory, client_id):
    store = await store_factory()
    await live_and_empty(store, client_id)
    k = store.keys(client_id)
    with pytest.raises(Exception, match="reserve_held: the block size"):
        await store.reserve_held({client_id: SVC}, 65535)
    bad = [b"#3:x;", b"1000,5,6:P\x00\x00abc", b"1000,7,6:P\x00\x01abc1000,6,6:P\x00\x02abc"]
    for blob in bad:
        with pytest.raises(Exception, match="spill_held: bad|without a packet id"):
            await store._call("spill_held", [k.messages, k.pids, k.state], [blob])
    assert await store.count(client_id) == 0


async def test_a_spill_restores_the_cursor_of_a_state_lost_while_the_client_was_held(store_factory, client_id):
    """A held client's state that Redis lost (a restart without persistence; a live state has no TTL): the spill
    brings back the reserved block's end and the last packet id, so the next save hands out a serial above every
    one the connection was given (it takes forwards only above its highest) and a free packet id."""
    store = await store_factory()
    await live_and_empty(store, client_id)
    serial, pid, end = (await store.reserve_held({client_id: SVC}, 10))[client_id]
    await store.redis.delete(store.keys(client_id).state)  # lost
    tail = [held(client_id, serial + 1, pid + 1, 1)]
    assert await store.spill_held({client_id: ({}, tail)}, cursors={client_id: (end, pid + 1)}) == 1
    await store.fetch_undelivered(client_id, attach=SVC)  # the session's resync attaches it again
    res = (await store.save_many_attached({client_id: [msg(2)]}))[client_id]
    assert [(d.serial, d.packet_id) for d in res.messages] == [(end + 1, pid + 2)]
    # a state that has its cursor keeps it: a cursor header never moves it back
    assert await store.spill_held({client_id: ({}, [])}, cursors={client_id: (serial, pid)}) == 0
    res = (await store.save_many_attached({client_id: [msg(3)]}))[client_id]
    assert res.messages[0].serial == end + 2
