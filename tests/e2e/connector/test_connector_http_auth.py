"""Provider http end to end (MQTT_AUTH_PROVIDERS=http, docs/security.md): the operator's authentication service —
an http.server of this test deciding per client id — is asked at every CONNECT of paho-mqtt 3.1.1 and 5.0
clients. It sees what the CONNECT said and the connector's Authorization header; its `allow` connects with the
acl it gives (SUBSCRIBE and PUBLISH outside it refused), `deny` refuses with 0x86, an error status or no
service at all refuses with 0x88 (never falling through), and an `expire_at` ends the connection then."""

from __future__ import annotations

import json
import time

import pytest
from connector_helpers import connector_health
from http_endpoint import Answer, HttpEndpoint, Request
from mqtt_clients import BOUND, Client, payloads, run, wait_until
from scraped import scrape, value
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_mqtt import ReasonCode as RC

pytestmark = [pytest.mark.e2e]

SECRET = "Bearer e2e-connector"


class AuthService(HttpEndpoint):
    """The operator's service: `answers[client id]` = (status, JSON document); every question is recorded."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, dict | None]] = {}
        self.questions: list[tuple[dict, str | None]] = []
        super().__init__(self._answer)

    def _answer(self, request: Request) -> Answer:
        body = json.loads(request.body)
        self.questions.append((body, request.headers.get("authorization")))
        status, doc = self.answers.get(body["clientid"], (200, {"result": "deny"}))
        return Answer(status, json.dumps(doc).encode() if doc is not None else b"")


@pytest.fixture(scope="module")
def service():
    s = AuthService()
    yield s
    s.close()


@pytest.fixture(scope="module")
async def suite(kafka, tmp_path_factory, service):
    env = {"MQTT_ALLOW_ANONYMOUS": "false", "MQTT_AUTH_PROVIDERS": "http",
           "MQTT_AUTH_HTTP_URL": f"{service.base}/mqtt/auth", "MQTT_AUTH_HTTP_AUTHORIZATION": SECRET,
           "MQTT_AUTH_HTTP_TIMEOUT_S": "2"}
    async with Suite(services=["session-registry", "router", "connector"], ports="free", log_format="json",
                     id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-http-auth"),
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"connector": env}) as s:
        yield s


def connack(port: int, cid: str, v5: bool, auth=None) -> tuple[int, Client | None]:
    """The CONNACK reason code (paho reports a 3.1.1 return code as its v5 reason) and the client if accepted."""
    c = Client(cid, v5=v5, auth=auth)
    got = c.connect(port, expect_ok=False)
    if got is None or got[1].is_failure:
        c.close()
        return (got[1].value if got is not None else -1), None
    return 0, c


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_the_service_decides_who_connects_and_with_which_rights(suite, service, v5):
    port, tag = suite.mqtt_ports[0], new_tag()
    dev, watcher = f"dev-{tag}", f"watch-{tag}"
    service.answers[dev] = (200, {"result": "allow", "acl": {"pub": ["up/%c"], "sub": ["down/%u"]}})
    service.answers[watcher] = (204, None)  # allowed, every right
    rc, w = await run(connack, port, watcher, v5)
    assert rc == 0
    await run(w.subscribe, f"up/{dev}", 1)
    rc, c = await run(connack, port, dev, v5, ("alice", "pw-1"))
    assert rc == 0
    asked = [(body, header) for body, header in service.questions if body["clientid"] == dev]
    assert asked == [({"clientid": dev, "username": "alice", "password": "pw-1", "peerhost": "127.0.0.1",
                       "cert_names": []}, SECRET)]
    codes = await run(c.subscribe, [("down/alice", 1), ("down/bob", 1)])
    assert [getattr(rc, "value", rc) for rc in codes] == [1, RC.NOT_AUTHORIZED if v5 else RC.UNSPECIFIED_ERROR]
    info = await run(c.publish, "elsewhere", b"denied", 1, check=False)
    assert await run(c.wait, lambda: info.mid in c.pubacks)
    assert c.pubacks[info.mid].value == (RC.NOT_AUTHORIZED if v5 else 0)
    await run(c.publish, f"up/{dev}", b"allowed", 1)
    assert await run(w.wait, lambda: payloads(w, f"up/{dev}") == [b"allowed"])
    for x in (c, w):
        await run(x.close)


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_deny_is_refused_and_a_broken_or_missing_service_is_server_unavailable(suite, service, v5):
    port, tag = suite.mqtt_ports[0], new_tag()
    service.answers[f"deny-{tag}"] = (200, {"result": "deny"})
    service.answers[f"err-{tag}"] = (500, {"result": "allow"})
    service.answers[f"junk-{tag}"] = (200, {"result": "perhaps"})
    assert (await run(connack, port, f"deny-{tag}", v5, ("u", "p")))[0] == RC.BAD_USER_NAME_OR_PASSWORD
    assert (await run(connack, port, f"err-{tag}", v5, ("u", "p")))[0] == RC.SERVER_UNAVAILABLE
    assert (await run(connack, port, f"junk-{tag}", v5, ("u", "p")))[0] == RC.SERVER_UNAVAILABLE


async def test_an_answer_with_expire_at_ends_the_connection_then(suite, service):
    port, cid = suite.mqtt_ports[0], f"exp-{new_tag()}"
    service.answers[cid] = (200, {"result": "allow", "expire_at": int(time.time()) + 3})
    rc, c = await run(connack, port, cid, True)
    assert rc == 0
    assert await run(c.wait, lambda: c.disconnects, BOUND), "the client stayed after its expire_at"
    assert c.disconnects[0].value == RC.NOT_AUTHORIZED


async def test_no_service_listening_is_server_unavailable(kafka, tmp_path_factory):
    """The service down (nothing on its port): 0x88, after at most the connection refusal."""
    closed = AuthService()
    url = f"{closed.base}/mqtt/auth"
    closed.close()
    env = {"MQTT_ALLOW_ANONYMOUS": "true", "MQTT_AUTH_PROVIDERS": "http,anonymous", "MQTT_AUTH_HTTP_URL": url,
           "MQTT_AUTH_HTTP_TIMEOUT_S": "2"}
    async with Suite(services=["session-registry", "connector"], ports="free", log_format="json", id_tag=new_tag(),
                     run_dir=tmp_path_factory.mktemp("suite-http-auth-down"),
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"connector": env}) as s:
        # anonymous is next in the order, and allowed: an unreachable service must not fall through to it
        assert (await run(connack, s.mqtt_ports[0], f"c-{new_tag()}", True))[0] == RC.SERVER_UNAVAILABLE
        assert (await connector_health(s)).get("http_auth_errors") == 1
        metrics = await scrape(s.health_port("connector"))
        assert value(metrics, "tbmq_auth_http_requests_total") == value(metrics, "tbmq_auth_http_errors_total") == 1


async def test_kept_answers_spare_the_service_until_they_expire(kafka, tmp_path_factory, service):
    """MQTT_AUTH_HTTP_CACHE_S: a reconnect with the same credentials is answered from the kept answer (the
    service is not asked again, not even when its decision changed), another password is another question, an
    error is never kept; once the answer expires the service's new decision applies."""
    env = {"MQTT_ALLOW_ANONYMOUS": "false", "MQTT_AUTH_PROVIDERS": "http", "MQTT_AUTH_HTTP_URL": f"{service.base}/a",
           "MQTT_AUTH_HTTP_CACHE_S": "3"}
    async with Suite(services=["session-registry", "connector"], ports="free", log_format="json", id_tag=new_tag(),
                     run_dir=tmp_path_factory.mktemp("suite-http-auth-cache"),
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"connector": env}) as s:
        port, cid, flaky = s.mqtt_ports[0], f"kept-{new_tag()}", f"flaky-{new_tag()}"

        def asked(client_id: str) -> int:
            return sum(body["clientid"] == client_id for body, _ in service.questions)

        async def connects(client_id: str, password: str) -> int:
            rc, c = await run(connack, port, client_id, True, ("u", password))
            if c is not None:
                await run(c.close)
            return rc

        service.answers[cid] = (204, None)
        assert await connects(cid, "pw") == 0 and asked(cid) == 1
        service.answers[cid] = (200, {"result": "deny"})  # the service changes its mind
        assert await connects(cid, "pw") == 0 and asked(cid) == 1  # the kept answer: not asked
        assert await connects(cid, "other") == RC.BAD_USER_NAME_OR_PASSWORD and asked(cid) == 2

        async def refused() -> bool:
            return await connects(cid, "pw") == RC.BAD_USER_NAME_OR_PASSWORD
        await wait_until(refused, BOUND, "the kept allow expiring")
        service.answers[flaky] = (500, {})
        for _ in range(2):  # errors are asked every time
            assert await connects(flaky, "pw") == RC.SERVER_UNAVAILABLE
        assert asked(flaky) == 2
        metrics = await scrape(s.health_port("connector"))
        assert value(metrics, "tbmq_auth_http_cached_total") >= 1
