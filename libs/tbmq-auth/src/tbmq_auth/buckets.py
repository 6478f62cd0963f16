"""The token bucket's one refill rule (pure), shared by every limit that counts a budget over time: failed
logins per address (tbmq_auth.failures), connects per address and PUBLISH rates (tbmq_connection.limits)."""

from __future__ import annotations


def refilled(tokens: float, elapsed_s: float, rate: float, burst: float) -> float:
    """A token bucket's balance after `elapsed_s` at `rate` tokens a second, capped at `burst`. A negative
    `elapsed_s` (an event timed before the last one counted: another connector's, read late) refills nothing."""
    return min(burst, tokens + max(0.0, elapsed_s) * rate)


__all__ = ["refilled"]
