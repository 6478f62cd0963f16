"""Backlogs beyond 65535 messages, fetched in pages (issue 12 goal 6b, issue 14 "stored backlogs fetched in
pages"): packet ids are handed out with pages / live forwards and kept until acknowledged; order is by
serial; a client is live only once a page reached the end; the handed-out limit sends a live client back to
paging; the byte limit trims oldest first. Real Redis, standalone and cluster (`redis_backend`)."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb
from tbmq.v1 import services_pb2 as spb

from tbmq_device_persistence.store import Attachment, client_keys
from waits import wait_until

pytestmark = pytest.mark.asyncio(loop_scope="session")


def msg(seq: int, pad: int = 0) -> pb.PublishMsg:
    return pb.PublishMsg(topic="t", payload=b"%06d" % seq + b" " * pad, qos=1)  # one size for every seq


def seqs(items) -> list[int]:
    return [int(d.msg.payload) for d in items]


async def page(store, cid, att, after=0, *, first=False, n=500, nbytes=0):
    resp = await store.fetch_undelivered_response(cid, att, check=not first, after=after, max_messages=n,
                                                  max_bytes=nbytes)
    assert not resp.not_attached
    return list(resp.messages), resp.more


async def test_hundred_thousand_offline_messages_fetched_in_pages(store_factory, client_id):
    store = await store_factory(messages_limit=1_000_000)
    total = 100_000
    for start in range(0, total, 5000):
        saved = await store.save_batch(client_id, [msg(i) for i in range(start, start + 5000)])
        assert len(saved) == 5000 and all(d.packet_id == 0 for d in saved)  # offline: no packet id yet
    att = Attachment("conn", "s1")
    got: list[int] = []
    in_use: set[int] = set()
    after, first, more = 0, True, True
    while more:
        messages, more = await page(store, client_id, att, after, first=first)
        first = False
        assert messages or not more
        pids = [d.packet_id for d in messages]
        assert 0 not in pids and len(set(pids)) == len(pids) and not in_use & set(pids)  # unique among unacked
        in_use |= set(pids)
        got += seqs(messages)
        after = messages[-1].serial if messages else after
        # the client acknowledges the page: its ids are free again
        assert await store.acknowledge_many(client_id, pids) == len(pids)
        in_use -= set(pids)
        assert await store.redis.hlen(client_keys(client_id).pids) == 0
    assert got == list(range(total))  # all of them, in serial order, each once
    assert await store.fetch_undelivered(client_id) == []
    # caught up: live, so the next message is forwarded with a packet id
    res = await store.save_batch_attached(client_id, [msg(total)])
    assert res.attached == att and [d.packet_id for d in res.forwards] == [res.messages[0].packet_id] != [0]
    await store.clear(client_id)


async def test_a_reconnect_re_sends_unacknowledged_messages_with_their_packet_ids(store_factory, client_id):
    store = await store_factory(messages_limit=1_000_000)
    await store.save_batch(client_id, [msg(i) for i in range(3000)])
    first, more = await page(store, client_id, Attachment("conn", "s1"), first=True, n=1000)
    second, more = await page(store, client_id, Attachment("conn", "s1"), first[-1].serial, n=1000)
    assert more and seqs(first + second) == list(range(2000))
    acked = [d.packet_id for d in first[::2]]
    assert await store.acknowledge_many(client_id, acked) == len(acked)
    pid_of = {int(d.msg.payload): d.packet_id for d in first + second}
    # the connection drops; the client comes back on another connector
    again, more = await page(store, client_id, Attachment("conn2", "s2"), first=True, n=2000)
    assert more and seqs(again)[:1500] == [s for s in range(2000) if s >= 1000 or s % 2]
    assert [d.packet_id for d in again[:1500]] == [pid_of[s] for s in seqs(again[:1500])]  # MQTT-4.4.0-1
    fresh = [d.packet_id for d in again[1500:]]
    assert seqs(again[1500:]) == list(range(2000, 2500)) and not set(fresh) & set(pid_of.values())
    # the old connection's late page: refused, it must not take the client back
    resp = await store.fetch_undelivered_response(client_id, Attachment("conn", "s1"), check=True,
                                                  after=second[-1].serial, max_messages=10)
    assert resp.not_attached
    await store.clear(client_id)


async def test_saved_while_paging_comes_after_the_backlog_and_live_starts_when_caught_up(store_factory, client_id):
    store = await store_factory()
    att = Attachment("conn", "s1")
    await store.save_batch(client_id, [msg(i) for i in range(30)])
    got, more = await page(store, client_id, att, first=True, n=10)
    assert more
    res = await store.save_batch_attached(client_id, [msg(i) for i in range(30, 35)])
    assert res.attached is None and res.forwards == []  # still paging: stays in Redis, no packet id
    assert all(d.packet_id == 0 for d in res.messages)
    while more:
        messages, more = await page(store, client_id, att, got[-1].serial, n=10)
        got += messages
    assert seqs(got) == list(range(35))  # the ones saved while paging come after the backlog
    res = await store.save_batch_attached(client_id, [msg(35), msg(36)])
    assert res.attached == att and seqs(res.forwards) == [35, 36]  # live now
    pids = [d.packet_id for d in got + res.forwards]
    assert len(set(pids)) == 37 and 0 not in pids
    # a new connection's first page stops the forwards to the old one at once
    await page(store, client_id, Attachment("conn2", "s2"), first=True, n=5)
    res = await store.save_batch_attached(client_id, [msg(37)])
    assert res.attached is None and res.forwards == []
    await store.clear(client_id)


async def test_a_live_client_that_does_not_acknowledge_falls_back_to_paging(store_factory, client_id):
    store = await store_factory(handed_out_limit=50)
    att = Attachment("conn", "s1")
    _, more = await page(store, client_id, att, first=True)
    assert not more  # nothing stored: live
    res = await store.save_batch_attached(client_id, [msg(i) for i in range(80)])
    assert res.attached == att and seqs(res.forwards) == list(range(50)) and res.paused
    res = await store.save_batch_attached(client_id, [msg(80)])
    assert res.forwards == [] and not res.paused  # paging: nothing forwarded, already paused
    forwarded = [d.packet_id for d in (await store.fetch_undelivered(client_id))[:50]]
    after = 50  # serials 1..50 were forwarded
    messages, more = await page(store, client_id, att, after)
    assert messages == [] and more  # no packet id free: nothing more until acknowledgements
    assert await store.acknowledge_many(client_id, forwarded[:30]) == 30
    messages, more = await page(store, client_id, att, after)
    assert seqs(messages) == list(range(50, 80)) and more
    assert await store.acknowledge_many(client_id, forwarded[30:] + [d.packet_id for d in messages]) == 50
    messages, more = await page(store, client_id, att, messages[-1].serial)
    assert seqs(messages) == [80] and not more  # caught up: live again
    res = await store.save_batch_attached(client_id, [msg(81)])
    assert seqs(res.forwards) == [81]
    await store.clear(client_id)


async def test_byte_limit_trims_oldest_first(store_factory, client_id):
    store = await store_factory(bytes_limit=4096)
    k = client_keys(client_id)
    size = len(msg(0, pad=500).SerializeToString()) + 3  # stored value: type byte + packet id + PublishMsg
    await store.save_batch(client_id, [msg(i, pad=500) for i in range(5)])
    await store.fetch_undelivered(client_id, attach=Attachment("conn", "s1"), max_messages=2)  # 2 handed out
    await store.save_batch(client_id, [msg(i, pad=500) for i in range(5, 12)])
    kept = 4096 // size
    stored = await store.fetch_undelivered(client_id)
    assert seqs(stored) == list(range(12 - kept, 12)) and store.stats.trimmed == 12 - kept
    assert int(await store.redis.hget(k.state, "bytes")) == kept * size
    assert await store.redis.hlen(k.pids) == 0  # the trimmed handed-out ones freed their ids
    # one batch alone above the byte limit: only its newest messages that fit are stored
    saved = await store.save_batch(client_id, [msg(i, pad=500) for i in range(100, 120)])
    assert seqs(saved) == list(range(120 - kept, 120))
    assert seqs(await store.fetch_undelivered(client_id)) == list(range(120 - kept, 120))
    # acknowledgements give the bytes back
    got = await store.fetch_undelivered(client_id, attach=Attachment("conn", "s1"))
    assert await store.acknowledge_many(client_id, [d.packet_id for d in got]) == kept
    assert int(await store.redis.hget(k.state, "bytes")) == 0
    await store.clear(client_id)


async def test_page_byte_bound(store_factory, client_id):
    store = await store_factory()
    size = len(msg(0, pad=1000).SerializeToString()) + 3
    await store.save_batch(client_id, [msg(i, pad=1000) for i in range(10)])
    att = Attachment("conn", "s1")
    messages, more = await page(store, client_id, att, first=True, n=0, nbytes=3 * size + 1)
    assert seqs(messages) == [0, 1, 2] and more
    messages, more = await page(store, client_id, att, messages[-1].serial, n=0, nbytes=1)  # first always fits
    assert seqs(messages) == [3] and more
    await store.clear(client_id)


async def test_expired_references_inside_a_bounded_page_do_not_shorten_it(store_factory, client_id):
    """A page is read a chunk at a time (one MGET of the values per chunk): references whose value expired
    are dropped and do not count, so the page still holds `n` live messages when there are that many."""
    store = await store_factory()
    att = Attachment("conn", "s1")
    await store.save_batch(client_id, [msg(i) for i in range(2)])
    await store.save_batch(client_id, [msg(i) for i in range(2, 5)], default_ttl=1)
    await store.save_batch(client_id, [msg(i) for i in range(5, 10)])

    async def expired() -> bool:
        return await store.redis.exists(*(client_keys(client_id).message(s) for s in range(3, 6))) == 0

    await wait_until(expired, 5, "the three short-lived messages expired")
    messages, more = await page(store, client_id, att, first=True, n=5)
    assert seqs(messages) == [0, 1, 5, 6, 7] and more
    assert [d.packet_id for d in messages] == [1, 2, 3, 4, 5]  # handed out in order, none for the expired
    assert await store.redis.zcard(client_keys(client_id).messages) == 7  # the stale references dropped
    messages, more = await page(store, client_id, att, messages[-1].serial, n=5)
    assert seqs(messages) == [8, 9] and not more
    await store.clear(client_id)


async def test_ids_of_messages_that_expired_unacknowledged_do_not_count_towards_the_limit(store_factory, client_id):
    store = await store_factory(handed_out_limit=5)
    att = Attachment("conn", "s1")
    await store.save_batch(client_id, [msg(i) for i in range(5)], default_ttl=1)
    await store.save_batch(client_id, [msg(i) for i in range(5, 8)])
    messages, more = await page(store, client_id, att, first=True, n=100)
    assert seqs(messages) == list(range(5)) and more  # five ids in use: the limit

    async def expired() -> bool:
        return await store.redis.exists(*(client_keys(client_id).message(s) for s in range(1, 6))) == 0

    await wait_until(expired, 5, "the five handed-out messages expired")
    messages, more = await page(store, client_id, att, 5, n=100)  # their ids are free again
    assert seqs(messages) == [5, 6, 7] and not more
    await store.clear(client_id)


async def test_a_check_page_that_does_not_reach_the_end_stops_the_forwards(store_factory, client_id):
    """The re-sync after a device-persistence restart: the client was live when the backlog grew (its
    forwards were handed out but never reached it), so the re-sync page (`check`) does not reach the end.
    From then on saves must wait for the pages: forwarded, they would jump ahead of the backlog."""
    store = await store_factory(messages_limit=1_000_000)
    att = Attachment("conn", "s1")
    _, more = await page(store, client_id, att, first=True)
    assert not more                                       # live
    res = await store.save_batch_attached(client_id, [msg(i) for i in range(30)])
    assert res.attached == att and seqs(res.forwards) == list(range(30))  # forwards that got lost
    got, more = await page(store, client_id, att, 0, n=10)  # the re-sync: after the last serial delivered (0)
    assert more and seqs(got) == list(range(10))
    assert all(d.redelivery for d in got)                 # handed out before (the lost forwards): DUP
    res = await store.save_batch_attached(client_id, [msg(30)])
    assert res.attached is None and res.forwards == []    # not live while paging: waits in Redis
    while more:
        messages, more = await page(store, client_id, att, got[-1].serial, n=10)
        got += messages
    assert seqs(got) == list(range(31))                   # the backlog, then what was saved meanwhile
    assert not got[-1].redelivery                         # never handed out before: DUP=0
    res = await store.save_batch_attached(client_id, [msg(31)])
    assert res.attached == att and seqs(res.forwards) == [31]  # caught up: live again
    await store.clear(client_id)


async def test_a_page_read_in_parts_is_the_page_read_at_once(store_factory, client_id):
    """A page larger than `fetch_chunk_messages` is read in several script calls (each sent before the previous
    part is encoded): the answer is the one a single call gives, and its byte bound holds across the parts
    (only the page's first message may exceed it)."""
    store = await store_factory(fetch_chunk_messages=4)
    for i in range(30):
        await store.save_batch(client_id, [msg(i)])
    size = len(pb.PublishMsg(topic="t", payload=b"000000", qos=1).SerializeToString()) + 3  # a stored value
    att = Attachment("conn", "s1")
    got, more = await page(store, client_id, att, first=True, n=10)          # parts of 4, 4 and 2
    assert seqs(got) == list(range(10)) and more
    assert [d.serial for d in got] == list(range(1, 11)) and len({d.packet_id for d in got}) == 10
    got, more = await page(store, client_id, att, after=10, n=0, nbytes=4 * size + 1)  # one byte left: the
    assert seqs(got) == list(range(10, 14)) and more                          # next part's first does not fit
    got, more = await page(store, client_id, att, after=14, n=0, nbytes=7 * size - 1)  # part 2 ends at the bytes
    assert seqs(got) == list(range(14, 20)) and more
    got, more = await page(store, client_id, att, after=20, n=0)              # no bound: to the end
    assert seqs(got) == list(range(20, 30)) and not more
    res = await store.save_batch_attached(client_id, [msg(30)])               # caught up: live
    assert res.attached == att and res.forwards and res.forwards[0].packet_id != 0
    # the same backlog read at once (one part) gives the same answer
    other = f"{client_id}-b"
    whole = await store_factory(fetch_chunk_messages=1000)
    for i in range(30):
        await whole.save_batch(other, [msg(i)])
    a = (await store.fetch_undelivered_response(other, None, max_messages=25)).SerializeToString()
    b = (await whole.fetch_undelivered_response(other, None, max_messages=25)).SerializeToString()
    assert a == b and len(spb.FetchUndeliveredResponse.FromString(a).messages) == 25
    await store.clear(client_id)
    await store.clear(other)


async def test_a_newer_session_between_two_parts_ends_the_page(store_factory, client_id):
    store = await store_factory(fetch_chunk_messages=3)
    await store.save_batch(client_id, [msg(i) for i in range(10)])
    real_call = store._call
    calls = 0

    async def call(name, keys, args):
        nonlocal calls
        calls += 1
        if calls == 2:  # another connection attaches the client between the page's first and second part
            await real_call(name, keys, [Attachment("conn2", "s2").encode(), "attach", 0, 1, 0, *args[5:7]])
        return await real_call(name, keys, args)

    store._call = call
    resp = await store.fetch_undelivered_response(client_id, Attachment("conn", "s1"), max_messages=9)
    assert not resp.not_attached and seqs(resp.messages) == [0, 1, 2] and resp.more
    assert (await store.attachment(client_id)) == Attachment("conn2", "s2")
    await store.clear(client_id)
