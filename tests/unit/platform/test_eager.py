"""tbmq_platform.eager: a coroutine run up to its first suspension without a task, its rest awaited as if the
coroutine had been awaited from the start."""

from __future__ import annotations

import asyncio

import pytest
from tbmq_platform import eager

pytestmark = pytest.mark.unit


async def test_a_coroutine_that_never_waits_finishes_in_the_call_and_gives_its_result():
    ran = []

    async def inner():
        ran.append("inner")
        return 7

    async def outer():
        ran.append("outer")
        return await inner() + 1  # an await that does not suspend

    tasks = asyncio.all_tasks()  # the session's loop may hold other tests' tasks
    assert eager.start(outer()) == 8
    assert ran == ["outer", "inner"]
    assert asyncio.all_tasks() == tasks  # no task was made for it


async def test_an_exception_before_any_wait_is_raised_by_start():
    async def refuse():
        raise KeyError("full")

    with pytest.raises(KeyError, match="full"):
        eager.start(refuse())


async def test_a_coroutine_that_waits_is_resumed_where_it_stopped_by_awaiting_its_rest():
    loop = asyncio.get_running_loop()
    gates = [loop.create_future(), loop.create_future()]
    steps = []

    async def two_waits():
        steps.append("before")
        steps.append(await gates[0])
        steps.append(await gates[1])
        return "done"

    rest = eager.start(two_waits())
    assert isinstance(rest, eager.Suspended) and steps == ["before"]
    task = loop.create_task(_await(rest))
    await asyncio.sleep(0)  # yield to the loop: the task now waits on the first gate
    assert not task.done()
    gates[0].set_result("first")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert steps == ["before", "first"] and not task.done()
    gates[1].set_result("second")
    assert await task == "done"
    assert steps == ["before", "first", "second"]


async def test_an_exception_after_the_wait_reaches_the_awaiting_task():
    gate = asyncio.get_running_loop().create_future()

    async def fails_later():
        await gate
        raise ValueError("refused after waiting")

    rest = eager.start(fails_later())
    gate.set_result(None)
    with pytest.raises(ValueError, match="refused after waiting"):
        await rest


async def test_cancelling_the_awaiting_task_cancels_the_coroutine_inside_its_wait():
    loop = asyncio.get_running_loop()
    gate = loop.create_future()
    seen = []

    async def waits():
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled inside")
            raise
        finally:
            seen.append("finally")

    rest = eager.start(waits())
    task = loop.create_task(_await(rest))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled inside", "finally"]
    assert gate.cancelled()  # the inner await of the future cancelled it, as with `await coro`


async def test_a_coroutine_may_catch_what_is_thrown_in_and_go_on():
    loop = asyncio.get_running_loop()
    gate, again = loop.create_future(), loop.create_future()

    async def retries():
        try:
            await gate
        except asyncio.CancelledError:
            pass
        return await again

    rest = eager.start(retries())
    task = loop.create_task(_await(rest))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not task.done()
    again.set_result("went on")
    assert await task == "went on"


async def test_closing_an_unawaited_rest_runs_the_coroutines_finally():
    gate = asyncio.get_running_loop().create_future()
    seen = []

    async def waits():
        try:
            await gate
        finally:
            seen.append("finally")

    rest = eager.start(waits())
    rest.close()
    assert seen == ["finally"]


async def _await(awaitable):
    return await awaitable
