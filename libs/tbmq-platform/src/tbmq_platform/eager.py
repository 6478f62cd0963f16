"""A coroutine run at once, in the caller's stack, up to its first suspension: a task only when it must wait.

asyncio runs every coroutine on a task: the task object, a scheduled first step and a turn of the loop before
its first line runs, and its end to finish. Some coroutines on the message path almost never wait: the
connector's hand-over of a PUBLISH to the producer (`aiokafka.AIOKafkaProducer.send` appends the record to the
partition's open batch and returns its future; it waits only for metadata it does not have yet or for room in
a full batch). Python 3.12's eager task factory does this for every task of a loop; this is the same thing for
one call, on 3.11 and without changing how the loop's other tasks start.

``start(coro)`` runs ``coro`` until it returns or first suspends:

* it returned: ``start`` returns its result (the same value ``await coro`` would have given, at the same
  moment, without a task);
* it raised: the exception propagates from ``start``, as from ``await coro``;
* it suspended (it awaits a future that is not done): ``start`` returns a ``Suspended``, the rest of the
  coroutine. Awaiting it (once, from a task) resumes the coroutine exactly where it stopped, as ``await coro``
  would have: the same future is waited on, and a cancellation of the awaiting task is thrown into it.

Whoever gets a ``Suspended`` must await it or ``close()`` it; the effects the coroutine had before its
suspension (aiokafka's: none but registering its wait) stay done.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any


class Suspended:
    """The rest of a coroutine that `start` ran up to its first suspension; await it once."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine, yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded  # what the coroutine yielded to the event loop (the future it waits on)

    def __await__(self) -> Generator[Any, Any, Any]:
        return _resume(self._coro, self._yielded)

    def close(self) -> None:
        """The rest will not be awaited: the coroutine is closed (its `finally` blocks run)."""
        self._coro.close()

    def __repr__(self) -> str:
        return f"<Suspended {self._coro!r} on {self._yielded!r}>"


def start(coro: Coroutine) -> Any:
    """Run `coro` now: its result, its exception, or a `Suspended` when it waits for something first."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return stop.value
    return Suspended(coro, yielded)


def _resume(coro: Coroutine, yielded: Any) -> Generator[Any, Any, Any]:
    """`yield from coro`, entered after the coroutine's first yield (`yielded`), with what the task sends or
    throws passed on to it."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancellation (or another exception thrown by the task) goes in
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value
