"""`tbmq_platform.lifecycle.serve`: a stop asked for while `start()` still runs (a start-up that keeps
retrying an unreachable Kafka) cancels the start-up and stops the service; it used to be ignored until
start() returned, so a service whose launcher died (its death signal is a SIGTERM) lived on, orphaned."""

from __future__ import annotations

import asyncio

import pytest
from tbmq_platform.lifecycle import Service, serve
from tbmq_platform.settings import CommonSettings

pytestmark = pytest.mark.unit


class Recorder(Service):
    """A service whose start() waits on `release` (never set unless the test sets it)."""

    def __init__(self) -> None:
        super().__init__(CommonSettings(service_name="svc"))
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.start_cancelled = False
        self.stopped = False

    async def start(self) -> None:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.start_cancelled = True
            raise

    async def stop(self) -> None:
        self.stopped = True


async def test_a_stop_while_starting_cancels_the_start_up_and_stops():
    svc = Recorder()
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(svc, svc.settings, install_signals=False, stop=stop))
    await asyncio.wait_for(svc.entered.wait(), 10)
    stop.set()
    code = await asyncio.wait_for(serving, 10)
    assert (code, svc.start_cancelled, svc.stopped) == (0, True, True)


async def test_a_started_service_runs_until_stop():
    svc = Recorder()
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(svc, svc.settings, install_signals=False, stop=stop))
    await asyncio.wait_for(svc.entered.wait(), 10)
    svc.release.set()
    await asyncio.sleep(0)  # let serve() see the start-up done (not a wait for time: one loop turn)
    assert not serving.done() and not svc.stopped
    stop.set()
    code = await asyncio.wait_for(serving, 10)
    assert (code, svc.start_cancelled, svc.stopped) == (0, False, True)


async def test_a_start_up_that_fails_exits_1_after_stop():
    svc = Recorder()

    async def broken() -> None:
        raise RuntimeError("no Kafka")

    svc.start = broken
    code = await asyncio.wait_for(serve(svc, svc.settings, install_signals=False, stop=asyncio.Event()), 10)
    assert (code, svc.stopped) == (1, True)
