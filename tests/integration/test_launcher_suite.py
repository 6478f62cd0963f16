"""The launcher (tbmq_launcher.Suite) with throwaway fake services: start order, real readiness, the
environment each instance gets, stop/kill/restart, failure at start, and teardown without leftovers."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time

import psutil
import pytest

from tbmq_launcher import ServiceDef, ServiceStartError, Suite

pytestmark = pytest.mark.integration

FAKE = textwrap.dedent('''
    """A fake service: /readyz answers 503 until FAKE_DELAY s have passed, then 200."""
    import http.server, json, os, signal, subprocess, sys, threading, time

    started = time.time()
    delay = float(os.environ.get("FAKE_DELAY", "0"))
    rec = os.environ["FAKE_RECORD"]
    sid = os.environ["TBMQ_SERVICE_ID"]
    if os.environ.get("FAKE_FAIL"):
        after = os.environ.get("FAKE_FAIL_AFTER_START_OF")  # a service id prefix: fail once it has started
        while after and not (os.path.exists(rec) and f'"id": "{after}' in open(rec).read()):
            time.sleep(0.05)
        print(f"{sid}: failing on purpose", flush=True)
        sys.exit(int(os.environ["FAKE_FAIL"]))
    if os.environ.get("FAKE_CHILD"):   # a grandchild that must not outlive the service
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if os.environ.get("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        def term(*_):
            with open(rec, "a") as f:
                f.write(json.dumps({"event": "term", "id": sid, "t": time.time()}) + "\\n")
            os._exit(0)
        signal.signal(signal.SIGTERM, term)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.time() - started >= delay
            code = 200 if (self.path == "/healthz" or ready) else 503
            self.send_response(code); self.end_headers(); self.wfile.write(b"ok" if code == 200 else b"no")
        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["HEALTH_PORT"])), H)
    env = {k: v for k, v in os.environ.items() if k.isupper() and not k.startswith(("PYTEST", "PATH"))}
    with open(rec, "a") as f:
        f.write(json.dumps({"event": "start", "id": sid, "t": time.time(), "env": env}) + "\\n")
    print(f"{sid}: listening on {os.environ['HEALTH_PORT']}", flush=True)
    srv.serve_forever()
''')


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_service.py"
    script.write_text(FAKE)
    record = tmp_path / "record.jsonl"

    def defs(*names: str, **env: str) -> dict[str, ServiceDef]:
        return {n: ServiceDef(n, n.replace("-", "_"), health_port=0, command=(sys.executable, str(script)),
                              env={"FAKE_RECORD": str(record), **env}) for n in names}

    def events() -> list[dict]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    defs.events = events
    return defs


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


async def test_services_start_in_order_each_after_the_previous_is_ready(kafka, fake, make_suite):
    before = _descendants()
    suite = await make_suite(
        services=["fake-a", "fake-b", "fake-c"], create_topics=False,
        service_defs=fake("fake-a", "fake-b", "fake-c", FAKE_DELAY="0.7"),
        service_env={"fake-b": {"EXTRA": "b-only"}}, env={"EVERYONE": "1"})
    starts = [e for e in fake.events() if e["event"] == "start"]
    assert [e["id"].rsplit("-", 1)[0] for e in starts] == ["fake-a-1", "fake-b-1", "fake-c-1"]
    # each one was started only once the previous answered /readyz 200 (it needs FAKE_DELAY to be ready)
    assert starts[1]["t"] - starts[0]["t"] >= 0.7
    assert starts[2]["t"] - starts[1]["t"] >= 0.7
    env_b = starts[1]["env"]
    assert env_b["KAFKA_BOOTSTRAP_SERVERS"] == kafka.bootstrap_servers == suite.bootstrap_servers
    assert env_b["REDIS_URL"] == suite.redis_url
    assert env_b["TBMQ_SERVICE_ID"] == suite.service_id("fake-b", 1)
    assert env_b["HEALTH_PORT"] == str(suite.health_port("fake-b"))
    assert env_b["EXTRA"] == "b-only" and "EXTRA" not in starts[0]["env"]
    assert env_b["EVERYONE"] == "1" and env_b["LOG_FORMAT"] == "json"
    pids = suite.pids()
    assert len(pids) == 4  # 3 services + redis (the shared Kafka is not the suite's)
    assert "fake-c-1" in suite.describe()

    await suite.stop()
    assert _alive(pids) == []
    assert _descendants() - before == set()
    terms = [e["id"].rsplit("-", 1)[0] for e in fake.events() if e["event"] == "term"]
    assert terms == ["fake-c-1", "fake-b-1", "fake-a-1"]  # graceful, in reverse order


async def test_a_tiers_services_start_together_and_the_front_door_after_all_of_them_are_ready(fake, make_suite):
    """START_TIERS: the back-ends (here the registry and two routers) start at once, none waiting for
    another's readiness; the connector starts only once every one of them is ready. Each fake needs
    FAKE_DELAY s to become ready, so starting one after the other would put that much between their starts."""
    delay = 2.0
    names = ["session-registry", "router", "connector"]
    await make_suite(services=names, instances={"router": 2}, create_topics=False,
                     service_defs=fake(*names, FAKE_DELAY=str(delay)))
    start = {e["id"].rsplit("-", 1)[0]: e["t"] for e in fake.events() if e["event"] == "start"}
    back_ends = [start["session-registry-1"], start["router-1"], start["router-2"]]
    assert max(back_ends) - min(back_ends) < delay, start
    assert start["connector-1"] >= max(back_ends) + delay, start


async def test_a_service_failing_in_its_tier_stops_its_tier_mates_and_the_next_tier_never_starts(fake, make_suite):
    before = _descendants()
    defs = {**fake("session-registry", "connector", FAKE_DELAY="60"),
            **fake("router", FAKE_FAIL="3", FAKE_FAIL_AFTER_START_OF="session-registry-1")}
    with pytest.raises(ServiceStartError, match="exited with code 3"):
        await make_suite(services=["session-registry", "router", "connector"], create_topics=False,
                         service_defs=defs)
    assert _descendants() - before == set()
    events = [(e["event"], e["id"].rsplit("-", 1)[0]) for e in fake.events()]
    # the registry, started with the router and never ready, was stopped gracefully; the connector never started
    assert events == [("start", "session-registry-1"), ("term", "session-registry-1")], events


async def test_stop_kill_restart_of_one_instance(fake, make_suite):
    suite = await make_suite(services=["fake-a"], instances={"fake-a": 2}, create_topics=False,
                             service_defs=fake("fake-a"))
    first, second = suite.instance("fake-a", 1), suite.instance("fake-a", 2)
    assert first.health_port != second.health_port
    pid2 = second.pid
    assert await suite.kill_service("fake-a", 2) == -signal.SIGKILL
    assert _alive([pid2]) == [] and first.running
    await suite.start_service("fake-a", 2)
    assert second.running and second.pid != pid2
    pid1 = first.pid
    assert await suite.stop_service("fake-a", 1) == 0  # SIGTERM handler exits 0
    p = await suite.restart_service("fake-a", 1)
    assert p.running and p.pid != pid1 and _alive([pid1]) == []
    assert len([e for e in fake.events() if e["event"] == "start"]) == 4


async def test_sigterm_ignored_escalates_to_sigkill_and_grandchildren_die(fake, make_suite):
    before = _descendants()
    suite = await make_suite(services=["fake-a"], create_topics=False, stop_timeout=1.0,
                             service_defs=fake("fake-a", FAKE_IGNORE_TERM="1", FAKE_CHILD="1"))
    inside = _descendants() - before
    assert len(inside) >= 3  # redis, the service, its child
    # the SIGKILL after stop_timeout is what ends it (a hang fails the bound of wait_for, not a clock check)
    assert await asyncio.wait_for(suite.stop_service("fake-a"), 30) == -signal.SIGKILL
    await suite.stop()
    assert _alive(inside) == []


async def test_a_service_dying_at_start_stops_everything_and_reports_its_log(fake, make_suite):
    before = _descendants()
    defs = {**fake("fake-a"), **fake("fake-b", FAKE_FAIL="7")}
    with pytest.raises(ServiceStartError) as err:
        await make_suite(services=["fake-a", "fake-b"], create_topics=False, service_defs=defs)
    assert "exited with code 7" in str(err.value)
    assert "failing on purpose" in str(err.value)  # the log tail
    assert _descendants() - before == set()
    assert [e["event"] for e in fake.events()] == ["start", "term"]  # fake-a was stopped


async def test_a_service_never_ready_times_out(fake, make_suite):
    before = _descendants()
    with pytest.raises(ServiceStartError, match="not ready"):
        await make_suite(services=["fake-a"], create_topics=False, start_timeout=1.5,
                         service_defs=fake("fake-a", FAKE_DELAY="60"))
    assert _descendants() - before == set()


async def test_kafka_and_redis_only_creates_the_catalogue_topics(kafka, make_suite):
    from aiokafka.admin import AIOKafkaAdminClient
    from tbmq_platform import topics as catalogue

    suite = await make_suite(services=[], connectors=2)
    admin = AIOKafkaAdminClient(bootstrap_servers=suite.bootstrap_servers)
    await admin.start()
    try:
        names = set(await admin.list_topics())
    finally:
        await admin.close()
    expected = {s.name for s in catalogue.static_topics()}
    # connectors=2 is ignored when no connector is started; the connector topics come with connectors
    assert expected <= names
    assert suite.mqtt_ports == []


async def test_port_plan_and_environment_of_the_real_services():
    """No process is started: the defaults of docs/architecture.md and the wiring between services."""
    s = Suite(connectors=3, instances={"app-delivery": 2}, ports="default", run_dir="/tmp/unused")
    assert s.bootstrap_servers == "localhost:9092"
    assert s.redis_url == "redis://127.0.0.1:6380/0"
    assert s.mqtt_ports == [1883, 1884, 1885]
    assert [p.service_id for p in s.procs.values()] == [
        "session-registry-1", "device-persistence-1", "app-delivery-1", "app-delivery-2", "router-1",
        "connector-1", "connector-2", "connector-3", "admin-1"]
    assert s.health_port("connector", 1) == 8081 and s.health_port("router") == 8082
    assert s.health_port("session-registry") == 8086 and s.health_port("device-persistence") == 8087
    assert s.health_port("app-delivery") == 8085 and s.health_port("connector", 2) == 8181
    env = s.service_environment("connector", 2)
    assert env["MQTT_PORT"] == "1884" and env["TBMQ_SERVICE_ID"] == "connector-2"
    # the listeners (TLS + (i-1); WS/WSS + 100*(i-1): WS 8083 + 1 would be WSS 8084) and the dev certificate
    assert s.tls_ports == [8883, 8884, 8885] and s.ws_ports == [8083, 8183, 8283]
    assert s.wss_ports == [8084, 8184, 8284]
    assert (env["MQTT_TLS_PORT"], env["MQTT_WS_PORT"], env["MQTT_WSS_PORT"]) == ("8884", "8183", "8184")
    assert env["MQTT_TLS_CERT_FILE"] == "/tmp/unused/tls/server.pem"
    assert env["MQTT_TLS_KEY_FILE"] == "/tmp/unused/tls/server-key.pem"
    assert env["MQTT_TLS_CA_FILE"] == "/tmp/unused/tls/ca.pem"
    assert s.listeners(2) == [("MQTT", "localhost:1884"), ("MQTT/TLS", "localhost:8884"),
                              ("WS", "ws://localhost:8183/mqtt"), ("WSS", "wss://localhost:8184/mqtt")]
    # internal surfaces on the loopback; MQTT too by default (anonymous clients allowed: docs/security.md)
    assert env["GRPC_HOST"] == "127.0.0.1" and env["HEALTH_HOST"] == "127.0.0.1"
    assert env["MQTT_BIND_HOST"] == "127.0.0.1" and "MQTT_BIND_HOST" not in s.service_environment("router")
    assert Suite(services=["connector"], run_dir="/tmp/unused", mqtt_host="0.0.0.0").service_environment(
        "connector")["MQTT_BIND_HOST"] == "0.0.0.0"
    off = Suite(services=["connector"], ports="default", run_dir="/tmp/unused",
                service_env={"connector": {"MQTT_WS_PORT": "0", "MQTT_WSS_PORT": ""}})
    assert off.ws_ports == [None] and off.wss_ports == [None] and off.tls_ports == [8883]
    moved = Suite(services=["connector"], connectors=2, ports="free", run_dir="/tmp/unused", tls_port=18883,
                  ws_port=18083, wss_port=18084)
    assert moved.tls_ports == [18883, 18884] and moved.ws_ports == [18083, 18183]
    assert moved.wss_ports == [18084, 18184]
    assert env["DEVICE_PERSISTENCE_GRPC_TARGET"] == "localhost:9061"
    assert env["DEVICE_PERSISTENCE_GRPC_TARGETS"] == "localhost:9061"
    assert Suite(instances={"device-persistence": 2}, run_dir="/tmp/unused").service_environment(
        "connector")["DEVICE_PERSISTENCE_GRPC_TARGETS"] == "localhost:9061,localhost:9161"
    assert env["APP_DELIVERY_GRPC_TARGETS"] == "localhost:9062,localhost:9162"
    assert s.service_environment("device-persistence")["DEVICE_PERSISTENCE_GRPC_PORT"] == "9061"
    assert s.service_environment("app-delivery", 2)["APP_DELIVERY_GRPC_PORT"] == "9162"
    assert len({p.health_port for p in s.procs.values()}) == len(s.procs)
    # the admin service: API and web UI on 8080, health on 8088, every instance's health endpoint, the users file
    admin = s.service_environment("admin")
    assert (admin["ADMIN_HTTP_PORT"], admin["HEALTH_PORT"], admin["OTEL_SERVICE_NAME"]) == ("8080", "8088", "admin")
    assert admin["ADMIN_USERS_FILE"] == "/tmp/unused/admin-users" and s.admin_url() == "http://127.0.0.1:8080/"
    assert admin["ADMIN_SERVICES"].split(",") == [f"{p.name}=127.0.0.1:{p.health_port}" for p in s.procs.values()]
    ordered = Suite(services=["connector", "router", "session-registry"], run_dir="/tmp/unused")
    assert ordered.service_names == ["session-registry", "router", "connector"]
    with pytest.raises(ValueError):
        Suite(services=["nope"], run_dir="/tmp/unused")


async def test_topic_profile_sets_the_partitions_and_every_service_environment(kafka, make_suite):
    """`make run` uses the single-node profile: the topics the suite creates get its partition counts and
    every service is started with the same TBMQ_TOPIC_PROFILE (so the topics it creates match)."""
    import uuid

    from tbmq_platform import topics as catalogue
    from tbmq_platform.kafka import make_consumer, topic_partitions

    suite = await make_suite(services=[], topic_profile="single-node")
    sid = f"connector-profile-{uuid.uuid4().hex[:8]}"
    await suite.ensure_topics(extra_service_ids=[sid])
    consumer = make_consumer(suite.bootstrap_servers, group_id=None, client_id="profile-check")
    await consumer.start()
    try:
        specs = catalogue.service_topics(sid)
        for s in specs:  # topic_partitions waits (bounded) until the new topic is in the metadata
            parts = await topic_partitions(consumer, s.name)
            assert len(parts) == s.partitions_in(catalogue.SINGLE_NODE) == 1, s.name
    finally:
        await consumer.stop()
    assert catalogue.spec(catalogue.DOWNLINK_BASIC_PREFIX + "<svc>").partitions_in(catalogue.PRODUCTION) > 1
    one = Suite(run_dir="/tmp/unused", topic_profile="single-node")
    assert {one.service_environment(n)["TBMQ_TOPIC_PROFILE"] for n in one.service_names} == {"single-node"}
    assert Suite(run_dir="/tmp/unused").service_environment("router")["TBMQ_TOPIC_PROFILE"] == "production"
    with pytest.raises(ValueError):
        Suite(run_dir="/tmp/unused", topic_profile="tiny")
