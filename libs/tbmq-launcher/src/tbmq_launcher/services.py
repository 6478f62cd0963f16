"""The suite's services: names, packages, default ports, start order, and how one instance runs.

A `ServiceDef` describes a service; a `ServiceProcess` is one running instance of it (a subprocess in its
own process group whose stdout/stderr go to `<run dir>/<service id>.log` and optionally to the console
with a `[service-id]` prefix, and whose readiness is `GET http://127.0.0.1:<HEALTH_PORT>/readyz` = 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tbmq_platform import settings as platform_settings
from tbmq_platform.settings import APP_DELIVERY_GRPC_PORT, DEVICE_PERSISTENCE_GRPC_PORT

from .process import death_signal_preexec, kill_group, tail


@dataclass(frozen=True)
class ServiceDef:
    """How to run one service of the suite.

    `command` overrides the default `<venv>/bin/<name>` (or `python -m <package>`); tests use it to run
    fake services. `health_port`, `grpc_port` and the MQTT listener ports (`mqtt_port` TCP, `tls_port`,
    `ws_port`, `wss_port`) are the defaults of instance 1 (docs/architecture.md); instance i > 1 uses
    health/gRPC port + 100*(i-1), MQTT and TLS port + (i-1), and WS/WSS port + 100*(i-1) (WS 8083 + 1 would be
    WSS 8084).
    """

    name: str
    package: str
    health_port: int
    grpc_port: int | None = None
    mqtt_port: int | None = None
    tls_port: int | None = None
    ws_port: int | None = None
    wss_port: int | None = None
    grpc_port_env: str | None = None  # the variable the service reads its gRPC listen port from
    http_port: int | None = None  # an HTTP listener besides the health port (admin: the API and web UI)
    http_port_env: str | None = None  # the variable the service reads it from
    grpc_callers: tuple[str, ...] = ()  # the services that call its gRPC surface (GRPC_TLS_PEER_NAMES)
    # the consumer groups it joins as a static member (TBMQ_KAFKA_STATIC_MEMBERSHIP): (the variable naming the
    # group, the service's default for it); Suite.stop takes its stopped instances out of them
    static_groups: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        if self.command:
            return list(self.command)
        script = Path(sys.executable).parent / self.name
        if script.exists():
            return [str(script)]
        return [sys.executable, "-m", self.package]


DEVICE_PERSISTENCE_GROUP = ("DEVICE_PERSISTENCE_GROUP_ID", platform_settings.DEVICE_PERSISTENCE_GROUP)

SERVICES: dict[str, ServiceDef] = {
    s.name: s
    for s in (
        ServiceDef("session-registry", "session_registry", health_port=8086,
                   static_groups=(("TBMQ_SESSION_REGISTRY_GROUP_ID", platform_settings.SESSION_REGISTRY_GROUP),)),
        ServiceDef("device-persistence", "device_persistence", health_port=8087, grpc_port=DEVICE_PERSISTENCE_GRPC_PORT,
                   grpc_port_env="DEVICE_PERSISTENCE_GRPC_PORT",
                   grpc_callers=("connector", "router", "session-registry"), static_groups=(DEVICE_PERSISTENCE_GROUP,)),
        ServiceDef("app-delivery", "app_delivery", health_port=8085, grpc_port=APP_DELIVERY_GRPC_PORT,
                   grpc_port_env="APP_DELIVERY_GRPC_PORT", grpc_callers=("connector",)),
        ServiceDef("router", "router", health_port=8082,
                   static_groups=(("ROUTER_GROUP_ID", platform_settings.ROUTER_GROUP),)),
        ServiceDef("connector", "connector", health_port=8081, mqtt_port=1883, tls_port=8883, ws_port=8083,
                   wss_port=8084),
        ServiceDef("admin", "admin", health_port=8088, http_port=8080, http_port_env="ADMIN_HTTP_PORT"),
    )
}

# Start order, in tiers: the session authority, the stores and the router first, then the MQTT front door and
# the admin API and web UI over all of them, so that a client reaching a connector finds every service behind
# it ready. The instances of one tier start together (none waits for another's readiness: each retries its
# peers), the tiers one after the other.
START_TIERS: tuple[tuple[str, ...], ...] = (("session-registry", "device-persistence", "app-delivery", "router"),
                                            ("connector", "admin"))
ORDER: tuple[str, ...] = tuple(n for tier in START_TIERS for n in tier)


class ServiceStartError(RuntimeError):
    pass


_COLORS = ("36", "35", "33", "32", "34", "96", "95", "93", "92", "94")


class ServiceProcess:
    """One instance of a service."""

    def __init__(
        self,
        sdef: ServiceDef,
        instance: int,
        service_id: str,
        env: Mapping[str, str],
        health_port: int,
        log_path: Path,
        *,
        echo: TextIO | None = None,
        color: str | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.sdef = sdef
        self.name = sdef.name
        self.instance = instance
        self.service_id = service_id
        self.env = dict(env)
        self.health_port = health_port
        self.log_path = log_path
        self.echo = echo
        self.color = color
        self.cwd = cwd
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.mqtt_port: int | None = None
        self.tls_port: int | None = None
        self.ws_port: int | None = None
        self.wss_port: int | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.returncode: int | None = None
        self._pump: asyncio.Task | None = None
        self.started_at: float | None = None
        self.ready_in: float | None = None
        self.wanted = False  # started and not stopped on purpose (the supervisor restarts it when it dies)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    async def start(self, timeout: float = 60.0) -> None:
        """Start the process and wait until /readyz answers 200 (ServiceStartError with the log tail when
        it exits or times out first; the process is stopped then)."""
        if self.running:
            raise ServiceStartError(f"{self.service_id} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env)
        argv = self.sdef.argv()
        with open(self.log_path, "ab") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
        self.started_at = time.monotonic()
        self.returncode = None
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=env, cwd=str(self.cwd) if self.cwd else None,
            start_new_session=True, preexec_fn=death_signal_preexec(signal.SIGTERM))
        self._pump = asyncio.create_task(self._pump_output(self.proc), name=f"log:{self.service_id}")
        self.wanted = True  # from here on a death is the supervisor's to heal
        try:
            await self._wait_ready(timeout)
        except BaseException:
            await self.stop(timeout=5)
            raise
        self.ready_in = time.monotonic() - self.started_at

    async def _pump_output(self, proc: asyncio.subprocess.Process) -> None:
        prefix = f"[{self.service_id}] "
        if self.color:
            prefix = f"\x1b[{self.color}m{prefix}\x1b[0m"
        with open(self.log_path, "ab", buffering=0) as f:
            assert proc.stdout is not None
            while True:
                line = await proc.stdout.readline()
                if not line:
                    break
                f.write(line)
                if self.echo is not None:
                    with contextlib.suppress(Exception):
                        self.echo.write(prefix + line.decode("utf-8", errors="replace").rstrip("\n") + "\n")
                        self.echo.flush()

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            assert self.proc is not None
            if self.proc.returncode is not None:
                await self._drain()
                raise ServiceStartError(
                    f"{self.service_id} exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                status = await http_status("127.0.0.1", self.health_port, "/readyz", timeout=1.0)
                if status == 200:
                    return
                last = f"HTTP {status}"
            except (OSError, asyncio.TimeoutError, ValueError) as e:
                last = e
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"{self.service_id} not ready (GET :{self.health_port}/readyz: {last!r}) within "
                    f"{timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")
            await asyncio.sleep(0.1)

    async def _drain(self) -> None:
        if self._pump is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._pump), 2)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Send `sig` to the instance's process group; SIGKILL after `timeout` s. Returns the exit code."""
        self.wanted = False
        proc = self.proc
        if proc is None:
            return self.returncode
        try:
            if proc.returncode is None:
                kill_group(proc.pid, sig)
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                except asyncio.TimeoutError:
                    kill_group(proc.pid, signal.SIGKILL)
                    await proc.wait()
            # children the service may have left in its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await self._drain()
        finally:
            if self._pump is not None and not self._pump.done():
                self._pump.cancel()
            self._pump = None
            self.returncode = proc.returncode
            self.proc = None
        return self.returncode

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status code, body) of `GET http://host:port/path` (HTTP/1.0, no dependency)."""

    async def run() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        line, _, rest = data.partition(b"\r\n")
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ValueError(f"not an HTTP answer: {line[:80]!r}")
        return int(parts[1]), rest.partition(b"\r\n\r\n")[2]

    return await asyncio.wait_for(run(), timeout)


async def http_status(host: str, port: int, path: str, timeout: float = 2.0) -> int:
    """Status code of `GET http://host:port/path`."""
    return (await http_get(host, port, path, timeout))[0]


async def readyz(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> dict:
    """The JSON of a service's `GET /readyz` (its health details), whatever the status code."""
    return json.loads((await http_get(host, port, "/readyz", timeout))[1])


def sort_services(names: Sequence[str]) -> list[str]:
    """Known services in ORDER, unknown (custom) ones after them in the given order."""
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), list(names).index(n)))


def start_tiers(names: Sequence[str]) -> list[list[str]]:
    """`names` grouped by START_TIERS (the empty tiers left out), then each unknown (custom) one alone, in the
    given order: the groups Suite.start starts one after the other."""
    tiers = [[n for n in tier if n in names] for tier in START_TIERS]
    return [t for t in tiers if t] + [[n] for n in names if n not in ORDER]
