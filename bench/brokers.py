"""Brokers under test: Mosquitto and amqtt started by the bench, tbmq-py started by tbmq_launcher.

Each broker object: start() / stop(), host/port, `pids()` (label → root pid, for CPU/RSS), `client_cfg`
(what the generator must send: MQTT version, username) and `notes`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .procmon import set_affinity_tree


class BrokerUnavailable(RuntimeError):
    """The broker cannot be started here (not installed / not written yet); the run skips it."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"broker exited with {proc.returncode} during start:\n{tail}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def _preexec(cpus: set[int] | None):
    if not cpus:
        return None

    def fn():
        os.sched_setaffinity(0, cpus)

    return fn


class _ProcBroker:
    name = "?"
    host = "127.0.0.1"

    def __init__(self, workdir: Path, cpus: set[int] | None = None, persistent: bool = True) -> None:
        self.workdir = Path(workdir) / self.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cpus = cpus
        self.persistent = persistent
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.notes: list[str] = []
        self.client_cfg: dict = {"username": None}  # "version": forced MQTT version (amqtt: 3.1.1 only)

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, port: int | None = None) -> None:
        """Start on a free port, or on `port` (a restart)."""
        self.port = port or free_port()
        cmd = self.command()
        self.log = self.workdir / "broker.log"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.workdir, preexec_fn=_preexec(self.cpus))
        wait_port(self.host, self.port, 30, self.proc, self.log)

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if getattr(self, "_logf", None):
            self._logf.close()

    def pids(self) -> dict[str, int]:
        return {self.name: self.proc.pid} if self.proc else {}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Mosquitto(_ProcBroker):
    """Mosquitto as the bench runs it: in memory. `durable=True` (the faults scenario's reference): persistence
    on, written every second (autosave_interval 1, its most durable setting short of every change)."""

    name = "mosquitto"

    def __init__(self, workdir: Path, cpus: set[int] | None = None, persistent: bool = True,
                 durable: bool = False) -> None:
        super().__init__(workdir, cpus, persistent)
        self.durable = durable

    def command(self) -> list[str]:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not Path(exe).exists():
            raise BrokerUnavailable("mosquitto is not installed (apt-get install mosquitto)")
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} {self.host}\n"
            "allow_anonymous true\n"
            + (f"persistence true\npersistence_location {self.workdir}/\nautosave_interval 1\n" if self.durable
               else "persistence false\n") +
            "max_queued_messages 1000000\n"
            "max_queued_bytes 0\n"
            "log_dest stdout\n"
            "log_type error\nlog_type warning\n")
        self.notes = ["mosquitto " + _mosquitto_version(exe),
                      ("persistence true, autosave_interval 1" if self.durable else "persistence false")
                      + ", max_queued_messages 1000000"]
        return [exe, "-c", str(conf)]


def _mosquitto_version(exe: str) -> str:
    try:
        out = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=5).stdout
        return out.split("version", 1)[1].split()[0]
    except Exception:
        return "?"


class Amqtt(_ProcBroker):
    """amqtt 0.12 (MQTT 3.1.1 only). With allow_anonymous true it never queues QoS 1 for offline sessions,
    so the bench configures allow_anonymous false and the generator sends a username."""

    name = "amqtt"

    def command(self) -> list[str]:
        exe = Path(sys.executable).parent / "amqtt"
        if not exe.exists():
            raise BrokerUnavailable(f"{exe} not found (pip install amqtt)")
        conf = self.workdir / "amqtt.yaml"
        anon = "false" if self.persistent else "true"
        conf.write_text(
            "listeners:\n"
            "  default:\n"
            "    type: tcp\n"
            f"    bind: {self.host}:{self.port}\n"
            "plugins:\n"
            "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            f"    allow_anonymous: {anon}\n")
        self.client_cfg = {"version": 4, "username": "bench"}
        try:
            from importlib.metadata import version
            v = version("amqtt")
        except Exception:
            v = "?"
        self.notes = [f"amqtt {v}", f"allow_anonymous {anon} (generator sends username 'bench')"]
        return [str(exe), "-c", str(conf)]


class Tbmq:
    """tbmq-py: Kafka, Redis and the five services started through tbmq_launcher's Suite.

    The launcher is asyncio; it runs on a private event loop in a background thread so the scenario runner
    stays synchronous."""

    name = "tbmq"
    host = "127.0.0.1"

    def __init__(self, workdir: Path, cpus: set[int] | None = None, persistent: bool = True,
                 app_pattern: str = "^bench-app-.*", persist_in_router: bool = True) -> None:
        self.workdir = Path(workdir) / self.name
        self.persist_in_router = persist_in_router
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cpus = cpus
        self.app_pattern = app_pattern
        self.port = 0
        self.suite = None
        self.notes: list[str] = []
        self.client_cfg: dict = {"username": None}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> None:
        try:
            import tbmq_launcher
            from tbmq_launcher import Suite  # noqa: F401
        except ImportError as e:
            raise BrokerUnavailable(f"tbmq_launcher.Suite is not available yet ({e})") from e
        from . import tbmq_adapter
        os.environ["TBMQ_APPLICATION_CLIENT_ID_PATTERNS"] = self.app_pattern
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tbmq-launcher", daemon=True)
        self._thread.start()
        try:
            self.suite, self.port, self.notes = self._run(
                tbmq_adapter.start_suite(self.workdir, {"TBMQ_APPLICATION_CLIENT_ID_PATTERNS": self.app_pattern},
                                         persist_in_router=self.persist_in_router))
        except BaseException:
            self.stop()
            raise
        if self.cpus:
            for pid in self.pids().values():
                set_affinity_tree(pid, self.cpus)

    def repin(self) -> None:
        """JVM/Faust threads created after start() inherit the mask; call again to catch stragglers."""
        if self.cpus:
            for pid in self.pids().values():
                set_affinity_tree(pid, self.cpus)

    def stop(self) -> None:
        from . import tbmq_adapter
        if self.suite is not None and self._loop is not None:
            try:
                self._run(tbmq_adapter.stop_suite(self.suite), timeout=120)
            except Exception as e:
                print(f"  tbmq: stop failed: {e!r}", file=sys.stderr)
            self.suite = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread:
                self._thread.join(10)
            self._loop = None

    def pids(self) -> dict[str, int]:
        from . import tbmq_adapter
        return tbmq_adapter.suite_pids(self.suite) if self.suite is not None else {}

    def alive(self) -> bool:
        """The launcher's supervisor restarts whatever dies (Suite(supervise=True), as under `make run`): alive
        while the suite runs; restarts are noted."""
        if self.suite is None:
            return False
        restarts = {p.service_id: self.suite.restarts(p.service_id) for p in self.suite.processes()}
        restarted = ", ".join(f"{k} ×{v}" for k, v in restarts.items() if v)
        self.notes = [n for n in self.notes if not n.startswith("restarted by the launcher")]
        if restarted:
            self.notes.append(f"restarted by the launcher during the run: {restarted}")
        return True


BROKERS = {"tbmq": Tbmq, "mosquitto": Mosquitto, "amqtt": Amqtt}


def make_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tbmq-bench-"))
