"""Failed logins per address (MQTT_LOGIN_FAILURES_PER_IP, docs/security.md "Limits"), end to end with paho-mqtt
3.1.1 and 5.0 and the `jwt` provider: an address that sends bad tokens faster than the limit is banned, and
while it is, even a good token from it gets CONNACK 0x8A Banned (3.1.1: 5, Not authorized); another address
connects meanwhile; the ban ends by itself. The budget is one across the connectors and a ban on one applies on
the other too, after the other's restart as well (tbmq.security.login.bans); an administrator lifts it on both
(the admin API)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time

import aiohttp
import jwt
import pytest
from connector_helpers import connector_health
from mqtt_clients import BOUND, connack_code, run, wait_until
from scraped import scrape, value
from tbmq_command import TBMQ, tbmq
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_mqtt import ReasonCode as RC

pytestmark = [pytest.mark.e2e]

SECRET = "e2e-login-failures-secret-0123456789abcdef"
FAILURES = 3
# Two suites, two ban lengths: the tests that wait for a ban's end use the short one; a lifting, a restart and
# the other connector reading a ban or its lifting must happen while the ban lasts, so those use the long one
# (a lifted ban that had ended by itself would prove nothing).
SHORT_BAN_S = 8  # still long enough for the other connector to read the ban while it lasts
BAN_S = 30


def token(secret: str = SECRET) -> str:
    return jwt.encode({"exp": int(time.time() + 3600)}, secret, algorithm="HS256")


def connack(port: int, v5: bool, password: str, address: str) -> int:
    """The CONNACK code paho reports for a CONNECT from `address` (paho maps 3.1.1's return codes onto the
    v5 reason codes: 4 → 0x86, 5 → 0x87)."""
    return connack_code(port, f"lf-{new_tag()}", v5, ("device", password), bind_address=address)


async def banned_on(ports: list[int], address: str) -> bool:
    """Whether every connector of `ports` refuses a good token from `address` (0x8A Banned)."""
    return all([await run(connack, p, True, token(), address) == RC.BANNED for p in ports])


async def cli_bans(suite) -> list[dict]:
    """`tbmq login-bans list`: the bans in force, one JSON line each."""
    return [json.loads(line) for line in (await run(tbmq, suite, "login-bans", "list")).splitlines()]


@contextlib.asynccontextmanager
async def banning_suite(kafka, tmp_path_factory, ban_s: int):
    """Two connectors (and the registry and the admin API) that ban an address for `ban_s` seconds."""
    env = {"MQTT_ALLOW_ANONYMOUS": "false", "MQTT_AUTH_PROVIDERS": "jwt", "MQTT_AUTH_JWT_SECRET": SECRET,
           "MQTT_LOGIN_FAILURES_PER_IP": str(FAILURES), "MQTT_LOGIN_FAILURES_WINDOW_S": "600",
           "MQTT_LOGIN_BAN_S": str(ban_s)}
    async with Suite(services=["session-registry", "connector", "admin"], ports="free", log_format="json",
                     id_tag=new_tag(), connectors=2,
                     run_dir=tmp_path_factory.mktemp("suite-login-failures"),
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"connector": env}) as s:
        yield s


@pytest.fixture(scope="module")
async def short_bans(kafka, tmp_path_factory):
    async with banning_suite(kafka, tmp_path_factory, SHORT_BAN_S) as s:
        yield s


@pytest.fixture(scope="module")
async def suite(kafka, tmp_path_factory):
    async with banning_suite(kafka, tmp_path_factory, BAN_S) as s:
        yield s


@pytest.mark.parametrize(("v5", "address"), [(True, "127.0.0.2"), (False, "127.0.0.3")], ids=["5", "311"])
async def test_an_address_guessing_tokens_is_banned_for_a_while(short_bans, v5, address):
    suite = short_bans
    port, bad, good = suite.mqtt_ports[0], token("another-secret-of-an-attacker-0123456789"), token()
    before = await scrape(suite.health_port("connector"))
    assert await run(connack, port, v5, good, address) == 0
    for _ in range(FAILURES):  # the whole budget at once: the last one starts the ban
        assert await run(connack, port, v5, bad, address) == RC.BAD_USER_NAME_OR_PASSWORD
    banned = RC.BANNED if v5 else RC.NOT_AUTHORIZED
    assert await run(connack, port, v5, good, address) == banned  # the right token, but from a banned address
    assert await run(connack, port, v5, good, "127.0.0.4") == 0  # another address carries on

    async def ban_over() -> bool:
        return await run(connack, port, v5, good, address) == 0
    await wait_until(ban_over, SHORT_BAN_S + BOUND, "the ban's end")
    after = await scrape(suite.health_port("connector"))

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)
    assert grew("tbmq_login_failures_total") == FAILURES
    assert grew("tbmq_login_bans_total") == 1
    assert grew("tbmq_connects_banned_total") >= 1
    assert (await connector_health(suite)).get("login_bans", 0) >= 1


async def test_a_ban_on_one_connector_applies_on_the_other(short_bans):
    """A guesser spreading its CONNECTs over the connectors behind one address: once connector 1 bans the
    address, connector 2 refuses it too (0x8A Banned), other addresses carry on there, and the ban ends on
    both."""
    suite = short_bans
    address, bad, good = "127.0.0.5", token("another-secret-of-an-attacker-0123456789"), token()
    first, second = suite.mqtt_ports
    before = await scrape(suite.health_port("connector", 2))
    for _ in range(FAILURES):
        assert await run(connack, first, True, bad, address) == RC.BAD_USER_NAME_OR_PASSWORD
    assert await run(connack, first, True, good, address) == RC.BANNED

    async def banned_on_second() -> bool:
        return await run(connack, second, True, good, address) == RC.BANNED
    await wait_until(banned_on_second, SHORT_BAN_S, "the ban read by connector 2 while it lasts")
    assert await run(connack, second, False, good, "127.0.0.6") == 0
    listed = await cli_bans(suite)
    assert any(b["address"] == address and b["by"].startswith("connector") for b in listed), listed

    async def ban_over() -> bool:
        return await run(connack, second, False, good, address) == 0
    await wait_until(ban_over, SHORT_BAN_S + BOUND, "the ban's end on connector 2")
    after = await scrape(suite.health_port("connector", 2))
    assert value(after, "tbmq_login_bans_shared_total") - value(before, "tbmq_login_bans_shared_total") == 1
    assert value(after, "tbmq_login_bans_total") == value(before, "tbmq_login_bans_total")  # none of its own


async def test_a_guesser_spreading_over_the_connectors_gets_one_budget(suite):
    """MQTT_LOGIN_FAILURES_PER_IP is one budget per address across the connectors: failed logins on connector 1
    and then one on connector 2, the limit in all, ban the address on both though neither had it alone; the
    ban is connector 2's (its failure used the budget up), and it still holds there after a restart."""
    address, bad, good = "127.0.0.9", token("another-secret-of-an-attacker-0123456789"), token()
    first, second = suite.mqtt_ports
    health = suite.health_port("connector", 2)
    before = await scrape(health)
    for _ in range(FAILURES - 1):
        assert await run(connack, first, True, bad, address) == RC.BAD_USER_NAME_OR_PASSWORD

    async def spent_on_second() -> bool:
        got = value(await scrape(health), "tbmq_login_failures_shared_total")
        return got - value(before, "tbmq_login_failures_shared_total") >= FAILURES - 1
    await wait_until(spent_on_second, BOUND, "connector 1's failed logins read by connector 2")
    assert await run(connack, second, True, good, address) == 0  # one failure left: not banned yet
    assert await run(connack, second, True, bad, address) == RC.BAD_USER_NAME_OR_PASSWORD

    await wait_until(lambda: banned_on(suite.mqtt_ports, address), BAN_S, "the one budget used up, on both connectors")
    assert await run(connack, second, False, good, "127.0.0.10") == 0
    after = await scrape(health)
    assert value(after, "tbmq_login_bans_total") - value(before, "tbmq_login_bans_total") == 1
    listed = await cli_bans(suite)
    assert [b["by"] for b in listed if b["address"] == address] == [suite.service_id("connector", 2)], listed

    await suite.restart_service("connector", 2)  # its failures and its ban read back: still banned
    assert await run(connack, second, True, good, address) == RC.BANNED
    assert await run(connack, second, True, good, "127.0.0.10") == 0


