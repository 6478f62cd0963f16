"""Attachment protocol of the store (fetch_undelivered.lua attaches, save_messages.lua reports the
attachment, detach.lua / clear_all.lua remove it) against real Redis, standalone and cluster."""

from __future__ import annotations

import asyncio
import random

import pytest
from tbmq.v1 import messages_pb2 as pb

from tbmq_device_persistence.store import Attachment, client_keys

pytestmark = pytest.mark.asyncio(loop_scope="session")


def msg(seq: int) -> pb.PublishMsg:
    return pb.PublishMsg(topic=f"t/{seq}", payload=b"%d" % seq, qos=1)


def seqs(items) -> list[int]:
    return [int(d.msg.payload) for d in items]


async def test_fetch_attaches_and_save_reports_it(store_factory, client_id):
    store = await store_factory()
    before = await store.save_batch_attached(client_id, [msg(0), msg(1)])
    assert before.attached is None and seqs(before.messages) == [0, 1]
    a = Attachment("connector-1", "sess-a")
    assert seqs(await store.fetch_undelivered(client_id, attach=a)) == [0, 1]
    assert await store.attachment(client_id) == a
    after = await store.save_batch_attached(client_id, [msg(2)])
    assert after.attached == a and seqs(after.messages) == [2]
    many = await store.save_many_attached({client_id: [msg(3)], client_id + "-other": [msg(9)]})
    assert many[client_id].attached == a and seqs(many[client_id].messages) == [3]
    assert many[client_id + "-other"].attached is None
    # a plain fetch (no attach) leaves the attachment alone
    assert seqs(await store.fetch_undelivered(client_id)) == [0, 1, 2, 3]
    assert await store.attachment(client_id) == a
    # the attachment key is in the client's slot and has no TTL
    k = client_keys(client_id)
    assert await store.redis.pttl(k.attached) == -1
    await store.clear(client_id + "-other")


async def test_detach_only_own_session(store_factory, client_id):
    store = await store_factory()
    assert await store.detach(client_id, "nobody") is False
    old, new = Attachment("connector-1", "s-old"), Attachment("connector-2", "s-new")
    await store.fetch_undelivered(client_id, attach=old)
    await store.fetch_undelivered(client_id, attach=new)  # reconnect elsewhere before the old Detach
    assert await store.detach(client_id, "s-old") is False  # late Detach of the old connection
    assert await store.attachment(client_id) == new
    assert (await store.save_batch_attached(client_id, [msg(0)])).attached == new
    assert await store.detach(client_id, "s-new") is True
    assert await store.attachment(client_id) is None
    assert (await store.save_batch_attached(client_id, [msg(1)])).attached is None
    assert await store.detach(client_id, "s-new") is False
    # a session id that merely ends like the stored one does not match
    await store.fetch_undelivered(client_id, attach=Attachment("c", "xyz"))
    assert await store.detach(client_id, "yz") is False
    assert await store.clear(client_id) == 2


async def test_state_live_is_only_ever_the_attachment(store_factory, client_id):
    """save_messages.lua forwards to state.live without reading the attachment: detach.lua removes the
    mark with the attachment, and only with its own session's."""
    store = await store_factory()
    k = client_keys(client_id)
    r = store.redis
    old, new = Attachment("connector-1", "s-old"), Attachment("connector-2", "s-new")
    await store.fetch_undelivered(client_id, attach=old)  # the end of the backlog: live
    assert Attachment.decode(await r.hget(k.state, "live")) == old
    await store.fetch_undelivered(client_id, attach=new)  # reconnect elsewhere before the old Detach
    assert Attachment.decode(await r.hget(k.state, "live")) == new
    assert await store.detach(client_id, "s-old") is False
    assert Attachment.decode(await r.hget(k.state, "live")) == new  # the new session's mark stays
    assert (await store.save_batch_attached(client_id, [msg(0)])).attached == new
    assert await store.detach(client_id, "s-new") is True
    assert await r.hget(k.state, "live") is None and await store.attachment(client_id) is None
    detached = await store.save_batch_attached(client_id, [msg(1)])
    assert detached.attached is None and seqs(detached.messages) == [1]
    assert [d.packet_id for d in detached.messages] == [0]  # stored, no packet id handed out
    again = Attachment("connector-1", "s-again")
    assert seqs(await store.fetch_undelivered(client_id, attach=again)) == [0, 1]
    assert (await store.save_batch_attached(client_id, [msg(2)])).attached == again
    assert await store.clear(client_id) == 3


async def test_clear_removes_attachment(store_factory, client_id):
    store = await store_factory()
    await store.fetch_undelivered(client_id, attach=Attachment("connector-1", "s"))
    await store.save_batch(client_id, [msg(0)])
    assert await store.clear(client_id) == 1
    assert await store.attachment(client_id) is None
    k = client_keys(client_id)
    assert await store.redis.exists(k.messages, k.pids, k.state, k.attached) == 0


async def test_service_id_with_bar_refused(store_factory, client_id):
    store = await store_factory()
    with pytest.raises(ValueError, match=r"\|"):
        await store.fetch_undelivered(client_id, attach=Attachment("a|b", "s"))


async def test_no_message_stranded_while_reattaching(store_factory, client_id):
    """Saves race with fetch+attach: each saved message is either in the answer of the first fetch
    that followed it, or reported as saved while attached (to be forwarded). Never neither."""
    store = await store_factory()
    total = 3000
    saved_with: dict[int, Attachment | None] = {}
    fetched_by: dict[int, list[int]] = {}

    async def producer():
        seq = 0
        while seq < total:
            n = random.randint(1, 20)
            batch = [msg(s) for s in range(seq, min(seq + n, total))]
            res = await store.save_batch_attached(client_id, batch)
            for d in res.messages:
                saved_with[int(d.msg.payload)] = res.attached
            seq += len(batch)
            await asyncio.sleep(0)

    async def reconnector():
        i = 0
        while len(saved_with) < total:
            i += 1
            a = Attachment(f"connector-{i % 2}", f"s{i}")
            got = await store.fetch_undelivered(client_id, attach=a)
            fetched_by[i] = seqs(got)
            await asyncio.sleep(random.random() * 0.002)  # jitter: vary the interleaving with the saves
            await store.detach(client_id, a.session_id)
            await asyncio.sleep(random.random() * 0.002)  # jitter

    await asyncio.gather(producer(), reconnector())
    assert len(fetched_by) > 3
    final = set(seqs(await store.fetch_undelivered(client_id)))
    in_some_fetch = set().union(*map(set, fetched_by.values())) | final
    for s in range(total):
        assert saved_with[s] is not None or s in in_some_fetch, f"message {s} stranded"
    # every fetch answer is in serial (= send) order
    for got in fetched_by.values():
        assert got == sorted(got)
    await store.clear(client_id)
