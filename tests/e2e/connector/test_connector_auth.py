"""Authentication and authorization end to end (docs/security.md), with clients nobody here wrote: paho-mqtt
3.1.1 and 5.0 and mosquitto_pub/mosquitto_sub with -u/-P, against two connectors (+ session registry and
router) that refuse anonymous clients (MQTT_ALLOW_ANONYMOUS=false), ask TLS clients for a certificate
(MQTT_TLS_CLIENT_AUTH=optional) and take JSON Web Tokens as passwords (provider jwt, an EC public key).
Credentials and blocked clients are written with the `tbmq` command line (a subprocess, as an operator runs
it); a change is waited for with `waits.wait_until`, never a sleep.

The tests' Kafka is shared by every e2e module: the credentials, certificate names and blocked client ids
here are unique per test, so no other module's clients are affected.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from connector_helpers import two_connector_suite
from mqtt_clients import BOUND, Client, payloads, poll, run, wait_until
from tbmq_command import tbmq
from tbmq_launcher.tls import issue_client_cert
from tbmq_mqtt import ConnackReturnCode, ReasonCode

pytestmark = [pytest.mark.e2e]

RC = ReasonCode
V3 = ConnackReturnCode


@pytest.fixture(scope="module")
def jwt_key(tmp_path_factory):
    """The token issuer's key (EC P-256): its public half is the connectors' MQTT_AUTH_JWT_PUBLIC_KEY_FILE."""
    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path_factory.mktemp("jwt") / "issuer.pem"
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, path


@pytest.fixture(scope="module")
async def sec(kafka, tmp_path_factory, jwt_key):
    env = {"MQTT_ALLOW_ANONYMOUS": "false", "MQTT_TLS_CLIENT_AUTH": "optional",
           "MQTT_AUTH_PROVIDERS": "password,x509,jwt", "MQTT_AUTH_JWT_PUBLIC_KEY_FILE": str(jwt_key[1])}
    async with two_connector_suite(kafka, tmp_path_factory.mktemp("suite-auth"),
                                   ["session-registry", "router", "connector"],
                                   service_env={"connector": env}) as s:
        yield s


async def add_credential(s, username: str, password: str | None, *extra: str) -> None:
    args = ["credentials", "add", "--username", username, *extra]
    if password is not None:
        args.append("--password-stdin")
    await run(tbmq, s, *args, stdin=None if password is None else password + "\n")


def try_connect(port: int, cid: str, v5: bool, auth=None, **kw) -> tuple[int, Client]:
    """CONNECT with paho; (reason / return code, client). A refused client is stopped already."""
    c = Client(cid, v5=v5, auth=auth, **kw)
    connack = c.connect(port, expect_ok=False)
    if connack is None or connack[1].is_failure:
        c.close()
        rc = connack[1] if connack is not None else None
        return (v3_code(rc) if not v5 and rc is not None else (rc.value if rc is not None else -1)), c
    return 0, c


def v3_code(rc) -> int:
    """paho 2 reports a 3.1.1 CONNACK return code as a ReasonCode mapped to v5 names: back to 3.1.1."""
    return {RC.BAD_USER_NAME_OR_PASSWORD: V3.BAD_USER_NAME_OR_PASSWORD, RC.NOT_AUTHORIZED: V3.NOT_AUTHORIZED,
            RC.BANNED: V3.NOT_AUTHORIZED}.get(rc.value, rc.value) if rc.value > 5 else rc.value


async def accepted_on(port: int, cid: str, v5: bool, auth, **kw) -> Client:
    """Wait until a CONNECT with `auth` (and `kw`: tls=...) is accepted on `port` (a new credential reaching
    that connector); the connected client."""
    found: list[Client] = []

    async def attempt() -> bool:
        rc, c = await run(try_connect, port, cid, v5, auth, **kw)
        if rc == 0:
            found.append(c)
        return rc == 0

    await wait_until(attempt, BOUND, f"credential accepted on :{port}", step=0.05)
    return found[0]


# ------------------------------------------------------------------------------------------------ passwords
@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_password_credential_added_with_the_cli_works_on_both_connectors(sec, unique, v5):
    user = unique("u")
    await add_credential(sec, user, "pw-" + user, "--pub", f"auth/{user}/#", "--sub", f"auth/{user}/#")
    for i, port in enumerate(sec.mqtt_ports):
        c = await accepted_on(port, f"{user}-{i}", v5, (user, "pw-" + user))
        await run(c.close)
    refused = {"bad password": (user, "wrong"), "unknown user": (unique("nobody"), "x"), "anonymous": None}
    expected = {"bad password": RC.BAD_USER_NAME_OR_PASSWORD, "unknown user": RC.BAD_USER_NAME_OR_PASSWORD,
                "anonymous": RC.NOT_AUTHORIZED}
    for what, auth in refused.items():
        for port in sec.mqtt_ports:
            rc, _ = await run(try_connect, port, unique("r"), v5, auth)
            want = expected[what] if v5 else {RC.BAD_USER_NAME_OR_PASSWORD: V3.BAD_USER_NAME_OR_PASSWORD,
                                               RC.NOT_AUTHORIZED: V3.NOT_AUTHORIZED}[expected[what]]
            assert rc == want, (what, port, rc)


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto-clients not installed")
async def test_mosquitto_clients_with_user_and_password(sec, unique):
    user = unique("mo")
    topic = f"auth/{user}/t"
    await add_credential(sec, user, "pw", "--pub", f"auth/{user}/#", "--sub", f"auth/{user}/#")
    # the credential reached both connectors (the subscriber's and the publisher's)
    for port in sec.mqtt_ports:
        await run((await accepted_on(port, unique("w"), True, (user, "pw"))).close)
    up = ["-u", user, "-P", "pw"]
    sub = subprocess.Popen(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(sec.mqtt_ports[0]), *up, "-t", topic,
                            "-q", "1", "-C", "1", "-i", user + "s", "-W", str(int(BOUND) + 10)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        attempts = iter(range(1, 10_000))

        async def received() -> bool:  # publish on the other connector until mosquitto_sub got one
            await run(subprocess.run, ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(sec.mqtt_ports[1]), *up,
                                       "-t", topic, "-m", "hello", "-q", "1", "-i", f"{user}p{next(attempts)}"],
                      check=True, timeout=BOUND)
            return bool(await poll(lambda: sub.poll() is not None, 0.3))

        await wait_until(received, BOUND, "mosquitto_sub to receive", step=0)
        out, err = await run(sub.communicate, timeout=BOUND)
        assert sub.returncode == 0, err
        assert out.strip() == "hello"
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    for version in ("mqttv311", "mqttv5"):
        bad = await run(subprocess.run, ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(sec.mqtt_ports[0]),
                                         "-V", version, "-u", user, "-P", "wrong", "-t", topic, "-m", "x",
                                         "-i", unique("b")], capture_output=True, text=True, timeout=BOUND)
        assert bad.returncode != 0 and "password" in (bad.stderr + bad.stdout).lower(), (version, bad)
        anon = await run(subprocess.run, ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(sec.mqtt_ports[0]),
                                          "-V", version, "-t", topic, "-m", "x", "-i", unique("a")],
                         capture_output=True, text=True, timeout=BOUND)
        assert anon.returncode != 0 and "authori" in (anon.stderr + anon.stdout).lower(), (version, anon)


# ------------------------------------------------------------------------------------------------ ACL
@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_denials_and_an_acl_change_without_reconnecting(sec, unique, v5):
    user, watcher = unique("acl"), unique("watch")
    topic = f"extra/{user}/t"
    await add_credential(sec, user, "pw", "--client-id", f"{user}-*", "--pub", "own/%c/#", "--sub", "own/%u/+")
    await add_credential(sec, watcher, "pw", "--sub", f"extra/{user}/#")
    w = await accepted_on(sec.mqtt_ports[1], watcher + "-1", True, (watcher, "pw"))
    c = await accepted_on(sec.mqtt_ports[0], f"{user}-1", v5, (user, "pw"))
    # a client id outside the credential's pattern
    rc, _ = await run(try_connect, sec.mqtt_ports[0], unique("other"), v5, (user, "pw"))
    assert rc == (RC.NOT_AUTHORIZED if v5 else V3.NOT_AUTHORIZED)
    # SUBSCRIBE: allowed, denied (another user's level, '#')
    codes = await run(c.subscribe, [(f"own/{user}/x", 1), (f"own/{unique('x')}/x", 1), ("#", 1)])
    denied = RC.NOT_AUTHORIZED if v5 else RC.UNSPECIFIED_ERROR  # 3.1.1 SUBACK failure 0x80
    assert [getattr(rc, "value", rc) for rc in codes] == [1, denied, denied]
    assert [getattr(rc, "value", rc) for rc in await run(w.subscribe, topic, 1)] == [1]
    # PUBLISH denied: v5 PUBACK 0x87; 3.1.1 acknowledged (PUBACK) and dropped
    info = await run(c.publish, topic, b"denied", 1, check=False)
    assert await run(c.wait, lambda: info.mid in c.pubacks)
    assert c.pubacks[info.mid].value == (RC.NOT_AUTHORIZED if v5 else 0)
    # the ACL changes (`credentials add` again replaces it); the connected client is not reconnected
    await add_credential(sec, user, "pw", "--client-id", f"{user}-*", "--pub", "own/%c/#", "--pub", topic,
                         "--sub", "own/%u/+")

    async def allowed() -> bool:
        i = await run(c.publish, topic, b"allowed", 1, check=False)
        await run(c.wait, lambda: i.mid in c.pubacks)
        return c.pubacks[i.mid].value == 0

    await wait_until(allowed, BOUND, "the new publish pattern to apply")
    assert await run(w.wait, lambda: len(payloads(w, topic)) >= 1)
    assert payloads(w, topic) == [b"allowed"]           # nothing denied before was forwarded
    assert c.disconnected is None                        # the same connection all along
    for x in (c, w):
        await run(x.close)


# ------------------------------------------------------------------------------------------------ blocked
@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_blocked_client_id_refused_then_unblocked(sec, unique, v5):
    user = unique("bl")
    cid = unique("blocked")
    await add_credential(sec, user, "pw", "--pub", "x/#")
    await run((await accepted_on(sec.mqtt_ports[0], cid, v5, (user, "pw"))).close)
    await run(tbmq, sec, "blocked", "add", "--client-id", cid, "--expires-in", "3600")
    assert f"client_id:{cid}" in await run(tbmq, sec, "blocked", "list")
    want = RC.BANNED if v5 else V3.NOT_AUTHORIZED

    async def banned(port) -> bool:
        rc, c = await run(try_connect, port, cid, v5, (user, "pw"))
        if rc == 0:
            await run(c.close)
        return rc == want

    for port in sec.mqtt_ports:
        await wait_until(lambda: banned(port), BOUND, f"client id blocked on :{port}")
    await run(tbmq, sec, "blocked", "delete", f"client_id:{cid}")
    for port in sec.mqtt_ports:
        await run((await accepted_on(port, cid, v5, (user, "pw"))).close)


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_a_connected_client_is_disconnected_when_blocked_or_its_credential_deleted(sec, unique, v5):
    """A blocked rule written while a matching client is connected closes its connection on whichever connector
    holds it (v5: DISCONNECT 0x98 Administrative action; 3.1.1: the socket closed), and a client whose
    credential is deleted is closed the same way; another client of the same credential stays connected when
    only the first is blocked."""
    user, bad, good = unique("kick"), unique("bad"), unique("good")
    await add_credential(sec, user, "pw", "--pub", "kick/#")
    blocked = await accepted_on(sec.mqtt_ports[0], bad, v5, (user, "pw"))
    other = await accepted_on(sec.mqtt_ports[1], good, v5, (user, "pw"))
    await run(tbmq, sec, "blocked", "add", "--client-id", bad, "--expires-in", "3600")
    assert await run(blocked.wait, lambda: blocked.disconnects, BOUND), "the blocked client stayed"
    if v5:
        assert blocked.disconnects[0].value == RC.ADMINISTRATIVE_ACTION
    # the other client of the same credential still works: its QoS 1 PUBLISH is acknowledged
    info = await run(other.publish, "kick/t", b"m", 1, check=False)
    assert await run(other.wait, lambda: info.mid in other.pubacks) and other.pubacks[info.mid].value == 0
    assert other.disconnects == []
    await run(tbmq, sec, "credentials", "delete", user)
    assert await run(other.wait, lambda: other.disconnects, BOUND), "the deleted credential's client stayed"
    if v5:
        assert other.disconnects[0].value == RC.ADMINISTRATIVE_ACTION
    await run(tbmq, sec, "blocked", "delete", f"client_id:{bad}")
    for c in (blocked, other):
        await run(c.close)


# ------------------------------------------------------------------------------------------------ X.509
async def test_client_certificate_cn_authenticates_without_a_password(sec, unique, tmp_path):
    user = unique("x509")
    cn = unique("device")
    cert, key = issue_client_cert(sec.tls, cn, tmp_path)
    await add_credential(sec, user, None, "--cert-cn", cn, "--pub", "x509/%u/#")
    tls = {"ca_certs": str(sec.tls.ca), "certfile": str(cert), "keyfile": str(key)}
    for i, port in enumerate(sec.tls_ports):
        c = await accepted_on(port, f"{cn}-{i}", True, None, tls=tls)
        info = await run(c.publish, f"x509/{user}/t", b"m", 1, check=False)
        assert await run(c.wait, lambda: info.mid in c.pubacks) and c.pubacks[info.mid].value == 0
        info = await run(c.publish, "elsewhere/t", b"m", 1, check=False)
        assert await run(c.wait, lambda: info.mid in c.pubacks)
        assert c.pubacks[info.mid].value == RC.NOT_AUTHORIZED       # the credential's rules apply
        await run(c.close)
    # the same TLS listener without a certificate: nobody (anonymous refused)
    rc, _ = await run(try_connect, sec.tls_ports[0], unique("nocert"), True, None, tls={"ca_certs": str(sec.tls.ca)})
    assert rc == RC.NOT_AUTHORIZED


async def test_credentials_list_never_prints_hashes(sec, unique):
    user = unique("ls")
    await add_credential(sec, user, "very-secret", "--sub", "ls/#")
    out = await run(tbmq, sec, "credentials", "list")
    line = next(ln for ln in out.splitlines() if user in ln)
    assert "argon2" not in out and "very-secret" not in out and '"password": true' in line
    await run(tbmq, sec, "credentials", "delete", user)
    assert user not in await run(tbmq, sec, "credentials", "list")


async def test_acl_change_drops_subscriptions_no_longer_allowed(sec, unique):
    """The credential loses a subscribe pattern: the connected client's subscription under it is removed (its
    set rewritten on tbmq.client.subscriptions, no UNSUBACK) and nothing published afterwards reaches it;
    the one still allowed keeps working. Decided with a witness on the same connector and a round trip on the
    client's own connection, no timing."""
    from connector_helpers import Tail
    from tbmq.v1 import messages_pb2 as pb
    from tbmq_platform.topics import CLIENT_SUBSCRIPTIONS

    user, pub_user, witness = unique("rev"), unique("revp"), unique("revw")
    gone, kept = f"rev/{user}/t", f"keep/{user}/t"
    await add_credential(sec, user, "pw", "--sub", "rev/%u/#", "--sub", "keep/%u/#", "--pub", "keep/%u/#")
    await add_credential(sec, pub_user, "pw", "--pub", "rev/#")
    await add_credential(sec, witness, "pw", "--sub", "rev/#")
    port = sec.mqtt_ports[0]
    c = await accepted_on(port, user + "-c", True, (user, "pw"))
    w = await accepted_on(port, witness + "-w", True, (witness, "pw"))
    p = await accepted_on(sec.mqtt_ports[1], pub_user + "-p", True, (pub_user, "pw"))
    assert [rc.value for rc in await run(c.subscribe, [(gone, 1), (kept, 1)])] == [1, 1]
    assert [rc.value for rc in await run(w.subscribe, gone, 1)] == [1]
    async with Tail(sec.bootstrap_servers, CLIENT_SUBSCRIPTIONS) as tail:
        await add_credential(sec, user, "pw", "--sub", "keep/%u/#", "--pub", "keep/%u/#")

        def rewritten(r) -> bool:
            if r.key != (user + "-c").encode() or not r.value:
                return False
            return [s.topic_filter for s in pb.ClientSubscriptions.FromString(r.value).subscriptions] == [kept]

        await tail.wait_for(rewritten)
    await run(p.publish, gone, b"late", 1)
    assert await run(w.wait, lambda: payloads(w, gone) == [b"late"])
    await run(c.publish, kept, b"marker", 1)               # behind any copy of "late" on c's connection
    assert await run(c.wait, lambda: payloads(c, kept) == [b"marker"])
    assert payloads(c, gone) == [] and c.disconnected is None
    for x in (c, w, p):
        await run(x.close)


