"""Registry settings against a real Kafka: the expiry cap and the quotas (each test starts its own registry;
no other registry of this test run is running then)."""

from __future__ import annotations


import pytest
from tbmq.v1 import messages_pb2 as pb

pytestmark = pytest.mark.integration

APPLICATION = pb.CLIENT_TYPE_APPLICATION


async def test_expiry_interval_is_capped(start_registry, connectors, cid):
    await start_registry({"MQTT_CLIENT_SESSION_EXPIRY_MAX_EXPIRY_INTERVAL": "100"})
    (c,) = await connectors(1)
    resp, _ = await c.connect(cid(), sei=0xFFFFFFFF)
    assert resp.session_expiry_interval == 100
    resp, _ = await c.connect(cid(), version=4, clean_start=False)
    assert resp.session_expiry_interval == 100  # 3.x persistent sessions live as long as the max


async def test_quotas(start_registry, connectors, sessions, cid):
    # other tests share this Kafka: the limit is set relative to the sessions that exist now, counted once
    # the table has read everything written so far
    await sessions.view.wait_caught_up()
    base = sum(1 for s in sessions.sessions.values() if s is not None)
    await start_registry({"MQTT_SESSIONS_LIMIT": str(base + 3), "MQTT_APPLICATION_CLIENTS_LIMIT": "100000",
                          "TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS": "600000"})
    (c,) = await connectors(1)
    ok = [await c.connect(cid(), sei=600) for _ in range(3)]
    assert all(r.success for r, _ in ok)
    resp, _ = await c.connect(cid(), sei=600)
    assert not resp.success and resp.failure == pb.SESSION_FAILURE_QUOTA_EXCEEDED
    # an existing client may still reconnect
    client = ok[0][0].client_id
    resp, _ = await c.connect(client, sei=600)
    assert resp.success


async def test_application_quota(start_registry, connectors, sessions, cid):
    await sessions.view.wait_caught_up()
    apps = sum(1 for s in sessions.sessions.values() if s is not None and s.client_type == APPLICATION)
    await start_registry({"MQTT_APPLICATION_CLIENTS_LIMIT": str(apps + 1),
                          "TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS": "600000"})
    (c,) = await connectors(1)
    resp, _ = await c.connect(cid("app"), sei=600)
    assert resp.success and resp.client_type == APPLICATION
    resp, _ = await c.connect(cid("app"), sei=600)
    assert not resp.success and resp.failure == pb.SESSION_FAILURE_QUOTA_EXCEEDED
    resp, _ = await c.connect(cid("dev"), sei=600)
    assert resp.success
