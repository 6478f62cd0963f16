"""The tests' bounded waits: poll a condition until it holds or a bound passes (never a bare sleep).

`tests/` is on sys.path (tests/conftest.py lives here), so any test or helper imports it as `waits`.

* `poll` / `wait_until`: wait for something that must happen (plain or async predicate).
* `quiet_for`: the one allowed pause, for a negative check ("nothing arrives") that has no later marker to
  wait for instead. Prefer the marker: make something happen that must come after the thing that must not
  (a second message on the same path, the system's own acknowledgement), wait for it, then assert.
* `asyncio.sleep(0)` (yield to the loop) and pacing inside load generators are not waits and stay as they are.

See docs/testing.md ("Writing tests")."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


async def poll(pred: Callable[[], object], timeout: float, step: float = 0.05) -> object:
    """The first truthy value of `pred()` (a plain or an async callable); False when `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    while True:
        held = pred()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return held
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(step)


async def wait_until(pred: Callable[[], object], timeout: float, what: str | Callable[[], str] = "condition",
                     step: float = 0.05) -> object:
    """`poll()` that fails the test (AssertionError naming `what`, a string or a callable giving one at the
    failure) when `pred()` does not hold in time; returns the truthy value that held."""
    held = await poll(pred, timeout, step)
    if not held:
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}")
    return held


async def quiet_for(seconds: float, happened: Callable[[], object], what: str, step: float = 0.05) -> None:
    """The only allowed pause: fails the test (naming `what`) as soon as `happened()` holds within `seconds`.

    For a negative check that no later marker can close (e.g. "the server sends nothing more while the
    client's window is full"); it can miss a late event, so it is the last resort, never a synchronisation."""
    if await poll(happened, seconds, step):
        raise AssertionError(f"{what} within {seconds:g}s")
