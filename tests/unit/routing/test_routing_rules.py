import hashlib

import pytest

from tbmq_routing.naming import (
    APP_TOPIC_PREFIX,
    SHARED_APP_TOPIC_PREFIX,
    app_topic_name,
    shared_app_topic_name,
    shared_store_id,
)
from tbmq_routing.rules import (
    APPLICATION,
    DEVICE,
    PublishInfo,
    RoundRobin,
    SessionView,
    plan_routing,
)
from tbmq_routing.trie import Subscription, SubscriptionTrie

pytestmark = pytest.mark.unit


def sha(s):
    return hashlib.sha256(s.encode()).hexdigest()


# sessions used by the table
ON = SessionView(True, "svc-a", DEVICE, False)          # connected, clean
ON_B = SessionView(True, "svc-b", DEVICE, False)
ON_P = SessionView(True, "svc-a", DEVICE, True)         # connected, persistent DEVICE
OFF_P = SessionView(False, "", DEVICE, True)            # offline persistent DEVICE
OFF = SessionView(False, "", DEVICE, False)             # offline clean (should not exist long)
ON_NOSVC = SessionView(True, "", DEVICE, False)
APP_ON = SessionView(True, "svc-b", APPLICATION, True)
APP_OFF = SessionView(False, "", APPLICATION, True)
APP_ON_NP = SessionView(True, "svc-a", APPLICATION, False)  # non-persistent APPLICATION
APP_OFF_NP = SessionView(False, "", APPLICATION, False)


def sub(cid, qos=1, share="", **kw):
    return Subscription(cid, qos=qos, share_name=share, **kw)


def summary(plan):
    out = {}
    if plan.live:
        out["live"] = {svc: sorted((d.client_id, d.qos, d.retain, d.subscription_ids) for d in ds)
                       for svc, ds in plan.live.items()}
    if plan.persisted:
        out["persisted"] = sorted((d.client_id, d.qos, d.retain, d.subscription_ids) for d in plan.persisted)
    if plan.app:
        out["app"] = sorted((d.client_id, d.topic, d.qos, d.retain, d.subscription_ids) for d in plan.app)
    if plan.shared_app:
        out["shared_app"] = sorted((c.topic_filter, c.topic, c.share_names, c.qos, c.retain, c.subscription_ids)
                                   for c in plan.shared_app)
    if plan.dropped:
        out["dropped"] = plan.dropped
    return out


