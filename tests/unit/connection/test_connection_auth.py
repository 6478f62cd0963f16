"""The connection machine's reaction to authentication and authorization (tbmq_auth.Authorizer passed in):
CONNACK codes per version, SUBACK / PUBACK / PUBREC codes, an ACL change applying to a connected client."""

from __future__ import annotations

import pytest
from connection_harness import Client, plain
from tbmq_auth import AuthTables, Authorizer, BlockedRule, Credential
from tbmq_connection import ProducePublish, ProduceSubscriptions, RequestSession
import tbmq_mqtt as mq

PubAck, PubComp, Publish, PubRec, PubRel = mq.PubAck, mq.PubComp, mq.Publish, mq.PubRec, mq.PubRel
SubAck, Subscribe, Subscription, Will = mq.SubAck, mq.Subscribe, mq.Subscription, mq.Will

pytestmark = pytest.mark.unit

RC = mq.ReasonCode
V3 = mq.ConnackReturnCode


def fake_verify(stored: str, password: bytes) -> bool:
    return stored == "hash:" + password.decode()


def make_auth(*creds: Credential, blocked=(), anonymous=False) -> tuple[Authorizer, AuthTables]:
    t = AuthTables()
    for c in creds:
        t.apply_credential(c.name.encode(), c.to_json())
    for b in blocked:
        t.apply_blocked(b.key.encode(), b.to_json())
    return Authorizer(t, allow_anonymous=anonymous, verify=fake_verify), t


DEV = Credential("dev", password_hash="hash:pw", client_id="dev-*", pub=("up/%c/#",), sub=("down/%c/+",))


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize("kw, v5_code, v3_code", [
    (dict(username="dev", password=b"bad"), RC.BAD_USER_NAME_OR_PASSWORD, V3.BAD_USER_NAME_OR_PASSWORD),
    (dict(username="nobody", password=b"pw"), RC.BAD_USER_NAME_OR_PASSWORD, V3.BAD_USER_NAME_OR_PASSWORD),
    (dict(), RC.NOT_AUTHORIZED, V3.NOT_AUTHORIZED),                                  # anonymous not allowed
    (dict(username="dev", password=b"pw", client_id="other-1"), RC.NOT_AUTHORIZED, V3.NOT_AUTHORIZED),
    (dict(username="dev", password=b"pw", will=Will("elsewhere", b"x")), RC.NOT_AUTHORIZED, V3.NOT_AUTHORIZED),
    (dict(username="dev", password=b"pw", client_id="dev-banned"), RC.BANNED, V3.NOT_AUTHORIZED),
])
def test_connect_refusals(level, kw, v5_code, v3_code):
    auth, _ = make_auth(DEV, blocked=(BlockedRule("client_id", "dev-banned"),))
    c = Client(level, auth=auth)
    kw.setdefault("client_id", "dev-1")
    connack = c.connect(**kw)
    assert connack.reason_code == (v5_code if level == 5 else v3_code)
    assert c.closed is not None and not c.of(RequestSession)
    assert c.m.stats["connect_refused_auth"] == 1


@pytest.mark.parametrize("level", [4, 5])
def test_accepted_with_password_and_will_allowed(level):
    auth, _ = make_auth(DEV)
    c = Client(level, auth=auth)
    connack = c.connect(client_id="dev-1", username="dev", password=b"pw", will=Will("up/dev-1/will", b"x"))
    assert connack.reason_code == 0 and c.closed is None
    assert c.m.identity.credential == "dev"
    # the registry keeps the Will with the session after authentication too (issue 15, dead connectors)
    assert c.request.will.topic == "up/dev-1/will" and c.request.will.payload == b"x"


def test_anonymous_allowed_may_do_everything():
    auth, _ = make_auth(DEV, anonymous=True)
    c = Client(5, auth=auth)
    assert c.connect(client_id="x").reason_code == RC.SUCCESS
    c.send(Subscribe(1, [Subscription("#", 1)]))
    assert c.take_effects(ProduceSubscriptions)


