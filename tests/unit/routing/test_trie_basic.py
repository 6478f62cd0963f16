import gc
import sys
import tracemalloc

import pytest

from tbmq_routing import trie as trie_mod
from tbmq_routing.trie import RetainedStore, Subscription, SubscriptionTrie

pytestmark = pytest.mark.unit


def S(cid, qos=0, share="", **kw):
    return Subscription(cid, qos=qos, share_name=share, **kw)


def matched(t, topic):
    return sorted((f, s.client_id, s.share_name) for f, s in t.match(topic))


@pytest.mark.parametrize("f,topic,hit", [
    ("a/b", "a/b", True),
    ("a/b", "a/c", False),
    ("a/b", "a/b/c", False),
    ("a/b/c", "a/b", False),
    ("a/+", "a/b", True),
    ("a/+", "a/", True),          # empty level is a level
    ("a/+", "a", False),
    ("a/+", "a/b/c", False),
    ("+", "a", True),
    ("+", "", True),
    ("+", "/", False),
    ("+/+", "/", True),
    ("/+", "/a", True),
    ("/+", "a", False),
    ("a/#", "a", True),           # '#' matches the parent level
    ("a/#", "a/", True),
    ("a/#", "a/b/c", True),
    ("a/#", "ab", False),
    ("#", "a/b", True),
    ("#", "/", True),
    ("a//b", "a//b", True),
    ("a//b", "a/b", False),
    ("a/+/c", "a//c", True),
    ("+/b/#", "x/b", True),
    ("a/+/#", "a", False),
    ("a/+/#", "a/b", True),
    # [MQTT-4.7.2-1]
    ("#", "$SYS/x", False),
    ("+/x", "$SYS/x", False),
    ("+", "$SYS", False),
    ("$SYS/#", "$SYS/x", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/+", "$SYS/x", True),
    ("$SYS", "$SYS", True),
    ("a/#", "a/$x", True),        # '$' only matters in the first level
    ("a/+", "a/$x", True),
    ("$share/g/x", "$share/g/x", True),
])
def test_match_rules(f, topic, hit):
    t = SubscriptionTrie()
    t.add(f, S("c"))
    assert bool(t.match(topic)) is hit


def test_match_returns_pairs_and_all_filters():
    t = SubscriptionTrie()
    subs = {"a/b": S("c1", 1), "a/+": S("c1", 2), "#": S("c2"), "a/#": S("c3")}
    for f, s in subs.items():
        t.add(f, s)
    t.add("a/b", S("c4", share="g"))
    res = t.match("a/b")
    assert sorted((f, s) for f, s in res if not s.share_name) == sorted(subs.items())
    assert ("a/b", S("c4", share="g")) in res
    assert len(res) == 5


def test_values_per_client_and_share():
    t = SubscriptionTrie()
    assert t.add("a", S("c", 0)) is True
    assert t.add("a", S("c", 2)) is False  # replace
    assert t.add("a", S("c", 1, share="g")) is True
    assert t.add("a", S("c", 1, share="h")) is True
    assert len(t) == 3 and t.client_count == 1 and t.filter_count == 1
    assert t.get("a", "c").qos == 2
    assert t.get("a", "c", "g").share_name == "g"
    assert t.get("a", "x") is None and t.get("b", "c") is None
    assert t.remove("a", "c", "g") is True
    assert t.remove("a", "c", "g") is False
    assert t.remove("zz", "c") is False
    assert matched(t, "a") == [("a", "c", ""), ("a", "c", "h")]


def test_many_values_on_one_node_switches_representation():
    t = SubscriptionTrie()
    n = 50
    for i in range(n):
        t.add("a/+", S(f"c{i}", i % 3))
    assert len(t.match("a/x")) == n
    for i in range(n):
        t.add("a/+", S(f"c{i}", 1))  # replacements
    assert len(t) == n and {s.qos for _, s in t.match("a/x")} == {1}
    for i in range(0, n, 2):
        assert t.remove("a/+", f"c{i}")
    assert sorted(s.client_id for _, s in t.match("a/x")) == sorted(f"c{i}" for i in range(1, n, 2))
    for i in range(1, n, 2):
        assert t.remove("a/+", f"c{i}")
    assert t.match("a/x") == [] and t.node_count == 0 and len(t) == 0


def test_filter_string_is_shared_between_clients():
    t = SubscriptionTrie()
    f1 = "".join(["a/", "b"])
    f2 = "".join(["a/", "b"])
    assert f1 is not f2
    t.add(f1, S("x"))
    t.add(f2, S("y"))
    fs = [f for f, _ in t.match("a/b")]
    assert fs[0] is fs[1]


def test_replace_client_diff():
    t = SubscriptionTrie()
    t.replace_client("c", [("a", S("c", 1)), ("b/+", S("c", 0)), ("x", S("c", 1, share="g"))])
    assert len(t) == 3
    before = t.get("a", "c")
    added, removed = t.replace_client("c", [
        ("a", S("c", 1)),                 # unchanged -> untouched
        ("b/+", S("c", 2)),               # changed qos
        ("x", S("c", 1, share="h")),      # different share -> new; g removed
        ("d/#", S("c", 1, subscription_id=5)),
    ])
    assert (added, removed) == (3, 1)
    assert t.get("a", "c") is before
    assert t.get("b/+", "c").qos == 2
    assert t.get("x", "c", "g") is None and t.get("x", "c", "h") is not None
    assert sorted(f for f, _ in t.subscriptions_of("c")) == ["a", "b/+", "d/#", "x"]
    assert matched(t, "d") == [("d/#", "c", "")]
    # empty set = removed
    assert t.replace_client("c", []) == (0, 4)
    assert len(t) == 0 and t.node_count == 0 and t.client_count == 0
    assert t.subscriptions_of("c") == []


def test_replace_client_single_to_many_and_back():
    t = SubscriptionTrie()
    t.replace_client("c", [("a", S("c"))])
    t.replace_client("c", [("a", S("c")), ("b", S("c"))])
    t.replace_client("c", [("b", S("c"))])
    assert t.subscriptions_of("c") == [("b", S("c"))]
    assert t.match("a") == [] and len(t) == 1


def test_replace_client_rejects_foreign_subscription():
    t = SubscriptionTrie()
    with pytest.raises(ValueError):
        t.replace_client("c", [("a", S("other"))])


def test_remove_client_and_other_clients_untouched():
    t = SubscriptionTrie()
    for i in range(10):
        t.add(f"a/{i}/+", S("c", 1))
        t.add(f"a/{i}/+", S(f"d{i}", 1))
    t.add("a/#", S("c", share="g"))
    assert t.remove_client("c") == 11
    assert t.remove_client("c") == 0
    assert len(t) == 10 and t.client_count == 10
    assert matched(t, "a/3/x") == [("a/3/+", "d3", "")]


def test_counts_and_pruning():
    t = SubscriptionTrie()
    t.add("a/b/c", S("x"))
    t.add("a/b", S("y"))
    t.add("a/+/#", S("z"))
    assert t.node_count == 5  # a, b, c, +, #
    assert t.filter_count == 3
    t.remove("a/b/c", "x")
    assert t.node_count == 4
    t.remove("a/b", "y")
    assert t.node_count == 3  # b pruned, a kept for '+'
    t.remove("a/+/#", "z")
    assert t.node_count == 0 and t.filter_count == 0 and len(t) == 0
    assert t.stats() == {"subscriptions": 0, "clients": 0, "filters": 0, "nodes": 0}
    assert trie_mod._EMPTY == {}  # the shared sentinel was never mutated


def test_memory_returns_to_empty_after_removing_everything():
    t = SubscriptionTrie()

    def fill():
        for i in range(2000):
            t.add(f"europe/ua/kyiv/{i}/+", S(f"dev{i}", 1))
            t.add(f"europe/ua/city{i % 7}/#", S(f"app{i}", 1, subscription_id=i + 1))
            t.add(f"europe/ua/kyiv/{i}/+", S(f"sh{i}", 1, share="g"))

    fill()  # warm up caches
    for c in list(t.clients()):
        t.remove_client(c)
    # The trie interns level strings; released ones leave Python's interned-string table, and re-adding
    # them can resize that global table inside the measuring window (how full it is depends on every test
    # that ran before). Holding the levels interned here keeps the measurement about the trie alone.
    levels = [sys.intern(x) for x in ("europe", "ua", "kyiv", "+", "#", *map(str, range(2000)),
                                      *(f"city{i}" for i in range(7)))]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fill()
        full = tracemalloc.get_traced_memory()[0]
        assert t.node_count > 2000
        for c in list(t.clients()):
            t.remove_client(c)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert t.node_count == 0 and len(t) == 0 and t.client_count == 0 and t.filter_count == 0
    assert full - base > 500_000
    assert after - base < (full - base) * 0.02, (base, full, after)
    del levels


def test_iteration():
    t = SubscriptionTrie()
    t.add("a", S("c"))
    t.add("b", S("c"))
    t.add("a", S("d"))
    assert sorted((f, s.client_id) for f, s in t) == [("a", "c"), ("a", "d"), ("b", "c")]
    assert sorted(t.clients()) == ["c", "d"]
    t.clear()
    assert len(t) == 0 and t.match("a") == []


# ---------------------------------------------------------------- retained store

def test_retained_set_get_delete():
    r = RetainedStore()
    assert r.set("a/b", 1) is True
    assert r.set("a/b", 2) is False
    assert r.get("a/b") == 2 and "a/b" in r and "a" not in r and r.get("a") is None
    assert r.set("a", 3) and r.set("a//b", 4) and r.set("/", 5)
    assert len(r) == 4
    assert sorted(r.items()) == [("/", 5), ("a", 3), ("a//b", 4), ("a/b", 2)]
    assert r.delete("a/b") is True and r.delete("a/b") is False and r.delete("zz") is False
    assert r.delete("a") and r.delete("a//b") and r.delete("/")
    assert len(r) == 0 and r.node_count == 0


@pytest.mark.parametrize("f,expected", [
    ("a/b", ["a/b"]),
    ("a/+", ["a/", "a/b", "a/c"]),
    ("a/#", ["a", "a/", "a/b", "a/b/c", "a/c"]),
    ("#", ["/x", "a", "a/", "a/b", "a/b/c", "a/c", "b"]),
    ("+", ["a", "b"]),
    ("+/#", ["/x", "a", "a/", "a/b", "a/b/c", "a/c", "b"]),
    ("+/+", ["/x", "a/", "a/b", "a/c"]),
    ("/+", ["/x"]),
    ("$SYS/#", ["$SYS", "$SYS/load"]),
    ("$SYS/+", ["$SYS/load"]),
    ("+/load", []),
    ("a/b/c/#", ["a/b/c"]),
    ("zz/#", []),
])
def test_retained_match_filter(f, expected):
    r = RetainedStore()
    for topic in ["a", "a/", "a/b", "a/c", "a/b/c", "b", "/x", "$SYS", "$SYS/load"]:
        r.set(topic, topic)
    assert sorted(r.match_filter(f)) == expected
