import pytest

from tbmq_routing.topics import (
    InvalidSharedSubscription,
    InvalidTopicFilter,
    InvalidTopicName,
    ParsedFilter,
    TopicError,
    is_valid_topic_filter,
    is_valid_topic_name,
    parse_subscription_filter,
    validate_topic_filter,
    validate_topic_name,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("topic", [
    "a", "a/b/c", "/", "//", "/a", "a/", "a//b", "$SYS/x", "$share/g/x", " ", "ünïcødé/тема", "a" * 65535,
    "€" * (65535 // 3),
])
def test_valid_topic_names(topic):
    validate_topic_name(topic)
    assert is_valid_topic_name(topic)


@pytest.mark.parametrize("topic,statement", [
    ("", "MQTT-4.7.3-1"),
    ("a/+", "MQTT-3.3.2-2"),
    ("a/#", "MQTT-3.3.2-2"),
    ("+", "MQTT-3.3.2-2"),
    ("a+b", "MQTT-3.3.2-2"),
    ("a#", "MQTT-3.3.2-2"),
    ("a\x00b", "MQTT-4.7.3-2"),
    ("a" * 65536, "MQTT-4.7.3-3"),
    ("€" * (65535 // 3 + 1), "MQTT-4.7.3-3"),
    ("a\ud800", "MQTT-1.5.4-1"),
])
def test_invalid_topic_names(topic, statement):
    with pytest.raises(InvalidTopicName) as ei:
        validate_topic_name(topic)
    assert ei.value.statement == statement
    assert isinstance(ei.value, TopicError) and isinstance(ei.value, ValueError)
    assert not is_valid_topic_name(topic)


@pytest.mark.parametrize("f", [
    "a", "#", "+", "+/+", "a/+/b", "a/#", "+/#", "/#", "//", "a//+", "$SYS/#", "+/", "/+", "a/+/#",
])
def test_valid_filters(f):
    validate_topic_filter(f)
    assert is_valid_topic_filter(f)


@pytest.mark.parametrize("f,statement", [
    ("", "MQTT-4.7.3-1"),
    ("a/#/b", "MQTT-4.7.1-1"),
    ("#/", "MQTT-4.7.1-1"),
    ("a#", "MQTT-4.7.1-1"),
    ("a/b#", "MQTT-4.7.1-1"),
    ("##", "MQTT-4.7.1-1"),
    ("a+", "MQTT-4.7.1-2"),
    ("a/+b/c", "MQTT-4.7.1-2"),
    ("++", "MQTT-4.7.1-2"),
    ("a/\x00", "MQTT-4.7.3-2"),
])
def test_invalid_filters(f, statement):
    with pytest.raises(InvalidTopicFilter) as ei:
        validate_topic_filter(f)
    assert ei.value.statement == statement
    assert not is_valid_topic_filter(f)


@pytest.mark.parametrize("raw,expected", [
    ("a/b", ParsedFilter("", "a/b")),
    ("$share/g/a/+", ParsedFilter("g", "a/+")),
    ("$share/g/#", ParsedFilter("g", "#")),
    ("$share/g//", ParsedFilter("g", "/")),
    ("$share/consumers-1/europe/ua/kyiv/1/+", ParsedFilter("consumers-1", "europe/ua/kyiv/1/+")),
    ("$share", ParsedFilter("", "$share")),  # not "$share/": an ordinary filter
    ("$sharex/a", ParsedFilter("", "$sharex/a")),
])
def test_parse_subscription_filter(raw, expected):
    p = parse_subscription_filter(raw)
    assert p == expected
    assert p.shared == bool(expected.share_name)
    assert p.original() == raw


@pytest.mark.parametrize("raw,statement", [
    ("$share//a", "MQTT-4.8.2-1"),
    ("$share/", "MQTT-4.8.2-1"),
    ("$share/g", "MQTT-4.8.2-2"),
    ("$share/g/", "MQTT-4.8.2-2"),
    ("$share/g+/a", "MQTT-4.8.2-2"),
    ("$share/#/a", "MQTT-4.8.2-2"),
    ("$share/g/a/#/b", "MQTT-4.7.1-1"),
    ("$share/g/a+", "MQTT-4.7.1-2"),
])
def test_invalid_shared(raw, statement):
    with pytest.raises(InvalidSharedSubscription) as ei:
        parse_subscription_filter(raw)
    assert ei.value.statement == statement
    assert not ei.value.protocol_error
    assert isinstance(ei.value, InvalidTopicFilter)


def test_shared_no_local_is_protocol_error():
    with pytest.raises(InvalidSharedSubscription) as ei:
        parse_subscription_filter("$share/g/a", no_local=True)
    assert ei.value.protocol_error and ei.value.statement == "MQTT-3.8.3-4"
    # no-local on a normal subscription is fine
    assert parse_subscription_filter("a", no_local=True) == ParsedFilter("", "a")


def test_shared_disabled_for_v3():
    assert parse_subscription_filter("$share/g/a", allow_shared=False) == ParsedFilter("", "$share/g/a")
    with pytest.raises(InvalidTopicFilter):
        parse_subscription_filter("a/#/b", allow_shared=False)


def test_error_message_names_statement():
    with pytest.raises(InvalidTopicFilter, match=r"MQTT-4\.7\.1-1"):
        validate_topic_filter("a/#/b")


@pytest.mark.parametrize("topic_filter,topic,expected", [
    ("a/b", "a/b", True), ("a/b", "a/c", False), ("a/+", "a/b", True), ("a/+", "a/b/c", False),
    ("a/+", "a", False), ("a/#", "a", True), ("a/#", "a/b/c", True), ("#", "a/b", True),
    ("+/+", "/x", True), ("+", "", True), ("a/+/c", "a//c", True), ("#", "$SYS/x", False),
    ("+/x", "$SYS/x", False), ("$SYS/#", "$SYS/x", True), ("a/b/#", "a", False),
])
def test_topic_matches(topic_filter, topic, expected):
    from tbmq_routing import topic_matches
    assert topic_matches(topic_filter, topic) is expected


def test_subscribed_to_uses_every_filter_of_the_set():
    from tbmq_routing import subscribed_to
    subs = {("", "a/b"): 1, ("g", "x/+"): 2, ("", "s/#"): 3}
    assert subscribed_to(subs, "a/b") and subscribed_to(subs, "x/1") and subscribed_to(subs, "s")
    assert not subscribed_to(subs, "a/c") and not subscribed_to(subs, "x/1/2") and not subscribed_to({}, "a")
