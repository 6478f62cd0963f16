"""One request in flight, answering only the calls made before it was sent.

Two rules of the subscription barrier need the same thing: "an answer computed AFTER I asked", shared by
everyone who asked meanwhile, with at most one request on the wire. The router's ListOffsets of the state
topics (`tbmq_platform.compacted.Barrier`) and the connector's subscription marks on tbmq.msg.all
(`tbmq_platform.marks.MarkWriter`) are both an `AfterCall`.

``after()`` is synchronous, so a caller fixes the moment it stands for without yielding: the future it gets
is answered by a request whose coroutine started after the call. The request in flight was sent before the
call, so a call made meanwhile joins the NEXT request, started as soon as the current one ends and shared by
every call made while it waited. One failed request fails the calls it answers; the next call starts a new
one. Under load this is one request per round trip whatever the number of callers; when quiet, a call
starts its request at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class AfterCall(Generic[T]):
    def __init__(self, request: Callable[[], Awaitable[T]]) -> None:
        self._request = request
        self._inflight: asyncio.Future | None = None
        self._next: asyncio.Future | None = None
        self._sent = False  # the in-flight request's coroutine has started
        self.requests = 0  # requests started (for /readyz and the tests)

    def after(self) -> asyncio.Future:
        """A future of the result of a request started after this call."""
        if self._inflight is None:
            fut = self._inflight = asyncio.get_running_loop().create_future()
            self._start(fut)
            return fut
        if not self._sent:  # the request's task has not run yet: it starts after this call too
            return self._inflight
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    async def wait(self) -> T:
        """`after()`, awaited; shielded: a caller that gives up does not cancel the answer others share."""
        return await asyncio.shield(self.after())

    def _start(self, fut: asyncio.Future) -> None:
        self._sent = False
        task = asyncio.get_running_loop().create_task(self._run())
        task.add_done_callback(lambda t: self._answered(fut, t))

    async def _run(self) -> T:
        self._sent = True
        self.requests += 1
        return await self._request()

    def _answered(self, fut: asyncio.Future, task: asyncio.Task) -> None:
        if not fut.done():
            if task.cancelled():
                fut.cancel()
            elif task.exception() is not None:
                fut.set_exception(task.exception())
            else:
                fut.set_result(task.result())
            if not fut.cancelled():
                fut.exception()  # marked retrieved: a caller that dropped its future logs nothing
        self._inflight, nxt, self._next = None, self._next, None
        if nxt is not None:
            self._inflight = nxt
            self._start(nxt)
