"""Issue 16, deliverables 1 and 2: the admin service's REST API and web UI against the whole suite (the
launcher's Suite, as `make run` starts it), with MQTT clients nobody here wrote (paho-mqtt, mosquitto_pub).

The web UI is driven in headless Chromium (headless.py); its screenshots are kept under the test's tmp dir."""

from __future__ import annotations

import json
import subprocess
import time
from urllib.parse import quote

import aiohttp
import jwt
import pytest
from admin_api import Api
from admin_users import write_users
from argon2 import PasswordHasher
from headless import Browser, chromium
from mqtt_clients import Client, run, wait_until
from suites import module_suite
from tbmq_command import tbmq
from tbmq_launcher.launcher import Suite
from tbmq_launcher.services import ORDER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BOUND = 30.0


@pytest.fixture(scope="module")
async def suite(kafka, tmp_path_factory):
    """Every service of `make run` (admin included), single-node topics; clients `app-*` are APPLICATION."""
    async with module_suite(kafka, tmp_path_factory, "suite-admin", topic_profile="single-node",
                            env={"TBMQ_APPLICATION_CLIENT_ID_PATTERNS": "app-.*"}) as s:
        yield s


@pytest.fixture
async def api(suite):
    async with aiohttp.ClientSession() as http:
        yield await Api(suite, http).login_as_admin()


async def test_login_is_required_and_a_bad_password_is_refused(suite):
    async with aiohttp.ClientSession() as http:
        a = Api(suite, http)
        status, body = await a.call("POST", "/auth/login", json={"username": "admin", "password": "wrong"})
        assert status == 401 and "bad user name or password" in body["error"]
        assert (await a.call("GET", "/sessions"))[0] == 401
        a.token = "forged"
        assert (await a.call("GET", "/sessions"))[0] == 401
        status, doc = await a.call("GET", "/openapi.json", auth=False)  # public: describes how to log in
        assert status == 200 and "/api/v1/sessions/{client_id}/disconnect" in doc["paths"]


async def test_an_address_failing_its_logins_is_refused_for_the_window(suite, api):
    """ADMIN_LOGIN_FAILURES (5) wrong passwords from one address: the fifth bars it (tbmq_auth.failures), and its
    next login gets 429 with Retry-After even with the right password; other addresses log in meanwhile."""
    password = suite.admin_password_file.read_text().strip()
    url = suite.admin_url().rstrip("/") + "/api/v1/auth/login"
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.6", 0))  # an address of its own on the loopback
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(5):
            async with http.post(url, json={"username": "admin", "password": "guess"}) as r:
                assert r.status == 401
        async with http.post(url, json={"username": "admin", "password": password}) as r:
            assert r.status == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
    assert (await api.call("POST", "/auth/login", auth=False, json={"username": "admin", "password": password}))[0] \
        == 200  # from 127.0.0.1


async def test_services_endpoint_shows_every_service_ready(suite, api):
    body = await wait_until(lambda: _all_ready(api), BOUND, "every service ready in GET /services")
    assert sorted({i["service"] for i in body["items"]}) == sorted(ORDER)
    assert {i["instance"] for i in body["items"]} == {p.service_id for p in suite.procs.values()}


async def _all_ready(api: Api):
    body = await api.get("/services")
    return body if body["all_ready"] else None


async def _session(api: Api, cid: str, **expect):
    """The session of `cid` in GET /sessions (client id prefix filter) once it has the `expect`ed fields."""
    items = (await api.get(f"/sessions?client_id={quote(cid)}"))["items"]
    return next((s for s in items if s["client_id"] == cid and all(s[k] == v for k, v in expect.items())), None)


