"""Run a service: settings → logging → telemetry → health endpoint → start → serve → graceful stop.

A service subclasses `Service`: `start()` rebuilds its state and begins serving (the health endpoint
reports ready once it returns), `stop()` stops accepting, finishes in-flight work, flushes producers and
commits what is done. Background loops are started with `spawn()`; if one dies, the service stops with
exit code 1 rather than limping on.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from .health import HealthServer
from .kafka import configure_security
from .logs import configure_logging
from .metrics import Metrics
from .settings import CommonSettings
from .telemetry import configure_telemetry

log = logging.getLogger(__name__)


class Service:
    name = "tbmq"

    def __init__(self, settings: CommonSettings):
        self.settings = settings
        self._tasks: set[asyncio.Task] = set()
        self._failed: asyncio.Future | None = None
        self.metrics = Metrics()  # GET /metrics on the health port: sources registered in start()

    # -- to override -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Rebuild state and begin serving."""

    async def stop(self) -> None:
        """Stop gracefully."""

    def health_details(self) -> dict:
        return {}

    def readiness_checks(self) -> dict:
        """{name: callable returning None or why the service is not ready now} (HealthServer.check): the
        background loops whose death or stall must take the service out of readiness. Asked once, after
        start(); the spawned tasks are covered already (one that dies stops the service)."""
        return {}

    # -- supervision ------------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task %s failed", task.get_name(), exc_info=exc)
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(exc)

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def failed(self) -> asyncio.Future:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return self._failed


async def serve(service: Service, settings: CommonSettings, *, install_signals: bool = True,
                stop: asyncio.Event | None = None) -> int:
    """Run `service` until SIGINT/SIGTERM or `stop` is set (or a background task fails). Returns the exit code.

    A stop that comes while `start()` still runs (e.g. it keeps retrying an unreachable Kafka) cancels the
    start-up: the service stops within `stop()`'s bound (exit code 0: the stop was asked for), rather than
    ignoring the signal and living on without its parent (a launcher's death signal is a SIGTERM)."""
    loop = asyncio.get_running_loop()
    stop = stop if stop is not None else asyncio.Event()
    if install_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    health = HealthServer(settings.health_host, settings.health_port, settings.service_name,
                          service.health_details, service.metrics, instance=settings.instance_id)
    await health.start()
    failed = service.failed()
    stop_wait = loop.create_task(stop.wait())
    code = 0
    try:
        starting = loop.create_task(service.start(), name=f"{settings.service_name} start")
        await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.warning("%s: stop requested while starting; start-up cancelled", settings.service_name)
        else:
            starting.result()  # a start-up that failed raises here
            # what start() built (modules, protobuf descriptors, state rebuilt from Kafka) lives as long as
            # the process: out of the collector's generations, so a full collection walks only what traffic
            # made (a connector's gen-2 pass took ~40 ms before, a pause every connection on it shares)
            gc.collect()
            gc.freeze()
            for name, check in service.readiness_checks().items():
                health.check(name, check)
            health.ready = True
            log.info("%s %s ready", settings.service_name, settings.instance_id)
            await asyncio.wait({stop_wait, failed}, return_when=asyncio.FIRST_COMPLETED)
            if failed.done() and failed.exception() is not None:
                code = 1
    except Exception:
        log.exception("%s failed to start", settings.service_name)
        code = 1
    finally:
        stop_wait.cancel()
        health.ready = False
        log.info("%s stopping", settings.service_name)
        try:
            await asyncio.wait_for(service.stop(), 30)
        except Exception:
            log.exception("%s did not stop cleanly", settings.service_name)
            code = code or 1
        await service.cancel_tasks()
        await health.stop()
    log.info("%s stopped", settings.service_name)
    return code


def run(settings: CommonSettings, factory: Callable[[CommonSettings], Service]) -> None:
    """Entry point body of every service's `main()`."""
    configure_logging(settings.service_name, settings.log_format, settings.log_level)
    configure_telemetry(settings.service_name, settings.instance_id, settings.otlp_endpoint)
    configure_security(settings.kafka_security)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # uvloop is optional; the default loop works, slower
        pass
    code = asyncio.run(serve(factory(settings), settings))
    raise SystemExit(code)