async def test_an_administrator_lifts_a_ban_on_every_connector(suite):
    """GET /api/v1/login-bans lists the banned address; DELETE lifts it, and both connectors take its CONNECTs
    again while the ban would still last (each counts one ban lifted while in force)."""
    address, bad, good = "127.0.0.7", token("another-secret-of-an-attacker-0123456789"), token()
    first, second = suite.mqtt_ports
    health = [suite.health_port("connector", i) for i in (1, 2)]
    before = [await scrape(h) for h in health]
    for _ in range(FAILURES):
        assert await run(connack, first, True, bad, address) == RC.BAD_USER_NAME_OR_PASSWORD
    async with aiohttp.ClientSession() as http:
        base = suite.admin_url().rstrip("/") + "/api/v1"
        async with http.post(base + "/auth/login", json={
                "username": "admin", "password": suite.admin_password_file.read_text().strip()}) as r:
            auth = {"Authorization": "Bearer " + (await r.json())["token"]}

        async def listed() -> dict | None:
            async with http.get(base + "/login-bans", headers=auth) as r:
                return next((b for b in (await r.json())["items"] if b["address"] == address), None)
        ban = await wait_until(listed, BOUND, "the ban in the admin API")
        assert ban["by"].startswith("connector") and ban["until_ms"] > time.time() * 1000

        await wait_until(lambda: banned_on(suite.mqtt_ports, address), BAN_S, "the ban in force on both connectors")
        async with http.delete(base + "/login-bans/" + address, headers=auth) as r:
            assert r.status == 202, await r.text()
        async with http.delete(base + "/login-bans/" + address, headers=auth) as r:
            assert r.status == 404  # lifted: none in force any more

    async def lifted_on_both() -> bool:
        return all([value(await scrape(h), "tbmq_login_bans_lifted_total") - value(b, "tbmq_login_bans_lifted_total")
                    == 1 for h, b in zip(health, before)])
    await wait_until(lifted_on_both, BAN_S, "the lifting read by both connectors while the ban lasted")
    for p in (first, second):
        assert await run(connack, p, False, good, address) == 0


