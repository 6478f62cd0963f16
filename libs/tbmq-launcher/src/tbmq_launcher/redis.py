"""Real Redis processes (standalone and a local Redis Cluster) for the launcher and the tests.

Uses the Debian ``redis-server`` / ``redis-cli`` binaries and needs no Python Redis client: readiness is
checked with a few bytes of RESP over a plain asyncio socket.

Every ``redis-server`` runs in its own session (process group) with a parent-death signal, so ``stop()``
(SIGTERM to the group, SIGKILL after a timeout) also ends AOF-rewrite children, and a killed launcher or
pytest does not leave a Redis behind. An ``atexit`` hook SIGKILLs anything still running at interpreter
exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import time
from pathlib import Path
from urllib.parse import quote

from tbmq_launcher.process import death_signal_preexec, kill_group, tail

__all__ = ["RedisError", "RedisServer", "RedisCluster", "find_free_port", "redis_command"]

_LIVE: dict[int, asyncio.subprocess.Process] = {}  # pid -> process started and not stopped yet


def _kill_leftovers() -> None:
    for pid, proc in list(_LIVE.items()):
        if proc.returncode is None:  # not reaped: the pid (and its group) is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    _LIVE.clear()


atexit.register(_kill_leftovers)


class RedisError(RuntimeError):
    """A Redis process failed to start, to become ready, or to form a cluster."""


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_GIVEN: set[int] = set()  # ports this process handed out already (a probe closes its socket at once)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their local port there)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_BAND_ENV = "TBMQ_FREE_PORT_BAND"


def port_band(value: str | None, low: int, high: int) -> tuple[int, int]:
    """The part of [low, high] that ``TBMQ_FREE_PORT_BAND=k/n`` gives this process: the k-th (1-based) of n equal
    bands. Unset or empty: all of it. Processes started side by side with different bands (``make test`` runs
    its pytest sessions in parallel lanes, scripts/test-lanes.sh) never pick the same port, so none takes a port
    another one has chosen and not yet bound."""
    if not value:
        return low, high
    try:
        k, n = (int(x) for x in value.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise RedisError(f"{PORT_BAND_ENV}={value!r}: expected k/n with 1 <= k <= n, e.g. 2/3") from None
    width = (high - low + 1) // n
    if width < 200:
        raise RedisError(f"{PORT_BAND_ENV}={value!r}: {n} bands of ports {low}-{high} are too narrow")
    return low + (k - 1) * width, low + k * width - 1


def find_free_port(*, cluster_bus: bool = False, host: str = "127.0.0.1") -> int:
    """A TCP port that is free now. With ``cluster_bus=True`` the Redis Cluster bus port (port + 10000) is free
    too. Chosen below the kernel's ephemeral range: a port the OS picks itself (bind to 0) comes from that range,
    where any outgoing connection (a Kafka client, a test's MQTT client) may take it as its local port before
    the service binds it (a start that failed with "address already in use"). Never the same port twice in one
    process; within this process's band (``TBMQ_FREE_PORT_BAND``, port_band) when one is set (a cluster's ports
    are banded within the range that leaves room for their bus ports). Another process may still take it before
    it is used."""
    low, high = port_band(os.environ.get(PORT_BAND_ENV), 10000, _ephemeral_low() - 1 - (10000 if cluster_bus else 0))
    for _ in range(500):
        port = random.randint(low, high) if high > low + 100 else _os_port(host)
        if port in _GIVEN or not _port_free(port, host):
            continue
        if cluster_bus and not (port + 10000 <= 65535 and _port_free(port + 10000, host)):
            continue
        _GIVEN.add(port)
        return port
    raise RedisError("no free port found")


def _os_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------- RESP


async def _read_reply(reader: asyncio.StreamReader):
    line = await reader.readline()
    if not line:
        raise ConnectionError("connection closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        return RedisError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = await reader.readexactly(n + 2)
        return data[:-2].decode(errors="replace")
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [await _read_reply(reader) for _ in range(n)]
    raise ConnectionError(f"unexpected reply {line!r}")


def _encode(args) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


async def redis_command(host: str, port: int, *args: str | bytes, timeout: float = 2.0,
                        password: str | None = None):
    """Run one command on a fresh connection (AUTH `password` first when given); returns the decoded reply
    (an error reply comes back as a RedisError instance, not raised). Enough for PING / CLUSTER INFO / INFO /
    SHUTDOWN."""

    async def run():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            if password:
                writer.write(_encode(("AUTH", password)))
            writer.write(_encode(args))
            await writer.drain()
            if password:
                auth = await _read_reply(reader)
                if isinstance(auth, RedisError):
                    return auth
            return await _read_reply(reader)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    return await asyncio.wait_for(run(), timeout)


# --------------------------------------------------------------------------------------------- server


class RedisServer:
    """One ``redis-server`` process.

    ``appendonly=True`` with ``appendfsync='everysec'`` (the default) is the realistic durability setting
    for stored DEVICE messages: at most about one second of writes is lost on a machine crash, nothing
    on a process crash. ``appendonly=False`` is pure in-memory (fastest; fine for throw-away tests).
    RDB snapshots are always off (``--save ''``).
    """

    def __init__(
        self,
        port: int,
        workdir: Path,
        *,
        bind: str = "127.0.0.1",
        appendonly: bool = True,
        appendfsync: str = "everysec",
        cluster: bool = False,
        extra_args: list[str] | tuple[str, ...] = (),
        start_timeout: float = 15.0,
        stop_timeout: float = 10.0,
        executable: str = "redis-server",
        password: str | None = None,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.port = port
        self.bind = bind
        self.workdir = Path(workdir)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.cluster = cluster
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.executable = executable
        self.password = password or None
        self.log_path = self.workdir / "redis.log"
        self._proc: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None  # monotonic time of the last start()
        self.wanted = False  # started and not stopped on purpose (the suite's supervisor restarts it)

    @property
    def url(self) -> str:
        """redis://[:password@]host:port/0"""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.bind}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def argv(self) -> list[str]:
        args = [
            self.executable,
            "--port", str(self.port),
            "--bind", self.bind,
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
        ]  # fmt: skip
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / "nodes.conf"),
                "--cluster-node-timeout", "5000",
            ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    async def start(self) -> None:
        if self.running:
            return
        self.started_at = time.monotonic()
        if shutil.which(self.executable) is None:
            raise RedisError(f"{self.executable} not found on PATH (apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=death_signal_preexec(signal.SIGTERM),
        )
        _LIVE[self._proc.pid] = self._proc
        self.wanted = True  # from here on a death is the supervisor's to heal
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        last_error: object = None
        while True:
            if self._proc.returncode is not None:
                raise RedisError(
                    f"redis-server on port {self.port} exited with code {self._proc.returncode}; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            try:
                # The answer must come from our process, not from another Redis already on the port.
                info = await redis_command(self.bind, self.port, "INFO", "server", timeout=1.0,
                                           password=self.password)
                if isinstance(info, str) and f"process_id:{self._proc.pid}\r\n" not in info:
                    last_error = "another process answers on this port"
                else:
                    reply = await redis_command(self.bind, self.port, "PING", timeout=1.0, password=self.password)
                    if reply == "PONG":
                        return
                    last_error = reply  # e.g. -LOADING while the AOF is replayed
            except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
                last_error = exc
            if time.monotonic() > deadline:
                raise RedisError(
                    f"redis-server on port {self.port} did not answer PING within {self.start_timeout}s "
                    f"(last: {last_error!r}); log {self.log_path}:\n{tail(self.log_path)}"
                )
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.wanted = False
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.returncode is None:
                kill_group(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), self.stop_timeout)
                except asyncio.TimeoutError:
                    kill_group(proc.pid, signal.SIGKILL)
                    await proc.wait()
            # AOF-rewrite children live in the same group; make sure none survives the leader. (killpg
            # only: the leader's pid is reaped now and must not be signalled on its own.)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        finally:
            _LIVE.pop(proc.pid, None)
            self._proc = None

    async def __aenter__(self) -> RedisServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


