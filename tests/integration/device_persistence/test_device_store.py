"""DeviceMsgStore + lua/ against real Redis: every test runs on a standalone server and on a 3-master
Redis Cluster (`redis_backend` is parametrized in conftest.py)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from redis.crc import key_slot
from redis.exceptions import ResponseError
from tbmq.v1 import messages_pb2 as pb

from redis_clock import redis_ms
from tbmq_device_persistence.store import Attachment, DeviceMsgStore, Source, StoreConfig, client_keys
from waits import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="session")

PUBLISH = pb.DEVICE_PACKET_TYPE_PUBLISH
PUBREL = pb.DEVICE_PACKET_TYPE_PUBREL


def msg(seq: int, **kw) -> pb.PublishMsg:
    return pb.PublishMsg(**{"topic": f"t/{seq}", "payload": b"%d" % seq, "qos": 1, **kw})


SVC = Attachment("svc", "s1")


def keys_ttl_max(ttl_ms: int) -> int:
    """The longest TTL a client's bookkeeping keys get from a save of messages with TTL `ttl_ms`: their
    shared deadline is the TTL plus a slack of TTL / 8, at most an hour (lua/save_messages.lua)."""
    return ttl_ms + min(ttl_ms // 8, 3_600_000)


async def take(store, client_id, **kw):
    """A page handed out to (and attaching) SVC: every message in it has its packet id."""
    return await store.fetch_undelivered(client_id, attach=SVC, **kw)


def seqs(items) -> list[int]:
    """The sequence numbers carried in the payloads of DevicePublishMsg or PublishMsg items."""
    return [int((d.msg if isinstance(d, pb.DevicePublishMsg) else d).payload) for d in items]


async def test_save_fetch_roundtrip(store_factory, client_id):
    store = await store_factory()
    full = pb.PublishMsg(
        publisher_id="pub",
        topic="a/b",
        payload=b"\x00\xff binary \r\n",
        qos=2,
        retain=True,
        user_properties=[pb.UserProperty(key="k", value="v")],
        content_type="text/plain",
        response_topic="r",
        correlation_data=b"c",
        subscription_ids=[1, 7],
        created_at_ms=int(time.time() * 1000),
        publisher_mqtt_version=5,
    )
    saved = await store.save_batch(client_id, [full, msg(1)])
    # not live: saved without packet ids
    assert [(d.packet_id, d.serial, d.packet_type) for d in saved] == [(0, 1, PUBLISH), (0, 2, PUBLISH)]
    assert saved[0].msg == full and saved[0].client_id == client_id
    assert list(await store.fetch_undelivered(client_id)) == list(saved)  # a peek hands nothing out
    fetched = await take(store, client_id)
    assert [(d.packet_id, d.serial) for d in fetched] == [(1, 1), (2, 2)]
    assert [d.msg for d in fetched] == [full, msg(1)] and fetched[0].client_id == client_id
    assert await store.fetch_undelivered("nobody-" + client_id) == []
    assert await store.save_batch(client_id, []) == []


async def test_acknowledge(store_factory, client_id):
    store = await store_factory()
    await store.save_batch(client_id, [msg(i) for i in range(5)])
    assert await store.acknowledge(client_id, 2) is False  # not handed out yet: no packet id is in use
    await take(store, client_id)
    assert await store.acknowledge(client_id, 2) is True
    assert await store.acknowledge(client_id, 2) is False
    assert await store.acknowledge(client_id, 999) is False
    assert await store.acknowledge_many(client_id, [1, 3, 1000]) == 2
    assert [(d.packet_id, int(d.msg.payload)) for d in await store.fetch_undelivered(client_id)] == [
        (4, 3),
        (5, 4),
    ]
    with pytest.raises(ValueError):
        await store.acknowledge(client_id, 0)
    with pytest.raises(ValueError):
        await store.acknowledge(client_id, 65536)


async def test_acknowledge_one_gives_its_bytes_back_and_never_revives_a_state(store_factory, client_id):
    """remove_message.lua's one-id path (ZREM's count instead of ZMSCORE) keeps `bytes` exact, and an
    acknowledgement whose client state is gone leaves no state behind (it would have no TTL)."""
    store = await store_factory()
    k = client_keys(client_id)
    r = store.redis
    size = len(msg(0).SerializeToString()) + 3  # stored value: type byte + packet id + PublishMsg
    await store.save_batch(client_id, [msg(0), msg(1), msg(2)])
    assert [d.packet_id for d in await take(store, client_id)] == [1, 2, 3]
    assert int(await r.hget(k.state, "bytes")) == 3 * size
    assert await store.acknowledge(client_id, 2) is True
    assert int(await r.hget(k.state, "bytes")) == 2 * size
    assert await store.acknowledge(client_id, 2) is False  # already removed: nothing freed twice
    assert int(await r.hget(k.state, "bytes")) == 2 * size
    await r.delete(k.state)  # the state gone (as after an expiry) while a message is still handed out
    assert await store.acknowledge(client_id, 1) is True
    assert await r.exists(k.state) == 0


async def test_apply_acks_many_clients(store_factory, client_id):
    """AcknowledgeMany's store side: PUBRECs then acknowledgements of several clients, pipelined."""
    store = await store_factory()
    other = client_id + "-b"
    await store.save_batch(client_id, [msg(i) for i in range(5)])
    await store.save_batch(other, [msg(i) for i in range(3)])
    await take(store, client_id)
    await take(store, other)
    acked, marked = await store.apply_acks(
        [(client_id, 1, 0), (other, 2, 0), (client_id, 3, 0), (client_id, 1, 0), (other, 999, 0), (client_id, 5, 0)],
        [(client_id, 4, 0), (other, 3, 0), (other, 77, 0), (client_id, 5, 0)])
    assert (acked, marked) == (4, 3)  # (client, 1) twice counts once; 999 unknown; 77 unknown
    left = await store.fetch_undelivered(client_id)
    assert [(d.packet_id, d.packet_type) for d in left] == [(2, PUBLISH), (4, PUBREL)]
    left = await store.fetch_undelivered(other)
    assert [(d.packet_id, d.packet_type) for d in left] == [(1, PUBLISH), (3, PUBREL)]
    assert await store.apply_acks([], []) == (0, 0)
    with pytest.raises(ValueError):
        await store.apply_acks([(client_id, 2, 0), (other, 0, 0)])
    assert len(await store.fetch_undelivered(client_id)) == 2  # nothing applied