async def test_the_command_line_lifts_a_ban(suite):
    """`tbmq login-bans lift ADDRESS`, as the admin API's DELETE: the connector takes the address again while
    the ban would still last; lifting it again fails (none in force)."""
    address, bad, good = "127.0.0.8", token("another-secret-of-an-attacker-0123456789"), token()
    port = suite.mqtt_ports[1]
    health = suite.health_port("connector", 2)
    before = await scrape(health)
    for _ in range(FAILURES):
        assert await run(connack, port, True, bad, address) == RC.BAD_USER_NAME_OR_PASSWORD
    assert await run(connack, port, True, good, address) == RC.BANNED

    async def listed() -> bool:
        return address in await run(tbmq, suite, "login-bans", "list")
    await wait_until(listed, BOUND, "the ban on the topic")
    assert "lifted" in await run(tbmq, suite, "login-bans", "lift", address)

    async def lifted() -> bool:
        got = value(await scrape(health), "tbmq_login_bans_lifted_total")
        return got - value(before, "tbmq_login_bans_lifted_total") == 1
    await wait_until(lifted, BAN_S, "the lifting read while the ban lasted")
    assert await run(connack, port, True, good, address) == 0
    again = await run(subprocess.run, [TBMQ, "login-bans", "lift", address, "--bootstrap-servers",
                                       suite.bootstrap_servers], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "no login ban" in again.stderr
