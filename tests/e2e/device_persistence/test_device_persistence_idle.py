"""A persistent DEVICE client connected for longer than the stored messages' TTL with nothing sent to it keeps
getting its messages, end to end (session-registry, device-persistence, router, connector; real Kafka and Redis;
a paho-mqtt 3.1.1 subscriber with clean_session=False).

The client's Redis keys expire with its last message (`state.exp`); a live client's state has no TTL
(lua/packet_ids.lua, state_lifetime). Before it did, the state expired while the client stayed connected, with
its `live` mark, and its next messages were stored and not forwarded until it reconnected. The suite runs with a
1-second TTL and held forwards off: held copies are forwarded from memory whatever Redis holds, so only the
stored path shows it (as QoS 2, ROUTER_PERSIST_VIA=kafka, or a held client after a spill take it).
"""

from __future__ import annotations

import uuid

import pytest
from mqtt_clients import Client, run, wait_until
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

from tbmq_device_persistence.store import DeviceMsgStore, StoreConfig

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]

TTL_S = 1


@pytest.fixture(scope="module")
async def stack(kafka, tmp_path_factory):
    s = Suite(services=["session-registry", "device-persistence", "router", "connector"], ports="free",
              log_format="json", id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-dp-idle"),
              start_timeout=90, stop_timeout=15,
              kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers,
              env={"MQTT_PERSISTENT_SESSION_DEVICE_PERSISTED_MESSAGES_TTL": str(TTL_S),
                   "DEVICE_PERSISTENCE_HELD": "false"})
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.mark.timeout(180)
async def test_a_client_connected_past_the_ttl_with_nothing_sent_still_gets_its_messages(stack):
    u = f"dp-idle-{uuid.uuid4().hex[:8]}"
    topic = f"{u}/cmd"
    port = stack.mqtt_ports[0]
    sub = Client(u, v5=False, clean=False, timeout=30.0)
    pub = Client(u + "-pub", v5=False)
    store = DeviceMsgStore(StoreConfig(redis_url=stack.redis_url,
                                       cluster_nodes=tuple(stack.redis_cluster_nodes or ())))
    await store.start()
    try:
        await run(sub.connect, port)
        assert [rc.value for rc in await run(sub.subscribe, topic, qos=1)] == [1]
        await run(pub.connect, port)
        await run(pub.publish, topic, b"1", qos=1)
        assert await run(sub.wait, lambda: [m.payload for m in sub.messages] == [b"1"], 30), "first not delivered"
        r, state = store.redis, store.keys(u).state

        async def past_the_deadline() -> bool:
            exp = await r.hget(state, "exp")  # written by the first message's save
            if exp is None:
                return True  # the state itself is gone: it expired
            sec, usec = await r.time()
            return int(sec) * 1000 + int(usec) // 1000 > int(exp) + 200

        # the first message's TTL and the keys' slack are over: everything but the state is gone
        await wait_until(past_the_deadline, 30, "the client's keys' deadline passed")
        await run(pub.publish, topic, b"2", qos=1)
        assert await run(sub.wait, lambda: [m.payload for m in sub.messages] == [b"1", b"2"], 30), (
            f"the second message did not reach the connected client: {[m.payload for m in sub.messages]}")
    finally:
        await store.close()
        await run(pub.close)
        await run(sub.close)