async def test_a_stale_ack_leaves_the_newer_message_of_its_packet_id(store_factory, client_id):
    """An acknowledgement or PUBREC carries the serial of the message it is for: retried from an earlier
    connection after the packet id was freed and handed to a newer message, it leaves that message alone
    (removed or marked, it would be lost or released unsent). Without a serial it applies to whatever holds
    the id, as before."""
    store = await store_factory()
    k = client_keys(client_id)
    await store.save_batch(client_id, [msg(0)])
    (first,) = await take(store, client_id)
    assert first.packet_id == 1
    assert await store.acknowledge(client_id, 1, first.serial) is True  # acknowledged: id 1 is free again
    await store.redis.hset(k.state, "pid", 65535)  # the cursor about to wrap: the next hand-out is id 1 again
    await store.save_batch(client_id, [msg(1), msg(2)])
    newer, after = await take(store, client_id)
    assert (newer.packet_id, after.packet_id) == (1, 2) and newer.serial != first.serial
    # the first connection's acknowledgement and PUBREC of id 1, retried late: nothing happens to the newer one
    assert await store.acknowledge(client_id, 1, first.serial) is False
    assert await store.mark_pubrec(client_id, 1, first.serial) is False
    assert await store.apply_acks([(client_id, 1, first.serial)], [(client_id, 1, first.serial)]) == (0, 0)
    left = await store.fetch_undelivered(client_id)
    assert [(d.serial, d.packet_id, d.packet_type) for d in left] == [
        (newer.serial, 1, PUBLISH), (after.serial, 2, PUBLISH)]
    assert await store.redis.hget(k.pids, 1) is not None  # still handed out to the newer message
    # its own serial applies; the same acknowledgement twice in a batch (with and without it) counts once
    assert await store.apply_acks([(client_id, 2, after.serial), (client_id, 2, 0)],
                                  [(client_id, 1, newer.serial)]) == (1, 1)
    assert await store.mark_pubrec(client_id, 1, newer.serial) is True  # a repeat finds it marked already
    left = await store.fetch_undelivered(client_id)
    assert [(d.serial, d.packet_id, d.packet_type) for d in left] == [(newer.serial, 1, PUBREL)]
    assert await store.acknowledge(client_id, 1) is True  # no serial: whatever holds the id
    assert await store.fetch_undelivered(client_id) == []
    assert int(await store.redis.hget(k.state, "bytes")) == 0


async def test_limit_trims_oldest(store_factory, client_id):
    store = await store_factory(messages_limit=5)
    await store.save_batch(client_id, [msg(i) for i in range(3)])
    saved = await store.save_batch(client_id, [msg(i) for i in range(3, 7)])
    assert [d.serial for d in saved] == [4, 5, 6, 7]
    assert store.stats.trimmed == 2
    assert seqs(await store.fetch_undelivered(client_id)) == [2, 3, 4, 5, 6]
    k = client_keys(client_id)
    r = store.redis
    assert await r.exists(k.message(1), k.message(2)) == 0  # payloads of trimmed ones deleted
    assert await r.zcard(k.messages) == 5

    # one batch larger than the limit: only its newest `limit` are stored and returned
    saved = await store.save_batch(client_id, [msg(i) for i in range(100, 108)])
    assert seqs(saved) == [103, 104, 105, 106, 107]
    assert seqs(await store.fetch_undelivered(client_id)) == [103, 104, 105, 106, 107]
    assert await r.zcard(k.messages) == 5
    serials = [d.serial for d in await store.fetch_undelivered(client_id)]
    assert serials == sorted(serials) and len(set(serials)) == 5


async def test_default_ttl_expiry(store_factory, client_id):
    store = await store_factory()
    k = client_keys(client_id)
    await store.save_batch(client_id, [msg(i) for i in range(3)], default_ttl=1)
    assert 0 < await store.redis.pttl(k.message(1)) <= 1000
    await take(store, client_id, max_messages=1)
    for key in (k.messages, k.pids, k.state):  # client keys expire with the last message (and a slack)
        assert 0 < await store.redis.pttl(key) <= keys_ttl_max(1000)
    assert len(await store.fetch_undelivered(client_id)) == 3

    async def gone():
        return await store.fetch_undelivered(client_id) == []

    await wait_until(gone, 5, "the client keys gone")


