"""Limits of a connector that one client cannot push it past (pure; the time is passed in).

`topic_problem` bounds topic names and filters (bytes and levels: a 64 KiB topic of 32k levels would cost
megabytes in every connector's retained and subscription tables).

Admission limits, decided before a connection costs anything:

`Admission.admit(open_connections, ip, now)` says whether a new TCP connection may go on to CONNECT, or why
not: the connector holds at most `max_connections` connections, and one IP address may open at most
`rate_per_ip` per second after a burst of `burst_per_ip` (a token bucket per address). The buckets are kept
for at most `max_addresses` addresses (least recently seen forgotten first), so a flood from many addresses
costs bounded memory; a forgotten address starts again with a full burst.

Rate limits of a connected client:

`PublishRate(messages_per_s, bytes_per_s).take(now_ms, payload_bytes)` spends the client's PUBLISH budget
(MQTT_MAX_PUBLISH_RATE, MQTT_MAX_PUBLISH_BYTES_RATE: token buckets holding one second's worth) and says how
long the connector must stop reading from it. The balance may go below zero (a packet already read is never
refused), so whatever the bursts, the client's average stays at the rates.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from tbmq_auth.buckets import refilled

TOO_MANY_CONNECTIONS = "max_connections"
CONNECT_RATE = "connect_rate"


class Admission:
    def __init__(self, max_connections: int, rate_per_ip: float, burst_per_ip: int,
                 max_addresses: int = 100_000) -> None:
        self.max_connections = max_connections
        self.rate = rate_per_ip
        self.burst = float(burst_per_ip)
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # ip -> (tokens, at)

    def admit(self, open_connections: int, ip: str, now: float) -> str | None:
        """None to admit (a token of `ip` is spent), else the reason it is refused."""
        if open_connections >= self.max_connections:
            return TOO_MANY_CONNECTIONS
        if self.rate <= 0:
            return None
        tokens, at = self._buckets.pop(ip, (self.burst, now))
        tokens = refilled(tokens, now - at, self.rate, self.burst)
        ok = tokens >= 1.0
        self._buckets[ip] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)
        return None if ok else CONNECT_RATE

    def __len__(self) -> int:
        return len(self._buckets)


class PublishRate:
    """One connection's PUBLISH budget: messages and payload bytes a second (0 = that one unlimited)."""

    __slots__ = ("_buckets", "_at")

    def __init__(self, messages_per_s: float, bytes_per_s: float) -> None:
        # [rate, balance, counts bytes]; a bucket holds one second's worth
        self._buckets = [[float(r), float(r), by_bytes] for r, by_bytes in ((messages_per_s, False),
                                                                           (bytes_per_s, True)) if r > 0]
        self._at: int | None = None

    def __bool__(self) -> bool:
        return bool(self._buckets)

    def take(self, now_ms: int, payload_bytes: int) -> int:
        """Spend one PUBLISH of `payload_bytes`: ms until every balance is back at zero (0: within the rates),
        the time the connection's reading must wait."""
        elapsed = 0.0 if self._at is None else max(0, now_ms - self._at) / 1000
        self._at = now_ms
        wait = 0.0
        for b in self._buckets:
            rate = b[0]
            b[1] = refilled(b[1], elapsed, rate, rate) - (payload_bytes if b[2] else 1)
            if b[1] < 0:
                wait = max(wait, -b[1] / rate)
        return math.ceil(wait * 1000)


def topic_problem(topic: str, max_bytes: int, max_levels: int) -> str | None:
    """Why a topic name or filter is over the connector's limits (MQTT_MAX_TOPIC_BYTES / _LEVELS), or None.
    Cheap on the common path: the UTF-8 length is only computed for a topic that could exceed it."""
    if topic.count("/") >= max_levels:
        return f"more than {max_levels} topic levels"
    if len(topic) * 4 > max_bytes and len(topic.encode("utf-8")) > max_bytes:
        return f"longer than {max_bytes} bytes"
    return None


__all__ = ["Admission", "CONNECT_RATE", "PublishRate", "TOO_MANY_CONNECTIONS", "topic_problem"]
