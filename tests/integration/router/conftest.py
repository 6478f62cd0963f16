from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from router_harness import StateWriter, hexid  # noqa: E402


@pytest.fixture
async def writer(kafka):
    from tbmq_platform import topics
    from tbmq_platform.kafka import ensure_topics

    await ensure_topics(kafka.bootstrap_servers, topics.static_topics())
    w = StateWriter(kafka.bootstrap_servers)
    await w.start()
    try:
        yield w
    finally:
        await w.stop()


@pytest.fixture
def start_routers(make_suite):
    """start_routers(n, group=None) -> Suite with n router instances (group: ROUTER_GROUP_ID). The routers run
    without device-persistence, so their stored copies go to tbmq.msg.persisted (ROUTER_PERSIST_VIA=kafka),
    where the tests read them; the Persist stream is covered with device-persistence (tests/integration/
    device_persistence, and every e2e suite with a persistent DEVICE subscriber)."""

    async def start(n: int = 2, group: str | None = None, **env):
        group = group or f"router-it-{hexid()}"
        renv = {"ROUTER_GROUP_ID": group, "ROUTER_COMMIT_INTERVAL_S": "0.5", "ROUTER_PERSIST_VIA": "kafka", **env}
        suite = await make_suite(services=["router"], instances={"router": n},
                                 redis_url="redis://127.0.0.1:1/0", service_env={"router": renv})
        suite.router_group = group
        return suite

    return start