P = "pub"  # publisher client id
CASES = [
    # id, (pub qos, retain), matches, sessions, expected summary
    ("clean connected -> live", (1, False), [("t", sub("c"))], {"c": ON},
     {"live": {"svc-a": [("c", 1, False, ())]}}),
    ("persistent connected, publish QoS0 -> live", (0, False), [("t", sub("c", 2))], {"c": ON_P},
     {"live": {"svc-a": [("c", 0, False, ())]}}),
    ("persistent connected, subscription QoS0 -> live", (2, False), [("t", sub("c", 0))], {"c": ON_P},
     {"live": {"svc-a": [("c", 0, False, ())]}}),
    ("persistent DEVICE connected QoS1/1 -> persisted", (1, False), [("t", sub("c", 1))], {"c": ON_P},
     {"persisted": [("c", 1, False, ())]}),
    ("persistent DEVICE offline QoS1/2 -> persisted at 1", (1, False), [("t", sub("c", 2))], {"c": OFF_P},
     {"persisted": [("c", 1, False, ())]}),
    ("persistent DEVICE offline QoS0 -> dropped", (0, False), [("t", sub("c", 2))], {"c": OFF_P},
     {"dropped": 1}),
    ("clean offline -> dropped", (1, False), [("t", sub("c"))], {"c": OFF}, {"dropped": 1}),
    ("no session -> dropped", (1, False), [("t", sub("c"))], {}, {"dropped": 1}),
    ("connected without service id -> dropped", (0, False), [("t", sub("c"))], {"c": ON_NOSVC}, {"dropped": 1}),
    ("APPLICATION connected QoS1 -> app topic", (1, False), [("t", sub("app1"))], {"app1": APP_ON},
     {"app": [("app1", "tbmq.msg.app.app1", 1, False, ())]}),
    ("APPLICATION offline QoS2, id hashed", (2, False), [("t", sub("app-1", 2))], {"app-1": APP_OFF},
     {"app": [("app-1", "tbmq.msg.app.h-" + sha("app-1"), 2, False, ())]}),
    ("APPLICATION connected QoS0 -> live", (0, False), [("t", sub("a", 1))], {"a": APP_ON},
     {"live": {"svc-b": [("a", 0, False, ())]}}),
    ("APPLICATION offline QoS0 -> dropped", (1, False), [("t", sub("a", 0))], {"a": APP_OFF}, {"dropped": 1}),
    ("non-persistent APPLICATION connected -> live", (2, False), [("t", sub("a", 2))], {"a": APP_ON_NP},
     {"live": {"svc-a": [("a", 2, False, ())]}}),
    ("non-persistent APPLICATION offline -> dropped", (2, False), [("t", sub("a", 2))], {"a": APP_OFF_NP},
     {"dropped": 1}),
    ("merge per client: max QoS, union of ids", (2, False),
     [("a/+", sub("c", 0, subscription_id=5)), ("a/#", sub("c", 2, subscription_id=3)),
      ("#", sub("c", 1)), ("a/b", sub("c", 0, subscription_id=5))], {"c": ON},
     {"live": {"svc-a": [("c", 2, False, (3, 5))]}}),
    ("merge then persist at max QoS", (1, False),
     [("a/+", sub("c", 0)), ("a/#", sub("c", 2, subscription_id=9))], {"c": OFF_P},
     {"persisted": [("c", 1, False, (9,))]}),
    ("QoS = min(publish, subscription)", (1, False), [("t", sub("c", 2))], {"c": ON},
     {"live": {"svc-a": [("c", 1, False, ())]}}),
    ("no-local skips the publisher only", (1, False),
     [("t", sub(P, 1, no_local=True)), ("t", sub("c", 1, no_local=True))], {P: ON, "c": ON},
     {"live": {"svc-a": [("c", 1, False, ())]}}),
    ("no-local on one of the publisher's filters", (1, False),
     [("t", sub(P, 2, no_local=True, subscription_id=1)), ("#", sub(P, 0, subscription_id=2))], {P: ON},
     {"live": {"svc-a": [(P, 0, False, (2,))]}}),
    ("retain-as-published keeps RETAIN", (1, True), [("t", sub("c", retain_as_published=True))], {"c": ON},
     {"live": {"svc-a": [("c", 1, True, ())]}}),
    ("without retain-as-published RETAIN is cleared", (1, True), [("t", sub("c"))], {"c": ON},
     {"live": {"svc-a": [("c", 1, False, ())]}}),
    ("retain-as-published with a non-retained publish", (1, False),
     [("t", sub("c", retain_as_published=True))], {"c": ON}, {"live": {"svc-a": [("c", 1, False, ())]}}),
    ("RAP on any merged subscription", (1, True),
     [("t", sub("c")), ("#", sub("c", retain_as_published=True))], {"c": OFF_P},
     {"persisted": [("c", 1, True, ())]}),
    ("live grouped per connector", (0, False),
     [("t", sub("c1")), ("t", sub("c2")), ("t", sub("c3"))], {"c1": ON, "c2": ON_B, "c3": ON},
     {"live": {"svc-a": [("c1", 0, False, ()), ("c3", 0, False, ())], "svc-b": [("c2", 0, False, ())]}}),
    ("mixed fan-out", (1, False),
     [("t", sub("d")), ("t", sub("p")), ("t", sub("a")), ("t", sub("x"))],
     {"d": ON, "p": OFF_P, "a": APP_OFF, "x": OFF},
     {"live": {"svc-a": [("d", 1, False, ())]}, "persisted": [("p", 1, False, ())],
      "app": [("a", "tbmq.msg.app.a", 1, False, ())], "dropped": 1}),
    # ---- shared DEVICE groups
    ("shared: none connected, one persistent -> group store", (2, False),
     [("a/+", sub("m1", 1, "g")), ("a/+", sub("m2", 2, "g", subscription_id=4))], {"m1": OFF, "m2": OFF_P},
     {"persisted": [("$share/g/a/+", 2, False, (4,))]}),
    ("shared: none connected, persistent but QoS0 -> dropped", (0, False),
     [("a/+", sub("m1", 1, "g"))], {"m1": OFF_P}, {"dropped": 1}),
    ("shared: nobody connected or persistent -> dropped", (1, False),
     [("a/+", sub("m1", 1, "g")), ("a/+", sub("m2", 1, "g"))], {"m1": OFF}, {"dropped": 1}),
    ("shared: chosen member persistent QoS1 -> its own store", (1, False),
     [("a/+", sub("m1", 1, "g", subscription_id=8))], {"m1": ON_P}, {"persisted": [("m1", 1, False, (8,))]}),
    ("shared: chosen member clean -> live", (1, True),
     [("a/+", sub("m1", 2, "g", retain_as_published=True))], {"m1": ON_B},
     {"live": {"svc-b": [("m1", 1, True, ())]}}),
    ("shared and non-shared of one client are separate copies", (1, False),
     [("a/+", sub("c", 1, "g")), ("a/#", sub("c", 0))], {"c": ON},
     {"live": {"svc-a": [("c", 0, False, ()), ("c", 1, False, ())]}}),
    ("two share names on one filter -> one device copy each", (1, False),
     [("a/+", sub("m1", 1, "g")), ("a/+", sub("m2", 1, "h"))], {"m1": ON, "m2": ON},
     {"live": {"svc-a": [("m1", 1, False, ()), ("m2", 1, False, ())]}}),
    # ---- shared APPLICATION groups
    ("shared APPLICATION: one copy per filter", (1, False),
     [("a/+", sub("x1", 1, "g")), ("a/+", sub("x2", 2, "g", subscription_id=3)),
      ("a/+", sub("x3", 0, "h")), ("b/#", sub("x1", 1, "g"))],
     {"x1": APP_ON, "x2": APP_OFF, "x3": APP_ON},
     {"shared_app": [("a/+", "tbmq.msg.app.shared.a._slw", ("g", "h"), 1, False, (3,)),
                     ("b/#", "tbmq.msg.app.shared.b._mlw", ("g",), 1, False, ())]}),
    ("shared APPLICATION QoS0 still goes to the shared topic", (0, False),
     [("a", sub("x1", 1, "g"))], {"x1": APP_OFF},
     {"shared_app": [("a", "tbmq.msg.app.shared.a", ("g",), 0, False, ())]}),
    ("shared mixed: APPLICATION copy + device round robin", (1, False),
     [("a", sub("x1", 1, "g")), ("a", sub("d1", 1, "g")), ("a", sub("n1", 1, "g"))],
     {"x1": APP_ON, "d1": ON, "n1": APP_ON_NP},
     {"shared_app": [("a", "tbmq.msg.app.shared.a", ("g",), 1, False, ())],
      "live": {"svc-a": [("d1", 1, False, ())]}}),
    ("shared mixed: offline clean device members covered by the app copy", (1, False),
     [("a", sub("x1", 1, "g")), ("a", sub("d1", 1, "g"))], {"x1": APP_OFF, "d1": OFF},
     {"shared_app": [("a", "tbmq.msg.app.shared.a", ("g",), 1, False, ())]}),
]


