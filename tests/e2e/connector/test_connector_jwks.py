"""Provider jwt with a JWK Set (MQTT_AUTH_JWT_JWKS), end to end with paho-mqtt 5.0: the token issuer rotates its
keys and the connector follows without a restart. Two sources: an https URL (the issuer's JWKS endpoint, an
http.server of this test answering what the issuer publishes, its certificate from a CA of its own given in
MQTT_AUTH_JWT_JWKS_CA_FILE; an unchanged set is answered 304) and a file replaced by rename. Until a URL's
first set loads, tokens get CONNACK 0x88 Server unavailable; a set that stops loading keeps the keys it had;
a key taken out of the set, or replaced under its kid, stops its tokens at the next CONNECT and closes the
connections they opened."""

from __future__ import annotations

import hashlib
import json
import os
import time

import jwt
import pytest
from connector_helpers import connector_health
from cryptography.hazmat.primitives.asymmetric import ec
from http_endpoint import Answer, HttpEndpoint, Request
from jwt.algorithms import ECAlgorithm
from mqtt_clients import BOUND, Client, connack_code, run, wait_until
from scraped import scrape, value
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.tls import DevCerts, ensure_dev_certs
from tbmq_mqtt import ReasonCode as RC

pytestmark = [pytest.mark.e2e]

REFRESH_S = "0.3"


class Issuer:
    """The token issuer: its keys by kid, the JWK Set it publishes (`document`), tokens signed by one key."""

    def __init__(self) -> None:
        self.keys = {kid: ec.generate_private_key(ec.SECP256R1()) for kid in ("2026-11", "2026-12")}

    def document(self, *kids: str) -> bytes:
        return json.dumps({"keys": [{**json.loads(ECAlgorithm.to_jwk(self.keys[k].public_key())), "kid": k}
                                    for k in kids]}).encode()

    def token(self, kid: str, client_id: str) -> str:
        return jwt.encode({"exp": int(time.time() + 3600), "client_id": client_id, "acl": {"pub": ["t/%c"]}},
                          self.keys[kid], algorithm="ES256", headers={"kid": kid})


class Endpoint(HttpEndpoint):
    """The issuer's JWKS endpoint over https (the development CA's server certificate): serves `body` with
    `status`, and as issuers' endpoints do, an ETag (the body's hash) and 304 Not Modified to a request whose
    If-None-Match names it (counted in `not_modified`)."""

    def __init__(self, certs: DevCerts) -> None:
        self.status, self.body, self.not_modified = 503, b"", 0
        super().__init__(self._answer, tls=(certs.server_cert, certs.server_key))
        self.url = f"{self.base}/.well-known/jwks.json"

    def _answer(self, request: Request) -> Answer:
        if self.status != 200:
            return Answer(self.status)
        tag = f'"{hashlib.sha256(self.body).hexdigest()[:16]}"'
        if request.headers.get("if-none-match") == tag:
            self.not_modified += 1
            return Answer(304, headers={"ETag": tag})
        return Answer(200, self.body, {"Content-Type": "application/json", "ETag": tag})


def connack(port: int, client_id: str, token: str) -> int:
    """The CONNACK reason code of a v5 CONNECT with `token` as password (0: accepted, then disconnected)."""
    return connack_code(port, client_id, True, ("device", token))


async def until_connack(port: int, client_id: str, token: str, want: int, what: str) -> None:
    async def seen() -> bool:
        return await run(connack, port, client_id, token) == want
    await wait_until(seen, BOUND, what)


async def jwks_suite(kafka, run_dir, source: str, **extra: str):
    env = {"MQTT_ALLOW_ANONYMOUS": "false", "MQTT_AUTH_PROVIDERS": "jwt", "MQTT_AUTH_JWT_JWKS": source,
           "MQTT_AUTH_JWT_JWKS_REFRESH_S": REFRESH_S, **extra}
    return Suite(services=["session-registry", "router", "connector"], ports="free", log_format="json",
                 id_tag=new_tag(), run_dir=run_dir, kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                 service_env={"connector": env})


