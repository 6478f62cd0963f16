"""tbmq_platform.backoff: the one back-off rule of the retry loops towards peer services."""

from __future__ import annotations

import pytest
from tbmq_platform.backoff import PEER_CHANNEL_OPTIONS, PEER_RETRY_MAX_S, Backoff


def test_doubles_from_the_initial_delay_up_to_the_cap_and_resets():
    b = Backoff(0.1, 1.0)
    assert not b.active and b.current == 0
    assert [b.next() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert b.active
    b.reset()
    assert not b.active and b.next() == pytest.approx(0.1)


def test_peer_default_and_channel_options_share_the_cap():
    b = Backoff()
    delays = [b.next() for _ in range(20)]
    assert max(delays) == PEER_RETRY_MAX_S <= 1.0       # a restarted peer is retried within a second
    opts = dict(PEER_CHANNEL_OPTIONS)
    assert opts["grpc.max_reconnect_backoff_ms"] == int(PEER_RETRY_MAX_S * 1000)
    assert opts["grpc.initial_reconnect_backoff_ms"] <= opts["grpc.max_reconnect_backoff_ms"]


@pytest.mark.parametrize("initial,cap", [(0, 1), (-1, 1), (2, 1)])
def test_bad_bounds_are_refused(initial, cap):
    with pytest.raises(ValueError):
        Backoff(initial, cap)
