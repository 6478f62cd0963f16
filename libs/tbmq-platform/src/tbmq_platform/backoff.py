"""Retry back-off: the one rule of the services' retry loops towards a peer service (gRPC streams and calls)
and the gRPC channel options that go with it.

A `Backoff` grows from `initial_s`, doubling, up to `max_s`, and is reset by a success. Towards the peers on
the message path (device-persistence) the cap is short (PEER_RETRY_MAX_S, 1 s): under `make run` or any
supervisor a crashed peer is ready again within a few seconds, and a retry sleeping several seconds after it
came back is most of the stall a crash costs. (`make bench` faults measured 12.6 s of stalled deliveries
after a device-persistence SIGKILL when these loops backed off to 5 s.) One retry a second per connection
towards a peer that is down is cheap; a peer that stays down is reported by its own readiness, not by
these loops giving up.

gRPC channels have their own reconnect back-off (by default 1 s growing to 120 s): while a channel waits in
it, every call fails at once with UNAVAILABLE however soon the loop retries, so PEER_CHANNEL_OPTIONS caps it
the same way.

A retry loop around a grpc.aio call must also be stoppable: `end_attempt` and `retry_after` are the two steps
every such loop takes between attempts (see `retry_after` for the cancellation grpc.aio can swallow).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

PEER_RETRY_INITIAL_S = 0.1
PEER_RETRY_MAX_S = 1.0

PEER_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", int(PEER_RETRY_INITIAL_S * 1000)),
    ("grpc.min_reconnect_backoff_ms", int(PEER_RETRY_INITIAL_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(PEER_RETRY_MAX_S * 1000)),
)


@dataclass(slots=True)
class Backoff:
    """Exponential back-off: next() gives initial_s, then doubles up to max_s; reset() after a success."""

    initial_s: float = PEER_RETRY_INITIAL_S
    max_s: float = PEER_RETRY_MAX_S
    current: float = 0.0  # the last delay given; 0 = none since the last success

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"back-off needs 0 < initial ({self.initial_s}) <= max ({self.max_s})")

    def next(self) -> float:
        """The delay before the next attempt."""
        self.current = self.initial_s if self.current <= 0 else min(self.current * 2, self.max_s)
        return self.current

    def reset(self) -> None:
        self.current = 0.0

    @property
    def active(self) -> bool:
        """Whether the last attempt failed (a delay was given since the last success)."""
        return self.current > 0


async def end_attempt(call, writer: asyncio.Task) -> None:
    """Ends one attempt of a bidi stream driven by a writer task: the call and the writer are cancelled and
    the writer awaited, shielded (a second cancellation of the loop must not leave the writer un-awaited), so
    nothing of the attempt outlives it."""
    call.cancel()
    writer.cancel()
    await asyncio.shield(asyncio.gather(writer, return_exceptions=True))


async def retry_after(delay: float) -> None:
    """The pause before a retry loop's next attempt, unless the loop's task was asked to stop.

    grpc.aio can swallow a cancellation: one that lands while the task awaits a call's preparation (the
    stream's `_prepare_rpc`, a unary call's `_invoke`, in grpc/aio/_call.py) is caught there, and the call
    then ends with its own status, UNAVAILABLE from a peer that is down. The loop takes that for a failed
    attempt, and without this check retries forever while `stop()` waits for it. `Task.cancelling()` still
    counts the request, so it is raised here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    await asyncio.sleep(delay)
