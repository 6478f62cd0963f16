"""`python -m tbmq_launcher run` / `tbmq-launcher run` (what `make run` calls);
`python -m tbmq_launcher topics --bootstrap-servers host:port` (create the catalogue's topics: compose);
`python -m tbmq_launcher certs --dir .run/tls` (a development CA and server certificate: compose's TLS).

Starts Kafka, Redis, the topics and every service with the default ports of docs/architecture.md
(MQTT localhost:1883, MQTT/TLS 8883, WS 8083 at /mqtt, WSS 8084 with a development CA and server certificate
made under <run-dir>/tls; gRPC and health ports on 127.0.0.1), prints what listens where and "ready", and
stops everything on Ctrl-C / SIGTERM.
`run --spark` also starts the Spark statistics job after the services (`make run RUN_ARGS=--spark`).
A process that exits while the suite runs (a service, the Spark job, Kafka, Redis) is started again with
exponential back-off (0.5 s doubling to 30 s; tbmq_launcher.supervisor); every exit and restart is printed,
and a process that keeps dying is reported as crash-looping. `--no-restart` turns that off.
Exit code: 0 after a clean stop, 1 when the start failed, 3 when a service died while running with
--no-restart.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import signal
import sys
from pathlib import Path

from tbmq_platform.topics import PROFILES

from .launcher import Suite, SuiteError

COMPOSE_GRPC_HOSTS = ("device-persistence", "app-delivery")  # the gRPC servers of compose.yaml
from .services import ORDER


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tbmq-launcher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the suite until Ctrl-C")
    r.add_argument("--services", default="all",
                   help=f"comma list of services to start, 'all' ({','.join(ORDER)}) or 'none' (Kafka+Redis)")
    r.add_argument("--connectors", type=int, default=1, help="connector instances (default 1)")
    r.add_argument("--app-delivery", type=int, default=1, dest="app_delivery", help="app-delivery instances")
    r.add_argument("--redis-cluster", action="store_true", help="a 3-master Redis Cluster instead of one server")
    r.add_argument("--free-ports", action="store_true", help="pick every port free instead of the defaults")
    r.add_argument("--mqtt-port", type=int, help="MQTT port of connector 1 (default 1883; instance i: +i-1)")
    r.add_argument("--tls-port", type=int, help="MQTT/TLS port of connector 1 (default 8883; instance i: +i-1)")
    r.add_argument("--ws-port", type=int, help="WebSocket port of connector 1 (default 8083; instance i: +100(i-1))")
    r.add_argument("--wss-port", type=int, help="WSS port of connector 1 (default 8084; instance i: +100(i-1))")
    r.add_argument("--mqtt-host", default="127.0.0.1",
                   help="bind address of the connectors' MQTT listeners (default 127.0.0.1: anonymous clients "
                        "allowed; another address refuses them unless --env MQTT_ALLOW_ANONYMOUS=true)")
    r.add_argument("--kafka-port", type=int, help="default 9092 (controller: --controller-port, 9093)")
    r.add_argument("--controller-port", type=int)
    r.add_argument("--redis-port", type=int, help="default 6380")
    r.add_argument("--redis-appendfsync", default="everysec", choices=("always", "everysec", "no"),
                   help="Redis AOF fsync policy: everysec (default: a host crash can lose about the last "
                        "second of acknowledged DEVICE messages) or always (none, at a cost per write); "
                        "docs/architecture.md, Storage trade-offs")
    r.add_argument("--no-restart", action="store_true",
                   help="do not restart a process that dies (default: restart with back-off); the launcher "
                        "then reports the death and keeps the others running")
    r.add_argument("--redis-password", default=None,
                   help="run the own Redis with requirepass (REDIS_URL then carries the password)")
    r.add_argument("--run-dir", default=".run",
                   help="logs, data and the development TLS certificates (<run-dir>/tls; default .run)")
    r.add_argument("--fresh", action="store_true", help="delete the Kafka/Redis data of earlier runs first")
    r.add_argument("--quiet", action="store_true", help="do not copy service output to the console")
    r.add_argument("--log-format", default="console", choices=("console", "json"))
    r.add_argument("--start-timeout", type=float, default=90.0, help="per-service readiness timeout (s)")
    r.add_argument("--grpc-tls", action="store_true", dest="grpc_tls",
                   help="mutual TLS between the services' gRPC peers (development CA in <run-dir>/grpc-tls)")
    r.add_argument("--separate-device-persistence", action="store_true", dest="separate_device_persistence",
                   help="run device-persistence as a process of its own (as compose.yaml does) instead of inside "
                        "the router (the default here: ROUTER_PERSIST_VIA=local, one process fewer on a persistent "
                        "message's path, docs/router.md); implied when --services names device-persistence")
    r.add_argument("--env", action="append", default=[], metavar="K=V", help="extra env for every service")
    r.add_argument("--topic-profile", default="single-node", choices=PROFILES,
                   help="partition counts of the topics (TBMQ_TOPIC_PROFILE; docs/topics.md): single-node "
                        "(default: one instance of each service on this host) or production (TBMQ's counts)")
    r.add_argument("--spark", action="store_true",
                   help="also run the Spark statistics job (python -m tbmq_spark stats; output <run-dir>/spark, "
                        "log <run-dir>/logs/spark-stats.log; docs/spark.md)")
    r.add_argument("--spark-args", default="", metavar="ARGS",
                   help="extra arguments of `tbmq_spark stats`, e.g. '--trigger \"processingTime=30 seconds\"'")
    r.add_argument("--spark-start-timeout", type=float, default=180.0,
                   help="wait this long for the Spark job's query to start (s)")
    c = sub.add_parser("certs", help="make a development CA and server certificate (kept when present)")
    c.add_argument("--dir", default=".run/tls", help="where: ca.pem, ca-key.pem, server.pem, server-key.pem")
    c.add_argument("--grpc", action="store_true",
                   help="also <dir>/grpc: a second CA and the certificate peer-tbmq.pem (its key peer-tbmq-key.pem) "
                        "for mutual TLS between compose's services (GRPC_TLS_*), naming their compose hosts")
    a = sub.add_parser("admin-user", help="the admin service's user `admin`: a generated password in "
                       "<dir>/admin-password, its argon2id hash in <dir>/admin-users (both 0600; kept when present)")
    a.add_argument("--dir", default=".run")
    t = sub.add_parser("topics", help="create the catalogue's topics on a running Kafka (idempotent)")
    t.add_argument("--bootstrap-servers", default="localhost:9092")
    t.add_argument("--service-id", action="append", default=[],
                   help="also the .<svc> topics of this connector id (repeatable)")
    t.add_argument("--timeout", type=float, default=120.0, help="wait this long for Kafka (s)")
    t.add_argument("--topic-profile", default="production", choices=PROFILES,
                   help="partition counts of the topics created (docs/topics.md)")
    t.add_argument("--replication-factor", type=int, default=1,
                   help="replication factor of the topics created (compose's production profile: 3)")
    t.add_argument("--min-insync-replicas", type=int, default=1,
                   help="min.insync.replicas of the topics created (compose's production profile: 2)")
    return p


async def _topics(args) -> int:
    from tbmq_platform import topics as catalogue
    from tbmq_platform.kafka import configure_security, ensure_topics
    from tbmq_platform.settings import CommonSettings, load_or_exit

    configure_security(load_or_exit(CommonSettings).kafka_security)  # KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_*

    layout = catalogue.TopicLayout(args.topic_profile, args.replication_factor, args.min_insync_replicas)
    if layout.problems():
        print("topics: " + "; ".join(layout.problems()), file=sys.stderr)
        return 2
    specs = list(catalogue.static_topics())
    for sid in args.service_id:
        specs.extend(catalogue.service_topics(sid))
    created = await ensure_topics(args.bootstrap_servers, specs, layout=layout, timeout_s=args.timeout)
    print(f"topics: {len(specs)} ensured on {args.bootstrap_servers}, {len(created)} created", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="launcher: %(message)s", stream=sys.stdout)
    if args.command == "topics":
        return asyncio.run(_topics(args))
    if args.command == "certs":
        from .tls import ensure_dev_certs

        certs = ensure_dev_certs(Path(args.dir))
        print(f"certs: CA {certs.ca}, server certificate {certs.server_cert} (key {certs.server_key})")
        if args.grpc:
            from .tls import issue_peer_cert

            internal = ensure_dev_certs(Path(args.dir) / "grpc", ca_name="tbmq-py internal development CA")
            cert, key = issue_peer_cert(internal, "tbmq", hosts=COMPOSE_GRPC_HOSTS)
            print(f"certs: gRPC CA {internal.ca}, certificate {cert} (key {key})")
        return 0
    if args.command == "admin-user":
        from .admin_user import ensure_admin_user

        pw_file, users_file = ensure_admin_user(Path(args.dir))
        print(f"admin-user: user admin, password in {pw_file}, users file {users_file} (ADMIN_USERS_FILE)")
        return 0
    if args.services == "all":
        services = list(ORDER)
        if not args.separate_device_persistence:  # the routers run it (persist_in_router)
            services.remove("device-persistence")
    elif args.services in ("none", ""):
        services = []
    else:
        services = [s.strip() for s in args.services.split(",") if s.strip()]
    env = dict(kv.split("=", 1) for kv in args.env)
    try:
        suite = Suite(
            services=services, connectors=args.connectors, instances={"app-delivery": args.app_delivery},
            ports="free" if args.free_ports else "default", mqtt_port=args.mqtt_port, tls_port=args.tls_port,
            ws_port=args.ws_port, wss_port=args.wss_port,
            kafka_port=args.kafka_port, controller_port=args.controller_port, redis_port=args.redis_port,
            run_dir=Path(args.run_dir), redis_cluster=args.redis_cluster,
            redis_appendfsync=args.redis_appendfsync, redis_password=args.redis_password, env=env,
            mqtt_host=args.mqtt_host, grpc_tls=args.grpc_tls,
            echo=None if args.quiet else sys.stdout, log_format=args.log_format,
            start_timeout=args.start_timeout, fresh=args.fresh, topic_profile=args.topic_profile,
            spark=args.spark, spark_args=shlex.split(args.spark_args),
            spark_start_timeout=args.spark_start_timeout, supervise=not args.no_restart,
            persist_in_router=not args.separate_device_persistence and "device-persistence" not in services)
    except (ValueError, SuiteError) as e:  # a bad setting or port plan: one message, nothing started
        print(f"launcher: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_run(suite))


async def _run(suite: Suite) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for s in signals:
        loop.add_signal_handler(s, stop.set)
    code = 0
    try:
        print(f"launcher: starting in {suite.run_dir} (Ctrl-C stops everything)", flush=True)
        start = asyncio.create_task(suite.start())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # Ctrl-C during the start: start() cleans up what it started
            start.cancel()
            try:
                await start
            except asyncio.CancelledError:
                pass
            print("launcher: interrupted during start; everything stopped", flush=True)
            return 130
        stopper.cancel()
        try:
            start.result()
        except Exception as e:
            print(f"launcher: start failed: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"launcher: listening\n{suite.describe()}", flush=True)
        for p in suite.instances_of("connector"):
            print(f"launcher: {p.service_id}: " + ", ".join(f"{kind} {addr}" for kind, addr in
                                                          suite.listeners(p.instance)), flush=True)
        if suite.tls is not None and suite.instances_of("connector"):
            print(f"launcher: TLS/WSS certificate signed by the development CA {suite.tls.ca} "
                  f"(e.g. mosquitto_sub --cafile {suite.tls.ca} -p {suite.tls_ports[0]} -t '#')", flush=True)
        for p in suite.instances_of("admin"):
            print(f"launcher: admin web UI {suite.admin_url(p.instance)} (user admin, password in "
                  f"{suite.admin_password_file}; docs/operations.md)", flush=True)
        mqtt = ", ".join(f"localhost:{p}" for p in suite.mqtt_ports if p) or "no connector"
        print(f"launcher: ready in {suite.start_seconds:.1f}s (MQTT {mqtt}; Ctrl-C to stop)", flush=True)

        stopper = asyncio.create_task(stop.wait())
        if suite.supervise:  # the supervisor restarts what dies
            await stopper
        while not stop.is_set():
            watcher = asyncio.create_task(suite.watch())
            done, _ = await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                sid, rc = watcher.result()
                p = next(p for p in suite.processes() if p.service_id == sid)
                print(f"launcher: {sid} exited with code {rc}; last lines of {p.log_path}:\n{p.log_tail(20)}",
                      file=sys.stderr, flush=True)
                await p.stop()
                code = 3
            else:
                watcher.cancel()
        print("launcher: stopping", flush=True)
    finally:
        # a second Ctrl-C while stopping is ignored: the stop itself escalates to SIGKILL on timeouts
        for s in signals:
            loop.add_signal_handler(s, lambda: None)
        await suite.stop()
        print("launcher: stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