async def test_a_live_clients_state_has_no_ttl_and_outlives_its_last_message(store_factory, client_id):
    """A DEVICE client connected for longer than the TTL with nothing saved keeps its state: its `live` mark and
    serial cursor. Were the state to expire with its last message, its next messages would be stored and not
    forwarded (and their serials would start again below what the connection delivered) until it reconnected."""
    store = await store_factory()
    k, r = client_keys(client_id), store.redis
    await take(store, client_id)  # at the end of an empty store: live
    assert await r.pttl(k.state) == -1
    first = (await store.save_many_attached({client_id: [msg(1)]}, default_ttl=1))[client_id]
    assert first.attached == SVC and await r.pttl(k.state) == -1  # the deadline moved: not on a live state
    assert 0 < await r.pttl(k.messages) <= keys_ttl_max(1000)
    await store.apply_acks([(client_id, d.packet_id, d.serial) for d in first.messages])

    async def past_the_deadline():
        return await redis_ms(r) > int(await r.hget(k.state, "exp")) + 100

    await wait_until(past_the_deadline, 5, "the state's deadline passed")
    nxt = (await store.save_many_attached({client_id: [msg(2)]}))[client_id]
    assert nxt.attached == SVC and [d.serial for d in nxt.messages] == [first.messages[0].serial + 1]
    assert await store.detach(client_id, SVC.session_id)  # not live any more: it expires at its deadline again
    assert 0 < await r.pttl(k.state) <= keys_ttl_max(604_800_000)


async def test_a_state_that_stops_being_live_gets_its_deadline_back(store_factory, client_id):
    """Paused by the handed-out limit, or paging (a page that does not reach the end): not live, so the state
    expires at state.exp again; a new client detached before anything was saved leaves no state behind."""
    store = await store_factory(handed_out_limit=1)
    k, r = client_keys(client_id), store.redis
    await take(store, client_id)
    res = (await store.save_many_attached({client_id: [msg(1), msg(2)]}))[client_id]
    assert res.paused and await r.hget(k.state, "live") is None
    exp = int(await r.hget(k.state, "exp"))
    assert abs(await redis_ms(r) + await r.pttl(k.state) - exp) < 2000
    assert len(await take(store, client_id, max_messages=1)) == 1  # a page short of the end: still not live
    assert await r.pttl(k.state) > 0
    other = client_id + "-new"
    await take(store, other)
    assert await r.pttl(client_keys(other).state) == -1
    assert await store.detach(other, SVC.session_id)
    assert await r.pttl(client_keys(other).state) == -2  # nothing in it but `live`: gone, not left without a TTL


async def test_expired_reference_reused_after_wrap(store_factory, client_id):
    store = await store_factory()
    k = client_keys(client_id)
    r = store.redis
    await store.save_batch(client_id, [msg(0), msg(1)], default_ttl=1)
    await store.save_batch(client_id, [msg(2)], default_ttl=100)
    assert [d.packet_id for d in await take(store, client_id)] == [1, 2, 3]

    async def payloads_gone():
        return await r.exists(k.message(1), k.message(2)) == 0

    await wait_until(payloads_gone, 5, "the payloads gone")
    assert await r.zcard(k.messages) == 3 and await r.hlen(k.pids) == 3  # stale entries not cleaned yet
    await r.hset(k.state, "pid", 65535)
    await store.save_batch(client_id, [msg(3)])
    fetched = await take(store, client_id)
    # id 1 names an expired message: free again; the serial goes on
    assert [(d.packet_id, d.serial, int(d.msg.payload)) for d in fetched] == [(3, 3, 2), (1, 4, 3)]
    assert await r.zcard(k.messages) == 2  # the fetch dropped the stale references


async def test_client_keys_expire_with_last_message(store_factory, client_id):
    store = await store_factory()
    k = client_keys(client_id)
    r = store.redis
    await store.save_batch(client_id, [msg(0)], default_ttl=100)
    await store.save_batch(client_id, [msg(1)], default_ttl=1)  # shorter: must not shorten the keys
    await take(store, client_id, max_messages=1)
    for key in (k.messages, k.pids, k.state):
        assert 90_000 < await r.pttl(key) <= keys_ttl_max(100_000)
    await store.save_batch(client_id, [msg(2)], default_ttl=200)  # longer: extends them
    for key in (k.messages, k.pids, k.state):
        assert 190_000 < await r.pttl(key) <= keys_ttl_max(200_000)


async def test_keys_emptied_by_acknowledgements_get_a_ttl_again(store_factory, client_id):
    """A live client's ZSET and packet-id HASH are deleted by Redis when its acknowledgements empty them;
    the next save creates them anew, and they must get the keys' deadline again (a key without a TTL
    would outlive a client that never comes back)."""
    store = await store_factory()
    k = client_keys(client_id)
    r = store.redis
    await store.save_batch(client_id, [msg(0)], default_ttl=100)
    assert [d.packet_id for d in await take(store, client_id)] == [1]  # live from now on
    assert await store.acknowledge(client_id, 1) is True
    assert await r.exists(k.messages, k.pids) == 0  # emptied: gone
    assert await r.pttl(k.state) == -1  # a live client's state has no TTL (lua/packet_ids.lua, state_lifetime)
    exp = int(await r.hget(k.state, "exp"))
    state_ttl = exp - await redis_ms(r)
    assert 99_000 < state_ttl <= keys_ttl_max(100_000)
    saved = await store.save_batch(client_id, [msg(1)], default_ttl=50)  # forwarded: a packet id
    assert [d.packet_id for d in saved] == [2]
    for key in (k.messages, k.pids):
        assert state_ttl - 2_000 <= await r.pttl(key) <= state_ttl + 1_000  # the shared deadline
    assert int(await r.hget(k.state, "exp")) == exp  # a shorter TTL does not move the deadline