@pytest.mark.parametrize("name,pub,matches,sessions,expected", CASES, ids=[c[0] for c in CASES])
def test_routing_table(name, pub, matches, sessions, expected):
    publish = PublishInfo(P, "a/b", qos=pub[0], retain=pub[1])
    plan = plan_routing(publish, matches, sessions)
    assert summary(plan) == expected
    # the callable form of the lookup gives the same plan
    assert summary(plan_routing(publish, matches, sessions.get)) == expected


def test_shared_round_robin_among_connected_members():
    rr = RoundRobin()
    matches = [("a/+", sub(m, 1, "g")) for m in ("m1", "m2", "m3")]
    sessions = {"m1": ON, "m2": OFF_P, "m3": ON_B}
    picks = []
    for _ in range(4):
        plan = plan_routing(PublishInfo(P, "a/x", 0), matches, sessions, rr)
        assert len(plan.shared_device) == 1
        choice = plan.shared_device[0]
        assert (choice.share_name, choice.topic_filter, choice.store_id) == ("g", "a/+", None)
        picks.append(choice.client_id)
        assert plan.copies == 1
    assert picks == ["m1", "m3", "m1", "m3"]  # m2 is offline
    # the delivery records which shared subscription it is for
    plan = plan_routing(PublishInfo(P, "a/x", 0), matches, sessions, rr)
    (d,) = [d for ds in plan.live.values() for d in ds]
    assert (d.share_name, d.topic_filter) == ("g", "a/+")


def test_shared_store_choice_and_dropped_ids():
    plan = plan_routing(PublishInfo(P, "a/x", 1), [("a/+", sub("m", 1, "g"))], {"m": OFF_P})
    assert plan.shared_device[0].store_id == "$share/g/a/+" and plan.shared_device[0].client_id is None
    assert plan.persisted[0].share_name == "g"
    plan = plan_routing(PublishInfo(P, "a/x", 1), [("a/+", sub("m", 1, "g")), ("t", sub("z"))], {"m": OFF})
    assert plan.dropped == 2 and sorted(plan.dropped_clients) == ["$share/g/a/+", "z"]


def test_no_local_counter_and_empty_plan():
    plan = plan_routing(PublishInfo(P, "t", 1), [("t", sub(P, no_local=True))], {P: ON})
    assert plan.no_local_skipped == 1 and plan.is_empty() and plan.dropped == 0
    assert plan_routing(PublishInfo(P, "t", 1), [], {}).is_empty()


