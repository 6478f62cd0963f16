"""The connection machine's limits (issue 14, deliverable 6): topic length and levels, subscriptions per client,
user properties per packet, retained quota; each with the reaction MQTT gives it, per protocol version."""

from __future__ import annotations

import pytest
from connection_harness import Client
from tbmq_connection import ProducePublish, ProduceSubscriptions
import tbmq_mqtt as mq

PubAck, PubRec, Publish, Properties = mq.PubAck, mq.PubRec, mq.Publish, mq.Properties
SubAck, Subscribe, Subscription, Will, ConnAck = mq.SubAck, mq.Subscribe, mq.Subscription, mq.Will, mq.ConnAck
RC = mq.ReasonCode

pytestmark = pytest.mark.unit

LIMITS = dict(max_topic_bytes=32, max_topic_levels=4, max_subscriptions=2, max_user_properties=2)


def connected(level: int, **kw) -> Client:
    c = Client(level, **LIMITS, **kw)
    assert c.connect(client_id="lim").reason_code == 0
    return c


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize("topic", ["a/b/c/d/e", "x" * 33])  # 5 levels; 33 bytes
def test_a_publish_over_the_topic_limits_is_refused(level, topic):
    c = connected(level)
    c.send(Publish(topic=topic, payload=b"p", qos=1, packet_id=7))
    assert not c.take_effects(ProducePublish) or all(e.msg is None for e in c.of(ProducePublish))
    (ack,) = c.take()
    assert isinstance(ack, PubAck) and ack.packet_id == 7
    # v5: Topic Name invalid; 3.1.1 has no failure code: acknowledged and dropped [MQTT-3.3.5-2]
    assert ack.reason_code == (RC.TOPIC_NAME_INVALID if level == 5 else RC.SUCCESS)
    assert c.m.stats["publish_refused_topic_limit"] == 1
    c.send(Publish(topic="a/b/c/d", payload=b"p", qos=1, packet_id=8))  # at the limits: goes on
    assert [e.msg.topic for e in c.of(ProducePublish) if e.msg is not None] == ["a/b/c/d"]


def test_user_properties_over_the_limit_v5():
    c = connected(5)
    props = Properties(user_properties=(("a", "1"), ("b", "2"), ("c", "3")))
    c.send(Publish(topic="t", payload=b"p", qos=2, packet_id=3, properties=props))
    (ack,) = c.take()
    assert isinstance(ack, PubRec) and ack.reason_code == RC.QUOTA_EXCEEDED
    assert not [e for e in c.of(ProducePublish) if e.msg is not None]


@pytest.mark.parametrize("level", [4, 5])
def test_retained_quota(level):
    room = {"ok": False}
    c = connected(level, retained_room=lambda topic, size: room["ok"])
    c.send(Publish(topic="r", payload=b"full", qos=1, packet_id=1, retain=True))
    (ack,) = c.take()
    assert isinstance(ack, PubAck) and ack.packet_id == 1
    assert ack.reason_code == (RC.QUOTA_EXCEEDED if level == 5 else RC.SUCCESS)
    c.send(Publish(topic="r", payload=b"", qos=1, packet_id=2, retain=True))  # clearing always works
    c.send(Publish(topic="r", payload=b"x", qos=0, retain=False))  # not retained: not concerned
    assert [(e.msg.topic, e.retain) for e in c.of(ProducePublish) if e.msg is not None] == [("r", True), ("r", False)]
    assert c.m.stats["publish_refused_retained_quota"] == 1


@pytest.mark.parametrize("level", [4, 5])
def test_subscriptions_per_client_and_filter_limits(level):
    c = connected(level)
    c.send(Subscribe(1, [Subscription("a/+", 1), Subscription("b/#", 1), Subscription("c", 1),
                         Subscription("a/b/c/d/e", 1), Subscription("a/+", 0)]))
    (sets,) = c.take_effects(ProduceSubscriptions)
    assert sorted(s.topic_filter for s in sets.subscriptions) == ["a/+", "b/#"]
    c.call("subscriptions_written", None)
    c.call("retained_ready")
    quota = RC.QUOTA_EXCEEDED if level == 5 else RC.UNSPECIFIED_ERROR
    invalid = RC.TOPIC_FILTER_INVALID if level == 5 else RC.UNSPECIFIED_ERROR
    # an existing filter may be replaced at the limit (the last entry)
    assert [p for p in c.take() if isinstance(p, SubAck)] == [SubAck(1, [1, 1, quota, invalid, 0])]
    assert c.m.stats["subscribe_refused_quota"] == 1 and c.m.stats["subscribe_refused_topic_limit"] == 1


