"""A single-node Apache Kafka 4.x broker (KRaft, combined broker+controller) run from the jars that
`infra/kafka/pom.xml` fetches from Maven Central (scripts/bootstrap.sh runs the Maven step).

    broker = KafkaBroker(port=9092, controller_port=9093, workdir=Path(".run/kafka"))
    await broker.start()          # format storage, start the JVM, wait until metadata answers
    broker.bootstrap_servers      # "localhost:9092"
    await broker.stop()           # SIGTERM to the JVM's process group, SIGKILL after a timeout

The JVM runs in its own process group (so Ctrl-C in a terminal reaches only the launcher, which stops it in
order) and with PR_SET_PDEATHSIG, so it dies with the Python process even when that one is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from .process import death_signal_preexec, kill_group, tail

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_LIBS = REPO_ROOT / "infra" / "kafka" / "target" / "libs"
DEFAULT_LOG4J = REPO_ROOT / "infra" / "kafka" / "log4j2.properties"

# JVM flags chosen for a fast start on a small machine: the broker's own defaults (G1, 1 GB heap) are
# sized for production. SerialGC and a small fixed heap keep the start at about 3.5 s on 2 cores.
#
# No perf data (-XX:-UsePerfData, which also means no hsperfdata file): its sampler woke the JVM's periodic
# task thread 20 times a second, idle or not, for counters only jstat reads. jcmd <pid> (scripts/kafka_jfr.py)
# attaches without them (docs/performance.md, "The thirty-eighth round").
#
# C2's thresholds at a tenth of HotSpot's (Tier4InvocationThreshold 5,000, Tier4MinInvocationThreshold 600,
# Tier4CompileThreshold 15,000, Tier4BackEdgeThreshold 40,000). HotSpot counts invocations, and the suite's
# services coalesce their records into about a hundred Kafka requests a second at 1,000 msg/s (one produce
# request and one fetch per 20 ms round): under the defaults the request path (KafkaApis.handleProduceRequest,
# ReplicaManager.appendRecords, LogValidator) ran in C1's profiling code for about three minutes after every
# start, costing Kafka about twice its steady CPU. With these it is compiled by C2 after about 500 requests
# (docs/performance.md, "The thirty-seventh round").
JVM_FLAGS = (
    "-XX:+UseSerialGC",
    "-XX:-UsePerfData",
    "-Xss512k",
    "-XX:Tier4InvocationThreshold=500",
    "-XX:Tier4MinInvocationThreshold=60",
    "-XX:Tier4CompileThreshold=1500",
    "-XX:Tier4BackEdgeThreshold=4000",
    "-Djava.awt.headless=true",
    "-Dlog4j2.formatMsgNoLookups=true",
)


class KafkaStartError(RuntimeError):
    pass


def _cds_key(java: str, libs_dir: Path) -> str:
    """Identifies the JVM and the jar set a class-data-sharing archive was dumped for."""
    h = hashlib.sha256(os.path.realpath(java).encode())
    with contextlib.suppress(OSError):
        h.update(str(os.stat(os.path.realpath(java)).st_mtime_ns).encode())
    for jar in sorted(libs_dir.glob("*.jar")):
        st = jar.stat()
        h.update(f"{jar.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(" ".join(JVM_FLAGS).encode())
    return h.hexdigest()[:16]


def cluster_id() -> str:
    """What `StorageTool random-uuid` prints: a random UUID in URL-safe base64 without padding.

    Like Kafka's Uuid.randomUuid, never one starting with '-': the storage tool's argument parser would
    take it for an option (about 1 start in 64 failed that way).
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not cid.startswith("-"):
            return cid


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise KafkaStartError("java not found (Java 17+ is required; scripts/bootstrap.sh)")
    return found


