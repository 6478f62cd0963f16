import hashlib
from pathlib import Path

from tbmq_platform import topics

ROOT = Path(__file__).resolve().parents[3]


def test_docs_topics_is_generated_from_the_catalogue():
    assert (ROOT / "docs/topics.md").read_text() == topics.render_markdown(), \
        "docs/topics.md is stale: python -m tbmq_platform.topics > docs/topics.md"


def test_reference_topics_are_all_catalogued():
    names = {s.name for s in topics.CATALOGUE}
    for expected in ("tbmq.msg.all", "tbmq.msg.persisted", "tbmq.msg.app.<client>",
                     "tbmq.msg.app.shared.<filter>", "tbmq.msg.retained", "tbmq.client.session",
                     "tbmq.client.subscriptions", "tbmq.client.session.event.request",
                     "tbmq.client.session.event.response.<svc>", "tbmq.client.disconnect.<svc>",
                     "tbmq.msg.downlink.basic.<svc>",
                     "tbmq.sys.app.removed", "tbmq.sys.historical.data"):
        assert expected in names
    # stored DEVICE messages reach connectors over device-persistence's Forward gRPC stream, not Kafka
    assert not any("downlink.persisted" in n for n in names)


def test_compacted_topics_have_no_time_retention():
    for s in topics.CATALOGUE:
        cfg = s.configs()
        if s.compact:
            assert cfg["cleanup.policy"] == "compact" and "retention.ms" not in cfg
        else:
            assert cfg["cleanup.policy"] == "delete" and int(cfg["retention.ms"]) > 0


def test_service_topics_fill_in_the_service_id():
    names = [s.name for s in topics.service_topics("connector-7")]
    assert names == [
        "tbmq.client.session.event.response.connector-7",
        "tbmq.client.disconnect.connector-7",
        "tbmq.msg.downlink.basic.connector-7",
    ]
    assert all("<" not in s.name for s in topics.static_topics())


def test_app_topic_name_is_the_id_or_h_and_its_sha256():
    assert topics.app_topic_name("sensor42") == "tbmq.msg.app.sensor42"
    digest = hashlib.sha256("app-1/é".encode()).hexdigest()
    assert topics.app_topic_name("app-1/é") == "tbmq.msg.app.h-" + digest
    # a client id that IS a hash keeps its own topic (issue 14: names cannot collide)
    assert topics.app_topic_name(digest) == "tbmq.msg.app." + digest != topics.app_topic_name("app-1/é")


def test_shared_app_topic_name():
    assert topics.shared_app_topic_name("home/+/t/#") == "tbmq.msg.app.shared.home._slw.t._mlw"
    assert topics.shared_app_topic_name("a/+") != topics.shared_app_topic_name("a/slw")  # TBMQ: the same
    assert topics.shared_app_topic_name("a b").startswith("tbmq.msg.app.shared.h-")
    assert len(topics.shared_app_topic_name("a b")) == len("tbmq.msg.app.shared.h-") + 64


def test_partition_profiles():
    by_name = {s.name: s for s in topics.CATALOGUE}
    prod = {n: s.partitions_in(topics.PRODUCTION) for n, s in by_name.items()}
    single = {n: s.partitions_in(topics.SINGLE_NODE) for n, s in by_name.items()}
    # production: TBMQ's counts
    assert prod["tbmq.msg.all"] == 16 and prod["tbmq.msg.persisted"] == 12
    assert prod["tbmq.client.session.event.request"] == 24 and prod["tbmq.msg.downlink.basic.<svc>"] == 12
    # single-node: one partition per message topic, but a shared APPLICATION group keeps one partition per
    # member it can serve at once
    for name in ("tbmq.msg.all", "tbmq.msg.persisted", "tbmq.client.session.event.request",
                 "tbmq.msg.downlink.basic.<svc>"):
        assert single[name] == 1, name
    assert single["tbmq.msg.app.shared.<filter>"] == prod["tbmq.msg.app.shared.<filter>"] > 1
    assert all(single[n] <= prod[n] for n in by_name)
    # derived specs keep the profile counts
    assert topics.app_topic("c1").partitions_in(topics.SINGLE_NODE) == 1
    assert all(s.partitions_in(topics.SINGLE_NODE) == 1 for s in topics.service_topics("c-1"))


def test_unknown_profile_is_refused():
    import pytest

    with pytest.raises(ValueError, match="unknown topic profile"):
        topics.spec(topics.MSG_ALL).partitions_in("tiny")


def test_the_profile_is_a_common_setting_and_a_bad_one_is_named():
    import pytest
    from tbmq_platform.settings import CommonSettings, SettingsError, load

    assert load(CommonSettings, {}).topic_profile == topics.PRODUCTION
    assert load(CommonSettings, {"TBMQ_TOPIC_PROFILE": "single-node"}).topic_profile == topics.SINGLE_NODE
    with pytest.raises(SettingsError, match="TBMQ_TOPIC_PROFILE='tiny'"):
        load(CommonSettings, {"TBMQ_TOPIC_PROFILE": "tiny"})


def test_app_consumer_groups_are_named_in_one_place():
    from tbmq_routing.naming import app_client_group, app_shared_group

    assert app_client_group("sensor42") == "app-delivery.c.sensor42"
    assert app_shared_group("g1") == "app-delivery.s.g1"
    assert app_client_group("s.g1") != app_shared_group("g1")  # a client id cannot name a share's group
