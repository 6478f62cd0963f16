"""compose.yaml: valid (the docker compose CLI's `config` when it works here, a structural check always),
every service of services/ is in it with a healthcheck, builds point at existing Dockerfiles, start order
goes through healthchecks, and the connector can be scaled."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
SERVICE_DIRS = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "pyproject.toml").exists())


PRODUCTION_ENV = ROOT / "infra" / "compose" / "production.env"
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}")


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def _interpolate(node, env: dict[str, str]):
    """compose's ${VAR:-default} interpolation (the subset compose.yaml uses)."""
    if isinstance(node, dict):
        return {k: _interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env) for v in node]
    if isinstance(node, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), node)
    return node


def _active(doc: dict, profiles: set[str]) -> dict:
    """The services compose would start with `profiles` active."""
    return {n: s for n, s in doc["services"].items() if not s.get("profiles") or set(s["profiles"]) & profiles}


@pytest.fixture(scope="module")
def compose() -> dict:
    """compose.yaml as `docker compose up` sees it without an env file."""
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), {})


@pytest.fixture(scope="module")
def production() -> dict:
    """compose.yaml as `docker compose --env-file infra/compose/production.env up` sees it."""
    env = _env_file(PRODUCTION_ENV)
    doc = _interpolate(yaml.safe_load(COMPOSE.read_text()), env)
    doc["services"] = _active(doc, set(env["COMPOSE_PROFILES"].split(",")))
    return doc


