"""Real Redis for the device-persistence tests: one standalone server and one 3-master Redis Cluster per
test session (started lazily, only when a test needs them), plus a `store_factory` parametrized over both.

Async fixtures live in the session event loop; test modules must use
``pytestmark = pytest.mark.asyncio(loop_scope="session")``.
"""

from __future__ import annotations

import uuid

import pytest
import pytest_asyncio
from tbmq_launcher.redis import RedisCluster, RedisError, RedisServer, find_free_port

from tbmq_device_persistence.store import DeviceMsgStore, StoreConfig

_START_ATTEMPTS = 3  # a "free" port can be taken by someone else before redis-server binds it


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def redis_standalone(tmp_path_factory):
    last: Exception | None = None
    for attempt in range(_START_ATTEMPTS):
        server = RedisServer(find_free_port(), tmp_path_factory.mktemp(f"redis-standalone-{attempt}"))
        try:
            await server.start()
        except RedisError as exc:
            last = exc
            continue
        try:
            yield server
        finally:
            await server.stop()
        return
    raise last  # type: ignore[misc]


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def redis_cluster(tmp_path_factory):
    last: Exception | None = None
    for attempt in range(_START_ATTEMPTS):
        ports = set()
        while len(ports) < 3:
            ports.add(find_free_port(cluster_bus=True))
        cluster = RedisCluster(sorted(ports), tmp_path_factory.mktemp(f"redis-cluster-{attempt}"))
        try:
            await cluster.start()
        except RedisError as exc:
            last = exc
            continue
        try:
            yield cluster
        finally:
            await cluster.stop()
        return
    raise last  # type: ignore[misc]


@pytest.fixture(params=["standalone", "cluster"])
def redis_backend(request) -> dict:
    """StoreConfig keyword arguments selecting one of the two Redis deployments."""
    if request.param == "standalone":
        return {"redis_url": request.getfixturevalue("redis_standalone").url}
    return {"cluster_nodes": tuple(request.getfixturevalue("redis_cluster").nodes)}


@pytest_asyncio.fixture(loop_scope="session")
async def store_factory(redis_backend):
    """`await store_factory(**StoreConfig overrides)` -> a started DeviceMsgStore, closed after the test."""
    stores: list[DeviceMsgStore] = []

    async def make(**overrides) -> DeviceMsgStore:
        store = DeviceMsgStore(StoreConfig(**{**redis_backend, **overrides}))
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


@pytest.fixture
def client_id() -> str:
    return f"dev-{uuid.uuid4().hex[:12]}"