async def test_keys_rotate_through_a_jwks_endpoint_without_a_restart(kafka, tmp_path_factory):
    certs = ensure_dev_certs(tmp_path_factory.mktemp("jwks-ca"), "e2e JWKS issuer CA")
    issuer, endpoint = Issuer(), Endpoint(certs)
    try:
        async with await jwks_suite(kafka, tmp_path_factory.mktemp("suite-jwks-url"), endpoint.url,
                                    MQTT_AUTH_JWT_JWKS_CA_FILE=str(certs.ca)) as s:
            port, cid = s.mqtt_ports[0], f"dev-{new_tag()}"
            old, new = issuer.token("2026-11", cid), issuer.token("2026-12", cid)
            # the endpoint answers 503: no key yet, the client is told to come back
            assert await run(connack, port, cid, old) == RC.SERVER_UNAVAILABLE
            endpoint.status, endpoint.body = 200, issuer.document("2026-11")
            await until_connack(port, cid, old, 0, "the first key set loaded")
            # refreshed while unchanged: asked with its ETag, answered 304, nothing loaded again
            loads = (await connector_health(s)).get("jwks_loads")
            await wait_until(lambda: endpoint.not_modified >= 2, BOUND, "refreshes answered 304")
            assert (await connector_health(s)).get("jwks_loads") == loads
            assert await run(connack, port, cid, new) == RC.BAD_USER_NAME_OR_PASSWORD  # the next key: not yet
            endpoint.body = issuer.document("2026-11", "2026-12")  # rotation: the next key beside the current
            await until_connack(port, cid, new, 0, "the next key published")
            assert await run(connack, port, cid, old) == 0
            endpoint.body = b"<html>maintenance</html>"  # the issuer's endpoint broken: the keys stay
            failures = (await connector_health(s)).get("jwks_failures", 0)  # the 503s before
            await wait_until(lambda: _more(s, "jwks_failures", failures), BOUND, "a failed refresh")
            assert await run(connack, port, cid, old) == 0 and await run(connack, port, cid, new) == 0
            # clients connected with a token of each key: retiring the old key closes the old token's connection
            online = {}
            for kid in ("2026-11", "2026-12"):
                c = online[kid] = Client(f"{cid}-{kid}", auth=("device", issuer.token(kid, f"{cid}-{kid}")))
                await run(c.connect, port)
            endpoint.body = issuer.document("2026-12")  # the old key retired
            # waited for through the old key's connected client, not by probing CONNECTs with the old token: a
            # probe connected at the moment the set loads would be closed (and counted) too
            gone = online["2026-11"]
            assert await run(gone.wait, lambda: gone.disconnects, BOUND), "the retired key's client stayed"
            assert gone.disconnects[0].value == RC.ADMINISTRATIVE_ACTION
            assert await run(connack, port, cid, old) == RC.BAD_USER_NAME_OR_PASSWORD
            assert await run(connack, port, cid, new) == 0
            assert online["2026-12"].disconnects == []
            assert (await connector_health(s)).get("connections_key_retired") == 1
            metrics = await scrape(s.health_port("connector"))
            assert value(metrics, "tbmq_connections_revoked_total", reason="key_retired") == 1
            assert value(metrics, "tbmq_reloads_total", what="jwks", result="loaded") >= 3
            assert value(metrics, "tbmq_reloads_total", what="jwks", result="failed") >= 1
            for c in online.values():
                await run(c.close)
    finally:
        endpoint.close()


async def test_keys_rotate_through_a_jwks_file_without_a_restart(kafka, tmp_path_factory, tmp_path):
    issuer = Issuer()
    key_set = tmp_path / "jwks.json"

    def publish(document: bytes) -> None:  # as a deployment tool would: a new file renamed over the old one
        (tmp_path / "next.json").write_bytes(document)
        os.replace(tmp_path / "next.json", key_set)

    publish(issuer.document("2026-11"))
    async with await jwks_suite(kafka, tmp_path_factory.mktemp("suite-jwks-file"), str(key_set)) as s:
        port, cid = s.mqtt_ports[0], f"dev-{new_tag()}"
        old, new = issuer.token("2026-11", cid), issuer.token("2026-12", cid)
        assert await run(connack, port, cid, old) == 0  # loaded at start-up
        assert await run(connack, port, cid, new) == RC.BAD_USER_NAME_OR_PASSWORD
        publish(issuer.document("2026-11", "2026-12"))
        await until_connack(port, cid, new, 0, "the next key in the file")
        publish(issuer.document("2026-12"))
        await until_connack(port, cid, old, RC.BAD_USER_NAME_OR_PASSWORD, "the old key retired")
        assert await run(connack, port, cid, new) == 0
        assert (await connector_health(s)).get("jwks_loads") == 2  # the two changes; start-up's load not counted
        # the key under kid 2026-12 replaced by another (compromised, reissued under the same kid): the client
        # its token connected is closed, by the key's thumbprint, and the new key's tokens are taken
        online = Client(f"{cid}-on", auth=("device", issuer.token("2026-12", f"{cid}-on")))
        await run(online.connect, port)
        retired = (await connector_health(s)).get("connections_key_retired", 0)  # no probe open now
        issuer.keys["2026-12"] = ec.generate_private_key(ec.SECP256R1())
        publish(issuer.document("2026-12"))
        assert await run(online.wait, lambda: online.disconnects, BOUND), "the replaced key's client stayed"
        assert online.disconnects[0].value == RC.ADMINISTRATIVE_ACTION
        assert (await connector_health(s)).get("connections_key_retired") == retired + 1
        assert await run(connack, port, cid, new) == RC.BAD_USER_NAME_OR_PASSWORD
        assert await run(connack, port, cid, issuer.token("2026-12", cid)) == 0
        await run(online.close)


async def _more(s, key: str, than: int) -> bool:
    return (await connector_health(s)).get(key, 0) > than