# ------------------------------------------------------------------------------------------------ JWT
def sign(key, expires_in: float, **claims) -> str:
    return jwt.encode({"exp": int(time.time() + expires_in), **claims}, key, algorithm="ES256")


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_a_jwt_password_authenticates_with_its_acl_until_it_expires(sec, unique, jwt_key, v5):
    """Provider jwt: a token signed by the issuer's key is accepted on both connectors, its acl claim decides
    SUBSCRIBE and PUBLISH, a token of another key, an expired one or one for another client id is refused, and
    at its exp the connection ends (v5 DISCONNECT 0x87 Not authorized)."""
    key, _ = jwt_key
    cid, watcher = unique("tok"), unique("watch")
    acl = {"pub": ["tok/%c/#"], "sub": ["cmd/%c"]}
    await add_credential(sec, watcher, "pw", "--sub", f"tok/{cid}/#")
    w = await accepted_on(sec.mqtt_ports[1], watcher, True, (watcher, "pw"))
    assert [getattr(rc, "value", rc) for rc in await run(w.subscribe, f"tok/{cid}/#", 1)] == [1]
    c = await accepted_on(sec.mqtt_ports[0], cid, v5, ("device", sign(key, 3600, client_id=cid, acl=acl)))
    codes = await run(c.subscribe, [(f"cmd/{cid}", 1), (f"cmd/{unique('other')}", 1)])
    denied = RC.NOT_AUTHORIZED if v5 else RC.UNSPECIFIED_ERROR
    assert [getattr(rc, "value", rc) for rc in codes] == [1, denied]
    info = await run(c.publish, f"elsewhere/{cid}", b"denied", 1, check=False)
    assert await run(c.wait, lambda: info.mid in c.pubacks)
    assert c.pubacks[info.mid].value == (RC.NOT_AUTHORIZED if v5 else 0)
    await run(c.publish, f"tok/{cid}/up", b"allowed", 1)
    assert await run(w.wait, lambda: payloads(w, f"tok/{cid}/up") == [b"allowed"])
    await run(c.close)
    other_key = ec.generate_private_key(ec.SECP256R1())
    bad = RC.BAD_USER_NAME_OR_PASSWORD if v5 else V3.BAD_USER_NAME_OR_PASSWORD
    for what, token, want in [("another key", sign(other_key, 3600, acl=acl), bad),
                              ("expired", sign(key, -1, acl=acl), bad),
                              ("another client id", sign(key, 3600, client_id=cid + "-x", acl=acl),
                               RC.NOT_AUTHORIZED if v5 else V3.NOT_AUTHORIZED)]:
        for port in sec.mqtt_ports:
            rc, _ = await run(try_connect, port, cid, v5, ("device", token))
            assert rc == want, (what, port, rc)
    # a token that expires in 5 s: connected, then closed at its exp
    c = await accepted_on(sec.mqtt_ports[1], cid, v5, ("device", sign(key, 5, client_id=cid, acl=acl)))
    assert await run(c.wait, lambda: c.disconnects, BOUND), "the client stayed after its token expired"
    if v5:
        assert c.disconnects[0].value == RC.NOT_AUTHORIZED
    for x in (c, w):
        await run(x.close)


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_a_revoked_jwt_closes_its_connections_and_is_refused_until_withdrawn(sec, unique, jwt_key, v5):
    """`tbmq tokens revoke --token-stdin` (tbmq.security.tokens.revoked): the connections the token opened, on
    both connectors, end (v5 DISCONNECT 0x98 Administrative action; 3.1.1 the socket closed); a connection of
    another token of the same device stays; the token's CONNECTs are refused (0x86 / 4) on both connectors;
    `tbmq tokens list` shows it; withdrawn (`tbmq tokens delete`), it connects again."""
    key, _ = jwt_key
    cid, jti = unique("rev"), unique("jti")
    acl = {"all": [f"rev/{cid}/#"]}
    revoked = sign(key, 3600, client_id=f"{cid}-*", acl=acl, jti=jti)
    other_token = sign(key, 3600, client_id=f"{cid}-*", acl=acl, jti=unique("jti"))
    opened = [await accepted_on(port, f"{cid}-{i}", v5, ("device", revoked))
              for i, port in enumerate(sec.mqtt_ports)]
    other = await accepted_on(sec.mqtt_ports[0], f"{cid}-other", v5, ("device", other_token))
    out = await run(tbmq, sec, "tokens", "revoke", "--token-stdin", stdin=revoked + "\n")
    assert jti in out
    for c in opened:
        assert await run(c.wait, lambda c=c: c.disconnects, BOUND), "a connection of the revoked token stayed"
        if v5:
            assert c.disconnects[0].value == RC.ADMINISTRATIVE_ACTION
    bad = RC.BAD_USER_NAME_OR_PASSWORD if v5 else V3.BAD_USER_NAME_OR_PASSWORD
    for port in sec.mqtt_ports:
        rc, _ = await run(try_connect, port, f"{cid}-again", v5, ("device", revoked))
        assert rc == bad, (port, rc)
    assert other.disconnects == [] and other.disconnected is None  # another token of the same device
    listed = [json.loads(line) for line in (await run(tbmq, sec, "tokens", "list")).splitlines()]
    exp = jwt.decode(revoked, options={"verify_signature": False})["exp"]
    assert [e["exp"] for e in listed if e["jti"] == jti] == [exp]
    await run(tbmq, sec, "tokens", "delete", jti)
    for port in sec.mqtt_ports:
        back = await accepted_on(port, f"{cid}-back", v5, ("device", revoked))
        await run(back.close)
    await run(other.close)
