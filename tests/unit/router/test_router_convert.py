"""Pure glue of the router: proto <-> tbmq_routing, plan -> records, expiry, state updates."""

from __future__ import annotations

import pytest

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_routing.rules import APPLICATION, DEVICE, SessionView

from router.convert import (DOWNLINK_RECORD_MAX_BYTES, downlink_values, is_expired, session_from_record,
                            subscriptions_from_record)
from router.state import RoutingState

pytestmark = pytest.mark.unit


def subs(client_id: str, *items: pb.TopicSubscription, client_type=pb.CLIENT_TYPE_DEVICE) -> bytes:
    return pb.ClientSubscriptions(client_id=client_id, subscriptions=list(items),
                                  client_type=client_type).SerializeToString()


def session(client_id: str, *, connected=True, service_id="c1", app=False, persistent=False) -> bytes:
    return pb.SessionInfo(client_id=client_id, service_id=service_id, connected=connected,
                          client_type=pb.CLIENT_TYPE_APPLICATION if app else pb.CLIENT_TYPE_DEVICE,
                          persistent=persistent).SerializeToString()


def publish(topic: str, *, qos=1, retain=False, publisher="pub", payload=b"x", **kw) -> bytes:
    return pb.PublishMsg(publisher_id=publisher, topic=topic, qos=qos, retain=retain, payload=payload,
                         **kw).SerializeToString()


def sub(f: str, qos=1, **kw) -> pb.TopicSubscription:
    return pb.TopicSubscription(topic_filter=f, qos=qos, **kw)


def test_subscriptions_from_record_maps_every_option_and_skips_invalid_filters():
    value = subs("c", sub("a/+", 2, no_local=True, retain_as_published=True, subscription_id=7,
                          retain_handling=pb.RETAIN_HANDLING_DONT_SEND),
                 sub("bad/#/x"), sub("g/#", 1, share_name="grp"))
    client, pairs = subscriptions_from_record(b"c", value)
    assert client == "c"
    assert [f for f, _ in pairs] == ["a/+", "g/#"]
    s = pairs[0][1]
    assert (s.client_id, s.qos, s.no_local, s.retain_as_published, s.subscription_id, s.retain_handling) == \
        ("c", 2, True, True, 7, 2)
    assert pairs[1][1].share_name == "grp"
    assert subscriptions_from_record(b"c", None) == ("c", [])


def test_session_from_record():
    assert session_from_record(None) is None
    assert session_from_record(session("a", app=True, persistent=True)) == SessionView(True, "c1", APPLICATION, True)
    # offline: no service id for routing
    assert session_from_record(session("a", connected=False)) == SessionView(False, "", DEVICE, False)


def test_expiry():
    m = pb.PublishMsg(created_at_ms=10_000, message_expiry_interval=5)
    assert not is_expired(m, 14_999)
    assert is_expired(m, 15_000)  # the whole interval has passed (tbmq_routing.expiry)
    assert not is_expired(pb.PublishMsg(created_at_ms=10_000), 10**12)  # no interval: never


def test_state_replace_and_remove():
    st = RoutingState()
    st.apply_subscriptions(b"c", subs("c", sub("a"), sub("b")))
    assert len(st.trie) == 2
    st.apply_subscriptions(b"c", subs("c", sub("b")))
    assert [f for f, _ in st.trie.subscriptions_of("c")] == ["b"]
    st.apply_subscriptions(b"c", subs("c"))  # empty set removes the client
    assert len(st.trie) == 0
    st.apply_subscriptions(b"d", subs("d", sub("x")))
    st.apply_subscriptions(b"d", None)  # tombstone removes the client
    assert len(st.trie) == 0
    st.apply_session(b"d", session("d"))
    assert "d" in st.sessions
    st.apply_session(b"d", None)
    assert "d" not in st.sessions


def _state(**clients) -> RoutingState:
    st = RoutingState()
    for cid, (subs_value, sess_value) in clients.items():
        st.apply_subscriptions(cid.encode(), subs_value)
        if sess_value is not None:
            st.apply_session(cid.encode(), sess_value)
    return st


