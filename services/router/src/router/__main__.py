"""Entry point `router`: settings -> logging/telemetry -> Faust worker (RouterRuntime first, then the app).

The Faust worker is started programmatically (not through the `faust` CLI); it handles SIGTERM/SIGINT:
the app stops its consumer, waits until every event in flight is acknowledged, commits, flushes the
producer, then the runtime stops the state views and the health endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import faust
import uvloop

from tbmq_platform.kafka import configure_security
from tbmq_platform.logs import configure_logging
from tbmq_device_persistence.settings import DevicePersistenceSettings
from tbmq_platform.settings import load_all_or_exit, load_or_exit
from tbmq_platform.telemetry import configure_telemetry

from .app import RouterRuntime, create_app
from .settings import RouterSettings

log = logging.getLogger("router")

# How long the stopped worker's loop runs on before it is closed, for the last callbacks (the transports'
# connection_lost, the tasks cancelled by the shutdown): mode's Worker sleeps a whole second here
SHUTDOWN_SETTLE_S = 0.05


class RouterWorker(faust.Worker):
    def __init__(self, app, runtime: RouterRuntime, **kw):
        super().__init__(app, runtime, **kw)
        self.runtime = runtime

    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        self.runtime.health.ready = True
        log.info("router %s ready (group %s)", self.runtime.settings.instance_id,
                 self.runtime.settings.group_id)

    async def on_stop(self) -> None:
        self.runtime.health.ready = False
        await super().on_stop()

    async def _sentinel_task(self) -> None:
        """The last task mode's Worker._shutdown_loop runs, after the services have stopped and the remaining
        tasks were gathered, before it closes the loop. mode sleeps 1 s in it: every graceful stop of a router
        (a rolling restart's stall of its partitions, a suite's stop) took a second longer than its work.
        Checked to exist at start-up (app.check_faust_internals)."""
        await asyncio.sleep(SHUTDOWN_SETTLE_S)


def main() -> None:
    if os.environ.get("ROUTER_PERSIST_VIA") == "local":  # this process runs device-persistence too: both
        settings, dp_settings = load_all_or_exit((RouterSettings, DevicePersistenceSettings))  # read, one message
    else:
        settings, dp_settings = load_or_exit(RouterSettings), None
    configure_logging(settings.service_name, settings.log_format, settings.log_level)
    configure_telemetry(settings.service_name, settings.instance_id, settings.otlp_endpoint)
    configure_security(settings.kafka_security)  # the router's own aiokafka clients; Faust: create_app
    for noisy in ("faust", "mode", "aiokafka"):
        if settings.log_level in ("INFO", "DEBUG"):
            logging.getLogger(noisy).setLevel(logging.WARNING if settings.log_level == "INFO" else logging.DEBUG)
    os.makedirs(settings.faust_data_dir, exist_ok=True)
    # uvloop for the worker's loop and for the loop of Faust's consumer thread (mode creates it with
    # asyncio.new_event_loop(), i.e. from the installed policy): cheaper I/O and cross-thread wake-ups
    uvloop.install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app, runtime = create_app(settings, device_persistence=dp_settings)
    worker = RouterWorker(app, runtime, loop=loop, loglevel=settings.log_level, override_logging=False,
                          redirect_stdouts=False, quiet=True)
    code = 0
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    code = runtime.exit_code or code
    log.info("router %s stopped (exit %d)", settings.instance_id, code)
    sys.exit(code)


if __name__ == "__main__":
    main()
