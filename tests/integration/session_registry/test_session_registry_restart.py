"""Exactly-once and partition splitting: a registry SIGKILLed during a burst of connects and restarted
answers every request exactly once and loses no session; two instances split the request partitions and
one takes over the other's when it dies."""

from __future__ import annotations

import asyncio
import collections
import random
import uuid

import pytest
from session_registry_harness import eventually
from tbmq_launcher.services import readyz

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def health(port: int) -> dict:
    return await readyz(port)


async def answered_after_everything(connectors) -> None:
    """A marker CONNECTION_REQUEST from each fake connector on every partition of the request topic, and
    their answers: everything the registry answers for requests sent before is in the responses now."""
    _, n_parts = await connectors[0].request_partition("")
    keys: dict[int, str] = {}
    while len(keys) < n_parts:
        key = f"marker{uuid.uuid4().hex[:10]}"
        keys.setdefault((await connectors[0].request_partition(key))[0], key)
    for conn in connectors:
        await asyncio.gather(*(conn.connect(key, sei=0, clean_start=True) for key in keys.values()))


def answered_once(connectors, request_ids: set[str]) -> tuple[int, list[str]]:
    counts = collections.Counter(r.request_id for c in connectors for r in c.all_responses())
    missing = [rid for rid in request_ids if counts[rid] == 0]
    dupes = [rid for rid, n in counts.items() if n > 1]
    return len(missing), dupes


@pytest.mark.timeout(240)
async def test_sigkill_during_burst_answers_each_request_once(start_registry, connectors, sessions, cid):
    suite = await start_registry()
    a, b = await connectors(2)
    n = 600
    clients = [cid("burst") if i % 10 else cid("app") for i in range(n)]
    reqs = []
    for i, client in enumerate(clients):
        conn = a if i % 2 else b
        reqs.append((conn, conn.connect_request(client, sei=600 if i % 3 else 0, clean_start=bool(i % 4 == 0))))
    request_ids = {r.request_id for _, r in reqs}

    async def burst():
        for i in range(0, n, 20):
            futs = [await conn.producer.send("tbmq.client.session.event.request", r.SerializeToString(),
                                             key=r.session.client_id.encode()) for conn, r in reqs[i:i + 20]]
            await asyncio.gather(*futs)
            await asyncio.sleep(0.02)  # pacing: the burst is still running when the registry dies

    sender = asyncio.create_task(burst())
    await eventually(lambda: len(a.all_responses()) + len(b.all_responses()) >= 80, timeout=30,
                     what="first answers")
    before = len(a.all_responses()) + len(b.all_responses())
    await suite.kill_service("session-registry")
    await sender
    assert before < n, "the burst must still be running when the registry dies"
    await suite.start_service("session-registry")

    await eventually(lambda: answered_once([a, b], request_ids)[0] == 0, timeout=90, interval=0.2,
                     what="every request answered")
    # a duplicate answer would be a re-processed request: a marker request on every request partition, from
    # each connector, is processed after it and answered behind it on that connector's response topic
    await answered_after_everything([a, b])
    missing, dupes = answered_once([a, b], request_ids)
    assert missing == 0 and dupes == []
    assert all(r.success for c in (a, b) for r in c.all_responses())

    # no session lost: every client's record is the one of its request
    by_client = {r.session.client_id: r.session for _, r in reqs}
    await eventually(lambda: all((s := sessions.get(c)) is not None and s.session_id == by_client[c].session_id
                                 for c in clients), timeout=20, what="every session saved")
    # state rebuilt: resuming a persistent one reports it present
    persistent = [c for i, c in enumerate(clients) if i % 3]
    resp, _ = await a.connect(random.choice(persistent), sei=600)
    assert resp.session_present


@pytest.mark.timeout(240)
async def test_two_instances_split_partitions_and_take_over(start_registry, connectors, sessions, cid):
    suite = await start_registry(instances=2)
    h1 = suite.health_port("session-registry", 1)
    h2 = suite.health_port("session-registry", 2)

    async def split():
        p1, p2 = (await health(h1))["partitions"], (await health(h2))["partitions"]
        return p1 and p2 and not set(p1) & set(p2) and len(p1) + len(p2) == 24

    await eventually(split, timeout=30, interval=0.2, what="partitions split between the two")
    (c,) = await connectors(1)
    clients = [cid() for _ in range(60)]
    sids = {}
    for client in clients:
        resp, sids[client] = await c.connect(client, sei=600)
        assert resp.success and not resp.session_present
    for client in clients:
        await c.disconnect(client, sids[client])
    await eventually(lambda: all((s := sessions.get(x)) and not s.connected for x in clients), what="disconnected")

    await suite.kill_service("session-registry", 2)
    await eventually(lambda: health(h1), timeout=5)
    # the survivor takes every partition (after the dead member's session timeout) and knows every session
    for client in clients:
        resp, _ = await c.connect(client, sei=600, timeout=40)
        assert resp.success and resp.session_present, client
    assert len((await health(h1))["partitions"]) == 24
    _, dupes = answered_once([c], {r.request_id for r in c.all_responses()})
    assert dupes == []


@pytest.mark.timeout(240)
async def test_a_restarted_instance_gets_its_partitions_back_inside_the_dead_ones_session(start_registry,
                                                                                           connectors, cid):
    """Static membership (TBMQ_KAFKA_STATIC_MEMBERSHIP): a registry SIGKILLed and started again with the same
    service id is given its partitions back at once. With a 30 s group session, a CONNECT sent right after
    the restart is answered within 15 s; as a dynamic member the new instance waited for the dead one's
    session to end (about 30 s after the kill) before any request was processed."""
    suite = await start_registry({"TBMQ_SESSION_REGISTRY_SESSION_TIMEOUT_S": "30"})
    port = suite.health_port("session-registry")
    (c,) = await connectors(1)
    first, _ = await c.connect(cid(), sei=600)
    assert first.success
    await suite.kill_service("session-registry")
    await suite.start_service("session-registry")
    again, _ = await c.connect(cid(), sei=600, timeout=15)
    assert again.success
    assert len((await health(port))["partitions"]) == 24