@pytest.mark.parametrize("level", [4, 5])
def test_subscribe_denied_per_filter(level):
    auth, _ = make_auth(DEV)
    c = Client(level, auth=auth)
    c.connect(client_id="dev-1", username="dev", password=b"pw")
    c.send(Subscribe(1, [Subscription("down/dev-1/cmd", 1), Subscription("down/dev-2/cmd", 1),
                         Subscription("down/dev-1/#", 0)]))
    (eff,) = c.take_effects(ProduceSubscriptions)
    assert [s.topic_filter for s in eff.subscriptions] == ["down/dev-1/cmd"]
    c.call("subscriptions_written", None)
    c.call("retained_ready")
    denied = RC.NOT_AUTHORIZED if level == 5 else RC.UNSPECIFIED_ERROR  # v5 0x87, 3.1.1 0x80
    assert c.take() == [SubAck(1, [1, denied, denied])]


def test_publish_denied_v5_puback_pubrec_0x87_in_packet_order():
    auth, _ = make_auth(DEV)
    c = Client(5, auth=auth)
    c.connect(client_id="dev-1", username="dev", password=b"pw")
    c.send(Publish("up/dev-1/a", b"ok", qos=1, packet_id=1))
    c.send(Publish("up/dev-2/a", b"no", qos=1, packet_id=2))
    c.send(Publish("up/dev-2/a", b"no", qos=2, packet_id=3))
    c.send(Publish("up/dev-2/a", b"no", qos=0))
    (ok,) = c.take_effects(ProducePublish)
    assert ok.topic == "up/dev-1/a" and c.take() == []      # the denied acks wait behind the first
    c.call("produced", ok, None)
    assert plain(c.take()) == [PubAck(1), PubAck(2, RC.NOT_AUTHORIZED), PubRec(3, RC.NOT_AUTHORIZED)]
    assert c.m.stats["publish_denied"] == 3


def test_publish_denied_v311_acknowledged_and_dropped():
    auth, _ = make_auth(DEV)
    c = Client(4, auth=auth)
    c.connect(client_id="dev-1", username="dev", password=b"pw")
    c.send(Publish("up/dev-2/a", b"no", qos=1, packet_id=1))
    c.send(Publish("up/dev-2/a", b"no", qos=2, packet_id=2, retain=True))
    assert c.take() == [PubAck(1), PubRec(2)] and not c.take_effects(ProducePublish)
    c.send(PubRel(2))
    assert c.take() == [PubComp(2)]


def test_acl_change_applies_without_reconnecting():
    auth, tables = make_auth(DEV)
    c = Client(5, auth=auth)
    c.connect(client_id="dev-1", username="dev", password=b"pw")
    c.send(Publish("other/x", b"no", qos=1, packet_id=1))
    assert plain(c.take()) == [PubAck(1, RC.NOT_AUTHORIZED)]
    tables.apply_credential(b"dev", Credential("dev", password_hash="hash:pw", pub=("other/#",)).to_json())
    c.send(Publish("other/x", b"yes", qos=1, packet_id=2))
    (eff,) = c.take_effects(ProducePublish)
    c.call("produced", eff, None)
    assert plain(c.take()) == [PubAck(2)]


@pytest.mark.parametrize("level", [4, 5])
def test_acl_change_removes_subscriptions_no_longer_allowed_without_unsuback(level):
    auth, tables = make_auth(Credential("dev", password_hash="hash:pw", sub=("a/#", "b/#")))
    c = Client(level, auth=auth)
    c.connect(client_id="dev-1", username="dev", password=b"pw")
    c.send(Subscribe(1, [Subscription("a/x", 1), Subscription("b/x", 1)]))
    c.take_effects(ProduceSubscriptions)
    c.call("subscriptions_written", None)
    c.call("retained_ready")
    assert c.take() == [SubAck(1, [1, 1])]
    c.call("acl_changed")                                   # nothing changed: nothing written
    assert not c.take_effects(ProduceSubscriptions)
    tables.apply_credential(b"dev", Credential("dev", password_hash="hash:pw", sub=("b/#",)).to_json())
    c.call("acl_changed")
    (eff,) = c.take_effects(ProduceSubscriptions)
    assert [s.topic_filter for s in eff.subscriptions] == ["b/x"]
    c.call("subscriptions_written", None)
    assert c.take() == [] and set(c.m.subs) == {("", "b/x")}  # no UNSUBACK: the client asked nothing
    assert c.m.stats["subscriptions_revoked"] == 1


