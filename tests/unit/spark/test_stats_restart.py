"""Which failed statistics query is started again, and which planned batch it forgets first
(tbmq_spark.stats.uncommitted_batch / deleted_topics; the run against real Kafka and Spark is
tests/integration/spark/test_spark_stats.py::test_available_now_run_goes_on_when_an_application_topic_is_deleted)."""

from __future__ import annotations

import json

from tbmq_spark.stats import deleted_topics, uncommitted_batch


def test_the_newest_planned_batch_without_a_commit_is_the_uncommitted_one():
    assert uncommitted_batch(["0", "1", "2", ".2.crc", ".1.crc"], ["0", "1", ".1.crc"]) == 2
    assert uncommitted_batch(["0", "1", "10", "9"], ["0", "1", "9"]) == 10  # numeric, not by name
    assert uncommitted_batch(["0", "1"], ["0", "1"]) is None
    assert uncommitted_batch(["0"], []) == 0
    assert uncommitted_batch([], []) is None
    assert uncommitted_batch([".0.crc", "metadata"], []) is None


def _entry(*sources) -> str:
    """An offsets log entry as Spark writes it: version, batch metadata, one line per source."""
    meta = {"batchWatermarkMs": 0, "batchTimestampMs": 1, "conf": {}}
    return "\n".join(["v1", json.dumps(meta), *(s if isinstance(s, str) else json.dumps(s) for s in sources)])


def test_the_topics_of_a_logged_batch_that_no_longer_exist():
    entry = _entry({"tbmq.msg.all": {"0": 5, "1": 7}, "tbmq.msg.app.a": {"0": 3}, "tbmq.msg.app.b": {"0": 1}},
                   {"tbmq.client.session": {"0": 9}})
    assert deleted_topics(entry, {"tbmq.msg.all", "tbmq.msg.app.b", "tbmq.client.session"}) == {"tbmq.msg.app.a"}
    assert deleted_topics(entry, {"tbmq.msg.all", "tbmq.msg.app.a", "tbmq.msg.app.b", "tbmq.client.session"}) == set()
    # the metadata line is not a source, and a source without offsets is written as "-"
    assert deleted_topics(_entry("-", {"t": {"0": 1}}), set()) == {"t"}
    assert deleted_topics(_entry(), set()) == set()