def test_with_trie_matches():
    t = SubscriptionTrie()
    t.add("europe/ua/kyiv/1/+", sub("dev1", 1))
    t.add("europe/#", sub("dash", 0, subscription_id=2))
    t.add("europe/ua/+/1/temp", sub("dev1", 2, subscription_id=7))
    plan = plan_routing(PublishInfo("p", "europe/ua/kyiv/1/temp", 2), t.match("europe/ua/kyiv/1/temp"),
                        {"dev1": OFF_P, "dash": ON})
    assert summary(plan) == {"persisted": [("dev1", 2, False, (7,))],
                             "live": {"svc-a": [("dash", 0, False, (2,))]}}


def test_round_robin_helper():
    rr = RoundRobin()
    assert [rr.pick("k", "abc") for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick("k", "xy") == "y"  # position kept modulo the new length
    assert rr.pick("other", [1, 2]) == 1
    assert len(rr) == 2
    rr.forget("k")
    assert rr.pick("k", "abc") == "a" and len(rr) == 2
    with pytest.raises(ValueError):
        rr.pick("k", [])


@pytest.mark.parametrize("client_id,expected", [
    ("abc123", "tbmq.msg.app.abc123"),
    ("ABCxyz09", "tbmq.msg.app.ABCxyz09"),
    ("app-1", "tbmq.msg.app.h-" + sha("app-1")),
    ("a.b", "tbmq.msg.app.h-" + sha("a.b")),
    ("", "tbmq.msg.app.h-" + sha("")),
    ("клієнт", "tbmq.msg.app.h-" + sha("клієнт")),
    ("a" * 236, "tbmq.msg.app." + "a" * 236),
    ("a" * 237, "tbmq.msg.app.h-" + sha("a" * 237)),  # would exceed Kafka's 249 chars
])
def test_app_topic_name(client_id, expected):
    assert app_topic_name(client_id) == expected
    assert expected.startswith(APP_TOPIC_PREFIX) and len(expected) <= 249


# issue 14, "names that cannot collide": each name is injective over what it is derived from
def test_derived_names_are_injective():
    from hypothesis import given, settings, strategies as st
    from tbmq_routing import is_reserved_client_id, shared_app_topic_name, shared_store_id

    share = st.text(alphabet=st.characters(blacklist_characters="/+#\x00"), min_size=1, max_size=6)
    flt = st.text(alphabet="ab_/+#slwm", min_size=1, max_size=8)

    @settings(max_examples=300, deadline=None)
    @given(share, flt, share, flt)
    def stores(s1, f1, s2, f2):
        if (s1, f1) != (s2, f2):
            assert shared_store_id(s1, f1) != shared_store_id(s2, f2)
        assert is_reserved_client_id(shared_store_id(s1, f1))

    @settings(max_examples=300, deadline=None)
    @given(flt, flt)
    def shared_topics(f1, f2):
        if f1 != f2:
            assert shared_app_topic_name(f1) != shared_app_topic_name(f2)

    @settings(max_examples=300, deadline=None)
    @given(st.text(max_size=70), st.text(max_size=70))
    def app_topics(c1, c2):
        if c1 != c2:
            assert app_topic_name(c1) != app_topic_name(c2)

    stores()
    shared_topics()
    app_topics()
    # the collisions TBMQ's names have
    assert shared_store_id("a_b", "c") != shared_store_id("a", "b_c")
    assert app_topic_name(sha("x")) != app_topic_name("x.")  # "x." is hashed
    assert not is_reserved_client_id("ss_sensor1") and is_reserved_client_id("$share/g/t")


@pytest.mark.parametrize("f,expected", [
    ("home/+/t/#", "tbmq.msg.app.shared.home._slw.t._mlw"),
    ("a", "tbmq.msg.app.shared.a"),
    ("#", "tbmq.msg.app.shared._mlw"),
    ("+/+", "tbmq.msg.app.shared._slw._slw"),
    ("a/slw", "tbmq.msg.app.shared.a.slw"),
    ("a/b-c", "tbmq.msg.app.shared.h-" + sha("a/b-c")),
    ("a//b", "tbmq.msg.app.shared.a..b"),
    ("a b", "tbmq.msg.app.shared.h-" + sha("a b")),
    ("x" * 229, "tbmq.msg.app.shared." + "x" * 229),
    ("x" * 230, "tbmq.msg.app.shared.h-" + sha("x" * 230)),
])
def test_shared_app_topic_name(f, expected):
    assert shared_app_topic_name(f) == expected
    assert expected.startswith(SHARED_APP_TOPIC_PREFIX) and len(expected) <= 249


def test_shared_store_id():
    assert shared_store_id("g", "a/+") == "$share/g/a/+"


def test_package_exports():
    import tbmq_routing
    from tbmq_routing import rules

    assert tbmq_routing.app_topic_name is rules.app_topic_name
    assert rules.APP_TOPIC_PREFIX == "tbmq.msg.app." and rules.SHARED_APP_TOPIC_PREFIX == "tbmq.msg.app.shared."