def test_a_resumed_sessions_subscriptions_are_checked_against_the_current_rules():
    from connection_harness import answer
    from tbmq_connection.convert import topic_subscription

    auth, _ = make_auth(Credential("dev", password_hash="hash:pw", sub=("b/#",)))
    c = Client(5, auth=auth)
    stored = {("", f): topic_subscription("", f, 1) for f in ("a/x", "b/x")}
    connack = c.connect(answer(present=True, sei=60), client_id="dev-1", username="dev", password=b"pw",
                        subs=stored)
    assert connack.session_present
    (eff,) = c.take_effects(ProduceSubscriptions)
    assert [s.topic_filter for s in eff.subscriptions] == ["b/x"]
    c.call("subscriptions_written", None)
    assert set(c.m.subs) == {("", "b/x")}


# ------------------------------------------------------------------------------------------ tokens (provider jwt)
@pytest.mark.parametrize("level", [4, 5])
def test_a_token_client_is_held_to_its_acl_and_closed_when_the_token_expires(level):
    """A JWT as the password: its acl decides PUBLISH / SUBSCRIBE, and at its exp the connection ends (v5
    DISCONNECT 0x87 Not authorized with "token expired"; 3.x the socket closed), with the Will."""
    import jwt

    from tbmq_auth import JwtVerifier
    from tbmq_connection import TOKEN_EXPIRY, ReportDisconnect, ScheduleWill

    secret = b"k" * 32
    auth = Authorizer(AuthTables(), providers=("jwt",), tokens=JwtVerifier(secret=secret))
    c = Client(level, auth=auth)
    exp_s = c.now // 1000 + 30
    t = jwt.encode({"exp": exp_s, "acl": {"pub": ["up/%c"], "sub": ["down/%c"]}}, secret, algorithm="HS256")
    connack = c.connect(client_id="dev-1", password=t.encode(), will=Will("up/dev-1", b"bye"))
    assert connack.reason_code == 0
    assert c.timers[TOKEN_EXPIRY] == exp_s * 1000
    c.send(Subscribe(1, [Subscription("down/dev-1", 1), Subscription("down/dev-2", 1)]))
    (eff,) = c.take_effects(ProduceSubscriptions)
    assert [x.topic_filter for x in eff.subscriptions] == ["down/dev-1"]
    c.call("subscriptions_written", None)
    c.call("retained_ready")
    denied = RC.NOT_AUTHORIZED if level == 5 else RC.UNSPECIFIED_ERROR
    assert c.take() == [SubAck(1, [1, denied])]
    c.send(Publish(topic="elsewhere", payload=b"x", qos=1, packet_id=7))  # not in the token's acl: dropped
    assert not c.take_effects(ProducePublish)
    c.send(Publish(topic="up/dev-1", payload=b"x", qos=1, packet_id=8))
    assert [e.topic for e in c.take_effects(ProducePublish)] == ["up/dev-1"]
    c.take()
    c.run(c.m.timer_fired(TOKEN_EXPIRY, c.now))  # early (a clock step): armed again, nothing else
    assert c.closed is None and c.timers[TOKEN_EXPIRY] == exp_s * 1000
    c.advance(exp_s * 1000 - 1 - c.now)
    assert c.closed is None
    c.advance(1)
    sent = c.take()
    if level == 5:
        assert plain(sent) == [mq.Disconnect(RC.NOT_AUTHORIZED)]
        assert sent[0].properties.reason_string == "token expired"
    else:
        assert sent == []
    assert c.closed is not None and "token expired" in c.closed.reason
    assert [w.delay for w in c.of(ScheduleWill)] == [0] and len(c.of(ReportDisconnect)) == 1
    assert c.m.stats["token_expired"] == 1
