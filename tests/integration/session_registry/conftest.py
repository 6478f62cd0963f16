"""Fixtures of the session registry's integration tests: a fake DevicePersistence, the registry started by
the launcher (a subprocess with its health check), fake connectors and topic watchers."""

from __future__ import annotations

import uuid

import pytest
from kafka_views import SessionTable
from session_registry_harness import SERVICE_ENV_BASE, FakeConnector, FakeDevicePersistence, TopicWatch, eventually
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

NO_REDIS = "redis://127.0.0.1:1/0"  # the registry does not use Redis; keeps the Suite from starting one


async def warm_up(kafka) -> None:
    """One request answered before the test starts. On a brand-new broker the first transactional
    produces can stall for a request timeout (30 s) while Kafka sets up its transaction state; the registry
    recovers by itself (the batch is retried), but a test's bounds should not include that."""
    c = await FakeConnector(kafka.bootstrap_servers, f"warmup-{uuid.uuid4().hex[:8]}").start()
    try:
        # an ancient request: answered SERVER_UNAVAILABLE without creating a session (quotas stay exact)
        req = c.connect_request(f"warmup-{uuid.uuid4().hex[:8]}")
        req.request_time_ms = 1
        await c.send(req)
        await eventually(lambda: c.response(req.request_id), 120, what="warm-up answer")
    finally:
        await c.stop()


def registry_suite(kafka, run_dir, env: dict, instances: int = 1) -> Suite:
    return Suite(services=["session-registry"], instances={"session-registry": instances}, ports="free",
                 log_format="json", id_tag=new_tag(), run_dir=run_dir, redis_url=NO_REDIS,
                 kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers,
                 service_env={"session-registry": env}, start_timeout=60.0, stop_timeout=10.0)


@pytest.fixture(scope="module")
async def fake_dp():
    dp = await FakeDevicePersistence().start()
    yield dp
    await dp.stop()


@pytest.fixture(scope="module")
async def registry(kafka, fake_dp, tmp_path_factory):
    """One registry for the module (APPLICATION: client ids app-*, username appuser; scan every 300 ms)."""
    env = {**SERVICE_ENV_BASE, "DEVICE_PERSISTENCE_GRPC_TARGET": fake_dp.target}
    suite = registry_suite(kafka, tmp_path_factory.mktemp("registry"), env)
    await suite.start()
    await warm_up(kafka)
    yield suite
    await suite.stop()


@pytest.fixture
async def start_registry(kafka, fake_dp, tmp_path_factory):
    """Factory of registries with extra settings (stopped after the test)."""
    suites: list[Suite] = []

    async def start(extra_env: dict | None = None, instances: int = 1) -> Suite:
        env = {**SERVICE_ENV_BASE, "DEVICE_PERSISTENCE_GRPC_TARGET": fake_dp.target, **(extra_env or {})}
        suite = registry_suite(kafka, tmp_path_factory.mktemp("registry"), env, instances)
        suites.append(suite)
        await suite.start()
        await warm_up(kafka)
        return suite

    yield start
    for s in reversed(suites):
        await s.stop()


@pytest.fixture
async def connectors(kafka):
    """connectors(n) -> n fake connectors with fresh service ids."""
    made: list[FakeConnector] = []

    async def make(n: int = 1) -> list[FakeConnector]:
        out = []
        for _ in range(n):
            c = await FakeConnector(kafka.bootstrap_servers, f"fakeconn-{uuid.uuid4().hex[:8]}").start()
            made.append(c)
            out.append(c)
        return out

    yield make
    for c in made:
        await c.stop()


@pytest.fixture
async def watch(kafka):
    """watch(topic) -> a TopicWatch from now on."""
    made: list[TopicWatch] = []

    async def make(topic: str) -> TopicWatch:
        w = await TopicWatch(kafka.bootstrap_servers, topic).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


@pytest.fixture
async def sessions(kafka):
    table = await SessionTable(kafka.bootstrap_servers).start()
    yield table
    await table.stop()


@pytest.fixture
def cid():
    """cid("prefix") -> a fresh client id "<prefix>-<hex>" (APPLICATION when the prefix is "app")."""
    def make(prefix: str = "dev") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:10]}"
    return make
