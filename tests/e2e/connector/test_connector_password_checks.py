"""Password checks at once (MQTT_PASSWORD_CHECK_THREADS, MQTT_PASSWORD_CHECKS_MAX; docs/security.md "Limits"),
end to end with paho-mqtt 3.1.1 and 5.0: a flood of CONNECTs with a known user name and wrong passwords, all
sent at once, gets its passwords verified up to the limit and CONNACK 0x89 Server busy (3.1.1: 3, Server
unavailable) past it, without a check; each refusal is counted; once the flood has passed, the right password
connects. A password verified is kept (MQTT_PASSWORD_CACHE_S): a storm of reconnects with it, all at once, is
accepted without a check and so never meets the limit; a replaced password is not answered from it. Failed-login
bans are off here (MQTT_LOGIN_FAILURES_PER_IP=0), so every refusal is this limit's or the password's."""

from __future__ import annotations

import threading

import pytest
from mqtt_clients import BOUND, connack_code, run, wait_until
from scraped import scrape, value
from tbmq_command import tbmq
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


def at_once(port: int, user: str, password: str) -> list[tuple[bool, int]]:
    """FLOOD CONNECTs with this user name and password, half 5.0 and half 3.1.1, sent at once: (v5, code) each."""
    start = threading.Barrier(FLOOD)
    got: list[tuple[bool, int]] = []
    lock = threading.Lock()

    def one(v5: bool) -> None:
        rc = connack_code(port, f"pc-{new_tag()}", v5, (user, password), start=start)
        with lock:
            got.append((v5, rc))
    threads = [threading.Thread(target=one, args=(i % 2 == 0,)) for i in range(FLOOD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    return got


async def add_credential(suite, user: str, password: str) -> None:
    await run(tbmq, suite, "credentials", "add", "--username", user, "--password-stdin", stdin=password + "\n")


def delta(after: str, before: str, metric: str) -> float:
    return value(after, metric) - value(before, metric)


async def test_a_flood_of_password_checks_is_bounded_and_the_rest_get_server_busy(suite, unique):
    port = suite.mqtt_ports[0]
    user, password = unique("u"), "pw-" + unique("p")
    other, other_password = unique("u"), "pw-" + unique("p")  # not verified before the flood
    await add_credential(suite, other, other_password)
    await add_credential(suite, user, password)

    async def accepted() -> bool:
        return await run(connack_code, port, f"pc-{new_tag()}", True, (user, password)) == 0
    await wait_until(accepted, BOUND, "the credential on the connector")
    before = await scrape(suite.health_port("connector"))
    got = await run(at_once, port, user, "a-wrong-guess")
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
    assert delta(after, before, "tbmq_password_cache_hits_total") == 0  # a wrong guess is never kept
    for v5 in (True, False):  # the flood over: a password not verified before is checked, and connects
        assert await run(connack_code, port, f"pc-{new_tag()}", v5, (other, other_password)) == 0
    checked_after = await scrape(suite.health_port("connector"))
    assert delta(checked_after, after, "tbmq_password_verifications_total") == 1  # the second one was kept
    assert delta(checked_after, after, "tbmq_password_cache_hits_total") == 1


async def test_a_reconnect_storm_with_a_verified_password_is_not_verified_again(suite, unique):
    """The fleet's case: every device reconnects at once (here FLOOD CONNECTs of one credential against one
    check at a time). Verified once, the password is kept: every CONNECT is accepted without a check, none gets
    Server busy. Replaced (a new hash), the old password is refused although it was kept."""
    port = suite.mqtt_ports[0]
    user, password = unique("u"), "pw-" + unique("p")
    await add_credential(suite, user, password)

    async def accepted() -> bool:
        return await run(connack_code, port, f"pc-{new_tag()}", True, (user, password)) == 0
    await wait_until(accepted, BOUND, "the credential on the connector")
    before = await scrape(suite.health_port("connector"))
    got = await run(at_once, port, user, password)
    assert [rc for _, rc in got] == [0] * FLOOD, got
    after = await scrape(suite.health_port("connector"))
    assert delta(after, before, "tbmq_password_cache_hits_total") == FLOOD
    assert delta(after, before, "tbmq_password_verifications_total") == 0
    assert delta(after, before, "tbmq_connects_busy_total") == 0
    assert value(after, "tbmq_password_cache_entries") >= 1

    new_password = "pw-" + unique("p")
    await add_credential(suite, user, new_password)

    async def old_refused() -> bool:
        return await run(connack_code, port, f"pc-{new_tag()}", True, (user, password)) == RC.BAD_USER_NAME_OR_PASSWORD
    await wait_until(old_refused, BOUND, "the replaced password refused")
    for v5 in (True, False):
        assert await run(connack_code, port, f"pc-{new_tag()}", v5, (user, new_password)) == 0
        assert await run(connack_code, port, f"pc-{new_tag()}", v5, (user, password)) == RC.BAD_USER_NAME_OR_PASSWORD


async def test_a_password_at_the_low_cost_is_verified_like_any_other(suite, unique):
    """`tbmq credentials add --hash-cost low` (OWASP's minimum for argon2id, a stored hash naming its own
    parameters): the connector accepts the right password and refuses another, with 5.0 and 3.1.1."""
    port = suite.mqtt_ports[0]
    user, password = unique("u"), "pw-" + unique("p")
    await run(tbmq, suite, "credentials", "add", "--username", user, "--password-stdin", "--hash-cost", "low",
              stdin=password + "\n")

    async def accepted() -> bool:
        return await run(connack_code, port, f"pc-{new_tag()}", True, (user, password)) == 0
    await wait_until(accepted, BOUND, "the credential on the connector")
    for v5 in (True, False):
        assert await run(connack_code, port, f"pc-{new_tag()}", v5, (user, "wrong")) == RC.BAD_USER_NAME_OR_PASSWORD
