"""The pure authentication and authorization decisions (tbmq_auth): password hashes, provider order, the
anonymous default, blocked rules on an injected clock, client-id patterns, %c/%u, '#' and '$SYS'."""

from __future__ import annotations

import pytest

from tbmq_auth import (
    AuthRequest,
    AuthTables,
    Authorizer,
    BlockedRule,
    Credential,
    anonymous_default,
    hash_password,
    parse_providers,
    substitute,
    verify_password,
)
from tbmq_mqtt import ReasonCode
from tbmq_routing import filter_covers

pytestmark = pytest.mark.unit

RC = ReasonCode
T0 = 1_700_000_000_000


def tables(*creds: Credential, blocked: tuple[BlockedRule, ...] = ()) -> AuthTables:
    t = AuthTables()
    for c in creds:
        t.apply_credential(c.name.encode(), c.to_json())
    for b in blocked:
        t.apply_blocked(b.key.encode(), b.to_json())
    return t


def fake_verify(stored: str, password: bytes) -> bool:
    return stored == "hash:" + password.decode()


def authz(*creds, blocked=(), providers=("password", "x509", "anonymous"), anonymous=False) -> Authorizer:
    return Authorizer(tables(*creds, blocked=blocked), providers=providers, allow_anonymous=anonymous,
                      verify=fake_verify)


ALICE = Credential("alice", password_hash="hash:secret", pub=("a/#",), sub=("a/#",))


# ------------------------------------------------------------------------------------------------ passwords
def test_password_hash_is_salted_argon2id_and_verifies():
    h1, h2 = hash_password("s3cret"), hash_password("s3cret")
    assert h1.startswith("$argon2id$") and h1 != h2 and "s3cret" not in h1
    assert verify_password(h1, b"s3cret") and verify_password(h2, "s3cret")
    assert not verify_password(h1, b"wrong")
    assert not verify_password("not a hash", b"s3cret")


def test_credential_record_round_trip_and_list_hides_the_hash():
    c = Credential("bob", password_hash="$argon2id$x", client_id="bob-*", cert_cn="bob.example",
                   pub=("p/%c",), sub=("s/#",))
    assert Credential.from_json("bob", c.to_json()) == c
    shown = c.public()
    assert "$argon2id$x" not in repr(shown) and shown["password"] is True


# ------------------------------------------------------------------------------------------------ providers
def test_good_password_accepted_bad_refused_0x86():
    a = authz(ALICE)
    ok = a.authenticate(AuthRequest("c1", "alice", b"secret"), T0)
    assert ok.ok and ok.identity.credential == "alice" and ok.identity.provider == "password"
    assert a.authenticate(AuthRequest("c1", "alice", b"nope"), T0).reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    assert a.authenticate(AuthRequest("c1", "alice", None), T0).reason_code == RC.BAD_USER_NAME_OR_PASSWORD


def test_wrong_password_is_refused_even_when_anonymous_is_allowed():
    a = authz(ALICE, anonymous=True)
    assert a.authenticate(AuthRequest("c1", "alice", b"nope"), T0).reason_code == RC.BAD_USER_NAME_OR_PASSWORD


def test_anonymous_only_when_allowed():
    assert authz(ALICE, anonymous=True).authenticate(AuthRequest("c1"), T0).identity.provider == "anonymous"
    # unknown user name with anonymous allowed: anonymous (the name still goes to the registry's rules)
    r = authz(ALICE, anonymous=True).authenticate(AuthRequest("c1", "nobody", b"x"), T0)
    assert r.ok and r.identity.credential is None
    assert authz(ALICE).authenticate(AuthRequest("c1"), T0).reason_code == RC.NOT_AUTHORIZED
    assert authz(ALICE).authenticate(AuthRequest("c1", "nobody", b"x"), T0).reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    # allowed, but not among the providers: refused
    a = authz(ALICE, providers=("password",), anonymous=True)
    assert a.authenticate(AuthRequest("c1"), T0).reason_code == RC.NOT_AUTHORIZED


def test_x509_cn_or_san_maps_to_the_credential():
    dev = Credential("dev1", cert_cn="dev1.example", pub=("d/%u/#",))
    a = authz(dev)
    r = a.authenticate(AuthRequest("c1", cert_names=("other", "dev1.example")), T0)
    assert r.ok and r.identity.provider == "x509" and r.identity.credential == "dev1"
    assert a.authenticate(AuthRequest("c1", cert_names=("stranger",)), T0).reason_code == RC.NOT_AUTHORIZED


def test_provider_order_decides():
    both = Credential("dev1", password_hash="hash:pw", cert_cn="dev1.example")
    other = Credential("other", cert_cn="other.example")
    req = AuthRequest("c1", "dev1", b"pw", cert_names=("other.example",))
    assert authz(both, other).authenticate(req, T0).identity.credential == "dev1"
    assert authz(both, other, providers=("x509", "password")).authenticate(req, T0).identity.credential == "other"


def test_parse_providers():
    assert parse_providers("password, X509") == ("password", "x509")
    for bad in ("", "password,password", "ldap"):
        with pytest.raises(ValueError):
            parse_providers(bad)


@pytest.mark.parametrize("hosts, expected", [
    (["127.0.0.1"], True), (["127.0.0.1", "::1", "localhost"], True), (["127.0.0.1", "0.0.0.0"], False),
    (["0.0.0.0"], False), (["10.1.2.3"], False), ([], False)])
def test_anonymous_default_from_listener_binds(hosts, expected):
    assert anonymous_default(hosts) is expected


