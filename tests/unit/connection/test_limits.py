"""tbmq_connection.limits: admission of new connections on an injected clock."""

from __future__ import annotations

import pytest
from tbmq_connection.limits import CONNECT_RATE, TOO_MANY_CONNECTIONS, Admission

pytestmark = pytest.mark.unit


def test_connection_limit_first():
    a = Admission(max_connections=10, rate_per_ip=0, burst_per_ip=1)
    assert a.admit(9, "1.2.3.4", 0.0) is None
    assert a.admit(10, "1.2.3.4", 0.0) == TOO_MANY_CONNECTIONS


def test_token_bucket_per_address():
    a = Admission(max_connections=100, rate_per_ip=10, burst_per_ip=5)
    assert [a.admit(0, "a", 0.0) for _ in range(6)] == [None] * 5 + [CONNECT_RATE]
    assert a.admit(0, "b", 0.0) is None  # another address has its own bucket
    assert a.admit(0, "a", 0.05) == CONNECT_RATE  # half a token back
    assert a.admit(0, "a", 0.1) is None  # one token back at 10/s
    assert [a.admit(0, "a", 100.0) for _ in range(6)] == [None] * 5 + [CONNECT_RATE]  # refilled to the burst


def test_addresses_kept_are_bounded():
    a = Admission(max_connections=100, rate_per_ip=1, burst_per_ip=1, max_addresses=3)
    for ip in ("a", "b", "c", "d"):
        assert a.admit(0, ip, 0.0) is None
    assert len(a) == 3
    assert a.admit(0, "a", 0.0) is None  # "a" was forgotten (least recently seen): a full burst again
    assert a.admit(0, "d", 0.0) == CONNECT_RATE


def test_publish_rate_in_messages_and_bytes():
    """PublishRate: one second's worth of burst, then the wait that brings the balance back to zero; the
    average holds whatever the bursts; 0 = unlimited."""
    from tbmq_connection.limits import PublishRate

    r = PublishRate(messages_per_s=10, bytes_per_s=0)
    assert [r.take(0, 1000) for _ in range(12)] == [0] * 10 + [100, 200]  # bytes do not count
    assert r.take(150, 1) == 150   # 1.5 tokens back, 0.5 - 1 - ... : the debt carried over
    assert r.take(10_000, 1) == 0  # refilled, capped at one second's worth
    assert [r.take(10_000, 1) for _ in range(9)] == [0] * 9 and r.take(10_000, 1) == 100
    b = PublishRate(messages_per_s=0, bytes_per_s=100)
    assert [b.take(0, 40) for _ in range(4)] == [0, 0, 200, 600]  # 20, then 60 bytes owed at 100 a second
    both = PublishRate(messages_per_s=1000, bytes_per_s=100)
    assert both.take(0, 300) == 2000  # the slower of the two decides
    assert not PublishRate(0, 0) and PublishRate(1, 0)