async def test_the_count_limit_holds_after_acknowledgements_emptied_the_store(store_factory, client_id):
    """With every message acknowledged (state.bytes "0": the ZSET is empty) a save counts no members
    (no ZCARD); the next one counts them again: the limit holds across both."""
    store = await store_factory(messages_limit=3)
    k = client_keys(client_id)
    r = store.redis
    await store.save_batch(client_id, [msg(0)])
    assert [d.packet_id for d in await take(store, client_id)] == [1]
    assert await store.acknowledge(client_id, 1) is True
    assert await r.hget(k.state, "bytes") == b"0" and await r.exists(k.messages) == 0
    assert [d.serial for d in await store.save_batch(client_id, [msg(i) for i in (1, 2, 3)])] == [2, 3, 4]
    assert store.stats.trimmed == 0
    await store.save_batch(client_id, [msg(4)])
    assert store.stats.trimmed == 1
    assert await r.zcard(k.messages) == 3
    assert int(await r.hget(k.state, "bytes")) == sum(
        int(m.split(b":")[1]) for m in await r.zrange(k.messages, 0, -1))
    assert 0 < await r.pttl(k.messages)


async def test_a_save_with_nothing_stored_hands_out_the_next_ids_over_stale_ones(store_factory, client_id):
    """Nothing stored (state.bytes "0"): an id the packet-id HASH still holds names a message that is gone
    (it expired unacknowledged), so a live save hands out the next ids without reading the HASH; an id that
    wraps onto a stale entry takes it over and its acknowledgement removes the new message. On standalone
    Redis the save is checked to read neither the HASH, the ZSET's size nor the attachment."""
    store = await store_factory()
    k = client_keys(client_id)
    r = store.redis
    await store.save_batch(client_id, [msg(0)])
    assert [d.packet_id for d in await take(store, client_id)] == [1]
    await r.delete(k.message(1))  # as if it expired unacknowledged
    assert await take(store, client_id) == []  # the reference is cleaned up; the end: live
    assert await r.hget(k.state, "bytes") == b"0" and await r.hlen(k.pids) == 1  # a stale entry for id 1
    standalone = not hasattr(r, "get_nodes")
    if standalone:
        await r.config_resetstat()
    assert [d.packet_id for d in await store.save_batch(client_id, [msg(1)])] == [2]
    if standalone:
        calls = {name.removeprefix("cmdstat_"): v["calls"] for name, v in (await r.info("commandstats")).items()}
        assert calls.get("hmget") == 1 and not {"hlen", "zcard", "get"} & calls.keys()  # the state's HMGET only
    assert await store.acknowledge(client_id, 2) is True
    await r.hset(k.state, "pid", 65535)  # the next id wraps to 1, the stale entry's
    assert [d.packet_id for d in await store.save_batch(client_id, [msg(2)])] == [1]
    assert (await r.hget(k.pids, 1)).startswith(b"3:")  # now names the new message (serial 3)
    assert await store.acknowledge(client_id, 1) is True
    assert await store.fetch_undelivered(client_id) == [] and await r.hget(k.state, "bytes") == b"0"


async def test_message_expiry(store_factory, client_id):
    store = await store_factory()
    k = client_keys(client_id)
    now = int(time.time() * 1000)
    batch = [
        msg(0),  # default TTL
        msg(1, message_expiry_interval=1, created_at_ms=now),  # expires in ~1 s
        msg(2, message_expiry_interval=5, created_at_ms=now - 10_000),  # already expired: not stored
        msg(3, message_expiry_interval=3600, created_at_ms=now - 600_000),  # 50 min left
    ]
    saved = await store.save_batch(client_id, batch)
    assert seqs(saved) == [0, 1, 3]
    assert store.stats.dropped_on_save == 1
    ttl0, ttl1, ttl3 = [await store.redis.pttl(k.message(serial)) for serial in (1, 2, 3)]
    assert 604_700_000 < ttl0 <= 604_800_000
    assert 0 < ttl1 <= 1000
    assert 2_990_000 < ttl3 <= 3_000_000

    async def expired():
        return seqs(await store.fetch_undelivered(client_id)) == [0, 3]

    await wait_until(expired, 5, "the expired messages gone")


async def test_pubrec_keeps_ttl_and_order(store_factory, client_id):
    store = await store_factory()
    k = client_keys(client_id)
    saved = await store.save_batch(client_id, [msg(i, qos=2) for i in range(3)], default_ttl=100)
    assert await store.mark_pubrec(client_id, 2) is False  # not handed out yet
    await take(store, client_id)
    assert await store.mark_pubrec(client_id, 2) is True
    pttl = await store.redis.pttl(k.message(2))
    assert 90_000 < pttl <= 100_000  # TBMQ's plain SET would leave -1 (no TTL)
    assert (await store.redis.get(k.message(2)))[:1] == b"R"
    fetched = await take(store, client_id)  # a re-send: the same packet ids
    assert [(d.packet_id, d.serial, d.packet_type) for d in fetched] == [
        (1, saved[0].serial, PUBLISH),
        (2, saved[1].serial, PUBREL),
        (3, saved[2].serial, PUBLISH),
    ]
    assert fetched[1].msg == saved[1].msg
    assert await store.mark_pubrec(client_id, 2) is True  # idempotent
    assert await store.mark_pubrec(client_id, 77) is False
    assert await store.acknowledge(client_id, 2) is True  # PUBCOMP