def test_live_downlink_one_record_per_connector_with_merged_recipients():
    st = _state(
        a=(subs("a", sub("t/+", 1, subscription_id=1), sub("t/#", 2, subscription_id=2)), session("a", service_id="c1")),
        b=(subs("b", sub("t/x", 0)), session("b", service_id="c1")),
        c=(subs("c", sub("#", 2)), session("c", service_id="c2")),
    )
    routed = st.route(b"t/x", publish("t/x", qos=2))
    by_topic = {r.topic: r for r in routed.records}
    assert set(by_topic) == {topics.downlink_basic_topic("c1"), topics.downlink_basic_topic("c2")}
    d1 = pb.BasicDownlink.FromString(by_topic[topics.downlink_basic_topic("c1")].value)
    assert d1.msg.topic == "t/x" and d1.msg.qos == 2
    rec = {r.client_id: (r.qos, list(r.subscription_ids)) for r in d1.recipients}
    assert rec == {"a": (2, [1, 2]), "b": (0, [])}
    assert by_topic[topics.downlink_basic_topic("c1")].key == b"t/x"


def test_persisted_app_and_shared_records():
    st = _state(
        dev=(subs("dev", sub("s/#", 1, subscription_id=3)), session("dev", connected=False, persistent=True)),
        app1=(subs("app1", sub("s/+", 2)), session("app1", app=True, persistent=True)),
        sa=(subs("sa", sub("s/#", 1, share_name="g")), session("sa", app=True, persistent=True)),
    )
    routed = st.route(b"s/1", publish("s/1", qos=2, retain=True))
    by_topic = {r.topic: r for r in routed.records}
    pm = pb.PersistedMsg.FromString(by_topic[topics.MSG_PERSISTED].value)
    assert by_topic[topics.MSG_PERSISTED].key == b"dev"
    assert (pm.client_id, pm.msg.qos, pm.msg.retain, list(pm.msg.subscription_ids)) == ("dev", 1, False, [3])
    app_rec = by_topic["tbmq.msg.app.app1"]
    assert app_rec.spec is not None and app_rec.spec.name == "tbmq.msg.app.app1"
    assert pb.PublishMsg.FromString(app_rec.value).qos == 2
    shared = by_topic[topics.shared_app_topic("s/#").name]
    assert shared.spec.partitions == topics.shared_app_topic("s/#").partitions
    assert pb.PublishMsg.FromString(shared.value).qos == 1


def test_persisted_copies_carry_the_origin_they_were_routed_from():
    st = _state(
        d1=(subs("d1", sub("s/#", 1)), session("d1", connected=False, persistent=True)),
        d2=(subs("d2", sub("s/+", 2)), session("d2", connected=False, persistent=True)),
        live=(subs("live", sub("s/#", 1)), session("live", service_id="c1")),
    )
    routed = st.route(b"s/1", publish("s/1", qos=2), origin=(7, 2**40 + 5))
    persisted = [pb.PersistedMsg.FromString(r.value) for r in routed.records if r.topic == topics.MSG_PERSISTED]
    assert sorted(pm.client_id for pm in persisted) == ["d1", "d2"]
    for pm in persisted:  # spliced fields decode as the proto says, next to a receiver copy per client
        assert (pm.origin_partition, pm.origin_offset) == (7, 2**40 + 5) and pm.msg.topic == "s/1"
    assert {pm.client_id: pm.msg.qos for pm in persisted} == {"d1": 1, "d2": 2}
    downlink = next(r for r in routed.records if r.topic == topics.downlink_basic_topic("c1"))
    assert pb.BasicDownlink.FromString(downlink.value).msg.topic == "s/1"  # other records as before
    # offset 0 is an origin too (the field's presence, not its value, says there is one)
    pm0 = pb.PersistedMsg.FromString(next(r for r in st.route(b"s/1", publish("s/1"), origin=(0, 0)).records
                                          if r.topic == topics.MSG_PERSISTED).value)
    assert pm0.HasField("origin_offset") and (pm0.origin_partition, pm0.origin_offset) == (0, 0)
    unknown = pb.PersistedMsg.FromString(next(r for r in st.route(b"s/1", publish("s/1")).records
                                              if r.topic == topics.MSG_PERSISTED).value)
    assert not unknown.HasField("origin_offset")


