"""The message expiry rule (tbmq_routing.expiry) at its boundaries [MQTT-3.3.2-5, MQTT-3.3.2-6]."""

from __future__ import annotations

import pytest

from tbmq_routing.expiry import deadline_ms, expired, forwarded_interval, interval_at, left_ms, store_ttl_ms

T0 = 1_700_000_000_000  # created_at_ms

# (interval s, ms waited, expired, forwarded interval s, store TTL ms)
TABLE = [
    (1, 0, False, 1, 1000),
    (1, 1, False, 1, 999),          # 999 ms left: forwarded as 1 s (rounded up), never 0
    (1, 999, False, 1, 1),          # 1 ms left: still alive
    (1, 1000, True, None, 0),       # the whole interval has passed: expired, not stored
    (1, 1001, True, None, -1),
    (10, 0, False, 10, 10_000),
    (10, 1, False, 10, 9_999),      # rounded up: never more than a second above the truth
    (10, 1000, False, 9, 9_000),    # exactly 9 s left
    (10, 1001, False, 9, 8_999),
    (10, 8_500, False, 2, 1_500),
    (10, 9_999, False, 1, 1),
    (10, 10_000, True, None, 0),
    (0, 0, True, None, 0),          # an interval of 0 has passed on arrival
    (0xFFFFFFFF, 10**9, False, 0xFFFFFFFF - 10**6, 0xFFFFFFFF * 1000 - 10**9),
]


@pytest.mark.parametrize("interval, waited, is_expired, forwarded, ttl", TABLE)
def test_boundary_table(interval, waited, is_expired, forwarded, ttl):
    now = T0 + waited
    assert expired(T0, interval, now) is is_expired
    assert forwarded_interval(T0, interval, now) == forwarded
    assert store_ttl_ms(T0, interval, now) == ttl
    # the three answers agree: stored exactly as long as it is alive, forwarded exactly while alive
    assert (store_ttl_ms(T0, interval, now) <= 0) is is_expired
    assert (forwarded_interval(T0, interval, now) is None) is is_expired


@pytest.mark.parametrize("interval, waited, is_expired, forwarded, ttl", TABLE)
def test_a_deadline_kept_and_read_later_agrees_with_the_rule(interval, waited, is_expired, forwarded, ttl):
    """What a holder keeps (deadline_ms, taken when the message reached it) and reads when it finally sends
    (interval_at) gives what forwarded_interval gives at that moment, whatever it waited in between."""
    for held_at in (T0, T0 + waited // 2, T0 + waited):
        deadline = deadline_ms(T0, interval, held_at)
        assert interval_at(deadline, T0 + waited) == forwarded
    assert interval_at(deadline_ms(T0, 10, T0 - 5000), T0 - 5000) == 10  # a clock behind: no wait counted


def test_forwarded_never_below_truth_nor_a_second_above():
    for waited in range(0, 5000, 7):
        left = left_ms(T0, 5, T0 + waited)
        fwd = forwarded_interval(T0, 5, T0 + waited)
        if left <= 0:
            assert fwd is None
        else:
            assert left <= fwd * 1000 < left + 1000


def test_clock_behind_the_connector_does_not_lengthen_life():
    # a service whose clock is 5 s behind the connector's: no wait counted, never more than received
    assert forwarded_interval(T0, 10, T0 - 5000) == 10
    assert store_ttl_ms(T0, 10, T0 - 5000) == 10_000


def test_unknown_creation_time_counts_as_not_waited():
    assert not expired(0, 1, T0)
    assert forwarded_interval(0, 3, T0) == 3
    assert store_ttl_ms(-1, 3, T0) == 3000


def test_will_rules_publish_records_and_delay():
    """tbmq_routing.wills: what a PUBLISH / Will writes, and when a Will goes (connector and registry)."""
    from tbmq.v1 import messages_pb2 as pb
    from tbmq_routing.wills import publish_records, will_delay_seconds

    plain_msg = pb.PublishMsg(topic="a/b", payload=b"x", retain=False)
    assert publish_records(plain_msg, "all", "ret") == [("all", b"a/b", plain_msg.SerializeToString())]
    kept = pb.PublishMsg(topic="a/b", payload=b"x", retain=True)
    assert [t for t, _k, _v in publish_records(kept, "all", "ret")] == ["all", "ret"]
    assert publish_records(kept, "all", "ret")[1][2] == kept.SerializeToString()
    empty = pb.PublishMsg(topic="a/b", payload=b"", retain=True)
    assert publish_records(empty, "all", "ret")[1] == ("ret", b"a/b", None)   # deletes [MQTT-3.3.1-6/-7]
    assert will_delay_seconds(5, 30, 10) == 10 and will_delay_seconds(4, 30, 100) == 0
