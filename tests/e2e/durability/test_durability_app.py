"""Crash durability of a persistent APPLICATION subscriber's messages, end to end through the real suite.

Same scenario as test_durability_device.py (numbered QoS 1 stream, one service SIGKILLed mid-stream and
started again, every PUBACKed number must arrive, duplicates allowed, first occurrences in order), but the
subscriber's client id matches TBMQ_APPLICATION_CLIENT_ID_PATTERNS (`app-.*`, conftest.py): its messages go
router → tbmq.msg.app.<client> → app-delivery (consumer group app-delivery.<client>, offsets committed up to
the acknowledged prefix) → gRPC stream → connector. The topic has one partition, so order is kept.
"""

from __future__ import annotations

import importlib.util

import pytest
from durability_helpers import crash_scenario

HAS_APP_DELIVERY = importlib.util.find_spec("app_delivery.__main__") is not None

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(not HAS_APP_DELIVERY, reason="app-delivery has no entry point yet (services/app-delivery)"),
]


async def test_durability_app_app_delivery_killed(healed, unique):
    await crash_scenario(healed, unique, "app-delivery", client_prefix="app")


async def test_durability_app_router_killed(healed, unique):
    await crash_scenario(healed, unique, "router", client_prefix="app")


async def test_durability_app_session_registry_killed(healed, unique):
    await crash_scenario(healed, unique, "session-registry", client_prefix="app", sub_offline_while_down=True)


async def test_durability_app_subscriber_connector_killed(healed, unique):
    await crash_scenario(healed, unique, "connector", 1, client_prefix="app")


async def test_durability_app_publisher_connector_killed(healed, unique):
    await crash_scenario(healed, unique, "connector", 2, client_prefix="app")


async def test_durability_app_app_delivery_killed_subscriber_reconnects_meanwhile(healed, unique):
    # the subscriber leaves and comes back (other connector) while app-delivery is down: the connector's
    # stream is retried with backoff and must deliver everything once app-delivery is back
    await crash_scenario(healed, unique, "app-delivery", client_prefix="app", sub_offline_while_down=True,
                         sub_back_while_down=True)


async def test_durability_app_qos2_router_killed_exactly_once(healed, unique):
    # QoS 2 both ways, 3 publishers with 100 in flight each: the router's replay writes its uncommitted
    # records' copies into tbmq.msg.app.<client> again, and app-delivery streams one copy per origin
    # (tbmq_routing.origins); before, the replayed copies reached the client a second time
    verdicts = await crash_scenario(healed, unique, "router", client_prefix="app", publishers=3, qos=2, window=100)
    assert all(v.duplicates == 0 for v in verdicts), [v.summary() for v in verdicts]
