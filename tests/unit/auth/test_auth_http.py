"""The `http` provider (tbmq_auth.http, tbmq_auth.Authorizer): what is asked of the operator's service, how its
answers read, and where they leave the CONNECT in the provider order. The service itself is exercised end to
end in tests/e2e/connector/test_connector_http_auth.py."""

from __future__ import annotations

import json

import pytest
from tbmq_auth import (
    HTTP,
    AuthRequest,
    AuthTables,
    Authorizer,
    BlockedRule,
    HttpAnswer,
    HttpCheck,
    make_credential,
    parse_answer,
    request_body,
)
from tbmq_auth.http import ALLOW, DENY, ERROR, IGNORE, AnswerCache, error
from tbmq_mqtt import ReasonCode as RC

pytestmark = pytest.mark.unit

NOW = 1_800_000_000_000


def answer(status=200, **doc) -> HttpAnswer:
    return parse_answer(status, json.dumps(doc).encode())


def test_the_question_carries_what_the_connect_said():
    assert request_body("dev-1", "alice", b"s3cret", "10.0.0.5", ("dev-1.example",)) == {
        "clientid": "dev-1", "username": "alice", "password": "s3cret", "peerhost": "10.0.0.5",
        "cert_names": ["dev-1.example"]}
    binary = request_body("dev-1", None, b"\xff\x00", "::1", ())
    assert binary["password"] is None and binary["password_base64"] == "/wA=" and binary["username"] is None


def test_answers_read_as_allow_deny_ignore_or_error():
    assert answer(result="allow") == HttpAnswer(ALLOW)
    granted = answer(result="allow", acl={"pub": ["up/%c"], "all": ["both/#"]}, username="u", expire_at=1_800_000_060)
    assert granted == HttpAnswer(ALLOW, ("up/%c", "both/#"), ("both/#",), "u", 1_800_000_060_000)
    assert answer(result="deny", reason="locked") == HttpAnswer(DENY, reason="locked")
    assert answer(result="ignore").result == IGNORE
    assert parse_answer(204, b"") == HttpAnswer(ALLOW)
    errors = {
        "HTTP 500": parse_answer(500, b'{"result": "allow"}'),
        "not JSON": parse_answer(200, b"<html>"),
        '"result"': answer(result="maybe"),
        "acl": answer(result="allow", acl={"pub": "up/#"}),
        "acl: 'a/#/b'": answer(result="allow", acl={"sub": ["a/#/b"]}),
        '"username"': answer(result="allow", username=7),
        '"expire_at"': answer(result="allow", expire_at="tomorrow"),
    }
    for text, got in errors.items():
        assert got.result == ERROR and text in got.reason, (text, got)


def authorizer(providers=(HTTP,), tables=None, **kw) -> Authorizer:
    return Authorizer(tables or AuthTables(), providers=providers, **kw)


def decide(auth: Authorizer, http: HttpAnswer | None, **req):
    req.setdefault("client_id", "dev-1")
    return auth.authenticate(AuthRequest(**req), NOW, http)


