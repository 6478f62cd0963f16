"""When the statistics job starts a failed query again, and which planned batch it forgets first
(tbmq_spark.stats.restartable / uncommitted_batch; the run against real Kafka and Spark is
tests/integration/spark/test_spark_stats.py::test_available_now_run_goes_on_when_an_application_topic_is_deleted)."""

from __future__ import annotations

from tbmq_spark.stats import restartable, uncommitted_batch

LOST = ("Some of partitions in Kafka topic(s) have been lost during running query with Trigger.AvailableNow. "
        "The error could be transient - restart your query, and report if you still see the same issue.")


def test_only_an_available_now_run_that_lost_a_topic_is_restarted():
    assert restartable("availableNow", f"[STREAM_FAILED] Query terminated with exception: {LOST}")
    assert restartable("available-now", "[LOST_TOPIC_PARTITIONS_IN_END_OFFSET_WITH_TRIGGER_AVAILABLENOW] x")
    # a processingTime query never runs Spark's availableNow check; another error is not ours to retry
    assert not restartable("processingTime=10 seconds", LOST)
    assert not restartable("once", LOST)
    assert not restartable("availableNow", "Timeout of 60000ms expired before the position for partition t-0")


def test_the_newest_planned_batch_without_a_commit_is_the_uncommitted_one():
    assert uncommitted_batch(["0", "1", "2", ".2.crc", ".1.crc"], ["0", "1", ".1.crc"]) == 2
    assert uncommitted_batch(["0", "1", "10", "9"], ["0", "1", "9"]) == 10  # numeric, not by name
    assert uncommitted_batch(["0", "1"], ["0", "1"]) is None
    assert uncommitted_batch(["0"], []) == 0
    assert uncommitted_batch([], []) is None
    assert uncommitted_batch([".0.crc", "metadata"], []) is None
