"""Shared DEVICE groups' offline store handed to the next member: connectors ×2 + router + session-registry +
device-persistence (+ Redis), paho-mqtt 3.1.1 persistent members (clean_session=False) of `$share/<g>/<u>/jobs/#`.

While no member is connected the router stores the group's copies under `ss_<g>_<filter>`
(tbmq_routing.shared_store_id); a persistent member that connects (or subscribes) fetches that store, gets the
messages through its connection's live packet-id allocator, and its PUBACKs remove them from the group store.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from connector_helpers import Tail
from mqtt_clients import PROBE, Client, poll, real, routed, run, wait_until
from suites import module_suite
from tbmq_launcher.launcher import Suite
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform.topics import MSG_PERSISTED
from tbmq_routing import shared_store_id

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("device_persistence.__main__") is None,
                       reason="device-persistence has no entry point yet (services/device-persistence)"),
]

N = 20


@pytest.fixture(scope="module")
async def ss(kafka, tmp_path_factory):
    # the router writes the group's copies to tbmq.msg.persisted (ROUTER_PERSIST_VIA=kafka), where the helpers
    # below see when it has stored them; the same routing goes over the Persist stream by default
    async with module_suite(kafka, tmp_path_factory, "suite-shared", connectors=2,
                            services=["session-registry", "device-persistence", "router", "connector"],
                            service_env={"router": {"ROUTER_PERSIST_VIA": "kafka"}}) as s:
        yield s


async def stored_count(suite: Suite, store_id: str) -> int:
    """Messages in device-persistence's Redis under `store_id`."""
    from tbmq_device_persistence.store import client_keys

    r = aioredis.from_url(suite.redis_url)
    try:
        return await r.zcard(client_keys(store_id).messages)
    finally:
        await r.aclose()


async def stored_at_least(suite: Suite, store_id: str, n: int, timeout: float = 20) -> None:
    async def enough() -> bool:
        return await stored_count(suite, store_id) >= n

    await wait_until(enough, timeout, f"{n} messages in {store_id}", step=0.1)


def job_copy_for(store_id: str) -> Callable:
    """Is a tbmq.msg.persisted record a copy of a job message (payload m<i>, not a probe) stored under
    `store_id`?"""
    key = store_id.encode()

    def match(r) -> bool:
        if r.key != key:
            return False
        m = pb.PersistedMsg()
        m.ParseFromString(r.value)
        return m.msg.payload[:1] == b"m"

    return match


async def jobs_to_group_store(suite: Suite, pub: Client, topic: str | Callable[[int], str], store_id: str) -> None:
    """Publish the N job messages (QoS 1, each acknowledged before the next) and wait until the router stored
    every one under the group store: a PUBACK says only that Kafka has it, and a member that connects while the
    router still routes would get the rest as a live member, not from the group store."""
    async with Tail(suite.bootstrap_servers, MSG_PERSISTED) as tail:
        for i in range(N):
            await run(pub.publish, topic(i) if callable(topic) else topic, b"m%d" % i, 1)
        await tail.wait_for_count(job_copy_for(store_id), N)


async def store_emptied(suite: Suite, store_id: str, timeout: float = 20) -> None:
    """Bounded wait until the members' acknowledgements (batched) removed everything from the store."""
    async def empty() -> bool:
        return await stored_count(suite, store_id) == 0

    await wait_until(empty, timeout, f"{store_id} emptied", step=0.1)


async def group_stores_now(suite: Suite, pub: Client, topic: str, store_id: str, timeout: float = 30) -> None:
    """Publish QoS 1 probes on `topic` until the router persists one under the group store id: it then knows
    that no member is connected (its session view lags the disconnects by a few ms)."""
    deadline = time.monotonic() + timeout
    key = store_id.encode()
    async with Tail(suite.bootstrap_servers, MSG_PERSISTED) as tail:
        i = 0
        while time.monotonic() < deadline:
            await run(pub.publish, topic, PROBE + b"off-%d" % i, 1)
            try:
                await tail.wait_for(lambda r: r.key == key, timeout=0.5)
                return
            except AssertionError:
                i += 1
    raise AssertionError(f"the router did not store for {store_id} within {timeout}s")


async def both_routed(pub: Client, a: Client, b: Client, topic: str) -> None:
    """The router knows both members (round robin: each gets a probe)."""
    await routed(pub, a, topic, 1)
    await routed(pub, b, topic, 1)


def indexes(c: Client, topic_prefix: str) -> list[int]:
    return [int(m.payload[1:]) for m in real(c.snapshot()) if m.topic.startswith(topic_prefix)]


