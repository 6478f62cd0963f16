"""The suite heals itself (issue 15, deliverable 1): under a supervised suite (`Suite(supervise=True)`, what
`make run` runs) a SIGKILLed service is started again by the launcher without any step of the test, and
Kafka and Redis restarts are survived; in every case every message whose PUBACK the publisher received
reaches the persistent subscriber, first occurrences in order (durability_helpers.crash_scenario).

The suite has its own Kafka and Redis (restarting the session's shared Kafka would disturb other tests).
"""

from __future__ import annotations

import os
import signal

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from durability_helpers import START_TIMEOUT, crash_scenario
from mqtt_clients import wait_until
from tbmq_launcher.launcher import Suite
from tbmq_launcher.services import http_status
from tbmq_launcher.supervisor import RestartPolicy
from tbmq_platform import topics as catalogue

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SERVICES = ["session-registry", "device-persistence", "router", "connector"]


@pytest.fixture(scope="module")
async def supervised(tmp_path_factory):
    s = Suite(services=SERVICES, connectors=2, ports="free", log_format="json", topic_profile="single-node",
              run_dir=tmp_path_factory.mktemp("supervised"), start_timeout=START_TIMEOUT, stop_timeout=15,
              supervise=True, restart_policy=RestartPolicy(initial_s=0.2, max_s=5.0))
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def is_ready(p) -> bool:
    """The instance runs and its /readyz answers 200."""
    if not p.running:
        return False
    try:
        return await http_status("127.0.0.1", p.health_port, "/readyz", timeout=1.0) == 200
    except (OSError, TimeoutError, ValueError):
        return False


async def crash(suite: Suite, name: str, instance: int = 1) -> None:
    """SIGKILL from outside the launcher (a crash, not Suite.kill_service), then wait for the supervisor's
    restart: a new pid, ready."""
    p = suite.instance(name, instance)
    old_pid, before = p.pid, suite.restarts(p.service_id)
    os.kill(old_pid, signal.SIGKILL)

    async def back() -> bool:
        if suite.restarts(p.service_id) <= before or p.pid == old_pid:
            return False
        return await is_ready(p)

    await wait_until(back, 120, f"the supervisor restarting {p.service_id}")


@pytest.mark.parametrize("victim", ["router", "device-persistence", "session-registry"])
async def test_a_crashed_service_is_restarted_by_the_launcher(supervised, unique, victim):
    await crash_scenario(supervised, unique, victim, fault=lambda: crash(supervised, victim))
    assert supervised.restarts(f"{victim}-1") >= 1
    assert f"{supervised.restarts(f'{victim}-1')} restarts" in supervised.describe()


async def test_kafka_restart_is_survived_without_a_manual_step(supervised, unique):
    await crash_scenario(supervised, unique, "kafka", fault=supervised.restart_kafka)
    print(f"\nservice restarts after the Kafka restart: "
          f"{ {p.service_id: supervised.restarts(p.service_id) for p in supervised.processes()} }")


async def test_redis_restart_is_survived_without_a_manual_step(supervised, unique):
    # the subscriber is offline while Redis restarts: its messages are in the store across the restart
    await crash_scenario(supervised, unique, "redis", fault=supervised.restart_redis, sub_offline_while_down=True)
    print(f"\nservice restarts after the Redis restart: "
          f"{ {p.service_id: supervised.restarts(p.service_id) for p in supervised.processes()} }")


async def test_crashed_kafka_is_restarted_by_the_launcher(supervised, unique):
    async def kill_kafka() -> None:
        before = supervised.restarts("kafka")
        os.kill(supervised.kafka.pid, signal.SIGKILL)
        await wait_until(lambda: supervised.restarts("kafka") > before and supervised.kafka.running, 120,
                         "the supervisor restarting Kafka")

    await crash_scenario(supervised, unique, "kafka", fault=kill_kafka)


async def test_kafka_restart_qos2_fan_in_wide_windows(supervised, unique):
    await crash_scenario(supervised, unique, "kafka", fault=supervised.restart_kafka, publishers=3, qos=2,
                         window=100)


async def test_redis_restart_qos2_fan_in_subscriber_offline(supervised, unique):
    await crash_scenario(supervised, unique, "redis", fault=supervised.restart_redis, publishers=3, qos=2,
                         window=100, sub_offline_while_down=True)


# the router's log line when Kafka refuses a routed record (router.app.Router.on_send_failure)
SEND_REFUSED = "a routed record was not acknowledged by Kafka"


async def set_topic_configs(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    """Kafka's (non-incremental) AlterConfigs: the topic's overrides become exactly `configs`."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    try:
        for response in await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic,
                                                                  configs=configs)]):
            for code, message, *_ in response.resources:
                assert code == 0, f"AlterConfigs {topic}: error {code} {message}"
    finally:
        await admin.close()


async def test_a_record_kafka_refuses_stops_the_router_until_kafka_takes_it(supervised, unique):
    """The router's send-failure path (Router.on_send_failure), on the live path: a clean-session subscriber
    on connector 1, so every copy goes to tbmq.msg.downlink.basic.<connector 1>. While Kafka refuses every
    record batch for that topic (its max.message.bytes cut below any batch), the router exits at the first
    refused record without committing what it routed; the launcher starts it again and it exits again on the
    same record (it was not committed). Once Kafka takes the records again, every message whose PUBACK the
    publisher received reaches the subscriber, first occurrences in order."""
    router = supervised.instance("router")
    downlink = catalogue.downlink_basic_topic(supervised.connector_ids[0])
    created = catalogue.spec(catalogue.DOWNLINK_BASIC_PREFIX + "<svc>").configs(catalogue.TopicLayout())

    def refusals() -> int:  # the router's log is appended to across the module's tests
        return router.log_path.read_text(errors="replace").count(SEND_REFUSED)

    refused_before = refusals()

    async def refuse_for_a_while() -> None:
        before = supervised.restarts(router.service_id)
        await set_topic_configs(supervised.bootstrap_servers, downlink, {**created, "max.message.bytes": "64"})
        try:
            await wait_until(lambda: supervised.restarts(router.service_id) >= before + 2, 120,
                             "the router exiting twice on the refused record")
        finally:
            await set_topic_configs(supervised.bootstrap_servers, downlink, created)
        await wait_until(lambda: is_ready(router), 120, "the router ready once Kafka takes its records")

    await crash_scenario(supervised, unique, "router", fault=refuse_for_a_while, clean_subscriber=True)
    assert refusals() >= refused_before + 2, "the router's exits were not its refused-record exits"