def test_expired_and_no_match_produce_nothing():
    st = _state(a=(subs("a", sub("#")), session("a")))
    r = st.route(b"t", publish("t", created_at_ms=1000, message_expiry_interval=1), now_ms=5000)
    assert r.expired and r.records == []
    assert st.route(b"$SYS/x", publish("$SYS/x")).records == []  # '#' does not match '$' topics
    assert st.counters["expired"] == 1


def test_a_fan_out_too_large_for_one_record_is_split_every_recipient_once():
    n = 30_000  # ~1.3 MB of recipients on one connector: over Kafka's default 1 MB max.request.size
    st = RoutingState()
    for i in range(n):
        cid = f"client-{i:06d}-" + "x" * 20
        st.apply_subscriptions(cid.encode(), subs(cid, sub("big/t", 1)))
        st.apply_session(cid.encode(), session(cid, service_id="c1"))
    routed = st.route(b"big/t", publish("big/t", payload=b"p" * 1000))
    assert len(routed.records) > 1
    got = []
    for r in routed.records:
        assert r.topic == topics.downlink_basic_topic("c1") and r.key == b"big/t"
        assert len(r.value) <= DOWNLINK_RECORD_MAX_BYTES
        d = pb.BasicDownlink.FromString(r.value)
        assert d.msg.topic == "big/t" and d.msg.payload == b"p" * 1000
        got.extend(x.client_id for x in d.recipients)
    assert len(got) == n and len(set(got)) == n  # every recipient exactly once


def test_downlink_values_split_in_order_and_keep_a_message_near_the_bound():
    from tbmq_routing.rules import Delivery

    ds = [Delivery(f"c{i}", 1, False, ()) for i in range(10)]
    msg_field = pb.BasicDownlink(msg=pb.PublishMsg(topic="t/x")).SerializeToString()  # field 1, as spliced
    values = downlink_values(msg_field, ds, max_bytes=len(msg_field) + 20)
    assert len(values) > 1 and all(len(v) <= len(msg_field) + 20 for v in values)
    decoded = [pb.BasicDownlink.FromString(v) for v in values]
    assert all(d.msg.topic == "t/x" for d in decoded)
    assert [r.client_id for d in decoded for r in d.recipients] == [d.client_id for d in ds]
    # a bound below the message plus one recipient: still sent, one recipient per record
    assert len(downlink_values(msg_field, ds[:3], max_bytes=len(msg_field))) == 3
    # fits: one record, same bytes as protobuf's encoding
    one = downlink_values(msg_field, ds[:2])
    assert one == [pb.BasicDownlink(msg=pb.PublishMsg(topic="t/x"), recipients=[
        pb.Recipient(client_id="c0", qos=1), pb.Recipient(client_id="c1", qos=1)]).SerializeToString()]


def test_downlink_values_keep_one_clients_recipients_in_one_record_and_the_origin_in_each():
    from router.convert import origin_fields
    from tbmq_routing.rules import Delivery

    # c3 has its own copy and one from a shared group, far apart in the plan's order
    ds = [Delivery(f"c{i}", 1, False, ()) for i in range(8)] + [Delivery("c3", 2, False, (), "g", "t/#")]
    msg_field = pb.BasicDownlink(msg=pb.PublishMsg(topic="t/x")).SerializeToString()
    tail = origin_fields(3, 41)
    values = downlink_values(msg_field, ds, max_bytes=len(msg_field) + len(tail) + 30, tail=tail)
    assert len(values) > 2
    decoded = [pb.BasicDownlink.FromString(v) for v in values]
    assert all((d.origin_partition, d.origin_offset) == (3, 41) for d in decoded)
    holding_c3 = [i for i, d in enumerate(decoded) if any(r.client_id == "c3" for r in d.recipients)]
    assert len(holding_c3) == 1 and [r.qos for r in decoded[holding_c3[0]].recipients if r.client_id == "c3"] \
        == [1, 2]
    got = sorted((r.client_id, r.qos) for d in decoded for r in d.recipients)
    assert got == sorted((d.client_id, d.qos) for d in ds)  # every recipient exactly once