async def test_sessions_subscriptions_shared_groups_disconnect_and_clear(suite, api, unique):
    cid = unique("dev")
    c = Client(cid, session_expiry=300)
    await run(c.connect, suite.mqtt_ports[0])
    await run(c.subscribe, f"{cid}/temp/+", 1)
    await run(c.subscribe, f"$share/grp/{cid}/jobs", 1)
    s = await wait_until(lambda: _session(api, cid, connected=True), BOUND, "the connected session listed")
    assert s["client_type"] == "DEVICE" and s["mqtt_version"] == 5 and s["session_expiry_interval"] == 300
    assert (await api.get("/sessions?connected=false&client_id=" + cid))["total"] == 0

    async def subscribed():
        got = await api.get(f"/subscriptions?topic_filter={quote(cid)}")
        return got if got["total"] == 2 else None
    subs = await wait_until(subscribed, BOUND, "both subscriptions listed")
    assert {(x["topic_filter"], x["share_name"], x["qos"]) for x in subs["items"]} == {
        (f"{cid}/temp/+", "", 1), (f"{cid}/jobs", "grp", 1)}
    groups = (await api.get("/shared-subscriptions"))["items"]
    assert {"share_name": "grp", "topic_filter": f"{cid}/jobs", "members": [{"client_id": cid, "qos": 1}]} in groups
    detail = await api.get(f"/sessions/{cid}")
    assert len(detail["subscriptions"]) == 2 and "kafka" not in detail

    # disconnect through the API: the paho client gets DISCONNECT 0x98 Administrative action
    status, _ = await api.call("POST", f"/sessions/{cid}/disconnect")
    assert status == 202
    assert await run(c.wait, lambda: c.disconnected is not None, BOUND), "not disconnected"
    assert c.disconnected.value == 0x98, c.disconnected
    c.close()
    # the connector reported the end to the registry: the persistent session is kept, disconnected
    await wait_until(lambda: _session(api, cid, connected=False), BOUND, "the session disconnected")
    assert (await api.call("POST", f"/sessions/{cid}/disconnect"))[0] == 409

    # clear: the registry removes the session and its subscriptions
    status, _ = await api.call("DELETE", f"/sessions/{cid}")
    assert status == 202

    async def gone():
        return (await api.call("GET", f"/sessions/{cid}"))[0] == 404
    await wait_until(gone, BOUND, "the cleared session removed")
    await wait_until(lambda: _no_subscriptions(api, cid), BOUND, "its subscriptions removed")


async def _no_subscriptions(api: Api, cid: str) -> bool:
    return (await api.get(f"/subscriptions?client_id={quote(cid)}"))["total"] == 0


async def test_retained_message_listed_then_deleted_and_not_sent_to_a_new_subscriber(suite, api, unique):
    u = unique("ret")
    port = str(suite.mqtt_ports[0])

    def mosquitto_pub(topic: str, payload: str) -> None:
        subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", port, "-t", topic, "-m", payload, "-r", "-q", "1"],
                       check=True, timeout=30)

    await run(mosquitto_pub, f"{u}/lamp", "on")

    async def listed():
        items = (await api.get(f"/retained?topic={quote(u)}"))["items"]
        return items or None
    (item,) = await wait_until(listed, BOUND, "the retained message listed")
    assert (item["topic"], item["payload_text"], item["qos"]) == (f"{u}/lamp", "on", 1)

    status, _ = await api.call("DELETE", "/retained/" + quote(f"{u}/lamp", safe=""))
    assert status == 202
    assert (await api.get(f"/retained?topic={quote(u)}"))["total"] == 0
    assert (await api.call("DELETE", "/retained/" + quote(f"{u}/lamp", safe="")))[0] == 404
    # a retained marker after the deletion (same topic partition: tbmq.msg.retained has one): a subscriber that
    # gets the marker would have got the deleted message with it had the connector not applied the deletion
    await run(mosquitto_pub, f"{u}/marker", "m")
    sub = Client(unique("sub"))
    await run(sub.connect, suite.mqtt_ports[0])
    await run(sub.subscribe, f"{u}/#", 1)
    assert await run(sub.wait, lambda: sub.messages_on(f"{u}/marker"), BOUND), "no retained marker"
    assert sub.messages_on(f"{u}/lamp") == []
    await run(sub.close)


