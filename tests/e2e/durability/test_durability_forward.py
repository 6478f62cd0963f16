"""Crash durability of the device-persistence -> connector Forward streams, end to end with paho clients.

Stored DEVICE messages reach a connected persistent subscriber over one gRPC Forward stream per (connector,
device-persistence instance); a stream can lose what it had queued when either end dies. The guarantee
under test: "nothing acknowledged is ever lost" still holds — every message whose PUBACK a publisher got
reaches its persistent subscriber (duplicates allowed, QoS 1), first occurrences in order per publisher —
when an instance at either end of the streams is SIGKILLed mid-stream. Here the suite runs TWO
device-persistence instances, so the connectors hold two streams each: killing one instance moves its
partitions to the other (replayed from the last commit) while the connectors re-sync through the survivor;
killing the subscribers' connector moves them to the other connector, whose streams take over.

Several publisher/subscriber pairs run at once (durability_helpers.crash_scenario, pairs=3).

Run: .venv/bin/pytest tests/e2e/durability/test_durability_forward.py -q -rA -s
"""

from __future__ import annotations

import pytest
from durability_helpers import crash_scenario, heal, running_suite

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
async def fsuite(kafka, tmp_path_factory):
    async with running_suite(kafka, tmp_path_factory, "suite-forward",
                             ["session-registry", "device-persistence", "router", "connector"],
                             instances={"device-persistence": 2}) as s:
        yield s


@pytest.fixture
async def fhealed(fsuite):
    await heal(fsuite)
    yield fsuite


async def test_forward_one_of_two_device_persistence_killed(fhealed, unique):
    await crash_scenario(fhealed, unique, "device-persistence", 1, pairs=3)


async def test_forward_subscribers_connector_killed(fhealed, unique):
    await crash_scenario(fhealed, unique, "connector", 1, pairs=3)


async def test_forward_publishers_connector_killed(fhealed, unique):
    await crash_scenario(fhealed, unique, "connector", 2, pairs=3)
