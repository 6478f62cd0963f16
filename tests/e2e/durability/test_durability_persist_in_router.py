"""Crash durability with device-persistence inside the router's process (ROUTER_PERSIST_VIA=local, the launcher's
`persist_in_router`): one process fewer on a persistent message's path, so one SIGKILL takes the routing and the
Redis save, the Forward streams to the connectors and the API they attach through, all at once.

The promise is the same as with separate processes (test_durability_device.py): every message whose PUBACK the
publisher received reaches the persistent subscriber, first occurrences in order. What makes it hold here: the
router commits a tbmq.msg.all offset only after its copies are saved (LocalPersist's futures resolve when
`persist` returned), so a kill replays what was not saved; the origin check stores a copy saved before once; the
connectors' Forward streams end with the process and are reopened to its restart, which re-syncs from Redis.

Its own suite (no device-persistence process): it runs before `dsuite` exists (conftest.py orders the tests
without `dsuite` first), so the two suites never share the session's Kafka at the same time.
"""

from __future__ import annotations

import pytest
from durability_helpers import crash_scenario, heal, running_suite

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
async def lsuite(kafka, tmp_path_factory):
    async with running_suite(kafka, tmp_path_factory, "suite-persist-in-router",
                             ["session-registry", "router", "connector"], persist_in_router=True) as s:
        assert ("device-persistence", 1) not in s.procs
        env = s.service_environment("router")
        assert env["ROUTER_PERSIST_VIA"] == "local"
        assert env["DEVICE_PERSISTENCE_GRPC_TARGETS"] == env["ROUTER_LOCAL_TARGET"]
        yield s


@pytest.fixture
async def lhealed(lsuite):
    await heal(lsuite)
    yield lsuite


async def test_persist_in_router_router_killed(lhealed, unique):
    await crash_scenario(lhealed, unique, "router", client_prefix="loc")


async def test_persist_in_router_router_killed_subscriber_offline(lhealed, unique):
    # the subscriber is offline while the process dies and restarts: what it had saved is in Redis, what it had
    # not is routed again and saved once; the subscriber comes back after the restart
    await crash_scenario(lhealed, unique, "router", client_prefix="loc", sub_offline_while_down=True)


async def test_persist_in_router_router_killed_qos2_fan_in(lhealed, unique):
    # three QoS 2 publishers with 100 in flight each into one persistent subscriber: batches of many clients'
    # copies are being saved when the process dies (test_durability_device's wide-window case, one process)
    await crash_scenario(lhealed, unique, "router", client_prefix="loc", publishers=3, qos=2, window=100)


async def test_persist_in_router_subscribers_connector_killed(lhealed, unique):
    # the subscriber's connector dies: it reconnects to the other one, whose Forward stream to the router's
    # device-persistence takes it over
    await crash_scenario(lhealed, unique, "connector", 1, client_prefix="loc")
