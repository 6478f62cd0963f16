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
                     "tbmq.msg.downlink.basic.<svc>", "tbmq.msg.downlink.persisted.<svc>",
                     "tbmq.sys.app.removed", "tbmq.sys.historical.data"):
        assert expected in names


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
        "tbmq.msg.downlink.persisted.connector-7",
    ]
    assert all("<" not in s.name for s in topics.static_topics())


def test_app_topic_name_is_the_id_or_its_sha256():
    assert topics.app_topic_name("sensor42") == "tbmq.msg.app.sensor42"
    digest = hashlib.sha256("app-1/é".encode()).hexdigest()
    assert topics.app_topic_name("app-1/é") == "tbmq.msg.app." + digest


def test_shared_app_topic_name():
    assert topics.shared_app_topic_name("home/+/t/#") == "tbmq.msg.app.shared.home.slw.t.mlw"
    assert topics.shared_app_topic_name("a b").startswith("tbmq.msg.app.shared.")
    assert len(topics.shared_app_topic_name("a b")) == len("tbmq.msg.app.shared.") + 64