async def test_credentials_and_blocked_clients_through_the_api(suite, api, unique):
    """The store of the tbmq command line (tbmq.security.*), written through the API: a credential works for a
    real client on the connector, the hash never shows, a blocked client id is refused (CONNACK 0x8A), and
    deleting both undoes them."""
    user, cid = unique("apiuser"), unique("blk")
    status, body = await api.call("PUT", f"/credentials/{user}", json={"password": "pw", "pub": ["a/%u/#"],
                                                                        "sub": ["a/%u/#"], "hash_cost": "low"})
    assert status == 202 and body["password"] is True and "password_hash" not in body
    assert (await api.call("PUT", "/credentials/x", json={"pub": ["a/#/b"], "password": "p"}))[0] == 400
    assert (await api.call("PUT", "/credentials/x", json={"password": "p", "hash_cost": "none"}))[0] == 400
    listed = (await api.get("/credentials"))["items"]
    # never a hash (a user name of another test may say "hash": the field and the value are what count)
    assert any(c["username"] == user for c in listed)
    assert not any("password_hash" in c or "$argon2" in json.dumps(c) for c in listed)

    def connack(client_id: str, password: str, username: str = user) -> int:
        c = Client(client_id)
        c.c.username_pw_set(username, password)
        _, rc, _ = c.connect(suite.mqtt_ports[0], expect_ok=False)
        c.close()
        return rc.value

    # the connector's view applies the credential within a second or so: wait for it
    async def accepted() -> bool:
        return await run(connack, unique("c"), "pw") == 0
    await wait_until(accepted, BOUND, "the credential written through the API to work on the connector")
    assert await run(connack, unique("c"), "wrong") == 0x86  # bad user name or password

    status, rule = await api.call("POST", "/blocked", json={"kind": "client_id", "value": cid, "reason": "test"})
    assert status == 202 and rule["key"] == f"client_id:{cid}"
    assert (await api.call("POST", "/blocked", json={"kind": "nope", "value": "x"}))[0] == 400

    async def banned() -> bool:
        return await run(connack, cid, "pw") == 0x8A
    await wait_until(banned, BOUND, "the blocked client id refused with 0x8A")
    assert [r for r in (await api.get("/blocked"))["items"] if r["key"] == f"client_id:{cid}"][0]["active"]

    assert (await api.call("DELETE", f"/blocked/client_id:{cid}"))[0] == 202
    async def unbanned() -> bool:
        return await run(connack, cid, "pw") == 0
    await wait_until(unbanned, BOUND, "the client id accepted again once unblocked")
    assert (await api.call("DELETE", f"/credentials/{user}"))[0] == 202
    assert (await api.call("DELETE", f"/credentials/{user}"))[0] == 404


async def test_mqtt_tokens_revoked_through_the_api(suite, api, unique):
    """POST /revoked-tokens writes the record every connector applies (tbmq.security.tokens.revoked, the one
    `tbmq tokens` writes and reads: tests/e2e/connector/test_connector_auth.py has the connectors' side) from the
    token itself or its jti and exp; what is not a valid revocation, or a token already expired, is 400 and
    writes nothing; the list shows the revocations in force; DELETE withdraws one (404 when none is in force)."""
    jti, other = unique("jti"), unique("jti")
    exp = int(time.time()) + 3600
    token = jwt.encode({"jti": jti, "exp": exp, "sub": "dev"}, "k" * 32, algorithm="HS256")
    status, body = await api.call("POST", "/revoked-tokens", json={"token": token})
    assert (status, body) == (202, {"jti": jti, "exp": exp})
    assert (await api.call("POST", "/revoked-tokens", json={"jti": other, "exp": exp}))[0] == 202
    for bad in ({"jti": unique("jti")}, {"token": "not-a-token"}, {"token": token, "jti": other},
                {"token": jwt.encode({"exp": exp}, "k" * 32, algorithm="HS256")},  # no jti
                {"jti": unique("jti"), "exp": int(time.time()) - 1}, [jti]):
        status, body = await api.call("POST", "/revoked-tokens", json=bad)
        assert status == 400 and body["error"], (bad, status, body)
    listed = {e["jti"]: e["exp"] for e in (await api.get("/revoked-tokens"))["items"]}
    assert listed.get(jti) == exp and listed.get(other) == exp

    def cli_revoked() -> dict[str, int]:
        mine = (jti, other)
        return {e["jti"]: e["exp"] for e in map(json.loads, tbmq(suite, "tokens", "list").splitlines())
                if e["jti"] in mine}
    assert await run(cli_revoked) == {jti: exp, other: exp}  # on the topic, in the connectors' form
    assert (await api.call("DELETE", f"/revoked-tokens/{other}"))[0] == 202
    assert (await api.call("DELETE", f"/revoked-tokens/{other}"))[0] == 404
    assert await run(cli_revoked) == {jti: exp}
    assert other not in [e["jti"] for e in (await api.get("/revoked-tokens"))["items"]]
    assert (await api.call("DELETE", f"/revoked-tokens/{jti}"))[0] == 202