@pytest.mark.parametrize("level", [4, 5])
def test_a_will_over_the_limits_is_refused_at_connect(level):
    c = Client(level, **LIMITS)
    c.send(mq.Connect(protocol_level=level, client_id="w", clean_start=True, will=Will("a/b/c/d/e", b"gone")))
    got = c.take()
    assert c.closed is not None and not c.of(mq.ConnAck)
    if level == 5:
        assert got == [ConnAck(False, RC.TOPIC_NAME_INVALID)] or (
            len(got) == 1 and got[0].reason_code == RC.TOPIC_NAME_INVALID)
    else:  # as an invalid Will topic: 3.1.1 has no return code for it, the connection is closed
        assert all(p.reason_code != 0 for p in got)


@pytest.mark.parametrize("level", [4, 5])
def test_a_client_over_its_publish_rate_is_throttled_not_refused(level):
    """MQTT_MAX_PUBLISH_RATE: beyond the burst each PUBLISH still goes on (never refused or dropped), with a
    Throttle telling the runner when it may read the client's next packet."""
    from tbmq_connection import Throttle

    c = connected(level, max_publish_rate=5)
    for i in range(7):
        c.send(Publish(topic="a/b", payload=b"p", qos=1, packet_id=i + 1))
    assert [e.msg.topic for e in c.of(ProducePublish)] == ["a/b"] * 7
    assert [t.until_ms - c.now for t in c.of(Throttle)] == [200, 400]
    assert c.m.stats["publish_throttled"] == 2
    c.advance(2000)  # back within the rate: no Throttle
    c.send(Publish(topic="a/b", payload=b"p", qos=0))
    assert len(c.of(Throttle)) == 2


@pytest.mark.parametrize("level", [4, 5])
def test_clients_over_the_connectors_publish_rate_are_throttled_whichever_spent_it(level):
    """MQTT_MAX_TOTAL_PUBLISH_RATE: one budget for all the connector's connections. One client spends the
    burst; the next PUBLISH of another (within its own rate) pauses that one, and the stat says it was the
    connector's rate; nothing is refused."""
    from tbmq_connection import Throttle
    from tbmq_connection.limits import PublishRate

    total = PublishRate(4, 0)
    a = Client(level, **LIMITS, total_rate=total, max_publish_rate=100)
    b = Client(level, **LIMITS, total_rate=total, max_publish_rate=100)
    for c, cid in ((a, "a"), (b, "b")):
        assert c.connect(client_id=cid).reason_code == 0
    for i in range(4):
        a.send(Publish(topic="a/b", payload=b"p", qos=1, packet_id=i + 1))
    assert not a.of(Throttle) and a.m.stats["publish_throttled_connector"] == 0
    b.send(Publish(topic="b/c", payload=b"p", qos=1, packet_id=1))
    (t,) = b.of(Throttle)
    assert t.until_ms - b.now == 250  # one PUBLISH over 4 a second
    assert b.m.stats["publish_throttled_connector"] == 1 and b.m.stats["publish_throttled"] == 0
    assert [e.msg.topic for e in b.of(ProducePublish)] == ["b/c"]
    a.advance(1000)
    b.advance(1000)  # the same clock: a second later the budget is back
    b.send(Publish(topic="b/c", payload=b"p", qos=0))
    assert len(b.of(Throttle)) == 1


def test_a_throttle_longer_than_the_keep_alive_does_not_close_the_client():
    """The connector stops reading while the client is throttled, so the client's packets (its PINGREQs too)
    wait in the socket: the keep alive counts from the throttle's end, not from the last packet read."""
    from tbmq_connection import Throttle

    c = Client(4, **LIMITS, max_publish_bytes_rate=100)
    assert c.connect(client_id="lim", keep_alive=10).reason_code == 0
    c.send(Publish(topic="a/b", payload=b"x" * 3000, qos=0))  # 2,900 bytes over: 29 s at 100 a second
    (t,) = c.of(Throttle)
    assert t.until_ms - c.now == 29_000
    c.advance(20_000)  # past 1.5 x the keep alive since the last packet, within the throttle
    assert c.closed is None
    c.advance(29_000 - 20_000 + 15_000)  # the throttle's end + 1.5 x the keep alive, nothing read
    assert c.closed is not None and "keep alive" in c.closed.reason
