"""`Suite`: Kafka + Redis + topics + the services, in order, each with a real readiness check.

    suite = Suite(connectors=2, ports="free", run_dir=tmp)     # tests
    await suite.start()                # Kafka, Redis, topics, then session-registry … connector(s)
    suite.mqtt_ports                   # [p1, p2]
    await suite.kill_service("connector", 2)
    await suite.restart_service("connector", 2)
    await suite.stop()                 # services (SIGTERM, SIGKILL after a timeout), then Kafka, then Redis

    Suite(spark=True)                  # + the Spark statistics job after the services (docs/spark.md)
    Suite(supervise=True)              # a process that dies is started again with back-off (make run;
                                       # tbmq_launcher.supervisor): suite.restarts("router-1")

`python -m tbmq_launcher run` (= `make run`) runs one with the default ports of docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TextIO

from .admin_user import ensure_admin_user
from .kafka import KafkaBroker
from .process import tail
from .tls import DevCerts, ensure_dev_certs, issue_peer_cert
from .services import (DEVICE_PERSISTENCE_GROUP, ORDER, SERVICES, ServiceDef, ServiceProcess, ServiceStartError,
                       _COLORS, sort_services, start_tiers)
from .supervisor import RestartPolicy, Supervisor, Unit

log = logging.getLogger(__name__)

DEFAULT_KAFKA_PORT = 9092
DEFAULT_CONTROLLER_PORT = 9093
DEFAULT_REDIS_PORT = 6380
DEFAULT_REDIS_CLUSTER_PORTS = (7001, 7002, 7003)
# every listening port of a service instance (ServiceProcess attributes)
PORT_ATTRS = ("health_port", "grpc_port", "http_port", "mqtt_port", "tls_port", "ws_port", "wss_port")
# the connector's listener port settings and the ServiceProcess attributes that hold them
LISTENER_PORTS = (("MQTT_PORT", "mqtt_port"), ("MQTT_TLS_PORT", "tls_port"), ("MQTT_WS_PORT", "ws_port"),
                  ("MQTT_WSS_PORT", "wss_port"))


class SuiteError(RuntimeError):
    pass


def _free_port(cluster_bus: bool = False) -> int:
    from .redis import find_free_port

    return find_free_port(cluster_bus=cluster_bus)


class Suite:
    """The whole local stack, or any part of it.

    Parameters (all keyword-only):
      services        names to start (default: all six, ORDER), started by START_TIERS; unknown names need a
                      `service_defs` entry (tests run fake services this way). [] = Kafka + Redis only.
      connectors      number of connector instances (default 1).
      instances       instance counts of other services, e.g. {"app-delivery": 2} (default 1 each).
      ports           "default" (docs/architecture.md: MQTT 1883, Kafka 9092/9093, Redis 6380, …) or
                      "free" (every port picked free by the OS: tests).
      mqtt_port, kafka_port, controller_port, redis_port: override single base ports.
      tls_port, ws_port, wss_port: the connector's other listener base ports (default 8883, 8083, 8084;
                      free ones with ports="free"); switch one off with service_env {"connector":
                      {"MQTT_WS_PORT": "0"}}.
      tls_dir         where the connector's TLS certificate comes from: a development CA and server
                      certificate are made there (tbmq_launcher.tls) unless `env`/`service_env` configure
                      MQTT_TLS_CERT_FILE; default <run_dir>/tls. The connectors get MQTT_TLS_CERT_FILE,
                      MQTT_TLS_KEY_FILE and MQTT_TLS_CA_FILE (the CA that client certificates are checked
                      against when MQTT_TLS_CLIENT_AUTH asks for them).
      grpc_tls        mutual TLS on the gRPC surfaces between the services (tbmq_platform.grpc_tls): a
                      development CA ("tbmq-py internal development CA") in <run_dir>/grpc-tls and a certificate
                      per instance (CN = its TBMQ_SERVICE_ID), given as GRPC_TLS_CERT_FILE, GRPC_TLS_KEY_FILE and
                      GRPC_TLS_CA_FILE (unless `env`/`service_env` set GRPC_TLS_CERT_FILE); a server's
                      GRPC_TLS_PEER_NAMES names the services that call it (ServiceDef.grpc_callers).
      mqtt_host       MQTT_BIND_HOST of the connectors (default 127.0.0.1, as Mosquitto 2 without a
                      configuration: reachable from this host only, so anonymous clients are allowed by
                      default; any other address turns MQTT_ALLOW_ANONYMOUS off unless set: docs/security.md).
      internal_host   GRPC_HOST and HEALTH_HOST of every service (default 127.0.0.1: the gRPC and health
                      ports are not reachable from other hosts).
      redis_password  the own Redis runs with requirepass, and REDIS_URL carries the password.
      run_dir         where logs and data go (.run for make run; a tmp dir in tests).
      kafka           an already running KafkaBroker (or a bootstrap string) to use instead of starting
                      one: the test session shares one broker this way.
      redis_url       an already running Redis to use instead of starting one.
      redis_appendfsync  the Redis AOF fsync policy (everysec default, always; docs/architecture.md).
      redis_cluster   start a 3-master Redis Cluster instead of a standalone server; the services get
                      REDIS_CLUSTER_NODES (and REDIS_URL of the first node).
      env             extra environment for every service; service_env: {"router": {...}} per service.
      echo            a stream (sys.stdout) to copy every service's output to, prefixed with its id.
      log_format      LOG_FORMAT given to the services ("console" or "json").
      id_tag          appended to every TBMQ_SERVICE_ID ("connector-1-<tag>"): suites sharing one Kafka
                      then get their own .<svc> topics.
      service_defs    extra or replacing ServiceDefs, by name.
      create_topics   ensure_topics(static_topics() + service_topics(<each connector id>)) after Kafka.
      topic_profile   TBMQ_TOPIC_PROFILE of the topics it creates and of every service: "production" (TBMQ's
                      partition counts; the default, which the tests use) or "single-node" (`make run`, bench).
      start_timeout   per service readiness timeout (s); stop_timeout: SIGTERM → SIGKILL delay (s).
      kafka_heap      -Xmx of the broker.
      spark           also run the Spark statistics job (`python -m tbmq_spark stats --bootstrap <kafka>
                      --output <run_dir>/spark`, log <run_dir>/logs/spark-stats.log) once the services are
                      ready; ready when its streaming query is active (spark_start_timeout), stopped first.
      spark_args      extra arguments of `tbmq_spark stats` (e.g. ("--trigger", "processingTime=30 seconds")).
      spark_start_timeout, spark_stop_timeout: its bounds (s): JVM start + query start; SIGTERM → SIGKILL.
      persist_in_router  no device-persistence process: each router instance runs one itself
                      (ROUTER_PERSIST_VIA=local, docs/router.md) on the port a device-persistence instance
                      would have (50061, + 100 per instance), and DEVICE_PERSISTENCE_GRPC_TARGETS lists the
                      routers; one process fewer on a persistent message's path.
      supervise       once started, start again (with the back-off of `restart_policy`) every process of the
                      suite — services, Spark job, Kafka, Redis — that exits without being stopped through
                      this object (tbmq_launcher.supervisor); `make run` does, tests that kill on purpose
                      do not unless they test it.
    """

    def __init__(
        self,
        *,
        services: Sequence[str] | None = None,
        connectors: int = 1,
        instances: Mapping[str, int] | None = None,
        ports: Literal["default", "free"] = "default",
        mqtt_port: int | None = None,
        tls_port: int | None = None,
        ws_port: int | None = None,
        wss_port: int | None = None,
        kafka_port: int | None = None,
        controller_port: int | None = None,
        redis_port: int | None = None,
        run_dir: str | os.PathLike = ".run",
        kafka: KafkaBroker | str | None = None,
        redis_url: str | None = None,
        redis_cluster: bool = False,
        redis_appendfsync: str = "everysec",
        redis_password: str | None = None,
        tls_dir: str | os.PathLike | None = None,
        internal_host: str = "127.0.0.1",
        grpc_tls: bool = False,
        mqtt_host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        service_env: Mapping[str, Mapping[str, str]] | None = None,
        echo: TextIO | None = None,
        log_format: str = "console",
        id_tag: str = "",
        service_defs: Mapping[str, ServiceDef] | None = None,
        create_topics: bool = True,
        topic_profile: str = "production",
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        kafka_heap: str = "512m",
        kafka_stop_timeout: float = 15.0,
        fresh: bool = False,
        spark: bool = False,
        spark_args: Sequence[str] = (),
        spark_start_timeout: float = 180.0,
        spark_stop_timeout: float = 30.0,
        supervise: bool = False,
        restart_policy: RestartPolicy | None = None,
        persist_in_router: bool = False,
    ) -> None:
        if ports not in ("default", "free"):
            raise ValueError("ports must be 'default' or 'free'")
        self.defs: dict[str, ServiceDef] = {**SERVICES, **(service_defs or {})}
        names = list(ORDER if services is None else services)
        self.persist_in_router = persist_in_router
        if persist_in_router:
            if services is not None and "device-persistence" in services:
                raise ValueError("persist_in_router: the routers run device-persistence; do not start it too")
            names = [n for n in names if n != "device-persistence"]
        unknown = [n for n in names if n not in self.defs]
        if unknown:
            raise ValueError(f"unknown services {unknown}; known: {sorted(self.defs)}")
        self.service_names = sort_services(names)
        self.counts = {n: 1 for n in self.service_names}
        self.counts.update({k: v for k, v in (instances or {}).items() if k in self.counts})
        if "connector" in self.counts:
            self.counts["connector"] = connectors
        self.connectors = connectors
        self.free_ports = ports == "free"
        self.run_dir = Path(run_dir).resolve()
        self.redis_cluster = redis_cluster
        self.env = dict(env or {})
        self.service_env = {k: dict(v) for k, v in (service_env or {}).items()}
        self.internal_host = internal_host
        self.mqtt_host = mqtt_host
        self.redis_password = redis_password
        configured = "MQTT_TLS_CERT_FILE" in {**self.env, **self.service_env.get("connector", {})}
        self.tls: DevCerts | None = None if configured else DevCerts(
            Path(tls_dir).resolve() if tls_dir else self.run_dir / "tls")
        self.grpc_tls: DevCerts | None = DevCerts(self.run_dir / "grpc-tls") if grpc_tls else None
        self.echo = echo
        self.log_format = log_format
        self.id_tag = id_tag
        self.create_topics = create_topics
        from tbmq_platform.topics import PROFILES
        if topic_profile not in PROFILES:
            raise ValueError(f"topic_profile must be one of {PROFILES}")
        self.topic_profile = topic_profile
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.kafka_stop_timeout = kafka_stop_timeout
        self.fresh = fresh

        # Kafka
        self._own_kafka = not isinstance(kafka, (KafkaBroker, str))
        self.kafka: KafkaBroker | None = kafka if isinstance(kafka, KafkaBroker) else None
        self._kafka_bootstrap = kafka if isinstance(kafka, str) else None
        if self._own_kafka:
            kp = kafka_port or (_free_port() if self.free_ports else DEFAULT_KAFKA_PORT)
            cp = controller_port or (_free_port() if self.free_ports else DEFAULT_CONTROLLER_PORT)
            self.kafka = KafkaBroker(port=kp, controller_port=cp, workdir=self.run_dir / "kafka", heap=kafka_heap)

        # Redis
        self._own_redis = redis_url is None
        self._redis_url = redis_url
        self.redis = None
        if self._own_redis:
            from .redis import RedisCluster, RedisServer

            if redis_cluster:
                rports = ([_free_port(cluster_bus=True) for _ in range(3)] if self.free_ports
                          else list(DEFAULT_REDIS_CLUSTER_PORTS))
                if redis_password:
                    raise ValueError("redis_password is not supported with redis_cluster yet")
                self.redis = RedisCluster(rports, self.run_dir / "redis-cluster", appendfsync=redis_appendfsync)
            else:
                rp = redis_port or (_free_port() if self.free_ports else DEFAULT_REDIS_PORT)
                self.redis = RedisServer(rp, self.run_dir / "redis", appendfsync=redis_appendfsync,
                                         password=redis_password)

        # ports and processes of every instance
        self.procs: dict[tuple[str, int], ServiceProcess] = {}
        color = 0
        for name in self.service_names:
            sdef = self.defs[name]
            for i in range(1, self.counts[name] + 1):
                health = self._port(sdef.health_port, i, 100)
                p = ServiceProcess(
                    sdef, i, self.service_id(name, i), {}, health,
                    self.run_dir / "logs" / f"{self.service_id(name, i)}.log",
                    echo=echo, color=_COLORS[color % len(_COLORS)] if _isatty(echo) else None,
                    cwd=self.run_dir)
                color += 1
                p.grpc_port = self._port(sdef.grpc_port, i, 100) if sdef.grpc_port else None
                if self._hosts_device_persistence(name):  # its device-persistence instance's gRPC port
                    p.grpc_port = self._port(SERVICES["device-persistence"].grpc_port, i, 100)
                p.http_port = self._port(sdef.http_port, i, 100) if sdef.http_port else None
                if name == "connector" and mqtt_port:
                    p.mqtt_port = mqtt_port + (i - 1)  # an explicit base wins over ports="free"
                elif sdef.mqtt_port:
                    p.mqtt_port = self._port(sdef.mqtt_port, i, 1)
                for attr, base, step in (("tls_port", tls_port, 1), ("ws_port", ws_port, 100),
                                         ("wss_port", wss_port, 100)):
                    if name == "connector" and base:  # an explicit base wins over ports="free"
                        setattr(p, attr, base + step * (i - 1))
                    elif getattr(sdef, attr):
                        setattr(p, attr, self._port(getattr(sdef, attr), i, step))
                overrides = {**self.env, **self.service_env.get(name, {})}
                for var, attr in LISTENER_PORTS:  # a listener the caller rebinds or switches off (0 or empty)
                    if var in overrides and getattr(p, attr):
                        raw = overrides[var].strip()
                        setattr(p, attr, int(raw) if raw.isdigit() and int(raw) else None)
                self.procs[(name, i)] = p
        self._check_port_plan()
        # the Spark statistics job (started after the services, stopped before them)
        self.spark = spark
        self.spark_args = tuple(spark_args)
        self.spark_start_timeout = spark_start_timeout
        self.spark_stop_timeout = spark_stop_timeout
        self.spark_job = None
        if spark:
            from .spark import SparkJobProcess

            self.spark_job = SparkJobProcess(
                self.bootstrap_servers, self.run_dir, self.spark_args, echo=echo,
                color=_COLORS[color % len(_COLORS)] if _isatty(echo) else None)
        self._started = False
        self.start_seconds: float | None = None
        self.supervise = supervise
        self.restart_policy = restart_policy or RestartPolicy()
        self.supervisor: Supervisor | None = None

    # -- naming and addresses --------------------------------------------------------------------------
    def _check_port_plan(self) -> None:
        """Two listeners of the plan on one port would fail the second one's start with "address already in
        use": refused before anything starts, every clash named. The defaults clash from 9 instances of a
        service on (connector-9's WS port 8083 + 800 is connector-1's TLS port 8883)."""
        owners: dict[int, list[str]] = {}
        for p in self.procs.values():
            for attr in PORT_ATTRS:
                port = getattr(p, attr)
                if port:
                    owners.setdefault(port, []).append(f"{p.service_id} {attr}")
        clashes = [f"{port}: {' and '.join(names)}" for port, names in sorted(owners.items()) if len(names) > 1]
        if clashes:
            raise SuiteError("two listeners on one port (start fewer instances, move a base port, or use free "
                             "ports): " + "; ".join(clashes))

    def _hosts_device_persistence(self, name: str) -> bool:
        """Whether instances of `name` run device-persistence in their process (the routers, persist_in_router)."""
        return name == "router" and self.persist_in_router

    def _port(self, base: int, instance: int, step: int) -> int:
        if self.free_ports:
            return _free_port()
        return base + step * (instance - 1)

    def service_id(self, name: str, instance: int = 1) -> str:
        sid = f"{name}-{instance}"
        return f"{sid}-{self.id_tag}" if self.id_tag else sid

    def instance(self, name: str, instance: int = 1) -> ServiceProcess:
        try:
            return self.procs[(name, instance)]
        except KeyError:
            raise KeyError(f"no instance {instance} of {name!r} in this suite") from None

    def instances_of(self, name: str) -> list[ServiceProcess]:
        return [p for (n, _), p in sorted(self.procs.items()) if n == name]

    @property
    def bootstrap_servers(self) -> str:
        if self.kafka is not None:
            return self.kafka.bootstrap_servers
        assert self._kafka_bootstrap is not None
        return self._kafka_bootstrap

    @property
    def redis_url(self) -> str:
        if self._redis_url:
            return self._redis_url
        if self.redis_cluster:
            return f"redis://{self.redis.nodes[0]}/0"
        return self.redis.url

    @property
    def redis_cluster_nodes(self) -> list[str] | None:
        if self.redis_cluster and self.redis is not None:
            return list(self.redis.nodes)
        return None

    @property
    def mqtt_ports(self) -> list[int]:
        return [p.mqtt_port for p in self.instances_of("connector")]

    @property
    def tls_ports(self) -> list[int | None]:
        return [p.tls_port for p in self.instances_of("connector")]

    @property
    def ws_ports(self) -> list[int | None]:
        return [p.ws_port for p in self.instances_of("connector")]

    @property
    def wss_ports(self) -> list[int | None]:
        return [p.wss_port for p in self.instances_of("connector")]

    def listeners(self, instance: int = 1) -> list[tuple[str, str]]:
        """(kind, address) of every MQTT listener of connector `instance` that is on: MQTT, MQTT/TLS, WS,
        WSS."""
        p = self.instance("connector", instance)
        path = self.service_environment("connector", instance).get("MQTT_WS_PATH", "/mqtt")
        out = []
        for kind, port, fmt in (("MQTT", p.mqtt_port, "localhost:{}"), ("MQTT/TLS", p.tls_port, "localhost:{}"),
                                ("WS", p.ws_port, "ws://localhost:{}" + path),
                                ("WSS", p.wss_port, "wss://localhost:{}" + path)):
            if port:
                out.append((kind, fmt.format(port)))
        return out

    @property
    def connector_ids(self) -> list[str]:
        return [p.service_id for p in self.instances_of("connector")]

    def health_port(self, name: str, instance: int = 1) -> int:
        return self.instance(name, instance).health_port

    def grpc_target(self, name: str, instance: int = 1) -> str:
        return f"localhost:{self.instance(name, instance).grpc_port}"

    def log_path(self, name: str, instance: int = 1) -> Path:
        return self.instance(name, instance).log_path

    def service_environment(self, name: str, instance: int = 1) -> dict[str, str]:
        """The environment (on top of os.environ) one instance is started with."""
        p = self.instance(name, instance)
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "REDIS_URL": self.redis_url,
            "TBMQ_SERVICE_ID": p.service_id,
            "HEALTH_PORT": str(p.health_port),
            "LOG_FORMAT": self.log_format,
            "OTEL_SERVICE_NAME": name,
            "PYTHONUNBUFFERED": "1",
            "TBMQ_TOPIC_PROFILE": self.topic_profile,
            "GRPC_HOST": self.internal_host,
            "HEALTH_HOST": self.internal_host,
        }
        if self.redis_cluster_nodes:
            env["REDIS_CLUSTER_NODES"] = ",".join(self.redis_cluster_nodes)
        dp = self.instances_of("router" if self.persist_in_router else "device-persistence")
        env["DEVICE_PERSISTENCE_GRPC_TARGET"] = (
            f"localhost:{dp[0].grpc_port}" if dp else f"localhost:{SERVICES['device-persistence'].grpc_port}")
        # connectors keep a forward stream to every instance
        env["DEVICE_PERSISTENCE_GRPC_TARGETS"] = (
            ",".join(f"localhost:{d.grpc_port}" for d in dp) if dp else env["DEVICE_PERSISTENCE_GRPC_TARGET"])
        ad = self.instances_of("app-delivery")
        env["APP_DELIVERY_GRPC_TARGETS"] = (
            ",".join(f"localhost:{a.grpc_port}" for a in ad) if ad
            else f"localhost:{SERVICES['app-delivery'].grpc_port}")
        if p.grpc_port:
            env[p.sdef.grpc_port_env or "GRPC_PORT"] = str(p.grpc_port)
        if self._hosts_device_persistence(name):
            env.update(ROUTER_PERSIST_VIA="local", DEVICE_PERSISTENCE_GRPC_PORT=str(p.grpc_port),
                       ROUTER_LOCAL_TARGET=f"localhost:{p.grpc_port}")
        if name == "connector":
            env["MQTT_BIND_HOST"] = self.mqtt_host
        if p.http_port and p.sdef.http_port_env:
            env[p.sdef.http_port_env] = str(p.http_port)
        if name == "admin":  # the users file of ensure_admin_user, every instance's health endpoint
            env["ADMIN_USERS_FILE"] = str(self.admin_users_file)
            env["ADMIN_SERVICES"] = ",".join(f"{q.name}=127.0.0.1:{q.health_port}" for q in self.procs.values())
        for var, attr in LISTENER_PORTS:
            if getattr(p, attr):
                env[var] = str(getattr(p, attr))
        if (p.tls_port or p.wss_port) and self.tls is not None:
            env.update(MQTT_TLS_CERT_FILE=str(self.tls.server_cert), MQTT_TLS_KEY_FILE=str(self.tls.server_key),
                       MQTT_TLS_CA_FILE=str(self.tls.ca))
        if self.grpc_tls is not None:
            cert, key = self.grpc_peer_cert(p.service_id)
            env.update(GRPC_TLS_CERT_FILE=str(cert), GRPC_TLS_KEY_FILE=str(key), GRPC_TLS_CA_FILE=str(self.grpc_tls.ca))
            callers = (SERVICES["device-persistence"].grpc_callers if self._hosts_device_persistence(name)
                       else p.sdef.grpc_callers)
            if callers:  # the instance certificates' CN is their service id: <service>-<n>[-tag]
                env["GRPC_TLS_PEER_NAMES"] = ",".join(f"{caller}-*" for caller in callers)
        env.update(p.sdef.env)
        overrides = {**self.env, **self.service_env.get(name, {})}
        env.update(overrides)
        if "DEVICE_PERSISTENCE_GRPC_TARGET" in overrides and "DEVICE_PERSISTENCE_GRPC_TARGETS" not in overrides:
            del env["DEVICE_PERSISTENCE_GRPC_TARGETS"]  # the caller's single target wins (connector fallback)
        return env

    def grpc_peer_cert(self, service_id: str) -> tuple[Path, Path]:
        """(certificate, key) an instance presents on the gRPC surfaces when `grpc_tls` is on (made at start)."""
        d = self.grpc_tls.directory
        return d / f"peer-{service_id}.pem", d / f"peer-{service_id}-key.pem"

    def _ensure_grpc_certs(self) -> None:
        ensure_dev_certs(self.grpc_tls.directory, ca_name="tbmq-py internal development CA")
        for p in self.procs.values():
            issue_peer_cert(self.grpc_tls, p.service_id)

    @property
    def admin_password_file(self) -> Path:
        return self.run_dir / "admin-password"

    @property
    def admin_users_file(self) -> Path:
        return self.run_dir / "admin-users"

    def admin_url(self, instance: int = 1) -> str:
        """The admin web UI (the REST API is below /api/v1)."""
        return f"http://127.0.0.1:{self.instance('admin', instance).http_port}/"

    def describe(self) -> str:
        """What listens where (printed by `run`)."""
        rows = [("kafka", self.bootstrap_servers, f"log {self.kafka.log_path}" if self.kafka else "external")]
        if self.tls is not None and self.instances_of("connector"):
            rows.append(("tls", f"CA {self.tls.ca}", f"server certificate {self.tls.server_cert}"))
        if self.grpc_tls is not None:
            rows.append(("grpc tls", f"CA {self.grpc_tls.ca}", f"instance certificates in {self.grpc_tls.directory}"))
        if self.redis_cluster_nodes:
            rows.append(("redis cluster", ",".join(self.redis_cluster_nodes), ""))
        else:
            rows.append(("redis", self.redis_url, "" if self._own_redis else "external"))
        for (name, i), p in self.procs.items():
            where = [f"health :{p.health_port}"]
            if name == "connector":
                where[:0] = [f"{kind} {addr}" for kind, addr in self.listeners(i)]
            if p.grpc_port:
                where.append(f"gRPC :{p.grpc_port}" + (" (device-persistence in this process)"
                                                       if self._hosts_device_persistence(name) else ""))
            if name == "admin" and p.http_port:
                where[:0] = [f"web UI and API http://127.0.0.1:{p.http_port}/"]
            state = f"pid {p.pid}" if p.running else "stopped"
            if self.restarts(p.service_id):
                state += f", {self.restarts(p.service_id)} restarts"
            rows.append((p.service_id, ", ".join(where), f"{state}, log {p.log_path}"))
        if self.spark_job is not None:
            j = self.spark_job
            state = f"pid {j.pid}" if j.running else "stopped"
            rows.append((j.service_id, f"output {j.output}", f"{state}, log {j.log_path}"))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        return "\n".join(f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Kafka, Redis, topics, then the services tier by tier (START_TIERS: the instances of a tier together,
        every one waited for before the next tier starts). On any failure (or
        cancellation) everything already started is stopped before the error propagates."""
        if self._started:
            raise SuiteError("suite already started")
        self._started = True
        t0 = time.monotonic()
        try:
            if self.fresh and self.run_dir.exists():
                # the Spark checkpoint holds offsets of the deleted Kafka data: it goes too
                for sub in ("kafka", "redis", "redis-cluster", "logs", "spark"):
                    shutil.rmtree(self.run_dir / sub, ignore_errors=True)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.instances_of("admin"):
                await asyncio.to_thread(ensure_admin_user, self.run_dir)
            if self.tls is not None and self.instances_of("connector"):
                await asyncio.to_thread(ensure_dev_certs, self.tls.directory)
            if self.grpc_tls is not None:
                await asyncio.to_thread(self._ensure_grpc_certs)
            infra = []
            if self._own_kafka:
                infra.append(self.kafka.start())
            if self._own_redis:
                infra.append(self.redis.start())
            results = await asyncio.gather(*infra, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            if self.create_topics:
                await self.ensure_topics()
            for tier in start_tiers(self.service_names):
                await self._start_together([p for name in tier for p in self.instances_of(name)])
            if self.spark_job is not None:
                await self.start_spark()
        except BaseException:
            await self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        if self.supervise:
            self.supervisor = Supervisor(self._units(), self.restart_policy)
            self.supervisor.start()

    def _units(self) -> list[Unit]:
        """What the supervisor watches: Kafka and Redis when this suite started them, every service
        instance, the Spark job."""
        units: list[Unit] = []
        if self._own_kafka and self.kafka is not None:
            k = self.kafka

            async def restart_kafka() -> None:
                await k.stop(timeout=5)
                await k.start()

            units.append(Unit("kafka", lambda: k.running, lambda: k.wanted, restart_kafka,
                              lambda: k.started_at, lambda: k.log_tail(20),
                              lambda: k.proc.returncode if k.proc else None))
        if self._own_redis and self.redis is not None:
            for srv in getattr(self.redis, "servers", [self.redis]):
                async def restart_redis(srv=srv) -> None:
                    await srv.stop()
                    await srv.start()

                units.append(Unit(f"redis:{srv.port}", lambda srv=srv: srv.running, lambda srv=srv: srv.wanted,
                                  restart_redis, lambda srv=srv: srv.started_at,
                                  lambda srv=srv: tail(srv.log_path, 20),
                                  lambda srv=srv: srv._proc.returncode if srv._proc else None))
        for p in self.processes():
            async def restart_proc(p=p) -> None:
                await p.stop(timeout=5)  # its pump and anything left in its process group
                if p is self.spark_job:
                    await self.start_spark()
                else:
                    await self._start_proc(p)

            units.append(Unit(p.service_id, lambda p=p: p.running, lambda p=p: p.wanted, restart_proc,
                              lambda p=p: p.started_at, lambda p=p: p.log_tail(20),
                              lambda p=p: p.proc.returncode if p.proc else None))
        return units

    def restarts(self, unit: str) -> int:
        """How often the supervisor restarted `unit` (a service id such as "router-1", "kafka",
        "redis:<port>")."""
        return self.supervisor.restarts(unit) if self.supervisor is not None else 0

    async def ensure_topics(self, extra_service_ids: Iterable[str] = ()) -> None:
        from tbmq_platform import topics as catalogue

        ensure = getattr(catalogue, "ensure_topics", None)
        if ensure is None:
            from tbmq_platform.kafka import ensure_topics as ensure
        specs = list(catalogue.static_topics())
        for sid in [*self.connector_ids, *extra_service_ids]:
            specs.extend(catalogue.service_topics(sid))
        await ensure(self.bootstrap_servers, specs, layout=catalogue.TopicLayout(self.topic_profile))

    async def _start_together(self, procs: list[ServiceProcess]) -> None:
        """Start `procs` at once and wait for every one's readiness; on the first failure the others' starts
        are cancelled (each stops what it started) before the error propagates."""
        tasks = [asyncio.create_task(self._start_proc(p), name=f"start:{p.service_id}") for p in procs]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _start_proc(self, p: ServiceProcess) -> None:
        p.env = self.service_environment(p.name, p.instance)
        log.info("starting %s", p.service_id)
        await p.start(timeout=self.start_timeout)
        log.info("%s ready in %.1fs (pid %s)", p.service_id, p.ready_in, p.pid)

    async def start_spark(self) -> None:
        """(Re)start the Spark statistics job and wait until its streaming query is active."""
        if self.spark_job is None:
            raise SuiteError("this suite has no Spark job (Suite(spark=True))")
        j = self.spark_job
        # the job reads KAFKA_BOOTSTRAP_SERVERS/TBMQ_SPARK_OUTPUT too; its command line already says both
        j.env = {"KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers, "TBMQ_SPARK_OUTPUT": str(j.output),
                 "PYTHONUNBUFFERED": "1"}
        log.info("starting %s", j.service_id)
        await j.start(timeout=self.spark_start_timeout)
        log.info("%s ready in %.1fs (pid %s)", j.service_id, j.ready_in, j.pid)

    async def stop_spark(self) -> int | None:
        """SIGTERM to the job (it stops its query), SIGKILL of its whole tree after spark_stop_timeout."""
        if self.spark_job is None or self.spark_job.proc is None:
            return None
        return await self.spark_job.stop(timeout=self.spark_stop_timeout)

    async def stop(self) -> None:
        """The Spark job, services in reverse order (SIGTERM, SIGKILL after stop_timeout), then Kafka, then
        Redis. Never raises for one part failing to stop; safe to call twice."""
        if self.supervisor is not None:
            await self.supervisor.stop()
            self.supervisor = None
        with contextlib.suppress(Exception):
            await self.stop_spark()
        for name in reversed(self.service_names):
            procs = [p for p in self.instances_of(name) if p.proc is not None]
            if procs:
                await asyncio.gather(*(p.stop(timeout=self.stop_timeout) for p in procs),
                                     return_exceptions=True)
        await self._leave_static_groups()
        if self._own_kafka and self.kafka is not None:
            with contextlib.suppress(Exception):
                await self.kafka.stop(timeout=self.kafka_stop_timeout)
        if self._own_redis and self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.stop()

    def static_members(self) -> dict[str, list[str]]:
        """Consumer group -> the instances of this suite that joined it as static members (their
        TBMQ_SERVICE_ID is their group.instance.id): every started instance of a service with `static_groups`,
        and a router running device-persistence (ROUTER_PERSIST_VIA=local) in that one's group too."""
        groups: dict[str, list[str]] = {}
        for p in self.processes():
            if not p.env:  # never started
                continue
            wanted = list(p.sdef.static_groups)
            if p.env.get("ROUTER_PERSIST_VIA") == "local":
                wanted.append(DEVICE_PERSISTENCE_GROUP)
            for var, default in wanted:
                groups.setdefault(p.env.get(var, default), []).append(p.env.get("TBMQ_SERVICE_ID", p.service_id))
        return groups

    async def _leave_static_groups(self) -> None:
        """Once the services have stopped: take their static members out of their groups
        (tbmq_platform.kafka.remove_static_members). A stopped static member keeps its partitions until its
        session times out, waiting for a restart with its id; a suite that stops is not coming back with
        these instances (another one sharing this Kafka, a test's next suite, has its own ids), and its
        successors' group joins would otherwise wait out that timeout. Best effort: never raises."""
        if self.kafka is not None and not self.kafka.running:  # stopped (a test's fault): the members expire
            return
        from tbmq_platform.kafka import remove_static_members

        for group, ids in self.static_members().items():
            try:
                await asyncio.wait_for(remove_static_members(self.bootstrap_servers, group, ids, timeout_s=5), 10)
            except Exception as e:  # noqa: BLE001 - best effort: the members expire with their sessions
                log.warning("could not take %s out of group %s: %r", ", ".join(ids), group, e)

    async def start_service(self, name: str, instance: int = 1) -> ServiceProcess:
        """(Re)start one instance and wait for its readiness. A connector started for the first time
        gets its .<svc> topics created first."""
        p = self.instance(name, instance)
        if name == "connector" and self.create_topics:
            await self.ensure_topics()
        await self._start_proc(p)
        return p

    async def stop_service(self, name: str, instance: int = 1, sig: int = signal.SIGTERM,
                           timeout: float | None = None) -> int | None:
        """Send `sig` (SIGTERM: graceful) and wait; SIGKILL after `timeout` (default stop_timeout).
        Returns the exit code (negative = killed by that signal). Stopped on purpose: not restarted."""
        if self.supervisor is not None:
            self.supervisor.cancel_restart(self.service_id(name, instance))
        return await self.instance(name, instance).stop(sig, self.stop_timeout if timeout is None else timeout)

    async def kill_service(self, name: str, instance: int = 1) -> int | None:
        """SIGKILL: a crash, no graceful shutdown."""
        return await self.stop_service(name, instance, signal.SIGKILL, timeout=5)

    async def restart_service(self, name: str, instance: int = 1, sig: int = signal.SIGTERM) -> ServiceProcess:
        await self.stop_service(name, instance, sig)
        return await self.start_service(name, instance)

    async def restart_kafka(self) -> None:
        """Stop this suite's Kafka (controlled shutdown) and start it again on the same ports and data."""
        if not self._own_kafka or self.kafka is None:
            raise SuiteError("this suite does not own its Kafka")
        if self.supervisor is not None:
            self.supervisor.cancel_restart("kafka")
        await self.kafka.stop(timeout=self.kafka_stop_timeout)
        await self.kafka.start()

    async def restart_redis(self) -> None:
        """Stop this suite's Redis server(s) (SIGTERM: the AOF is flushed) and start them again."""
        if not self._own_redis or self.redis is None:
            raise SuiteError("this suite does not own its Redis")
        for srv in getattr(self.redis, "servers", [self.redis]):
            if self.supervisor is not None:
                self.supervisor.cancel_restart(f"redis:{srv.port}")
            await srv.stop()
            await srv.start()

    def processes(self) -> list[ServiceProcess]:
        """Every supervised process: the service instances and the Spark job."""
        return [*self.procs.values(), *([self.spark_job] if self.spark_job is not None else [])]

    def pids(self) -> list[int]:
        """Pids of everything this suite started that is running now (services, Kafka, Redis)."""
        out = [p.pid for p in self.processes() if p.running]
        if self._own_kafka and self.kafka is not None and self.kafka.pid:
            out.append(self.kafka.pid)
        if self._own_redis and self.redis is not None:
            servers = getattr(self.redis, "servers", [self.redis])
            out.extend(s.pid for s in servers if s.pid)
        return out

    async def watch(self) -> tuple[str, int]:
        """Wait until any running service exits; returns (service id, exit code)."""
        waits = {asyncio.ensure_future(p.proc.wait()): p for p in self.processes() if p.running}
        if not waits:
            await asyncio.Event().wait()
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            fut = next(iter(done))
            return waits[fut].service_id, fut.result()
        finally:
            for f in waits:
                f.cancel()

    async def __aenter__(self) -> "Suite":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def new_tag() -> str:
    return uuid.uuid4().hex[:6]


def _isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty() and not os.environ.get("NO_COLOR")
    except Exception:
        return False


__all__ = ["Suite", "SuiteError", "ServiceDef", "ServiceStartError", "ORDER", "SERVICES", "new_tag"]
