"""Password checks at once (MQTT_PASSWORD_CHECK_THREADS, MQTT_PASSWORD_CHECKS_MAX; docs/security.md "Limits"),
end to end with paho-mqtt 3.1.1 and 5.0: a flood of CONNECTs with a known user name and wrong passwords, all
sent at once, gets its passwords verified up to the limit and CONNACK 0x89 Server busy (3.1.1: 3, Server
unavailable) past it, without a check; each refusal is counted; once the flood has passed, the right password
connects. Failed-login bans are off here (MQTT_LOGIN_FAILURES_PER_IP=0), so every refusal is this limit's."""

from __future__ import annotations

import threading

import pytest
from connector_helpers import tbmq
from mqtt_clients import BOUND, connack_code, run, wait_until
from scraped import scrape, value
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_mqtt import ReasonCode as RC

pytestmark = [pytest.mark.e2e]

FLOOD = 24  # CONNECTs sent at once; one password verified at a time, one at most in flight


@pytest.fixture(scope="module")
async def suite(kafka, tmp_path_factory):
    env = {"MQTT_ALLOW_ANONYMOUS": "false", "MQTT_LOGIN_FAILURES_PER_IP": "0",
           "MQTT_PASSWORD_CHECK_THREADS": "1", "MQTT_PASSWORD_CHECKS_MAX": "1"}
    async with Suite(services=["session-registry", "connector"], ports="free", log_format="json",
                     id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-password-checks"),
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"connector": env}) as s:
        yield s


def flood(port: int, user: str) -> list[tuple[bool, int]]:
    """FLOOD CONNECTs with a wrong password, half 5.0 and half 3.1.1, sent at once: (v5, code) each."""
    start = threading.Barrier(FLOOD)
    got: list[tuple[bool, int]] = []
    lock = threading.Lock()

    def one(v5: bool) -> None:
        rc = connack_code(port, f"pc-{new_tag()}", v5, (user, "a-wrong-guess"), start=start)
        with lock:
            got.append((v5, rc))
    threads = [threading.Thread(target=one, args=(i % 2 == 0,)) for i in range(FLOOD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    return got


async def test_a_flood_of_password_checks_is_bounded_and_the_rest_get_server_busy(suite, unique):
    port = suite.mqtt_ports[0]
    user, password = unique("u"), "pw-" + unique("p")
    await run(tbmq, suite, "credentials", "add", "--username", user, "--password-stdin", stdin=password + "\n")

    async def accepted() -> bool:
        return await run(connack_code, port, f"pc-{new_tag()}", True, (user, password)) == 0
    await wait_until(accepted, BOUND, "the credential on the connector")
    before = await scrape(suite.health_port("connector"))
    got = await run(flood, port, user)
    assert len(got) == FLOOD
    busy_code = {True: RC.SERVER_BUSY, False: RC.SERVER_UNAVAILABLE}  # 3.1.1: return code 3
    checked = [rc for v5, rc in got if rc == RC.BAD_USER_NAME_OR_PASSWORD]
    busy = [rc for v5, rc in got if rc == busy_code[v5]]
    assert len(checked) + len(busy) == FLOOD, got  # nothing else: verified and refused, or refused unchecked
    assert checked and busy, got
    after = await scrape(suite.health_port("connector"))
    assert value(after, "tbmq_connects_busy_total") - value(before, "tbmq_connects_busy_total") == len(busy)
    assert value(after, "tbmq_login_failures_total") - value(before, "tbmq_login_failures_total") == len(checked)
    assert value(after, "tbmq_password_checks") == 0
    for v5 in (True, False):  # the flood over: the right password connects
        assert await run(connack_code, port, f"pc-{new_tag()}", v5, (user, password)) == 0