# ------------------------------------------------------------------------------------------------ client id
def test_client_id_pattern():
    dev = Credential("dev1", password_hash="hash:pw", client_id="%u-*", pub=("#",))
    a = authz(dev)
    assert a.authenticate(AuthRequest("dev1-7", "dev1", b"pw"), T0).ok
    r = a.authenticate(AuthRequest("dev2-7", "dev1", b"pw"), T0)
    assert r.reason_code == RC.NOT_AUTHORIZED and "client id" in r.reason


# ------------------------------------------------------------------------------------------------ blocked
def test_blocked_rules_before_authentication_with_expiry():
    rules = (BlockedRule("client_id", "bad", expires_at_ms=T0 + 1000), BlockedRule("username", "mallory"),
             BlockedRule("ip", "10.9.0.0/16"), BlockedRule("regex", "evil-.*", target="client_id"))
    a = authz(ALICE, blocked=rules, anonymous=True)

    def code(client_id="c", username=None, ip="192.0.2.1", now=T0):
        return a.authenticate(AuthRequest(client_id, username, b"secret" if username else None, ip=ip), now).reason_code

    assert code("bad") == RC.BANNED
    assert code("bad", now=T0 + 1000) == RC.SUCCESS        # expired
    assert code(username="mallory") == RC.BANNED
    assert code(ip="10.9.3.4") == RC.BANNED and code(ip="10.8.3.4") == RC.SUCCESS
    assert code("evil-1") == RC.BANNED and code("not-evil-1") == RC.SUCCESS
    assert code("bad", username="alice") == RC.BANNED       # before the (good) password


def test_blocked_rule_deleted_by_tombstone():
    t = tables(blocked=(BlockedRule("client_id", "bad"),))
    assert t.blocked_by("bad", None, "", T0) is not None
    t.apply_blocked(b"client_id:bad", None)
    assert t.blocked_by("bad", None, "", T0) is None


# ------------------------------------------------------------------------------------------------ ACL
def test_substitution_of_client_id_and_username():
    assert substitute("d/%u/%c/#", "c1", "u1") == "d/u1/c1/#"
    assert substitute("d/%c", "a/b", "u") is None and substitute("d/%c", "+", "u") is None
    assert substitute("d/%c", "", "u") is None and substitute("plain/#", "", "") == "plain/#"


def test_publish_and_subscribe_patterns():
    dev = Credential("dev1", password_hash="hash:pw", pub=("devices/%c/up", "logs/%u/#"), sub=("devices/%c/down/+",))
    a = authz(dev)
    me = a.authenticate(AuthRequest("c7", "dev1", b"pw"), T0).identity
    assert a.may_publish(me, "c7", "devices/c7/up") and a.may_publish(me, "c7", "logs/dev1/x/y")
    assert not a.may_publish(me, "c7", "devices/c8/up") and not a.may_publish(me, "c7", "logs/dev2/x")
    assert a.may_subscribe(me, "c7", "devices/c7/down/+") and a.may_subscribe(me, "c7", "devices/c7/down/cmd")
    assert not a.may_subscribe(me, "c7", "devices/c7/down/#") and not a.may_subscribe(me, "c7", "devices/+/down/x")


def test_hash_and_sys_need_explicit_patterns():
    wide = Credential("w", password_hash="hash:pw", sub=("+/#",), pub=("#",))
    full = Credential("f", password_hash="hash:pw", sub=("#", "$SYS/#"))
    a = authz(wide, full)
    w = a.authenticate(AuthRequest("c", "w", b"pw"), T0).identity
    f = a.authenticate(AuthRequest("c", "f", b"pw"), T0).identity
    assert not a.may_subscribe(w, "c", "#") and a.may_subscribe(w, "c", "a/#")
    assert not a.may_subscribe(w, "c", "$SYS/#") and not a.may_publish(w, "c", "$SYS/x")
    assert a.may_subscribe(f, "c", "#") and a.may_subscribe(f, "c", "$SYS/broker/#")


def test_acl_change_applies_to_an_existing_identity():
    t = tables(ALICE)
    a = Authorizer(t, verify=fake_verify)
    me = a.authenticate(AuthRequest("c1", "alice", b"secret"), T0).identity
    assert a.may_publish(me, "c1", "a/1") and not a.may_publish(me, "c1", "b/1")
    t.apply_credential(b"alice", Credential("alice", password_hash="hash:secret", pub=("b/#",)).to_json())
    assert not a.may_publish(me, "c1", "a/1") and a.may_publish(me, "c1", "b/1")
    t.apply_credential(b"alice", None)
    assert not a.may_publish(me, "c1", "b/1") and not a.may_subscribe(me, "c1", "a/1")


def test_will_is_a_publish():
    a = authz(ALICE)
    assert a.authenticate(AuthRequest("c1", "alice", b"secret", will_topic="a/will"), T0).ok
    r = a.authenticate(AuthRequest("c1", "alice", b"secret", will_topic="b/will"), T0)
    assert r.reason_code == RC.NOT_AUTHORIZED


@pytest.mark.parametrize("pattern, topic_filter, covered", [
    ("#", "a/b", True), ("#", "#", True), ("a/#", "a", True), ("a/#", "a/+/c", True), ("a/+", "a/+", True),
    ("a/+", "a/#", False), ("+/#", "#", False), ("a/b", "a/+", False), ("a/+", "a/b/c", False),
    ("#", "$SYS/x", False), ("$SYS/#", "$SYS/x/#", True), ("+", "$x", False)])
def test_filter_covers(pattern, topic_filter, covered):
    assert filter_covers(pattern, topic_filter) is covered


def test_the_library_is_pure():
    """No event loop, Kafka, sockets, threads or clock in tbmq_auth: the connector passes the time in."""
    import tbmq_auth
    from purity import assert_imports_none_of

    assert_imports_none_of(tbmq_auth, {"asyncio", "aiokafka", "redis", "grpc", "socket", "time", "threading",
                                       "tbmq_platform"})
