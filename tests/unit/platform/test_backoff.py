"""tbmq_platform.backoff: the one back-off rule of the retry loops towards peer services."""

from __future__ import annotations

import asyncio

import pytest
from tbmq_platform.backoff import PEER_CHANNEL_OPTIONS, PEER_RETRY_MAX_S, Backoff, retry_after
from waits import wait_until


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


async def test_retry_after_stops_a_loop_whose_cancellation_was_swallowed():
    """As grpc.aio does when a cancellation lands on a call's preparation: caught there, and the call ends
    with its own status (UNAVAILABLE), which the loop takes for one more failed attempt."""
    attempts = []

    async def loop() -> None:
        while True:
            attempts.append(1)
            try:
                await asyncio.Event().wait()           # the attempt: waits until cancelled
            except asyncio.CancelledError:
                pass                                   # swallowed, as grpc.aio's _prepare_rpc does
            await retry_after(60.0)

    task = asyncio.get_running_loop().create_task(loop())
    await wait_until(lambda: attempts, 5.0, "the first attempt")
    task.cancel()
    await wait_until(task.done, 5.0, "the loop stopped")
    assert task.cancelled() and len(attempts) == 1


async def test_retry_after_pauses_a_loop_that_was_not_stopped():
    loop = asyncio.get_running_loop()
    start = loop.time()
    await retry_after(0.05)
    assert loop.time() - start >= 0.05
