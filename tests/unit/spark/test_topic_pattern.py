"""The statistics job's message-topic pattern against the catalogue. Spark's Kafka source keeps a topic when
the pattern is FOUND in its name (as re.search does), so every alternative must be anchored: an unanchored
`tbmq\\.msg\\.persisted` took tbmq.msg.persisted.dead too, and the job then refused the test's starting
offsets ("you must specify all TopicPartitions")."""

from __future__ import annotations

import re

from tbmq_platform import topics as T
from tbmq_spark.kafka_io import MESSAGE_TOPICS_PATTERN


def test_the_pattern_takes_exactly_the_message_topics_however_it_is_matched():
    names = [s.name for s in T.static_topics()] + [T.downlink_basic_topic("connector-1"),
                                                   T.app_topic_name("app1"), T.shared_app_topic_name("a/+")]
    wanted = {T.MSG_ALL, T.MSG_PERSISTED, T.MSG_PERSISTED_TALLY, T.downlink_basic_topic("connector-1"),
              T.app_topic_name("app1"), T.shared_app_topic_name("a/+")}
    rx = re.compile(MESSAGE_TOPICS_PATTERN)
    assert {n for n in names if rx.search(n)} == wanted
    assert {n for n in names if rx.fullmatch(n)} == wanted
    assert T.MSG_PERSISTED_DEAD in names and not rx.search(T.MSG_PERSISTED_DEAD)