async def test_noscript_recovery(store_factory, client_id):
    store = await store_factory()
    r = store.redis
    sha = store._scripts["save_messages"].sha

    async def flush():
        await r.script_flush()
        exists = await r.script_exists(sha)
        assert not any(exists if isinstance(exists, list) else [exists])

    await flush()
    assert seqs(await store.save_batch(client_id, [msg(0)])) == [0]  # single EVALSHA path
    await flush()
    assert seqs(await take(store, client_id)) == [0]
    await flush()
    other = client_id + "-b"
    out = await store.save_many({client_id: [msg(1)], other: [msg(2)]})  # pipelined path
    assert seqs(out[client_id]) == [1] and seqs(out[other]) == [2]
    assert store.stats.noscript_reloads >= 1
    await flush()
    assert await store.mark_pubrec(client_id, 1) is True
    await flush()
    assert await store.acknowledge(client_id, 1) is True
    await flush()
    assert await store.detach(client_id, "s1") is True
    await flush()
    assert await store.clear(client_id) == 1
    assert await store.clear(other) == 1


async def test_clear(store_factory, client_id):
    store = await store_factory()
    k = client_keys(client_id)
    await store.save_batch(client_id, [msg(i) for i in range(4)])
    await store.save_batch(client_id, [msg(9)], default_ttl=1)

    async def short_one_gone():
        return await store.redis.exists(k.message(5)) == 0

    await wait_until(short_one_gone, 5, "the short-lived message gone")
    await take(store, client_id, max_messages=2)
    assert await store.clear(client_id) == 4  # the expired one is not counted
    assert await store.redis.exists(k.messages, k.pids, k.state, k.attached, *map(k.message, range(1, 6))) == 0
    assert await store.fetch_undelivered(client_id) == []
    assert await store.clear(client_id) == 0
    saved = await store.save_batch(client_id, [msg(0)])
    assert (saved[0].packet_id, saved[0].serial) == (0, 1)


async def test_save_many_clients(store_factory):
    store = await store_factory()
    batches = {f"many-{time.time_ns()}-{c}": [msg(c * 10 + i) for i in range(5)] for c in range(200)}
    out = await store.save_many(batches)
    assert out.keys() == batches.keys()
    for cid, saved in out.items():
        assert [d.serial for d in saved] == [1, 2, 3, 4, 5]
        assert all(d.client_id == cid for d in saved)
    out2 = await store.save_many({cid: [msg(999)] for cid in batches})
    assert all([(d.packet_id, d.serial) for d in v] == [(0, 6)] for v in out2.values())
    for cid in list(batches)[:20]:
        assert seqs(await store.fetch_undelivered(cid)) == seqs(batches[cid]) + [999]
    for cid in batches:
        assert await store.clear(cid) == 6


async def test_a_replayed_batch_is_stored_once_per_source_offset(store_factory, client_id):
    """device-persistence replays what it saved but had not committed (a crash) and retries a save whose
    reply it lost: the records' partition and offsets make the save apply each of them once, the new
    ones of a replayed batch are stored after the old ones, and a live client is forwarded only those."""
    store = await store_factory()
    other = client_id + "-other"
    first = await store.save_many_attached({client_id: [msg(1), msg(2), msg(3)], other: [msg(7)]},
                                           sources={client_id: Source(4, [10, 12, 13]), other: Source(2, [3])})
    assert [d.serial for d in first[client_id].messages] == [1, 2, 3]
    # the crash: the same records again, now with one more of each client behind them
    again = await store.save_many_attached({client_id: [msg(1), msg(2), msg(3), msg(4)], other: [msg(7), msg(8)]},
                                           sources={client_id: Source(4, [10, 12, 13, 20]), other: Source(2, [3, 9])})
    assert [(seqs([d])[0], d.serial) for d in again[client_id].messages] == [(4, 4)]
    assert again[client_id].indexes == [3]
    assert [(seqs([d])[0], d.serial) for d in again[other].messages] == [(8, 2)]
    assert store.stats.replayed == 4
    # entirely replayed: nothing stored, nothing forwarded, even to a live client
    await take(store, client_id)  # attached and live on SVC
    replay = await store.save_many_attached({client_id: [msg(3), msg(4)]}, sources={client_id: Source(4, [13, 20])})
    assert replay[client_id].messages == [] and replay[client_id].forwards == []
    new = await store.save_many_attached({client_id: [msg(4), msg(5)]}, sources={client_id: Source(4, [20, 21])})
    assert [(seqs([d])[0], d.serial) for d in new[client_id].forwards] == [(5, 5)]
    # another partition (the topic was resized) is not compared; no source: stored as given
    moved = await store.save_many_attached({client_id: [msg(6)]}, sources={client_id: Source(0, [1])})
    plain = await store.save_many_attached({client_id: [msg(6)]})
    assert [d.serial for d in moved[client_id].messages] == [6] and [d.serial for d in plain[client_id].messages] == [7]
    assert seqs(await store.fetch_undelivered(client_id)) == [1, 2, 3, 4, 5, 6, 6]
    assert seqs(await store.fetch_undelivered(other)) == [7, 8]
    await store.clear(client_id)
    await store.clear(other)


