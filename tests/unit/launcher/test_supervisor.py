"""The launcher's supervision (tbmq_launcher.supervisor): back-off, reset after a stable run, crash loops,
and the supervisor restarting what dies but not what was stopped on purpose. Fake units, an injected clock
and an injected back-off sleep: no processes, no waiting on time."""

from __future__ import annotations

import asyncio
import logging

from tbmq_launcher.supervisor import RestartHistory, RestartPolicy, Supervisor, Unit
from waits import wait_until

POLICY = RestartPolicy(initial_s=0.5, factor=2.0, max_s=4.0, stable_s=60.0, loop_exits=3, loop_window_s=120.0)


def test_back_off_doubles_up_to_the_maximum():
    h = RestartHistory(POLICY)
    started = 0.0
    delays = []
    for n in range(6):
        now = started + 1.0  # each run lasts 1 s: never stable
        d = h.exited(started, now)
        delays.append(d.delay_s)
        started = now + d.delay_s
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert h.restarts == 6


def test_a_stable_run_resets_the_back_off():
    h = RestartHistory(POLICY)
    assert h.exited(0.0, 1.0).delay_s == 0.5
    assert h.exited(1.5, 2.0).delay_s == 1.0
    d = h.exited(3.0, 3.0 + 60.0)  # ran stable_s
    assert d.delay_s == 0.5 and d.restarts == 3


def test_crash_loop_is_loop_exits_within_the_window():
    h = RestartHistory(POLICY)
    assert not h.exited(0.0, 1.0).crash_loop
    assert not h.exited(1.0, 2.0).crash_loop
    d = h.exited(2.0, 3.0)
    assert d.crash_loop and d.recent_exits == 3
    # exits older than the window no longer count
    d = h.exited(200.0, 201.0)
    assert not d.crash_loop and d.recent_exits == 1


class FakeProcess:
    """A process that 'runs' until `die()`; `fail_starts` start attempts fail first."""

    def __init__(self, name: str, fail_starts: int = 0) -> None:
        self.name = name
        self.running = True
        self.wanted = True
        self.starts = 0
        self.fail_starts = fail_starts
        self.t = 0.0

    def die(self) -> None:
        self.running = False

    async def restart(self) -> None:
        self.starts += 1
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError(f"{self.name} not ready\nlong log tail")
        self.running = True

    def unit(self) -> Unit:
        return Unit(self.name, lambda: self.running, lambda: self.wanted, self.restart, lambda: self.t,
                    lambda: "line 1\nline 2", lambda: -9)


async def supervised(*procs: FakeProcess):
    lines: list[tuple[int, str]] = []
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    sup = Supervisor([p.unit() for p in procs], POLICY, tick_s=0.001,
                     report=lambda level, msg: lines.append((level, msg)), clock=lambda: 10.0, sleep=fake_sleep)
    sup.start()
    return sup, lines, slept


async def test_a_dead_process_is_restarted_and_reported():
    a, b = FakeProcess("router-1"), FakeProcess("connector-1")
    sup, lines, slept = await supervised(a, b)
    try:
        a.die()
        await wait_until(lambda: a.running and sup.restarts("router-1") == 1, 5, "router-1 restarted")
        assert b.starts == 0 and sup.restarts("connector-1") == 0
        assert slept == [0.5]
        assert "router-1 exited with code -9; restart 1 in 0.5s" in lines[0][1] and "line 2" in lines[0][1]
        assert lines[-1] == (logging.WARNING, "router-1 restarted (restart 1)")
    finally:
        await sup.stop()


async def test_failed_starts_back_off_then_report_a_crash_loop_and_keep_trying():
    a = FakeProcess("router-1", fail_starts=3)
    sup, lines, slept = await supervised(a)
    try:
        a.die()
        await wait_until(lambda: a.running, 5, "router-1 up again")
        assert a.starts == 4
        assert slept == [0.5, 1.0, 2.0, 4.0]
        assert [lvl for lvl, m in lines if "crash loop" in m] == [logging.ERROR, logging.ERROR]
        assert any(m == "router-1: restart 1 failed: router-1 not ready" for _, m in lines)
        assert not any("long log tail" in m for _, m in lines if "failed" in m)
    finally:
        await sup.stop()


async def test_a_process_stopped_on_purpose_is_not_restarted():
    a, marker = FakeProcess("router-1"), FakeProcess("marker")
    sup, lines, slept = await supervised(a, marker)
    try:
        a.wanted = False  # Suite.stop_service
        a.die()
        marker.die()  # restarted by the same supervisor loop: by then router-1 was looked at too
        await wait_until(lambda: marker.running, 5, "marker restarted")
        await asyncio.sleep(0)
        assert not a.running and a.starts == 0 and sup.restarts("router-1") == 0
    finally:
        await sup.stop()
