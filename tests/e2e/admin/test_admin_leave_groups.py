"""The admin API's leave-groups (docs/operations.md, "Scaling down a router or device-persistence"): a router
stopped for good is taken out of its consumer group, and the other router routes its partitions at once instead
of after the stopped one's session timeout. Real Kafka, the launcher's suite with two routers, paho clients."""

from __future__ import annotations

import aiohttp
import pytest
from admin_api import Api
from kafka_views import group_members, stable_with
from mqtt_clients import Client, run
from suites import module_suite
from waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BOUND = 30.0
SESSION_TIMEOUT_S = 90  # the routers' (ROUTER_SESSION_TIMEOUT_S): far longer than any wait of this test


@pytest.fixture(scope="module")
async def suite(kafka, tmp_path_factory):
    """Two routers on the production topic profile (each holds some of tbmq.msg.all's 16 partitions)."""
    async with module_suite(kafka, tmp_path_factory, "suite-leave-groups", instances={"router": 2},
                            service_env={"router": {"ROUTER_SESSION_TIMEOUT_S": str(SESSION_TIMEOUT_S)}}) as s:
        yield s


async def test_a_stopped_router_taken_out_of_its_group_hands_its_partitions_over_at_once(suite, unique):
    group, bootstrap = "router", suite.bootstrap_servers
    gone, stays = suite.service_id("router", 2), suite.service_id("router", 1)
    await wait_until(lambda: stable_with(bootstrap, group, 2), BOUND, "both routers in their group")
    async with aiohttp.ClientSession() as http:
        api = Api(suite, http)
        path = f"/instances/{gone}/leave-groups"
        assert (await api.call("POST", path))[0] == 401  # an admin's change: logged in only
        await api.login_as_admin()
        status, body = await api.call("POST", path)
        assert status == 409 and "is running" in body["error"], body  # a running member is not fenced
        assert await group_members(bootstrap, group) == ("Stable", 2)

        await suite.stop_service("router", 2)
        # a static member that stopped keeps its place (and its partitions) until its session times out
        assert await group_members(bootstrap, group) == ("Stable", 2)

        status, body = await api.call("POST", path)
        assert (status, body) == (200, {"instance_id": gone, "groups": [group]}), body
        await wait_until(lambda: stable_with(bootstrap, group, 1), BOUND,
                         f"{stays} alone in its group, long before the {SESSION_TIMEOUT_S} s session timeout")

        # every partition of tbmq.msg.all is routed again: messages on 40 topics (keys spread over the 16)
        u = unique("lg")
        sub, pub = Client(f"{u}-sub"), Client(f"{u}-pub")
        try:
            await run(sub.connect, suite.mqtt_ports[0])
            await run(sub.subscribe, f"{u}/#", 1)
            await run(pub.connect, suite.mqtt_ports[0])
            for i in range(40):
                await run(pub.publish, f"{u}/t{i}", f"m{i}".encode(), 1)
            assert await run(sub.wait, lambda: len(sub.messages) >= 40), f"{len(sub.messages)} of 40 delivered"
            assert sorted(m.topic for m in sub.messages) == sorted(f"{u}/t{i}" for i in range(40))
        finally:
            sub.close()
            pub.close()

        # taken out already, or never a member: nothing to do
        status, body = await api.call("POST", path)
        assert status == 404 and "static member of none of router, device-persistence" in body["error"], body
        status, body = await api.call("POST", "/instances/no-such-instance/leave-groups")
        assert status == 404, body