def _compose_cli() -> list[str] | None:
    """`docker compose` or `docker-compose`, when the CLI plugin is really there (no daemon needed)."""
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for cmd in candidates:
        try:
            r = subprocess.run([*cmd, "version"], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return cmd
    return None


def test_docker_compose_config_accepts_the_file():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose CLI here; the structural checks below still run")
    r = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr


def test_every_service_is_in_compose_with_a_healthcheck(compose):
    services = _active(compose, set())
    assert SERVICE_DIRS == sorted(["admin", "app-delivery", "connector", "device-persistence", "router",
                                   "session-registry"])
    for name in [*SERVICE_DIRS, "kafka", "redis", "otel-collector"]:
        assert name in services, name
        hc = services[name].get("healthcheck")
        assert hc and not hc.get("disable") and hc.get("test"), f"{name} has no healthcheck"
    for name in SERVICE_DIRS:
        test = " ".join(services[name]["healthcheck"]["test"])
        assert "/readyz" in test and "HEALTH_PORT" in test, name
        assert services[name]["environment"]["HEALTH_PORT"], name


def test_builds_point_at_existing_dockerfiles(compose):
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build is None:
            assert "image" in svc, f"{name}: neither image nor build"
            continue
        context = ROOT / build.get("context", ".")
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
    for name in SERVICE_DIRS:
        svc = compose["services"][name]
        assert svc["build"]["dockerfile"] == f"services/{name}/Dockerfile"
        text = (ROOT / "services" / name / "Dockerfile").read_text()
        assert text.startswith("#") and "FROM python:3.11-slim" in text
        assert "USER " in text and "-c /app/requirements.lock" in text
        assert f'ENTRYPOINT ["{name}"]' in text


def test_depends_on_names_existing_services_and_waits_for_health(compose):
    services = compose["services"]
    allowed = {"service_healthy", "service_started", "service_completed_successfully"}
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in allowed
            if dep in SERVICE_DIRS or dep in ("kafka", "redis"):
                assert cond["condition"] == "service_healthy", f"{name} -> {dep}"
    # start order of the launcher: session-registry, device-persistence, app-delivery, router, connector
    order = ["session-registry", "device-persistence", "app-delivery", "router", "connector"]
    for i, later in enumerate(order[1:], start=1):
        deps = services[later]["depends_on"]
        assert "session-registry" in deps and "kafka" in deps, later
    assert {"router", "device-persistence", "app-delivery"} <= set(services["connector"]["depends_on"])
    # the admin service last: over every other service
    assert set(order) <= set(services["admin"]["depends_on"])


def test_connector_is_scalable(compose):
    c = compose["services"]["connector"]
    assert "container_name" not in c
    assert c["environment"]["TBMQ_SERVICE_ID_FROM_HOSTNAME"] == "1"
    assert "TBMQ_SERVICE_ID" not in c["environment"]
    for port in c.get("ports", []):
        host = str(port).rsplit(":", 1)[0]
        assert "-" in host, f"a fixed host port {port} would stop --scale connector=3"


def test_environment_matches_the_architecture(compose):
    for name in SERVICE_DIRS:
        env = compose["services"][name]["environment"]
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert env["OTEL_SERVICE_NAME"] == name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector:")
    otel = compose["services"]["otel-collector"]
    src = otel["volumes"][0].split(":")[0]
    assert (ROOT / src).is_file()
    assert yaml.safe_load((ROOT / src).read_text())["service"]["pipelines"]["traces"]


def _brokers(doc: dict) -> dict[str, dict]:
    return {n: s for n, s in doc["services"].items() if s.get("image", "").startswith("apache/kafka")}


def test_default_profile_is_one_broker_with_replication_factor_1(compose):
    brokers = _brokers({"services": _active(compose, set())})
    assert list(brokers) == ["kafka"]
    env = brokers["kafka"]["environment"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    for name in SERVICE_DIRS:
        svc = compose["services"][name]["environment"]
        assert (svc["TBMQ_TOPIC_REPLICATION_FACTOR"], svc["TBMQ_TOPIC_MIN_INSYNC_REPLICAS"]) == ("1", "1")


def test_production_profile_is_three_brokers_rf3_min_isr2(production):
    """The production profile: every topic (the suite's, Kafka's offsets and transaction logs) on 3 brokers,
    an acknowledged record on 2 at least; one broker may go without losing data or stopping writes."""
    brokers = _brokers(production)
    assert sorted(brokers) == ["kafka", "kafka-2", "kafka-3"]
    ids = {b["environment"]["KAFKA_NODE_ID"] for b in brokers.values()}
    assert ids == {1, 2, 3}
    voters = {v.split("@")[0]: v.split("@")[1] for v in
              brokers["kafka"]["environment"]["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")}
    assert voters == {str(b["environment"]["KAFKA_NODE_ID"]): f"{n}:9093" for n, b in brokers.items()}
    for name, b in brokers.items():
        env = b["environment"]
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == brokers["kafka"]["environment"]["KAFKA_CONTROLLER_QUORUM_VOTERS"]
        assert env["KAFKA_ADVERTISED_LISTENERS"].startswith(f"PLAINTEXT://{name}:9092")
        for key in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                    "KAFKA_DEFAULT_REPLICATION_FACTOR"):
            assert env[key] == "3", (name, key)
        assert env["KAFKA_MIN_INSYNC_REPLICAS"] == env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "2"
    bootstrap = ",".join(f"{n}:9092" for n in sorted(brokers))
    for name in SERVICE_DIRS:
        env = production["services"][name]["environment"]
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == bootstrap, name
        assert (env["TBMQ_TOPIC_REPLICATION_FACTOR"], env["TBMQ_TOPIC_MIN_INSYNC_REPLICAS"]) == ("3", "2"), name
    topics = production["services"]["topics"]
    args = topics["entrypoint"]
    assert args[args.index("--replication-factor") + 1] == "3"
    assert args[args.index("--min-insync-replicas") + 1] == "2"
    assert args[args.index("--bootstrap-servers") + 1] == bootstrap
    assert {"kafka", "kafka-2", "kafka-3"} <= set(topics["depends_on"])


def test_only_the_mqtt_listeners_are_published(compose, production):
    """Kafka, Redis, the OTLP collector, gRPC and health ports stay on the compose network (issue 14); the admin
    web UI is published on the host's loopback only (issue 16)."""
    for doc in (compose, production):
        for name, svc in doc["services"].items():
            if name == "admin":
                assert svc["ports"] == ["127.0.0.1:8080:8080"]
                assert svc["environment"]["ADMIN_HTTP_PORT"] == "8080"
            elif name != "connector":
                assert not svc.get("ports"), f"{name} publishes {svc.get('ports')}"
        targets = sorted(int(str(p).rsplit(":", 1)[1]) for p in doc["services"]["connector"]["ports"])
        assert targets == [1883, 8083, 8084, 8883]
        assert "HOST" not in doc["services"]["kafka"]["environment"]["KAFKA_LISTENERS"]


def test_redis_requires_the_password_the_services_get(compose):
    redis = compose["services"]["redis"]
    password = redis["command"][redis["command"].index("--requirepass") + 1]
    assert password and redis["environment"]["REDISCLI_AUTH"] == password
    assert compose["services"]["device-persistence"]["environment"]["REDIS_PASSWORD"] == password


def test_the_collector_scrapes_every_services_metrics_on_its_health_port(compose):
    """Issue 16: /metrics is served on the health port (tbmq_platform.metrics); the collector of compose
    scrapes every service there, every replica by DNS, and health ports listen on the compose network."""
    collector = yaml.safe_load((ROOT / "infra" / "otel" / "collector.yaml").read_text())
    scrape = collector["receivers"]["prometheus"]["config"]["scrape_configs"]
    targets = {c["names"][0]: c["port"] for job in scrape for c in job["dns_sd_configs"]}
    for name in SERVICE_DIRS:
        env = compose["services"][name]["environment"]
        assert targets.get(name) == int(env["HEALTH_PORT"]), name
        assert env["HEALTH_HOST"] == "0.0.0.0"
    assert "prometheus" in collector["service"]["pipelines"]["metrics"]["receivers"]
