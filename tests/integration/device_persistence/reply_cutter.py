"""A TCP proxy in front of a real Redis that can lose one reply, or hold it back: what a client sees when Redis
goes away right after running its command (a restart, a network cut), or answers late. Fault injection only:
every byte it passes is Redis's."""

from __future__ import annotations

import asyncio
import contextlib


class ReplyCutter:
    """Passes every connection through to ``host:port``. After ``arm(*markers)``, the first request that holds
    every marker is passed on (Redis runs it), then the reply it gets is dropped and both sides of that
    connection are closed; ``cut`` is set. With ``arm(*markers, hold=True)`` the reply is held instead:
    ``held`` is set once Redis answered, and the reply goes on to the client at ``release()`` (nothing is
    passed to it if it closed its side meanwhile). Everything else, before and after, passes untouched."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, port)
        self.port: int | None = None
        self.cut = asyncio.Event()
        self.held = asyncio.Event()
        self._release = asyncio.Event()
        self._hold = False
        self._markers: tuple[bytes, ...] = ()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"redis://{self.upstream[0]}:{self.port}/0"

    async def start(self) -> ReplyCutter:
        self._server = await asyncio.start_server(self._connection, self.upstream[0], 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def arm(self, *markers: bytes, hold: bool = False) -> None:
        self.cut.clear()
        self.held.clear()
        self._release.clear()
        self._hold = hold
        self._markers = markers

    def release(self) -> None:
        """The held reply goes on to its client."""
        self._release.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        cutting = asyncio.Event()  # this connection's marked request is on its way to Redis
        holding = asyncio.Event()  # ... to be answered late

        async def to_redis() -> None:
            while data := await reader.read(65536):
                if self._markers and all(m in data for m in self._markers):
                    self._markers = ()
                    (holding if self._hold else cutting).set()
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if cutting.is_set():  # Redis ran it: its reply is lost with the connection
                    self.cut.set()
                    return
                if holding.is_set():  # Redis ran it: its reply waits for release()
                    holding.clear()
                    self.held.set()
                    await self._release.wait()
                writer.write(data)
                await writer.drain()

        try:
            parts = [asyncio.ensure_future(to_redis()), asyncio.ensure_future(to_client())]
            await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
            for p in parts:
                p.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._tasks.discard(task)