async def test_application_client_backlog_is_its_kafka_lag(suite, api, unique):
    cid = unique("app")
    app = Client(cid, session_expiry=300)
    await run(app.connect, suite.mqtt_ports[0])
    await run(app.subscribe, f"{cid}/in", 1)
    await run(app.close, wait=True)
    await wait_until(lambda: _session(api, cid, connected=False, client_type="APPLICATION"), BOUND,
                     "the APPLICATION session disconnected")
    pub = Client(unique("pub"))
    await run(pub.connect, suite.mqtt_ports[0])
    for i in range(3):
        await run(pub.publish, f"{cid}/in", f"m{i}".encode(), 1)
    await run(pub.close)

    async def lag3():
        detail = await api.get(f"/sessions/{cid}")
        return detail if detail["kafka"]["lag"] == 3 else None
    detail = await wait_until(lag3, BOUND, "a backlog of 3 records")
    assert detail["kafka"]["topic"].startswith("tbmq.msg.app.")
    apps = (await api.get("/applications?limit=1000"))["items"]
    assert [a["kafka"]["lag"] for a in apps if a["client_id"] == cid] == [3]
    assert (await api.get("/overview"))["application_lag"] >= 3


async def test_statistics_windows_of_the_spark_job(suite, api):
    """A UsageStats record as the Spark stats job writes it (docs/spark.md; the job itself is tested in
    tests/integration/spark): listed by GET /stats, the last record of a window key winning."""
    import random
    import time

    from tbmq.v1 import messages_pb2 as pb
    from tbmq_platform.kafka import make_producer
    from tbmq_platform.topics import SYS_HISTORICAL_DATA

    start = (int(time.time() * 1000) // 60_000 + random.randint(10**6, 10**7)) * 60_000  # a window of its own
    producer = make_producer(suite.bootstrap_servers, client_id="test-stats")
    await producer.start()
    try:
        for n in (1, 7):
            w = pb.UsageStats(source="spark-stats", window_start_ms=start, window_end_ms=start + 60_000,
                              stats=[pb.UsageStat(key="incoming_msgs", value=n),
                                     pb.UsageStat(key="incoming_msgs", dimension="qos=1", value=n)])
            await (await producer.send(SYS_HISTORICAL_DATA, w.SerializeToString(), key=str(start).encode()))
    finally:
        await producer.stop()

    async def window():
        items = (await api.get(f"/stats?since_ms={start}"))["items"]
        return items if items and items[0]["totals"] == {"incoming_msgs": 7} else None
    (w,) = await wait_until(window, BOUND, "the statistics window")
    assert w["window_end_ms"] == start + 60_000 and w["dimensions"] == {"incoming_msgs": {"qos=1": 7}}


@pytest.mark.skipif(chromium() is None, reason="no chromium (scripts/bootstrap.sh installs Debian's chromium)")
async def test_web_ui_login_overview_sessions_and_retained(suite, api, unique, tmp_path):
    cid = unique("ui")
    # a persistent session: its subscription is still there (on the subscriptions page) after the UI's Disconnect
    c = Client(cid, clean=False, session_expiry=600)
    await run(c.connect, suite.mqtt_ports[0])
    await run(c.subscribe, f"{cid}/status", 1)
    await run(c.publish, f"{cid}/status", b"online", 1, retain=True)
    await wait_until(lambda: _session(api, cid, connected=True), BOUND, "the session in the API")
    browser = await Browser(tmp_path / "chromium").start()
    try:
        url = await _login_page(browser, suite)
        # a wrong password: the page says so and stays on the login form
        await browser.evaluate("document.querySelector('#password').value = 'wrong';"
                               "document.querySelector('#login-button').click()")
        await wait_until(lambda: _text_has(browser, "#login-error", "Login failed"), BOUND, "the login error")
        await browser.screenshot(tmp_path / "login-failed.png")
        password = suite.admin_password_file.read_text().strip()
        await browser.evaluate(f"document.querySelector('#password').value = {password!r};"
                               "document.querySelector('#login-button').click()")
        await wait_until(lambda: _shows(browser, "overview", "Connected"), BOUND, "the overview")
        # the live charts follow the API, polled every 3 s: two samples draw a line
        await wait_until(lambda: browser.evaluate(
            "document.querySelectorAll('#page svg[aria-label=\"Connections (live)\"] circle').length >= 2"),
            BOUND, "two samples on the connections chart")
        await browser.screenshot(tmp_path / "overview.png")
        await browser.goto(url + "#sessions?client_id=" + cid)
        await wait_until(lambda: _shows(browser, "sessions", cid), BOUND, "the session in the sessions table")
        row = await browser.evaluate(
            f"[...document.querySelectorAll('#page tbody tr')].map(r => r.innerText).find(t => t.includes({cid!r}))")
        assert "DEVICE" in row and "yes" in row, row
        await browser.screenshot(tmp_path / "sessions.png")
        # the Disconnect button: the client gets DISCONNECT 0x98
        await browser.evaluate(f"document.querySelector('[data-disconnect=\"{cid}\"]').click()")
        assert await run(c.wait, lambda: c.disconnected is not None, BOUND), "not disconnected from the UI"
        assert c.disconnected.value == 0x98
        await browser.goto(url + "#subscriptions")
        await wait_until(lambda: _shows(browser, "subscriptions", f"{cid}/status"), BOUND, "the subscription")
        await browser.screenshot(tmp_path / "subscriptions.png")
        await browser.goto(url + "#retained")
        await wait_until(lambda: _shows(browser, "retained", f"{cid}/status"), BOUND, "the retained message")
        assert "online" in await browser.text("#page table")
        await browser.screenshot(tmp_path / "retained.png")
        # credentials and blocked clients: written from their pages, shown in their tables (never a hash)
        user = unique("uiuser")
        await browser.goto(url + "#credentials")
        await wait_until(lambda: _shows(browser, "credentials", "Credentials"), BOUND, "the credentials page")
        await browser.evaluate(f"{{ const f = document.querySelector('#cred-form'); f.username.value = {user!r};"
                               "f.password.value = 'pw'; f.pub.value = 'ui/%u/#'; f.sub.value = 'ui/%u/+';"
                               "f.querySelector('button').click() }")
        await wait_until(lambda: _shows(browser, "credentials", user), BOUND, "the new credential in the table")
        assert "argon2" not in await browser.text("#page")
        await browser.screenshot(tmp_path / "credentials.png")
        assert any(cr["username"] == user for cr in (await api.get("/credentials"))["items"])
        await browser.goto(url + "#blocked")
        await wait_until(lambda: _shows(browser, "blocked", "Blocked clients"), BOUND, "the blocked page")
        await browser.evaluate(f"{{ const f = document.querySelector('#block-form'); f.elements.value.value = "
                               f"{cid + '-x'!r}; f.reason.value = 'ui test'; f.querySelector('button').click() }}")
        await wait_until(lambda: _shows(browser, "blocked", f"client_id:{cid}-x"), BOUND, "the rule in the table")
        await browser.screenshot(tmp_path / "blocked.png")
        # a token revoked from its own text, shown in the revoked tokens' table, withdrawn with its button
        jti = unique("uijti")
        token = jwt.encode({"jti": jti, "exp": int(time.time()) + 600}, "k" * 32, algorithm="HS256")
        await browser.evaluate(f"{{ const f = document.querySelector('#revoke-form'); f.token.value = {token!r};"
                               "f.querySelector('button').click() }")
        await wait_until(lambda: _shows(browser, "blocked", jti), BOUND, "the revoked token in the table")
        assert jti in [t["jti"] for t in (await api.get("/revoked-tokens"))["items"]]
        await browser.evaluate(f"document.querySelector('[data-withdraw=\"{jti}\"]').click()")

        async def withdrawn() -> bool:
            return jti not in [t["jti"] for t in (await api.get("/revoked-tokens"))["items"]]
        await wait_until(withdrawn, BOUND, "the revocation withdrawn from the UI")
        await api.call("DELETE", f"/blocked/client_id:{cid}-x")
        await api.call("DELETE", f"/credentials/{user}")
        await browser.goto(url + "#services")
        await wait_until(lambda: _shows(browser, "services", "admin"), BOUND, "the services")
        assert "NOT READY" not in await browser.text("#page table")
        await browser.screenshot(tmp_path / "services.png")
        print(f"\nscreenshots in {tmp_path}")
    finally:
        await browser.stop()
        await run(c.close)


@pytest.mark.skipif(chromium() is None, reason="no chromium (scripts/bootstrap.sh installs Debian's chromium)")
async def test_web_ui_of_a_viewer_shows_the_lists_without_what_changes_things(suite, api, unique, tmp_path):
    """A `viewer` user (ADMIN_USERS_FILE's role field): the pages list as for an administrator, and no button,
    form or page that would change something (or show the credentials) is on them."""
    users = suite.admin_users_file
    original = users.read_text()
    write_users(users, original + f"watch-ui:{PasswordHasher().hash('viewer-password')}:viewer\n")
    cid = unique("uiview")
    c = Client(cid, clean=False, session_expiry=600)
    await run(c.connect, suite.mqtt_ports[0])
    await wait_until(lambda: _session(api, cid, connected=True), BOUND, "the session in the API")
    browser = await Browser(tmp_path / "chromium").start()
    try:
        url = await _login_page(browser, suite)
        await browser.evaluate("document.querySelector('#username').value = 'watch-ui';"
                               "document.querySelector('#password').value = 'viewer-password';"
                               "document.querySelector('#login-button').click()")
        await wait_until(lambda: _shows(browser, "overview", "Connected"), BOUND, "the overview")
        hidden = "[...document.querySelectorAll('[data-write]')].every(e => e.offsetParent === null)"
        assert await browser.evaluate("document.querySelector('nav a[href=\"#credentials\"]').offsetParent === null")
        await browser.goto(url + "#sessions?client_id=" + cid)
        await wait_until(lambda: _shows(browser, "sessions", cid), BOUND, "the session in the sessions table")
        assert await browser.evaluate(f"document.querySelectorAll('[data-disconnect=\"{cid}\"]').length") == 1
        assert await browser.evaluate(hidden), "a Disconnect or Clear button shown to a viewer"
        await browser.screenshot(tmp_path / "viewer-sessions.png")
        await browser.goto(url + "#blocked")
        await wait_until(lambda: _shows(browser, "blocked", "Blocked clients"), BOUND, "the blocked page")
        assert await browser.evaluate("document.querySelectorAll('#block-form').length") == 1
        assert await browser.evaluate(hidden), "the Block form shown to a viewer"
        assert c.disconnected is None  # nothing done to the client
    finally:
        await browser.stop()
        await run(c.close)
        write_users(users, original)


async def _login_page(browser: Browser, suite: Suite) -> str:
    """The UI opened on its login form; its URL."""
    url = suite.admin_url()
    await browser.goto(url)
    await wait_until(lambda: browser.evaluate("!document.querySelector('#login').hidden"), BOUND, "login page")
    return url


async def _text_has(browser: Browser, selector: str, text: str) -> bool:
    return text in await browser.text(selector)


async def _shows(browser: Browser, page: str, text: str) -> bool:
    """Page `page` of the UI rendered (not the previous page's table still there) with `text` in it."""
    return (await browser.evaluate("document.querySelector('#page').dataset.shown") == page
            and text in await browser.text("#page"))
