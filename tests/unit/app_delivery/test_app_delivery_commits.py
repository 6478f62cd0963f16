"""What a partition's state makes of its own commits (app_delivery.streams.PartState): a commit whose sender
was cancelled (the stream closing) may still reach Kafka; the final commit that follows must take it for its
own, not for the registry's clean start, and still write the exact DUP mark back."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from app_delivery.streams import PartState
from app_delivery.tracking import encode_mark

pytestmark = pytest.mark.unit

AHEAD = 100


def streamed(acked_up_to: int, last: int) -> PartState:
    """Offsets 0..`last` streamed under a reservation, 0..`acked_up_to` acknowledged and committed."""
    part = PartState(TopicPartition("tbmq.msg.app.c", 0), prev_mark=-1, reserved=-1, committed=None)
    for o in range(last + 1):
        part.tracker.sent(o)
    point, mark = part.commit_target((0, last), False, AHEAD)
    part.sending(point, mark, encode_mark(mark))
    part.sent()
    for o in range(acked_up_to + 1):
        part.tracker.ack(o)
    return part


def test_a_commit_acknowledged_moves_committed_and_reserved():
    part = streamed(acked_up_to=9, last=24)
    assert (part.committed, part.reserved, part.in_flight) == (0, 24 + AHEAD, None)
    assert part.commit_target(None, False, AHEAD) == (10, 24 + AHEAD)


def test_a_cancelled_commit_that_reached_kafka_is_ours_and_the_exact_mark_follows():
    part = streamed(acked_up_to=24, last=24)
    point, mark = part.commit_target(None, False, AHEAD)
    assert (point, mark) == (25, 24 + AHEAD)
    part.sending(point, mark, encode_mark(mark))
    # cancelled before Kafka's answer: committed is still 0, Kafka holds 25 with our metadata
    assert not part.moved_by_others(25, encode_mark(24 + AHEAD))
    assert (part.committed, part.reserved, part.in_flight) == (25, 24 + AHEAD, None)
    # the stream ends: the exact mark (the last offset streamed) replaces the one reserved ahead, so the
    # next stream sends offset 25 with DUP=0
    assert part.commit_target(None, True, AHEAD) == (25, 24)


def test_an_offset_moved_by_someone_else_is_not_taken_for_ours():
    part = streamed(acked_up_to=24, last=24)
    part.sending(25, 24 + AHEAD, encode_mark(24 + AHEAD))
    assert part.moved_by_others(40, "")  # the registry's clean start: the end offset, no mark
    assert part.in_flight is not None and part.committed == 0
    assert part.moved_by_others(25, "")  # our offset, not our metadata
    assert not part.moved_by_others(0, encode_mark(24 + AHEAD))  # behind: the commit never landed


def test_a_commit_of_unknown_outcome_is_never_skipped():
    part = streamed(acked_up_to=9, last=24)
    point, mark = part.commit_target(None, False, AHEAD)
    part.sending(point, mark, encode_mark(mark))
    part.sent()
    assert part.commit_target(None, False, AHEAD) is None  # nothing moved
    part.sending(point, mark, encode_mark(mark))  # sent again, its answer lost (a timeout, a cancel)
    assert part.commit_target(None, False, AHEAD) == (point, mark)
