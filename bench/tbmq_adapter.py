"""tbmq-py through tbmq_launcher.Suite: start whatever part of the suite exists, name its processes."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def available_services() -> tuple[list[str], list[str]]:
    """(services whose `<package>.__main__` is importable, the missing ones), in start order."""
    from tbmq_launcher import ORDER, SERVICES

    have, missing = [], []
    for name in ORDER:
        pkg = SERVICES[name].package
        try:
            ok = importlib.util.find_spec(pkg + ".__main__") is not None
        except (ImportError, ValueError):
            ok = False
        (have if ok else missing).append(name)
    return have, missing


async def start_suite(workdir: Path, env: dict[str, str], persist_in_router: bool = True):
    """→ (suite, mqtt port, notes). BrokerUnavailable when the connector (the MQTT front door) is missing.
    `persist_in_router`: the routers run device-persistence (Suite(persist_in_router=True)), as under `make run`."""
    from tbmq_launcher import Suite

    from .brokers import BrokerUnavailable

    have, missing = available_services()
    if "connector" not in have:
        raise BrokerUnavailable(f"tbmq-py connector has no __main__ yet (services present: {have or 'none'})")
    # the layout a user of `make run` gets: one instance of each service, single-node topic partitions, and
    # the launcher's supervisor restarting what dies (the "faults" scenario kills services)
    # every client of the bench comes from 127.0.0.1: the per-address connect rate limit (a protection against
    # one source, MQTT_CONNECT_RATE_PER_IP) would measure itself in the connect storm, so it is off here
    env = {"MQTT_CONNECT_RATE_PER_IP": "0", **env}
    if persist_in_router:
        have = [s for s in have if s != "device-persistence"]
    suite = Suite(services=have, ports="free", run_dir=workdir, env=env, fresh=True, log_format="json",
                  start_timeout=120.0, topic_profile="single-node", supervise=True,
                  persist_in_router=persist_in_router)
    await suite.start()
    notes = [f"tbmq-py via tbmq_launcher.Suite: {', '.join(have)} + Kafka + Redis "
             f"(started in {suite.start_seconds:.1f}s)"
             + (", device-persistence in the router (ROUTER_PERSIST_VIA=local)" if persist_in_router else "")]
    if missing:
        notes.append(f"not running (not written yet): {', '.join(missing)}")
    return suite, suite.mqtt_ports[0], notes


async def stop_suite(suite) -> None:
    await suite.stop()


def suite_pids(suite) -> dict[str, int]:
    """label → pid: each service instance, Kafka's JVM, Redis server(s)."""
    out: dict[str, int] = {}
    for p in suite.procs.values():
        if p.running:
            out[p.service_id] = p.pid
    kafka = getattr(suite, "kafka", None)
    if getattr(suite, "_own_kafka", True) and kafka is not None and kafka.pid:
        out["kafka"] = kafka.pid
    redis = getattr(suite, "redis", None)
    if getattr(suite, "_own_redis", True) and redis is not None:
        servers = getattr(redis, "servers", [redis])
        for i, s in enumerate(servers):
            if s.pid:
                out["redis" if len(servers) == 1 else f"redis-{i + 1}"] = s.pid
    return out
