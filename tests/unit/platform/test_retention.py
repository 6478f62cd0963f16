"""tbmq_platform.retention.assess: the state of one partition from its offsets (pure)."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from tbmq_platform.retention import LOST, NEAR, OK, assess

pytestmark = pytest.mark.unit

TP = TopicPartition("t", 0)


def test_a_group_that_consumed_everything_is_ok_whatever_the_age_of_the_log():
    f = assess(TP, committed=100, earliest=0, end=100, first_at_threshold=None)
    assert (f.state, f.unconsumed, f.lost) == (OK, 0, 0)


def test_no_committed_offset_is_not_judged():
    assert assess(TP, committed=None, earliest=10, end=100, first_at_threshold=None).state == OK


def test_unconsumed_records_younger_than_the_threshold_are_ok():
    # the first record at or after the threshold time is offset 40; the group is at 50: what it has not
    # consumed is all younger than the threshold
    f = assess(TP, committed=50, earliest=0, end=100, first_at_threshold=40)
    assert (f.state, f.unconsumed) == (OK, 50)


def test_unconsumed_records_older_than_the_threshold_are_near():
    f = assess(TP, committed=30, earliest=0, end=100, first_at_threshold=40)
    assert (f.state, f.unconsumed, f.lost) == (NEAR, 70, 0)


def test_every_record_older_than_the_threshold_and_some_unconsumed_is_near():
    f = assess(TP, committed=99, earliest=0, end=100, first_at_threshold=None)
    assert (f.state, f.unconsumed) == (NEAR, 1)


def test_committed_below_the_log_start_is_lost_with_the_count_of_deleted_records():
    f = assess(TP, committed=5, earliest=25, end=100, first_at_threshold=None)
    assert (f.state, f.unconsumed, f.lost) == (LOST, 95, 20)
