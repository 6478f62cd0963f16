"""Message expiry: THE rule every service applies to an MQTT 5 Message Expiry Interval. Pure, no I/O.

A message carries the interval as received (seconds) and ``created_at_ms``, the time the connector accepted
it. At ``now_ms`` (any service's clock):

* waited = now_ms - created_at_ms, never negative (a clock behind the connector's does not lengthen the
  life); an unknown creation time (``created_at_ms <= 0``) counts as not waited — the caller may pass a
  better one (app-delivery: the Kafka record's timestamp);
* left_ms = interval * 1000 - waited; the message has EXPIRED when left_ms <= 0, i.e. once the whole
  interval has passed [MQTT-3.3.2-5]: a 1 s message is alive at 999 ms and expired at 1000 ms;
* the interval forwarded to a subscriber is the received value minus the time waited [MQTT-3.3.2-6] in
  whole seconds, left_ms rounded UP (1 ms to 1000 ms left -> 1 s). Rounding down would forward 0 (or drop)
  a message that still has up to a second to live: a 1 s message could never be forwarded after any wait.
  So a live message is always forwarded with at least 1 and never with more than a second above the truth;
* a store (device-persistence's Redis) keeps the message for exactly left_ms (``store_ttl_ms``); the
  store's TTL and ``expired`` agree to the millisecond.

Used by the connector (outbound PUBLISH), the router (drops before routing), device-persistence (TTL) and
app-delivery (drops before streaming). docs/architecture.md, "Message expiry".
"""

from __future__ import annotations

__all__ = ["left_ms", "expired", "forwarded_interval", "store_ttl_ms", "deadline_ms", "interval_at"]


def left_ms(created_at_ms: int, interval_s: int, now_ms: int) -> int:
    """Milliseconds of life left (<= 0: expired)."""
    waited = now_ms - created_at_ms if created_at_ms > 0 else 0
    return interval_s * 1000 - (waited if waited > 0 else 0)


def expired(created_at_ms: int, interval_s: int, now_ms: int) -> bool:
    """True once the whole interval has passed [MQTT-3.3.2-5]."""
    return left_ms(created_at_ms, interval_s, now_ms) <= 0


def forwarded_interval(created_at_ms: int, interval_s: int, now_ms: int) -> int | None:
    """The Message Expiry Interval to forward, whole seconds rounded up (>= 1) [MQTT-3.3.2-6]; None when
    the message has expired and must not be forwarded [MQTT-3.3.2-5]."""
    left = left_ms(created_at_ms, interval_s, now_ms)
    if left <= 0:
        return None
    return -(-left // 1000)


def deadline_ms(created_at_ms: int, interval_s: int, now_ms: int) -> int:
    """The time (ms, on `now_ms`'s clock) at which the message expires: what a holder that sends it later keeps
    (`interval_at`), so the wait in between counts too."""
    return now_ms + left_ms(created_at_ms, interval_s, now_ms)


def interval_at(deadline: int, now_ms: int) -> int | None:
    """`forwarded_interval` from a `deadline_ms`: whole seconds left, rounded up (>= 1) [MQTT-3.3.2-6]; None
    once expired [MQTT-3.3.2-5]."""
    left = deadline - now_ms
    if left <= 0:
        return None
    return -(-left // 1000)


def store_ttl_ms(created_at_ms: int, interval_s: int, now_ms: int) -> int:
    """How long a store keeps the message (ms); <= 0: expired, do not store."""
    return left_ms(created_at_ms, interval_s, now_ms)
