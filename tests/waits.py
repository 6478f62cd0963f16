"""The tests' bounded wait: poll a condition until it holds or a bound passes (never a bare sleep).

`tests/` is on sys.path (tests/conftest.py lives here), so any test or helper imports it as `waits`."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


async def poll(pred: Callable[[], object], timeout: float, step: float = 0.05) -> bool:
    """True once `pred()` (a plain or an async callable) holds; False when `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    while True:
        held = pred()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(step)


async def wait_until(pred: Callable[[], object], timeout: float, what: str = "condition",
                     step: float = 0.05) -> None:
    """`poll()` that fails the test (AssertionError naming `what`) when `pred()` does not hold in time."""
    if not await poll(pred, timeout, step):
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
