"""Limits of a connector that one client cannot push it past (pure; the time is passed in).

`topic_problem` bounds topic names and filters (bytes and levels: a 64 KiB topic of 32k levels would cost
megabytes in every connector's retained and subscription tables).

Admission limits, decided before a connection costs anything:

`Admission.admit(open_connections, ip, now)` says whether a new TCP connection may go on to CONNECT, or why
not: the connector holds at most `max_connections` connections, and one IP address may open at most
`rate_per_ip` per second after a burst of `burst_per_ip` (a token bucket per address). The buckets are kept
for at most `max_addresses` addresses (least recently seen forgotten first), so a flood from many addresses
costs bounded memory; a forgotten address starts again with a full burst.
"""

from __future__ import annotations

from collections import OrderedDict

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
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[ip] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)
        return None if ok else CONNECT_RATE

    def __len__(self) -> int:
        return len(self._buckets)


def topic_problem(topic: str, max_bytes: int, max_levels: int) -> str | None:
    """Why a topic name or filter is over the connector's limits (MQTT_MAX_TOPIC_BYTES / _LEVELS), or None.
    Cheap on the common path: the UTF-8 length is only computed for a topic that could exceed it."""
    if topic.count("/") >= max_levels:
        return f"more than {max_levels} topic levels"
    if len(topic) * 4 > max_bytes and len(topic.encode("utf-8")) > max_bytes:
        return f"longer than {max_bytes} bytes"
    return None


__all__ = ["Admission", "CONNECT_RATE", "TOO_MANY_CONNECTIONS", "topic_problem"]