def test_the_provider_asks_then_applies_the_answer():
    auth = authorizer()
    asked = decide(auth, None, username="alice", password=b"pw", ip="10.0.0.5")
    assert isinstance(asked, HttpCheck) and asked.body["username"] == "alice" and asked.body["peerhost"] == "10.0.0.5"
    ok = decide(auth, answer(result="allow", acl={"pub": ["up/%c"], "sub": ["down/%u"]}), username="alice")
    ident = ok.identity
    assert ok.ok and ident.provider == HTTP and ident.username == "alice" and ident.restricted
    assert auth.may_publish(ident, "dev-1", "up/dev-1") and not auth.may_publish(ident, "dev-1", "up/dev-2")
    assert auth.may_subscribe(ident, "dev-1", "down/alice") and not auth.may_subscribe(ident, "dev-1", "#")
    free = decide(auth, answer(result="allow"), username="alice").identity
    assert not free.restricted and auth.may_publish(free, "dev-1", "any/topic")  # no acl: every right
    assert decide(auth, answer(result="allow", expire_at=1_800_000_030), username="a").identity.expires_at_ms == (
        1_800_000_030_000)
    passed = decide(auth, answer(result="allow", expire_at=NOW // 1000), username="a")
    assert passed.reason_code == RC.BAD_USER_NAME_OR_PASSWORD and "expire_at has passed" in passed.reason
    denied = decide(auth, answer(result="deny", reason="locked"), username="alice")
    assert denied.reason_code == RC.BAD_USER_NAME_OR_PASSWORD and "locked" in denied.reason
    broken = decide(auth, parse_answer(503, b""), username="alice")
    assert broken.reason_code == RC.SERVER_UNAVAILABLE and broken.identity is None


def test_ignore_passes_to_the_next_provider_and_an_error_never_does():
    auth = authorizer(providers=(HTTP, "anonymous"), allow_anonymous=True)
    assert decide(auth, answer(result="ignore")).identity.provider == "anonymous"
    assert decide(auth, parse_answer(500, b"")).reason_code == RC.SERVER_UNAVAILABLE  # fail closed
    assert decide(authorizer(), answer(result="ignore"), username="u").reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    assert decide(authorizer(), answer(result="ignore")).reason_code == RC.NOT_AUTHORIZED


def test_earlier_providers_and_blocked_rules_decide_before_the_service_is_asked():
    tables = AuthTables()
    cred = make_credential("alice", password="pw")
    tables.apply_credential(b"alice", cred.to_json())
    tables.apply_blocked(b"client_id:dev-9", BlockedRule("client_id", "dev-9").to_json())
    auth = authorizer(providers=("password", HTTP), tables=tables)
    assert decide(auth, None, username="alice", password=b"pw").identity.provider == "password"
    assert decide(auth, None, username="alice", password=b"bad").reason_code == RC.BAD_USER_NAME_OR_PASSWORD
    assert isinstance(decide(auth, None, username="bob", password=b"pw"), HttpCheck)  # not a credential: asked
    assert decide(auth, None, client_id="dev-9").reason_code == RC.BANNED
    # the Will is checked against the answer's acl
    will = decide(auth, answer(result="allow", acl={"pub": ["up/%c"]}), username="bob", will_topic="elsewhere")
    assert will.reason_code == RC.NOT_AUTHORIZED


def test_answers_are_kept_by_question_for_the_ttl_errors_never():
    """AnswerCache: the same question (password included) gets the kept answer until the TTL, another password
    is another question; an error is never kept; at most max_entries, the oldest dropped; ttl 0 keeps nothing."""
    cache = AnswerCache(ttl_s=10.0, max_entries=2)
    q = request_body("dev", "u", b"pw", "10.0.0.1", ())
    key = AnswerCache.key(q)
    assert key == AnswerCache.key(dict(reversed(list(q.items()))))  # the same question, whatever the order
    assert b"pw" not in key and len(key) == 32
    assert cache.get(key, 0.0) is None
    cache.put(key, HttpAnswer(ALLOW, ("up/%c",), ()), 0.0)
    assert cache.get(key, 9.9).pub == ("up/%c",)
    assert cache.get(AnswerCache.key(request_body("dev", "u", b"other", "10.0.0.1", ())), 1.0) is None
    assert cache.get(key, 10.0) is None and len(cache) == 0  # expired and dropped
    denied = AnswerCache.key(request_body("bad", None, None, "10.0.0.2", ()))
    cache.put(denied, HttpAnswer(DENY), 0.0)
    cache.put(key, error("down"), 0.0)
    assert cache.get(key, 1.0) is None and cache.get(denied, 1.0).result == DENY
    for i in range(3):
        cache.put(AnswerCache.key({"n": i}), HttpAnswer(IGNORE), 1.0)
    assert len(cache) == 2 and cache.get(denied, 1.0) is None  # the oldest dropped
    off = AnswerCache(ttl_s=0.0)
    off.put(key, HttpAnswer(ALLOW), 0.0)
    assert not off and off.get(key, 0.0) is None
