"""A tiny HTTP health endpoint per service: GET /healthz (alive) and GET /readyz (state rebuilt, serving).

Plain asyncio so that it adds nothing to a service's dependencies; the launcher, compose healthchecks and
Kubernetes probes use it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class HealthServer:
    def __init__(self, host: str, port: int, service: str, details: Callable[[], dict] | None = None):
        self.host, self.port, self.service = host, port, service
        self.ready = False
        self.details = details or (lambda: {})
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health endpoint on http://%s:%d/readyz", self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            if path.startswith("/readyz"):
                ok = self.ready
            elif path.startswith("/healthz"):
                ok = True
            else:
                return await self._reply(writer, 404, {"error": "not found"})
            body = {"service": self.service, "ready": self.ready}
            try:
                body.update(self.details())
            except Exception:  # details are best effort; health must answer
                log.exception("health details failed")
            await self._reply(writer, 200 if ok else 503, body)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
