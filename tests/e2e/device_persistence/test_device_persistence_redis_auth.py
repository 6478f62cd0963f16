"""The services against a Redis that requires a password (issue 14, internal surfaces): the launcher runs its
Redis with requirepass (Suite(redis_password=...)), REDIS_URL carries the password, and a persistent DEVICE
client's messages go through device-persistence's Redis store: live, and while it is offline."""

from __future__ import annotations

import pytest
from mqtt_clients import Client, payloads, routed, run
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.redis import RedisError, redis_command

from tbmq_device_persistence.store import DeviceMsgStore, StoreConfig

pytestmark = [pytest.mark.e2e]

PASSWORD = "s3cret/pass word"


@pytest.fixture(scope="module")
async def stack(kafka, tmp_path_factory):
    async with Suite(services=["session-registry", "device-persistence", "router", "connector"], connectors=1,
                     ports="free", log_format="json", id_tag=new_tag(), redis_password=PASSWORD,
                     run_dir=tmp_path_factory.mktemp("suite-redis-auth"), start_timeout=90,
                     kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers) as s:
        yield s


async def test_redis_refuses_a_client_without_the_password(stack):
    r = stack.redis
    assert ":s3cret%2Fpass%20word@" in stack.redis_url
    reply = await redis_command(r.bind, r.port, "PING")
    assert isinstance(reply, RedisError) and "NOAUTH" in str(reply)
    assert await redis_command(r.bind, r.port, "PING", password=PASSWORD) == "PONG"
    # REDIS_PASSWORD (StoreConfig.redis_password) instead of a password in the URL
    async with DeviceMsgStore(StoreConfig(redis_url=f"redis://{r.bind}:{r.port}/0", redis_password=PASSWORD,
                                          key_prefix="auth-test:")) as store:
        assert await store.ping()


async def test_persistent_device_messages_go_through_the_password_protected_redis(stack, unique):
    port = stack.mqtt_ports[0]
    cid, topic = unique("dev"), f"auth/{unique('t')}"
    sub = Client(cid, v5=True, clean=False, session_expiry=3600)
    pub = Client(unique("pub"))
    await run(sub.connect, port)
    await run(pub.connect, port)
    await run(sub.subscribe, topic, 1)
    await routed(pub, sub, topic, 1)
    await run(sub.close, wait=True)
    for i in range(3):  # stored in Redis while the client is offline
        await run(pub.publish, topic, b"off-%d" % i, 1)
    again = Client(cid, v5=True, clean=False, session_expiry=3600)
    flags, _rc, _props = await run(again.connect, port)
    assert flags.session_present
    assert await run(again.wait, lambda: len([p for p in payloads(again, topic) if p.startswith(b"off-")]) >= 3)
    assert [p for p in payloads(again, topic) if p.startswith(b"off-")] == [b"off-0", b"off-1", b"off-2"]
    await run(again.close, 0)
    await run(pub.close)
