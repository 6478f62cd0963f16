"""Supervision of the suite's processes: a process that exits without being asked to is started again, with
exponential back-off, and a crash loop is reported instead of hidden.

Guarantee: while the suite runs (`Suite(supervise=True)`, what `make run` uses), every process the suite
started — each service instance, the Spark job, Kafka, each Redis server — is either running, being
started again after its back-off, or was stopped on purpose (`Suite.stop_service`, `Suite.stop`). Nothing
stays dead silently: every exit is logged with its code and the last lines of its log, every restart with
its count, and a process that keeps failing is reported as crash-looping (and still retried, at the
longest back-off) rather than given up on, so a Kafka or Redis outage heals by itself once it is over.

`RestartPolicy` + `RestartHistory` are the pure part (no asyncio, the time is passed in); `Supervisor` polls
the processes and applies them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("tbmq_launcher")


@dataclass(frozen=True)
class RestartPolicy:
    """initial_s, doubled (`factor`) after each exit up to max_s; a run of stable_s resets it. loop_exits
    exits within loop_window_s make a crash loop."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    stable_s: float = 60.0
    loop_exits: int = 5
    loop_window_s: float = 120.0


@dataclass(frozen=True)
class Decision:
    delay_s: float       # wait this long, then start the process again
    restarts: int        # restarts so far, this one included
    crash_loop: bool     # loop_exits exits within loop_window_s
    recent_exits: int    # exits within loop_window_s, this one included


@dataclass
class RestartHistory:
    """The exits of one process and what to do after the next one."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restarts: int = 0
    streak: int = 0                       # exits since the last stable run
    exits: list[float] = field(default_factory=list)

    def exited(self, started_at: float | None, now: float) -> Decision:
        """The process started (its last start attempt) at `started_at` exited at `now`."""
        p = self.policy
        if started_at is not None and now - started_at >= p.stable_s:
            self.streak = 0
        delay = min(p.max_s, p.initial_s * p.factor ** self.streak)
        self.streak += 1
        self.restarts += 1
        self.exits = [t for t in self.exits if now - t < p.loop_window_s] + [now]
        return Decision(delay, self.restarts, len(self.exits) >= p.loop_exits, len(self.exits))


@dataclass
class Unit:
    """One supervised process: `alive()` says whether it runs, `wanted()` whether it should (started and not
    stopped on purpose), `restart()` starts it again (raising when it does not come up), `started_at()` the
    monotonic time of its last start attempt, `log_tail()` the end of its log."""

    name: str
    alive: Callable[[], bool]
    wanted: Callable[[], bool]
    restart: Callable[[], Awaitable[None]]
    started_at: Callable[[], float | None]
    log_tail: Callable[[], str]
    exit_code: Callable[[], int | None] = lambda: None
    history: RestartHistory = field(default_factory=RestartHistory)


class Supervisor:
    """Polls its units every `tick_s` and starts again, after the back-off of its policy, each one that is
    wanted but not alive. `report` gets one line per event (default: the launcher's log)."""

    def __init__(self, units: list[Unit], policy: RestartPolicy | None = None, *, tick_s: float = 0.25,
                 report: Callable[[int, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.policy = policy or RestartPolicy()
        self.units = units
        for u in units:
            u.history = RestartHistory(self.policy)
        self.tick_s = tick_s
        self.report = report or (lambda level, msg: log.log(level, "%s", msg))
        self.clock = clock
        self.sleep = sleep  # the back-off's (tests inject one)
        self._restarting: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def restarts(self, name: str) -> int:
        return next((u.history.restarts for u in self.units if u.name == name), 0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="supervisor")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._restarting.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._task = None
        self._restarting.clear()

    def cancel_restart(self, name: str) -> None:
        """A caller stops `name` on purpose: a pending restart of it is dropped."""
        t = self._restarting.pop(name, None)
        if t is not None:
            t.cancel()

    async def _run(self) -> None:
        while True:
            for u in self.units:
                if u.name not in self._restarting and u.wanted() and not u.alive():
                    self._restarting[u.name] = asyncio.create_task(self._recover(u), name=f"restart:{u.name}")
            await asyncio.sleep(self.tick_s)  # the poll period (a tick, not a back-off)

    async def _recover(self, u: Unit) -> None:
        first = True
        try:
            while True:
                d = u.history.exited(u.started_at(), self.clock())
                tail = "\n".join(u.log_tail().splitlines()[-10:])
                what = f"{u.name} exited with code {u.exit_code()}" if first else f"{u.name} is still down"
                first = False
                if d.crash_loop:
                    self.report(logging.ERROR,
                                f"{what}: crash loop, {d.recent_exits} exits within "
                                f"{self.policy.loop_window_s:.0f}s; restart {d.restarts} in {d.delay_s:.1f}s; "
                                f"last lines of its log:\n{tail}")
                else:
                    self.report(logging.WARNING,
                                f"{what}; restart {d.restarts} in {d.delay_s:.1f}s; last lines of "
                                f"its log:\n{tail}")
                await self.sleep(d.delay_s)  # the back-off
                try:
                    await u.restart()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self.report(logging.WARNING, f"{u.name}: restart {d.restarts} failed: {str(e).splitlines()[0]}")
                    continue
                self.report(logging.WARNING, f"{u.name} restarted (restart {d.restarts})")
                return
        finally:
            if self._restarting.get(u.name) is asyncio.current_task():
                del self._restarting[u.name]


__all__ = ["Decision", "RestartHistory", "RestartPolicy", "Supervisor", "Unit"]