async def test_a_record_routed_again_is_stored_once_per_origin(store_factory, client_id):
    """A router that crashed routes its uncommitted tbmq.msg.all records again, as new tbmq.msg.persisted
    records: each save carries every record's origin (tbmq.msg.all partition and offset), and a record whose
    origin the client's store applied is dropped wherever it stands in the batch (origins of two partitions
    interleave), while the new records around it are stored in order and forwarded to a live client."""
    store = await store_factory()
    other = client_id + "-other"
    first = await store.save_many_attached(
        {client_id: [msg(1), msg(2), msg(3)], other: [msg(50)]},
        origins={client_id: [(0, 100), (1, 7), (0, 101)], other: [(0, 100)]})
    assert [(seqs([d])[0], d.serial) for d in first[client_id].messages] == [(1, 1), (2, 2), (3, 3)]
    await take(store, client_id)  # attached and live: saves are forwarded
    # the replay: partition 0 from 100 again, partition 1 from 7 again, interleaved with new records of both
    again = await store.save_many_attached(
        {client_id: [msg(1), msg(4), msg(2), msg(3), msg(5), msg(6)], other: [msg(50), msg(51)]},
        origins={client_id: [(0, 100), (2, 3), (1, 7), (0, 101), (1, 8), (0, 102)], other: [(0, 100), (0, 101)]})
    assert [(seqs([d])[0], d.serial) for d in again[client_id].messages] == [(4, 4), (5, 5), (6, 6)]
    assert again[client_id].indexes == [1, 4, 5]
    assert [seqs([d])[0] for d in again[client_id].forwards] == [4, 5, 6]
    assert [(seqs([d])[0], d.serial) for d in again[other].messages] == [(51, 2)]
    assert store.stats.routed_again == 4
    # a record without an origin (an older router) is stored as given; origins below the mark of a
    # partition are dropped even when they were never stored (routed before the client's subscription)
    mixed = await store.save_many_attached({client_id: [msg(7), msg(8), msg(9)]},
                                           origins={client_id: [None, (0, 99), (0, 103)]})
    assert [seqs([d])[0] for d in mixed[client_id].messages] == [7, 9]
    # both checks in one save: the source prefix first (device-persistence's own replay), then the origins
    both = await store.save_many_attached({client_id: [msg(9), msg(10), msg(11)]},
                                          sources={client_id: Source(3, [40, 41, 42])},
                                          origins={client_id: [(0, 103), (2, 3), (2, 4)]})
    assert [seqs([d])[0] for d in both[client_id].messages] == [11]
    replay = await store.save_many_attached({client_id: [msg(11), msg(12)]},
                                            sources={client_id: Source(3, [42, 43])},
                                            origins={client_id: [(2, 4), (2, 5)]})
    assert [seqs([d])[0] for d in replay[client_id].messages] == [12] and store.stats.replayed == 1
    assert seqs(await store.fetch_undelivered(client_id)) == [1, 2, 3, 4, 5, 6, 7, 9, 11, 12]
    assert seqs(await store.fetch_undelivered(other)) == [50, 51]
    await store.clear(client_id)
    await store.clear(other)


async def test_a_single_record_routed_again_is_stored_once(store_factory, client_id):
    """The usual save carries one record per client: the same origin rule (save_messages.lua takes a shorter
    way for it) whether the record is new, routed again, below the mark, or without an origin."""
    store = await store_factory()
    k = client_keys(client_id)

    async def save_one(seq: int, origin):
        res = await store.save_many_attached({client_id: [msg(seq)]}, origins={client_id: [origin]})
        return seqs(res[client_id].messages)

    assert await save_one(1, (3, 5)) == [1]
    assert await store.redis.hget(k.state, "o3") == b"5"
    await take(store, client_id)  # live: the rule is the same for a forwarded record
    assert await save_one(1, (3, 5)) == [] and store.stats.routed_again == 1  # routed again
    assert await save_one(2, (3, 4)) == [] and store.stats.routed_again == 2  # below the mark
    assert await save_one(3, None) == [3]  # no origin: stored as given, the mark unchanged
    assert await store.redis.hget(k.state, "o3") == b"5"
    assert await save_one(4, (7, 1)) == [4]  # another partition: its own mark
    assert await save_one(5, (3, 6)) == [5]
    assert (await store.redis.hget(k.state, "o3"), await store.redis.hget(k.state, "o7")) == (b"6", b"1")
    assert seqs(await store.fetch_undelivered(client_id)) == [1, 3, 4, 5]
    await store.clear(client_id)


async def test_a_live_save_hands_out_the_next_ids_whether_or_not_ids_are_in_use(store_factory, client_id):
    """A live client's save takes the ids after the cursor, wrapping from 65535 to 1: when none is in use
    (its messages all acknowledged: save_messages.lua then needs no look-up of the ids) and when some are,
    whose ids are skipped."""
    store = await store_factory()
    k = client_keys(client_id)
    assert await take(store, client_id) == []  # attached and live, nothing stored
    await store.redis.hset(k.state, "pid", 65534)
    first = (await store.save_many_attached({client_id: [msg(1), msg(2), msg(3)]}))[client_id]
    assert [d.packet_id for d in first.forwards] == [65535, 1, 2]  # none in use: the next three, wrapped
    assert await store.apply_acks([(client_id, 65535, 0), (client_id, 2, 0)]) == (2, 0)
    await store.redis.hset(k.state, "pid", 65535)  # id 1 still in use
    second = (await store.save_many_attached({client_id: [msg(4), msg(5)]}))[client_id]
    assert [d.packet_id for d in second.forwards] == [2, 3]  # 1 is skipped
    assert await store.apply_acks([(client_id, pid, 0) for pid in (1, 2, 3)]) == (3, 0)
    assert await store.redis.exists(k.pids) == 0  # nothing handed out any more
    third = (await store.save_many_attached({client_id: [msg(6)]}))[client_id]
    assert [d.packet_id for d in third.forwards] == [4]
    assert seqs(await store.fetch_undelivered(client_id)) == [6]
    await store.clear(client_id)


