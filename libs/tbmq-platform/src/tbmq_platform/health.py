"""A tiny HTTP health endpoint per service: GET /healthz (alive) and GET /readyz (state rebuilt, serving).

GET /metrics: Prometheus text (tbmq_platform.metrics) when the service gave its Metrics.

/readyz is 200 only while the service says it is ready AND every registered check passes: a check is a
callable returning None (fine) or why not (a stopped background loop, a follower that cannot fetch), so
readiness follows the service's loops for as long as it runs instead of being set once at start-up. The
failing checks are listed in the body (`"not_ready": {name: reason}`).

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
    def __init__(self, host: str, port: int, service: str, details: Callable[[], dict] | None = None,
                 metrics=None, instance: str = ""):
        self.host, self.port, self.service = host, port, service
        self.instance = instance  # TBMQ_SERVICE_ID, in every answer (the admin service lists instances by it)
        self.metrics = metrics  # tbmq_platform.metrics.Metrics: GET /metrics
        self.ready = False
        self.details = details or (lambda: {})
        self.checks: dict[str, Callable[[], str | None]] = {}
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health endpoint on http://%s:%d/readyz", self.host, self.port)

    def check(self, name: str, problem: Callable[[], str | None]) -> None:
        """Make readiness also depend on `problem()` returning None."""
        self.checks[name] = problem

    def problems(self) -> dict[str, str]:
        out = {}
        for name, problem in self.checks.items():
            try:
                p = problem()
            except Exception as e:  # a check that fails is a problem, not a crash of the endpoint
                p = f"check failed: {e!r}"
            if p:
                out[name] = p
        return out

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
            if path.startswith("/metrics") and self.metrics is not None:
                from .metrics import CONTENT_TYPE

                return await self._send(writer, 200, "OK", CONTENT_TYPE, await self.metrics.exposition())
            problems = self.problems()
            if path.startswith("/readyz"):
                ok = self.ready and not problems
            elif path.startswith("/healthz"):
                ok = True
            else:
                return await self._reply(writer, 404, {"error": "not found"})
            body = {"service": self.service, "ready": self.ready and not problems}
            if self.instance:
                body["instance"] = self.instance
            if problems:
                body["not_ready"] = problems
            try:
                body.update(self.details())
            except Exception:  # details are best effort; health must answer
                log.exception("health details failed")
            await self._reply(writer, 200 if ok else 503, body)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    @classmethod
    async def _reply(cls, writer: asyncio.StreamWriter, status: int, body: dict) -> None:
        reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
        await cls._send(writer, status, reason, "application/json", json.dumps(body).encode())

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, reason: str, ctype: str, data: bytes) -> None:
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