async def test_offline_group_store_handed_to_the_member_that_reconnects_then_round_robin(ss, unique):
    u = unique("ss")
    filt = f"{u}/jobs/#"
    store = shared_store_id("g", filt)
    ports = ss.mqtt_ports
    pub = Client(u + "p")
    await run(pub.connect, ports[0])
    a = Client(u + "a", v5=False, clean=False)
    b = Client(u + "b", v5=False, clean=False)
    await run(a.connect, ports[0])
    await run(b.connect, ports[1])
    for m in (a, b):
        await run(m.subscribe, f"$share/g/{filt}", 1)
    await both_routed(pub, a, b, f"{u}/jobs/probe")
    await run(a.close, wait=True)
    await run(b.close, wait=True)
    await group_stores_now(ss, pub, f"{u}/jobs/probe", store)

    await jobs_to_group_store(ss, pub, lambda i: f"{u}/jobs/{i % 3}", store)
    await stored_at_least(ss, store, N)  # saved by device-persistence (after the PUBACKs: asynchronously)

    # member a comes back on the OTHER connector: every message of the group store, in order
    a2 = Client(u + "a", v5=False, clean=False)
    flags, _, _ = await run(a2.connect, ports[1])
    assert flags.session_present
    assert await run(a2.wait, lambda: len(indexes(a2, f"{u}/jobs/")) >= N), indexes(a2, f"{u}/jobs/")
    got = indexes(a2, f"{u}/jobs/")
    assert got == list(range(N)), got
    # its PUBACKs (local packet ids) removed them from the group store
    await store_emptied(ss, store)

    # mix: a online, b offline -> everything goes to a; then b back -> round robin; each message at least once
    for i in range(N, 2 * N):
        await run(pub.publish, f"{u}/jobs/x", b"m%d" % i, 1)
    assert await poll(lambda: set(indexes(a2, f"{u}/jobs/")) >= set(range(2 * N)), 30)
    await store_emptied(ss, store)  # (copies the router stored for the group before it saw a2 are acked)
    b2 = Client(u + "b", v5=False, clean=False)
    flags, _, _ = await run(b2.connect, ports[0])
    assert flags.session_present
    await both_routed(pub, a2, b2, f"{u}/jobs/probe")
    for i in range(2 * N, 4 * N):
        await run(pub.publish, f"{u}/jobs/y", b"m%d" % i, 1)

    def union() -> list[int]:
        return indexes(a2, f"{u}/jobs/") + indexes(b2, f"{u}/jobs/")

    assert await poll(lambda: set(union()) >= set(range(4 * N)), 30), sorted(set(range(4 * N)) - set(union()))
    everything = union()  # duplicates (at least once) are only reported: one still in flight is not counted
    dups = len(everything) - len(set(everything))
    assert set(everything) == set(range(4 * N)), "lost: " + str(sorted(set(range(4 * N)) - set(everything)))
    print(f"\n{4 * N} messages, {dups} duplicates across the group")
    got_b = indexes(b2, f"{u}/jobs/")
    assert got_b and all(i >= 2 * N for i in got_b)  # b was offline for the first 2N (a connected)
    for c in (a2, b2):  # no reordering within a member
        idx = indexes(c, f"{u}/jobs/")
        assert idx == sorted(idx), idx
    for c in (a2, b2, pub):
        await run(c.close)


async def test_group_messages_not_acknowledged_are_redelivered_to_the_next_member(ss, unique):
    u = unique("sr")
    filt = f"{u}/jobs/#"
    store = shared_store_id("g", filt)
    ports = ss.mqtt_ports
    pub = Client(u + "p")
    await run(pub.connect, ports[0])
    c = Client(u + "c", v5=False, clean=False)
    d = Client(u + "d", v5=False, clean=False)
    await run(c.connect, ports[0])
    await run(d.connect, ports[1])
    for m in (c, d):
        await run(m.subscribe, f"$share/g/{filt}", 1)
    await both_routed(pub, c, d, f"{u}/jobs/probe")
    await run(c.close, wait=True)
    await run(d.close, wait=True)
    await group_stores_now(ss, pub, f"{u}/jobs/probe", store)
    await jobs_to_group_store(ss, pub, f"{u}/jobs/1", store)

    # c comes back but never acknowledges (paho manual ack), then goes away
    c2 = Client(u + "c", v5=False, clean=False)
    c2.c.manual_ack_set(True)
    await run(c2.connect, ports[1])
    assert await run(c2.wait, lambda: len(indexes(c2, f"{u}/jobs/")) >= N)
    assert indexes(c2, f"{u}/jobs/") == list(range(N))
    await run(c2.close, wait=True)
    await stored_at_least(ss, store, N)  # nothing acknowledged: still in the group store

    # d gets them all again (DUP=1), in order, and acknowledges them
    d2 = Client(u + "d", v5=False, clean=False)
    await run(d2.connect, ports[0])
    assert await run(d2.wait, lambda: len(indexes(d2, f"{u}/jobs/")) >= N)
    assert indexes(d2, f"{u}/jobs/") == list(range(N))
    assert all(m.dup for m in real(d2.snapshot()) if m.topic.startswith(f"{u}/jobs/"))
    await store_emptied(ss, store)
    for x in (d2, pub):
        await run(x.close)