async def test_save_many_one_call_per_group_of_clients(store_factory, redis_backend):
    """save_many saves many clients per save_messages.lua call: all of them (up to
    save_clients_per_call) on standalone Redis, those of one hash slot on a cluster. Each client keeps
    its own packet ids, serials, limit and attachment."""
    store = await store_factory(save_clients_per_call=50, messages_limit=4)
    tag = time.time_ns()
    clients = [f"grp-{tag}-{c}" for c in range(120)]
    await store.fetch_undelivered(clients[7], attach=Attachment("conn-7", "s7"))  # live (nothing stored)
    batches = {cid: [msg(c * 10 + i) for i in range(1 + c % 6)] for c, cid in enumerate(clients)}
    out = await store.save_many_attached(batches)
    if redis_backend.get("cluster_nodes"):
        slots = Counter(key_slot(client_keys(cid).messages.encode()) for cid in clients)
        expected_calls = sum(-(-n // 50) for n in slots.values())
    else:
        expected_calls = 3  # 120 clients, 50 per call
    assert store.stats.save_calls == expected_calls
    for c, cid in enumerate(clients):
        n = 1 + c % 6
        kept = min(n, 4)  # the oldest of a batch above the limit are skipped
        res = out[cid]
        assert seqs(res.messages) == seqs(batches[cid])[n - kept:]
        live = c == 7  # forwarded: packet ids handed out at save time
        assert [(d.packet_id, d.serial) for d in res.messages] == [(i if live else 0, i) for i in range(1, kept + 1)]
        assert res.attached == (Attachment("conn-7", "s7") if live else None)
        assert res.forwards == (res.messages if live else [])
    assert seqs(await store.fetch_undelivered(clients[5])) == [52, 53, 54, 55]
    for cid in clients:
        if cid != clients[7]:
            await take(store, cid)
    # acknowledgements of many clients: one remove_message.lua call per group, grouped the same way
    acks = [(cid, pid, 0) for c, cid in enumerate(clients) for pid in range(1, min(1 + c % 6, 4) + 1) if pid != 2]
    acked, _ = await store.apply_acks(acks + [(clients[0], 999, 0)])
    assert acked == len(acks) and store.stats.ack_calls == expected_calls
    for c, cid in enumerate(clients[:12]):
        assert [d.packet_id for d in await store.fetch_undelivered(cid)] == ([2] if min(1 + c % 6, 4) >= 2 else [])
    for cid in clients:
        await store.clear(cid)


async def test_save_messages_bad_batch_writes_nothing(store_factory):
    """One malformed batch fails the whole multi-client call before anything is written."""
    store = await store_factory()
    base = f"bad-{time.time_ns()}"
    first = client_keys(base + "-a")
    slot = key_slot(first.messages.encode())
    # one slot (cluster): 16,384 slots, so 100,000 candidates missed it once in ~500 runs (StopIteration in
    # CI); 2,000,000 cannot in practice (e^-122)
    second = next(client_keys(f"{base}-{i}") for i in range(2_000_000)
                  if key_slot(client_keys(f"{base}-{i}").messages.encode()) == slot)
    keys = [first.messages, first.pids, first.state, first.attached,
            second.messages, second.pids, second.state, second.attached]
    good = b"604800000,4:P\x00\x00x"
    limits = [10, 1 << 20, 100]
    with pytest.raises(ResponseError, match="bad record"):
        await store._call("save_messages", keys, [*limits, good, b"604800000,9:P\x00\x00x"])
    with pytest.raises(ResponseError, match="bad record"):  # shorter than type byte + packet id
        await store._call("save_messages", keys, [*limits, good, b"604800000,2:Px"])
    # the TTL goes to SET PX as written: only plain digits (Lua's tonumber would take these, Redis would not
    # take them all, and a refusal half-way would leave the first client's message written)
    for ttl in (b"0604800000", b" 604800000", b"+604800000", b"6.048e8", b"0x240C8400", b"604800000.0", b"0",
                b"1" * 16):
        with pytest.raises(ResponseError, match="bad record"):
            await store._call("save_messages", keys, [*limits, good, ttl + b",4:P\x00\x00x"])
    assert await store.redis.exists(first.messages, first.message(1), second.messages) == 0
    with pytest.raises(ResponseError, match="source offsets of batch 2 must ascend"):
        await store._call("save_messages", keys, [*limits, good, b"@0:5,5;" + good + good])
    with pytest.raises(ResponseError, match="1 source offsets for 2 records in batch 2"):
        await store._call("save_messages", keys, [*limits, good, b"@0:5;" + good + good])
    with pytest.raises(ResponseError, match="bad source header of batch 1"):
        await store._call("save_messages", keys, [*limits, b"@x:5;" + good, good])
    assert await store.redis.exists(first.messages, first.message(1), second.messages) == 0
    with pytest.raises(ResponseError, match="bad origin header of batch 2"):
        await store._call("save_messages", keys, [*limits, good, b"#0:5,x;" + good + good])
    with pytest.raises(ResponseError, match="1 origins for 2 records in batch 2"):
        await store._call("save_messages", keys, [*limits, good, b"#0:5;" + good + good])
    assert await store.redis.exists(first.messages, first.message(1), second.messages) == 0
    reply = await store._call("save_messages", keys, [*limits, good, b"@0:5,6;#0:5,-;" + good + good])
    assert reply[:8] == [0, 0, 1, b"", b"", 0, 0, b""] and reply[8:12] == [0, 0, 1, b""]
    assert reply[15] == b"00"  # one mark per record: neither origin was applied before
    await store.clear(base + "-a")
    await store.redis.delete(second.messages, second.pids, second.state, second.message(1), second.message(2))


async def test_ten_thousand_messages_in_order(store_factory, client_id):
    store = await store_factory(messages_limit=10_000)
    for start in range(0, 10_000, 1000):
        saved = await store.save_batch(client_id, [msg(i) for i in range(start, start + 1000)])
        assert len(saved) == 1000
    fetched = await take(store, client_id)
    assert seqs(fetched) == list(range(10_000))
    assert [d.serial for d in fetched] == list(range(1, 10_001))
    assert [d.packet_id for d in fetched] == list(range(1, 10_001))
    # one more trims exactly the oldest
    await store.save_batch(client_id, [msg(10_000)])
    fetched = await store.fetch_undelivered(client_id)
    assert len(fetched) == 10_000 and seqs(fetched)[:2] == [1, 2] and seqs(fetched)[-1] == 10_000
    assert await store.redis.hget(client_keys(client_id).pids, 1) is None  # the trimmed one's id is free
    assert await store.clear(client_id) == 10_000


async def test_packet_id_wraparound_keeps_order(store_factory, client_id):
    """TBMQ #207: > 65535 messages through one session, handed out and acknowledged in batches while some
    stay unacknowledged across the wrap. Order is by serial, nothing is skipped, in-use ids are skipped,
    and an unacknowledged message keeps its packet id on every re-send."""
    store = await store_factory()
    batch, total = 5000, 70_000
    pinned = lambda s: s % 97 == 0  # noqa: E731 - never acknowledged until the end
    outstanding: list[int] = []
    pid_of: dict[int, int] = {}
    wrapped = False
    prev_pid = 0
    for start in range(0, total, batch):
        saved = await store.save_batch(client_id, [msg(s) for s in range(start, start + batch)])
        assert seqs(saved) == list(range(start, start + batch))
        fetched = await take(store, client_id)
        assert seqs(fetched) == outstanding + seqs(saved)  # serial order, nothing skipped
        in_use = {pid_of[s] for s in outstanding}
        for d in fetched:
            seq = int(d.msg.payload)
            if seq in pid_of:
                assert d.packet_id == pid_of[seq], "a re-sent message got another packet id"
                continue
            assert d.packet_id not in in_use, "packet id of an unacknowledged message reused"
            wrapped |= d.packet_id < prev_pid
            prev_pid = d.packet_id
            pid_of[seq] = d.packet_id
            in_use.add(d.packet_id)
        outstanding += seqs(saved)
        acked = [s for s in seqs(saved) if not pinned(s)]
        assert await store.acknowledge_many(client_id, [pid_of[s] for s in acked]) == len(acked)
        outstanding = [s for s in outstanding if pinned(s)]
    assert wrapped
    # after the wrap, ids of pinned messages (e.g. seq 0 -> id 1) were skipped, not overwritten
    assert pid_of[0] == 1 and pid_of[65_535] == 2
    fetched = await take(store, client_id)
    assert seqs(fetched) == [s for s in range(total) if pinned(s)]
    assert [d.packet_id for d in fetched] == [pid_of[s] for s in seqs(fetched)]
    assert await store.clear(client_id) == len(fetched)


async def test_client_keys_share_one_slot(redis_cluster):
    store = DeviceMsgStore(StoreConfig(cluster_nodes=tuple(redis_cluster.nodes)))
    await store.start()
    try:
        await _check_slots(store)
    finally:
        await store.close()


async def _check_slots(store):
    rc = store.redis
    for cid in ["plain", "", "}x", "%a", "a{b}c", "{x}", "ünï cødé/#+", "a}b"]:
        k = client_keys(cid)
        keys = [k.messages, k.pids, k.state, k.attached, k.message(1), k.message(65535)]
        slots = {await rc.cluster_keyslot(key) for key in keys}
        assert len(slots) == 1, (cid, keys)
        assert {rc.keyslot(key) for key in keys} == slots
        await store.save_batch(cid, [msg(1), msg(2)])
        fetched = await take(store, cid)
        assert seqs(fetched) == [1, 2] and [d.packet_id for d in fetched] == [1, 2]
        node = rc.get_node_from_key(k.messages)
        assert await rc.cluster_countkeysinslot(slots.pop()) >= 5
        assert node is rc.get_node_from_key(k.message(2))
        assert await store.clear(cid) == 2
    # clients are spread over the masters
    owners = {rc.get_node_from_key(client_keys(f"c{i}").messages).name for i in range(50)}
    assert len(owners) == 3


async def test_a_redis_that_stops_answering_fails_the_call_instead_of_hanging():
    # a black hole: accepts the connection, reads, never answers (a hung Redis host); no store fixture: the
    # point is a server that is not Redis at all
    import asyncio

    from redis.exceptions import TimeoutError as RedisTimeout

    async def swallow(reader, writer):
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = DeviceMsgStore(StoreConfig(redis_url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.5,
                                       connect_timeout_s=0.5))
    try:
        with pytest.raises(RedisTimeout):  # redis-py's own: not the wait_for bound below
            # bounded only for the test's own safety: without the socket timeout this would hang
            await asyncio.wait_for(store.start(), 30)
    finally:
        await store.close()
        server.close()
