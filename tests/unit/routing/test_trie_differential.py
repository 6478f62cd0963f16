"""Differential tests: SubscriptionTrie / RetainedStore against a naive split-and-compare matcher."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tbmq_routing import trie as trie_mod
from tbmq_routing.topics import is_valid_topic_filter, is_valid_topic_name, topic_matches
from tbmq_routing.trie import RetainedStore, Subscription, SubscriptionTrie

pytestmark = pytest.mark.unit

FILTER_LEVELS = ["", "+", "#", "$sys", "a", "b"]
TOPIC_LEVELS = ["", "$sys", "a", "b"]


# the naive split-and-compare matcher: tbmq_routing.topics.topic_matches (one filter at a time; its own
# examples are in test_routing_topics.py)
naive_match = topic_matches


# valid filters built constructively ('#' only as the last level), '' alone excluded
filters = st.builds(
    lambda levels, tail: "/".join(levels + (["#"] if tail else [])),
    st.lists(st.sampled_from([lv for lv in FILTER_LEVELS if lv != "#"]), max_size=4),
    st.booleans(),
).filter(lambda f: f != "")
topics = st.lists(st.sampled_from(TOPIC_LEVELS), min_size=1, max_size=5).map("/".join).filter(
    lambda t: t != "")
clients = st.sampled_from(["c1", "c2", "c3"])
shares = st.sampled_from(["", "", "g"])

op = st.one_of(
    st.tuples(st.just("add"), filters, clients, shares, st.integers(0, 2)),
    st.tuples(st.just("remove"), filters, clients, shares),
    st.tuples(st.just("replace"), clients,
              st.lists(st.tuples(filters, shares, st.integers(0, 2)), max_size=4)),
    st.tuples(st.just("remove_client"), clients),
)


def key(f, s):
    return (f, s.client_id, s.share_name, s.qos)


@settings(max_examples=250, deadline=None)
@given(ops=st.lists(op, max_size=25), probe=st.lists(topics, min_size=1, max_size=12),
       small=st.sampled_from([1, 2, 8]))
def test_trie_matches_naive_model(ops, probe, small):
    # small: the node's tuple->dict threshold, lowered to exercise both representations
    saved = trie_mod._SMALL
    trie_mod._SMALL = small
    try:
        _check_against_model(ops, probe)
    finally:
        trie_mod._SMALL = saved


def _check_against_model(ops, probe):
    trie = SubscriptionTrie()
    model: dict[tuple[str, str, str], Subscription] = {}  # (filter, client, share) -> sub
    for o in ops:
        if o[0] == "add":
            _, f, c, sh, q = o
            sub = Subscription(c, qos=q, share_name=sh)
            assert trie.add(f, sub) == ((f, c, sh) not in model)
            model[(f, c, sh)] = sub
        elif o[0] == "remove":
            _, f, c, sh = o
            assert trie.remove(f, c, sh) == ((f, c, sh) in model)
            model.pop((f, c, sh), None)
        elif o[0] == "replace":
            _, c, items = o
            new = {(f, c, sh): Subscription(c, qos=q, share_name=sh) for f, sh, q in items}
            trie.replace_client(c, [(f, s) for (f, _, _), s in new.items()])
            for k in [k for k in model if k[1] == c]:
                del model[k]
            model.update(new)
        else:
            _, c = o
            n = sum(1 for k in model if k[1] == c)
            assert trie.remove_client(c) == n
            for k in [k for k in model if k[1] == c]:
                del model[k]
        assert len(trie) == len(model)
    assert trie.client_count == len({k[1] for k in model})
    assert trie.filter_count == len({k[0] for k in model})
    for topic in probe:
        got = Counter(key(f, s) for f, s in trie.match(topic))
        want = Counter(key(f, s) for (f, _, _), s in model.items() if naive_match(f, topic))
        assert got == want, topic
    # everything removed -> the trie is empty again
    for c in {k[1] for k in model}:
        trie.remove_client(c)
    assert len(trie) == 0 and trie.node_count == 0 and trie.filter_count == 0


@settings(max_examples=200, deadline=None)
@given(stored=st.lists(topics, max_size=15), deleted=st.lists(topics, max_size=5),
       probe=st.lists(filters, min_size=1, max_size=10))
def test_retained_matches_naive_model(stored, deleted, probe):
    store = RetainedStore()
    model = {}
    for i, t in enumerate(stored):
        store.set(t, (t, i))
        model[t] = (t, i)
    for t in deleted:
        assert store.delete(t) == (t in model)
        model.pop(t, None)
    assert len(store) == len(model)
    for f in probe:
        got = sorted(store.match_filter(f))
        want = sorted(v for t, v in model.items() if naive_match(f, t))
        assert got == want, f
    for t in list(model):
        store.delete(t)
    assert store.node_count == 0


@settings(max_examples=50, deadline=None)
@given(f=filters, t=topics)
def test_generated_inputs_are_valid(f, t):
    assert is_valid_topic_filter(f) and is_valid_topic_name(t)


def test_naive_matcher_sanity():
    assert naive_match("a/#", "a") and naive_match("#", "a") and not naive_match("#", "$sys")
    assert naive_match("$sys/#", "$sys") and not naive_match("+", "$sys") and naive_match("+", "")
    assert not naive_match("a/+", "a") and naive_match("a/+", "a/")