class KafkaBroker:
    """One local Kafka broker+controller on `localhost:<port>` (controller on `<controller_port>`)."""

    def __init__(
        self,
        port: int = 9092,
        controller_port: int = 9093,
        workdir: str | os.PathLike = ".run/kafka",
        heap: str = "512m",
        *,
        host: str = "localhost",
        libs_dir: str | os.PathLike | None = None,
        log4j_config: str | os.PathLike | None = None,
        extra_properties: Mapping[str, object] | None = None,
        start_timeout: float = 90.0,
        offsets_partitions: int = 4,
        transaction_partitions: int = 4,
        auto_create_topics: bool = False,
        cds: bool | None = None,
    ) -> None:
        self.port = port
        self.controller_port = controller_port
        self.workdir = Path(workdir).resolve()
        self.heap = heap
        self.host = host
        self.libs_dir = Path(libs_dir or os.environ.get("TBMQ_KAFKA_LIBS", DEFAULT_LIBS)).resolve()
        self.log4j_config = Path(log4j_config or DEFAULT_LOG4J).resolve()
        self.extra_properties = dict(extra_properties or {})
        self.start_timeout = start_timeout
        self.offsets_partitions = offsets_partitions
        self.transaction_partitions = transaction_partitions
        self.auto_create_topics = auto_create_topics
        # AppCDS: the first start dumps the loaded classes to infra/kafka/target/cds/ at JVM exit; later
        # starts map them, which halves the JVM start (≈8 s → ≈4 s on a loaded 2-core machine).
        self.cds = cds if cds is not None else os.environ.get("TBMQ_KAFKA_CDS", "1") != "0"
        self.cluster_id: str | None = None
        self._cds_pending: list[tuple[Path, Path]] = []
        self._log_offset = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.started_in: float | None = None  # seconds from start() to a metadata answer
        self.started_at: float | None = None  # monotonic time of the last start()
        self.wanted = False  # started and not stopped on purpose (the suite's supervisor restarts it)
        self._log_file = None

    # -- addresses -------------------------------------------------------------------------------------
    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "kafka.log"

    @property
    def properties_path(self) -> Path:
        return self.workdir / "server.properties"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    # -- configuration ---------------------------------------------------------------------------------
    def properties(self) -> dict[str, str]:
        h = self.host
        props: dict[str, object] = {
            "process.roles": "broker,controller",
            "node.id": 1,
            "controller.quorum.bootstrap.servers": f"{h}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{h}:{self.port},CONTROLLER://{h}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{h}:{self.port},CONTROLLER://{h}:{self.controller_port}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
            "num.partitions": 1,
            "default.replication.factor": 1,
            "min.insync.replicas": 1,
            "auto.create.topics.enable": str(self.auto_create_topics).lower(),
            "delete.topic.enable": "true",
            # internal topics on one node
            "offsets.topic.replication.factor": 1,
            "offsets.topic.num.partitions": self.offsets_partitions,
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "transaction.state.log.num.partitions": self.transaction_partitions,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
            # fast start / small machine
            "group.initial.rebalance.delay.ms": 0,
            "num.network.threads": 1,
            "num.io.threads": 2,
            "metadata.max.idle.interval.ms": 5000,
            "num.recovery.threads.per.data.dir": 1,
            "log.retention.check.interval.ms": 300000,
            "log.cleaner.threads": 1,
            "log.cleaner.dedupe.buffer.size": 16 * 1024 * 1024,
        }
        props.update(self.extra_properties)
        return {k: str(v) for k, v in props.items()}

    def _write_properties(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        text = "".join(f"{k}={v}\n" for k, v in self.properties().items())
        self.properties_path.write_text("# written by tbmq_launcher.kafka\n" + text)

    def _classpath(self) -> str:
        if not self.libs_dir.is_dir() or not any(self.libs_dir.glob("kafka_2.13-*.jar")):
            raise KafkaStartError(
                f"no Kafka jars in {self.libs_dir}: run scripts/bootstrap.sh "
                "(mvn -f infra/kafka/pom.xml dependency:copy-dependencies)")
        return str(self.libs_dir / "*")

    def _cds_flags(self, java: str, what: str) -> list[str]:
        if not self.cds:
            return []
        try:
            cds_dir = self.libs_dir.parent / "cds"
            archive = cds_dir / f"{what}-{_cds_key(java, self.libs_dir)}.jsa"
            if archive.exists():
                return [f"-XX:SharedArchiveFile={archive}", "-Xshare:auto", "-Xlog:cds*=off"]
            cds_dir.mkdir(parents=True, exist_ok=True)
            tmp = cds_dir / f".{archive.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            self._cds_pending.append((tmp, archive))
            return [f"-XX:ArchiveClassesAtExit={tmp}", "-Xlog:cds*=off"]
        except OSError:
            return []

    def _cds_commit(self, clean: bool) -> None:
        """Move the archives the exited JVMs dumped into place (atomic: concurrent first runs are fine);
        drop them when the JVM did not exit cleanly (a SIGKILL may leave half an archive)."""
        pending, self._cds_pending = self._cds_pending, []
        for tmp, archive in pending:
            with contextlib.suppress(OSError):
                if clean and tmp.exists() and tmp.stat().st_size > 0:
                    os.replace(tmp, archive)
                tmp.unlink(missing_ok=True)

    def _java_cmd(self, main: str, *args: str, heap: str, cds: str) -> list[str]:
        java = java_binary()
        return [
            java, f"-Xms{heap}" if heap == self.heap else "-Xms64m", f"-Xmx{heap}", *JVM_FLAGS,
            *self._cds_flags(java, cds),
            f"-Dlog4j2.configurationFile={self.log4j_config}",
            "-cp", self._classpath(), main, *args,
        ]

    # -- lifecycle -------------------------------------------------------------------------------------
    async def format(self) -> None:
        """`StorageTool format --standalone` (idempotent thanks to --ignore-formatted), run only when the
        log dir is not formatted yet: a dir with meta.properties is what the tool itself leaves alone ("All of
        the log directories are already formatted"; it writes meta.properties last, after the bootstrap
        checkpoint and the metadata log). Skipping it saves a JVM start on every restart of a kept dir (make
        run, the supervisor's restart after a crash): `make bench` faults' Kafka restart stalled deliveries
        3.6–6.1 s instead of 7.4–9.0 s on a 2-core machine (docs/performance.md, "The fourth round")."""
        existing = self._existing_cluster_id()
        if existing is not None:
            self.cluster_id = existing
            with open(self.log_path, "ab") as f:
                f.write(b"--- StorageTool format: skipped, the log dir is formatted (cluster " + existing.encode()
                        + b") ---\n")
            return
        self.cluster_id = cluster_id()
        cmd = self._java_cmd(
            "kafka.tools.StorageTool", "format", "--standalone", "--ignore-formatted",
            "-t", self.cluster_id, "-c", str(self.properties_path), heap="256m", cds="format")
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, preexec_fn=death_signal_preexec(signal.SIGKILL))
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        except BaseException:
            kill_group(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        self._cds_commit(proc.returncode == 0)
        with open(self.log_path, "ab") as f:
            f.write(b"--- StorageTool format ---\n" + out)
        if proc.returncode != 0:
            raise KafkaStartError(f"kafka StorageTool format failed ({proc.returncode}):\n{out.decode(errors='replace')}")

    def _existing_cluster_id(self) -> str | None:
        """The cluster id of an already formatted log dir (make run keeps its data between runs)."""
        meta = self.workdir / "data" / "meta.properties"
        with contextlib.suppress(OSError):
            for line in meta.read_text().splitlines():
                if line.startswith("cluster.id="):
                    return line.split("=", 1)[1].strip()
        return None

    async def start(self) -> None:
        if self.proc is not None:
            raise KafkaStartError("already started")
        t0 = self.started_at = time.monotonic()
        self._write_properties()
        await self.format()
        cmd = self._java_cmd("kafka.Kafka", str(self.properties_path), heap=self.heap, cds="server")
        self._log_file = open(self.log_path, "ab")
        self._log_offset = self._log_file.tell()
        self._log_file.write(b"--- kafka.Kafka ---\n")
        self._log_file.flush()
        env = dict(os.environ)
        env.pop("KAFKA_OPTS", None)
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=self._log_file, stderr=asyncio.subprocess.STDOUT,
            cwd=str(self.workdir), env=env, start_new_session=True,
            preexec_fn=death_signal_preexec(signal.SIGTERM))
        self.wanted = True  # from here on a death is the supervisor's to heal (not while start() prepares)
        try:
            await self._wait_ready(t0 + self.start_timeout)
        except BaseException:
            await self.stop(timeout=5)
            raise
        self.started_in = time.monotonic() - t0
        log.info("kafka ready on %s in %.1fs (pid %s)", self.bootstrap_servers, self.started_in, self.pid)

    async def _wait_ready(self, deadline: float) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        last_error: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise KafkaStartError(
                    f"kafka exited with {self.proc.returncode} during start; {self.log_path}:\n{self.log_tail()}")
            if "Address already in use" in self._log_since_start():
                raise KafkaStartError(
                    f"kafka could not bind its ports ({self.port}, {self.controller_port}): in use; "
                    f"{self.log_path}:\n{self.log_tail()}")
            if await _port_open(self.host, self.port):
                admin = AIOKafkaAdminClient(
                    bootstrap_servers=self.bootstrap_servers, request_timeout_ms=3000,
                    client_id="tbmq-launcher-probe")
                try:
                    await asyncio.wait_for(admin.start(), timeout=5)
                    cluster = await asyncio.wait_for(admin.describe_cluster(), timeout=5)
                    if cluster.get("cluster_id") not in (None, self.cluster_id):
                        raise KafkaStartError(
                            f"another Kafka (cluster {cluster.get('cluster_id')}) answers on "
                            f"{self.bootstrap_servers}; ours is {self.cluster_id}")
                    if cluster.get("brokers"):
                        return
                except KafkaStartError:
                    raise
                except Exception as e:  # not ready yet
                    last_error = e
                finally:
                    with contextlib.suppress(Exception):
                        await admin.close()
            await asyncio.sleep(0.2)
        raise KafkaStartError(
            f"kafka did not answer metadata on {self.bootstrap_servers} within {self.start_timeout:.0f}s "
            f"(last error: {last_error!r}); {self.log_path}:\n{self.log_tail()}")

    def _log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    async def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (controlled shutdown), then SIGKILL after `timeout` s. Safe to call twice."""
        self.wanted = False
        proc, self.proc = self.proc, None
        killed = False
        try:
            if proc is not None and proc.returncode is None:
                if self._cds_pending:  # the first run writes its class archive at exit: give it time
                    timeout = max(timeout, 60.0)
                kill_group(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("kafka did not stop within %.0fs: SIGKILL", timeout)
                    killed = True
                    kill_group(proc.pid, signal.SIGKILL)
                    await proc.wait()
            # anything left in the group (there should be nothing); killpg only: the pid is reaped
            if proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        finally:
            self._cds_commit(proc is not None and not killed and proc.returncode in (0, 143))
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    async def __aenter__(self) -> "KafkaBroker":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def _port_open(host: str, port: int) -> bool:
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=1)
    except (OSError, asyncio.TimeoutError):
        return False
    w.close()
    with contextlib.suppress(Exception):
        await w.wait_closed()
    return True
