"""Shared fixtures of the whole test suite.

Session-wide (started once, lazily, only when a test asks for them):
  kafka            a real Kafka 4.x broker (KRaft, one node) on free ports: `.bootstrap_servers`.
                   TBMQ_TEST_KAFKA=host:port uses an already running broker instead (quick local loops).
  kafka_bootstrap  its bootstrap string.
  redis_server     a standalone redis-server on a free port (in memory): `.url`, `.port`.
  redis_url        its URL.
  redis_cluster    a local 3-master Redis Cluster: `.nodes` (["127.0.0.1:p", ...]).
Per test:
  unique           unique("topic") -> "topic-<test>-<hex>": names that isolate tests sharing the broker.
  make_suite       `suite = await make_suite(services=[...], connectors=2, ...)`: a launcher Suite on
                   free ports, using the session's Kafka (kafka=None: its own broker) and its own Redis;
                   stopped after the test. Options: see tbmq_launcher.launcher.Suite.
Per module:
  suite            the whole suite (every service of ORDER, admin included; 2 connectors) for end-to-end tests.

Every test shares one event loop (pytest.ini: asyncio_default_*_loop_scope = session).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

# The tests fork service processes (the launcher's preexec_fn runs in the child) while in-process gRPC
# fakes and clients have live streams (connectors keep Forward streams open): grpc's fork handlers then
# skip ("Other threads are currently calling into gRPC") and the child can crash before exec. The test
# process never needs gRPC in a forked child (children exec at once), so fork support is off.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tbmq_launcher.kafka import KafkaBroker  # noqa: E402
from tbmq_launcher.launcher import Suite, new_tag  # noqa: E402
from tbmq_launcher.process import tail  # noqa: E402


class ExternalKafka:
    """An already running broker (TBMQ_TEST_KAFKA)."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers

    async def stop(self) -> None:  # not ours
        pass


# $SYS statistics are published into tbmq.msg.all every MQTT_SYS_INTERVAL_S by a live connector: suites that share
# the session's Kafka would see each other's (the Spark statistics test counts every record of its windows, and
# tests/e2e/durability's suite lives to the end of the session). Off in every service the tests start, unless a
# test sets it (tests/e2e/operations/test_sys_topics.py); the services' own default is 10 s.
os.environ.setdefault("MQTT_SYS_INTERVAL_S", "0")


@pytest.fixture(scope="session")
async def kafka(tmp_path_factory):
    external = os.environ.get("TBMQ_TEST_KAFKA")
    if external:
        yield ExternalKafka(external)
        return
    from tbmq_launcher.redis import find_free_port

    broker = KafkaBroker(
        port=find_free_port(), controller_port=find_free_port(),
        workdir=tmp_path_factory.mktemp("kafka"), heap="512m")
    await broker.start()
    print(f"\nkafka {broker.bootstrap_servers} ready in {broker.started_in:.1f}s (log {broker.log_path})")
    try:
        yield broker
    finally:
        await broker.stop(timeout=10)


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka) -> str:
    return kafka.bootstrap_servers


@pytest.fixture(scope="session")
async def redis_server(tmp_path_factory):
    from tbmq_launcher.redis import RedisServer, find_free_port

    server = RedisServer(find_free_port(), tmp_path_factory.mktemp("redis"), appendonly=False)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
async def redis_cluster(tmp_path_factory):
    from tbmq_launcher.redis import RedisCluster, find_free_port

    cluster = RedisCluster([find_free_port(cluster_bus=True) for _ in range(3)],
                           tmp_path_factory.mktemp("redis-cluster"), appendonly=False)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.stop()


@pytest.fixture
def unique(request):
    """unique("t") -> "t-<test name>-<8 hex>", valid as a Kafka topic / group / client id."""
    test = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-")

    def make(prefix: str = "t") -> str:
        return f"{prefix}-{test}-{uuid.uuid4().hex[:8]}"

    return make


_SHARED = object()


@pytest.fixture
async def make_suite(kafka, tmp_path_factory):
    """Factory of started Suites (stopped after the test, even when it fails)."""
    suites: list[Suite] = []

    async def make(**options) -> Suite:
        options.setdefault("ports", "free")
        options.setdefault("log_format", "json")
        options.setdefault("id_tag", new_tag())
        options.setdefault("start_timeout", 60.0)
        options.setdefault("stop_timeout", 10.0)
        if "run_dir" not in options:
            options["run_dir"] = tmp_path_factory.mktemp("suite")
        if options.get("kafka", _SHARED) is _SHARED:
            options["kafka"] = kafka.bootstrap_servers if isinstance(kafka, ExternalKafka) else kafka
        if os.environ.get("TBMQ_TEST_ECHO"):
            import sys

            options.setdefault("echo", sys.stderr)
        suite = Suite(**options)
        suites.append(suite)
        await suite.start()
        return suite

    make.suites = suites  # for the log tails of a failed test (pytest_runtest_makereport)
    try:
        yield make
    finally:
        for s in reversed(suites):
            await s.stop()


@pytest.fixture(scope="module")
async def suite(kafka, tmp_path_factory):
    """The whole suite (session-registry, device-persistence, app-delivery, router, 2 connectors, admin) on
    free ports with the session's Kafka; shared by the tests of one module."""
    s = Suite(
        connectors=2, ports="free", log_format="json", id_tag=new_tag(),
        run_dir=tmp_path_factory.mktemp("suite"),
        kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


LOG_TAIL_LINES = 30


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the last lines of every service log of the suites it used (its
    fixtures' Suites and make_suite's): a failure in CI, where the run directory is gone afterwards, can
    then be read from the output alone."""
    report = yield
    if report.failed and call.when in ("setup", "call"):
        for suite in _suites_of(item):
            for proc in suite.procs.values():
                text = tail(proc.log_path, LOG_TAIL_LINES)
                if text:
                    report.sections.append((f"last {LOG_TAIL_LINES} lines of {proc.service_id}'s log", text))
    return report


def _suites_of(item) -> list[Suite]:
    found: list[Suite] = []
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Suite):
            found.append(value)
        found.extend(s for s in getattr(value, "suites", ()) if isinstance(s, Suite))
    return found


def pytest_sessionfinish(session, exitstatus):
    """Safety net: nothing this test run started may survive it (fixtures stop their processes; a
    leftover is a bug, reported and killed here)."""
    try:
        import psutil
    except ImportError:
        return
    me = psutil.Process()
    left = [c for c in me.children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    if not left:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    for c in left:
        with_cmd = " ".join(c.cmdline()[:4]) if c.is_running() else "?"
        if tr:
            tr.write_line(f"WARNING: leftover process {c.pid} ({with_cmd}) killed at session end", yellow=True)
        try:
            c.kill()
        except psutil.Error:
            pass


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