# --------------------------------------------------------------------------------------------- cluster


class RedisCluster:
    """A local Redis Cluster of masters only (no replicas), one ``redis-server`` per port, each in
    ``workdir/<port>/``. Ports need their bus port (port + 10000) free: use
    ``find_free_port(cluster_bus=True)``."""

    def __init__(
        self,
        ports: list[int],
        workdir: Path,
        *,
        bind: str = "127.0.0.1",
        appendonly: bool = True,
        appendfsync: str = "everysec",
        start_timeout: float = 30.0,
    ) -> None:
        if len(ports) < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        self.ports = list(ports)
        self.bind = bind
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        self.servers = [
            RedisServer(
                p,
                self.workdir / str(p),
                bind=bind,
                appendonly=appendonly,
                appendfsync=appendfsync,
                cluster=True,
            )
            for p in self.ports
        ]

    @property
    def nodes(self) -> list[str]:
        return [s.address for s in self.servers]

    async def start(self) -> None:
        try:
            await asyncio.gather(*(s.start() for s in self.servers))
            await self._create()
            await self._wait_ok()
        except BaseException:
            await self.stop()
            raise

    async def _create(self) -> None:
        info = await redis_command(self.bind, self.ports[0], "CLUSTER", "INFO")
        if isinstance(info, str) and "cluster_slots_assigned:16384" in info:
            return  # restarted from existing nodes.conf files
        log = self.workdir / "cluster-create.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                "redis-cli", "--cluster", "create", *self.nodes,
                "--cluster-replicas", "0", "--cluster-yes",
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                rc = await asyncio.wait_for(proc.wait(), self.start_timeout)
            except asyncio.TimeoutError:
                kill_group(proc.pid, signal.SIGKILL)
                await proc.wait()
                raise RedisError(f"redis-cli --cluster create timed out:\n{tail(log)}") from None
        if rc != 0:
            raise RedisError(f"redis-cli --cluster create failed ({rc}):\n{tail(log)}")

    async def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        pending = list(self.servers)
        while pending:
            s = pending[0]
            try:
                info = await redis_command(self.bind, s.port, "CLUSTER", "INFO", timeout=1.0)
            except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
                info = repr(exc)
            if isinstance(info, str) and "cluster_state:ok" in info:
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RedisError(
                    f"cluster node {s.address} not ok after {self.start_timeout}s:\n{info}\n"
                    f"log {s.log_path}:\n{tail(s.log_path)}"
                )
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)

    async def __aenter__(self) -> RedisCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
